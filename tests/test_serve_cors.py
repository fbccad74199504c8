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
