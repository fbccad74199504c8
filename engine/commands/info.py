"""`bitnet info`: CPU features and the kernel path the dispatcher chose."""
HELP = "print CPU features and the chosen SIMD kernel path"


def add_arguments(p):
    pass


def main(args) -> int:
    import simd

    print(f"features: {simd.features()}")
    print(f"active:   {simd.active()}")
    return 0
