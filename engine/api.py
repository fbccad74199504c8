"""The public runtime API: the only thing chat/ and bench/ use (contract: engine/INTERFACES.md).

    from bitnet_cpu.engine.api import load_model, SamplingParams
    llm = load_model("model.gguf", ctx=2048, threads=2)          # None -> the bundled default model
    ids = llm.chat_prompt([{"role": "user", "content": "Hi"}])
    for chunk in llm.generate(ids, SamplingParams(temperature=0.7), max_tokens=128):
        print(chunk.text, end="", flush=True)
        if chunk.finish_reason:
            print(chunk.stats)

One LLM object is one session: one KV cache, reused across generate() calls by longest common prefix.
Many sequences at once (continuous batching over a paged KV cache, engine/batching/):

    eng = load_engine("model.gguf", parallel=16, ctx=4096)
    stream = eng.submit(eng.chat_prompt([{"role": "user", "content": "Hi"}]), max_tokens=64)
    for chunk in stream:                                        # or submit(..., callback=fn)
        print(chunk.text, end="")
    eng.close()

Every error the API raises is a BitNetError (one line; .hint says what to do), importable from here with the
documented kinds: ContextOverflowError, ConstraintError, NoTokenAllowedError, QueueFullError, TemplateError.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import os
import time
from typing import Iterator, Sequence

import numpy as np

from .runtime import chat_template as _ct
from .config import ModelConfig
from .cpu import available_cores, default_threads
from .errors import (BitNetError, ConstraintError, ContextOverflowError, FormatError, ModelChangedError, QueueFullError,
                     token_ids)
from .fileio import why_missing
from .runtime.generate import Chunk, Stats, generate as _generate, whole_number
from .runtime.model import Model, check_kv_dtype
from .runtime.constraints import Constraint, compile_constraint
from .runtime.dry import breaker_table, cached_table
from .runtime.sampling import NoTokenAllowedError, SamplingParams
from .runtime.speculative import LookupParams, checked_lookup
from .formats.compat import all_warnings, check_runnable
from .formats.store import Store, is_store
from .formats.tokenizer import Tokenizer

__all__ = ["load_model", "LLM", "load_engine", "resolve_store", "model_card", "ModelCard", "Engine", "SamplingParams",
           "LookupParams", "Chunk", "Stats", "Constraint",
           # the errors the API raises: BitNetError and its documented kinds
           "BitNetError", "ContextOverflowError", "ConstraintError", "NoTokenAllowedError", "QueueFullError",
           "TemplateError", "ModelChangedError"]
TemplateError = _ct.TemplateError


def _resolve(model: str | None, lm_head: str | None, progress: bool) -> str:
    from .formats.convert import LM_HEADS
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise BitNetError(f"model: a path or a hub id (str), not {type(model).__name__}")
    if lm_head is not None and lm_head not in LM_HEADS:   # before a store's head is compared with it
        raise BitNetError(f"lm_head {lm_head!r}: one of {', '.join(LM_HEADS)} (None: the converter's choice)")
    if model is not None and is_store(model):
        from .formats.convert import check_store_head
        return check_store_head(os.fspath(model), lm_head)
    if model is not None and not os.path.exists(model):
        from .formats.hub import control_character, is_hub_ref

        if not is_hub_ref(model):
            bad = control_character(model)   # `$'o/r\n'`: was taken as the hub id o/r
            raise BitNetError(f"model {model!r} (-m/--model): {why_missing(model)}" +
                              (f", nor a hub id: it holds a control character ({bad})" if bad else ""),
                              hint="check how the name was quoted or pasted" if bad else
                              "give a model file, a directory, or a hub id such as microsoft/bitnet-b1.58-2B-4T")
    from .formats.convert import resolve_model

    return resolve_model(model, lm_head=lm_head, progress=progress)


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")   # the server's (developer: as system)


def _text_content(m, k: int) -> dict:
    """messages[k] as the templates take it: a dict with a 'role' the server takes (developer becomes system, as
    there) and text content (None only for an assistant's tool calls); OpenAI's content parts ([{"type": "text",
    "text": ...}]) joined into one text with a newline between two, as the server joins them (their repr went into
    the prompt; chat_template.join_text_parts). Anything else
    is one BitNetError naming it, as the server's 400 (a role "bogus" or content 5 rendered in silence)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BitNetError(f"messages[{k}]: a dict with a 'role' (str), not {m!r:.80}")
    if m["role"] not in CHAT_ROLES:
        raise BitNetError(f"messages[{k}].role {m['role']!r:.40}: one of {', '.join(CHAT_ROLES)}")
    if m["role"] == "developer":
        m = {**m, "role": "system"}
    parts = m.get("content")
    if parts is None and m["role"] != "assistant":
        raise BitNetError(f"messages[{k}].content: a {m['role']} message needs its content (text)")
    if parts is not None and not isinstance(parts, (str, list)):
        raise BitNetError(f"messages[{k}].content: text (str) or OpenAI's text parts, not {type(parts).__name__}")
    if parts == [] and m["role"] != "assistant":   # OpenAI's 400 (the server's): it was an empty turn
        raise BitNetError(f"messages[{k}].content: an empty list: a {m['role']} message needs at least one text "
                          "part (or a string)")
    if not isinstance(parts, list):
        return m
    for j, p in enumerate(parts):
        if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
            raise BitNetError(f"messages[{k}].content[{j}]: this model takes text parts only "
                              f"({{'type': 'text', 'text': ...}}), not {p!r:.80}")
    return {**m, "content": _ct.join_text_parts(p["text"] for p in parts)}


def _continuation(messages: list[dict], continue_final: bool | None, generation_prompt: bool
                  ) -> tuple[list[dict], str | None]:
    """(the messages to render, the text of a final assistant message the answer continues, or None): the server's
    rule (serve/schemas.py continuation, llama-server's), in the Python API's words. continue_final None continues
    a final assistant's text where a generation prompt is asked for."""
    last = messages[-1] if messages else {}
    can = last.get("role") == "assistant" and not last.get("tool_calls")
    if continue_final is None:
        continue_final = can and generation_prompt
    if not continue_final:
        return messages, None
    if not can:
        raise BitNetError("continue_final_message: the last message is not an assistant's text to continue")
    if len(messages) >= 2 and messages[-2].get("role") == "assistant":
        raise BitNetError("messages: two assistant messages at the end (the last one is continued)",
                          hint="continue_final_message=False renders them as they are, with a new turn after")
    return messages[:-1], last.get("content") or ""


class _Text:
    """text <-> ids helpers shared by LLM and Engine (need self.tokenizer and self.store)."""

    _chat_template: str | None = None   # set_chat_template's, else the model file's
    _template_kwargs: dict = {}         # set_template_kwargs's: every chat's template variables, under a call's own

    def __reduce__(self):
        """Mapped weights, a KV cache, an Engine's thread: none crosses processes (pickle, a spawn Process's args,
        a Pool): one line saying what to do instead of "cannot pickle 'mmap.mmap' object"."""
        kind, load = ("an Engine", "load_engine()") if isinstance(self, Engine) else ("an LLM", "load_model()")
        raise BitNetError(f"{kind} cannot cross processes: {load} in the child")

    def __copy__(self):
        """copy.copy / copy.deepcopy: no process is crossed, so not __reduce__'s words: what to do instead."""
        if isinstance(self, Engine):
            raise BitNetError("an Engine cannot be copied: submit to this one from any thread (it batches them), or "
                              "load_engine() again")
        raise BitNetError("an LLM cannot be copied: it is one session (one KV cache); load_model() again for another")

    def __deepcopy__(self, memo):
        self.__copy__()

    _template_source: str | None = None   # where set_chat_template's came from, for error hints

    @property
    def chat_template(self) -> str | None:
        """The chat template in use: set_chat_template's, else the model file's (None: the built-in fallback)."""
        return self._chat_template if self._chat_template is not None else self.store.chat_template

    def template_for(self, tools: bool = False) -> str | None:
        """The template a chat is rendered with: chat_template, or for a request with tools the model file's
        template named "tool_use" where it has one (tokenizer_config's named templates; transformers and
        llama.cpp pick it for tools the same way)."""
        if tools and self._chat_template is None:
            tool_use = self.store.meta.get("chat_template_tool_use")
            if isinstance(tool_use, str) and tool_use.strip():
                return tool_use
        return self.chat_template

    def set_chat_template(self, template: str, source: str | None = None) -> None:
        """Render chats with `template` (a Jinja2 chat template, or a name of runtime/chat_template.NAMED: any other
        text is a TemplateError, as --chat-template's) instead of the model file's, as llama.cpp's --chat-template /
        --chat-template-file. It is rendered once on a test conversation first: a template that does not parse or
        render is a TemplateError (a BitNetError) and the model's own stays. source: where the template came from, as
        error hints name it ("--chat-template-file FILE"; default: set_chat_template, or --chat-template NAME for a
        name)."""
        if not isinstance(template, str):
            raise _ct.TemplateError(f"chat template: a Jinja2 template or a name (str), not {type(template).__name__}")
        if template in _ct.NAMED and source in (None, "--chat-template"):
            source = f"--chat-template {template}"
        source = source or "set_chat_template"
        try:
            template = _ct.named_or_jinja(template)
        except _ct.TemplateError as e:
            raise _ct.TemplateError(f"chat template {e.args[0]}") from None
        before = self._chat_template, self._template_source
        self._chat_template, self._template_source = template, source
        try:
            self.chat_text([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                            {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}])
        except BaseException:
            self._chat_template, self._template_source = before
            raise

    @property
    def template_kwargs(self) -> dict:
        """The template variables every chat is rendered with (set_template_kwargs's), under a call's own."""
        return dict(self._template_kwargs)

    def set_template_kwargs(self, kwargs: dict) -> None:
        """Render every chat with these template variables (llama.cpp's --chat-template-kwargs, e.g.
        {"enable_thinking": False} for Qwen3's), under the ones a chat_prompt call passes. Checked on a test
        conversation first: a name the template sets itself, or one it cannot render with, is a TemplateError (a
        BitNetError) and the variables before stay."""
        if not isinstance(kwargs, dict):
            raise _ct.TemplateError(f"chat_template_kwargs: a dict of template variables, not {type(kwargs).__name__}")
        before, self._template_kwargs = self._template_kwargs, dict(kwargs)
        try:
            self.chat_text([{"role": "user", "content": "u"}])
        except BaseException:
            self._template_kwargs = before
            raise

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise BitNetError(f"tokenize: text (str), not {type(text).__name__}")
        for name, flag in (("add_bos", add_bos), ("special", special)):   # 1 was a FormatError about the model
            if not isinstance(flag, (bool, np.bool_)):                      # file, "no" was True
                raise BitNetError(f"{name} {flag!r:.40}: True or False")
        return self.tokenizer.encode(text, add_bos=bool(add_bos), special=bool(special))

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of token ids; one BitNetError for anything but ids of this model (an id outside the
        vocabulary was dropped from the text in silence, a float truncated)."""
        return self.tokenizer.decode(self._in_vocab(token_ids(ids, "ids", text_ok=False), "ids"))

    def _in_vocab(self, ids: list[int], what: str) -> list[int]:
        """ids, or one BitNetError naming the first outside the vocabulary, before any work is done."""
        vocab = self.config.vocab_size
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise BitNetError(f"{what}[{bad}] {ids[bad]}: not a token id of this model (0..{vocab - 1})")
        return ids

    def compile_constraint(self, constraint):
        """A Constraint (or schema dict / "json") compiled for this model's tokenizer, cached; None for None.
        Raises ConstraintError naming what cannot be enforced. Compiling a new schema can take ~10-100 ms: a
        server calls this off its event loop and passes the result to submit()."""
        return compile_constraint(self.tokenizer, self.config.vocab_size, constraint)

    def sampling_ready(self, params: SamplingParams) -> bool:
        """Whether a sampler with `params` finds what it takes from the tokenizer already built (else
        prepare_sampling builds it)."""
        breakers = params.dry_breakers
        return not breakers or cached_table(self.tokenizer, self.config.vocab_size, breakers) is not None

    def prepare_sampling(self, params: SamplingParams) -> None:
        """Build and cache what a sampler with `params` takes from the tokenizer: DRY's sequence-breaker table (the
        first costs ~0.3 s for a 128k vocabulary). A server calls this off its event loop before submit()."""
        if params.dry_breakers:
            breaker_table(self.tokenizer, self.config.vocab_size, params.dry_breakers)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, prefill: str = "", template_kwargs: dict | None = None, *,
                    results_in_order: bool = False, continue_final_message: bool | None = None) -> list[int]:
        """Token ids of `messages` rendered with the model's own chat template (or the built-in fallback).
        tools: OpenAI-style function list; messages may then hold assistant `tool_calls` (or the deprecated
        `function_call`, that message's one call) and `tool` results (engine/runtime/tools.py puts them in the form
        the template renders). Both are checked as the server checks them (a BitNetError naming the field): a tool
        result answers an earlier call by its `tool_call_id`, unless results_in_order (ollama's history: results
        without ids, each answering the calls in order). prefill: text the answer continues
        (a final assistant message's start, as Anthropic's and ollama's APIs take it), after the template's text.
        A final assistant message (text, not tool calls) is continued, as the server does by default (llama-server's
        rule, ollama's and Anthropic's): the messages before it with the generation prompt, then its text, then
        prefill; on a thinking template with enable_thinking False (the continued text is the answer), unless
        template_kwargs say otherwise. continue_final_message (the server's field): None, that default (only with
        add_generation_prompt); False, the message is closed and a new assistant turn opened, as any other; True, the
        last message must be an assistant's text (else a BitNetError). Two assistant messages at the end are
        refused when the last one would be continued, as the server refuses them.
        template_kwargs: more template variables (enable_thinking=False for Qwen3's; chat_template.render).
        The ids start with BOS where the model's tokenizer adds one, whether or not the template writes it
        (llama-server tokenizes chat prompts with add_special): a ChatML template has no {{ bos_token }}, and a
        template that writes it does not get two."""
        if not isinstance(prefill, str):
            raise BitNetError(f"prefill: text (str), not {type(prefill).__name__}")
        text = self.chat_text(messages, add_generation_prompt, tools, template_kwargs,
                              results_in_order=results_in_order, continue_final_message=continue_final_message)
        ids = self.tokenizer.encode(text + prefill, add_bos=False, special=True)
        bos = self.tokenizer.text_bos
        return ids if bos is None or ids[:1] == [bos] else [bos] + ids

    def chat_text(self, messages: list[dict], add_generation_prompt: bool = True,
                  tools: list[dict] | None = None, template_kwargs: dict | None = None, *,
                  results_in_order: bool = False, continue_final_message: bool | None = None) -> str:
        """The text chat_prompt tokenizes (special tokens as text): what the template makes of `messages`, a final
        assistant message continued as chat_prompt says."""
        from .runtime.tools import MessageError, check_tool_results, checked_calls, functions_from_tools
        if not isinstance(add_generation_prompt, (bool, np.bool_)):   # "no" was True
            raise BitNetError(f"add_generation_prompt {add_generation_prompt!r:.40}: True or False")
        if not isinstance(results_in_order, (bool, np.bool_)):
            raise BitNetError(f"results_in_order {results_in_order!r:.40}: True or False")
        if continue_final_message is not None and not isinstance(continue_final_message, (bool, np.bool_)):
            raise BitNetError(f"continue_final_message {continue_final_message!r:.40}: True, False or None (continue "
                              "a final assistant message with the generation prompt)")
        if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
            raise BitNetError(f"messages: a list of {{'role': ..., 'content': ...}} dicts, not {type(messages).__name__}")
        messages = [_text_content(m, k) for k, m in enumerate(messages)]
        # the calls and results as the server checks them (they were AttributeErrors from inside, or rendered in
        # silence: a function_call dropped, a result answering no call)
        checked = [checked_calls(m, f"messages[{k}]") for k, m in enumerate(messages)]
        if not results_in_order:   # before a function_call becomes a call: the server counts tool_calls only
            try:
                check_tool_results(messages)
            except MessageError as e:   # the server's words, and what to do here
                raise MessageError(e.args[0], where=e.where, hint="a tool result gives the tool_call_id of the call "
                                   "it answers (results_in_order=True: results without ids, in the calls' order)"
                                   ) from None
        messages = checked
        messages, continued = _continuation(messages, continue_final_message, bool(add_generation_prompt))
        if continued is not None:
            add_generation_prompt = True
            if self.thinks:   # the continued text is the answer, not a thought (the server's rule)
                template_kwargs = {"enable_thinking": False, **(template_kwargs or {})}
        if tools is not None and (isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Sequence)
                                  or not all(isinstance(t, dict) for t in tools)):
            raise BitNetError(f"tools: a list of OpenAI-style tool dicts, not {tools!r:.80}")
        if tools:   # as the server checks them before they reach the template (they went in as given)
            functions_from_tools(list(tools))
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise BitNetError(f"template_kwargs: a dict of template variables, not {type(template_kwargs).__name__}")
        bos, eos = self.template_tokens()
        template = self.template_for(bool(tools))
        messages, tools = self.tool_format(bool(tools)).prepare(messages, tools)
        if self._template_kwargs:
            template_kwargs = {**self._template_kwargs, **(template_kwargs or {})}
        source = self._template_source if self._chat_template is not None else None
        return _ct.render(template, messages, add_generation_prompt=add_generation_prompt,
                          bos_token=bos or "", eos_token=eos or "", tools=tools, kwargs=template_kwargs,
                          source=source) + (continued or "")

    def template_tokens(self) -> tuple[str, str]:
        """(bos_token, eos_token): the strings the chat template is rendered with ("" where there is none): the
        model's own where its conversion recorded them (tokenizer_config's, as transformers renders), else the
        tokenizer's BOS and first end-of-text token."""
        tok, meta = self.tokenizer, self.store.meta
        bos = meta.get("bos_token") or (tok.id_to_token(tok.bos_id) if tok.bos_id is not None else "")
        eos = meta.get("eos_token") or (tok.id_to_token(tok.eos_ids[0]) if tok.eos_ids else "")
        return bos or "", eos or ""

    def bos_text(self) -> str:
        """The BOS token's text when tokenizing a text adds it (tokenize(add_bos=True)), else ""."""
        bos = self.tokenizer.text_bos
        if bos is None:
            return ""
        return self.store.meta.get("bos_token") or self.tokenizer.id_to_token(bos) or ""

    @property
    def thinks(self) -> bool:
        """The chat template writes a <think> block before answers (engine/runtime/reasoning.py)."""
        from .runtime.reasoning import thinks
        return thinks(_ct.choose_template(self.chat_template))

    def think_splitter(self, prompt_ids: Sequence[int], free_start: bool = True):
        """A ThinkSplitter for an answer to prompt_ids (a chat_prompt), or None when the template does not think.
        The answer starts as reasoning where the prompt ends inside an open <think> block -- unless a grammar decides
        how it starts (free_start False: a required call, a format), whose output is the answer, never a thought
        nobody closed."""
        from .runtime.reasoning import ThinkSplitter, prompt_opens_thought
        if not self.thinks:
            return None
        return ThinkSplitter(free_start and prompt_opens_thought(self.tokenizer.decode(list(prompt_ids[-8:]))))

    def answer_thought(self, prompt_ids: Sequence[int]) -> str | None:
        """Where an answer to prompt_ids stands with a thought its think_splitter takes out, for a tool grammar
        (engine/runtime/tools.py constraint's thought): None, the template does not think; "open", the prompt
        opened one (the answer starts in it); "may", the answer may open one."""
        from .runtime.reasoning import prompt_opens_thought
        if not self.thinks:
            return None
        return "open" if prompt_opens_thought(self.tokenizer.decode(list(prompt_ids[-8:]))) else "may"

    def thought_may_open(self, compiled) -> bool:
        """Whether an answer under a compiled constraint (None: none) may start inside a thought the prompt opened:
        no grammar, one that leaves the start free (tool_choice auto), or one that continues the thought (it writes
        </think> without opening one: engine/runtime/reasoning.py continues_thought). think_splitter's free_start."""
        from .runtime.reasoning import continues_thought, writes_close
        if compiled is None or compiled.spec.free_start:
            return True
        # a matcher is made only for a grammar that writes </think> (a format's, a call's never does)
        return writes_close(compiled.spec) and continues_thought(compiled.spec, compiled.matcher(), self.tokenizer)

    def grammar_thinks(self, compiled) -> bool:
        """Whether a compiled constraint lets the answer open a thought (<think>): a grammar that writes the thought
        itself (docs/structured-output.md). A format or a required call does not: its output is the answer."""
        from .runtime.reasoning import OPEN
        ids = self.tokenizer.encode(OPEN, add_bos=False, special=True)
        return compiled is None or compiled.matcher().valid_prefix(ids) == ids

    def warm_constraints(self) -> None:
        """Build the grammar engine's view of the tokenizer (seconds for a 128k vocabulary on 2 busy cores) and
        a JSON matcher on a background thread, so the first constrained request does not wait for it."""
        import threading

        def warm():
            try:
                self.compile_constraint("json")
            except Exception:  # noqa: BLE001 - a warm-up only; the real request reports any problem
                pass
        threading.Thread(target=warm, name="bitnet-grammar-warmup", daemon=True).start()

    def embed_tokens(self, texts: str | Sequence[str]) -> list[list[int]]:
        """The token lists embed() runs: each text with BOS, as llama-server tokenizes an embedding input; an
        empty text is refused (BitNetError naming it)."""
        # bytes iterate as ints, a dict as its keys: neither is a list of texts
        if not isinstance(texts, str) and (texts is None or not hasattr(texts, "__iter__")
                                           or isinstance(texts, (bytes, bytearray, dict))):
            raise BitNetError(f"texts: give a string or a list of strings, not {type(texts).__name__}")
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts:
            raise BitNetError("no texts to embed")
        for i, t in enumerate(texts):   # counted as `bitnet embed` counts them: "text 2 of 3", from 1
            if not isinstance(t, str) or not t:
                raise BitNetError(f"text {i + 1} of {len(texts)} is empty: nothing to embed" if t == "" else
                                  f"text {i + 1} of {len(texts)}: expected a string, got {type(t).__name__}")
        return [self.tokenize(t, add_bos=True) for t in texts]

    def tool_format(self, tools: bool = True):
        """How this model writes tool calls (engine/runtime/tools.py), from the chat template a request with tools
        (tools False: one without) is rendered with (template_for)."""
        from .runtime.tools import tool_format

        return tool_format(_ct.choose_template(self.template_for(tools)))


def _display_name(store: Store) -> str:
    return store.config.name or os.path.splitext(os.path.basename(store.meta.get("source") or store.path))[0]


def _checked_threads(threads: int | None, warnings: list[str]) -> int:
    """-t below 1 is an error; above the available (logical) CPUs it is capped, with a warning; not given:
    engine.cpu.default_threads() (one per physical core, or OMP_NUM_THREADS)."""
    if threads is None:
        return default_threads()
    threads = whole_number(threads, "threads", 1, "-t/--threads")
    cores = available_cores()
    if threads > cores:
        warnings.append(f"-t/--threads {threads} is more than the {cores} CPU cores available; using {cores}")
        return cores
    return threads


def _checked_ctx(ctx: int | None) -> int | None:
    """-c: None (the default), 0 (the model's trained context) or a count of tokens."""
    return None if ctx is None else whole_number(ctx, "ctx", 0, "-c/--ctx; 0: the model's trained context")


class LLM(_Text):
    """A loaded model session. Attributes: config, n_ctx, name, source, tokenizer, load_s."""

    def __init__(self, store: Store, *, ctx: int | None = None, threads: int | None = None,
                 kv_dtype: str = "f16", load_s: float = 0.0, lookup: LookupParams | None = None):
        t0 = time.perf_counter()
        self.lookup = checked_lookup(lookup) if lookup is not None else None  # None: speculative.default_lookup
        self.store = store
        self.config: ModelConfig = store.config
        check_runnable(store)   # what this engine does not know (a newer bitnet-cpu's): refused, not ignored
        self.warnings: list[str] = all_warnings(store)   # one line each, for the CLI to print ("-c above ...")
        ctx = _checked_ctx(ctx)
        if ctx == 0:
            ctx = store.config.context_length
        chosen = threads is not None   # -t given: used as it is; else the default, decode's count tuned
        self.threads = threads = _checked_threads(threads, self.warnings)
        self.model = Model(store, n_ctx=ctx, kv_dtype=kv_dtype, threads=threads, tune_threads=not chosen)
        self.warnings += self.model.warnings
        self.tokenizer = Tokenizer.from_store(store)
        self.n_ctx = self.model.n_ctx
        from .formats.convert import source_label

        self.source = source_label(store.meta)   # the file (or hub id) the store was converted from
        self.name = _display_name(store)
        self.load_s = load_s + (time.perf_counter() - t0)

    # ---- running ----
    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                 max_tokens: int = 256, stop: Sequence[str] = (), ignore_eos: bool = False,
                 lookup: LookupParams | None = None, constraint=None, cancel=None) -> Iterator[Chunk]:
        """Stream Chunk(text, token) per generated token, then Chunk("", None, finish_reason, stats).
        A str prompt is tokenized with BOS. finish_reason: "eos" | "stop" | "length" | "context".
        max_tokens=0 only prefills the prompt into the cache. Raises ContextOverflowError when the
        prompt alone does not fit n_ctx. ignore_eos: end-of-text tokens are never sampled (llama.cpp's
        --ignore-eos). lookup: prompt-lookup speculative decoding for this call (default: the session's, else
        engine.speculative.default_lookup); the output is the same with or without it.
        constraint: structured output every token obeys -- a JSON Schema dict, "json" (any JSON object), or a
        Constraint (Constraint.regex(...), .gbnf(...), .lark(...)); raises ConstraintError (a BitNetError) when
        it cannot be enforced exactly. Ends with "eos" once the output is complete, "length" if it is not by
        max_tokens; a stop string ends it "stop" where it matches, inside a value too (OpenAI's, llama-server's
        and this server's rule: stats.stop_word names it), so "stop" is no promise of a whole value. cancel: a
        function of no arguments asked between prefill chunks (128 prompt tokens by default); once it returns true
        the prompt stops there (what was done stays cached) and the stream ends with one Chunk, finish_reason
        "cancelled" and no token (bitchat's Ctrl-C during a long prompt)."""
        model = self._open_model(run=True)
        if isinstance(prompt, (bytes, bytearray)):
            raise BitNetError("prompt: give text (str) or token ids, not bytes")
        if not isinstance(ignore_eos, (bool, np.bool_)):
            raise BitNetError(f"ignore_eos {ignore_eos!r}: True or False")
        # an id outside the vocabulary is raised here, not at the first next() after the cache was cut
        ids = self.tokenize(prompt, add_bos=True) if isinstance(prompt, str) else \
            self._in_vocab(token_ids(prompt), "prompt")
        compiled = self.compile_constraint(constraint)   # raised here, not at the first next()
        return _told_changed(_generate(model, self.tokenizer, ids, params, max_tokens=max_tokens, stop=stop,
                                       load_s=self.load_s, ignore_eos=ignore_eos,
                                       lookup=lookup if lookup is not None else self.lookup, constraint=compiled,
                                       cancel=cancel), self.store)

    def embed(self, texts: str | Sequence[str], *, pooling: str = "mean", normalize: int | None = None):
        """Embeddings [len(texts), hidden] f32 (a str: one row): each text with BOS through the model, the final-norm
        hidden states pooled -- "mean" (default) or "last" -- and normalised (None: 2, L2; llama.cpp's
        embd_normalize values), or pooling "none": a list of each text's [tokens, hidden] rows as they are
        (engine/runtime/embed.py; the same bits as Engine.embed), where a normalize is refused (BitNetError, as the
        server's 400). Raises ContextOverflowError for a text over n_ctx. Leaves the last text in the KV cache."""
        from .runtime.embed import NORMALIZE, check_normalize, check_pooling, check_unpooled_norm, embed_ids
        pooling = check_pooling(pooling)
        if normalize is not None:
            check_normalize(normalize, "normalize")   # this argument's name (embd_normalize is the server's field)
        check_unpooled_norm(pooling, normalize)
        normalize = NORMALIZE if normalize is None else normalize
        all_ids = self.embed_tokens(texts)
        for i, ids in enumerate(all_ids):
            if len(ids) > self.n_ctx:
                raise ContextOverflowError(f"text {i + 1} of {len(all_ids)} has {len(ids)} tokens but the context "
                                           f"holds {self.n_ctx}", hint="raise the context or shorten the text",
                                           n_prompt_tokens=len(ids), n_ctx=self.n_ctx)
        with self._cache("embed()", run=True):
            if pooling == "none":
                return [embed_ids(self.model, ids, pooling) for ids in all_ids]
            out = np.zeros((len(all_ids), self.config.hidden_size), np.float32)
            for i, ids in enumerate(all_ids):
                out[i] = embed_ids(self.model, ids, pooling, normalize)
        return out

    def perplexity(self, text: str | Sequence[int], *, chunk: int = 512, chunks: int = -1, stride: int = 0) -> dict:
        """llama-perplexity's figure (engine/runtime/perplexity.py; `bitnet perplexity`): the text (a str is
        tokenized with BOS, a special token's spelling in it as plain text) cut into `chunks` (-1: every whole
        one) of `chunk` tokens, each run from an empty cache with BOS in front and scored over its second half;
        with `stride` > 0, llama-perplexity's --ppl-stride: windows of `chunk` tokens every `stride` tokens, as
        the text has them, scored over their last `stride` rows. Returns {"ppl", "ppl_err", "chunks",
        "tokens_scored"}. BitNetError when `chunk` exceeds n_ctx or the text is shorter than one chunk. Leaves the
        last chunk in the KV cache."""
        from .runtime import perplexity as P
        self._open_model(run=True)   # a closed model says so first (a short text was told it was shorter than a chunk)
        # the arguments in this API's names (the runtime's checks name the command line's flags)
        chunk, stride = whole_number(chunk, "chunk", 4), whole_number(stride, "stride", 0)
        chunks = whole_number(chunks, "chunks", -1)
        if chunk > self.n_ctx:
            raise BitNetError(f"chunk {chunk} is over this session's context ({self.n_ctx})",
                              hint="load the model with ctx >= chunk")
        if chunks == 0:
            raise BitNetError("chunks 0: nothing to score (a positive count, or -1 for every chunk)")
        if stride and stride >= chunk:
            raise BitNetError(f"stride {stride}: must be below chunk ({chunk})")
        ids = self.tokenize(text, add_bos=True, special=False) if isinstance(text, str) else \
            self._in_vocab(token_ids(text, "text"), "text")
        runs = P.passes(len(ids), chunk, chunks, stride, self.tokenizer.text_bos)
        stats = P.NllStats()
        with self._cache("perplexity()", run=True):
            for start, bos, first in runs:
                for logits, targets in P.chunk_logits(self.model, ids[start: start + chunk], bos, first):
                    stats.add(logits, targets)
        ppl, err = stats.estimate()
        return {"ppl": ppl, "ppl_err": err, "chunks": len(runs), "tokens_scored": stats.count}

    def forward(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [len(ids), vocab] f32 from a fresh cache (for tests)."""
        ids = self._in_vocab(token_ids(ids, "ids", text_ok=False), "ids")
        with self._cache("forward()", run=True):
            return self.model.forward(ids)

    def reset(self):
        with self._cache("reset()"):
            self.model.reset()

    @contextlib.contextmanager
    def _cache(self, what: str, run: bool = False):
        """The KV cache, for a call (`what`) that runs it: a generate() in flight (this thread's or another's) is
        superseded (its next step says by what) instead of sharing the cache. run: the call reads the weights (the
        model file rewritten in place since the load is a ModelChangedError first)."""
        model = self._open_model(run)
        with model.lock:
            model.generation += 1
            model.taken_by = what
            try:
                yield
            except BitNetError:
                _raise_if_changed(self.store)
                raise

    @property
    def cached_tokens(self) -> list[int]:
        return list(self._open_model().cache_ids)

    def _open_model(self, run: bool = False) -> Model:
        """The model; run: a call that reads the weights, refused (ModelChangedError) when the file they are mapped
        from was rewritten in place since the load (one fstat per call, never per token)."""
        if self.model is None:
            raise BitNetError("this model is closed", hint="load it again with load_model()")
        if run:
            self.store.check_unchanged()
        return self.model

    def close(self):
        """Free the weights, the KV cache and the buffers (a generate() in flight is superseded); using this LLM
        afterwards is a BitNetError. Closing twice is harmless. `with load_model(...) as llm:` closes at the end."""
        model = self.model
        if model is not None:
            with model.lock:
                model.generation += 1
                model.taken_by = "close() (the model is closed)"
                model.closed = True
                self.model = None
            del model   # its weight views held the map open: the store could not unmap it while this frame did
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _raise_if_changed(store: Store) -> None:
    """Where a run failed (NaN logits: "its weights are corrupt"), the cause when it is the file rewritten under the
    mapping while the run read it: the file is fine, and re-converting it would not help."""
    store.check_unchanged()


def _told_changed(chunks: Iterator[Chunk], store: Store) -> Iterator[Chunk]:
    """generate()'s chunks; a failure while the model file was rewritten under it is told as that
    (_raise_if_changed)."""
    try:
        yield from chunks
    except BitNetError:
        _raise_if_changed(store)
        raise


def open_store(path: str, *, mmap: bool | None = None, progress: bool = True) -> Store:
    """The store at `path`: mmap True maps the file, False reads the weights into (huge-page) memory, None
    decides by size, huge-page support and free memory (Store's load="auto"); a progress bar on stderr (a
    terminal) while a large read takes place. What this engine does not know (check_runnable) is refused first."""
    from .formats.convert import progress_bar

    if mmap is not None and not isinstance(mmap, (bool, np.bool_)):   # "no" was true: the file was mapped
        raise BitNetError(f"mmap {mmap!r}: True, False or None (the default: decided by size and memory)")
    from . import faults
    if not faults.installed():   # a program embedding the engine: a mapped file truncated under it is one line naming
        faults.install(GUARD_PROG)   # the file and exit 2, not a bare "Bus error" (the CLIs install their own name)
    bar = None

    def report(done: int, total: int):
        nonlocal bar
        if bar is None and total >= PROGRESS_MIN_BYTES:
            bar = progress_bar(total, f"load {os.path.basename(path)}", progress, unit="B") or False
        if bar:
            bar.update(done - bar.n)

    try:
        return Store(path, load="auto" if mmap is None else "mmap" if mmap else "memory", progress=report,
                     check=check_runnable)   # a store this engine cannot run is refused before its weights are read
    finally:
        if bar:
            bar.close()


PROGRESS_MIN_BYTES = 256 << 20
GUARD_PROG = "bitnet_cpu"   # the fault guard's line starts "bitnet_cpu: error: " (faults.install("myapp") first: yours)


def resolve_store(model: str | None = None, *, lm_head: str | None = None, progress: bool = True) -> str:
    """The path of the store `model` names (as load_model takes it: a store, a GGUF, an HF directory or hub id
    converted into the cache, None: the default model), opened once (mapped, not read; what this engine does not
    know refused, as a load refuses it) and closed: a server whose engines load elsewhere (`bitnet serve
    --ray-replicas`) says what is wrong with -m before it starts them."""
    path = _resolve(model, lm_head, progress)
    open_store(path, mmap=True, progress=False).close()
    return path


def load_model(model: str | None = None, *, ctx: int | None = None, threads: int | None = None,
               kv_dtype: str = "f16", progress: bool = True, lm_head: str | None = None,
               lookup: LookupParams | None = None, mmap: bool | None = None) -> LLM:
    """Open (converting once if needed) a model: a store, GGUF file or HF dir; None -> bundled default.
    lm_head ("q4" | "i8" | "f16"; None: the converter's default) is passed to the converter when a conversion
    happens. mmap True: view the weights in the mapped file instead of reading them into huge-page memory (starts
    at once and shares the file's pages with other processes; decode is slower, ~8-13% on the 2B model); False:
    always read them; None: read stores over 64 MiB when the kernel has transparent huge pages and memory allows."""
    t0 = time.perf_counter()
    path = _resolve(model, lm_head, progress)
    try:
        store = open_store(path, mmap=mmap, progress=progress)
        try:
            return LLM(store, ctx=ctx, threads=threads, kv_dtype=kv_dtype, load_s=time.perf_counter() - t0,
                       lookup=lookup)
        except BaseException:   # its weights go now, not when the traceback does (as load_engine's)
            store.close()
            raise
    except FormatError as e:
        if model is None or os.path.abspath(path) == os.path.abspath(model):
            raise
        # a cached conversion of the user's file: name theirs, and say how to redo it
        raise FormatError(f"{model}: {e.args[0]}", hint=e.hint or f"delete the cached conversion {path} to convert"
                          " again") from None


from .batching import default_batch_tokens  # noqa: E402  (batching imports nothing of api)
from .batching.scheduler import BatchScheduler  # noqa: E402

DEFAULT_POOL_BYTES = 4 << 30  # default KV pool cap (untouched pages cost no memory: the pool is lazily mapped)


# A server's prompts carry what its clients send (a tool list, a system prompt): a model trained on a short context
# (the bundled one: 512 tokens) is served with at least this many, as llama-server and ollama serve any model
# with 4096 whatever it was trained on. Past the trained length RoPE extrapolates: worse text there, not an error.
SERVE_MIN_CTX = 2048


def serving_ctx(cfg: ModelConfig) -> int:
    """load_engine's default context: the model's trained context, at least SERVE_MIN_CTX and at most 4096."""
    return min(max(cfg.context_length, SERVE_MIN_CTX), 4096)


def engine_ctx(cfg: ModelConfig, ctx: int | None = None) -> int:
    """The context an Engine of this model runs with, given load_engine's ctx (None: serving_ctx; 0: the trained
    one)."""
    ctx = _checked_ctx(ctx)
    return int(cfg.context_length if ctx == 0 else ctx or serving_ctx(cfg))


class ModelCard:
    """What a model file says of itself, read without loading its weights (model_card): `config` (ModelConfig),
    `name` (as a loaded model's .name), `chat_template` (the file's, or the one given; None: the built-in
    fallback), `path` (the file read: a store, or the GGUF file / HF directory itself when it is not converted
    yet), `thinks` (as a loaded model's)."""

    def __init__(self, config: ModelConfig, name: str, chat_template: str | None, path: str):
        self.config, self.name, self.chat_template, self.path = config, name, chat_template, path

    @property
    def thinks(self) -> bool:
        from .runtime.reasoning import thinks
        return thinks(_ct.choose_template(self.chat_template))


def model_card(model: str | os.PathLike, *, chat_template: str | None = None) -> ModelCard:
    """A model's description (ModelCard) from its file, its weights left unread: a store's header and index; for a
    GGUF file or an HF directory, its current conversion in the cache when there is one, else the file's own
    metadata (nothing is converted, nor marked used). chat_template: a template (or a name of NAMED) that replaces
    the file's, as set_chat_template's. For ollama's /api/show and listings of models not loaded. A file that
    cannot be read: BitNetError."""
    path = os.fspath(model)
    if not os.path.exists(path):
        raise FormatError(f"{path}: {why_missing(path)}")
    template = None if chat_template is None else _ct.named_or_jinja(chat_template)
    if not is_store(path):
        from .formats.convert import current_conversion
        store_path = current_conversion(path)
        if store_path is None:
            from .formats.sources import open_source
            src = open_source(path, check_ternary=False)
            try:
                name = src.config.name or os.path.splitext(os.path.basename(os.path.abspath(path).rstrip(os.sep)))[0]
                return ModelCard(src.config, name, template if template is not None else src.chat_template, path)
            finally:
                src.close()
        path = store_path
    # the header and the index with plain reads, nothing mapped: a listing (the router's /api/tags, /api/show) of a
    # file being rewritten meanwhile is an error for that file, never a SIGBUS ending the process
    with Store(path, load="index") as s:
        return ModelCard(s.config, _display_name(s), template if template is not None else s.chat_template, path)


class Engine(_Text, BatchScheduler):
    """Many sequences through one model (see load_engine). Attributes: config, n_ctx, name, tokenizer, load_s."""

    def __init__(self, store: Store, *, ctx: int | None = None, threads: int | None = None, parallel: int = 16,
                 kv_pool_tokens: int | None = None, max_batch_tokens: int | None = None, max_queue: int = 64,
                 kv_dtype: str = "f16", load_s: float = 0.0, kv_pool_mib: float | None = None,
                 lookup: LookupParams | None = None):
        t0 = time.perf_counter()
        cfg = store.config
        check_runnable(store)
        self.warnings: list[str] = all_warnings(store)
        self.threads = threads = _checked_threads(threads, self.warnings)
        ctx = _checked_ctx(ctx)
        check_kv_dtype(kv_dtype)
        n_ctx = engine_ctx(cfg, ctx)
        if ctx is None and n_ctx > cfg.context_length:
            # -c N is a trade-off, not a fix: at the trained length a tool list or a long system prompt may not fit
            self.warnings.append(f"context {n_ctx} (a server's default: at least {SERVE_MIN_CTX}) is past the "
                                 f"{cfg.context_length} tokens the model was trained on; -c {cfg.context_length} "
                                 "keeps to it, but then tool lists or long system prompts may not fit")
        elif n_ctx > cfg.context_length:   # as LLM's (engine/runtime/model.py): the server said nothing of it
            self.warnings.append(f"-c/--ctx {n_ctx} is larger than the {cfg.context_length} tokens the model was "
                                 "trained on: output past that may be garbage")
        from .batching.kv_pool import PAGE_TOKENS, KVPool
        # the sizes as whole numbers, named as here (a float was truncated, a str or NaN failed deep inside)
        parallel = whole_number(parallel, "parallel", 1, "--parallel")
        max_queue = whole_number(max_queue, "max_queue", 0, "--max-queue")
        if max_batch_tokens is not None:
            max_batch_tokens = whole_number(max_batch_tokens, "max_batch_tokens", 1, "-b/--batch-size")
        if kv_pool_tokens is not None:
            kv_pool_tokens = whole_number(kv_pool_tokens, "kv_pool_tokens", 1)
        per_tok = KVPool.bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, kv_dtype)
        if kv_pool_tokens is not None and kv_pool_mib is not None:
            raise BitNetError("give the KV pool size as kv_pool_tokens or kv_pool_mib, not both")
        if kv_pool_mib is not None:
            if isinstance(kv_pool_mib, bool) or not isinstance(kv_pool_mib, numbers.Real) \
                    or not 0 < kv_pool_mib < math.inf:
                raise BitNetError(f"kv_pool_mib {kv_pool_mib!r}: a size in MiB, > 0")
            kv_pool_tokens = int(kv_pool_mib * (1 << 20)) // per_tok
            least = -(-n_ctx // PAGE_TOKENS) * PAGE_TOKENS   # the scheduler's floor: a context's pages
            if -(-kv_pool_tokens // PAGE_TOKENS) < least // PAGE_TOKENS:   # named as given (the scheduler
                # named kv_pool_tokens, which the caller never passed)
                mib = math.ceil(least * per_tok / (1 << 20) * 100) / 100
                raise BitNetError(f"kv_pool_mib {kv_pool_mib!r}: the pool must hold at least one context ({n_ctx} "
                                  f"tokens: {mib:g} MiB)", hint=f"give kv_pool_mib >= {mib:g}, or leave it out")
        sized = kv_pool_tokens is not None
        if not sized:   # a context per slot, and a page each for n choices' shared partial pages; within half the
            # memory available (the scheduler refuses a pool past what is available: a small machine's default
            # --parallel must still serve, its slots sharing fewer pages, as before that check)
            from .memory import available_memory
            avail = available_memory()
            cap = DEFAULT_POOL_BYTES if avail is None else min(DEFAULT_POOL_BYTES, avail // 2)
            kv_pool_tokens = max(n_ctx, min(parallel * (n_ctx + PAGE_TOKENS), cap // per_tok))
        if kv_pool_tokens * per_tok > 1 << 40:   # (the pool holds a context at least: -c 10^11 overflowed in C)
            raise BitNetError(f"KV pool of {kv_pool_tokens} tokens: {kv_pool_tokens * per_tok / (1 << 30):.0f} GiB, "
                              "past any machine's memory (at most 1 TiB)" + ("" if sized else
                              f"; it holds one context of {n_ctx} tokens at least: give a smaller -c/--ctx-size"))
        super().__init__(store, Tokenizer.from_store(store), n_ctx=n_ctx, parallel=parallel,
                         kv_pool_tokens=kv_pool_tokens,
                         max_batch_tokens=default_batch_tokens() if max_batch_tokens is None else max_batch_tokens,
                         max_queue=max_queue, kv_dtype=kv_dtype, threads=threads, lookup=lookup)
        self.name = _display_name(store)
        self.load_s = load_s + (time.perf_counter() - t0)

    def embed(self, texts: str | Sequence[str], timeout: float | None = None, *, pooling: str | None = None,
              normalize: int | None = None):
        """Embeddings [len(texts), hidden] f32, as LLM.embed, batched through the engine: each text is a
        prefill-only sequence beside the running generations (engine/batching/embed.py). pooling / normalize:
        None takes the engine's (load_engine's). submit_embed(token lists, callback) is the non-blocking form."""
        return self.embed_ids(self.embed_tokens(texts), timeout, pooling=pooling, normalize=normalize)

    def close(self):
        """Stop the scheduler (what is in flight ends "cancelled") and free the weights; closing twice is harmless.
        `with load_engine(...) as eng:` closes at the end."""
        BatchScheduler.close(self)
        self.model = None   # the weights' views: the store can then let them go
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load_engine(model: str | None = None, *, ctx: int | None = None, threads: int | None = None, parallel: int = 16,
                kv_pool_tokens: int | None = None, max_batch_tokens: int | None = None, max_queue: int = 64,
                kv_dtype: str = "f16", progress: bool = True, lm_head: str | None = None,
                kv_pool_mib: float | None = None, lookup: LookupParams | None = None, mmap: bool | None = None,
                pooling: str = "mean", embd_normalize: int = 2) -> Engine:
    """A batching engine over `model` (as load_model opens it), its scheduler thread started.
    ctx: per-sequence context (default: serving_ctx, the model's trained context but 2048 to 4096);
    parallel: sequences running at once; kv_pool_tokens: KV pool size in tokens
    (default parallel * (ctx + a page), capped at 4 GiB of pages but at least one context), or kv_pool_mib in MiB;
    a request whose choices could never be promised their pages is refused at submit (BitNetError naming n);
    max_batch_tokens: rows per step (each decoding sequence's token, then prompt tokens), 1..BATCH_TOKENS_MAX (None:
    engine.batching.default_batch_tokens(), 128, or 256 where the AMX tiles run);
    max_queue: waiting requests before submit() raises QueueFullError;
    lookup: prompt-lookup speculative decoding for every sequence (None: off, as LLM.generate's default): a
    decoding sequence whose recent tokens repeat runs up to lookup.draft_max draft tokens in the rows a step has
    left; the output is the same with or without it. Drafted / accepted tokens: metrics(). mmap: as load_model.
    pooling / embd_normalize: what embed() gives a call that names none (llama-server's --pooling and
    --embd-normalize: "mean" / "last" / "none"; 2 = L2)."""
    from .runtime.embed import check_normalize, check_pooling
    pooling, embd_normalize = check_pooling(pooling), check_normalize(embd_normalize)
    t0 = time.perf_counter()
    path = _resolve(model, lm_head, progress)
    store = open_store(path, mmap=mmap, progress=progress)
    try:
        eng = Engine(store, ctx=ctx, threads=threads, parallel=parallel, kv_pool_tokens=kv_pool_tokens,
                     max_batch_tokens=max_batch_tokens, max_queue=max_queue, kv_dtype=kv_dtype,
                     load_s=time.perf_counter() - t0, kv_pool_mib=kv_pool_mib, lookup=lookup)
    except BaseException:
        store.close()
        raise
    eng.pooling, eng.embd_normalize = pooling, embd_normalize
    return eng.start()
