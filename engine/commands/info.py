"""`bitnet info`: version, CPU features and the kernel path the dispatcher chose, as a table (`--json`
gives the same facts as one JSON object for scripts)."""
HELP = "print the version, CPU features and the chosen SIMD kernel path (--json for scripts)"


def add_arguments(p):
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table%(default).0s")


def facts() -> dict:
    import os
    import platform

    import simd
    from engine import __version__

    return {"version": __version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "threads": simd.get_num_threads(), "active": simd.active(),
            "supported": list(simd.supported_isas()), "forced": os.environ.get("BITNET_ISA") or None,
            "features": dict(simd.features())}


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
        ("kernel path", f["active"] + (f" (forced by BITNET_ISA={f['forced']})" if f["forced"] else "")),
        ("paths this CPU runs", ", ".join(f["supported"]) + "  (force one with BITNET_ISA=...)"),
        ("threads", f"{f['threads']} of {f['cpu_count']} CPUs  (-t N to change)"),
        ("CPU features", ", ".join(have) or "-"),
        ("not present", ", ".join(lacking) or "-"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
