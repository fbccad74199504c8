"""Tokenizer data for the weight store, built from what a source file carries.

- GGUF "gpt2" (byte-level BPE: tokens + merges + token types) -> an HF tokenizer.json that gives the same ids:
  the LLaMA-3, GPT-2 or Qwen2 pre-tokenizer regex, as llama.cpp picks it by tokenizer.ggml.pre (LLaMA-3's when
  the key is MISSING: the official 2B-4T GGUF has none); a name llama.cpp splits another way gets the closest
  regex and a warning, a name llama.cpp does not know is refused (as llama.cpp refuses it); control tokens
  (type 3) and user-defined tokens (type 4) become added tokens, so they are matched whole in text.
- GGUF "llama" (SentencePiece) -> best effort: an HF BPE tokenizer.json in the LLaMA-2 style (metaspace
  normalizer, byte fallback, merges derived from the token scores the way transformers' SentencePiece
  converter does). Ids agree with SentencePiece on ordinary text; rare tie-breaks may differ.
- BOS: add_bos_token (or llama.cpp's default for the pre-tokenizer) without tokenizer.ggml.bos_token_id takes the
  vocabulary family's BOS token by name (<|begin_of_text|>, <s>); a vocabulary without it gets a warning.
- Chat templates: the official GGUF's broken "Human: ... BITNETAssistant:" template is replaced by the
  2B-4T chat form; a missing one is filled in for BitNet b1.58 (LLaMA-3 vocab) models.
"""
from __future__ import annotations

import json

from ..config import BITNET_CHAT_TEMPLATE, is_broken_chat_template
from ..errors import FormatError

LLAMA3_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT2_SPLIT_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Qwen2 / Qwen3 (tokenizer.ggml.pre "qwen2"): the LLaMA-3 pattern with single digits, no ignore_merges
QWEN2_SPLIT_REGEX = LLAMA3_SPLIT_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
SPLIT_REGEX = {"llama3": LLAMA3_SPLIT_REGEX, "gpt2": GPT2_SPLIT_REGEX, "qwen2": QWEN2_SPLIT_REGEX}
# tokenizer.ggml.pre names for which llama.cpp (src/llama-vocab.cpp) splits text with exactly one of these regexes;
# missing: LLaMA-3's, as the official 2B-4T GGUF (no .pre key) needs
LLAMA3_PRES = {None, "", "llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
               "lfm2", "jina-v5-nano"}
PRE_REGEX = {**dict.fromkeys(LLAMA3_PRES, "llama3"),
             **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                              "mellum", "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling"),
                             "gpt2"),
             **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
                              "solar-open"), "qwen2")}
# the names llama.cpp knows and splits its own way: the closest regex here (by how it splits digits and letters),
# with a warning, since the ids may differ from llama.cpp's
PRE_CLOSEST = {**dict.fromkeys(("dbrx", "chatglm-bpe", "glm4", "glm5", "jais-2", "minicpm5", "gpt-4o", "llama4",
                                "kanana2", "talkie", "minimax-m2", "granite-embed-multi-97m", "tiny_aya", "cohere2moe",
                                "deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4", "kimi-k2", "afmoe"), "llama3"),
               **dict.fromkeys(("qwen35", "tekken", "youtu", "spark2_5", "bailingmoe", "bailingmoe2", "llada-moe",
                                "seed-coder", "ufakzeka", "grok-2", "laguna", "exaone-moe", "deepseek-coder"), "qwen2"),
               **dict.fromkeys(("default", "deepseek-llm", "falcon", "starcoder", "refact", "command-r", "smollm",
                                "codeshell", "exaone", "minerva-7b", "mellum2", "poro-chat", "bloom", "gpt3-finnish",
                                "viking", "chameleon", "superbpe", "jina-v1-en", "jina-v2-code", "roberta-bpe",
                                "whitespace", "gemma4", "granite-embed-multi-311m", "sarvam-moe"), "gpt2")}
# llama.cpp's own flags for a pre-tokenizer: merges ignored (a word in the vocabulary is one token), BOS by default
IGNORE_MERGES_PRES = LLAMA3_PRES | {"minicpm5", "youtu", "glm4", "glm5", "tekken", "granite-embed-multi-97m"}
ADD_BOS_PRES = LLAMA3_PRES | {"tekken", "chameleon"}


def fix_chat_template(tmpl: str | None) -> str:
    """The template to store: the 2B-4T form if missing or the known-broken official GGUF one (the same rule
    the runtime renders by: engine/config.py)."""
    return BITNET_CHAT_TEMPLATE if is_broken_chat_template(tmpl) else tmpl


def special_ids_from_hf_json(blob: bytes, names, path: str = "tokenizer.json") -> list[int]:
    from .tokenizer import parse_hf_json

    tj = parse_hf_json(blob, path)
    found = {}
    for t in tj.get("added_tokens") or []:
        if t["content"] in names:
            found[t["content"]] = t["id"]
    vocab = tj["model"].get("vocab")
    if isinstance(vocab, dict):
        for n in names:
            if n not in found and n in vocab:
                found[n] = vocab[n]
    return [found[n] for n in names if isinstance(found.get(n), int)]


def _as_list(v, what, path):
    if v is None:
        return None
    try:
        return list(v)
    except TypeError:
        raise FormatError(f"{path}: GGUF key {what} is not an array") from None


def gguf_tokenizer(g) -> dict:
    """{"kind": "gpt2"|"llama"|None, "blob": (store kind, bytes) | None, "chat_template", "bos", "eos": [..],
    "meta": {...}} from a GGUFFile's tokenizer.ggml.* keys."""
    kv, path = g.kv, g.path
    model = g.get("tokenizer.ggml.model", str)
    tokens = _as_list(kv.get("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens", path)
    meta: dict = {}
    warnings: list[str] = []   # one line each: what the file leaves to a guess (the store keeps them)
    bos = g.get("tokenizer.ggml.bos_token_id", int)
    eos: list[int] = []
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = g.get(k, int)
        if v is not None and v not in eos:
            eos.append(v)
    tmpl = g.get("tokenizer.chat_template", str)
    tool_use = g.get("tokenizer.chat_template.tool_use", str)   # llama.cpp's key for the named "tool_use" template
    if tool_use:
        meta["chat_template_tool_use"] = tool_use
    blob = None
    if model is None or tokens is None:
        meta["tokenizer_note"] = "the GGUF file has no tokenizer"
    else:
        if not all(isinstance(t, str) for t in tokens):
            raise FormatError(f"{path}: tokenizer.ggml.tokens is not a list of strings")
        n = len(tokens)
        types = _as_list(kv.get("tokenizer.ggml.token_type"), "tokenizer.ggml.token_type", path) or [1] * n
        if len(types) != n:
            raise FormatError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        try:
            types = [int(t) for t in types]
        except (TypeError, ValueError):
            raise FormatError(f"{path}: tokenizer.ggml.token_type is not a list of integers") from None
        for i, t in enumerate(tokens):
            if t in ("<|eot_id|>", "<|end_of_text|>") and i not in eos:
                eos.append(i)
        add_bos = g.get("tokenizer.ggml.add_bos_token", bool)
        if model == "gpt2":
            if "tokenizer.ggml.merges" not in kv:   # without them every word is bytes: other ids, silently
                raise FormatError(f"{path}: tokenizer.ggml.merges is missing (a gpt2 BPE tokenizer needs its merges;"
                                  " llama.cpp refuses such a file too)")
            merges = _as_list(kv.get("tokenizer.ggml.merges"), "tokenizer.ggml.merges", path) or []
            pre = g.get("tokenizer.ggml.pre", str)
            regex = PRE_REGEX.get(pre) or PRE_CLOSEST.get(pre)
            if regex is None:   # llama.cpp refuses the file ("unknown pre-tokenizer type")
                raise FormatError(f"{path}: unknown tokenizer.ggml.pre {pre!r} (llama.cpp refuses it too); this engine"
                                  f" splits text as llama.cpp does for {', '.join(sorted(p for p in PRE_REGEX if p))}")
            meta["tokenizer_pre"] = f"{pre or 'missing'} -> {regex} regex"
            if pre not in PRE_REGEX:
                meta["tokenizer_pre"] += " (the closest; llama.cpp splits its own way)"
                warnings.append(f"the GGUF's tokenizer.ggml.pre {pre!r} is split here with the {regex} regex, the"
                                " closest of ours: text may tokenize differently from llama.cpp")
            # llama.cpp's: the key, else its pre's
            meta["add_bos"] = add_bos if add_bos is not None else pre in ADD_BOS_PRES
            bos = _named_bos(bos, meta, tokens, "<|begin_of_text|>", warnings)
            _named_are_control(types, tokens, [bos, *eos], warnings)
            js = _bpe_json(tokens, types, merges, pre in IGNORE_MERGES_PRES, bos if meta["add_bos"] else None,
                           path, SPLIT_REGEX[regex])
            blob = ("hf_json", js.encode("utf-8"))
        elif model == "llama":
            scores = _as_list(kv.get("tokenizer.ggml.scores"), "tokenizer.ggml.scores", path) or [0.0] * n
            try:
                scores = [float(x) for x in scores]
            except (TypeError, ValueError):
                raise FormatError(f"{path}: tokenizer.ggml.scores is not a list of numbers") from None
            if len(scores) != n:
                raise FormatError(f"{path}: tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
            meta["add_bos"] = add_bos is not False
            bos = _named_bos(bos, meta, tokens, "<s>", warnings)
            _named_are_control(types, tokens, [bos, *eos], warnings)
            js = _spm_json(tokens, types, scores, bos if meta["add_bos"] else None)
            blob = ("hf_json", js.encode("utf-8"))
            meta["tokenizer_note"] = "SentencePiece vocab rebuilt as an HF BPE tokenizer (best effort)"
        else:
            raise FormatError(f"{path}: unsupported tokenizer.ggml.model {model!r} (expected gpt2 or llama)")
    if g.arch not in ("llama", "qwen3") and (model == "gpt2" or g.arch != "bitnet"):  # llama / qwen3: their own or none
        fixed = fix_chat_template(tmpl)
        if fixed != tmpl:
            meta["chat_template_note"] = "missing in the file" if not tmpl else "replaced the broken GGUF template"
        tmpl = fixed
    if warnings:
        meta["warnings"] = warnings
    return {"kind": model, "blob": blob, "chat_template": tmpl, "bos": bos if isinstance(bos, int) else None,
            "eos": eos, "meta": meta}


def _named_bos(bos, meta: dict, tokens: list, name: str, warnings: list) -> int | None:
    """The BOS id when the file wants one (meta["add_bos"]) but tokenizer.ggml.bos_token_id is missing: the token
    named as the vocabulary family's BOS (LLaMA-3's <|begin_of_text|>, SentencePiece's <s>). Without one, texts
    start with no BOS though the file asks for it: said in a warning."""
    if bos is not None or not meta["add_bos"]:
        return bos
    if name in tokens:
        i = tokens.index(name)
        meta["bos_note"] = f"no tokenizer.ggml.bos_token_id: {name} (id {i}) is the BOS"
        return i
    warnings.append(f"the GGUF asks for a BOS token (tokenizer.ggml.add_bos_token) but names none (no"
                    f" tokenizer.ggml.bos_token_id, no {name} in its vocabulary): texts start without one")
    return None


def _named_are_control(types: list, tokens: list, ids, warnings: list) -> None:
    """The BOS / EOS / EOT ids the file names, typed NORMAL (or no token_type at all): typed control here, as
    llama.cpp overrides them with a warning. Else a chat template's bos_token and <|eot_id|> texts were cut into
    literal pieces: prompts with no BOS id and no end-of-turn id, said nowhere."""
    fixed = []
    for i in dict.fromkeys(i for i in ids if isinstance(i, int) and 0 <= i < len(tokens)):
        t = tokens[i]
        if types[i] not in (3, 4) and len(t) > 2 and t.startswith("<") and t.endswith(">"):   # control-looking
            types[i] = 3
            fixed.append(f"{t!r} (id {i})")
    if fixed:
        warnings.append(f"the GGUF's {', '.join(fixed)} named as BOS/EOS/EOT {'is' if len(fixed) == 1 else 'are'} "
                        "not typed control (tokenizer.ggml.token_type): taken as control tokens, as llama.cpp does")


def _added(tokens, types, specials_only=False):
    out = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (3, 4) or (ty == 2 and not specials_only):
            out.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                        "normalized": ty == 4, "special": ty != 4})
    return out


def _post(bos, tokens):
    if bos is None or not 0 <= bos < len(tokens):
        return None
    b = tokens[bos]
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": b, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {b: {"id": b, "ids": [bos], "tokens": [b]}}}


def _bpe_json(tokens, types, merges, ignore_merges: bool, bos, path: str, regex: str) -> str:
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = []
    for m in merges:
        a, sep, b = str(m).partition(" ")
        if not sep:
            raise FormatError(f"{path}: tokenizer.ggml.merges holds a bad merge {m!r}")
        for part in (a, b, a + b):   # what the tokenizers library would refuse, named in the file's own terms
            if part not in vocab:
                raise FormatError(f"{path}: tokenizer.ggml.merges holds {m!r}, but {part!r} is not in"
                                  " tokenizer.ggml.tokens")
        pairs.append([a, b])
    tj = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": _added(tokens, types),
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex},
             "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": _post(bos, tokens),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": bool(ignore_merges), "vocab": vocab, "merges": pairs},
    }
    return json.dumps(tj, ensure_ascii=False)


def _spm_json(tokens, types, scores, bos) -> str:
    """LLaMA-2-style tokenizer.json from a SentencePiece vocab (merges ordered by the merged token's score)."""
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    normal = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    cands = []
    for t, i in normal.items():
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in normal and b in normal:
                cands.append((-scores[i], normal[a], normal[b], a, b))
    cands.sort()
    unk = next((t for t, ty in zip(tokens, types) if ty == 2), None)
    tj = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": _added(tokens, types),
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                           {"type": "Replace", "pattern": {"String": " "},
                                                            "content": "\u2581"}]},
        "pre_tokenizer": None,
        "post_processor": _post(bos, tokens),
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [[a, b] for _, _, _, a, b in cands]},
    }
    return json.dumps(tj, ensure_ascii=False)
