"""Flags shared by `bitnet run`, `bitchat` and `bitnet serve`: model, context, threads, answer length, system
prompt, sampling and prompt lookup, spelled as llama.cpp spells them, with one help text, one minimum and one
check each; plus the parsing helper that answers an unknown flag with the subcommand's own usage and a "did you
mean" suggestion.

    add_engine_args(p, n_predict_default=256)    # -m -c -t [-n] --temp ... --draft-max ...
    add_system_args(p)
    problem = check_engine_args(args)            # one line naming the flag, or None
    params = sampling_params_from_args(args)
    args = parse_args_suggesting(parser, argv, subparsers={"run": run_parser, ...})

The sampling defaults and their checks are the engine's (SamplingParams, setting_problem), so `--top-p 3`,
bitchat's `/set top_p 3` and the server's `"top_p": 3` are refused with the same words.
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys

from ..engine.runtime.sampling import SamplingParams, setting_problem

UNTIL_END = -1   # -n -1: until the end of text or a full context (llama.cpp's meaning)
RANDOM_SEED = -1  # --seed -1: a fresh random seed (llama.cpp's meaning)
CTX_MIN = 0       # 0: the model's trained context (llama.cpp's -c 0); 1 token is the engine's own minimum, and a
                  # prompt that does not fit is then the engine's one-line error, naming -c/--ctx


def auto_threads(n: int | None) -> int | None:
    """-t/--threads as llama.cpp reads it: 0 or less is the default count (None here), as its hardware
    concurrency there."""
    return None if n is not None and n <= 0 else n

_D = SamplingParams()
# SamplingParams field (the argparse dest) -> (spellings, type, metavar, help); defaults come from SamplingParams
SAMPLING_FLAGS = {
    "temperature": (("--temp", "--temperature"), float, "T", "temperature (0 = greedy)"),
    "top_k": (("--top-k",), int, "K", "top-k (<= 0 = off)"),
    "top_p": (("--top-p",), float, "P", "top-p (1 = off)"),
    "min_p": (("--min-p",), float, "P", "min-p (0 = off)"),
    "repeat_penalty": (("--repeat-penalty",), float, "R", "repetition penalty (1 = off)"),
    "repeat_last_n": (("--repeat-last-n",), int, "N", "tokens the repetition penalty looks back at"),
    "seed": (("--seed", "-s"), int, "S", "random seed; -1 or none: a random one"),
    "presence_penalty": (("--presence-penalty",), float, "P", "OpenAI's presence penalty on generated tokens (0 = off)"),
    "frequency_penalty": (("--frequency-penalty",), float, "F", "OpenAI's frequency penalty on generated tokens (0 = off)"),
    "dry_multiplier": (("--dry-multiplier",), float, "M", "DRY: penalty multiplier of tokens extending a repeat (0 = off)"),
    "dry_base": (("--dry-base",), float, "B", "DRY: the penalty's base (multiplier * base^(length - allowed))"),
    "dry_allowed_length": (("--dry-allowed-length",), int, "N", "DRY: repeats this long go unpenalized"),
    "dry_penalty_last_n": (("--dry-penalty-last-n",), int, "N", "DRY: tokens it looks back at (-1 = all, 0 = off)"),
    "top_n_sigma": (("--top-nsigma", "--top-n-sigma"), float, "N", "keep logits within N standard deviations of the top "
                    "(<= 0 = off)"),
    "typical_p": (("--typical",), float, "P", "locally typical sampling (1 = off)"),
    "xtc_probability": (("--xtc-probability",), float, "P", "XTC: how often the top choices are excluded (0 = off)"),
    "xtc_threshold": (("--xtc-threshold",), float, "P", "XTC: the probability a top choice needs (> 0.5 = off)"),
    "dynatemp_range": (("--dynatemp-range",), float, "R", "dynamic temperature: temp +- R by the entropy (0 = off)"),
    "dynatemp_exponent": (("--dynatemp-exp",), float, "E", "dynamic temperature's exponent"),
    "mirostat": (("--mirostat",), int, "N", "Mirostat 1 or 2 instead of top-k/top-p/min-p... (0 = off)"),
    "mirostat_eta": (("--mirostat-lr",), float, "ETA", "Mirostat's learning rate"),
    "mirostat_tau": (("--mirostat-ent",), float, "TAU", "Mirostat's target entropy (surprise, bits)"),
    "min_keep": (("--min-keep",), int, "N", "typical, top-p, min-p and XTC keep at least N tokens (0 = no minimum)"),
    "reasoning_budget": (("--reasoning-budget",), int, "N", "a thinking model's <think> block ends after N tokens "
                         "(-1 = no limit, 0 = at once)"),
    "reasoning_budget_message": (("--reasoning-budget-message",), str, "TEXT", "text put before the end of a thought "
                                 "the budget cuts"),
}


class _Breakers(argparse._AppendAction):
    """llama.cpp's --dry-sequence-breaker: the first one given replaces the defaults, the next ones add to it (an
    append action still, so `bitnet serve`'s model processes get each one passed on)."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        given = [] if current is None or current is self.default else list(current)
        setattr(namespace, self.dest, given + [values])


NO_JINJA = "chat templates are always rendered as Jinja2 here (there is no other renderer); it changes nothing"
# what llama.cpp's --context-shift / --cache-prompt switches ask for, as done here (always the same)
NO_SHIFT = ("the context never shifts here: a prompt longer than -c is refused, and an answer stops when the context "
            "is full")
CACHED = ("the start a prompt shares with an earlier one is always reused from the KV cache here (bitnet serve's "
          "prefix cache, bitchat's conversation), with the same results (f32 prefill attention, the default)")
SHIFT_REFUSED = "the context does not shift here: a prompt longer than -c is refused, an answer stops at a full context"
NO_CACHE_REFUSED = ("the prompt cache cannot be turned off here: a cached prompt start gives the same results as a "
                    "fresh one (f32 prefill attention, the default)")


class _Unneeded(argparse._StoreTrueAction):
    """A llama.cpp flag asking for what cannot be done here and changes nothing: taken, with one warning line saying
    why (its command lines run unchanged, and the user is told)."""

    def __init__(self, *args, why: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string}: {self.why}", file=sys.stderr)
        super().__call__(parser, namespace, values, option_string)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", metavar="MODEL", default=None,
                   help="a converted store, a GGUF file, an HF model directory, or a Hugging Face hub id "
                        "(REPO[:FILE|:TAG][@REVISION]) already downloaded (default: the bundled model)%(default).0s")


def add_engine_args(p: argparse.ArgumentParser, *, n_predict_default: int | None = None) -> None:
    """-m, -c, -t, the sampling flags and the prompt-lookup flags for every command that loads a model; -n when
    `n_predict_default` is given. For `bitnet serve` the sampling flags are the defaults of fields a request
    leaves out, and --draft-max / --lookup-ngram-min apply to every sequence."""
    add_model_args(p)
    if n_predict_default is not None:
        p.add_argument("-n", "--n-predict", "--max-tokens", dest="n_predict", type=int, default=n_predict_default,
                       metavar="N", help="max tokens per answer (-1 = until the end of text or a full context)")
    p.add_argument("-c", "--ctx-size", "--ctx", dest="ctx", type=int, default=None, metavar="N",
                   help="context size in tokens, of each sequence (default: min(model's, 4096); bitnet serve: "
                        "at least 2048; 0: the model's trained context)%(default).0s")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="CPU threads (default, 0 or less too, as llama.cpp: one per physical core, or "
                        "$OMP_NUM_THREADS)%(default).0s")
    p.add_argument("--kv", dest="kv", choices=("f16", "f32", "q8"), default="f16",
                   help="KV cache precision (q8: int8 with a scale per position, 0.52x the memory of f16; "
                        "docs/kv-cache.md)")
    p.add_argument("--prefill-attention", dest="prefill_attention", choices=("f32", "bf16"), default=None,
                   help="products of the prompt's attention: f32 (default: the same bytes however a prompt is split, "
                        "batched or decoded) or bf16 (CPUs with AVX512_BF16: attention ~1.6x faster, a 4,096-token "
                        "prompt ~1.2x; results within bf16 rounding; docs/performance.md; $BITNET_ATTENTION)"
                        "%(default).0s")
    texts = "-p, --stop and --dry-sequence-breaker" if p.prog.endswith(" run") else "--dry-sequence-breaker"
    p.add_argument("-e", "--escape", dest="escape", action="store_true", default=True,
                   help=f"process escapes (\\n \\r \\t \\' \\\" \\\\ \\xHH) in {texts}, as llama.cpp does (on; a file's "
                        "text is taken as it is)%(default).0s")
    p.add_argument("--no-escape", dest="escape", action="store_false", help="take those texts as typed%(default).0s")
    p.add_argument("--jinja", action="store_true",
                   help="accepted for llama.cpp's command lines: chat templates are always Jinja2 here")
    p.add_argument("--no-jinja", dest="no_jinja", action=_Unneeded, why=NO_JINJA,
                   help="accepted for llama.cpp's command lines, with a warning: chat templates are always Jinja2 "
                        "here")
    # llama.cpp's switches whose "on" / "off" asks for what every command here always does: accepted (a no-op);
    # their other side is one line, exit 2 (LLAMA_ONLY), and so are llama-server's variables for them (llama_env_argv)
    p.add_argument("--no-context-shift", dest="no_context_shift", action="store_true",
                   help=f"accepted for llama.cpp's command lines: {NO_SHIFT}%(default).0s")
    p.add_argument("--cache-prompt", dest="cache_prompt", action="store_true",
                   help=f"accepted for llama.cpp's command lines: {CACHED}%(default).0s")
    p.add_argument("--mmap", dest="mmap", action="store_const", const=True, default=None,
                   help="map the model file instead of reading its weights into huge-page memory: starts at once "
                        "and shares the file's pages with other processes, decodes ~10%% slower (default: models "
                        "over 64 MiB are read when the kernel has transparent huge pages and memory allows)"
                        "%(default).0s")
    p.add_argument("--no-mmap", dest="mmap", action="store_const", const=False,
                   help="always read the weights into memory%(default).0s")
    for field, (spellings, kind, metavar, text) in SAMPLING_FLAGS.items():
        default = getattr(_D, field)
        p.add_argument(*spellings, dest=field, type=kind, default=default, metavar=metavar,
                       help=text + ("%(default).0s" if default in (None, "") else ""))
    p.add_argument("--dry-sequence-breaker", dest="dry_sequence_breakers", action=_Breakers,
                   default=_D.dry_sequence_breakers, metavar="STR",
                   help="DRY: a sequence breaker, replacing the defaults (newline, colon, quote, asterisk; "
                        "repeatable; 'none': no breakers)%(default).0s")
    p.add_argument("--chat-template", default=None, metavar="NAME|JINJA",
                   help="render chats with this template instead of the model file's: bitnet, chatml, llama3, or a "
                        "Jinja2 template (llama.cpp's flag)%(default).0s")
    p.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="the chat template (Jinja2) from a file%(default).0s")
    p.add_argument("--chat-template-kwargs", dest="chat_template_kwargs", default=None, metavar="JSON",
                   help="more variables for every chat's template, a JSON object, e.g. '{\"enable_thinking\": false}' "
                        "(llama.cpp's flag; a request's chat_template_kwargs win)%(default).0s")
    p.add_argument("-rea", "--reasoning", dest="reasoning", default=None, metavar="on|off|auto",
                   help="a thinking model's <think> block: on, off (the template's enable_thinking), auto: the "
                        "template's default (llama.cpp's flag)%(default).0s")
    p.add_argument("--reasoning-effort", dest="reasoning_effort", default=None, metavar="LEVEL",
                   help="the template's reasoning_effort variable (gpt-oss's low / medium / high; 'default': "
                        "left out; llama.cpp's flag)%(default).0s")
    p.add_argument("--draft-max", type=int, default=None, metavar="K",
                   help="prompt-lookup speculative decoding: most draft tokens verified per pass, 0 = off "
                        "(default: off; --draft-max 4 is a good start on repetitive text; same output either "
                        "way)%(default).0s")
    p.add_argument("--lookup-ngram-min", type=int, default=None, metavar="N",
                   help="prompt lookup: shortest repeated n-gram that proposes a draft (default: 2)%(default).0s")


def add_lm_head_arg(p: argparse.ArgumentParser) -> None:
    """--lm-head of `bitnet run` and bitchat (they share the model flags): the head a conversion of -m gets."""
    p.add_argument("--lm-head", choices=("q4", "i8", "f16"), default=None,
                   help="LM head precision when the model gets converted (default: the converter's)%(default).0s")


def add_system_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-sys", "--system-prompt", "--system", dest="system", default=None, metavar="TEXT",
                   help="system prompt (default: none)%(default).0s")


def add_constraint_args(p: argparse.ArgumentParser) -> None:
    """Structured output, as llama.cpp spells it: the answer must match a JSON Schema or a GBNF grammar."""
    g = p.add_argument_group("structured output (every generated token obeys it)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("-j", "--json-schema", default=None, metavar="SCHEMA",
                     help="JSON Schema the answer must match (JSON text; '{}' = any JSON object)%(default).0s")
    src.add_argument("--json-schema-file", default=None, metavar="FILE", help="the JSON Schema from a file%(default).0s")
    src.add_argument("--grammar", default=None, metavar="GBNF", help="GBNF grammar (llama.cpp's format)%(default).0s")
    src.add_argument("--grammar-file", default=None, metavar="FILE", help="the GBNF grammar from a file%(default).0s")
    g.add_argument("--no-jump-forward", action="store_true",
                   help="sample the tokens the grammar forces one by one (same output, slower)%(default).0s")


def constraint_from_args(args: argparse.Namespace):
    """The Constraint the structured-output flags ask for, or None. Raises BitNetError (one line naming the
    flag) for an unreadable file or a malformed schema; what cannot be enforced is refused when compiled."""
    import contextlib
    import json

    from ..engine.errors import BitNetError
    from ..engine.fileio import read_settings_file
    from ..engine.runtime.constraints import Constraint

    jf = not getattr(args, "no_jump_forward", False)

    def read(path, flag):   # a regular file of at most 4 MiB, ~ expanded (engine/fileio.py)
        try:
            return read_settings_file(path, "a schema or grammar")
        except ValueError as e:
            raise BitNetError(f"{flag} {path}: {e}") from None

    def schema(text, where):
        # '{}' (or nothing) is "a JSON object", as /set format json and llama.cpp's converter read it; a schema
        # that says nothing would otherwise let any value through (60, "x")
        with contextlib.suppress(ValueError):
            if json.loads(text) == {}:
                return Constraint.json_object(where=where, jump_forward=jf)
        return Constraint.json_schema(text, where=where, jump_forward=jf)

    if getattr(args, "json_schema", None) is not None:
        return schema(args.json_schema or "{}", "-j/--json-schema")
    if getattr(args, "json_schema_file", None) is not None:
        return schema(read(args.json_schema_file, "--json-schema-file"), f"--json-schema-file {args.json_schema_file}")
    if getattr(args, "grammar", None) is not None:
        return Constraint.gbnf(args.grammar, where="--grammar", jump_forward=jf)
    if getattr(args, "grammar_file", None) is not None:
        return Constraint.gbnf(read(args.grammar_file, "--grammar-file"), where=f"--grammar-file {args.grammar_file}",
                               jump_forward=jf)
    return None


def check_engine_args(args: argparse.Namespace) -> str | None:
    """One line naming the first bad value among the flags add_engine_args added, or None; then (all good)
    --prefill-attention is in force, process-wide (a kernel setting, like BITNET_ISA)."""
    n = getattr(args, "n_predict", None)
    if n == -2:   # llama.cpp's "until the context is full": here, as -1, until the end of text or a full context
        args.n_predict = n = UNTIL_END
    if n is not None and n < UNTIL_END:
        return f"-n/--n-predict {n}: must be >= 0, or -1 (-2) for until the end of text or a full context"
    if args.ctx is not None and args.ctx < CTX_MIN:
        return f"-c/--ctx {args.ctx}: must be >= {CTX_MIN} (0: the model's trained context, as llama.cpp)"
    args.threads = auto_threads(args.threads)
    for field, (spellings, *_) in SAMPLING_FLAGS.items():
        if not hasattr(args, field):
            continue
        value = getattr(args, field)
        if field == "temperature" and value is not None and value < 0:   # llama.cpp's max(temp, 0): greedy
            args.temperature = value = 0.0
        if field == "top_k" and value is not None and value < 0:   # llama.cpp's: top-k <= 0 is off
            args.top_k = value = 0
        if field == "seed" and value == RANDOM_SEED:
            continue
        problem = setting_problem(field, value, spellings[0])
        if problem:
            return problem
    problem = _read_chat_template(args) or _read_template_kwargs(args)
    if problem:
        return problem
    if getattr(args, "draft_max", None) is not None or getattr(args, "lookup_ngram_min", None) is not None:
        from ..engine.errors import BitNetError
        from ..engine.runtime.speculative import lookup_from_flags

        try:   # the engine's own check (LookupParams.check) says it
            lookup_from_flags(args.draft_max, args.lookup_ngram_min)
        except BitNetError as e:
            return str(e)
    return _apply_prefill_attention(getattr(args, "prefill_attention", None))


def _read_chat_template(args: argparse.Namespace) -> str | None:
    """--chat-template / --chat-template-file: read and parsed now (one line naming the flag, or None); the text
    is left in args.chat_template_text for apply_chat_template once the model is loaded."""
    path, text = getattr(args, "chat_template_file", None), getattr(args, "chat_template", None)
    if path is None and text is None:
        return None
    if path is not None and text is not None:
        return "--chat-template and --chat-template-file: give one"
    flag = "--chat-template-file" if path is not None else "--chat-template"
    if path is not None:
        from ..engine.fileio import decode_text
        try:
            with open(path, "rb") as f:
                data = f.read((1 << 20) + 1)
        except OSError as e:
            return f"--chat-template-file {path}: {e.strerror or e}"
        if len(data) > 1 << 20:
            return f"--chat-template-file {path}: over 1 MiB: not a chat template"
        try:
            text = decode_text(data)   # a leading BOM dropped: it went into every rendered prompt
        except ValueError as e:
            return f"--chat-template-file {path}: {e}"
    from ..engine.runtime import chat_template as ct
    jinja = "{{" in text or "{%" in text
    if path is not None and not jinja:   # a file is a Jinja2 template, never a name (as llama.cpp reads it)
        if not text.strip():
            return f"--chat-template-file {path}: {'empty' if not text else 'only whitespace'}: no chat template"
        named = f" (for the named template give --chat-template {text.strip()})" if text.strip() in ct.NAMED else ""
        return (f"--chat-template-file {path}: no Jinja2 in it ({{{{ ... }}}} or {{% ... %}}): a chat template "
                f"renders the messages{named}")
    try:   # a name, or Jinja2 (the engine's check): "--chat-template 'chatlm': not a template name (...) nor ..."
        template = text if path is not None else ct.named_or_jinja(text)
    except ct.TemplateError as e:
        return f"{flag} {e.args[0]}"
    try:
        ct.check(template)
    except ct.TemplateError as e:
        return f"{flag}{' ' + path if path else ''}: {e.args[0]}"
    args.chat_template_text, args.chat_template_flag = text, f"{flag} {path}" if path else flag
    return None


# llama.cpp's readings of a switch's value (common/arg.cpp is_truthy / is_falsey / is_autoy)
_ON, _OFF, _AUTO = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0"), ("auto", "-1")


def _read_template_kwargs(args: argparse.Namespace) -> str | None:
    """--chat-template-kwargs, -rea/--reasoning and --reasoning-effort as one dict of template variables in
    args.template_kwargs (None: none given), for apply_chat_template; one line naming the flag, or None. As in
    llama.cpp, --reasoning on / off is the variable enable_thinking, and --reasoning-effort LEVEL reasoning_effort."""
    import json
    text, reasoning = getattr(args, "chat_template_kwargs", None), getattr(args, "reasoning", None)
    effort = getattr(args, "reasoning_effort", None)
    kwargs = None
    if text is not None:
        try:
            kwargs = json.loads(text)
        except ValueError as e:
            return f"--chat-template-kwargs: not JSON ({e})"
        if not isinstance(kwargs, dict):
            return f"--chat-template-kwargs: a JSON object of template variables, not {type(kwargs).__name__}"
    if reasoning is not None:
        if reasoning.lower() not in _ON + _OFF + _AUTO:
            return f"-rea/--reasoning {reasoning!r}: on, off or auto"
        if reasoning.lower() not in _AUTO:
            kwargs = {**(kwargs or {}), "enable_thinking": reasoning.lower() in _ON}
    if effort is not None and not effort.strip():   # an unset shell variable: the template would get ""
        return "--reasoning-effort '': give a level (low, medium, high) or 'default'"
    if effort is not None and effort != "default":
        kwargs = {**(kwargs or {}), "reasoning_effort": effort}
    args.template_kwargs = kwargs
    return None


def apply_chat_template(model, args: argparse.Namespace) -> None:
    """The template of --chat-template / --chat-template-file and the variables of --chat-template-kwargs /
    -rea / --reasoning-effort (checked by check_engine_args) on a loaded LLM or Engine; one that does not render is
    a BitNetError naming the flag."""
    from ..engine.errors import BitNetError
    text = getattr(args, "chat_template_text", None)
    if text is not None:
        try:
            model.set_chat_template(text, source=getattr(args, "chat_template_flag", "--chat-template"))
        except BitNetError as e:
            raise BitNetError(f"{getattr(args, 'chat_template_flag', '--chat-template')}: {e.args[0]}") from None
    kwargs = getattr(args, "template_kwargs", None)
    if kwargs:
        try:
            model.set_template_kwargs(kwargs)
        except BitNetError as e:
            flag = "--chat-template-kwargs" if getattr(args, "chat_template_kwargs", None) else "-rea/--reasoning"
            raise BitNetError(f"{flag}: {e.args[0].removeprefix('chat_template_kwargs: ')}") from None


def thinking_warnings(model, args: argparse.Namespace) -> list[str]:
    """-rea on and --reasoning-budget N ask for a <think> block; on a chat template that writes none they change
    nothing: a warning each, never silence (bitchat's /set think refuses the same). A warning, not an error: one
    command line often serves several models; -rea off and auto ask for nothing."""
    if getattr(model, "thinks", True):
        return []
    out, why = [], f"{model.name}'s chat template does not think; it changes nothing"
    reasoning = getattr(args, "reasoning", None)
    if reasoning is not None and reasoning.lower() in _ON:
        out.append(f"-rea/--reasoning {reasoning}: {why}")
    budget = getattr(args, "reasoning_budget", _D.reasoning_budget)
    if budget is not None and budget != _D.reasoning_budget:
        out.append(f"--reasoning-budget {budget}: {why}")
    return out


def _apply_prefill_attention(precision: str | None) -> str | None:
    """Sets the prefill attention's precision (None: leave BITNET_ATTENTION's or the default); bf16 only where
    its vector bodies run (the scalar ones are for tests: slower than f32), else one line saying why.
    BITNET_ATTENTION=bf16 without those bodies (it picks the scalar ones, for tests) gets one warning line: prompt
    processing is then many times slower (12,039 -> 321 tok/s measured on the bundled model)."""
    import os
    import sys

    if precision is None:
        from .. import simd
        if simd.attention_precision() == "bf16" and not simd.attention_bf16_vector():
            print("bitnet: warning: BITNET_ATTENTION=bf16 on a CPU or kernel path without AVX512_BF16 bodies runs "
                  "the scalar ones (for tests): prompts are processed many times slower than f32; unset it",
                  file=sys.stderr, flush=True)
        return None

    from .. import simd

    if precision == "bf16" and not simd.attention_bf16_vector():
        why = ("this CPU has no AVX512_BF16" if not simd.features().get("avx512bf16")
               else f"the {simd.active()} kernel path runs no bf16 bodies (BITNET_ISA)")
        return f"--prefill-attention bf16: {why}; leave it at f32"
    simd.set_attention_precision(precision)
    os.environ["BITNET_ATTENTION"] = precision   # processes this one starts (bitnet serve --ray's replicas)
    return None


def sampling_params_from_args(args: argparse.Namespace, seed: int | None = None) -> SamplingParams:
    """SamplingParams of the parsed sampling flags; `seed` (if given) replaces --seed."""
    values = {field: getattr(args, field) for field in SAMPLING_FLAGS}
    breakers = getattr(args, "dry_sequence_breakers", None)
    if breakers is not None:   # llama.cpp's --dry-sequence-breaker: replaces the defaults; "none": no breakers
        values["dry_sequence_breakers"] = tuple(escaped(args, b, "--dry-sequence-breaker")
                                                for b in breakers if b != "none")
    if seed is not None:
        values["seed"] = seed
    elif values["seed"] == RANDOM_SEED:
        values["seed"] = None
    return SamplingParams(**values).check({f: spellings[0] for f, (spellings, *_) in SAMPLING_FLAGS.items()})


_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\"}


def process_escapes(text: str) -> str:
    """llama.cpp's string_process_escapes: \\n \\r \\t \\' \\" \\\\ and \\xHH; any other backslash stays as typed.
    As there, \\xHH is a byte: a run of them is decoded as UTF-8 (\\xc3\\xa9 is é); ValueError (one line) when
    the run is not UTF-8."""
    out, raw, i, n = [], bytearray(), 0, len(text)

    def bytes_done():
        if raw:
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                typed = "".join(f"\\x{b:02x}" for b in raw)
                raise ValueError(f"{typed} is not UTF-8: \\xHH escapes are bytes, as in llama.cpp (é is \\xc3\\xa9; "
                                 "--no-escape takes the text as typed)") from None
            raw.clear()

    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            e = text[i + 1]
            hh = text[i + 2:i + 4]
            if e == "x" and len(hh) == 2 and all(h in "0123456789abcdefABCDEF" for h in hh):
                raw.append(int(hh, 16))
                i += 4
                continue
            bytes_done()
            if e in _ESCAPES:
                out.append(_ESCAPES[e])
                i += 2
                continue
        bytes_done()
        out.append(c)
        i += 1
    bytes_done()
    return "".join(out)


def escaped(args: argparse.Namespace, text: str, flag: str = "") -> str:
    """`text` with its escapes processed unless --no-escape was given (llama.cpp's -e, on by default); \\xHH bytes
    that are not UTF-8 are a BitNetError naming `flag`."""
    if not getattr(args, "escape", True):
        return text
    try:
        return process_escapes(text)
    except ValueError as e:
        from ..engine.errors import BitNetError
        raise BitNetError(f"{flag + ': ' if flag else ''}{e}") from None


# ---- parsing: exact flags only ---------------------------------------------------------------------------
NEGATIVE_VALUE = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$|^-((\d+\.?\d*|\.\d+)(ns|us|µs|ms|s|m|h))+$")


# options whose values name files or models (paths, cache names, repositories): kept as the OS gave them, the bytes
# that open the file; every other option's value is text (Parser.parse_known_args)
PATH_DESTS = frozenset({"model", "file", "api_key_file", "chat_template_file", "grammar_file", "json_schema_file",
                        "kld_base", "models_dir", "out", "src", "names", "ref"})


def typed_text(value: str, action: argparse.Action) -> str:
    """A flag's value as the text typed: where Python decodes argv in a locale that is not UTF-8 (LANG=C with
    PYTHONUTF8=0), typed UTF-8 arrives as lone surrogates (surrogateescape), which went on into a server's every
    answer (500s), a stop string that never matched, a system prompt that refused every message; they are the
    UTF-8 they spell. ValueError (one line naming the flag) for bytes that are no UTF-8."""
    if not any("\udc80" <= ch <= "\udcff" for ch in value):
        return value
    from ..engine.formats.tokenizer import decode_utf8
    return decode_utf8(value, "/".join(action.option_strings) or action.metavar or action.dest)


class Parser(argparse.ArgumentParser):
    """argparse without its guesses: a flag is matched only as spelled (no `--metrics` -> --metrics-public, `--keep`
    -> --keep-alive-timeout prefixes), and a single-dash flag takes no value glued to it (`-s 42`, llama.cpp's seed,
    was read as `-sys 42`, a system prompt; `-ngl 99` as `-n gl`). The user's llama.cpp habits then meet a clear
    refusal (LLAMA_ONLY) instead of another flag's meaning."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        # a value, not a flag: a negative number as argparse takes one (-1, -.5), in exponent form (-1e3), or a
        # negative Go duration (`--models-keep-alive -5m`, ollama's "for ever"), which argparse refused as
        # "expected one argument" (only `=-5m` got through)
        self._negative_number_matcher = NEGATIVE_VALUE

    def _get_option_tuples(self, option_string):
        return []

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, then every text value made the text it was typed as (typed_text); a value that is no UTF-8
        is one line naming its flag, exit 2. Each subcommand's parser (a Parser too) does its own values."""
        ns, extras = super().parse_known_args(args, namespace)
        for a in self._actions:
            if a.dest in PATH_DESTS or not hasattr(ns, a.dest):
                continue
            value = getattr(ns, a.dest)
            try:
                if isinstance(value, str):
                    setattr(ns, a.dest, typed_text(value, a))
                elif isinstance(value, list) and any(isinstance(v, str) for v in value):
                    setattr(ns, a.dest, [typed_text(v, a) if isinstance(v, str) else v for v in value])
            except ValueError as e:
                self.exit(2, f"{self.prog}: error: {e}\n")
        return ns, extras

    def _print_message(self, message, file=None):
        """argparse drops an OSError writing --help / --version: to a full disk that was exit 0 and nothing said.
        It goes on to the command's handler ("write error: ...", exit 2), as any other write to stdout does."""
        if message:
            (file or sys.stderr).write(message)


TLS_REFUSED = "TLS is not supported here: put a TLS-terminating proxy (nginx, Caddy) in front"

# llama.cpp flags this engine has no use for, and why (one line instead of "unrecognized arguments")
LLAMA_ONLY = {
    ("-ngl", "--gpu-layers", "--n-gpu-layers"): "GPU offload does not apply: this engine runs on the CPU",
    ("-fa", "--flash-attn"): "attention is always fused here (no flag needed)",
    ("-ctk", "--cache-type-k", "-ctv", "--cache-type-v"): "the KV cache's type is --kv (f16, f32, q8: K and V together)",
    ("-tb", "--threads-batch"): "one thread count serves prompts and generation here: -t/--threads",
    ("-hf", "--hf-repo", "-hfr"): "download a model with `bitnet pull REPO`, then -m REPO",
    ("--mlock",): "the weights are read into memory (huge pages) or memory-mapped (--mmap); locking them is not "
                  "supported",
    ("-sm", "--split-mode", "-ts", "--tensor-split", "-mg", "--main-gpu", "-dev", "--device"):
        "there are no GPUs to split across: this engine runs on the CPU",
    ("--numa",): "NUMA placement is left to the operating system",
    ("--rope-scaling", "--rope-scale", "--rope-freq-base", "--rope-freq-scale", "--yarn-orig-ctx"):
        "RoPE scaling is not supported: -c above the trained context warns instead",
    ("-i", "--interactive", "-if", "--interactive-first"): ("chat interactively with `bitchat` (or `bitnet run -cnv`)",
                                                           ("bitnet run",)),
    ("--lora", "--lora-scaled", "--control-vector"): "adapters are not supported",
    ("--keep", "--context-shift"): SHIFT_REFUSED,
    ("--no-cache-prompt",): NO_CACHE_REFUSED,
    ("-n", "--n-predict"): ("bitnet serve has no server-wide answer length: each request's max_tokens (n_predict, "
                            "num_predict) sets it", ("bitnet serve",)),
    ("-b", "--batch-size", "-ub", "--ubatch-size"): ("the prompt is processed in the engine's own batches here: "
                                                     "there is no batch size to set", ("bitnet run", "bitchat")),
    ("-ub", "--ubatch-size"): ("one step's size is -b/--batch-size here", ("bitnet serve",)),
    ("--special",): ("special tokens are never printed here (--json gives each piece's token id)",
                     ("bitnet run", "bitchat")),
    ("--verbose-prompt",): "the prompt's tokens are not listed here (`bitnet run -v` prints their count)",
    ("-md", "--model-draft", "-ngld", "--gpu-layers-draft"): "speculation uses prompt lookup here (--draft-max K), not "
                                                            "a draft model",
    ("--reasoning-format",): ("bitchat shows a thought apart, between [Start thinking] and [End thinking], and "
                              "bitnet run prints the text as generated; it is bitnet serve's (reasoning_content). "
                              "-rea off turns thinking off", ("bitnet run", "bitchat")),
    # llama-server's, refused by bitnet serve (its flags that ask for what it always does are accepted flags)
    ("--ssl-key-file", "--ssl-cert-file"): (TLS_REFUSED, ("bitnet serve",)),
    ("-to", "--timeout"): ("a request's time limit is --request-timeout here (a slow client's: --header-timeout, "
                           "--body-timeout, --send-timeout)", ("bitnet serve",)),
    ("-nocb", "--no-cont-batching"): ("batching is always continuous here", ("bitnet serve",)),
    ("--threads-http",): ("HTTP is served by one event loop here: there are no HTTP threads to count",
                          ("bitnet serve",)),
    ("--no-slots",): ("/slots is always served here (with the API key); it shows no prompts", ("bitnet serve",)),
    ("--props",): ("/props is read-only here (GET): the server's settings are its flags, changed by a restart",
                   ("bitnet serve",)),
    ("--path",): ("the chat page is built in; there are no static files to serve", ("bitnet serve",)),
    ("--slot-save-path",): ("slot save / restore is not supported: the prefix cache keeps recent prompts' KV by "
                            "itself", ("bitnet serve",)),
    ("--log-disable", "--log-format"): ("the server's log is uvicorn's: --log-level sets how much (critical: "
                                        "the least)", ("bitnet serve",)),
    ("--reranking", "--rerank"): ("reranking (/rerank) is not supported", ("bitnet serve",)),
    ("--cache-reuse",): ("the prefix cache reuses a prompt's cached start by itself here: there is nothing to set",
                         ("bitnet serve",)),
    ("--grammar", "--grammar-file", "-j", "--json-schema", "--json-schema-file"):
        ("a server-wide grammar or schema is not supported: give it in each request (grammar, json_schema, "
         "response_format)", ("bitnet serve",)),
}


def llama_only(word: str, prog: str) -> str | None:
    """The reason `prog` does not take llama.cpp's flag `word`, or None (a value is (reason, the commands it is
    about); a bare reason is about every command)."""
    flag = word.split("=", 1)[0]
    for flags, why in LLAMA_ONLY.items():
        why, progs = why if isinstance(why, tuple) else (why, None)
        if flag in flags and (progs is None or prog in progs):
            return f"{flag}: {why}"
    return None


# llama-server's environment variables (its Docker images are set up with them) -> this server's flags; a flag
# on the command line wins, as there. Set ones that have no meaning here are named in a warning, never dropped
# without a word (LLAMA_API_KEY ignored would leave a server open that its operator believes closed).
LLAMA_ENV = {"LLAMA_ARG_MODEL": "-m", "LLAMA_ARG_CTX_SIZE": "-c", "LLAMA_ARG_THREADS": "-t",
             "LLAMA_ARG_N_PARALLEL": "--parallel", "LLAMA_ARG_HOST": "--host", "LLAMA_ARG_PORT": "--port",
             "LLAMA_API_KEY": "--api-key", "LLAMA_ARG_API_KEY_FILE": "--api-key-file", "LLAMA_ARG_ALIAS": "--alias",
             "LLAMA_ARG_BATCH": "--batch-size", "LLAMA_ARG_CHAT_TEMPLATE": "--chat-template",
             "LLAMA_ARG_CHAT_TEMPLATE_FILE": "--chat-template-file",
             "LLAMA_ARG_CHAT_TEMPLATE_KWARGS": "--chat-template-kwargs", "LLAMA_ARG_REASONING": "--reasoning",
             "LLAMA_ARG_REASONING_EFFORT": "--reasoning-effort",
             "LLAMA_ARG_THINK": "--reasoning-format", "LLAMA_ARG_THINK_BUDGET": "--reasoning-budget",
             "LLAMA_ARG_THINK_BUDGET_MESSAGE": "--reasoning-budget-message", "LLAMA_ARG_TEMPERATURE": "--temp",
             "LLAMA_ARG_TOP_K": "--top-k", "LLAMA_ARG_TOP_P": "--top-p", "LLAMA_ARG_MIN_P": "--min-p",
             "LLAMA_ARG_REPEAT_PENALTY": "--repeat-penalty", "LLAMA_ARG_PRESENCE_PENALTY": "--presence-penalty",
             "LLAMA_ARG_FREQUENCY_PENALTY": "--frequency-penalty", "LLAMA_ARG_DRAFT_MAX": "--draft-max",
             "LLAMA_ARG_POOLING": "--pooling", "LLAMA_ARG_MODELS_DIR": "--models-dir",
             "LLAMA_ARG_MODELS_MAX": "--models-max"}
# switches: on with llama.cpp's true / 1 / on / enabled
LLAMA_ENV_SWITCHES = {"LLAMA_ARG_JINJA": "--jinja", "LLAMA_ARG_CONT_BATCHING": "-cb",
                      "LLAMA_ARG_ENDPOINT_METRICS": "--metrics", "LLAMA_ARG_NO_MMAP": "--no-mmap"}
_TRUE, _FALSE = _ON + ("yes",), _OFF + ("no", "")   # llama.cpp's readings, and the shell's yes / no / unset
# refused, whatever their value: ignored, they would serve plain HTTP to clients whose operator set up TLS
LLAMA_ENV_REFUSED = {"LLAMA_ARG_SSL_KEY_FILE": TLS_REFUSED, "LLAMA_ARG_SSL_CERT_FILE": TLS_REFUSED}
# a variable's flag -> the flags it cannot go with: typed on the command line, they win over the variable too
_ROUTER = ("--models-dir", "--models-cache")
LLAMA_ENV_EXCLUDED_BY = {"--chat-template": ("--chat-template-file",), "--chat-template-file": ("--chat-template",),
                         "-m": _ROUTER, "--alias": _ROUTER, "--models-dir": ("-m", "--alias")}
LLAMA_ENV_ROUTER_ONLY = ("--models-max",)   # without a router: a warning, as a variable with no meaning here
# llama.cpp's switches of what is always so here: variable -> (the value that is so, its flags: on, off; why the
# other value cannot be). As in llama.cpp, LLAMA_ARG_NO_<NAME> set is <NAME> off, before LLAMA_ARG_<NAME>; a typed
# flag of either side wins. The flags and the variables get one answer: accepted, or the same line and exit 2
LLAMA_ENV_ALWAYS = {"LLAMA_ARG_CONTEXT_SHIFT": (False, ("--context-shift", "--no-context-shift"), SHIFT_REFUSED),
                    "LLAMA_ARG_CACHE_PROMPT": (True, ("--cache-prompt", "--no-cache-prompt"), NO_CACHE_REFUSED)}


def _always_switch(name: str, environ) -> tuple[bool | None, str] | None:
    """What llama.cpp reads from LLAMA_ENV_ALWAYS's variable `name` (or its LLAMA_ARG_NO_ twin) in `environ`:
    (on / off, or None for a value that is no switch value; the variable and value to name), or None: unset (an
    empty value is unset, the shell's way, as for the other switches)."""
    no = name.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1)
    if environ.get(no, ""):
        return False, f"{no}={environ[no]!r}"
    value = environ.get(name, "")
    if not value:
        return None
    v = value.strip().lower()
    return (True if v in _TRUE else False if v in _FALSE else None), f"{name}={value!r}"


def _value_problem(action, value: str) -> str | None:
    """What argparse would say of `value` for `action` (its type, its choices), or None."""
    v = value
    if callable(action.type):
        try:
            v = action.type(value)
        except argparse.ArgumentTypeError as e:
            return str(e)
        except (TypeError, ValueError):
            return f"invalid {getattr(action.type, '__name__', repr(action.type))} value"
    if action.choices is not None and v not in action.choices:
        return f"invalid choice (choose from {', '.join(map(repr, action.choices))})"
    return None


def llama_env_argv(parser, argv: list[str], environ) -> tuple[list[str], list[str], dict]:
    """(the flags llama-server's variables in `environ` give, where argv gives neither that flag nor one it cannot go
    with; one warning each for a set LLAMA_ARG_* this server does not take; {"NAME='value'": its flag's spellings} of
    the variables applied, for from_variable). A value the flag does not take exits 2 with one line naming the variable:
    argparse's usage and "argument --temp/--temperature" named a flag nobody typed; so does a TLS variable."""
    def action_of(flag: str):
        return next(a for a in parser._actions if flag in a.option_strings)

    def given(flag: str) -> bool:
        action = action_of(flag)
        return any(w in action.option_strings or w.split("=", 1)[0] in action.option_strings for w in argv)

    def given_word(flag: str) -> bool:   # a flag typed as such (--context-shift is no option of this parser)
        return any(w.split("=", 1)[0] == flag for w in argv)

    def typed_wins(flag: str) -> bool:
        return given(flag) or any(given(other) for other in LLAMA_ENV_EXCLUDED_BY.get(flag, ()))
    router = any(given(f) for f in _ROUTER) or ("LLAMA_ARG_MODELS_DIR" in environ and not typed_wins("--models-dir"))
    out, notes, applied = [], [], {}
    for name, (always, flags, why) in LLAMA_ENV_ALWAYS.items():
        asked = _always_switch(name, environ)
        if asked is None or any(given_word(f) for f in flags):
            continue
        on, said = asked
        if on is None:
            notes.append(f"{said}: not a switch value (true / false); left out")
        elif on != always:
            parser.exit(2, f"{parser.prog}: error: {said} ({flags[0] if on else flags[1]}): {why}\n")
    for name, value in sorted(environ.items()):
        if name in LLAMA_ENV_ALWAYS or name.replace("LLAMA_ARG_NO_", "LLAMA_ARG_", 1) in LLAMA_ENV_ALWAYS:
            continue   # read above
        if name in LLAMA_ENV_REFUSED:
            parser.exit(2, f"{parser.prog}: error: {name}: {LLAMA_ENV_REFUSED[name]}\n")
        if name in LLAMA_ENV:
            flag = LLAMA_ENV[name]
            if typed_wins(flag):
                continue
            if flag in LLAMA_ENV_ROUTER_ONLY and not router:
                notes.append(f"{name} applies to --models-dir / --models-cache only (llama-server's router); "
                             "it is not used")
                continue
            why = _value_problem(action_of(flag), value)
            if why is not None:
                parser.exit(2, f"{parser.prog}: error: {name}={value!r}: argument {flag}: {why}\n")
            out.append(f"{flag}={value}")
            applied[f"{name}={value!r}"] = tuple(action_of(flag).option_strings)
        elif name in LLAMA_ENV_SWITCHES:
            v = value.strip().lower()
            if v not in _TRUE + _FALSE:
                notes.append(f"{name}={value!r}: not a switch value (true / false); left out")
            elif v in _TRUE and not given(LLAMA_ENV_SWITCHES[name]):
                out.append(LLAMA_ENV_SWITCHES[name])
            elif name == "LLAMA_ARG_JINJA" and v and v in _FALSE and not given("--jinja"):   # llama.cpp's --no-jinja
                notes.append(f"{name}={value!r}: {NO_JINJA}")
        elif name.startswith("LLAMA_ARG_"):
            notes.append(f"{name} is llama-server's and has no meaning here; it is not used")
    return out, notes, applied


def from_variable(error, applied: dict[str, tuple[str, ...]] | None):
    """`error` (a BitNetError "FLAG VALUE: why", FLAG spelled as -c/--ctx too) as "NAME='VALUE': FLAG why" when the
    flag's value came from a variable (llama_env_argv's `applied`): the user set the variable and never typed the
    flag. Any other error is returned as it is."""
    from ..engine.errors import BitNetError
    head, sep, why = str(error.args[0]).partition(": ") if error.args else ("", "", "")
    spelled = head.split(" ", 1)[0]
    for variable, spellings in (applied or {}).items():
        if sep and set(spelled.split("/")) & set(spellings):
            joint = " " if why.startswith("must") else ": "   # "--port must be in ...", "--host: unix sockets ..."
            return BitNetError(f"{variable}: {spelled}{joint}{why}", hint=getattr(error, "hint", None))
    return error


# ---- unknown flags: the subcommand's usage and a suggestion -------------------------------------------------
def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings]


def suggestion(parser: argparse.ArgumentParser, word: str) -> str | None:
    """The option of `parser` closest to `word` (`--ctx-szie` -> `--ctx-size`), or None."""
    flag = word.split("=", 1)[0]
    if not flag.startswith("-"):
        return None
    close = difflib.get_close_matches(flag, _option_strings(parser), n=1, cutoff=0.75)
    return close[0] if close else None


def reject_unknown(parser: argparse.ArgumentParser, extras: list[str]) -> None:
    """parser.error() (usage + one line, exit 2) naming the unrecognized arguments and a close flag; a llama.cpp
    flag this engine has no use for is one line saying why (no usage: the flag is known, only not needed)."""
    for word in extras:
        why = llama_only(word, parser.prog)
        if why:
            parser.exit(2, f"{parser.prog}: error: {why}\n")
    msg = f"unrecognized arguments: {' '.join(extras)}"
    for word in extras:
        close = suggestion(parser, word)
        if close:
            msg += f" (did you mean {close}?)"
            break
    parser.error(msg)


def parse_args_suggesting(parser: argparse.ArgumentParser, argv: list[str] | None,
                          subparsers: dict[str, argparse.ArgumentParser] | None = None,
                          command_dest: str = "command") -> argparse.Namespace:
    """parse_args, except that unknown arguments are reported by the subcommand they were given to."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        sub = (subparsers or {}).get(getattr(args, command_dest, None) or "")
        reject_unknown(sub or parser, extras)
    return args


def given_options(argv: list[str]) -> frozenset:
    """The long options typed in argv (their --NAME=value forms too), up to a bare `--`."""
    out = set()
    for w in argv:
        if w == "--":
            break
        if w.startswith("--"):
            out.add(w.split("=", 1)[0])
    return frozenset(out)


def given(args, flag: str, default) -> bool:
    """Whether `flag` (a long option, no abbreviations here) was given: typed, even at its default value (a user
    who asks for `--drain-timeout 5` where it cannot apply is told so), or, for a Namespace not parsed by
    bitnet's main, set off its default."""
    flags = getattr(args, "given_flags", None)
    if flags is not None:
        return flag in flags
    return getattr(args, flag[2:].replace("-", "_")) != default


def maybe_autocomplete(parser: argparse.ArgumentParser) -> None:
    """Shell completion through argcomplete, only when a shell asks for it (no import cost otherwise).
    Enable with: eval "$(register-python-argcomplete bitnet)" (and the same for bitchat)."""
    import os

    if "_ARGCOMPLETE" not in os.environ:
        return
    try:
        import argcomplete
    except ImportError:  # pragma: no cover - argcomplete is a dependency
        sys.exit(1)
    argcomplete.autocomplete(parser)


def read_text_file(path: str, flag: str = "-f/--file") -> str:
    """The UTF-8 text of `path` ('-': stdin), or BitNetError in one line (a missing file, invalid UTF-8, UTF-16).
    A leading UTF-8 BOM is dropped: it marks the encoding, it is never a prompt's text."""
    import sys

    from ..engine.errors import BitNetError
    from ..engine.formats.tokenizer import decode_utf8
    try:
        if path == "-":
            return decode_utf8(sys.stdin.buffer.read(), "stdin", start=True)
        with open(path, "rb") as f:
            return decode_utf8(f.read(), f"{flag} {path}", start=True)
    except OSError as e:
        raise BitNetError(f"{flag} {path}: {e.strerror}") from None
    except ValueError as e:
        raise BitNetError(str(e)) from None
