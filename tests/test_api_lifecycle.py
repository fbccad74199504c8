"""The Python API used as a developer uses it: one LLM from two threads (each gets its own text or a clear
"superseded" error, never another's tokens), a finished Stream iterated again (nothing, at once), close() (the
model is gone: using it is one error; `with` closes), a str prompt to Engine.submit (tokenized as LLM.generate
tokenizes it), bad settings of the wrong type (one BitNetError naming the field, at the call). The bundled
model, in process."""
from __future__ import annotations

import re
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
                 lambda: llm.perplexity(PROMPT * 40, chunk=32), lambda: llm.cached_tokens,
                 lambda: llm.perplexity("hello world", chunk=128)):   # short: it was "fewer than one chunk"
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
        with pytest.raises(BitNetError, match=took.replace("(", r"\(").replace(")", r"\)")) as e:
            list(gen)
        # the one-at-a-time advice where another call took the model, not where it was closed
        assert (e.value.hint is None) == (took == "close()"), (took, e.value.hint)


def test_prompts_and_texts_of_the_wrong_type_are_a_bitnet_error():
    """None, a number, float or bool token ids, a string where ids go: a BitNetError naming what is wrong (a bare
    TypeError / ValueError before, and 1.5 or True was taken as token id 1); numpy ids are ids."""
    llm = load_model(ctx=128, progress=False)
    with load_engine(ctx=128, parallel=2, progress=False) as eng:
        for call, words in ((lambda: llm.embed(123), "texts: give a string or a list of strings, not int"),
                            (lambda: eng.embed(None), "texts: give a string or a list of strings, not NoneType"),
                            (lambda: list(llm.generate(None)), "prompt: give text (str) or token ids, not NoneType"),
                            (lambda: list(llm.generate(7)), "prompt: give text (str) or token ids, not int"),
                            (lambda: list(llm.generate([1.5])), r"prompt: token ids are integers, not float \(1.5\)"),
                            (lambda: eng.submit(None), "prompt: give text"),
                            (lambda: eng.embed_ids([[True]]), r"text 1 of 1: token ids are integers, not bool"),
                            (lambda: eng.embed_ids([[1], [2.0]]), r"text 2 of 2: token ids are integers, not float"),
                            (lambda: eng.embed_ids(["ab"]), "text 1 of 1: give token ids, not str")):
            with pytest.raises(BitNetError, match=words.replace("(str)", r"\(str\)")):
                call()
        assert eng.embed_ids([np.array([1, 2, 3])]).shape[0] == 1
    assert len(list(llm.generate(np.array([1, 2, 3]), GREEDY, max_tokens=2))) >= 1
    llm.close()


def test_a_stop_string_is_one_stop_sequence():
    """stop="word" is that word (OpenAI's `stop: string | array`, llama-cpp-python's and vLLM's reading), on
    LLM.generate and Engine.submit alike; it was taken letter by letter (a str is a sequence of str), cutting the
    text at the first of its letters."""
    llm = load_model(ctx=256, progress=False)
    words = _text(llm, n=24).split()
    word = next(w for w in words[2:] if len(w) > 2 and w.isalpha())
    as_list = list(llm.generate(PROMPT, GREEDY, max_tokens=24, ignore_eos=True, stop=[word]))
    as_str = list(llm.generate(PROMPT, GREEDY, max_tokens=24, ignore_eos=True, stop=word))
    assert [c.text for c in as_str] == [c.text for c in as_list]
    assert as_str[-1].finish_reason == "stop" and as_str[-1].stats.stop_word == word
    with load_engine(ctx=256, parallel=2, progress=False) as eng:
        got = list(eng.submit(PROMPT, GREEDY, max_tokens=24, ignore_eos=True, stop=word))
        assert "".join(c.text for c in got) == "".join(c.text for c in as_list)
        for bad in ([123], [b"x"], 5):   # refused at the call (a [123] ended the sequence "error" later)
            with pytest.raises(BitNetError, match="stop"):
                eng.submit(PROMPT, stop=bad)
    assert list(llm.generate(PROMPT, GREEDY, max_tokens=3, stop=None))[-1].finish_reason == "length"


def test_breaking_out_of_an_engine_stream_cancels_its_request():
    """An Engine stream abandoned before its end (a break, an exception in the loop) cancels the request, as
    LLM.generate's: it went on decoding to max_tokens in its slot, and a request behind it waited for the slot."""
    with load_engine(ctx=512, parallel=1, progress=False) as eng:
        for _ in eng.submit(PROMPT, GREEDY, max_tokens=400, ignore_eos=True):
            break
        after = list(eng.submit("2+3=", GREEDY, max_tokens=4, ignore_eos=True))
        assert after[-1].finish_reason == "length"
        done = eng.metrics()
        assert done["running"] == 0 and done["tokens_generated_total"] < 400   # the first ended early
        with pytest.raises(ZeroDivisionError):
            for _ in eng.submit(PROMPT, GREEDY, max_tokens=400, ignore_eos=True):
                1 / 0
        list(eng.submit("2+3=", GREEDY, max_tokens=4, ignore_eos=True))
        assert eng.metrics()["tokens_generated_total"] - done["tokens_generated_total"] < 400


@pytest.mark.parametrize("call,words", [
    (lambda: load_model(ctx=64, threads="2", progress=False), "threads '2'"),
    (lambda: load_model(ctx="512", progress=False), "ctx '512'"),
    (lambda: load_model(ctx=1.5, progress=False), "ctx 1.5"),
    (lambda: load_model(ctx=64, lookup={"draft_max": 2}, progress=False), "lookup: a LookupParams"),
    (lambda: load_model(123), "model: a path"),
    (lambda: load_engine(ctx=64, threads=2.5, progress=False), "threads 2.5"),
    # the engine's sizes: a float was truncated, a str or NaN failed deep inside, 10**30 overflowed in the pool
    (lambda: load_engine(ctx=64, parallel=2.7, progress=False), "parallel 2.7"),
    (lambda: load_engine(ctx=64, parallel="4", progress=False), "parallel '4'"),
    (lambda: load_engine(ctx=64, max_queue=None, progress=False), "max_queue None"),
    (lambda: load_engine(ctx=64, max_batch_tokens=1.9, progress=False), "max_batch_tokens 1.9"),
    (lambda: load_engine(ctx=64, kv_pool_tokens=[1], progress=False), "kv_pool_tokens"),
    (lambda: load_engine(ctx=64, kv_pool_tokens=10 ** 30, progress=False), "past any machine's memory"),
    # the default pool holds a context: -c 10**11 overflowed in C (bitnet serve's exit 70, an internal error)
    (lambda: load_engine(ctx=10 ** 11, progress=False), "past any machine's memory.*smaller -c"),
    (lambda: load_engine(ctx=64, kv_pool_mib=float("nan"), progress=False), "kv_pool_mib nan"),
    (lambda: load_engine(ctx=64, kv_pool_mib=-1, progress=False), "kv_pool_mib -1"),
    # named as given (it said "kv_pool_tokens 0", an argument the caller never passed)
    (lambda: load_engine(ctx=64, kv_pool_mib=0.001, progress=False),
     r"kv_pool_mib 0.001: the pool must hold at least one context \(64 tokens: [\d.]+ MiB\)"),
    (lambda: load_model(lm_head="bogus", progress=False), "lm_head 'bogus': one of q4, i8, f16"),
    (lambda: load_model(ctx=64, mmap="no", progress=False), "mmap 'no'"),   # a non-empty str was true
    (lambda: load_engine(ctx=64, mmap=[1], progress=False), r"mmap \[1\]"),
])
def test_api_arguments_of_the_wrong_type_are_one_error(call, words):
    """Each a BitNetError naming the argument, at the call (they were TypeErrors / AttributeErrors from deep
    inside, or a float silently truncated)."""
    with pytest.raises(BitNetError, match=words):
        call()


def test_call_arguments_of_the_wrong_type_are_one_error():
    llm = load_model(ctx=64, progress=False)
    with load_engine(ctx=64, parallel=1, progress=False) as eng:
        for call, words in ((lambda: llm.generate(PROMPT, {"temperature": 0}), "params: a SamplingParams"),
                            (lambda: eng.submit(PROMPT, "x"), "params: a SamplingParams"),
                            (lambda: llm.generate(PROMPT, max_tokens=None), "max_tokens None"),
                            (lambda: llm.generate(PROMPT, max_tokens=1.5), "max_tokens 1.5"),
                            (lambda: eng.submit(PROMPT, max_tokens="4"), "max_tokens '4'"),
                            (lambda: llm.tokenize(None), "tokenize: text"),
                            # a FormatError blaming the model file; "no" was True (control tokens parsed)
                            (lambda: llm.tokenize("<|eot_id|>hi", add_bos=1), "add_bos 1: True or False"),
                            (lambda: llm.tokenize("x", add_bos=None), "add_bos None: True or False"),
                            (lambda: eng.tokenize("<|eot_id|>hi", special="no"), "special 'no': True or False"),
                            (lambda: llm.chat_prompt("hi"), "messages: a list"),
                            (lambda: llm.chat_prompt([{"content": "x"}]), r"messages\[0\]: a dict with a 'role'"),
                            (lambda: llm.set_chat_template(123), "chat template: .* not int"),
                            # these were bare TypeErrors / AttributeErrors, or silently converted
                            (lambda: llm.chat_prompt([{"role": "user", "content": "x"}], prefill=None),
                             "prefill: text"),
                            (lambda: llm.chat_prompt([{"role": "user", "content": "x"}], tools="x"), "tools: a list"),
                            (lambda: llm.chat_prompt([{"role": "user", "content": "x"}], template_kwargs=5),
                             "template_kwargs: a dict"),
                            (lambda: llm.chat_prompt([{"role": "user", "content": [{"type": "image_url"}]}]),
                             r"messages\[0\].content\[0\]: this model takes text parts only"),
                            (lambda: llm.detokenize(None), "ids: give token ids, not NoneType"),
                            (lambda: llm.detokenize([74.9]), "ids: token ids are integers, not float"),
                            (lambda: llm.detokenize([74, 10 ** 6]), r"ids\[1\] 1000000: not a token id"),
                            (lambda: llm.forward([1, -1]), r"ids\[1\] -1: not a token id"),
                            (lambda: llm.perplexity(b"bytes", chunk=32),
                             r"text: give text \(str\) or token ids, not bytes"),
                            (lambda: llm.perplexity([7.9] * 200, chunk=32), "text: token ids are integers"),
                            (lambda: llm.perplexity(PROMPT * 50, chunk=32, stride=True), "stride True"),
                            (lambda: llm.perplexity(PROMPT * 50, chunk=32, stride=64.0), "stride 64.0"),
                            (lambda: llm.perplexity(PROMPT * 50, chunk=32, stride=-1), "stride -1"),
                            (lambda: llm.perplexity(PROMPT * 50, chunk=32, chunks=0), "chunks 0"),
                            (lambda: eng.score_ids([0, 75.9, 80.2]), "ids: token ids are integers, not float"),
                            (lambda: eng.score_ids(b"ab"), "ids: give token ids, not bytes"),
                            (lambda: eng.score_ids([1, 2], top_k=2.9), "top_k 2.9"),
                            (lambda: eng.submit(PROMPT, callback="print"), "callback: a function"),
                            (lambda: llm.generate(PROMPT, ignore_eos="no"), "ignore_eos 'no'"),
                            (lambda: eng.submit(PROMPT, ignore_eos=1), "ignore_eos 1"),
                            (lambda: eng.submit_n(PROMPT, n=1, callbacks=iter([5])), "callback: a function")):
            with pytest.raises(BitNetError, match=words):
                call()
    # content parts are text joined, a newline between two, as the server joins them (their Python repr went into
    # the prompt)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Once upon"}, {"type": "text", "text": "a time"}]}]
    assert llm.chat_prompt(parts) == llm.chat_prompt([{"role": "user", "content": "Once upon\na time"}])
    llm.close()


def test_an_out_of_vocabulary_prompt_id_is_raised_at_the_call_and_touches_nothing():
    """generate() with an id outside the vocabulary: raised at the call, as its docstring says; it was raised at
    the first next(), after the generator in flight was superseded and the cache cut."""
    llm = load_model(ctx=64, progress=False)
    ids = llm.tokenize(PROMPT, add_bos=True)
    running = llm.generate(ids, GREEDY, max_tokens=8, ignore_eos=True)
    first = next(running)
    cached = llm.cached_tokens
    with pytest.raises(BitNetError, match="not a token id"):
        llm.generate(ids + [10 ** 6])
    assert llm.cached_tokens == cached
    rest = list(running)   # the generator in flight goes on, not superseded
    assert rest[-1].finish_reason == "length" and len([first] + rest) == 9
    llm.close()


def test_close_ends_a_generator_not_yet_started():
    """close() between generate() and the first next(): the generator refuses (it ran the whole text on the
    closed model, the weights kept mapped by it)."""
    llm = load_model(ctx=64, progress=False)
    gen = llm.generate(PROMPT, GREEDY, max_tokens=8)
    llm.close()
    with pytest.raises(BitNetError, match="closed"):
        next(gen)


def test_an_engine_or_model_in_a_forked_child():
    """fork() after load (gunicorn --preload, multiprocessing's 'fork'): the child's Engine refuses work in one
    error (its scheduler thread does not exist there: a stream waited for ever), and an LLM whose lock another
    thread of the parent held at the fork still generates in the child (the lock was held for ever there)."""
    import os
    import signal

    if not hasattr(os, "fork"):
        pytest.skip("no fork() on this platform")
    llm = load_model(ctx=128, progress=False)
    want = _text(llm, n=6)
    with load_engine(ctx=128, parallel=1, progress=False) as eng:
        held, release = threading.Event(), threading.Event()

        def hold():
            with llm.model.lock:
                held.set()
                release.wait(60)
        t = threading.Thread(target=hold)
        t.start()
        held.wait(30)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:   # the child: report on the pipe, never return into pytest
            code = 1
            try:
                signal.alarm(60)
                try:
                    eng.submit(PROMPT, max_tokens=2)
                    out = "submitted"
                except BitNetError as e:
                    out = str(e)
                out += "\n" + _text(llm, n=6)
                os.write(w, out.encode())
                code = 0
            finally:
                os._exit(code)
        release.set()
        t.join()
        os.close(w)
        with os.fdopen(r, "rb") as f:
            got = f.read().decode()
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, got)
        first, text = got.split("\n", 1)
        assert "loaded before fork()" in first
        assert text == want


@pytest.mark.parametrize("what", ["llm_mmap", "llm_memory", "engine"])
def test_a_model_cannot_be_pickled_and_says_what_to_do(what):
    """pickle (a spawn Process's args, a Pool) of an LLM or Engine: one BitNetError saying to load in the child
    (it was "TypeError: cannot pickle 'mmap.mmap' object", also with mmap=False)."""
    import pickle

    if what == "engine":
        obj, want = load_engine(ctx=64, parallel=1, progress=False), "an Engine cannot cross processes: load_engine()"
    else:
        obj = load_model(ctx=64, progress=False, mmap=what == "llm_mmap")
        want = "an LLM cannot cross processes: load_model()"
    with obj:
        with pytest.raises(BitNetError, match=re.escape(want)) as e:
            pickle.dumps(obj)
        assert "\n" not in str(e.value)


def test_an_engine_dropped_without_close_is_freed():
    """An Engine nobody references any more (a notebook cell run again: `eng = load_engine(...)`) is freed with its
    thread, as a dropped LLM is: its scheduler thread held it for the process's life (1.4 GB a cell on the 2B
    model)."""
    import gc
    import time
    import weakref

    def schedulers():
        return sum(t.name == "bitnet-scheduler" and t.is_alive() for t in threading.enumerate())

    before = schedulers()
    eng = load_engine(ctx=128, parallel=2, progress=False)
    assert list(eng.submit(PROMPT, GREEDY, max_tokens=3))[-1].finish_reason
    ref = weakref.ref(eng)
    del eng
    deadline = time.monotonic() + 30
    while (ref() is not None or schedulers() > before) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert ref() is None and schedulers() == before


def test_an_engine_asked_for_more_than_the_trained_context_says_so():
    """-c above the model's trained context warns in load_engine (and so in `bitnet serve`), as in load_model; it
    said nothing unless the context was the server's own default."""
    llm = load_model(ctx=64, progress=False)
    trained = llm.config.context_length
    with load_engine(ctx=trained * 2, parallel=1, progress=False) as eng:
        assert any(f"-c/--ctx {trained * 2} is larger than the {trained} tokens" in w for w in eng.warnings)
    with load_engine(ctx=trained, parallel=1, progress=False) as eng:
        assert not any("trained" in w for w in eng.warnings)


def _call_from_a_callback(eng, call):
    """Submit a short request whose callback runs call() once, on the engine's own thread: (seen, done), seen[0]
    the BitNetError it raised (None if it returned), done set at the stream's final chunk."""
    seen, done = [], threading.Event()

    def cb(chunk):
        if not seen:
            try:
                call()
                seen.append(None)
            except BitNetError as e:
                seen.append(e)
        if chunk.finish_reason is not None:
            done.set()
    eng.submit(PROMPT, GREEDY, max_tokens=4, callback=cb)
    return seen, done


def test_close_from_a_callback_is_one_error_and_the_engine_closes_later():
    """A stream's callback runs on the engine's own thread: close() there joined that thread (RuntimeError
    'cannot join current thread', swallowed by the callback wrapper) and left the engine marked closed with its
    weights held. Now a BitNetError saying where to call it from; the stream ends, and close() elsewhere works."""
    eng = load_engine(ctx=128, parallel=2, progress=False)
    seen, done = _call_from_a_callback(eng, eng.close)
    assert done.wait(120)
    assert isinstance(seen[0], BitNetError) and "own thread" in str(seen[0]), seen
    assert len(list(eng.submit(PROMPT, GREEDY, max_tokens=2))) >= 1   # still open
    eng.close()
    with pytest.raises(BitNetError, match="closed"):
        eng.submit(PROMPT, GREEDY, max_tokens=2)


@pytest.mark.parametrize("wait", ["embed", "score", "iterate"])
def test_a_blocking_call_from_a_callback_is_one_error_not_a_dead_engine(wait):
    """embed / score_ids / iterating a stream from a callback (the engine's own thread) waited for that thread,
    which was waiting for them: the engine never stepped again and close() hung too. Now a BitNetError at the
    call; the stream ends and the engine goes on."""
    eng = load_engine(ctx=128, parallel=2, progress=False)
    calls = {"embed": lambda: eng.embed("hello"), "score": lambda: eng.score_ids([1, 2, 3]),
             "iterate": lambda: list(eng.submit(PROMPT, GREEDY, max_tokens=2))}
    seen, done = _call_from_a_callback(eng, calls[wait])
    ended = done.wait(60)
    if not ended:   # the old hang: leave the stuck engine's daemon thread behind rather than hang the suite too
        pytest.fail("the stream never ended: the callback's call waited for the engine's own thread")
    assert isinstance(seen[0], BitNetError) and "own thread" in str(seen[0]), seen
    assert len(list(eng.submit(PROMPT, GREEDY, max_tokens=2))) >= 1   # the engine goes on
    eng.close()


def _maps_of(path: str) -> int:
    import os
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return sum(line.rstrip("\n").endswith(real) for line in f)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
def test_close_unmaps_the_weights_while_the_llm_object_lives():
    """close() unmaps the store now, though the LLM object is kept (a registry of closed models held one map and one
    descriptor each: the close() frame's own reference to the model kept its weight views alive)."""
    llm = load_model(ctx=128, progress=False)
    path = llm.store.path
    assert _text(llm, n=2) and _maps_of(path) >= 1
    llm.close()
    assert _maps_of(path) == 0


def test_bytes_or_a_dict_to_embed_is_one_error_naming_it():
    """embed(b"hi") said "input 0: expected a string, got int" (bytes iterate as ints); embed({"a": 1}) embedded the
    dict's keys."""
    llm = load_model(ctx=128, progress=False)
    for bad, name in ((b"hi", "bytes"), ({"a": 1, "bb": 2}, "dict")):
        with pytest.raises(BitNetError, match=f"texts: give a string or a list of strings, not {name}"):
            llm.embed(bad)
    llm.close()


def test_a_prompt_over_the_context_says_to_load_a_larger_one():
    """A prompt alone over an LLM's context was told "the context is already the model's full 512 tokens: shorten
    the prompt or ask for less", though load_model(ctx=N) takes it (with a warning past the trained length) and
    asking for less cannot help; now the hint says to load with a larger context, as the Engine's does."""
    from bitnet_cpu.engine.errors import ContextOverflowError
    llm = load_model(progress=False)
    trained = llm.config.context_length
    prompt = "word " * trained
    n = len(llm.tokenize(prompt, add_bos=True))
    with pytest.raises(ContextOverflowError) as e:
        llm.generate(prompt, GREEDY, max_tokens=8)
    assert f"load with a context of at least {n} tokens (load_model(ctx=N)" in str(e.value), e.value
    assert "ask for less" not in str(e.value) and "-c/--ctx" not in str(e.value)
    llm.close()
    with load_model(ctx=n + 8, progress=False) as big:   # what the hint says works
        assert list(big.generate(prompt, GREEDY, max_tokens=4))[-1].finish_reason in ("length", "eos")


def test_the_smallest_kv_pool_mib_named_is_taken():
    """The size kv_pool_mib's error names is enough: a pool of that many MiB loads."""
    with pytest.raises(BitNetError) as e:
        load_engine(ctx=64, kv_pool_mib=0.001, progress=False)
    least = float(re.search(r"([\d.]+) MiB", str(e.value)).group(1))
    load_engine(ctx=64, kv_pool_mib=least, parallel=1, progress=False).close()


def test_embed_overflow_carries_the_counts():
    """LLM.embed's ContextOverflowError had n_prompt_tokens and n_ctx None, though its message gave both (as
    Engine.embed's and generate's errors carry them)."""
    from bitnet_cpu.engine.errors import ContextOverflowError
    with load_model(ctx=64, progress=False) as llm:
        text = "word " * 100
        n = len(llm.tokenize(text, add_bos=True))
        with pytest.raises(ContextOverflowError) as e:
            llm.embed(["a cat", text])
        assert (e.value.n_prompt_tokens, e.value.n_ctx) == (n, 64) and f"{n} tokens" in str(e.value)


def test_the_overflow_hint_names_the_least_context_that_holds_the_prompt():
    """A 65-token prompt at ctx=64 said "load with a context over 65 tokens", though ctx=65 holds it (a prompt as long
    as the context gets one token): the hint names that context, and it does hold the prompt."""
    from bitnet_cpu.engine.errors import ContextOverflowError
    with load_model(ctx=64, progress=False) as llm:
        prompt = "the fox " * 40
        n = len(llm.tokenize(prompt, add_bos=True))
        with pytest.raises(ContextOverflowError) as e:
            llm.generate(prompt, GREEDY, max_tokens=4)
    assert f"load with a context of at least {n} tokens (load_model(ctx=N))" in str(e.value), e.value
    with load_model(ctx=n, progress=False) as exact:   # exactly that: the prompt, and one token
        *_, last = exact.generate(prompt, GREEDY, max_tokens=4)
        assert last.stats.n_prompt == n and last.stats.n_generated == 1 and last.finish_reason == "context"


def test_a_wait_s_timeout_of_the_wrong_type_or_range_is_one_error():
    """Engine.embed(timeout=-1) said "the embeddings were not ready within -1 s" and timeout="x" raised a bare
    TypeError from the comparison; a timeout is now checked as every other argument is, before the request runs."""
    with load_engine(ctx=64, parallel=1, progress=False) as eng:
        ids = eng.tokenize("a cat", add_bos=True)
        for bad in (-1, "x", True, float("nan"), [1]):
            for call in (lambda: eng.embed(["a cat"], timeout=bad), lambda: eng.score_ids(ids, timeout=bad)):
                with pytest.raises(BitNetError, match=r"timeout .*: None \(no limit\) or seconds") as e:
                    call()
                assert "\n" not in str(e.value) and "not ready" not in str(e.value)
        for good in (None, 60, 2.5, float("inf")):
            assert eng.embed(["a cat"], timeout=good).shape[0] == 1
            assert len(eng.score_ids(ids, timeout=good)) == len(ids) - 1


def test_every_documented_exception_comes_from_engine_api():
    """ContextOverflowError, NoTokenAllowedError and TemplateError (documented as raised) lived only in internal
    modules, BitNetError was not in __all__, and the module's docstring imported from "engine.api", which is no
    module; all come from bitnet_cpu.engine.api now, and the docstring's import runs."""
    import bitnet_cpu.engine.api as api
    from bitnet_cpu.engine import errors
    from bitnet_cpu.engine.runtime import chat_template, sampling
    names = {}
    exec("from bitnet_cpu.engine.api import *", names)
    for name, cls in (("BitNetError", errors.BitNetError), ("ContextOverflowError", errors.ContextOverflowError),
                      ("NoTokenAllowedError", sampling.NoTokenAllowedError),
                      ("TemplateError", chat_template.TemplateError),
                      ("ConstraintError", errors.ConstraintError), ("QueueFullError", errors.QueueFullError)):
        assert names.get(name) is cls and issubclass(cls, errors.BitNetError), name
    imports = [line.strip() for line in api.__doc__.splitlines() if line.strip().startswith("from ")]
    assert imports and all(line.startswith("from bitnet_cpu.engine.api import") for line in imports), imports
    for line in imports:
        exec(line, {})
    import os
    import re
    docs = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(api.__file__))), "docs", "api.md"),
                encoding="utf-8").read()
    block = re.search(r"```python\n(from bitnet_cpu\.engine\.api import \(.*?\))\n```", docs, re.S)
    assert block, "docs/api.md says where the Python API's errors come from"
    exec(block.group(1), {})


def test_chat_prompt_refuses_what_the_server_refuses():
    """chat_prompt took add_generation_prompt="no" as True, and a {"role": "bogus"} message or content 5 in
    silence (5 rendered as "5"); the server refuses all three, and so does the API now, one BitNetError each."""
    llm = load_model(ctx=64, progress=False)
    user = {"role": "user", "content": "Hi"}
    for call, words in ((lambda: llm.chat_prompt([user], add_generation_prompt="no"), "add_generation_prompt 'no'"),
                        (lambda: llm.chat_text([user], add_generation_prompt=1), "add_generation_prompt 1"),
                        (lambda: llm.chat_prompt([{"role": "bogus", "content": "x"}]),
                         r"messages\[0\]\.role 'bogus': one of system, developer, user, assistant, tool"),
                        (lambda: llm.chat_prompt([user, {"role": "user", "content": 5}]),
                         r"messages\[1\]\.content: text"),
                        (lambda: llm.chat_prompt([{"role": "user", "content": None}]), r"messages\[0\]\.content"),
                        (lambda: llm.chat_prompt([{"role": "user"}]), r"messages\[0\]\.content")):
        with pytest.raises(BitNetError, match=words) as e:
            call()
        assert "\n" not in str(e.value)
    # what the server takes still renders: an assistant's call with no content, developer as system, a tool result
    calls = [{"type": "function", "id": "c1", "function": {"name": "f", "arguments": "{}"}}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [{"role": "developer", "content": "Be brief."}, user, {"role": "assistant", "content": None,
            "tool_calls": calls}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    assert llm.chat_prompt(msgs, add_generation_prompt=False, tools=tools)
    assert llm.chat_text(msgs[:2]) == llm.chat_text([{"role": "system", "content": "Be brief."}, user])
    llm.close()


def test_model_card_reads_a_model_without_loading_or_converting_it(tmp_path, monkeypatch):
    """model_card (ollama's /api/show of a router's models): a store's config, name, template and thinking as the
    loaded model has them; an HF directory's from its own files, nothing converted into the cache; a file that is
    no model: one BitNetError."""
    import os
    import shutil

    from bitnet_cpu.engine.api import engine_ctx, model_card
    from bitnet_cpu.engine.formats.convert import bundled_model
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir

    monkeypatch.setenv("BITNET_CACHE", str(tmp_path / "cache"))
    store = bundled_model()
    card = model_card(store)
    with load_engine(store, ctx=256, parallel=1, progress=False) as eng:
        assert (card.config, card.name, card.chat_template, card.thinks) == \
            (eng.config, eng.name, eng.chat_template, eng.thinks)
        assert engine_ctx(card.config, 256) == eng.n_ctx
    with load_engine(store, parallel=1, progress=False) as eng:
        assert engine_ctx(card.config) == eng.n_ctx
    assert model_card(store, chat_template="chatml").chat_template.startswith("{% for message")
    hf = write_hf_dir(SynthModel(small_config(), seed=3), str(tmp_path / "hf"))
    hf_card = model_card(hf)
    assert hf_card.path == hf and hf_card.config.n_layers == small_config()["num_hidden_layers"]
    assert not os.path.exists(tmp_path / "cache")
    with load_engine(hf, ctx=256, parallel=1, progress=False) as eng:   # converted now: the card is its store's
        assert hf_card.config == eng.config and hf_card.name == eng.name
        assert model_card(hf).path == eng.store.path
    shutil.copy(store, tmp_path / "broken.bnstore")
    with open(tmp_path / "broken.bnstore", "r+b") as f:
        f.truncate(100)
    for bad in (tmp_path / "broken.bnstore", tmp_path / "missing.gguf"):
        with pytest.raises(BitNetError):
            model_card(bad)
