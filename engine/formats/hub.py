"""Models by their Hugging Face hub id, through huggingface_hub's own cache API (never hand-parsed paths).

    REF = REPO[:FILE][@REVISION]      e.g. microsoft/bitnet-b1.58-2B-4T, microsoft/bitnet-b1.58-2B-4T-gguf:ggml-model-i2_s.gguf
    resolve_hub_ref(ref) -> (local path, source label)   # offline: what `huggingface-cli download` put in the cache
    pull(ref) -> local path                                 # online: download with huggingface_hub's progress bars

The cache is huggingface_hub's: HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub; revisions are
branch or tag names (resolved through the cache's refs) or commit hashes. A repository with config.json is an
HF model directory; one without (the `-gguf` repos) is used through its single .gguf file, or the FILE named.
The source label recorded in a converted store is REPO[:FILE]@COMMIT (nothing of this machine).
"""
from __future__ import annotations

import os
import re

from ..errors import BitNetError

# what a model needs from a repository (pull downloads only these; README, images, ... are skipped)
MODEL_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.jinja", "*.gguf"]
_REF = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)"
                  r"(?::(?P<file>[^@:]+))?(?:@(?P<rev>[A-Za-z0-9_./-]+))?$")


def parse_hub_ref(ref: str) -> tuple[str, str | None, str | None] | None:
    """(repo id, file or None, revision or None), or None when `ref` is not a hub id."""
    m = _REF.match(ref or "")
    if not m or ref.startswith(("./", "../")):
        return None
    if m.group("repo").endswith((".gguf", ".bnstore", ".safetensors")):   # a mistyped local path, not a repo
        return None
    return m.group("repo"), m.group("file"), m.group("rev")


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


def _not_cached(ref: str, repo: str) -> BitNetError:
    return BitNetError(f"-m/--model {ref}: no such file or directory here, and not downloaded into the "
                       f"Hugging Face cache ({hub_cache_dir()})",
                       hint=f"download it with `bitnet pull {ref}` (or `huggingface-cli download {repo}`)")


def _model_in_snapshot(ref: str, repo: str, snap: str) -> tuple[str, str | None]:
    """(path, file) of the model inside a snapshot folder: the folder itself (HF layout) or its .gguf file."""
    if os.path.isfile(os.path.join(snap, "config.json")):
        if not any(f.endswith(".safetensors") for f in os.listdir(snap)):
            raise BitNetError(f"-m/--model {ref}: the download in {snap} has config.json but no *.safetensors",
                              hint=f"finish it with `bitnet pull {repo}`")
        return snap, None
    ggufs = sorted(os.path.relpath(os.path.join(d, f), snap) for d, _, fs in os.walk(snap)
                   for f in fs if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(snap, ggufs[0]), ggufs[0]
    if not ggufs:
        raise BitNetError(f"-m/--model {ref}: the download in {snap} holds neither config.json nor a .gguf file",
                          hint=f"download the model files with `bitnet pull {repo}`")
    raise BitNetError(f"-m/--model {ref}: {len(ggufs)} GGUF files in that download ({', '.join(ggufs)})",
                      hint=f"pick one: -m {repo}:{ggufs[0]}")


def resolve_hub_ref(ref: str) -> tuple[str, str]:
    """(local path of the model, source label) for a hub id already in the local cache; never the network."""
    parsed = parse_hub_ref(ref)
    if parsed is None:
        raise BitNetError(f"-m/--model {ref}: not a Hugging Face hub id (REPO[:FILE][@REVISION])")
    repo, file, rev = parsed
    try:
        from huggingface_hub import hf_hub_download, snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        raise BitNetError(f"-m/--model {ref}: looks like a hub id but huggingface_hub is not installed",
                          hint="pip install huggingface_hub") from None
    try:
        if file:
            path = hf_hub_download(repo, file, revision=rev, local_files_only=True)
            return path, _label(repo, file, path)
        snap = snapshot_download(repo, revision=rev, local_files_only=True)
    except LocalEntryNotFoundError:
        raise _not_cached(ref, repo) from None
    except HFValidationError as e:
        raise BitNetError(f"-m/--model {ref}: not a valid hub id ({e})") from None
    path, found = _model_in_snapshot(ref, repo, snap)
    return path, _label(repo, found, snap)


# ---- downloading --------------------------------------------------------------------------------------------
def _offline_reason(e: BaseException) -> str | None:
    """Why the hub could not be reached, when `e` says so (None: some other failure)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    if constants.HF_HUB_OFFLINE or isinstance(e, OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set, so nothing is downloaded (unset it to download)"
    seen, cur = set(), e
    while cur is not None and id(cur) not in seen:  # the connection error is usually a cause of the hub's error
        seen.add(id(cur))
        name = type(cur).__name__
        if name in ("ConnectError", "ConnectTimeout", "ConnectionError", "NetworkError", "ReadTimeout",
                    "TimeoutException", "ProxyError") or isinstance(cur, (ConnectionError, TimeoutError)):
            return f"cannot reach {constants.ENDPOINT} ({name})"
        cur = cur.__cause__ or cur.__context__
    if isinstance(e, LocalEntryNotFoundError):
        return f"cannot reach {constants.ENDPOINT}"
    return None


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


def pull(ref: str) -> str:
    """Download REPO[:FILE][@REV] into the hub cache (huggingface_hub's progress bars on stderr); returns the
    local path. Raises BitNetError with one clear line when offline, or when the repo/file/revision is unknown."""
    parsed = parse_hub_ref(ref)
    if parsed is None:
        raise BitNetError(f"pull {ref}: not a Hugging Face hub id", hint="e.g. bitnet pull microsoft/bitnet-b1.58-2B-4T")
    repo, file, rev = parsed
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError, HFValidationError,
                                        LocalEntryNotFoundError, OfflineModeIsEnabled, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    def offline(e, reason=None):
        return BitNetError(f"pull {ref}: offline: {reason or _offline_reason(e) or 'the hub cannot be reached'}",
                           hint="models already downloaded still run: `bitnet list`, `bitnet run -m REPO`")

    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        reason = _unreachable(constants.ENDPOINT)
        if reason:
            try:   # already downloaded: that copy is what the user wants
                return resolve_hub_ref(ref)[0]
            except BitNetError:
                raise offline(None, reason) from None

    try:
        if file:
            return hf_hub_download(repo, file, revision=rev)
        return snapshot_download(repo, revision=rev, allow_patterns=MODEL_PATTERNS)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:   # not cached, and the hub out of reach
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
        if _offline_reason(e) is None:
            first = str(e).splitlines()[0] if str(e) else ""
            raise BitNetError(f"pull {ref}: download failed: {type(e).__name__}: {first}") from None
        raise offline(e) from None
