"""One benchmark session of one engine in its own process (so peak memory is that engine's alone), printing
one JSON line. bench_e2e.py runs it alternately for our engine and llama.cpp; it is also usable by hand:

    python bench/e2e_worker.py --engine ours  --model bench/cache/2b4t.i8.bnstore --mode session
    python bench/e2e_worker.py --engine llama --model bench/cache/2b4t.tq2_0.gguf --mode cold

Both engines get the same token ids (random ids of ordinary tokens, fixed by --seed), greedy sampling,
the same thread count and context, and are timed the same way from outside with perf_counter:
    load_s            constructor call (mmap + setup)
    first_token_s     load + generate for a 1-token prompt until its first token ("load to first prompt token")
    prefill_tps[N]    N / (time from generate(N-token prompt, fresh cache) to its first token)
    decode_tps        (tokens after the first) / (time from first to last generated token), 16-token prompt
    ttft_s            time to first token for the 128-token prompt (fresh cache)
    chat_ttft_s[t]    time to first token of chat turn t: each turn appends the previous reply and an equal
                      number of new user tokens; the KV cache of the previous turns is reused
    peak_rss / rss_* VmHWM and VmRSS from /proc/self/status (baseline = after imports, before loading)
--mode cold evicts the model file from the page cache first (posix_fadvise DONTNEED on the file, which needs
no privileges and does not disturb other processes' caches) and measures only load and first token.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def proc_status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssFile", "RssAnon"):
                out[key] = int(val.split()[0]) * 1024
    return out


def resident_bytes(path: str) -> int | None:
    """Bytes of `path` in the page cache (util-linux fincore), None when it cannot be told."""
    try:
        r = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", path],
                           capture_output=True, text=True, timeout=30)
        return int(r.stdout.split()[0]) if r.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def evict(path: str, drop_caches: bool = False) -> dict:
    """Remove `path` from the page cache; report how it was done and what stayed resident."""
    before = resident_bytes(path)
    method = "posix_fadvise(DONTNEED)"
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if drop_caches:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            method += " + drop_caches"
        except OSError as e:
            method += f" (drop_caches refused: {e.strerror})"
    return {"method": method, "resident_before": before, "resident_after": resident_bytes(path)}


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    """Random ids of ordinary tokens (the specials sit at the top of a LLaMA-3 vocabulary)."""
    import numpy as np

    hi = min(vocab, 128000) if vocab > 1000 else vocab
    lo = 256 if hi > 1024 else 1
    return [int(t) for t in np.random.default_rng(seed).integers(lo, hi, size=n)]


class Ours:
    """engine.api, the public runtime API (the only thing bench/ uses of the engine)."""

    name = "ours"

    def load(self, model: str, threads: int, ctx: int):
        from bitnet_cpu.engine.api import SamplingParams, load_model

        self.llm = load_model(model, ctx=ctx, threads=threads or None, progress=False)  # 0: the default
        self.threads_used = self.llm.threads
        self.greedy = SamplingParams(temperature=0.0)
        self.vocab = self.llm.config.vocab_size

    def reset(self):
        self.llm.reset()

    def stream(self, ids: list[int], n: int):
        """Yield generated token ids (greedy), at most n; reuses the cached prefix like a chat turn."""
        for ch in self.llm.generate(list(ids), self.greedy, max_tokens=n):
            if ch.token is not None:
                yield ch.token
            if ch.stats is not None:
                self.last_stats = ch.stats


class Llama:
    """llama.cpp through llama-cpp-python, on the same GGUF."""

    name = "llama"

    def load(self, model: str, threads: int, ctx: int):
        from llama_cpp import Llama as _Llama

        self.llm = _Llama(model_path=model, n_ctx=ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                          n_ubatch=512, logits_all=False, use_mmap=True, verbose=False)
        self.vocab = self.llm.n_vocab()

    def reset(self):
        self.llm.reset()

    def stream(self, ids: list[int], n: int):
        # generate(reset=True) keeps the longest common prefix of the KV cache, like our chat turns.
        it = self.llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True)
        for i, tok in enumerate(it):
            yield int(tok)
            if i + 1 >= n:
                break
        it.close()


def timed_stream(engine, ids: list[int], n: int) -> tuple[float, list[float], list[int]]:
    """(start time, arrival time of each token, tokens)."""
    t0 = time.perf_counter()
    times, toks = [], []
    for tok in engine.stream(ids, n):
        times.append(time.perf_counter())
        toks.append(tok)
    return t0, times, toks


def run(a) -> dict:
    engine = Ours() if a.engine == "ours" else Llama()
    res: dict = {"engine": engine.name, "model": a.model, "mode": a.mode, "threads": a.threads, "ctx": a.ctx,
                 "model_bytes": os.path.getsize(a.model)}
    if a.mode == "cold":
        res["evict"] = evict(a.model, a.drop_caches)
    res["rss_baseline"] = proc_status()["VmRSS"]

    t0 = time.perf_counter()
    engine.load(a.model, a.threads, a.ctx)
    res["load_s"] = time.perf_counter() - t0
    res["threads_used"] = getattr(engine, "threads_used", a.threads)
    first = prompt_ids(1, a.seed + 1, engine.vocab)
    _, times, _ = timed_stream(engine, first, 1)
    res["first_token_s"] = times[0] - t0
    res["rss_after_first_token"] = proc_status()["VmRSS"]
    if a.mode == "cold":
        res.update({"peak_rss": proc_status()["VmHWM"]})
        return res

    res["prefill_tps"] = {}
    for n in a.prefill:
        best_dt = None
        for _ in range(a.inner):
            engine.reset()
            s, times, _ = timed_stream(engine, prompt_ids(n, a.seed, engine.vocab), 1)
            dt = times[0] - s
            best_dt = dt if best_dt is None else min(best_dt, dt)
        res["prefill_tps"][str(n)] = n / best_dt
        if n == 128:
            res["ttft_s"] = best_dt

    engine.reset()
    s, times, toks = timed_stream(engine, prompt_ids(16, a.seed + 2, engine.vocab), a.decode + 1)
    res["decode_generated"] = len(toks)
    res["decode_tps"] = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None
    res["decode_stats_tps"] = getattr(getattr(engine, "last_stats", None), "decode_tps", None)

    engine.reset()
    history: list[int] = []
    res["chat_ttft_s"], res["chat_prompt_tokens"] = [], []
    for turn in range(a.turns):
        ids = history + prompt_ids(a.turn_tokens, a.seed + 100 + turn, engine.vocab)
        s, times, toks = timed_stream(engine, ids, a.reply_tokens)
        res["chat_ttft_s"].append(times[0] - s)
        res["chat_prompt_tokens"].append(len(ids))
        history = ids + toks

    st = proc_status()
    res.update({"peak_rss": st["VmHWM"], "rss_end": st["VmRSS"], "rss_file_end": st.get("RssFile"),
                "rss_anon_end": st.get("RssAnon")})
    return res


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="one end-to-end benchmark session of one engine (JSON out)")
    ap.add_argument("--engine", choices=("ours", "llama"), required=True)
    ap.add_argument("--model", required=True, help="our store (ours) or the GGUF (llama)")
    ap.add_argument("--mode", choices=("session", "cold"), default="session")
    ap.add_argument("--threads", type=int, default=2, help="0: the engine's default (ours only)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--prefill", type=lambda s: [int(x) for x in s.split(",")], default=[128, 512])
    ap.add_argument("--inner", type=int, default=1, help="prefill repetitions inside the session (best kept)")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drop-caches", action="store_true", help="cold mode: also write /proc/sys/vm/drop_caches")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if not os.path.exists(a.model):
        print(f"e2e_worker: --model {a.model}: no such file", file=sys.stderr)
        return 2
    print(json.dumps(run(a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
