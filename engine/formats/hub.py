"""Models by their Hugging Face hub id, through huggingface_hub's own cache API (never hand-parsed paths).

    REF = REPO[:FILE|:TAG][@REVISION] e.g. microsoft/bitnet-b1.58-2B-4T, microsoft/bitnet-b1.58-2B-4T-gguf:ggml-model-i2_s.gguf,
                                      microsoft/bitnet-b1.58-2B-4T-gguf:i2_s (a quant tag, as ollama's hf.co/REPO:TAG)
    resolve_hub_ref(ref) -> (local path, source label)   # offline: what `huggingface-cli download` put in the cache
    pull(ref) -> local path                                 # online: download with huggingface_hub's progress bars

The cache is huggingface_hub's: HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub; revisions are
branch or tag names (resolved through the cache's refs) or commit hashes. A repository with config.json is an
HF model directory; one without (the `-gguf` repos) is used through its single .gguf file, or the FILE named, or
the .gguf file whose name ends in -TAG (any case; `latest` is no tag, as in ollama).
The source label recorded in a converted store is REPO[:FILE]@COMMIT (nothing of this machine).
"""
from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import shlex
import time
from typing import Callable

from ..errors import BitNetError

# what an HF-layout model needs from a repository (pull downloads only these; README, images, GGUF files, ... are
# skipped); a GGUF model is its one file
HF_DIR_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.jinja"]
_REF = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)"
                  r"(?::(?P<file>[^@:]+))?(?:@(?P<rev>[A-Za-z0-9_./-]+))?")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def control_character(ref: str) -> str | None:
    """The first control character of `ref` (a newline, a tab, an escape), as a message shows it, or None: a hub
    id never holds one (ollama refuses such a name too); a trailing newline was taken as the id without it."""
    m = _CONTROL.search(ref) if isinstance(ref, str) else None
    return repr(m.group())[1:-1] if m else None


def parse_hub_ref(ref: str) -> tuple[str, str | None, str | None] | None:
    """(repo id, file or None, revision or None), or None when `ref` is not a hub id."""
    m = _REF.fullmatch(ref or "")   # fullmatch: `$` let a trailing newline through
    if not m or ref.startswith(("./", "../")) or control_character(ref):
        return None
    if m.group("repo").endswith((".gguf", ".bnstore", ".safetensors")):   # a mistyped local path, not a repo
        return None
    file = m.group("file")
    if file is not None and file.lower() == "latest":   # ollama's default tag: no particular file
        file = None
    return m.group("repo"), file, m.group("rev")


def _check_parts(what: str, file: str | None, rev: str | None) -> None:
    """FILE of REPO:FILE and REVISION of REPO@REVISION that name no file, branch, tag or commit, refused in one
    line: an absolute, drive, UNC or backslash path, a `..` segment (a `.` one too in a revision). huggingface_hub
    refuses them as well, but with a ValueError (FILE) or an IsADirectoryError (refs/.. of its cache) that read as
    a bug here."""
    if file and (file.startswith("/") or "\\" in file or re.match(r"[A-Za-z]:", file) or ".." in file.split("/")):
        raise BitNetError(f"{what}: the file part {file!r} is a path, not a file of the repository",
                          hint="name a file as the repository lists it, e.g. REPO:model.gguf or REPO:i2_s")
    if rev and (rev.startswith("/") or "\\" in rev or any(p in (".", "..") for p in rev.split("/"))):
        raise BitNetError(f"{what}: the revision {rev!r} is a path, not a branch, tag or commit",
                          hint="name a revision as the repository has it, e.g. REPO@main, REPO@v1.0 or a commit hash")


# ---- quant tags: REPO:TAG names the GGUF file of that quantization, as ollama's hf.co/OWNER/REPO:TAG does ----
_SHARD = re.compile(r"-\d{5}-of-\d{5}$")


def is_quant_tag(file: str | None) -> bool:
    """FILE of REPO:FILE is a quant tag (TQ2_0, i2_s, Q4_K_M) rather than a file name: it has no dot or slash."""
    return bool(file) and "." not in file and "/" not in file


def quant_tag(filename: str) -> str | None:
    """The tag of a GGUF file: the last `-` or `.` separated part of its name (ggml-model-i2_s.gguf -> i2_s,
    Falcon3-1B-Instruct-1.58bit-TQ2_0.gguf -> TQ2_0); None for other files."""
    base = os.path.basename(filename)
    if not base.lower().endswith(".gguf"):
        return None
    stem = _SHARD.sub("", base[: -len(".gguf")])
    return re.split(r"[-.]", stem)[-1] or None


def _tag_list(ggufs: list[str]) -> list[str]:
    return sorted({t for t in map(quant_tag, ggufs) if t}, key=str.lower)


def _tags(ggufs: list[str]) -> str:
    return ", ".join(_tag_list(ggufs))


def _first(repo: str, ggufs: list[str]) -> str:
    """REPO:TAG of the first tag (by name) that picks one model, for a hint; else REPO:FILE. Tags match in any
    case, so a tag that two files hold in different cases (i2_s, I2_S) picks neither: the file is named."""
    for tag in _tag_list(ggufs):
        hits = [f for f in ggufs if (quant_tag(f) or "").lower() == tag.lower()]
        if len(hits) == 1 or _one_split_set(hits) is not None:
            return f"{repo}:{tag}"
    return f"{repo}:{ggufs[0]}"


def split_parts(file: str, files: list[str]) -> list[str]:
    """The parts of the split GGUF whose first part is `file` (llama.cpp's gguf-split names, as engine/formats/gguf.py
    reads them) found in `files`, in order; [file] for a file that is not a first part."""
    from .gguf import SPLIT_NAME, split_part   # here: the module (numpy) only where a split is looked at

    m = SPLIT_NAME.match(file)
    if m is None or m.group(2) != "00001":
        return [file]
    listed = set(files)
    return [p for p in (split_part(file, i) for i in range(1, int(m.group(3)) + 1)) if p in listed]


def _one_split_set(ggufs: list[str]) -> str | None:
    """The first part, when `ggufs` (sorted) are exactly the parts of one split GGUF, every one of them (else None)."""
    from .gguf import SPLIT_NAME

    m = SPLIT_NAME.match(ggufs[0]) if len(ggufs) > 1 else None
    return ggufs[0] if m and len(ggufs) == int(m.group(3)) and split_parts(ggufs[0], ggufs) == ggufs else None


def _split_gap(ggufs: list[str]) -> tuple[str, int, int] | None:
    """(first part's name, the number of the first part missing, the part count) when `ggufs` are some but not all
    parts of one split GGUF (a download cut short); else None."""
    from .gguf import SPLIT_NAME

    ms = [SPLIT_NAME.match(f) for f in ggufs]
    if not ms or None in ms or len({(m.group(1), m.group(3)) for m in ms}) != 1:
        return None
    count, have = int(ms[0].group(3)), {int(m.group(2)) for m in ms}
    missing = [i for i in range(1, count + 1) if i not in have]
    return (f"{ms[0].group(1)}-00001-of-{ms[0].group(3)}.gguf", missing[0], count) if missing else None


def _lacks_part(what: str, where: str, gap: tuple[str, int, int], hint: str | None) -> BitNetError:
    first, no, count = gap
    return BitNetError(f"{what}: the split GGUF {first}{where} lacks part {no} of {count}", hint=hint)


def gguf_for_tag(what: str, repo: str, tag: str, files: list[str], where: str = "", hint: str | None = None) -> str:
    """The one GGUF file of `files` (a repository's, or a snapshot's) whose quant tag is `tag` (any case).
    Errors start with `what` (the command and its argument) and say `where` the files were looked for."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    hits = [f for f in ggufs if (quant_tag(f) or "").lower() == tag.lower()]
    if len(hits) == 1:
        return hits[0]
    first = _one_split_set(hits)
    if first is not None:   # one model in parts: its first part names it (the engine reads the rest beside it)
        return first
    gap = _split_gap(hits)
    if gap is not None:   # some parts of one model: which is not there, not "name the file" (a circle)
        raise _lacks_part(what, f" ({repo}{where})", gap, hint)
    if not hits:
        raise BitNetError(f"{what}: no GGUF file of {repo}{where} has the tag {tag!r}" +
                          (f" (tags: {_tags(ggufs)})" if ggufs else " (no .gguf file at all)"),
                          hint=hint or (f"name one: {_first(repo, ggufs)}" if ggufs else None))
    raise BitNetError(f"{what}: {len(hits)} GGUF files of {repo}{where} have the tag {tag!r} ({', '.join(hits)})",
                      hint=f"name the file: {repo}:{hits[0]}")


def hub_names(label: str) -> list[str]:
    """The hub ids that name a store converted from `label` (REPO[:FILE]@COMMIT, `bitnet list`'s SOURCE), in
    lower case: REPO:FILE, REPO:TAG for a GGUF file with a quant tag, and REPO alone."""
    parsed = parse_hub_ref(label or "")
    if parsed is None:
        return []
    repo, file, _ = parsed
    names = [f"{repo}:{file}"] if file else []
    if file and quant_tag(file):
        names.append(f"{repo}:{quant_tag(file)}")
    return [n.lower() for n in names + [repo]]


def is_hub_ref(ref: str) -> bool:
    """A string that names a hub repository rather than a path on this machine (callers check the path first)."""
    return parse_hub_ref(ref) is not None


def hub_cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _label(repo: str, file: str | None, path: str) -> str:
    """REPO[:FILE]@COMMIT: the commit is the snapshot folder the cache API returned."""
    parts = os.path.normpath(path).split(os.sep)
    commit = parts[parts.index("snapshots") + 1][:12] if "snapshots" in parts[:-1] else None
    return f"{repo}{':' + file if file else ''}{'@' + commit if commit else ''}"


class NotDownloaded(BitNetError):
    """The hub id (or its quant tag) is not in the local cache: `bitnet pull` would fetch it."""


class Unfinished(BitNetError):
    """The hub id's download is in the cache, but not all of it (a pull cut short): `bitnet pull` would finish it."""


def _pull_hint(do: str, ref: str, tail: str = "") -> str:
    """"DO with `bitnet pull REF`", the name quoted for a shell; with HF_HUB_OFFLINE set, that the pull needs it
    unset first (offline, the pull cannot do what the hint says: it pointed back at the command just run)."""
    from huggingface_hub import constants

    hint = f"{do} with `bitnet pull {shlex.quote(ref)}`{tail}"
    return f"unset HF_HUB_OFFLINE, then {hint}" if constants.HF_HUB_OFFLINE else hint


def _not_cached(what: str, ref: str, repo: str) -> BitNetError:
    return NotDownloaded(f"{what}: no such file or directory here, and not downloaded into the "
                         f"Hugging Face cache ({hub_cache_dir()})",
                         hint=_pull_hint("download it", ref, f" (or `huggingface-cli download {shlex.quote(repo)}`)"))


def _model_in_snapshot(what: str, repo: str, snap: str) -> tuple[str, str | None]:
    """(path, file) of the model inside a snapshot folder: the folder itself (HF layout) or its .gguf file."""
    if os.path.isfile(os.path.join(snap, "config.json")):
        if not any(f.endswith(".safetensors") for f in os.listdir(snap)):
            raise Unfinished(f"{what}: the download in {snap} has config.json but no *.safetensors",
                              hint=_pull_hint("finish it", repo))
        from .safetensors_io import INDEX, index_shards   # here: numpy only where an HF download is looked at

        if os.path.isfile(os.path.join(snap, INDEX)):
            shards = index_shards(snap)   # a broken index: the loader's own words, before any shard is looked for
            missing = [f for f in shards if not os.path.exists(os.path.join(snap, f))]
            if missing:
                raise Unfinished(f"{what}: the download in {snap} lacks {len(missing)} of its {len(shards)} "
                                  f"weight files ({missing[0]}{', ...' if len(missing) > 1 else ''})",
                                  hint=_pull_hint("finish it", repo))
        return snap, None
    ggufs = sorted(os.path.relpath(os.path.join(d, f), snap) for d, _, fs in os.walk(snap)
                   for f in fs if f.endswith(".gguf"))
    gap = _split_gap(ggufs)
    if gap is not None:   # a download cut short: the engine would say so only after a tag and a file name were picked
        e = _lacks_part(what, f" in the download in {snap}", gap, _pull_hint("finish it", repo))
        raise Unfinished(e.args[0], hint=e.hint)
    one = ggufs[0] if len(ggufs) == 1 else _one_split_set(ggufs)   # a split GGUF: its first part
    if one is not None:
        return os.path.join(snap, one), one
    if not ggufs:
        raise Unfinished(f"{what}: the download in {snap} holds neither config.json nor a .gguf file",
                          hint=_pull_hint("download the model files", repo))
    how = "bitnet pull" if what.startswith("pull ") else "-m"
    raise BitNetError(f"{what}: {len(ggufs)} GGUF files in that download ({', '.join(ggufs)})",
                      hint=f"pick one by its tag ({_tags(ggufs)}): {how} {shlex.quote(_first(repo, ggufs))}")


def _snapshot_files(snap: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), snap) for d, _, fs in os.walk(snap) for f in fs)


def resolve_hub_ref(ref: str, what: str | None = None) -> tuple[str, str]:
    """(local path of the model, source label) for a hub id already in the local cache; never the network.
    Errors start with `what` (default: `-m/--model REF`); NotDownloaded where the cache lacks it."""
    what = what or f"-m/--model {ref}"
    parsed = parse_hub_ref(ref)
    if parsed is None:
        raise BitNetError(f"{what}: not a Hugging Face hub id (REPO[:FILE|:TAG][@REVISION])")
    repo, file, rev = parsed
    _check_parts(what, file, rev)
    try:
        from huggingface_hub import hf_hub_download, snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        raise BitNetError(f"{what}: looks like a hub id but huggingface_hub is not installed",
                          hint="pip install huggingface_hub") from None
    try:
        if file and not is_quant_tag(file):
            path = hf_hub_download(repo, file, revision=rev, local_files_only=True)
            return path, _label(repo, file, path)
        snap = snapshot_download(repo, revision=rev, local_files_only=True)
    except LocalEntryNotFoundError as e:
        # huggingface_hub 2.x refuses a snapshot that holds fewer files than the repository lists (README, other
        # quantizations: what `pull` skips) and names the folder: what it holds is checked below
        snap = getattr(e, "snapshot_path", None)
        if not snap or not os.path.isdir(snap):
            raise _not_cached(what, ref, repo) from None
    except HFValidationError as e:
        raise BitNetError(f"{what}: not a valid hub id ({e})") from None
    if file:   # a quant tag: the file of that tag among those downloaded
        try:
            found = gguf_for_tag(what, repo, file, _snapshot_files(snap), " downloaded here",
                                 hint=_pull_hint("download it", ref))
        except BitNetError as e:
            raise NotDownloaded(str(e.args[0]), hint=e.hint) from None
        return os.path.join(snap, found), _label(repo, found, snap)
    path, found = _model_in_snapshot(what, repo, snap)
    return path, _label(repo, found, snap)


# ---- downloading --------------------------------------------------------------------------------------------
def _cause(e: BaseException, test: Callable[[BaseException], bool]) -> BaseException | None:
    """The first of `e` and its causes that passes `test`."""
    seen, cur = set(), e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if test(cur):
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def _offline_reason(e: BaseException) -> str | None:
    """Why the hub could not be reached, when `e` says so (None: some other failure)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    if constants.HF_HUB_OFFLINE or isinstance(e, OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set, so nothing is downloaded (unset it to download)"
    names = ("ConnectError", "ConnectTimeout", "ConnectionError", "NetworkError", "ReadTimeout", "TimeoutException",
             "ProxyError")   # the connection error is usually a cause of the hub's error
    unreachable = _cause(e, lambda c: type(c).__name__ in names or isinstance(c, (ConnectionError, TimeoutError)))
    if unreachable is not None:
        return f"cannot reach {constants.ENDPOINT} ({type(unreachable).__name__})"
    if isinstance(e, LocalEntryNotFoundError) and _http_failure(e) is None:   # a 429 / 500 is an answer
        return f"cannot reach {constants.ENDPOINT}"
    return None


def _http_failure(e: BaseException) -> tuple[int, str] | None:
    """(status, what the hub said) when `e` or one of its causes is an HTTP answer of the hub (huggingface_hub
    wraps a 429 or a 500 on a file in LocalEntryNotFoundError, which read as "cannot reach"), else None."""
    def status(c):
        return getattr(getattr(c, "response", None), "status_code", None)
    cur = _cause(e, lambda c: isinstance(status(c), int) and status(c) >= 400)
    if cur is None:
        return None
    said = getattr(cur, "server_message", None) or ""
    reason = getattr(cur.response, "reason_phrase", None) or getattr(cur.response, "reason", None) or ""
    return status(cur), " ".join(x for x in (reason, f"({said.strip()})" if said.strip() else "") if x)


def _http_error(ref: str, status: int, said: str) -> BitNetError:
    """One line for the hub's HTTP answer, with what to do about the usual ones."""
    hint = {401: "check HF_TOKEN (or `huggingface-cli login`): the hub did not take the token sent",
            403: "the token has no access to this repository (accept its terms on the hub, or check HF_TOKEN)",
            429: "the hub limits requests: wait a little and pull again (logged in, the limit is higher)"}.get(
        status, "the hub's own trouble: pull again later" if status >= 500 else None)
    return BitNetError(f"pull {ref}: the hub answered {status}" + (f" {said}" if said else ""), hint=hint)


def _unreachable(endpoint: str, timeout: float = 5.0) -> str | None:
    """Why a TCP connection to the hub endpoint fails (None: it connects, or a proxy is in the way so only the
    download itself can tell). Probed once so that an offline machine gets its answer at once, rather than
    after huggingface_hub's retries with backoff."""
    import socket
    from urllib.parse import urlsplit

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                                       "all_proxy")):
        return None
    u = urlsplit(endpoint)
    if not u.hostname:
        return None
    try:
        socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout=timeout).close()
    except OSError as e:
        return f"cannot reach {endpoint} ({e.strerror or type(e).__name__})"
    return None


def _file_to_pull(ref: str, repo: str, tag: str | None, files: list[str]) -> str | None:
    """What `pull` downloads from a repository holding `files`: the GGUF file of the quant tag, else the one GGUF
    file of a repository without config.json, else None (the HF layout, as a snapshot). A repository of several
    GGUF files and no tag is refused before anything is downloaded, naming its tags."""
    if tag:
        return gguf_for_tag(f"pull {ref}", repo, tag, files)
    if "config.json" in files:
        return None
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    one = ggufs[0] if len(ggufs) == 1 else _one_split_set(ggufs)   # a split GGUF: its first part
    if one is not None:
        return one
    if not ggufs:
        raise BitNetError(f"pull {ref}: {repo} holds neither config.json nor a .gguf file")
    raise BitNetError(f"pull {ref}: {repo} holds {len(ggufs)} GGUF files (tags: {_tags(ggufs)})",
                      hint=f"pick one: bitnet pull {shlex.quote(_first(repo, ggufs))}")


class _NullFile:
    def write(self, text):
        pass

    def flush(self):
        pass


def _reporting_bar(report: Callable[[int, int], None]):
    """A tqdm class for huggingface_hub's `tqdm_class` (its documented hook) that draws nothing and hands the byte
    count to report(completed, total), at most 4 times a second and at the end. Several byte bars of one
    download (a snapshot's transfer and reconstruction) report their furthest count."""
    import threading

    from tqdm.auto import tqdm

    state = {"sent": 0.0, "done": 0}
    lock = threading.Lock()   # a snapshot's files come down on several threads

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            kwargs.update(disable=False, file=_NullFile())
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            out = super().update(n)
            if self.unit == "B" and self.total:
                with lock:
                    state["done"] = max(state["done"], int(self.n))
                    now = time.monotonic()
                    if now - state["sent"] >= 0.25 or state["done"] >= self.total:
                        state["sent"] = now
                        report(min(state["done"], int(self.total)), int(self.total))
            return out

    return Bar


def _verify(ref: str, path: str, files: dict, cached: frozenset = frozenset()) -> list[str]:
    """Each downloaded file whose listing gives a sha256 (its LFS object) has those bytes, as ollama checks every
    blob; one that differs (a proxy's page, a download cut and resumed wrong) is deleted, so the next pull fetches
    it again (huggingface_hub keeps it under the expected name: pulling again said "downloaded" over the same bad
    bytes), and is one error. `path`: the file itself, or the snapshot directory holding `files`. A file of
    `cached` (in the download cache before this pull: nothing came down) that differs is deleted and said on
    stderr, and its name returned, for the pull to download it again."""
    import hashlib
    import sys

    again = []
    for name, entry in files.items():
        want = getattr(getattr(entry, "lfs", None), "sha256", None)
        local = path if os.path.isfile(path) else os.path.join(path, name)
        if not want or not os.path.exists(local):
            continue
        h = hashlib.sha256()
        with open(local, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        if h.hexdigest() != want:
            for p in {os.path.realpath(local), local}:   # the blob and the snapshot's link to it
                with contextlib.suppress(OSError):
                    os.remove(p)
            if name in cached:
                print(f"bitnet: pull {ref}: the copy of {name} in the download cache is damaged (sha256 "
                      f"{h.hexdigest()[:12]}, expected {want[:12]}): downloading it again", file=sys.stderr)
                again.append(name)
                continue
            raise BitNetError(f"pull {ref}: {name} came down with other bytes than the hub lists (sha256 "
                              f"{h.hexdigest()[:12]}, expected {want[:12]}): deleted",
                              hint="pull again; if it repeats, a proxy or the network alters the download")
    return again


def _checked(download, verify, cached: frozenset):
    """download(), its files verified (verify(got, cached): _verify's list of damaged copies the download cache
    held): those are deleted, and everything is downloaded once again, where bad bytes are then an error."""
    got = download()
    if verify(got, cached):
        got = download()
        verify(got, frozenset())
    return got


def _in_cache(repo: str, names, rev: str | None) -> frozenset:
    """The names of `names` that the download cache already holds for `repo` at `rev` (a pull downloads none of
    them: huggingface_hub takes the cached copy as it is)."""
    from huggingface_hub import try_to_load_from_cache

    found = set()
    for name in names:
        with contextlib.suppress(Exception):   # noqa: BLE001  (not cached, or a cache it cannot read)
            path = try_to_load_from_cache(repo, name, revision=rev)
            if isinstance(path, str) and os.path.exists(path):
                found.add(name)
    return frozenset(found)


@contextlib.contextmanager
def _quiet():
    """huggingface_hub's own warnings ("Not enough free disk space ...", with their source line) and its retry
    logging ("HTTP Error 500 thrown while requesting HEAD ...", "Retrying in 8s [Retry 5/5].") kept off stderr:
    what went wrong is the pull's one line."""
    import logging
    import warnings

    from huggingface_hub.utils import logging as hf_logging   # its loggers, set up as huggingface_hub sets them

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"huggingface_hub(\.|$)")
            yield
    finally:
        hf_logging.set_verbosity(level)


def _free(path: str) -> int | None:
    """Free bytes on the file system that holds `path` (or its nearest existing parent)."""
    import shutil

    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _failed(ref: str, repo: str, file: str | None, e: BaseException, need: int, free: int | None) -> BitNetError | None:
    """Our own line for a download failure that huggingface_hub says in its words (None: no such failure)."""
    import errno

    if _cause(e, lambda c: isinstance(c, OSError) and c.errno == errno.ENOSPC) is not None:
        mb = lambda n: f"{n / 1e6:.2f} MB"   # noqa: E731
        sizes = f" (need {mb(need)}, {mb(free)} free before the download)" if need and free is not None else ""
        return BitNetError(f"pull {ref}: no space left on device in {hub_cache_dir()}{sizes}",
                           hint="free some space, or set HF_HUB_CACHE to a disk with room")
    bad = _cause(e, lambda c: "Consistency check failed" in str(c))
    m = re.search(r"should be of size (\d+) but has size (\d+)", str(bad)) if bad is not None else None
    if m:
        return BitNetError(f"pull {ref}: the hub answered {file or repo} with {m.group(2)} bytes, not the "
                           f"{m.group(1)} it lists: a page (a proxy's or a login page?) instead of the file",
                           hint="check HF_ENDPOINT and the proxy settings, or sign in to the network")
    if _cause(e, lambda c: type(c).__name__ == "JSONDecodeError") is not None:
        return BitNetError(f"pull {ref}: the hub answered the listing of {repo} with something that is not JSON: "
                           "a page (a proxy's or a login page?) instead of the hub's answer",
                           hint="check HF_ENDPOINT and the proxy settings, or sign in to the network")
    return None


def _with_bar(fn, progress, **kwargs):
    """fn(**kwargs), with tqdm_class reporting to `progress` where this huggingface_hub takes one."""
    import inspect

    if progress is not None and "tqdm_class" in inspect.signature(fn).parameters:
        kwargs["tqdm_class"] = _reporting_bar(progress)
    return fn(**kwargs)


def pull(ref: str, progress: Callable[[dict], None] | None = None) -> str:
    """Download REPO[:FILE|:TAG][@REV] into the hub cache (huggingface_hub's progress bars on stderr): the
    repository is listed first, then the one GGUF file (of the tag), or the HF layout's files; returns the
    local path. Raises BitNetError with one clear line when offline, or when the repo/file/revision is unknown.
    progress: called instead of the bars with {"file", "digest", "completed", "total"} as bytes arrive (digest:
    the file's sha256 where the hub lists one, else its name; a whole snapshot is one item named by REPO)."""
    with _quiet():
        return _pull(ref, progress)


def _pull(ref: str, progress: Callable[[dict], None] | None) -> str:
    parsed, bad = parse_hub_ref(ref), control_character(ref)
    if bad:
        raise BitNetError(f"pull {ref!r}: not a Hugging Face hub id: it holds a control character ({bad})",
                          hint="check how the name was quoted or pasted")
    if parsed is None:
        raise BitNetError(f"pull {ref}: not a Hugging Face hub id", hint="e.g. bitnet pull microsoft/bitnet-b1.58-2B-4T")
    repo, file, rev = parsed
    _check_parts(f"pull {ref}", file, rev)
    from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError, HFValidationError,
                                        LocalEntryNotFoundError, OfflineModeIsEnabled, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    def offline(e, reason=None):
        # what works offline, never this same pull (nor `run -m REPO`, which sends the user back to it)
        local = "offline, `bitnet run -m` takes a local model file or folder, or a hub id already downloaded in full"
        hint = f"{local}; unset HF_HUB_OFFLINE to download this one" if constants.HF_HUB_OFFLINE else \
            f"{local} (HF_HUB_OFFLINE=1 skips the network); pull again once {constants.ENDPOINT} can be reached"
        return BitNetError(f"pull {ref}: offline: {reason or _offline_reason(e) or 'the hub cannot be reached'}",
                           hint=hint)

    reason = _offline_reason(OfflineModeIsEnabled()) if constants.HF_HUB_OFFLINE else _unreachable(constants.ENDPOINT)
    if reason:
        try:   # already downloaded: that copy is what the user wants
            return resolve_hub_ref(ref, what=f"pull {ref}")[0]
        except NotDownloaded:
            raise offline(None, reason) from None
        except Unfinished as e:   # it said "finish it with `bitnet pull REPO`": this very pull, which cannot
            raise offline(None, f"{reason}, and {e.args[0].removeprefix(f'pull {ref}: ')}") from None

    free, need = _free(hub_cache_dir()), [0]
    try:
        listed = {f.path: f for f in HfApi().list_repo_tree(repo, revision=rev, recursive=True)
                  if hasattr(f, "size")}   # files, not folders
        if file is None or is_quant_tag(file):
            file = _file_to_pull(ref, repo, file, list(listed))
        elif file not in listed:
            raise BitNetError(f"pull {ref}: {repo} has no file {file!r}")
        name = file or repo
        lfs = getattr(listed.get(file), "lfs", None) if file else None
        digest = f"sha256:{lfs.sha256}" if lfs is not None and getattr(lfs, "sha256", None) else name
        # a snapshot's bar grows as its files are found: the listing's size of what comes down is the total
        # from the first report on (a client sizes its bar by the first one)
        def report(done, total):
            total = (0 if file else need[0]) or total
            progress({"file": name, "digest": digest, "completed": min(done, total), "total": total})

        report = None if progress is None else report
        if file:   # a split GGUF comes down whole: every part, the first one's path naming the model
            parts = split_parts(file, list(listed))
            cached = _in_cache(repo, parts, rev)
            need[0] = sum(getattr(listed.get(p), "size", 0) or 0 for p in parts if p not in cached)
            paths = _checked(lambda: [_with_bar(hf_hub_download, report, repo_id=repo, filename=part, revision=rev)
                                      for part in parts],
                             lambda paths, cached: [n for part, path in zip(parts, paths)
                                                    for n in _verify(ref, path, {part: listed.get(part)}, cached)],
                             cached)
            return paths[0]
        took = {name: f for name, f in listed.items()   # the files snapshot_download takes
                if any(fnmatch.fnmatch(name, pat) for pat in HF_DIR_PATTERNS)}
        cached = _in_cache(repo, took, rev)
        need[0] = sum(getattr(f, "size", 0) or 0 for n, f in took.items() if n not in cached)
        return _checked(lambda: _with_bar(snapshot_download, report, repo_id=repo, revision=rev,
                                          allow_patterns=HF_DIR_PATTERNS),
                        lambda path, cached: _verify(ref, path, took, cached), cached)
    except BitNetError:
        raise
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:   # not cached, and the hub out of reach
        failed = _http_failure(e)
        if failed is not None:   # or it answered, with an error status (a rate limit, its own 500)
            raise _http_error(ref, *failed) from None
        raise offline(e) from None
    except GatedRepoError:
        raise BitNetError(f"pull {ref}: the repository is gated", hint="accept its terms on the hub and log in "
                          "with `huggingface-cli login`") from None
    except RepositoryNotFoundError:
        raise BitNetError(f"pull {ref}: no such repository on the hub (or it is private)") from None
    except RevisionNotFoundError:
        raise BitNetError(f"pull {ref}: no revision {rev!r} in {repo}") from None
    except EntryNotFoundError:
        raise BitNetError(f"pull {ref}: {repo} has no file {file!r}") from None
    except HFValidationError as e:
        raise BitNetError(f"pull {ref}: not a valid hub id ({e})") from None
    except (HfHubHTTPError, OSError, Exception) as e:  # noqa: BLE001  (network layers raise many types)
        failed = _http_failure(e)
        if failed is not None:
            raise _http_error(ref, *failed) from None
        ours = _failed(ref, repo, file, e, need[0], free)
        if ours is not None:
            raise ours from None
        if _offline_reason(e) is None:
            first = str(e).splitlines()[0] if str(e) else ""
            raise BitNetError(f"pull {ref}: download failed: {type(e).__name__}: {first}") from None
        raise offline(e) from None
