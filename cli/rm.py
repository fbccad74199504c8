"""`bitnet rm NAME... | --all`: delete converted stores from the engine's cache (names as `bitnet list` shows
them; a unique prefix or the recorded source, e.g. a hub id, also works). Source files are never touched."""
from __future__ import annotations

HELP = "remove converted models from the cache (NAME as `bitnet list` shows it, or --all)"


def add_arguments(p):
    p.add_argument("names", metavar="NAME", nargs="*", help="model name (or unique prefix, or its source)%(default).0s")
    p.add_argument("--all", action="store_true", help="remove every converted model in the cache%(default).0s")


def match(rows: list[dict], name: str) -> tuple[str, list[dict]]:
    """(how, rows) `name` designates: an exact name, else every conversion of that source (a hub id matches
    any revision, REPO:TAG the file of that quant tag, REPO every file of it), else the names it is a prefix of
    (the caller refuses an ambiguous prefix)."""
    from ..engine.formats.hub import hub_names

    for how, test in (("name", lambda r: r["name"] == name or r["name"] + ".bnstore" == name),
                      ("source", lambda r: r["source"] == name or name.lower() in hub_names(r["source"])),
                      ("prefix", lambda r: r["name"].startswith(name))):
        found = [r for r in rows if test(r)]
        if found:
            return how, found
    return "", []


def main(args) -> int:
    import os

    from .list import cached_stores, human_size
    from ..engine.formats.convert import cache_dir_default
    from ..engine.errors import BitNetError

    if args.all == bool(args.names):
        raise BitNetError("rm: give model NAMEs (see `bitnet list`) or --all, not both and not neither")
    rows = cached_stores()
    if args.all:
        chosen = rows
    else:
        chosen = []
        for name in args.names:
            how, found = match(rows, name)
            if not found:
                raise BitNetError(f"rm {name}: no such model in {cache_dir_default()}", hint="see `bitnet list`")
            if how == "prefix" and len(found) > 1:
                raise BitNetError(f"rm {name}: matches {len(found)} models ({', '.join(r['name'] for r in found)})",
                                  hint="give the full name")
            chosen += [r for r in found if r not in chosen]
    failed = []
    for r in chosen:   # one that cannot go (a directory, no permission) is said; the others still go
        try:
            if os.path.isdir(r["path"]) and not os.path.islink(r["path"]):
                raise IsADirectoryError(21, "a directory, not a converted model: left alone")
            os.remove(r["path"])
        except FileNotFoundError:
            pass
        except OSError as e:
            failed.append(f"{r['name']}: {e.strerror}")
            continue
        print(f"deleted {r['name']} ({human_size(r['size'])})")
    if not chosen:
        print("nothing to remove")
    if failed:
        raise BitNetError(f"rm: could not remove {'; '.join(failed)}")
    return 0
