"""Stores written by another bitnet-cpu than this one (docs/formats.md, "Stores of other versions").

Older: what a conversion of an older converter lacks that a conversion today records is said at every load in one
line, with the command that converts the model again (load_warnings); where the store itself holds what today's
converter decides from (add_bos: its tokenizer.json), the runtime decides it the same way and says nothing.
A cache entry whose source changed since, or that an older bitnet-cpu made, is said the same way when its file is
loaded itself (`bitnet serve --models-cache` loads the cache's files; `bitnet run -m SRC` converts it again).

Newer: a converter version above this one's is said at load ("upgrade"); what this engine would misread or
ignore (a config key, a tensor, an index "requires" entry, a layout, a tokenizer kind it does not know) is
refused in one line (check_runnable), naming it and the newer converter that wrote it where the store says so.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex

from ..config import RETIRED_CONFIG_KEYS, ModelConfig
from ..errors import FormatError
from .convert import CACHE_NAME, LM_HEADS, cache_key, cache_status, default_lm_head, source_label
from .store import CONVERTER_VERSION, converter_of, made_by, newer_converter, store_warnings

UPGRADE = "upgrade bitnet-cpu"
HEAD_LAYOUTS = {"f16_tile16", "i8_tile16", "q4g_tile16"}
LINEAR_LAYOUTS = {"tile16", "tile16b3", "tg128"}
TOKENIZER_KINDS = {"hf_json", "sentencepiece"}
TOP_TENSORS = {"token_embd", "output", "output.scale", "output.rowsum", "output.gscale", "output.rows", "output_norm"}
LAYER_TENSORS = {"attn_norm", "attn_qkv", "attn_qkv.scale", "attn_output", "attn_output.scale", "attn_q_norm",
                 "attn_k_norm", "attn_sub_norm", "ffn_norm", "ffn_gate_up", "ffn_gate_up.scale", "ffn_down",
                 "ffn_down.scale", "ffn_sub_norm"}
LINEARS = ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down")
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def check_runnable(store) -> None:
    """FormatError (one line) where the store holds what this engine does not know and would otherwise ignore or
    misread: a config key, a tensor, a head or linear layout, a tokenizer kind (a dtype, an index "requires"
    entry, a format version: Store refuses those)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)} | RETIRED_CONFIG_KEYS   # an older writer's, not a newer
    what = [f"config key {k!r}" for k in sorted(set(store.config_keys) - fields)]
    n_layers = store.config.n_layers
    tok = store.tokenizer_kind
    for name in store.tensor_names:
        m = _LAYER.fullmatch(name)
        known = name in TOP_TENSORS or name == store.tokenizer_tensor or \
            (m is not None and int(m.group(1)) < n_layers and m.group(2) in LAYER_TENSORS)
        if not known:
            what.append(f"tensor {name!r}")
    for name, known in [("output", HEAD_LAYOUTS)] + [(f"blk.{i}.{s}", LINEAR_LAYOUTS) for i in range(n_layers)
                                                     for s in LINEARS]:
        lay = store.info(name).get("layout") if name in store else None
        if lay is None:
            continue
        if not isinstance(lay, str):   # damage, not a later writer's layout
            raise FormatError(f"{store.path}: tensor {name!r} has a corrupt index entry (layout {str(lay)[:60]})")
        if lay not in known:
            what.append(f"{'lm head layout' if name == 'output' else 'layout'} {lay!r}"
                        f"{'' if name == 'output' else f' ({name})'}")
    if tok is not None and tok not in TOKENIZER_KINDS:
        what.append(f"tokenizer kind {tok!r}")
    if what:
        more = f" (and {len(what) - 1} more)" if len(what) > 1 else ""
        hint = UPGRADE if newer_converter(store.meta) is not None else f"{UPGRADE}, or convert the model again"
        raise FormatError(f"{store.path}: holds {what[0]}{more}, which this bitnet-cpu does not know "
                          f"({made_by(store.meta)})", hint=hint)


def _hub_ref(m: dict) -> str | None:
    """For a cache entry of a hub download: the REPO[:FILE][@COMMIT] that `bitnet run -m` resolves to that same
    download, so the entry is converted again in place (its recorded path is a blob or snapshot of the hub cache:
    run with it, the conversion was another entry, named after the blob). Without @ where the repository's main is
    that commit, else with the full commit (huggingface_hub finds no short one offline). None: not a download."""
    rec = m.get("cache")
    if not (isinstance(rec, dict) and rec.get("downloaded") is True and isinstance(rec.get("source_path"), str)):
        return None
    from .hub import parse_hub_ref

    ref, _, commit = str(m.get("source") or "").partition("@")
    if parse_hub_ref(ref) is None:
        return None
    parts = os.path.normpath(rec["source_path"]).split(os.sep)
    repo = next((os.sep.join(parts[:i + 1]) for i in range(len(parts) - 1, -1, -1)
                 if parts[i].startswith("models--")), None)
    if not commit or repo is None:
        return ref
    try:
        with open(os.path.join(repo, "refs", "main")) as f:
            if f.read(100).strip().startswith(commit):
                return ref
    except OSError:
        pass
    try:
        full = [c for c in os.listdir(os.path.join(repo, "snapshots")) if c.startswith(commit)]
    except OSError:
        full = []
    return f"{ref}@{full[0]}" if len(full) == 1 else ref


def reconvert_command(store) -> str:
    """`bitnet convert SRC [--lm-head H] [--weights W] -o PATH`: the store converted again as it was, today."""
    m = store.meta
    rec = m.get("cache")
    src = _hub_ref(m) or (rec["source_path"] if isinstance(rec, dict) and isinstance(rec.get("source_path"), str)
                          else source_label(m))
    args = ["bitnet", "convert", src if src != "?" else "SRC"]
    head = m.get("lm_head")
    if head in LM_HEADS and head != default_lm_head(store.config):
        args += ["--lm-head", head]
    if m.get("weights") == "t1.6":
        args += ["--weights", "t1.6"]
    return " ".join(shlex.quote(a) for a in args + ["-o", store.path])


def _differences(store) -> list[str]:
    """What this store, made by an older converter, does that a conversion of its source today does not."""
    m, cfg, out = store.meta, store.config, []
    if "output" in store and store.info("output").get("layout") == "q4g_tile16" and not cfg.tie_word_embeddings \
            and "output.rows" not in store:
        out.append("its untied q4 head has no f16 rows to rescore from (output.rows): "
                   "approximate logits, not the f16 head's greedy choices")
    n = converter_of(m)
    if n is not None and n < 2 and str(m.get("source_format", "")).startswith("hf") and "eos_token" not in m \
            and store.tokenizer_kind in TOKENIZER_KINDS:
        from .tokenizer import Tokenizer
        tok = Tokenizer.from_store(store)
        eos = tok.id_to_token(tok.eos_ids[0]) if tok.eos_ids else None
        if eos:
            out.append(f"a chat template's eos_token is {eos}, the config's first EOS (converter 1 did not record "
                       "tokenizer_config.json's eos_token, which a conversion today renders: Llama 3's is <|eot_id|>)")
    return out


def _cache_line(store, diffs: list[str]) -> str | None:
    """The line for a stale entry of the conversion cache, loaded as a file (None: not one)."""
    path, m = store.path, store.meta
    if not isinstance(m.get("cache"), dict) and not CACHE_NAME.search(os.path.basename(path)):
        return None
    src, status = cache_status(m, path)
    if status != "stale":
        return None
    n = converter_of(m)
    also = f"; also {'; '.join(diffs)}" if diffs else ""
    if src is None:   # an older bitnet's entry: it records no source path (its name: the source's file name)
        return (f"{path} is a stale entry of the conversion cache, made by an older bitnet-cpu (converter "
                f"{n if n is not None else '?'}){also}: `bitnet run -m {shlex.quote(source_label(m))}` converts its "
                "source again, `bitnet rm --stale` removes this one")
    why = "its source changed since it was converted" if n == int(CONVERTER_VERSION) else \
        f"an older bitnet-cpu made it (converter {n if n is not None else '?'})"
    cmd = f"bitnet run -m {shlex.quote(_hub_ref(m) or src)}"
    key = CACHE_NAME.search(os.path.basename(path)).group(0)[1:21] if CACHE_NAME.search(os.path.basename(path)) else ""
    head = m.get("lm_head")
    if head in LM_HEADS and key and key != cache_key(src, "default") and key == cache_key(src, head):
        cmd += f" --lm-head {head}"
    return f"{path} is a stale entry of the conversion cache ({why}){also}: `{cmd}` converts it again"


def load_warnings(store) -> list[str]:
    """One line each, said at every load: a converter above this one's, a stale cache entry, or what a conversion
    of an older converter does differently from one today (with the command that converts it again)."""
    n = newer_converter(store.meta)
    if n is not None:
        return [f"{store.path}: made by a newer bitnet-cpu (converter {n}; this one writes {CONVERTER_VERSION}): "
                f"it may run differently here; {UPGRADE}"]
    diffs = _differences(store)
    line = _cache_line(store, diffs)
    if line is not None:
        return [line]
    if not diffs:
        return []
    c = converter_of(store.meta)
    who = f"an older bitnet-cpu (converter {c})" if c is not None and c < int(CONVERTER_VERSION) else "its converter"
    return [f"{store.path}: made by {who}, it runs differently from a conversion today: {'; '.join(diffs)}; "
            f"to convert it again: {reconvert_command(store)}"]


def all_warnings(store) -> list[str]:
    """store_warnings (what conversion could only guess) and load_warnings: every line a load of the store says."""
    return store_warnings(store) + load_warnings(store)
