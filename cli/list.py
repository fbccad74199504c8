"""`bitnet list`: the converted weight stores in the engine's cache ($BITNET_CACHE, else
$XDG_CACHE_HOME/bitnet): name (what `bitnet rm` takes), source (the file's full path, or the hub id), size, LM
head type, status (current, stale: its source changed since, or an older bitnet made it; source missing), last
used (the access time that engine.convert.mark_used sets on every use)."""
from __future__ import annotations

HELP = "list the converted models in the cache (name, source path or hub id, size, head, status, last used)"


def add_arguments(p):
    p.add_argument("--json", action="store_true", help="one JSON object per model, one per line%(default).0s")


def human_size(n: float) -> str:
    from ..engine.formats.describe import human_size as of_base

    return of_base(n, 1000)   # decimal units, as ollama lists models


def ago(seconds: float) -> str:
    s = max(0, int(seconds))
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if s >= size:
            k = s // size
            return f"{k} {unit}{'s' if k > 1 else ''} ago"
    return "just now"


def cached_stores(cache_dir: str | None = None) -> list[dict]:
    """One dict per *.bnstore in the cache: name, path, source (the label the store records: a file name or a hub
    id), source_path (the resolved path it was converted from, None for a store that does not record one), status
    (engine.formats.convert.cache_status), size, lm_head, last_used (mtime), error."""
    import os

    from ..engine.formats.convert import cache_dir_default, cache_status, source_label
    from ..engine.formats.store import Store

    d = cache_dir or cache_dir_default()
    try:
        files = sorted(f for f in os.listdir(d) if f.endswith(".bnstore"))
    except FileNotFoundError:
        return []
    except OSError as e:   # a file, or a directory this user cannot read: one line, not an internal error
        from ..engine.errors import FormatError
        raise FormatError(f"{d}: cannot read the cache directory: {e.strerror}",
                          hint="set BITNET_CACHE to a readable directory") from None
    out = []
    for f in files:
        path = os.path.join(d, f)
        try:
            st, why = os.stat(path), None
        except OSError as e:   # a dangling link (listed, so that `bitnet rm` can remove it), or gone since listdir
            try:
                st, why = os.lstat(path), f"unreadable: {e.strerror or e}"
            except OSError:
                continue
        row = {"name": f[: -len(".bnstore")], "path": path, "size": st.st_size,
               "last_used": max(st.st_atime, st.st_mtime), "source": "?", "source_path": None, "status": "unknown",
               "lm_head": "?", "error": why}
        if why:
            out.append(row)
            continue
        try:
            with Store(path) as s:
                row["source"] = source_label(s.meta)
                row["lm_head"] = s.meta.get("lm_head", "?")
                row["source_path"], row["status"] = cache_status(s.meta, path)
        except Exception as e:  # noqa: BLE001  (a damaged file is listed, so that `bitnet rm` can remove it)
            row["error"] = f"unreadable: {e}"
        out.append(row)
    return out


def main(args) -> int:
    import json
    import sys
    import time

    from ..engine.formats.convert import cache_dir_default

    rows = cached_stores()
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    if not rows:
        print(f"no converted models in {cache_dir_default()} (`bitnet run -m MODEL` or `bitnet pull REPO` adds one)",
              file=sys.stderr)
        return 0
    now = time.time()
    table = [("NAME", "SOURCE", "SIZE", "HEAD", "STATUS", "LAST USED")]
    for r in rows:   # a local source by its full path: the same file name in two folders is two sources
        source = r["source"] if "/" in r["source"] or not r["source_path"] else r["source_path"]
        table.append((r["name"], r["error"] or source, human_size(r["size"]), r["lm_head"],
                      "-" if r["error"] else r["status"], ago(now - r["last_used"])))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0
