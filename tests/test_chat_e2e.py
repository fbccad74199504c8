'''bitchat end to end: the real `bitchat` program driven through a pseudo-terminal (pexpect) and
through a pipe, on a real model (the bundled default if there is one, else a small synthetic model
converted by engine.convert). Timeouts are generous and answers short: the CI machine is a loaded
2-core box.
'''
import json
import os
import re
import shutil
import subprocess
import time

import pytest

from helpers import console_script

pexpect = pytest.importorskip("pexpect", reason="pexpect drives the terminal tests (pip install pexpect)")

TIMEOUT = 180
# prompt_toolkit enables bracketed paste when a prompt starts and disables it when the input is
# accepted: these two markers tell a fresh prompt from a re-render of the line being typed.
PROMPT_RE = re.compile(r"\x1b\[\?2004h[^>]*>>>")
ACCEPTED = "\x1b[?2004l"
STATS_RE = re.compile(r"\[(\d+) tokens?(?:, first token (\d+) ms)?[^\]\r\n]*\]")
ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory):
    """Path of the model the chat tests talk to."""
    from bitnet_cpu.engine.formats.convert import resolve_model
    from bitnet_cpu.engine.errors import BitNetError

    try:
        return resolve_model(None, progress=False)
    except (BitNetError, OSError):
        pass
    return synth_store(tmp_path_factory, "chat_model", hidden_size=256, n_layers=2)


@pytest.fixture(scope="session")
def long_model(tmp_path_factory):
    """A synthetic model that, greedy, talks on without an end-of-turn token and is slow enough
    (a few hundred tokens/s) for a Ctrl-C to land in the middle of the answer."""
    return synth_store(tmp_path_factory, "long_model", hidden_size=512, n_layers=4, n_ctx=8192)


def synth_store(tmp_path_factory, name, *, hidden_size, n_layers, n_ctx=4096):
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir

    synth = SynthModel(small_config(hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                    num_hidden_layers=n_layers, max_position_embeddings=n_ctx), seed=11)
    d = tmp_path_factory.mktemp(name)
    src = write_hf_dir(synth, str(d / "hf"))
    return convert(src, str(d / f"{name}.bnstore"), progress=False)


def test_env(tmp_path) -> dict:
    env = dict(os.environ)
    env.update(TERM="xterm-256color", PROMPT_TOOLKIT_NO_CPR="1", NO_COLOR="1",
               BITCHAT_HISTORY=str(tmp_path / "history"), PYTHONUNBUFFERED="1",
               XDG_STATE_HOME=str(tmp_path / "state"))   # the recovery copies: never the user's own folder
    env.pop("BITCHAT_DEBUG", None)
    env.pop("BITNET_DEBUG", None)
    return env


test_env.__test__ = False  # a helper, not a test


class Chat:
    """A bitchat process in a pseudo-terminal."""

    def __init__(self, model, tmp_path, *extra):
        cmd = console_script("bitchat")
        args = cmd[1:] + ["-m", model, "-t", "1", "--seed", "1", "-n", "8", *extra]
        self.child = pexpect.spawn(cmd[0], args, env=test_env(tmp_path), encoding="utf-8",
                                   timeout=TIMEOUT, dimensions=(50, 220))
        self.log = []
        self.wait_prompt()

    def expect(self, pattern):
        try:
            i = self.child.expect(pattern)
        except (pexpect.TIMEOUT, pexpect.EOF):
            raise AssertionError(f"bitchat never printed {pattern!r}; last output:\n{self.child.before[-2000:]!r}")
        self.log.append(self.child.before + (self.child.after if isinstance(self.child.after, str) else ""))
        return i

    def wait_prompt(self):
        self.expect(PROMPT_RE)

    def enter(self, text):
        """Type a line and press Enter; returns once bitchat has accepted it."""
        self.child.send(text)
        self.child.send("\r")
        self.expect(re.escape(ACCEPTED))

    def ask(self, text):
        """Ask a question; returns (answer as shown, number of tokens, ttft ms)."""
        self.enter(text)
        self.expect(STATS_RE)
        shown = self.child.before
        n, ttft = int(self.child.match.group(1)), self.child.match.group(2)
        self.wait_prompt()
        return shown, n, ttft

    def command(self, text, expected):
        self.enter(text)
        self.expect(expected)
        out = self.child.before + self.child.after
        self.wait_prompt()
        return out

    def finish(self, how="/bye"):
        if how == "/bye":
            self.enter("/bye")
        else:
            self.child.send(how)
        self.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus


def plain(text: str) -> str:
    return " ".join(ANSI_RE.sub("", text).split())


def test_question_streams_an_answer_with_stats_and_bye_exits(chat_model, tmp_path):
    chat = Chat(chat_model, tmp_path)
    shown, n, ttft = chat.ask("Hello, who are you?")
    assert 1 <= n <= 8 and ttft is not None
    chat.command(f"/save {tmp_path / 'c.json'}", r"\[saved 1 turn ")
    saved = json.loads((tmp_path / "c.json").read_text())
    answer = saved["turns"][0]["assistant"]
    assert saved["turns"][0]["user"] == "Hello, who are you?"
    assert answer.strip(), "the model produced no visible text"
    assert plain(answer) in plain(shown)          # what was saved is what was shown
    assert chat.finish("/bye") == 0


def test_every_slash_command(chat_model, tmp_path):
    chat = Chat(chat_model, tmp_path)
    out = chat.command("/help", r"/retry")
    assert "/save" in out
    for name, value, shown in [("temp", "0", "0.0"), ("top_k", "5", "5"), ("top_p", "0.9", "0.9"),
                               ("min_p", "0.1", "0.1"), ("seed", "7", "7"), ("max_tokens", "6", "6")]:
        chat.command(f"/set {name} {value}", rf"\[{name} = {re.escape(shown)}\]")
    chat.command("/set", r"temp=0 top_k=5 top_p=0\.9 min_p=0\.1 repeat_penalty=1 seed=7 max_tokens=6")
    # mistakes: one line of hint, the session goes on
    for command, hint in [("/set temp hot", r"/set temp: 'hot' is not a number"),
                          ("/set top_p 3", r"must be in \[0, 1\]"), ("/set colour red", r"unknown setting 'colour'"),
                          ("/frobnicate", r"unknown command /frobnicate"), ("/save", r"/save needs a file name"),
                          (f"/load {tmp_path / 'missing.json'}", r"no such file"), ("/retry", r"nothing to retry")]:
        chat.command(command, hint)
    chat.command("/system You are terse.", r"\[system prompt set\]")
    chat.command("/system", r"system prompt: 'You are terse\.'")
    out = chat.command("/show", r"system: [^\r\n]*")
    assert "layers" in out and "context:" in out and "You are terse." in out
    _, n1, _ = chat.ask("Say something.")
    assert n1 <= 6
    chat.enter("/retry")                              # regenerates the last answer
    chat.expect(STATS_RE)
    chat.wait_prompt()
    out = chat.command("/stats", r"context: [^\r\n]*")
    assert "last answer:" in out and "session:     1 turn (" in out
    chat.command("/reset", r"\[conversation cleared\]")
    chat.command("/stats", r"session:     0 turns")
    # tab completion: "/he" + Tab completes to /help (on screen before the Enter: read with the Tab, the Enter
    # took the line before the completion ran, as a person's keys never come)
    chat.child.send("/he\t")
    chat.expect(r"/help")
    chat.child.send("\r")
    chat.expect(re.escape(ACCEPTED))
    chat.expect(r"/retry")
    chat.wait_prompt()
    assert chat.finish("\x04") == 0


def test_ctrl_z_at_the_prompt_suspends_and_fg_resumes(chat_model, tmp_path):
    """Ctrl-Z at the prompt stops bitchat as a job (bash, Python's REPL and llama-cli do): it typed a \x1a into
    the line. Run under an interactive bash, whose job control is what stops and resumes it."""
    import shlex

    cmd = console_script("bitchat") + ["-m", chat_model, "-t", "1", "-n", "4"]
    env = {**test_env(tmp_path), "PS1": "sh$ ", "HISTFILE": str(tmp_path / "bash_history")}
    sh = pexpect.spawn("bash", ["--norc", "--noprofile", "-i"], env=env, encoding="utf-8", timeout=TIMEOUT,
                       dimensions=(50, 220))
    try:
        sh.expect_exact("sh$ ")
        sh.send(shlex.join(cmd) + "\r")
        sh.expect(PROMPT_RE)
        sh.send("hel")
        sh.expect_exact("hel")
        sh.send("\x1a")
        sh.expect("Stopped", timeout=60)   # bash's job report: bitchat is suspended
        sh.expect_exact("sh$ ")
        sh.send("fg\r")
        sh.expect_exact("hel")    # the prompt is back with the line as it was
        sh.send("lo there\r")
        sh.expect(STATS_RE)       # and it answers it
        sh.expect(PROMPT_RE)
        sh.send("/save " + str(tmp_path / "c.json") + "\r")
        sh.expect(r"\[saved 1 turn ")
        assert json.loads((tmp_path / "c.json").read_text())["turns"][0]["user"] == "hello there"
        sh.send("/bye\r")
        sh.expect_exact("sh$ ")
    finally:
        sh.close(force=True)


def test_ctrl_c_stops_a_long_answer_and_the_chat_goes_on(long_model, tmp_path):
    chat = Chat(long_model, tmp_path, "-n", "8000", "--temp", "0")
    chat.enter("Tell me a very long story about a dragon, with many chapters.")
    chat.expect(r"\S")                                # the answer has started streaming
    chat.child.send("\x03")
    i = chat.expect([r"\[interrupted: the answer so far is kept\]", STATS_RE])
    assert i == 0, f"the answer ended by itself before Ctrl-C landed: {chat.child.after!r}"
    chat.expect(STATS_RE)
    assert int(chat.child.match.group(1)) < 8000
    chat.wait_prompt()
    chat.command("/set max_tokens 4", r"\[max_tokens = 4\]")
    _, n, _ = chat.ask("And now a short answer.")
    assert 1 <= n <= 4
    chat.command(f"/save {tmp_path / 'c.json'}", r"\[saved 2 turns")
    turns = json.loads((tmp_path / "c.json").read_text())["turns"]
    assert turns[0]["interrupted"] is True and turns[0]["finish_reason"] == "interrupted"
    assert turns[0]["assistant"] is not None
    assert not turns[1].get("interrupted")
    assert chat.finish("/bye") == 0


ALTERNATING = ("{% set ns = namespace(i=0) %}{% for m in messages %}{% if m['role'] != 'system' %}"
               "{% if (m['role'] == 'user') != (ns.i % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}{% endif %}"
               "{% set ns.i = ns.i + 1 %}{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
               "{% if add_generation_prompt %}assistant:{% endif %}")


def test_ctrl_c_at_any_moment_of_a_turn_leaves_it_answered(long_model, tmp_path):
    """Ctrl-C pressed at any moment after Enter -- read with the Enter itself (keys that arrive together, over
    ssh or on a busy machine), while the long conversation's prompt is fitted and saved, before the first token,
    or while it streams -- leaves the turn answered (what was shown, marked interrupted) or, stopped before any of
    its answer was shown, takes it out of the conversation; never a question without an answer: the next turn
    would put two user messages in a row, which templates that alternate roles refuse (every later message was
    'not sent' until /reset). A Ctrl-C read with the Enter was kept for the next prompt and the answer ran whole."""
    from bitnet_cpu.chat.transcript import Conversation

    long = Conversation()
    for i in range(100):   # a long history: fitting and saving it takes a while after each Enter
        t = long.add_user(f"question {i} " + "words " * 40)
        t.assistant = f"answer {i} " + "more words " * 40
    long.save(str(tmp_path / "long.json"))
    template = tmp_path / "alternate.jinja"
    template.write_text(ALTERNATING)
    chat = Chat(long_model, tmp_path, "-n", "8000", "--temp", "0", "-c", "8192", "--chat-template-file",
                str(template))
    chat.command(f"/load {tmp_path / 'long.json'}", r"\[loaded 100 turns[^\]]*\]")
    delays = [None, 0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.2]   # None: in one write with the Enter
    said_kept = []   # the attempts whose notice said the answer so far is kept (the others: the message dropped)
    for i, delay in enumerate(delays):
        if delay is None:
            chat.child.send(f"interrupted {i}\r\x03")
        else:
            chat.child.send(f"interrupted {i}\r")
            time.sleep(delay)
            chat.child.send("\x03")
        chat.wait_prompt()
        said = plain(chat.child.before)
        kept_notice, dropped_notice = "the answer so far is kept" in said, "the message is dropped" in said
        assert kept_notice != dropped_notice, (i, said[-500:])   # exactly one of the two, every time
        if kept_notice:
            said_kept.append(f"interrupted {i}")
    # and one stopped once its answer is on the screen, whatever the machine's speed: it is kept, with that text
    chat.enter(f"interrupted {len(delays)}")
    chat.expect(r"\S")   # the answer has started
    chat.child.send("\x03")
    chat.expect(r"\[interrupted: the answer so far is kept\]")
    chat.wait_prompt()
    said_kept.append(f"interrupted {len(delays)}")
    chat.command("/set max_tokens 2", r"\[max_tokens = 2\]")
    chat.enter("and a last question")
    chat.expect(STATS_RE)   # answered: not "[message not sent: ... roles must alternate ...]"
    chat.wait_prompt()
    chat.command(f"/save {tmp_path / 'after.json'}", r"\[saved \d+ turns")
    turns = json.loads((tmp_path / "after.json").read_text())["turns"]
    assert all(isinstance(t["assistant"], str) for t in turns), [t for t in turns if t["assistant"] is None]
    kept = [t["user"] for t in turns[100:-1]]
    assert kept == said_kept and turns[-1]["user"] == "and a last question", (kept, said_kept)
    assert "interrupted 0" not in kept   # stopped with its Enter: never answered, so never kept
    assert all(t.get("interrupted") and t["assistant"] for t in turns[100:-1]), turns[100:-1]
    assert chat.finish("/bye") == 0


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_restore_the_terminal_and_keep_the_answer_so_far(long_model, tmp_path, sig):
    """kill, or the terminal closed, while an answer streams: the terminal's modes are restored (echo was left
    off; at a prompt, raw mode), the answer shown so far is in the recovery copy (it held the question alone),
    and one line says where, with the signal's exit status."""
    import signal
    import termios

    chat = Chat(long_model, tmp_path, "-n", "8000", "--temp", "0")
    chat.enter("Tell me a very long story about a dragon, with many chapters.")
    chat.expect(r"\S")                                # the answer has started
    chat.child.kill(getattr(signal, sig))
    chat.expect(pexpect.EOF)
    after = termios.tcgetattr(chat.child.child_fd)   # the terminal as bitchat left it
    chat.child.close()
    assert chat.child.exitstatus == 128 + getattr(signal, sig), (chat.child.exitstatus, chat.child.signalstatus)
    assert f"bitchat: terminated ({sig})" in chat.child.before
    saved = re.search(r"saved in (\S+recovery-\d+\.json)", chat.child.before)
    assert saved, chat.child.before
    turns = json.loads(open(saved.group(1)).read())["turns"]
    # the question is answered with what was written before the signal (held the question alone, as unanswered)
    assert turns[-1].get("interrupted") and isinstance(turns[-1]["assistant"], str), turns[-1]
    assert after[3] & termios.ECHO and after[3] & termios.ICANON   # the terminal as it was (pexpect's: cooked)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_kill_while_a_long_paste_is_prefilled_keeps_it_in_the_recovery_copy(long_model, tmp_path, sig):
    """kill, or the terminal closed, while a long pasted message is prefilled (no answer shown yet): bitchat ends
    with the signal's status and the recovery copy it names holds the message. Only a Ctrl-C takes a message back;
    the paste was dropped and the copy rewritten without it, so the one place bitchat said it was kept lost it."""
    import signal

    env = test_env(tmp_path)
    cmd = console_script("bitchat") + ["-m", long_model, "-t", "1", "--seed", "1", "-n", "8", "-c", "8192"]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    copy = tmp_path / "state" / "bitchat" / f"recovery-{p.pid}.json"
    paste = "a long pasted paragraph of words " * 240   # thousands of tokens: seconds of prefill
    try:
        p.stdin.write(b"Short first question\n" + paste.encode() + b"\n")
        p.stdin.flush()
        deadline = time.monotonic() + TIMEOUT * 2
        while time.monotonic() < deadline and p.poll() is None:   # the copy holds the paste as its prefill begins
            try:
                turns = json.loads(copy.read_text())["turns"]
                if turns[-1]["user"].strip() == paste.strip():
                    break
            except (OSError, ValueError, IndexError):
                pass
            time.sleep(0.02)
        else:
            raise AssertionError(f"bitchat (exit {p.returncode}) never wrote the paste to {copy}")
        p.send_signal(getattr(signal, sig))
        _, err = p.communicate(timeout=TIMEOUT)
    finally:
        p.kill()
        p.wait()
    err = err.decode()
    assert p.returncode == 128 + getattr(signal, sig), (p.returncode, err[-500:])
    assert "dropped" not in err, err[-500:]
    saved = re.search(r"saved in (\S+recovery-\d+\.json)", err)
    assert saved, err[-500:]
    turns = json.loads(open(saved.group(1)).read())["turns"]
    users = [t["user"].strip() for t in turns]
    assert users == ["Short first question", paste.strip()], [u[:40] for u in users]
    assert isinstance(turns[-1]["assistant"], str) and turns[-1].get("interrupted"), turns[-1]


def test_a_terminal_closed_mid_answer_keeps_the_answer_and_exits_as_sighup(long_model, tmp_path):
    """The terminal itself closes (its window, an ssh session) while an answer streams: the next write fails (EIO)
    before any SIGHUP arrives. That was an internal error (exit 70) that emptied the answer in the recovery copy;
    now it is SIGHUP's exit, 129, with the answer shown so far kept."""
    import pty
    import select
    import signal

    stderr = tmp_path / "stderr.txt"
    cmd = console_script("bitchat")
    pid, fd = pty.fork()
    if pid == 0:   # the child: bitchat on the pty, its stderr in a file (the terminal will be gone)
        try:
            os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            os.execvpe(cmd[0], [*cmd, "-m", long_model, "-t", "1", "-n", "8000", "--temp", "0"], test_env(tmp_path))
        finally:
            os._exit(127)
    shown, deadline = b"", time.monotonic() + TIMEOUT

    def read_until(done):
        nonlocal shown
        while not done() and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    shown += os.read(fd, 65536)
                except OSError:
                    break
        return done()
    try:
        assert read_until(lambda: b">>>" in shown), shown[-500:]
        os.write(fd, b"Tell me a very long story about a dragon, with many chapters.\r")
        mark = len(shown)
        assert read_until(lambda: len(ANSI_RE.sub("", shown[mark:].decode(errors="replace")).strip()) > 200)
    finally:
        os.close(fd)   # the terminal closes
    left = time.monotonic() + TIMEOUT
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < left:
        time.sleep(0.1)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError("bitchat did not end when its terminal closed")
    err = stderr.read_text()
    assert os.waitstatus_to_exitcode(done[1]) == 128 + signal.SIGHUP and "internal error" not in err, err
    saved = re.search(r"saved in (\S+recovery-\d+\.json)", err)
    assert saved, err
    last = json.loads(open(saved.group(1)).read())["turns"][-1]
    assert last.get("interrupted") and last["assistant"], last   # what was shown, not an empty answer


def test_sigterm_while_a_conversation_loads_ends_bitchat(long_model, tmp_path):
    """SIGTERM at any moment of /load (reading, fitting the window, the prefill) ends bitchat with 143: it was
    taken for a tokenizer error ("[internal error: FormatError ... 15]") or a Ctrl-C of the prefill, and bitchat
    went on."""
    from bitnet_cpu.chat.transcript import Conversation

    long = Conversation()
    for i in range(100):
        t = long.add_user(f"question {i} " + "words " * 40)
        t.assistant = f"answer {i} " + "more words " * 40
    long.save(str(tmp_path / "long.json"))
    for delay in (0.0, 0.05, 0.3):
        chat = Chat(long_model, tmp_path, "-c", "8192")
        chat.enter(f"/load {tmp_path / 'long.json'}")
        _sigterm_ends_it(chat, delay)
        assert "internal error" not in chat.child.before


def _sigterm_ends_it(chat, delay):
    """SIGTERM `delay` s from now: bitchat ends with 143, saying so."""
    import signal

    time.sleep(delay)
    chat.child.kill(signal.SIGTERM)
    try:
        chat.expect(pexpect.EOF)
    except AssertionError as e:   # (a SIGTERM taken and never acted on: bitchat at its prompt again, say)
        raise AssertionError(f"bitchat did not end after a SIGTERM {delay} s into it: {e}") from None
    chat.child.close()
    assert chat.child.exitstatus == 143 and "bitchat: terminated (SIGTERM)" in chat.child.before, \
        (delay, chat.child.before[-500:])


def test_sigterm_while_the_prompt_takes_a_paste_ends_bitchat(chat_model, tmp_path):
    """SIGTERM while the prompt works through typed or pasted text (prompt_toolkit's event loop in a callback):
    bitchat ends with 143. The signal's exception went to the loop's error handler, which printed "Unhandled
    exception in event loop ... Press ENTER to continue", and bitchat went on (its next Enter took the line)."""
    for delay in (0.0, 0.02, 0.1):
        chat = Chat(chat_model, tmp_path)
        chat.child.send("\x1b[200~" + "a pasted paragraph of words " * 4000 + "\x1b[201~")
        _sigterm_ends_it(chat, delay)
        assert "Unhandled exception" not in chat.child.before


def test_ctrl_d_typed_while_an_answer_streams_ends_the_chat_after_it(long_model, tmp_path):
    """Keys typed while an answer streams wait for the next prompt: a Ctrl-D too (the terminal's canonical mode
    took it as its own end-of-file, so it was lost and bitchat stayed at the prompt)."""
    chat = Chat(long_model, tmp_path, "-n", "1500", "--temp", "0")
    chat.enter("Tell me a very long story about a dragon, with many chapters.")
    chat.expect(r"\S")                                # the answer has started
    chat.child.send("\x04")
    chat.expect(STATS_RE)                             # the answer ran to its end
    chat.expect(pexpect.EOF)                          # then the Ctrl-D at the prompt: bye
    chat.child.close()
    assert chat.child.exitstatus == 0


def test_ctrl_c_at_the_prompt_clears_the_line_and_hints(chat_model, tmp_path):
    chat = Chat(chat_model, tmp_path)
    chat.child.send("some text I regret")
    chat.child.send("\x03")          # clears the line
    chat.child.send("\x03")          # empty prompt: nothing
    chat.child.send("\x03")          # again: the hint
    chat.expect(r"use /bye or Ctrl-D to exit")
    chat.wait_prompt()
    chat.command("/stats", r"session:     0 turns")   # the cleared text was never sent
    assert chat.finish("\x04") == 0


def test_typed_lines_with_stdout_piped_say_line_mode_and_show_a_prompt(chat_model, tmp_path):
    """`bitchat | tee log`, `bitchat > answers.txt` (stdin a terminal, stdout not): no REPL, and it looked like a
    hang: no prompt, no hint. The ready line says it is line mode, a prompt shows on stderr (the terminal) before
    each line, stdout gets the answers only, and a Ctrl-C while a line is typed clears it, as the REPL does (the
    run goes on). (A file, not `| cat`: the terminal's Ctrl-C would end cat as well, as it ends a real tee.)"""
    import shlex

    out = tmp_path / "out.txt"
    cmd = console_script("bitchat") + ["-m", chat_model, "-t", "1", "--seed", "1", "-n", "4", "--temp", "0"]
    child = pexpect.spawn("bash", ["-c", f"{shlex.join(cmd)} > {shlex.quote(str(out))}"],
                          env=test_env(tmp_path), encoding="utf-8", timeout=TIMEOUT, dimensions=(50, 220))
    try:
        child.expect(r"ready in [^\r\n]*")
        assert "line mode" in child.after and "/bye or Ctrl-D" in child.after, child.after
        child.expect_exact(">>> ")
        child.send("Hello there\r")
        child.expect(STATS_RE)
        child.expect_exact(">>> ")
        child.send("words never sent")
        child.expect_exact("words never sent")   # (echoed by the terminal: the line is being typed)
        child.send("\x03")
        child.expect_exact(">>> ")                # cleared: a fresh prompt, bitchat still runs
        child.send('"""\r')
        child.expect_exact("... ")                # a block's continuation prompt
        child.send('two\r"""\r')
        child.expect(STATS_RE)
        child.expect_exact(">>> ")
        child.send(f"/save {tmp_path / 'c.json'}\r")
        child.expect(r"\[saved 2 turns")
        child.send("/bye\r")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    turns = json.loads((tmp_path / "c.json").read_text())["turns"]
    assert [t["user"] for t in turns] == ["Hello there", "two"]
    piped = out.read_text()
    assert ">>>" not in piped and "saved" not in piped and "ready" not in piped, piped
    assert plain(turns[0]["assistant"]) in plain(piped)


def test_a_typed_nul_is_kept_with_the_text_after_it(chat_model, tmp_path):
    """Ctrl-@ (Ctrl-Space: a NUL byte) typed mid-line was emacs' set-mark: the keys after it never reached the line,
    and "hello<NUL>world" sent "hello". Now it is text, as a paste or piped input takes it."""
    chat = Chat(chat_model, tmp_path)
    chat.child.send("hello")
    chat.child.send("\x00")
    chat.child.send("world")
    chat.expect("world")
    chat.child.send("\r")
    chat.expect(STATS_RE)
    chat.wait_prompt()
    chat.command(f"/save {tmp_path / 'c.json'}", r"\[saved 1 turn ")
    assert json.loads((tmp_path / "c.json").read_text())["turns"][0]["user"] == "hello\x00world"
    assert chat.finish("/bye") == 0


@pytest.mark.parametrize("setting", [{"LANG": "C", "LC_ALL": "C"}, {"LANG": "C"}])
def test_bytes_that_are_not_utf8_under_lang_c_name_the_locale(chat_model, tmp_path, setting):
    """Typed in a C locale, a byte that is not UTF-8 is refused in one line that names the locale, as the docs say
    (it read as under C.UTF-8: Python reads the C locale in its UTF-8 mode); typed UTF-8 is still taken."""
    cmd = console_script("bitchat")
    env = {k: v for k, v in test_env(tmp_path).items() if k not in ("LC_ALL", "LC_CTYPE", "LANG", "PYTHONUTF8")}
    child = pexpect.spawn(cmd[0], cmd[1:] + ["-m", chat_model, "-t", "1", "-n", "2"], env={**env, **setting},
                          encoding="utf-8", codec_errors="replace", timeout=TIMEOUT, dimensions=(50, 220))
    try:
        child.expect(PROMPT_RE)
        os.write(child.child_fd, b"caf\xe9\r")   # (pexpect sends text as UTF-8)
        child.expect(r"\[message: not UTF-8 text[^\]]*\]")
        want = "LC_ALL=C" if "LC_ALL" in setting else "LANG=C"
        assert f"the locale ({want}) is not UTF-8" in plain(child.after), child.after
        child.expect(PROMPT_RE)
        child.send("/bye\r")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)


def test_multiline_input(chat_model, tmp_path):
    chat = Chat(chat_model, tmp_path, "-n", "2")
    chat.child.send('"""')
    chat.child.send("\r")            # inside an open block Enter adds a line
    chat.child.send("first line\r")
    chat.child.send('second line"""')
    chat.enter("")
    chat.expect(STATS_RE)
    chat.wait_prompt()
    chat.child.send("alpha")
    chat.child.send("\x1b\r")        # Esc-Enter: a newline, not a send
    chat.enter("beta")
    chat.expect(STATS_RE)
    chat.wait_prompt()
    chat.child.send('/set system """You are a pirate.')
    chat.child.send("\r")            # ollama's system prompt block: Enter adds a line too
    chat.child.send("Always say arr.\r")
    chat.command('"""', r"\[system prompt set\]")
    chat.command(f"/save {tmp_path / 'm.json'}", r"\[saved 2 turns")
    saved = json.loads((tmp_path / "m.json").read_text())
    turns = saved["turns"]
    assert turns[0]["user"] == "first line\nsecond line"
    assert turns[1]["user"] == "alpha\nbeta"
    assert saved["system"] == "You are a pirate.\nAlways say arr."
    assert chat.finish("/bye") == 0
    history = (tmp_path / "history").read_text()     # persistent input history
    assert "alpha" in history and "/save" in history


def test_save_and_load_reprefills_and_reuses_the_cache(chat_model, tmp_path):
    chat = Chat(chat_model, tmp_path, "-n", "4", "--system", "You are a test.")
    chat.ask("First question?")
    chat.ask("Second question?")
    path = tmp_path / "conv.json"
    chat.command(f"/save {path}", r"\[saved 2 turns")
    chat.finish("/bye")
    saved = json.loads(path.read_text())
    assert saved["system"] == "You are a test." and len(saved["turns"]) == 2

    chat = Chat(chat_model, tmp_path, "-n", "4")
    chat.command(f"/load {path}", r"\[prefilled (\d+) tokens")
    out = chat.command("/show", r"system: [^\r\n]*")
    assert "You are a test." in out
    chat.enter("Third question?")
    chat.expect(r"prefill (\d+) new of (\d+)")
    new, total = int(chat.child.match.group(1)), int(chat.child.match.group(2))
    assert new < total / 2, f"after /load the conversation should come from the cache ({new} new of {total})"
    chat.wait_prompt()
    chat.command(f"/save {path}", r"\[saved 3 turns")
    turns = json.loads(path.read_text())["turns"]
    assert [t["user"] for t in turns] == ["First question?", "Second question?", "Third question?"]
    assert turns[:2] == saved["turns"]
    # a corrupt file is refused with one line and the conversation stays
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    chat.command(f"/load {bad}", r"not valid JSON")
    chat.command("/stats", r"session:     3 turns")
    assert chat.finish("\x04") == 0


def run_piped(model, tmp_path, stdin, *extra):
    cmd = console_script("bitchat") + ["-m", model, "-t", "1", "--seed", "1", "-n", "6", *extra]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=TIMEOUT * 2,
                          env=test_env(tmp_path))


def test_piped_stdin_turns_and_plain_output(chat_model, tmp_path):
    path = tmp_path / "p.json"
    r = run_piped(chat_model, tmp_path, f"Hello there.\n/set temp 0\nWhat next?\n/save {path}\n")
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\x1b" not in r.stderr   # plain text for scripts
    assert "Traceback" not in r.stderr
    turns = json.loads(path.read_text())["turns"]
    assert [t["user"] for t in turns] == ["Hello there.", "What next?"]
    assert plain(turns[0]["assistant"] + " " + turns[1]["assistant"]) == plain(r.stdout)  # stdout = answers only
    stats = re.findall(r"prefill (\d+) new of (\d+)", r.stderr)
    assert len(stats) == 2
    assert int(stats[1][0]) < int(stats[1][1])                # turn 2 reused turn 1's cache


def test_ctrl_c_ends_a_piped_run_with_130_keeping_what_was_answered(long_model, tmp_path):
    """`bitchat < questions.txt` and Ctrl-C: each press only cut the current answer, the next question ran, and the
    run ended 0 (a file of 100 questions took 100 presses). Nobody is at a prompt: the answer so far is kept in the
    recovery copy, named in one line, and the run ends 130, as llama-cli's and every filter's."""
    import signal

    env = test_env(tmp_path)
    env["BITCHAT_RECOVERY"] = str(tmp_path / "rec.json")
    cmd = console_script("bitchat") + ["-m", long_model, "-t", "1", "--temp", "0", "-n", "1500"]
    questions = tmp_path / "questions.txt"
    questions.write_text("Once upon a time\nsecond question\nthird question\n")
    with open(questions) as stdin:
        p = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert p.stdout.read(1)   # the first answer has started
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=TIMEOUT * 2)
    finally:
        p.kill()
        p.wait()
    err = err.decode()
    assert p.returncode == 130, err
    turns = json.loads((tmp_path / "rec.json").read_text())["turns"]
    assert [t["user"] for t in turns] == ["Once upon a time"] and turns[0]["interrupted"], turns
    assert f"bitchat: interrupted; the conversation so far is saved in {tmp_path / 'rec.json'}" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("stderr", ["closed", "/dev/full"])
def test_an_unwritable_stderr_loses_only_the_notices(chat_model, tmp_path, stderr):
    """stderr closed (`2>&-`) or on a full disk (`2>/dev/full`): the answers still come on stdout and the exit is 0
    (every notice raised EBADF / ENOSPC: no answer, exit 1)."""
    if stderr == "/dev/full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    path = tmp_path / "p.json"
    cmd = console_script("bitchat") + ["-m", chat_model, "-t", "1", "--seed", "1", "-n", "6"]
    with open(os.devnull if stderr == "closed" else stderr, "w") as err:
        r = subprocess.run(cmd, input=f"Hello there.\n/save {path}\n", stdout=subprocess.PIPE, stderr=err,
                           text=True, timeout=TIMEOUT * 2, env=test_env(tmp_path),
                           preexec_fn=(lambda: os.close(2)) if stderr == "closed" else None)
    assert r.returncode == 0
    turns = json.loads(path.read_text())["turns"]
    assert turns[0]["assistant"] and plain(turns[0]["assistant"]) == plain(r.stdout)


def test_a_recovery_path_holding_another_file_is_refused(chat_model, tmp_path):
    """$BITCHAT_RECOVERY naming a file that is not a recovery copy (the user's own, a saved conversation) is refused
    at start in one line, exit 2, the file untouched: it was replaced by the copy, then removed at exit."""
    for content in ("precious notes\n", json.dumps({"format": "bitchat-conversation", "version": 1, "turns": []})):
        path = tmp_path / "precious.txt"
        path.write_text(content)
        env = test_env(tmp_path)
        env["BITCHAT_RECOVERY"] = str(path)
        r = subprocess.run(console_script("bitchat") + ["-m", chat_model, "-t", "1"], input="/bye\n",
                           capture_output=True, text=True, timeout=TIMEOUT, env=env)
        assert r.returncode == 2 and path.read_text() == content, r.stderr
        assert r.stderr.count("\n") == 1 and "not a bitchat recovery copy" in r.stderr
        assert "BITCHAT_RECOVERY" in r.stderr


def test_a_recovery_path_ending_in_a_slash_is_refused_and_the_saved_chat_kept(chat_model, tmp_path):
    """BITCHAT_RECOVERY=$PWD/mine.json/ passed the start-up check (nothing is at "mine.json/"), then the copy was
    written over mine.json, a saved conversation, and removed at the normal exit: the user's chat was gone."""
    saved = tmp_path / "mine.json"
    content = json.dumps({"format": "bitchat-conversation", "version": 1, "system": None,
                          "turns": [{"user": "My saved question", "assistant": "Kept."}]})
    saved.write_text(content)
    env = test_env(tmp_path)
    env["BITCHAT_RECOVERY"] = f"{saved}/"
    r = subprocess.run(console_script("bitchat") + ["-m", chat_model, "-t", "1", "-n", "4"], input="hi\n",
                       capture_output=True, text=True, timeout=TIMEOUT * 2, env=env)
    assert saved.read_text() == content
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "BITCHAT_RECOVERY" in r.stderr, r.stderr


def test_an_earlier_sessions_copy_at_a_fixed_recovery_path_is_kept(chat_model, tmp_path):
    """A fixed $BITCHAT_RECOVERY holding the copy an earlier (crashed) session left is never written over nor
    removed, even once /load-ed as the crash line advises: this session writes X-2.json beside it and says so in one
    line naming both (the copy was replaced at the first turn, then deleted at exit)."""
    path = tmp_path / "rec.json"
    content = json.dumps({"format": "bitchat-conversation", "version": 1, "system": None,
                          "turns": [{"user": "My secret plan", "assistant": "Noted."}],
                          "meta": {"recovered": True}})
    path.write_text(content)
    env = test_env(tmp_path)
    env["BITCHAT_RECOVERY"] = str(path)
    r = subprocess.run(console_script("bitchat") + ["-m", chat_model, "-t", "1", "-n", "4"],
                       input=f"/load {path}\nAnd then?\n", capture_output=True, text=True, timeout=TIMEOUT * 2,
                       env=env)
    assert r.returncode == 0, r.stderr
    assert path.read_text() == content
    beside = tmp_path / "rec-2.json"
    assert [line for line in r.stderr.splitlines() if str(path) in line and str(beside) in line], r.stderr
    assert not beside.exists()   # this session's own copy: removed at its normal exit


LEFT_BEHIND = "did not end normally"   # the start notice about copies that sessions killed or crashed left


def _session_with_a_copy(model, tmp_path, copy=None, **env_extra):
    """A piped bitchat that has answered its first turn and waits for the next, its recovery copy written:
    (process, copy path). `copy`: where the copy goes (default: the state dir's recovery-PID.json)."""
    env = dict(test_env(tmp_path), **env_extra)
    cmd = console_script("bitchat") + ["-m", model, "-t", "1", "--seed", "1", "-n", "4"]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    copy = copy or tmp_path / "state" / "bitchat" / f"recovery-{p.pid}.json"
    p.stdin.write(b"My secret plan\n")
    p.stdin.flush()
    deadline = time.monotonic() + TIMEOUT * 2
    while time.monotonic() < deadline and p.poll() is None:   # the copy holds the turn once its answer is made
        try:
            turns = json.loads(copy.read_text())["turns"]
            if turns and turns[0]["assistant"] is not None:
                return p, copy
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    p.kill()
    p.wait()
    raise AssertionError(f"bitchat (exit {p.returncode}) never wrote its first turn to {copy}")


def _killed_session(model, tmp_path, copy=None, **env_extra):
    """The recovery copy a bitchat left as SIGKILL ended it after its first turn (it had no chance to say so)."""
    import signal

    p, copy = _session_with_a_copy(model, tmp_path, copy, **env_extra)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert copy.exists()
    return copy


def _end(p):
    """End a session waiting for input as a user does (end of input): a normal exit, its copy removed."""
    try:
        p.stdin.close()
        assert p.wait(timeout=TIMEOUT) == 0
    finally:
        p.kill()
        p.wait()


def test_a_killed_sessions_copy_is_named_at_the_next_start_and_a_running_ones_never(chat_model, tmp_path):
    """A bitchat killed with SIGKILL (or by the OOM killer, or a crash) left its recovery copy, the user's
    conversation, unannounced for ever. The next bitchat names it before the first prompt, in one line on stderr
    (a piped run's stdout holds answers only), with its turns, when it was last written and how to /load it; the
    copy of a bitchat still running in another terminal is never named; nothing is deleted."""
    orphan = _killed_session(chat_model, tmp_path)
    live, live_copy = _session_with_a_copy(chat_model, tmp_path)
    try:
        r = run_piped(chat_model, tmp_path, f"/load {orphan}\n")   # the line's advice works
        assert r.returncode == 0, r.stderr
        named = [line for line in r.stderr.splitlines() if LEFT_BEHIND in line]
        assert len(named) == 1 and str(orphan) in named[0] and "1 turn" in named[0], r.stderr
        assert f"/load {orphan}" in named[0] and "last written" in named[0]
        assert str(live_copy) not in r.stderr and str(orphan) not in r.stdout and LEFT_BEHIND not in r.stdout
        assert orphan.exists() and live_copy.exists()   # never deleted: the user's data

        chat = Chat(chat_model, tmp_path)   # on a terminal: said before the first prompt
        before = plain(chat.log[0])
        assert LEFT_BEHIND in before and str(orphan) in before and str(live_copy) not in before, before
        assert chat.finish() == 0

        listed = subprocess.run(console_script("bitchat") + ["--recovered"], capture_output=True, text=True,
                                timeout=TIMEOUT, env=test_env(tmp_path))
        assert listed.returncode == 0, listed.stderr
        assert [line.split("\t")[0] for line in listed.stdout.splitlines()] == [str(orphan)], listed.stdout
        assert "1 turn" in listed.stdout and "My secret plan" in listed.stdout
    finally:
        _end(live)
    assert not live_copy.exists() and orphan.exists()


def test_a_copy_whose_pid_now_runs_another_process_is_named(chat_model, tmp_path):
    """PID reuse: the process holding a dead session's PID now (here another running bitchat) is not its writer:
    the copy is named; one written by the process that runs now is not."""
    orphan = _killed_session(chat_model, tmp_path)
    live, live_copy = _session_with_a_copy(chat_model, tmp_path)
    try:
        d = json.loads(orphan.read_text())
        d["meta"]["process"]["pid"] = live.pid   # the dead writer's PID, as the running one got it
        reused = tmp_path / "state" / "bitchat" / f"recovery-{live.pid}-2.json"
        reused.write_text(json.dumps(d))
        orphan.unlink()
        r = run_piped(chat_model, tmp_path, "")
        assert r.returncode == 0, r.stderr
        named = [line for line in r.stderr.splitlines() if LEFT_BEHIND in line]
        assert len(named) == 1 and str(reused) in named[0] and str(live_copy) not in r.stderr, r.stderr
    finally:
        _end(live)


def test_bitchat_recovery_limits_which_copies_are_named_and_dev_null_none(chat_model, tmp_path):
    """$BITCHAT_RECOVERY=X.json: only X.json and the copies beside it are this bitchat's to name (the state dir's
    are not); /dev/null: no recovery copies, none named; a running bitchat's copy at X is said to be one."""
    fixed = tmp_path / "rec.json"
    orphan = _killed_session(chat_model, tmp_path, fixed, BITCHAT_RECOVERY=str(fixed))
    dead = json.loads(orphan.read_text())["meta"]["process"]["pid"]
    elsewhere = tmp_path / "state" / "bitchat" / f"recovery-{dead}.json"   # as a session in the state dir left it
    elsewhere.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(orphan, elsewhere)

    def start(recovery):
        env = dict(test_env(tmp_path), BITCHAT_RECOVERY=recovery)
        r = subprocess.run(console_script("bitchat") + ["-m", chat_model, "-t", "1"], input="", capture_output=True,
                           text=True, timeout=TIMEOUT, env=env)
        assert r.returncode == 0, r.stderr
        return [line for line in r.stderr.splitlines() if LEFT_BEHIND in line], r.stderr

    named, err = start(str(fixed))
    assert len(named) == 1 and str(fixed) in named[0] and str(elsewhere) not in err, err
    assert start(os.devnull)[0] == [] and start("")[0] == []

    live_path = tmp_path / "live.json"
    live, _ = _session_with_a_copy(chat_model, tmp_path, live_path, BITCHAT_RECOVERY=str(live_path))
    try:
        named, err = start(str(live_path))
        assert named == [] and "a bitchat still running" in err, err
    finally:
        _end(live)
    assert fixed.exists() and elsewhere.exists()


def test_piped_bad_command_hints_and_exits_1(chat_model, tmp_path):
    r = run_piped(chat_model, tmp_path, "/set temp hot\n/nope\n")
    assert r.returncode == 1
    assert "/set temp: 'hot' is not a number" in r.stderr and "unknown command /nope" in r.stderr
    assert "Traceback" not in r.stderr


def test_context_overflow_drops_oldest_turns_keeps_system(chat_model, tmp_path):
    path = tmp_path / "long.json"
    questions = "".join(f"Question number {i}: tell me more about it, please.\n" for i in range(8))
    r = run_piped(chat_model, tmp_path, questions + f"/save {path}\n", "-c", "128", "--system", "Be brief.")
    assert r.returncode == 0, r.stderr
    assert "dropped the" in r.stderr and "Traceback" not in r.stderr
    saved = json.loads(path.read_text())
    assert len(saved["turns"]) == 8                   # the transcript keeps everything
    assert saved["window_start"] > 0 and saved["system"] == "Be brief."


def test_bad_model_and_bad_flags_one_line_exit_2(tmp_path):
    r = run_piped(str(tmp_path / "no_such_model.gguf"), tmp_path, "")
    assert r.returncode == 2
    assert "bitchat: error:" in r.stderr and "no_such_model.gguf" in r.stderr and "Traceback" not in r.stderr
    cmd = console_script("bitchat")
    r = subprocess.run(cmd + ["--temp", "hot"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--temp" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(cmd + ["--top-p", "2"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("bitchat: error: --top-p 2") and r.stderr.count("\n") == 1
    for flags in (["-c", "-5"], ["--min-p", "2"], ["-n", "0"]):   # a value out of range: one line, no usage block
        r = subprocess.run(cmd + flags, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and flags[0] in r.stderr, r.stderr
    # -m '': "loading the bundled default model ..." and then "model '': no such file": one line, saying which
    r = subprocess.run(cmd + ["-m", ""], input="", capture_output=True, text=True, timeout=60, env=test_env(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "-m" in r.stderr and "loading" not in r.stderr, r.stderr


def test_a_template_that_cannot_render_is_one_line(chat_model, tmp_path):
    """A model whose own template does not parse: one line at load, exit 2 (not an internal error at every
    turn). A template that refuses one conversation (a word it will not take): that message is not sent, the
    session goes on, and the end says a turn failed (exit 1)."""
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir

    synth = SynthModel(small_config(hidden_size=64, intermediate_size=128, num_hidden_layers=1), seed=3)
    synth.chat_template = "{% for m in messages %}{{ m.content }}"   # no endfor
    broken = convert(write_hf_dir(synth, str(tmp_path / "hf")), str(tmp_path / "broken.bnstore"), progress=False)
    r = run_piped(broken, tmp_path, "Hello\n")
    assert r.returncode == 2 and "bitchat: error: chat template does not parse" in r.stderr, r.stderr
    assert "internal error" not in r.stderr and r.stderr.count("\n") == 2 and not r.stdout   # loading..., error
    picky = ("{% for m in messages %}{% if 'forbidden' in m.content %}{{ raise_exception('no such word') }}"
             "{% endif %}{{ m.content }}{% endfor %}")
    r = run_piped(chat_model, tmp_path, "Hello\nA forbidden word\nAgain\n", "--chat-template", picky)
    assert r.returncode == 1 and "[message not sent: chat template: no such word]" in r.stderr, r.stderr
    assert len(re.findall(r"prefill \d+ new", r.stderr)) == 2   # the first and the third turns were answered
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr and r.stdout.strip()


def test_utf8_typed_in_a_c_locale_is_sent(chat_model, tmp_path, monkeypatch):
    """A terminal in the C locale (no UTF-8 coercion) that sends UTF-8: the message goes to the model as typed (it
    was refused as "not UTF-8 text ... convert it with iconv")."""
    for name, value in (("LANG", "C"), ("LC_ALL", "C"), ("PYTHONCOERCECLOCALE", "0"), ("PYTHONUTF8", "0")):
        monkeypatch.setenv(name, value)
    chat = Chat(chat_model, tmp_path, "-n", "2")
    chat.enter("Say 🐉 dragon")
    chat.expect(STATS_RE)
    chat.wait_prompt()
    chat.command(f"/save {tmp_path / 'c.json'}", r"\[saved 1 turn")
    assert json.loads((tmp_path / "c.json").read_text())["turns"][0]["user"] == "Say 🐉 dragon"
    assert chat.finish("/bye") == 0


def test_a_terminal_that_is_not_utf8_gets_the_answers(chat_model, tmp_path):
    """stdout in latin-1 (what a latin-1 locale gives Python) and an answer it cannot encode (forced by a format):
    the answer is shown with stand-ins and saved (every turn ended as an 'internal error', its answer lost)."""
    schema = tmp_path / "cjk.json"
    schema.write_text(json.dumps({"type": "string", "enum": ["日本語 ✓"]}))
    path = tmp_path / "c.json"
    cmd = console_script("bitchat") + ["-m", chat_model, "-t", "1", "--temp", "0", "-n", "24"]
    r = subprocess.run(cmd, input=f"/set format {schema}\nHello there.\n/save {path}\n".encode(), capture_output=True,
                       timeout=TIMEOUT * 2, env={**test_env(tmp_path), "PYTHONIOENCODING": "latin-1"})
    err = r.stderr.decode("latin-1")
    assert r.returncode == 0 and "internal error" not in err, err
    assert json.loads(path.read_text(encoding="utf-8"))["turns"][0]["assistant"] == '"日本語 ✓"'
    assert r.stdout.decode("latin-1").strip() == '"??? ?"'


def test_history_is_private_and_bounded(tmp_path):
    """The input history (what was typed may be a secret) is 0600 in a 0700 directory, whatever the umask, and
    keeps its last entries (it was world-readable and grew without bound)."""
    from prompt_toolkit.history import FileHistory

    from bitnet_cpu.chat.repl import private_history

    path = tmp_path / "state" / "bitchat" / "history"
    old = os.umask(0o022)
    try:
        private_history(str(path))
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    h = FileHistory(str(path))
    for i in range(40):
        h.store_string(f"entry {i}\nsecond line {i}" + " padding" * 100)
    os.chmod(path, 0o644)   # as an earlier bitchat left it
    private_history(str(path), keep=5)
    assert path.stat().st_mode & 0o777 == 0o600
    kept = list(FileHistory(str(path)).load_history_strings())
    assert [s.split("\n")[0] for s in kept] == [f"entry {i}" for i in range(39, 34, -1)]
    assert all(s.split("\n")[1].startswith(f"second line {39 - k}") for k, s in enumerate(kept))
    private_history(str(path), keep=100, max_bytes=4000)   # entries of ~830 bytes: under a quarter of it
    assert 0 < len(list(FileHistory(str(path)).load_history_strings())) < 5
    # a history linked to a dotfiles repo is cut through the link: the link stays, the user's file is cut
    # (the link was replaced by a cut copy, and the user's file was never written again)
    target = tmp_path / "dotfiles" / "history"
    target.parent.mkdir()
    os.replace(path, target)
    os.symlink(target, path)
    for i in range(30):   # past the 16 KiB under which the file is not read
        FileHistory(str(target)).store_string(f"more {i}" + " padding" * 100)
    FileHistory(str(target)).store_string("newest")
    private_history(str(path), keep=2)
    assert path.is_symlink() and os.path.realpath(path) == str(target)
    assert [s.split("\n")[0] for s in FileHistory(str(target)).load_history_strings()][0] == "newest"
    assert len(list(FileHistory(str(target)).load_history_strings())) == 2


def test_term_dumb_gets_no_colour():
    """TERM=dumb (Emacs' shell, some CI logs): no escape codes, as git's colour rule (they showed raw)."""
    import io

    from bitnet_cpu.chat.render import Output

    old = os.environ.get("TERM"), os.environ.get("NO_COLOR")
    os.environ.pop("NO_COLOR", None)
    try:
        os.environ["TERM"] = "dumb"
        assert not Output(io.StringIO(), io.StringIO(), interactive=True).color
        os.environ["TERM"] = "xterm-256color"
        assert Output(io.StringIO(), io.StringIO(), interactive=True).color
    finally:
        for k, v in zip(("TERM", "NO_COLOR"), old):
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_a_signal_after_a_failed_recovery_write_never_names_the_older_copy(chat_model, tmp_path):
    """The recovery copy's write failed (a full disk: here the OS's file size limit on the bitchat process): SIGTERM
    then said "the conversation so far is saved in" a copy holding only the turns before the failure. Now the line
    says it is not saved and what the older copy holds; with room again, the next turn writes it again."""
    import resource
    import signal

    chat = Chat(chat_model, tmp_path)
    chat.ask("Hello?")
    rec = tmp_path / "state" / "bitchat" / f"recovery-{chat.child.pid}.json"
    assert len(json.loads(rec.read_text())["turns"]) == 1
    hard = resource.prlimit(chat.child.pid, resource.RLIMIT_FSIZE)[1]
    resource.prlimit(chat.child.pid, resource.RLIMIT_FSIZE, (rec.stat().st_size + 16, hard))   # "the disk is full"
    chat.ask("And a longer second question, please?")
    assert "cannot keep a recovery copy" in plain("".join(chat.log))
    chat.child.kill(signal.SIGTERM)
    chat.expect(pexpect.EOF)
    chat.child.close()
    last = plain(chat.child.before)
    assert chat.child.exitstatus == 143 and "saved in" not in last, last
    assert "bitchat: terminated (SIGTERM); the conversation so far is not saved: the recovery copy could not be " \
           "written" in last and f"{rec} holds an older copy (1 of 2 turns)" in last, last
    # the same, the limit lifted before the next turn: written again, and named as the session ends
    chat = Chat(chat_model, tmp_path)
    chat.ask("Hello?")
    rec = tmp_path / "state" / "bitchat" / f"recovery-{chat.child.pid}.json"
    resource.prlimit(chat.child.pid, resource.RLIMIT_FSIZE, (rec.stat().st_size + 16, hard))
    chat.ask("And a longer second question, please?")
    resource.prlimit(chat.child.pid, resource.RLIMIT_FSIZE, (hard, hard))
    chat.ask("Third?")
    assert "recovery copy is kept again" in plain("".join(chat.log))
    chat.child.kill(signal.SIGTERM)
    chat.expect(pexpect.EOF)
    chat.child.close()
    assert f"saved in {rec}" in plain(chat.child.before)
    assert len(json.loads(rec.read_text())["turns"]) == 3


def test_a_pasted_command_with_more_lines_does_nothing_and_says_so(chat_model, tmp_path):
    """A bracketed paste whose first line is /save made the next line part of the file name (a file named
    "paste.json\\nhello") and the message was lost: now one line says a command is one line and nothing was done;
    with // in front the same paste is a message."""
    chat = Chat(chat_model, tmp_path)
    target = tmp_path / "paste.json"
    chat.child.send(f"\x1b[200~/save {target}\nhello\x1b[201~")
    out = chat.command("", r"nothing was done[^\r\n]*")
    assert "a command is one line" in plain(out) and "start it with //" in plain(out)
    assert not any(x.startswith("paste.json") for x in os.listdir(tmp_path))
    chat.child.send(f"\x1b[200~//save {target}\nhello\x1b[201~")
    chat.enter("")
    chat.expect(STATS_RE)
    chat.wait_prompt()
    chat.command(f"/save {tmp_path / 'c.json'}", r"\[saved 1 turn ")
    assert json.loads((tmp_path / "c.json").read_text())["turns"][0]["user"] == f"/save {target}\nhello"
    assert not any(x.startswith("paste.json") for x in os.listdir(tmp_path))
    assert chat.finish("/bye") == 0
