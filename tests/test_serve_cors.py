"""Cross-origin requests (serve/auth.py allow_cross_origin): pages of this machine may call `bitnet serve` from
their scripts, as with ollama; other sites only when `--cors-origin` names them. Checked on the headers a real
server sends (single-model and router), and in Chromium, where the browser itself enforces them: a page on another
origin calls the API with fetch() and either reads the answer or is refused."""
from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading

import httpx
import pytest

pytest.importorskip("fastapi", reason="bitnet serve needs the serve extra (pip install .[serve])")

from serve_proc import ROOT, Server  # noqa: E402

KEY = "sesame"
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
BODY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--cors-origin", "https://app.example.com", threads=1)
    yield s
    s.stop()


def preflight(url, origin, path="/v1/chat/completions"):
    return httpx.options(url + path, headers={"Origin": origin, **PREFLIGHT}, timeout=30)


@pytest.mark.parametrize("origin", ["http://localhost:5173", "http://127.0.0.1:3000", "https://localhost",
                                    "http://[::1]:8000", "app://obsidian.md", "https://app.example.com"])
def test_local_pages_and_named_origins_may_call(server, origin):
    r = preflight(server.url, origin)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    ok = httpx.post(server.url + "/v1/chat/completions", json=BODY, timeout=60,
                    headers={"Origin": origin, "Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == origin
    assert "retry-after" in ok.headers["access-control-expose-headers"].lower()
    # refused for want of a key, the page can still read why
    no_key = httpx.post(server.url + "/v1/chat/completions", json=BODY, headers={"Origin": origin}, timeout=60)
    assert no_key.status_code == 401 and no_key.headers["access-control-allow-origin"] == origin


@pytest.mark.parametrize("origin", ["https://evil.example", "http://localhost.evil.example",
                                    "http://127.0.0.1.evil.example:80", "https://app.example.com.evil.example", "null"])
def test_other_sites_are_refused(server, origin):
    r = preflight(server.url, origin)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    got = httpx.get(server.url + "/v1/models", headers={"Origin": origin, "Authorization": f"Bearer {KEY}"},
                    timeout=30)
    assert "access-control-allow-origin" not in got.headers   # the browser keeps the answer from the page


def test_any_origin_when_asked_and_on_the_router(tmp_path):
    shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), tmp_path / "tiny.bnstore")
    for args in (("--cors-origin", "*"), ("--models-dir", str(tmp_path), "--cors-origin", "*")):
        s = Server(*args, threads=1)
        try:
            r = preflight(s.url, "https://anywhere.example")
            allowed = r.headers["access-control-allow-origin"]
            assert r.status_code == 200 and allowed in ("*", "https://anywhere.example")
        finally:
            s.stop()
    s = Server("--models-dir", str(tmp_path), threads=1)
    try:
        assert preflight(s.url, "http://localhost:5173").status_code == 200
        assert preflight(s.url, "https://evil.example").status_code == 400
    finally:
        s.stop()


@pytest.mark.parametrize("value", ["example.com", "https://a.example/path", "", "http://"])
def test_a_bad_origin_flag_is_one_line(value):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "--cors-origin", value, "--port", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--cors-origin" in r.stderr and "Traceback" not in r.stderr


# ---- in a browser --------------------------------------------------------------------------------------------
PAGE = """<!doctype html><title>other origin</title><script>
async function ask(url) {
  try {
    const r = await fetch(url + "/v1/chat/completions", {method: "POST",
      headers: {"Content-Type": "application/json", "Authorization": "Bearer KEY"},
      body: JSON.stringify({messages: [{role: "user", content: "Hi"}], max_tokens: 3, temperature: 0})});
    const j = await r.json();
    return "ok:" + j.choices[0].message.content;
  } catch (e) { return "refused:" + e.name; }
}
</script>""".replace("KEY", KEY)


@pytest.fixture(scope="module")
def page_site():
    """A static page served on 127.0.0.1 (reached as http://127.0.0.1:P and, by Chromium's resolver rule, as
    http://other.test:P: the same page on a local and on a foreign origin)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            data = PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


def test_a_browser_lets_local_and_named_pages_read_the_answer_and_no_other(page_site):
    pw = pytest.importorskip("playwright.sync_api", reason="the browser test needs playwright (pip install .[test])")
    chromium = os.environ.get("BITNET_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("no chromium binary (apt install chromium, or set BITNET_CHROMIUM)")
    named = f"http://named.test:{page_site}"
    s = Server("--api-key", KEY, "--cors-origin", named, threads=1)
    try:
        want = httpx.post(s.url + "/v1/chat/completions", json={**BODY, "max_tokens": 3, "temperature": 0}, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}).json()["choices"][0]["message"]["content"]
        rules = "MAP other.test 127.0.0.1, MAP named.test 127.0.0.1"
        with pw.sync_playwright() as p:
            b = p.chromium.launch(executable_path=chromium, headless=True,
                                  args=["--no-sandbox", f"--host-resolver-rules={rules}"])
            try:
                got = {}
                for origin in (f"http://127.0.0.1:{page_site}", f"http://other.test:{page_site}", named):
                    page = b.new_page()
                    page.goto(origin + "/")
                    got[origin] = page.evaluate(f"ask({s.url!r})")
                    page.close()
            finally:
                b.close()
        assert got[f"http://127.0.0.1:{page_site}"] == "ok:" + want
        assert got[named] == "ok:" + want
        assert got[f"http://other.test:{page_site}"] == "refused:TypeError"
    finally:
        s.stop()


@pytest.fixture(scope="module")
def open_server():
    """No key: what stands between a web page and the model is the origin and Host check alone."""
    s = Server("--cors-origin", "https://app.example.com", threads=1)
    yield s
    s.stop()


def _requests_total(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("bitnet_requests_total"))


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://localhost.evil.example"])
def test_a_page_of_another_site_cannot_make_the_server_work(open_server, origin):
    """A "simple" cross-site POST (text/plain: no preflight) from a page the user merely visits: 403 before it runs
    (the CORS headers only kept the answer from the page; the generation, a model load or a delete ran)."""
    before = _requests_total(open_server)
    r = httpx.post(open_server.url + "/v1/chat/completions", content=__import__("json").dumps(BODY), timeout=60,
                   headers={"Origin": origin, "Content-Type": "text/plain"})
    assert r.status_code == 403 and "--cors-origin" in r.json()["error"]["message"]
    assert _requests_total(open_server) == before
    # no Origin (curl, the SDKs), this machine's pages, a named origin, the page's own origin: as before
    for headers in ({}, {"Origin": "http://localhost:5173"}, {"Origin": "https://app.example.com"},
                    {"Origin": open_server.url}):
        ok = httpx.post(open_server.url + "/v1/chat/completions", json=BODY, timeout=60, headers=headers)
        assert ok.status_code == 200, (headers, ok.text)


def test_the_403s_advice_for_a_null_origin_works(open_server, tmp_path):
    """Browsers send `Origin: null` from sandboxed iframes and file:// pages; the 403 says to start the server with
    --cors-origin null, which the CLI refused as not an origin. Taken as advised (a single-model server and a
    router): that origin may call, answered with the `null` browsers need; other sites are refused as before."""
    r = httpx.post(open_server.url + "/v1/chat/completions", json=BODY, timeout=60, headers={"Origin": "null"})
    assert r.status_code == 403
    advice = __import__("re").search(r"start it with (--cors-origin \S+) to allow", r.json()["error"]["message"])
    flag, value = advice.group(1).split()
    shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), tmp_path / "tiny.bnstore")
    for args in ((), ("--models-dir", str(tmp_path))):
        s = Server(flag, value, *args, threads=1)
        try:
            pre = preflight(s.url, "null")
            assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "null", (args, pre.text)
            ok = httpx.post(s.url + "/v1/chat/completions", json={**BODY, "model": "tiny"}, timeout=120,
                            headers={"Origin": "null"})
            assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "null", (args, ok.text)
            bad = httpx.post(s.url + "/v1/chat/completions", json={**BODY, "model": "tiny"}, timeout=60,
                             headers={"Origin": "https://evil.example"})
            assert bad.status_code == 403, args
        finally:
            s.stop()


def test_dns_rebinding_is_refused_on_a_loopback_server(open_server):
    """A site whose name comes to point at 127.0.0.1 is same-origin with its own pages: a loopback-only server
    refuses a Host that is not this machine (ollama's allowed hosts); this machine's names pass, and so does a
    site named by --cors-origin (a proxy that passes its Host on)."""
    for host in ("rebind.evil.example", f"rebind.evil.example:{open_server.port}"):
        r = httpx.get(open_server.url + "/v1/models", timeout=30, headers={"Host": host, "Origin": f"http://{host}"})
        assert r.status_code == 403 and "not this machine" in r.json()["error"]["message"]
        assert "Host localhost" in r.json()["error"]["message"]   # what a proxy should send instead
    for host in (f"localhost:{open_server.port}", f"127.0.0.1:{open_server.port}", "myapp.localhost", "box.local",
                 "bitnet", "10.1.2.3:8080", "app.example.com"):
        assert httpx.get(open_server.url + "/v1/models", timeout=30, headers={"Host": host}).status_code == 200, host


def test_with_a_key_the_key_is_the_guard(server):
    """A server that needs a key answers a page of another site, or a name made to point here, with the 401 it
    answers anyone without the key; with the key (a proxy passing its own Host on, a named page) it works."""
    r = httpx.post(server.url + "/v1/chat/completions", content=__import__("json").dumps(BODY), timeout=60,
                   headers={"Origin": "https://evil.example", "Content-Type": "text/plain"})
    assert r.status_code == 401
    ok = httpx.post(server.url + "/v1/chat/completions", json=BODY, timeout=60, headers={
        "Host": "chat.example.com", "Origin": "https://chat.example.com", "Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200, ok.text


def test_the_open_paths_are_open_to_reads_only(tmp_path):
    """/health (and /metrics with --metrics-public) need no key for GET; any other method needs it. On the router
    a POST /health with a model's name went to its catch-all route and loaded that model, with no key."""
    shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), tmp_path / "tiny.bnstore")
    for args in ((), ("--models-dir", str(tmp_path))):
        s = Server("--api-key", KEY, "--metrics-public", *args, threads=1)
        try:
            for path in ("/health", "/v1/health", "/metrics"):
                assert httpx.get(s.url + path, timeout=30).status_code == 200, (args, path)
                assert httpx.head(s.url + path, timeout=30).status_code == 200, (args, path)   # load balancers
                for method in ("POST", "PUT", "DELETE"):
                    r = httpx.request(method, s.url + path, json={"model": "tiny"}, timeout=30)
                    assert r.status_code == 401, (args, path, method, r.status_code)
                r = httpx.post(s.url + path, json={"model": "tiny"}, timeout=30,
                               headers={"Authorization": f"Bearer {KEY}"})
                assert r.status_code == 405, (args, path, r.status_code)
            if args:
                ps = httpx.get(s.url + "/api/ps", timeout=30, headers={"Authorization": f"Bearer {KEY}"}).json()
                assert ps["models"] == []   # nothing was loaded
                # a read of a model's own metrics goes on to it once it is loaded, as docs/serving.md says (it was a 405)
                auth = {"Authorization": f"Bearer {KEY}"}
                r = httpx.get(s.url + "/metrics?model=tiny", timeout=120, headers=auth)
                assert r.status_code == 400 and "not loaded" in r.text, r.text
                assert httpx.post(s.url + "/models/load", json={"model": "tiny"}, timeout=120,
                                  headers=auth).status_code == 200
                r = httpx.get(s.url + "/metrics?model=tiny", timeout=120, headers=auth)
                assert r.status_code == 200 and "bitnet_" in r.text, r.text
        finally:
            s.stop()


@pytest.mark.parametrize("value", [",", " , ", ""])
def test_an_api_key_flag_without_a_key_is_refused(value):
    """--api-key ',' (or LLAMA_API_KEY="$A,$B" with both unset) left the server open, without the warning."""
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "--api-key", value, "--port", "1"],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert r.returncode == 2 and "no key in it" in r.stderr and "Traceback" not in r.stderr


# ---- wildcard origins, as OLLAMA_ORIGINS takes them ---------------------------------------------------------
WILD = ("chrome-extension://*", "moz-extension://*", "https://*.example.com", "http://localhost.test:*",
        "http://[fd00::5]:*")


@pytest.mark.parametrize("origin,allowed", [
    ("chrome-extension://jfgfiigpkhlkbnfnbobbkinehhfdhndo", True), ("moz-extension://1234-abcd", True),
    ("https://chat.example.com", True), ("https://a.b.example.com", True), ("https://CHAT.Example.com", True),
    ("http://localhost.test:8080", True), ("http://localhost.test", True),
    ("https://example.com", False), ("https://evil-example.com", False), ("https://example.com.evil.org", False),
    ("https://chat.example.com.evil.org", False), ("http://chat.example.com", False),
    ("https://chat.example.com:8443", False), ("https://evil.org/.example.com", False),
    ("https://evil.org?.example.com", False), ("https://evil.org#.example.com", False),
    ("https://evil.org@chat.example.com", False), ("chrome-extension-x://abc", False),
    ("safari-web-extension://abc", False), ("http://localhost.test.evil.org:80", False),
    ("http://[fd00::5]:8080", True), ("http://[fd00::5]", True), ("http://[fd00::6]:8080", False),
    ("http://[fd00::55]:8080", False), ("http://[fd00::5:1]", False), ("https://[fd00::5]:8080", False),
    ("http://[fd00::5]:8080.evil.org", False), ("http://evil.org@[fd00::5]:80", False),
])
def test_wildcard_origins_match_as_ollama_origins_do(origin, allowed):
    """--cors-origin 'chrome-extension://*' (Page Assist's setup on ollama: OLLAMA_ORIGINS=chrome-extension://*),
    'https://*.example.com', 'http://host:*': patterns, matched by the browser-facing check and the CORS headers
    alike. They were compared as literal text, so they allowed nothing while the server started without a word."""
    from bitnet_cpu.serve.auth import origin_allowed
    assert origin_allowed(origin, WILD) is allowed


def test_an_ipv6_host_on_any_port_is_the_address_however_it_is_written():
    """HOST:* with an IPv6 literal (http://[fd00::5]:*, as docs/serving-limits.md promises for any HOST) was
    refused at start as a misplaced wildcard. It is the address on any port, matched as a browser writes it in an
    origin (compressed, lower case), however the pattern spells it; brackets that hold no address are refused."""
    from bitnet_cpu.serve.auth import check_origin, origin_allowed
    for pattern in ("http://[fd00::5]:*", "http://[FD00:0:0::5]:*", "http://[fd00:0000::0005]:*/"):
        assert check_origin(pattern) is None, pattern
        assert origin_allowed("http://[fd00::5]:3000", (pattern,)), pattern
        assert not origin_allowed("http://[fd00::50]:3000", (pattern,)), pattern
    for pattern in ("http://[zz::1]:*", "http://[fd00::5]x:*", "http://[fd00::5]:*:*", "http://[]:*"):
        assert "wildcard" in check_origin(pattern), pattern


@pytest.fixture(scope="module")
def wild_servers():
    keyed = Server("--api-key", KEY, *[a for o in WILD for a in ("--cors-origin", o)], threads=1)
    try:
        open_ = Server(*[a for o in WILD for a in ("--cors-origin", o)], threads=1)
    except BaseException:
        keyed.stop()
        raise
    yield keyed, open_
    keyed.stop()
    open_.stop()


@pytest.mark.parametrize("origin", ["chrome-extension://jfgfiigpkhlkbnfnbobbkinehhfdhndo", "moz-extension://1234",
                                    "https://chat.example.com", "http://[fd00::5]:3000"])
def test_a_wildcard_origin_lets_its_pages_call(wild_servers, origin):
    keyed, open_ = wild_servers
    pre = preflight(keyed.url, origin)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin, pre.text
    ok = httpx.post(keyed.url + "/v1/chat/completions", json=BODY, timeout=60,
                    headers={"Origin": origin, "Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == origin
    plain = httpx.post(open_.url + "/v1/chat/completions", json=BODY, timeout=60, headers={"Origin": origin})
    assert plain.status_code == 200 and plain.headers["access-control-allow-origin"] == origin, plain.text


@pytest.mark.parametrize("origin", ["https://evil-example.com", "https://example.com.evil.org", "https://example.com",
                                    "http://[fd00::55]:3000"])
def test_a_wildcard_origin_lets_no_lookalike_in(wild_servers, origin):
    keyed, open_ = wild_servers
    pre = preflight(keyed.url, origin)
    assert pre.status_code == 400 and "access-control-allow-origin" not in pre.headers
    r = httpx.post(open_.url + "/v1/chat/completions", json=BODY, timeout=60, headers={"Origin": origin})
    assert r.status_code == 403 and "--cors-origin" in r.json()["error"]["message"]


def test_a_wildcard_site_is_no_host_for_dns_rebinding_unless_it_names_a_domain(wild_servers):
    """An extension's 'host' is its id, never a name a site points here: chrome-extension://* opens no Host; a
    domain pattern does for its own subdomains (a proxy that passes its Host on), as a named site does."""
    _, open_ = wild_servers
    for host in ("rebind.evil.example", "jfgfiigpkhlkbnfnbobbkinehhfdhndo.evil.example", "example.com"):
        assert httpx.get(open_.url + "/v1/models", headers={"Host": host}, timeout=30).status_code == 403, host
    assert httpx.get(open_.url + "/v1/models", headers={"Host": "chat.example.com"}, timeout=30).status_code == 200


@pytest.mark.parametrize("value", ["https://ex*ample.com", "*://example.com", "https://*example.com",
                                   "https://*.*.example.com", "https://chat.*.com", "https://*.com:8*",
                                   "https://*.", "https://[*::1]", "http://[zz::1]:*"])
def test_a_wildcard_origin_ollama_does_not_mean_is_one_line(value):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "serve", "--cors-origin", value, "--port", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--cors-origin" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2, r.stderr   # the error line (and its hint)


@pytest.mark.parametrize("origin", ["file://", "app://", "tauri://localhost", "vscode-webview://abc"])
def test_app_shell_origins_pass_the_preflight_and_the_request_alike(open_server, origin):
    """An Electron page loaded from disk sends `Origin: file://`: the preflight said yes (the CORS middleware took the
    origin as sent), then every request was a 403 (the guard stripped the "/" and `file:` matched no local origin),
    and the 403 advised `--cors-origin file:`, a value the server refuses at start."""
    pre = preflight(open_server.url, origin)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin
    ok = httpx.post(open_server.url + "/v1/chat/completions", json=BODY, timeout=60, headers={"Origin": origin})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == origin, ok.text


def test_the_403s_advice_is_a_value_the_server_takes(open_server):
    """An origin --cors-origin cannot name (no host) is advised `--cors-origin '*'`, never a value the CLI refuses."""
    from bitnet_cpu.serve.auth import check_origin
    for origin in ("https://evil.example", "weird-app:"):
        r = httpx.post(open_server.url + "/v1/chat/completions", json=BODY, timeout=60, headers={"Origin": origin})
        assert r.status_code == 403
        value = __import__("re").search(r"--cors-origin (.\*.|\S+) to allow", r.json()["error"]["message"])
        assert value, r.text
        value = value.group(1)
        assert check_origin(value.strip("'")) is None, value
