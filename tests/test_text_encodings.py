"""Text the user hands us in files, on stdin and on the command line, whatever the locale.

A UTF-8 byte-order mark (Windows editors' "UTF-8 with BOM") at the start of a file or of piped stdin is no text; a
UTF-16 or UTF-32 file is named as such with the way to convert it; UTF-8 typed under a locale that is not UTF-8
(Python not in UTF-8 mode: PYTHONUTF8=0 LC_ALL=C) is taken as the text it is, in every flag; request bodies are
UTF-8, as docs/api.md says; and output the terminal's encoding cannot show is said once on stderr, not lost
silently. Expected outputs come from the same command run in a UTF-8 setting (or from a grammar that forces the
text), never from stored values."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest

from helpers import ROOT, console_script

BOM = b"\xef\xbb\xbf"
# Python then decodes argv as ASCII with surrogateescape: typed UTF-8 arrives as lone surrogates
NOT_UTF8_MODE = {"PYTHONUTF8": "0", "LC_ALL": "C", "LANG": "C"}
WIDE = [("utf-16", "UTF-16"), ("utf-16-be", "UTF-16"), ("utf-32", "UTF-32")]


def wide_bytes(codec: str, text: str) -> bytes:
    """text in a UTF-16/32 codec, with its byte-order mark (utf-16-be writes none of its own)."""
    return (b"\xfe\xff" if codec == "utf-16-be" else b"") + text.encode(codec)


def env(**extra) -> dict:
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), BITCHAT_RECOVERY="")
    e.pop("PYTHONIOENCODING", None)
    e.update(extra)
    return e


def bitnet(*args, stdin: bytes | None = None, cwd: str = ROOT, timeout: float = 300,
           **extra) -> subprocess.CompletedProcess:
    from helpers import slowness
    return subprocess.run([sys.executable, "-m", "bitnet_cpu", *args], cwd=cwd, env=env(**extra), input=stdin,
                          capture_output=True, timeout=timeout * slowness())


def bitchat(*args, stdin: bytes, cwd: str = ROOT, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([*console_script("bitchat"), *args], cwd=cwd, env=env(**extra), input=stdin,
                          capture_output=True, timeout=300)


def err(r) -> str:
    return r.stderr.decode("utf-8", "backslashreplace")


def one_line(r, rc: int = 2) -> str:
    text = err(r)
    assert r.returncode == rc and "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    return text


def json_text(r) -> str:
    """The generated text of `bitnet run --json` output."""
    assert r.returncode == 0, err(r)
    return "".join(d.get("text", "") for d in map(json.loads, r.stdout.decode("utf-8").splitlines()))


def prompt_tokens(r) -> int:
    assert r.returncode == 0, err(r)
    return int(err(r).split("prompt: ")[1].split()[0])


# ---- 1-2: a UTF-8 byte-order mark is no text ------------------------------------------------------------
def test_text_file_readers_drop_a_leading_utf8_bom_only(tmp_path):
    from bitnet_cpu.cli.flags import read_text_file
    from bitnet_cpu.engine.fileio import read_settings_file
    from bitnet_cpu.serve.auth import read_key_file

    p = tmp_path / "p.txt"
    p.write_bytes(BOM + "Café\r\nnaïve\n".encode())
    assert read_text_file(str(p)) == "Café\r\nnaïve\n"
    assert read_settings_file(str(p), "a grammar") == "Café\r\nnaïve\n"
    inner = tmp_path / "inner.txt"   # only the mark that starts the file: one inside it is text, as typed
    inner.write_bytes(b"a" + BOM + b"b")
    assert read_text_file(str(inner)) == "a\ufeffb"
    keys = tmp_path / "keys.txt"   # Notepad's "UTF-8 with BOM", CRLF
    keys.write_bytes(BOM + b"secret1\r\nsecret2\r\n")
    assert read_key_file(str(keys)) == ["secret1", "secret2"]


@pytest.mark.parametrize("codec,name", WIDE)
def test_utf16_and_utf32_files_are_named_with_the_way_to_convert_them(tmp_path, codec, name):
    from bitnet_cpu.chat.transcript import Conversation, TranscriptError
    from bitnet_cpu.cli.flags import read_text_file
    from bitnet_cpu.engine.errors import BitNetError
    from bitnet_cpu.engine.fileio import read_settings_file
    from bitnet_cpu.serve.auth import read_key_file

    p = tmp_path / "wide.txt"
    p.write_bytes(wide_bytes(codec, '{"a": "Once upon a time"}\n'))
    said = []
    for call, kind in ((lambda: read_text_file(str(p)), BitNetError),
                       (lambda: read_settings_file(str(p), "a JSON Schema"), ValueError),
                       (lambda: read_key_file(str(p)), BitNetError),
                       (lambda: Conversation.load(str(p)), TranscriptError)):
        with pytest.raises(kind) as e:
            call()
        said.append(str(e.value))
    r = bitnet("run", "--chat", "-p", "Hi", "--chat-template-file", str(p))
    said.append(one_line(r))
    for s in said:
        assert f"{name} text" in s and f"iconv -f {name} -t UTF-8" in s, s
        assert "latin1" not in s and "codec" not in s and "\n" not in s.strip(), s


def test_a_bom_in_chat_template_schema_and_grammar_files_changes_nothing(tmp_path):
    template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    files = {"t.jinja": template, "s.json": '{"type": "object", "properties": {"name": {"enum": ["café", "thé"]}},'
                                            ' "required": ["name"]}',
             "g.gbnf": 'root ::= "café" | "thé"\n'}
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        (tmp_path / ("bom_" + name)).write_bytes(BOM + text.encode())
    runs = {}
    for prefix in ("", "bom_"):
        t, s, g = (str(tmp_path / (prefix + n)) for n in files)
        runs[prefix] = (prompt_tokens(bitnet("run", "--chat", "-p", "Hi", "--chat-template-file", t, "-v", "-n", "1",
                                             "--temp", "0")),
                        json_text(bitnet("run", "-p", "Hi", "--json-schema-file", s, "-n", "16", "--temp", "0",
                                         "--json")),
                        json_text(bitnet("run", "-p", "Hi", "--grammar-file", g, "-n", "8", "--temp", "0", "--json")))
    assert runs["bom_"] == runs[""]
    assert runs[""][2] in ("café", "thé") and json.loads(runs[""][1])["name"] in ("café", "thé")


def test_prompt_files_drop_the_bom_in_run_embed_and_on_stdin(tmp_path):
    text = "Once upon a time, a café\n"
    (tmp_path / "p.txt").write_bytes(text.encode())
    (tmp_path / "bom.txt").write_bytes(BOM + text.encode())
    plain = prompt_tokens(bitnet("run", "-f", str(tmp_path / "p.txt"), "-n", "1", "-v"))
    assert prompt_tokens(bitnet("run", "-f", str(tmp_path / "bom.txt"), "-n", "1", "-v")) == plain
    assert prompt_tokens(bitnet("run", "-f", "-", "-n", "1", "-v", stdin=BOM + text.encode())) == plain
    vectors = [bitnet("embed", "-f", str(tmp_path / n), "--embd-output-format", "json") for n in ("p.txt", "bom.txt")]
    assert all(r.returncode == 0 for r in vectors), [err(r) for r in vectors]
    assert json.loads(vectors[0].stdout) == json.loads(vectors[1].stdout)


def test_bitchat_script_with_a_bom_runs_its_first_line_and_loads_a_bom_conversation(tmp_path):
    r = bitchat("-n", "4", stdin=BOM + b"/set temp 0\r\nhello\r\n/save a.json\r\n", cwd=str(tmp_path))
    assert r.returncode == 0, err(r)
    saved = json.loads((tmp_path / "a.json").read_text(encoding="utf-8"))
    assert [t["user"] for t in saved["turns"]] == ["hello"]
    assert saved["meta"]["settings"]["temp"] == 0
    (tmp_path / "b.json").write_bytes(BOM + (tmp_path / "a.json").read_bytes())   # an editor saved it again
    r = bitchat("-n", "4", stdin=b"/load b.json\nagain\n/save b.json\n", cwd=str(tmp_path))
    assert r.returncode == 0, err(r)
    again = json.loads((tmp_path / "b.json").read_text(encoding="utf-8"))
    assert [t["user"] for t in again["turns"]] == ["hello", "again"]


# ---- 4: UTF-8 typed under a locale that is not UTF-8 ------------------------------------------------------
def test_non_ascii_flag_values_are_text_when_python_is_not_in_utf8_mode(tmp_path):
    forced = bitnet("run", "-p", "Hi", "--grammar", 'root ::= "aé b"', "-n", "8", "--json", **NOT_UTF8_MODE)
    assert json_text(forced) == "aé b"
    assert json_text(bitnet("run", "-p", "Hi", "--grammar", 'root ::= "aé b"', "--stop", "é", "-n", "8", "--json",
                            **NOT_UTF8_MODE)) == "a"
    assert json.loads(json_text(bitnet("run", "-p", "Hi", "-j", '{"enum": ["é"]}', "-n", "8", "--json",
                                       **NOT_UTF8_MODE))) == "é"
    utf8 = bitnet("run", "-p", "Café — naïve", "-n", "4", "--temp", "0", "--json")
    assert json_text(bitnet("run", "-p", "Café — naïve", "-n", "4", "--temp", "0", "--json",
                            **NOT_UTF8_MODE)) == json_text(utf8)
    # paths are used as the OS gave them (their bytes open the file), whatever the locale
    (tmp_path / "invite é.txt").write_text("Once upon a time\n", encoding="utf-8")
    (tmp_path / "règle.gbnf").write_text('root ::= "é"\n', encoding="utf-8")
    os.symlink(os.path.join(ROOT, "models", "default.bnstore"), tmp_path / "modèle.bnstore")
    r = bitnet("run", "-m", str(tmp_path / "modèle.bnstore"), "-f", str(tmp_path / "invite é.txt"),
               "--grammar-file", str(tmp_path / "règle.gbnf"), "-n", "4", "--json", **NOT_UTF8_MODE)
    assert json_text(r) == "é"
    system = "Tu es gentil — ça va"
    chat = [bitnet("run", "--chat", "-p", "hi", "-sys", system, "-n", "3", "--temp", "0", "--json", **e)
            for e in ({}, NOT_UTF8_MODE)]
    assert json_text(chat[1]) == json_text(chat[0])
    r = bitchat("-sys", system, "-n", "3", "--temp", "0", stdin=b"hello\n/save s.json\n", cwd=str(tmp_path),
                **NOT_UTF8_MODE)
    assert r.returncode == 0, err(r)
    saved = json.loads((tmp_path / "s.json").read_text(encoding="utf-8"))
    assert saved["turns"][0]["user"] == "hello" and system in json.dumps(saved, ensure_ascii=False)


@pytest.mark.parametrize("args,flag", [(["run", "-p", b"caf\xe9"], "-p/--prompt"),
                                       (["run", "-p", "x", "--stop", b"\xe9"], "--stop"),
                                       (["serve", "--alias", b"caf\xe9"], "--alias"),
                                       (["serve", "--api-key", b"cl\xe9"], "--api-key")])
def test_a_flag_value_that_is_not_utf8_is_one_line_naming_the_flag(args, flag):
    from serve_proc import free_port
    if args[0] == "serve":   # refused before it listens (a server that did start is stopped by the timeout)
        args = [*args, "--host", "127.0.0.1", "--port", str(free_port())]
    r = bitnet(*args, timeout=60)
    assert flag in one_line(r) and "not UTF-8" in err(r), err(r)
    assert "internal error" not in err(r)


def test_server_alias_and_key_typed_in_utf8_under_a_c_locale_serve_every_endpoint():
    from serve_proc import Server
    s = Server("--alias", "café", "--api-key", "clé", env=NOT_UTF8_MODE)
    try:
        auth = {"Authorization": "Bearer clé".encode()}
        models = httpx.get(s.url + "/v1/models", headers=auth, timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "café", models.text
        for path in ("/api/tags", "/props"):
            r = httpx.get(s.url + path, headers=auth, timeout=30)
            assert r.status_code == 200 and "café" in json.dumps(r.json(), ensure_ascii=False), (path, r.text)
        body = {"model": "café", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "café", r.text
        r = httpx.post(s.url + "/v1/chat/completions", json={**body, "stream": True}, headers=auth, timeout=60)
        assert r.status_code == 200 and "[DONE]" in r.text and '"model":"café"' in r.text.replace(" ", ""), r.text
        r = httpx.post(s.url + "/api/chat", json={**body, "stream": False}, headers=auth, timeout=60)
        assert r.status_code == 200 and r.json()["model"].startswith("café"), r.text
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer cle"}, timeout=30).status_code == 401

        # ---- 5: a body is UTF-8 (RFC 8259), as docs/api.md says: UTF-16 and UTF-32 are a 400 ----
        raw = json.dumps(body)
        for data in (raw.encode("utf-16"), raw.encode("utf-16-le"), raw.encode("utf-32")):
            r = httpx.post(s.url + "/v1/chat/completions", content=data, timeout=60,
                           headers={**auth, "Content-Type": "application/json"})
            assert r.status_code == 400 and "not valid JSON" in r.text, r.text
        r = httpx.post(s.url + "/v1/chat/completions", content=BOM + raw.encode(), timeout=60,
                       headers={**auth, "Content-Type": "application/json"})
        assert r.status_code == 200, r.text   # a UTF-8 BOM before the JSON is ignored (RFC 8259 allows it)
    finally:
        code, stderr = s.stop()
    assert "Traceback" not in stderr, stderr


def test_router_passes_non_ascii_flags_on_to_its_models_under_a_c_locale(tmp_path):
    from serve_proc import Server
    models = tmp_path / "models"
    models.mkdir()
    os.symlink(os.path.join(ROOT, "models", "default.bnstore"), models / "m.bnstore")
    s = Server("--models-dir", str(models), "--reasoning-budget-message", "… assez réfléchi.", env=NOT_UTF8_MODE)
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        s.stop()


# ---- 6: output the terminal's encoding cannot show ------------------------------------------------------
def test_unencodable_output_is_said_once_and_json_output_escapes_it(tmp_path):
    grammar = 'root ::= "Ça — 日本語 é"'
    r = bitnet("run", "-p", "Hi", "--grammar", grammar, "-n", "64", PYTHONIOENCODING="ascii")
    assert r.returncode == 0, err(r)
    warned = [line for line in err(r).splitlines() if "cannot show" in line]
    assert len(warned) == 1 and "ascii" in warned[0] and "PYTHONIOENCODING=utf-8" in warned[0], err(r)
    assert r.stdout.startswith(b"?a")
    js = bitnet("run", "-p", "Hi", "--grammar", grammar, "-n", "64", "--json", PYTHONIOENCODING="ascii")
    assert json_text(js) == "Ça — 日本語 é" and "cannot show" not in err(js)
    js = bitnet("run", "-p", "Hi", "--grammar", grammar, "-n", "64", "--json")   # a UTF-8 stdout: the text as is
    assert json_text(js) == "Ça — 日本語 é" and b"\\u" not in js.stdout
    (tmp_path / "s.json").write_text('{"enum": ["thé"]}', encoding="utf-8")
    r = bitchat("-n", "8", stdin=b"/set format s.json\nhi\n", cwd=str(tmp_path), PYTHONIOENCODING="ascii")
    assert r.returncode == 0, err(r)
    assert b'"th?"' in r.stdout
    warned = [line for line in err(r).splitlines() if "cannot show" in line]
    assert len(warned) == 1 and warned[0].startswith("bitchat: warning:"), err(r)


def test_a_utf8_stdout_gets_no_warning():
    r = bitnet("run", "-p", "Hi", "--grammar", 'root ::= "é"', "-n", "4")
    assert r.returncode == 0 and r.stdout.decode() == "é" and "cannot show" not in err(r), err(r)


@pytest.mark.skipif(shutil.which("iconv") is None, reason="checks the advice with iconv itself")
def test_the_iconv_advice_for_a_utf16_file_gives_a_file_that_is_read(tmp_path):
    p = tmp_path / "p16.txt"
    p.write_bytes("Once upon a time\n".encode("utf-16"))
    said = one_line(bitnet("run", "-f", str(p)))
    cmd = said.split("`")[1].split()
    with open(tmp_path / "p8.txt", "wb") as out:
        subprocess.run([*cmd, str(p)], stdout=out, check=True, timeout=30)
    assert (tmp_path / "p8.txt").read_bytes() == b"Once upon a time\n"


def test_run_json_error_object_is_escaped_whatever_stdout_takes(tmp_path):
    """`bitnet run --json`'s error object was written as is: '?' for "é" under an ASCII stdout (the docs promise
    JSON escapes), and a file name's undecodable byte came out as '?' with a warning blaming a UTF-8 stdout."""
    for extra in ({"PYTHONIOENCODING": "ascii"}, {}):
        r = bitnet("run", "--json", "-f", str(tmp_path / "café.txt"), **extra)
        assert r.returncode == 2 and "cannot show" not in err(r), err(r)
        error = json.loads(r.stdout.decode("ascii"))["error"]
        assert "café.txt" in error["message"] and error["exit_code"] == 2, error
    bad = os.fsencode(str(tmp_path)) + b"/caf\xe9.txt"   # a name that is no UTF-8 (bytes as the OS gives them)
    r = bitnet("run", "--json", "-f", bad)
    assert r.returncode == 2 and "cannot show" not in err(r), err(r)
    assert "caf\udce9.txt" in json.loads(r.stdout.decode("ascii"))["error"]["message"], r.stdout


def test_escaped_utf8_names_its_first_bad_byte_and_drops_an_escaped_bom():
    """A str that came through surrogateescape (argv or a stream under LANG=C): the byte named is the first that
    is no UTF-8 (it named the first escaped one, 0xc3 of a valid "é"), and a UTF-8 BOM that came in escaped is
    dropped at a stream's start like one decoded already (a piped script's first command went to the model)."""
    from bitnet_cpu.engine.formats.tokenizer import decode_utf8
    typed = (b"caf\xc3\xa9 \xe9").decode("ascii", "surrogateescape")   # a valid "é", then a lone latin-1 one
    with pytest.raises(ValueError, match=r"byte 0xe9 at character 6"):
        decode_utf8(typed, "-p")
    assert decode_utf8(b"\xef\xbb\xbf/help".decode("ascii", "surrogateescape"), "stdin", start=True) == "/help"
    assert decode_utf8("\ufeff/help", "stdin", start=True) == "/help"
    assert decode_utf8("\ufeff/help", "stdin") == "\ufeff/help"   # not a stream's start: kept
    assert decode_utf8((b"caf\xc3\xa9").decode("ascii", "surrogateescape"), "-p") == "café"
