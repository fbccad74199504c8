"""Recovery copies whose bitchat no longer runs: a session killed (SIGKILL, the OOM killer), crashed, or on a machine
that lost power leaves its conversation in its copy and never gets to say so. bitchat names them at start (one
line, cli/chat.py) and `bitchat --recovered` lists them; nothing here ever removes one (the user's data).

Each copy's meta names the process that wrote it (`process`: PID, host name, boot id, PID namespace and the
process's start time in clock ticks since boot), so a PID since reused by another program, or by a later bitchat,
is not taken for its writer. A copy written by an older bitchat (no `process`) is judged by the PID in its name
and the time the process now holding that PID started: after the copy's last write, it is not its writer.
A copy whose writer cannot be told apart from a running one (another machine sharing the folder, another PID
namespace: a container) is never named.
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass

from .transcript import FORMAT, LOAD_MAX_BYTES, names_a_directory, state_dir

SCAN_MAX = 10_000     # directory entries looked at (a state dir is small; a huge $BITCHAT_RECOVERY folder is not)
READ_MAX = 200        # copies read, newest first (each up to LOAD_MAX_BYTES)
# bitchat's start-up notice reads a copy whole only up to PARSE_MAX bytes, and PARSE_BUDGET bytes in all: a larger
# one (/load takes up to LOAD_MAX_BYTES: a few GiB of Python objects to parse) is judged from its head and its
# meta at its end (save writes "format" first and "meta" last), its turns left uncounted. --recovered reads whole.
PARSE_MAX = 16 << 20
PARSE_BUDGET = 64 << 20
HEAD_BYTES = 4096
TAIL_BYTES = 256 << 10
CLOCK_SLACK_S = 2.0   # the boot time /proc gives is whole seconds and may drift: a start that close is not "after"


@dataclass
class Copy:
    path: str
    mtime: float      # when it was last written
    turns: int | None   # None: not counted (a large copy, at start)
    first: str        # the first question, as typed ("" where not read)
    running: bool     # its bitchat is still running (another terminal): never called left behind
    size: int = 0     # bytes


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of process `pid`, or None (no /proc, no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()   # the command name may hold spaces and ")"
        return fields[0].decode("ascii", "replace"), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _read_line(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(200).strip() or None
    except OSError:
        return None


def this_process() -> dict:
    """Who writes this session's recovery copy, for its meta (what a later bitchat checks: writer_running)."""
    info: dict = {"pid": os.getpid(), "host": socket.gethostname()}
    boot = _read_line("/proc/sys/kernel/random/boot_id")
    if boot:
        info["boot"] = boot
    try:
        info["pidns"] = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pass
    stat = _proc_stat(os.getpid())
    if stat:
        info["start"] = stat[1]
    return info


def _is_pid(pid) -> bool:
    return isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 1 << 31


def _alive(pid: int) -> bool:
    """Whether a process `pid` exists and has not ended (a zombie, killed but not yet reaped, has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process: it exists
        pass
    except (OSError, OverflowError, ValueError):
        return False
    stat = _proc_stat(pid)
    return stat is None or stat[0] not in ("Z", "X")


def _boot_epoch() -> int | None:
    """When this machine started (seconds since the epoch), or None where /proc does not say."""
    try:
        with open("/proc/stat", encoding="ascii", errors="replace") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("btime ")), None)
    except (OSError, ValueError, IndexError):
        return None


def _start_epoch(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), or None where /proc does not say."""
    stat, btime = _proc_stat(pid), _boot_epoch()
    if stat is None or btime is None:
        return None
    try:
        return btime + stat[1] / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def writer_running(meta: dict, path: str, mtime: float) -> bool:
    """Whether the bitchat that wrote the recovery copy at `path` (its `meta`, last written at `mtime`) may still
    run: True unless it is known to have ended."""
    owner = meta.get("process")
    if isinstance(owner, dict) and _is_pid(owner.get("pid")):
        me = this_process()
        if owner.get("host") != me["host"]:
            return True    # another machine sharing this folder: whether it runs cannot be told from here
        if owner.get("boot") and me.get("boot") and owner["boot"] != me["boot"]:
            # this machine started again since the copy's last write, or it is another machine of the same name
            # (cloned VMs, containers given one --hostname): only the former is known to have ended it
            booted = _boot_epoch()
            return booted is None or booted <= mtime - CLOCK_SLACK_S
        if owner.get("pidns") != me.get("pidns"):
            return True    # another PID namespace (a container): its PIDs are not ours to look up
        if not _alive(owner["pid"]):
            return False
        now = _proc_stat(owner["pid"])
        return now is None or owner.get("start") is None or now[1] == owner["start"]   # else: a PID reused
    # an older bitchat's copy: the PID in its name (recovery-PID.json, recovery-PID-N.json) wrote it
    m = re.fullmatch(r"recovery-(\d+)(?:-\d+){0,2}\.json", os.path.basename(path))
    if not m:
        return False       # no writer named at all ($BITCHAT_RECOVERY's file): an earlier session's
    pid = int(m.group(1))
    if not _is_pid(pid) or not _alive(pid):
        return False
    started = _start_epoch(pid)
    return started is None or started <= mtime + CLOCK_SLACK_S   # started after the copy's last write: not its writer


def _pattern(fixed: str | None) -> tuple[str, re.Pattern]:
    """(folder, file-name pattern) of the recovery copies of this place: the state dir's recovery-PID.json and the
    -N.json beside one, or $BITCHAT_RECOVERY's X.json with X-N.json, X-PID.json and X-PID-N.json beside it."""
    if not fixed:
        return state_dir(), re.compile(r"recovery-\d+(?:-\d+){0,2}\.json")
    if names_a_directory(fixed):   # "x.json/" is no file (refused at start): never the copies beside x.json
        return os.path.dirname(os.path.abspath(fixed)), re.compile(r"(?!)")
    fixed = os.path.abspath(os.path.expanduser(fixed))
    base, ext = os.path.splitext(os.path.basename(fixed))
    name = re.escape(base)
    if ext:   # X.json, X-N.json (cli/chat.py's _beside), X-PID.json and X-PID-N.json (session.py's _free_beside)
        name += r"(?:-\d+){0,2}" + re.escape(ext)
    else:     # X, X-N, X-PID.json, X-PID-N.json
        name += r"(?:(?:-\d+)?|-\d+(?:-\d+)?\.json)"
    return os.path.dirname(fixed), re.compile(name)


def _read_copy(path: str) -> tuple[dict, list] | None:
    """(meta, turns) of the recovery copy at `path`, or None when it is not one (any other file: never named)."""
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read(LOAD_MAX_BYTES + 1).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(d, dict) or d.get("format") != FORMAT or not isinstance(d.get("turns"), list):
        return None
    meta = d.get("meta")
    if not isinstance(meta, dict) or meta.get("recovered") is not True:
        return None
    return meta, d["turns"]


_HEAD = re.compile(r'\ufeff?\s*\{\s*"format"\s*:\s*"' + re.escape(FORMAT) + '"')
_META = re.compile(r'"meta"\s*:\s*(?=\{)')


def _skim_copy(path: str) -> dict | None:
    """The meta of the recovery copy at `path`, from its first and last bytes only (None: not one, or its meta is
    not where save writes it: the file's last value, whole within TAIL_BYTES)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES).decode("utf-8", "replace")
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - TAIL_BYTES))
            tail = f.read(TAIL_BYTES).decode("utf-8", "replace")
    except OSError:
        return None
    if not _HEAD.match(head):
        return None
    for m in list(_META.finditer(tail))[-16:]:   # the outermost that ends the file (a schema may hold a "meta" too)
        try:
            meta, end = json.JSONDecoder().raw_decode(tail, m.end())
        except (ValueError, RecursionError):
            continue
        if tail[end:].strip() == "}":
            return meta if isinstance(meta, dict) and meta.get("recovered") is True else None
    return None


def recovery_copies(fixed: str | None = None, *, whole: bool = False) -> list[Copy]:
    """The recovery copies of this place (see _pattern; `fixed`: $BITCHAT_RECOVERY), newest first, with whether each
    one's bitchat still runs. Reads at most READ_MAX of them; never raises for a folder it cannot read. whole False
    (bitchat's start): a copy over PARSE_MAX, or past PARSE_BUDGET, is skimmed (_skim_copy; its turns None);
    True (--recovered): each is read whole."""
    directory, pattern = _pattern(fixed)
    found = []
    try:
        with os.scandir(directory) as entries:
            for i, entry in enumerate(entries):
                if i >= SCAN_MAX:
                    break
                if not pattern.fullmatch(entry.name):
                    continue
                try:
                    st = entry.stat()
                except OSError:
                    continue
                if entry.is_file() and 0 < st.st_size <= LOAD_MAX_BYTES:
                    found.append((st.st_mtime, st.st_size, entry.path))
    except OSError:   # no such folder yet, or one not ours to read
        return []
    copies, budget = [], PARSE_BUDGET
    for mtime, size, path in sorted(found, reverse=True)[:READ_MAX]:
        if not whole and (size > PARSE_MAX or size > budget):
            meta = _skim_copy(path)
            if meta is not None:
                copies.append(Copy(path, mtime, None, "", writer_running(meta, path, mtime), size))
            continue
        budget -= size
        read = _read_copy(path)
        if read is None:
            continue
        meta, turns = read
        first = next((t["user"] for t in turns if isinstance(t, dict) and isinstance(t.get("user"), str)), "")
        copies.append(Copy(path, mtime, len(turns), first, writer_running(meta, path, mtime), size))
    return copies


def left_behind(fixed: str | None = None) -> list[Copy]:
    """The recovery copies whose bitchat no longer runs, newest first (each read whole: `bitchat --recovered`)."""
    return [c for c in recovery_copies(fixed, whole=True) if not c.running]


def when(mtime: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(mtime))
    except (OverflowError, OSError, ValueError):   # a file system's absurd time: never bitchat's start failing
        return "?"


def _turns(n: int) -> str:
    return f"{n} turn{'' if n == 1 else 's'}"


def notice(copies: list[Copy]) -> str | None:
    """The one line bitchat says at start about the copies left behind, or None when there are none."""
    if not copies:
        return None
    newest = copies[0]
    held = _turns(newest.turns) if newest.turns is not None else f"{newest.size / (1 << 20):.0f} MiB"
    about = f"{held}, last written {when(newest.mtime)}"
    if len(copies) == 1:
        return (f"bitchat: a session that did not end normally (killed or crashed) left its conversation ({about}): "
                f"/load {newest.path} to continue it, or delete the file")
    return (f"bitchat: {len(copies)} sessions that did not end normally (killed or crashed) left their conversations; "
            f"the newest ({about}): /load {newest.path}; `bitchat --recovered` lists them all (delete the files "
            "you no longer need)")


def listing(copies: list[Copy]) -> list[str]:
    """`bitchat --recovered`'s lines: path, when last written, turns, the first question (tab-separated)."""
    lines = []
    for c in copies:
        first = "".join(ch if ch.isprintable() else "?" for ch in " ".join(c.first.split()))   # no terminal codes
        first = first if len(first) <= 60 else first[:57] + "..."
        held = _turns(c.turns) if c.turns is not None else f"{c.size / (1 << 20):.0f} MiB"
        lines.append(f"{c.path}\t{when(c.mtime)}\t{held}\t{first}")
    return lines
