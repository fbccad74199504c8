"""`python -m simd`: print CPU features and the chosen kernel path (`bitnet info` shows the same as a table,
with --json for scripts; this stays here so the kernels can be checked without the engine's CLI)."""
import platform
import sys

from .errors import BitNetError


def _main() -> int:
    try:
        from .. import simd

        feats = simd.features()
        print(f"features: {', '.join(k for k, v in feats.items() if v)}")
        print(f"active:   {simd.active()}")
        arm = platform.machine().lower() in ("aarch64", "arm64")
        names = "scalar|neon|dotprod|i8mm" if arm else "scalar|avx2|avxvnni|avx512|amx"
        print(f"paths:    {', '.join(simd.supported_isas())} (force one with BITNET_ISA={names})")
        print(f"tiles:    {simd.tiles()} ({simd.tiles_reason()}; BITNET_TILES=emu runs their emulation)")
        if simd.active() in ("avx512", "amx", "avx2", "avxvnni"):
            print(f"prefetch: {simd.gemv_prefetch()} bytes ahead in the decode GEMV (BITNET_PREFETCH=N, 0: off)")
        print(f"threads:  {simd.get_num_threads()}")
        return 0
    except BitNetError as e:  # e.g. BITNET_ISA naming a path this CPU cannot run
        print(f"python -m simd: error: {e}", file=sys.stderr)
        return e.exit_code


sys.exit(_main())
