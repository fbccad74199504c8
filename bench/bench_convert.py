"""Conversion time per GB of GGUF, by tensor type: the same random ternary model in 2B-4T layer shapes (hidden
2560, intermediate 6912, 20/5 heads; a few layers, a small vocabulary so the linear weights dominate) written as
TQ2_0 (the reference), F16, BF16, Q8_0, Q4_0, Q5_0 (gguf's numpy quantizers) and, when llama-cpp-python is
installed, Q6_K, Q4_K_M, Q2_K, IQ4_XS, IQ3_S (llama.cpp's quantizer), then converted into a store.

    python bench/bench_convert.py [--layers 2] [--vocab 8192] [--types F16,Q8_0,...] [--dir DIR] [--keep]

Prints per type: file size, conversion seconds, seconds per GB of file, seconds per layer and the ratio to TQ2_0
measured in the same run. For F16, BF16 and Q8_0 it also converts without the fast path on the stored bits
(engine.ternary_check.fit_exact_raw) and with the `gguf` package's dequantizer instead of ours (the last column),
and times the two decoders alone on one matrix: why ours are kept for those types. Single run on a possibly busy
machine: the ratios are what mean something.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

GGUF_TYPES = ["TQ2_0", "F16", "BF16", "Q8_0", "Q5_0", "Q4_0"]
LLAMA_TYPES = {"Q6_K": 18, "Q4_K_M": 15, "Q2_K": 10, "IQ4_XS": 30, "IQ3_S": 26}
OWN_VS_GGUF = ("F16", "BF16", "Q8_0")


def make_files(d: str, layers: int, vocab: int, types: list[str]) -> dict[str, str]:
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_gguf_tq

    m = SynthModel(small_config(hidden_size=2560, intermediate_size=6912, num_hidden_layers=layers,
                                num_attention_heads=20, num_key_value_heads=5, vocab_size=vocab), seed=0)
    files = {}
    for t in types:
        if t in LLAMA_TYPES:
            continue
        files[t] = os.path.join(d, f"m.{t}.gguf")
        if not os.path.exists(files[t]):
            write_gguf_tq(m, files[t], t)
    wanted = [t for t in types if t in LLAMA_TYPES]
    if wanted:
        try:
            import llama_cpp
        except ImportError:
            print(f"# llama-cpp-python not installed: {', '.join(wanted)} skipped (bash bench/setup_llama.sh)")
            return files
        src = os.path.join(d, "m.F32.gguf")
        if not os.path.exists(src):
            write_gguf_tq(m, src, "F32")
        for t in wanted:
            files[t] = os.path.join(d, f"m.{t}.gguf")
            if not os.path.exists(files[t]):
                p = llama_cpp.llama_model_quantize_default_params()
                p.ftype, p.nthread = LLAMA_TYPES[t], 2
                if llama_cpp.llama_model_quantize(src.encode(), files[t].encode(), p) != 0:
                    print(f"# llama.cpp could not make {t}")
                    del files[t]
    return files


def time_convert(path: str, out: str, force_gguf: bool = False) -> float:
    import bitnet_cpu.engine.formats.gguf as eg
    import bitnet_cpu.engine.formats.ternary_check as tc
    from bitnet_cpu.engine.formats.convert import convert

    saved, fast = eg.DECODABLE, tc.fit_exact_raw
    if force_gguf:  # no fast path on the stored bits, and everything but TQ*/I2_S through gguf.quants
        eg.DECODABLE = frozenset({"TQ1_0", "TQ2_0", "I2_S"})
        tc.fit_exact_raw = lambda *args: None
    try:
        t0 = time.perf_counter()
        convert(path, out, progress=False)
        return time.perf_counter() - t0
    finally:
        eg.DECODABLE, tc.fit_exact_raw = saved, fast
        if os.path.exists(out):
            os.unlink(out)


def time_decoders(path: str, name: str = "blk.0.ffn_up.weight", repeats: int = 3) -> tuple[float, float]:
    """Best-of-N seconds to dequantize one matrix with our decoder and with gguf.quants.dequantize."""
    from bitnet_cpu.engine.formats.gguf import GGUFFile, decode_blocks
    from bitnet_cpu.engine.formats.gguf_dequant import decode_with_gguf

    g = GGUFFile(path)
    t = g.info(name)
    raw = g.raw(name)
    best = []
    for fn in (lambda: decode_blocks(raw, t.type_name), lambda: decode_with_gguf(raw, t.type_name, t.shape[0])):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        best.append(min(times))
    g.close()
    return best[0], best[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--types", default=",".join(GGUF_TYPES + list(LLAMA_TYPES)))
    ap.add_argument("--dir", default=None, help="where the GGUF files are made (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    a = ap.parse_args(argv)
    types = [t for t in a.types.split(",") if t]
    if "TQ2_0" not in types:
        types.insert(0, "TQ2_0")
    d = a.dir or tempfile.mkdtemp(prefix="bench-convert-")
    os.makedirs(d, exist_ok=True)
    try:
        t0 = time.perf_counter()
        files = make_files(d, a.layers, a.vocab, types)
        print(f"# {a.layers} layers of 2B-4T shape, vocab {a.vocab}; files made in {time.perf_counter() - t0:.0f} s"
              f" ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}: a busy machine, compare ratios)")
        print(f"{'type':<8} {'file MB':>8} {'convert s':>10} {'s/GB':>7} {'s/layer':>8} {'vs TQ2_0':>9}"
              f" {'no fast path, gguf decoders s':>30}")
        ref = None
        for t in [x for x in types if x in files]:
            path = files[t]
            size = os.path.getsize(path)
            s = time_convert(path, path + ".bnstore")
            ref = s if t == "TQ2_0" else ref
            other = f"{time_convert(path, path + '.bnstore', force_gguf=True):>30.2f}" if t in OWN_VS_GGUF else ""
            print(f"{t:<8} {size / 1e6:>8.0f} {s:>10.2f} {s / (size / 1e9):>7.2f} {s / a.layers:>8.2f}"
                  f" {s / ref:>9.2f} {other}", flush=True)
        print(f"# decoders alone, one ffn_up matrix (6912x2560), best of 3: ours vs gguf.quants")
        for t in [x for x in OWN_VS_GGUF if x in files]:
            ours, theirs = time_decoders(files[t])
            print(f"{t:<8} ours {ours:.3f} s  gguf {theirs:.3f} s  gguf/ours {theirs / ours:.2f}", flush=True)
    finally:
        if not a.keep and not a.dir:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
