"""Tokenizers from the weight store's blob, and streaming detokenization that never splits a UTF-8 character.

Kinds (engine/INTERFACES.md): "hf_json" -> the `tokenizers` library on a tokenizer.json (also what the
converter builds from a GGUF gpt2 vocab + merges), "sentencepiece" -> `sentencepiece` on a model proto.
Using the reference libraries themselves is what makes our ids equal to theirs.

Streaming: every token is its exact bytes (Tokenizer.token_bytes: a byte-level BPE token's, a SentencePiece
piece's with "▁" as a space and <0xNN> as that byte) fed through one incremental UTF-8 decoder, so text once
emitted is never revised and a character split over several tokens comes out whole when its last byte does,
as llama-server's streaming does. (A window decoded again per token, what this did before for SentencePiece,
had to give up after 4 pieces on an invalid byte run and then emitted text twice.)
"""
from __future__ import annotations

import json
import os
import re
import threading
import weakref

from ..errors import BitNetError, FormatError, json_why
from ..fileio import NOT_UTF8_HINT, decode_text

# Names under which the end-of-turn token appears in known vocabularies; all present ones stop generation.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|end_of_text|>", "<|im_end|>", "<end_of_turn>")


def _gpt2_byte_map() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (what ByteLevel token strings use)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


_GPT2_BYTES_INV = {c: b for b, c in _gpt2_byte_map().items()}
_GPT2_CHARS = frozenset(_GPT2_BYTES_INV)
_GPT2_TO_LATIN1 = {ord(c): b for c, b in _GPT2_BYTES_INV.items()}   # str.translate's table: then one byte a char
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def parse_hf_json(blob: bytes, source: str) -> dict:
    """tokenizer.json parsed and checked for the JSON types we (and the `tokenizers` library) rely on, so a
    file with fields of the wrong type is one FormatError naming it, not a traceback or a library panic."""
    try:
        spec = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"{source}: tokenizer.json is not valid JSON: {json_why(e)}") from None

    def bad(what, want, got):
        raise FormatError(f"{source}: tokenizer.json: {what} must be {want}, got {type(got).__name__}",
                          hint="the tokenizer file is corrupt or not a Hugging Face tokenizer.json")

    if not isinstance(spec, dict):
        bad("the top level", "an object", spec)
    model = spec.get("model")
    if not isinstance(model, dict):
        bad('"model"', "an object", model)
    if not isinstance(model.get("type", "BPE"), str):
        bad('"model.type"', "a string", model.get("type"))
    vocab = model.get("vocab")
    if vocab is not None and not isinstance(vocab, (dict, list)):
        bad('"model.vocab"', "an object or a list", vocab)
    if isinstance(vocab, dict) and not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                           for v in vocab.values()):
        raise FormatError(f"{source}: tokenizer.json: \"model.vocab\" ids must be non-negative integers")
    merges = model.get("merges")
    if merges is not None and not isinstance(merges, list):
        bad('"model.merges"', "a list", merges)
    for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder", "truncation", "padding"):
        if spec.get(key) is not None and not isinstance(spec[key], dict):
            bad(f'"{key}"', "an object or null", spec[key])
    added = spec.get("added_tokens")
    if added is not None and not isinstance(added, list):
        bad('"added_tokens"', "a list", added)
    for t in added or []:
        if not isinstance(t, dict) or not isinstance(t.get("content"), str) or \
                not isinstance(t.get("id"), int) or isinstance(t.get("id"), bool) or t["id"] < 0:
            raise FormatError(f"{source}: tokenizer.json: every added token needs a string \"content\" and a"
                              " non-negative integer \"id\"")
    return spec


def _library_call(source: str, what: str, fn, *args):
    """Call into the tokenizer library; any failure (also a Rust panic, which is a BaseException) becomes a
    FormatError naming the file."""
    try:
        return fn(*args)
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except BaseException as e:  # noqa: B036 - pyo3's PanicException derives from BaseException
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
            raise   # a signal's exception raised while the library ran (bitchat's SIGTERM), never the file's fault
        raise FormatError(f"{source}: {what}: {' '.join(str(e).split())[:300]}") from None


def hf_adds_bos(hf, bos: int) -> bool:
    """Whether a `tokenizers` Tokenizer's own post-processor starts a text's tokens with `bos` (what
    transformers' PreTrainedTokenizerFast adds)."""
    try:
        return hf.encode("a", add_special_tokens=True).ids[:1] == [bos]
    except Exception:   # noqa: BLE001  (a tokenizer that cannot encode: its load or first use says so)
        return True


_LIVE: "weakref.WeakSet[Tokenizer]" = weakref.WeakSet()


def _after_fork_in_child():
    """A fork()ed child gets each tokenizer's flag lock as the parent's threads held it: one encoding at the fork
    (a server tokenizes on a pool) would leave it held for ever there."""
    for t in list(_LIVE):
        t._flag_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Tokenizer:
    """encode / decode / stream. `bos_id`, `eos_ids` (every id that should stop generation)."""

    def __init__(self, kind: str, blob: bytes, *, bos_id: int | None = None, eos_ids=(), source: str = "store",
                 add_bos: bool | None = None):
        """add_bos: whether encode(add_bos=True) starts with BOS, as the model's reference tokenizer does (the
        conversion's finding; None, a store made before it whose tokenizer cannot tell: always)."""
        self.kind = kind
        self.add_bos = add_bos
        self._source = source
        if kind == "hf_json":
            from tokenizers import Tokenizer as HFTokenizer

            spec = parse_hf_json(blob, source)
            self._hf = _library_call(source, "tokenizer.json cannot be loaded", HFTokenizer.from_str, blob.decode("utf-8"))
            # encode_special_tokens is state of this one HF tokenizer, shared by every thread (the server tokenizes on
            # a pool): set and read under this lock, or an encode with the other `special` flips it in between (a chat
            # prompt's control tokens read as plain text)
            self._flag_lock = threading.Lock()
            _LIVE.add(self)
            self._sp = None
            self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
            # specials (added tokens flagged special) are what `special=False` must not parse from text
            added = spec.get("added_tokens") or []
            self._special_ids = {int(t["id"]) for t in added if t.get("special")}
            self._added_ids = {int(t["id"]) for t in added}
            self._byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
        elif kind == "sentencepiece":
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor()
            _library_call(source, "SentencePiece model cannot be loaded", self._sp.LoadFromSerializedProto, blob)
            self._hf = None
            self.vocab_size = self._sp.GetPieceSize()
            # control pieces and <unk>: transformers (slow and fast) and llama.cpp parse "<unk>" in a text as the
            # one token, as a tokenizer.json of the same vocabulary flags it special (it was cut into pieces)
            self._special_ids = {i for i in range(self.vocab_size) if self._sp.IsControl(i) or self._sp.IsUnknown(i)}
            pieces = sorted((self._sp.IdToPiece(i) for i in self._special_ids if self._sp.IdToPiece(i)), key=len, reverse=True)
            self._special_re = re.compile("(" + "|".join(re.escape(p) for p in pieces) + ")") if pieces else None
        else:
            raise FormatError(f"{source}: unknown tokenizer kind {kind!r} (expected hf_json or sentencepiece)")
        if self.vocab_size == 0:
            raise FormatError(f"{source}: the tokenizer has an empty vocabulary",
                              hint="the tokenizer file is corrupt; re-convert from a complete model")
        self.bos_id = bos_id
        self._bytes_cache: dict[int, bytes] = {}
        eos = [int(e) for e in eos_ids if e is not None]
        for name in END_OF_TURN_TOKENS:  # e.g. LLaMA-3's <|eot_id|> next to config's <|end_of_text|>
            i = self.token_to_id(name)
            if i is not None and i not in eos:
                eos.append(i)
        self.eos_ids = tuple(eos)

    @classmethod
    def from_store(cls, store) -> "Tokenizer":
        spec = store.tokenizer_spec
        if spec is None:
            raise FormatError(f"{store.path}: the store has no tokenizer", hint="re-convert the model from a source with one")
        cfg = store.config
        origin = store.meta.get("source")
        source = store.path if not isinstance(origin, str) or not origin else f"{store.path} (converted from {origin})"
        add_bos = store.meta.get("add_bos")
        tok = cls(spec[0], spec[1], bos_id=cfg.bos_token_id, eos_ids=cfg.eos_token_ids, source=source,
                  add_bos=add_bos if isinstance(add_bos, bool) else None)
        if tok.add_bos is None and tok._hf is not None and tok.bos_id is not None:
            # a store of a converter before 3 (no add_bos): its own tokenizer.json decides, as a conversion today
            # decides it for a tokenizer.json of no Llama class (a Qwen3 / Ternary Bonsai one adds no BOS, and got
            # one here before); a GGUF's built tokenizer.json has its BOS template exactly where the file wants one
            tok.add_bos = hf_adds_bos(tok._hf, tok.bos_id)
        return tok

    # ---- lookups ------------------------------------------------------------------------------------
    def token_to_id(self, token: str) -> int | None:
        if self._hf is not None:
            return self._hf.token_to_id(token)
        i = self._sp.PieceToId(token)
        return i if i != self._sp.unk_id() or token == self._sp.IdToPiece(i) else None

    def id_to_token(self, i: int) -> str | None:
        if self._hf is not None:
            return self._hf.id_to_token(i)
        return self._sp.IdToPiece(i) if 0 <= i < self.vocab_size else None

    # ---- encode / decode ----------------------------------------------------------------------------
    def encode(self, text: str, *, add_bos: bool = False, special: bool = True) -> list[int]:
        """Token ids of `text`. add_bos: what the reference adds as special tokens (BOS). special: parse
        special-token strings like <|eot_id|> in the text into their ids (else they are plain text)."""
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:   # a lone surrogate: the caller's text, not the model, is wrong
                raise BitNetError(f"the text holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x} at character"
                                  f" {e.start + 1}): not text") from None
        if self._hf is not None:
            with self._flag_lock:
                self._hf.encode_special_tokens = not special
                ids = _library_call(self._source, "the tokenizer cannot encode this text",
                                    lambda: self._hf.encode(text, add_special_tokens=add_bos)).ids
                if add_bos and self.add_bos is False and self.bos_id is not None and ids[:1] == [self.bos_id] and \
                        self._hf.encode(text, add_special_tokens=False).ids[:1] != [self.bos_id]:
                    ids = ids[1:]   # a post-processor that adds a BOS where the reference does not: dropped
        else:
            ids = []
            parts = self._special_re.split(text) if special and self._special_re else [text]
            for k, part in enumerate(parts):
                if not part:
                    continue
                if special and k % 2 == 1:
                    ids.append(self._sp.PieceToId(part))
                else:
                    ids.extend(self._sp.EncodeAsIds(part))
        if add_bos and self.bos_id is not None and self.add_bos is not False and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return list(ids)

    def decode(self, ids, *, skip_special: bool = False) -> str:
        ids = [int(i) for i in ids]
        if self._hf is not None:
            return _library_call(self._source, "the tokenizer cannot decode these tokens",
                                 lambda: self._hf.decode(ids, skip_special_tokens=skip_special))
        # ids past the SentencePiece model's pieces (a model's vocabulary may be padded beyond them, as 1bitLLM's
        # 32002 over 32000) have no text: nothing, as transformers decodes them (SentencePiece itself raises)
        ids = [i for i in ids if 0 <= i < self.vocab_size and not (skip_special and i in self._special_ids)]
        # sentencepiece drops control tokens when decoding; keep them visible like llama.cpp does
        out, run = [], []
        for i in ids:
            if i in self._special_ids and not skip_special:
                if run:
                    out.append(self._sp.DecodeIds(run))
                    run = []
                out.append(self._sp.IdToPiece(i))
            else:
                run.append(i)
        if run:
            out.append(self._sp.DecodeIds(run))
        return "".join(out)

    @property
    def text_bos(self) -> int | None:
        """The BOS id a text's tokens start with (encode(add_bos=True)), or None where the model's tokenizer adds
        none (llama.cpp's llama_vocab_get_add_bos: its perplexity puts BOS first in a chunk only then)."""
        return self.bos_id if self.add_bos is not False else None

    def is_special(self, i: int) -> bool:
        return i in self._special_ids

    def is_unknown(self, i: int) -> bool:
        """SentencePiece's <unk> piece (a tokenizer.json flags its unknown token special: is_special)."""
        return self._sp is not None and 0 <= i < self.vocab_size and self._sp.IsUnknown(i)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token i adds to a text, computed on first use and cached. Byte-level BPE: its exact bytes
        (GPT-2's byte-to-unicode map). SentencePiece (the library, or a tokenizer.json in its style, what a GGUF
        "llama" vocab becomes): a byte-fallback piece <0xNN> is that one byte; any other piece its text as it
        decodes after Tokenizer.anchor, so "▁the" is " the" (the space a decode strips at the very start of a
        text is kept: this is a continuation). Control tokens: their piece, as decode() shows them. An id
        outside the vocabulary: nothing."""
        b = self._bytes_cache.get(i)
        if b is None:
            b = self._token_bytes(i)
            self._bytes_cache[i] = b
        return b

    def _token_bytes(self, i: int) -> bytes:
        if not 0 <= i < self.vocab_size:
            return b""
        t = self.id_to_token(i)
        if t is None:
            return b""
        if self.byte_level:
            if i in self._added_ids or not _GPT2_CHARS.issuperset(t):
                return t.encode("utf-8")
            return t.translate(_GPT2_TO_LATIN1).encode("latin-1")
        if self._sp is not None and self._sp.IsByte(i):
            return bytes([int(t[3:5], 16)])
        if i in self._special_ids:
            return t.encode("utf-8")
        anchor = self.anchor
        if anchor is None:   # no plain one-character token to decode after (no such vocabulary seen)
            return self.decode([i]).encode("utf-8")
        head = self.decode([anchor])
        text = self.decode([anchor, i])
        if _BYTE_PIECE.fullmatch(t) and text in (head + "\ufffd", head + chr(int(t[3:5], 16))):
            return bytes([int(t[3:5], 16)])   # tokenizer.json's ByteFallback piece
        return text[len(head):].encode("utf-8") if text.startswith(head) else text.encode("utf-8")

    @property
    def byte_level(self) -> bool:
        return self._hf is not None and self._byte_level

    def stream(self, *, skip_special: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special=skip_special)

    @property
    def anchor(self) -> int | None:
        """A plain token whose text is one character with no space before it, or None: StreamDecoder decodes
        each window after it, so a SentencePiece decoder's strip of the text's first space (right at the start of
        a decode) never takes the space of a generated word."""
        if not hasattr(self, "_anchor"):
            self._anchor = None
            for ch in "a0x.":
                i = self.token_to_id(ch)
                if i is not None and not self.is_special(i) and self.decode([i, i]) == ch + ch:
                    self._anchor = i
                    break
        return self._anchor


class StreamDecoder:
    """push(id) -> the new text that is complete so far ("" while a character is still incomplete);
    flush() -> whatever is left (an invalid tail decodes to U+FFFD). Text once returned is never revised."""

    def __init__(self, tok: Tokenizer, *, skip_special: bool = True):
        import codecs

        self._tok = tok
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        token = int(token)
        if self._skip and self._tok.is_special(token):
            return ""
        return self._utf8.decode(self._tok.token_bytes(token))

    @property
    def pending(self) -> bool:
        """Bytes of a character not yet complete are held (the next push may finish it)."""
        return bool(self._utf8.getstate()[0])

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# ---- text given by the user (argv, stdin, -f files) ------------------------------------------------------
ENCODING_HINT = NOT_UTF8_HINT


def decode_utf8(data: bytes | str, where: str, start: bool = False) -> str:
    """`data` as text, or ValueError with one line naming the first bad byte, where it is and what to do.
    Bytes: engine/fileio.py's decode_text (start: they begin a file or a stream, whose UTF-8 BOM is dropped).
    A str holds lone surrogates where Python could not decode argv's or stdin's bytes in the locale's encoding
    (surrogateescape): UTF-8 typed under a locale that is not UTF-8 (LANG=C with PYTHONUTF8=0) is the text it
    spells; bytes that are no UTF-8 are refused, naming the first."""
    if isinstance(data, str):
        if any("\udc80" <= ch <= "\udcff" for ch in data):
            raw = data.encode("utf-8", "surrogateescape")
            try:
                data = raw.decode("utf-8")
            except UnicodeDecodeError as e:   # the first byte that is no UTF-8 (one before it may be: "é" then 0xe9)
                i = len(raw[:e.start].decode("utf-8", "surrogateescape"))
                raise ValueError(f"{where}: not UTF-8 text: byte 0x{raw[e.start]:02x} at character {i + 1} "
                                 f"({ENCODING_HINT})") from None
        # the BOM after the bytes are text: one that came in escaped ("\udcef\udcbb\udcbf") is one too
        return data[1:] if start and data.startswith("\ufeff") else data
    try:
        return decode_text(data, start)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
