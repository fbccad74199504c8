"""A thinking model's <think> block (engine/runtime/reasoning.py): split from the answer as llama-server's
--reasoning-format deepseek splits it (OpenAI chat: `reasoning_content`, streamed as delta.reasoning_content) and as
ollama gives it (`thinking`, with `think` true / false); `chat_template_kwargs` reach the template (enable_thinking).
The server is a real subprocess on the bundled model with a template whose generation prompt opens the thought (as
DeepSeek-R1's and Qwen3's forced ones do), unless `open_thought: false` asks it not to (then the model writes
<think> itself, as Qwen3's does); a GBNF grammar makes the model write a known thought and answer."""
from __future__ import annotations

import json

import httpx
import pytest

from bitnet_cpu.engine.runtime.reasoning import ThinkSplitter, thinks

pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
ollama = pytest.importorskip("ollama", reason="the ollama tests need the ollama client (pip install .[test])")
from serve_proc import sse_events  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
            "{% if m.reasoning_content is defined and m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
            "{% endif %}{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
            "{% elif open_thought is not defined or open_thought %}<think>\n{% endif %}{% endif %}")
THOUGHT, ANSWER = "I add 2 and 3.", "Five."
GRAMMAR = f'root ::= "<think>\\n" "{THOUGHT}" "\\n</think>" "\\n\\n" "{ANSWER}"'
SELF = {"open_thought": False}   # the model opens its thought itself (the grammar writes it)
Q = [{"role": "user", "content": "What is 2+3?"}]


@pytest.mark.parametrize("text, opened, want", [
    ("<think>\nI add 2 and 3.\n</think>\n\nFive.", False, ("I add 2 and 3.", "Five.")),
    ("I add.\n</think>\n\nFive.", True, ("I add.", "Five.")),
    ("  Five, <think> is a tag", False, ("", "  Five, <think> is a tag")),   # not at the start: content
    ("<think>\ncut off in the thou", False, ("cut off in the thou", "")),   # never closed: all reasoning
    ("<thi", False, ("", "<thi")),
    ("<think>\ncut in the thought\n</th", False, ("cut in the thought", "")),   # a closing tag cut part-way
    ("math: a<", True, ("math: a<", "")),   # a lone "<" may be the thought's own
    ("<think></think>Five.", False, ("", "Five.")),
])
def test_splitter_gives_the_same_split_at_any_cut(text, opened, want):
    for step in (1, 2, 3, 7, len(text)):
        s, got = ThinkSplitter(opened), ["", ""]
        for i in range(0, len(text), step):
            r, c = s.feed(text[i:i + step])
            assert "<think" not in c or "<think> is" in text, (step, c)   # a tag being written is held back
            got[0] += r
            got[1] += c
        r, c = s.finish()
        assert (got[0] + r, got[1] + c) == want, step
    assert thinks(TEMPLATE) and not thinks("{{ messages }}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from serve_proc import Server
    path = tmp_path_factory.mktemp("think") / "think.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    s = Server("--parallel", "4", "--chat-template-file", str(path), threads=1)
    yield s
    s.stop()


def chat(server, **body):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": Q, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def streamed(url, **body) -> tuple[str, str]:
    """(reasoning, content) of a streamed chat answer, its deltas joined."""
    reasoning = content = ""
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                      json={"messages": Q, "temperature": 0, "stream": True, **body}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
    return reasoning, content


def test_reasoning_content_whole_and_streamed(server):
    m = chat(server, grammar=GRAMMAR, chat_template_kwargs=SELF)["message"]
    assert m["reasoning_content"] == THOUGHT and m["content"] == ANSWER
    raw = chat(server, grammar=GRAMMAR, chat_template_kwargs=SELF, reasoning_format="none")["message"]
    assert "reasoning_content" not in raw and raw["content"] == f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
    assert streamed(server.url, grammar=GRAMMAR, chat_template_kwargs=SELF) == (THOUGHT, ANSWER)
    # the openai client keeps the field (model_extra)
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="m", messages=Q, temperature=0,
                                       extra_body={"grammar": GRAMMAR, "chat_template_kwargs": SELF})
    assert r.choices[0].message.content == ANSWER and r.choices[0].message.model_extra["reasoning_content"] == THOUGHT


def test_chat_template_kwargs_reach_the_template(server):
    """enable_thinking false: the template closes the thought in the prompt, so the answer is all content;
    variables the template already gets are a 400 naming the field."""
    on = chat(server, max_tokens=8)["message"]
    off = chat(server, max_tokens=8, chat_template_kwargs={"enable_thinking": False})["message"]
    assert on["reasoning_content"] and not on["content"]   # the tiny model never closes its thought in 8 tokens
    assert "reasoning_content" not in off and off["content"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": Q, "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": Q, "reasoning_format": "sideways"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_format"
    # "false" is true to the template: llama-server's 400 (a string took the thinking path in silence)
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": Q, "chat_template_kwargs": {"enable_thinking": "false"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    assert "enable_thinking" in r.json()["error"]["message"]


def test_apply_template_renders_the_requests_template_kwargs(server):
    """/apply-template shows the prompt the chat endpoint runs: with the request's chat_template_kwargs too
    (enable_thinking false closes the thought in the prompt), counted by the chat endpoint's prompt tokens; bad
    variables are the chat endpoint's 400."""
    for kwargs in (None, {"enable_thinking": False}, {"enable_thinking": True}):
        body = {"messages": Q} if kwargs is None else {"messages": Q, "chat_template_kwargs": kwargs}
        prompt = httpx.post(server.url + "/apply-template", json=body, timeout=60).json()["prompt"]
        # as the test below; with the BOS the chat endpoint puts first (llama-server's add_special)
        n = len(httpx.post(server.url + "/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"])
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=60)
        assert r.json()["usage"]["prompt_tokens"] == n, kwargs
        assert prompt.endswith("</think>\n\n") == (kwargs == {"enable_thinking": False}), (kwargs, prompt[-30:])
    r = httpx.post(server.url + "/apply-template", json={"messages": Q, "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_ollama_thinking(server):
    """ollama's `think`: true gives the thought as message.thinking (streamed too), false turns it off; the model's
    capabilities say "thinking"; think levels (gpt-oss's "high") are a 400."""
    client = ollama.Client(host=server.url, timeout=60)
    opts = {"temperature": 0, "num_predict": 8}
    raw = chat(server, max_tokens=8, reasoning_format="none")["message"]["content"]   # the thought as generated
    r = client.chat(model="m", messages=Q, think=True, options=opts)
    assert r.message.thinking == raw.strip() and r.message.content == ""
    parts = list(client.chat(model="m", messages=Q, think=True, stream=True, options=opts))
    assert "".join(p.message.thinking or "" for p in parts) == raw.strip()
    assert "".join(p.message.content for p in parts) == ""
    off = client.chat(model="m", messages=Q, think=False, options=opts)
    assert not off.message.thinking and off.message.content
    assert client.generate(model="m", prompt=Q[0]["content"], think=True, options=opts).thinking == raw.strip()
    assert "thinking" in client.show("m").capabilities
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="m", messages=Q, think="high")
    assert e.value.status_code == 400
    # a format decides the answer from its first token: think true beside it is refused (it was answered without a
    # thought, in silence); think left out takes the format as the answer
    for call in (lambda **k: client.chat(model="m", messages=Q, **k),
                 lambda **k: client.generate(model="m", prompt="x", **k)):
        with pytest.raises(ollama.ResponseError) as e:
            call(think=True, format="json", options=opts)
        assert e.value.status_code == 400 and "think: true with format" in str(e.value)
        call(format="json", options=opts)


def test_anthropic_messages_ask_a_thinking_template_not_to_think(server):
    """Anthropic's API thinks only when asked: without `thinking`, /v1/messages renders a thinking template with
    enable_thinking false, so its answer is the one OpenAI's endpoint gives with that variable; count_tokens counts
    that same prompt."""
    want = chat(server, max_tokens=8, chat_template_kwargs={"enable_thinking": False})["message"]["content"]
    body = {"model": "m", "max_tokens": 8, "temperature": 0, "messages": Q}
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=60).json()
    assert [b["type"] for b in r["content"]] == ["text"] and r["content"][0]["text"] == want
    n = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": "m", "messages": Q}).json()
    assert n["input_tokens"] == r["usage"]["input_tokens"] + r["usage"]["cache_read_input_tokens"]


def test_responses_reasoning_items(server):
    """The Responses API: the thought is a reasoning item (reasoning_text content) before the message, streamed
    with response.reasoning_text.* events, which the openai client accumulates into the same items; reasoning
    items sent back as input are taken (the next assistant turn's thought: see the test below); effort "none"
    asks the template not to think; effort levels are a 400."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    q = Q[0]["content"]
    extra = {"grammar": GRAMMAR, "chat_template_kwargs": SELF}
    r = client.responses.create(model="m", input=q, temperature=0, extra_body=extra)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THOUGHT and r.output_text == ANSWER
    with client.responses.stream(model="m", input=q, temperature=0, extra_body=extra) as s:
        kinds = {e.type for e in s}
        final = s.get_final_response()
    assert {"response.reasoning_text.delta", "response.reasoning_text.done"} <= kinds
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == THOUGHT and final.output_text == ANSWER
    again = client.responses.create(model="m", temperature=0, max_output_tokens=4, input=[
        {"role": "user", "content": q}, *[o.model_dump(exclude_none=True) for o in r.output],
        {"role": "user", "content": "And 3+4?"}])
    assert again.status == "incomplete" and again.output
    off = client.responses.create(model="m", input=q, temperature=0, max_output_tokens=8, reasoning={"effort": "none"})
    want = chat(server, max_tokens=8, chat_template_kwargs={"enable_thinking": False})["message"]["content"]
    assert [o.type for o in off.output] == ["message"] and off.output_text == want
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input=q, reasoning={"effort": "high"})



@pytest.mark.parametrize("limit", [None, 8])   # the whole thought; one cut inside it by max_output_tokens
def test_a_reasoning_items_part_is_added_and_done_as_a_messages_part_is(server, limit):
    """A streamed reasoning item's reasoning_text part opens with response.content_part.added (the part, empty)
    and closes with response.content_part.done (the part, whole) around its reasoning_text events, as a
    message's output_text part does and as OpenAI's reference Responses server (gpt-oss's) streams it: a strict
    event-order check, or an accumulator that indexes item.content by the part events, found none. Every part's
    events lie between its added and its done; the openai client reads the stream to the same items."""
    openai = pytest.importorskip("openai")
    body = {"model": "m", "input": Q[0]["content"], "temperature": 0, "grammar": GRAMMAR,
            "chat_template_kwargs": SELF, **({"max_output_tokens": limit} if limit else {})}
    events = sse_events(server.url, "/v1/responses", body)
    [(_, added)] = [(k, d) for k, d in events if k == "response.output_item.added" and d["item"]["type"] == "reasoning"]
    rs, at = added["item"]["id"], added["output_index"]
    mine = [(k, d) for k, d in events if d.get("item_id") == rs or (d.get("item") or {}).get("id") == rs]
    kinds = [k for k, _ in mine]
    n = kinds.count("response.reasoning_text.delta")
    assert n and kinds == ["response.output_item.added", "response.content_part.added",
                           *["response.reasoning_text.delta"] * n, "response.reasoning_text.done",
                           "response.content_part.done", "response.output_item.done"], kinds
    thought = mine[-1][1]["item"]["content"][0]["text"]
    assert thought == (THOUGHT if limit is None else "".join(d["delta"] for _, d in mine[2:2 + n]))
    assert thought and (limit is not None or mine[-1][1]["item"]["status"] == "completed")
    assert mine[1][1]["part"] == {"type": "reasoning_text", "text": ""}
    assert mine[-2][1]["part"] == {"type": "reasoning_text", "text": thought}
    assert all(d["output_index"] == at and d.get("content_index", 0) == 0 for _, d in mine)
    opened, closed = set(), set()   # every part-level event within its part's added .. done
    for k, d in events:
        if k == "response.content_part.added":
            opened.add((d["item_id"], d["content_index"]))
        elif "content_index" in d:
            key = (d["item_id"], d["content_index"])
            assert key in opened and key not in closed, (k, d)
            if k == "response.content_part.done":
                closed.add(key)
    assert opened == closed
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    extra = {"grammar": GRAMMAR, "chat_template_kwargs": SELF}
    with client.responses.stream(model="m", input=Q[0]["content"], temperature=0, extra_body=extra,
                                 **({"max_output_tokens": limit} if limit else {})) as s:
        parts = [e.part for e in s if e.type == "response.content_part.added"]
        final = s.get_final_response() if limit is None else None
    assert parts and parts[0].type == "reasoning_text"
    if final is not None:
        assert final.output[0].content[0].text == THOUGHT and final.output_text == ANSWER

def test_responses_effort_none_still_splits_a_thought_written_anyway(server):
    """reasoning.effort "none" asks the template not to think; a <think> block the model writes anyway is a
    reasoning item, as chat's reasoning_effort "none" gives it as reasoning_content (it was left in output_text,
    tags and all)."""
    body = {"model": "m", "input": Q[0]["content"], "temperature": 0, "reasoning": {"effort": "none"},
            "grammar": GRAMMAR}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60).json()
    assert [o["type"] for o in r["output"]] == ["reasoning", "message"], r
    assert r["output"][0]["content"][0]["text"] == THOUGHT and r["output"][1]["content"][0]["text"] == ANSWER
    c = chat(server, grammar=GRAMMAR, reasoning_effort="none")["message"]
    assert (c["reasoning_content"], c["content"]) == (THOUGHT, ANSWER)


def test_responses_thought_tokens_are_reasoning_tokens_not_the_texts_logprobs(server):
    """The Responses API with a thought: the message's logprobs are its own text's tokens, whole and streamed (the
    first text delta carried every token of the <think> block), the thought's tokens (tags included) are
    usage.output_tokens_details.reasoning_tokens (it was always 0), and a thought cut by max_output_tokens is an
    incomplete reasoning item (it said completed)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    body = {"model": "m", "input": Q[0]["content"], "temperature": 0, "include": ["message.output_text.logprobs"],
            "grammar": GRAMMAR, "chat_template_kwargs": SELF}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60).json()
    message = r["output"][-1]["content"][0]
    assert message["text"] == ANSWER and "".join(x["token"] for x in message["logprobs"]) == ANSWER
    every = [x["token"] for x in chat(server, grammar=GRAMMAR, chat_template_kwargs=SELF,
                                      logprobs=True)["logprobs"]["content"]]   # the chat's: every token
    assert every[len(every) - len(message["logprobs"]):] == [x["token"] for x in message["logprobs"]]
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == len(every) - len(message["logprobs"])
    deltas, usage = [], None
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                e = json.loads(line[6:])
                deltas += e.get("logprobs", []) if e["type"] == "response.output_text.delta" else []
                usage = e["response"]["usage"] if e["type"] == "response.completed" else usage
    assert deltas == message["logprobs"] and usage == r["usage"]
    inside = next(k for k in range(len(every)) if "".join(every[:k]).startswith("<think>\nI ")) + 1
    cut = client.responses.create(model="m", input=Q[0]["content"], temperature=0, max_output_tokens=inside,
                                  extra_body={"grammar": GRAMMAR, "chat_template_kwargs": SELF})
    assert cut.status == "incomplete" and [(o.type, o.status) for o in cut.output] == [("reasoning", "incomplete")]
    assert cut.usage.output_tokens_details.reasoning_tokens == cut.usage.output_tokens


def test_a_grammar_that_decides_the_start_is_the_answer_though_the_prompt_opened_a_thought(server):
    """The prompt opens the thought, but a grammar makes the answer (a required call, a JSON format): that output is
    the answer -- tool_calls, content -- never reasoning nobody closed (it came back as reasoning_content, with no
    calls and finish_reason stop). tool_choice auto leaves the start free: a thought there is still a thought."""
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]
    c = chat(server, tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    assert c["finish_reason"] == "tool_calls" and c["message"]["tool_calls"][0]["function"]["name"] == "ping"
    assert not c["message"].get("reasoning_content")
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
        "additionalProperties": False}}}
    m = chat(server, response_format=fmt, max_tokens=40)["message"]
    assert json.loads(m["content"])["n"] in range(10) and not m.get("reasoning_content")
    client = ollama.Client(host=server.url, timeout=60)
    r = client.generate(model="m", prompt=Q[0]["content"], format=fmt["json_schema"]["schema"],
                        options={"temperature": 0, "num_predict": 40})   # (think true beside it: a 400)
    assert json.loads(r.response)["n"] in range(10) and not r.thinking
    auto = chat(server, tools=tools, max_tokens=8)["message"]   # free text: the tiny model's unclosed thought
    assert auto["reasoning_content"] and not auto.get("tool_calls")


def test_a_grammar_that_goes_on_with_the_prompts_thought_is_split_and_budgeted(server):
    """The prompt opens the thought (R1's templates, Qwen3's forced one) and the grammar writes its rest and the
    answer without a <think> of its own: the text up to </think> is that thought (it all came back as content), and
    the budget cuts it (it ran on unbounded)."""
    grammar = f'root ::= "{THOUGHT}" "\\n</think>\\n\\n" "{ANSWER}"'
    m = chat(server, grammar=grammar, max_tokens=40)["message"]
    assert (m.get("reasoning_content"), m["content"]) == (THOUGHT, ANSWER), m
    assert streamed(server.url, grammar=grammar, max_tokens=40) == (THOUGHT, ANSWER)
    free = f'root ::= [^<]* "</think>" "\\n\\n" "{ANSWER}"'
    long = chat(server, grammar=free, max_tokens=40, ignore_eos=True)["message"]
    cut = chat(server, grammar=free, max_tokens=40, ignore_eos=True, reasoning_budget=2)["message"]
    assert long["reasoning_content"].startswith(cut["reasoning_content"]), (long, cut)
    assert len(cut["reasoning_content"]) < len(long["reasoning_content"]) and cut["content"] == ANSWER, (long, cut)


def test_an_answer_that_only_starts_like_a_tag_is_kept(server):
    """Text held back as the start of <think> that never became one is the answer, in every API (the Responses
    API gave it back to the splitter at the end, which held it again: an empty output)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    for text in ("<", "<th", "<think"):
        extra = {"grammar": f'root ::= "{text}"', "chat_template_kwargs": SELF}
        assert chat(server, **extra)["message"]["content"] == text
        r = client.responses.create(model="m", input=Q[0]["content"], temperature=0, extra_body=extra)
        assert r.output_text == text and [o.type for o in r.output] == ["message"]


def test_the_reasoning_budget_cuts_the_thought(server):
    """llama-server's reasoning budget on the chat endpoint (reasoning_budget, or its names reasoning_budget_tokens
    and thinking_budget_tokens): the thought is the start of the one written without a budget, then it is closed
    and the answer follows; the message comes at the thought's end. reasoning_effort "none" turns thinking off,
    as enable_thinking false does; its levels are a 400."""
    body = {"max_tokens": 24, "ignore_eos": True}
    free = chat(server, **body)["message"]
    assert free["reasoning_content"] and not free["content"]   # the tiny model's thought runs on
    cut = chat(server, reasoning_budget=3, **body)["message"]
    assert free["reasoning_content"].startswith(cut["reasoning_content"])
    assert len(cut["reasoning_content"]) < len(free["reasoning_content"]) and cut["content"]
    for alias in ("reasoning_budget_tokens", "thinking_budget_tokens"):
        assert chat(server, **{alias: 3}, **body)["message"] == cut
    said = chat(server, reasoning_budget=3, reasoning_budget_message=" Time to answer.", **body)["message"]
    assert said["reasoning_content"] == cut["reasoning_content"] + " Time to answer."
    off = chat(server, max_tokens=8, reasoning_effort="none")["message"]
    assert off == chat(server, max_tokens=8, chat_template_kwargs={"enable_thinking": False})["message"]
    # a message that would close the thought itself puts the rest of the forced end in the answer: refused
    for bad in ({"reasoning_effort": "high"}, {"reasoning_budget": -2},
                {"reasoning_budget": 3, "reasoning_budget_message": "stop </think> here"}):
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": Q, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] in bad, r.text


def test_the_budget_waits_out_a_phrase_the_grammar_writes(server):
    """A grammar that writes a fixed phrase at the thought's start forbids its end only there: a budget that runs
    out inside the phrase ends the thought just after it (it was dropped, and the thought ran on to max_tokens)."""
    phrase = "Let me think step by step."
    grammar = f'root ::= "<think>" "{phrase}" [^<]* "</think>" [ \\n]* [A-Za-z .]+'
    for budget in (0, 2):
        c = chat(server, grammar=grammar, reasoning_budget=budget, max_tokens=60, chat_template_kwargs=SELF)
        thought = c["message"]["reasoning_content"]
        assert thought.startswith(phrase) and len(thought) < len(phrase) + 12, (budget, c)
        assert c["message"]["content"], (budget, c)   # the answer after it (the grammar's [A-Za-z .]+ runs on)


def test_a_closing_tag_cut_part_way_is_not_thought(server):
    """max_tokens or a stop string inside the budget's forced end (or any </think> being written) leaves no piece
    of the tag in reasoning_content (it gave "</th")."""
    for extra in ({"max_tokens": 4}, {"max_tokens": 6}, {"max_tokens": 24, "stop": ["think"]}):
        m = chat(server, reasoning_budget=0, **extra)["message"]
        assert "<" not in (m.get("reasoning_content") or "") and "<" not in m["content"], (extra, m)
        reasoning, content = streamed(server.url, reasoning_budget=0, **extra)
        assert (reasoning, content) == (m.get("reasoning_content") or "", m["content"]), extra


def test_thinking_asked_beside_a_format_is_refused_unless_the_grammar_writes_it(server):
    """Anthropic's thinking or chat_template_kwargs enable_thinking true, with a format that decides the answer
    from its first token: a 400 naming the field (it was a 200 with no thought, in silence); a grammar that writes
    the thought itself is taken (the docs' way), and a format without thinking asked for is the answer."""
    fmt = {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "boolean"}},
                                             "required": ["a"]}}
    r = httpx.post(server.url + "/v1/messages", headers={"anthropic-version": "2023-06-01"}, timeout=120, json={
        "model": "m", "max_tokens": 30, "messages": Q, "output_config": {"format": fmt},
        "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "no room for a thought" in r.json()["error"]["message"]
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": fmt["schema"]}}
    body = {"messages": Q, "max_tokens": 30, "response_format": rf}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={**body, "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.enable_thinking", r.text
    assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
    got = chat(server, max_tokens=40, grammar=GRAMMAR, chat_template_kwargs={**SELF, "enable_thinking": True})
    assert (got["message"]["reasoning_content"], got["message"]["content"]) == (THOUGHT, ANSWER)


def test_anthropic_thinking_blocks(server):
    """`thinking` (adaptive, or enabled with budget_tokens) lets the template think: the thought is a thinking block
    before the text, with an empty signature, streamed as thinking_delta then signature_delta, which Anthropic's
    own client accumulates into the same message; display "omitted" sends the block empty; budget_tokens is the
    reasoning budget; thinking blocks sent back in the conversation are the template's to show."""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    # temperature goes in extra_body: the client (2.x) has no such argument
    kw = {"model": "m", "max_tokens": 60, "messages": Q, "thinking": {"type": "adaptive"},
          "extra_body": {"temperature": 0, "grammar": GRAMMAR, "chat_template_kwargs": SELF}}
    m = client.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert (m.content[0].thinking, m.content[0].signature, m.content[1].text) == (THOUGHT, "", ANSWER)
    with client.messages.stream(**kw) as s:
        deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert deltas.index("thinking_delta") < deltas.index("signature_delta") < deltas.index("text_delta")
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
    hidden = client.messages.create(**{**kw, "thinking": {"type": "adaptive", "display": "omitted"}})
    assert [(b.type, getattr(b, "thinking", None)) for b in hidden.content] == [("thinking", ""), ("text", None)]
    # budget_tokens: the same cut as the chat endpoint's reasoning budget
    body = {"max_tokens": 24, "ignore_eos": True}
    want = chat(server, reasoning_budget=3, **body)["message"]
    m = client.messages.create(model="m", max_tokens=24, messages=Q, extra_body={"temperature": 0, "ignore_eos": True},
                               thinking={"type": "enabled", "budget_tokens": 3})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", want["reasoning_content"]), ("text", want["content"])]
    # an earlier turn's thinking block is the template's (this one shows it: a longer prompt); a redacted one is not
    turns = [Q[0], {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hmm.", "signature": ""},
                                                     {"type": "redacted_thinking", "data": "xx"},
                                                     {"type": "text", "text": "Five."}]},
             {"role": "user", "content": "And 3+4?"}]
    plain = [Q[0], {"role": "assistant", "content": "Five."}, {"role": "user", "content": "And 3+4?"}]
    a = client.messages.create(model="m", max_tokens=8, messages=turns, thinking={"type": "adaptive"},
                               extra_body={"temperature": 0})
    b = client.messages.create(model="m", max_tokens=8, messages=plain, thinking={"type": "adaptive"},
                               extra_body={"temperature": 0})
    def prompt_size(m):   # Anthropic's input_tokens leaves out the cached part
        return m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert prompt_size(a) > prompt_size(b)
    n = client.messages.count_tokens(model="m", messages=plain, thinking={"type": "adaptive"})
    assert n.input_tokens == b.usage.input_tokens + (b.usage.cache_read_input_tokens or 0)


def test_an_earlier_thought_reaches_the_template(server):
    """An assistant turn's earlier thought is the template's to show (llama-server passes `reasoning_content` on;
    Qwen3's template renders those of a tool loop): the chat field, ollama's `thinking`, an Anthropic thinking
    block and a Responses reasoning item each lengthen the prompt by the same tokens as the chat field does."""
    thought, q2 = "An earlier thought.", {"role": "user", "content": "And 3+4?"}
    turns = [Q[0], {"role": "assistant", "content": "Five.", "reasoning_content": thought}, q2]
    plain = [Q[0], {"role": "assistant", "content": "Five."}, q2]
    prompt = httpx.post(server.url + "/apply-template", json={"messages": turns}, timeout=60).json()["prompt"]
    assert f"<think>{thought}</think>Five." in prompt
    user_thought = [Q[0], {"role": "user", "content": "Hi", "reasoning_content": thought}]   # only an assistant's
    assert thought not in httpx.post(server.url + "/apply-template", json={"messages": user_thought}).json()["prompt"]

    def chat_size(messages):
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"messages": messages, "max_tokens": 1, "chat_template_kwargs": SELF})
        return r.json()["usage"]["prompt_tokens"]
    extra = chat_size(turns) - chat_size(plain)
    assert extra > 0

    def ollama_size(messages):
        r = httpx.post(server.url + "/api/chat", timeout=60, json={
            "model": "m", "messages": messages, "stream": False, "options": {"num_predict": 1}})
        return r.json()["prompt_eval_count"]
    o_turns = [Q[0], {"role": "assistant", "content": "Five.", "thinking": thought}, q2]
    assert ollama_size(o_turns) - ollama_size(plain) == extra

    def anthropic_size(assistant_blocks):
        r = httpx.post(server.url + "/v1/messages/count_tokens", timeout=60, json={"model": "m", "messages": [
            Q[0], {"role": "assistant", "content": assistant_blocks}, q2]})
        return r.json()["input_tokens"]
    text = {"type": "text", "text": "Five."}
    block = {"type": "thinking", "thinking": thought, "signature": ""}
    assert anthropic_size([block, text]) - anthropic_size([text]) == extra
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": "m", "messages": [
        Q[0], {"role": "assistant", "content": [{"type": "thinking", "thinking": 5}, text]}, q2]})
    assert r.status_code == 400 and "thinking" in r.text

    def responses_size(items):
        r = httpx.post(server.url + "/v1/responses", timeout=60, json={
            "model": "m", "max_output_tokens": 1, "chat_template_kwargs": SELF, "input": [Q[0], *items, q2]})
        return r.json()["usage"]["input_tokens"]
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Five."}]}
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": thought}]}
    assert responses_size([reasoning, message]) - responses_size([message]) == extra
    assert responses_size([reasoning]) == responses_size([])   # a thought with no assistant turn after it


def test_responses_carry_the_thought_in_encrypted_content_when_asked(server):
    """include ["reasoning.encrypted_content"] (what a stateless Responses client such as Codex sends with store
    false): each reasoning item, whole and streamed, carries its thought there too; given back with that alone
    (no content) it is the same prompt as with its text; another server's blob cannot be read and is dropped (the
    prompt has no thought), and one that claims to be this server's but is not is a 400."""
    body = {"model": "m", "input": Q[0]["content"], "temperature": 0, "grammar": GRAMMAR, "chat_template_kwargs": SELF,
            "include": ["reasoning.encrypted_content"]}
    whole = httpx.post(server.url + "/v1/responses", json=body, timeout=60).json()
    thought = whole["output"][0]
    assert thought["type"] == "reasoning" and thought["content"][0]["text"] == THOUGHT, whole
    assert isinstance(thought["encrypted_content"], str) and THOUGHT not in thought["encrypted_content"]
    plain = httpx.post(server.url + "/v1/responses", json={**body, "include": None}, timeout=60).json()
    assert "encrypted_content" not in plain["output"][0], plain
    done = []
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                e = json.loads(line[6:])
                if e["type"] == "response.output_item.done" and e["item"]["type"] == "reasoning":
                    done.append(e["item"]["encrypted_content"])
    assert done == [thought["encrypted_content"]]

    def size(item):
        r = httpx.post(server.url + "/v1/responses", timeout=60, json={
            "model": "m", "max_output_tokens": 1, "chat_template_kwargs": SELF,
            "input": [Q[0], *([item] if item else []), whole["output"][1], {"role": "user", "content": "And 3+4?"}]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens"]
    sealed = {"type": "reasoning", "id": thought["id"], "summary": [],
              "encrypted_content": thought["encrypted_content"]}
    assert size(sealed) == size(thought) > size(None)
    assert size({**sealed, "encrypted_content": "gAAAAABo-another-servers-blob"}) == size(None)
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": "m", "max_output_tokens": 1,
        "input": [Q[0], {**sealed, "encrypted_content": "bitnet.v1.%%%"}, whole["output"][1]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].encrypted_content", r.text


def test_the_servers_budget_is_for_thinking_chats(tmp_path):
    """--reasoning-budget is the default of a thinking template's chats, as llama-server's: raw completions
    (/completion, /v1/completions, ollama's raw generate) are not cut unless the request asks; -1 in a request's
    budget fields is the server's default, as llama-server reads it."""
    from serve_proc import Server
    path = tmp_path / "think.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    s = Server("--parallel", "2", "--chat-template-file", str(path), "--reasoning-budget", "3", threads=1)
    try:
        body = {"messages": Q, "temperature": 0, "max_tokens": 24, "ignore_eos": True}
        cut = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        assert cut["content"]   # the server's budget closed the thought
        for alias in ("reasoning_budget", "reasoning_budget_tokens", "thinking_budget_tokens"):
            again = httpx.post(s.url + "/v1/chat/completions", json={**body, alias: -1}, timeout=60).json()
            assert again["choices"][0]["message"] == cut, alias
        raw = {"prompt": "Q?<think>\n", "temperature": 0, "n_predict": 16, "ignore_eos": True}
        free = httpx.post(s.url + "/completion", json=raw, timeout=60).json()["content"]
        assert "</think>" not in free
        asked = httpx.post(s.url + "/completion", json={**raw, "reasoning_budget": 2}, timeout=60).json()["content"]
        assert "</think>" in asked   # a request's own budget applies as sent
        gen = httpx.post(s.url + "/api/generate", timeout=60, json={"model": "m", "prompt": "Q?<think>\n", "raw": True,
                         "stream": False, "options": {"temperature": 0, "num_predict": 16}}).json()["response"]
        assert "</think>" not in gen
    finally:
        s.stop()


def test_a_continued_answer_on_a_thinking_template_is_not_a_thought(server):
    """A final assistant message is continued (llama-server's default): on a thinking template that is the
    answer, so the template is asked not to think (as /v1/messages renders a prefill) -- the continuation came
    inside the open <think> block, its </think> in content; /apply-template shows that prompt; asking for the
    thought anyway (enable_thinking true) is llama-server's 400."""
    m = Q + [{"role": "assistant", "content": "The answer is"}]
    prompt = httpx.post(server.url + "/apply-template", json={"messages": m}).json()["prompt"]
    assert prompt.endswith("</think>\n\nThe answer is") and not prompt.endswith("<think>\nThe answer is")
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": m, "temperature": 0, "max_tokens": 8, "grammar": 'root ::= " five."'})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == " five.", r.text
    assert r.json()["usage"]["prompt_tokens"] == len(httpx.post(server.url + "/tokenize", json={
        "content": prompt, "add_special": True}).json()["tokens"])   # with the chat prompt's BOS
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": m, "chat_template_kwargs":
                                                              {"enable_thinking": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_the_servers_reasoning_flags(tmp_path):
    """llama-server's -rea off (the template's enable_thinking false for every chat; a request's
    chat_template_kwargs win) and --reasoning-format (a request's reasoning_format wins): deepseek-legacy, as
    llama-server's, streams the text as written in content, tags and all (the opening one too where the prompt opened
    the thought), and splits a whole answer as deepseek does."""
    from serve_proc import Server
    path = tmp_path / "think.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    s = Server("--parallel", "2", "--chat-template-file", str(path), "-rea", "off",
               "--reasoning-format", "deepseek-legacy", threads=1)
    try:
        def one(**body):
            r = httpx.post(s.url + "/v1/chat/completions", timeout=60,
                           json={"messages": Q, "temperature": 0, "max_tokens": 8, **body})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]
        prompt = httpx.post(s.url + "/apply-template", json={"messages": Q}, timeout=60).json()["prompt"]
        assert prompt.endswith("<think>\n\n</think>\n\n")   # -rea off: the template closed the thought
        assert "reasoning_content" not in one()
        written = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
        split = {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT, "refusal": None}
        assert one(grammar=GRAMMAR, chat_template_kwargs=SELF, max_tokens=64) == split
        assert one(grammar=GRAMMAR, chat_template_kwargs=SELF, reasoning_format="deepseek", max_tokens=64) == split
        assert streamed(s.url, grammar=GRAMMAR, chat_template_kwargs=SELF) == ("", written)
        assert streamed(s.url, grammar=GRAMMAR, chat_template_kwargs=SELF, reasoning_format="deepseek") == \
            (THOUGHT, ANSWER)
        opened = streamed(s.url, max_tokens=8, chat_template_kwargs={"enable_thinking": True})   # the prompt opens it
        assert opened[0] == "" and opened[1].startswith("<think>\n") and len(opened[1]) > len("<think>\n")
        # Anthropic's thinking enabled asks the template to think over the server's -rea off; count_tokens agrees
        body = {"model": "m", "max_tokens": 8, "messages": Q, "temperature": 0, "thinking": {"type": "adaptive"}}
        m = httpx.post(s.url + "/v1/messages", json=body, timeout=60).json()
        assert [b["type"] for b in m["content"]] == ["thinking"], m
        n = httpx.post(s.url + "/v1/messages/count_tokens", json=body, timeout=60).json()["input_tokens"]
        assert n == m["usage"]["input_tokens"] + (m["usage"].get("cache_read_input_tokens") or 0)
        on = one(chat_template_kwargs={"enable_thinking": True})   # the request's variable wins
        assert on["reasoning_content"] and not on["content"]   # all thought: the tiny model never closes it
    finally:
        s.stop()
