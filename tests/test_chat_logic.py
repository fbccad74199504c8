"""bitchat's pure logic: transcript model + window trimming + atomic save/load, slash command parsing
and validation, multi-line blocks, completion, stats rendering. No engine, no terminal."""
import io
import json
import os
import time

import pytest

from bitnet_cpu.chat.commands import (CommandError, Settings, completions, help_text, is_command, open_block,
                           parse_command, parse_setting, split_set, strip_block)
from bitnet_cpu.chat.render import Output, format_stats
from bitnet_cpu.chat.transcript import Conversation, TranscriptError, Turn


def words(messages):
    """A token counter for trimming tests: one token per whitespace word plus 3 per message."""
    return sum(len(m["content"].split()) + 3 for m in messages)


def make_conv(n_turns, system="be brief"):
    c = Conversation(system=system)
    for i in range(n_turns):
        t = c.add_user(f"question {i} " + "w " * 10)
        t.assistant = f"answer {i} " + "w " * 10
    return c


# ---- transcript -------------------------------------------------------------------------------

def test_messages_roles_and_system_first():
    c = make_conv(2)
    c.add_user("pending")
    msgs = c.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[0]["content"] == "be brief" and msgs[-1]["content"] == "pending"
    assert [m["role"] for m in Conversation().messages()] == []


def test_fit_window_keeps_everything_when_it_fits():
    c = make_conv(3)
    assert c.fit_window(words, budget=10_000) == 0
    assert c.window_start == 0


def test_fit_window_drops_oldest_keeps_system_and_newest():
    c = make_conv(6)
    c.add_user("newest question")
    total = words(c.messages())
    dropped = c.fit_window(words, budget=total - 1)
    assert dropped >= 1
    msgs = c.messages()
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[-1]["content"] == "newest question"
    assert words(msgs) <= total - 1
    # the oldest turns left the window, not the transcript
    assert len(c.turns) == 7 and c.turns[0].user.startswith("question 0")
    assert msgs[1]["content"].startswith(f"question {dropped}")


def test_fit_window_trims_down_to_target_for_hysteresis():
    c = make_conv(8)
    total = words(c.messages())
    one_turn = 2 * (12 + 3)
    dropped = c.fit_window(words, budget=total - 1, target=total - 3 * one_turn)
    assert dropped == 3
    assert words(c.messages()) <= total - 3 * one_turn


def test_fit_window_never_drops_the_newest_turn():
    c = make_conv(3)
    c.add_user("x " * 500)
    c.fit_window(words, budget=50)
    assert c.window_turns() == [c.turns[-1]]
    assert words(c.messages()) > 50   # caller sees it still does not fit and refuses the message


def test_fit_window_of_a_long_conversation_counts_a_few_windows_not_one_per_turn():
    """Each count renders and tokenizes the whole window: one drop at a time, /load of 1,000 turns counted 985
    windows (245 s on 2 cores). The start is found by bisection: the same window as dropping one at a time."""
    for n, budget in ((1000, 400), (1000, 30_000), (37, 200), (2, 20)):
        c = make_conv(n)
        c.add_user("newest question")
        calls = []

        def counting(messages):
            calls.append(1)
            return words(messages)
        dropped = c.fit_window(counting, budget=budget)
        ref = make_conv(n)
        ref.add_user("newest question")
        while ref.window_start < len(ref.turns) - 1 and words(ref.messages()) > budget:   # one at a time
            ref.window_start += 1
        assert c.window_start == ref.window_start and dropped == ref.window_start
        assert len(calls) <= 2 + n.bit_length(), (n, len(calls))


def test_save_and_load_take_a_quoted_path_as_a_shell_would():
    """/save "my chat.json" named a file with the quotes in its name (and a quoted path with a folder failed)."""
    for line, want in (('/save "my chat.json"', "my chat.json"), ("/load 'a/b c.json'", "a/b c.json"),
                       ('/save "', '"'), ("/save plain.json", "plain.json"), ('/save a"b.json"', 'a"b.json"')):
        assert parse_command(line).arg == want, line
    with pytest.raises(CommandError, match="needs a file name"):
        parse_command('/save ""')


def test_set_format_takes_a_quoted_path_as_save_and_load_do():
    """/set format "dir with space/s chema.json" looked for a file with the quotes in its name (/save and /load
    remove them): every file argument is read by the same rule."""
    for line, want in (('/set format "dir with space/s chema.json"', "dir with space/s chema.json"),
                       ("/set format 'a b.json'", "a b.json"), ("/set format plain.json", "plain.json"),
                       ('/set parameter format "x y.json"', "x y.json"), ("/set format json", "json")):
        assert split_set(parse_command(line).arg)[1] == want, line


def test_reset_and_drop_last_turn():
    c = make_conv(3)
    c.window_start = 3
    c.drop_last_turn()
    assert len(c.turns) == 2 and c.window_start == 2
    c.reset()
    assert c.turns == [] and c.window_start == 0 and c.system == "be brief"


def test_save_load_round_trip(tmp_path):
    c = make_conv(3, system="sys ü ✓")
    c.turns[1].interrupted = True
    c.turns[1].finish_reason = "interrupted"
    c.add_user("unanswered")
    c.window_start = 1
    path = c.save(str(tmp_path / "conv.json"), meta={"model": "m"})
    back = Conversation.load(path)
    assert back.system == c.system
    assert back.turns[:3] == c.turns[:3]
    # a question saved before its answer began (what a killed bitchat's recovery copy holds) loads answered,
    # empty and interrupted: the next question would otherwise follow it, two user turns in a row
    assert back.turns[3] == Turn(user="unanswered", assistant="", interrupted=True, finish_reason="interrupted")
    assert back.window_start == 1
    assert json.loads(open(path, encoding="utf-8").read())["meta"] == {"model": "m"}


OLD = '{\n "format": "bitchat-conversation", "turns": []}\n'   # an earlier save's file, as save starts them


def test_save_is_atomic_and_leaves_no_temp_files(tmp_path):
    target = tmp_path / "conv.json"
    target.write_text(OLD)
    make_conv(2).save(str(target))
    assert json.loads(target.read_text())["format"] == "bitchat-conversation"
    assert len(json.loads(target.read_text())["turns"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv.json"]


def test_save_never_replaces_a_file_that_is_not_a_conversation(tmp_path):
    """/save notes.txt replaced the user's notes (a read-only file too, made 0600): only an earlier conversation, or
    an empty file, is replaced; anything else is one line and stays as it was."""
    notes = tmp_path / "notes.txt"
    for content in ("my notes", '{"turns": []}', '[{"format": "bitchat-conversation"}]'):
        notes.write_text(content)
        with pytest.raises(TranscriptError, match="exists and is not a bitchat conversation: not replaced"):
            make_conv(1).save(str(notes))
        assert notes.read_text() == content
    notes.write_text("")
    make_conv(1).save(str(notes))
    assert len(json.loads(notes.read_text())["turns"]) == 1
    make_conv(2).save(str(notes))   # its own file again: replaced
    assert len(json.loads(notes.read_text())["turns"]) == 2


def _save_past_the_size_limit(tmp_path, on_sigxfsz, raises):
    """Save a conversation over an old file with the file-size limit (which binds root too) crossed mid-write, the
    kernel's SIGXFSZ handled by `on_sigxfsz`; the save must raise `raises`. Leaves the old file to check."""
    import resource
    import signal

    target = tmp_path / "conv.json"
    target.write_text(OLD)
    big = make_conv(50)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, on_sigxfsz)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
    try:
        with raises:
            big.save(str(target))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    return target


def test_failed_save_keeps_the_old_file(tmp_path):
    """A write that fails half way leaves the old file untouched and no temp file behind."""
    import signal

    target = _save_past_the_size_limit(tmp_path, signal.SIG_IGN,   # SIG_IGN: EFBIG instead of being killed
                                       pytest.raises(TranscriptError, match="conv.json: write failed"))
    assert target.read_text() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv.json"]


def test_a_signal_during_a_save_leaves_no_temp_file(tmp_path):
    """A signal whose handler raises (Ctrl-C; bitchat's SIGTERM) in the middle of the write: here SIGXFSZ, sent by
    the kernel when the write crosses the file-size limit, with a handler that raises KeyboardInterrupt. The old file
    stays, and no .bitchat-*.tmp is left beside it (only a failed write's OSError removed it)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    target = _save_past_the_size_limit(tmp_path, interrupt, pytest.raises(KeyboardInterrupt))
    assert target.read_text() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv.json"]


def test_save_errors_name_the_file(tmp_path):
    with pytest.raises(TranscriptError, match="does not exist"):
        make_conv(1).save(str(tmp_path / "nodir" / "c.json"))
    with pytest.raises(TranscriptError, match="is a directory"):
        make_conv(1).save(str(tmp_path))
    afile = tmp_path / "afile"
    afile.write_text("notes\n")   # a file where a folder of the path goes: it said the folder "does not exist"
    for path in (afile / "c.json", afile / "sub" / "c.json"):
        with pytest.raises(TranscriptError, match=f"{afile} is not a directory$"):
            make_conv(1).save(str(path))


def test_a_path_ending_in_a_slash_names_a_directory_and_never_a_file(tmp_path):
    """/save newdir/ wrote a regular file named newdir, and /save x.json/ replaced x.json (the slash was dropped
    before the checks): a name ending in / (or /.) names a directory, as in a shell; nothing is written."""
    from bitnet_cpu.chat.transcript import recovery_problem

    saved = tmp_path / "mine.json"
    make_conv(1).save(str(saved))
    before = saved.read_text()
    for name in ("newdir/", "mine.json/", "mine.json/."):
        path = f"{tmp_path}/{name}"   # (pathlib drops the slash)
        with pytest.raises(TranscriptError, match="names a directory"):
            make_conv(2).save(path)
        assert recovery_problem(path), name
    assert saved.read_text() == before and not (tmp_path / "newdir").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.json"]


def test_a_history_under_a_file_says_not_a_directory(tmp_path):
    """The input history's folder is a file: the line said "File exists", which named no problem."""
    from bitnet_cpu.chat.repl import private_history

    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError) as e:
        private_history(str(tmp_path / "f" / "h"))
    assert e.value.strerror == "Not a directory" and e.value.filename == str(tmp_path / "f")


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"format": "other"}', "not a bitchat conversation"),
    ('{"type": "object", "properties": {"a": {"type": "string"}}}', "not a bitchat conversation (it has no 'turns')"),
    ('{"turns": [{"assistant": "a"}]}', "turn 0 needs a string 'user'"),
    ('{"turns": "x"}', "'turns' must be a list"),
    ('{"system": 3}', "'system' must be a string"),
    ('{"version": 99}', "newer"),
    ('{"version": "1", "turns": []}', "'version' must be an integer"),
    ('{"version": "one", "turns": []}', "'version' must be an integer"),
    ('{"version": 1.0, "turns": []}', "'version' must be an integer"),
    pytest.param('{"turns": [], "window_start": ' + "9" * 5000 + "}", "not a bitchat conversation (Exceeds the limit",
                 id="a-5000-digit-number"),   # Python's own limit: was an internal error
])
def test_load_rejects_bad_files_with_one_line(tmp_path, content, message):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(TranscriptError) as e:
        Conversation.load(str(p))
    assert message in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)


def test_files_that_are_not_regular_are_never_read_replaced_or_chmodded(tmp_path):
    """A FIFO, a device or a symlink where a conversation, or the input history, is saved or loaded: /save
    replaced a FIFO or a device node with a file (as root, /dev/full), /load of /dev/zero read until memory ran out
    (and of a FIFO waited for ever), and BITCHAT_HISTORY=/dev/null (history off, as HISTFILE=/dev/null) made
    bitchat chmod /dev/null 0600. A symlink is saved through: the link stays."""
    import os
    import stat

    from bitnet_cpu.chat.repl import private_history

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o644)
    for path in (str(fifo), "/dev/zero"):
        with pytest.raises(TranscriptError, match="not a regular file"):
            Conversation.load(path)
    with pytest.raises(TranscriptError, match="not a regular file"):
        make_conv(1).save(str(fifo))
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and stat.S_IMODE(os.stat(fifo).st_mode) == 0o644
    with pytest.raises(OSError, match="not a regular file"):
        private_history(str(fifo))
    assert stat.S_IMODE(os.stat(fifo).st_mode) == 0o644   # not chmodded
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("")   # (an empty file may be replaced; someone's own content may not)
    os.symlink(real, link)
    make_conv(2).save(str(link))
    assert os.path.islink(link) and len(Conversation.load(str(real)).turns) == 2


def test_a_history_that_cannot_be_written_goes_on_in_memory(tmp_path):
    """A full disk under the input history: each line's write failed with prompt_toolkit's traceback and "Press
    ENTER"; now the first failure is kept to be said once and the rest of the history stays in memory."""
    import os

    from bitnet_cpu.chat.repl import guarded_file_history

    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (Linux) to fail a write with ENOSPC")
    h = guarded_file_history("/dev/full")
    h.store_string("a secret")
    h.store_string("another")
    assert h.problem and "/dev/full" in h.problem and "memory" in h.problem


def test_a_history_line_that_is_not_utf8_is_not_stored(tmp_path):
    """A line typed in another encoding reaches the prompt with its bytes as surrogates (and is not sent): storing
    it raised UnicodeEncodeError inside prompt_toolkit's loop (a traceback and "Press ENTER to continue" at every
    such line) after writing an empty entry. It is left out of the history; the others are kept."""
    from bitnet_cpu.chat.repl import guarded_file_history

    path = tmp_path / "history"
    h = guarded_file_history(str(path))
    h.store_string("before")
    h.store_string(b"caf\xe9".decode("utf-8", "surrogateescape"))
    h.store_string("after")
    assert h.problem is None
    text = path.read_text(encoding="utf-8")
    assert "+before" in text and "+after" in text and text.count("# ") == 2


def test_one_huge_history_entry_does_not_erase_the_history(tmp_path):
    """A 1.2 MiB paste in the input history: the trim at the next start kept nothing but what came after it (all
    501 entries went). Only the oversized entry is dropped; the entries before and after it are kept."""
    from prompt_toolkit.history import FileHistory

    from bitnet_cpu.chat.repl import private_history

    path = tmp_path / "history"
    h = FileHistory(str(path))
    for i in range(500):
        h.store_string(f"entry {i}")
    h.store_string("pasted " + "x" * (1200 << 10))
    h.store_string("after the paste")
    private_history(str(path))
    kept = list(FileHistory(str(path)).load_history_strings())
    assert kept == ["after the paste"] + [f"entry {i}" for i in range(499, -1, -1)]


def _append_history(path, n):
    from bitnet_cpu.chat.repl import guarded_file_history

    h = guarded_file_history(path)
    for k in range(n):
        h.store_string(f"B-{k}")
    assert h.problem is None


def test_a_bitchat_starting_up_keeps_what_another_one_stores_meanwhile(tmp_path):
    """Two bitchats on one history: the trim at one's start read the file and replaced it, and what the other
    appended in between was lost (hundreds of entries under a tight loop). The trim and the appends take turns on
    a lock: every entry appended while trims run is there afterwards (all are newer than the ones cut)."""
    import multiprocessing
    import re

    from bitnet_cpu.chat.repl import private_history

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("needs fork to run the second bitchat's appends")
    path = tmp_path / "history"
    path.write_text("".join(f"\n# 2026-01-01 00:00:00\n+A-{i} " + "y" * 100 + "\n" for i in range(4000)))
    child = multiprocessing.get_context("fork").Process(target=_append_history, args=(str(path), 2000))
    child.start()
    trims = 0
    while child.is_alive() or trims == 0:
        private_history(str(path), keep=3000)
        trims += 1
    child.join()
    assert child.exitcode == 0
    got = set(re.findall(r"(?m)^\+B-(\d+)$", path.read_text()))
    assert len(got) == 2000, f"{2000 - len(got)} appended entries lost over {trims} trims"


def test_load_refuses_a_file_larger_than_any_conversation(tmp_path):
    """Over LOAD_MAX_BYTES (what /save writes at most) is refused before reading: a 60 MB file froze /load for
    minutes. A sparse file: nothing is written."""
    from bitnet_cpu.chat.transcript import LOAD_MAX_BYTES

    p = tmp_path / "huge.json"
    with open(p, "wb") as f:
        f.truncate(LOAD_MAX_BYTES + (1 << 20))
    over, limit = (LOAD_MAX_BYTES >> 20) + 1, LOAD_MAX_BYTES >> 20
    with pytest.raises(TranscriptError,
                       match=rf"{over} MiB is too large for a bitchat conversation \(at most {limit} MiB\)"):
        Conversation.load(str(p))


def test_load_missing_file(tmp_path):
    with pytest.raises(TranscriptError, match="no such file"):
        Conversation.load(str(tmp_path / "missing.json"))


def test_load_clamps_a_bad_window_start(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"turns": [{"user": "a", "assistant": "b"}], "window_start": 7}))
    assert Conversation.load(str(p)).window_start == 0


# ---- commands ---------------------------------------------------------------------------------

def test_is_command():
    assert is_command("/help") and is_command("  /set temp 1") and is_command("/?")
    assert not is_command("hello /help") and not is_command("/") and not is_command("/ 2 is a slash")
    assert not is_command("")


@pytest.mark.parametrize("line, name, arg", [
    ("/help", "/help", ""), ("/HELP", "/help", ""), ("/quit", "/bye", ""), ("/exit", "/bye", ""),
    ("/system  You are terse.  ", "/system", "You are terse."), ("/set temp 0.2", "/set", "temp 0.2"),
    ("/set", "/set", ""), ("/save a b.json", "/save", "a b.json"), ("/retry", "/retry", ""),
])
def test_parse_command_ok(line, name, arg):
    cmd = parse_command(line)
    assert (cmd.name, cmd.arg) == (name, arg)


@pytest.mark.parametrize("line, fragment", [
    ("/frobnicate", "unknown command /frobnicate"),
    ("/sav x", "did you mean /save"),
    ("/save", "needs a file name"),
    ("/load   ", "needs a file name"),
    ("/reset now", "takes no argument"),
    ("/set temp", "needs NAME VALUE"),
    ("/set parameter temp", "needs NAME VALUE"),
])
def test_parse_command_errors_are_one_line_hints(line, fragment):
    with pytest.raises(CommandError) as e:
        parse_command(line)
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name, text, key, value", [
    ("temp", "0", "temp", 0.0), ("temperature", "1.5", "temp", 1.5), ("top_k", "0", "top_k", 0),
    ("top-p", "1", "top_p", 1.0), ("min_p", "0.1", "min_p", 0.1), ("seed", "42", "seed", 42),
    ("seed", "random", "seed", None), ("max_tokens", "16", "max_tokens", 16),
    ("repeat_penalty", "1.1", "repeat_penalty", 1.1), ("TOP_K", "5", "top_k", 5),
    ("mirostat", "2", "mirostat", 2), ("typical", "0.5", "typical_p", 0.5),
    ("dry-multiplier", "0.8", "dry_multiplier", 0.8),
    ("dry_sequence_breakers", '["\\n", ":"]', "dry_sequence_breakers", ("\n", ":")),
    ("dry_sequence_breakers", "###", "dry_sequence_breakers", ("###",)),
    ("dry_sequence_breakers", "none", "dry_sequence_breakers", ()),
])
def test_parse_setting_ok(name, text, key, value):
    assert parse_setting(name, text) == (key, value)


@pytest.mark.parametrize("name, text, fragment", [
    ("temp", "hot", "not a number"), ("temp", "-1", ">= 0"), ("temp", "nan", "finite"),
    ("top_k", "2.5", "not an integer"), ("top_k", "-3", ">= 0"), ("top_p", "-0.1", "[0, 1]"),
    ("top_p", "1.5", "[0, 1]"), ("min_p", "2", "[0, 1]"), ("seed", "-5", ">= 0"),
    ("max_tokens", "0", ">= 1"), ("repeat_penalty", "0", "> 0"), ("colour", "red", "unknown setting"),
    ("mirostat", "3", "0, 1 or 2"), ("dry_sequence_breakers", '["", "x"]', "non-empty strings"),
    ("dry_sequence_breakers", "[oops", "JSON list"),
    ("dry_sequence_breakers", "[1,2]", "'[1,2]' is not a JSON list of strings"),
])
def test_parse_setting_rejects(name, text, fragment):
    with pytest.raises(CommandError) as e:
        parse_setting(name, text)
    assert fragment in str(e.value)


@pytest.mark.parametrize("line, key, value", [
    ('/set dry_sequence_breakers ["\\n", ":"]', "dry_sequence_breakers", ("\n", ":")),   # the documented form
    ('/set dry_sequence_breakers ["a b", "c"]', "dry_sequence_breakers", ("a b", "c")),
    ("/set temp   0.5 ", "temp", 0.5),
    ("/set parameter temperature 0.5", "temp", 0.5),
    ('/set parameter dry_sequence_breakers [": ", "x"]', "dry_sequence_breakers", (": ", "x")),
])
def test_a_set_line_as_typed(line, key, value):
    """A /set line as the user types it, through the command parser to the setting: the value is the rest of
    the line, spaces and all."""
    cmd = parse_command(line)
    assert parse_setting(*split_set(cmd.arg)) == (key, value)


def test_a_set_value_with_words_too_many_is_refused_by_the_setting():
    with pytest.raises(CommandError, match="'1 2' is not a number"):
        parse_setting(*split_set(parse_command("/set temp 1 2").arg))


@pytest.mark.parametrize("argv, breakers", [
    (["--dry-sequence-breaker", r"\n"], ("\n",)),
    (["--dry-sequence-breaker", "none"], ()),
    (["-e", "--dry-sequence-breaker", r"\x3a", "--dry-sequence-breaker", "x"], (":", "x")),
    (["--no-escape", "--dry-sequence-breaker", r"\n"], (r"\n",)),
])
def test_bitchat_reads_dry_sequence_breakers_as_bitnet_run_does(argv, breakers):
    """-e escapes and 'none' mean in bitchat what they mean in `bitnet run` and `bitnet serve` (it took the raw
    text: a breaker of backslash and n, and one of the four letters n-o-n-e)."""
    from bitnet_cpu.cli.chat import build_parser, settings_from_args

    args = build_parser().parse_args(argv)
    assert settings_from_args(args, pytest.fail).dry_sequence_breakers == breakers


def test_max_tokens_limited_by_context():
    """/set max_tokens over the context is its size (the session says so), as bitchat -n N takes it: one refused and
    the other taken was two answers to one request."""
    assert parse_setting("max_tokens", "129", max_tokens_limit=128) == ("max_tokens", 128)
    assert parse_setting("num_predict", "1000", max_tokens_limit=128) == ("max_tokens", 128)
    assert parse_setting("max_tokens", "128", max_tokens_limit=128) == ("max_tokens", 128)
    # ollama's num_predict -1 (llama.cpp's -n -1 / -2): until the end of text or a full context
    # is kept as -1 (it became the context size: /save wrote 128, and a /load into a larger -c capped every answer)
    for v in ("-1", "-2"):
        assert parse_setting("max_tokens", v, max_tokens_limit=128) == ("max_tokens", -1)
        assert parse_setting("num_predict", v, max_tokens_limit=128) == ("max_tokens", -1)
    assert "max_tokens=-1 (until the end)" in Settings(max_tokens=-1).describe()


@pytest.mark.parametrize("name", ["num_ctx", "ctx-size", "n_ctx"])
def test_setting_the_context_says_it_is_fixed_at_start(name):
    """ollama's /set parameter num_ctx N (what its users type at "context full" notices) was "unknown setting" and a
    list of 30 names, as if bitchat had no context to set: one line says it is fixed at start, and how to set it."""
    with pytest.raises(CommandError) as e:
        parse_setting(name, "128", max_tokens_limit=256)
    assert str(e.value) == (f"/set {name}: the context window is fixed when bitchat starts: restart it with -c N "
                            "(now 256)"), e.value
    assert split_set(f"parameter {name} 128") == (name, "128")


def test_n_minus_one_is_until_the_end_not_a_number():
    """bitchat -n -1 kept 2^30, then the context size: shown and saved as that number."""
    from bitnet_cpu.cli.chat import build_parser, settings_from_args

    for n in ("-1", "-2"):
        assert settings_from_args(build_parser().parse_args(["-n", n]), pytest.fail).max_tokens == -1
    with pytest.raises(CommandError):
        parse_setting("max_tokens", "-3", max_tokens_limit=128)


def test_settings_describe_lists_every_setting():
    text = Settings(seed=3).describe()
    for name in ("temp", "top_k", "top_p", "min_p", "repeat_penalty", "seed=3", "max_tokens"):
        assert name in text
    assert "mirostat" not in text   # llama.cpp's other samplers: shown once set
    assert "mirostat=2 mirostat_tau=3" in Settings(mirostat=2, mirostat_tau=3.0).describe()


def test_settings_describe_shows_integers_as_typed():
    """An integer setting of a million or more is shown as typed, as /set took it (it was "1.23457e+06")."""
    s = Settings()
    for name, text in (("min_keep", "1000001"), ("reasoning_budget", "1234567"), ("dry_penalty_last_n", "1234567"),
                       ("dry_allowed_length", "2000000")):
        key, value = parse_setting(name, text)
        setattr(s, key, value)
        assert f" {name}={text}" in s.describe(), s.describe()


def test_help_lists_every_command():
    text = help_text()
    for name in ("/help", "/reset", "/system", "/set", "/show", "/save", "/load", "/retry", "/stats", "/bye"):
        assert name in text


@pytest.mark.parametrize("value", ["/dev/null", "", "  "])
def test_history_off_by_dev_null_or_empty(value, monkeypatch):
    """BITCHAT_HISTORY=/dev/null, the usual way to turn a history off, was "not a regular file; history kept in
    memory only" at every start: now it is off, as BITCHAT_RECOVERY=/dev/null is, and as an empty value."""
    from bitnet_cpu.chat.repl import history_path

    monkeypatch.setenv("BITCHAT_HISTORY", value)
    assert history_path() is None


def test_help_names_every_alias():
    """/exit, /quit, /? and /clear work: /help says so (only /clear was named)."""
    from bitnet_cpu.chat.commands import ALIASES

    text = help_text()
    for alias in ALIASES:
        assert alias in text, alias


@pytest.mark.parametrize("line", ["/exit now", "/quit now", "/? x", "/clear x"])
def test_an_alias_given_an_argument_is_named_as_typed(line):
    """`/exit now` said "/bye takes no argument", a command the user did not type."""
    with pytest.raises(CommandError) as e:
        parse_command(line)
    assert str(e.value).startswith(f"{line.split()[0]} takes no argument"), str(e.value)


def test_ollamas_one_word_set_commands_parse():
    """ollama's /set verbose, quiet, wordwrap, ... are commands of their own ("/set needs NAME VALUE" before); its
    /set think LEVEL says there are no levels here."""
    for word in ("verbose", "quiet", "wordwrap", "nowordwrap", "history", "nohistory", "noformat"):
        cmd = parse_command(f"/set {word.upper()}")
        assert split_set(cmd.arg) == (word, "")
        with pytest.raises(CommandError, match=f"/set {word} takes no value"):
            parse_command(f"/set {word} yes")
    for level in ("high", "medium", "low"):
        with pytest.raises(CommandError, match=f"/set think {level}: no thinking levels here: /set think or /set "
                                               "nothink"):
            parse_command(f"/set think {level}")


def test_completions():
    assert completions("/s") == ["/system", "/set", "/show", "/save", "/stats"]
    assert completions("/re") == ["/reset", "/retry"]
    assert completions("/set t") == ["temp", "top_k", "top_p", "top_n_sigma", "typical_p", "think"]
    assert completions("/set no") == ["noformat", "nothink"]
    assert completions("/set temp 0") == []
    assert completions("hello") == []


def test_multiline_blocks():
    assert open_block('"""') and open_block('"""first line\nsecond')
    assert not open_block('"""one"""') and not open_block('"""a\nb\n"""') and not open_block("plain")
    assert strip_block('"""\nline one\nline two\n"""') == "line one\nline two"
    assert strip_block('"""inline"""') == "inline"
    assert strip_block("  plain  ") == "plain"
    # ollama's system prompt block (the REPL's Enter adds a line while it is open)
    assert open_block('/set system """You are') and open_block('/system """\nYou are')
    assert open_block('/set  system """')
    assert not open_block('/set system """You are"""') and not open_block('/set system """a\nb\n"""')
    assert not open_block('/set system You are') and not open_block('/set temp 1')
    assert split_set('system """a\nb\n"""') == ("system", "a\nb") and split_set('system """a"""') == ("system", "a")


@pytest.mark.parametrize("lines, message", [
    (['"""Hello""" is what a docstring looks like; explain it', '"""'],
     'Hello""" is what a docstring looks like; explain it'),
    (['"""', "first", '""" trailing words', '"""'], 'first\n""" trailing words'),
    (['"""a""" or """b"""?', '"""'], 'a""" or """b"""?'),
    (['"""one"""'], "one"),
    (['"""', "two lines", "here  \"\"\"  "], "two lines\nhere"),
])
def test_a_block_closes_only_at_a_line_end_and_keeps_every_word(lines, message):
    """A \"\"\" inside a line is text: the block stays open until a line ends in \"\"\", and the message keeps
    every word typed (what followed a closing \"\"\" on its line was dropped unsaid). The REPL's Enter (open_block
    on its buffer) and the piped loop (a line ending in \"\"\") agree on where a block ends."""
    from bitnet_cpu.chat.commands import closes_block

    for i in range(1, len(lines)):   # the REPL keeps the block open while the lines so far do not close it
        assert open_block("\n".join(lines[:i])), lines[:i]
        assert not closes_block(lines[i - 1]) or i == 1
    assert not open_block("\n".join(lines))
    assert strip_block("\n".join(lines)) == message


# ---- rendering --------------------------------------------------------------------------------

class _Stats:
    n_prompt, n_cached, n_generated = 40, 30, 12
    ttft_s, decode_tps, finish_reason = 0.0123, 45.67, "length"


def test_format_stats():
    line = format_stats(_Stats())
    assert line.startswith("[12 tokens") and "first token 12 ms" in line and "45.7 tok/s" in line
    assert "prefill 10 new of 40" in line and "max_tokens" in line
    assert format_stats(None, 3) == "[3 tokens]"
    one = _Stats()
    one.n_generated = 1   # -n 1: "[1 tokens, ...]"
    assert format_stats(one).startswith("[1 token,") and format_stats(None, 1) == "[1 token]"


def test_an_answer_follows_a_terminal_resized_while_it_streams():
    """The answer wraps at the terminal's width as it is now: resized from 80 to 40 columns mid-answer, the lines
    after are at most 40 wide (they stayed at 80, and the terminal broke each mid-word). A real pseudo-terminal."""
    import fcntl
    import select
    import struct
    import termios

    master, slave = os.openpty()
    try:
        def columns(n):
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, n, 0, 0))
        columns(80)
        out = open(slave, "w", encoding="utf-8", closefd=False)
        o = Output(out, out, interactive=True)
        words = [f"word{i:02d}" for i in range(60)]
        for w in words[:30]:
            o.stream(w + " ")
        columns(40)
        for w in words[30:]:
            o.stream(w + " ")
        o.end_answer()
        out.close()
        shown = b""
        for _ in range(100):   # (all of it is written already: a read or two; bounded all the same)
            if b"word59" in shown and shown.endswith(b"\n") or not select.select([master], [], [], 10)[0]:
                break
            shown += os.read(master, 4096)
    finally:
        os.close(master)
        os.close(slave)
    lines = shown.decode().replace("\r", "").rstrip("\n").split("\n")
    after = lines[next(i for i, line in enumerate(lines) if "word30" in line) + 1:]
    assert after and all(len(line.rstrip()) <= 40 for line in after), lines
    assert " ".join(" ".join(lines).split()) == " ".join(words)   # every word whole, in order


def test_output_plain_when_not_a_terminal():
    out, err = io.StringIO(), io.StringIO()
    o = Output(out, err, interactive=False)
    o.stream("Hello")
    o.stream(" world")
    o.dim("[2 tokens]")
    o.notice("[hint]")
    assert out.getvalue() == "Hello world\n"        # answers only, newline-terminated
    assert err.getvalue() == "[2 tokens]\n[hint]\n"  # no escape codes
    assert "\x1b" not in out.getvalue() + err.getvalue()


class _Writes:
    """A stream with only write/flush (contextlib.redirect_stdout to a logger adapter): no isatty."""

    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s
        return len(s)

    def flush(self):
        pass


def test_output_to_streams_without_isatty_is_plain():
    """Streams without isatty are no terminal (it raised AttributeError when asked)."""
    out, err = _Writes(), _Writes()
    o = Output(out, err)
    o.thought("hmm")
    o.stream("Hello")
    assert not o.interactive and out.text.endswith("Hello") and "hmm" in err.text


def test_output_dim_on_a_terminal(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    out = io.StringIO()
    o = Output(out, io.StringIO(), interactive=True)
    o.dim("[stats]")
    assert out.getvalue() == "\x1b[2m[stats]\x1b[0m\n"
    monkeypatch.setenv("NO_COLOR", "1")
    out2 = io.StringIO()
    Output(out2, io.StringIO(), interactive=True).dim("[stats]")
    assert out2.getvalue() == "[stats]\n"


def test_control_characters_from_the_model_are_made_visible_on_a_terminal():
    out = io.StringIO()
    o = Output(out, io.StringIO(), interactive=True)
    o.stream("a\x1b[2Jb\rc\td\ne\x07\x9b")
    assert out.getvalue() == "a\u241b[2Jb\u240dc\td\ne\u2407\ufffd"
    piped = io.StringIO()
    Output(piped, io.StringIO(), interactive=False).stream("a\x1bb")
    assert piped.getvalue() == "a\x1bb"            # scripts get the text as it is


def test_a_terminal_gets_visible_controls_also_when_stdin_is_piped():
    """`echo hi | bitchat` on a terminal is not interactive (stdin is a pipe), but its answers reach a terminal:
    control characters are still shown, never obeyed (they reached it raw)."""
    import os
    master, slave = os.openpty()
    with os.fdopen(slave, "w", encoding="utf-8", closefd=True) as tty:
        Output(tty, io.StringIO(), interactive=False).stream("a\x1b[2Jb\x07")
        tty.flush()
        got = os.read(master, 1024).decode("utf-8")
    os.close(master)
    assert "\x1b" not in got and "\x07" not in got and "\u241b[2J" in got and "\u2407" in got


def test_bitchats_state_ignores_a_relative_xdg_folder(tmp_path, monkeypatch):
    """XDG_STATE_HOME=rel put the history and recovery copies under the working directory; the XDG spec says a
    relative one is ignored."""
    from bitnet_cpu.chat.transcript import state_dir
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", "rel")
    assert state_dir() == str(tmp_path / ".local" / "state" / "bitchat")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "s"))
    assert state_dir() == str(tmp_path / "s" / "bitchat")


def test_fit_window_never_counts_a_window_the_caller_knows_cannot_fit():
    """least_start: the caller knows no window starting before it fits (one turn's own text is too long); those
    windows are never counted, and the window found is the one counting every window gives."""
    for least in range(0, 9):
        plain, told = make_conv(12), make_conv(12)
        plain.turns[least - 1 if least else 0].user += " w" * 400   # a turn no window holding it can fit
        told.turns[least - 1 if least else 0].user += " w" * 400
        counted = []

        def count(m, seen=counted):
            seen.append(len(m))
            return words(m)
        dropped = plain.fit_window(words, 200, 150)
        assert told.fit_window(count, 200, 150, least_start=least) == dropped
        assert told.window_start == plain.window_start
        if least:   # every window counted starts after the long turn
            assert all(n <= len(told.messages(start=least)) for n in counted), (least, counted)


@pytest.mark.parametrize("text", ["/save paste.json\nhello", "/save! paste2.json\r\nnext", "/set temp 0.5\nhello there",
                                  "/load paste.json\nthen ask", "/set format json\nsecond line", "/show\nparameters",
                                  "/bye\nsee you", "/nope\nsecond line"])
def test_a_command_is_one_line_and_a_paste_of_several_is_refused(text):
    """A paste whose first line is a command made the other lines its argument: /save wrote a file whose name held
    a newline and the message was lost. A command is one line: such input is one line saying nothing was done and
    how to send the text as a message."""
    with pytest.raises(CommandError) as e:
        parse_command(text)
    line = str(e.value)
    assert "\n" not in line and "\r" not in line
    assert line.startswith(text.split()[0] + ": a command is one line") and "nothing was done" in line
    assert "start it with //" in line


def test_the_system_prompt_commands_still_span_lines():
    assert parse_command('/set system """You are\nbrief."""').arg == 'system """You are\nbrief."""'
    assert parse_command("/system You are\nbrief.").arg == "You are\nbrief."
    assert parse_command("/system\nYou are brief.").arg == "You are brief."
    assert "a command is one line" in help_text().lower()


def test_save_into_a_folder_that_takes_no_files_says_so(tmp_path):
    """/save /proc/x.json said "cannot write here (No such file or directory)" of a folder that exists."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc on this system")
    with pytest.raises(TranscriptError) as e:
        make_conv(1).save("/proc/x.json")
    assert "No such file or directory" not in str(e.value)
    assert str(e.value) == "/proc/x.json: cannot create a file in /proc (that folder takes no new files)"



def _recovery_copy(path, meta):
    path.write_text(json.dumps({"format": "bitchat-conversation", "version": 1, "system": None,
                                "turns": [{"user": "Kept?", "assistant": "Kept."}], "meta": meta}))


def test_a_copy_is_left_behind_when_the_process_it_names_is_not_its_writer(tmp_path, monkeypatch):
    """Which recovery copies a starting bitchat names: those whose writer no longer runs. The writer is the process
    the copy's meta names (PID and start time: a PID reused by another process is not it); a copy of an older
    bitchat, without that, is judged by the PID in its name: a process that started after the copy's last write
    is not its writer. Real processes (this one, a child that has ended); files that are not copies are skipped."""
    import subprocess
    import sys

    from bitnet_cpu.chat.recovery import left_behind, recovery_copies, this_process

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    folder = tmp_path / "bitchat"
    folder.mkdir()
    me = this_process()
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = int(ended.stdout)
    _recovery_copy(folder / "recovery-11.json", {"recovered": True, "process": me})                  # this process
    _recovery_copy(folder / "recovery-12.json", {"recovered": True, "process": dict(me, pid=gone)})   # it ended
    if "start" in me:   # the PID runs, but another process than the writer (started at another time)
        _recovery_copy(folder / "recovery-13.json", {"recovered": True, "process": dict(me, start=me["start"] + 1)})
    legacy_now = folder / f"recovery-{os.getpid()}-5.json"   # an older bitchat's copy written while this one ran
    _recovery_copy(legacy_now, {"recovered": True})
    legacy_old = folder / f"recovery-{os.getpid()}-6.json"   # one written a day before this process started
    _recovery_copy(legacy_old, {"recovered": True})
    os.utime(legacy_old, (time.time() - 86400, time.time() - 86400))
    _recovery_copy(folder / f"recovery-{gone}.json", {"recovered": True})   # the PID in its name has ended
    (folder / "recovery-14.json").write_text('{"format": "bitchat-conversation", "turns": []}')   # not a copy
    (folder / "notes-15.json").write_text("mine")
    if "boot" in me:   # another boot id: a copy written before this boot has ended; one written since is another
        from bitnet_cpu.chat.recovery import _boot_epoch   # machine of this name (cloned VMs): it may still run
        _recovery_copy(folder / "recovery-16.json", {"recovered": True, "process": dict(me, boot="another")})
        _recovery_copy(folder / "recovery-17.json", {"recovered": True, "process": dict(me, boot="another")})
        before_boot = _boot_epoch() - 86400
        os.utime(folder / "recovery-17.json", (before_boot, before_boot))

    running = {os.path.basename(c.path) for c in recovery_copies() if c.running}
    left = {os.path.basename(c.path) for c in left_behind()}
    want = {"recovery-12.json", f"recovery-{gone}.json"} | ({"recovery-13.json"} if "start" in me else set())
    if os.path.isdir("/proc/self"):   # where a process's start time can be read
        want.add(legacy_old.name)
    want |= {"recovery-17.json"} if "boot" in me else set()
    assert left == want
    assert running == {"recovery-11.json", legacy_now.name} | ({legacy_old.name} - want) | (
        {"recovery-16.json"} if "boot" in me else set())
    assert all(c.turns == 1 and c.first == "Kept?" for c in left_behind())


# ---- what /save writes, /load reads back --------------------------------------------------------

def test_a_lone_surrogate_anywhere_in_a_file_is_refused_at_load_in_one_line(tmp_path):
    """JSON's unpaired "\\ud800" (a JavaScript tool that cut an emoji in half) loaded into a turn out of the model's
    view, or a setting, and every later /save failed as an internal error: the file is refused where it is read,
    naming where the character is. A pair ("\\ud83d\\ude00") is one character and loads."""
    cases = {
        "turns[0].user": {"turns": [{"user": "old \\ud800 one", "assistant": "a"}, {"user": "b", "assistant": "c"}]},
        "system": {"system": "x\\udfffy", "turns": []},
        "meta.settings.dry_sequence_breakers[0]": {"turns": [], "meta": {"settings": {
            "dry_sequence_breakers": ["a\\ud800"]}}},
        "meta.settings.reasoning_budget_message": {"turns": [], "meta": {"settings": {
            "reasoning_budget_message": "x\\ud800y"}}},
    }
    for place, body in cases.items():
        p = tmp_path / "sur.json"
        p.write_text(json.dumps(body).replace("\\\\u", "\\u"))
        with pytest.raises(TranscriptError) as e:
            Conversation.load(str(p))
        line = str(e.value)
        assert "lone UTF-16 surrogate" in line and place in line and str(p) in line and "\n" not in line, line
    p.write_text('{"turns": [{"user": "smile \\ud83d\\ude00", "assistant": "ok"}]}')
    assert Conversation.load(str(p)).turns[0].user == "smile \U0001F600"


def test_a_save_of_text_that_is_not_text_is_one_line_and_writes_nothing(tmp_path):
    """A lone surrogate that got into the conversation some other way: /save said "internal error:
    UnicodeEncodeError"; now one line naming the file, and the file there stays as it was."""
    target = tmp_path / "conv.json"
    target.write_text(OLD)
    c = make_conv(1)
    c.add_user("bad \ud800").assistant = "x"
    with pytest.raises(TranscriptError, match=r"conv.json: .*lone UTF-16 surrogate"):
        c.save(str(target))
    assert target.read_text() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv.json"]


def test_a_conversation_over_the_old_16_mib_bound_is_saved_and_loaded_back(tmp_path):
    """/save wrote 17.6 MB (indented) from a 16.6 MB file it had loaded, then /load refused its own file as over
    16 MiB: what /save writes, /load reads, and a large conversation is written compactly."""
    c = Conversation()
    for i in range(2):
        c.add_user(f"paste {i} " + "q" * (9 << 20)).assistant = "a" * 1000
    path = c.save(str(tmp_path / "big.json"))
    assert Conversation.load(path).turns == c.turns
    assert os.path.getsize(path) < len(c.turns[0].user) * 2 + 4096   # no indentation bytes on every line


def test_save_refuses_what_load_would_refuse_and_keeps_the_old_file(tmp_path, monkeypatch):
    """The size bound of /load is checked when writing too: never a file bitchat cannot read back (a lower bound
    here, as a conversation at the real one takes hundreds of MB)."""
    from bitnet_cpu.chat import transcript

    monkeypatch.setattr(transcript, "LOAD_MAX_BYTES", 64 << 10)
    target = tmp_path / "conv.json"
    target.write_text(OLD)
    c = Conversation()
    c.add_user("x" * (100 << 10)).assistant = "y"
    with pytest.raises(TranscriptError, match=r"conv.json: .*too large for /load to read back") as e:
        c.save(str(target))
    assert "\n" not in str(e.value)
    assert target.read_text() == OLD and sorted(p.name for p in tmp_path.iterdir()) == ["conv.json"]


def test_big_recovery_copies_are_found(tmp_path, monkeypatch):
    """A killed session's recovery copy over 16 MiB was never named at start nor by --recovered, and
    $BITCHAT_RECOVERY naming it called it "not a bitchat recovery copy"."""
    import subprocess
    import sys

    from bitnet_cpu.chat.recovery import left_behind
    from bitnet_cpu.chat.transcript import recovery_problem

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    folder = tmp_path / "bitchat"
    folder.mkdir()
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    c = Conversation()
    c.add_user("First?").assistant = "x" * (17 << 20)
    path = c.save(str(folder / f"recovery-{gone}.json"), meta={"recovered": True}, durable=False)
    assert os.path.getsize(path) > 16 << 20
    assert [(x.path, x.turns, x.first) for x in left_behind()] == [(path, 1, "First?")]
    assert recovery_problem(path) is None


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="reads /proc/self/io (Linux)")
def test_the_start_up_scan_does_not_parse_large_recovery_copies(tmp_path, monkeypatch):
    """/load reads conversations up to 256 MiB, and bitchat's start-up notice read and parsed every recovery copy
    up to that too (a few GiB of Python objects each) only to count turns: a few large crashed sessions made every
    start slow or ran it out of memory. At start a large copy is judged from its first and last bytes (it is still
    named, with its size); `bitchat --recovered` reads it whole."""
    import subprocess
    import sys

    from bitnet_cpu.chat.recovery import left_behind, notice, recovery_copies, this_process

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    folder = tmp_path / "bitchat"
    folder.mkdir()
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    schema = {"type": "object", "properties": {"meta": {"type": "string"}}}   # a "meta" inside the meta
    c = Conversation()
    c.add_user("Big?").assistant = "x" * (24 << 20)   # more than the old 16 MiB bound
    big = c.save(str(folder / f"recovery-{gone}.json"), durable=False, meta={
        "recovered": True, "process": dict(this_process(), pid=gone), "settings": {"format": {"file": "s.json",
                                                                                               "schema": schema}}})
    mine = c.save(str(folder / f"recovery-{gone}-2.json"), durable=False, meta={   # this bitchat's, still running
        "recovered": True, "process": this_process()})
    os.utime(mine, (time.time() - 60, time.time() - 60))
    with open("/proc/self/io") as f:
        before = next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    copies = recovery_copies()
    with open("/proc/self/io") as f:
        read = next(int(line.split()[1]) for line in f if line.startswith("rchar:")) - before
    assert read < 2 << 20, f"read {read} bytes to start"
    assert [(x.path, x.running, x.turns) for x in copies] == [(big, False, None), (mine, True, None)]
    line = notice([x for x in copies if not x.running])
    assert big in line and f"{os.path.getsize(big) >> 20} MiB" in line, line
    assert [(x.path, x.turns, x.first) for x in left_behind()] == [(big, 1, "Big?")]


def test_a_conversation_is_known_by_its_format_wherever_the_key_is(tmp_path):
    """A saved conversation reformatted by jq or an editor ("version" first) loads, but /save and /save! refused to
    replace it ("exists and is not a bitchat conversation"): the file is judged by its content, as /load does."""
    p = tmp_path / "vfirst.json"
    p.write_text(json.dumps({"version": 1, "turns": [{"user": "a", "assistant": "b"}],
                             "format": "bitchat-conversation"}, indent=4))
    assert len(Conversation.load(str(p)).turns) == 1
    make_conv(3).save(str(p))
    assert len(Conversation.load(str(p)).turns) == 3


def test_a_save_to_a_new_name_never_replaces_a_file_made_there_meanwhile(tmp_path):
    """/save checked that the name was free, then replaced whatever was there at the rename: two sessions saving to
    one new name both said "saved" and one conversation was lost. A caller that found no file (expect=None) only
    ever creates one; one that saw a file replaces only that file."""
    target = tmp_path / "x.json"
    make_conv(1).save(str(target))
    theirs = target.read_text()
    with pytest.raises(TranscriptError, match=r"x.json: .*meanwhile .*: not replaced"):
        make_conv(2).save(str(target), expect=None)
    assert target.read_text() == theirs
    from bitnet_cpu.chat.transcript import file_identity

    seen = file_identity(os.stat(target))
    make_conv(3).save(str(target))   # another writer after the caller looked
    with pytest.raises(TranscriptError, match=r"meanwhile .*: not replaced"):
        make_conv(4).save(str(target), expect=seen)
    assert len(Conversation.load(str(target)).turns) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def _no_hard_links(monkeypatch):
    """os.link as on FAT, SMB or vboxsf: EPERM, so a save to a new name reserves it with O_EXCL instead."""
    import errno

    def link(src, dst, *args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(os, "link", link)


@pytest.mark.parametrize("failure", [OSError(5, "Input/output error"), KeyboardInterrupt()], ids=["eio", "ctrl-c"])
def test_a_save_to_a_new_name_without_hard_links_leaves_no_empty_file_when_it_fails(tmp_path, monkeypatch,
                                                                                     failure):
    """Where hard links fail, the new name is reserved by creating an empty file, then the written file replaces
    it: a failure or a Ctrl-C at the replace left that empty file under the user's name (and bitchat's /save,
    seeing a file that was not there, said it had saved the conversation to it)."""
    target = tmp_path / "new.json"
    _no_hard_links(monkeypatch)
    make_conv(2).save(str(target), expect=None)   # the fallback itself works
    assert len(Conversation.load(str(target)).turns) == 2
    target.unlink()

    def replace(src, dst, *args, **kwargs):
        raise failure
    with monkeypatch.context() as m:
        m.setattr(os, "replace", replace)
        with pytest.raises(TranscriptError if isinstance(failure, OSError) else KeyboardInterrupt):
            make_conv(1).save(str(target), expect=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_two_writers_of_one_new_name_one_wins_and_the_other_is_told(tmp_path):
    """Both writers of a new name start together (a barrier), many rounds: each round exactly one is saved, and the
    file holds that one's conversation."""
    import threading

    for round_ in range(30):
        target = str(tmp_path / f"r{round_}.json")
        barrier, results = threading.Barrier(2), {}

        def write(n):
            barrier.wait()
            try:
                make_conv(n).save(target, expect=None, durable=False)
                results[n] = True
            except TranscriptError:
                results[n] = False
        threads = [threading.Thread(target=write, args=(n,)) for n in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results.values()) == [False, True], results
        winner = next(n for n, ok in results.items() if ok)
        assert len(Conversation.load(target).turns) == winner
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bitchat-")]


def test_a_replaced_file_keeps_its_mode(tmp_path):
    """/save over a 0644 conversation left it 0600 (the temp file's mode); a new file is still private (0600)."""
    import stat

    target = tmp_path / "shared.json"
    make_conv(1).save(str(target))
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    os.chmod(target, 0o644)
    make_conv(2).save(str(target))
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644


def test_interrupted_must_be_true_or_false(tmp_path):
    """"interrupted": "false" loaded as interrupted (bool of a non-empty string)."""
    p = tmp_path / "c.json"
    p.write_text('{"turns": [{"user": "a", "assistant": "b", "interrupted": "false"}]}')
    with pytest.raises(TranscriptError, match=r"turn 0: 'interrupted' must be true or false, got 'false'"):
        Conversation.load(str(p))
    p.write_text('{"turns": [{"user": "a", "assistant": "b", "interrupted": false}]}')
    assert Conversation.load(str(p)).turns[0].interrupted is False


@pytest.mark.parametrize("content, message", [
    (b'[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]',
     "a list of role/content messages (OpenAI or ollama style), not a bitchat conversation"),
    (b'{"turns": []}\n{"turns": []}\n', "JSON Lines"),
    (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03", "gzip-compressed"),
])
def test_other_tools_files_are_named_in_the_refusal(tmp_path, content, message):
    p = tmp_path / "other.json"
    p.write_bytes(content)
    with pytest.raises(TranscriptError) as e:
        Conversation.load(str(p))
    line = str(e.value)
    assert message in line and str(p) in line and "\n" not in line and "iconv" not in line, line
