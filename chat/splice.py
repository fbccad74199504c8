"""Prompt ids for the next turn that start with the exact tokens already in the KV cache.

Re-rendering the whole conversation with the chat template and tokenizing it again does not give
back the tokens the model generated: BPE merges differently across the answer's edges (the 2B-4T
template ends its generation prompt with "Assistant: " and the re-rendered answer glues that space
to its first word), and a model can emit token sequences that re-tokenize into other ones. Then
the engine's longest-common-prefix reuse stops at the start of the previous answer, and every turn
re-prefills that answer. llama.cpp's chat avoids this by tokenizing only the new part; we do the
same with nothing but `llm.chat_prompt`:

    next = prompt_ids(turn k) + answer_ids(turn k) + close + new_part

`close` (the template's end of an assistant message) and `new_part` (the new user message and the
generation prompt) are found by rendering with the template and cutting at token boundaries that
the renderings share; every assumption is checked, and when one fails the caller falls back to
the plain full rendering (correct, just slower).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CachedTurn:
    """What the KV cache holds after a turn: `prompt_ids` (what was sent) then `answer_ids`."""
    messages: list[dict]     # the window messages `prompt_ids` stands for (ending with the user turn)
    prompt_ids: list[int]
    answer_ids: list[int]    # generated tokens whose text was kept (end-of-turn token excluded)
    answer_text: str


def _starts_with(seq: list[int], prefix: list[int]) -> bool:
    return len(seq) >= len(prefix) and seq[:len(prefix)] == prefix


def spliced_prompt(llm, last: CachedTurn | None, messages: list[dict]) -> list[int] | None:
    """Prompt ids for `messages` that extend the cached turn `last` token for token, or None when
    `messages` is not `last` + its answer + one new user message (then render normally)."""
    if last is None:
        return None
    k = len(last.messages)
    if messages == last.messages:               # /retry: the very same prompt as last time
        return list(last.prompt_ids)
    if (len(messages) != k + 2 or messages[:k] != last.messages
            or messages[k] != {"role": "assistant", "content": last.answer_text}
            or messages[k + 1].get("role") != "user"):
        return None
    # the text shown leaves out special tokens the model wrote (a stray <|begin_of_text|>) and, at a max_tokens cut,
    # the bytes of a character begun; the cache holds them, as llama.cpp's does: compare without them, or one such
    # token re-reads the whole window next turn
    if not last.answer_ids:
        return None
    said = llm.tokenizer.decode(last.answer_ids, skip_special=True)
    if said != last.answer_text and not (said.startswith(last.answer_text)
                                         and set(said[len(last.answer_text):]) == {"\ufffd"}):
        return None
    # the template's closing of an assistant message: render it around an empty answer
    opened = llm.chat_prompt(last.messages, add_generation_prompt=True, continue_final_message=False)
    closed_empty = llm.chat_prompt(last.messages + [{"role": "assistant", "content": ""}],
                                   add_generation_prompt=False)
    if not _starts_with(closed_empty, opened):
        return None
    close = closed_empty[len(opened):]
    # the new user message and the generation prompt: what follows the closed answer
    closed = llm.chat_prompt(messages[:k + 1], add_generation_prompt=False)
    full = llm.chat_prompt(messages, add_generation_prompt=True, continue_final_message=False)
    if not _starts_with(full, closed) or len(full) == len(closed):
        return None
    return list(last.prompt_ids) + list(last.answer_ids) + close + full[len(closed):]
