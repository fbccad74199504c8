"""`bitnet run`: one-shot generation. stdout carries only the generated text (streamed, flushed per
piece); progress, warnings and --verbose timings go to stderr. Ctrl-C stops generation keeping what was
printed (exit 130)."""
HELP = "generate text from a prompt (streams to stdout)"


def add_arguments(p):
    p.add_argument("-m", "--model", default=None,
                   help="model: a GGUF file, a Hugging Face model dir, or a converted store "
                        "(default: the bundled model)%(default).0s")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", default=None, help="prompt text ('-' reads stdin)%(default).0s")
    src.add_argument("-f", "--file", default=None, help="read the prompt from this file ('-' reads stdin)%(default).0s")
    p.add_argument("-n", "--n-predict", type=int, default=256, dest="n_predict", help="max tokens to generate")
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=40, help="top-k (0 = off)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p (1 = off)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p (0 = off)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="repetition penalty (1 = off)")
    p.add_argument("--repeat-last-n", type=int, default=64, help="tokens the repetition penalty looks back at")
    p.add_argument("--seed", type=int, default=None, help="random seed; -1 or none: a random one (printed with -v)%(default).0s")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: all cores)%(default).0s")
    p.add_argument("-c", "--ctx", type=int, default=None, help="context size in tokens (default: min(model's, 4096))%(default).0s")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template%(default).0s")
    p.add_argument("--system", default=None, help="system message (with --chat)%(default).0s")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)%(default).0s")
    p.add_argument("--kv", choices=("f16", "f32"), default="f16", help="KV cache precision")
    p.add_argument("--lm-head", choices=("i8", "f16"), default=None,
                   help="LM head precision when the model gets converted (default: the converter's)%(default).0s")
    p.add_argument("-v", "--verbose", action="store_true", help="print timings to stderr%(default).0s")


def _read_prompt(args) -> str:
    import sys

    from engine.errors import BitNetError

    if args.file is not None:
        if args.file == "-":
            return sys.stdin.read()
        try:
            with open(args.file, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise BitNetError(f"-f/--file {args.file}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise BitNetError(f"-f/--file {args.file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if args.prompt == "-":
        return sys.stdin.read()
    if args.prompt is None:
        raise BitNetError("no prompt: give -p/--prompt TEXT or -f/--file FILE ('-' for stdin)")
    return args.prompt


def resolve_seed(seed: int | None) -> int:
    """llama.cpp's convention: no seed or -1 means a fresh random one, chosen here so -v can print it (and a
    run can be repeated with --seed N)."""
    from engine.errors import BitNetError

    if seed is None or seed == -1:
        import secrets

        return secrets.randbits(32)
    if seed < 0:
        raise BitNetError(f"--seed {seed}: must be >= 0, or -1 for a random seed")
    return seed


def main(args) -> int:
    import sys

    from engine.api import SamplingParams, load_model
    from engine.errors import BitNetError
    from engine.generate import FINISH_MESSAGES

    if args.n_predict < 0:
        raise BitNetError(f"-n/--n-predict {args.n_predict}: must be >= 0")
    if args.system is not None and not args.chat:
        raise BitNetError("--system needs --chat")
    prompt = _read_prompt(args)
    seed = resolve_seed(args.seed)
    params = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n, seed=seed).check()
    llm = load_model(args.model, ctx=args.ctx, threads=args.threads, kv_dtype=args.kv,
                     progress=sys.stderr.isatty(), lm_head=args.lm_head)
    for w in llm.warnings:
        print(f"bitnet: warning: {w}", file=sys.stderr)
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system is not None else [])
        ids = llm.chat_prompt(msgs + [{"role": "user", "content": prompt}])
    else:
        ids = llm.tokenize(prompt, add_bos=True)
        if prompt.strip() and not [i for i in ids if i != llm.tokenizer.bos_id]:
            raise BitNetError(f"the prompt became no tokens at all: none of its characters are in the vocabulary of"
                              f" {llm.name}", hint="check the model's tokenizer (bitnet inspect)")
    out = sys.stdout
    try:  # a non-UTF-8 terminal gets replacement characters, never an encoding traceback
        out.reconfigure(errors="replace")
    except (AttributeError, ValueError):
        pass
    stats = None
    try:
        for chunk in llm.generate(ids, params, max_tokens=args.n_predict, stop=args.stop):
            if chunk.text:
                out.write(chunk.text)
                out.flush()
            if chunk.finish_reason:
                stats = chunk.stats
    except KeyboardInterrupt:
        if out.isatty():
            out.write("\n")
        out.flush()
        print("bitnet: interrupted", file=sys.stderr)
        return 130
    if out.isatty():  # a pipe gets exactly the generated text
        out.write("\n")
    out.flush()
    if stats and stats.finish_reason == "context":
        print(f"bitnet: {FINISH_MESSAGES['context']} (n_ctx {llm.n_ctx}; {llm.model.context_hint()})", file=sys.stderr)
    if args.verbose and stats:
        print(f"model: {llm.name} ({llm.model.lm_head} head, kv {args.kv}, n_ctx {llm.n_ctx}, seed {seed})\n"
              f"load: {stats.load_s * 1000:.0f} ms | prompt: {stats.n_prompt} tokens ({stats.n_cached} cached), "
              f"{stats.prefill_tps:.1f} tok/s | first token: {stats.ttft_s * 1000:.0f} ms | "
              f"generated: {stats.n_generated} tokens, {stats.decode_tps:.1f} tok/s | stop: {stats.finish_reason}",
              file=sys.stderr)
    return 0
