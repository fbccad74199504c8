"""`bitnet run`: one-shot generation. stdout carries only the generated text (streamed, flushed per
piece); progress, warnings and --verbose timings go to stderr. Ctrl-C stops generation keeping what was
printed (exit 130). Flags follow llama.cpp (cli/flags.py); `-cnv` runs the chat on stdin
as bitchat does; `--json` prints one JSON object per line (text pieces, then the stats) for scripts."""
from .flags import (RANDOM_SEED, UNTIL_END, add_constraint_args, add_engine_args, add_lm_head_arg, add_system_args,
                    apply_chat_template, check_engine_args, constraint_from_args, escaped, sampling_params_from_args,
                    thinking_warnings)
from .. import simd
from ..engine.formats.tokenizer import decode_utf8

HELP = "generate text from a prompt (streams to stdout)"


def _tuned(tuner) -> str:
    """-v: what decode's thread tuner settled on (engine/runtime/thread_tuner.py), when it ran."""
    if tuner is None:
        return ""
    return f", decode on {tuner.cur} (tuned)" if tuner.cur != tuner.n else ", decode tuned"


def add_arguments(p):
    add_engine_args(p, n_predict_default=256)
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", default=None, help="prompt text ('-' reads stdin)%(default).0s")
    src.add_argument("-f", "--file", default=None, help="read the prompt from this file ('-' reads stdin)%(default).0s")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template%(default).0s")
    add_system_args(p)
    p.add_argument("-cnv", "--conversation", action="store_const", const=True, default=None,
                   help="chat on stdin as bitchat does (a terminal gets the REPL; -p is the first message)%(default).0s")
    # llama-cli's opposite, common in its command lines: one prompt, one answer, which is bitnet run's default
    p.add_argument("-no-cnv", "--no-conversation", dest="conversation", action="store_const", const=False,
                   help="one prompt, one answer (the default; llama-cli's flag, taken as it means there: the prompt "
                        "is completed as it is, without the chat template that -sys or --chat-template would "
                        "bring)%(default).0s")
    p.add_argument("-st", "--single-turn", dest="single_turn", action="store_true",
                   help="one chat turn: the prompt in the model's chat template, one answer (llama-cli's flag, as "
                        "--chat; with -cnv too)%(default).0s")
    # llama-cli's flags that ask for what bitnet run always does: accepted, so its command lines run unchanged
    for flags, why in (
            (("--no-display-prompt",), "the prompt is never echoed here"),
            (("--no-warmup",), "no warm-up pass runs here"),
            (("--log-disable",), "stderr carries only warnings, errors and -v's timings (2>/dev/null hides them)"),
            (("--simple-io",), "the input and output are always plain text")):
        p.add_argument(*flags, dest="llama_cli_" + flags[0].lstrip("-").replace("-", "_"), action="store_true",
                       help=f"accepted for llama-cli's command lines: {why}%(default).0s")
    p.add_argument("--ignore-eos", action="store_true",
                   help="never end at the end-of-text token (only -n, the context or --stop end it)%(default).0s")
    p.add_argument("--stop", "-r", "--reverse-prompt", dest="stop", action="append", default=[],
                   help="stop string (repeatable; llama.cpp's -r)%(default).0s")
    add_lm_head_arg(p)
    p.add_argument("--json", action="store_true",
                   help='print one JSON object per line: {"text": ...} per piece, then {"done": true, "stats": ...}, '
                        'or {"error": {"message": ...}} (and the error on stderr) (to make the ANSWER JSON, use '
                        '-j/--json-schema)%(default).0s')
    add_constraint_args(p)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print timings, and the random seed chosen, to stderr%(default).0s")


def _read_prompt(args) -> str | None:
    """The prompt of -p, -f FILE, or stdin (-f - / -p -). A file's or stdin's one final newline is dropped, as
    llama.cpp's -f drops it: every editor and `echo` end a file with one, and a completion prompt that ends in a
    newline is another prompt ("2+3=\\n" is no sum to complete)."""
    from ..engine.errors import BitNetError
    from .flags import read_text_file

    def chomp(t: str) -> str:
        return t[:-2] if t.endswith("\r\n") else t[:-1] if t.endswith("\n") else t

    if args.file is not None:
        return chomp(read_text_file(args.file))
    if args.prompt == "-":
        return chomp(read_text_file("-"))
    if args.prompt is None:
        if args.conversation:
            return None
        raise BitNetError("no prompt: give -p/--prompt TEXT or -f/--file FILE ('-' for stdin), or -cnv to chat")
    try:
        return escaped(args, decode_utf8(args.prompt, "-p/--prompt"), "-p/--prompt")
    except ValueError as e:
        raise BitNetError(str(e)) from None


def _stats_dict(stats, llm) -> dict:
    from dataclasses import asdict

    d = asdict(stats)
    d.update(model=llm.name, n_ctx=llm.n_ctx)
    return d


def resolve_seed(seed: int | None) -> int:
    """llama.cpp's convention: no seed or -1 means a fresh random one, chosen here so -v can print it (and a
    run can be repeated with --seed N). Other values were checked with the flags (check_engine_args)."""
    if seed is None or seed == RANDOM_SEED:
        import secrets

        return secrets.randbits(32)
    return seed


def main(args) -> int:
    """The command; under --json an error (a prompt over the context, a model that does not load, ...) is also one
    JSON object on stdout, {"error": {"message", "exit_code", ...}} (the server's shape, with its n_prompt_tokens /
    n_ctx for a prompt over the context), so a consumer of the JSON lines gets one: stderr's line and the exit code
    stay as for any error."""
    from ..engine.errors import BitNetError

    try:
        return _main(args)
    except BitNetError as e:
        if getattr(args, "json", False) and not getattr(args, "conversation", None):
            _json_error(e)
        raise


def _json_error(e) -> None:
    import contextlib
    import json
    import sys

    error = {"message": str(e), "exit_code": e.exit_code}
    n, ctx = getattr(e, "n_prompt_tokens", None), getattr(e, "n_ctx", None)
    if n is not None and ctx is not None:
        error.update(n_prompt_tokens=n, n_ctx=ctx)
    with contextlib.suppress(OSError, ValueError):   # stdout closed or full: stderr's line still says it
        # escaped: any stdout shows it, and a file name's undecodable bytes (\udce9) stay what they were
        sys.stdout.write(json.dumps({"error": error}) + "\n")
        sys.stdout.flush()


def _main(args) -> int:
    import sys

    from ..engine.errors import BitNetError

    problem = check_engine_args(args)
    if problem:
        raise BitNetError(problem)
    # flags that only mean something in a chat (llama.cpp turns its chat on for them)
    chat_only = [flag for flag, given in (
        ("-sys/--system-prompt", args.system is not None), ("--chat-template", args.chat_template is not None),
        ("--chat-template-file", args.chat_template_file is not None),
        ("--chat-template-kwargs / -rea", bool(args.template_kwargs))) if given]
    raw = args.conversation is False and not args.chat and not args.single_turn   # an explicit -no-cnv
    if raw and chat_only:   # llama-cli's -no-cnv: the prompt as it is, no template
        print(f"bitnet: warning: -no-cnv: the prompt is completed as it is; {', '.join(chat_only)} "
              f"{'is' if len(chat_only) == 1 else 'are'} not used (--chat to wrap it in the chat template)",
              file=sys.stderr)
    if args.single_turn:   # llama-cli's -st: its conversation mode for one turn, i.e. one chat answer
        args.conversation, args.chat = False, True
    prompt = _read_prompt(args)
    constraint = constraint_from_args(args)   # a malformed schema or unreadable file: before the model loads
    if args.conversation:
        for flag, given in (("--json", args.json), ("--ignore-eos", args.ignore_eos),
                            ("-r/--reverse-prompt/--stop", args.stop)):   # all its spellings: -r is llama-cli's
            if given:
                raise BitNetError(f"{flag} does not apply to -cnv/--conversation (the chat has plain text answers "
                                  "that end at the end of a turn)")
        if args.verbose:   # bitchat has no -v: its stats line follows every answer
            raise BitNetError("-v/--verbose does not apply to -cnv/--conversation (the chat shows each answer's stats "
                              "line; /stats and /show info say the rest: model, seed, threads)")
        if constraint is not None and constraint.kind not in ("json_schema", "json_object"):
            raise BitNetError("--grammar/--grammar-file does not apply to -cnv/--conversation (its answers take a "
                              "JSON Schema: -j/--json-schema, --json-schema-file, or /set format inside the chat)")
        # a JSON Schema is the chat's starting format (/set format FILE's), with its --no-jump-forward
        args.chat_format = constraint
        args.chat_format_label = "json" if constraint is not None and constraint.kind == "json_object" else \
            args.json_schema_file or "the -j schema"
        from .chat import run_chat

        return run_chat(args, first_message=prompt)

    stop = [escaped(args, s, "-r/--stop") for s in args.stop]   # an escape that is not UTF-8: before the model loads
    if "" in stop:   # before the model loads, named as typed (generate refuses it as `stop`)
        raise BitNetError("-r/--stop \"\": an empty stop string (each must be non-empty)")
    from ..engine.api import load_model
    from ..engine.fileio import is_terminal
    from ..engine.formats.convert import stderr_is_terminal
    from ..engine.runtime.generate import FINISH_MESSAGES

    seed = resolve_seed(args.seed)
    params = sampling_params_from_args(args, seed=seed)
    from ..engine.runtime.speculative import lookup_from_flags

    lookup = lookup_from_flags(args.draft_max, args.lookup_ngram_min)
    llm = load_model(args.model, ctx=args.ctx, threads=args.threads, kv_dtype=args.kv,
                     progress=stderr_is_terminal(), lm_head=args.lm_head, lookup=lookup, mmap=args.mmap)
    llm.model.cli_hints = True   # a context hint names -c/--ctx, not load_model(ctx=N)
    apply_chat_template(llm, args)
    for w in [*llm.warnings, *thinking_warnings(llm, args)]:
        print(f"bitnet: warning: {w}", file=sys.stderr)
    if args.chat or (chat_only and not raw):
        msgs = ([{"role": "system", "content": args.system}] if args.system is not None else [])
        ids = llm.chat_prompt(msgs + [{"role": "user", "content": prompt}])
    else:
        ids = llm.tokenize(prompt, add_bos=True)
        if prompt.strip() and not [i for i in ids if i != llm.tokenizer.bos_id]:
            raise BitNetError(f"the prompt became no tokens at all: none of its characters are in the vocabulary of"
                              f" {llm.name}", hint="check the model's tokenizer (bitnet inspect)")
    if constraint is not None:
        constraint = llm.compile_constraint(constraint)   # refused (one line) before any token is generated
    until_end = args.n_predict == UNTIL_END
    max_tokens = llm.n_ctx if until_end else args.n_predict
    out = sys.stdout   # a non-UTF-8 terminal gets '?' for what it cannot show (replace_unencodable, at entry)
    if args.json:
        import json

        from . import takes_any_text
        escape = not takes_any_text(out)   # JSON escapes (\u00e9) where stdout's encoding cannot show it

        def emit(text, token):
            out.write(json.dumps({"text": text, "token": token}, ensure_ascii=escape) + "\n")
    else:
        def emit(text, token):
            out.write(text)
    stats = None
    try:
        for chunk in llm.generate(ids, params, max_tokens=max_tokens, stop=stop,
                                  ignore_eos=args.ignore_eos, constraint=constraint):
            if chunk.text:
                emit(chunk.text, chunk.token)
                out.flush()
            if chunk.finish_reason:
                stats = chunk.stats
    except KeyboardInterrupt:
        if is_terminal(out) and not args.json:
            out.write("\n")
        out.flush()
        print("bitnet: interrupted", file=sys.stderr)
        return 130
    if args.json and stats is not None:
        out.write(json.dumps({"done": True, "finish_reason": stats.finish_reason,
                              "stats": _stats_dict(stats, llm)}) + "\n")
    elif is_terminal(out):  # a pipe gets exactly the generated text
        out.write("\n")
    out.flush()
    if stats and stats.finish_reason == "context" and not until_end:
        print(f"bitnet: {FINISH_MESSAGES['context']} (n_ctx {llm.n_ctx}; {llm.model.context_hint()})", file=sys.stderr)
    if args.verbose and stats:
        print(f"model: {llm.name} ({llm.model.lm_head} head, kv {args.kv}, n_ctx {llm.n_ctx}, seed {seed}, "
              f"threads {llm.threads}{_tuned(llm.model.tuner)}, kernels {simd.active()})\n"
              f"load: {stats.load_s * 1000:.0f} ms, weights {llm.store.load_summary()} | prompt: {stats.n_prompt} tokens ({stats.n_cached} cached), "
              f"{stats.prefill_tps:.1f} tok/s | first token: {stats.ttft_s * 1000:.0f} ms | "
              f"generated: {stats.n_generated} tokens, {stats.decode_tps:.1f} tok/s | stop: {stats.finish_reason}"
              + (f" | drafts (lookup, forced tokens): {stats.n_accepted}/{stats.n_drafted} draft tokens accepted"
                 if stats.n_drafted or (lookup is not None and lookup.draft_max) else ""),   # on: said, 0 too
              file=sys.stderr)
    return 0
