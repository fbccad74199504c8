"""The conversation: system prompt + turns, the window the model sees, and atomic JSON save/load.

A transcript is never lost: when the context window fills, the oldest turns leave the *window*
(what is rendered into the prompt) but stay in the conversation, so `/save` still writes them all.
Pure logic, no engine and no terminal: unit-tested directly.
"""
from __future__ import annotations

import errno
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Callable

FORMAT = "bitchat-conversation"
FORMAT_VERSION = 1


class TranscriptError(Exception):
    """A conversation file cannot be read or written (message names the file and the problem)."""


LOAD_MAX_BYTES = 16 << 20   # /load reads at most this much (a conversation of a 128k context is ~1 MB)


@dataclass
class Turn:
    user: str
    assistant: str | None = None     # None while the answer is being made (or was never made)
    interrupted: bool = False        # Ctrl-C stopped the answer; what was shown is kept
    finish_reason: str | None = None  # "eos" | "stop" | "length" | "context" | "interrupted"

    def to_dict(self) -> dict:
        d = {"user": self.user, "assistant": self.assistant}
        if self.interrupted:
            d["interrupted"] = True
        if self.finish_reason:
            d["finish_reason"] = self.finish_reason
        return d


def _is_conversation(path: str) -> bool:
    """Whether the file starts as a saved conversation does (save writes "format" first): /save replaces only
    those (it replaced any file, a read-only one included, with the conversation, mode 0600)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", "replace")
    except OSError:
        return False
    return re.match(r'\ufeff?\s*\{\s*"format"\s*:\s*"' + re.escape(FORMAT) + '"', head) is not None


def same_file_key(path: str) -> str:
    """The file a path names, links and ~ resolved: what /save compares with the files this session owns."""
    return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


def other_conversation(path: str) -> str | None:
    """What a conversation file at `path` holds ("another conversation (12 turns)"), or None when there is none
    there (no file, an empty one, or not a conversation: /save refuses those itself)."""
    if not os.path.isfile(path) or not os.path.getsize(path) or not _is_conversation(path):
        return None
    try:
        n = len(Conversation.load(path).turns)
    except TranscriptError:
        return "another conversation"
    return f"another conversation ({n} turn{'' if n == 1 else 's'})"


def state_dir() -> str:
    """bitchat's own folder of private state (the input history, recovery copies): $XDG_STATE_HOME/bitchat."""
    base = os.environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(base):   # the XDG spec: a relative one is ignored (not taken from the working directory)
        base = os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "bitchat")


def private_dir(directory: str) -> None:
    """Make `directory` if missing, 0700 (what it holds was typed, maybe a secret); bitchat's own state folder,
    made with the umask's bits by an earlier bitchat (a piped one made it 0755), is made private again."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except FileExistsError:   # a file where the folder goes: its "File exists" named no problem
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), directory) from None
    if os.path.abspath(directory) == os.path.abspath(state_dir()):
        try:
            if os.stat(directory).st_mode & 0o077:
                os.chmod(directory, 0o700)
        except OSError:   # not ours to change
            pass


def names_a_directory(path: str) -> bool:
    """Whether `path` ends in "/" (or "/.", ".."), naming a directory as a shell takes it: never a file to write.
    (os.path.abspath drops the slash: "mine.json/" became mine.json, written over and then removed.)"""
    seps = os.sep + (os.altsep or "")
    return path.endswith(tuple(seps)) or os.path.basename(path) in (".", "..")


def refuse_directory_name(path: str) -> None:
    """TranscriptError when `path` names a directory (names_a_directory): a shell's rule, "x.json/" is never the
    file x.json."""
    path = os.path.expanduser(path)
    if names_a_directory(path):
        raise TranscriptError(f"{path}: is a directory" if os.path.isdir(path) else
                              f"{path}: names a directory (it ends in '/'), not a file: give a file name")


def recovery_problem(path: str) -> str | None:
    """Why `path` cannot be this session's recovery copy, or None: a file there must be empty or an earlier
    recovery copy (meta.recovered), as the copy is rewritten at every turn and removed at a normal exit."""
    if names_a_directory(path):
        return "ends in '/': it names a directory, not a file"
    if not os.path.lexists(path):
        return None
    if not os.path.isfile(path):
        return "is not a regular file"
    if os.path.getsize(path) == 0:
        return None
    recovered = False
    try:
        if _is_conversation(path) and os.path.getsize(path) <= LOAD_MAX_BYTES:
            from ..engine.fileio import decode_text
            with open(path, "rb") as f:
                recovered = json.loads(decode_text(f.read())).get("meta", {}).get("recovered") is True
    except (OSError, ValueError, AttributeError, RecursionError):
        pass
    return None if recovered else "holds a file that is not a bitchat recovery copy (it would be replaced, " \
        "then removed at exit)"


@dataclass
class Conversation:
    system: str | None = None
    turns: list[Turn] = field(default_factory=list)
    window_start: int = 0            # index of the oldest turn still rendered into the prompt
    meta: dict = field(default_factory=dict, compare=False)   # the file's "meta" (the settings /load restores)

    # ---- editing -------------------------------------------------------------------------------
    def add_user(self, text: str) -> Turn:
        turn = Turn(user=text)
        self.turns.append(turn)
        return turn

    def reset(self) -> None:
        """Forget every turn (the system prompt stays)."""
        self.turns.clear()
        self.window_start = 0

    def last_turn(self) -> Turn | None:
        return self.turns[-1] if self.turns else None

    def drop_last_turn(self) -> None:
        if self.turns:
            self.turns.pop()
        self.window_start = min(self.window_start, len(self.turns))

    # ---- what the model sees -------------------------------------------------------------------
    def window_turns(self) -> list[Turn]:
        return self.turns[self.window_start:]

    def messages(self, start: int | None = None) -> list[dict]:
        """Chat messages (role/content) of the window, ready for llm.chat_prompt."""
        start = self.window_start if start is None else start
        msgs = []
        if self.system:
            msgs.append({"role": "system", "content": self.system})
        for t in self.turns[start:]:
            msgs.append({"role": "user", "content": t.user})
            if t.assistant is not None:
                msgs.append({"role": "assistant", "content": t.assistant})
        return msgs

    def fit_window(self, count_tokens: Callable[[list[dict]], int], budget: int, target: int | None = None,
                   least_start: int | None = None) -> int:
        """Move the window start forward (dropping oldest turns, never the system prompt nor the
        newest turn) until `count_tokens(messages) <= budget`. Once trimming is needed it trims
        down to `target` (<= budget) so the next few turns do not each trigger a new trim (every
        trim changes the prompt prefix and costs a full re-prefill). Returns how many turns left
        the window; raises nothing: the caller checks whether the newest turn alone fits.
        `least_start`: the caller knows no window starting before it fits (a turn's own text alone is too long):
        those are never counted (a 12 MB turn was rendered and tokenized whole, twice, to learn it).
        """
        first, last = self.window_start, len(self.turns) - 1
        known_over = least_start is not None and least_start > first
        if not known_over and count_tokens(self.messages()) <= budget:
            return 0
        goal = budget if target is None else min(target, budget)
        if first >= last:
            return 0
        # the first start whose window fits, by bisection: the count only falls as the start moves on, and each
        # count renders and tokenizes the whole window (one turn at a time, /load of a 1,000-turn conversation
        # took 245 s on 2 cores; 3.6 s this way); none fits: the newest turn alone
        lo, hi = min(max(first + 1, least_start or 0), last), last
        while lo < hi:
            self.window_start = (lo + hi) // 2
            if count_tokens(self.messages()) <= goal:
                hi = self.window_start
            else:
                lo = self.window_start + 1
        self.window_start = lo
        return lo - first

    # ---- JSON ----------------------------------------------------------------------------------
    def to_dict(self, meta: dict | None = None) -> dict:
        d = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "system": self.system,
            "turns": [t.to_dict() for t in self.turns],
            "window_start": self.window_start,
        }
        if meta:
            d["meta"] = meta
        return d

    @classmethod
    def from_dict(cls, d, where: str = "conversation") -> "Conversation":
        if not isinstance(d, dict):
            raise TranscriptError(f"{where}: expected a JSON object, got {type(d).__name__}")
        if d.get("format", FORMAT) != FORMAT:
            raise TranscriptError(f"{where}: not a bitchat conversation (format={d.get('format')!r})")
        version = d.get("version", FORMAT_VERSION)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:   # "1", 1.0: not newer
            raise TranscriptError(f"{where}: 'version' must be an integer, got {version!r}")
        if version > FORMAT_VERSION:
            raise TranscriptError(f"{where}: conversation format version {version!r} is newer than this bitchat")
        system = d.get("system")
        if system is not None and not isinstance(system, str):
            raise TranscriptError(f"{where}: 'system' must be a string or null")
        if "turns" not in d:   # any other JSON object (a schema meant for /set format) would load as an empty chat
            raise TranscriptError(f"{where}: not a bitchat conversation (it has no 'turns')")
        raw_turns = d["turns"]
        if not isinstance(raw_turns, list):
            raise TranscriptError(f"{where}: 'turns' must be a list")
        turns = []
        for i, t in enumerate(raw_turns):
            if not isinstance(t, dict) or not isinstance(t.get("user"), str):
                raise TranscriptError(f"{where}: turn {i} needs a string 'user'")
            answer = t.get("assistant")
            if answer is not None and not isinstance(answer, str):
                raise TranscriptError(f"{where}: turn {i}: 'assistant' must be a string or null")
            interrupted = bool(t.get("interrupted", False))
            reason = t.get("finish_reason") if isinstance(t.get("finish_reason"), str) else None
            if answer is None:   # saved before its answer began (a recovery copy of a killed bitchat): answered
                answer, interrupted, reason = "", True, "interrupted"   # empty, or two user turns would follow
            turns.append(Turn(user=t["user"], assistant=answer, interrupted=interrupted, finish_reason=reason))
        start = d.get("window_start", 0)
        if not isinstance(start, int) or not 0 <= start <= len(turns):
            start = 0
        meta = d.get("meta")
        return cls(system=system or None, turns=turns, window_start=start, meta=meta if isinstance(meta, dict) else {})

    def save(self, path: str, meta: dict | None = None, *, durable: bool = True) -> str:
        """Write atomically: temp file in the same directory, fsync, rename, fsync the directory.
        A crash at any point leaves either the old file or the new one, never half of one.
        durable=False skips the fsyncs (the recovery copy: it must survive the process, not the machine)."""
        given = os.path.expanduser(path)
        refuse_directory_name(given)
        path = os.path.abspath(given)
        if os.path.islink(path):   # written through: the link stays, its file gets the conversation
            path = os.path.realpath(path)
        directory = os.path.dirname(path)
        if os.path.isdir(path):
            raise TranscriptError(f"{path}: is a directory")
        if os.path.exists(path) and not os.path.isfile(path):   # a device, a FIFO: never replaced by a file
            raise TranscriptError(f"{path}: not a regular file")
        if not os.path.isdir(directory):
            above = directory
            while not os.path.lexists(above) and os.path.dirname(above) != above:
                above = os.path.dirname(above)
            if os.path.lexists(above) and not os.path.isdir(above):   # a file where a folder of the path goes
                raise TranscriptError(f"{path}: {above} is not a directory")
            raise TranscriptError(f"{path}: directory {directory} does not exist")
        if os.path.isfile(path) and os.path.getsize(path) and not _is_conversation(path):   # someone's own file
            raise TranscriptError(f"{path}: exists and is not a bitchat conversation: not replaced (pick another "
                                  "name, or remove it first)")
        if os.path.isfile(path) and not os.access(path, os.W_OK):   # the rename would replace it all the same
            raise TranscriptError(f"{path}: is read-only: not replaced")
        data = json.dumps(self.to_dict(meta), ensure_ascii=False, indent=1) + "\n"
        try:
            fd, tmp = tempfile.mkstemp(prefix=".bitchat-", suffix=".tmp", dir=directory)
        except OSError as e:
            if e.errno == errno.ENOENT and os.path.isdir(directory):   # /proc, /sys: "No such file or directory" of
                raise TranscriptError(f"{path}: cannot create a file in {directory} (that folder takes no new "
                                      "files)") from None   # a folder that is there
            raise TranscriptError(f"{path}: cannot write here ({e.strerror})") from None
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(data)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as e:   # a full disk, or Ctrl-C / SIGTERM mid-write: never a temp file left behind
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if isinstance(e, OSError):
                raise TranscriptError(f"{path}: write failed ({e.strerror})") from None
            raise
        if not durable:
            return path
        try:  # make the rename itself durable
            dfd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass
        return path

    @classmethod
    def load(cls, path: str) -> "Conversation":
        path = os.path.expanduser(path)
        try:
            # /dev/zero or a FIFO would be read for ever (or opening it would wait for a writer)
            if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
                raise TranscriptError(f"{path}: not a regular file")
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > LOAD_MAX_BYTES:
                    raise TranscriptError(f"{path}: {size / (1 << 20):.0f} MiB is too large for a bitchat "
                                          f"conversation (at most {LOAD_MAX_BYTES >> 20} MiB)")
                data = f.read()
            from ..engine.fileio import decode_text
            try:   # a BOM an editor added is dropped; UTF-16 is said as such, with its iconv
                text = decode_text(data)
            except ValueError as e:
                raise TranscriptError(f"{path}: {e}") from None
            d = json.loads(text)
        except FileNotFoundError:
            raise TranscriptError(f"{path}: no such file") from None
        except IsADirectoryError:
            raise TranscriptError(f"{path}: is a directory") from None
        except OSError as e:
            raise TranscriptError(f"{path}: cannot read ({e.strerror or e})") from None
        except json.JSONDecodeError as e:
            raise TranscriptError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
        except ValueError as e:   # valid JSON Python will not read: a number of more than 4300 digits
            raise TranscriptError(f"{path}: not a bitchat conversation ({str(e).split(';')[0]})") from None
        except RecursionError:
            raise TranscriptError(f"{path}: not a bitchat conversation (JSON nested too deep)") from None
        return cls.from_dict(d, where=path)
