"""`bitnet perplexity`: how well a model predicts a text, as llama.cpp's `llama-perplexity` measures it (the same
chunks, tokens scored and arithmetic: engine/runtime/perplexity.py), and the KL divergence of its next-token
distributions from a base model's (`--kl-divergence-base`, llama.cpp's file: a base written by either tool is read
by the other).

    bitnet perplexity -m MODEL -f wiki.test.raw                      # PPL over every 512-token chunk
    bitnet perplexity -m BASE -f TEXT --kl-divergence-base base.kld  # also save the base's log-probabilities
    bitnet perplexity -m OTHER --kl-divergence-base base.kld --kl-divergence
    bitnet perplexity -m MODEL --hellaswag -f hellaswag_val_full.txt   # acc_norm, llama.cpp's task file
    bitnet perplexity -m MODEL --winogrande -f winogrande-debiased-eval.csv
    bitnet perplexity -m MODEL --multiple-choice -f mmlu-validation.bin     # ARC, MMLU, TruthfulQA: llama.cpp's .bin

The running PPL ("[1]7.1234,[2]...") and the final estimate (or the KL table and statistics) go to stdout, progress
to stderr; --json prints one object instead. Ctrl-C prints the estimate over the chunks done and exits 130, leaving no
half-written base file (an existing one is replaced only once a run completes).
"""
from .flags import auto_threads, read_text_file

HELLASWAG_TASKS = 400   # --hellaswag-tasks' default: llama-perplexity's

HELP = ("measure perplexity over a text file, the KL divergence from a base model's saved logits, HellaSwag, "
        "Winogrande or multiple-choice tasks (llama-perplexity's chunks, numbers and files)")

DEFAULT_CTX = 512   # llama-perplexity's


def add_arguments(p):
    from .flags import add_model_args
    add_model_args(p)
    p.add_argument("-f", "--file", default=None, metavar="FILE",
                   help="the text to score ('-' reads stdin; not needed with --kl-divergence, which scores the base "
                        "file's tokens)%(default).0s")
    p.add_argument("-c", "--ctx-size", "--ctx", dest="ctx", type=int, default=None, metavar="N",
                   help=f"tokens per chunk (default: {DEFAULT_CTX}, as llama-perplexity; with --kl-divergence, the "
                        "base file's)%(default).0s")
    p.add_argument("--chunks", type=int, default=-1, metavar="N", help="score at most N chunks (-1: every whole one)")
    p.add_argument("--ppl-stride", dest="ppl_stride", type=int, default=0, metavar="N",
                   help="llama-perplexity's strided pass: windows of -c tokens every N tokens, each scored over its "
                        "last N (default: 0, whole chunks)%(default).0s")
    p.add_argument("--ppl-output-type", dest="ppl_output_type", type=int, choices=(0, 1), default=0,
                   help="0: the running PPL as [1]7.1234,[2]...; 1: one line per chunk: its first token, the PPL so "
                        "far (and, over chunks, the mean log-likelihood and its error), as llama-perplexity")
    p.add_argument("-b", "--batch-size", "-ub", "--ubatch-size", dest="batch_size", type=int, default=None,
                   metavar="N", help="accepted for llama-perplexity's command lines: chunks run one after another "
                                     "here, and the score is the same%(default).0s")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="CPU threads (default, 0 or less too, as llama.cpp: one per physical core, or "
                        "$OMP_NUM_THREADS)%(default).0s")
    p.add_argument("--kv", dest="kv", choices=("f16", "f32", "q8"), default="f16", help="KV cache precision")
    p.add_argument("--lm-head", choices=("q4", "i8", "f16"), default=None,
                   help="LM head precision when the model gets converted (default: the converter's)%(default).0s")
    p.add_argument("--kl-divergence-base", dest="kld_base", default=None, metavar="FILE",
                   help="the base logits file: written (with the text's tokens) unless --kl-divergence is given, "
                        "then read%(default).0s")
    p.add_argument("--kl-divergence", dest="kld", action="store_true",
                   help="compare with --kl-divergence-base: KL divergence, PPL ratio, top-token agreement%(default).0s")
    p.add_argument("--hellaswag", action="store_true",
                   help="score HellaSwag tasks from -f (llama.cpp's 6-line file) as llama-perplexity --hellaswag: "
                        "acc_norm with its 95%% interval%(default).0s")
    # the task counts' defaults are None, so that one given for another task set is said even at its default value
    p.add_argument("--hellaswag-tasks", dest="hellaswag_tasks", type=int, default=None, metavar="N",
                   help="tasks to score, drawn at random from the file as llama-perplexity draws them (the same "
                        f"tasks where it was built with GCC's libstdc++); 0: every one (default: {HELLASWAG_TASKS})"
                        "%(default).0s")
    p.add_argument("--winogrande", action="store_true",
                   help="score Winogrande tasks from -f (llama.cpp's CSV: index,sentence,choice1,choice2,answer) as "
                        "llama-perplexity --winogrande%(default).0s")
    p.add_argument("--winogrande-tasks", dest="winogrande_tasks", type=int, default=None, metavar="N",
                   help="tasks to score, drawn as llama-perplexity draws them; 0: every one, in the file's order "
                        "(default: 0)%(default).0s")
    p.add_argument("--multiple-choice", dest="multiple_choice", action="store_true",
                   help="score multiple-choice tasks from -f (llama.cpp's binary file: ARC, MMLU, TruthfulQA) as "
                        "llama-perplexity --multiple-choice%(default).0s")
    p.add_argument("--multiple-choice-tasks", dest="multiple_choice_tasks", type=int, default=None, metavar="N",
                   help="tasks to score, drawn as llama-perplexity draws them; 0: every one, in the file's order "
                        "(default: 0)%(default).0s")
    p.add_argument("--json", action="store_true", help="print one JSON object with the results%(default).0s")


def _check(args) -> None:
    from ..engine.errors import BitNetError
    chosen = [flag for flag, on in (("--hellaswag", args.hellaswag), ("--winogrande", args.winogrande),
                                    ("--multiple-choice", args.multiple_choice)) if on]
    if len(chosen) > 1:
        raise BitNetError(f"{' and '.join(chosen)}: one task set at a time")
    task = chosen[0] if chosen else None
    if task and (args.kld or args.kld_base):
        raise BitNetError(f"{task} scores tasks: it takes no --kl-divergence / --kl-divergence-base")
    for flag, dest, default in (("--hellaswag-tasks", "hellaswag_tasks", HELLASWAG_TASKS),
                                ("--winogrande-tasks", "winogrande_tasks", 0),
                                ("--multiple-choice-tasks", "multiple_choice_tasks", 0)):
        n = getattr(args, dest)
        if n is None:
            setattr(args, dest, default)
            continue
        if n < 0:
            raise BitNetError(f"{flag} {n}: must be >= 0 (0: every task)")
        if task != flag.removesuffix("-tasks"):   # said, not ignored (llama-perplexity ignores it), at any value
            raise BitNetError(f"{flag} counts the tasks of {flag.removesuffix('-tasks')}, which this run does not "
                              "score")
    if args.batch_size is not None and args.batch_size < 1:   # taken, not used: a nonsense value is still said
        raise BitNetError(f"-b/--batch-size {args.batch_size}: must be >= 1")
    if task and args.chunks != -1:   # said, not ignored (llama-perplexity ignores it)
        raise BitNetError(f"--chunks counts the chunks of a text's perplexity; {task} scores tasks (count them "
                          f"with {task}-tasks)")
    printer = task or ("--kl-divergence" if args.kld else "--json" if args.json else None)
    if args.ppl_output_type and printer:
        raise BitNetError(f"--ppl-output-type {args.ppl_output_type} chooses the lines of a text's perplexity; "
                          f"{printer} prints its own")
    if args.ppl_stride < 0:
        raise BitNetError(f"--ppl-stride {args.ppl_stride}: must be >= 0 (0: whole chunks)")
    if args.ppl_stride and (task or args.kld or args.kld_base):
        raise BitNetError(f"--ppl-stride scores a text's perplexity: it takes no "
                          f"{task or '--kl-divergence / --kl-divergence-base'}")
    if args.kld and not args.kld_base:
        raise BitNetError("--kl-divergence needs --kl-divergence-base FILE (the base model's logits)")
    if not args.kld and args.file is None:
        raise BitNetError("no text: give -f/--file FILE ('-' for stdin)")
    if args.kld and args.file is not None:   # llama-perplexity takes it and reads the base file's tokens alone
        _info(f"-f {args.file} is not read: --kl-divergence scores the base file's tokens")
    if args.kld_base and not args.kld:   # it is written: checked now, not after every chunk has run
        from ..engine.fileio import check_output, starts_with
        from ..engine.runtime.perplexity import MAGIC
        check_output(args.kld_base, "--kl-divergence-base", keep=lambda p: not starts_with(p, MAGIC))
    if args.ctx is not None and args.ctx < 4 and args.ctx != 0:
        raise BitNetError(f"-c/--ctx-size {args.ctx}: must be >= 4 (0: the model's trained context)")
    ctx = DEFAULT_CTX if args.ctx is None else args.ctx
    if args.ppl_stride and ctx and args.ppl_stride >= ctx:   # before the load (-c 0: the model's, checked later)
        raise BitNetError(f"--ppl-stride {args.ppl_stride}: must be between 1 and the context size - 1 ({ctx - 1})")
    args.threads = auto_threads(args.threads)
    if args.chunks == 0:
        raise BitNetError("--chunks 0: nothing to score (a positive count, or -1 for every chunk)")


def _info(msg: str) -> None:
    import sys
    print(f"perplexity: {msg}", file=sys.stderr, flush=True)


def main(args) -> int:
    import sys

    from ..engine.api import load_model
    from ..engine.errors import BitNetError
    from ..engine.formats.convert import stderr_is_terminal
    from ..engine.runtime.perplexity import LogitsReader

    _check(args)
    reader = LogitsReader(args.kld_base) if args.kld else None
    try:
        if reader is not None:
            if args.ctx is not None and args.ctx != reader.n_ctx:
                raise BitNetError(f"-c/--ctx-size {args.ctx}: {args.kld_base} was made with chunks of {reader.n_ctx} "
                                  "(leave -c out)")
            n_ctx = reader.n_ctx
        else:
            n_ctx = DEFAULT_CTX if args.ctx is None else args.ctx   # 0: the model's trained context
        # a bad task file: one line before the load. `extra`: Winogrande's lines that were no task, the
        # multiple-choice file's task count
        tasks, extra = (_hellaswag_tasks(args), 0) if args.hellaswag else \
            _winogrande_tasks(args) if args.winogrande else \
            _choice_tasks(args) if args.multiple_choice else (None, 0)
        llm = load_model(args.model, ctx=n_ctx, threads=args.threads, kv_dtype=args.kv, lm_head=args.lm_head,
                         progress=stderr_is_terminal())
        n_ctx = n_ctx or llm.n_ctx   # -c 0: the model's
        try:
            for w in llm.warnings:
                print(f"bitnet: warning: {w}", file=sys.stderr)
            if tasks is not None:
                return _hellaswag(args, llm, tasks) if args.hellaswag else \
                    _winogrande(args, llm, tasks, extra) if args.winogrande else _multiple_choice(args, llm, tasks, extra)
            return _score(args, llm, reader, n_ctx)
        finally:
            llm.close()
    finally:
        if reader is not None:
            reader.close()


def _score(args, llm, reader, n_ctx) -> int:
    import sys
    import time

    from ..engine.errors import BitNetError
    from ..engine.runtime import perplexity as P
    vocab = llm.config.vocab_size
    if reader is not None:
        if reader.vocab != vocab:
            raise BitNetError(f"{args.kld_base} holds a vocabulary of {reader.vocab} tokens, this model's has {vocab}: "
                              "not the same model family")
        tokens = reader.tokens
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
            raise BitNetError(f"{args.kld_base}: token ids outside this model's vocabulary")
    else:
        t0 = time.perf_counter()
        tokens = llm.tokenize(read_text_file(args.file), add_bos=True, special=False)   # as llama-perplexity: text is text
    stride = args.ppl_stride
    runs = P.passes(len(tokens), n_ctx, args.chunks, stride, llm.tokenizer.text_bos)   # a short text: one line
    if reader is None:
        _info(f"tokenization took {1e3 * (time.perf_counter() - t0):.1f} ms ({len(tokens)} tokens)")
    n_chunk = len(runs)
    tokens = [int(t) for t in tokens[: runs[-1][0] + n_ctx]]
    writer = P.LogitsWriter(args.kld_base, n_ctx, vocab, tokens) if args.kld_base and not args.kld else None
    nll, kld = P.NllStats(), (P.KldStats() if reader is not None else None)
    _info(f"calculating {'KL divergence' if kld else 'perplexity'} over {n_chunk} "
          + (f"windows of {n_ctx} tokens every {stride}, {stride} tokens scored per window" if stride else
             f"chunks, n_ctx={n_ctx}, {P.scored_rows(n_ctx)} tokens scored per chunk") + f", {llm.threads} threads")
    out = sys.stdout
    done, marks = 0, None
    started = time.perf_counter()
    try:
        for c, (start, bos, first) in enumerate(runs):
            t0 = time.perf_counter()
            marks = (nll.mark(), kld.mark() if kld is not None else None)   # a chunk counts whole or not at all
            for logits, targets in P.chunk_logits(llm.model, tokens[start: start + n_ctx], bos, first):
                nll.add(logits, targets)
                if writer is not None:
                    writer.add(logits)
                if kld is not None:
                    kld.add(logits, targets, reader.rows(len(targets)))
            done, marks = done + 1, None   # one statement: a Ctrl-C lands before it or after it
            if c == 0:
                per = time.perf_counter() - t0
                _info(f"{per:.2f} seconds per pass - ETA {per * n_chunk / 60:.2f} minutes")
                if kld is not None and not args.json:
                    out.write("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
                              "              Δp RMS            Same top p\n")
            if not args.json:
                out.write(_kld_line(c + 1, kld.row()) if kld is not None else _ppl_line(args, c, start, nll))
                out.flush()
    except KeyboardInterrupt:
        if writer is not None:
            writer.abort()
        if marks is not None:   # Ctrl-C inside a chunk: its pieces scored so far are not part of the estimate
            nll.back(marks[0])
            if kld is not None:
                kld.back(marks[1])
        if done:
            _final(args, out, nll, kld, done, n_chunk, n_ctx, time.perf_counter() - started, interrupted=True)
        print("bitnet: interrupted" + (f" after {done} of {n_chunk} chunks" if done else ""), file=sys.stderr)
        return 130
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.commit()
    _final(args, out, nll, kld, done, n_chunk, n_ctx, time.perf_counter() - started)
    if writer is not None:   # after the final line: before it, it landed on the running [i]ppl, line of a terminal
        _info(f"saved the base logits of {n_chunk} chunks to {args.kld_base}")
    return 0


def _ppl_line(args, c: int, start: int, nll) -> str:
    """The running PPL after chunk c (0-based) starting at token `start`, as llama-perplexity prints it."""
    if args.ppl_output_type == 0:
        return f"[{c + 1}]{nll.ppl():.4f},"
    if args.ppl_stride:
        return f"{start:8d}  {nll.ppl():.4f}\n"
    mean, err = nll.mean_nll()
    return f"{start:8d}  {nll.ppl():.4f}  {mean:4f}  {err:4f}\n"


def _kld_line(chunk: int, r: dict) -> str:
    return (f"{chunk:4d}    {r['ppl']:9.4f} ± {r['ppl_err']:9.4f}    {r['ln_ppl_ratio']:10.5f} ± "
            f"{r['ln_ppl_ratio_err']:10.5f}    {r['kld']:10.5f} ± {r['kld_err']:10.5f}    "
            f"{100 * r['p_diff_rms']:6.3f} ± {100 * r['p_diff_rms_err']:6.3f} %    "
            f"{100 * r['same_top']:6.3f} ± {100 * r['same_top_err']:6.3f} %\n")


def _final(args, out, nll, kld, done, n_chunk, n_ctx, seconds, interrupted=False) -> None:
    import json
    ppl, err = nll.estimate()
    summary = kld.summary() if kld is not None and kld.count >= 100 else None
    if args.json:
        rec = {"ppl": ppl, "ppl_err": err, "chunks": done, "chunks_planned": n_chunk, "n_ctx": n_ctx,
               "tokens_scored": nll.count, "seconds": round(seconds, 3)}
        if args.ppl_stride:
            rec["stride"] = args.ppl_stride
        if interrupted:
            rec["interrupted"] = True
        if kld is not None:
            rec["kl_divergence"] = summary if summary is not None else kld.row()
        out.write(json.dumps(rec) + "\n")
        out.flush()
        return
    if kld is None:
        out.write("\n" + ("Final estimate" if not interrupted else f"Estimate over {done} of {n_chunk} chunks")
                  + f": PPL = {ppl:.4f} +/- {err:.5f}\n")
    elif summary is not None:
        out.write("\n" + _kld_report(summary))
    out.flush()
    if kld is not None and kld.floored:
        import sys
        print(f"perplexity: note: {kld.floored} of {kld.count} scored tokens are below the base file's floor (its top "
              "log-probability - 16, stored as the floor as llama.cpp stores them): PPL(base) is lower than the base "
              "model's own PPL by that much", file=sys.stderr)


def _kld_report(s: dict) -> str:
    """llama-perplexity's statistics blocks, line for line (scripts read them)."""
    k, d = s["kld_percentiles"], s["p_diff_percentiles"]
    lines = ["====== Perplexity statistics ======",
             f"Mean PPL(Q)                   : {s['ppl']:10.6f} ± {s['ppl_err']:10.6f}",
             f"Mean PPL(base)                : {s['ppl_base']:10.6f} ± {s['ppl_base_err']:10.6f}",
             f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['ln_ppl_cor']:6.2f}%",
             f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ppl_ratio']:10.6f} ± {s['ln_ppl_ratio_err']:10.6f}",
             f"Mean PPL(Q)/PPL(base)         : {s['ppl_ratio']:10.6f} ± {s['ppl_ratio_err']:10.6f}",
             f"Mean PPL(Q)-PPL(base)         : {s['ppl_diff']:10.6f} ± {s['ppl_diff_err']:10.6f}",
             "",
             "====== KL divergence statistics ======",
             f"Mean    KLD: {s['kld']:10.6f} ± {s['kld_err']:10.6f}",
             f"Maximum KLD: {k['max']:10.6f}"]
    lines += [f"{p.rjust(4)}%   KLD: {k[p]:10.6f}" for p in ("99.9", "99.0", "95.0", "90.0")]
    lines += [f"Median  KLD: {k['median']:10.6f}"]
    lines += [f"{p.rjust(4)}%   KLD: {k[p]:10.6f}" for p in ("10.0", "5.0", "1.0", "0.1")]
    lines += [f"Minimum KLD: {k['min']:10.6f}", "",
              "====== Token probability statistics ======",
              f"Mean    Δp: {100 * s['p_diff']:6.3f} ± {100 * s['p_diff_err']:5.3f} %",
              f"Maximum Δp: {100 * d['max']:6.3f}%"]
    lines += [f"{p.rjust(4)}%   Δp: {100 * d[p]:6.3f}%" for p in ("99.9", "99.0", "95.0", "90.0", "75.0")]
    lines += [f"Median  Δp: {100 * d['median']:6.3f}%"]
    lines += [f"{p.rjust(4)}%   Δp: {100 * d[p]:6.3f}%" for p in ("25.0", "10.0", "5.0", "1.0", "0.1")]
    lines += [f"Minimum Δp: {100 * d['min']:6.3f}%",
              f"RMS Δp    : {100 * s['p_diff_rms']:6.3f} ± {100 * s['p_diff_rms_err']:5.3f} %",
              f"Same top p: {100 * s['same_top']:6.3f} ± {100 * s['same_top_err']:5.3f} %"]
    return "\n".join(lines) + "\n"


def _hellaswag_tasks(args) -> list:
    """The tasks to score, in order: --hellaswag-tasks of them (0: all) drawn as llama-perplexity draws them."""
    from ..engine.runtime.perplexity import draw_hellaswag, parse_hellaswag
    tasks = parse_hellaswag(read_text_file(args.file))
    return draw_hellaswag(tasks, len(tasks) if args.hellaswag_tasks == 0 else args.hellaswag_tasks)


def _continuations(llm, kind: str, items) -> list[list[list[int]]]:
    """Each task's token lists, BOS + context + " " + ending (llama-perplexity's tokenization), every task checked
    against the context before the first is scored. items: (index, context, endings)."""
    from ..engine.errors import BitNetError
    out = []
    for index, context, endings in items:
        seqs = [llm.tokenize(context + " " + e, add_bos=True, special=False) for e in endings]
        longest = max(len(x) for x in seqs)
        if longest > llm.n_ctx:
            raise BitNetError(f"{kind} task {index + 1} needs {longest} tokens, over the context ({llm.n_ctx})",
                              hint="raise -c")
        out.append(seqs)
    return out


def _hellaswag(args, llm, tasks) -> int:
    """acc_norm over the tasks, a line per task as llama-perplexity prints them (task, running accuracy, its 95%
    Wilson interval); Ctrl-C keeps what was scored."""
    import json
    import sys
    import time

    from ..engine.runtime.perplexity import continuation_scores, wilson
    out = sys.stdout
    all_seqs = _continuations(llm, "HellaSwag", [(t.index, t.context, t.endings) for t in tasks])
    _info(f"scoring {len(tasks)} HellaSwag tasks, {llm.threads} threads")
    if not args.json:
        out.write("\ntask\tacc_norm\t95% confidence interval\n")
    right, results = 0, []
    started = time.perf_counter()
    interrupted = False
    try:
        for n, (task, seqs) in enumerate(zip(tasks, all_seqs), 1):
            scores = continuation_scores(llm.model, seqs)
            chosen = max(range(4), key=lambda j: (scores[j], -j))   # the first of equal bests, as llama.cpp
            right += chosen == task.gold
            results.append({"task": task.index, "gold": task.gold, "chosen": chosen, "scores": scores})
            if not args.json:
                lo, hi = wilson(right, n)
                out.write(f"{n}\t{100 * right / n:3.8f}%\t[{100 * lo:3.4f}%, {100 * hi:3.4f}%]\n")
                out.flush()
    except KeyboardInterrupt:
        interrupted = True
    n = len(results)
    if args.json and n:
        lo, hi = wilson(right, n)
        rec = {"tasks": n, "tasks_planned": len(tasks), "acc_norm": 100 * right / n, "ci95": [100 * lo, 100 * hi],
               "seconds": round(time.perf_counter() - started, 3), "results": results}
        if interrupted:
            rec["interrupted"] = True
        out.write(json.dumps(rec) + "\n")
        out.flush()
    if interrupted:
        print(f"bitnet: interrupted after {n} of {len(tasks)} tasks", file=sys.stderr)
        return 130
    return 0


def _winogrande_tasks(args) -> tuple[list, int]:
    """(the tasks to score, the lines that were none, each "line N: why": a header's, or a mistake's)."""
    from ..engine.errors import BitNetError
    from ..engine.runtime.perplexity import draw_winogrande, parse_winogrande
    tasks, skipped = parse_winogrande(read_text_file(args.file))
    if not tasks:   # a file of one task says so: its last line is never read (llama-perplexity's reading)
        raise BitNetError(f"-f/--file {args.file}: no Winogrande tasks in it (its last line is never a task, as "
                          "in llama-perplexity)",
                          hint="llama.cpp's CSV: index,sentence with _,choice1,choice2,answer 1 or 2")
    return draw_winogrande(tasks, args.winogrande_tasks), skipped


def _winogrande(args, llm, tasks, skipped: list) -> int:
    """Winogrande's accuracy, a line per task as llama-perplexity prints them (task, running accuracy, the two
    scores, the choice, the answer), and its final score with the standard error from 100 tasks on."""
    import json
    import math
    import sys
    import time

    from ..engine.errors import BitNetError
    from ..engine.runtime.perplexity import winogrande_scores
    out = sys.stdout
    prepared = []
    for task in tasks:   # every task is checked before the first is scored
        seqs = [llm.tokenize(task.first + c + task.second, add_bos=True, special=False) for c in task.choices]
        bases = [len(llm.tokenize(task.first + c, add_bos=True, special=False)) for c in task.choices]
        if max(len(x) for x in seqs) > llm.n_ctx:
            raise BitNetError(f"Winogrande task {task.index + 1} needs {max(len(x) for x in seqs)} tokens, over the "
                              f"context ({llm.n_ctx})", hint="raise -c")
        prepared.append((seqs, bases))
    if skipped:   # which and why (a header's, or a task's mistake: "3 lines (a header?)" named none)
        _info(f"skipped {len(skipped)} line{'s' if len(skipped) > 1 else ''} that {'are' if len(skipped) > 1 else 'is'}"
              f" not a task: {'; '.join(skipped[:3])}{'; ...' if len(skipped) > 3 else ''}")
    _info(f"scoring {len(tasks)} Winogrande tasks, {llm.threads} threads")
    right, results, interrupted = 0, [], False
    started = time.perf_counter()
    try:
        for n, (task, (seqs, bases)) in enumerate(zip(tasks, prepared), 1):
            s1, s2 = winogrande_scores(llm.model, seqs, bases)
            chosen = 1 if s1 > s2 else 2   # a nan loses to a number, as in llama-perplexity
            right += chosen == task.answer
            results.append({"task": task.index, "answer": task.answer, "chosen": chosen, "scores": [s1, s2]})
            if not args.json:
                out.write(f"{n}\t{100 * right / n:.4f}\t{s1:10.6f}  {s2:10.6f}  {chosen}  {task.answer}\n")
                out.flush()
    except KeyboardInterrupt:
        interrupted = True
    n = len(results)
    if n:
        p = right / n
        err = 100 * math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0
        if args.json:
            rec = {"tasks": n, "tasks_planned": len(tasks), "score": 100 * p, "score_err": err,
                   "seconds": round(time.perf_counter() - started, 3),
                   "results": [{**r, "scores": [x if x == x else None for x in r["scores"]]} for r in results]}
            if interrupted:
                rec["interrupted"] = True
            out.write(json.dumps(rec) + "\n")
        elif n >= 100:
            out.write(f"\nFinal Winogrande score({n} tasks): {100 * p:.4f} +/- {err:.4f}\n")
        out.flush()
    if interrupted:
        print(f"bitnet: interrupted after {n} of {len(tasks)} tasks", file=sys.stderr)
        return 130
    return 0


def _choice_tasks(args) -> tuple[list, int]:
    """(the tasks to score, the file's task count)."""
    import sys

    from ..engine.errors import BitNetError
    from ..engine.runtime.perplexity import parse_multiple_choice
    try:
        if args.file == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(args.file, "rb") as f:
                data = f.read()
    except OSError as e:
        raise BitNetError(f"-f/--file {args.file}: {e.strerror}") from None
    try:
        return parse_multiple_choice(data, args.multiple_choice_tasks)
    except BitNetError as e:
        raise BitNetError(f"-f/--file {args.file}: {e.args[0]}", hint=e.hint or "llama.cpp's binary multiple-choice "
                          "layout (ikawrakow/validation-datasets-for-llama.cpp)") from None


def _multiple_choice(args, llm, tasks, count: int) -> int:
    """Accuracy over multiple-choice tasks (the answer with the highest mean log-probability, right when its label
    is 1), a line per task as llama-perplexity prints them (task, running accuracy); the final result and the
    random chance (tasks / answers) with their standard errors, from 100 tasks on or over every task."""
    import json
    import math
    import sys
    import time

    from ..engine.runtime.perplexity import continuation_scores
    out = sys.stdout
    all_seqs = _continuations(llm, "multiple-choice", [(t.index, t.question, t.answers) for t in tasks])
    _info(f"scoring {len(tasks)} of {count} multiple-choice tasks, {llm.threads} threads")
    if not args.json:
        out.write("\ntask\tacc_norm\n")
    right, answers, results, interrupted = 0, 0, [], False
    started = time.perf_counter()
    try:
        for n, (task, seqs) in enumerate(zip(tasks, all_seqs), 1):
            scores = continuation_scores(llm.model, seqs) if len(seqs) > 1 else [0.0]
            chosen = max(range(len(scores)), key=lambda j: (scores[j], -j))   # the first of equal bests
            ok = task.labels[chosen] == 1
            right += ok
            answers += len(scores)
            results.append({"task": task.index, "labels": task.labels, "chosen": chosen, "right": ok,
                            "scores": scores})
            if not args.json:
                out.write(f"{n}\t{100 * right / n:.8f}\n")
                out.flush()
    except KeyboardInterrupt:
        interrupted = True
    n = len(results)
    if n:
        def mean_err(p):
            return 100 * p, (100 * math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0)
        acc, acc_err = mean_err(right / n)
        chance, chance_err = mean_err(n / answers)
        if args.json:
            rec = {"tasks": n, "tasks_planned": len(tasks), "accuracy": acc, "accuracy_err": acc_err,
                   "random_chance": chance, "random_chance_err": chance_err,
                   "seconds": round(time.perf_counter() - started, 3), "results": results}
            if interrupted:
                rec["interrupted"] = True
            out.write(json.dumps(rec) + "\n")
        elif n >= 100 or n == count:
            out.write(f"\nFinal result: {acc:.4f} +/- {acc_err:.4f}\nRandom chance: {chance:.4f} +/- {chance_err:.4f}\n")
        out.flush()
    if interrupted:
        print(f"bitnet: interrupted after {n} of {len(tasks)} tasks", file=sys.stderr)
        return 130
    return 0
