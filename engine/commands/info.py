"""`bitnet info`: CPU features and the kernel path the dispatcher chose."""
HELP = "print CPU features and the chosen SIMD kernel path"


def add_arguments(p):
    pass


def main(args) -> int:
    import simd

    feats = simd.features()
    print(f"features: {feats}")
    print(f"active:   {simd.active()}")
    print(f"paths:    {', '.join(simd.supported_isas())} (force one with BITNET_ISA=scalar|avx2|avxvnni|avx512)")
    print(f"threads:  {simd.get_num_threads()}")
    return 0
