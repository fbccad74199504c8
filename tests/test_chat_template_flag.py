"""--chat-template NAME|JINJA and --chat-template-file FILE (llama.cpp's flags): the template replaces the model
file's in `bitnet run --chat`, bitchat and `bitnet serve` (every chat endpoint, /apply-template, /props, ollama's
/api/show, and a --models-dir router's model processes). Expected prompts are rendered here with jinja2 itself
from the same template text, and token counts come from the engine's tokenizer, not from stored values."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import jinja2
import pytest

from helpers import ROOT

TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


def expected(template: str, messages, **kw) -> str:
    return jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(template).render(
        messages=messages, add_generation_prompt=True, **kw)


def bitnet(*args, stdin=None):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "bitnet_cpu", *args], cwd=ROOT, env=env, input=stdin,
                          capture_output=True, text=True, timeout=300)


def bitchat(*args, stdin):
    from helpers import console_script
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), BITCHAT_RECOVERY="")
    return subprocess.run([*console_script("bitchat"), *args], cwd=ROOT, env=env, input=stdin, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def llm():
    from bitnet_cpu.engine.api import load_model
    return load_model(None, progress=False)


def test_set_chat_template_renders_the_given_template_and_keeps_the_old_one_on_error(llm):
    from bitnet_cpu.engine.errors import BitNetError
    from bitnet_cpu.engine.runtime.chat_template import NAMED

    own = llm.chat_text(MSGS)
    llm.set_chat_template(TEMPLATE)
    try:
        assert llm.chat_text(MSGS) == expected(TEMPLATE, MSGS)
        assert llm.chat_template == TEMPLATE
        llm.set_chat_template("chatml")
        assert llm.chat_text(MSGS) == expected(NAMED["chatml"], MSGS)
        for bad in ("{% for %}", "{{ messages[9].content }}", "{{ raise_exception('no') }}"):
            with pytest.raises(BitNetError):
                llm.set_chat_template(bad)
            assert llm.chat_text(MSGS) == expected(NAMED["chatml"], MSGS)   # still the last good one
    finally:
        llm._chat_template = None
    assert llm.chat_text(MSGS) == own


def test_set_chat_template_refuses_a_mistyped_name_as_the_cli_does(llm):
    """set_chat_template("chatlm") (a typo of "chatml") took the word as a constant template, and every chat
    became that one word; now it is the CLI's --chat-template refusal (one check in the engine), a TemplateError
    naming the templates, and the template before stays."""
    from bitnet_cpu.engine.runtime.chat_template import NAMED, TemplateError

    own = llm.chat_text(MSGS)
    for bad in ("chatlm", "", "plain words"):
        with pytest.raises(TemplateError, match="not a template name") as e:
            llm.set_chat_template(bad)
        assert repr(bad) in str(e.value) and all(name in str(e.value) for name in NAMED)
        assert "\n" not in str(e.value) and llm.chat_text(MSGS) == own


def test_generation_tags_render_their_body(llm):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens for training masks;
    LFM2.5's and SmolLM3's templates use it) renders what it encloses, as the same template without the tags."""
    tagged = ("{% for m in messages %}[{{ m['role'] | upper }}] {% if m['role'] == 'assistant' %}{% generation %}"
              "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
              "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
    plain = tagged.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    msgs = MSGS + [{"role": "assistant", "content": "5."}, {"role": "user", "content": "And 2+4?"}]
    llm.set_chat_template(tagged)
    try:
        assert llm.chat_text(msgs) == expected(plain, msgs)
        assert "[ASSISTANT] 5.[USER]" in llm.chat_text(msgs)
    finally:
        llm._chat_template = None


def test_chat_prompts_start_with_one_bos_whatever_the_template_writes(llm):
    """llama-server tokenizes a chat prompt with add_special: a template without {{ bos_token }} (ChatML, Qwen's)
    still gets the BOS the model's tokenizer adds, where its prompts started without one; one that writes it does
    not get two."""
    bos, bos_text = llm.tokenizer.text_bos, llm.bos_text()
    assert bos is not None and bos_text
    try:
        for template in ("chatml", TEMPLATE, "{{ bos_token }}" + TEMPLATE, "llama3"):
            llm.set_chat_template(template)
            text = llm.chat_text(MSGS)
            ids = llm.chat_prompt(MSGS)
            assert ids[0] == bos and ids[1:] == llm.tokenize(text.removeprefix(bos_text), add_bos=False), template
    finally:
        llm._chat_template = None


def test_run_prompts_with_the_templates_text(llm, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    want = len(llm.tokenize(expected(TEMPLATE, MSGS[1:]), add_bos=True, special=True))   # BOS: the tokenizer's
    for flags in (("--chat-template-file", str(path)), ("--chat-template", TEMPLATE)):
        r = bitnet("run", "--chat", "-p", MSGS[1]["content"], "-n", "2", "--temp", "0", "--json", *flags)
        assert r.returncode == 0, r.stderr
        stats = json.loads(r.stdout.splitlines()[-1])["stats"]
        assert stats["n_prompt"] == want
    default = bitnet("run", "--chat", "-p", MSGS[1]["content"], "-n", "2", "--temp", "0", "--json")
    assert json.loads(default.stdout.splitlines()[-1])["stats"]["n_prompt"] != want


def test_no_cnv_completes_the_prompt_as_it_is(llm, tmp_path):
    """llama-cli's -no-cnv is raw completion: given with -sys or --chat-template it was ignored and the prompt went
    through the template. Now the prompt is completed as it is (BOS and its own tokens), with one warning line
    naming what is not used; without -no-cnv those flags still turn the chat on."""
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    raw = len(llm.tokenize(MSGS[1]["content"], add_bos=True))
    for flags, named in ((("-sys", "Be brief."), "-sys/--system-prompt"),
                         (("--chat-template-file", str(path)), "--chat-template-file")):
        r = bitnet("run", "-no-cnv", "-p", MSGS[1]["content"], "-n", "2", "--temp", "0", "--json", *flags)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout.splitlines()[-1])["stats"]["n_prompt"] == raw
        warned = [line for line in r.stderr.splitlines() if "-no-cnv" in line]
        assert len(warned) == 1 and named in warned[0] and "not used" in warned[0], r.stderr
        r = bitnet("run", "-p", MSGS[1]["content"], "-n", "2", "--temp", "0", "--json", *flags)
        assert json.loads(r.stdout.splitlines()[-1])["stats"]["n_prompt"] > raw and "-no-cnv" not in r.stderr


@pytest.mark.parametrize("flags,words", [
    (("--chat-template", "vicuna-ish"), "not a template name"),
    (("--chat-template", "{% for %}"), "does not parse"),
    (("--chat-template-file", "/nonexistent/t.jinja"), "--chat-template-file /nonexistent/t.jinja"),
    (("--chat-template", "chatml", "--chat-template-file", "x"), "give one"),
])
def test_bad_templates_are_one_line_before_anything_loads(flags, words):
    for cmd in (("run", "-p", "hi"), ("serve", "--port", "1")):
        r = bitnet(*cmd, *flags)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_a_template_file_is_jinja_never_a_name(tmp_path):
    """A --chat-template-file is read as a Jinja2 template (llama.cpp's reading), never looked up as a name: a file
    holding "chatml" was the named template in silence, and a file of plain text or an empty one was refused with
    its whole content where the path belongs. Now one line names the path and says why."""
    big = "plain text, no template markers. " * 400
    for name, content, words in (("name.txt", "chatml", "no Jinja2 in it"), ("plain.txt", big, "no Jinja2 in it"),
                                 ("empty.txt", "", "empty"), ("blank.txt", "\n\n", "only whitespace")):
        path = tmp_path / name
        path.write_text(content)
        for cmd in (("run", "-p", "hi"), ("serve", "--port", "1")):
            r = bitnet(*cmd, "--chat-template-file", str(path))
            assert r.returncode == 2 and f"--chat-template-file {path}: {words}" in r.stderr, r.stderr
            assert len(r.stderr.strip().splitlines()) == 1 and len(r.stderr) < 300, r.stderr


def test_a_template_that_does_not_render_is_one_line(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[7]['content'] }}")   # parses; fails on a real conversation
    r = bitnet("run", "--chat", "-p", "hi", "--chat-template-file", str(path))
    assert r.returncode == 2 and f"--chat-template-file {path}" in r.stderr and "Traceback" not in r.stderr
    r = bitchat("--chat-template-file", str(path), "-n", "4", stdin="hi\n")
    assert r.returncode == 2 and "--chat-template-file" in r.stderr and "Traceback" not in r.stderr


def test_bitchat_chats_with_the_template(llm, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    want = len(llm.tokenize(expected(TEMPLATE, [{"role": "user", "content": "hi"}]), add_bos=True, special=True))
    r = bitchat("--chat-template-file", str(path), "-n", "4", "--temp", "0", stdin="hi\n")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert f"prefill {want} new of {want}" in r.stderr + r.stdout   # its stats line: the prompt it rendered


def test_serve_renders_every_chat_with_it(tmp_path):
    pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
    from serve_proc import Server

    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    s = Server("--chat-template-file", str(path), threads=1)
    try:
        got = httpx.post(s.url + "/apply-template", json={"messages": MSGS}, timeout=60).json()["prompt"]
        assert got == expected(TEMPLATE, MSGS, bos_token="<|begin_of_text|>")
        # with BOS, as llama-server tokenizes a chat prompt (the template writes none)
        tokens = httpx.post(s.url + "/tokenize", json={"content": got, "add_special": True}, timeout=60).json()
        n = len(tokens["tokens"])
        chat = httpx.post(s.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1}, timeout=60).json()
        assert chat["usage"]["prompt_tokens"] == n
        assert httpx.get(s.url + "/props", timeout=30).json()["chat_template"] == TEMPLATE
        model = httpx.get(s.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        assert httpx.post(s.url + "/api/show", json={"model": model}, timeout=30).json()["template"] == TEMPLATE
    finally:
        s.stop()
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), models / "tiny.bnstore")
    s = Server("--models-dir", str(models), "--chat-template", "chatml", threads=1)
    try:
        from bitnet_cpu.engine.runtime.chat_template import NAMED
        got = httpx.post(s.url + "/apply-template", json={"model": "tiny", "messages": MSGS}, timeout=60).json()
        assert got["prompt"] == expected(NAMED["chatml"], MSGS)
        # ollama's /api/show, read from the file by the router (no load), names the template the model renders
        assert httpx.post(s.url + "/api/show", json={"model": "tiny"}, timeout=30).json()["template"] == NAMED["chatml"]
    finally:
        s.stop()


def test_serve_reports_the_fallback_template_where_the_model_has_none(tmp_path):
    """/props' chat_template and ollama's /api/show template are the template rendered: for a model file without
    one, the built-in fallback (they were "", though every chat was rendered with it)."""
    pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.formats.store import Store
    from bitnet_cpu.engine.synth import SynthModel, write_hf_dir
    from serve_proc import Server

    m = SynthModel(seed=5, style="llama")   # a llama-style model: no template is put in for it
    m.chat_template = None
    store = convert(write_hf_dir(m, str(tmp_path / "src")), str(tmp_path / "t.bnstore"), progress=False)
    assert Store(store).chat_template is None
    s = Server("-m", store, threads=1)
    try:
        props = httpx.get(s.url + "/props", timeout=30).json()
        got = httpx.post(s.url + "/apply-template", json={"messages": MSGS}, timeout=60).json()["prompt"]
        bos = props["bos_token"]
        assert expected(props["chat_template"], MSGS, bos_token=bos).removeprefix(bos) == got and got
        model = httpx.get(s.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        shown = httpx.post(s.url + "/api/show", json={"model": model}, timeout=30).json()["template"]
        assert shown == props["chat_template"]
    finally:
        s.stop()


def test_templates_get_the_tokenizer_configs_eos_and_bos_strings(tmp_path):
    """A template's eos_token / bos_token are tokenizer_config.json's strings, as transformers passes them: the
    bundled HF directory says <|eot_id|>, while its config.json's first end-of-text id is <|end_of_text|> (which a
    template ending turns with eos_token got before)."""
    from bitnet_cpu.engine.api import load_model
    from bitnet_cpu.engine.formats.convert import convert
    src = os.path.join(ROOT, "models", "bitnet-b1.58-tiny")
    with open(os.path.join(src, "tokenizer_config.json"), encoding="utf-8") as f:
        tc = json.load(f)
    store = convert(src, str(tmp_path / "t.bnstore"), progress=False)
    with load_model(store, ctx=64, progress=False) as llm:
        llm.set_chat_template("{{ bos_token }}|{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
        text = llm.chat_text([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert text == f"{tc['bos_token']}|hi{tc['eos_token']}" and tc["eos_token"] == "<|eot_id|>"


NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}<assistant>{% endif %}")


# Mistral's form: user and assistant alternate, any other role raises
ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
               "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% elif m['role'] == 'assistant' %}"
               "{{ m['content'] }}</s>{% else %}{{ raise_exception('Only user and assistant roles') }}{% endif %}"
               "{% endfor %}")


def test_a_template_without_a_system_role_gets_the_system_text_in_the_first_user_turn(llm, tmp_path):
    """Gemma's templates raise on a system message: the system text goes before the first user message's (llama.cpp's
    polyfill), where such a template was refused at --chat-template-file (`echo hi | bitchat` exited 2) and every
    request with a system prompt failed."""
    from bitnet_cpu.engine.errors import BitNetError
    folded = [{"role": "user", "content": "Be brief.\nWhat is 2+3?"}]
    llm.set_chat_template(NO_SYSTEM)
    try:
        assert llm.chat_text(MSGS) == expected(NO_SYSTEM, folded)
        assert llm.chat_text(MSGS[1:]) == expected(NO_SYSTEM, MSGS[1:])   # none: as it is
        with pytest.raises(BitNetError, match="System role not supported"):   # a template that fails anyway
            llm.set_chat_template(NO_SYSTEM + "{{ raise_exception('System role not supported') }}")
    finally:
        llm._chat_template = None   # the model file's again, for the module's other tests
    path = tmp_path / "nosys.jinja"
    path.write_text(NO_SYSTEM)
    r = bitchat("--chat-template-file", str(path), "--system", "Be brief.", "-n", "2", stdin="hi\n")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_every_system_message_is_folded_as_llama_cpp_folds_them(llm):
    """llama.cpp's polyfill for a template without a system role: system texts waiting are joined with a newline
    and go before the next user message's; before an assistant message or at the end they are a user message of
    their own. Only a leading one was folded: two system messages, a system prompt alone, or one in mid-conversation
    were "System role not supported"."""
    s1, s2 = {"role": "system", "content": "A."}, {"role": "system", "content": "B."}
    u, a = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}
    cases = [([s1, s2, u], [{"role": "user", "content": "A.\nB.\nhi"}]),
             ([s1], [{"role": "user", "content": "A."}]),
             ([u, a, s1, u], [u, a, {"role": "user", "content": "A.\nhi"}]),
             ([u, s1, a], [u, {"role": "user", "content": "A."}, a]),
             ([u, a, s1, s2], [u, a, {"role": "user", "content": "A.\nB."}])]
    anywhere = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported')"
                " }}{% endif %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>")
    for template in (anywhere, ALTERNATING):
        llm.set_chat_template(template)
        try:
            for msgs, folded in cases:
                if template is ALTERNATING and msgs[1:2] == [s1]:
                    continue   # two user turns in a row: that template refuses them however they come
                # (a final assistant message closed, not continued: the folding is what is checked)
                assert llm.chat_text(msgs, continue_final_message=False) == expected(template, folded), msgs
        finally:
            llm._chat_template = None


# a template with a system role that needs a user message (Llama-3.1's with tools in the first user message)
NEEDS_USER = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
              "{% if not messages | selectattr('role', 'equalto', 'user') | list %}"
              "{{ raise_exception('no first user message') }}{% endif %}")


def test_system_text_is_folded_only_for_templates_without_a_system_role(llm):
    """The system texts go into the user turns only for a template that refuses a system role (decided once, on a
    probe conversation, as llama.cpp does). They were folded after any error: a template with a system role got
    its system prompt as the user's message instead of its own error, and Gemma's said "System role not supported"
    where the real problem was two user messages in a row."""
    from bitnet_cpu.engine.errors import BitNetError
    llm.set_chat_template(NEEDS_USER)
    try:
        with pytest.raises(BitNetError, match="no first user message"):
            llm.chat_text([{"role": "system", "content": "S"}])
        llm.set_chat_template(ALTERNATING)
        with pytest.raises(BitNetError, match="Conversation roles must alternate") as e:
            llm.chat_text([{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                           {"role": "user", "content": "b"}])
        assert "System" not in str(e.value) and "Only user and assistant" not in str(e.value)
    finally:
        llm._chat_template = None


# microsoft/bitnet-b1.58-2B-4T's own template (its tokenizer_config.json)
HF_2B4T = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = message['role'] | "
           "capitalize + ': '+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = "
           "bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant: ' }}"
           "{% endif %}")


# the built-in form as earlier conversions stored it (for the official GGUF, whose own template is broken)
STORED_BEFORE = ("{{ bos_token }}{% for message in messages %}{{ message['role'] | capitalize }}: "
                 "{{ message['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}Assistant: {% endif %}")


def test_the_builtin_bitnet_template_trims_as_the_models_own(llm):
    """--chat-template bitnet (and the replacement of the official GGUF's broken template) renders as the 2B-4T
    model's own template, each content trimmed; a model file that stored the untrimmed form renders trimmed too."""
    msgs = [{"role": "system", "content": "Be brief.\n"}, {"role": "user", "content": " Hello there\n"}]
    want = expected(HF_2B4T, msgs, bos_token="<|begin_of_text|>")
    for template in ("bitnet", STORED_BEFORE):
        llm.set_chat_template(template)
        try:
            assert llm.chat_text(msgs) == want
        finally:
            llm._chat_template = None


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


NAMED_ROLES = ("{{ bos_token }}{% for m in messages %}{{ m.name if m.name is defined else m.role }}: {{ m['content'] }}"
               "\n{% endfor %}{% if add_generation_prompt %}assistant:{% else %}{{ eos_token }}{% endif %}")


def test_a_messages_name_and_other_keys_reach_the_template(llm):
    """A message's `name` (and any key the template reads) reaches it as given, as transformers passes messages:
    the messages were rebuilt as {role, content} for every template that does not render tools itself."""
    msgs = [{"role": "user", "name": "alice", "content": "Hi"}, {"role": "user", "name": "bob", "content": "Yo"}]
    llm.set_chat_template(NAMED_ROLES)
    try:
        assert llm.chat_text(msgs) == expected(NAMED_ROLES, msgs, bos_token="<|begin_of_text|>")
        assert "alice: Hi\nbob: Yo\n" in llm.chat_text(msgs, tools=TOOLS)   # with tools, the names stay too
    finally:
        llm._chat_template = None


def test_serve_takes_function_call_and_refusal_and_reports_the_templates_tokens(tmp_path):
    """An assistant's deprecated function_call is its one tool call and a refusal its text (both were dropped in
    silence: an empty assistant turn); one where it means nothing is a 400 naming it. A message's name reaches the
    template. /props' bos_token / eos_token are the strings the template is rendered with: rendering its
    chat_template with them gives the server's prompt (eos_token was the first end-of-text token, not the
    template's)."""
    pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")
    from serve_proc import Server

    path = tmp_path / "t.jinja"
    path.write_text(NAMED_ROLES)
    s = Server("--chat-template-file", str(path), threads=1)
    try:
        def apply(msgs, **kw):
            return httpx.post(s.url + "/apply-template", json={"messages": msgs, **kw}, timeout=60)

        call = {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}
        legacy = apply([{"role": "user", "content": "W?"},
                        {"role": "assistant", "content": None, "function_call": call},
                        {"role": "user", "content": "ok"}])
        modern = apply([{"role": "user", "content": "W?"},
                        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": call}]},
                        {"role": "user", "content": "ok"}])
        assert legacy.status_code == 200 and legacy.json() == modern.json()
        assert "get_weather" in legacy.json()["prompt"]
        refused = apply([{"role": "user", "content": "W?"}, {"role": "assistant", "content": None, "refusal": "No."},
                         {"role": "user", "content": "why"}]).json()["prompt"]
        assert "assistant: No.\n" in refused
        for bad, where in (({"role": "user", "content": "x", "function_call": call}, "function_call"),
                           ({"role": "assistant", "content": None, "function_call": call,
                             "tool_calls": [{"type": "function", "function": call}]}, "function_call")):
            r = apply([bad])
            assert r.status_code == 400 and where in r.json()["error"]["message"], r.text
        msgs = [{"role": "user", "name": "alice", "content": "u"}, {"role": "assistant", "content": "a"}]
        got = apply(msgs, add_generation_prompt=False, continue_final_message=False).json()["prompt"]
        props = httpx.get(s.url + "/props", timeout=30).json()
        want = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(NAMED_ROLES).render(
            messages=msgs, add_generation_prompt=False, bos_token=props["bos_token"], eos_token=props["eos_token"])
        assert "alice: u" in got and got == want.removeprefix(props["bos_token"]) and got.endswith("<|eot_id|>")
    finally:
        s.stop()


def _hf_model(tmp_path, template, jinja_file: str | None = None) -> str:
    """A converted synthetic model whose tokenizer_config.json holds `template` (a string or named templates),
    with chat_template.jinja beside it where jinja_file is given."""
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.synth import SynthModel, write_hf_dir
    m = SynthModel(seed=5, style="llama")
    m.chat_template = template
    src = write_hf_dir(m, str(tmp_path / "src"))
    if jinja_file is not None:
        with open(os.path.join(src, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(jinja_file)
    return convert(src, str(tmp_path / "t.bnstore"), progress=False)


ONE_USER = [{"role": "user", "content": "hi"}]


def test_chat_template_jinja_takes_priority_over_tokenizer_configs(tmp_path):
    """transformers reads chat_template.jinja before tokenizer_config.json's chat_template (hub repos keep an old
    template in the config and the fixed one in the file): the config's was rendered."""
    from bitnet_cpu.engine.api import load_model
    old = "{% for m in messages %}OLD {{ m['content'] }}\n{% endfor %}"
    new = "{% for m in messages %}NEW {{ m['content'] }}\n{% endfor %}"
    with load_model(_hf_model(tmp_path, old, jinja_file=new), ctx=64, progress=False) as llm:
        assert llm.chat_template == new
        assert llm.chat_text(ONE_USER) == expected(new, ONE_USER)


def test_a_named_tool_use_template_renders_requests_with_tools(tmp_path, llm):
    """tokenizer_config.json's named templates [{"name": "default"}, {"name": "tool_use"}]: a request with tools
    is rendered with tool_use, as transformers and llama.cpp pick it; the conversion dropped it and every request
    got the default with the generic tool block."""
    from bitnet_cpu.engine.api import load_model
    default = "{% for m in messages %}DEFAULT {{ m['content'] }}\n{% endfor %}"
    tool_use = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}For each call return\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'   # Hermes' form
                "{% for m in messages %}TOOLUSE {{ m['content'] }}\n{% endfor %}")
    named = [{"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}]
    with load_model(_hf_model(tmp_path, named), ctx=64, progress=False) as model:
        assert model.chat_text(ONE_USER) == expected(default, ONE_USER)
        assert model.chat_text(ONE_USER, tools=TOOLS) == expected(tool_use, ONE_USER, tools=TOOLS)
        model.set_chat_template("chatml")   # a template given replaces both
        assert model.chat_text(ONE_USER, tools=TOOLS).startswith("<|im_start|>system\nYou can call these tools")
    # a model file converted before (no tool_use kept): its one template, for requests with tools too
    assert "chat_template_tool_use" not in llm.store.meta and llm.template_for(True) == llm.chat_template


LOOPS = ("{% for m in messages %}{% if 'LOOP' in m['content'] %}{% for i in range(100000) %}{% for j in range(9) %}"
         "{% endfor %}{% endfor %}{% endif %}{{ m['content'] }}{% endfor %}")


def test_template_errors_name_where_the_template_came_from(llm, tmp_path):
    """A template's error hint names its source (the flag and file, set_chat_template), not "the model file"; an
    empty message list is said to be one (it read as a broken template)."""
    from bitnet_cpu.engine.errors import BitNetError
    path = tmp_path / "t.jinja"
    path.write_text(LOOPS)
    r = bitnet("run", "--chat-template-file", str(path), "-p", "LOOP", "-n", "1")
    assert r.returncode == 2 and f"the template of --chat-template-file {path} loops" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "model file" not in r.stderr
    llm.set_chat_template(LOOPS, source="--chat-template-file t.jinja")
    try:
        with pytest.raises(BitNetError, match="the template of --chat-template-file t.jinja loops") as e:
            llm.chat_text([{"role": "user", "content": "LOOP"}])
        assert "model file" not in str(e.value)
        with pytest.raises(BitNetError, match="the template of set_chat_template is broken"):
            llm.set_chat_template("{{ messages[0]['content'].nope() }}")
        llm.set_chat_template("{{ messages[0]['content'] }}")
        with pytest.raises(BitNetError, match="the message list is empty") as e:
            llm.chat_text([])
        assert "broken" not in str(e.value)
    finally:
        llm._chat_template = None
