"""A message's text parts, as every API of `bitnet serve` takes them (OpenAI's chat, its Responses API,
Anthropic's Messages, llama-server's /apply-template): one text with "\\n" between two parts, as llama-server and
vLLM join them. Each is checked against the same conversation sent as plain strings joined so, on a real server
(the prompt's text where the API shows it, else its token count)."""
from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")

from serve_proc import Server  # noqa: E402

DOC = "Hi"      # "Hi" + "there" and "Hi\nthere" are told apart by the counts on the bundled tokenizer
ASK = "there"


@pytest.fixture(scope="module")
def server():
    s = Server(threads=1)
    yield s
    s.stop()


def post(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_parts_render_with_a_newline_between_them(server):
    parts = [{"role": "user", "content": [{"type": "text", "text": DOC}, {"type": "text", "text": ASK}]}]
    prompt = post(server, "/apply-template", {"messages": parts})["prompt"]
    assert prompt == post(server, "/apply-template", {"messages": [
        {"role": "user", "content": DOC + "\n" + ASK}]})["prompt"]
    assert DOC + "\n" + ASK in prompt
    n = post(server, "/v1/chat/completions/input_tokens", {"messages": parts})["input_tokens"]
    assert n == post(server, "/v1/chat/completions/input_tokens", {"messages": [
        {"role": "user", "content": DOC + "\n" + ASK}]})["input_tokens"]


def test_responses_and_anthropic_parts_count_as_the_text_joined_so(server):
    def responses(content):
        return post(server, "/v1/responses/input_tokens", {"model": "any", "input": [
            {"role": "user", "content": content}]})["input_tokens"]

    def anthropic(content):
        return post(server, "/v1/messages/count_tokens", {"model": "any", "messages": [
            {"role": "user", "content": content}]})["input_tokens"]

    joined, glued = DOC + "\n" + ASK, DOC + ASK
    assert responses(joined) != responses(glued)   # the counts tell the two apart on this tokenizer
    assert responses([{"type": "input_text", "text": DOC}, {"type": "input_text", "text": ASK}]) == responses(joined)
    assert anthropic([{"type": "text", "text": DOC}, {"type": "text", "text": ASK}]) == anthropic(joined)
    # Anthropic's system blocks, too
    sys_n = post(server, "/v1/messages/count_tokens", {"model": "any", "system": [
        {"type": "text", "text": DOC}, {"type": "text", "text": ASK}], "messages": [
        {"role": "user", "content": "hi"}]})["input_tokens"]
    assert sys_n == post(server, "/v1/messages/count_tokens", {"model": "any", "system": joined, "messages": [
        {"role": "user", "content": "hi"}]})["input_tokens"]
