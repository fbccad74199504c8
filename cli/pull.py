"""`bitnet pull REPO[:FILE|:TAG][@REV]`: download a model from the Hugging Face hub into huggingface_hub's cache
(its progress bars on stderr), then convert it once into the engine's store cache, so `bitnet run -m REPO`
starts at once. Offline it says so in one line (exit 2)."""
HELP = "download a model from the Hugging Face hub (REPO[:FILE|:TAG][@REVISION]) and convert it"


def add_arguments(p):
    p.add_argument("ref", metavar="REPO[:FILE|:TAG][@REV]",
                   help="hub id, e.g. microsoft/bitnet-b1.58-2B-4T, microsoft/bitnet-b1.58-2B-4T-gguf:ggml-model-i2_s.gguf, "
                        "or a quant tag: REPO:TQ2_0 (the .gguf file whose name ends in -TQ2_0)")
    p.add_argument("--no-convert", action="store_true", help="only download (convert on first run)%(default).0s")
    p.add_argument("--json-progress", action="store_true",
                   help="report the download as JSON lines on stderr (`bitnet: progress {...}`: file, digest, "
                        "completed and total bytes; then the conversion's steps: convert, completed, total) instead "
                        "of progress bars, for programs (the server's ollama /api/pull)%(default).0s")
    p.add_argument("--lm-head", choices=("q4", "i8", "f16"), default=None,
                   help="LM head precision of the conversion (default: the converter's)%(default).0s")


def main(args) -> int:
    import shlex
    import sys

    from ..engine.formats.hub import pull

    import json
    import threading

    lock = threading.Lock()   # huggingface_hub downloads a snapshot's files on several threads

    def report(update: dict):
        line = "bitnet: progress " + json.dumps(update) + "\n"
        with lock:   # one write per line: lines of two threads never interleave
            sys.stderr.write(line)
            sys.stderr.flush()

    path = pull(args.ref, progress=report if args.json_progress else None)
    print(f"bitnet: downloaded {args.ref} -> {path}", file=sys.stderr)
    if args.no_convert:
        print(path)
        return 0
    from ..engine.formats.convert import resolve_model

    def steps(done, total):
        report({"convert": args.ref, "completed": done, "total": total})

    store = resolve_model(args.ref, lm_head=args.lm_head, progress=steps if args.json_progress else True)
    head = f" --lm-head {args.lm_head}" if args.lm_head else ""   # the conversion `run` must ask for to find it
    # quoted for a shell: a file name with a space was two words when pasted (another model, or none)
    print(f"bitnet: ready: bitnet run -m {shlex.quote(args.ref)}{head}", file=sys.stderr)
    print(store)
    return 0
