"""The Python API used as a developer uses it: one LLM from two threads (each gets its own text or a clear
"superseded" error, never another's tokens), a finished Stream iterated again (nothing, at once), close() (the
model is gone: using it is one error; `with` closes), a str prompt to Engine.submit (tokenized as LLM.generate
tokenizes it), bad settings of the wrong type (one BitNetError naming the field, at the call). The bundled
model, in process."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from bitnet_cpu.engine.api import SamplingParams, load_engine, load_model
from bitnet_cpu.engine.errors import BitNetError

PROMPT = "Once upon a time"
GREEDY = SamplingParams(temperature=0)


def _text(llm, prompt=PROMPT, n=24):
    return "".join(c.text for c in llm.generate(prompt, GREEDY, max_tokens=n, ignore_eos=True))


def test_one_llm_from_two_threads_never_mixes_their_texts():
    llm = load_model(ctx=256, progress=False)
    want = {p: _text(llm, p) for p in (PROMPT, "2+3=")}
    for _ in range(3):
        got: dict = {}
        start = threading.Barrier(2)

        def run(p):
            text = ""
            start.wait()
            try:
                for c in llm.generate(p, GREEDY, max_tokens=24, ignore_eos=True):
                    text += c.text
                got[p] = (text, None)
            except BitNetError as e:
                got[p] = (text, str(e))
        ts = [threading.Thread(target=run, args=(p,)) for p in want]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert set(got) == set(want)
        for p, (text, err) in got.items():
            if err is None:
                assert text == want[p], (p, text)
            else:   # superseded by the other thread's call: what came before is its own text
                assert "superseded" in err and want[p].startswith(text), (p, text, err)
    assert _text(llm) == want[PROMPT]   # and the model goes on as before
    llm.close()


def test_a_finished_stream_iterated_again_ends_at_once():
    with load_engine(ctx=256, parallel=2, progress=False) as eng:
        s = eng.submit(PROMPT, GREEDY, max_tokens=4)
        first = list(s)
        assert first and first[-1].finish_reason
        again: list = []
        t = threading.Thread(target=lambda: again.extend(s), daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive() and again == []   # it waited for ever on the queue


def test_close_frees_the_model_and_using_it_after_is_one_error():
    with load_model(ctx=128, progress=False) as llm:
        assert _text(llm, n=4)
    for call in (lambda: llm.generate(PROMPT), lambda: llm.embed("hi"), lambda: llm.forward([1, 2]),
                 lambda: llm.perplexity(PROMPT * 40, chunk=32), lambda: llm.cached_tokens):
        with pytest.raises(BitNetError, match="closed"):
            call()
    assert llm.model is None and llm.store._data is None   # nothing holds the weights
    llm.close()   # twice: harmless
    eng = load_engine(ctx=128, parallel=1, progress=False)
    eng.close()
    with pytest.raises(BitNetError, match="closed"):
        eng.submit(PROMPT)
    eng.close()


def test_engine_takes_a_text_prompt_as_llm_does():
    llm = load_model(ctx=256, progress=False)
    want = [c.token for c in llm.generate(PROMPT, GREEDY, max_tokens=8, ignore_eos=True) if c.token is not None]
    with load_engine(ctx=256, parallel=2, progress=False) as eng:
        got = [c.token for c in eng.submit(PROMPT, GREEDY, max_tokens=8, ignore_eos=True) if c.token is not None]
        assert got == want
        with pytest.raises(BitNetError, match="bytes"):
            eng.submit(b"Once")
    with pytest.raises(BitNetError, match="bytes"):
        llm.generate(b"Once")


@pytest.mark.parametrize("kw,words", [
    ({"top_k": 40.0}, "top_k 40.0: must be an integer"), ({"temperature": "0.7"}, "temperature '0.7': must be a number"),
    ({"seed": "1"}, "seed '1': must be an integer"), ({"temperature": None}, "temperature None: must be a number"),
])
def test_settings_of_the_wrong_type_are_one_error_at_the_call(kw, words):
    llm = load_model(ctx=64, progress=False)
    with pytest.raises(BitNetError, match=words.replace("(", r"\(")):
        llm.generate(PROMPT, SamplingParams(**kw))   # raised by the call, not at the first next()
    ok = SamplingParams(mirostat=np.int64(2), dry_allowed_length=np.int64(2), top_p=np.float32(0.5),
                        logit_bias={np.int64(5): np.float32(1.0)})
    assert ok.check() is ok   # numpy's numbers are numbers


def test_a_superseded_generator_says_what_took_the_model():
    llm = load_model(ctx=128, progress=False)
    for took, call in (("embed()", lambda: llm.embed("hi")), ("a newer generate() call", lambda: _text(llm, n=2)),
                       ("close()", llm.close)):
        gen = llm.generate(PROMPT, GREEDY, max_tokens=8, ignore_eos=True)
        next(gen)
        call()
        with pytest.raises(BitNetError, match=took.replace("(", r"\(").replace(")", r"\)")):
            list(gen)
