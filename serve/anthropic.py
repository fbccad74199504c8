"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the chat pipeline, as
llama-server and ollama serve it (since January 2026) for Claude-compatible clients and agents: the request is
translated into the chat endpoint's terms (content blocks -> messages, `tool_use` / `tool_result` blocks -> tool
calls and results, `input_schema` tools -> chat tools, `output_config.format` -> the constraint) and the answer
built back as content blocks, whole or as the typed SSE events (message_start, content_block_start / delta /
stop, message_delta, message_stop). A final assistant message is a prefill: the answer continues it.

Extended thinking (`thinking` enabled or adaptive) lets a thinking model's template think: its <think> block becomes
a `thinking` block (with an empty `signature`: nothing here is signed), `budget_tokens` caps it (the engine's reasoning
budget), and thinking blocks sent back in the conversation are the message's `reasoning_content` for the template
(most leave earlier thoughts out; Qwen3's shows those of a tool loop after the last user message). A
model whose template does not think answers without one, as within any budget.

What this server cannot do is refused with a 400 naming the field: images and documents, effort levels, server
tools (web search, bash, text editor, computer use, MCP, code execution), containers. Errors
come back in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`). Pure translation: no engine,
no I/O; serve/app.py runs the request and feeds `MessageBuilder`. The fields: docs/api.md.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import replace
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from .limits import anthropic_error_body
from .schemas import (NamedTool, RequestProblem, ToolChoiceName, _Sampling, boolean_or_none, cut_short,
                      join_text_parts, json_text, text_of_parts)

# finish reason (engine) -> stop_reason; "tool_use" replaces end_turn when whole calls were made, and "max_tokens"
# any other where the answer was cut (a call cut by a stop sequence: schemas.cut_short; a JSON answer one cut is a
# stop_sequence, as chat's stop)
STOP_REASON = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens",
               "context": "model_context_window_exceeded", "cancelled": "end_turn"}
# the keys Anthropic's API takes in its nested objects; any other is its 400 ("Extra inputs are not permitted")
TEXT_BLOCK_KEYS = {"type", "text", "cache_control", "citations"}
# per tool_choice type (a name on type auto was ignored; none has no disable_parallel_tool_use)
TOOL_CHOICE_KEYS = {"auto": {"type", "disable_parallel_tool_use"}, "any": {"type", "disable_parallel_tool_use"},
                    "tool": {"type", "name", "disable_parallel_tool_use"}, "none": {"type"}}
FORMAT_KEYS = {"type", "schema"}   # output_config.format, output_format
NESTED_KEYS = {"metadata": {"user_id"}, "output_config": {"format", "effort"}, "output_format": FORMAT_KEYS}
# a custom tool's keys, and a tool_result block's: Anthropic's (what this server does not use is ignored)
TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control", "strict", "input_examples",
             "defer_loading", "allowed_callers", "eager_input_streaming"}
TOOL_RESULT_KEYS = {"type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"}
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")


def only_keys(value: Optional[dict], keys: set, where: str) -> None:
    """RequestProblem for a key of `value` that Anthropic's API does not have there (a misspelt one did nothing)."""
    extra = sorted(set(value or ()) - keys)
    if extra:
        raise RequestProblem(f"{where}.{extra[0]}", f"{where}.{extra[0]}: Extra inputs are not permitted")


def only_boolean(value: Any, where: str) -> None:
    """RequestProblem for a flag that is not JSON's boolean (its truthiness read "no" as true), as Anthropic's."""
    if not boolean_or_none(value):
        raise RequestProblem(where, f"{where}: Input should be a valid boolean")


def text_blocks(content, where: str) -> str:
    """A string or text blocks (system, a tool_result's content) as text, a block's keys checked as a message's
    text block's are (an unknown key inside a tool_result was ignored)."""
    if isinstance(content, list):
        for j, p in enumerate(content):
            if isinstance(p, dict) and p.get("type") == "text":
                only_keys(p, TEXT_BLOCK_KEYS, f"{where}.{j}")
    return text_of_parts(content, where, ("text",))


class _Conversation(BaseModel):
    """What /v1/messages and /v1/messages/count_tokens share: the conversation and its tools. A field the API does
    not have is a 400, as Anthropic's ("Extra inputs are not permitted"): a misspelt stop_sequence ran on in silence."""
    model_config = ConfigDict(extra="forbid")
    messages: list[Any] = Field(min_length=1)
    system: Union[str, list[Any], None] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None

    def turns(self) -> list[tuple[str, str, list[tuple[str, Any]]]]:
        """The messages as turns (role, the first message's path, [(a block's path, the block)]): consecutive
        messages of one role are one turn, their blocks in order, as Anthropic's API combines them (two user
        messages were two turns; two final assistant messages, a finished turn and a prefill of the second's
        text). RequestProblem for a message without content: only a final assistant message may be empty."""
        turns: list[tuple[str, str, list[tuple[str, Any]]]] = []
        last = len(self.messages) - 1
        for i, m in enumerate(self.messages):
            where = f"messages.{i}"
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
                raise RequestProblem(f"{where}.role", f"{where}.role: expected user or assistant")
            blocks = m.get("content")
            if isinstance(blocks, str):
                blocks = [(f"{where}.content", {"type": "text", "text": blocks})] if blocks else []
            elif isinstance(blocks, list):
                blocks = [(f"{where}.content.{j}", b) for j, b in enumerate(blocks)]
            else:
                raise RequestProblem(f"{where}.content", f"{where}.content: a string or a list of content blocks")
            if not blocks and not (i == last and m["role"] == "assistant"):
                raise RequestProblem(f"{where}.content", f"{where}: all messages must have non-empty content "
                                                         "except for the optional final assistant message")
            if turns and turns[-1][0] == m["role"]:
                turns[-1][2].extend(blocks)
            else:
                turns.append((m["role"], where, blocks))
        return turns

    def chat_messages(self) -> tuple[list[dict], str]:
        """(the engine's chat messages, the prefill: the text of a final assistant turn the answer continues);
        RequestProblem naming the block this model cannot take, or what Anthropic's API refuses."""
        out: list[dict] = []
        if self.system:
            out.append({"role": "system", "content": text_blocks(self.system, "system")})
        names: dict[str, str] = {}   # tool_use id -> tool name, for the results that answer them
        uses: set[str] = set()       # the tool_use ids of the turn just before (the only ones a result answers)
        tool_blocks = False
        for role, where, items in self.turns():
            before, uses, answered = uses, set(), set()
            texts, calls, thoughts = [], [], []
            for at, b in items:
                kind = b.get("type") if isinstance(b, dict) else None
                tool_blocks = tool_blocks or kind in ("tool_use", "tool_result")
                if kind == "text":
                    if not isinstance(b.get("text"), str):
                        raise RequestProblem(f"{at}.text", f"{at}.text: a text block needs its text (a string)")
                    only_keys(b, TEXT_BLOCK_KEYS, at)
                    # an answer's own whitespace may come back in a history; a prefill's is refused below
                    if not b["text"].strip() and not (role == "assistant" and b["text"]):
                        raise RequestProblem(f"{at}", f"{at}: text content blocks must "
                                             + ("contain non-whitespace text" if b["text"] else "be non-empty"))
                    texts.append(b["text"])
                elif kind == "thinking" and role == "assistant":   # an earlier turn's thought: the template's
                    if not isinstance(b.get("thinking"), str):               # to show (Qwen3's: in a tool loop)
                        raise RequestProblem(f"{at}.thinking", f"{at}.thinking: a thinking block needs its thinking "
                                                               "(a string)")
                    thoughts.append(b["thinking"])
                elif kind == "redacted_thinking" and role == "assistant":
                    continue   # encrypted by Anthropic: nothing here can read it
                elif kind == "tool_use" and role == "assistant":
                    if not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str)
                            and isinstance(b.get("input", {}), dict)):
                        raise RequestProblem(at, f"{at}: a tool_use block needs id, name and an input object")
                    names[b["id"]] = b["name"]
                    uses.add(b["id"])
                    calls.append({"id": b["id"], "type": "function", "function": {
                        "name": b["name"], "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}})
                elif kind == "tool_result" and role == "user":
                    use_id = b.get("tool_use_id")
                    if not isinstance(use_id, str):
                        raise RequestProblem(f"{at}.tool_use_id", f"{at}.tool_use_id: required")
                    only_keys(b, TOOL_RESULT_KEYS, at)
                    only_boolean(b.get("is_error"), f"{at}.is_error")   # "false" was an error result
                    answered.add(use_id)
                    if use_id not in before:   # Anthropic's 400: a result answers a use of the message before it
                        raise RequestProblem(f"{at}.tool_use_id", f"{at}: unexpected tool_use_id {json_text(use_id)}"
                                                                  " in a "
                                             "tool_result block: each tool_result needs a tool_use block with that "
                                             "id in the previous message")
                    content = b.get("content")
                    result = text_blocks(content, f"{at}.content")
                    if b.get("is_error"):
                        result = f"Error: {result}"
                    msg = {"role": "tool", "tool_call_id": use_id, "content": result}
                    if use_id in names:
                        msg["name"] = names[use_id]
                    out.append(msg)
                elif kind in ("tool_use", "tool_result"):
                    raise RequestProblem(f"{at}.type", f"{at}.type {json_text(kind)}: belongs in an "
                                                       f"{'assistant' if kind == 'tool_use' else 'user'} message")
                else:
                    raise RequestProblem(f"{at}.type", f"{at}.type {json_text(kind)}"
                                                       ": not supported here (text, tool_use and "
                                                       "tool_result blocks are; this model takes text only)")
            if role == "user" and before - answered:   # Anthropic's 400: a use is answered in the next turn
                raise RequestProblem(where, f"{where}: `tool_use` ids were found without `tool_result` blocks "
                                     f"immediately after: {', '.join(sorted(before - answered))}. Each `tool_use` "
                                     "block must have a corresponding `tool_result` block in the next message.")
            if texts or calls or role == "assistant":
                msg = {"role": role, "content": join_text_parts(texts)}   # a newline between blocks
                if calls:
                    msg["tool_calls"] = calls
                if thoughts:
                    msg["reasoning_content"] = "\n\n".join(thoughts)
                out.append(msg)
        prefill = ""
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant":
            if last.get("tool_calls"):
                raise RequestProblem(f"messages.{len(self.messages) - 1}", "the last message is the assistant's tool "
                                     "use: send its tool_result in a user message")
            prefill = out.pop()["content"]
            if prefill != prefill.rstrip():   # Anthropic's 400 (its models' tokens start with the space)
                raise RequestProblem("messages", "messages: final assistant content cannot end with trailing "
                                                 "whitespace")
        if tool_blocks and not self.tools:
            raise RequestProblem("tools", "Requests which include `tool_use` or `tool_result` blocks must define "
                                          "tools.")
        if not any(m["role"] != "system" for m in out):
            raise RequestProblem("messages", "messages: no user message to answer")
        return out, prefill

    def ends_in_thought(self) -> bool:
        """The final message is the assistant's with a thinking block: a prefill even without text (its thought
        would be lost, as a prefill's is)."""
        last = self.messages[-1] if self.messages else None
        blocks = last.get("content") if isinstance(last, dict) and last.get("role") == "assistant" else None
        return isinstance(blocks, list) and any(
            isinstance(b, dict) and b.get("type") in ("thinking", "redacted_thinking") for b in blocks)

    def check_thinking(self) -> bool:
        """Whether `thinking` is on; RequestProblem for a malformed one, or one with a forced tool use (Anthropic's
        400; /v1/messages and count_tokens alike)."""
        on = self.thinking_budget() is not None
        if on and (self.tool_choice or {}).get("type") in ("any", "tool"):
            raise RequestProblem("thinking", "thinking may not be enabled when tool_choice forces tool use (as "
                                             "Anthropic's API)")
        return on

    def chat_tools(self) -> Optional[list[dict]]:
        if not self.tools:
            return None
        out = []
        for i, t in enumerate(self.tools):
            kind = t.get("type", "custom") if isinstance(t, dict) else None
            if kind != "custom":
                raise RequestProblem(f"tools.{i}", f"tools.{i}: only custom tools ({{name, description, "
                                     f"input_schema}}) run here, not {json_text(kind)}"
                                     " (server tools run on Anthropic's)")
            only_keys(t, TOOL_KEYS, f"tools.{i}")   # an unknown key was ignored
            # a custom tool's own fields, as Anthropic's API names them (a missing name was blamed on the type)
            if not isinstance(t.get("name"), str):
                raise RequestProblem(f"tools.{i}.name", f"tools.{i}.name: required (a string)")
            if not TOOL_NAME.fullmatch(t["name"]):   # Anthropic's pattern (a call to "f f!" cannot be written back)
                raise RequestProblem(f"tools.{i}.name", f"tools.{i}.name: String should match pattern "
                                     f"'^{TOOL_NAME.pattern}$'")
            only_boolean(t.get("strict"), f"tools.{i}.strict")   # Anthropic's 400 ("yes" was taken, and dropped)
            if not isinstance(t.get("input_schema"), dict):
                raise RequestProblem(f"tools.{i}.input_schema", f"tools.{i}.input_schema: required (a JSON Schema "
                                     "object; {\"type\": \"object\"} for a tool without arguments)")
            # a description left out stays out (an empty one wrote "description": "" into the prompt: other tokens
            # than the chat endpoint's); the keys in the chat shape's order, which the template renders as they come
            fn = {"name": t["name"], **({"description": t["description"]} if t.get("description") is not None else {}),
                  "parameters": t["input_schema"]}
            out.append({"type": "function", "function": fn})
        return out

    def tool_choice_name(self) -> ToolChoiceName:
        """"none" | "auto" | "required" (type any) | NamedTool(a function name: type tool)."""
        c = self.tool_choice or {"type": "auto"}
        kind = c.get("type")
        if kind not in TOOL_CHOICE_KEYS:
            raise RequestProblem("tool_choice.type", f"tool_choice.type {json_text(kind)}"
                                                     ": expected auto, any, tool or none")
        only_keys(c, TOOL_CHOICE_KEYS[kind], "tool_choice")
        # JSON's boolean: "no" was read as true (parallel calls off)
        only_boolean(c.get("disable_parallel_tool_use"), "tool_choice.disable_parallel_tool_use")
        if kind == "tool":
            if not isinstance(c.get("name"), str):
                raise RequestProblem("tool_choice.name", "tool_choice.name: required for type tool")
            return NamedTool(c["name"])
        return {"auto": "auto" if self.tools else "none", "any": "required", "none": "none"}[kind]

    @property
    def parallel_tool_calls(self) -> bool:
        return not (self.tool_choice or {}).get("disable_parallel_tool_use", False)

    @property
    def named_parallel_calls(self) -> bool:
        """A type tool choice may make several calls of its tool only when disable_parallel_tool_use: false is
        sent (Anthropic documents the flag on that type); left out, the forced tool is one call, as OpenAI's named
        choice (several copies of one forced call ran a small model to max_tokens)."""
        return (self.tool_choice or {}).get("disable_parallel_tool_use") is False

    def thinking_budget(self) -> int | None:
        """-> None: thinking off (absent or disabled); -1: on without a budget (adaptive); N: on, at most N tokens.
        RequestProblem for a malformed `thinking`."""
        t = self.thinking
        if t is None:
            return None
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "disabled":
            return None
        if kind not in ("enabled", "adaptive"):
            raise RequestProblem("thinking.type", f"thinking.type {json_text(kind)}"
                                                  ": expected enabled, adaptive or disabled")
        if t.get("display", "summarized") not in ("summarized", "omitted"):
            raise RequestProblem("thinking.display", f"thinking.display {json_text(t.get('display'))}"
                                                     ": expected summarized or "
                                                     "omitted")
        budget = t.get("budget_tokens")
        if kind == "adaptive":
            if budget is not None:
                raise RequestProblem("thinking.budget_tokens", "thinking.budget_tokens: not taken with type adaptive "
                                                              "(the model decides how long it thinks)")
            return -1
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise RequestProblem("thinking.budget_tokens", f"thinking.budget_tokens {json_text(budget)}"
                                                           ": required with type "
                                                          "enabled, an integer >= 0")
        return budget



class MessagesRequest(_Conversation, _Sampling):
    """The body of POST /v1/messages (Anthropic's fields; the chat endpoint's sampling extras too); any other, a 400."""
    model_config = ConfigDict(extra="forbid")   # over _Sampling's (the chat endpoint ignores unknown fields)
    MAX_TEMPERATURE: ClassVar[Optional[float]] = 1.0   # Anthropic's range
    FORCED_CALL_FORMAT: ClassVar[str] = "refuse"
    model: str   # required, as Anthropic's API (the chat endpoint's is optional); any name is this model's
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = None
    output_config: Optional[dict[str, Any]] = None
    container: Optional[Any] = None
    mcp_servers: Optional[Any] = None
    context_management: Optional[dict[str, Any]] = None
    output_format: Optional[dict[str, Any]] = None   # the structured-outputs beta's name of output_config.format
    speed: Optional[str] = None   # "standard" (this machine's own speed); "fast" 400
    chat_template_kwargs: Optional[dict[str, Any]] = None   # llama-server's extension, as on chat completions
    # hints with no meaning on one local server (the account's, its caches, its regions): taken, as the API takes them
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[Literal["auto", "standard_only"]] = None
    cache_control: Optional[dict[str, Any]] = None   # the prefix cache is automatic here
    inference_geo: Optional[str] = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None
    diagnostics: Optional[dict[str, Any]] = None

    @field_validator("metadata", "output_config", "output_format")
    @classmethod
    def _known_keys(cls, value, info: ValidationInfo):
        """A key Anthropic's API does not have in the object is its 400, as at the top (metadata.foo was taken;
        output_config.format.name too)."""
        try:
            only_keys(value, NESTED_KEYS[info.field_name], info.field_name)
            fmt = (value or {}).get("format") if info.field_name == "output_config" else None
            if isinstance(fmt, dict):
                only_keys(fmt, FORMAT_KEYS, "output_config.format")
        except RequestProblem as e:
            raise PydanticCustomError("invalid_setting", "{message}", {"message": str(e)}) from None
        return value

    @field_validator("stop_sequences")
    @classmethod
    def _no_empty_stop(cls, value):
        """An empty stop sequence is Anthropic's 400 (it was dropped in silence)."""
        if value and any(not s for s in value):
            raise PydanticCustomError("invalid_setting", "stop_sequences: each stop sequence must be non-empty")
        return value

    def limit(self) -> Optional[int]:
        return self.max_tokens

    def sampling_params(self, defaults=None):
        """The chat pipeline's, with thinking.budget_tokens as the reasoning budget."""
        params = super().sampling_params(defaults)
        budget = self.thinking_budget()
        if budget is not None and budget >= 0:
            params = replace(params, reasoning_budget=budget)
        return params

    def stop_entries(self) -> list[str]:
        return (self.stop_sequences or []) + super().stop_entries()

    def format_spec(self) -> Optional[dict]:
        fmt, where = (self.output_config or {}).get("format"), "output_config.format"
        if self.output_format is not None:   # the beta's field (anthropic-beta: structured-outputs-2025-11-13)
            if fmt is not None:
                raise RequestProblem("output_format", "give output_config.format or output_format, not both")
            fmt, where = self.output_format, "output_format"
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise RequestProblem(where, f"{where}: {{\"type\": \"json_schema\", \"schema\": {{...}}}}")
        return dict(fmt, where=where)

    def constraint(self):
        from ..engine.errors import ConstraintError
        from ..engine.runtime.constraints import Constraint
        fmt, other = self.format_spec(), super().constraint()
        if fmt is None:
            return other
        if other is not None:
            raise ConstraintError("give output_config.format or one of response_format, json_schema and grammar",
                                  where=other.where)
        return Constraint.json_schema(fmt["schema"], where=fmt["where"] + ".schema")

    def unsupported(self) -> tuple[str, str] | None:
        try:
            self.check_thinking()
        except RequestProblem as e:
            return e.param, str(e)
        if (self.output_config or {}).get("effort") is not None:
            return "output_config.effort", "effort levels are not supported (this model has no reasoning mode)"
        if self.container is not None:
            return "container", "code execution containers are not supported"
        if self.mcp_servers:
            return "mcp_servers", "MCP servers are not supported here (give their tools as custom tools)"
        if (self.context_management or {}).get("edits"):
            return "context_management", "context editing is not supported (the conversation runs as sent)"
        if self.n != 1:
            return "n", "one answer per message (n is not part of the Messages API)"
        if self.speed not in (None, "standard"):
            return "speed", f"speed {json_text(self.speed)}: only \"standard\" (this machine's own speed)"
        return super().unsupported()


# the chat pipeline's names of a request's parts -> Anthropic's (an error names what the client sent)
_CHAT_NAMES = [(re.compile(r"\btools\[(\d+)\]\.function\.parameters"), r"tools.\1.input_schema"),
               (re.compile(r"\btools\[(\d+)\]\.function\.name"), r"tools.\1.name"),
               (re.compile(r"\btools\[(\d+)\]"), r"tools.\1")]


def anthropic_names(text: str | None) -> str | None:
    """`tools[0].function.parameters` (a chat-shaped error) as Anthropic's `tools.0.input_schema`."""
    if text is None:
        return None
    for pattern, name in _CHAT_NAMES:
        text = pattern.sub(name, text)
    return text


class CountTokensRequest(MessagesRequest):
    """count_tokens' body: a message's (clients count the body they will send; its generation fields change
    nothing in the count), max_tokens optional; a field neither has is a 400."""
    max_tokens: Optional[int] = Field(default=None, ge=1)


class MessageBuilder:
    """One answer's content blocks, built from its text as it comes (a tool-call parser splits text from calls):
    feed() / finish() return the SSE events the stream sends, result() the whole answer. The non-streaming answer
    is the same calls with the events dropped."""

    def __init__(self, model: str, parser=None, splitter=None, thinking: str | None = None):
        """splitter: a thinking model's ThinkSplitter (engine/runtime/reasoning.py); thinking: where its <think>
        block goes -- None: left out (thinking off), "summarized": a thinking block, "omitted": the block, empty."""
        self.model, self.parser, self.splitter, self.thinking = model, parser, splitter, thinking
        self.id = f"msg_{uuid.uuid4().hex}"
        self.content: list[dict] = []
        self.open_text = False   # the last block is text still being written
        self.open_thought = False   # the last block is a thinking block still being written
        self.stop_reason = self.stop_sequence = None
        self.usage = {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": 0}

    @staticmethod
    def _event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"

    def start(self, n_prompt: int) -> list[str]:
        self.usage["input_tokens"] = n_prompt
        head = {**self.result(), "content": [], "stop_reason": None}
        return [self._event("message_start", message=head), self._event("ping")]

    def feed(self, text: str, lps=(), n_tokens: int = 0) -> list[str]:   # logprobs: none in this API
        if self.splitter is None:
            return self._answer(text)
        reasoning, text = self.splitter.feed(text)
        return self._think(reasoning) + self._answer(text)

    def _think(self, reasoning: str) -> list[str]:
        if not reasoning or self.thinking is None:
            return []
        ev = []
        if not self.open_thought:   # the splitter gives the whole thought before any of the answer
            self.content.append({"type": "thinking", "thinking": "", "signature": ""})
            self.open_thought = True
            ev.append(self._event("content_block_start", index=len(self.content) - 1,
                                  content_block={"type": "thinking", "thinking": "", "signature": ""}))
        if self.thinking == "summarized":
            self.content[-1]["thinking"] += reasoning
            ev.append(self._event("content_block_delta", index=len(self.content) - 1,
                                  delta={"type": "thinking_delta", "thinking": reasoning}))
        return ev

    def _close_thought(self) -> list[str]:
        """The end of the thinking block: its signature (empty: a local model's thought is not signed), as the
        Anthropic SDK's stream accumulator expects before the block stops."""
        if not self.open_thought:
            return []
        self.open_thought = False
        i = len(self.content) - 1
        return [self._event("content_block_delta", index=i, delta={"type": "signature_delta", "signature": ""}),
                self._event("content_block_stop", index=i)]

    def _answer(self, text: str) -> list[str]:
        content, calls = self.parser.feed(text) if self.parser is not None else (text, [])
        return self._put(content, calls)

    def _put(self, content: str, calls: list[dict]) -> list[str]:
        ev = self._close_thought() if content or calls else []
        if content:
            if not self.open_text:
                self.content.append({"type": "text", "text": ""})
                self.open_text = True
                ev.append(self._event("content_block_start", index=len(self.content) - 1,
                                      content_block={"type": "text", "text": ""}))
            self.content[-1]["text"] += content
            ev.append(self._event("content_block_delta", index=len(self.content) - 1,
                                  delta={"type": "text_delta", "text": content}))
        for c in calls:
            fn = c["function"]
            try:
                args = json.loads(fn["arguments"])
            except ValueError:   # a call cut (max_tokens, a stop sequence): its arguments so far are no object
                args = None
            if not fn["name"] or not isinstance(args, dict):   # a cut call: no tool_use claiming input it never
                continue                                        # had (it showed {} for a call cut mid-arguments)
            ev += self._close_text()
            block = {"type": "tool_use", "id": "toolu_" + c["id"].split("_", 1)[-1], "name": fn["name"],
                     "input": args}
            self.content.append(block)
            i = len(self.content) - 1
            ev.append(self._event("content_block_start", index=i, content_block={**block, "input": {}}))
            ev.append(self._event("content_block_delta", index=i,
                                  delta={"type": "input_json_delta", "partial_json": json.dumps(args)}))
            ev.append(self._event("content_block_stop", index=i))
        return ev

    def _close_text(self) -> list[str]:
        if not self.open_text:
            return []
        self.open_text = False
        return [self._event("content_block_stop", index=len(self.content) - 1)]

    def finish(self, final, usage: dict, cut_by: str | None = None) -> list[str]:
        """The end, from the answer's final Chunk (its reason and Stats); usage: the chat pipeline's counts;
        cut_by: "shutdown" for an answer a stopping server's drain cut short, said in the last event
        (message_stop), as OpenAI's stream says it."""
        finish_reason, st = final.finish_reason, final.stats
        n_generated, n_cached = usage["completion_tokens"], st.n_cached if st is not None else 0
        stop_word = st.stop_word if st is not None else None
        cut = finish_reason in ("length", "context")
        thought, held = self.splitter.finish() if self.splitter is not None else ("", "")
        ev = self._think(thought) + self._close_thought()
        ev += self._answer(held) if held else []
        rest, calls = self.parser.finish(cut) if self.parser is not None else ("", [])
        ev += self._put(rest, calls) + self._close_text()
        reason = STOP_REASON.get(finish_reason, "end_turn")
        called = any(b["type"] == "tool_use" for b in self.content)
        if reason in ("end_turn", "stop_sequence") and cut_short(finish_reason, self.parser):
            reason = "max_tokens"   # a call a stop sequence cut: may be cut, never to run
        if reason == "end_turn" and called:
            reason = "tool_use"
        self.stop_reason, self.stop_sequence = reason, stop_word if reason == "stop_sequence" else None
        # Anthropic's input_tokens leaves out the cached part (clients add input, cache read and cache creation
        # for the prompt's size); message_start, sent before the cache is known, said the whole prompt, and
        # message_delta's counts are totals that replace it
        u = self.usage
        u["input_tokens"], u["cache_read_input_tokens"] = u["input_tokens"] - n_cached, n_cached
        u["output_tokens"] = n_generated
        return ev + [self._event("message_delta", delta={"stop_reason": self.stop_reason,
                                                         "stop_sequence": self.stop_sequence},
                                 usage={k: u[k] for k in ("input_tokens", "cache_read_input_tokens",
                                                          "output_tokens")}),
                     self._event("message_stop", **({"cut_by": cut_by} if cut_by else {}))]

    def fail(self, message: str, status: int = 500) -> list[str]:
        return [self._event("error", error=anthropic_error_body(status, message)["error"])]

    def result(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.content,
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence, "usage": dict(self.usage)}
