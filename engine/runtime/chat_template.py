"""Chat templates: the model's own Jinja2 template rendered like transformers renders it (sandboxed,
trim_blocks + lstrip_blocks, loop controls, raise_exception / strftime_now helpers), with a built-in
fallback in the BitNet 2B-4T form:

    <|begin_of_text|>System: ...<|eot_id|>User: ...<|eot_id|>Assistant: 

The official 2B-4T GGUF embeds a broken "Human: / BITNETAssistant:" template; it is recognized and
replaced by the fallback, as is a missing template. Templates come from downloaded files, so they render
in engine/template_sandbox.py's LimitedSandbox: a deadline and size budget per render, one clear
TemplateError (exit 2) when a template loops or grows without bound.
"""
from __future__ import annotations

import datetime
import json
from functools import lru_cache

from ..config import BITNET_CHAT_TEMPLATE, LEGACY_BITNET_CHAT_TEMPLATE, is_broken_chat_template
from ..errors import BitNetError
from .template_sandbox import HINT as LOOP_HINT
from .template_sandbox import Limits, TemplateLimitError, _guard_filter, render_limited

LIMITS = Limits()   # per render: 2 s, 1 MiB (+4x the messages) per value and output, 200k loop iterations

ROLES = ("system", "user", "assistant")


# templates by name for --chat-template (llama.cpp's names for the same forms); anything else given there is Jinja
NAMED = {
    "bitnet": BITNET_CHAT_TEMPLATE,
    "chatml": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '')"
               " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
               "{% endif %}"),
    "llama3": ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
               "'<|end_header_id|>\n\n' + (message['content'] or '') | trim + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
}


def join_text_parts(texts) -> str:
    """A message's text parts (OpenAI's content parts, Responses' input_text, Anthropic's text blocks) as the one
    text the template renders: a newline between two, as llama-server joins them (common/chat.cpp: a "\n" before
    each part once the text so far is not empty) and vLLM; glued, "Hi" + "there" was "Hithere"."""
    texts = list(texts)
    first = next((i for i, t in enumerate(texts) if t), len(texts))   # the empty parts before any text add nothing
    return "\n".join(texts[first:])   # one pass: adding part by part was quadratic (30,000 parts took 20 s)


def named_or_jinja(text: str) -> str:
    """The Jinja2 text a --chat-template / set_chat_template value stands for: a NAMED template's, or `text` itself
    where it is Jinja2 ({{ ... }} or {% ... %}). Anything else (a mistyped name such as "chatlm") would render as
    that constant word in place of every chat: a TemplateError naming the names (the CLI's and the API's check)."""
    if text in NAMED:
        return NAMED[text]
    if "{{" in text or "{%" in text:
        return text
    raise TemplateError(f"{text!r}: not a template name ({', '.join(NAMED)}) nor a Jinja2 template")


def check(template: str) -> None:
    """TemplateError if `template` does not parse (a template given on the command line, checked before loading)."""
    _compile(template)


def choose_template(template: str | None) -> str:
    """The template to render: the model's own, or the fallback (engine/config.py: the one rule for both)."""
    if template == LEGACY_BITNET_CHAT_TEMPLATE:   # stored by earlier conversions: the same form, untrimmed
        return BITNET_CHAT_TEMPLATE
    return BITNET_CHAT_TEMPLATE if is_broken_chat_template(template) else template


class TemplateError(BitNetError):
    """The model's chat template failed to render."""


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2 import TemplateError as JinjaError

    from .template_sandbox import make_environment

    def raise_exception(message):
        raise TemplateError(f"chat template: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = make_environment()
    env.filters["tojson"] = _guard_filter("tojson", tojson)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except (JinjaError, RecursionError, MemoryError, ValueError, TypeError, OverflowError) as e:
        raise TemplateError(f"chat template does not parse: {_one_line(e)}", hint="the model file's template is broken") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")   # what render() itself sets


def _system_folded(messages: list[dict]) -> list[dict] | None:
    """The messages without system messages, for a template that has no system role, as llama.cpp's polyfill
    (minja's polyfill_system_role) makes them: pending system texts joined with "\n" go before the next user
    message's text ("\n" between); before any other message, or at the end, they become a user message of their
    own (empty ones are dropped). None where there is no system message; one whose content is not text stays."""
    if not any(m.get("role") == "system" for m in messages):
        return None
    out, pending = [], ""
    for m in messages:
        content, role = m.get("content"), m.get("role")
        if isinstance(content, str) and role == "system":
            pending += ("\n" if pending else "") + content
            continue
        if isinstance(content, str) and pending:
            if role == "user":
                m = {**m, "content": pending + ("\n" + content if content else "")}
            else:
                out.append({"role": "user", "content": pending})
            pending = ""
        out.append(m)
    if pending:
        out.append({"role": "user", "content": pending})
    return out


_PROBE_NEEDLE = "<System Needle>"


@lru_cache(maxsize=8)
def supports_system_role(template: str) -> bool:
    """Whether `template` (a template text choose_template gave) renders a system message: decided once per template
    as llama.cpp's chat-template caps detection does it (minja's supports_system_role): a probe conversation of a
    system and a user message renders without error and shows the system text. Gemma's raise, and a template that
    leaves system messages out shows nothing: the system text then goes into the user turns (_system_folded)."""
    probe = [{"role": "system", "content": _PROBE_NEEDLE}, {"role": "user", "content": "Hey"}]
    try:
        out = render_limited(_compile(template), LIMITS.for_messages(probe), messages=probe,
                             add_generation_prompt=False, bos_token="", eos_token="")
    except Exception:  # noqa: BLE001 - whatever the template raises on the probe: it takes no system role
        return False
    return _PROBE_NEEDLE in out


def _hints(source: str | None) -> tuple[str, str]:
    """(broken, loops): the hints of a template that fails to render and of one that ran past its budget, naming
    where the template came from (source: "--chat-template-file FILE", "--chat-template NAME", ...; None: the
    model file)."""
    if not source:
        return "the model file's template is broken", LOOP_HINT
    return (f"the template of {source} is broken: fix it, or give another",
            f"the template of {source} loops or grows without bound: fix it, or give another")


def render(template: str | None, messages: list[dict], *, add_generation_prompt: bool = True,
           bos_token: str = "", eos_token: str = "", limits: Limits | None = None, tools: list | None = None,
           kwargs: dict | None = None, source: str | None = None) -> str:
    """Render `messages` ([{"role", "content", ...}]: every key reaches the template, as transformers passes them)
    with the model's template (or the fallback). tools: the function list, for templates that render it
    (engine/runtime/tools.py decides which do). kwargs: more variables for the template (transformers'
    apply_chat_template **kwargs, llama-server's chat_template_kwargs: enable_thinking=False, ...); RESERVED names
    are refused (TemplateError). A template without a system role (supports_system_role) gets the system texts
    in the user turns (llama.cpp's polyfill); any other template's own error is the error. source: where the
    template came from, for the hints (None: the model file)."""
    from jinja2 import TemplateError as JinjaError

    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise TemplateError(f"chat message {i}: expected a dict with 'role' and 'content'")
    chosen = choose_template(template)
    broken, loops = _hints(source)
    try:
        tpl = _compile(chosen)
    except TemplateError as e:
        raise TemplateError(e.args[0], hint=broken) from None
    empty = "" if messages else " (the message list is empty: give at least one message)"
    try:
        clash = [k for k in (kwargs or {}) if k in RESERVED or not isinstance(k, str) or not k.isidentifier()]
        if clash:
            raise TemplateError(f"chat_template_kwargs: {clash[0]!r} cannot be set (the template's own variables: "
                                f"{', '.join(RESERVED)})")
        thinking = (kwargs or {}).get("enable_thinking")
        if thinking is not None and not isinstance(thinking, bool):   # "false" is true to Jinja (llama-server: 400)
            raise TemplateError(f"chat_template_kwargs: enable_thinking {thinking!r}: expected true or false (a "
                                f"boolean, not {type(thinking).__name__})")
        extra = {**(kwargs or {}), **({"tools": tools} if tools else {})}
        if not supports_system_role(chosen):
            messages = _system_folded(messages) or messages
        return render_limited(tpl, (limits or LIMITS).for_messages(messages), messages=list(messages),
                              add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                              eos_token=eos_token, **extra)
    except TemplateLimitError as e:
        raise TemplateLimitError(e.args[0] + empty, hint=loops) from None
    except TemplateError as e:
        if not empty:
            raise
        raise TemplateError(e.args[0] + empty, hint=e.hint) from None
    except BitNetError:
        raise
    except (JinjaError, RecursionError, MemoryError, ArithmeticError, LookupError, TypeError, ValueError,
            AttributeError) as e:  # whatever the template's own code runs into
        raise TemplateError(f"chat template failed to render: {type(e).__name__}: {_one_line(e)}{empty}",
                            hint=None if empty else broken) from None
