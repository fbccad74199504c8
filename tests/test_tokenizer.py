"""Tokenizers from the store blob (tokenizers / sentencepiece), UTF-8-safe streaming, chat templates."""
import io

import pytest

from bitnet_cpu.engine.runtime import chat_template as ct
from bitnet_cpu.engine.errors import BitNetError, FormatError
from bitnet_cpu.engine.synth import BROKEN_GGUF_TEMPLATE, TRAIN_TEXT, SynthModel
from bitnet_cpu.engine.formats.tokenizer import Tokenizer

TEXTS = [TRAIN_TEXT, "Café 日本語 🙂🙂 naïve — ‘quotes’", "a\u0301 e\u0301 \U0001F468\u200D\U0001F469", " x  y\n\n\tz"]


@pytest.fixture(scope="module")
def bpe():
    m = SynthModel(seed=0)
    info = m.tokenizer_info()
    return Tokenizer("hf_json", m.tokenizer_json().encode(), bos_id=info["bos"], eos_ids=[info["eos"]]), info


@pytest.fixture(scope="module")
def spm_blob():
    spm = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TRAIN_TEXT.splitlines() * 3), model_writer=buf,
                                   vocab_size=600, model_type="bpe", byte_fallback=True, character_coverage=0.98,
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    return buf.getvalue()


def _stream(tok, ids):
    s = tok.stream()
    pieces = [s.push(i) for i in ids] + [s.flush()]
    return pieces


def test_bpe_round_trip_and_stream(bpe):
    tok, info = bpe
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        pieces = _stream(tok, ids)
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces), "a streamed piece split a UTF-8 character"
    # multi-byte characters really are split over several byte tokens in this vocabulary
    ids = tok.encode("🙂")
    assert len(ids) > 1 and _stream(tok, ids)[0] == ""


def test_bpe_specials_bos_eos(bpe):
    tok, info = bpe
    assert tok.encode("<|eot_id|>", special=True) == [info["eot"]]
    assert info["eot"] not in tok.encode("<|eot_id|>", special=False)
    assert tok.encode("hi", add_bos=True)[0] == info["bos"]
    assert tok.encode("hi", add_bos=True).count(info["bos"]) == 1
    assert set(tok.eos_ids) == {info["eos"], info["eot"]}  # <|eot_id|> joins config's eos
    # specials are skipped when streaming, kept by decode()
    assert "".join(_stream(tok, [info["eot"]] + tok.encode("ok"))) == "ok"
    assert tok.decode([info["eot"]]) == "<|eot_id|>"


def test_sentencepiece(spm_blob):
    import sentencepiece as spm

    ref = spm.SentencePieceProcessor(model_proto=spm_blob)
    tok = Tokenizer("sentencepiece", spm_blob, bos_id=1, eos_ids=[2])
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text)
        assert tok.encode(text, add_bos=True) == [1] + ref.encode(text)
        assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text))
        pieces = _stream(tok, tok.encode(text))
        # a stream is text after what came before (a prompt): the first word keeps its space, as in the
        # decode of a context and the ids, less the context's text (transformers' TextStreamer, vLLM, llama.cpp)
        ctx = ref.encode("x.")
        assert "".join(pieces) == ref.decode(ctx + ref.encode(text))[len(ref.decode(ctx)):]
        assert not any("\ufffd" in p for p in pieces)
    assert tok.encode("a</s>b", special=True).count(2) == 1
    assert 2 not in tok.encode("a</s>b", special=False)
    # "<unk>" in a text is the unknown token, as transformers and llama.cpp parse it (it was cut into pieces)
    assert tok.encode("a<unk>b", special=True).count(0) == 1
    assert 0 not in tok.encode("a<unk>b", special=False)


def test_bad_blobs():
    with pytest.raises(FormatError):
        Tokenizer("hf_json", b"{not json", source="x.bnstore")
    with pytest.raises(FormatError):
        Tokenizer("sentencepiece", b"garbage")
    with pytest.raises(FormatError):
        Tokenizer("wordpiece", b"")


MSGS = [{"role": "system", "content": "You are a helpful AI assistant."}, {"role": "user", "content": "How are you?"}]


def test_fallback_template_is_the_2b4t_form():
    want = "<|begin_of_text|>System: You are a helpful AI assistant.<|eot_id|>User: How are you?<|eot_id|>Assistant: "
    for tpl in (None, "", BROKEN_GGUF_TEMPLATE):
        assert ct.render(tpl, MSGS, bos_token="<|begin_of_text|>") == want
    assert ct.render(None, MSGS, add_generation_prompt=False, bos_token="<|begin_of_text|>") == want[: -len("Assistant: ")]


def test_model_template_used_and_sandboxed():
    tpl = "{% for m in messages %}[{{ m.role }}]{{ m.content | trim }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    assert ct.render(tpl, MSGS) == "[system]You are a helpful AI assistant.\n[user]How are you?\n>"
    with pytest.raises(BitNetError):
        ct.render("{{ ''.__class__.__mro__[1].__subclasses__() }}", MSGS)
    with pytest.raises(BitNetError, match="no system"):
        ct.render("{{ raise_exception('no system role') }}", MSGS)
    with pytest.raises(BitNetError):
        ct.render("{% for %}", MSGS)
    with pytest.raises(BitNetError):
        ct.render(None, [{"content": "no role"}])


def test_one_rule_for_a_broken_chat_template():
    """The converter (what it stores) and the runtime (what it renders) replace the same templates: missing,
    blank or the official GGUF's "BITNETAssistant" one; a model's own template that says "Human: " is kept."""
    from bitnet_cpu.engine.formats.tokenizer_build import fix_chat_template

    own = "{% for m in messages %}Human: {{ m.content }}\n{% endfor %}"
    for tpl in (None, "", "  \n", BROKEN_GGUF_TEMPLATE, own):
        assert fix_chat_template(tpl) == ct.choose_template(tpl)
    assert fix_chat_template(own) == own
    assert fix_chat_template(BROKEN_GGUF_TEMPLATE) != BROKEN_GGUF_TEMPLATE


def test_bos_only_where_the_reference_tokenizer_adds_one(tmp_path):
    """A text's tokens start with BOS as the model's own tokenizer does: a Qwen3-style tokenizer.json adds none
    (though config.json names a bos_token_id; the `tokenizers` library is transformers' PreTrainedTokenizerFast), a
    LlamaTokenizerFast adds one by tokenizer_config's add_bos_token, and a GGUF by tokenizer.ggml.add_bos_token
    (llama.cpp's rule), whichever way the key says."""
    import json

    from tokenizers import Tokenizer as HFTokenizer

    from bitnet_cpu.engine.api import load_model
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.synth import write_bonsai_dir, write_gguf_tq
    from test_fuzz import _rewrite_gguf

    text = "Once upon a time"
    m = SynthModel({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 64,
                    "hidden_act": "silu"}, seed=1, style="llama")
    d = write_bonsai_dir(m, str(tmp_path / "qwen"))
    tj = json.load(open(f"{d}/tokenizer.json"))
    tj["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                            "use_regex": False}   # as Qwen3's: no template adding a BOS
    json.dump(tj, open(f"{d}/tokenizer.json", "w"))
    reference = HFTokenizer.from_file(f"{d}/tokenizer.json").encode(text).ids
    bos = json.load(open(f"{d}/config.json"))["bos_token_id"]
    assert bos is not None and reference[:1] != [bos]
    llm = load_model(convert(d, str(tmp_path / "qwen.bnstore"), progress=False), ctx=64, progress=False)
    assert llm.tokenize(text, add_bos=True) == reference
    tc = json.load(open(f"{d}/tokenizer_config.json"))   # LlamaTokenizerFast rebuilds its post-processor: BOS
    json.dump({**tc, "tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True}, open(f"{d}/tokenizer_config.json", "w"))
    llm = load_model(convert(d, str(tmp_path / "llama_class.bnstore"), progress=False), ctx=64, progress=False)
    assert llm.tokenize(text, add_bos=True) == [bos] + reference

    g = SynthModel({}, seed=3, style="llama")
    src = write_gguf_tq(g, str(tmp_path / "g.gguf"), "TQ2_0", arch="llama")
    with_bos = load_model(convert(src, str(tmp_path / "g.bnstore"), progress=False), ctx=64, progress=False)
    ids = with_bos.tokenize(text, add_bos=True)
    assert ids[0] == with_bos.tokenizer.bos_id
    _rewrite_gguf(src, str(tmp_path / "nobos.gguf"), "tokenizer.ggml.add_bos_token", ("bool", False))
    no_bos = load_model(convert(str(tmp_path / "nobos.gguf"), str(tmp_path / "nobos.bnstore"), progress=False),
                        ctx=64, progress=False)
    assert no_bos.tokenize(text, add_bos=True) == ids[1:]
    # perplexity puts BOS first in each chunk only where texts start with it (llama-perplexity's add_bos rule)
    from bitnet_cpu.engine.runtime import perplexity as P
    assert no_bos.tokenizer.text_bos is None and with_bos.tokenizer.text_bos == ids[0]
    chunk = no_bos.tokenize(TRAIN_TEXT)[:16]
    stats = P.NllStats()
    for logits, targets in P.chunk_logits(no_bos.model, chunk, None):
        stats.add(logits, targets)
    assert no_bos.perplexity(chunk, chunk=16)["ppl"] == stats.estimate()[0]


def test_sentencepiece_stream_after_a_prompt_and_ids_past_its_pieces(spm_blob):
    """Generated text streams as the reference shows it after the prompt (decode(prompt + ids) less decode(prompt)):
    the first word keeps its space, and so does a word after a skipped special token (SentencePiece strips the
    space at the start of a decode). Ids past the model's pieces (a vocabulary padded beyond them) are no text,
    never an error."""
    import sentencepiece as spm

    ref = spm.SentencePieceProcessor(model_proto=spm_blob)
    tok = Tokenizer("sentencepiece", spm_blob, bos_id=1, eos_ids=[2])
    prompt = ref.encode("The quick brown fox")
    for text in TEXTS:
        ids = ref.encode(" jumps over " + text)
        want = ref.decode(prompt + ids)[len(ref.decode(prompt)):]
        assert "".join(_stream(tok, ids)) == want
        # an end-of-text between two words, skipped: the words around it as decoded apart
        cut = next(i for i in range(1, len(ids)) if ref.id_to_piece(ids[i]).startswith("\u2581"))
        with_eos = ids[:cut] + [2] + ids[cut:]
        assert "".join(_stream(tok, with_eos)) == want[:len(ref.decode(prompt + ids[:cut])) - len(ref.decode(prompt))] \
            + ref.decode(prompt + ids[cut:])[len(ref.decode(prompt)):]
    past = ref.get_piece_size() + 5
    assert tok.decode([past]) == "" and tok.decode(prompt + [past]) == ref.decode(prompt)
    assert "".join(_stream(tok, [past] + ids)) == "".join(_stream(tok, ids))


def test_a_lone_surrogate_is_the_texts_fault(bpe, spm_blob):
    """Text with a lone surrogate (what Python makes of undecodable bytes or JSON's unpaired "\\ud800") is refused
    naming the character, by both kinds of tokenizer; it was a FormatError blaming the model file (byte-level) or
    a raw RuntimeError (SentencePiece)."""
    for tok in (bpe[0], Tokenizer("sentencepiece", spm_blob, bos_id=1, eos_ids=[2])):
        with pytest.raises(BitNetError, match=r"lone UTF-16 surrogate \(\\ud800 at character 3\)") as e:
            tok.encode("ab\ud800c")
        assert not isinstance(e.value, FormatError)


def _spm_as_gguf_json(ref) -> Tokenizer:
    """The SentencePiece vocabulary as a GGUF "llama" vocab becomes in a store: an HF tokenizer.json in the
    LLaMA-2 style (Metaspace, ByteFallback), built the way the converter builds it."""
    from bitnet_cpu.engine.formats.tokenizer_build import _spm_json

    n = ref.get_piece_size()
    types = [3 if ref.is_control(i) else 2 if ref.is_unknown(i) else 6 if ref.is_byte(i) else 1 for i in range(n)]
    js = _spm_json([ref.id_to_piece(i) for i in range(n)], types, [ref.get_score(i) for i in range(n)], 1)
    return Tokenizer("hf_json", js.encode(), bos_id=1, eos_ids=[2])


def test_sentencepiece_stream_of_byte_pieces_is_never_revised(spm_blob):
    """Byte-fallback pieces stream as their bytes through one UTF-8 decoder: a character split over them comes
    out whole, invalid bytes as U+FFFD, and text once emitted stays. The reference is the bytes the
    SentencePiece library gives each piece (<0xNN> its byte, any other piece its text after a context), decoded
    by Python's UTF-8 codec. The old window decoder gave up after 4 pieces, emitted U+FFFD, and once a later byte
    completed a character it emitted its anchor piece and text already sent a second time."""
    import random

    import sentencepiece as spm

    ref = spm.SentencePieceProcessor(model_proto=spm_blob)
    ctx = ref.encode("x.")
    head = ref.decode(ctx)

    def ref_bytes(i):
        if ref.is_byte(i):
            return bytes([int(ref.id_to_piece(i)[3:5], 16)])
        return ref.decode(ctx + [i])[len(head):].encode("utf-8")

    byte = {b: ref.piece_to_id(f"<0x{b:02X}>") for b in range(256)}
    words = [i for i in range(ref.get_piece_size()) if not (ref.is_byte(i) or ref.is_control(i) or ref.is_unknown(i))]
    rng = random.Random(5)
    for tok in (Tokenizer("sentencepiece", spm_blob, bos_id=1, eos_ids=[2]), _spm_as_gguf_json(ref)):
        cases = [ref.encode("Hi") + [byte[b] for b in (0x80, 0xF0, 0x9F, 0x98, 0x80)] + ref.encode(" ok"),
                 ref.encode("Hi") + [byte[b] for b in (0xE6, 0xDC, 0xE7, 0xC4, 0xAE)] + ref.encode(" ok")]
        for _ in range(60):
            ids = []
            for _ in range(rng.randint(1, 12)):
                if rng.random() < 0.5:
                    ids.append(rng.choice(words))
                else:   # a character's bytes, whole or cut, or random bytes
                    raw = rng.choice(["é", "日", "🙂", "\u200d"]).encode() if rng.random() < 0.6 else \
                        bytes(rng.randrange(0x80, 0x100) for _ in range(rng.randint(1, 5)))
                    ids += [byte[b] for b in raw[: rng.randint(1, len(raw))]]
            cases.append(ids)
        for ids in cases:
            pieces = _stream(tok, ids)
            assert "".join(pieces) == b"".join(ref_bytes(i) for i in ids).decode("utf-8", "replace"), ids
        assert "".join(_stream(tok, cases[0])) == " Hi\ufffd\U0001F600 ok"   # the emoji after a stray byte, whole
    # the vocabulary as a GGUF gives it: each token's bytes as the SentencePiece model's (grammars and DRY match
    # these: "\u2581the" was b"\xe2\x96\x81the" there, "<0x0A>" six bytes, and no token could give a space)
    gguf_tok, sp_tok = _spm_as_gguf_json(ref), Tokenizer("sentencepiece", spm_blob, bos_id=1, eos_ids=[2])
    for i in range(ref.get_piece_size()):
        if not (ref.is_control(i) or ref.is_unknown(i)):
            assert gguf_tok.token_bytes(i) == sp_tok.token_bytes(i) == ref_bytes(i), (i, ref.id_to_piece(i))


def test_special_flag_is_per_call_under_concurrent_encodes(bpe):
    """encode(special=...) sets a flag on the one HF tokenizer every thread shares (the server tokenizes on a pool):
    threads encoding the same text with special True and False each get their own reading, never the other's (a
    chat prompt's <|eot_id|> read as plain text, or a parse_special=false answer holding the control token)."""
    import sys
    import threading
    import time

    tok, info = bpe
    text = "a<|eot_id|>b"
    want = {True: tok.encode(text, special=True), False: tok.encode(text, special=False)}
    assert want[True] != want[False] and info["eot"] in want[True]
    wrong, stop_at = [], time.monotonic() + 5
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # switch threads as often as possible: the gap between flag and encode is tiny

    def work(special):
        for n in range(20000):
            if tok.encode(text, special=special) != want[special]:
                wrong.append(special)
            if n % 256 == 0 and (wrong or time.monotonic() > stop_at):
                return
    try:
        threads = [threading.Thread(target=work, args=(sp,)) for sp in (True, False)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not wrong, f"{len(wrong)} encodes read the other thread's special flag"
