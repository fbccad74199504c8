"""Fill-in-the-middle (FIM): the prompt a code model fills a gap with, built from the text before the gap (prefix),
the text after it (suffix) and other files (extra context), for llama-server's /infill, OpenAI's /v1/completions
`suffix` and ollama's /api/generate `suffix`. A model can do it only where its vocabulary has the FIM tokens, found
by their text as llama.cpp's vocabulary loader finds them (Qwen's <|fim_prefix|>, StarCoder's <fim_prefix>,
CodeLlama's <PRE>, DeepSeek's, CodeGemma's, GLM's); every refusal says which it is, from the model's own vocabulary.
The prompt is llama-server's (format_infill, PSM order, repo-level form where the vocabulary has its tokens):

    [BOS] [FIM_REP]myproject\\n [FIM_SEP]name0\\n text0 ... [FIM_SEP]filename\\n
    [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]

Nothing here knows of kernels: `eng` is engine.api's model session.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

# each FIM token's spellings, as llama.cpp's vocabulary loader looks them up
FIM_SPELLINGS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>", "\u2581<PRE>",
            "<|code_prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>", "\u2581<SUF>",
            "<|code_suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>", "\u2581<MID>",
            "<|code_middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>", "<fim-sep>", "<SEP>", "<filename>"),
}
# tokens that end a filled-in middle besides the model's end of text (llama.cpp counts them end-of-generation):
# the FIM pad, repo and file separators, and Qwen's document end (a Qwen3 chat model's EOS is <|im_end|>)
FIM_ENDS = ("pad", "rep", "sep")
DOCUMENT_END = ("<|endoftext|>", "<EOT>", "<|end_of_text|>")
NO_FIM = ("fill-in-the-middle is not supported for this model: its vocabulary has no fill-in-the-middle tokens "
          "(<|fim_prefix|>, <fim_prefix> or <PRE> with their suffix and middle tokens)")
# the /infill fields: on the other completion endpoints a 400 naming them (they were dropped in silence)
INFILL_FIELDS = ("input_prefix", "input_suffix", "input_extra")
BATCH = 2048   # llama-server's default n_batch, which bounds the prefix and suffix kept (3:1)


class FimTokens(NamedTuple):
    pre: int
    suf: int
    mid: int
    pad: Optional[int]
    rep: Optional[int]
    sep: Optional[int]


def fim_tokens(tokenizer) -> Optional[FimTokens]:
    """The model's FIM token ids, or None where its vocabulary lacks a prefix, suffix or middle token."""
    found = {}
    for role, names in FIM_SPELLINGS.items():
        found[role] = next((i for i in map(tokenizer.token_to_id, names) if i is not None), None)
    if any(found[r] is None for r in ("pre", "suf", "mid")):
        return None
    return FimTokens(**found)


def fim_ends(eng, fim: FimTokens) -> list[int]:
    """The tokens that end a middle besides the model's end of text (the engine's end_ids)."""
    tok = eng.tokenizer
    ids = [getattr(fim, r) for r in FIM_ENDS] + [tok.token_to_id(t) for t in DOCUMENT_END]
    return [i for i in dict.fromkeys(ids) if i is not None and i not in tok.eos_ids]


def off(value) -> bool:
    """Whether an /infill field or a suffix sent to an endpoint that has none asks for nothing (clients send "",
    [] and null at a file's end)."""
    return value is None or value == "" or value == []


def field_refusal(eng, name: str) -> str:
    """The 400's message for /infill's fields (and `suffix` on /completion) on an endpoint that completes its
    prompt alone: where the model can fill in the middle, where it can; else why it cannot."""
    if fim_tokens(eng.tokenizer) is None:
        return f"{name}: {NO_FIM}"
    kind = "/v1/completions' field" if name == "suffix" else "an /infill field"   # (/infill refuses suffix)
    return (f"{name}: {kind}; this endpoint completes its prompt alone (send input_prefix, input_suffix "
            "and input_extra to /infill, or prompt and suffix to /v1/completions)")


def suffix_refusal(eng) -> Optional[str]:
    """The one message `suffix` gets where the model cannot fill in the middle (None where it can)."""
    return None if fim_tokens(eng.tokenizer) is not None else f"suffix: {NO_FIM}"


def extra_chunks(value) -> list[tuple[str, str]]:
    """input_extra as (filename, text) pairs (llama-server's: a list of {"filename", "text"} objects, filename
    "tmp" when left out); ValueError naming what is wrong."""
    if value is None:
        return []
    shape = 'input_extra: a list of {"filename": string, "text": string}'
    if not isinstance(value, list):
        raise ValueError(shape)
    out = []
    for i, c in enumerate(value):
        if not isinstance(c, dict):
            raise ValueError(f"input_extra[{i}]: an object ({shape})")
        text, name = c.get("text", ""), c.get("filename", "tmp")
        if not isinstance(text, str) or not isinstance(name, str):
            raise ValueError(f"input_extra[{i}]: text and filename are strings ({shape})")
        out.append((name, text))
    return out


def cut_to(prefix: str, suffix: str, chars: int) -> tuple[str, str]:
    """The prefix's last and the suffix's first `chars` characters (the most of a prompt the context can hold,
    offload.chars_bound): infill_ids keeps less of either, so a file longer than the context is cut here, not
    refused for its length (the characters are counted before the tokens are cut)."""
    return prefix[max(0, len(prefix) - chars):], suffix[:max(0, chars)]


def infill_ids(eng, fim: FimTokens, prefix: str, suffix: str, extra=(), prompt_ids=(),
               answer_room: Optional[int] = None) -> list[int]:
    """The FIM prompt's ids: prefix and suffix as plain text (a control token's text in them stays text), the
    prefix's last 3/4 of a batch and the suffix's first 1/4 less the prompt kept (llama-server's bound), less
    where the context leaves less beside the answer's room, then as much extra context, from its end, as fits in
    the context besides room for the answer (answer_room tokens, at most a quarter of the context; None: a
    quarter)."""
    def tok(text):
        return eng.tokenize(text, add_bos=False, special=False) if text else []
    n_ctx, prompt_ids = eng.n_ctx, list(prompt_ids)
    batch = min(BATCH, n_ctx)
    pre, suf = tok(prefix), tok(suffix)
    pre = pre[len(pre) - min(len(pre), 3 * (batch // 4)):]
    suf = suf[:max(0, batch // 4 - (2 + len(prompt_ids)))]
    bos = eng.tokenize("", add_bos=True)   # [BOS] where the model's prompts start with one
    room = n_ctx // 4 if answer_room is None else min(answer_room, n_ctx // 4)
    # the batch's bound alone left a prompt over a context of 2048 or less (a 400 for the server's own cut): the
    # prefix and suffix also share what the context leaves beside BOS, the FIM tokens, the prompt and the answer,
    # the suffix up to a quarter (more where the prefix is short), the prefix the rest
    budget = max(0, n_ctx - len(bos) - 3 - len(prompt_ids) - room)
    if len(pre) + len(suf) > budget:
        keep_suf = min(len(suf), max(budget // 4, budget - len(pre)))
        keep_pre = min(len(pre), budget - keep_suf)
        pre, suf = pre[len(pre) - keep_pre:], suf[:keep_suf]
    extra_ids = [fim.rep] + tok("myproject\n") if fim.rep is not None else []
    for name, text in extra:
        extra_ids += [fim.sep] + tok(name + "\n") if fim.sep is not None else tok("\n\n--- snippet ---\n\n")
        extra_ids += tok(text)
    if fim.sep is not None:
        extra_ids += [fim.sep] + tok("filename\n")
    core = [fim.pre] + pre + prompt_ids + [fim.suf] + suf + [fim.mid]
    take = max(0, min(len(extra_ids), n_ctx - len(bos) - len(core) - room))
    return bos + extra_ids[len(extra_ids) - take:] + core
