"""Logprobs against the text a client gets, on a real `bitnet serve` (bundled model, whose byte-level vocabulary
splits a non-ASCII character over several tokens): /v1/completions names a token that is part of a character
"bytes:\\xNN" (OpenAI's legacy way), so different tokens keep different names; its text_offset indexes into the
returned text (the bytes of one character share its offset), streamed and not; a chat answer that became tool
calls has no records of the call's markup; vLLM's repetition_penalty is llama.cpp's repeat_penalty over the
whole context."""
from __future__ import annotations

import json
import re

import httpx
import pytest

pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")

from serve_proc import Server  # noqa: E402

ACCENTS = 'root ::= ("é" | "è" | "ü") "."'
# 2-, 3- and 4-byte characters
MIXED = "Zürich crème brûlée 日本 😀 ok"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server():
    s = Server("--parallel", "4")
    yield s
    s.stop()


def post(server, path, **body):
    r = httpx.post(server.url + path, json=body, timeout=120)
    return r.status_code, r.json()


def streamed(server, path, **body) -> list[dict]:
    out = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def raw_bytes(name: str) -> bytes:
    """A legacy logprobs token name back to its bytes ("bytes:\\xc3" -> b"\\xc3")."""
    if name.startswith("bytes:"):
        return bytes(int(h, 16) for h in re.findall(r"\\x([0-9a-f]{2})", name[6:]))
    return name.encode("utf-8")


def check_offsets(text: str, lp: dict):
    """Each text_offset is the character of `text` the token's first byte lies in (one at the very end: len(text)),
    a token that is whole text reads as itself there, and a "bytes:" name is no whole UTF-8 text."""
    at = 0   # the token's first byte in text's UTF-8
    for name, off in zip(lp["tokens"], lp["text_offset"]):
        b = raw_bytes(name)
        if name.startswith("bytes:"):
            with pytest.raises(UnicodeDecodeError):
                b.decode("utf-8")
        else:
            assert text[off:off + len(name)] == name
        assert 0 <= off <= len(text)
        if off < len(text):
            assert len(text[:off].encode("utf-8")) <= at < len(text[:off + 1].encode("utf-8")), (name, off)
        else:
            assert at >= len(text.encode("utf-8"))
        at += len(b)
    assert lp["text_offset"] == sorted(lp["text_offset"])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_byte_tokens_keep_their_own_names(server, seed):
    """A sampled byte token and the other byte tokens of its position have names of their own: each of the
    grammar's 3 allowed continuation bytes is a top_logprobs key, tokens[i] is a key there only with its own
    logprob (an é sampled where è was likelier is no longer "the top token"), and the names spell the text."""
    code, r = post(server, "/v1/completions", prompt="Letter:", max_tokens=4, temperature=1.5, seed=seed,
                   logprobs=3, grammar=ACCENTS)
    assert code == 200, r
    c = r["choices"][0]
    lp = c["logprobs"]
    assert b"".join(raw_bytes(t) for t in lp["tokens"]).decode("utf-8") == c["text"]
    second = lp["top_logprobs"][1]   # after 0xc3: the continuation bytes of é, è and ü
    assert len(second) == 3 and all(k.startswith("bytes:\\x") for k in second)
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(set(top)) == len(top)
        if tok in top:
            assert top[tok] == v
        greedy = max(top, key=top.get)
        assert (greedy == tok) == (top[greedy] == v)


@pytest.mark.parametrize("prompt, body", [
    ("Dessert:", {"grammar": f'root ::= "{MIXED}"', "max_tokens": 40}),
    (f"The café in {MIXED} and", {"echo": True, "max_tokens": 4}),
], ids=["grammar", "echo"])
def test_text_offset_indexes_into_the_text(server, prompt, body):
    """text_offset on text with 2-, 3- and 4-byte characters (a grammar-forced answer; an echoed accented prompt
    and its completion): each offset is the character its token's first byte lies in, never past the text; a
    stream gives the same tokens, logprobs and offsets."""
    kw = dict(prompt=prompt, temperature=0, logprobs=2, **body)
    code, r = post(server, "/v1/completions", **kw)
    assert code == 200, r
    c = r["choices"][0]
    if "grammar" in body:
        assert c["text"] == MIXED
    else:
        assert c["text"].startswith(prompt)
    check_offsets(c["text"], c["logprobs"])
    text, got = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in streamed(server, "/v1/completions", **kw):
        for x in ch["choices"]:
            text += x["text"]
            for k in got:
                got[k] += (x["logprobs"] or {}).get(k) or []
    assert text == c["text"] and got == c["logprobs"]


def test_a_tool_call_answer_has_no_records_of_its_markup(server):
    """An answer that became a tool call (content null) has logprobs.content null, as OpenAI's: the <tool_call>
    markup is no text of the message; a stream carries no records either (and the same names and logprobs as the
    whole answer where it carries any)."""
    body = dict(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, tool_choice="required",
                max_tokens=40, temperature=0, logprobs=True, top_logprobs=1)
    code, r = post(server, "/v1/chat/completions", **body)
    assert code == 200, r
    c = r["choices"][0]
    assert c["message"]["content"] is None and c["message"]["tool_calls"]
    assert c["logprobs"] == {"content": None, "refusal": None}
    records, calls = [], []
    for ch in streamed(server, "/v1/chat/completions", **body):
        for x in ch["choices"]:
            records += (x["logprobs"] or {}).get("content") or []
            calls += x["delta"].get("tool_calls") or []
    assert calls and records == []


def test_an_answer_beside_tools_has_the_records_of_its_content(server):
    """With tools offered and tool_choice auto: the records are those of the message's content (its bytes
    joined are the content; none where the answer is a call alone), streamed and not."""
    base = dict(messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS, tool_choice="auto",
                max_tokens=24, temperature=0, logprobs=True)
    code, r = post(server, "/v1/chat/completions", **base)
    assert code == 200, r
    c = r["choices"][0]
    content = c["message"]["content"]
    entries = (c["logprobs"] or {}).get("content") or []
    assert bytes(b for e in entries for b in e["bytes"]).decode("utf-8") == (content or "")
    records = []
    for ch in streamed(server, "/v1/chat/completions", **base):
        for x in ch["choices"]:
            records += (x["logprobs"] or {}).get("content") or []
    assert records == entries


def test_repetition_penalty_is_repeat_penalty_over_the_whole_context(server):
    """vLLM's repetition_penalty (HF's rule over prompt and answer) is repeat_penalty with repeat_last_n -1: the
    same text and logprobs, on completions and chat; it changes a greedy answer's logprobs (it was ignored); sent
    with a repeat_penalty of another value or a repeat_last_n window it is a 400 naming it; its range is
    repeat_penalty's."""
    kw = dict(prompt="Once upon a time, once upon a time", max_tokens=8, temperature=0, logprobs=1)
    vllm = post(server, "/v1/completions", repetition_penalty=1.5, **kw)[1]["choices"][0]
    llama = post(server, "/v1/completions", repeat_penalty=1.5, repeat_last_n=-1, **kw)[1]["choices"][0]
    plain = post(server, "/v1/completions", **kw)[1]["choices"][0]
    assert (vllm["text"], vllm["logprobs"]) == (llama["text"], llama["logprobs"])
    assert vllm["logprobs"]["token_logprobs"] != plain["logprobs"]["token_logprobs"]
    both = post(server, "/v1/completions", repetition_penalty=1.5, repeat_penalty=1.5, **kw)[1]["choices"][0]
    assert both["logprobs"] == vllm["logprobs"]
    chat = dict(messages=[{"role": "user", "content": "Say it again and again: again"}], max_tokens=8,
                temperature=0, logprobs=True)
    a = post(server, "/v1/chat/completions", repetition_penalty=1.3, **chat)[1]["choices"][0]
    b = post(server, "/v1/chat/completions", repeat_penalty=1.3, repeat_last_n=-1, **chat)[1]["choices"][0]
    assert (a["message"], a["logprobs"]) == (b["message"], b["logprobs"])
    for path, extra in (("/v1/completions", kw), ("/v1/chat/completions", chat)):
        for bad in ({"repeat_penalty": 1.2}, {"repeat_last_n": 64}, {}):
            code, r = post(server, path, **extra, repetition_penalty=0 if not bad else 1.5, **bad)
            assert code == 400, r
            assert r["error"]["param"] == "repetition_penalty" and "\n" not in r["error"]["message"]
    # vLLM's "off" (1, in every request of its clients) beside llama.cpp's fields: those as sent (it was a 400)
    windowed = post(server, "/v1/completions", repeat_penalty=1.5, repeat_last_n=8, **kw)[1]["choices"][0]
    off = post(server, "/v1/completions", repetition_penalty=1, repeat_penalty=1.5, repeat_last_n=8, **kw)
    assert off[0] == 200 and off[1]["choices"][0]["logprobs"] == windowed["logprobs"], off
