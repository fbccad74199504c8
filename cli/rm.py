"""`bitnet rm NAME... [--all] | --all | --stale`: delete converted stores from the engine's cache (names as `bitnet
list` shows them; a unique prefix, the source's path, or the recorded source, e.g. a hub id, also works). A file
name that stores of files in several folders record is refused, naming them: the store's name picks one, --all
takes every one. --stale removes the stores `bitnet list` marks stale or source missing. Source files are never
touched."""
from __future__ import annotations

HELP = ("remove converted models from the cache (NAME as `bitnet list` shows it, --all, or --stale for those whose "
        "source changed or is gone)")
STALE = ("stale", "source missing")


def add_arguments(p):
    p.add_argument("names", metavar="NAME", nargs="*",
                   help="model name (or unique prefix, the source's path, or its source: a file name or hub id)"
                        "%(default).0s")
    p.add_argument("--all", action="store_true",
                   help="remove every converted model in the cache; with NAMEs, every model each NAME matches"
                        "%(default).0s")
    p.add_argument("--stale", action="store_true",
                   help="remove the models whose source changed since their conversion or is gone (`bitnet list`"
                        " marks them), and say the space freed%(default).0s")


def match(rows: list[dict], name: str) -> tuple[str, list[dict]]:
    """(how, rows) `name` designates: an exact name, else the conversions of the source at that path, else every
    conversion of that source (a file name: of every folder, which the caller refuses when there are several;
    a hub id matches any revision, REPO:TAG the file of that quant tag, REPO every file of it), else the names
    it is a prefix of (the caller refuses an ambiguous prefix)."""
    import os

    from ..engine.formats.hub import hub_names

    where = os.path.realpath(name)
    for how, test in (("name", lambda r: r["name"] == name or r["name"] + ".bnstore" == name),
                      ("path", lambda r: r.get("source_path") == where),
                      ("source", lambda r: r["source"] == name or name.lower() in hub_names(r["source"])),
                      ("prefix", lambda r: r["name"].startswith(name))):
        found = [r for r in rows if test(r)]
        if found:
            return how, found
    return "", []


def ambiguous(how: str, found: list[dict]) -> bool:
    """Whether `found` (match's) holds the conversions of more than one source that `name` could mean: several
    names by prefix, or one file name recorded by stores of files in different folders (a store that records no
    path, an older bitnet's, counts as a source of its own). A hub id names one repository: all of them."""
    if how == "prefix":
        return len(found) > 1
    if how != "source":
        return False
    local = [r for r in found if "/" not in r["source"]]
    return len({r.get("source_path") or ("?", r["name"]) for r in local}) > 1


def main(args) -> int:
    import os

    from .list import cached_stores, human_size
    from ..engine.formats.convert import cache_dir_default
    from ..engine.errors import BitNetError

    if args.stale and (args.names or args.all):
        raise BitNetError("rm: --stale removes every stale model; give it alone, without NAMEs or --all")
    if not (args.stale or args.all or args.names):
        raise BitNetError("rm: give model NAMEs (see `bitnet list`), --all or --stale")
    rows = cached_stores()
    if args.stale:
        chosen = [r for r in rows if r["status"] in STALE]
    elif not args.names:
        chosen = rows
    else:
        chosen = []
        for name in args.names:
            how, found = match(rows, name)
            if not found:
                raise BitNetError(f"rm {name}: no such model in {cache_dir_default()}", hint="see `bitnet list`")
            if not args.all and ambiguous(how, found):
                what = "models" if how == "prefix" else "models converted from different files of that name"
                raise BitNetError(f"rm {name}: matches {len(found)} {what} "
                                  f"({', '.join(r['name'] for r in found)})",
                                  hint=f"give the full name of one (see `bitnet list`), or `bitnet rm {name} --all` "
                                       "for all of them")
            chosen += [r for r in found if r not in chosen]
    failed, freed = [], 0
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
        freed += r["size"]
        why = f", {r['status']}" if args.stale else ""
        print(f"deleted {r['name']} ({human_size(r['size'])}{why})")
    if not chosen:
        print("nothing to remove" + (" (no stale models)" if args.stale else ""))
    elif args.stale:
        print(f"freed {human_size(freed)} ({freed} bytes)")
    if failed:
        raise BitNetError(f"rm: could not remove {'; '.join(failed)}")
    return 0
