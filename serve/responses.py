"""OpenAI's Responses API (`POST /v1/responses`) over the chat pipeline: the request is translated into the chat
endpoint's terms (input items -> messages, flat function tools -> chat tools, `text.format` -> the constraint),
and the answer is built back as Responses output items, whole or as its typed SSE events.

What a local one-model server cannot do is refused with a 400 naming the field, never ignored in silence:
stored state (`previous_response_id`, `conversation`, item references, `background`), built-in tools (web search,
file search, computer use, MCP, ...), images and files in the input, reasoning. Nothing is stored: the answer
says `"store": false`. The fields accepted, refused and ignored: docs/api.md.

Pure translation: no engine, no I/O. serve/app.py runs the request and feeds `ResponseBuilder`.
"""
from __future__ import annotations

import base64
import json
import re
import time
import uuid
from typing import Any, Optional, Union

from pydantic import ConfigDict, Field, field_validator, with_config
from pydantic_core import PydanticCustomError
from typing_extensions import TypedDict

from .schemas import (Metadata, NamedTool, RequestProblem, ServiceTier, ToolChoiceName, _Sampling, boolean_or_none,
                      check_openai_name, cut_short, json_text, text_of_parts)

# `include` values: what they ask for exists here (logprobs) or is vacuous (no built-in tools run, no images are
# taken: accepted, nothing to include)
INCLUDE_LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = {INCLUDE_LOGPROBS, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
              "web_search_call.action.sources", "message.input_image.image_url",
              "computer_call_output.output.image_url", "code_interpreter_call.outputs"}
# a stateless client (store false) carries its model's reasoning across turns in encrypted_content: here the
# thought's own text, wrapped (no keys, nothing stored), on each reasoning item when asked for; given back
# without its content, it is read again. One from another server (OpenAI's) cannot be read: dropped, as
# Anthropic's redacted_thinking is
ENCRYPTED_REASONING = "reasoning.encrypted_content"
SEALED = "bitnet.v1."


def seal_thought(text: str) -> str:
    return SEALED + base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii")


def open_thought(blob, where: str) -> str:
    """The thought a reasoning item's encrypted_content holds ("" when another server wrote it)."""
    if not isinstance(blob, str):
        raise RequestProblem(where, f"{where}: a string (the encrypted_content a response gave)")
    if not blob.startswith(SEALED):
        return ""
    try:
        return base64.b64decode(blob[len(SEALED):].encode("ascii"), altchars=b"-_", validate=True).decode("utf-8")
    except (ValueError, UnicodeError):   # binascii.Error is a ValueError
        raise RequestProblem(where, f"{where}: not reasoning this server wrote (send it back as it came)") from None


# request fields that need state or machinery this server does not have: (field, why) when set
REFUSED_STATE = {
    "previous_response_id": "responses are not stored here (store is false); send the whole conversation as input",
    "conversation": "conversations are not stored here; send the whole conversation as input",
    "prompt": "stored prompt templates are not supported; send instructions and input",
    "max_tool_calls": "max_tool_calls is not supported (built-in tools do not run here)",
    "context_management": "context management (compaction) needs stored responses; none are stored here",
    "moderation": "moderation is not run here",
    "image": "image options: this model takes and gives text only",
    "access_programs": "access programs are not supported here",
}
BACKGROUND_WHY = "background responses are not supported (nothing is stored to poll)"
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")   # the Responses API's text content parts


# the objects nested in a request, with OpenAI's keys: any other key is a 400 naming its dotted path
# (reasoning.foo), as an unknown top-level field is (they were ignored, and text.format's echoed back)
@with_config(ConfigDict(extra="forbid"))
class TextFormat(TypedDict, total=False):
    type: Any
    name: Any
    schema: Any
    strict: Any
    description: Any


@with_config(ConfigDict(extra="forbid"))
class TextOptions(TypedDict, total=False):
    format: Optional[TextFormat]
    verbosity: Any


@with_config(ConfigDict(extra="forbid"))
class ReasoningOptions(TypedDict, total=False):
    effort: Any
    summary: Any
    generate_summary: Any


def refused_state(fields: dict) -> tuple[str, str] | None:
    """(field, why) of the first field of a Responses request that needs state no server here has (REFUSED_STATE,
    background), else None: read from the parsed request by unsupported(), and from the raw JSON body by the
    router (serve/router.py), which so refuses it before it loads (and makes room for) a model that would too."""
    for name, why in REFUSED_STATE.items():
        if fields.get(name) is not None:
            return name, why
    if fields.get("background") is True:
        return "background", BACKGROUND_WHY
    return None


class ResponsesRequest(_Sampling):
    """The body of POST /v1/responses (OpenAI's fields; the chat endpoint's sampling extras are taken too). A field
    neither has is a 400, as OpenAI's "Unknown parameter" (a misspelt one did nothing in silence)."""
    model_config = ConfigDict(extra="forbid")

    input: Union[str, list[Any], None] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)   # 0 gave an empty output (OpenAI's minimum: 16)
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextOptions] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    chat_template_kwargs: Optional[dict[str, Any]] = None   # llama-server's extension, as on chat completions
    include: Optional[list[str]] = None
    truncation: Optional[str] = None
    reasoning: Optional[ReasoningOptions] = None
    background: Optional[bool] = None
    store: Optional[bool] = None
    metadata: Optional[Metadata] = None   # OpenAI's rule: string values (serve/schemas.py)
    previous_response_id: Optional[str] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    max_tool_calls: Optional[int] = None
    context_management: Optional[Any] = None
    moderation: Optional[Any] = None
    # hints with no meaning on one local server (its caches are automatic, the account's tiers): taken
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    safety_identifier: Optional[str] = None
    service_tier: Optional[ServiceTier] = None   # one of OpenAI's tiers
    background_options: Optional[dict[str, Any]] = None   # with background, which is refused
    image: Optional[Any] = None            # image options: 400 when set (text only)
    access_programs: Optional[Any] = None  # 400 when set

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value):
        """One message object or a number: said as what input takes (it was "Input should be a valid string",
        pydantic's word for the union's first branch)."""
        if value is None or isinstance(value, (str, list)):
            return value
        got = "an object" if isinstance(value, dict) else "a boolean" if isinstance(value, bool) else \
            "a number" if isinstance(value, (int, float)) else type(value).__name__
        raise PydanticCustomError("input_type", f"expected a string or a list of input items, got {got}")

    # -- what the chat pipeline (serve/app.py) asks of a request --
    def limit(self) -> Optional[int]:
        if self.max_output_tokens is not None:
            return self.max_output_tokens
        return self.predict_limit(None)   # llama-server's n_predict (max_tokens is refused: unsupported)

    def wants_logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or ()) or self.top_logprobs is not None

    def record_logprobs(self):
        return (self.top_logprobs or 0) if self.wants_logprobs() else None

    def format_spec(self) -> Optional[dict]:
        """text.format, checked: None for plain text."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise RequestProblem("text.format", "text.format: expected {\"type\": \"text\" | \"json_object\" | "
                                                "\"json_schema\", ...}")
        if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):   # OpenAI's 400 too
            raise RequestProblem("text.format.strict", "text.format.strict: expected a boolean")
        if fmt["type"] == "json_schema" and not isinstance(fmt.get("name"), str):   # OpenAI's 400 (and its words)
            raise RequestProblem("text.format.name", "Missing required parameter: 'text.format.name'.")
        check_openai_name(fmt.get("name"), "text.format.name")
        return None if fmt["type"] == "text" else fmt

    def constraint(self):
        from ..engine.errors import ConstraintError
        from ..engine.runtime.constraints import Constraint
        fmt = self.format_spec()
        other = super().constraint()   # the chat endpoint's extras (response_format, json_schema, grammar)
        if fmt is None:
            return other
        if other is not None:
            raise ConstraintError("give text.format or one of response_format, json_schema and grammar, not both",
                                  where=other.where)
        if fmt["type"] == "json_object":
            return Constraint.json_object(where="text.format")
        schema = fmt.get("schema")
        if not isinstance(schema, (dict, bool)):   # (a boolean is JSON Schema's true / false)
            raise ConstraintError("text.format.schema: a JSON Schema object is required for type json_schema",
                                  where="text.format.schema")
        return Constraint.json_schema(schema, where="text.format.schema")

    def unsupported(self) -> tuple[str, str] | None:
        refused = refused_state({name: getattr(self, name) for name in (*REFUSED_STATE, "background")})
        if refused:
            return refused
        if self.truncation not in (None, "disabled"):
            return "truncation", (f"truncation {json_text(self.truncation)}: only \"disabled\" (an input longer "
                                  "than the context is refused, not cut)")
        effort, reasoning = (self.reasoning or {}).get("effort"), self.reasoning or {}
        if effort not in (None, "none") or any(reasoning.get(k) is not None for k in ("summary", "generate_summary")):
            return "reasoning", ("reasoning: this model has no effort levels or summaries (a thinking template thinks "
                                 "unless effort is \"none\")")
        verbosity = (self.text or {}).get("verbosity")
        if verbosity not in (None, "medium"):
            return "text.verbosity", f"text.verbosity {json_text(verbosity)}: only \"medium\" (the model's own length)"
        for i, v in enumerate(self.include or ()):
            if v not in INCLUDABLE:
                return f"include[{i}]", f"include {json_text(v)}: unknown"
        if self.n != 1:
            return "n", "one output per response (n is not part of the Responses API)"
        if self.max_tokens is not None:   # OpenAI's 400 too (it was taken, and lost to max_output_tokens in silence)
            return "max_tokens", "max_tokens is not a Responses API field: use max_output_tokens"
        return super().unsupported()

    # -- the translation into the chat pipeline's terms --
    def messages(self) -> list[dict]:
        """instructions and input as the engine's chat messages (OpenAI chat shape); RequestProblem if an item
        cannot be given to this model."""
        out: list[dict] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if self.input is None:
            raise RequestProblem("input", "input: required (a string or a list of input items)")
        if isinstance(self.input, str):
            out.append({"role": "user", "content": self.input})
            return out
        names: dict[str, str] = {}   # call_id -> function name, for the tool results that answer them
        thought = None   # a reasoning item's text, for the assistant turn that follows it
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise RequestProblem(where, f"{where}: expected an object (a message or a function call item)")
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise RequestProblem(f"{where}.role", f"{where}.role {json_text(role)}: expected user, system, "
                                                          "developer or assistant")
                out.append({"role": "system" if role == "developer" else role,
                            "content": text_of_parts(item.get("content"), f"{where}.content", TEXT_PARTS)})
            elif kind == "function_call":
                call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
                if not (isinstance(call_id, str) and call_id and isinstance(name, str) and isinstance(args, str)):
                    raise RequestProblem(where, f"{where}: a function_call needs call_id, name and arguments "
                                                "(strings)")
                names[call_id] = name
                call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":   # the calls of one assistant turn
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                call_id = item.get("call_id")
                if not isinstance(call_id, str) or not call_id:
                    raise RequestProblem(f"{where}.call_id", f"{where}.call_id: required")
                if call_id not in names:   # OpenAI's "No tool call found for function call output with call_id"
                    raise RequestProblem(f"{where}.call_id", f"{where}.call_id {json_text(call_id)}"
                                                             ": no function_call item "
                                                             "before it has this call_id")
                msg = {"role": "tool", "tool_call_id": call_id,
                       "content": text_of_parts(item.get("output"), f"{where}.output", TEXT_PARTS)}
                if call_id in names:
                    msg["name"] = names[call_id]
                out.append(msg)
            elif kind == "reasoning":   # a thought given back: the next assistant turn's reasoning_content
                parts = item.get("content") or []
                if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
                    raise RequestProblem(f"{where}.content", f"{where}.content: a list of reasoning_text parts")
                thought = "".join(p["text"] for p in parts
                                  if p.get("type") == "reasoning_text" and isinstance(p.get("text"), str))
                if not thought and item.get("encrypted_content") is not None:
                    thought = open_thought(item["encrypted_content"], f"{where}.encrypted_content")
                continue
            elif kind == "item_reference":
                raise RequestProblem(where, f"{where}: item references need stored items (none are stored here); "
                                            "send the item itself")
            else:
                raise RequestProblem(f"{where}.type", f"{where}.type {json_text(kind)}: not supported here (messages, "
                                                      "function_call and function_call_output items are)")
            if thought is not None:   # the item after a reasoning item: its turn's, if the assistant's
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("reasoning_content", thought)
                thought = None
        if not any(m["role"] != "system" for m in out):
            raise RequestProblem("input", "input: no message to answer")
        return out

    def chat_tools(self) -> Optional[list[dict]]:
        """The function tools in the chat endpoint's shape ({"type": "function", "function": {...}})."""
        if not self.tools:
            return None
        out = []
        for i, t in enumerate(self.tools):
            if not isinstance(t, dict) or t.get("type", "function") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise RequestProblem(f"tools[{i}].type", f"tools[{i}].type {json_text(kind)}: only function tools run "
                                                         "here (built-in tools run on OpenAI's servers)")
            flat = not isinstance(t.get("function"), dict)
            if not boolean_or_none((t if flat else t["function"]).get("strict")):   # OpenAI's 400 ("yes" was taken)
                where = f"tools[{i}].strict" if flat else f"tools[{i}].function.strict"
                raise RequestProblem(where, f"{where}: expected a boolean")
            check_openai_name((t if flat else t["function"]).get("name"),
                              f"tools[{i}].name" if flat else f"tools[{i}].function.name")
            if not flat:   # the chat shape, sent here by mistake: taken as it is
                out.append(t)
                continue
            out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                          "strict") if k in t}})
        return out

    def tool_choice_name(self) -> ToolChoiceName:
        """"none" | "auto" | "required" | NamedTool(a function name) (the chat pipeline's terms)."""
        c = self.tool_choice
        if c is None:
            return "auto" if self.tools else "none"
        if isinstance(c, str):
            if c not in ("none", "auto", "required"):
                raise RequestProblem("tool_choice", f"tool_choice {json_text(c)}: expected none, auto, required or "
                                                    "{\"type\": \"function\", \"name\": ...}")
            return c
        kind = c.get("type")   # the key at fault is named (the whole object was echoed, cut mid-JSON)
        if kind == "function":
            if not isinstance(c.get("name"), str):
                raise RequestProblem("tool_choice.name", "tool_choice.name: required for type function (a string)")
            return NamedTool(c["name"])
        if kind == "allowed_tools":
            if c.get("mode") not in ("auto", "required"):
                raise RequestProblem("tool_choice.mode", f"tool_choice.mode {json_text(c.get('mode'))}: expected "
                                                         "auto or required")
            return c["mode"]
        raise RequestProblem("tool_choice", f"tool_choice.type {json_text(kind)}: expected function or "
                                            "allowed_tools (or the string none, auto or required; built-in tools "
                                            "do not run here)")

    def allowed_tools(self) -> Optional[list[str]]:
        """The function names tool_choice {"type": "allowed_tools", "mode", "tools"} lets the model call (None: all)."""
        c = self.tool_choice
        if not (isinstance(c, dict) and c.get("type") == "allowed_tools"):
            return None
        refs = c.get("tools")
        if not isinstance(refs, list) or not refs or not all(
                isinstance(r, dict) and r.get("type", "function") == "function" and isinstance(r.get("name"), str)
                for r in refs):
            raise RequestProblem("tool_choice.tools", "tool_choice.tools: a list of {\"type\": \"function\", "
                                                      "\"name\": ...}")
        return [r["name"] for r in refs]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """One response's output items, built from the answer's text as it comes (a tool-call parser splits text from
    calls): feed() / finish() return the SSE events the stream sends, and result() is the object at any point.
    The non-streaming answer is the same calls with the events dropped, so both paths give the same items."""

    def __init__(self, body: ResponsesRequest, model: str, params, parser=None, entry=None, splitter=None):
        """splitter: a thinking model's ThinkSplitter (engine/runtime/reasoning.py): its <think> block becomes a
        reasoning item (reasoning_text content), as open models' thoughts come back in this API."""
        self.body, self.model, self.params, self.parser = body, model, params, parser
        self.splitter, self.thought = splitter, None   # the reasoning item being written
        self.seal = ENCRYPTED_REASONING in (body.include or ())   # the thought also goes into encrypted_content
        self.entry = entry   # (token, TokenLogprob) -> a logprob entry; None: no logprobs asked
        self.id, self.created = _id("resp"), int(time.time())
        self.output: list[dict] = []
        self.msg: Optional[dict] = None   # the message item being written
        self.seq = 0
        self.status, self.usage, self.incomplete, self.error = "in_progress", None, None, None
        self.pending: list[dict] = []   # logprob entries of tokens whose text the parser holds back
        self.unsplit: list = []   # (token, TokenLogprob) of tokens fed while the splitter cannot yet tell thought
        # from answer
        self.unsplit_tokens = 0
        self.reasoning_tokens = 0   # tokens of the thought, its tags included (usage.output_tokens_details)

    # -- events --
    def _event(self, kind: str, **fields) -> str:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def start(self, n_prompt: int = 0) -> list[str]:
        snap = self.result()
        return [self._event("response.created", response=snap), self._event("response.in_progress", response=snap)]

    def feed(self, text: str, lps=(), n_tokens: int = 0) -> list[str]:
        """The next piece of the answer, the logprob items of its tokens and how many tokens it is. A thinking
        model's thought and its tags are no part of the message's text: their tokens are counted as reasoning
        tokens, and their logprob items left out (the first text delta carried every one of them)."""
        if self.splitter is None:
            return self._answer(text, lps)
        self.unsplit += lps
        self.unsplit_tokens += n_tokens
        reasoning, text = self.splitter.feed(text)
        ev = self._reason(reasoning)
        if self.splitter.mode == "start":
            return ev   # whitespace, or the start of a tag: thought or answer, not known yet
        lps, self.unsplit = self.unsplit, []
        n, self.unsplit_tokens = self.unsplit_tokens, 0
        if self.splitter.mode in ("think", "after"):
            self.reasoning_tokens += n
            return ev
        return ev + self._answer(text, lps)

    def _answer(self, text: str, lps=()) -> list[str]:
        """Answer text (past any thought): through the tool-call parser into the output."""
        content, calls = self.parser.feed(text) if self.parser is not None else (text, [])
        ev = self._close_thought() if content or calls else []
        return ev + self._put(content, calls, lps)

    def _reason(self, text: str) -> list[str]:
        if not text:
            return []
        ev = []
        if self.thought is None:
            self.thought = {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "in_progress",
                            "content": [{"type": "reasoning_text", "text": ""}]}
            self.output.append(self.thought)
            i = len(self.output) - 1
            # the item, then its reasoning_text part, as a message's output_text part (and OpenAI's gpt-oss server)
            ev.append(self._event("response.output_item.added", output_index=i, item={**self.thought, "content": []}))
            ev.append(self._event("response.content_part.added", item_id=self.thought["id"], output_index=i,
                                  content_index=0, part={"type": "reasoning_text", "text": ""}))
        self.thought["content"][0]["text"] += text
        ev.append(self._event("response.reasoning_text.delta", item_id=self.thought["id"],
                              output_index=self.output.index(self.thought), content_index=0, delta=text))
        return ev

    def _close_thought(self, cut: bool = False) -> list[str]:
        item, self.thought = self.thought, None
        if item is None:
            return []
        item["status"] = "incomplete" if cut else "completed"   # cut: max_output_tokens came inside the thought
        if self.seal:
            item["encrypted_content"] = seal_thought(item["content"][0]["text"])
        i = self.output.index(item)
        return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                            text=item["content"][0]["text"]),
                self._event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                            part=item["content"][0]),
                self._event("response.output_item.done", output_index=i, item=item)]

    def _put(self, content: str, calls: list[dict], lps=(), cut_call: bool = False) -> list[str]:
        ev = []
        if self.entry is not None:
            self.pending += [self.entry(t, x) for t, x in lps]
        if content:
            if self.msg is None:
                ev += self._open_message()
            part = self.msg["content"][0]
            # the tokens this text covers; the rest are of text the parser holds back (a call's start, maybe)
            n = self._covering(len(content.encode("utf-8")))
            lp, self.pending = self.pending[:n], self.pending[n:]
            part["text"] += content
            part["logprobs"] += lp
            ev.append(self._event("response.output_text.delta", item_id=self.msg["id"],
                                  output_index=len(self.output) - 1, content_index=0, delta=content, logprobs=lp))
        for c in calls:   # a call's tokens have no place for logprobs in this API: theirs are dropped
            self.pending = []
            ev += self._close_message(cut=False)
            ev += self._call(c, cut_call)
        return ev

    def _covering(self, n_bytes: int) -> int:
        """How many of the pending entries, from the first, have their tokens start within n_bytes of text."""
        k = size = 0
        while k < len(self.pending) and size < n_bytes:
            size += len(self.pending[k]["bytes"])
            k += 1
        return k

    def _open_message(self) -> list[str]:
        self.msg = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant", "content": []}
        self.output.append(self.msg)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        added = self._event("response.output_item.added", output_index=len(self.output) - 1, item=self.msg)
        self.msg["content"].append(part)
        return [added, self._event("response.content_part.added", item_id=self.msg["id"],
                                   output_index=len(self.output) - 1, content_index=0,
                                   part={**part, "logprobs": []})]

    def _close_message(self, cut: bool) -> list[str]:
        msg, self.msg = self.msg, None
        if msg is None:
            return []
        msg["status"] = "incomplete" if cut else "completed"
        i, part = self.output.index(msg), msg["content"][0]
        return [self._event("response.output_text.done", item_id=msg["id"], output_index=i, content_index=0,
                            text=part["text"], logprobs=part["logprobs"]),
                self._event("response.content_part.done", item_id=msg["id"], output_index=i, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=i, item=msg)]

    def _call(self, c: dict, cut: bool) -> list[str]:
        fn = c["function"]
        item = {"type": "function_call", "id": _id("fc"), "call_id": c["id"], "name": fn["name"], "arguments": "",
                "status": "in_progress"}
        self.output.append(item)
        i = len(self.output) - 1
        ev = [self._event("response.output_item.added", output_index=i, item=item)]   # serialized now
        item["arguments"] = fn["arguments"]
        ev.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                              delta=fn["arguments"]))
        ev.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                              name=fn["name"], arguments=fn["arguments"]))
        item["status"] = "incomplete" if cut else "completed"   # a call cut at max_output_tokens: not to be run
        ev.append(self._event("response.output_item.done", output_index=i, item=item))
        return ev

    def finish(self, final, usage: dict, cut_by: str | None = None) -> list[str]:
        """The end, from the answer's final Chunk: completed, or incomplete (max_output_tokens or the context, or a
        stop string inside a call or a text.format answer). usage: the chat pipeline's counts; cut_by: "shutdown"
        for an answer a stopping server's drain cut short, said in the last event, as OpenAI's chat stream says
        it."""
        said = {"cut_by": cut_by} if cut_by else {}
        cut = final.finish_reason in ("length", "context")
        n_cached = final.stats.n_cached if final.stats is not None else 0
        ev, thinking = [], self.splitter is not None and self.splitter.mode == "think"
        if self.splitter is not None:
            reasoning, held = self.splitter.finish()
            ev += self._reason(reasoning)
            lps, self.unsplit = self.unsplit, []
            ev += self._answer(held, lps) if held else []
        ev += self._close_thought(cut and thinking)
        rest, calls = self.parser.finish(cut) if self.parser is not None else ("", [])
        cut_call = self.parser is not None and self.parser.cut_call
        ev += self._put(rest, calls, cut_call=cut_call)
        # a call cut by a stop string: as one cut by max_output_tokens (chat's length), never to be run (an answer
        # in text.format a stop string cut is completed, as OpenAI's)
        cut = cut_short(final.finish_reason, self.parser)
        if not cut and self.msg is None and not any(o["type"] in ("message", "function_call") for o in self.output):
            ev += self._open_message()   # an empty answer (a stop string at its start) is still a message, as chat's
            #                              (one cut inside its thought is that thought alone, incomplete)
        ev += self._close_message(cut)
        self.usage = {"input_tokens": usage["prompt_tokens"],
                      "input_tokens_details": {"cached_tokens": n_cached, "cache_write_tokens": 0},
                      "output_tokens": usage["completion_tokens"],
                      "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                      "total_tokens": usage["total_tokens"]}
        if cut:
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
            return ev + [self._event("response.incomplete", response=self.result(), **said)]
        self.status = "completed"
        return ev + [self._event("response.completed", response=self.result(), **said)]

    def fail(self, message: str, status: int = 500) -> list[str]:
        """The engine failed this request's sequence (response.failed: the server goes on), or a stopping server
        ended it before it started (status 503: code "shutting_down", to retry)."""
        code = "shutting_down" if status == 503 else "server_error"
        self.status, self.error = "failed", {"code": code, "message": message}
        return [self._event("response.failed", response=self.result())]

    def result(self) -> dict:
        b = self.body
        fmt = b.format_spec() or {"type": "text"}
        reasoning = b.reasoning or {}   # as sent (effort "none" is honoured: it was echoed as null)
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": self.status,
            "completed_at": int(time.time()) if self.status == "completed" else None,
            "background": False, "error": self.error, "incomplete_details": self.incomplete,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "max_tool_calls": None,
            "model": self.model, "output": self.output,
            "parallel_tool_calls": b.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}, "store": False,
            "temperature": self.params.temperature, "top_p": self.params.top_p,
            "text": {"format": fmt, "verbosity": "medium"}, "tool_choice": b.tool_choice or "auto",
            "tools": b.tools or [], "top_logprobs": b.top_logprobs or 0, "truncation": "disabled",
            "usage": self.usage, "user": b.user, "metadata": b.metadata or {},
        }



_FLAT_TOOL = re.compile(r"\btools\[(\d+)\]\.function\.")


def responses_names(text: str | None) -> str | None:
    """`tools[1].function.name` (a chat-shaped error) as the Responses API's flat `tools[1].name`."""
    return None if text is None else _FLAT_TOOL.sub(r"tools[\1].", text)


# a client's retrieve / delete / cancel / input_items of an earlier response ((path, methods); the reason, not a bare
# 404): a model's server and the router answer them alike, under both prefixes, as POST /responses is served
STORED_RESPONSE_ROUTES = tuple((prefix + "/responses/{response_id}" + suffix, methods) for prefix in ("/v1", "")
                               for suffix, methods in (("", ["GET", "DELETE"]), ("/cancel", ["POST"]),
                                                       ("/input_items", ["GET"])))


def not_stored(response_id: str) -> str:
    return (f"response {json_text(response_id)}"
            " not found: responses are not stored here (store is false); keep the answer "
            "you got")
