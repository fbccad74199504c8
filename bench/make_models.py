"""Generate (once, cached) the benchmark models: a synthetic BitNet b1.58 model of the exact 2B-4T shape
(hidden 2560, intermediate 6912, 30 layers, 20 heads, 5 KV heads, vocab 128256, tied f16 token_embd) with
random ternary weights, written as a TQ2_0 GGUF (what llama.cpp runs) and converted from that very file
into our store (int8 LM head, the default; and the f16 LM head variant). TQ1_0 on request.

    python bench/make_models.py [--tq1] [--no-f16] [--heads q4,i8,f16] [--force] [--cache bench/cache]
                                [--shape 2b4t|small]
                                [--ik-quantize PATH/TO/ik_llama.cpp/llama-quantize]

Everything is streamed tensor by tensor by engine.synth / engine.convert, so memory stays near one tensor
(the f16 embedding, 656 MB, is the largest). Prints each file's size and the total disk used.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEFAULT_CACHE = os.path.join(HERE, "cache")
# the machine-limits probe the benchmarks run in a subprocess, so its thread count is set before OpenMP starts
LIMITS = os.path.join(HERE, "limits.py")
SEED = 0


def save_json(path: str | None, results) -> None:
    """The results as JSON at path (--json), when one is given."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def bench_parser(doc: str, levels: str | None = None) -> argparse.ArgumentParser:
    """The flags the load benchmarks share: --threads; with levels (the default list of numbers of concurrent
    clients), the sweep's shape too: --levels --gen --prompt --engines --cache --out-dir."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    if levels is not None:
        ap.add_argument("--levels", default=levels)
        ap.add_argument("--gen", type=int, default=128, help="tokens per request")
        ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
        ap.add_argument("--engines", default="ours,llama")
        ap.add_argument("--cache", default=DEFAULT_CACHE)
        ap.add_argument("--out-dir", default=HERE)
    return ap


def model_paths(cache: str = DEFAULT_CACHE, shape: str = "2b4t") -> dict[str, str]:
    return {
        "tq2_0": os.path.join(cache, f"{shape}.tq2_0.gguf"),
        "tq1_0": os.path.join(cache, f"{shape}.tq1_0.gguf"),
        "store_q4": os.path.join(cache, f"{shape}.q4.bnstore"),   # the converter's default head
        "store_i8": os.path.join(cache, f"{shape}.i8.bnstore"),
        "store_f16": os.path.join(cache, f"{shape}.f16.bnstore"),
        "manifest": os.path.join(cache, f"{shape}.manifest.json"),
        # ik_llama.cpp's source (it has no TQ2_0): F16 weights under its BitNet-2B arch, requantized by its
        # llama-quantize to IQ2_BN (the type it repacks to IQ2_BN_R4 at load with -rtr)
        "ik_f16": os.path.join(cache, f"{shape}.bitnet25.f16.gguf"),
        "iq2_bn": os.path.join(cache, f"{shape}.iq2_bn.gguf"),
        # bitnet.cpp's I2_S (2 bits per weight, one f32 scale per tensor) under the `bitnet` architecture of the
        # llama.cpp fork its releases up to 2024-11 build against (see bench/setup_bitnet_cpp.sh)
        "i2_s": os.path.join(cache, f"{shape}.bitnet.i2_s.gguf"),
    }


def synth_model(shape: str, seed: int = SEED):
    from bitnet_cpu.engine.synth import SynthModel, bitnet_2b4t_config, small_config

    if shape == "2b4t":
        cfg = bitnet_2b4t_config()
    elif shape == "small":
        # smallest shape llama.cpp accepts for TQ types (ternary input dims multiples of 256)
        cfg = small_config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=1024, max_position_embeddings=2048)
    else:
        raise SystemExit(f"make_models: --shape {shape!r}: expected 2b4t or small")
    return SynthModel(cfg, seed=seed)


@contextlib.contextmanager
def sigterm_unwinds():
    """SIGTERM / SIGHUP (a script's `timeout`, a lease ending) unwind as Ctrl-C does while the files are written,
    as the `bitnet` CLI has them: the store writer removes its temporary file (a hidden .bnstore-* of over 1 GB at
    the 2B-4T shape was left by the signal's default action) and the script exits 128 + signum. Only in the main
    thread, and only where the signal still has its default action (a caller's own handler is kept)."""
    from bitnet_cpu.engine.errors import ENDING_SIGNALS, raise_terminated

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in ENDING_SIGNALS}
    mine = [s for s, h in old.items() if h == signal.SIG_DFL]
    for s in mine:
        signal.signal(s, raise_terminated)
    try:
        yield
    finally:
        for s in mine:
            signal.signal(s, old[s])


def _write_whole(path: str, write) -> None:
    """write(tmp) into path + ".tmp", renamed over path once complete: an interrupted write leaves no partial
    file under the final name (the next run took it for a finished model)."""
    tmp = path + ".tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _human(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def make(cache: str = DEFAULT_CACHE, shape: str = "2b4t", *, tq1: bool = False, f16: bool = True,
         force: bool = False, progress: bool = True, stores: bool = True,
         ik_quantize: str | None = None, heads: tuple[str, ...] = ("q4", "i8", "f16"),
         only_ik: bool = False) -> dict[str, str]:
    """Create the missing files; return the paths of the ones that exist afterwards. `heads`: which of our
    stores (by LM head) to convert, where `stores` is on (f16 only if `f16` too). only_ik: the IQ2_BN file
    alone (it is written from the synthetic model, not the TQ2_0 file, so it can be made beside that one).
    A SIGTERM meanwhile removes the file being written (sigterm_unwinds)."""
    with sigterm_unwinds():
        return _make(cache, shape, tq1=tq1, f16=f16, force=force, progress=progress, stores=stores,
                     ik_quantize=ik_quantize, heads=heads, only_ik=only_ik)


def _make(cache: str, shape: str, *, tq1: bool, f16: bool, force: bool, progress, stores: bool,
          ik_quantize: str | None, heads: tuple[str, ...], only_ik: bool) -> dict[str, str]:
    from bitnet_cpu.engine.synth import write_gguf_tq

    os.makedirs(cache, exist_ok=True)
    paths = model_paths(cache, shape)
    manifest = {}
    if os.path.exists(paths["manifest"]):
        with open(paths["manifest"]) as f:
            manifest = json.load(f)
    model = None
    want = [("tq2_0", not only_ik), ("tq1_0", tq1 and not only_ik)]
    for key, wanted in want:
        p = paths[key]
        if not wanted or (os.path.exists(p) and not force):
            continue
        model = model or synth_model(shape)
        t0 = time.perf_counter()
        print(f"writing {p} ...", file=sys.stderr, flush=True)
        # TQ2_0 has a fast numpy packer (identical bytes to gguf's quantizer); TQ1_0 goes through gguf
        _write_whole(p, lambda tmp: write_gguf_tq(model, tmp, qtype=key.upper(), embed_type="F16",
                                                  hidden_activation="relu2",
                                                  quantizer="fast" if key == "tq2_0" else "gguf"))
        manifest[key] = {"seconds": round(time.perf_counter() - t0, 1), "seed": SEED}
    for head in ("q4", "i8", "f16"):
        key, wanted = f"store_{head}", stores and not only_ik and head in heads and (f16 or head != "f16")
        p = paths[key]
        if not wanted or (os.path.exists(p) and not force and
                          os.path.getmtime(p) >= os.path.getmtime(paths["tq2_0"])):
            continue
        from bitnet_cpu.engine.formats.convert import convert

        t0 = time.perf_counter()
        print(f"converting {paths['tq2_0']} -> {p} (lm head {head}) ...", file=sys.stderr, flush=True)
        convert(paths["tq2_0"], p, lm_head=head, progress=progress)
        manifest[key] = {"seconds": round(time.perf_counter() - t0, 1), "source": os.path.basename(paths["tq2_0"])}
    if ik_quantize and (force or not os.path.exists(paths["iq2_bn"])):
        manifest["iq2_bn"] = make_ik(paths, ik_quantize, model or synth_model(shape))
    with open(paths["manifest"], "w") as f:
        json.dump(manifest, f, indent=1)
    return {k: v for k, v in paths.items() if os.path.exists(v)}


def make_i2s(cache: str = DEFAULT_CACHE, shape: str = "2b4t") -> str:
    """The same ternary weights for bitnet.cpp (written once): I2_S tensors, f16 tied embedding, arch `bitnet`
    (its fork's graph: sub-norms, GQA, tied head; SiLU where the 2B-4T graph has relu2, which costs nothing
    measurable beside the weight reads)."""
    from bitnet_cpu.engine.synth.writers import write_gguf_i2s

    path = model_paths(cache, shape)["i2_s"]
    if not os.path.exists(path):
        print(f"writing {path} ...", file=sys.stderr, flush=True)
        with sigterm_unwinds():
            _write_whole(path, lambda tmp: write_gguf_i2s(synth_model(shape), tmp, arch="bitnet", pre=None))
    return path


def make_ik(paths: dict[str, str], quantize: str, model) -> dict:
    """The same ternary weights for ik_llama.cpp: an F16 GGUF of arch bitnet-25 (its 2B-4T graph: relu2,
    sub-norms, tied embedding), then its own llama-quantize to IQ2_BN; the F16 file is deleted afterwards."""
    import subprocess

    from bitnet_cpu.engine.synth import write_gguf_tq

    t0 = time.perf_counter()
    print(f"writing {paths['ik_f16']} ...", file=sys.stderr, flush=True)
    write_gguf_tq(model, paths["ik_f16"], qtype="F16", embed_type="F16", arch="bitnet-25")
    print(f"{quantize} -> {paths['iq2_bn']} (IQ2_BN) ...", file=sys.stderr, flush=True)
    r = subprocess.run([quantize, paths["ik_f16"], paths["iq2_bn"], "IQ2_BN"], capture_output=True, text=True)
    os.unlink(paths["ik_f16"])
    if r.returncode != 0:
        raise SystemExit(f"make_models: {quantize} failed (exit {r.returncode}): "
                         + " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:]))
    return {"seconds": round(time.perf_counter() - t0, 1), "quantize": quantize}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default=DEFAULT_CACHE, help="where the files go (default: bench/cache)")
    ap.add_argument("--shape", default="2b4t", help="2b4t (the benchmark) or small (a quick check)")
    ap.add_argument("--tq1", action="store_true", help="also write the TQ1_0 GGUF")
    ap.add_argument("--no-f16", action="store_true", help="skip the f16-LM-head store")
    ap.add_argument("--heads", default="q4,i8,f16",
                    help="our stores to convert, by LM head (default q4,i8,f16; a machine leased for minutes "
                    "converts only the one its benchmark reads)")
    ap.add_argument("--force", action="store_true", help="regenerate even if cached")
    ap.add_argument("--gguf-only", action="store_true", help="write the GGUF files only (no conversion)")
    ap.add_argument("--ik-quantize", metavar="PATH",
                    help="ik_llama.cpp's llama-quantize: also write the IQ2_BN GGUF of the same weights")
    ap.add_argument("--only-ik", action="store_true", help="with --ik-quantize: write that file alone")
    a = ap.parse_args(argv)
    heads = tuple(h for h in a.heads.split(",") if h)
    if a.only_ik and not a.ik_quantize:
        ap.error("--only-ik needs --ik-quantize")
    if set(heads) - {"q4", "i8", "f16"}:
        ap.error(f"--heads {a.heads!r}: expected a comma list of q4, i8, f16")
    t0 = time.perf_counter()
    paths = make(a.cache, a.shape, tq1=a.tq1, f16=not a.no_f16, force=a.force, stores=not a.gguf_only,
                 ik_quantize=a.ik_quantize, heads=heads, only_ik=a.only_ik)
    total = 0
    for key, p in paths.items():
        size = os.path.getsize(p)
        total += size
        if key != "manifest":
            print(f"{key:10s} {_human(size):>10s}  {p}")
    print(f"{'total':10s} {_human(total):>10s}  on disk under {a.cache} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
