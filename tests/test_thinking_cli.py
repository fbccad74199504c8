"""A thinking model on the command line: llama.cpp's --chat-template-kwargs JSON, -rea/--reasoning on|off|auto and
--reasoning-effort set the template's variables for every chat (LLM.set_template_kwargs; a call's own variables
win); bitchat shows the <think> block apart, as llama-cli does ([Start thinking] ... [End thinking], dim on a
terminal, on stderr when stdout is piped, so stdout keeps the answers), and ollama's /set think | nothink switch it.
The model is the bundled one with a template whose generation prompt opens the thought (as Qwen3's and
DeepSeek-R1's do) unless enable_thinking is false; expected prompts come from jinja2 itself."""
from __future__ import annotations

import io
import os
import subprocess

import jinja2
import pytest

from helpers import ROOT, console_script
from test_serve_reasoning import TEMPLATE

Q = [{"role": "user", "content": "What is 2+3?"}]


def expected(**kw) -> str:
    return jinja2.Environment().from_string(TEMPLATE).render(messages=Q, add_generation_prompt=True, **kw)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("think") / "think.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    return str(path)


def test_set_template_kwargs_are_every_chats_under_a_calls_own():
    from bitnet_cpu.engine.api import load_model
    from bitnet_cpu.engine.errors import BitNetError

    llm = load_model(None, progress=False)
    llm.set_chat_template(TEMPLATE)
    assert llm.chat_text(Q) == expected() and llm.template_kwargs == {}
    llm.set_template_kwargs({"enable_thinking": False})
    assert llm.chat_text(Q) == expected(enable_thinking=False)
    assert llm.chat_text(Q, template_kwargs={"enable_thinking": True}) == expected(enable_thinking=True)
    for bad in ({"messages": []}, ["enable_thinking"]):   # a variable the template sets itself; not a dict
        with pytest.raises(BitNetError):
            llm.set_template_kwargs(bad)
        assert llm.template_kwargs == {"enable_thinking": False}   # the ones before stay
    llm.template_kwargs["enable_thinking"] = True   # a copy: the model's are changed only through the setter
    assert llm.chat_text(Q) == expected(enable_thinking=False)


def test_the_flags_make_the_template_variables():
    from bitnet_cpu.cli import build_parser
    from bitnet_cpu.cli.flags import check_engine_args, llama_env_argv

    subs: dict = {}
    build_parser(subs)
    for prog in ("run", "serve"):
        p = subs[prog]

        def kwargs(*argv):
            args = p.parse_args([*argv])
            problem = check_engine_args(args)
            return problem if problem else args.template_kwargs

        assert kwargs() is None and kwargs("-rea", "auto") is None and kwargs("--reasoning", "-1") is None
        assert kwargs("-rea", "off") == {"enable_thinking": False}
        assert kwargs("--reasoning", "on") == {"enable_thinking": True}
        assert kwargs("--chat-template-kwargs", '{"x": 1, "enable_thinking": true}', "-rea", "disabled") == \
            {"x": 1, "enable_thinking": False}   # as llama.cpp: --reasoning writes enable_thinking
        assert kwargs("--reasoning-effort", "high") == {"reasoning_effort": "high"}
        assert kwargs("--reasoning-effort", "default") is None
        assert kwargs("--reasoning-effort", " ").startswith("--reasoning-effort '': give a level")
        assert kwargs("-rea", "maybe") == "-rea/--reasoning 'maybe': on, off or auto"
        assert kwargs("--chat-template-kwargs", "[1]").startswith("--chat-template-kwargs: a JSON object")
        assert kwargs("--chat-template-kwargs", "{x}").startswith("--chat-template-kwargs: not JSON")
    argv, notes, _ = llama_env_argv(subs["serve"], [], {"LLAMA_ARG_REASONING": "off", "LLAMA_ARG_THINK": "none",
                                                     "LLAMA_ARG_CHAT_TEMPLATE_KWARGS": '{"a": 1}'})
    assert sorted(argv) == sorted(["--reasoning=off", "--reasoning-format=none", '--chat-template-kwargs={"a": 1}'])
    assert not notes


def bitchat(*args, stdin: str):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), BITCHAT_RECOVERY="")
    return subprocess.run([*console_script("bitchat"), "-n", "6", "--temp", "0", *args], cwd=ROOT, env=env,
                          input=stdin, capture_output=True, text=True, timeout=300)


def test_bitchat_shows_the_thought_apart_and_rea_off_turns_it_off(template_file):
    """Piped: the thought (the whole answer here: the tiny model never closes it in 6 tokens) goes to stderr
    between the markers and stdout stays empty; with -rea off the template closes the thought in the prompt and
    the answer is on stdout; /set think and /set nothink switch it within the session."""
    think = bitchat("--chat-template-file", template_file, stdin="What is 2+3?\n")
    assert think.returncode == 0, think.stderr
    assert think.stdout.strip() == ""
    start, end = think.stderr.index("[Start thinking]\n"), think.stderr.index("\n[End thinking]\n")
    thought = think.stderr[start + len("[Start thinking]\n"):end]
    assert thought.strip()
    off = bitchat("--chat-template-file", template_file, "-rea", "off", stdin="What is 2+3?\n")
    assert off.returncode == 0 and off.stdout.strip() and "[Start thinking]" not in off.stdout + off.stderr
    both = bitchat("--chat-template-file", template_file, stdin="/set nothink\nWhat is 2+3?\n/set think\nHi\n")
    assert both.returncode == 0, both.stderr
    assert both.stdout.strip() == off.stdout.strip()   # the first answer, not thought; the second is a thought
    assert "[thinking off]" in both.stderr and "[thinking on]" in both.stderr
    assert both.stderr.count("[Start thinking]") == 1
    plain = bitchat(stdin="/set think\n")   # the bundled model's own template does not think
    assert "does not think" in plain.stderr


@pytest.mark.parametrize("interactive", [False, True])
def test_output_puts_the_thought_between_the_markers(interactive, monkeypatch):
    from bitnet_cpu.chat.render import DIM, Output

    monkeypatch.delenv("NO_COLOR", raising=False)
    out, err = io.StringIO(), io.StringIO()
    o = Output(out, err, interactive=interactive, width=40 if interactive else None)
    for piece in ("I add", " 2 and 3."):
        o.thought(piece)
    o.end_thought()
    o.stream("Five.")
    o.end_thought()   # once: the answer has started
    o.end_answer()
    if interactive:   # one screen, the thought dim, its last word (held back for wrapping) too
        assert err.getvalue() == "" and f"{DIM}I " in out.getvalue() and f"{DIM}3.\x1b[0m" in out.getvalue()
        plain = out.getvalue().replace(DIM, "").replace("\x1b[0m", "")
        assert plain == "[Start thinking]\nI add 2 and 3.\n[End thinking]\nFive.\n"
    else:
        assert out.getvalue() == "Five.\n"
        assert err.getvalue() == "[Start thinking]\nI add 2 and 3.\n[End thinking]\n"


def test_a_thought_on_a_terminal_cannot_drive_it():
    """Piped answers, stderr a terminal: the thought's control characters are shown as symbols, not obeyed (an ESC
    could clear the screen or set the title), as answers on a terminal are."""
    from bitnet_cpu.chat.render import Output

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    err = Terminal()
    o = Output(io.StringIO(), err, interactive=False)
    o.thought("a\x1b[2Jb\x1b]0;title\x07")
    o.end_thought()
    assert "\x1b" not in err.getvalue() and "\x07" not in err.getvalue() and "a\u241b[2Jb" in err.getvalue()
