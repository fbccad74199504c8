"""The conversation: system prompt + turns, the window the model sees, and atomic JSON save/load.

A transcript is never lost: when the context window fills, the oldest turns leave the *window*
(what is rendered into the prompt) but stay in the conversation, so `/save` still writes them all.
Pure logic, no engine and no terminal: unit-tested directly.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import tempfile
from dataclasses import dataclass, field
from typing import Callable

FORMAT = "bitchat-conversation"
FORMAT_VERSION = 1


class TranscriptError(Exception):
    """A conversation file cannot be read or written (message names the file and the problem)."""


# /load reads at most this much, and /save (a recovery copy too) never writes more: a conversation of a 128k context
# is ~1 MB, but a session keeps every turn, also those out of the window, and may have loaded a large file
LOAD_MAX_BYTES = 256 << 20
COMPACT_OVER = 16 << 20      # a conversation larger than this, indented, is written without indentation
_SURROGATE = re.compile("[\ud800-\udfff]")
# what a file that is not JSON text starts with: compressed or archived (a .json.gz was called latin-1, "iconv")
_PACKED = ((b"\x1f\x8b", "gzip-compressed", "gunzip"), (b"\xfd7zXZ\x00", "xz-compressed", "unxz"),
           (b"BZh", "bzip2-compressed", "bunzip2"), (b"\x28\xb5\x2f\xfd", "zstd-compressed", "unzstd"),
           (b"PK\x03\x04", "a zip archive", "unzip"))


def lone_surrogate(obj, at: str = "") -> str | None:
    """Where the first string of `obj` (JSON data: dicts, lists, strings; keys too) holding a lone UTF-16 surrogate
    is, in words ("turns[0].user holds a lone UTF-16 surrogate (\\ud800 at character 5)"), or None. Such a
    string is no text: it cannot be written as UTF-8 nor tokenized (JSON's unpaired "\\ud800": a tool that cut an
    emoji in two)."""
    stack = [(at, obj)]
    while stack:
        where, x = stack.pop()
        if isinstance(x, str):
            m = _SURROGATE.search(x)
            if m:
                return (f"{where or 'the text'} holds a lone UTF-16 surrogate (\\u{ord(m.group()):04x} at "
                        f"character {m.start() + 1}), which is not text")
        elif isinstance(x, dict):
            stack.extend(reversed([(f"{where}.{k}" if where else str(k), v) for k, v in x.items()]))
            stack.extend((f"{where} (a key)", k) for k in x)
        elif isinstance(x, list):
            stack.extend(reversed([(f"{where}[{i}]", v) for i, v in enumerate(x)]))
    return None


def file_identity(st: os.stat_result) -> tuple:
    """A file's identity and version: a rewrite by another process (a new inode, or a new time and size) differs."""
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def _identity_at(path: str) -> tuple | None:
    try:
        return file_identity(os.stat(path))
    except OSError:
        return None


ANY = object()   # Conversation.save's expect: whatever file is there (or none) when it looks


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
    """Whether the file is a saved conversation, a JSON object whose "format" is bitchat's, wherever the key is (jq
    or an editor may write "version" first: /load took it, /save and /save! would not replace it): /save replaces
    only those (it replaced any file, a read-only one included, with the conversation, mode 0600). The start of
    what save writes is known without reading the file whole."""
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
    except OSError:
        return False
    head = raw.decode("utf-8", "replace")
    if re.match(r'\ufeff?\s*\{\s*"format"\s*:\s*"' + re.escape(FORMAT) + '"', head):
        return True
    if not re.match(r"\ufeff?\s*\{", head) or ('"' + FORMAT + '"') not in head and len(raw) < 4096:
        return False   # (the whole file, read: no "format" of bitchat's anywhere)
    try:
        d = _read_json(path)
    except TranscriptError:
        return False
    return isinstance(d, dict) and d.get("format") == FORMAT


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
        d = _read_json(path)
        recovered = d.get("format") == FORMAT and d.get("meta", {}).get("recovered") is True
    except (TranscriptError, AttributeError):
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
        if isinstance(d, list) and d and all(isinstance(m, dict) and "role" in m for m in d):
            raise TranscriptError(f"{where}: a list of role/content messages (OpenAI or ollama style), not a bitchat "
                                  "conversation: /load reads only what bitchat's /save writes, a JSON object with "
                                  "\"turns\": [{\"user\": ..., \"assistant\": ...}, ...]")
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
            interrupted = t.get("interrupted", False)
            if not isinstance(interrupted, bool):   # "false" was taken as true
                raise TranscriptError(f"{where}: turn {i}: 'interrupted' must be true or false, got "
                                      f"{interrupted!r:.40}")
            reason = t.get("finish_reason") if isinstance(t.get("finish_reason"), str) else None
            if answer is None:   # saved before its answer began (a recovery copy of a killed bitchat): answered
                answer, interrupted, reason = "", True, "interrupted"   # empty, or two user turns would follow
            turns.append(Turn(user=t["user"], assistant=answer, interrupted=interrupted, finish_reason=reason))
        start = d.get("window_start", 0)
        if not isinstance(start, int) or not 0 <= start <= len(turns):
            start = 0
        meta = d.get("meta")
        # a string that is no text (a lone surrogate), anywhere, also in a turn out of the window (never tokenized) or
        # a setting: refused here, or no later /save nor recovery copy could write the conversation
        problem = lone_surrogate({"system": system, "turns": raw_turns, "meta": meta})
        if problem:
            raise TranscriptError(f"{where}: {problem}: not loaded (remove or fix that character)")
        return cls(system=system or None, turns=turns, window_start=start, meta=meta if isinstance(meta, dict) else {})

    def _encoded(self, path: str, meta: dict | None) -> bytes:
        """The file's bytes: indented JSON, or compact once that is over COMPACT_OVER; TranscriptError (one line) when
        it is not text (a lone surrogate: "internal error: UnicodeEncodeError") or more than /load reads back."""
        d = self.to_dict(meta)
        problem = lone_surrogate(d)
        if problem:
            raise TranscriptError(f"{path}: not written: {problem}")
        data = (json.dumps(d, ensure_ascii=False, indent=1) + "\n").encode("utf-8")
        if len(data) > COMPACT_OVER:
            data = (json.dumps(d, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        if len(data) > LOAD_MAX_BYTES:
            raise TranscriptError(f"{path}: not written: {len(data) / (1 << 20):.0f} MiB is too large for /load to "
                                  f"read back (at most {LOAD_MAX_BYTES >> 20} MiB): /reset, or save it in parts")
        return data

    def save(self, path: str, meta: dict | None = None, *, durable: bool = True, expect=ANY,
             owned: bool = False) -> str:
        """Write atomically: temp file in the same directory, fsync, rename, fsync the directory.
        A crash at any point leaves either the old file or the new one, never half of one.
        durable=False skips the fsyncs (the recovery copy: it must survive the process, not the machine).
        `expect`: the file_identity of the file the caller judged fit to replace, or None for no file: any other
        there is not replaced (TranscriptError). `owned`: that file is the caller's (it saved or loaded it), replaced
        whatever its content. Whatever `expect`, a name with no file is only created, never a file that another
        writer made there meanwhile replaced; an existing file only while it is the one looked at."""
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
        if os.path.islink(path):   # a link that loops (realpath gave it back): never replaced by a file
            raise TranscriptError(f"{path}: a symbolic link that leads to no file (it loops): not replaced")
        seen = _identity_at(path)
        if expect is not ANY and seen != expect:   # the caller judged another file (or none) there
            raise TranscriptError(f"{path}: {_MEANWHILE}")
        if seen is not None and seen[3] and not owned and not _is_conversation(path):   # someone's own file
            raise TranscriptError(f"{path}: exists and is not a bitchat conversation: not replaced (pick another "
                                  "name, or remove it first)")
        if seen is not None and not os.access(path, os.W_OK):   # the rename would replace it all the same
            raise TranscriptError(f"{path}: is read-only: not replaced")
        data = self._encoded(path, meta)
        try:
            fd, tmp = tempfile.mkstemp(prefix=".bitchat-", suffix=".tmp", dir=directory)
        except OSError as e:
            if e.errno == errno.ENOENT and os.path.isdir(directory):   # /proc, /sys: "No such file or directory" of
                raise TranscriptError(f"{path}: cannot create a file in {directory} (that folder takes no new "
                                      "files)") from None   # a folder that is there
            raise TranscriptError(f"{path}: cannot write here ({e.strerror})") from None
        try:
            with os.fdopen(fd, "wb") as f:
                if seen is not None:   # a replaced file keeps its mode (0644 became mkstemp's 0600); a new one is 0600
                    with contextlib.suppress(OSError):
                        os.fchmod(f.fileno(), stat.S_IMODE(os.stat(path).st_mode) & 0o777)
                f.write(data)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            _commit(tmp, path, seen)
        except OSError as e:   # a full disk
            raise TranscriptError(f"{path}: write failed ({e.strerror})") from None
        finally:   # also on Ctrl-C / SIGTERM mid-write, and after a link(2): never a temp file left behind
            with contextlib.suppress(OSError):
                os.unlink(tmp)
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
        return cls.from_dict(_read_json(path), where=path)


_MEANWHILE = ("another file was written there meanwhile (another bitchat's /save?): not replaced; look at it, then "
              "/save! replaces it, or pick another name")


def _commit(tmp: str, path: str, seen: tuple | None) -> None:
    """Put the written temp file `tmp` at `path`: a name that had no file (`seen` None) is created, never replacing
    a file made there since (link(2) fails on an existing name: two sessions saving to one new name both said
    "saved", one conversation lost); an existing file is replaced while it is still the one seen."""
    if seen is None:
        try:
            os.link(tmp, path)
            return
        except FileExistsError:
            raise TranscriptError(f"{path}: {_MEANWHILE}") from None
        except OSError as e:   # a file system without hard links (FAT, some network ones): O_EXCL reserves the name
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                raise
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise TranscriptError(f"{path}: {_MEANWHILE}") from None
        placeholder = None
        try:
            try:
                placeholder = os.fstat(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:   # a failed replace, or Ctrl-C: no empty file left under the user's name
            with contextlib.suppress(OSError):
                st = os.stat(path)
                if (st.st_dev, st.st_ino) == (placeholder.st_dev, placeholder.st_ino) if placeholder is not None \
                        else st.st_size == 0:
                    os.unlink(path)
            raise
        return
    if _identity_at(path) != seen:
        raise TranscriptError(f"{path}: {_MEANWHILE}")
    os.replace(tmp, path)


def _read_json(path: str):
    """The JSON value of the file at `path` (bounded, its BOM dropped), or TranscriptError in one line naming it."""
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
        packed = next((p for p in _PACKED if data.startswith(p[0])), None)
        if packed:   # (its bytes were called latin-1 text, with iconv's advice)
            raise TranscriptError(f"{path}: {packed[1]}, not a bitchat conversation (JSON text): {packed[2]} it "
                                  "first, then /load the file it gives")
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
        if e.msg == "Extra data" and _json_lines(text):   # read as a broken file: it is another format
            raise TranscriptError(f"{path}: JSON Lines (one JSON value a line), not a bitchat conversation, which "
                                  "is one JSON object as /save writes it") from None
        raise TranscriptError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    except ValueError as e:   # valid JSON Python will not read: a number of more than 4300 digits
        raise TranscriptError(f"{path}: not a bitchat conversation ({str(e).split(';')[0]})") from None
    except RecursionError:
        raise TranscriptError(f"{path}: not a bitchat conversation (JSON nested too deep)") from None
    return d


def _json_lines(text: str) -> bool:
    """Whether `text` is JSON Lines: more than one line, each one JSON value (the first few looked at)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 2:
        return False
    try:
        for line in lines[:3]:
            json.loads(line)
    except (ValueError, RecursionError):
        return False
    return True
