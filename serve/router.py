"""Many models behind one port (`bitnet serve --models-dir DIR` / `--models-cache`), as ollama serves every pulled
model and llama-server's router mode serves a directory: a request's `model` field picks the model; the first
request naming one loads it, and at most `models_max` are loaded at once (the least recently used idle one is
unloaded to make room).

Each loaded model is its own `bitnet serve` process on a loopback port (a listening socket bound here and inherited
by the process; the command the CLI gives, with a key of
this router's that nothing else knows, in a file only this user can read), and this app forwards every request to
it byte for byte, streams included: every API of serve/app.py (OpenAI's, Anthropic's, ollama's, llama-server's, the embeddings) answers
exactly as a single-model server would, a model that crashes takes down nothing else, and unloading one gives
its memory back to the system. A client that hangs up closes the forwarded stream, which cancels its sequence in
the model's process.

The router itself answers the listings (`/v1/models`, `/models`, ollama's `/api/tags` and `/api/ps`), ollama's
`/api/show` (from the model's file, as ollama reads it: no model is loaded for it), llama-server's
`/models/load` and `/models/unload`, ollama's keep_alive (a request's keep_alive sets how long its model stays
loaded once idle; 0 unloads it after the request, and an empty `/api/generate` or `/api/chat` with keep_alive 0
unloads it at once, as ollama does), `/health`, its own `/metrics` (`?model=NAME` forwards to the model's), and
the chat page. GET requests (`/slots?model=NAME`, `/props?model=NAME`) go to a loaded model and never load one.
Nothing here knows of engines: the catalog and the command line come from the CLI."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from ..engine import faults
from ..engine.errors import EXIT_BAD_INPUT, BitNetError
from .auth import AuthMiddleware, KeyChecker, allow_cross_origin
from .limits import (Limits, LimitsMiddleware, RouteNorms, allow_header, allowed_methods, anthropic_shaped,
                     anthropic_status, error_json, refuses_method)
from .offload import NOT_JSON, BodyRefused, ClientGone, Streamed, loads, not_json, unless_gone
from .ollama import (BLOBS_WHY, FOREVER, LOAD_WAIT_HEADER, OLLAMA_VERSION,  # noqa: F401 - parse_keep_alive: the CLI's
                     parse_keep_alive)
from .schemas import bare_name as _bare, model_object, name_key, shown_path, tagged_name, utc_iso

# a model whose load failed gets the same answer at once for FAILED_RETRY s, then is loaded again by the next
# request (its cause may lie outside its file: a cache directory, memory); each failure again doubles the wait, up
# to FAILED_RETRY_MAX s. A changed file, or POST /models/load, tries again at once.
FAILED_RETRY, FAILED_RETRY_MAX = 30.0, 300.0
SHOWS_MAX = 256   # describe answers kept at least (more with a larger catalog: Router.shows_limit)
PULLS_MAX = 2   # ollama's /api/pull processes at once (each downloads and converts: a process, ~70 MB, a core)
# hop-by-hop headers, and what this router sets itself on the forwarded request / the response
REQUEST_DROP = {b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"authorization",
                b"x-api-key", b"upgrade", b"te", b"proxy-authorization",
                b"origin",   # the router judged the origin; the model's process answers the router, not a page
                LOAD_WAIT_HEADER.encode()}   # the router's own word to the model's process, never a client's
RESPONSE_DROP = {"connection", "keep-alive", "transfer-encoding", "date", "server"}
RESPONSES_PATHS = ("/v1/responses", "/responses", "/v1/responses/input_tokens")   # OpenAI's Responses API requests


@dataclass(frozen=True)
class LoadFailure:
    """A model's last load, which failed: of the file whose digest this is, with this answer (`message`) and its
    process's exit code, answered again until `retry_at` (monotonic); `wait`: the seconds that was after it."""
    digest: str
    message: str
    exit_code: int
    retry_at: float
    wait: float


@dataclass(frozen=True)
class ModelSpec:
    """One model the router can load: the name requests use, the file (or directory) its process loads. `source`:
    the hub id a converted model of the cache came from (REPO[:FILE]@COMMIT, `bitnet list`'s SOURCE); `names`: the
    hub ids that name it too, in lower case (REPO:FILE, REPO:TAG, REPO); `cached`: a conversion in the store
    cache, which ollama's /api/delete may remove (a file of a --models-dir is the user's, and stays)."""
    name: str
    path: str
    size: int = 0
    modified: float = 0.0
    format: str = "bnstore"
    source: str = ""
    cached: bool = False
    names: tuple[str, ...] = ()
    stamp: tuple = ()   # (file name, size, mtime_ns) of every file of a model of several: any one replaced is seen

    def digest(self) -> str:
        # ollama's `digest`: of the path, size and time, not the content (gigabytes, read at each listing): it
        # changes with the file, but two copies differ (docs/serving.md). The path's own bytes: a name that is not
        # UTF-8 has surrogates, which str.encode() refuses
        return hashlib.sha256(os.fsencode(os.path.abspath(self.path))
                              + f":{self.size}:{self.modified}:{self.stamp!r}".encode()
                              ).hexdigest()


HUB_PREFIXES = ("hf.co/", "huggingface.co/", "https://huggingface.co/", "https://hf.co/")


def hub_name(name: str) -> str:
    """ollama's name of a Hugging Face model (hf.co/OWNER/REPO[:TAG], TAG "latest" meaning none) as the hub id
    `bitnet pull` takes (OWNER/REPO[:FILE|:TAG]); any other name as it is."""
    for prefix in HUB_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    return _bare(name)


def told_apart(names) -> list[str]:
    """Names, sorted, as a message shows them: escaped (\\u0301) where two look the same (one NFC, one NFD)."""
    import unicodedata
    names = sorted(names)
    if len({unicodedata.normalize("NFC", n) for n in names}) < len(names):
        return [ascii(n)[1:-1] for n in names]
    return names


class RouterError(Exception):
    def __init__(self, status: int, message: str, code: str | None, param: str | None = None,
                 retry_after: int | None = None, allow: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.retry_after = status, message, code, param, retry_after
        self.allow = allow   # a 405's Allow header


def out_of_files(e: BaseException | None) -> OSError | None:
    """The EMFILE / ENFILE behind an error (httpx's ConnectError: its causes, anyio's groups of attempts), if any."""
    seen, todo = set(), [e]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
            return e
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return None


def upstream_error(request: Request, spec, e: BaseException, retry_after: int) -> RouterError:
    """What a request is told when its model's process could not be reached: out of descriptors, the router's own
    state (503 out_of_resources + Retry-After and one log line, as the plain server says it; a 502 blamed a model
    that was fine); else the model did not answer (502)."""
    short = out_of_files(e)
    if short is not None:
        why = os.strerror(short.errno).lower()
        print(f"bitnet serve: {request.method} {request.url.path}: {why} connecting to model '{spec.name}' "
              f"({type(short).__name__}: {short}); raise ulimit -n or lower --max-connections", file=sys.stderr,
              flush=True)
        return RouterError(503, f"the server is out of resources ({why}); retry later", "out_of_resources",
                           retry_after=retry_after)
    return RouterError(502, f"model '{spec.name}' did not answer: {type(e).__name__}", "model_unavailable",
                       retry_after=retry_after)


def _listening_socket() -> socket.socket:
    """A loopback socket on a free port, listening: handed to a model's process (BITNET_LISTEN_FD), which serves
    on it. Held from before that process starts, so no other process can take the port while it starts up (as
    one could when the port was only picked here and bound by the process a second later), and the router's
    health polls can only ever reach that process."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", 0))
        s.listen(2048)
    except OSError:
        s.close()
        raise
    return s


class Reserve:
    """The descriptors starting a model's process takes (its listening socket, its log file, /dev/null for its
    stdin, and two spare ones for Popen's pipe to its child), held from before room is made for it."""

    def __init__(self, log_path: str):
        self.log_path = log_path
        self.sock: socket.socket | None = None
        self.log = None
        self.devnull: int | None = None
        self.spare: tuple[int, ...] = ()

    def take(self):
        self.sock = _listening_socket()
        self.log = open(self.log_path, "wb")
        self.devnull = os.open(os.devnull, os.O_RDONLY)
        self.spare = os.pipe()

    def spare_free(self):
        for fd in self.spare:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.spare = ()

    def close(self):
        self.spare_free()
        if self.devnull is not None:
            with contextlib.suppress(OSError):
                os.close(self.devnull)
            self.devnull = None
        for f in (self.log, self.sock):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self.log = self.sock = None

    def discard(self):
        """Unused (or its start failed): closed, and its log file, empty, removed."""
        self.close()
        with contextlib.suppress(OSError):
            os.remove(self.log_path)


class Child:
    """A model's process and what the router knows of it."""

    def __init__(self, spec: ModelSpec, proc: subprocess.Popen, port: int, log_path: str):
        self.spec, self.proc, self.port, self.log_path = spec, proc, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.active = 0                  # requests in flight through it
        self.last_used = time.monotonic()
        self.keep_alive = FOREVER        # seconds it stays loaded once idle (the last request's keep_alive)
        self.expires = FOREVER           # monotonic time it is unloaded at, if still idle
        self.unload_asked = False        # /models/unload came while it served: its unload is the request's
        self.started = time.monotonic()
        self.ready_at = math.inf         # monotonic time it became ready (loaded)
        self.info: dict = {}             # its /api/ps entry once loaded: context_length, details
        self.stopping = False
        self.yielding = False            # chosen to make room for a waiting request: takes no new ones meanwhile
        self.ended: asyncio.Task | None = None   # once stopping: the wait for its process's exit

    @property
    def status(self) -> str:
        return "loaded" if self.ready.done() and not self.ready.exception() else "loading"

    def memory(self) -> int | None:
        """Bytes of memory its process holds (resident set; Linux), which ollama's /api/ps reports as `size`."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return None

    def log_size(self) -> int:
        """How much its log holds now (0: none yet): where a request's own part of it starts (log_tail's since)."""
        try:
            return os.path.getsize(self.log_path)
        except OSError:
            return 0

    def log_tail(self, since: int = 0) -> str:
        """The last line the process wrote (after byte `since` of its log) that says what went wrong (its one-line
        error, less its "bitnet serve: error:" prefix, which nested in the router's own line), "" when none does: a
        warning is no reason (a process killed while loading was said to have failed of the context warning it
        printed first). Only the log's last 8 KiB are read: a long-lived model's log can be large."""
        try:
            with open(self.log_path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                start = max(since, size - 8192)
                f.seek(start)
                raw = f.read(max(0, size - start))
        except OSError:
            return ""
        if start > since:   # the window starts mid-line: that line's end is no line of its own
            raw = raw.partition(b"\n")[2]
        text = raw.decode("utf-8", errors="replace")
        lines = [ln.strip() for ln in re.split(r"[\r\n]+", text) if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower()]
        return re.sub(r"^bitnet(?: serve)?: error: ", "", (errors or [""])[-1])


def exit_said(code: int | None) -> str:
    """How a model's process ended, for the router's lines: a negative code is the signal that killed it (the
    kernel's out-of-memory killer sends SIGKILL), not an exit code."""
    if code is None or code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "an unknown signal"
    return f"was killed by signal {-code} ({name}" + (": out of memory?)" if -code == signal.SIGKILL else ")")


LOGDIR_PREFIX = "bitnet-router-"


def _process_start(pid: int) -> str | None:
    """When process `pid` started (field 22 of /proc/PID/stat, in clock ticks since boot), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[19].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return None


def _pid_namespace() -> str | None:
    """This process's PID namespace (its inode), None where unknown."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return None


def _boot_time() -> float | None:
    """When the machine booted (seconds since the epoch), None where unknown."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def router_stamp() -> str:
    """What a router writes to its directory's pid file: its pid, its start time and its PID namespace ("-" where
    unknown), so that a later router removes that directory only once this process is surely gone."""
    pid = os.getpid()
    return f"{pid} {_process_start(pid) or '-'} {_pid_namespace() or '-'}\n"


def _router_gone(stamp: str, written: float) -> bool:
    """Whether the router that wrote `stamp` (router_stamp's) to a file last modified at `written` has surely ended:
    the file predates the machine's boot, or the router ran in this PID namespace and its pid is gone or now a
    process that started at another time. A router in another PID namespace (a container sharing /tmp), or one
    whose stamp says less (an older version's, only a pid), is never taken for dead while the machine is up."""
    boot = _boot_time()
    if boot is not None and written < boot - 1:
        return True
    parts = stamp.split()
    if len(parts) != 3 or not parts[0].isdigit():
        return False
    pid, start, ns = int(parts[0]), parts[1], parts[2]
    if pid <= 0 or pid == os.getpid() or ns == "-" or ns != _pid_namespace():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:   # alive (another user's pid now: EPERM)
        pass
    now = _process_start(pid)
    return start != "-" and now is not None and now != start   # the pid taken since by another process


def remove_dead_routers_dirs():
    """The temporary directories (key file, logs) of this user's routers that ended without removing them (a fatal
    fault, SIGKILL): each names its router (router_stamp); one whose router is surely gone (_router_gone) is
    removed. Directories of routers still running, of other users, of unknown owners, or of routers in another PID
    namespace are left."""
    base = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(base) if n.startswith(LOGDIR_PREFIX)]
    except OSError:
        return
    for n in names[:1000]:
        d = os.path.join(base, n)
        try:
            if os.lstat(d).st_uid != os.getuid():
                continue
            with open(os.path.join(d, "pid")) as f:
                written = os.fstat(f.fileno()).st_mtime
                stamp = f.read(200)
        except (OSError, ValueError):
            continue
        if _router_gone(stamp, written):
            shutil.rmtree(d, ignore_errors=True)


class Router:
    def __init__(self, scan: Callable[[], dict[str, ModelSpec]], command: Callable[[ModelSpec, int, str], list[str]], *,
                 models_max: int = 3, keep_alive: float = FOREVER, load_timeout: float = 600.0,
                 stop_timeout: float = 10.0, retry_after: int = 1, log: Callable[[str], None] | None = None,
                 pull: Callable[[str], list[str]] | None = None, failed_retry: float = FAILED_RETRY,
                 source_of: Callable[[str], str | None] | None = None,
                 describe: Callable[[ModelSpec], dict] | None = None, shows_max: int = SHOWS_MAX):
        """pull: the command that downloads and converts a hub id into the store cache (`bitnet pull REF`), for
        ollama's /api/pull; None where the catalog holds no cache (--models-dir alone): /api/pull answers 501.
        source_of: the source (REPO[:FILE]@COMMIT, as a store records it) that a hub id with a revision (a branch,
        a tag, a commit) names in the download cache, None where it is not there: such a name is served as the
        conversion of that source (the source keeps the commit alone, so REPO@main matched nothing).
        failed_retry: seconds a failed load is answered again before a request loads the model anew (doubling).
        describe: ollama's /api/show answer of a model, read from its file without loading it (run in a thread;
        BitNetError / OSError: the file cannot be read); its `details` fill /api/tags too. None: /api/show loads
        the model and asks its process. shows_max: the describe answers (and unreadable files) kept at least; more
        while the catalog holds more models (shows_limit), and those of files gone from it are dropped at a scan."""
        self.scan, self.command, self.models_max, self.pull = scan, command, models_max, pull
        self.describe, self.shows_max = describe, shows_max
        self.source_of = source_of
        self.models = scan()        # name -> ModelSpec, scanned again (refresh) as files come and go
        self._scanned = time.monotonic()
        self.keep_alive, self.load_timeout, self.stop_timeout = keep_alive, load_timeout, stop_timeout
        self.retry_after, self.failed_retry = retry_after, failed_retry
        self.log = log or (lambda line: print(f"bitnet serve: {line}", file=sys.stderr, flush=True))
        self.key = secrets.token_urlsafe(32)   # the model processes answer only the router
        self.children: dict[str, Child] = {}
        self.ending: set[Child] = set()             # stopped, their processes not yet exited
        self.room_queue: list = []                  # requests waiting for a model's room (--models-max), in order
        self.details: dict[str, dict] = {}     # a model's /api/ps entry, kept after it is unloaded
        # a model whose process said why it cannot be loaded: its answer, given again for a while (FAILED_RETRY) while
        # the file is unchanged, so that each retry (a client's, a model picker's) does not unload a working model
        # for room and load the broken one again; the listings say the last load failed
        self.failed: dict[str, LoadFailure] = {}
        self.shows: dict[str, dict] = {}       # /api/show answers by model file (ModelSpec.digest), bounded
        self.unreadable: dict[str, str] = {}   # digest -> why describe failed: a listing does not read it again
        self.pulling: set[str] = set()         # hub ids being pulled now (one process each, PULLS_MAX at most)
        self.counts: dict[tuple, int] = {}
        self.spawned = 0                       # model processes started: numbers each one's log file
        self.draining = False
        self.cond: asyncio.Condition | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client: httpx.AsyncClient | None = None
        remove_dead_routers_dirs()
        self.logdir = tempfile.mkdtemp(prefix=LOGDIR_PREFIX)   # 0700: the key file and each process's log
        with open(os.path.join(self.logdir, "pid"), "w") as f:   # whose it is: remove_dead_routers_dirs
            f.write(router_stamp())
        self.key_file = os.path.join(self.logdir, "key")
        fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.key + "\n")
        # an exit through the fault guard (a file mapped in this process cut short) runs no Python: the key goes
        # with it, and the next router removes the rest (remove_dead_routers_dirs)
        faults.unlink_on_fault(self.key_file)
        self._reaper: asyncio.Task | None = None
        self._tasks: set = set()               # releases and process waits in flight (the loop holds tasks weakly)

    # ---- the catalog --------------------------------------------------------------------------------------
    async def refresh(self, fresh: bool = False):
        """Scan the directories again (for a listing at most once a second; for a name not in the catalog, now):
        a model `bitnet pull` or `bitnet convert` added meanwhile is served, one removed is no longer offered (a
        loaded one runs on until it is unloaded). A scan that fails (two files of one name) keeps the last
        catalog, and says why."""
        if not fresh and time.monotonic() - self._scanned < 1.0:
            return
        self._scanned = time.monotonic()
        try:
            self.models = await asyncio.to_thread(self.scan)
        except Exception as e:   # noqa: BLE001  (the catalog stays as it was)
            self.log(f"the model directories were not scanned again: {e}")
            return
        # what was read of files no longer in the catalog (removed, replaced: a new digest) is read no more
        here = {s.digest() for s in self.models.values()}
        for kept in (self.shows, self.unreadable):
            for key in [k for k in kept if k not in here]:
                del kept[key]

    def shows_limit(self) -> int:
        """How many describe answers (and unreadable files) are kept: every model of the catalog's, and room for the
        files replaced since the last scan (a catalog larger than a fixed bound had a listing evict, and read again,
        the answers the one before it read, and showed a different set of models without details each time)."""
        return max(self.shows_max, 2 * len(self.models))

    def find(self, name: str) -> ModelSpec | None:
        """The model a request's name means: its name, with or without ollama's ":latest" tag, in any case and any
        Unicode normalisation (ollama matches names case-insensitively; a file named on macOS is NFD, a name typed
        elsewhere NFC; an exact name first, then the one that differs only so), or a hub id the cache converted.
        ":latest" is no part of a name on either side: a file `solo:latest.bnstore` is `solo` too, as in ollama."""
        spec = self.models.get(name) or self.models.get(_bare(name))
        if spec is None:
            folded = self.alike(name)
            spec = folded[0] if len(folded) == 1 else None
        return spec if spec is not None else self.by_source(name)

    def alike(self, name: str) -> list[ModelSpec]:
        """The catalog's models named `name` but for case, Unicode normalisation and ollama's ":latest" (several:
        the name is ambiguous)."""
        key = name_key(name)
        return [s for n, s in self.models.items() if name_key(n) == key]

    async def resolve(self, name) -> ModelSpec:
        if isinstance(name, str) and name:
            for attempt in range(2):
                spec = self.find(name)
                if spec is not None:
                    return spec
                if attempt == 0:   # perhaps new since the last scan
                    await self.refresh(fresh=True)
            alike = self.alike(name)
            if len(alike) > 1:   # never whichever of them is loaded now: one name, one answer
                raise RouterError(404, f"model '{name}' not found: it could be any of "
                                  f"{', '.join(told_apart(s.name for s in alike))} (they differ only in case, Unicode "
                                  "normalisation or \":latest\"): name one exactly",
                                  "model_not_found", "model")
            loaded = [c.spec for n, c in self.children.items() if name_key(n) == name_key(name)]
            loaded = [s for s in loaded if s.name == name] or loaded
            if len(loaded) == 1:   # its file is gone but it is still loaded: it can be used and unloaded until the
                return loaded[0]   # reaper's next round
            # ollama's words: its CLI (ollama stop / rm, /load in ollama run) looks for "not found"
            here = f"models here: {', '.join(sorted(self.models))}" if self.models else "no models here yet"
            raise RouterError(404, f"model '{name}' not found ({here})", "model_not_found", "model")
        if name is not None and not isinstance(name, str):
            raise RouterError(400, "model: must be a string", "invalid_value", "model")
        if len(self.models) == 1:
            return next(iter(self.models.values()))
        if not self.models:
            raise RouterError(404, "no models here yet: pull one (ollama's /api/pull, or `bitnet pull` on the server's "
                              "machine)", "model_not_found", "model")
        raise RouterError(400, f"model: required: this server has several (models: {', '.join(sorted(self.models))})",
                          "missing_model", "model")

    def conversions(self, name: str) -> list[ModelSpec]:
        """Every conversion in the cache of a hub id (OWNER/REPO[:FILE|:TAG][@REV], or ollama's
        hf.co/OWNER/REPO[:TAG]), as `bitnet rm` finds them: other heads, other commits; with @REV, those of the
        commit the revision names in the download cache."""
        ref = hub_name(name)
        if "/" not in ref:
            return []
        if "@" not in ref:
            return [spec for spec in self.models.values() if ref.lower() in spec.names]
        try:
            source = self.source_of(ref) if self.source_of is not None else None
        except Exception:   # noqa: BLE001  (a name the cache cannot resolve names no model)
            source = None
        return [spec for spec in self.models.values() if source and spec.source.lower() == source.lower()]

    def by_source(self, name: str) -> ModelSpec | None:
        """The cache's conversion of a hub id (OWNER/REPO[:FILE|:TAG][@REV], or ollama's hf.co/OWNER/REPO[:TAG]):
        the name a client that pulled it uses. Several conversions of it (other heads, other commits): the newest."""
        found = self.conversions(name)
        return max(found, key=lambda spec: spec.modified) if found else None

    async def pull_updates(self, name: str, ref: str):
        """ollama's progress objects for a pull of `ref`: {"status": ...} as it goes (with "digest", "total" and
        "completed" bytes while it downloads, as ollama's layers), {"status": "success"} at the end, or
        {"error": "..."} (the pull's own one-line reason). The pull runs as its own process (the
        download and the conversion are the CLI's); leaving this generator early (a client that hung up) ends it."""
        self.pulling.add(ref)
        try:
            yield {"status": "pulling manifest"}
            proc = await asyncio.create_subprocess_exec(*self.pull(ref), stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.DEVNULL,
                                                        stderr=asyncio.subprocess.PIPE)
        except BaseException:
            self.pulling.discard(ref)
            raise
        self.log(f"pulling {ref!r}")
        lines: list[str] = []
        try:
            yield {"status": f"downloading {ref}"}
            buf = b""
            while True:
                piece = await proc.stderr.read(4096)
                if not piece:
                    break
                buf += piece
                *done, buf = re.split(rb"[\r\n]", buf)
                for raw in done:
                    text = raw.decode("utf-8", "replace").strip()
                    if not text:
                        continue
                    if text.startswith("bitnet: progress "):   # bytes of the download (`--json-progress`)
                        layer = None
                        with contextlib.suppress(ValueError, KeyError, TypeError):
                            p = json.loads(text[len("bitnet: progress "):])
                            if "convert" in p:   # the conversion's steps: status text (no layer of ollama's)
                                layer = {"status": f"converting {ref} ({int(p['completed'])}/{int(p['total'])})"}
                            else:
                                layer = {"status": f"pulling {p['file']}", "digest": str(p["digest"]),
                                         "total": int(p["total"]), "completed": int(p["completed"])}
                        if layer is not None:
                            yield layer
                        continue
                    lines = (lines + [text])[-20:]
                    if text.startswith("bitnet: downloaded "):
                        yield {"status": f"converting {ref}"}
            if buf.strip():   # a last line without its newline
                lines = (lines + [buf.decode("utf-8", "replace").strip()])[-20:]
            code = await proc.wait()
        finally:
            self.pulling.discard(ref)
            if proc.returncode is None:   # its client went away (or the server stops): the pull ends with it
                # said first, with no await before it: a cancelled request's task is cancelled again at each one
                self.log(f"pull of {ref!r} stopped: " + ("the server is shutting down" if self.draining else
                                                         "its client went away"))
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                self._track(self._end_pull(proc))   # waited for by a task of its own, for the same reason
        if code != 0:
            errors = [ln for ln in lines if ln.startswith("bitnet: error: ")]
            why = errors[-1].removeprefix("bitnet: error: ") if errors else (lines[-1] if lines else f"exit {code}")
            self.log(f"pull of {ref!r} failed: {why}")
            yield {"error": why}
            return
        await self.refresh(fresh=True)
        spec = self.by_source(name)
        self.log(f"pulled {ref!r}" + (f": served as '{spec.name}'" if spec else ""))
        yield {"status": "success"}

    async def _end_pull(self, proc):
        """A stopped pull's process: its exit waited for (SIGKILL if it takes over 10 s), so none is left behind."""
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(Exception):
                await proc.wait()

    def count(self, *key):
        self.counts[key] = self.counts.get(key, 0) + 1

    # ---- lifecycle ------------------------------------------------------------------------------------------
    async def start(self):
        self.loop = asyncio.get_running_loop()
        self.cond = asyncio.Condition()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self._reaper = asyncio.create_task(self._reap())

    async def close(self):
        self.draining = True
        if self._reaper is not None:
            self._reaper.cancel()
        for c in list(self.children.values()):
            self._stop(c, "shutdown")
        await asyncio.gather(*(c.ended for c in list(self.ending) if c.ended), return_exceptions=True)
        self.children.clear()
        if self.client is not None:
            await self.client.aclose()
        shutil.rmtree(self.logdir, ignore_errors=True)

    def begin_drain(self):
        """Ctrl-C / SIGTERM: admit nothing more; every model process drains itself (its streams end) and exits.
        The requests waiting for room are woken, so they answer "shutting down" now (they waited on till a busy
        model's stream ended or their load timeout passed). Called from a signal handler: the wake-up is handed to
        the event loop."""
        self.draining = True
        for c in self.children.values():
            if c.proc.poll() is None:
                with contextlib.suppress(OSError):
                    c.proc.send_signal(signal.SIGTERM)
        if self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):   # the loop has just stopped: nobody waits
                self.loop.call_soon_threadsafe(lambda: self._track(self._wake()))

    async def _wake(self):
        async with self.cond:
            self.cond.notify_all()

    # ---- loading and unloading ------------------------------------------------------------------------------
    async def acquire(self, spec: ModelSpec, load: bool = True,
                      admitted: Callable[[Child], None] | None = None) -> Child:
        """The model's process, ready, with this request counted on it (release() it). Loads the model if
        `load`, first unloading the least recently used idle one when `models_max` are loaded; waits (up to the
        load timeout) while every loaded model is busy. `admitted(c)`: called once the request has its model's
        process, before the wait for its load (a request's keep_alive: an unload asked during that wait is
        later, and wins)."""
        deadline = time.monotonic() + self.load_timeout
        async with self.cond:
            ticket = object()   # its place in room_queue once it waits for room
            held: list[Reserve] = []   # what starting its model's process takes, once it makes room for it
            try:
                c = await self._admit(spec, load, deadline, ticket, held)
            finally:
                for r in held:   # not used: the model came another way, or this request gave up
                    r.discard()
                if ticket in self.room_queue:
                    self.room_queue.remove(ticket)
                    if not self.room_queue:   # nobody waits for room (any more): every model takes requests
                        for x in self.children.values():
                            x.yielding = False
                    self.cond.notify_all()   # the next in the queue may act
            c.active += 1
            if admitted is not None:
                admitted(c)
        try:
            await asyncio.wait_for(asyncio.shield(c.ready), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            self.release(c)
            raise RouterError(503, f"model '{spec.name}' is still loading; retry", "loading",
                              retry_after=self.retry_after) from None
        except BaseException:   # its load failed (RouterError), or the request went away
            self.release(c)
            raise
        return c

    async def _admit(self, spec: ModelSpec, load: bool, deadline: float, ticket, held: list) -> Child:
        """acquire()'s wait, the condition held: the model's process once this request may use it. A request that
        needs room (its model not loaded) joins room_queue with its ticket, and only the queue's first makes room
        and loads, in the order they came (acquire() takes the ticket out). What starting its model's process takes
        (a Reserve, in `held`) is taken before an idle model is unloaded for it, and held while that one exits: a start
        that cannot proceed for want of descriptors unloads nothing (acquire() discards one left unused)."""
        while True:
            if self.draining:
                raise RouterError(503, "shutting down", "unavailable", retry_after=self.retry_after)
            c = self.children.get(spec.name)
            if c is not None and c.spec.digest() != spec.digest() and c.active == 0 and not c.stopping:
                self._stop(c, "replaced")   # its file was replaced (bitnet pull / convert again): load anew
                continue
            if c is not None and c.proc.poll() is None and not c.stopping:
                if not (c.yielding and self.room_queue):
                    break
                # it is making room for a request that came first: this one waits, as ollama's queue does,
                # so the model goes idle and the switch happens (admitted, a steady stream kept it busy and the
                # other request waited out its whole timeout)
            elif c is not None:   # exited (the reaper has not seen it yet)
                self._forget(c, "exited")
                continue
            elif self.failure(spec) is not None and time.monotonic() < self.failed[spec.name].retry_at:
                f = self.failed[spec.name]
                raise RouterError(500, f.message, "load_failed", "model",
                                  retry_after=max(1, math.ceil(f.retry_at - time.monotonic())))
            elif not load:
                raise RouterError(400, f"model '{spec.name}' is not loaded (a request that generates with it, or "
                                       "POST /models/load, loads it)", "model_not_loaded", "model")
            elif self.room_queue and self.room_queue[0] is not ticket:
                pass   # others came first for room: after them
            # a model still exiting holds its memory: it counts until it has gone
            elif len(self.children) + len(self.ending) < self.models_max:
                c = self._spawn(spec, held.pop() if held else self._reserve(spec))
                break
            else:
                idle = [x for x in self.children.values() if x.active == 0 and not x.stopping]
                if idle and len(self.children) >= self.models_max:   # one victim: not every idle model while
                    victim = min(idle, key=lambda x: x.last_used)      # the first one is still exiting
                    if not held:   # raises (out of descriptors) before the victim goes
                        held.append(self._reserve(spec))
                    self._stop(victim, "room")
                    continue
                busy = [x for x in self.children.values() if not x.stopping]
                if busy and not idle and not any(x.yielding for x in busy):   # the least recently used one
                    min(busy, key=lambda x: x.last_used).yielding = True    # takes nothing new from now on
            left = deadline - time.monotonic()
            if left <= 0:
                raise RouterError(503, f"all {self.models_max} loaded models are busy (--models-max); retry",
                                  "models_busy", retry_after=self.retry_after)
            if c is None and ticket not in self.room_queue:
                self.room_queue.append(ticket)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.cond.wait(), left)
        return c

    def release(self, c: Child, upstream=None) -> asyncio.Task:
        """A request through `c` has ended (`upstream`: its forwarded response, closed first); the model's
        keep_alive was set when the request began. Runs as a task of its own: a request's task may be cancelled,
        and anyio cancels every await of a cancelled scope again, which would leave the request counted for ever
        (and its model never idle). Awaiting the task is optional."""
        return self._track(self._release(c, upstream))

    async def _release(self, c: Child, upstream):
        if upstream is not None:
            with contextlib.suppress(Exception):
                await upstream.aclose()
        async with self.cond:
            c.active -= 1
            c.last_used = time.monotonic()
            if c.active == 0:
                c.expires = c.last_used + c.keep_alive
                if c.keep_alive == 0 and not c.stopping and self.children.get(c.spec.name) is c:
                    self._stop(c, "request" if c.unload_asked else "keep_alive")
            self.cond.notify_all()

    def _start_failed(self, spec: ModelSpec, e: OSError) -> RouterError:
        """What a request is told when its model's process could not be started: out of descriptors or processes
        (EMFILE / ENFILE, EAGAIN from fork, ENOMEM), the router's own state: 503 out_of_resources + Retry-After, as
        the connect to a running process says it; else a 500 saying why. One log line either way, never a
        traceback."""
        hint = {errno.EMFILE: "raise ulimit -n or lower --max-connections",
                errno.ENFILE: "the system's open-files table is full",
                errno.EAGAIN: "the process limit is reached (ulimit -u)",
                errno.ENOMEM: "out of memory"}.get(e.errno)
        why = os.strerror(e.errno).lower() if e.errno else type(e).__name__
        self.log(f"{why} starting model '{spec.name}' ({type(e).__name__}: {e})" + (f"; {hint}" if hint else ""))
        if hint is not None:
            return RouterError(503, f"the server is out of resources ({why}); retry later", "out_of_resources",
                               retry_after=self.retry_after)
        return RouterError(500, f"model '{spec.name}' could not be started: {why}", "load_failed", "model")

    def _reserve(self, spec: ModelSpec) -> "Reserve":
        """What starting the model's process takes of the router's descriptors, taken now: before an idle model is
        unloaded to make room, so a start that cannot proceed for want of them unloads nothing (a working model was
        stopped, then the start failed, and nothing was loaded). Raises the start's RouterError."""
        # numbered: the name alone, made safe for a file, is not unique ("x y" and "x_y"; every two-character
        # name of another script), and two loads then wrote one file, each reading the other's load error
        self.spawned += 1
        log_path = os.path.join(self.logdir, f"{self.spawned}-{re.sub(r'[^A-Za-z0-9._-]', '_', spec.name)}.log")
        r = Reserve(log_path)
        try:
            r.take()
        except OSError as e:
            r.discard()
            raise self._start_failed(spec, e) from None
        return r

    def _spawn(self, spec: ModelSpec, r: "Reserve") -> Child:
        """Start the model's process with what `r` holds (closed here, whatever happens)."""
        try:
            port = r.sock.getsockname()[1]
            r.spare_free()   # Popen's own pipe to its child takes these two
            # BITNET_ROUTER_PID: the process ends itself when this one dies, even by SIGKILL; BITNET_LISTEN_FD: it
            # serves on this socket, inherited (cli/serve.py); the router's copy closes once the process has it
            proc = subprocess.Popen(self.command(spec, port, self.key_file), stdin=r.devnull, stdout=r.log,
                                    stderr=subprocess.STDOUT, pass_fds=(r.sock.fileno(),),
                                    env=dict(os.environ, BITNET_ROUTER_PID=str(os.getpid()),
                                             BITNET_LISTEN_FD=str(r.sock.fileno())))
        except OSError as e:   # fork's EAGAIN (the process table), ENOMEM: said, never a traceback
            r.discard()
            raise self._start_failed(spec, e) from None
        r.close()
        c = Child(spec, proc, port, r.log_path)
        c.keep_alive = self.keep_alive
        self.children[spec.name] = c
        self.count("loads", spec.name)
        self.log(f"loading '{spec.name}' ({spec.path})")
        self._track(self._watch_load(c))
        return c

    async def _watch_load(self, c: Child):
        """Poll the process's /health until it answers 200 (ready), says its model failed to load, or exits."""
        problem, said = None, False   # said: the model's process said why its model does not load (not a kill)
        while True:
            if c.proc.poll() is not None:
                tail = c.log_tail()
                problem = tail or f"its process {exit_said(c.proc.returncode)}"
                said = c.proc.returncode == EXIT_BAD_INPUT and bool(tail)   # its one line on the load (a kill: not)
                break
            try:
                r = await self.client.get(c.url + "/health", timeout=5.0)
                if r.status_code == 200:
                    break
                body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
                if (body.get("error") or {}).get("code") == "load_failed":
                    problem, said = body["error"]["message"].removeprefix("model failed to load: "), True
                    break
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.1)
        if problem is None:
            self.failed.pop(c.spec.name, None)
            await self._learn(c)
            took = time.monotonic() - c.started
            self.log(f"'{c.spec.name}' loaded in {took:.1f} s")
            c.ready_at = time.monotonic()
            if not c.ready.done():
                c.ready.set_result(True)
            return
        if self.draining or c.stopping:   # stopped while loading (Ctrl-C, an unload): not the model's fault
            error = RouterError(503, "shutting down" if self.draining else f"model '{c.spec.name}' was unloaded "
                                "while loading; retry", "unavailable", retry_after=self.retry_after)
        elif not await asyncio.to_thread(os.path.exists, c.spec.path):
            # removed while it loaded (ollama's /api/delete, rm): said in the router's words, not the process's
            # command-line ones (-m/--model, "a hub id such as ..."), and no failure of the model's
            self.log(f"'{c.spec.name}': its file {c.spec.path} was removed while it loaded")
            error = RouterError(404, f"model '{c.spec.name}' not found: its file was removed while it loaded",
                                "model_not_found", "model")
        else:
            self.count("load_failures", c.spec.name)
            self.log(f"'{c.spec.name}' failed to load: {problem}")
            message = f"model '{c.spec.name}' failed to load: {problem}"
            wait = None
            if said:   # answered again for a while, the wait doubling while it fails (an exit, a kill, may not)
                last = self.failure(c.spec)
                wait = self.failed_retry if last is None else min(max(last.wait * 2, self.failed_retry),
                                                                  FAILED_RETRY_MAX)
                code = c.proc.returncode if c.proc.returncode is not None else EXIT_BAD_INPUT   # (/health said it)
                self.failed[c.spec.name] = LoadFailure(c.spec.digest(), message, code, time.monotonic() + wait, wait)
            error = RouterError(500, message, "load_failed", "model",
                                retry_after=None if wait is None else max(1, math.ceil(wait)))
        if not c.ready.done():
            c.ready.set_exception(error)
            c.ready.exception()   # retrieved: no "never retrieved" warning when no request waits
        async with self.cond:
            self._stop(c, "failed")
            self.cond.notify_all()

    async def _learn(self, c: Child):
        """What the model's process says of it (context, family, size) for the listings; its warnings, relayed."""
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
            r = await self.client.get(c.url + "/api/ps", headers={"authorization": f"Bearer {self.key}"}, timeout=10)
            entry = r.json()["models"][0]
            c.info = {"context_length": entry.get("context_length"), "details": entry.get("details")}
            self.details[c.spec.name] = c.info
        with contextlib.suppress(OSError):
            with open(c.log_path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if "warning:" in line:
                        self.log(f"'{c.spec.name}': {line.strip().removeprefix('bitnet serve: ')}")

    def _stop(self, c: Child, reason: str):
        """Unload (call with the condition held, or at shutdown): SIGTERM, so its process drains and exits;
        SIGKILL after stop_timeout. The exit is waited for by a task of its own (c.ended), never under the
        condition: every other model's requests go on meanwhile (an unload stalled them for up to a second, a
        drain for its whole timeout). Until it has exited the process counts against models_max."""
        if c.stopping:
            return
        c.stopping = True
        self._forget(c, reason)
        if c.proc.poll() is None:
            with contextlib.suppress(OSError):
                c.proc.send_signal(signal.SIGTERM)
            self.ending.add(c)
            c.ended = self._track(self._end(c))

    async def _end(self, c: Child):
        try:
            await asyncio.wait_for(asyncio.to_thread(c.proc.wait), self.stop_timeout)
        except asyncio.TimeoutError:
            c.proc.kill()
            await asyncio.to_thread(c.proc.wait)
        finally:
            self.ending.discard(c)
            with contextlib.suppress(OSError):   # its log is read no more (each load has its own file)
                os.remove(c.log_path)
            async with self.cond:   # room for a model waiting to load
                self.cond.notify_all()

    def _track(self, coro) -> asyncio.Task:
        """A task the loop runs to its end whatever happens to the request that started it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _forget(self, c: Child, reason: str):
        if self.children.get(c.spec.name) is c:
            del self.children[c.spec.name]
            if reason not in ("failed", "shutdown"):
                self.count("unloads", c.spec.name, reason)
                if reason == "exited":
                    tail = c.log_tail()
                    self.log(f"'{c.spec.name}': its process {exit_said(c.proc.returncode)}"
                             + (f": {tail}" if tail else ""))
                else:
                    self.log(f"unloaded '{c.spec.name}' ({reason})")
        if not c.ready.done():
            c.ready.set_exception(RouterError(503, f"model '{c.spec.name}' was unloaded while loading; retry",
                                              "loading", retry_after=self.retry_after))
            c.ready.exception()

    async def _reap(self):
        """Unload idle models past their keep_alive; forget processes that exited (one that drained and exited 0
        while the router stops is no unexpected exit: neither said nor counted as one)."""
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            async with self.cond:
                for c in list(self.children.values()):
                    if c.stopping:
                        continue
                    if c.proc.poll() is not None and c.ready.done():
                        # a stopping router told it to drain (SIGTERM): its exit 0 is that drain's end, no crash
                        drained = self.draining and c.proc.returncode == 0
                        self._forget(c, "shutdown" if drained else "exited")
                        self.cond.notify_all()
                    elif c.active == 0 and c.ready.done() and now >= c.expires:
                        self._stop(c, "request" if c.unload_asked else "keep_alive")
                        self.cond.notify_all()
                    elif c.active == 0 and c.ready.done() and c.spec.name not in self.models:
                        self._stop(c, "removed")   # its file is gone from the directories (bitnet rm)
                        self.cond.notify_all()

    async def unload(self, spec: ModelSpec) -> bool:
        """Unload now (returning once its process has exited), or as soon as its requests end (ollama's way)."""
        async with self.cond:
            c = self.children.get(spec.name)
            if c is None:
                return False
            if c.active:
                c.keep_alive, c.unload_asked = 0, True
                return True
            self._stop(c, "request")
            self.cond.notify_all()
        if c.ended is not None:
            await asyncio.shield(c.ended)   # outside the condition: the other models serve on meanwhile
        return True

    def _kept(self, kept: dict, key: str, value) -> None:
        """kept[key] = value, bounded by shows_limit(): the oldest entry goes."""
        if len(kept) >= self.shows_limit() and key not in kept:
            kept.pop(next(iter(kept)))
        kept[key] = value

    def keep_show(self, key: str, answer: dict):
        self._kept(self.shows, key, answer)

    def said_unreadable(self, key: str, why: str):
        self._kept(self.unreadable, key, why)

    async def show(self, spec: ModelSpec) -> dict | None:
        """ollama's /api/show answer of a model, from its file (describe), never loading it; kept by model file.
        None where the router has no describe."""
        if self.describe is None:
            return None
        key = spec.digest()
        if key not in self.shows:
            try:
                answer = await asyncio.to_thread(self.describe, spec)
            except (BitNetError, OSError) as e:
                self.said_unreadable(key, str(e))
                raise RouterError(500, f"model '{spec.name}': cannot read its file: {e}", "load_failed",
                                  "model") from None
            self.unreadable.pop(key, None)
            self.keep_show(key, answer)
        return self.shows[key]

    async def describe_all(self, specs: list[ModelSpec]):
        """The show answers of the listed models not read yet (their details for /api/tags), in one thread; a file
        that cannot be read is listed without them, and not read again while it is unchanged."""
        if self.describe is None:
            return
        todo = [s for s in specs if s.digest() not in self.shows and s.digest() not in self.unreadable]
        todo = todo[:self.shows_limit()]   # specs: the catalog's, which the limit holds whole
        if not todo:
            return

        def read_all():
            out = []
            for s in todo:
                try:
                    out.append((s, self.describe(s), None))
                except (BitNetError, OSError) as e:
                    out.append((s, None, str(e)))
            return out
        for s, answer, why in await asyncio.to_thread(read_all):
            if answer is None:
                self.said_unreadable(s.digest(), why)
            else:
                self.keep_show(s.digest(), answer)

    def failure(self, spec: ModelSpec) -> LoadFailure | None:
        """The model's last load, if it failed, of the file as it is now (a file changed since: tried afresh)."""
        f = self.failed.get(spec.name)
        return f if f is not None and f.digest == spec.digest() else None

    # ---- listings -------------------------------------------------------------------------------------------
    def status(self, name: str) -> str:
        c = self.children.get(name)
        return "unloaded" if c is None else c.status

    def status_object(self, spec: ModelSpec) -> dict:
        """llama-server's router `status`: {"value": loaded / loading / unloaded}, and, while its last load
        failed and it is not loading again, "failed": true with the process's "exit_code"."""
        value = self.status(spec.name)
        f = self.failure(spec) if value == "unloaded" else None
        return {"value": value} if f is None else {"value": value, "failed": True, "exit_code": f.exit_code}

    def expires_at(self, c: Child) -> str:
        left = c.keep_alive if c.active else c.expires - time.monotonic()
        return "2318-01-01T00:00:00Z" if not math.isfinite(left) else utc_iso(time.time() + max(0.0, left))

    def tag(self, spec: ModelSpec) -> dict:
        known = (self.shows.get(spec.digest()) or {}).get("details") or \
            (self.details.get(spec.name) or {}).get("details") or {}
        details = {"parent_model": "", "format": spec.format, "family": "", "families": [], "parameter_size": "",
                   "quantization_level": "ternary (b1.58)", **known}
        listed = tagged_name(spec.name)   # as ollama lists a name (NAME:latest): its clients match it with the tag
        return {"name": listed, "model": listed, "modified_at": utc_iso(spec.modified or 0), "size": spec.size,
                "digest": spec.digest(), "details": details}

    def metrics_text(self) -> str:
        out = ["# HELP bitnet_router_models_loaded Models whose process is loaded or loading.",
               "# TYPE bitnet_router_models_loaded gauge", f"bitnet_router_models_loaded {len(self.children)}"]
        for name, help_ in (("loads", "Model loads started."), ("load_failures", "Model loads that failed."),
                            ("unloads", "Models unloaded (room: for another model, keep_alive, request, exited)."),
                            ("requests", "Requests forwarded to a model.")):
            out += [f"# HELP bitnet_router_{name}_total {help_}", f"# TYPE bitnet_router_{name}_total counter"]
            for key, n in sorted(self.counts.items()):
                if key[0] == name:
                    labels = f'model="{_label(key[1])}"' + (f',reason="{key[2]}"' if len(key) > 2 else "")
                    out.append(f"bitnet_router_{name}_total{{{labels}}} {n}")
        return "\n".join(out) + "\n"


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class UpstreamGone(Exception):
    """The model's process died in the middle of an answer the router was relaying."""


def _gone(e: BaseException) -> bool:
    inner = getattr(e, "exceptions", None)   # an exception group of the response's task group
    return isinstance(e, UpstreamGone) or bool(inner) and all(_gone(x) for x in inner)


class _CutAnswers(logging.Filter):
    """uvicorn logs "ASGI callable returned without completing response." (an ERROR, read as the router's bug) for
    each answer a Relay ends without HTTP's end of body on purpose, after the router's own line on why (its model's
    process died): that many of those lines are dropped, no other."""
    NOTE = "ASGI callable returned without completing response"

    def __init__(self):
        super().__init__()
        self.pending = 0

    def filter(self, record) -> bool:
        if self.pending and record.getMessage().startswith(self.NOTE):
            self.pending -= 1
            return False
        return True


CUT_ANSWERS = _CutAnswers()


class Relay(StreamingResponse):
    """A forwarded answer. Its cleanup (close the stream to the model's process, count the request as ended) runs
    however the response ends, also when the client left before its first byte (the body never iterated). An
    answer whose model process died midway ends without HTTP's end of body, as a proxy's does when its upstream
    closes early: the client sees a cut answer, never one that looks whole."""

    def __init__(self, content, finish, **kw):
        super().__init__(content, **kw)
        self.finish = finish

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except Exception as e:
            if not _gone(e):
                raise
            CUT_ANSWERS.pending += 1
        finally:
            self.finish()


def cut_answer_event(content_type: str, message: str, tail: bytes, path: str = "", events: int = 0) -> bytes:
    """The last piece of a streamed answer cut by its model process's death, in the stream's own format: an SSE
    error event (as --request-timeout's: Anthropic's named `event: error`, the Responses API's typed one numbered
    after the `events` relayed, OpenAI's chat shape for the rest), or ollama's {"error": ...} line; nothing for other
    bodies. `tail`: the last bytes relayed, to end a line or event cut in the middle first."""
    if content_type.startswith("text/event-stream"):
        lead = b"" if tail.endswith(b"\n\n") or not tail else b"\n" if tail.endswith(b"\n") else b"\n\n"
        if path.rstrip("/") in ("/v1/responses", "/responses"):   # typed clients read `type`
            event = json.dumps({"type": "error", "code": "model_died", "message": message, "param": None,
                                "sequence_number": events})
            return lead + f"event: error\ndata: {event}\n\n".encode()
        if path.startswith("/v1/messages"):   # the anthropic client skips an SSE message without an event name
            return lead + b"event: error\ndata: " + error_json(message, "server_error", "model_died",
                                                             scope={"path": path}, status=500) + b"\n\n"
        event = json.dumps({"error": {"message": message, "type": "server_error", "code": "model_died"}})
        return lead + f"data: {event}\n\n".encode()
    if content_type.startswith("application/x-ndjson"):
        return (b"" if tail.endswith(b"\n") or not tail else b"\n") + (json.dumps({"error": message}) + "\n").encode()
    return b""


@functools.cache
def model_routes() -> tuple:
    """(path regex, methods) of every route a model's own server has (serve/app.py's create_app, built without a
    model): the router forwards only to those, and loads a model only for a POST one. A route there only to refuse
    its method (POST /props: 405) is left out: the router answers it itself."""
    from .app import create_app

    return tuple((r.path_regex, frozenset(r.methods)) for r in create_app(lambda: None).routes
                 if getattr(r, "methods", None) and hasattr(r, "path_regex")
                 and not getattr(getattr(r, "endpoint", None), "refuses_method", False))


@functools.cache
def model_openapi() -> dict:
    """A model's own server's OpenAPI schema (create_app built without a model): the router serves the same API."""
    from .app import create_app

    return create_app(lambda: None).openapi()


async def exited(proc: subprocess.Popen, wait: float = 0.5) -> bool:
    """Whether a model's process has exited, or does within `wait` s (a process killed closes its sockets a
    moment before its exit can be seen)."""
    deadline = time.monotonic() + wait
    while proc.poll() is None:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def body_problem(body: bytes) -> str:
    """Why a request body with no model to route by is refused, in a model's server's own words (not JSON, not
    UTF-8, not an object): the router said "not a JSON object" to all three."""
    try:
        data = loads(body)
    except NOT_JSON as e:
        return not_json(e)
    except BodyRefused as e:   # an integer too long to read, named by its field
        return str(e.detail)
    return "request body must be a JSON object" if not isinstance(data, dict) else \
        "request body is not a JSON object (with the model's name in `model`)"


def create_router_app(router: Router, *, api_keys: tuple = (), limits: Limits | None = None,
                      metrics_public: bool = False, cors_origins: tuple = (), local_only: bool = False,
                      webui: bool = True) -> FastAPI:
    error_log = logging.getLogger("uvicorn.error")
    if CUT_ANSWERS not in error_log.filters:
        error_log.addFilter(CUT_ANSWERS)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await router.start()
        await asyncio.to_thread(model_routes)   # built once here, not on the first request's event loop
        yield
        await router.close()

    app = FastAPI(title="bitnet serve (models)", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router
    app.add_middleware(RouteNorms)
    # no --request-timeout here: each model's process holds its requests to it, timed from when it has the request,
    # so the wait for a load (bounded by --models-load-timeout) never counts, as in ollama (a first request whose
    # model loaded for longer than the limit was a 504 while the load went on)
    app.add_middleware(LimitsMiddleware, limits=dataclasses.replace(limits or Limits(), request_timeout=0))
    app.add_middleware(AuthMiddleware, checker=KeyChecker(api_keys), metrics_public=metrics_public)
    allow_cross_origin(app, cors_origins, local_only, keyed=bool(api_keys))   # the models' processes see the router

    def error(request: Request, e: RouterError) -> Response:
        body = error_json(e.message, "not_found_error" if e.status == 404 else
                          "server_error" if e.status >= 500 else "invalid_request_error",
                          e.code, e.param, scope=request.scope, status=e.status)
        headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else {}
        if e.allow:
            headers["allow"] = e.allow
        status = anthropic_status(e.status) if anthropic_shaped(request.scope) else e.status   # 529: overloaded
        return Response(body, status_code=status, media_type="application/json", headers=headers or None)

    @app.exception_handler(RouterError)
    async def _router_error(request, e: RouterError):
        return error(request, e)

    @app.exception_handler(405)
    async def _not_allowed(request: Request, e):
        """A method no route of the path takes (the forwarder takes the usual ones): in the API's error shape, its
        Allow every method of the path, the router's and its models' (FastAPI's was {"detail": ...})."""
        return error(request, RouterError(405, f"{request.method} {request.scope['path']}: method not allowed", None,
                                          allow=allow_header(path_methods(request.scope))))

    def path_methods(scope) -> set:
        """The methods a path takes here: its routes' (the forwarder aside), and its models' where they serve it."""
        path = scope["path"]
        return allowed_methods(app.router.routes, scope, skip=(forward,)) | set().union(
            *(m for rx, m in model_routes() if rx.match(path)))

    @app.exception_handler(404)
    async def _no_route(request: Request, e):
        """A path no route's pattern takes: one with a newline in it (a route's `.` stops at one), such as
        /v1/models/NAME for a file named with a newline. Its model entry, or the API's own 404, never FastAPI's
        {"detail": "Not Found"}."""
        path = request.scope["path"]   # (request.url drops a newline: urllib's URL parsing removes it)
        try:
            if path.startswith("/v1/models/") and request.method == "GET":
                return JSONResponse(model_entry(await router.resolve(path[len("/v1/models/"):])))
            raise RouterError(404, f"{request.method} {path}: no such endpoint", "not_found")
        except RouterError as err:
            return error(request, err)

    @app.api_route("/health", methods=["GET", "HEAD"])   # HEAD: load balancers' checks (HAProxy's httpchk)
    @app.api_route("/v1/health", methods=["GET", "HEAD"])   # llama-server's other path
    async def health():
        if router.draining:
            return JSONResponse({"error": {"message": "server is shutting down", "type": "unavailable_error",
                                           "param": None, "code": "shutting_down"}}, status_code=503,
                                headers={"Retry-After": str(router.retry_after)})
        return {"status": "ok", "models_loaded": len(router.children)}

    def model_entry(spec: ModelSpec) -> dict:
        n_ctx = (router.details.get(spec.name) or {}).get("context_length")
        return model_object(spec.name, int(spec.modified), path=shown_path(spec.path),
                            status=router.status_object(spec), **({"meta": {"n_ctx": n_ctx}} if n_ctx else {}))

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        await router.refresh()
        data = [model_entry(s) for s in router.models.values()]
        return {"object": "list", "data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None}

    async def body_model(request: Request) -> tuple[dict | None, bytes]:
        body = await request.body()
        if not body:
            return None, body
        try:
            data = await asyncio.to_thread(json.loads, body) if len(body) > 65536 else json.loads(body)
        except (ValueError, RecursionError):
            return None, body
        return (data if isinstance(data, dict) else None), body

    async def load_or_unload(request: Request, unload: bool):
        data, _ = await body_model(request)
        spec = await router.resolve((data or {}).get("model"))
        if unload:
            if not await router.unload(spec):
                raise RouterError(400, f"model '{spec.name}' is not loaded", "model_not_loaded", "model")
        else:
            router.failed.pop(spec.name, None)   # asked by hand: tried again now, its cause perhaps fixed meanwhile
            c = await router.acquire(spec)
            await router.release(c)   # the task: a load returns once it counts as idle
        return {"success": True}

    @app.get("/v1/models/{model_name:path}")
    async def model_one(model_name: str):
        return model_entry(await router.resolve(model_name))

    @app.post("/models/load")
    async def models_load(request: Request):
        return await load_or_unload(request, unload=False)

    @app.post("/models/unload")
    async def models_unload(request: Request):
        return await load_or_unload(request, unload=True)

    @app.api_route("/api/tags", methods=["GET", "HEAD"])   # HEAD: as ollama answers it
    async def api_tags():
        await router.refresh()
        await router.describe_all(list(router.models.values()))   # family, parameter_size: from the files
        return {"models": [router.tag(s) for s in router.models.values()]}

    @app.get("/api/ps")
    async def api_ps():
        out = []
        for c in list(router.children.values()):
            if c.status != "loaded":
                continue
            t = router.tag(c.spec)
            out.append({**{k: t[k] for k in ("name", "model", "digest", "details")}, "size": c.memory() or t["size"],
                        "expires_at": router.expires_at(c), "size_vram": 0,
                        "context_length": c.info.get("context_length")})
        return {"models": out}

    @app.api_route("/api/version", methods=["GET", "HEAD"])
    async def api_version():
        return {"version": OLLAMA_VERSION}

    async def not_here(request: Request):
        what = request.url.path.rsplit("/", 1)[-1]
        why = ("models come from `bitnet pull` / `bitnet convert` on the server's machine (a --models-cache server "
               "serves a new one at once)" if what in ("pull", "create", "copy") else
               "`bitnet rm NAME` on the server's machine removes a converted model" if what == "delete" else
               "bitnet serve does not push models")
        return JSONResponse({"error": f"/api/{what}: {why}"}, status_code=501)
    for what in ("push", "create", "copy"):
        app.add_api_route(f"/api/{what}", not_here, methods=["POST"])

    async def no_blobs(request: Request, digest: str):   # ollama create's upload, before its /api/create
        return JSONResponse({"error": BLOBS_WHY}, status_code=501)
    app.add_api_route("/api/blobs/{digest}", no_blobs, methods=["HEAD", "POST"], include_in_schema=False)

    async def ollama_body(request: Request) -> tuple[dict | None, bytes]:
        """The body of ollama's /api/show, /api/pull and /api/delete: a JSON object, or None for no body (then
        "model: required"); any other body is ollama's 400 for it, in a model's server's words (a body that was not
        JSON read "model: required", as if it had come without its name)."""
        data, body = await body_model(request)
        if data is None and body:
            raise RouterError(400, body_problem(body), "invalid_json")
        return data, body

    def ollama_name(data: dict | None) -> str:
        name = (data or {}).get("model") or (data or {}).get("name")   # older clients send `name`
        if not isinstance(name, str) or not name.strip():
            raise RouterError(400, "model: required (the model's name, a string)", "invalid_value", "model")
        return name

    async def ollama_model(data: dict | None) -> ModelSpec:
        """The model /api/show and /api/delete name: the name as sent first (a file " lead.bnstore" is listed,
        and served by /api/chat, as " lead"), then without the spaces around it."""
        name = ollama_name(data)
        if name != name.strip():
            with contextlib.suppress(RouterError):
                return await router.resolve(name)
        return await router.resolve(name.strip())

    @app.post("/api/show")
    async def api_show(request: Request):
        """ollama's /api/show is metadata: clients (Open WebUI, Continue, editors) ask it of every listed model. It
        is answered from the model's file (router.describe: its header, config and template), as ollama answers
        it: no model is loaded for it, nor one in use unloaded to make room. An answer is kept by model file
        (path, size, time); the request's other fields (verbose) change nothing of it. A router without describe
        (none given) loads the model once and asks its process."""
        if router.draining:
            raise RouterError(503, "shutting down", "unavailable", retry_after=router.retry_after)
        data, body = await ollama_body(request)
        spec = await ollama_model(data)
        answer = await router.show(spec)
        if answer is not None:
            return JSONResponse(answer)
        key = spec.digest()
        if key in router.shows:
            return JSONResponse(router.shows[key])
        c = await router.acquire(spec)
        try:
            r = await router.client.post(c.url + "/api/show", content=body, timeout=60,
                                         headers={"authorization": f"Bearer {router.key}",
                                                  "content-type": "application/json"})
        except httpx.HTTPError as e:
            raise upstream_error(request, spec, e, router.retry_after) from None
        finally:
            router.release(c)
        if r.status_code == 200:
            with contextlib.suppress(ValueError):
                router.keep_show(key, json.loads(r.content))
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.post("/api/pull")
    async def api_pull(request: Request):
        """ollama's pull for a --models-cache server: `bitnet pull` of the hub id (hf.co/OWNER/REPO[:TAG], or
        OWNER/REPO[:FILE|:TAG][@REV]) into the store cache, streamed as ollama's progress objects, then served under
        `bitnet list`'s name and under the name pulled. Its process ends when the client hangs up."""
        if router.pull is None:
            return await not_here(request)
        if router.draining:
            raise RouterError(503, "shutting down", "unavailable", retry_after=router.retry_after)
        data, _ = await ollama_body(request)
        name = ollama_name(data)
        stream = (data or {}).get("stream", True)
        if not isinstance(stream, bool):
            raise RouterError(400, "stream: must be true or false", "invalid_value", "stream")
        listed = router.find(name)   # a listed name as sent (" lead"), else without the spaces around it
        bad = re.search(r"[\x00-\x1f\x7f-\x9f]", name) if listed is None else None
        if bad:   # "o/r\n" was pulled as o/r: a control character is no typed space to strip (ollama refuses it too)
            raise RouterError(400, f"invalid model name {name!r}: it holds a control character "
                              f"({ascii(bad.group())[1:-1]})", "invalid_value", "model")
        name = name if listed is not None else name.strip()
        ref = hub_name(name)
        listed = (listed or router.find(name)) if "/" not in ref else None
        if listed is not None and listed.cached and listed.source:   # a name /api/tags lists (ollama pulls any:
            ref = listed.source.rsplit("@", 1)[0]                     # an update): its hub id, the newest commit
        # ollama checks a name before anything runs ("invalid model name"); the pull's own process checks the rest
        # (FILE: not an absolute, drive or backslash path, which huggingface_hub refuses as a ValueError, a 500)
        if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[^\s/:@]+(:(?![A-Za-z]:)[^\s@/\\][^\s@\\]*)?(@[^\s]+)?", ref) \
                or ".." in ref:
            raise RouterError(400, f"invalid model name {name!r}: a hub id, OWNER/REPO[:FILE|:TAG][@REVISION] or "
                              "hf.co/OWNER/REPO[:TAG]", "invalid_value", "model")
        if ref in router.pulling:
            raise RouterError(409, f"{name!r} is being pulled already", "conflict", "model")
        if len(router.pulling) >= PULLS_MAX:
            raise RouterError(503, f"{PULLS_MAX} pulls are running; try again when one has ended", "unavailable",
                              retry_after=router.retry_after * 10)
        pulled = router.pull_updates(name, ref)
        # its first step marks `ref` as pulling, here, with no await since the check above: run by the response
        # instead, a second pull of the same name arriving meanwhile passed the check, and both converted into one file
        first = await pulled.__anext__()

        async def updates():
            try:
                yield first
                async for u in pulled:
                    yield u
            finally:
                await pulled.aclose()   # a client that hung up ends the pull's process
        if stream:
            return Streamed((json.dumps(u) + "\n" async for u in updates()), media_type="application/x-ndjson")
        last: dict = {}
        async for u in updates():
            last = u
        if "error" in last:
            return JSONResponse(last, status_code=500)
        return last

    @app.api_route("/api/delete", methods=["DELETE", "POST"])   # ollama's is DELETE; a POST got a model's 501
    async def api_delete(request: Request):
        """ollama's delete: a converted model of the store cache is unloaded and its file removed (as `bitnet
        rm`); a --models-dir file is the user's and stays (400). Without --models-cache: 501, as /api/pull."""
        if router.pull is None:
            return await not_here(request)
        data, _ = await ollama_body(request)
        await router.refresh(fresh=True)   # every conversion there is now, not those of a listing up to 1 s old
        spec = await ollama_model(data)
        if not spec.cached:
            raise RouterError(400, f"'{spec.name}' is {shown_path(spec.path)}, a file of --models-dir: the server "
                              "deletes only the converted models of its cache (remove the file itself)",
                              "invalid_value", "model")
        # a hub id names every conversion of it (other heads, other commits), as `bitnet rm REPO` removes them all:
        # the newest alone went, and the name still answered with the next one
        every = [s for s in router.conversions(ollama_name(data).strip()) if s.cached]
        for one in sorted(every, key=lambda s: s.name) if spec in every else [spec]:
            await router.unload(one)
            try:
                await asyncio.to_thread(os.remove, one.path)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise RouterError(500, f"cannot delete '{one.name}': {e.strerror}", "delete_failed") from None
            router.log(f"deleted '{one.name}' ({one.path})")
        await router.refresh(fresh=True)
        return Response(status_code=200)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics(request: Request):
        if "model" in request.query_params:
            return await forward(request)
        return Response(router.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/props")
    async def props(request: Request):
        """llama-server's router answers /props without a model with its own (the web UI reads it before it knows
        a model); with ?model=NAME (or one model served) it is that model's, forwarded."""
        if request.query_params.get("model") is not None or len(router.models) == 1:
            return await forward(request)
        from ..engine import __version__
        return {"role": "router", "model_alias": "", "model_path": "", "total_slots": 0, "chat_template": "",
                "default_generation_settings": {"n_ctx": 0, "params": {}},
                "modalities": {"vision": False, "audio": False}, "build_info": f"bitnet-cpu {__version__}"}

    def not_served(why: str, path: str = ""):
        async def refuse(request: Request):   # a model's server's 501 (405 for POST /props), without loading a model
            status, headers = (405, {"Allow": "GET, HEAD"}) if path in READ_ONLY else (501, None)
            return Response(error_json(why, "not_supported_error", "not_supported", scope=request.scope,
                                       status=status), status_code=status, media_type="application/json",
                            headers=headers)
        return refuses_method(refuse) if path in READ_ONLY else refuse

    from .llama_api import LORA_WHY, NOT_SERVED, READ_ONLY, lora_request_is_empty
    for paths, why in NOT_SERVED.items():
        for path in paths:
            app.add_api_route(path, not_served(why, path), methods=["POST"], include_in_schema=False)

    @app.get("/lora-adapters", include_in_schema=False)
    async def lora_adapters():   # as a model's server answers: no adapters
        return []

    @app.post("/lora-adapters", include_in_schema=False)
    async def lora_scales(request: Request):
        if lora_request_is_empty(await request.body()):
            return {"success": True}
        return await not_served(LORA_WHY)(request)

    from .responses import STORED_RESPONSE_ROUTES, not_stored, refused_state

    async def response_not_stored(request: Request, response_id: str):   # as a model's server answers them (a
        # GET carries no model to route by: it was a 400 "model: required")
        raise RouterError(404, not_stored(response_id), "not_stored", "response_id")

    for path, methods in STORED_RESPONSE_ROUTES:
        app.add_api_route(path, response_not_stored, methods=methods)

    @app.get("/openapi.json")
    async def openapi_schema():   # a model's schema (it was a 400 "model: required" from the forwarder)
        return JSONResponse(await asyncio.to_thread(model_openapi))

    @app.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse)   # HEAD /: the ollama CLI's heartbeat
    async def page():
        from .app import page_response
        return page_response(webui)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"],
                   include_in_schema=False)
    async def forward(request: Request):
        if request.url.path in ("/health", "/v1/health", "/metrics") and request.method not in ("GET", "HEAD"):
            # their reads are the router's own (/metrics?model=); in the API's shape, as a model's server says it
            raise RouterError(405, f"{request.method} {request.url.path}: method not allowed", None,
                              allow=allow_header({"GET"}))
        if router.draining:
            raise RouterError(503, "shutting down", "unavailable", retry_after=router.retry_after)
        path = request.url.path
        methods = [m for rx, m in model_routes() if rx.match(path)]
        if not methods:   # no model serves it: never a model loaded (and another unloaded) for a stray request
            raise RouterError(404, f"{request.method} {path}: no such endpoint", "not_found")
        allowed = set().union(*methods)
        if "GET" in allowed:   # a model's server runs HEAD as GET (RouteNorms)
            allowed.add("HEAD")
        if request.method not in allowed:   # a model's server's 405, before any model is named or loaded
            raise RouterError(405, "Method Not Allowed", None, allow=allow_header(path_methods(request.scope)))
        data, body = await body_model(request)
        name = (data or {}).get("model")
        if name is None and path.startswith("/api/"):
            name = (data or {}).get("name")   # ollama's older clients name the model so
        name = request.query_params.get("model") if name is None else name
        if name is None and data is None and body and len(router.models) > 1:
            raise RouterError(400, body_problem(body), "invalid_json")
        await router.refresh()   # at most once a second: a file replaced or removed since is seen by its next request
        spec = await router.resolve(name)
        refused = refused_state(data) if data is not None and path.rstrip("/") in RESPONSES_PATHS else None
        if refused:   # the model's server's own 400, said before its model is loaded (and another unloaded for it)
            raise RouterError(400, refused[1], "unsupported_parameter", refused[0])
        keep_alive = None
        if data is not None and data.get("keep_alive") is not None and path.startswith("/api/"):
            try:
                keep_alive = parse_keep_alive(data["keep_alive"])
            except ValueError as e:
                raise RouterError(400, str(e), "invalid_value", "keep_alive") from None
            if keep_alive == 0 and path in ("/api/generate", "/api/chat") and \
                    not data.get("prompt") and not data.get("messages"):
                # ollama's unload request: an empty generate / chat with keep_alive 0
                await router.unload(spec)
                piece = {"response": ""} if path == "/api/generate" else {"message": {"role": "assistant",
                                                                                       "content": ""}}
                return {"model": spec.name, "created_at": utc_iso(), **piece, "done": True, "done_reason": "unload"}
        def set_keep_alive(c: Child):
            """ollama's: each request sets how long its model stays once idle, the default where it names none (a
            keep_alive 0 stayed in force for every later request); set when the request is admitted, before its
            model has loaded: an unload asked meanwhile came later and wins (it was overwritten once the load was
            done, and the model stayed loaded for ever). A request after an unload keeps the model, as its
            keep_alive says."""
            c.keep_alive = router.keep_alive if keep_alive is None else keep_alive
            c.unload_asked = False

        asked = time.monotonic()
        for attempt in range(2):
            try:   # a client gone while its model waits for room (or loads) takes its place in the queue with it
                c = await unless_gone(router.acquire(spec, load=request.method == "POST" and any(
                    "POST" in m for m in methods), admitted=set_keep_alive if request.method == "POST" else None),
                    request, lost=router.release)
            except ClientGone:
                return Response(status_code=499)
            if attempt == 0:
                router.count("requests", spec.name)
            since = c.log_size()   # what its process writes from here on may be about this request
            headers = [(k, v) for k, v in request.headers.raw if k.lower() not in REQUEST_DROP]
            headers.append((b"authorization", f"Bearer {router.key}".encode()))
            if c.ready_at > asked:   # it waited for its model's load: ollama's load_duration, which the model's
                # process puts in its answer (it knows nothing of the wait)
                headers.append((LOAD_WAIT_HEADER.encode(), str(int((c.ready_at - asked) * 1e9)).encode()))
            url = httpx.URL(c.url + path, query=request.url.query.encode())
            try:
                # a non-streamed answer's headers come when its work is done: a client that hangs up before then
                # closes the connection to the model's process (which cancels the work there), as a stream's does
                upstream = await unless_gone(router.client.send(router.client.build_request(
                    request.method, url, headers=headers, content=body), stream=True), request)
                break
            except ClientGone:
                router.release(c)
                return Response(status_code=499)
            except httpx.HTTPError as e:
                router.release(c)
                if attempt == 0 and isinstance(e, (httpx.NetworkError, httpx.RemoteProtocolError)) and \
                        await exited(c.proc):
                    # its process died while idle, its socket closed before the router saw the exit: nothing of
                    # the answer was sent, so the model is started again for it, once (it was a 502)
                    continue
                raise upstream_error(request, spec, e, router.retry_after) from None
            except BaseException:
                router.release(c)
                raise

        done = False

        def finish():
            nonlocal done
            if not done:
                done = True
                router.release(c, upstream)

        async def relay():
            tail, events = b"", 0   # the last bytes relayed; the SSE events (the Responses API numbers them)
            try:
                async for chunk in upstream.aiter_raw():
                    if chunk:
                        events += (tail[-1:] + chunk).count(b"\n\n")
                        tail = chunk[-2:]
                    yield chunk
            except httpx.HTTPError:   # its process died mid-answer (the reaper sees the exit): say so, then cut
                # with its reason where it said one as it exited (a model file changed under it: its one line,
                # exit 2), which was in the router's log only; never a line written before this request began
                # (another request's failure), nor any line when it was killed (it wrote none: how it ended)
                why = ""
                if await exited(c.proc):
                    code = c.proc.returncode
                    why = await asyncio.to_thread(c.log_tail, since) if code == EXIT_BAD_INPUT else ""
                    why = why or f"its process {exit_said(code)}"
                last = cut_answer_event(upstream.headers.get("content-type", ""),
                                        f"model '{spec.name}' stopped in the middle of this answer"
                                        + (f": {why}" if why else ""), tail, path, events)
                if last:
                    yield last
                raise UpstreamGone() from None
            finally:
                finish()

        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in RESPONSE_DROP}
        return Relay(relay(), finish, status_code=upstream.status_code, headers=out_headers)

    return app
