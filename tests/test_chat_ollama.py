"""bitchat as ollama users expect it: every turn that fits stays (only the answer's -n is reserved, the oldest
turns go first with a one-line notice), /stats says what the stats line said, /set system, /set parameter,
/show info|system|parameters, /clear, answers wrapped at the terminal width while streaming. In process on a
small synthetic model, and through a pseudo-terminal (pexpect) for what a user sees."""
import io
import json
import re

import pytest

from bitnet_cpu.chat.commands import CommandError, Settings, parse_command
from bitnet_cpu.chat.render import _VISIBLE_CONTROLS, Output, WordWrapper, _cell_width
from bitnet_cpu.chat.session import ChatSession


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from bitnet_cpu.engine.api import load_model
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir

    synth = SynthModel(small_config(max_position_embeddings=1024), seed=5)
    d = tmp_path_factory.mktemp("ollama_model")
    store = convert(write_hf_dir(synth, str(d / "hf")), str(d / "m.bnstore"), progress=False)
    return load_model(store, ctx=256, threads=1, progress=False)


def session(llm, max_tokens=8, system="Be brief."):
    llm.reset()
    sink = io.StringIO()
    return ChatSession(llm, Settings(temp=0.0, max_tokens=max_tokens), Output(sink, sink, interactive=False),
                       system=system), sink


def test_turns_are_dropped_only_as_needed_and_only_n_is_reserved(llm):
    s, sink = session(llm, max_tokens=8)
    budget = llm.n_ctx - 8
    drops_seen = 0
    for i in range(14):
        before = s.n_dropped
        s.ask(f"Question {i}: " + "some more words " * 3)
        msgs = s.conv.messages()
        assert s.count_tokens(msgs[:-1], generation_prompt=False) <= llm.n_ctx   # what was sent fitted
        if s.n_dropped > before:
            drops_seen += 1
            # minimal down to 3/4 of the room (room to grow, so the next turns reuse the cache): with one more of
            # the dropped turns back, the prompt (before this answer) would pass that
            wider = s.conv.messages(start=s.conv.window_start - 1)
            assert s.count_tokens(wider[:-1]) > budget * 3 // 4
    assert drops_seen >= 2
    notices = [x for x in sink.getvalue().splitlines() if "dropped the" in x]
    assert len(notices) == drops_seen and all(x.startswith("[context full") for x in notices)
    assert s.conv.messages()[0] == {"role": "system", "content": "Be brief."}
    assert len(s.conv.turns) == 14


def test_stats_command_says_what_the_stats_line_said(llm):
    s, sink = session(llm, max_tokens=6)
    for q in ("One?", "Two?"):
        s.ask(q)
    stats_line = [x for x in sink.getvalue().splitlines() if x.startswith("[") and "tokens" in x][-1]
    s.run_command(parse_command("/stats"))
    out = sink.getvalue().splitlines()
    last = next(x for x in out if x.startswith("last answer:"))
    assert stats_line in last
    total = sum(int(re.match(r"\[(\d+) tokens?", x).group(1)) for x in sink.getvalue().splitlines()
                if re.match(r"\[\d+ tokens", x))
    session_line = next(x for x in out if x.startswith("session:"))
    assert f"{total} tokens generated" in session_line


def test_ollama_set_and_show_commands(llm):
    s, sink = session(llm)
    s.run_command(parse_command("/set system You answer in one word."))
    assert s.conv.system == "You answer in one word."
    s.run_command(parse_command("/set parameter temperature 0.7"))
    s.run_command(parse_command("/set parameter num_predict 5"))
    s.run_command(parse_command("/set parameter top_k 7"))
    s.run_command(parse_command("/set parameter repeat_last_n 16"))
    s.run_command(parse_command("/set min_p 0.1"))
    st = s.settings
    assert (st.temp, st.max_tokens, st.top_k, st.repeat_last_n, st.min_p) == (0.7, 5, 7, 16, 0.1)
    assert s.sampling_params().repeat_last_n == 16
    with pytest.raises(CommandError, match="unknown setting"):
        s.run_command(parse_command("/set parameter colour red"))
    with pytest.raises(CommandError, match="/set parameter needs NAME VALUE"):
        parse_command("/set parameter temperature")
    sink.truncate(0)
    s.run_command(parse_command("/show info"))
    info = sink.getvalue()
    assert "source:" in info and "layers" in info and "context:" in info
    assert re.search(r"source:\s+hf\b", info), info        # the file it was converted from, by name
    s.run_command(parse_command("/show system"))
    assert "You answer in one word." in sink.getvalue().splitlines()[-1]
    s.run_command(parse_command("/show parameters"))
    assert "temp=0.7" in sink.getvalue().splitlines()[-1]
    with pytest.raises(CommandError, match="unknown topic"):
        parse_command("/show license")
    s.ask("Hi?")
    s.run_command(parse_command("/clear"))
    assert s.conv.turns == [] and s.conv.system == "You answer in one word."


def test_word_wrapper_breaks_between_words_and_loses_nothing():
    text = ("The quick brown fox jumps over the lazy dog, then a supercalifragilisticexpialidocious word and "
            "wide 漢字漢字漢字漢字漢字漢字 characters.\nA new paragraph\tafter a tab.")
    for width in (10, 17, 30):
        for step in (1, 3, 7):
            w = WordWrapper(width)
            out = "".join(w.feed(text[i:i + step]) for i in range(0, len(text), step)) + w.flush()
            assert all(_cell_width(line.expandtabs(8)) <= width for line in out.split("\n")), (width, out)
            assert out.split() == text.split() or "".join(out.split()) == "".join(text.split())
            for word in ("quick", "brown", "paragraph"):   # short words are never cut
                assert word in out.split()


def test_output_wraps_only_on_a_terminal():
    out = io.StringIO()
    o = Output(out, io.StringIO(), interactive=True, width=12)
    for piece in ("Hello there", " my good", " friend, how", " are you?"):
        o.stream(piece)
    o.end_answer()
    assert out.getvalue() == "Hello there \nmy good \nfriend, how \nare you?\n"
    piped = io.StringIO()
    o = Output(piped, io.StringIO(), interactive=False, width=None)
    o.stream("Hello there my good friend, how are you?")
    o.end_answer()
    assert piped.getvalue() == "Hello there my good friend, how are you?\n"


# ---- through a pseudo-terminal ------------------------------------------------------------------------------
pexpect = pytest.importorskip("pexpect", reason="pexpect drives the terminal tests (pip install pexpect)")

from test_chat_e2e import ACCEPTED, ANSI_RE, STATS_RE, Chat, chat_model, long_model  # noqa: E402,F401,F811


def test_pty_ollama_commands_and_stats_agree(chat_model, tmp_path):
    chat = Chat(chat_model, tmp_path)
    chat.command("/set system You are terse.", r"\[system prompt set\]")
    chat.command("/set parameter temperature 0.7", r"\[temp = 0\.7\]")
    chat.command("/set parameter num_predict 6", r"\[max_tokens = 6\]")
    out = chat.command("/show info", r"system: [^\r\n]*")
    assert "You are terse." in out and re.search(r"source:\s+\S", out)
    chat.command("/show parameters", r"temp=0\.7[^\r\n]*max_tokens=6")
    chat.enter("Hello?")
    chat.expect(STATS_RE)
    line = ANSI_RE.sub("", chat.child.after)
    chat.wait_prompt()
    out = ANSI_RE.sub("", chat.command("/stats", r"context: [^\r\n]*"))
    assert line in out, (line, out)
    chat.command("/clear", r"\[conversation cleared\]")
    chat.command("/stats", r"session:     0 turns")
    assert chat.finish("/bye") == 0


def test_pty_long_answer_wraps_at_the_terminal_width(long_model, tmp_path):
    width = 40
    chat = Chat(long_model, tmp_path, "-n", "80", "--temp", "0")
    chat.child.setwinsize(50, width)
    chat.enter("Tell me a long story.")
    chat.expect(STATS_RE)
    shown = ANSI_RE.sub("", chat.child.before)
    chat.wait_prompt()
    chat.command(f"/save {tmp_path / 'w.json'}", r"\[saved 1 turn ")
    answer = json.loads((tmp_path / "w.json").read_text())["turns"][0]["assistant"]
    lines = shown.replace("\r\n", "\n").split("\n")
    start = max(i for i, x in enumerate(lines) if "Tell me a long story." in x) + 1   # after the echoed input
    body = [x.rstrip("\r") for x in lines[start:] if x.strip()]
    assert len(body) >= 3, shown                                   # it did need wrapping
    assert all(_cell_width(x.expandtabs(8)) <= width for x in body), body
    visible = answer.translate(_VISIBLE_CONTROLS)                  # as a terminal is shown model text
    assert "".join(shown.split()).endswith("".join(visible.split()))   # wrapping only moved whitespace
    assert chat.finish("/bye") == 0
