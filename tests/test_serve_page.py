"""The chat page at `/` in a real headless browser (Playwright + Chromium): type a question and see the
streamed answer (the same text the API gives for the same greedy request), stop a long answer, start a new
chat; the screenshot is kept as an artifact (tests/artifacts/serve_chat_page.png, path printed)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil

import httpx
import pytest

pw = pytest.importorskip("playwright.sync_api", reason="the page test needs playwright (pip install .[test])")
from serve_proc import ROOT, Server  # noqa: E402

CHROMIUM = os.environ.get("BITNET_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = os.path.join(ROOT, "tests", "artifacts")


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM:
        pytest.skip("no chromium binary (apt install chromium, or set BITNET_CHROMIUM)")
    with pw.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def _set(page, **settings):
    for k, v in settings.items():
        page.fill(f"#{k}", str(v))


def test_chat_page_streams_answer(browser):
    s = Server("--parallel", "4")
    try:
        q = "What is 12+7?"
        want = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": q}], "temperature": 0, "max_tokens": 64}).json()
        want_text = want["choices"][0]["message"]["content"]
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        page.goto(s.url + "/")
        page.wait_for_function("document.getElementById('model').textContent.includes('ctx')", timeout=20000)
        _set(page, temperature=0, max_tokens=64)
        page.fill("#input", q)
        page.keyboard.press("Enter")
        page.wait_for_selector("#log .msg.assistant:not(.streaming)", timeout=30000)
        page.wait_for_function("document.getElementById('stats').textContent.includes('finish')", timeout=30000)
        got = page.inner_text("#log .msg.assistant .text")
        assert got == want_text
        assert page.inner_text("#log .msg.user .text") == q
        stats = page.inner_text("#stats")
        assert "tok/s" in stats and "first token" in stats
        os.makedirs(ARTIFACTS, exist_ok=True)
        shot = os.path.join(ARTIFACTS, "serve_chat_page.png")
        page.screenshot(path=shot, full_page=True)
        print(f"\nscreenshot: {shot}")
        assert os.path.getsize(shot) > 5000
        page.click("#new")
        assert page.locator("#log .msg").count() == 0
        page.close()
    finally:
        assert s.stop()[0] == 0


def test_chat_page_stop_long_answer(browser, tmp_path_factory):
    """A random model that greedily never ends: Stop must end the answer and free the server's slot."""
    from serve_proc import slow_model
    s = Server("-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "2")
    try:
        page = browser.new_page()
        page.goto(s.url + "/")
        page.wait_for_function("document.getElementById('model').textContent.includes('ctx')", timeout=20000)
        _set(page, temperature=0, max_tokens=3000)
        page.fill("#input", "a")
        page.click("#send")
        page.wait_for_function("document.querySelector('#log .msg.assistant .text')?.textContent.length > 0",
                               timeout=30000)
        assert page.is_enabled("#stop")
        page.click("#stop")
        page.wait_for_function("document.getElementById('stats').textContent.startsWith('stopped after')", timeout=10000)
        n = int(page.inner_text("#stats").split()[2])
        assert 0 < n < 3000
        assert page.is_enabled("#send") and not page.is_enabled("#stop")
        assert s.slots_when_idle()["slots"] == []
        page.close()
    finally:
        assert s.stop()[0] == 0


def test_chat_page_asks_for_the_key(browser):
    """With --api-key the page gets a 401, asks for the key, works once it is typed in, and never stores it."""
    s = Server("--api-key", "page-secret-key", "--parallel", "2")
    try:
        page = browser.new_page()
        page.goto(s.url + "/")
        page.wait_for_function("document.getElementById('model').textContent.includes('API key')", timeout=20000)
        assert "needs an API key" in page.inner_text("#model")
        page.fill("#api_key", "not-the-key")   # a wrong key is said to be refused, not missing
        page.dispatch_event("#api_key", "change")
        page.wait_for_function("document.getElementById('model').textContent.includes('refused')", timeout=20000)
        page.fill("#api_key", "page-secret-key")
        page.dispatch_event("#api_key", "change")
        page.wait_for_function("document.getElementById('model').textContent.includes('ctx')", timeout=20000)
        _set(page, temperature=0, max_tokens=8)
        page.fill("#input", "What is 12+7?")
        page.keyboard.press("Enter")
        page.wait_for_function("document.getElementById('stats').textContent.includes('finish')", timeout=30000)
        assert page.inner_text("#log .msg.assistant .text")
        stored = page.evaluate("JSON.stringify(Object.assign({}, localStorage, sessionStorage))")
        assert "page-secret-key" not in stored
        page.close()
    finally:
        assert s.stop()[0] == 0


def test_chat_page_picks_among_the_routers_models(browser, tmp_path_factory):
    """bitnet serve --models-dir: the page offers the models in a picker, and each answer comes from the one
    picked (the same text the API gives through the router for that model)."""
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir

    d = tmp_path_factory.mktemp("page-models")
    shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), d / "tiny.bnstore")
    src = write_hf_dir(SynthModel(small_config(max_position_embeddings=4096), seed=11),
                       str(tmp_path_factory.mktemp("page-hf") / "synth"))
    convert(src, str(d / "synth.bnstore"), progress=False)
    s = Server("--models-dir", str(d), "-c", "1024", "--temp", "0.3", "--top-k", "7")
    try:
        q = "What is 12+7?"
        want = {name: httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "model": name, "messages": [{"role": "user", "content": q}], "temperature": 0, "max_tokens": 24,
        }).json()["choices"][0]["message"]["content"] for name in ("tiny", "synth")}
        assert want["tiny"] != want["synth"]
        page = browser.new_page()
        page.goto(s.url + "/")
        page.wait_for_selector("#pick:not([hidden])", timeout=20000)
        assert sorted(page.eval_on_selector_all("#pick option", "os => os.map(o => o.value)")) == ["synth", "tiny"]
        _set(page, temperature=0, max_tokens=24)
        for name in ("synth", "tiny"):
            page.click("#new")
            page.select_option("#pick", name)
            page.fill("#input", q)
            page.keyboard.press("Enter")
            page.wait_for_selector("#log .msg.assistant:not(.streaming)", timeout=30000)
            page.wait_for_function("document.getElementById('stats').textContent.includes('finish')",
                                   timeout=30000)
            assert page.inner_text("#log .msg.assistant .text") == want[name], name
            assert page.input_value("#pick") == name   # the listing refreshed after the answer keeps the pick
            # the empty fields show the picked model's own settings (the router's flags), as on one model's
            # server; they showed nothing under a note saying the server's settings are shown greyed
            page.wait_for_function("document.getElementById('top_k').placeholder === '7'", timeout=20000)
            assert float(page.get_attribute("#temperature", "placeholder")) == 0.3
        page.close()
    finally:
        assert s.stop()[0] == 0


def test_chat_page_shows_a_thought_apart(browser, tmp_path_factory):
    """A thinking model's reasoning_content is shown in its own block above the answer, and never sent back as
    the assistant's text (chat templates leave past thoughts out)."""
    from test_serve_reasoning import TEMPLATE
    path = tmp_path_factory.mktemp("think") / "think.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    s = Server("--parallel", "2", "--chat-template-file", str(path))
    try:
        q = "What is 12+7?"
        want = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": q}], "temperature": 0, "max_tokens": 16}).json()
        msg = want["choices"][0]["message"]
        assert msg["reasoning_content"]   # the tiny model does not close its thought in 16 tokens
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        page.goto(s.url + "/")
        page.wait_for_function("document.getElementById('model').textContent.includes('ctx')", timeout=20000)
        _set(page, temperature=0, max_tokens=16)
        page.fill("#input", q)
        page.keyboard.press("Enter")
        page.wait_for_function("document.getElementById('stats').textContent.includes('finish')", timeout=30000)
        assert page.inner_text("#log .msg.assistant .thought") == msg["reasoning_content"]
        assert page.inner_text("#log .msg.assistant .text") == (msg["content"] or "")
        page.close()
    finally:
        assert s.stop()[0] == 0


def _ready(page):
    page.wait_for_function("document.getElementById('model').textContent.includes('ctx')", timeout=20000)


@contextlib.contextmanager
def _served(browser, *args, env=None, **page_kw):
    """A `bitnet serve` with `args` and a new browser page (not loaded yet: listeners and routes go on first);
    the server must stop cleanly after."""
    s = Server(*args, env=env)
    try:
        page = browser.new_page(**page_kw)
        yield s, page
        page.close()
    finally:
        assert s.stop()[0] == 0


def _load(page, url):
    page.goto(url)
    _ready(page)


def _ask(page, q):
    page.fill("#input", q)
    page.keyboard.press("Enter")
    page.wait_for_function("document.getElementById('stats').textContent.includes('finish')", timeout=30000)


def _started(page, q, part="text"):
    """Send q and wait until the answer's `part` (text or thought) shows its first characters."""
    page.fill("#input", q)
    page.keyboard.press("Enter")
    page.wait_for_function(f"document.querySelector('#log .msg.assistant .{part}')?.textContent.length > 0",
                           timeout=30000)


def _bodies(page) -> list:
    """The chat requests' bodies the page sends, in order (filled as it sends them)."""
    bodies = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/chat/completions") else None)
    return bodies


def test_chat_page_leaves_sampling_to_the_server_unless_set(browser):
    """Fields left empty send nothing: the server's own settings (--temp 0 here) answer, as the API's greedy
    answer; the fields show the server's values (/props) as placeholders. The page sent its own 0.8 / 256."""
    with _served(browser, "--parallel", "2", "--temp", "0", "--seed", "7") as (s, page):
        q = "What is 12+7?"
        want = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": q}], "temperature": 0}).json()["choices"][0]["message"]["content"]
        bodies = _bodies(page)
        _load(page, s.url + "/")
        page.wait_for_function("document.getElementById('temperature').placeholder !== ''", timeout=20000)
        assert float(page.get_attribute("#temperature", "placeholder")) == 0.0
        assert page.get_attribute("#seed", "placeholder") == "7"
        _ask(page, q)
        assert page.inner_text("#log .msg.assistant .text") == want
        assert not {"temperature", "max_tokens", "top_k", "seed"} & set(bodies[-1])
        _set(page, top_k=5)
        _ask(page, q)
        assert bodies[-1]["top_k"] == 5   # what the user sets is sent


def test_chat_page_new_chat_while_an_answer_streams(browser, tmp_path_factory):
    """New chat during an answer: the new conversation starts empty (the cut answer went into it, and its
    'stopped' line showed in the empty chat)."""
    from serve_proc import slow_model
    with _served(browser, "-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "2") as (s, page):
        bodies = _bodies(page)
        _load(page, s.url + "/")
        _set(page, temperature=0, max_tokens=3000)
        _started(page, "first question", "text")
        page.click("#new")
        page.wait_for_function("document.getElementById('stop').disabled", timeout=10000)
        assert page.inner_text("#stats") == "" and page.locator("#log .msg").count() == 0
        _set(page, max_tokens=3)
        _ask(page, "a new topic")
        assert [m["role"] for m in bodies[-1]["messages"]] == ["user"]
        assert bodies[-1]["messages"][0]["content"] == "a new topic"


def test_chat_page_behind_a_path_prefix(browser):
    """A reverse proxy publishing the server under /bitnet/ (nginx `location /bitnet/ { proxy_pass ...; }`): the
    page asks for its API under the same prefix (it asked the proxy's root, 404)."""
    with _served(browser, "--parallel", "2") as (s, page):
        def proxy(route):
            path = route.request.url.split("://", 1)[1].split("/", 1)[1]
            if not path.startswith("bitnet/"):
                return route.fulfill(status=404, content_type="text/html", body="<h1>not the bitnet server</h1>")
            route.fulfill(response=route.fetch(url=s.url + "/" + path[len("bitnet/"):]))
        page.route("**/*", proxy)
        page.goto(s.url + "/bitnet/")
        _ready(page)
        _set(page, temperature=0, max_tokens=8)
        _ask(page, "What is 12+7?")
        assert page.inner_text("#log .msg.assistant .text")


def test_chat_page_enter_picks_an_input_method_candidate(browser):
    """Enter while an input method composes (Japanese, Chinese) picks the candidate; it sent the half-typed text."""
    with _served(browser, "--parallel", "2") as (s, page):
        _load(page, s.url + "/")
        page.focus("#input")
        cdp = page.context.new_cdp_session(page)
        cdp.send("Input.imeSetComposition", {"text": "にほん", "selectionStart": 3, "selectionEnd": 3})
        cdp.send("Input.dispatchKeyEvent", {"type": "rawKeyDown", "key": "Enter", "code": "Enter",
                                            "windowsVirtualKeyCode": 13})
        cdp.send("Input.insertText", {"text": "日本"})
        cdp.send("Input.dispatchKeyEvent", {"type": "keyUp", "key": "Enter", "code": "Enter",
                                            "windowsVirtualKeyCode": 13})
        page.wait_for_function("document.getElementById('input').value === '日本'", timeout=5000)
        assert page.locator("#log .msg").count() == 0


def test_chat_page_on_a_phone_reaches_its_settings(browser):
    """A narrow screen hides the settings in a drawer; a server that needs a key opens it at the key's field (the
    field was hidden, so such a server could not be used from a phone)."""
    with _served(browser, "--api-key", "phone-key", "--parallel", "2",
                 viewport={"width": 390, "height": 740}) as (s, page):
        page.goto(s.url + "/")
        page.wait_for_function("document.getElementById('model').textContent.includes('API key')", timeout=20000)
        assert page.is_visible("#api_key")
        page.fill("#api_key", "phone-key")
        page.dispatch_event("#api_key", "change")
        _ready(page)
        page.click("#close_settings")
        assert not page.is_visible("#temperature")
        page.click("#settings")
        _set(page, temperature=0, max_tokens=6)
        page.keyboard.press("Escape")
        assert not page.is_visible("#temperature")
        _ask(page, "What is 12+7?")
        assert page.inner_text("#log .msg.assistant .text")


def test_chat_page_keeps_the_text_before_a_mid_answer_error(browser):
    """A fault in the middle of an answer (BITNET_FAULT_TOKEN, the engine's test hook: the step holding that token
    fails) keeps the text shown so far, marked cut off, and it is the answer the next turn sends back; the page
    wiped it and dropped the question from the conversation, while both stayed on screen."""
    q = "What is 12+7?"
    s = Server("--parallel", "2")
    try:
        r = httpx.post(s.url + "/completion", timeout=60, json={
            "prompt": httpx.post(s.url + "/apply-template", json={"messages": [{"role": "user", "content": q}]},
                                 timeout=60).json()["prompt"], "temperature": 0, "n_predict": 24,
            "return_tokens": True}).json()
        prompt_ids = httpx.post(s.url + "/tokenize", json={"content": r["prompt"], "add_special": True},
                                timeout=60).json()["tokens"]
    finally:
        assert s.stop()[0] == 0
    # a token of the answer, not of the prompt, a few tokens in: the answer fails there
    k, bad = next((k, t) for k, t in enumerate(r["tokens"])
                  if k >= 3 and t not in prompt_ids and t not in r["tokens"][:k])
    with _served(browser, "--parallel", "2", env={"BITNET_FAULT_TOKEN": str(bad)}) as (s, page):
        bodies = _bodies(page)
        _load(page, s.url + "/")
        _set(page, temperature=0, max_tokens=24)
        page.fill("#input", q)
        page.keyboard.press("Enter")
        page.wait_for_selector("#log .msg.error", timeout=30000)
        cut = page.inner_text("#log .msg.assistant .text")
        assert cut and r["content"].startswith(cut) and page.locator("#log .msg.assistant.cut").count() == 1
        _set(page, max_tokens=1)
        page.fill("#input", "and 3+4?")
        page.keyboard.press("Enter")
        page.wait_for_function("document.querySelectorAll('#log .msg.user').length === 2", timeout=10000)
        page.wait_for_function("!document.getElementById('send').disabled", timeout=30000)
        assert [(m["role"], m["content"]) for m in bodies[-1]["messages"]] == \
            [("user", q), ("assistant", cut), ("user", "and 3+4?")]


def test_chat_page_stop_while_queued_leaves_no_empty_turn(browser, tmp_path_factory):
    """Stop before the first token (the page's request waiting behind another on a one-slot server): no empty
    assistant bubble stays, and no empty assistant turn is sent back with the next question (it was)."""
    import threading

    from serve_proc import slow_model
    with _served(browser, "-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "1") as (s, page):
        bodies = _bodies(page)
        _load(page, s.url + "/")
        started = threading.Event()

        def occupy():   # holds the one slot until the page's Stop is seen; then hangs up (the slot frees)
            with httpx.stream("POST", s.url + "/v1/completions", timeout=120, json={
                    "prompt": "a", "max_tokens": 3000, "temperature": 0, "stream": True}) as r:
                for _ in r.iter_lines():
                    started.set()
                    if done.is_set():
                        return
        done = threading.Event()
        t = threading.Thread(target=occupy, daemon=True)
        t.start()
        assert started.wait(60)
        _set(page, temperature=0, max_tokens=3)
        page.fill("#input", "first question")
        page.keyboard.press("Enter")
        page.wait_for_function("document.getElementById('stats').textContent === '…'", timeout=10000)
        page.click("#stop")
        page.wait_for_function("document.getElementById('stats').textContent.startsWith('stopped')", timeout=10000)
        done.set()
        t.join(60)
        assert page.inner_text("#stats") == "stopped before the first token"
        assert page.locator("#log .msg.assistant").count() == 0
        assert page.locator("#log .msg.user.unsent").count() == 1
        _ask(page, "second question")
        assert [m["role"] for m in bodies[-1]["messages"]] == ["user"]
        assert bodies[-1]["messages"][0]["content"] == "second question"


def test_chat_page_says_what_to_do_when_the_conversation_outgrows_the_context(browser):
    """A conversation longer than the context (each turn sends all of it): the error says to start a New chat,
    where the server's words alone said to shorten a prompt the user never wrote; a lost server is said to be
    lost (fetch's own "Failed to fetch" was shown); the page asks for no /favicon.ico (a console error)."""
    with _served(browser, "--parallel", "2", "-c", "256") as (s, page):
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        _load(page, s.url + "/")
        _set(page, temperature=0, max_tokens=2)
        words = " ".join(["story"] * 100)
        _ask(page, words)
        assert page.locator("#log .msg.assistant").count() == 1
        # an answer cut at max_tokens is marked so (it looked whole; only the stats line said "length")
        api = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": words}], "temperature": 0, "max_tokens": 2}).json()
        cut = api["choices"][0]["finish_reason"] == "length"
        assert (page.locator("#log .msg.assistant.cut").count() == 1) == cut, api["choices"][0]
        page.fill("#input", words + " " + words)
        page.keyboard.press("Enter")
        page.wait_for_selector("#log .msg.error", timeout=30000)
        assert "start a New chat" in page.inner_text("#log .msg.error")
        assert errors == [m for m in errors if "400" in m], errors   # the refused turn's 400, nothing else
        s.stop()
        page.fill("#input", "hello?")
        page.keyboard.press("Enter")
        page.wait_for_function("document.querySelectorAll('#log .msg.error').length === 2", timeout=30000)
        assert "lost the connection to the server" in page.locator("#log .msg.error").nth(1).inner_text()


def test_chat_page_sends_number_settings_as_typed(browser):
    """A number field is sent as typed: "1e3" max tokens is 1000 and a top-k of 2.5 reaches the server, whose 400
    the page shows; the page read both with parseInt, sending 1 and 2 (and "0.5", 0: top-k off) without a word."""
    with _served(browser, "--parallel", "2") as (s, page):
        bodies = _bodies(page)
        _load(page, s.url + "/")
        _set(page, temperature=0, max_tokens="1e3", top_k=40)
        _ask(page, "What is 12+7?")
        assert bodies[-1]["max_tokens"] == 1000 and bodies[-1]["top_k"] == 40
        _set(page, max_tokens=4, top_k=2.5)
        page.fill("#input", "and 3+4?")
        page.keyboard.press("Enter")
        page.wait_for_selector("#log .msg.error", timeout=30000)
        assert bodies[-1]["top_k"] == 2.5
        assert "top_k" in page.inner_text("#log .msg.error")


def test_chat_page_stays_where_the_reader_scrolled(browser, tmp_path_factory):
    """A long answer streaming: the view follows it while it is at the end, and stays put once the reader
    scrolls up to read (every token pulled the view back to the bottom)."""
    from serve_proc import slow_model
    with _served(browser, "-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "2",
                 viewport={"width": 900, "height": 420}) as (s, page):
        _load(page, s.url + "/")
        _set(page, temperature=0, max_tokens=3000)
        page.fill("#input", "a")
        page.keyboard.press("Enter")
        page.wait_for_function("(l => l.scrollHeight > l.clientHeight + 200)(document.getElementById('log'))",
                               timeout=60000)
        # followed: the view is at the end while the answer grows past the screen
        at_end = "(l => l.scrollHeight - l.scrollTop - l.clientHeight < 30)(document.getElementById('log'))"
        page.wait_for_function(at_end, timeout=10000)
        page.evaluate("document.getElementById('log').scrollTop = 0")
        n = len(page.inner_text("#log .msg.assistant .text"))
        page.wait_for_function(f"document.querySelector('#log .msg.assistant .text').textContent.length > {n + 300}",
                               timeout=60000)
        assert page.evaluate("document.getElementById('log').scrollTop") == 0
        # done with it: Stop if it still runs (a fast machine may have finished the 3000 tokens by now; a click
        # on the disabled button then waited out its 30 s), and the page settles either way
        page.evaluate("(b => b.disabled || b.click())(document.getElementById('stop'))")
        page.wait_for_function("(t => t.startsWith('stopped') || t.includes('finish'))"
                               "(document.getElementById('stats').textContent)", timeout=10000)
        assert page.evaluate("document.getElementById('log').scrollTop") == 0


def test_chat_page_stop_mid_thought_keeps_the_thought(browser, tmp_path_factory):
    """Stop while a thinking model is still in its thought: the bubble with the thought stays and the stats say
    how many tokens came; the page removed it and said "stopped before the first token", the question marked
    unsent, though the user had watched the thought stream."""
    from serve_proc import slow_model
    from test_serve_reasoning import TEMPLATE
    path = tmp_path_factory.mktemp("think-stop") / "think.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    with _served(browser, "-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "2",
                 "--chat-template-file", str(path)) as (s, page):
        bodies = _bodies(page)
        _load(page, s.url + "/")
        _set(page, temperature=0, max_tokens=3000)
        _started(page, "Hello", "thought")   # (its greedy thought runs past 3000 tokens under this template)
        page.click("#stop")
        page.wait_for_function("document.getElementById('stats').textContent.startsWith('stopped')", timeout=10000)
        assert page.inner_text("#stats").startswith("stopped after ")
        assert page.inner_text("#log .msg.assistant .thought")
        assert page.locator("#log .msg.user.unsent").count() == 0
        thought = page.inner_text("#log .msg.assistant .thought")
        _set(page, max_tokens=1)
        _ask(page, "b")
        assert [m["role"] for m in bodies[-1]["messages"]] == ["user", "assistant", "user"]
        page.reload()   # the conversation kept over a reload shows the thought too
        _ready(page)
        assert page.locator("#log .msg.assistant .thought").first.inner_text() == thought


def test_chat_page_keeps_a_thought_cut_by_an_error(browser, tmp_path_factory):
    """A fault while the model is still thinking (BITNET_FAULT_TOKEN, as above): the thought shown so far stays,
    marked cut off, and the question stays part of the conversation; the page removed both as if nothing came."""
    from test_serve_reasoning import TEMPLATE
    path = tmp_path_factory.mktemp("think-fault") / "think.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    args = ("--parallel", "2", "--chat-template-file", str(path))
    q = "What is 12+7?"
    s = Server(*args)
    try:
        prompt = httpx.post(s.url + "/apply-template", json={"messages": [{"role": "user", "content": q}]},
                            timeout=60).json()["prompt"]
        r = httpx.post(s.url + "/completion", timeout=60, json={
            "prompt": prompt, "temperature": 0, "n_predict": 16, "return_tokens": True}).json()
        prompt_ids = httpx.post(s.url + "/tokenize", json={"content": prompt, "add_special": True},
                                timeout=60).json()["tokens"]
    finally:
        assert s.stop()[0] == 0
    assert "</think>" not in r["content"]   # 16 tokens of the tiny model stay in the thought
    k, bad = next((k, t) for k, t in enumerate(r["tokens"])
                  if k >= 3 and t not in prompt_ids and t not in r["tokens"][:k])
    with _served(browser, *args, env={"BITNET_FAULT_TOKEN": str(bad)}) as (s, page):
        _load(page, s.url + "/")
        _set(page, temperature=0, max_tokens=16)
        page.fill("#input", q)
        page.keyboard.press("Enter")
        page.wait_for_selector("#log .msg.error", timeout=30000)
        assert page.inner_text("#log .msg.assistant .thought")
        assert page.locator("#log .msg.assistant.cut").count() == 1
        assert page.locator("#log .msg.user.unsent").count() == 0


def test_chat_page_says_the_key_cannot_be_sent(browser):
    """An API key with a character an HTTP header cannot carry (a pasted em dash): the page says so, at load and
    at Send, and keeps the question; fetch threw, and the page said it had lost the connection to the server."""
    with _served(browser, "--api-key", "page-key", "--parallel", "2") as (s, page):
        page.goto(s.url + "/")
        page.wait_for_function("document.getElementById('model').textContent.includes('API key')", timeout=20000)
        page.fill("#api_key", "page-key\u2014")
        page.dispatch_event("#api_key", "change")
        page.wait_for_function("document.getElementById('model').textContent.includes('cannot carry')", timeout=20000)
        page.fill("#input", "What is 12+7?")
        page.keyboard.press("Enter")
        page.wait_for_selector("#log .msg.error", timeout=10000)
        assert "cannot carry" in page.inner_text("#log .msg.error")
        assert page.input_value("#input") == "What is 12+7?"
        page.fill("#api_key", "page-key")
        page.dispatch_event("#api_key", "change")
        _ready(page)
        _set(page, temperature=0, max_tokens=4)
        _ask(page, "What is 12+7?")
        assert page.inner_text("#log .msg.assistant .text")


def test_chat_page_writes_right_to_left_text_right_to_left(browser):
    """Hebrew or Arabic typed or answered runs right to left, in the input box and in its bubble, while English
    beside it stays left to right (everything was laid out left to right: punctuation landed at the wrong end)."""
    with _served(browser, "--parallel", "2") as (s, page):
        _load(page, s.url + "/")
        _set(page, temperature=0, max_tokens=2)
        page.fill("#input", "שלום, מה שלומך?")
        assert page.evaluate("getComputedStyle(document.getElementById('input')).direction") == "rtl"
        page.keyboard.press("Enter")
        page.wait_for_function("document.getElementById('stats').textContent.includes('finish')", timeout=30000)
        page.fill("#input", "What is 12+7?")
        assert page.evaluate("getComputedStyle(document.getElementById('input')).direction") == "ltr"
        _ask(page, "What is 12+7?")
        dirs = page.eval_on_selector_all("#log .msg.user .text", "es => es.map(e => getComputedStyle(e).direction)")
        assert dirs == ["rtl", "ltr"]


def test_chat_page_keeps_the_conversation_over_a_reload(browser):
    """The conversation survives a reload (it was lost; the settings were kept) and goes on from there; "New
    chat" clears it for good; what is kept is bounded (~1 MB: the oldest turns go) and never holds the key."""
    with _served(browser, "--api-key", "reload-key", "--parallel", "2") as (s, page):
        bodies = _bodies(page)
        page.goto(s.url + "/")
        page.fill("#api_key", "reload-key")
        page.dispatch_event("#api_key", "change")
        _ready(page)
        _set(page, temperature=0, max_tokens=6)
        _ask(page, "What is 12+7?")
        _ask(page, "and 3+4?")
        shown = page.eval_on_selector_all("#log .msg", "es => es.map(e => [e.className, e.innerText])")
        page.reload()
        page.fill("#api_key", "reload-key")
        page.dispatch_event("#api_key", "change")
        _ready(page)
        assert page.eval_on_selector_all("#log .msg", "es => es.map(e => [e.className, e.innerText])") == shown
        assert "reload-key" not in page.evaluate("JSON.stringify(Object.assign({}, localStorage))")
        _ask(page, "and 5+6?")
        sent = bodies[-1]["messages"]
        assert [m["role"] for m in sent] == ["user", "assistant"] * 2 + ["user"]
        assert [m["content"] for m in sent[::2]] == ["What is 12+7?", "and 3+4?", "and 5+6?"]
        assert sent[1]["content"] == page.locator("#log .msg.assistant .text").first.inner_text()
        page.click("#new")
        page.reload()
        assert page.locator("#log .msg").count() == 0
        # three turns of 400 kB kept (another tab, an older page): the next save keeps the newest that fit
        big = [{"role": r, "content": f"{i}" + "x" * 400000 if r == "user" else f"answer {i}"}
               for i in range(3) for r in ("user", "assistant")]
        page.evaluate("t => localStorage.setItem('bitnet.conversation', JSON.stringify(t))", big)
        page.reload()
        page.fill("#api_key", "reload-key")
        page.dispatch_event("#api_key", "change")
        _ready(page)
        assert page.locator("#log .msg").count() == 6
        page.fill("#input", "hello")
        page.keyboard.press("Enter")
        page.wait_for_function("!document.getElementById('send').disabled", timeout=60000)
        kept = page.evaluate("localStorage.getItem('bitnet.conversation')")
        assert len(kept) <= 1000000
        assert json.loads(kept)[0]["content"].startswith("1x")


def test_chat_page_reads_the_server_again_after_losing_it(browser):
    """The server gone (a restart) and back with another context and temperature: the page reads them again
    once it reaches the server, where the header's ctx and the greyed defaults stayed the old ones until a reload.
    The page's requests go through a route standing for the one address both servers take in turn."""
    s1 = Server("--parallel", "2", "-c", "1024", "--temp", "0.3")
    s2 = Server("--parallel", "2", "-c", "512", "--temp", "0.6")
    at = {"url": s1.url}
    try:
        page = browser.new_page()

        def proxy(route):
            if at["url"] is None:
                return route.abort("connectionrefused")
            route.fulfill(response=route.fetch(url=at["url"] + "/" + route.request.url.split("/", 3)[3]))
        page.route("**/*", proxy)
        _load(page, s1.url + "/")
        assert "ctx 1024" in page.inner_text("#model")
        page.wait_for_function("document.getElementById('temperature').placeholder === '0.3'", timeout=20000)
        at["url"] = None
        page.fill("#input", "What is 12+7?")
        page.keyboard.press("Enter")
        page.wait_for_selector("#log .msg.error", timeout=30000)
        assert "lost the connection" in page.inner_text("#log .msg.error")
        at["url"] = s2.url
        page.wait_for_function("document.getElementById('model').textContent.includes('ctx 512')", timeout=20000)
        page.wait_for_function("document.getElementById('temperature').placeholder === '0.6'", timeout=20000)
        page.close()
    finally:
        codes = s1.stop()[0], s2.stop()[0]
        assert codes == (0, 0)


def test_chat_page_sends_a_latin1_key(browser):
    """A key with a letter past ASCII but within Latin-1 (clé): a browser sends it as Latin-1 bytes, curl as UTF-8;
    the server takes both, so the page gets in; it said the server refused the key curl was let in with."""
    with _served(browser, "--api-key", "clé", "--parallel", "2") as (s, page):
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer clé".encode()}).status_code == 200
        assert httpx.get(s.url + "/v1/models",
                         headers={"Authorization": "Bearer clé".encode("latin-1")}).status_code == 200
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer cle"}).status_code == 401
        page.goto(s.url + "/")
        page.wait_for_function("document.getElementById('model').textContent.includes('API key')", timeout=20000)
        page.fill("#api_key", "clé")
        page.dispatch_event("#api_key", "change")
        _ready(page)
        _set(page, temperature=0, max_tokens=4)
        _ask(page, "What is 12+7?")
        assert page.locator("#log .msg.error").count() == 0


def _stores(tmp_path_factory, *names) -> str:
    """A --models-dir holding the bundled model under each of `names`."""
    d = tmp_path_factory.mktemp("page-router")
    for name in names:
        shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), d / (name + ".bnstore"))
    return str(d)


def _picker(page, url):
    page.goto(url)
    page.wait_for_selector("#pick:not([hidden])", timeout=20000)


def test_chat_page_header_fits_a_long_model_name(browser, tmp_path_factory):
    """A long model name in the router's picker: the picker shrinks (ellipsis, the whole name as its title) and
    "New chat" / "Settings" stay on screen and clickable, on a desktop and on a phone; the picker took its longest
    name's width and pushed them off the page (under the settings panel, past a phone's screen)."""
    long_name, phone_name = "bitnet-b1.58-2B-4T-instruct-" + "x" * 60, "Llama3-8B-1.58-100B-tokens-TQ2_0"
    d = _stores(tmp_path_factory, "tiny", long_name, phone_name)
    with _served(browser, "--models-dir", d, "-c", "512") as (s, _):
        for width, name, buttons in ((1100, long_name, ("new",)), (390, phone_name, ("settings", "new"))):
            ctx = browser.new_context(viewport={"width": width, "height": 760}, is_mobile=width < 700,
                                      has_touch=width < 700)
            page = ctx.new_page()
            _picker(page, s.url + "/")
            page.select_option("#pick", name)
            assert page.evaluate("document.documentElement.scrollWidth") <= width
            for b in buttons:
                box = page.locator("#" + b).bounding_box()
                assert box["x"] >= 0 and box["x"] + box["width"] <= width, (width, b, box)
                top = page.evaluate("([x, y]) => document.elementFromPoint(x, y)?.id",
                                    [box["x"] + box["width"] / 2, box["y"] + box["height"] / 2])
                assert top == b, (width, b, top)   # not under the settings panel
            assert page.get_attribute("#pick", "title") == name
            if width < 700:
                page.click("#settings", timeout=5000)
                assert page.is_visible("#temperature")
                page.click("#close_settings")
            page.click("#new", timeout=5000)
            ctx.close()


def test_chat_page_on_a_router_without_models(browser, tmp_path_factory):
    """A router whose cache is empty (the docs: it may start so): the header says what the server says, no models
    here yet and how to pull one; it showed a JavaScript TypeError ("Cannot read properties of undefined")."""
    cache = tmp_path_factory.mktemp("empty-cache")
    with _served(browser, "--models-cache", env={"BITNET_CACHE": str(cache)}) as (s, page):
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(s.url + "/")
        page.wait_for_function("document.getElementById('model').textContent.includes('no models')", timeout=20000)
        header = page.inner_text("#model")
        assert "no models on this server yet" in header and "pull" in header, header
        assert "Cannot read" not in header and "undefined" not in header
        assert page.is_hidden("#pick") and not errors, errors


def test_chat_page_on_a_router_with_one_model_shows_its_settings(browser, tmp_path_factory):
    """A router serving one model (the usual ollama-style setup): once it is loaded (after the first answer) the
    header shows its context and the empty fields its settings, greyed; they stayed "ctx ?" and empty."""
    d = _stores(tmp_path_factory, "only")
    with _served(browser, "--models-dir", d, "-c", "1024", "--temp", "0.3", "--top-k", "7") as (s, page):
        _load(page, s.url + "/")
        _set(page, max_tokens=4)
        _ask(page, "hi")
        page.wait_for_function("document.getElementById('model').textContent.includes('ctx 1024')", timeout=20000)
        page.wait_for_function("document.getElementById('top_k').placeholder === '7'", timeout=20000)
        assert float(page.get_attribute("#temperature", "placeholder")) == 0.3


def test_chat_page_keeps_the_picked_model_over_a_reload(browser, tmp_path_factory):
    """The model picked in the router's page is kept over a reload (the conversation goes on with it); the page
    went on with the first loaded model in the listing, silently."""
    d = _stores(tmp_path_factory, "alpha", "beta")
    with _served(browser, "--models-dir", d, "-c", "512") as (s, page):
        bodies = _bodies(page)
        _picker(page, s.url + "/")
        _set(page, max_tokens=4)
        for name in ("alpha", "beta"):
            page.select_option("#pick", name)
            _ask(page, "hi " + name)
        page.reload()
        page.wait_for_selector("#pick:not([hidden])", timeout=20000)
        assert page.input_value("#pick") == "beta"
        _ask(page, "go on")
        assert [b["model"] for b in bodies] == ["alpha", "beta", "beta"]


def test_chat_page_asks_no_settings_of_a_model_not_loaded(browser, tmp_path_factory):
    """Picking models the router has not loaded: no console errors (the page asked /props of each, a 400
    model_not_loaded every time)."""
    d = _stores(tmp_path_factory, "alpha", "beta")
    with _served(browser, "--models-dir", d, "-c", "512") as (s, page):
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        _picker(page, s.url + "/")
        page.select_option("#pick", "beta")
        page.select_option("#pick", "alpha")
        _set(page, max_tokens=2)
        _ask(page, "hi")   # alpha loaded now: its settings are read, and asking them is no error either
        page.select_option("#pick", "beta")
        page.select_option("#pick", "alpha")
        page.wait_for_function("document.getElementById('model').textContent.includes('ctx 512')", timeout=20000)
        assert errors == [], errors


def test_chat_page_reload_mid_answer_keeps_the_question_and_the_partial_answer(browser, tmp_path_factory):
    """A reload (or a closed tab) while an answer streams: the question and the answer so far come back, the
    answer marked cut off, and the next turn sends both back; both were lost (only the turns before came back)."""
    from serve_proc import slow_model
    with _served(browser, "-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "2") as (s, page):
        bodies = _bodies(page)
        _load(page, s.url + "/")
        _set(page, temperature=0, max_tokens=4)
        _ask(page, "first question")
        _set(page, max_tokens=3000)
        page.fill("#input", "second question")
        page.keyboard.press("Enter")
        page.wait_for_function("document.querySelectorAll('#log .msg.assistant .text')[1]?.textContent.length > 50",
                               timeout=60000)
        page.reload()
        _ready(page)
        shown = page.eval_on_selector_all("#log .msg", "es => es.map(e => e.className)")
        assert len(shown) == 4, shown
        assert page.locator("#log .msg.user .text").nth(1).inner_text() == "second question"
        partial = page.locator("#log .msg.assistant .text").nth(1).inner_text()
        assert partial and "cut" in shown[3], shown
        _set(page, max_tokens=1)
        _ask(page, "third")
        assert [m["role"] for m in bodies[-1]["messages"]] == ["user", "assistant"] * 2 + ["user"]
        assert bodies[-1]["messages"][3]["content"] == partial


def test_chat_page_when_the_server_stops(browser, tmp_path_factory):
    """The server stopped (Ctrl-C) while an answer streams: the answer it cut at its drain is marked cut off
    (it looked whole: finish "stop"), and the header says the connection is lost in the words the error bubble
    uses for a send that finds the server gone (it kept showing the model, then fetch's "Failed to fetch")."""
    import signal

    from serve_proc import slow_model
    with _served(browser, "-m", slow_model(tmp_path_factory), "-c", "4096", "--parallel", "2",
                 "--drain-timeout", "1") as (s, page):
        _load(page, s.url + "/")
        _set(page, temperature=0, max_tokens=3000)
        _started(page, "a")
        s.proc.send_signal(signal.SIGINT)
        page.wait_for_function("!document.getElementById('send').disabled", timeout=60000)
        assert page.locator("#log .msg.assistant.cut").count() == 1
        assert s.proc.wait(60) == 0   # gone (a second Ctrl-C while it exits is not this test's)
        page.wait_for_function("document.getElementById('model').textContent.includes('lost the connection')",
                               timeout=30000)
        assert "Failed to fetch" not in page.inner_text("#model")
        page.fill("#input", "hello?")
        page.keyboard.press("Enter")
        page.wait_for_selector("#log .msg.error", timeout=30000)
        assert "lost the connection to the server" in page.inner_text("#log .msg.error")
        assert "lost the connection to the server" in page.inner_text("#model")
