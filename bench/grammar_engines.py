"""The grammar engine choice, measured: llguidance (what the engine uses) against xgrammar on our tokenizers.

    python bench/grammar_engines.py [--vocab-gguf PATH ...] [--corpus DIR] [--json OUT]

Per tokenizer: the engine's tokenizer setup time; per schema: compile time, and the mask time per token while
walking a valid answer token by token (median and p99, one thread); over a corpus of real-world JSON Schemas
(default: the ~30 CI / config schemas vendored by the check-jsonschema package on PyPI, --corpus DIR for
another): how many each engine compiles, and its median compile time. xgrammar is optional (its PyPI
package needs torch + transformers): without it the llguidance rows print alone, saying so.

Tokenizers: the bundled model's (1.2k), --vocab-gguf files (llama.cpp's vocab-only GGUFs, e.g.
ggml-vocab-llama-bpe.gguf = Llama-3's 128k, from the llama-cpp-python sdist's vendor/llama.cpp/models), and a
sentencepiece model (the synthetic 1bitLLM vocabulary).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

sys.path.insert(0, HERE)
from bench_structured import EXTRACTION  # noqa: E402
from make_models import save_json  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
TOOL_CALL = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
             "properties": {"name": {"const": "get_weather"},
                            "arguments": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                                          "properties": {"city": {"type": "string"},
                                                         "days": {"type": "integer", "minimum": 1, "maximum": 14}}}}}
# (schema, a valid answer in compact JSON) pairs walked token by token
WALKS = {
    "person": (PERSON, {"name": "Ada Lovelace", "age": 36}),
    "tool_call": (TOOL_CALL, {"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}),
    "extraction": (EXTRACTION, {"name": "Amelie Durand", "age": 34, "email": "amelie.durand@example.org", "city": "Lyon",
                                "country": "France", "phone": "+33 612 3456", "member": True, "score": 87,
                                "tags": ["vip", "early"], "id": 40213}),
}


def tokenizers(vocab_ggufs):
    from bitnet_cpu.engine.api import load_model
    from bitnet_cpu.engine.formats.gguf import GGUFFile
    from bitnet_cpu.engine.formats.tokenizer import Tokenizer
    from bitnet_cpu.engine.formats.tokenizer_build import gguf_tokenizer

    llm = load_model(None, progress=False)
    yield "bundled (hf_json)", llm.tokenizer, llm.config.vocab_size
    for path in vocab_ggufs:
        t = gguf_tokenizer(GGUFFile(path))
        kind, blob = t["blob"]
        tok = Tokenizer(kind, blob, bos_id=t["bos"], eos_ids=t["eos"], source=path)
        yield f"{os.path.basename(path)} ({tok.vocab_size})", tok, tok.vocab_size
    try:
        from bitnet_cpu.engine.synth import SynthModel

        m = SynthModel(seed=3, style="1bitllm")
        info = m.tokenizer_info()
        tok = Tokenizer("sentencepiece", info["model"], bos_id=info.get("bos"), eos_ids=[info.get("eos")])
        yield f"sentencepiece ({tok.vocab_size})", tok, m.V
    except ImportError:
        pass


def token_bytes(tok, n_vocab):
    from bitnet_cpu.engine.runtime.constraints import _SentencePieceVocab

    if tok.kind == "sentencepiece":
        return _SentencePieceVocab(tok, n_vocab).tokens
    out = []
    for i in range(n_vocab):
        b = tok.token_bytes(i) if i < tok.vocab_size else b""
        out.append(b if b is not None else (tok.id_to_token(i) or "").replace("\u2581", " ").encode())
    return out


def exact_tokens(text, tok, vocab_bytes):
    """The tokenizer's ids for `text` when they spell exactly its bytes (sentencepiece-style encoders add a
    leading space: then a longest-match split over the vocabulary's bytes)."""
    ids, data = tok.encode(text), text.encode("utf-8")
    if b"".join(vocab_bytes[i] for i in ids) == data:
        return ids
    index = {}
    for i, b in enumerate(vocab_bytes):
        if b:
            index.setdefault(b, i)
    longest, out, pos = max(map(len, index)), [], 0
    while pos < len(data):
        n = next(n for n in range(min(longest, len(data) - pos), 0, -1) if data[pos:pos + n] in index)
        out.append(index[data[pos:pos + n]])
        pos += n
    return out


class LLG:
    name = "llguidance"

    def __init__(self, tok, n_vocab):
        from bitnet_cpu.engine.runtime.constraints import _ll_tokenizer

        self.ll = _ll_tokenizer(tok, n_vocab)
        import numpy as np
        self.mask = np.zeros((n_vocab + 31) // 32, np.int32)

    def compile(self, schema):
        from llguidance import LLMatcher
        m = LLMatcher(self.ll, LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}),
                      log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def walk(self, m, tokens):
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
            times.append(time.perf_counter() - t0)
            if not m.consume_token(t):
                raise ValueError(m.get_error())
        return times


class XGR:
    name = "xgrammar"

    def __init__(self, tok, n_vocab):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo(token_bytes(tok, n_vocab), xgr.VocabType.RAW, vocab_size=n_vocab,
                                 stop_token_ids=list(tok.eos_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(1, n_vocab)

    def compile(self, schema):
        cg = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        return self.xgr.GrammarMatcher(cg)

    def walk(self, m, tokens):
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(self.mask)
            times.append(time.perf_counter() - t0)
            if not m.accept_token(t):
                raise ValueError(f"token {t} rejected")
        return times


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-gguf", action="append", default=[], help="a llama.cpp vocab-only GGUF (repeatable)")
    ap.add_argument("--corpus", help="a folder of JSON Schema files (default: check-jsonschema's vendored ones)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    engines = [LLG]
    try:
        import xgrammar  # noqa: F401
        engines.append(XGR)
    except ImportError as e:
        print(f"xgrammar not installed ({e}): llguidance rows only (pip install xgrammar pulls torch + transformers)")
    corpus = a.corpus
    if corpus is None:
        try:
            import check_jsonschema
            corpus = os.path.join(os.path.dirname(check_jsonschema.__file__), "builtin_schemas", "vendor")
        except ImportError:
            print("no corpus: pip install check-jsonschema (its vendored schemas) or give --corpus DIR")
    schemas = {}
    for p in sorted(glob.glob(os.path.join(corpus, "*.json"))) if corpus else []:
        try:
            with open(p, encoding="utf-8") as f:
                schemas[os.path.basename(p)] = json.load(f)
        except ValueError:
            pass
    res = []
    for label, tok, n_vocab in tokenizers(a.vocab_gguf):
        for E in engines:
            t0 = time.perf_counter()
            eng = E(tok, n_vocab)
            vocab_bytes = token_bytes(tok, n_vocab)
            row = {"tokenizer": label, "engine": E.name, "setup_ms": (time.perf_counter() - t0) * 1000}
            for name, (schema, answer) in WALKS.items():
                t0 = time.perf_counter()
                m = eng.compile(schema)
                row[f"{name}_compile_ms"] = (time.perf_counter() - t0) * 1000
                toks = exact_tokens(json.dumps(answer, separators=(",", ":"), ensure_ascii=False), tok, vocab_bytes)
                try:
                    ts = eng.walk(m, toks)
                    row[f"{name}_mask_us"] = (statistics.median(ts) * 1e6, _pct(ts, 0.99) * 1e6, len(toks))
                except ValueError as e:
                    row[f"{name}_mask_us"] = f"walk failed: {str(e)[:80]}"
            ok, times = 0, []
            for name, schema in schemas.items():
                t0 = time.perf_counter()
                try:
                    eng.compile(schema)
                    ok += 1
                    times.append(time.perf_counter() - t0)
                except Exception:
                    pass
            row["corpus"] = (ok, len(schemas), statistics.median(times) * 1000 if times else float("nan"))
            res.append(row)
            walks = " | ".join(f"{n} " + (f"{v[0]:.0f}/{v[1]:.0f} us x{v[2]}" if isinstance(v, tuple) else v)
                               for n, v in ((n, row[f"{n}_mask_us"]) for n in WALKS))
            print(f"{label:34s} {E.name:10s} setup {row['setup_ms']:7.0f} ms | compile "
                  + " ".join(f"{row[f'{n}_compile_ms']:.1f}" for n in WALKS)
                  + f" ms | mask median/p99 {walks} | corpus {ok}/{len(schemas)} compiled, median {row['corpus'][2]:.1f} ms",
                  flush=True)
    save_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
