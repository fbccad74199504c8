"""Tool (function) calling: how a model family writes a call, the grammar that makes it write a valid one, and
the parser that turns its text back into calls.

    fmt = tool_format(template)                       # from the model's chat template
    messages, tools_arg = fmt.prepare(messages, tools) # the tool list reaches the model through its template
    spec = fmt.constraint(tools, choice, parallel)     # "required" / a named function: every call is valid
    spec = fmt.constraint(tools, "auto", parallel, llm.answer_thought(prompt_ids))   # a thought may name calls
    # tools: OpenAI's list ([{"type": "function", "function": {...}}]) or functions_from_tools(tools)'s Functions
    parser = fmt.parser(); parser.feed(text) -> (content, calls); parser.finish(cut) -> (content, calls)

Formats:
  hermes       <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block per call: Qwen3, Ternary
               Bonsai, Hermes-style templates, and the default for templates that know nothing of tools (they
               get DEFAULT_SYSTEM_BLOCK in the system message, as llama-server's generic format does)
  hermes_list  <tool_call>\n[{"name": ..., "arguments": {...}}, ...]\n</tool_call>, one block holding a list of
               calls: Falcon3's template
  llama3_json  {"name": ..., "parameters": {...}}: Llama-3.x templates that render `tools` themselves (one call
               an answer: their templates refuse to render two in the history)
A template that renders `tools` in a format none of these is (Mistral's [TOOL_CALLS], MiniCPM's <function ...>,
Qwen3-Coder's <tool_call><function=...>, GLM's <tool_call>name<arg_key>..., Functionary's, Command-R's) is treated
as one that knows nothing of tools, so the prompt and the grammar agree on hermes. The grammar holds a call's JSON
to the separators the templates write (", ", ": ").
A call's arguments are constrained by its function's JSON Schema (engine/runtime/constraints.py); with
tool_choice "auto" the model may answer in text, or write text (a thought, a <think> block) and then calls; once
it opens a call the rest is constrained; a thinking template's thought (split off the answer) may name calls, which
are thought, not calls.
A call cut off by max_tokens or the context comes back as a call with the name and arguments written so far
(partial_call), never as template text in the content; the finish reason (length) says it is not to be run.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace

from ..errors import BitNetError, ConstraintError, json_text
from .constraints import Constraint, check, prepared, rebased

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
DEFAULT_SYSTEM_BLOCK = (
    "You can call these tools (each line: a function, its description and the JSON Schema of its arguments):\n"
    "{tools}\n"
    "To call a tool, answer with one block per call and nothing else:\n"
    "<tool_call>\n{{\"name\": \"<function name>\", \"arguments\": {{<the arguments as JSON>}}}}\n</tool_call>\n"
    "A tool's result comes back in <tool_response></tool_response>. If no tool is needed, answer normally.")
# no room for endless whitespace, and the separators of the calls the templates show and render (Jinja's tojson,
# Python's json.dumps: ", " and ": "), not constraints.JSON_OPTIONS' compact ones: a model is held to the text its
# prompt and history taught it
CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict


def functions_from_tools(tools: list[dict], where: str = "tools") -> list[Function]:
    """OpenAI's / ollama's `tools` ([{"type": "function", "function": {name, description, parameters}}]) checked:
    names unique and non-empty, parameters a JSON Schema of objects (its type "object" or not given, then taken as
    "object"; a top-level anyOf/oneOf with a branch that cannot be one is refused) that can be enforced (refused
    naming the tool)."""
    if not isinstance(tools, (list, tuple)):
        raise ConstraintError(f"{where}: a list of {{\"type\": \"function\", \"function\": {{...}}}}, not "
                              f"{type(tools).__name__}", where=where)
    out, seen = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ConstraintError(f"{where}[{i}]: expected {{\"type\": \"function\", \"function\": {{...}}}}",
                                  where=f"{where}[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not name or name in seen:
            raise ConstraintError(f"{where}[{i}].function.name: a non-empty name, unique among the tools",
                                  where=f"{where}[{i}].function.name")
        seen.add(name)
        params = fn.get("parameters")
        params = {"type": "object", "properties": {}} if params is None else params
        if not isinstance(params, dict):
            raise ConstraintError(f"{where}[{i}].function.parameters: must be a JSON Schema object",
                                  where=f"{where}[{i}].function.parameters")
        kind = params.get("type", "object")
        if kind != "object" and kind != ["object"]:
            # a call's arguments are an object (OpenAI and Anthropic refuse other tools too); a string's or a
            # list's arguments reached the client as a JSON string, and Anthropic's tool_use input as {}
            raise ConstraintError(f"{where}[{i}].function.parameters: must be a JSON Schema of type \"object\" (a "
                                  f"call's arguments are an object), not {json.dumps(kind, default=str)[:60]}",
                                  where=f"{where}[{i}].function.parameters")
        for key in ("anyOf", "oneOf"):   # a branch that is no object's would be dropped unsaid: refused instead
            branches = params.get(key)
            bad = next((j for j, b in enumerate(branches) if not _may_be_object(b)), None) \
                if isinstance(branches, list) else None
            if bad is not None:
                raise ConstraintError(f"{where}[{i}].function.parameters: {key}[{bad}] cannot be an object (a "
                                      "call's arguments are an object)", where=f"{where}[{i}].function.parameters")
        # the type said, not just checked: without it the grammar took any JSON value ("0", a number) as arguments
        out.append(Function(name, str(fn.get("description") or ""), {**params, "type": "object"}))
    return out


class MessageError(BitNetError):
    """A chat message whose tool calls or tool result cannot be rendered as given (the server's 400); where: the
    field (messages[1].tool_calls[0].function)."""

    def __init__(self, message: str, *, where: str, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.where = where


CALL_SHAPE = "{'type': 'function', 'function': {'name': ..., 'arguments': ...}}"


def checked_calls(m: dict, where: str) -> dict:
    """A message (its role checked) with its calls checked as the server checks them: tool_calls and function_call
    only on an assistant message, not both; each call OpenAI's shape or transformers' flat {"name", "arguments"},
    its name a str, its arguments JSON text (as written: a call cut at max_tokens comes back so) or a dict, its
    type "function", its id a str. An assistant's function_call (OpenAI's deprecated single call) becomes its
    one tool call, as the server takes it. MessageError naming the field, else the message to render."""
    role = m["role"]
    for key in ("tool_calls", "function_call"):
        if m.get(key) is not None and role != "assistant":
            raise MessageError(f"{where}.{key}: only an assistant message has one, not a {role} message",
                               where=f"{where}.{key}")
    legacy = m.get("function_call")
    if legacy is not None:
        if m.get("tool_calls"):
            raise MessageError(f"{where}.function_call is the deprecated form of tool_calls: give one of them",
                               where=f"{where}.function_call")
        _checked_function(legacy, f"{where}.function_call")
        rest = {k: v for k, v in m.items() if k != "function_call"}
        return {**rest, "tool_calls": [{"id": None, "type": "function", "function": legacy}]}
    calls = m.get("tool_calls")
    if calls is None:
        return m
    if not isinstance(calls, (list, tuple)):
        raise MessageError(f"{where}.tool_calls: a list of calls {CALL_SHAPE}, not {calls!r:.60}",
                           where=f"{where}.tool_calls")
    for j, c in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(c, dict) or not ("function" in c or "name" in c):
            raise MessageError(f"{at}: a call {CALL_SHAPE}, not {c!r:.60}", where=at)
        if c.get("type", "function") != "function":
            raise MessageError(f"{at}.type {c['type']!r:.40}: 'function' (the one kind of call)", where=f"{at}.type")
        if c.get("id") is not None and not isinstance(c["id"], str):
            raise MessageError(f"{at}.id: the call's id (str), not {type(c['id']).__name__}", where=f"{at}.id")
        _checked_function(c["function"] if "function" in c else c, f"{at}.function" if "function" in c else at)
    return m


def _checked_function(f, at: str) -> None:
    """MessageError unless `f` is a call's function: a name (str) and arguments (JSON text or a dict) if any."""
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise MessageError(f"{at}: a function call {{'name': str, 'arguments': ...}}, not {f!r:.60}", where=at)
    args = f.get("arguments")
    if args is not None and not isinstance(args, (str, dict)):
        raise MessageError(f"{at}.arguments: the arguments as JSON text (str) or a dict, not {args!r:.40}",
                           where=f"{at}.arguments")


def check_tool_results(messages: list[dict]) -> None:
    """MessageError (OpenAI's 400s, in its words, as the server answers them) for a tool message without a
    tool_call_id, with no assistant tool_calls before it, or answering an id none of those calls has: such a
    result was rendered as an answer to no call. Calls never answered are taken (clients send those
    mid-conversation); calls sent without ids cannot be matched, so then any id is taken."""
    ids: set = set()
    called = False
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if calls:
            called = True
            ids |= {c.get("id") for c in calls}
        if m.get("role") != "tool":
            continue
        where, call_id = f"messages[{i}].tool_call_id", m.get("tool_call_id")
        if call_id is None:
            raise MessageError(f"Missing required parameter '{where}'.", where=where)
        if not isinstance(call_id, str):
            raise MessageError(f"{where}: the id (str) of the call it answers, not {type(call_id).__name__}",
                               where=where)
        if not called:
            raise MessageError(f"{where}: messages with role 'tool' must be a response to a preceding message with "
                               "'tool_calls'", where=where)
        if None not in ids and call_id not in ids:
            raise MessageError(f"{where} {json_text(call_id)}: no earlier assistant message has a tool call with "
                               "that id", where=where)


def _functions(tools) -> list[Function]:
    """ToolFormat.constraint's functions: Functions, or OpenAI's tool list (checked by functions_from_tools)."""
    if isinstance(tools, (list, tuple)) and all(isinstance(f, Function) for f in tools):
        return list(tools)
    if isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools):
        return functions_from_tools(tools)
    raise ConstraintError("tools: a list of OpenAI-style tools ({\"type\": \"function\", ...}) or of "
                          "functions_from_tools(tools)'s Functions, not a mix nor "
                          f"{type(tools).__name__ if not isinstance(tools, (list, tuple)) else 'other items'}",
                          where="tools")


def _may_be_object(schema) -> bool:
    """Whether a schema branch admits an object at all (its type, const or enum says not)."""
    if schema is False:
        return False
    if not isinstance(schema, dict):
        return True
    kind = schema.get("type")
    if isinstance(kind, str) and kind != "object" or isinstance(kind, list) and "object" not in kind:
        return False
    if "const" in schema and not isinstance(schema["const"], dict):
        return False
    enum = schema.get("enum")
    return not (isinstance(enum, list) and not any(isinstance(v, dict) for v in enum))


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolFormat:
    name = "hermes"

    def __init__(self, template_renders_tools: bool):
        self.template_renders_tools = template_renders_tools

    # ---- the prompt -----------------------------------------------------------------------------------
    def prepare(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
        """Messages for the template (assistant tool calls and tool results in a form it renders), and the
        `tools` argument to give it (None when the template has no tool support: the list goes into the
        system message instead)."""
        if self.template_renders_tools:
            return [_native(m) for m in messages], tools
        out: list[dict] = []
        names = {c.get("id"): c.get("function", c).get("name") for m in messages if m["role"] == "assistant"
                 for c in m.get("tool_calls") or () if isinstance(c, dict) and c.get("id") is not None}
        for i, m in enumerate(messages):
            text = self._as_text(m, names.get(m.get("tool_call_id")) or m.get("name"))
            if m["role"] == "tool" and i and messages[i - 1]["role"] == "tool":   # one turn for a turn's results:
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text["content"]}   # templates that
                continue                                                                   # alternate roles
            out.append(text)
        if tools:
            lines = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
            block = DEFAULT_SYSTEM_BLOCK.format(tools=lines)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + block}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out, None

    def call_text(self, name: str, arguments) -> str:
        return f"{HERMES_OPEN}\n{_call_json(name, 'arguments', arguments)}\n{HERMES_CLOSE}"

    def _as_text(self, m: dict, answers: str | None = None) -> dict:
        """answers: for a tool result, the name of the function whose call it answers (from the call its
        tool_call_id names): the result says it, as Hermes-2-Pro's {"name", "content"}, so results sent back in
        another order than the calls still reach the model as answers to the right functions."""
        role, content = m["role"], m.get("content") or ""
        # an assistant's earlier thought (llama-server's reasoning_content) and a message's other keys stay for the
        # template to show or leave out
        if role == "assistant" and m.get("tool_calls"):
            fns = [c.get("function", c) for c in m["tool_calls"]]   # OpenAI's shape, or {"name", "arguments"}
            calls = "\n".join(self.call_text(f["name"], f.get("arguments") or "{}") for f in fns)
            rest = {k: v for k, v in m.items() if k != "tool_calls"}   # the calls are in the text now
            return {**rest, "content": (content + "\n" if content else "") + calls}
        if role == "tool":
            if isinstance(answers, str) and answers:
                content = json.dumps({"name": answers, "content": content}, ensure_ascii=False)
            return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        return {**m, "content": content}   # every other key as given (a `name`, ...), as transformers passes them

    # ---- the grammar ----------------------------------------------------------------------------------
    ARGS = "arguments"   # the call object's key for the arguments

    def _call_schema(self, functions: list[Function]) -> dict:
        """One schema for a call of any of `functions`; each tool's parameters sit under the call's ARGS key,
        their own references ("#/$defs/...", "#") moved there."""
        def at(i):
            return ("/oneOf/%d" % i if len(functions) > 1 else "") + "/properties/" + self.ARGS

        one = [{"type": "object", "additionalProperties": False, "required": ["name", self.ARGS],
                "properties": {"name": {"const": f.name}, self.ARGS: rebased(prepared(f.parameters, f"tools: {f.name}"), at(i))}}
               for i, f in enumerate(functions)]
        return {"x-guidance": CALL_JSON, **({"oneOf": one} if len(one) > 1 else one[0])}

    def _call_rule(self, functions, parallel: bool, thought: str | None = None) -> str:
        """`call`: one block; `tail`: what follows its opening tag (thought: _auto_rule's LEAD takes it)."""
        return (f'call: "{HERMES_OPEN}" tail\n'
                f'tail: "\\n" body "\\n{HERMES_CLOSE}"\n'
                f"body: %json {json.dumps(self._call_schema(functions), ensure_ascii=False)}\n")

    def _calls_rule(self, parallel: bool) -> str:
        return 'calls: call ("\\n" call)*\n' if parallel else "calls: call\n"

    def _text_rule(self, thought: str | None = None) -> str:
        """Free text that never opens a call (so a call, once begun, is constrained); with a thought, the thought
        may say anything (the tag too: it is no call) and the text after it opens none."""
        tag = _regex_escape(HERMES_OPEN)
        if thought is None:
            return f"TEXT: /(?s:.+)/ & ~/(?s:.*{tag}.*)/\n"
        rules = _thought_rules(thought) + f"NO_CALL: /(?s:.*)/ & ~/(?s:.*{tag}.*)/\n"
        if thought == "open":   # still inside the prompt's thought (never closed: all reasoning), or past it
            return rules + 'TEXT: (/(?s:.+)/ & THINK_BODY) | THINK_BODY "</think>" NO_CALL\n'
        return rules + "TEXT: (/(?s:.+)/ & NO_CALL) | THINK NO_CALL | THINK_OPEN THINK_BODY\n"

    def _auto_rule(self, parallel: bool, thought: str | None = None) -> str:
        """tool_choice auto: text alone, or text (maybe none) up to the first opening tag -- one lexeme, so the
        lexer never has to take back the start of a tag it read as text -- then that call's tail and any others.
        With a thought (_thought_rules), the first tag after it: one the thought names is no call (it was forced
        into a call's JSON, and after it only the end, so the thought never closed and no call came)."""
        tag = _regex_escape(HERMES_OPEN)
        more = ' ("\\n" call)*' if parallel else ""
        if thought is None:
            lead = f"LEAD: /(?s:.*{tag})/ & ~/(?s:.*{tag}.+)/\n"
        elif thought == "open":   # the thought must close first
            lead = f'LEAD: THINK_BODY "</think>" NO_CALL "{HERMES_OPEN}"\n'
        else:   # no thought, or a whole one first; a thought left open opens no call
            lead = f'LEAD: (NO_CALL "{HERMES_OPEN}" & ~/(?s:\\s*<think>.*)/) | THINK NO_CALL "{HERMES_OPEN}"\n'
        return f"start: TEXT | LEAD tail{more}\n" + self._text_rule(thought) + lead

    def constraint(self, functions: list[Function] | list[dict], choice: str, parallel: bool,
                   thought: str | None = None, checked: bool = False, *, named: bool = False) -> Constraint | None:
        """functions: functions_from_tools(tools)'s, or OpenAI's tool list itself. choice: "auto" | "required" | a
        function name ("none": no constraint, no tools); anything else is a ConstraintError naming the functions.
        named: choice is a function's name, never a mode (a tool may be named "auto", "required" or "none").
        thought (choice auto): where the answer stands with a <think> block its splitter takes out (engine api's
        answer_thought): None, the template does not think (or the thought is not split off: <think> is text); "may",
        the answer may open with one; "open", the prompt opened it. Text before a call may then hold the whole
        thought. checked: an earlier call for the same functions checked each schema (~2 ms a tool): the request's
        first, made before its prompt is rendered, and this one once the prompt says where the thought stands."""
        functions = _functions(functions)
        names = ", ".join(f.name for f in functions) or "none given"
        mode = None if named or choice not in ("none", "auto", "required") else choice   # None: a named function
        if mode is None and not any(f.name == choice for f in functions):
            # the filter below would leave no function, and the grammar's schema an IndexError
            what = "no function of that name among the" if named else \
                "not 'auto', 'required', 'none' nor a function of the"
            raise ConstraintError(f"tool_choice {choice!r}: {what} tools ({names})", where="tool_choice")
        if parallel not in (True, False):   # "no" was taken as true: several calls allowed
            raise ConstraintError(f"parallel {parallel!r:.40}: True or False (several calls in one answer, or one)",
                                  where="parallel")
        if mode == "none" or not functions:
            return None
        for i, f in enumerate([] if checked else functions):   # each tool's schema alone first: an error names it
            check(Constraint.json_schema(f.parameters, where=f"tools[{i}].function.parameters"))
        if mode is None:
            functions = [f for f in functions if f.name == choice]
        if thought not in (None, "may", "open"):   # a ValueError, not the BitNetError the API promises
            raise ConstraintError(f"thought {thought!r:.40}: None, 'may' or 'open' (engine api's answer_thought)",
                                  where="thought")
        thought = thought if mode == "auto" else None   # a required call is the answer from its first token
        start = self._auto_rule(parallel, thought) if mode == "auto" else "start: calls\n"
        c = Constraint.lark(start + self._calls_rule(parallel) + self._call_rule(functions, parallel, thought),
                            where="tools")
        return replace(c, free_start=True) if mode == "auto" else c

    # ---- the answer -----------------------------------------------------------------------------------
    def parser(self) -> "HermesParser":
        return HermesParser()


class Llama3JsonFormat(ToolFormat):
    """Llama-3.x's JSON tool calls: the whole answer is {"name": ..., "parameters": {...}}."""
    name = "llama3_json"
    ARGS = "parameters"

    def call_text(self, name, arguments):
        return _call_json(name, self.ARGS, arguments)

    def _call_rule(self, functions, parallel, thought=None):
        """A call opens with one lexeme, '{"name": "': up to there a text answer may start the same way (JSON that
        is no call is text), and the lexer never has to take back a "{" it read as text; then a function's name
        and its arguments. With a thought (_thought_rules), the lexeme takes it first: a whole one, or the rest
        of the one the prompt opened."""
        opener = json.dumps(_JSON_CALL_OPEN)
        if thought == "open":
            opener = f'THINK_BODY "</think>" /\\s*/ {opener}'
        elif thought == "may":
            opener = f"(THINK /\\s*/)? {opener}"
        rules = [f'call: CALL_OPEN ({" | ".join(f"args{i}" for i in range(len(functions)))})\n',
                 f"CALL_OPEN: {opener}\n"]
        for i, f in enumerate(functions):
            after_open = json.dumps(f.name, ensure_ascii=False)[1:] + f', "{self.ARGS}": '
            schema = {"x-guidance": CALL_JSON, **prepared(f.parameters, f"tools: {f.name}")}
            rules.append(f'args{i}: {json.dumps(after_open, ensure_ascii=False)} '
                         f'%json {json.dumps(schema, ensure_ascii=False)} "}}"\n')
        return "".join(rules)

    def _calls_rule(self, parallel):
        return "calls: call\n"   # one call an answer: Llama 3.x templates raise on two in the history

    def _text_rule(self, thought=None):   # a text answer is anything that does not open a call: JSON that is no
        # call is text (whitespace then a call is neither: the parser reads past leading whitespace, so it would be
        # a call that skipped the call grammar); nor is a thought then a call
        call = f"/(?s:\\s*{_CALL_START.pattern}.*)/"
        if thought is None:
            return f"TEXT: /(?s:.+)/ & ~{call}\n"
        if thought == "open":
            return _thought_rules(thought) + f'TEXT: /(?s:.+)/ & ~(THINK_BODY "</think>" {call})\n'
        return _thought_rules(thought) + f"TEXT: /(?s:.+)/ & ~{call} & ~(THINK {call})\n"

    def _auto_rule(self, parallel, thought=None):
        return "start: TEXT | calls\n" + self._text_rule(thought)   # the whole answer is the call

    def parser(self):
        return JsonCallParser()


_LIST_OPEN = re.compile(r"<tool_call>(?:\\n|\n)\s*\[")   # "<tool_call>\n[" as the template's text writes it
# what may stand between a tag and the JSON after it in a template's source: newlines (written or escaped), spaces,
# the end of one Jinja string and the start of the next
_GLUE = r"""(?:\\n|\s|['"]\s*-?\}\}|\{\{-?\s*['"]|\{%-?[^%]*%\})*"""
# a template that shows or renders a call as JSON right after <tool_call> (a list's first object for Falcon3's):
# `<tool_call>\n{"name": ...`, `'<tool_call>\n{"name": "' + ...`; not Qwen3-Coder's <tool_call>\n<function=...>,
# GLM's <tool_call>{function-name}\n<arg_key>..., nor a prose mention of the tags
_HERMES_JSON = re.compile(re.escape(HERMES_OPEN) + _GLUE + r"\[?" + _GLUE + r"\{(?:\s|\\n)*\\?\"")
# Llama 3.x's instruction: 'Respond in the format {"name": function name, "parameters": dictionary of argument name
# and its value}' (Functionary's, Command-R's and others' "parameters" are formats of their own)
_LLAMA3_JSON = re.compile(r'"parameters\\?": dictionary')


def with_answer_format(calls: Constraint, answer: Constraint, *, forced: str = "refuse") -> Constraint:
    """A tool grammar with choice auto (calls.free_start) whose answer in text must be JSON of a format
    (Anthropic's output_config.format beside tools, OpenAI's response_format beside tools): the model calls
    tools, or answers in the format. A required call leaves no text answer to shape: forced "drop" gives the
    call grammar alone (OpenAI's: both fields are taken, the format shapes a later turn's answer; instructor's
    Responses mode and the Agents SDK's forced tool use send the pair), "refuse" a ConstraintError (Anthropic's
    400). ConstraintError for a regex or grammar beside tools (not JSON), whatever the choice (llama-server's too)."""
    from .constraints import JSON_OPTIONS
    if answer.kind not in ("json_object", "json_schema"):   # first: a required call dropped it unread, even invalid
        raise ConstraintError(f"{answer.where}: only a JSON format can go with tools (a regex or grammar cannot)",
                              where=answer.where)
    if not calls.free_start and forced == "drop":
        return calls
    if not calls.free_start:
        raise ConstraintError(f"tool_choice: it requires a call, so there is no text answer for {answer.where} to "
                              "shape (use tool_choice auto, or drop the format)", where="tool_choice")
    answer.refuse_costly()   # its patterns, in its own words: inside the grammar's %json they are the grammar's
    schema = {"type": "object"} if answer.kind == "json_object" else prepared(json.loads(answer.source), answer.where)
    first, rest = calls.source.split("\n", 1)   # "start: TEXT | ...": text, or text leading to calls
    if not first.startswith("start: TEXT |") or "\ncalls:" not in "\n" + rest:
        raise ConstraintError(f"{answer.where}: this model's tool-call format cannot take a format beside it",
                              where=answer.where)
    # the answer in the format, or calls from the first token (no free text before them: it would be an answer
    # that is not in the format)
    source = "start: answer | calls\n" + rest + \
        f"answer: %json {json.dumps({'x-guidance': JSON_OPTIONS, **schema}, ensure_ascii=False)}\n"
    return replace(calls, source=source, free_start=False, where=answer.where)


def tool_format(template: str | None) -> ToolFormat:
    """The call format of a chat template (None, a template without tools, or one whose own call format is none of
    ours: hermes with the default block)."""
    t = template or ""
    if "tools" not in t:
        return ToolFormat(False)
    if _HERMES_JSON.search(t):
        return HermesListFormat(True) if _LIST_OPEN.search(t) else ToolFormat(True)
    if _LLAMA3_JSON.search(t):
        return Llama3JsonFormat(True)
    return ToolFormat(False)   # it would tell the model a format the grammar then forbids: our block instead


class HermesListFormat(ToolFormat):
    """Falcon3's: one <tool_call> block holding a JSON list of the calls (its template shows the model that)."""
    name = "hermes_list"

    def call_text(self, name, arguments):
        return f"{HERMES_OPEN}\n[{_call_json(name, 'arguments', arguments)}]\n{HERMES_CLOSE}"

    def _call_rule(self, functions, parallel, thought=None):
        more = ' (WS? "," WS? body)*' if parallel else ""
        return (f'call: "{HERMES_OPEN}" tail\n'
                f'tail: "\\n[" WS? body{more} WS? "]\\n{HERMES_CLOSE}"\n'
                "WS: /\\n {0,4}| {1,2}/\n"   # as the template's example: "[\\n  {", "},\\n  {", "}\\n]"
                f"body: %json {json.dumps(self._call_schema(functions), ensure_ascii=False)}\n")

    def _calls_rule(self, parallel):
        return "calls: call\n"   # every call in the one block

    def _auto_rule(self, parallel, thought=None):
        return super()._auto_rule(False, thought)


def _thought_rules(thought: str) -> str:
    """The thought an answer may hold before its calls (engine/runtime/reasoning.py splits it off): THINK_BODY,
    free text up to its first </think> (tags included: a call it names is no call); THINK, a whole one at the
    answer's start ("may": the model opens it); THINK_OPEN, its opening ("open": the prompt opened it, and the
    answer starts in THINK_BODY)."""
    return ("THINK_BODY: /(?s:.*)/ & ~/(?s:.*<\\/think>.*)/\n"
            + ('THINK_OPEN: /\\s*<think>/\nTHINK: THINK_OPEN THINK_BODY "</think>"\n' if thought == "may" else ""))


def _native(m: dict) -> dict:
    """A message for a template that renders tools itself: content never None, arguments as objects (Qwen and
    Llama templates `tojson` them)."""
    out = dict(m, content=m.get("content") or "")
    if m.get("tool_calls"):   # OpenAI's {"function": {...}} shape gets object arguments; other shapes pass as given
        out["tool_calls"] = [dict(c, function=dict(c["function"], arguments=_loads(c["function"].get("arguments") or "{}")))
                             if isinstance(c, dict) and isinstance(c.get("function"), dict) else c
                             for c in m["tool_calls"]]
    return out


def _call_json(name: str, key: str, arguments) -> str:
    """{"name": name, key: arguments} as the model writes a call. Arguments that are no JSON (a call the server
    returned cut at max_tokens, sent back in the history as OpenAI's API allows any string) go in as written."""
    args = _loads(arguments)
    if isinstance(args, str) and isinstance(arguments, str):
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{key}": {arguments}}}'
    # DEL (U+007F) escaped, as the grammar writes it (json.dumps leaves it raw, which the grammar refuses): the
    # history shows the model the text it is held to
    return json.dumps({"name": name, key: args}, ensure_ascii=False).replace("\x7f", "\\u007f")


def _loads(a):
    try:
        return json.loads(a) if isinstance(a, str) else a
    except ValueError:
        return a


def _regex_escape(s: str) -> str:
    return re.escape(s).replace("/", "\\/")   # inside a Lark /regex/


class HermesParser:
    """feed(text) -> (content to show now, calls completed now); finish() -> (the rest, calls). Text that might
    be the start of <tool_call> is held back until it is or is not; a call is emitted when its block closes."""

    def __init__(self):
        self.buf = ""
        self.in_call = False
        self.n_calls = 0
        self.cut_call = False   # finish() gave a call cut off (a stop string too): never to be run
        self.looked = 0         # the call's text before this was no end of it

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        content, calls = "", []
        while True:
            if self.in_call:
                end, objs = self._close()
                if end < 0:
                    return content, calls
                calls += self._calls(objs)
                self.buf, self.in_call, self.looked = self.buf[end + len(HERMES_CLOSE):], False, 0
                continue
            start = self.buf.find(HERMES_OPEN)
            if start >= 0:
                before = self.buf[:start]
                content += before if not (self.n_calls or calls) else before.strip()
                self.buf, self.in_call = self.buf[start + len(HERMES_OPEN):], True
                continue
            hold = next((n for n in range(min(len(HERMES_OPEN) - 1, len(self.buf)), 0, -1)
                         if self.buf.endswith(HERMES_OPEN[:n])), 0)
            out, self.buf = self.buf[: len(self.buf) - hold], self.buf[len(self.buf) - hold:]
            content += out if not (self.n_calls or calls) else out.strip()
            return content, calls

    def _close(self) -> tuple[int, list]:
        """Where the open block ends and its calls: the first </tool_call> after a whole call (an object with a
        name, or a list of them: Falcon3's); one inside an argument's string is the string's. (-1, []) until then."""
        while (end := self.buf.find(HERMES_CLOSE, self.looked)) >= 0:
            self.looked = end + 1
            try:
                obj = json.loads(self.buf[:end])
            except ValueError:
                continue
            objs = obj if isinstance(obj, list) else [obj]
            if objs and all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in objs):
                return end, objs
        return -1, []

    def _calls(self, objs: list[dict]) -> list[dict]:
        self.n_calls += len(objs)
        return [{"id": new_call_id(), "type": "function",
                 "function": {"name": o["name"], "arguments": json.dumps(o.get("arguments", {}), ensure_ascii=False)}}
                for o in objs]

    def finish(self, cut: bool = False) -> tuple[str, list[dict]]:
        """cut: the answer ended at max_tokens or the context (finish reason length), so text held back as the
        start of <tool_call> was one; a lone "<" stays text (any text may end so: "5 <" lost its "<")."""
        rest, self.buf, self.looked = self.buf, "", 0
        if self.in_call or (cut and len(rest) > 1 and HERMES_OPEN.startswith(rest)):   # cut inside a call: as far as
            started, self.in_call, self.cut_call = self.in_call, False, True     # it was written, never as text
            body = rest.lstrip() if started else ""
            return "", partial_call(body[1:] if body.startswith("[") else body, "arguments")   # a list: its first
        return (rest if not self.n_calls else rest.strip()), []


_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)(")?')
_JSON_CALL_OPEN = '{"name": "'
# how a Llama-3 JSON call opens (llama.cpp's trigger for it): {"name" or {"type": "function", "name"
_CALL_START = re.compile(r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"')


def partial_call(body: str, args_key: str) -> list[dict]:
    """A call cut off before its end (max_tokens, the context) as OpenAI's shape: its name and its arguments as far
    as they were written (a prefix of valid JSON under the grammar; whole and re-dumped when only the block's end was
    missing). Never template markup: the finish reason (length) tells the client not to run it. None at all where
    the cut came before its name was whole: OpenAI sends a call's name whole, first, and a call named "" or "get_w"
    broke agent loops (the Agents SDK looked the tool up; /v1/responses refused the item sent back)."""
    m = _NAME.match(body)
    if not m or not m.group(2):
        return []
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        name = m.group(1)
    args = ""
    a = re.compile(r'\s*,\s*"' + re.escape(args_key) + r'"\s*:\s*').match(body, m.end())
    if a:
        args = body[a.end():]
        try:
            args = json.dumps(json.JSONDecoder().raw_decode(args)[0], ensure_ascii=False)
        except ValueError:
            pass   # cut inside the arguments: the text so far
    return [{"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}]


class JsonCallParser:
    """Llama-3 JSON calls: an answer that starts with "{" is held whole and parsed at the end: a call when it opens
    as one (_CALL_START), else text (a JSON answer that is no call)."""

    def __init__(self):
        self.buf, self.mode = "", None
        self.cut_call = False

    def feed(self, text):
        self.buf += text
        if self.mode is None and self.buf.strip():
            self.mode = "call" if self.buf.lstrip().startswith("{") else "text"
        if self.mode == "text":
            out, self.buf = self.buf, ""
            return out, []
        return "", []

    def finish(self, cut: bool = False):
        rest, self.buf = self.buf, ""
        if self.mode != "call" or not _CALL_START.match(rest.lstrip()):
            return rest, []
        try:
            obj = json.loads(rest)
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                return "", [{"id": new_call_id(), "type": "function",
                             "function": {"name": obj["name"],
                                          "arguments": json.dumps(obj.get("parameters", obj.get("arguments", {})),
                                                                  ensure_ascii=False)}}]
        except ValueError:
            pass
        self.cut_call = True   # cut off (max_tokens, the context): the call so far
        return "", partial_call(rest, "parameters")
