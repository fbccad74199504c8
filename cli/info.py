"""`bitnet info`: version, CPU name (py-cpuinfo: about a second, paid only here), CPU features and the kernel
path the dispatcher chose, as a table (`--json` gives the same facts as one JSON object for scripts)."""
HELP = "print the version, CPU features and the chosen SIMD kernel path (--json for scripts)"


def add_arguments(p):
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table%(default).0s")


def facts() -> dict:
    import os
    import platform

    from .. import simd
    from ..engine import __version__
    from ..engine.cpu import available_cores, cpu_brand, default_threads, physical_cores
    from ..engine.memory import thp_mode

    return {"version": __version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpu": cpu_brand(),
            "cpu_count": os.cpu_count(), "available_cpus": available_cores(), "physical_cores": physical_cores(),
            "threads": default_threads(), "active": simd.active(), "huge_pages": thp_mode(),
            "supported": list(simd.supported_isas()), "forced": os.environ.get("BITNET_ISA") or None,
            "features": dict(simd.features()), "tiles": simd.tiles(), "tiles_reason": simd.tiles_reason(),
            "tiles_forced": os.environ.get("BITNET_TILES") or None, "gemv_prefetch": simd.gemv_prefetch(),
            "gemv_prefetch_forced": os.environ.get("BITNET_PREFETCH") or None,
            "prefill_attention": simd.attention_precision(), "attention_bf16_vector": simd.attention_bf16_vector(),
            "tile_bodies": {"min_rows": simd.tile_min_rows(), "kblock": simd.tile_kblock(),
                            "stream": simd.tile_stream(), "overlap": simd.tile_overlap(), "warm": simd.tile_warm()}}


def _tile_bodies(b: dict) -> str:
    """How the tile bodies run (the BITNET_TILE_* settings), for A/B runs on an AMX machine."""
    on = {True: "on", False: "off"}
    rows = f"from {b['min_rows']} rows" if b["min_rows"] else "from the default crossover"
    return (f"{rows}; k-block {b['kblock'] or 'all of K'}, streamed small-M {on[b['stream']]}, unpack beside the "
            f"multiply {on[b['overlap']]}, weights read ahead {on[b['warm']]} (BITNET_TILE_MIN_ROWS, _KBLOCK, "
            "_STREAM, _OVERLAP, _WARM)")


def _huge_pages_line(mode: str | None) -> str:
    if mode in ("always", "madvise"):
        return (f"transparent huge pages: {mode} (models over 64 MiB are read into 2 MB pages: faster decode; "
                "--mmap maps the file instead)")
    return (f"transparent huge pages: {mode or 'not available'} (models are mapped from the file; decode is "
            "~10% faster with huge pages: echo madvise > /sys/kernel/mm/transparent_hugepage/enabled)")


def _tiles_line(f: dict) -> str:
    """AMX tiles: used for prefill, batches and every multi-row product, or why not."""
    mode = f["tiles"]
    forced = f" (forced by BITNET_TILES={f['tiles_forced']})" if f["tiles_forced"] else ""
    if mode == "amx":
        return f"AMX for multi-row products{forced}: {f['tiles_reason']}; {_tile_bodies(f['tile_bodies'])}"
    if mode == "emu":
        return (f"emu: the portable emulation of AMX (slow; tests){forced}; hardware: {f['tiles_reason']}; "
                f"{_tile_bodies(f['tile_bodies'])}")
    if f["forced"] and "amx" in f["supported"]:
        return f"off (BITNET_ISA={f['forced']}; the auto choice uses AMX here: {f['tiles_reason']})"
    return f"off: {f['tiles_reason']}"


def _attention_line(f: dict) -> str:
    """The prompt attention's products: f32, or bf16 where asked for (and whether it runs on vector units here)."""
    tiles = f["tiles"] == "amx" and f["features"].get("amx-bf16")
    if f["prefill_attention"] == "bf16":
        return ("bf16 products (BITNET_ATTENTION=bf16" + ("" if f["attention_bf16_vector"] else
                "; no AVX512_BF16 bodies on this path: scalar, slower than f32")
                + ("; prompt chunks of 16+ rows on the AMX-BF16 tiles" if tiles else "") + ")")
    return ("f32 products (--prefill-attention bf16 / BITNET_ATTENTION=bf16: faster long prompts within bf16 "
            "rounding, " + ("AVX512_BF16 here" if f["attention_bf16_vector"] else "not on this CPU / path") + ")")


def main(args) -> int:
    import json

    f = facts()
    if args.json:
        print(json.dumps(f))
        return 0
    have = [k for k, v in f["features"].items() if v]
    lacking = [k for k, v in f["features"].items() if not v]
    rows = [
        ("version", f"bitnet-cpu {f['version']} (Python {f['python']}, {f['machine']})"),
        ("CPU", f["cpu"]),
        ("kernel path", f["active"] + (f" (forced by BITNET_ISA={f['forced']})" if f["forced"] else "")),
        ("matrix tiles", _tiles_line(f)),
        *([("decode prefetch", f"{f['gemv_prefetch']} bytes ahead of the weights in the decode GEMV"
                                + (" (forced by BITNET_PREFETCH)" if f["gemv_prefetch_forced"] else
                                   " (BITNET_PREFETCH=N bytes, 0: off)"))]
          if f["active"] in ("avx512", "amx", "avx2", "avxvnni") else []),
        ("prefill attention", _attention_line(f)),
        ("paths this CPU runs", ", ".join(f["supported"]) + "  (force one with BITNET_ISA=...)"),
        ("threads", f"{f['threads']} (physical cores: {f['physical_cores']} of {f['available_cpus']} CPUs this "
                    f"process may use, {f['cpu_count']} in the machine; -t N to change)"),
        ("huge pages", _huge_pages_line(f["huge_pages"])),
        ("CPU features", ", ".join(have) or "-"),
        ("not present", ", ".join(lacking) or "-"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
