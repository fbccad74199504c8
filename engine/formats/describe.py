"""Human-readable description of a model file for `bitnet inspect`: a weight store, a GGUF file or an HF
directory. Returns lines; reading GGUF/HF sources decodes each ternary tensor once to count -1/0/+1."""
from __future__ import annotations

import json
import os
from typing import Iterator

import numpy as np

from ..errors import FormatError
from .compat import all_warnings
from .store import Store, is_store


def human_size(n: float, base: int = 1024) -> str:
    """Bytes for people: base 1024 gives KiB/MiB/GiB (inspect), base 1000 KB/MB/GB (`bitnet list`, as ollama)."""
    units = ("B", "KiB", "MiB", "GiB") if base == 1024 else ("B", "KB", "MB", "GB")
    for unit in units:
        if n < base or unit == units[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= base
    return str(n)


def _config_lines(c, family: str = "") -> list[str]:
    from .families import family_label, runtime_summary

    return [f"family: {family_label(family)}" + (f" ({family})" if family else ""),
            runtime_summary(c),
            f"architecture: {c.arch}  name: {c.name or '-'}",
            f"dims: hidden {c.hidden_size}, intermediate {c.intermediate_size}, layers {c.n_layers}, heads {c.n_heads}"
            f" (kv {c.n_kv_heads}, head_dim {c.head_dim}), vocab {c.vocab_size}, context {c.context_length}",
            f"rope_theta {c.rope_theta:g}, rms_norm_eps {c.rms_norm_eps:g}, hidden_act {c.hidden_act},"
            f" tied embeddings {c.tie_word_embeddings}, sub-norms {c.sub_norms}, bos {c.bos_token_id},"
            f" eos {list(c.eos_token_ids)}"]


def _tokenizer_line(spec) -> str:
    if not spec:
        return "tokenizer: none"
    kind, blob = spec
    size = "?"
    if kind == "hf_json":
        try:
            tj = json.loads(blob)
            size = len(tj["model"]["vocab"]) + sum(1 for t in tj.get("added_tokens") or []
                                                   if t.get("content") not in tj["model"]["vocab"])
            size = f"{size} tokens, {tj['model'].get('type', '?')}"
        except (ValueError, KeyError, TypeError, RecursionError):
            size = "unparsable"
    else:
        try:
            import sentencepiece as spm

            size = f"{spm.SentencePieceProcessor(model_proto=blob).get_piece_size()} pieces"
        except Exception:  # noqa: BLE001  (any decoding problem: just say so)
            size = "unparsable"
    return f"tokenizer: {kind} ({size}, {len(blob)} bytes)"


def _stats_lines(stats: dict) -> list[str]:
    if not stats:
        return []
    out = ["ternary tensors: share of -1 / 0 / +1, scale" + (
        "; GGUF tensors not stored as ternary: share of values off -s/0/+s beyond the type's rounding (tol),"
        " how the scale was recovered" if any("off" in s for s in stats.values()) else "")]
    for name in sorted(stats, key=_natural):
        s = stats[name]
        sc = ", ".join(f"{x:.6g}" for x in s["scale"][:4]) + (" ..." if len(s["scale"]) > 4 else "")
        fit = (f"   off {s['off']:.2%} (tol {s['tol']:.0%}), scale {s['scale_kind']}" if "off" in s else "")
        out.append(f"  {name:<28} {s['neg']:.3f} / {s['zero']:.3f} / {s['pos']:.3f}   scale {sc}{fit}")
    return out


def _tl_lines(tilings: dict) -> list[str]:
    """bitnet.cpp TL1 / TL2 tensors: the layout and the tile configuration each matrix shape was read with."""
    out = ["bitnet.cpp lookup-table layout: codes tiled per kernel_config.ini (engine/formats/tl_layouts.py)"]
    for (kind, m, k), t in sorted(tilings.items()):
        out.append(f"  {kind} {m}x{k}: {t.label()}")
    return out


def _natural(s: str):
    return [int(t) if t.isdigit() else t for t in s.replace(".", " . ").split()]


def _table(rows, limit) -> list[str]:
    out = [f"tensors ({len(rows)}):", f"  {'name':<40} {'type':<14} {'shape':<22} bytes"]
    for r in rows[: limit if limit is not None else len(rows)]:
        out.append(f"  {r[0]:<40} {r[1]:<14} {str(list(r[2])):<22} {human_size(r[3])}")
    if limit is not None and len(rows) > limit:
        out.append(f"  ... {len(rows) - limit} more")
    return out


def head_line(s: Store) -> str:
    """What the runtime does with the store's LM head, and the bytes it reads per token."""
    names = s.tensor_names
    layout = s.info("output").get("layout", "f16_tile16") if "output" in names else "?"
    per_token = human_size(sum(s.info(n)["nbytes"] for n in names if n.startswith("output.") and n != "output.rows")
                           + (s.info("output")["nbytes"] if "output" in names else 0))
    if layout == "q4g_tile16":
        rows = ("output.rows (f16)" if "output.rows" in names else
                "token_embd (tied)" if s.config.tie_word_embeddings else None)
        how = (f"4-bit groups rank every token, the best candidates get the f16 head's exact logits from {rows}"
               if rows else "4-bit groups, no f16 rows to rescore from (approximate logits)")
    else:
        how = {"i8_tile16": "int8 rows with per-row scales", "f16_tile16": "f16 (the reference numerics)"}.get(
            layout, f"unknown layout {layout!r}")
    return f"lm head: {how}; reads {per_token} per token"


def describe(path: str, max_tensors: int | None = None) -> Iterator[str]:
    """Lines about `path`, starting with "file: PATH" exactly as given; a store's source is the file name (or
    hub id) it recorded at conversion, with nothing of the machine it was built on."""
    from .convert import source_label

    yield f"file: {path}"
    if is_store(path):
        with Store(path) as s:
            yield f"kind: BitNet weight store ({human_size(os.path.getsize(path))})"
            m = s.meta
            yield from _config_lines(s.config, m.get("family", ""))
            yield (f"source: {source_label(m)} ({m.get('source_format', '?')}), lm_head {m.get('lm_head', '?')},"
                   f" weights {m.get('weights', 't2')}, converter {m.get('converter_version', '?')}")
            if m.get("folded"):  # constants folded into the weights at conversion (MiniCPM)
                yield f"folded: {m['folded']}"
            for w in all_warnings(s):   # what conversion could only guess, another version's store (as every load)
                yield f"warning: {w}"
            yield head_line(s)
            rows = []
            for n in s.tensor_names:
                e = s.info(n)
                typ = e.get("layout") or e["dtype"]
                shape = [e["rows"], e["cols"]] if "rows" in e else e["shape"]
                rows.append((n, typ, shape, e["nbytes"]))
            yield from _table(rows, max_tensors)
            yield _tokenizer_line(s.tokenizer_spec)
            yield f"chat template: {s.chat_template!r}"
            yield from _stats_lines(m.get("ternary_stats") or {})
        return
    from .sources import LINEARS, GGUFSource, open_source

    src = open_source(path, check_ternary=False)
    try:
        kind = "GGUF file" if isinstance(src, GGUFSource) else "Hugging Face model directory"
        yield f"kind: {kind} ({src.source_format})"
        yield from _config_lines(src.config, src.meta.get("family", ""))
        for k, v in sorted(src.meta.items()):
            if k != "warnings":
                yield f"{k}: {v}"
        for w in src.meta.get("warnings", []):
            yield f"warning: {w}"
        if isinstance(src, GGUFSource):
            rows = [(t.name, t.type_name, t.shape, max(t.nbytes, 0)) for t in src.g.tensors.values()]
        else:
            rows = []
            for n in src.st.names():
                tag, shape = src.st.info(n)
                size = int(np.prod(shape, dtype=np.int64)) * np.dtype(
                    {"U8": "u1", "I8": "i1", "BF16": "u2", "F16": "f2", "F32": "f4"}.get(tag, "f8")).itemsize
                rows.append((n, tag, shape, size))
        yield from _table(rows, max_tensors)
        yield _tokenizer_line(src.tokenizer)
        yield f"chat template: {src.chat_template!r}"
        stats = {}
        refused = []
        for i in range(src.config.n_layers):
            for short in LINEARS:
                name = f"blk.{i}.{short}.weight"
                if src.config.weight_groups:   # Ternary Bonsai: one scale per 128 weights (range shown)
                    try:
                        w, _, scale = src.linear(short, i)
                    except FormatError:
                        refused.append(f"blk.{i}.{short}")
                        continue
                elif isinstance(src, GGUFSource) and src.g.info(name).type_name not in ("I2_S", "TL1", "TL2", "TQ1_0",
                                                                                             "TQ2_0"):
                    fit = src.ternary_fit(name)  # reported, not refused: inspect shows why a file would be
                    w, scale = fit.codes, fit.scale
                    if not fit.ok:
                        refused.append(f"blk.{i}.{short}")
                else:
                    w, scale, seen = src.linear(short, i)
                n = w.size
                neg, zero = int(np.count_nonzero(w == -1)), int(np.count_nonzero(w == 0))
                stats[f"blk.{i}.{short}"] = {"neg": neg / n, "zero": zero / n, "pos": (n - neg - zero) / n,
                                             "scale": scale if isinstance(scale, list) else [scale], **getattr(src, "fit_notes", {}).get(name, {})}
        yield from _stats_lines(stats)
        if isinstance(src, GGUFSource) and src.g.tl_tilings:
            yield from _tl_lines(src.g.tl_tilings)
        unused = getattr(src, "unused_tensors", [])
        if unused:
            yield (f"UNUSED TENSORS: {len(unused)} tensors (first {unused[0]}) are not part of a {src.g.arch} model;"
                   " conversion refuses this file")
        if refused:
            yield (f"NOT TERNARY: {len(refused)} linear tensors (first {refused[0]}) are not ternary; conversion"
                   " refuses this file (run it with llama.cpp)")
    finally:
        src.close()
