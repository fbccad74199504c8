"""`bitnet bench`: how fast a model runs on this machine, as llama.cpp's `llama-bench` measures it, with its flags and
its table (or JSON / JSON lines / CSV for scripts).

`ppN`: a fresh cache, N random prompt tokens prefilled (one pass of the engine's prefill chunks), N / time. `tgN`:
N tokens decoded one by one after the first token, greedy, end of text ignored and prompt lookup off, N / time:
unlike llama-bench's (random tokens fed back) it includes picking each token from the LM head, as every real
answer does. `ppN+tgM` (-pg): both, (N + M) / time. `-npl B`: B sequences at once through the serving engine's batched
steps (as llama-batched-bench), B x tokens / time (`tg128 x16`). Each test runs once unrecorded (warm-up), then -r times:
mean ± sample standard deviation of the rates. Rows print as tests finish; Ctrl-C keeps them (exit 130).
The same kernels as `bitnet run` (BITNET_ISA=avx512 turns AMX tiles off, for an A/B on one machine).
"""
HELP = "measure prompt processing (pp) and generation (tg) speed, llama-bench style (-p, -n, -pg, -t, -r, -o)"

FORMATS = ("md", "json", "jsonl", "csv")


def _int_list(flag: str, minimum: int | None):
    def parse(text: str) -> list[int]:
        import argparse
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of integers") from None
        if not vals:
            raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of integers")
        if minimum is not None and any(v < minimum for v in vals):
            raise argparse.ArgumentTypeError(f"{text!r}: integers >= {minimum}")
        return vals
    parse.__name__ = flag
    return parse


def _pairs(text: str) -> list[tuple[int, int]]:
    import argparse
    out = []
    for item in text.split(";") if ";" in text else [text]:
        try:
            pp, tg = (int(x) for x in item.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: PP,TG (e.g. 512,128)") from None
        if pp < 1 or tg < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: PP and TG >= 1")
        out.append((pp, tg))
    return out


def add_arguments(p):
    # -m as llama-bench takes it: given twice, both models are tested, one after the other
    p.add_argument("-m", "--model", metavar="MODEL", action="append", default=None,
                   help="a converted store, a GGUF file, an HF model directory, or a downloaded hub id (default: the "
                        "bundled model); given again, each model is tested in turn, as llama-bench's%(default).0s")
    # a list flag given twice adds its values, as llama-bench's ("-p 8 -p 16" runs both)
    p.add_argument("-p", "--n-prompt", type=_int_list("n-prompt", 0), action="extend", default=None,
                   metavar="N[,N...]", help="prompt tokens of each pp test (0: none; default: 512)%(default).0s")
    p.add_argument("-n", "--n-gen", type=_int_list("n-gen", 0), action="extend", default=None, metavar="N[,N...]",
                   help="generated tokens of each tg test (0: none; default: 128)%(default).0s")
    p.add_argument("-pg", dest="pg", type=_pairs, action="extend", default=None, metavar="PP,TG",
                   help="also a prompt of PP tokens then TG generated, timed together (several: 'A,B;C,D')%(default).0s")
    # 0 or less: the default count, as `bitnet run -t 0` and llama.cpp's -t take it
    p.add_argument("-t", "--threads", type=_int_list("threads", None), action="extend", default=None,
                   metavar="N[,N...]", help="thread counts to test (default, 0 or less too, as llama.cpp: one "
                                            "per physical core, or "
                                            "$OMP_NUM_THREADS)%(default).0s")
    p.add_argument("-npl", dest="npl", type=_int_list("npl", 1), action="extend", default=None, metavar="N[,N...]",
                   help="sequences at once: N > 1 runs each test as N sequences batched through the serving "
                        "engine (as llama-batched-bench's -npl); t/s counts every sequence's tokens%(default).0s")
    p.add_argument("-d", "--n-depth", dest="n_depth", type=_int_list("n-depth", 0), action="extend", default=None,
                   metavar="N[,N...]", help="tokens already in the context when each test starts (llama-bench's "
                                            "'pp512 @ d4096'; prefilled untimed; default: 0)%(default).0s")
    p.add_argument("-r", "--repetitions", type=int, default=5, metavar="N", help="timed runs of each test")
    p.add_argument("-o", "--output", choices=FORMATS, default="md", help="table, or records for scripts")
    p.add_argument("--kv", choices=("f16", "f32", "q8"), default="f16", help="KV cache precision")


def tests_of(args) -> list[tuple[int, int]]:
    """(prompt tokens, generated tokens) of every test, in llama-bench's order: pp, tg, then pg."""
    n_prompt = [512] if args.n_prompt is None else args.n_prompt
    n_gen = [128] if args.n_gen is None else args.n_gen
    return [(n, 0) for n in n_prompt if n] + [(0, n) for n in n_gen if n] + list(args.pg or [])


def _name(pp: int, tg: int, depth: int = 0) -> str:
    return "+".join(x for x in ((f"pp{pp}" if pp else ""), (f"tg{tg}" if tg else "")) if x) + \
        (f" @ d{depth}" if depth else "")


def run_test(llm, pp: int, tg: int, rng, depth: int = 0) -> float:
    """Seconds for one run: a fresh cache (holding `depth` random tokens, prefilled before the clock starts),
    pp random tokens prefilled, then tg tokens decoded."""
    import time

    from ..engine.api import LookupParams, SamplingParams
    vocab = llm.config.vocab_size
    bos = llm.tokenizer.text_bos
    ids = rng.integers(0, vocab, pp).tolist() if pp else [bos if bos is not None else int(rng.integers(vocab))]
    llm.reset()
    if depth:   # the context the test starts in: generate() reuses it as the cached prefix of the timed prompt
        before = rng.integers(0, vocab, depth).tolist()
        for _ in llm.generate(before, SamplingParams(temperature=0), max_tokens=1, ignore_eos=True,
                              lookup=LookupParams(draft_max=0)):
            pass
        ids = before + ids
    t0 = time.perf_counter()
    # after a prompt, tg tokens decoded one by one as llama-bench's pg test feeds them (the prefill's own first
    # token is one more); a tg test's first token comes from its one-token prompt, as llama-bench's
    for _ in llm.generate(ids, SamplingParams(temperature=0), max_tokens=tg + 1 if pp and tg else tg, ignore_eos=True,
                          lookup=LookupParams(draft_max=0)):
        pass
    return time.perf_counter() - t0


def run_batched(eng, pp: int, tg: int, npl: int, rng) -> float:
    """Seconds for npl sequences at once through the batching engine, each a fresh random prompt of pp tokens
    (one token when pp is 0) then tg decoded tokens."""
    import time

    from ..engine.api import SamplingParams
    vocab = eng.config.vocab_size
    prompts = [rng.integers(0, vocab, max(pp, 1)).tolist() for _ in range(npl)]
    t0 = time.perf_counter()
    n = tg + 1 if pp and tg else tg   # as run_test
    streams = [eng.submit(ids, SamplingParams(temperature=0), max_tokens=n, ignore_eos=True) for ids in prompts]
    for s in streams:
        for _ in s:
            pass
    return time.perf_counter() - t0


def machine() -> dict:
    """The machine fields, the same for every row: asked once (py-cpuinfo takes 1-3 s)."""
    from .. import simd
    from ..engine import __version__
    from ..engine.cpu import cpu_brand
    return {"build_commit": f"bitnet-cpu-{__version__}", "build_number": 0, "cpu_info": cpu_brand(), "gpu_info": "",
            "backends": "CPU", "isa": simd.active() + (" AMX" if simd.tiles() == "amx" else "")}


def describe(llm, given: str | None) -> dict:
    """The model fields: model_filename as -m gave it (a GGUF or hub id, not the converted store it runs)."""
    import os
    path = llm.store.path
    return {"model_filename": given or path, "model_type": llm.name, "model_size": os.path.getsize(path),
            "model_n_params": llm.config.n_params}


KV_TYPE = {"f16": "f16", "f32": "f32", "q8": "q8_0"}   # --kv as llama-bench names a cache type


def record(info: dict, runner, args, pp: int, tg: int, npl: int, times: list, rates: list, depth: int = 0) -> dict:
    """One test's record: llama-bench's fields in its order (scripts and its compare-llama-bench.py read them;
    the ones about GPUs and loading hold its CPU defaults), then this engine's own (isa, n_parallel, samples)."""
    import datetime
    import statistics
    batch = getattr(runner, "max_batch_tokens", None) or runner.model.chunk
    return {**{k: info[k] for k in ("build_commit", "build_number", "cpu_info", "gpu_info", "backends",
                                    "model_filename", "model_type", "model_size", "model_n_params")},
            "n_batch": batch, "n_ubatch": batch, "n_threads": runner.threads, "cpu_mask": "0x0", "cpu_strict": False,
            "poll": 50, "type_k": KV_TYPE[args.kv], "type_v": KV_TYPE[args.kv], "n_gpu_layers": 0, "n_cpu_moe": 0,
            "split_mode": "layer", "main_gpu": 0, "no_kv_offload": False, "flash_attn": 1, "devices": "auto",
            "tensor_split": "0.00", "tensor_buft_overrides": "none", "load_mode": "auto", "lazy_mode": "auto",
            "embeddings": False, "no_op_offload": 0, "no_host": False, "repack": True, "fit_target": 0,
            "fit_min_ctx": 0, "n_prompt": pp, "n_gen": tg, "n_depth": depth,
            "test_time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "avg_ns": int(statistics.mean(times) * 1e9),
            "stddev_ns": int(statistics.stdev(times) * 1e9) if len(times) > 1 else 0,
            "avg_ts": statistics.mean(rates), "stddev_ts": statistics.stdev(rates) if len(rates) > 1 else 0.0,
            "isa": info["isa"], "n_parallel": npl,
            "samples_ns": [int(t * 1e9) for t in times], "samples_ts": rates}


class Table:
    """Rows printed as they come, in the chosen format. The md table adds type_k and type_v after threads when
    the KV cache is not llama-bench's default f16, as its printer does: a q8 run's table read as an f16 one."""
    COLUMNS = ("model", "size", "params", "backend", "threads", "test", "t/s")
    WIDTHS = (30, 10, 10, 12, 7, 13, 20)

    def __init__(self, fmt: str, out, kv: str = "f16"):
        self.fmt, self.out, self.rows = fmt, out, []
        if kv != "f16":
            at = self.COLUMNS.index("test")
            self.COLUMNS = self.COLUMNS[:at] + ("type_k", "type_v") + self.COLUMNS[at:]
            self.WIDTHS = self.WIDTHS[:at] + (6, 6) + self.WIDTHS[at:]

    def head(self):
        if self.fmt == "md":
            self.out.write("| " + " | ".join(c.ljust(w) for c, w in zip(self.COLUMNS, self.WIDTHS)) + " |\n")
            marks = [("-" * (w - 1) + ":") if c not in ("model", "backend") else "-" * w
                     for c, w in zip(self.COLUMNS, self.WIDTHS)]
            self.out.write("| " + " | ".join(marks) + " |\n")
        elif self.fmt == "csv":
            self.out.write(",".join(CSV_FIELDS) + "\n")
        elif self.fmt == "json":
            self.out.write("[\n")
        self.out.flush()

    def row(self, rec: dict):
        import json
        if self.fmt == "md":
            size, n = rec["model_size"], rec["model_n_params"]
            cells = (rec["model_type"], f"{size / 2 ** 30:.2f} GiB" if size >= 2 ** 30 else f"{size / 2 ** 20:.2f} MiB",
                     f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M",
                     f"{rec['backends']} {rec['isa']}", str(rec["n_threads"]),
                     *((rec["type_k"], rec["type_v"]) if "type_k" in self.COLUMNS else ()),
                     _name(rec["n_prompt"], rec["n_gen"], rec["n_depth"])
                     + (f" x{rec['n_parallel']}" if rec["n_parallel"] > 1 else ""),
                     f"{rec['avg_ts']:.2f} ± {rec['stddev_ts']:.2f}")
            self.out.write("| " + " | ".join(c.ljust(w) if i in (0, 3) else c.rjust(w)
                                               for i, (c, w) in enumerate(zip(cells, self.WIDTHS))) + " |\n")
        elif self.fmt == "csv":
            self.out.write(",".join(_csv(rec[f]) for f in CSV_FIELDS) + "\n")
        elif self.fmt == "jsonl":
            self.out.write(json.dumps(rec) + "\n")
        else:
            self.out.write(("" if not self.rows else ",\n") + "  " + json.dumps(rec))
        self.rows.append(rec)
        self.out.flush()

    def tail(self):
        if self.fmt == "json":
            self.out.write("\n]\n")
            self.out.flush()


CSV_FIELDS = ("build_commit", "build_number", "cpu_info", "gpu_info", "backends", "model_filename", "model_type",
              "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads", "cpu_mask", "cpu_strict", "poll",
              "type_k", "type_v", "n_gpu_layers", "n_cpu_moe", "split_mode", "main_gpu", "no_kv_offload", "flash_attn",
              "devices", "tensor_split", "tensor_buft_overrides", "load_mode", "lazy_mode", "embeddings",
              "no_op_offload", "no_host", "repack", "fit_target", "fit_min_ctx", "n_prompt", "n_gen", "n_depth",
              "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts", "isa", "n_parallel")   # llama-bench's, ours


def _csv(v) -> str:
    s = str(int(v)) if isinstance(v, bool) else str(v)   # llama-bench writes a flag as 0 / 1
    return '"' + s.replace('"', '""') + '"' if any(c in s for c in ',"\n') else s


def main(args) -> int:
    import os
    import sys

    import numpy as np

    from ..engine.api import LookupParams, load_engine, load_model
    from ..engine.errors import BitNetError
    from ..engine.formats.convert import stderr_is_terminal
    from ..engine.formats.hub import is_hub_ref
    from .flags import auto_threads
    tests = tests_of(args)
    if not tests:
        raise BitNetError("no tests: every -p and -n is 0 and no -pg was given")
    if args.repetitions < 1:
        raise BitNetError(f"-r/--repetitions {args.repetitions}: must be >= 1")
    depths = args.n_depth or [0]
    if max(depths) and any(n > 1 for n in args.npl or [1]):
        raise BitNetError("-d/--n-depth with -npl above 1: a depth is measured on one sequence (-npl 1)")
    # the longest test's positions (its last token is not fed), after the deepest context
    ctx = max(depths) + max(max(pp, 1) + tg for pp, tg in tests)
    for m in args.model or []:   # every -m before any test: a typo in the last one ended a long run at it
        if not os.path.exists(m) and not is_hub_ref(m):
            from ..engine.fileio import why_missing
            raise BitNetError(f"-m {m}: {why_missing(m)}")
    table = Table(args.output, sys.stdout, args.kv)
    said_ctx = False
    host = machine()
    started = False
    try:
        for model, threads, npl in ((m, auto_threads(t), n) for m in args.model or [None]
                                    for t in args.threads or [None] for n in args.npl or [1]):
            if npl == 1:   # one sequence: the LLM session, as bitnet run decodes
                runner = load_model(model, ctx=max(ctx, 16), threads=threads, kv_dtype=args.kv,
                                    progress=stderr_is_terminal())
                one = lambda pp, tg, rng, d: run_test(runner, pp, tg, rng, d)   # noqa: E731
            else:          # many: the serving engine's batched steps, as bitnet serve runs them
                runner = load_engine(model, ctx=max(ctx, 16), threads=threads, kv_dtype=args.kv,
                                     parallel=npl, max_queue=npl,   # all npl are submitted at once
                                     progress=stderr_is_terminal(), lookup=LookupParams(draft_max=0))
                one = lambda pp, tg, rng, d, npl=npl: run_batched(runner, pp, tg, npl, rng)   # noqa: E731
            for w in runner.warnings:   # the context is bench's own choice, not a -c the user gave
                if not w.startswith("-c/--ctx"):
                    print(f"bitnet: warning: {w}", file=sys.stderr)
            trained = runner.config.context_length
            if ctx > trained and not said_ctx:
                said_ctx = True
                print(f"bitnet: warning: the longest test runs {ctx} positions, past the {trained} the model "
                      "was trained on (its speed is measured all the same)", file=sys.stderr)
            info = {**describe(runner, model), **host}
            if not started:
                table.head()
                started = True
            rng = np.random.default_rng(1234)
            try:
                for (pp, tg), d in ((t, d) for d in depths for t in tests):   # llama-bench's order
                    one(pp, tg, rng, d)   # warm-up: pages, caches, the pool's threads
                    times = [one(pp, tg, rng, d) for _ in range(args.repetitions)]
                    rates = [npl * (pp + tg) / t for t in times]
                    table.row(record(info, runner, args, pp, tg, npl, times, rates, d))
            finally:
                runner.close()
    except KeyboardInterrupt:
        if started:   # a JSON array is closed only where it was opened
            table.tail()
        print("bitnet: interrupted", file=sys.stderr)
        return 130
    except BaseException:   # a model that fails to load after others ran: the rows printed stay a whole array
        if started:
            table.tail()
        raise
    table.tail()
    return 0
