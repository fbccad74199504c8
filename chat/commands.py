"""Slash commands: the table (name, argument, help), parsing with validation, and the sampling settings.

Every mistake becomes a CommandError whose message is one line saying what is wrong and what to
type instead; the REPL prints it and the session goes on. Pure logic: unit-tested directly.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, fields

from ..engine.runtime.sampling import SamplingParams, setting_problem

# name -> (argument synopsis, one-line help). Order is the order /help shows.
COMMANDS: dict[str, tuple[str, str]] = {
    "/help": ("", "show this help (/? too)"),
    "/reset": ("", "forget the conversation, the system prompt stays (/clear does the same)"),
    "/system": ("[TEXT|--clear]", "show, set or clear the system prompt"),
    "/set": ("[NAME VALUE]", "show settings, or set temp|top_k|top_p|min_p|repeat_penalty|repeat_last_n|seed|"
                             "max_tokens|dry_multiplier|dry_base|dry_allowed_length|dry_penalty_last_n|"
                             "dry_sequence_breakers|typical_p|top_n_sigma|xtc_probability|xtc_threshold|"
                             "dynatemp_range|dynatemp_exponent|mirostat|mirostat_tau|mirostat_eta|min_keep|"
                             "reasoning_budget|reasoning_budget_message; also ollama's "
                             "/set parameter NAME VALUE, /set system TEXT and "
                             "/set format json|FILE|off (answers as JSON / matching a JSON Schema file; "
                             "/set noformat: off), "
                             "/set think and /set nothink (a thinking model's <think> block on / off)"),
    "/show": ("[info|system|parameters]", "model information (source file, shape, context) and current settings"),
    "/save": ("FILE", "save the conversation and its settings as JSON (atomic write); /save! FILE replaces another "
                      "conversation"),
    "/load": ("FILE", "load a conversation saved with /save, restore its settings and prefill it"),
    "/retry": ("", "regenerate the last answer"),
    "/stats": ("", "timings of the last answer and of the session"),
    "/bye": ("", "exit (/exit and /quit too; Ctrl-D also exits)"),
}
THINK_WORDS = ("think", "nothink")   # /set think | nothink: ollama's switch of a thinking model's thought
THINK_LEVELS = ("high", "medium", "low")   # ollama's /set think LEVEL (gpt-oss's reasoning effort)
# ollama's other one-word /set commands: (what bitchat does already: said, not an error; the line)
OLLAMA_SET_WORDS = {
    "verbose": (True, "[the stats line is always shown here, after each answer; /stats repeats it]"),
    "quiet": (False, "/set quiet: not here: the stats line is always shown (on stderr when stdout is not a terminal)"),
    "wordwrap": (True, "[answers always wrap at the terminal's width here]"),
    "nowordwrap": (False, "/set nowordwrap: not here: answers on a terminal always wrap at its width (output "
                          "piped to a file or program is never wrapped)"),
    "history": (True, "[the input history is kept here unless bitchat was started with BITCHAT_HISTORY= (empty)]"),
    "nohistory": (False, "/set nohistory: not here: start bitchat with BITCHAT_HISTORY= (empty) to keep no input "
                         "history"),
}
ALIASES = {"/exit": "/bye", "/quit": "/bye", "/?": "/help", "/clear": "/reset"}
SHOW_TOPICS = ("info", "system", "parameters")


class CommandError(Exception):
    """One-line hint for a command the user mistyped."""


class CommandInterrupted(CommandError):
    """Ctrl-C stopped a command (/save, /load), nothing changed: the REPL goes on; a piped run ends (130)."""


_DEFAULT = SamplingParams()   # the one source of the sampling defaults and checks (engine/runtime/sampling.py)
UNTIL_END = -1   # max_tokens -1 (-n -1, num_predict -1): until the end of text or a full context, shown and saved so


def shown_max_tokens(n: int) -> str:
    return "-1 (until the end)" if n == UNTIL_END else str(n)


@dataclass
class Settings:
    """Sampling settings of the session (flag names as `bitnet run`; /set names in snake_case)."""
    temp: float = _DEFAULT.temperature
    top_k: int = _DEFAULT.top_k
    top_p: float = _DEFAULT.top_p
    min_p: float = _DEFAULT.min_p
    repeat_penalty: float = _DEFAULT.repeat_penalty
    seed: int | None = _DEFAULT.seed
    max_tokens: int = 512
    repeat_last_n: int = _DEFAULT.repeat_last_n
    presence_penalty: float = _DEFAULT.presence_penalty
    frequency_penalty: float = _DEFAULT.frequency_penalty
    dry_multiplier: float = _DEFAULT.dry_multiplier
    dry_base: float = _DEFAULT.dry_base
    dry_allowed_length: int = _DEFAULT.dry_allowed_length
    dry_penalty_last_n: int = _DEFAULT.dry_penalty_last_n
    dry_sequence_breakers: tuple[str, ...] = _DEFAULT.dry_sequence_breakers
    top_n_sigma: float = _DEFAULT.top_n_sigma
    typical_p: float = _DEFAULT.typical_p
    xtc_probability: float = _DEFAULT.xtc_probability
    xtc_threshold: float = _DEFAULT.xtc_threshold
    dynatemp_range: float = _DEFAULT.dynatemp_range
    dynatemp_exponent: float = _DEFAULT.dynatemp_exponent
    mirostat: int = _DEFAULT.mirostat
    mirostat_tau: float = _DEFAULT.mirostat_tau
    mirostat_eta: float = _DEFAULT.mirostat_eta
    min_keep: int = _DEFAULT.min_keep
    reasoning_budget: int = _DEFAULT.reasoning_budget
    reasoning_budget_message: str = _DEFAULT.reasoning_budget_message

    def describe(self) -> str:
        seed = "random" if self.seed is None else str(self.seed)
        text = (f"temp={self.temp:g} top_k={self.top_k} top_p={self.top_p:g} min_p={self.min_p:g} "
                f"repeat_penalty={self.repeat_penalty:g} seed={seed} max_tokens={shown_max_tokens(self.max_tokens)} "
                f"repeat_last_n={self.repeat_last_n} presence_penalty={self.presence_penalty:g} "
                f"frequency_penalty={self.frequency_penalty:g}")
        # llama.cpp's other samplers: shown once set (off, they would only lengthen the line)
        if self.dry_sequence_breakers != _DEFAULT.dry_sequence_breakers:
            text += f" dry_sequence_breakers={json.dumps(list(self.dry_sequence_breakers))}"
        for name in ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "top_n_sigma",
                     "typical_p", "xtc_probability", "xtc_threshold", "dynatemp_range", "dynatemp_exponent",
                     "mirostat", "mirostat_tau", "mirostat_eta", "min_keep", "reasoning_budget"):
            value = getattr(self, name)
            if value != getattr(_DEFAULT, name):   # an integer as typed (:g made 1234567 "1.23457e+06")
                text += f" {name}={value:g}" if isinstance(value, float) else f" {name}={value}"
        if self.reasoning_budget_message:
            text += f" reasoning_budget_message={json.dumps(self.reasoning_budget_message)}"
        return text

    def answer_limit(self, n_ctx: int) -> int:
        """The most tokens an answer may have: max_tokens, or the whole context for -1 (the engine stops there)."""
        return n_ctx if self.max_tokens == UNTIL_END else self.max_tokens

    def sampling_params(self, seed_offset: int = 0) -> SamplingParams:
        """The engine's SamplingParams; a fixed seed is advanced by `seed_offset` (so /retry differs)."""
        values = {field: getattr(self, name) for name, field in FIELD_OF_SETTING.items()}   # per-request fields keep defaults
        if self.seed is not None:
            values["seed"] = (self.seed + seed_offset) % (1 << 64)
        return SamplingParams(**values)


SETTING_NAMES = [f.name for f in fields(Settings)]
# /set name -> SamplingParams field (max_tokens is the session's own: not a sampling parameter)
FIELD_OF_SETTING = {n: ("temperature" if n == "temp" else n) for n in SETTING_NAMES if n != "max_tokens"}
# ollama's parameter names (num_predict, ...) and llama.cpp's flag spellings are accepted too
SETTING_ALIASES = {"temperature": "temp", "t": "temp", "n": "max_tokens", "max-tokens": "max_tokens",
                   "top-k": "top_k", "top-p": "top_p", "min-p": "min_p", "repeat-penalty": "repeat_penalty",
                   "n_predict": "max_tokens", "n-predict": "max_tokens", "num_predict": "max_tokens",
                   "repeat-last-n": "repeat_last_n", "presence-penalty": "presence_penalty",
                   "frequency-penalty": "frequency_penalty", "typical": "typical_p", "top-nsigma": "top_n_sigma",
                   "top-n-sigma": "top_n_sigma", "xtc-probability": "xtc_probability",
                   "xtc-threshold": "xtc_threshold", "dynatemp-range": "dynatemp_range",
                   "dynatemp-exp": "dynatemp_exponent", "dry-multiplier": "dry_multiplier", "dry-base": "dry_base",
                   "dry-allowed-length": "dry_allowed_length", "dry-penalty-last-n": "dry_penalty_last_n",
                   "mirostat-lr": "mirostat_eta", "mirostat-ent": "mirostat_tau", "min-keep": "min_keep",
                   "reasoning-budget": "reasoning_budget", "reasoning-budget-message": "reasoning_budget_message"}


# the context's size by its other names (ollama's /set parameter num_ctx, llama.cpp's -c / --ctx-size): fixed when
# bitchat starts, so /set answers that in one line, never "unknown setting" and the list of every name
CONTEXT_NAMES = ("num_ctx", "n_ctx", "ctx", "ctx_size", "ctx-size", "c", "context", "context_length")


def max_tokens_over_context(n: int, n_ctx: int) -> str:
    """The one line for a max_tokens over the context (bitchat -n, /set max_tokens): taken as the context's size."""
    return (f"max_tokens {n} is more than the {n_ctx}-token context window, where an answer ends anyway: "
            f"max_tokens = {n_ctx}")


def _number(name: str, text: str, kind):
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise CommandError(f"/set {name}: {text!r} is not {what}") from None
    if kind is float and not math.isfinite(value):
        raise CommandError(f"/set {name}: {text!r} must be finite")
    return value


def _breakers(text: str) -> tuple[str, ...]:
    """/set dry_sequence_breakers ["\\n", ":"] | TEXT | none"""
    if text.strip().lower() == "none":
        return ()
    if text.lstrip().startswith("["):
        try:
            v = json.loads(text)
        except (ValueError, RecursionError):
            v = None
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):   # [1, 2] was echoed as (1, 2)
            raise CommandError(f"/set dry_sequence_breakers: {text!r} is not a JSON list of strings")
        return tuple(v)
    return (text,)


def parse_setting(name: str, text: str, *, max_tokens_limit: int | None = None) -> tuple[str, object]:
    """Validate `/set NAME VALUE`; returns (canonical name, typed value) or raises CommandError."""
    key = name.lower()
    key = SETTING_ALIASES.get(key, key)
    if key in CONTEXT_NAMES:
        now = f" (now {max_tokens_limit})" if max_tokens_limit is not None else ""
        raise CommandError(f"/set {name}: the context window is fixed when bitchat starts: restart it with -c N{now}")
    if key not in SETTING_NAMES:
        raise CommandError(f"/set: unknown setting {name!r} (one of: {', '.join(SETTING_NAMES)})")
    if key == "max_tokens":
        v = _number(key, text, int)
        if v in (-1, -2):   # ollama's num_predict -1 / llama.cpp's -n -1 / -2: until the end or a full context
            return key, UNTIL_END   # kept as such (it was the context size: /save wrote that number)
        if v < 1:
            raise CommandError("/set max_tokens: must be >= 1, or -1 for until the end of text or a full context")
        if max_tokens_limit is not None and v > max_tokens_limit:   # an answer ends at the context's end anyway
            return key, max_tokens_limit   # (the session says so: max_tokens_over_context), as bitchat -n N
        return key, v
    field = FIELD_OF_SETTING[key]
    if key in ("dry_sequence_breakers", "reasoning_budget_message"):
        # a JSON list of strings, one string, or none; the text as typed
        v = _breakers(text) if key == "dry_sequence_breakers" else text
        bad = next((s for s in (v if isinstance(v, tuple) else (v,)) if re.search("[\ud800-\udfff]", s)), None)
        if bad is not None:   # JSON's unpaired "\ud800": no text; every later /save failed (an internal error)
            raise CommandError(f"/set {key}: {text!r} holds a lone UTF-16 surrogate, which is not text")
    elif key == "seed" and text.lower() in ("none", "random", "off", "-1"):
        v = None
    else:
        v = _number(key, text, type(getattr(_DEFAULT, field)) if field != "seed" else int)
    problem = setting_problem(field, v, f"/set {key}")
    if problem:
        raise CommandError(problem)
    return key, v


@dataclass(frozen=True)
class Command:
    name: str      # canonical, e.g. "/set"
    arg: str       # the rest of the line, stripped ("" if none)
    force: bool = False   # /save!: replace a conversation file this session did not write or load


NEEDS_ARG = {"/save", "/load"}
NO_ARG = {"/help", "/reset", "/retry", "/stats", "/bye"}


def is_command(line: str) -> bool:
    """A line is a command when it starts with '/' followed by a letter or '?' ('/ 2' is a message;
    a message that must start with a word after '/' is typed '//...')."""
    s = line.lstrip()
    return len(s) >= 2 and s[0] == "/" and (s[1].isalpha() or s[1] == "?")


def file_argument(text: str) -> str:
    """A file named in a command (/save, /load, /set format): a shell's habit, "my chat.json" in quotes names my
    chat.json, not a file with quotes in its name. The one rule for every file argument."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def parse_command(line: str) -> Command:
    """Parse a slash command line; raises CommandError with a one-line hint when it is not valid."""
    s = line.strip()
    head = s.split(None, 1)[0]   # ("/show\nparameters": /show, not a command named with a newline)
    rest = s[len(head):].strip()
    name = head.lower()
    name = ALIASES.get(name, name)
    force = name == "/save!"
    if force:
        name = "/save"
    lines = s.splitlines()
    if len(lines) > 1 and name != "/system" and not (name == "/set" and rest.split(None, 1)[0].lower() == "system"):
        # a paste whose first line is a command: its other lines were the argument (/save made a file whose name
        # held a newline, and the message was lost). Only a system prompt's text spans lines
        raise CommandError(f"{head}: a command is one line, and this input has {len(lines)}: nothing was done (to "
                           "send it as a message, start it with //)")
    if name not in COMMANDS:
        close = [c for c in COMMANDS if c.startswith(name[:3])] if len(name) > 1 else []
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise CommandError(f"unknown command {head}{hint}; type /help for the list")
    if name in NEEDS_ARG:
        rest = file_argument(rest)
    if name in NEEDS_ARG and not rest:
        raise CommandError(f"{name} needs a file name: {name} {COMMANDS[name][0]}")
    if name in NO_ARG and rest:
        raise CommandError(f"{head} takes no argument (got {rest!r})")   # as typed: /exit, not /bye
    if name == "/set" and rest:
        parts = rest.split()
        if parts[0].lower() == "system":            # ollama: /set system TEXT (the text may have spaces)
            if len(parts) < 2:
                raise CommandError("/set system needs the text, e.g. /set system You are brief.")
        elif parts[0].lower() == "parameter":       # ollama: /set parameter NAME VALUE
            if len(parts) == 2:
                raise CommandError("/set parameter needs NAME VALUE, e.g. /set parameter temperature 0.7")
        elif parts[0].lower() in THINK_WORDS:      # ollama: /set think, /set nothink
            if len(parts) == 2 and parts[0].lower() == "think" and parts[1].lower() in THINK_LEVELS:
                raise CommandError(f"/set think {parts[1].lower()}: no thinking levels here: /set think or /set "
                                   "nothink (start bitchat with --reasoning-effort LEVEL for a template that takes "
                                   "one)")
            if len(parts) > 1:
                raise CommandError(f"/set {parts[0].lower()} takes no value")
        elif parts[0].lower() in (*OLLAMA_SET_WORDS, "noformat"):   # ollama: /set verbose, ... (no value)
            if len(parts) > 1:
                raise CommandError(f"/set {parts[0].lower()} takes no value")
        elif len(parts) < 2:   # the value is the rest of the line (a breaker list may hold spaces)
            raise CommandError("/set needs NAME VALUE, e.g. /set temp 0.7 (or /set alone to show settings)")
    if name == "/show" and rest and rest.lower() not in SHOW_TOPICS:
        raise CommandError(f"/show: unknown topic {rest!r} (one of: {', '.join(SHOW_TOPICS)})")
    return Command(name, rest, force)


def split_set(arg: str) -> tuple[str, str] | None:
    """`/set` argument -> ("system", TEXT) | (NAME, VALUE); None for `/set parameter` alone (list them)."""
    parts = arg.split(None, 1)
    head = parts[0].lower()
    if head in THINK_WORDS or head in OLLAMA_SET_WORDS or head == "noformat":
        return head, ""
    if head == "system":
        return "system", strip_block(parts[1])
    if head == "parameter":
        rest = parts[1].split(None, 1) if len(parts) > 1 else []
        if len(rest) < 2:
            return None
        name, value = rest
    else:
        name, value = parts   # VALUE: the rest of the line
    return name, file_argument(value) if name.lower() == "format" else value.strip()


def help_text() -> str:
    width = max(len(n) + 1 + len(a) for n, (a, _) in COMMANDS.items())
    lines = [f"  {(n + ' ' + a).strip():<{width}}  {h}" for n, (a, h) in COMMANDS.items()]
    lines.append('  """ starts a multi-line message, a line ending in """ ends it (/set system """ a system')
    lines.append('  prompt); a """ inside a line is part of the text.')
    lines.append('  Esc-Enter inserts a newline.')
    lines.append("  A message that starts with / is written //. A command is one line (but a system")
    lines.append("  prompt's text): input of several lines that starts with one is refused, nothing done.")
    lines.append("  Ctrl-C stops an answer (what was shown is kept; a message stopped before its answer")
    lines.append("  began is dropped from the conversation) or clears the line; Ctrl-D exits.")
    return "\n".join(lines)


def completions(text_before_cursor: str) -> list[str]:
    """Candidates for tab completion of the text before the cursor (command names, /set names)."""
    if not text_before_cursor.startswith("/") or "\n" in text_before_cursor:
        return []
    if " " not in text_before_cursor:
        return [c for c in COMMANDS if c.startswith(text_before_cursor.lower())]
    head, _, rest = text_before_cursor.partition(" ")
    if head.lower() == "/set" and " " not in rest.lstrip():
        return [n for n in SETTING_NAMES + ["system", "parameter", "format", "noformat", *THINK_WORDS]
                if n.startswith(rest.lstrip().lower())]
    if head.lower() == "/show" and " " not in rest.lstrip():
        return [n for n in SHOW_TOPICS if n.startswith(rest.lstrip().lower())]
    return []


# ollama's multi-line system prompt: /set system """TEXT ... """ (and bitchat's own /system)
_SYSTEM_BLOCK = re.compile(r'\s*/(?:set\s+)?system\s+"""', re.IGNORECASE)


def open_block(text: str) -> bool:
    '''True when `text` opened a """ multi-line block that is not closed yet: a message, or a system prompt given as
    ollama does (/set system """You are\n...\n""": its first line was the prompt, the next ones messages).'''
    s = text.lstrip()
    head = _SYSTEM_BLOCK.match(text)
    if head:
        body = text[head.end():]
    elif s.startswith('"""'):
        body = s[3:]
    else:
        return False
    return not closes_block(body)


def closes_block(text: str) -> bool:
    '''Whether `text` (a block's lines after its opening """) ends the block: only a line that ends in """ does,
    as in ollama and in piped input. A """ inside a line is text: `"""Hello""" is what ...` opens a block whose
    message keeps every word (a close anywhere cut the message there and dropped the rest unsaid).'''
    return text.rstrip().endswith('"""')


def strip_block(text: str) -> str:
    '''The message inside a """ ... """ block (or the text itself when it is not a block): the opening """ and a
    closing one at the end are taken off, every other character is the message's.'''
    s = text.strip()
    if s.startswith('"""'):
        s = s[3:]
        if closes_block(s):
            s = s.rstrip()[:-3]
        return s.strip("\n").strip()
    return text.strip()
