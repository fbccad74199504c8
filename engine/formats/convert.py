"""Convert a BitNet model file (bitnet.cpp / llama.cpp GGUF, HF safetensors directory) into the engine's weight
store once, and find or make the cached store for `bitnet run -m SRC`.

    convert(src, out=None, *, lm_head=None|"q4"|"i8"|"f16", weights="t2"|"t1.6", progress=True, hidden_act=None,
            ternarize=False) -> store path
    resolve_model(src, *, cache_dir=None, lm_head=None, progress=True) -> store path

What goes into the store (tensor names and layouts: engine/INTERFACES.md):
- per layer q, k, v fused into attn_qkv and gate, up into ffn_gate_up, each with a per-row f32 scale (the
  multiplying form; legacy dividing checkpoints are inverted at conversion), repacked to layout.tile16 with
  N padded to 16 and K to 64 (any dimension that is a multiple of 4 works);
- token_embd as f16 row-major for lookup; the LM head (tied: the embedding) as 4-bit codes with 6-bit group
  scales per 32 columns + a row scale (lm_head="q4", the default: 0.53 bytes/weight, layout.quantize_rows_q4g;
  an untied head also keeps its f16 rows as output.rows, which the runtime rescores the q4 head's best
  candidates from), int8 rows + scale + row sums (lm_head="i8": the default where the hidden size exceeds the
  q4 kernel's bound), or f16 (lm_head="f16", the reference numerics);
- config, tokenizer blob, chat template, and meta (source, format, per-tensor ternary shares and scales).
Everything is streamed tensor by tensor (peak memory ~ one layer plus one chunk of the embedding).
Cache: $BITNET_CACHE, else $XDG_CACHE_HOME/bitnet, else ~/.cache/bitnet; one store per source and options, named
by the source's resolved path + LM head kind + the kernel settings (cache_key); the store records the state it was
made from (size + mtime (ns) of every file the conversion reads, converter version, the kernel_config.ini's content:
source_stamp), and a store whose source changed is converted again in its place.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
from typing import Iterator

import numpy as np

from ...simd import layout
from ..errors import BitNetError, FormatError
from ..fileio import check_output, is_terminal, why_missing
from .store import CONVERTER_VERSION, TensorSpec, is_store, write_store

LM_HEADS = ("q4", "i8", "f16")
WEIGHTS = {"t2": "tile16", "t1.6": "tile16b3"}   # --weights: ternary layout of the linear layers
EMBED_CHUNK = 8192  # rows per chunk (a multiple of 16 so tile-major packs concatenate)
# bitnet_cpu/models: the bundled model's files, found by path (the package that trains it is not imported)
BUNDLED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "models")
BUNDLED_HF_DIR = os.path.join(BUNDLED_DIR, "bitnet-b1.58-tiny")


def _stats(w_t: np.ndarray, scales) -> dict:
    n = max(w_t.size, 1)
    neg, zero = int(np.count_nonzero(w_t == -1)), int(np.count_nonzero(w_t == 0))
    return {"neg": neg / n, "zero": zero / n, "pos": (w_t.size - neg - zero) / n,
            "scale": [float(s) for s in scales]}


def _fused(src, shorts: tuple[str, ...], i: int, stats: dict, b3: bool = False) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Ternary matrices stacked along the output dim, repacked; per-row scale [N_pad]."""
    mats, scales = [], []
    for s in shorts:
        w, scale, seen = src.linear(s, i)
        stats[f"blk.{i}.{s}"] = _stats(w, seen)
        stats[f"blk.{i}.{s}"].update(getattr(src, "fit_notes", {}).get(f"blk.{i}.{s}.weight", {}))  # GGUF check
        mats.append(w)
        scales.append(np.full(w.shape[0], scale, np.float32))
    w = mats[0] if len(mats) == 1 else np.concatenate(mats)
    n, k = w.shape
    row_scale = np.zeros(layout.pad_to(n, layout.TILE_ROWS), np.float32)
    row_scale[:n] = np.concatenate(scales)
    return (layout.pack_ternary_b3(w) if b3 else layout.pack_ternary(w)), row_scale, n, k


def _fused_groups(src, shorts: tuple[str, ...], i: int, stats: dict) -> tuple[np.ndarray, int, int]:
    """Group-scaled ternary matrices (config.weight_groups) stacked along the output dim, packed as tg128."""
    mats, scales = [], []
    for s in shorts:
        w, sc, seen = src.linear(s, i)
        stats[f"blk.{i}.{s}"] = _stats(w, seen)
        mats.append(w)
        scales.append(sc)
    w, sc = (mats[0], scales[0]) if len(mats) == 1 else (np.concatenate(mats), np.concatenate(scales))
    return layout.pack_tg128(w, sc), w.shape[0], w.shape[1]


def _linears(src, i: int, pairs, stats: dict, weights: str = "t2") -> Iterator[TensorSpec]:
    for name, shorts in pairs:
        if src.config.weight_groups:
            w, n, k = _fused_groups(src, shorts, i, stats)
            yield TensorSpec(f"blk.{i}.{name}", w, {"layout": "tg128", "rows": n, "cols": k})
        else:
            w, s, n, k = _fused(src, shorts, i, stats, weights == "t1.6")
            yield TensorSpec(f"blk.{i}.{name}", w, {"layout": WEIGHTS[weights], "rows": n, "cols": k})
            yield TensorSpec(f"blk.{i}.{name}.scale", s)


def _tensors(src, lm_head: str, stats: dict, bar, weights: str = "t2") -> Iterator[TensorSpec]:
    c = src.config
    V, D = c.vocab_size, c.hidden_size
    chunks = [(r, min(r + EMBED_CHUNK, V)) for r in range(0, V, EMBED_CHUNK)]

    def step(name):
        if bar is not None:
            bar.set_postfix_str(name, refresh=False)
            bar.update(1)

    emb = np.empty((V, D), np.float16)
    for r0, r1 in chunks:
        emb[r0:r1] = src.embed(r0, r1)
        if not np.isfinite(emb[r0:r1]).all():  # NaN/inf in the source, or values beyond the f16 range
            raise FormatError(f"{src.path}: the token embedding holds NaN/inf values (or values too large for f16)")
    yield TensorSpec("token_embd", emb)
    step("token_embd")
    head_src = src.lm_head if not c.tie_word_embeddings else (lambda r0, r1: emb[r0:r1])
    if lm_head == "i8":
        packs, scales, sums = [], [], []
        for r0, r1 in chunks:
            q, s = layout.quantize_rows_i8(head_src(r0, r1))
            packs.append(layout.pack_i8(q))
            scales.append(s)
            sums.append(q.sum(axis=1, dtype=np.int32))
        v_pad = layout.pad_to(V, layout.TILE_ROWS)
        scale = np.zeros(v_pad, np.float32)
        rowsum = np.zeros(v_pad, np.int32)
        scale[:V], rowsum[:V] = np.concatenate(scales), np.concatenate(sums)
        yield TensorSpec("output", np.concatenate(packs), {"layout": "i8_tile16", "rows": V, "cols": D})
        yield TensorSpec("output.scale", scale)
        yield TensorSpec("output.rowsum", rowsum)
    elif lm_head == "q4":
        if layout.pad_to(D, layout.K_ALIGN) > layout.Q4G_MAX_K:
            raise BitNetError(f"--lm-head q4: hidden size {D} > {layout.Q4G_MAX_K} (the q4 head's int32 bound)",
                              hint="use --lm-head i8")
        codes, gscales, ds = [], [], []
        for r0, r1 in chunks:
            q, s, d = layout.quantize_rows_q4g(head_src(r0, r1))
            codes.append(layout.pack_q4g(q))
            gscales.append(layout.pack_q4g_scales(s))
            ds.append(d)
        scale = np.zeros(layout.pad_to(V, layout.TILE_ROWS), np.float32)
        scale[:V] = np.concatenate(ds)
        yield TensorSpec("output", np.concatenate(codes), {"layout": "q4g_tile16", "rows": V, "cols": D})
        yield TensorSpec("output.gscale", np.concatenate(gscales))
        yield TensorSpec("output.scale", scale)
    else:
        packs = [layout.pack_f16(head_src(r0, r1)) for r0, r1 in chunks]
        yield TensorSpec("output", np.concatenate(packs), {"layout": "f16_tile16", "rows": V, "cols": D})
    step("output")
    emb = None  # free the f16 copy before the layers
    if lm_head == "q4" and not c.tie_word_embeddings:
        # the f16 rows the q4 head's best candidates are rescored from (a tied head uses token_embd)
        rows = np.empty((V, D), np.float16)
        for r0, r1 in chunks:
            rows[r0:r1] = head_src(r0, r1)
        if not np.isfinite(rows).all():
            raise FormatError(f"{src.path}: the lm_head holds NaN/inf values (or values too large for f16)")
        yield TensorSpec("output.rows", rows)
        rows = None
    yield TensorSpec("output_norm", _finite(src, "output_norm", src.norm("output_norm", None)))
    for i in range(c.n_layers):
        yield TensorSpec(f"blk.{i}.attn_norm", _finite(src, f"blk.{i}.attn_norm", src.norm("attn_norm", i)))
        yield from _linears(src, i, (("attn_qkv", ("attn_q", "attn_k", "attn_v")), ("attn_output", ("attn_output",))),
                            stats, weights)
        if c.qk_norm:
            for short in ("attn_q_norm", "attn_k_norm"):
                yield TensorSpec(f"blk.{i}.{short}", _finite(src, f"blk.{i}.{short}", src.norm(short, i)))
        if c.sub_norms:
            yield TensorSpec(f"blk.{i}.attn_sub_norm", _finite(src, f"blk.{i}.attn_sub_norm", src.norm("attn_sub_norm", i)))
        yield TensorSpec(f"blk.{i}.ffn_norm", _finite(src, f"blk.{i}.ffn_norm", src.norm("ffn_norm", i)))
        yield from _linears(src, i, (("ffn_gate_up", ("ffn_gate", "ffn_up")), ("ffn_down", ("ffn_down",))), stats,
                            weights)
        if c.sub_norms:
            yield TensorSpec(f"blk.{i}.ffn_sub_norm", _finite(src, f"blk.{i}.ffn_sub_norm", src.norm("ffn_sub_norm", i)))
        step(f"blk.{i}")


def _finite(src, name, v):
    v = np.ascontiguousarray(v, dtype=np.float32)
    if not np.isfinite(v).all():
        raise FormatError(f"{src.path}: norm weight {name} holds NaN/inf values")
    return v


def default_lm_head(config) -> str:
    """The LM head a conversion gets unless told: q4 (its best candidates rescored exactly at run time: greedy
    agreement with the f16 head 100% over 10k positions on three models, int8 97.8-99.7%, and 0.53 bytes per
    weight against int8's 1.0; bench/head_quality.py, bench/decode_rows.py), else i8 where the hidden size is
    beyond the q4 kernel's int32 bound."""
    return "q4" if layout.pad_to(config.hidden_size, layout.K_ALIGN) <= layout.Q4G_MAX_K else "i8"


def default_store_path(src: str, lm_head: str | None) -> str:
    """SRC's name with .bnstore (the default head) or .HEAD.bnstore (a head asked for)."""
    base = os.path.abspath(src).rstrip(os.sep)
    base = re.sub(r"\.(gguf|safetensors)$", "", base)
    return f"{base}.{lm_head}.bnstore" if lm_head else f"{base}.bnstore"


def source_label(meta: dict) -> str:
    """The source a store records, with nothing of the machine it was built on: the file name of a local
    source (stores converted before this recorded the absolute path) or the hub reference REPO[:FILE]@REV."""
    src = str(meta.get("source") or "")
    if not src:
        return "?"
    if os.path.isabs(src) or "\\" in src or re.match(r"^[A-Za-z]:[\\/]", src):
        return re.split(r"[\\/]", src.rstrip("/\\"))[-1]
    return src


def convert(src: str, out: str | None = None, *, lm_head: str | None = None, weights: str = "t2",
            progress=True, hidden_act: str | None = None, ternarize: bool = False,
            source_name: str | None = None, cache: dict | None = None) -> str:
    """Convert `src` (GGUF file or HF directory) into a store at `out`; returns the store path.
    lm_head None: default_lm_head of the model. weights: "t2" (tile16, 2 bits per weight) or "t1.6" (base-3
    tile16b3). `source_name` is what the store records as its source (default: the file name of `src`);
    `cache`, the cache's record of a conversion it makes (meta "cache": the source's path and state).
    progress: a bar on a terminal (True), none (False), or report(done, total) called at each step."""
    from .sources import open_source

    if lm_head is not None and lm_head not in LM_HEADS:
        raise BitNetError(f"--lm-head: {lm_head!r} is not one of {', '.join(LM_HEADS)}")
    if weights not in WEIGHTS:
        raise BitNetError(f"--weights: {weights!r} is not one of {', '.join(WEIGHTS)}")
    src = os.fspath(src)
    if is_store(src):   # the magic alone: a damaged store is said as such, as `run` and `inspect` say it
        damage = _damage(src)[0]
        raise FormatError(f"{src}: " + (damage if damage else "is already a BitNet store (nothing to convert)"))
    source = open_source(src, hidden_act, ternarize)
    try:
        if weights != "t2" and source.config.weight_groups:
            raise BitNetError(f"--weights {weights}: {src} scales its weights per group of {source.config.weight_groups} "
                              f"(group-scaled layout tg128); only t2 applies to it")
        _check_tokenizer(source, src)
        if out:   # the source's own problems first; then never over it, a model's file or a text: only a store
            check_output(os.fspath(out), "-o", keep=lambda p: not is_store(p))
    except BaseException:
        source.close()
        raise
    out = os.fspath(out) if out else default_store_path(src, lm_head)
    lm_head = lm_head or default_lm_head(source.config)
    stats: dict = {}
    bar = progress_bar(source.config.n_layers + 2, f"convert {os.path.basename(src.rstrip(os.sep))}", progress)
    try:
        meta = {"source": source_name or os.path.basename(os.path.abspath(src).rstrip(os.sep)),
                "source_format": source.source_format, "lm_head": lm_head, "weights": weights,
                "converter_version": CONVERTER_VERSION, "ternary_stats": stats, **source.meta}
        if cache is not None:
            meta["cache"] = cache
        tok = source.tokenizer
        try:  # values are checked explicitly (NaN/inf -> FormatError): no numpy warning lines on stderr
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                write_store(out, source.config, _tensors(source, lm_head, stats, bar, weights), meta=meta,
                            chat_template=source.chat_template, tokenizer_kind=tok[0] if tok else None,
                            tokenizer_blob=tok[1] if tok else None)
        except OSError as e:
            raise FormatError(f"{out}: cannot write the store: {e.strerror or e}") from None
    finally:
        if bar is not None:
            bar.close()
        source.close()
    return out


def _check_tokenizer(source, src: str):
    """Load the tokenizer once now, so a missing or broken one is an error naming the user's file (not the
    cached store a later run would fail on)."""
    from .tokenizer import Tokenizer

    if not source.tokenizer:   # a store without one could run token ids only: every command needs text
        raise FormatError(f"{src}: no tokenizer found (tokenizer.json or tokenizer.model beside the weights, or "
                          "the GGUF's tokenizer.ggml keys)", hint="copy the model's tokenizer files next to it")
    kind, blob = source.tokenizer
    c = source.config
    tok = Tokenizer(kind, blob, bos_id=c.bos_token_id, eos_ids=c.eos_token_ids,
                    source=getattr(source, "tokenizer_path", None) or src)
    tok.decode(tok.encode("Hello, world! 123", add_bos=True))  # a tokenizer that loads but cannot encode


class _Reported:
    """A bar that hands each step to report(done, total) instead of drawing (`bitnet pull --json-progress`)."""

    def __init__(self, total: int, report):
        self.total, self.n, self.report = total, 0, report

    def set_postfix_str(self, text, refresh=True):
        pass

    def update(self, n=1):
        self.n += n
        self.report(self.n, self.total)

    def close(self):
        pass


def stderr_is_terminal() -> bool:
    """Whether sys.stderr is a terminal (fileio.is_terminal: None or a stand-in without isatty is not; load_model()
    raised an AttributeError there)."""
    return is_terminal(sys.stderr)


def progress_bar(total: int, desc: str, progress, unit: str = "step"):
    """A tqdm bar on stderr when progress is wanted, stderr is a terminal and tqdm is installed; else None.
    progress may also be a callable report(done, total), which then gets each step instead of a bar."""
    if callable(progress):
        return _Reported(total, progress)
    if not progress or not stderr_is_terminal():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, unit_scale=unit == "B",
                unit_divisor=1024 if unit == "B" else 1000)


# ---- cache ------------------------------------------------------------------------------------------------
def cache_dir_default() -> str:
    d = os.environ.get("BITNET_CACHE")
    if d:
        return d
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(xdg):   # the XDG spec: a relative one is ignored (it was taken from the working directory,
        xdg = os.path.join(os.path.expanduser("~"), ".cache")   # a model converted again in each)
    return os.path.join(xdg, "bitnet")


CACHE_NAME = re.compile(r"-[0-9a-f]{20}\.bnstore$")   # NAME-KEY.bnstore: the cache's own conversions
KERNEL_CONFIG = "BITNET_TL_KERNEL_CONFIG"


def cache_options(lm_head: str) -> dict:
    """What besides the source decides how it converts: the LM head asked for, the kernel_config.ini named by
    BITNET_TL_KERNEL_CONFIG (its file, resolved as it is read: from the working directory) and a
    BITNET_I2S_BLOCK other than the default 128."""
    opts = {"lm_head": lm_head}
    if os.environ.get(KERNEL_CONFIG):
        opts["kernel_config"] = os.path.realpath(os.environ[KERNEL_CONFIG])
    if os.environ.get("BITNET_I2S_BLOCK", "128") != "128":
        opts["i2s_block"] = os.environ["BITNET_I2S_BLOCK"]
    return opts


def cache_key(src: str, lm_head: str) -> str:
    """The conversion's name in the cache: the source's resolved path and cache_options, not the state of its
    files (source_stamp, recorded in the store), so a source that changes is converted again under the same
    name, replacing its earlier conversion (each change left one more store behind)."""
    p = os.path.realpath(src)   # a link to a model folder is that folder: one conversion (abspath made a second)
    opts = cache_options(lm_head)
    h = hashlib.sha256(f"{p}\0{lm_head}".encode())
    for k in ("kernel_config", "i2s_block"):
        if k in opts:
            h.update(f"\0{k}={opts[k]}".encode())
    return h.hexdigest()[:20]


def _source_files(p: str) -> list[str]:
    """The files a conversion of `p` (a resolved path) reads, no other (a dangling link to an unused file is no
    matter)."""
    if os.path.isdir(p):
        from .safetensors_io import INDEX, index_shards
        from .sources import HF_READS

        names = set(os.listdir(p))
        weights = [f for f in names if f.endswith(".safetensors")]
        if INDEX in names:
            weights = [INDEX] + [f for f in index_shards(p) if f in names]   # a bad index: the loader's words
        return sorted(os.path.join(p, f) for f in names & set(HF_READS) | set(weights))
    from .gguf import SPLIT_NAME, split_part   # a split GGUF's first part: every part (engine/formats/gguf.py)
    m = SPLIT_NAME.match(p)
    if m is not None and m.group(2) == "00001":
        return [p] + [f for f in (split_part(p, i) for i in range(2, int(m.group(3)) + 1)) if os.path.isfile(f)]
    return [p]


def _file_digest(path: str) -> str:
    """sha256 of a small settings file, or why it cannot be read (the conversion says so, where it reads it)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return h.hexdigest()


def source_stamp(src: str, downloaded: bool = False, kernel_config: str | None = None) -> str:
    """The state a conversion of `src` was made from: the converter version, each file's name, size and mtime
    (a hub download's times are left out: the same commit downloaded again is the same conversion) and the
    content of the kernel_config.ini it read (edited in place, it was the same conversion). A cached store
    records it; another one now means that the store is stale. OSError: a file of the source is unreadable."""
    p = os.path.realpath(src)
    h = hashlib.sha256(f"{CONVERTER_VERSION}".encode())
    for f in _source_files(p):
        st = os.stat(f)
        h.update(f"\0{os.path.basename(f)}\0{st.st_size}".encode())
        if not downloaded:
            h.update(f"\0{st.st_mtime_ns}".encode())
    if kernel_config:
        h.update(f"\0{KERNEL_CONFIG}\0{_file_digest(kernel_config)}".encode())
    return h.hexdigest()[:20]


def cache_status(meta: dict, path: str) -> tuple[str | None, str]:
    """(the source's resolved path or None, "current" | "stale" | "source missing" | "unknown") of the store at
    `path` in the cache with metadata `meta`: stale when its source changed since (it is converted again at its
    next use) or when it is an entry of an older bitnet (no record of its source: never used again)."""
    rec = meta.get("cache")
    if not isinstance(rec, dict) or not isinstance(rec.get("source_path"), str):
        return None, "stale" if CACHE_NAME.search(os.path.basename(path)) else "unknown"
    src = rec["source_path"]
    if not os.path.exists(src):
        return src, "source missing"
    try:
        now = source_stamp(src, bool(rec.get("downloaded")), rec.get("kernel_config"))
    except OSError:   # a file of it gone or unreadable: its conversion would fail or differ
        return src, "stale"
    return src, "current" if now == rec.get("stamp") else "stale"


def bundled_model() -> str | None:
    """The default model shipped in models/: its store (default.bnstore, else any *.bnstore), else its HF
    directory (converted into the cache by resolve_model), else None."""
    d, hf_dir = BUNDLED_DIR, BUNDLED_HF_DIR
    try:
        stores = sorted(f for f in os.listdir(d) if f.endswith(".bnstore"))
    except OSError:
        stores = []
    if "default.bnstore" in stores and is_store(os.path.join(d, "default.bnstore")):
        return os.path.join(d, "default.bnstore")
    for f in stores:
        if is_store(os.path.join(d, f)):
            return os.path.join(d, f)
    if hf_dir and os.path.isfile(os.path.join(hf_dir, "config.json")):
        return hf_dir
    return None


def check_store_head(path: str, lm_head: str | None) -> str:
    """path, unless lm_head asks for another head than the store's: its head was chosen at its conversion, and
    loading it as it is would quietly ignore the request (FormatError naming both)."""
    if lm_head is None:
        return path
    from .store import Store
    with Store(path, load="mmap") as s:
        have = layout.head_kind(s.info("output").get("layout"))
    if have != lm_head:
        raise FormatError(f"--lm-head {lm_head}: {path} is a converted store with a {have} head (the head is chosen "
                          "when a model is converted)",
                          hint=f"convert the source again with --lm-head {lm_head}, or leave --lm-head out")
    return path


def resolve_model(src: str | None, *, cache_dir: str | None = None, lm_head: str | None = None,
                  progress: bool = True) -> str:
    """A store path for `src`: the bundled model for None, the file itself for a store, a Hugging Face hub
    id (REPO[:FILE][@REV], not a local path) found in the hub cache, else the cached conversion (made now
    if missing or stale)."""
    source_name = None
    if src is not None and not os.path.exists(src):
        from .hub import is_hub_ref, resolve_hub_ref

        if is_hub_ref(src):
            src, source_name = resolve_hub_ref(src)
    if src is None:
        src = bundled_model()
        if src is None:
            raise FormatError(f"{BUNDLED_DIR}: no bundled model (*.bnstore) found",
                              hint="pass a model with -m FILE")
    src = os.fspath(src)
    if not os.path.exists(src):
        raise FormatError(f"{src}: {why_missing(src)}")
    if is_store(src):
        return check_store_head(src, lm_head)
    downloaded = source_name is not None
    opts = cache_options(lm_head or "default")
    path, stamp = _cache_entry(src, source_name, lm_head, cache_dir)
    d = os.path.dirname(path)
    how = "once"
    if is_store(path):
        damage, had = _damage(path)
        if damage is None and had == stamp:
            mark_used(path)
            return path
        if damage is not None:
            # our own cache, damaged (a disk error, a copy cut short): converted again, as `bitnet pull` promises
            # to repair it (it said "ready" over the damaged store, and the run failed on it)
            print(f"bitnet: the cached conversion {path} is damaged ({damage}): converting {src} again",
                  file=sys.stderr)
        # else its source changed since (or an older bitnet made it): the new store is written beside it and
        # renamed over it when whole (a process that maps the old one keeps reading it), as one store per source
        how = "again" if damage is not None else "again (it changed since its conversion)"
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise FormatError(f"{d}: cannot create the cache directory: {e.strerror}",
                          hint="set BITNET_CACHE to a writable directory") from None
    if progress is True and stderr_is_terminal():
        print(f"bitnet: converting {src} {how} into {path}", file=sys.stderr)
    cache = {"source_path": os.path.realpath(src), "downloaded": downloaded, "stamp": stamp,
             "kernel_config": opts.get("kernel_config")}
    return convert(src, path, lm_head=lm_head, progress=progress, source_name=source_name, cache=cache)


def _cache_entry(src: str, source_name: str | None, lm_head: str | None,
                 cache_dir: str | None) -> tuple[str, str]:
    """(the path of `src`'s conversion in the cache, the stamp of `src`'s files now), as resolve_model names and
    checks it. FormatError: a file of the source is unreadable."""
    opts = cache_options(lm_head or "default")
    try:
        key = cache_key(src, lm_head or "default")
        stamp = source_stamp(src, source_name is not None, opts.get("kernel_config"))
    except OSError as e:   # the file that failed (a snapshot's link to a deleted blob), not only its folder
        raise FormatError(f"{e.filename or src}: cannot read: {e.strerror}") from None
    d = cache_dir or cache_dir_default()
    stem = source_name.split("@")[0].replace("/", "--").replace(":", "--") if source_name else \
        os.path.basename(os.path.abspath(src).rstrip(os.sep))
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", stem)[:80]
    return os.path.join(d, f"{name}-{key}.bnstore"), stamp


def current_conversion(src: str, *, cache_dir: str | None = None, lm_head: str | None = None) -> str | None:
    """The cache's conversion of the local GGUF file or HF directory `src` when there is one, whole and made from
    `src` as it is now, else None; nothing is converted, nor marked used (a model's metadata, read for a
    listing)."""
    path, stamp = _cache_entry(os.fspath(src), None, lm_head, cache_dir)
    if not is_store(path):
        return None
    damage, had = _damage(path)
    return path if damage is None and had == stamp else None


def _damage(path: str) -> tuple[str | None, str | None]:
    """(what is wrong with a store's structure (its index and sizes, read from the mapping) or None, the
    source_stamp its cache record holds or None)."""
    from .store import Store
    try:
        with Store(path, load="mmap") as s:
            rec = s.meta.get("cache")
            return None, rec.get("stamp") if isinstance(rec, dict) else None
    except FormatError as e:
        return str(e).removeprefix(f"{path}: "), None


def mark_used(path: str) -> None:
    """Record a use of a cached store for `bitnet list`: its access time, set explicitly (reads alone do not
    update it under noatime/relatime mounts); the mtime, which says when it was converted, is kept."""
    import time

    try:
        os.utime(path, ns=(time.time_ns(), os.stat(path).st_mtime_ns))
    except OSError:  # a read-only cache still works, it just does not record the use
        pass
