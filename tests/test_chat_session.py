"""bitchat's session on a real (small, synthetic) model, in process: KV reuse across turns through
prompt splicing, context-window trimming, refused messages, /retry, /load + re-prefill, Ctrl-C."""
import io
import json
import os
import re
import signal

import pytest

from bitnet_cpu.chat.commands import CommandError, Settings, parse_command
from bitnet_cpu.chat.render import Output
from bitnet_cpu.chat.session import ChatSession, ExitChat
from bitnet_cpu.chat.transcript import Conversation, Turn


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from bitnet_cpu.engine.api import load_model
    from bitnet_cpu.engine.formats.convert import convert
    from bitnet_cpu.engine.synth import SynthModel, small_config, write_hf_dir

    synth = SynthModel(small_config(max_position_embeddings=1024), seed=5)
    d = tmp_path_factory.mktemp("session_model")
    store = convert(write_hf_dir(synth, str(d / "hf")), str(d / "m.bnstore"), progress=False)
    return load_model(store, threads=1, progress=False)


def new_session(llm, *, system="You are a test.", max_tokens=8, temp=0.0):
    llm.reset()
    sink = io.StringIO()
    s = ChatSession(llm, Settings(temp=temp, max_tokens=max_tokens, seed=3), Output(sink, sink, interactive=False),
                    system=system)
    return s, sink


def test_second_turn_reuses_every_cached_token(llm):
    s, _ = new_session(llm)
    s.ask("First question?")
    first_prompt, first = list(s.last_prompt_ids), s.cached_turn
    assert first is not None and first.answer_ids
    s.ask("Second question?")
    st = s.last_stats
    # the cache holds prompt 1 + answer 1 (minus the last token when it stopped at max_tokens)
    held = len(first_prompt) + len(first.answer_ids) - (1 if s.conv.turns[0].finish_reason == "length" else 0)
    assert st.n_cached == held
    assert s.last_prompt_ids[:len(first_prompt) + len(first.answer_ids)] == first_prompt + first.answer_ids
    # same text as rendering the conversation from scratch: splicing changes tokens, never content
    fresh = llm.chat_prompt(s.conv.messages()[:4])   # system, user, answer, user
    assert llm.detokenize(s.last_prompt_ids) == llm.detokenize(fresh)


def test_without_splicing_the_prompt_is_the_plain_rendering(llm):
    s, _ = new_session(llm)
    s.splice = False
    s.ask("First question?")
    n_first = len(s.last_prompt_ids)
    s.ask("Second question?")
    assert s.last_stats.n_cached >= n_first - 1      # the earlier prompt is still reused
    assert s.last_prompt_ids == llm.chat_prompt(s.conv.messages()[:4])


def test_ttft_tokens_do_not_grow_with_turns(llm):
    s, _ = new_session(llm, max_tokens=6)
    new_tokens = []
    for i in range(6):
        s.ask(f"Question {i}?")
        new_tokens.append(s.last_stats.n_prompt - s.last_stats.n_cached)
    assert max(new_tokens[1:]) <= min(new_tokens[1:]) + 4, new_tokens


def test_context_trimming_keeps_system_and_never_overflows(llm):
    from bitnet_cpu.engine.api import load_model

    small = load_model(llm.store.path, ctx=128, threads=1, progress=False)
    sink = io.StringIO()
    s = ChatSession(small, Settings(temp=0.0, max_tokens=8), Output(sink, sink, interactive=False), system="Be brief.")
    for i in range(10):
        s.ask(f"Question {i}: " + "more words here " * 5)
        assert s.tokens_in_cache <= small.n_ctx
    assert s.n_dropped > 0 and "dropped the" in sink.getvalue()
    assert len(s.conv.turns) == 10 and all(t.assistant is not None for t in s.conv.turns)
    # /stats counts the turns out of the window, also those a loaded conversation had dropped before
    path = os.path.join(os.path.dirname(small.store.path), "trimmed.json")
    s.conv.save(path)
    again = ChatSession(small, Settings(temp=0.0, max_tokens=8), Output(sink, sink, interactive=False))
    again.run_command(parse_command(f"/load {path}"))
    again.run_command(parse_command("/stats"))
    assert f"10 turns ({10 - s.conv.window_start} in the window, {s.conv.window_start} dropped)" in sink.getvalue()
    assert s.conv.messages()[0] == {"role": "system", "content": "Be brief."}
    assert s.conv.messages()[-2]["content"].startswith("Question 9:")


def test_too_long_message_is_refused_and_the_window_stays(llm):
    from bitnet_cpu.engine.api import load_model

    small = load_model(llm.store.path, ctx=96, threads=1, progress=False)
    sink = io.StringIO()
    s = ChatSession(small, Settings(temp=0.0, max_tokens=4), Output(sink, sink, interactive=False))
    s.ask("Hello.")
    s.ask("word " * 400)
    assert "message not sent" in sink.getvalue()
    # the rule is "no room left for the answer": "it needs 96 tokens but the context window is 96" contradicted itself
    assert re.search(r"it needs \d+ tokens plus room for the answer, and the context window is 96", sink.getvalue())
    assert len(s.conv.turns) == 1 and s.conv.window_start == 0
    s.ask("Still there?")
    assert len(s.conv.turns) == 2 and s.had_errors


def test_retry_reuses_the_prompt_and_replaces_the_answer(llm):
    s, _ = new_session(llm, temp=1.0)
    s.ask("Tell me something.")
    prompt = list(s.last_prompt_ids)
    s.run_command(parse_command("/retry"))
    assert s.last_prompt_ids == prompt
    assert s.last_stats.n_cached == len(prompt) - 1   # all but the last prompt token came from the cache
    assert len(s.conv.turns) == 1 and s.conv.turns[0].assistant is not None


def test_a_retry_that_makes_nothing_keeps_the_turn_and_its_answer(llm):
    """/retry of a turn that no longer fits (a longer system prompt since) is refused and the turn stays, answer and
    all (it was deleted as a new message too long is); a Ctrl-C before the retry's first token keeps the earlier
    answer (it became empty)."""
    from bitnet_cpu.engine.api import load_model

    small = load_model(llm.store.path, ctx=96, threads=1, progress=False)
    sink = io.StringIO()
    s = ChatSession(small, Settings(temp=0.0, max_tokens=4), Output(sink, sink, interactive=False))
    s.ask("Hello.")
    answer = s.conv.turns[0].assistant
    assert answer
    s.run_command(parse_command("/set system " + "rules " * 200))
    s.run_command(parse_command("/retry"))
    assert "not sent" in sink.getvalue() and "the earlier one is kept" in sink.getvalue()
    assert [(t.user, t.assistant) for t in s.conv.turns] == [("Hello.", answer)]
    s.run_command(parse_command("/system --clear"))
    s.interrupt_pending = True   # a Ctrl-C typed with the Enter of /retry: the answer stops before it begins
    s.run_command(parse_command("/retry"))
    turn = s.conv.turns[0]
    assert "interrupted before the answer began" in sink.getvalue()
    assert (turn.user, turn.assistant, turn.interrupted) == ("Hello.", answer, False)


def test_a_retry_stopped_partway_keeps_the_earlier_answer(llm, tmp_path):
    """A Ctrl-C partway through /retry shows the new answer's first words but puts the earlier, whole answer back (in
    the conversation, the recovery copy and /save), and says so; the next turn is built on the answer kept."""
    s, sink = new_session(llm, max_tokens=20)
    s.enable_recovery(str(tmp_path / "recovery.json"))
    s.ask("Tell me something.")
    answer = s.conv.turns[0].assistant
    assert answer and len(s.cached_turn.answer_ids) >= 3
    s.out = _InterruptingOutput(sink, sink, interactive=False)
    s.run_command(parse_command("/retry"))
    turn = s.conv.turns[0]
    assert (turn.assistant, turn.interrupted) == (answer, False)
    assert "[retry interrupted: the earlier answer is kept]" in sink.getvalue()
    assert "so far is kept" not in sink.getvalue()
    for name in ("recovery.json", "c.json"):
        if name == "c.json":
            s.out = Output(sink, sink, interactive=False)
            s.run_command(parse_command(f"/save {tmp_path / name}"))
        assert json.loads((tmp_path / name).read_text())["turns"][0]["assistant"] == answer, name
    s.ask("Next?")
    assert llm.detokenize(s.last_prompt_ids) == llm.detokenize(llm.chat_prompt(s.conv.messages()[:4]))
    assert s.conv.messages()[2]["content"] == answer


def test_commands_change_settings_and_bye_exits(llm):
    s, sink = new_session(llm)
    s.run_command(parse_command("/set temp 0.5"))
    s.run_command(parse_command("/set seed random"))
    assert s.settings.temp == 0.5 and s.settings.seed is None
    s.run_command(parse_command("/set max_tokens 5000"))   # as bitchat -n 5000: the context's size, said
    assert s.settings.max_tokens == 1024 and "max_tokens 5000 is more than the 1024-token context" in sink.getvalue()
    s.run_command(parse_command("/system New rules."))
    assert s.conv.messages()[0]["content"] == "New rules."
    s.run_command(parse_command("/system --clear"))
    assert s.conv.system is None
    with pytest.raises(ExitChat):
        s.run_command(parse_command("/bye"))


def test_a_fixed_seed_gives_the_same_answer_again_after_set_seed_or_reset(llm):
    """The same seed and question give the same answer, as a fresh `bitchat --seed` does: /set seed (even the same
    value) and /reset start the per-answer seed offset again (answers used seed + answers made so far, never
    reset); a /retry still gets the next seed."""
    def answer(s):
        s.ask("Hello")
        return s.conv.turns[-1].assistant

    fresh, _ = new_session(llm, temp=1.5, max_tokens=12)
    first = answer(fresh)
    assert fresh.sampling_params().seed == 4   # the next answer (a /retry) gets another seed
    s, _ = new_session(llm, temp=1.5, max_tokens=12)
    for _ in range(3):
        answer(s)
    s.run_command(parse_command("/set seed 3"))
    assert s.sampling_params().seed == 3
    s.run_command(parse_command("/reset"))
    assert answer(s) == first
    answer(s)
    s.run_command(parse_command("/reset"))
    assert answer(s) == first


def test_save_load_prefills_and_next_turn_is_cached(llm, tmp_path):
    s, _ = new_session(llm)
    s.ask("One?")
    s.ask("Two?")
    path = tmp_path / "c.json"
    s.run_command(parse_command(f"/save {path}"))
    assert json.loads(path.read_text())["system"] == "You are a test."

    s2, sink = new_session(llm, system=None)
    s2.run_command(parse_command(f"/load {path}"))
    assert "prefilled" in sink.getvalue()
    n_loaded = s2.tokens_in_cache
    s2.ask("Three?")
    assert s2.last_stats.n_cached >= n_loaded - 1
    assert [t.user for t in s2.conv.turns] == ["One?", "Two?", "Three?"]
    with pytest.raises(CommandError, match="/load: .*no such file"):
        s2.run_command(parse_command(f"/load {tmp_path / 'missing.json'}"))
    assert len(s2.conv.turns) == 3


def test_load_after_the_model_file_was_rewritten_ends_the_session(llm, tmp_path):
    """The model file rewritten in place (a `cp` over it) before /load: its prefill fails with ModelChangedError,
    which ends bitchat as everywhere else (one line naming the recovery copy, which holds the loaded conversation).
    It was "[prefill failed: ...; the next turn will retry]", and the next message then ended bitchat anyway."""
    import shutil

    from bitnet_cpu.engine.api import load_model
    from bitnet_cpu.engine.errors import ModelChangedError

    store = tmp_path / "m.bnstore"
    shutil.copyfile(llm.store.path, store)
    mine = load_model(str(store), threads=1, progress=False)
    sink = io.StringIO()
    s = ChatSession(mine, Settings(temp=0.0, max_tokens=4), Output(sink, sink, interactive=False))
    s.enable_recovery(str(tmp_path / "recovery.json"))
    s.ask("Hello")
    s.run_command(parse_command(f"/save {tmp_path / 'c.json'}"))
    st = os.stat(store)
    os.utime(store, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # as a cp over it leaves it
    with pytest.raises(ModelChangedError):
        s.run_command(parse_command(f"/load {tmp_path / 'c.json'}"))
    assert "will retry" not in sink.getvalue()
    turns = json.loads((tmp_path / "recovery.json").read_text())["turns"]
    assert [t["user"] for t in turns] == ["Hello"] and turns[0]["assistant"] is not None


def test_load_restores_the_settings_save_kept_and_the_recovery_copy_has_them(llm, tmp_path):
    """/save keeps every setting /set changes, the format included (a schema itself, so it loads where its file is
    gone), /load puts them back and says so in its loaded line (it restored none, and format was not saved); the
    recovery copy carries them too."""
    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["mood"],
              "properties": {"mood": {"enum": ["happy", "sad"]}}}
    schema_file, saved, rec = tmp_path / "mood.json", tmp_path / "chat.json", tmp_path / "rec.json"
    schema_file.write_text(json.dumps(schema))
    s, _ = new_session(llm, max_tokens=40)
    s.enable_recovery(str(rec))
    for line in ("/set temp 1.5", "/set seed 42", "/set top_k 5", '/set dry_sequence_breakers ["@@"]',
                 f"/set format {schema_file}"):
        s.run_command(parse_command(line))
    s.ask("How are you?")
    assert json.loads(rec.read_text())["meta"]["settings"]["seed"] == 42
    s.run_command(parse_command(f"/save {saved}"))
    schema_file.unlink()

    fresh, sink = new_session(llm, max_tokens=40)
    fresh.run_command(parse_command(f"/load {saved}"))
    st = fresh.settings
    assert (st.temp, st.seed, st.top_k, st.dry_sequence_breakers) == (1.5, 42, 5, ("@@",))
    assert fresh.format is not None and fresh.format_label == str(schema_file)
    loaded = [line for line in sink.getvalue().splitlines() if line.startswith("[loaded 1 turn")]
    assert loaded and "; settings restored: " in loaded[0], sink.getvalue()
    for said in ("temp 1.5", "seed 42", "top_k 5", 'dry_sequence_breakers ["@@"]', f"format {schema_file}"):
        assert said in loaded[0].split("; settings restored: ")[1], loaded[0]
    fresh.ask("And now?")
    jsonschema.validate(json.loads(fresh.conv.turns[-1].assistant), schema)


def test_max_tokens_until_the_end_survives_save_and_load(llm, tmp_path):
    """/set max_tokens -1 (bitchat -n -1) became the context size: /show said 1024, /save wrote it, and a /load into
    a session with a larger -c brought back that cap. It stays "until the end" (-1), and answers still run."""
    s, sink = new_session(llm, max_tokens=8)
    s.run_command(parse_command("/set max_tokens -1"))
    assert "[max_tokens = -1 (until the end)]" in sink.getvalue()
    assert "max_tokens=-1 (until the end)" in s.describe_settings()
    path = tmp_path / "until.json"
    s.run_command(parse_command(f"/save {path}"))
    assert json.loads(path.read_text())["meta"]["settings"]["max_tokens"] == -1
    t, t_sink = new_session(llm, max_tokens=8)
    t.run_command(parse_command(f"/load {path}"))
    assert t.settings.max_tokens == -1 and "max_tokens -1 (until the end)" in t_sink.getvalue()
    assert t._reserve() == llm.n_ctx // 2
    s.run_command(parse_command("/set max_tokens 3"))
    s.run_command(parse_command("/set max_tokens -1"))
    s.ask("Hi?")
    assert s.conv.turns[-1].assistant is not None and s.last_stats.finish_reason != "length"


def test_load_skips_a_setting_this_model_cannot_take_with_one_line(llm, tmp_path):
    """A saved setting the current model cannot honour (think on a template that does not think, a value out of
    range) is skipped with one line naming it; the rest are restored, a max_tokens over this context as the
    context's size (as /set max_tokens and -n take it), said."""
    path = tmp_path / "chat.json"
    Conversation(turns=[Turn("Hi?", "Hello.")]).save(str(path), meta={"settings": {
        "max_tokens": 99999, "think": True, "top_p": 7, "temp": 0.25}})
    s, sink = new_session(llm)
    s.run_command(parse_command(f"/load {path}"))
    out = sink.getvalue()
    for name in ("think", "top_p"):
        assert len([line for line in out.splitlines() if f"setting {name} not restored" in line]) == 1, out
    assert s.settings.temp == 0.25 and s.settings.max_tokens == llm.n_ctx and s.settings.top_p != 7
    assert (f"settings restored: max_tokens {llm.n_ctx} (saved 99999: more than this {llm.n_ctx}-token context), "
            "temp 0.25]") in out


def test_load_restores_think_on_a_thinking_template(llm, tmp_path):
    """/set nothink is saved with the conversation and restored by /load on a template that thinks."""
    from bitnet_cpu.engine.api import load_model

    thinker = load_model(llm.store.path, threads=1, progress=False)
    thinker.set_chat_template("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
                              "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    path = tmp_path / "chat.json"
    sink = io.StringIO()
    s = ChatSession(thinker, Settings(temp=0.0, max_tokens=4), Output(sink, sink, interactive=False))
    s.run_command(parse_command("/set nothink"))
    s.ask("Hi?")
    s.run_command(parse_command(f"/save {path}"))
    s.run_command(parse_command("/set think"))
    s.run_command(parse_command(f"/load {path}"))
    assert thinker.template_kwargs["enable_thinking"] is False
    assert "settings restored: nothink]" in sink.getvalue()


def test_save_replaces_another_conversation_only_when_forced(llm, tmp_path):
    """/save over a conversation file this session neither saved nor loaded is refused, naming its turns (a fresh
    bitchat replaced a long conversation with an empty one, in silence); /save! replaces it; the session's own
    earlier save and the file it loaded are replaced as before, but only while they are still as it left them
    (another session's /save! there since was replaced by the first one's next /save, in silence)."""
    s, _ = new_session(llm)
    s.ask("One?")
    s.ask("Two?")
    path = tmp_path / "mine.json"
    s.run_command(parse_command(f"/save {path}"))
    s.ask("Three?")
    s.run_command(parse_command(f"/save {path}"))
    fresh, sink = new_session(llm)
    with pytest.raises(CommandError, match=r"holds another conversation \(3 turns\): not replaced; /save! "):
        fresh.run_command(parse_command(f"/save {path}"))
    assert len(json.loads(path.read_text())["turns"]) == 3
    fresh.run_command(parse_command(f"/save! {path}"))
    assert json.loads(path.read_text())["turns"] == [] and "[saved 0 turns to" in sink.getvalue()
    with pytest.raises(CommandError, match=r"holds another conversation \(0 turns\): not replaced; /save! "):
        s.run_command(parse_command(f"/save {path}"))   # its own earlier save, but replaced since by another's
    assert json.loads(path.read_text())["turns"] == []
    s.run_command(parse_command(f"/save! {path}"))
    path.write_text(path.read_text().replace("Three?", "Three, edited?"))   # changed from a shell
    with pytest.raises(CommandError, match=r"holds another conversation \(3 turns\): not replaced"):
        s.run_command(parse_command(f"/save {path}"))
    s.run_command(parse_command(f"/save! {path}"))
    loader, sink = new_session(llm)
    loader.run_command(parse_command(f"/load {path}"))
    loader.ask("Four?")
    loader.run_command(parse_command(f"/save {path}"))
    assert len(json.loads(path.read_text())["turns"]) == 4 and "[saved 4 turns to" in sink.getvalue()


class _InterruptingOutput(Output):
    """Presses Ctrl-C (a real SIGINT to this process) once the answer has started to show."""

    def stream(self, text):
        super().stream(text)
        if text and not getattr(self, "pressed", False):
            self.pressed = True
            os.kill(os.getpid(), signal.SIGINT)


def test_an_answer_holding_a_special_token_is_still_spliced(llm):
    """The text shown leaves out a special token the model wrote mid-answer; the next turn still extends the cached
    ids (before, the text check failed and the whole window was read again)."""
    from bitnet_cpu.chat.splice import CachedTurn, spliced_prompt

    tok = llm.tokenizer
    assert tok.bos_id is not None and tok.is_special(tok.bos_id)
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    answer_ids = tok.encode("Hello", add_bos=False) + [tok.bos_id] + tok.encode(" there", add_bos=False)
    text = tok.decode(answer_ids, skip_special=True)
    assert text != llm.detokenize(answer_ids)   # what made the splice give up
    last = CachedTurn(first, llm.chat_prompt(first), answer_ids, text)
    nxt = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "And?"}]
    ids = spliced_prompt(llm, last, nxt)
    assert ids is not None and ids[:len(last.prompt_ids) + len(answer_ids)] == last.prompt_ids + answer_ids


def test_an_answer_cut_by_the_context_says_so(llm):
    """An answer that runs into the end of the context is "context" (the notice and the stats line say the window
    is full), not "stopped at max_tokens": the limit given to the engine is the user's, not the room left."""
    from bitnet_cpu.engine.api import load_model

    small = load_model(llm.store.path, ctx=128, threads=1, progress=False)
    sink = io.StringIO()
    s = ChatSession(small, Settings(temp=0.0, max_tokens=128), Output(sink, sink, interactive=False),
                    system="Be brief.")
    s.ask("Tell me a very long story about " + "dragons and " * 10 + "knights.")
    st, turn = s.last_stats, s.conv.turns[0]
    assert turn.finish_reason == "context" and st.finish_reason == "context"
    assert "context window is full" in sink.getvalue() and "stopped at max_tokens" not in sink.getvalue()


def test_ctrl_c_keeps_the_partial_answer_and_the_cache_consistent(llm):
    before = signal.getsignal(signal.SIGINT)   # default_int_handler; SIG_IGN when pytest was started in the background
    llm.reset()
    sink = io.StringIO()
    s = ChatSession(llm, Settings(temp=0.0, max_tokens=500), _InterruptingOutput(sink, sink, interactive=False))
    s.ask("Talk for a long time.")
    turn = s.conv.turns[0]
    assert turn.interrupted and turn.finish_reason == "interrupted"
    assert turn.assistant and turn.assistant in sink.getvalue()
    assert s.last_stats.n_generated < 500
    assert signal.getsignal(signal.SIGINT) is before   # the handler it found is back
    s.out = Output(sink, sink, interactive=False)
    s.ask("Next?")
    assert not s.conv.turns[1].interrupted and s.last_stats.n_cached > 0


def test_ctrl_c_during_a_long_prompt_stops_it_at_the_next_chunk(llm):
    """A real SIGINT while the prompt is being prefilled (at the second chunk's forward pass): the prefill stops
    before the third chunk, not after the whole prompt; the question leaves the conversation (nothing of its answer
    was shown: as if never sent, said in one line), and the chunks done stay cached for the next turn."""
    llm.reset()
    sink = io.StringIO()
    s = ChatSession(llm, Settings(temp=0.0, max_tokens=4), Output(sink, sink, interactive=False))
    text = "Read all of this carefully before you answer me. " * 12
    passes = _ctrl_c_at_forward_pass(llm, s, text, 2)
    assert s.count_tokens([{"role": "user", "content": text}]) > 5 * 8
    assert s.conv.turns == []   # no turn with an empty answer that every later prompt carries
    assert len(passes) == 2   # the third chunk never ran (before: every chunk of the prompt, then the stop)
    assert len(llm.cached_tokens) == 16
    assert "[interrupted before the answer began: the message is dropped from the conversation]" in sink.getvalue()
    assert "[0 tokens]" not in sink.getvalue() and "so far is kept" not in sink.getvalue()
    assert "last answer: none yet" in s.describe_stats() and "0 turns" in s.describe_stats()
    s.ask("Next?")
    assert len(s.conv.turns) == 1 and not s.conv.turns[0].interrupted and s.last_stats.n_cached >= 1


def _ctrl_c_at_forward_pass(llm, s, text, at, sig=signal.SIGINT):
    """Ask `text` in 8-token prefill chunks, pressing Ctrl-C (a real SIGINT; or sending `sig`) at the `at`-th
    forward pass; the passes made."""
    import sys

    chunk, llm.model.chunk = llm.model.chunk, 8
    passes = []

    def watch(frame, event, arg):   # counts the model's forward passes; presses Ctrl-C at the `at`-th
        if event == "call" and frame.f_code.co_name == "_blocks":
            passes.append(1)
            if len(passes) == at:
                os.kill(os.getpid(), sig)
    try:
        sys.setprofile(watch)
        s.ask(text)
    finally:
        sys.setprofile(None)
        llm.model.chunk = chunk
    return passes


def test_a_message_stopped_before_its_answer_is_not_read_again_nor_saved(llm, tmp_path):
    """The finding's case: a message answered, a long paste stopped by Ctrl-C while it is prefilled, then "Hi". The
    stopped message is in neither the conversation, the recovery copy nor /save, and "Hi" does not pay its prefill
    again (it was a turn with an empty answer that every later prompt carried)."""
    s, sink = new_session(llm, max_tokens=4, system=None)
    s.enable_recovery(str(tmp_path / "recovery.json"))
    s.ask("My name is Zed.")
    _ctrl_c_at_forward_pass(llm, s, "word " * 120, 2)
    assert [t.user for t in s.conv.turns] == ["My name is Zed."]
    assert [t["user"] for t in json.loads((tmp_path / "recovery.json").read_text())["turns"]] == ["My name is Zed."]
    s.ask("Hi")
    alone = s.count_tokens(s.conv.messages())   # the prompt of the two real turns
    assert s.last_stats.n_prompt <= alone and "word word" not in llm.detokenize(s.last_prompt_ids)
    s.run_command(parse_command(f"/save {tmp_path / 'c.json'}"))
    assert [t["user"] for t in json.loads((tmp_path / "c.json").read_text())["turns"]] == ["My name is Zed.", "Hi"]


def test_a_dropped_message_leaves_the_next_prompt_as_if_never_sent(llm):
    """A message stopped by Ctrl-C before its answer began: the next question's prompt is token for token the one
    a session that never sent it builds, and the previous answer stays reused from the cache. The previous answer's
    exact tokens were thrown away with the message, so the next prompt was rebuilt from text (other ids) and that
    whole answer was prefilled again."""
    def next_prompt(drop: bool):
        s, _ = new_session(llm, max_tokens=8, system=None)
        s.ask("Tell me about the sea and ships.")
        if drop:
            _ctrl_c_at_forward_pass(llm, s, "word " * 60, 2)
            assert [t.user for t in s.conv.turns] == ["Tell me about the sea and ships."]
        s.ask("Hi")
        return s.last_prompt_ids, s.last_stats.n_cached

    never, cached_never = next_prompt(False)
    dropped, cached_dropped = next_prompt(True)
    assert dropped == never
    assert cached_dropped >= cached_never


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_kill_while_a_new_message_is_prefilled_keeps_it_in_the_recovery_copy(llm, tmp_path, sig):
    """SIGTERM or SIGHUP (bitchat killed, its terminal closed) while a long paste is prefilled: only a Ctrl-C takes
    a message back. The paste was dropped and the recovery copy rewritten without it, then bitchat left saying the
    conversation was saved there: the paste was lost. Now it stays, answered empty and interrupted."""
    from bitnet_cpu.engine.errors import Terminated, raise_terminated

    signum = getattr(signal, sig)
    s, sink = new_session(llm, max_tokens=4, system=None)
    s.enable_recovery(str(tmp_path / "recovery.json"))
    s.ask("My name is Zed.")
    paste = "A long pasted document I must not lose. " * 20
    previous = signal.signal(signum, raise_terminated)   # as bitchat has it
    try:
        with pytest.raises(Terminated) as e:
            _ctrl_c_at_forward_pass(llm, s, paste, 2, sig=signum)
    finally:
        signal.signal(signum, previous)
    assert e.value.signum == signum
    turns = json.loads((tmp_path / "recovery.json").read_text())["turns"]
    assert [t["user"] for t in turns] == ["My name is Zed.", paste]
    assert turns[-1]["assistant"] == "" and turns[-1]["interrupted"], turns[-1]
    assert [t.user for t in s.conv.turns] == ["My name is Zed.", paste]
    assert "dropped" not in sink.getvalue()


def test_a_message_stopped_before_its_answer_gives_back_the_turns_it_pushed_out(llm):
    """A message that made room for itself by dropping the oldest turns from view, then stopped before its answer:
    those turns come back into the model's view (a message the user cancelled pushed the conversation out)."""
    from bitnet_cpu.engine.api import load_model

    small = load_model(llm.store.path, ctx=256, threads=1, progress=False)
    sink = io.StringIO()
    s = ChatSession(small, Settings(temp=0.0, max_tokens=4), Output(sink, sink, interactive=False))
    for i in range(3):
        s.ask(f"Question {i}?")
    paste = "a long paste " * 25
    assert s.conv.window_start == 0 and s.count_tokens([{"role": "user", "content": paste}]) < 256 - 4
    _ctrl_c_at_forward_pass(small, s, paste, 1)
    assert "dropped the" in sink.getvalue(), sink.getvalue()   # it had pushed turns out of view
    assert len(s.conv.turns) == 3 and s.conv.window_start == 0 and s.n_dropped == 0
    assert "3 turns (3 in the window, 0 dropped)" in s.describe_stats()


def test_input_lines_commands_messages_and_slash_escape(llm):
    from bitnet_cpu.chat.repl import handle_line

    s, sink = new_session(llm, max_tokens=2)
    assert handle_line(s, "//etc is a path") is True
    assert s.conv.turns[-1].user == "/etc is a path"
    assert handle_line(s, '"""\nline 1\nline 2\n"""') is True
    assert s.conv.turns[-1].user == "line 1\nline 2"
    assert handle_line(s, "/nonsense") is True and "unknown command /nonsense" in sink.getvalue()
    assert s.had_errors and len(s.conv.turns) == 2
    assert handle_line(s, "/bye") is False


def test_a_system_prompt_over_several_lines_as_ollama_takes_it(llm):
    '''ollama's /set system """...""": the lines up to the one ending in """ are the system prompt, piped as typed
    (its first line was the prompt, """ and all, the next ones went to the model, and the closing """ opened a block
    that swallowed the commands after it); on one line, the text inside the quotes.'''
    from bitnet_cpu.chat.repl import run_plain

    s, sink = new_session(llm, system=None)
    run_plain(s, io.StringIO('/set system """You are a pirate.\nAlways say arr.\n"""\n/show system\n'))
    assert s.conv.system == "You are a pirate.\nAlways say arr." and not s.conv.turns
    assert "system prompt: 'You are a pirate.\\nAlways say arr.'" in sink.getvalue()
    for line in ('/set system """Be brief."""', '/system """Be brief."""', '/SET SYSTEM """\nBe brief.\n"""'):
        run_plain(s, io.StringIO(line + "\n/show system\n"))
        assert s.conv.system == "Be brief." and not s.conv.turns, line
    with pytest.raises(CommandError, match="/set system needs the text"):
        s.run_command(parse_command('/set system """\n"""'))
    assert s.conv.system == "Be brief." and not s.had_errors


def test_reset_leaves_no_context_in_use(llm):
    """After /reset, /stats and /show info said the forgotten turn's tokens were in use ("34 / 512", 0 turns)."""
    s, _ = new_session(llm)
    s.ask("Hello?")
    assert s.tokens_in_cache > 0
    s.run_command(parse_command("/reset"))
    assert f"context:     0 / {llm.n_ctx} tokens" in s.describe_stats() and "in use 0" in s.describe_model()
    s.ask("Again?")
    assert s.tokens_in_cache > 0


def test_max_tokens_over_the_context_is_one_line(llm):
    """/set max_tokens over the context: one line saying it is taken as the context's size (it was followed by a
    second, "[max_tokens = N]")."""
    s, sink = new_session(llm)
    s.run_command(parse_command("/set max_tokens 100000"))
    lines = sink.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"max_tokens = {llm.n_ctx}]"), lines
    assert s.settings.max_tokens == llm.n_ctx


@pytest.mark.parametrize("name, value", [("reasoning_budget", "5"), ("reasoning_budget_message", "Enough.")])
def test_a_reasoning_budget_on_a_template_that_does_not_think_says_it_changes_nothing(llm, name, value):
    """As the flag warns (--reasoning-budget N): /set reasoning_budget N on a template that does not think says in
    its one line that it changes nothing (it said only "[reasoning_budget = 5]"); the value is kept for /save."""
    assert not llm.thinks
    s, sink = new_session(llm)
    s.run_command(parse_command(f"/set {name} {value}"))
    lines = sink.getvalue().splitlines()
    assert len(lines) == 1 and "does not think; it changes nothing" in lines[0], lines
    assert str(getattr(s.settings, name)) == value


def test_piped_blocks_keep_the_text_after_a_quote_inside_a_line(llm, tmp_path):
    '''Piped, as typed: a """ inside a line is text, a line ending in """ ends the block. The message keeps every
    word (`"""Hello""" is what ...` sent "Hello"), and the command after a closed block runs.'''
    from bitnet_cpu.chat.repl import run_plain

    s, _ = new_session(llm, max_tokens=2, system=None)
    script = ('"""Hello""" is what a docstring looks like; explain it\n"""\n'
              '"""\nfirst\n""" trailing words\n"""\n'
              f'/save {tmp_path / "c.json"}\n')
    assert run_plain(s, io.StringIO(script)) == 0
    turns = json.loads((tmp_path / "c.json").read_text())["turns"]
    assert [t["user"] for t in turns] == ['Hello""" is what a docstring looks like; explain it',
                                          'first\n""" trailing words']


def test_utf8_typed_in_a_locale_that_is_not_utf8_is_sent(llm, monkeypatch):
    """In a C locale Python reads typed UTF-8 as lone surrogates, one per byte: the text they spell is sent (it was
    refused as "not UTF-8 ... iconv"); bytes that are not UTF-8 are refused in one line naming the locale."""
    import locale

    s, _ = new_session(llm, max_tokens=2)
    typed = "Say 🐉 dragon".encode("utf-8").decode("ascii", "surrogateescape")
    s.ask(typed)
    assert s.conv.turns[-1].user == "Say 🐉 dragon"
    monkeypatch.setattr(locale, "getpreferredencoding", lambda do_setlocale=True: "ANSI_X3.4-1968")
    with pytest.raises(CommandError, match=r"not UTF-8 text: byte 0xe9 .*not sent; the locale's encoding is "
                                           r"ANSI_X3.4-1968, not UTF-8"):
        s.ask(b"caf\xe9".decode("ascii", "surrogateescape"))
    assert len(s.conv.turns) == 1


def test_typed_line_mode_exits_0_after_a_mistyped_command_as_the_repl_does(llm):
    """Lines typed at a terminal while stdout is not one (`bitchat > answers.txt`): a mistyped command or a refused
    message is said and the session goes on; leaving exits 0, as the REPL does. It exited 1, the rule of piped
    input, so `bitchat > out.txt && next-step` failed after a typo. Piped input keeps its rule."""
    from bitnet_cpu.chat.repl import run_plain

    script = b"/sett temp 1\nHello\n/bye\n"
    s, sink = new_session(llm, max_tokens=2)
    assert run_plain(s, io.BytesIO(script), prompt=lambda text: None) == 0
    assert "/sett" in sink.getvalue() and [t.user for t in s.conv.turns] == ["Hello"]
    s, _ = new_session(llm, max_tokens=2)
    assert run_plain(s, io.BytesIO(script)) == 1
    s, _ = new_session(llm, max_tokens=2)
    assert run_plain(s, io.BytesIO(script[:-5]), prompt=lambda text: None) == 0   # ended by Ctrl-D


def test_a_typed_byte_that_is_not_utf8_in_line_mode_names_the_locale(llm, monkeypatch):
    """Typed line mode under a locale that is not UTF-8: a byte that is not UTF-8 is refused naming the locale, as
    the REPL does and the docs say; it got the piped file's line ("stdin line 3", convert the file). Piped input
    keeps naming its line."""
    import locale

    from bitnet_cpu.chat.repl import run_plain

    monkeypatch.setattr(locale, "getpreferredencoding", lambda do_setlocale=True: "ANSI_X3.4-1968")
    script = b"Hi\n\ncaf\xe9\n"
    s, sink = new_session(llm, max_tokens=2)
    run_plain(s, io.BytesIO(script), prompt=lambda text: None)
    said = sink.getvalue()
    assert "not UTF-8 text: byte 0xe9" in said and "the locale's encoding is ANSI_X3.4-1968, not UTF-8" in said
    assert "stdin line" not in said and [t.user for t in s.conv.turns] == ["Hi"]
    s, sink = new_session(llm, max_tokens=2)
    run_plain(s, io.BytesIO(script))
    assert "stdin line 3: not UTF-8 text: byte 0xe9" in sink.getvalue()


def test_piped_input_that_ends_inside_an_open_block_says_so(llm, tmp_path):
    '''A piped script whose """ block is never closed: what follows it, commands included, is one message sent at
    the end of input, and one line says so, naming the line the block opened on; exit 1 (a /save in it never ran).
    It was sent with no word.'''
    from bitnet_cpu.chat.repl import run_plain

    script = f'Hi\n"""Hello""" is a greeting\n/save {tmp_path / "c.json"}\n/bye\n'
    s, sink = new_session(llm, max_tokens=2)
    assert run_plain(s, io.StringIO(script)) == 1
    assert '[input ended inside the """ block opened at line 2: sent as one message]' in sink.getvalue()
    assert not (tmp_path / "c.json").exists() and len(s.conv.turns) == 2
    s, sink = new_session(llm, max_tokens=2)
    assert run_plain(s, io.StringIO('Hi\n"""\nline\n"""\n')) == 0 and "input ended" not in sink.getvalue()


def test_set_format_json_schema_and_off(llm, tmp_path):
    """/set format (ollama's words): answers are JSON (or match a schema file) until /set format off; a bad
    schema or file is a one-line CommandError and leaves the format as it was."""
    import jsonschema

    s, sink = new_session(llm, max_tokens=300, temp=1.0)
    s.run_command(parse_command("/set format json"))
    s.ask("Describe yourself.")
    turn = s.conv.turns[-1]
    assert turn.assistant.startswith("{"), turn.assistant
    # any JSON object: a random model's string can run past any max_tokens (it did on aarch64, whose float
    # rounding takes another path than x86's). Then, as OpenAI does, the answer is cut and the user is told so;
    # an answer that ended by itself is whole JSON
    if turn.finish_reason == "length":
        assert s.last_stats.n_generated == 300 and "stopped at max_tokens" in sink.getvalue()
    else:
        assert isinstance(json.loads(turn.assistant), dict), (turn.finish_reason, turn.assistant)
    # a schema that ends within a few tokens (keys and punctuation forced, one choice sampled): always whole
    schema = {"type": "object", "additionalProperties": False, "required": ["mood"],
              "properties": {"mood": {"enum": ["happy", "sad"]}}}
    path = tmp_path / "mood.json"
    path.write_text(json.dumps(schema))
    s.run_command(parse_command(f"/set format {path}"))
    s.ask("How are you?")
    assert s.conv.turns[-1].finish_reason != "length"
    jsonschema.validate(json.loads(s.conv.turns[-1].assistant), schema)
    # and the same schema with too few tokens for it: cut at the limit, a prefix of the only possible start
    s.run_command(parse_command("/set max_tokens 2"))
    s.ask("How are you now?")
    cut = s.conv.turns[-1]
    assert cut.finish_reason == "length" and cut.assistant and '{"mood":"'.startswith(cut.assistant), cut.assistant
    assert sink.getvalue().rstrip().endswith("stopped at max_tokens]")
    s.run_command(parse_command("/set max_tokens 300"))
    assert f"format={path}" in s.describe_settings()
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "strin"}')
    with pytest.raises(CommandError, match="strin"):
        s.run_command(parse_command(f"/set format {bad}"))
    with pytest.raises(CommandError, match="No such file"):
        s.run_command(parse_command(f"/set format {tmp_path / 'missing.json'}"))
    assert s.format_label == str(path)
    s.run_command(parse_command("/set format off"))
    assert s.format is None and "format=off" in s.describe_settings()
    s.run_command(parse_command("/set format json"))
    s.run_command(parse_command("/set noformat"))   # ollama's spelling of off
    assert s.format is None and "format=off" in s.describe_settings()


def test_ollamas_one_word_set_commands_say_what_they_do_here(llm):
    """ollama's /set verbose, wordwrap, history: what bitchat always does, said in one line; quiet, nowordwrap,
    nohistory: refused in one line naming what to do instead ("/set needs NAME VALUE" before)."""
    s, sink = new_session(llm)
    for word in ("verbose", "wordwrap", "history"):
        s.run_command(parse_command(f"/set {word}"))
    assert "stats line is always shown" in sink.getvalue() and "always wrap" in sink.getvalue()
    assert "BITCHAT_HISTORY=" in sink.getvalue()
    for word, hint in (("quiet", "always shown"), ("nowordwrap", "never wrapped"), ("nohistory", "BITCHAT_HISTORY=")):
        with pytest.raises(CommandError, match=f"/set {word}: not here: .*{hint}"):
            s.run_command(parse_command(f"/set {word}"))


ALTERNATING = ("{% for m in messages %}{% if m['role'] != 'system' %}{% if (m['role'] == 'user') != (loop.index0 "
               "% 2 == (1 if messages[0]['role'] == 'system' else 0)) %}{{ raise_exception('Conversation roles must "
               "alternate user/assistant') }}{% endif %}{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
               "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_a_recovery_copy_with_an_unanswered_question_loads_and_goes_on(llm, tmp_path):
    """A killed bitchat's recovery copy ends with a question whose answer never began (assistant null): loaded
    under a template that alternates roles, the next question is answered (each was 'not sent', for ever)."""
    from bitnet_cpu.engine.api import load_model

    strict = load_model(llm.store.path, ctx=256, threads=1, progress=False)
    strict.set_chat_template(ALTERNATING)
    sink = io.StringIO()
    s = ChatSession(strict, Settings(temp=0.0, max_tokens=4), Output(sink, sink, interactive=False))
    path = tmp_path / "recovered.json"
    path.write_text(json.dumps({"format": "bitchat-conversation", "version": 1, "system": None, "window_start": 0,
                                "turns": [{"user": "Hello", "assistant": "Hi."},
                                          {"user": "Lost question", "assistant": None}]}))
    s.run_command(parse_command(f"/load {path}"))
    s.ask("Next question?")
    assert "not sent" not in sink.getvalue(), sink.getvalue()
    assert [t.user for t in s.conv.turns] == ["Hello", "Lost question", "Next question?"]
    assert all(t.assistant is not None for t in s.conv.turns)


def test_load_refuses_what_the_model_cannot_take_and_keeps_the_chat(llm, tmp_path):
    """A hand-edited conversation holding a lone surrogate (JSON's unpaired "\\ud800"): /load says so in one line
    and the current conversation stays (it was replaced, then every message failed as an internal error)."""
    s, sink = new_session(llm)
    s.ask("One?")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "bitchat-conversation", "version": 1, '
                   '"turns": [{"user": "x\\ud800y", "assistant": "z"}]}')
    with pytest.raises(CommandError, match=r"/load: .*bad.json: turns\[0\].user holds a lone UTF-16 surrogate"):
        s.run_command(parse_command(f"/load {bad}"))
    assert [t.user for t in s.conv.turns] == ["One?"]
    s.ask("Two?")
    assert "internal error" not in sink.getvalue()
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(CommandError, match="nested too deep"):
        s.run_command(parse_command(f"/load {deep}"))


def test_load_fits_the_window_to_this_sessions_context(llm, tmp_path):
    """A conversation saved by a session with a small context (its window had dropped turns) loads whole into a
    larger one: the turns that fit are back in view (the saved window start kept them out for good)."""
    from bitnet_cpu.engine.api import load_model

    small = load_model(llm.store.path, ctx=128, threads=1, progress=False)
    sink = io.StringIO()
    s = ChatSession(small, Settings(temp=0.0, max_tokens=8), Output(sink, sink, interactive=False))
    for i in range(6):
        s.ask(f"Question {i}: " + "more words here " * 3)
    assert s.conv.window_start > 0
    path = tmp_path / "small.json"
    s.conv.save(str(path))
    big, _ = new_session(llm, system=None)
    big.run_command(parse_command(f"/load {path}"))
    assert big.conv.window_start == 0 and len(big.conv.turns) == 6


def test_a_full_context_is_not_trimmed_on_every_turn(llm):
    """Once the context is full, trimming frees a quarter of the room: the next turns reuse the cache (trimming
    just enough, one old turn per new one, changed the prompt's start every turn: the whole window was read
    again each time, 26-41 s a turn on the 2B model)."""
    from bitnet_cpu.engine.api import load_model

    small = load_model(llm.store.path, ctx=256, threads=1, progress=False)
    sink = io.StringIO()
    s = ChatSession(small, Settings(temp=0.0, max_tokens=8), Output(sink, sink, interactive=False), system="Be brief.")
    trimmed, reused = [], []
    for i in range(16):
        before = s.n_dropped
        s.ask(f"Question {i}: tell me more.")
        trimmed.append(s.n_dropped > before)
        reused.append(s.last_stats.n_cached)
        assert s.tokens_in_cache <= small.n_ctx
    after_first = trimmed[trimmed.index(True):]
    assert sum(after_first) <= len(after_first) // 2, trimmed
    assert s.conv.messages()[0] == {"role": "system", "content": "Be brief."}


def test_a_system_prompt_too_long_for_the_context_is_named(llm):
    """When the system prompt alone leaves no room, the refusal says so (it told the user to shorten a one-word
    message)."""
    from bitnet_cpu.engine.api import load_model

    small = load_model(llm.store.path, ctx=96, threads=1, progress=False)
    sink = io.StringIO()
    s = ChatSession(small, Settings(temp=0.0, max_tokens=4), Output(sink, sink, interactive=False),
                    system="rules " * 200)
    s.ask("hi")
    assert "the system prompt alone needs" in sink.getvalue() and s.conv.turns == []
    s.run_command(parse_command("/system Be brief."))
    s.ask("hi")
    assert len(s.conv.turns) == 1 and s.conv.turns[0].assistant is not None


def test_the_recovery_copy_removes_only_what_it_wrote(llm, tmp_path):
    """A normal exit removes the recovery copy only while it is the one this session wrote: a file it never wrote
    (the user's own, a conversation /load-ed from that path), another bitchat's copy there and one written over
    it since all stay (each was removed at every exit, even with no turn made)."""
    path = tmp_path / "rec.json"
    path.write_text("precious notes\n")
    s, _ = new_session(llm)
    s.enable_recovery(str(path))
    s.discard_recovery()
    assert path.read_text() == "precious notes\n" and s.recovery_copy() is None
    path.unlink()
    s.ask("Hi?")
    assert json.loads(path.read_text())["meta"]["recovered"] and s.recovery_copy() == str(path)
    other, _ = new_session(llm)   # a second bitchat given the same path
    other.enable_recovery(str(path))
    other.ask("Mine?")
    other.discard_recovery()
    assert [t["user"] for t in json.loads(path.read_text())["turns"]] == ["Hi?"]
    path.write_text(json.dumps({**json.loads(path.read_text()), "turns": []}))   # a copy written over it since
    s.discard_recovery()
    assert path.exists()


def test_a_shared_recovery_path_keeps_each_sessions_copy(llm, tmp_path):
    """Two bitchats given the same $BITCHAT_RECOVERY: the second one's first turn wrote over the first one's copy,
    so a SIGHUP to the first named no copy, and the second one's normal exit removed the only one left: the first
    one's turns were gone. The second one's copy goes beside it (X-PID.json, said in one line); a copy written
    over behind a session's back is written again beside it as the session leaves on a signal, and named."""
    def users(p):
        return [t["user"] for t in json.loads(open(p).read())["turns"]]

    path = tmp_path / "shared.json"
    a, _ = new_session(llm)
    a.enable_recovery(str(path))
    a.ask("A's secret question?")
    b, b_sink = new_session(llm)
    b.enable_recovery(str(path))
    b.ask("B's question?")
    theirs = b.recovery_copy()
    assert theirs and theirs != str(path) and users(theirs) == ["B's question?"]
    assert f"this session's copy is now {theirs}" in b_sink.getvalue()
    assert a.keep_recovery() == str(path) and users(path) == ["A's secret question?"]
    b.discard_recovery()   # B's normal exit
    assert not os.path.exists(theirs) and users(path) == ["A's secret question?"]
    Conversation(turns=[Turn("Someone else's?", "Yes.")]).save(str(path), meta={"recovered": True})
    kept = a.keep_recovery()   # A's terminal closes
    assert kept and kept != str(path) and users(kept) == ["A's secret question?"]
    assert users(path) == ["Someone else's?"]


def test_save_to_a_name_ending_in_a_slash_keeps_the_file_without_it(llm, tmp_path):
    """/save mine.json/ said "holds another conversation ... /save! mine.json/ replaces it" (and /save! did, the
    slash dropped): a name ending in / names a directory, refused in one line; mine.json stays."""
    saved = tmp_path / "mine.json"
    Conversation(turns=[Turn("Mine?", "Yes.")]).save(str(saved))
    before = saved.read_text()
    s, _ = new_session(llm)
    s.ask("Hi?")
    for line in (f"/save {saved}/", f"/save! {saved}/", f"/save {tmp_path}/newdir/"):
        with pytest.raises(CommandError, match=r"^/save: .*names a directory \(it ends in '/'\), not a file"):
            s.run_command(parse_command(line))
    assert saved.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["mine.json"]


def test_a_recovery_copy_under_a_file_says_why_in_words(llm, tmp_path):
    """$XDG_STATE_HOME/bitchat is a file: the notice showed Python's "[Errno 17] File exists: '...'"."""
    afile = tmp_path / "bitchat"
    afile.write_text("")
    s, sink = new_session(llm)
    s.enable_recovery(str(afile / "recovery-1.json"))
    s.ask("Hi?")
    assert f"[cannot keep a recovery copy of the conversation: {afile}: Not a directory; /save still works; it is " \
        "tried again at every turn]" in sink.getvalue()
    assert "Errno" not in sink.getvalue()


def test_a_ctrl_c_during_save_says_the_file_was_not_written(llm, tmp_path):
    """Ctrl-C while /save writes (here: the kernel's SIGXFSZ at the file-size limit, its handler raising
    KeyboardInterrupt as Ctrl-C's does): it said only "[interrupted]"; now the line says the file was not written
    and the old one is kept (the save is atomic)."""
    import resource

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    s, _ = new_session(llm)
    s.conv.turns = [Turn(f"Question {i}?", "An answer. " * 20) for i in range(20)]
    path = tmp_path / "c.json"
    s.run_command(parse_command(f"/save {path}"))
    old = path.read_text()
    s.conv.turns.append(Turn("One more?", "Yes."))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, interrupt)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
    try:
        with pytest.raises(CommandError, match=rf"^/save: interrupted; {path} was not written \(the file there is "
                                               r"kept as it was\)$"):
            s.run_command(parse_command(f"/save {path}"))
    except KeyboardInterrupt:   # (as the REPL took it: "[interrupted]" alone; caught here so pytest goes on)
        pytest.fail("the Ctrl-C left /save without a line saying what was written")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert path.read_text() == old


def test_a_ctrl_c_at_a_new_file_s_rename_without_hard_links_is_not_called_saved(llm, tmp_path, monkeypatch):
    """Where hard links fail (FAT, SMB, vboxsf) a new name is reserved with an empty file first: a Ctrl-C before
    the written file replaced it left that empty file, and /save, seeing a file where there was none, said
    "[saved N turns to ...]" over it. Now nothing is left there and the line says it was not written."""
    import errno

    def link(src, dst, *args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    def replace(src, dst, *args, **kwargs):
        raise KeyboardInterrupt
    s, sink = new_session(llm)
    s.conv.turns = [Turn("Question?", "An answer.")]
    path = tmp_path / "c.json"
    with monkeypatch.context() as m:
        m.setattr(os, "link", link)
        m.setattr(os, "replace", replace)
        with pytest.raises(CommandError, match=rf"^/save: interrupted; {path} was not written$"):
            s.run_command(parse_command(f"/save {path}"))
    assert not path.exists() and "saved" not in sink.getvalue()


def test_the_recovery_copy_follows_the_commands_that_change_the_conversation(llm, tmp_path):
    """/set system, /system, /load and /reset rewrite the recovery copy (or remove it when no turn is left), so the
    copy a SIGTERM's line names is the conversation as it stands (it was the one before the command)."""
    rec, other = tmp_path / "rec.json", tmp_path / "other.json"
    s, _ = new_session(llm)
    s.enable_recovery(str(rec))
    s.ask("Hi?")

    def copy():
        return json.loads(rec.read_text())

    s.run_command(parse_command("/set system Be terse."))
    assert copy()["system"] == "Be terse."
    s.run_command(parse_command("/system Be kind."))
    assert copy()["system"] == "Be kind."
    s.run_command(parse_command("/system --clear"))
    assert copy()["system"] is None
    Conversation(system="Loaded.", turns=[Turn("Loaded question?", "Loaded answer.")]).save(str(other))
    s.run_command(parse_command(f"/load {other}"))
    assert [t["user"] for t in copy()["turns"]] == ["Loaded question?"] and copy()["system"] == "Loaded."
    s.run_command(parse_command("/reset"))
    assert not rec.exists() and s.recovery_copy() is None
    s.ask("Again?")
    assert [t["user"] for t in copy()["turns"]] == ["Again?"]


def test_the_recovery_folder_is_private(llm, tmp_path, monkeypatch):
    """bitchat's state folder, made for a recovery copy (a piped bitchat made it with the umask's bits, 0755) or
    left so by an earlier bitchat, is 0700: what it holds was typed."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    folder = tmp_path / "state" / "bitchat"
    s, _ = new_session(llm)
    s.enable_recovery(str(folder / "recovery-1.json"))
    old = os.umask(0o022)
    try:
        s.ask("Hi?")
    finally:
        os.umask(old)
    assert folder.stat().st_mode & 0o777 == 0o700
    os.chmod(folder, 0o755)   # as an earlier bitchat left it
    s.ask("Again?")
    assert folder.stat().st_mode & 0o777 == 0o700


def test_load_keeps_the_sessions_system_prompt_when_the_file_has_none(llm, tmp_path):
    """bitchat -sys TEXT, then /load of a conversation saved without a system prompt: TEXT stays and the loaded line
    says which system prompt is in use (it was dropped in silence); a file's own system prompt replaces it."""
    plain, _ = new_session(llm, system=None)
    plain.ask("Hi?")
    nosys = tmp_path / "nosys.json"
    plain.run_command(parse_command(f"/save {nosys}"))
    s, sink = new_session(llm, system="Answer only in French.")
    s.run_command(parse_command(f"/load {nosys}"))
    assert s.conv.system == "Answer only in French."
    assert "[loaded 1 turn from" in sink.getvalue() and "'Answer only in French.' kept (the file has none)" in \
        sink.getvalue()
    assert s.conv.messages()[0] == {"role": "system", "content": "Answer only in French."}
    withsys = tmp_path / "withsys.json"
    new_session(llm, system="Be brief.")[0].conv.save(str(withsys))
    s.run_command(parse_command(f"/load {withsys}"))
    assert s.conv.system == "Be brief." and "system prompt 'Be brief.'" in sink.getvalue()


def test_load_of_a_system_prompt_too_long_for_the_context_says_so(llm, tmp_path):
    """A loaded conversation whose system prompt alone overflows the context is named as such (it said the last turn
    would be trimmed, then refused every question over the system prompt)."""
    from bitnet_cpu.engine.api import load_model

    small = load_model(llm.store.path, ctx=96, threads=1, progress=False)
    path = tmp_path / "longsys.json"
    path.write_text(json.dumps({"format": "bitchat-conversation", "version": 1, "system": "rules " * 200,
                                "turns": [{"user": "Hello", "assistant": "Hi."}]}))
    sink = io.StringIO()
    s = ChatSession(small, Settings(temp=0.0, max_tokens=4), Output(sink, sink, interactive=False))
    s.run_command(parse_command(f"/load {path}"))
    assert "the system prompt alone needs" in sink.getvalue() and "trimmed" not in sink.getvalue()


def test_load_tokenizes_a_conversation_that_fits_once(llm, tmp_path, monkeypatch):
    """/load reads the whole conversation through the tokenizer once: the prefill's fit reuses the ids /load's check
    made (it tokenized the whole conversation three times: 96 s for 10,000 turns). Counted, not timed: the real
    tokenizer does the work, each call of it on the whole conversation is counted."""
    s, _ = new_session(llm)
    for i in range(3):
        s.ask(f"Question {i}?")
    path = tmp_path / "c.json"
    s.run_command(parse_command(f"/save {path}"))
    whole = llm.chat_text(s.conv.messages(), add_generation_prompt=False)
    tok = llm.tokenizer
    seen = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: (seen.append(text == whole), real(text, **kw))[1])
    loader, sink = new_session(llm)
    loader.run_command(parse_command(f"/load {path}"))
    assert "prefilled" in sink.getvalue() and sum(seen) == 1, seen


def _long_conversation(path, n_turns):
    from bitnet_cpu.chat.transcript import Conversation, Turn

    conv = Conversation(system="Be brief.", turns=[Turn(f"Question {i}: tell me about item {i}.",
                                                        f"Answer {i}: item {i} is fine.") for i in range(n_turns)])
    conv.save(str(path))
    return conv


def test_load_of_a_long_conversation_tokenizes_only_what_can_fit(llm, tmp_path, monkeypatch):
    """/load of a conversation far longer than the context reads only about a context's worth of it through the
    tokenizer (it tokenized the whole file in one call: minutes for tens of MB); the window is the one trimming the
    whole conversation gives. Counted, not timed: the real tokenizer does the work, the text given to it is noted."""
    from bitnet_cpu.chat.transcript import Conversation

    path = tmp_path / "long.json"
    _long_conversation(path, 1000)
    s, sink = new_session(llm, system=None)
    budget = llm.n_ctx - s._reserve()
    whole = Conversation.load(str(path))
    whole.window_start = 0
    whole.fit_window(lambda m: len(llm.chat_prompt(m, add_generation_prompt=False)), budget, budget * 3 // 4)
    tok = llm.tokenizer
    seen = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: (seen.append(text), real(text, **kw))[1])
    s.run_command(parse_command(f"/load {path}"))
    assert "prefilled" in sink.getvalue()
    assert s.conv.window_start == whole.window_start > 0
    assert f"dropped the {whole.window_start} oldest turns" in sink.getvalue()
    assert not any("Question 0:" in text for text in seen)   # the oldest turns never went through the tokenizer
    assert sum(map(len, seen)) < len(llm.chat_text(whole.messages(start=0), add_generation_prompt=False)) / 3


def test_ctrl_c_during_a_load_keeps_the_current_conversation(llm, tmp_path, monkeypatch):
    """A Ctrl-C (a real SIGINT) while /load reads the conversation through the tokenizer stops it there: one line,
    the current conversation stays (it was heard only once the whole file was tokenized, minutes later)."""
    path = tmp_path / "long.json"
    _long_conversation(path, 400)
    s, sink = new_session(llm)
    s.ask("Still here?")
    calls = _ctrl_c_at_the_first_encode(llm, monkeypatch)
    try:
        with pytest.raises(CommandError, match=r"/load .*long.json: interrupted; the current conversation is kept"):
            s.run_command(parse_command(f"/load {path}"))
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C was a KeyboardInterrupt once the whole conversation was tokenized")
    assert len(calls) <= 2   # stopped within the turn it came in
    assert [t.user for t in s.conv.turns] == ["Still here?"]


def _ctrl_c_at_the_first_encode(llm, monkeypatch) -> list:
    """A Ctrl-C (SIGINT to this process) as the tokenizer's first encode() of what follows begins, as a user's
    comes while a /load tokenizes; the texts encoded are listed in the list returned."""
    tok, calls = llm.tokenizer, []
    real = tok.encode

    def encode(text, **kw):
        calls.append(text)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return real(text, **kw)
    monkeypatch.setattr(tok, "encode", encode)
    return calls


def _one_huge_turn(path):
    huge = "hello " * 200_000
    Conversation(turns=[Turn(huge, "ok")]).save(str(path))
    return huge


def test_ctrl_c_during_the_load_of_one_huge_turn_keeps_the_current_conversation(llm, tmp_path, monkeypatch):
    """A conversation whose one turn alone overflows the window: a Ctrl-C while it went through the tokenizer was
    never looked at (the count returned as the turn overflowed), and the load went on to replace the chat."""
    path = tmp_path / "huge.json"
    _one_huge_turn(path)
    s, sink = new_session(llm)
    s.ask("Still here?")
    calls = _ctrl_c_at_the_first_encode(llm, monkeypatch)
    try:
        with pytest.raises(CommandError, match=r"/load .*huge.json: interrupted; the current conversation is kept"):
            s.run_command(parse_command(f"/load {path}"))
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C was a KeyboardInterrupt once the whole turn was tokenized")
    assert len(calls) == 1 and [t.user for t in s.conv.turns] == ["Still here?"]


def test_a_sigterm_as_a_load_winds_down_ends_the_session(llm, tmp_path):
    """A SIGTERM after /load's last look at the signals, as it put the terminal and the handlers back, was taken
    and never acted on: the conversation loaded and bitchat went back to its prompt, still running. Now it
    leaves (Terminated, bitchat's exit 143) with the current conversation kept, as at any earlier moment."""
    import sys

    from bitnet_cpu.chat.session import quiet_terminal
    from bitnet_cpu.engine.errors import Terminated, raise_terminated

    path = tmp_path / "other.json"
    Conversation(turns=[Turn("Loaded question?", "Loaded answer.")]).save(str(path))
    s, _ = new_session(llm)
    s.ask("Still here?")
    code, entered, sent = quiet_terminal.__wrapped__.__code__, [], []

    def watch(frame, event, arg):   # the SIGTERM as /load's quiet_terminal resumes to restore (its 2nd "call")
        if event == "call" and frame.f_code is code:
            entered.append(1)
            if len(entered) == 2:
                sent.append(1)
                os.kill(os.getpid(), signal.SIGTERM)
    previous = signal.signal(signal.SIGTERM, raise_terminated)   # as bitchat has it
    try:
        sys.setprofile(watch)
        with pytest.raises(Terminated):
            s.run_command(parse_command(f"/load {path}"))
    finally:
        sys.setprofile(None)
        signal.signal(signal.SIGTERM, previous)
    assert sent   # (the moment came)
    assert [t.user for t in s.conv.turns] == ["Still here?"]


def test_load_never_tokenizes_a_turn_far_beyond_the_window_whole(llm, tmp_path, monkeypatch):
    """The newest turn alone far beyond the window: /load tokenized all of it at least twice (15 MB: a minute,
    deaf to Ctrl-C); now only enough of it to know it cannot fit. It loads, and the one line says it does not fit."""
    path = tmp_path / "huge.json"
    huge = _one_huge_turn(path)
    s, sink = new_session(llm)
    tok = llm.tokenizer
    real = tok.encode
    seen = []
    monkeypatch.setattr(tok, "encode", lambda text, **kw: (seen.append(len(text)), real(text, **kw))[1])
    s.run_command(parse_command(f"/load {path}"))
    assert "[loaded 1 turn from" in sink.getvalue()
    assert "last turn alone does not fit the context window" in sink.getvalue()
    assert sum(seen) < len(huge) / 10, seen


def test_small_inputs_that_are_nothing_or_too_much(llm, tmp_path):
    """-sys '   ' rendered an empty system block (-sys '' and a blank /system are none); /system --clear extra set
    the system prompt to "--clear extra"; /load said nothing when the file was saved with another model."""
    s, sink = new_session(llm, system="   \n ")
    assert s.conv.system is None
    s.run_command(parse_command("/system Be brief."))
    with pytest.raises(CommandError, match=r"/system --clear takes nothing after it"):
        s.run_command(parse_command("/system --clear extra"))
    assert s.conv.system == "Be brief."
    path = tmp_path / "other.json"
    Conversation(turns=[Turn("Hi?", "Hello.")]).save(str(path), meta={"model": "some-other-model"})
    s.run_command(parse_command(f"/load {path}"))
    assert "saved with some-other-model" in sink.getvalue()


def test_dev_null_as_the_recovery_path_is_no_recovery_copy(monkeypatch):
    """BITCHAT_RECOVERY=/dev/null refused to start ("not a regular file"), while BITCHAT_HISTORY=/dev/null is
    history off (HISTFILE=/dev/null is a common habit): it is no recovery copy, as the empty value."""
    from bitnet_cpu.cli.chat import recovery_path
    for value in (os.devnull, ""):
        monkeypatch.setenv("BITCHAT_RECOVERY", value)
        assert recovery_path() is None


def test_a_dead_sessions_recovery_copy_is_not_written_over(tmp_path, monkeypatch):
    """The default recovery copy is recovery-PID.json: where a session that died with the same PID (PIDs are
    reused) left its copy, this session takes recovery-PID-2.json (it wrote over that copy at its first turn)."""
    from bitnet_cpu.cli.chat import recovery_path
    monkeypatch.delenv("BITCHAT_RECOVERY", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    first = recovery_path()
    assert os.path.basename(first) == f"recovery-{os.getpid()}.json"
    os.makedirs(os.path.dirname(first))
    with open(first, "w") as f:
        f.write('{"the": "dead session"}')
    second = recovery_path()
    assert second != first and os.path.basename(second) == f"recovery-{os.getpid()}-2.json"
    with open(first) as f:
        assert f.read() == '{"the": "dead session"}'


def test_set_format_reads_only_a_regular_file_of_bounded_size(llm, tmp_path, monkeypatch):
    """/set format FILE takes the checks /load has: a device, a FIFO or a directory is one line and nothing is read
    (/dev/zero was read until the machine ran out of memory, deaf to Ctrl-C; a FIFO waited for a writer), a file
    over the cap is one line naming the cap, and ~ is the home folder as for /save and /load."""
    from bitnet_cpu.chat.session import FORMAT_MAX_BYTES
    from helpers import address_space_cap

    s, _ = new_session(llm)
    with pytest.raises(CommandError, match=r"^/set format /dev/null: not a regular file"):
        s.run_command(parse_command("/set format /dev/null"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with address_space_cap():   # the old read of /dev/zero: a MemoryError here, not the OOM killer
        for name in ("/dev/zero", "/dev/urandom", str(fifo)):
            with pytest.raises(CommandError, match=r"not a regular file \(give json, off, or a JSON Schema file\)"):
                s.run_command(parse_command(f"/set format {name}"))
    with pytest.raises(CommandError, match=r"^/set format .*: is a directory"):
        s.run_command(parse_command(f"/set format {tmp_path}"))
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(FORMAT_MAX_BYTES + 1)
    with pytest.raises(CommandError) as e:
        s.run_command(parse_command(f"/set format {big}"))
    assert "too large for a JSON Schema" in str(e.value) and "\n" not in str(e.value)
    assert s.format is None and s.format_label == "off"
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "s.json").write_text('{"type": "object"}')
    s.run_command(parse_command("/set format ~/s.json"))
    assert s.format is not None and s.format_label == "~/s.json"


def test_a_recovery_copy_that_failed_is_written_again_and_a_stale_one_never_named(llm, tmp_path):
    """A recovery write that failed once (a full disk) stopped the copy for good, and a signal then named the stale
    copy as "the conversation so far" (1 turn of 10,003). Now each turn tries again, one line says when it works
    again, and as bitchat leaves it is written then or said to be lost, with what the older copy holds."""
    from helpers import file_size_cap

    rec = tmp_path / "rec.json"
    s, sink = new_session(llm)
    s.enable_recovery(str(rec))
    s.ask("First question?")
    assert s.keep_recovery() == str(rec)
    with file_size_cap(os.path.getsize(rec) + 16):   # the next copy is larger: its write fails
        s.ask("Second question, a longer one than the first?")
        assert sink.getvalue().count("cannot keep a recovery copy") == 1
        s.ask("Third?")
        assert sink.getvalue().count("cannot keep a recovery copy") == 1   # said once, tried at every turn
        assert s.keep_recovery() is None   # the file there holds one turn of three: never named as the conversation
        lost = s.recovery_lost()
        assert "could not be written" in lost and f"{rec} holds an older copy (1 of 3 turns)" in lost, lost
        assert "\n" not in lost
    assert len(Conversation.load(str(rec)).turns) == 1
    s.ask("Fourth, with room again?")   # the next turn writes it again, and says so
    assert len(Conversation.load(str(rec)).turns) == 4 and "recovery copy is kept again" in sink.getvalue()
    assert s.keep_recovery() == str(rec) and s.recovery_lost() is None
    with file_size_cap(os.path.getsize(rec) + 16):
        s.ask("Fifth, and the disk is full again?")
    # a signal once there is room again: the copy is written then, before it is named
    assert s.keep_recovery() == str(rec) and len(Conversation.load(str(rec)).turns) == 5
    s.discard_recovery()
    assert not rec.exists()


def _huge_last_answer(path):
    huge = "word " * 250_000
    Conversation(turns=[Turn("First question?", "Short answer."), Turn("Tell me a lot.", huge)]).save(str(path))
    return huge


def _window_as_plain_trimming_gives(s, question: str) -> tuple[int, list[int]]:
    """The window start and prompt ids trimming s's conversation plus `question` gives by counting every window whole
    (what bitchat did before it kept each turn's count), on a copy: the reference the session must match."""
    turns = [Turn(t.user, t.assistant) for t in s.conv.turns] + [Turn(question)]
    conv = Conversation(system=s.conv.system, turns=turns, window_start=s.conv.window_start)
    budget = s.llm.n_ctx - s._reserve()
    conv.fit_window(lambda m: len(s.llm.chat_prompt(m)), budget, budget * 3 // 4)
    return conv.window_start, s.llm.chat_prompt(conv.messages())


def test_the_first_question_after_loading_a_huge_turn_never_tokenizes_it_whole(llm, tmp_path, monkeypatch):
    """/load of a conversation whose last answer is far beyond the context left it in the window; the next question
    then tokenized the whole window twice (a 12 MB turn: 10-30 s, deaf to Ctrl-C). Now each turn's text is counted
    once, and of a huge one only enough to know it cannot fit: the same window and prompt as counting every window
    whole gives. Counted, not timed: the real tokenizer does the work, the texts given to it are noted."""
    path = tmp_path / "huge.json"
    huge = _huge_last_answer(path)
    s, sink = new_session(llm, system=None)
    s.run_command(parse_command(f"/load {path}"))
    assert "last turn alone does not fit" in sink.getvalue()
    start, prompt = _window_as_plain_trimming_gives(s, "What next?")
    tok = llm.tokenizer
    seen = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: (seen.append(len(text)), real(text, **kw))[1])
    s.ask("What next?")
    assert s.conv.window_start == start and s.last_prompt_ids == prompt
    assert s.conv.turns[-1].assistant is not None and not s.conv.turns[-1].interrupted
    assert sum(seen) < len(huge) / 10, seen   # it went through the tokenizer whole, twice
    seen.clear()
    s.ask("And then?")
    assert sum(seen) < len(huge) / 10, seen


def test_a_ctrl_c_while_the_first_question_after_a_huge_load_is_fitted_stops_it_there(llm, tmp_path, monkeypatch):
    """A Ctrl-C (a real SIGINT) while the window is fitted to the first question after /load of a huge turn: heard
    after that tokenizer call, the question leaves the conversation (said), the session goes on (it was heard only
    once the whole window had been tokenized, twice)."""
    path = tmp_path / "huge.json"
    _huge_last_answer(path)
    s, sink = new_session(llm, system=None)
    s.run_command(parse_command(f"/load {path}"))
    calls = _ctrl_c_at_the_first_encode(llm, monkeypatch)
    s.ask("What next?")
    assert len(calls) == 1, [len(c) for c in calls]
    assert "[interrupted before the answer began: the message is dropped from the conversation]" in sink.getvalue()
    assert "What next?" not in [t.user for t in s.conv.turns]
    monkeypatch.undo()
    s.ask("Still there?")
    assert s.conv.turns[-1].assistant is not None and not s.conv.turns[-1].interrupted


def test_a_message_far_beyond_the_context_is_refused_without_tokenizing_it_whole(llm, monkeypatch):
    """A pasted message far larger than the context is refused in one line (it needs over N tokens) after reading
    only enough of it to know; the one before it stays."""
    s, sink = new_session(llm)
    s.ask("Hello.")
    huge = "word " * 250_000
    tok = llm.tokenizer
    seen = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: (seen.append(len(text)), real(text, **kw))[1])
    s.ask(huge)
    assert re.search(r"message not sent: it needs over \d+ tokens plus room for the answer", sink.getvalue())
    assert sum(seen) < len(huge) / 10, seen
    assert [t.user for t in s.conv.turns] == ["Hello."]


def test_stats_and_info_say_what_is_in_use(llm):
    """/stats said "context: 257 / 256 tokens" after an answer cut by a full context (the last token sampled is never
    fed to the cache) and "1 turns"; /show info said "threads: 64" where -t 64 was capped to the CPUs there are."""
    from bitnet_cpu.engine.api import load_model
    from bitnet_cpu.engine.cpu import available_cores

    small = load_model(llm.store.path, ctx=128, threads=10_000, progress=False)
    sink = io.StringIO()
    s = ChatSession(small, Settings(temp=0.0, max_tokens=128), Output(sink, sink, interactive=False),
                    system="Be brief.", threads=10_000)
    s.ask("Tell me a very long story about " + "dragons and " * 10 + "knights.")
    assert s.conv.turns[0].finish_reason == "context"
    assert s.tokens_in_cache == len(small.cached_tokens) <= small.n_ctx
    s.run_command(parse_command("/stats"))
    assert f"context:     {len(small.cached_tokens)} / 128 tokens" in sink.getvalue()
    assert "session:     1 turn (1 in the window, 0 dropped)" in sink.getvalue()
    s.run_command(parse_command("/show info"))
    cores = available_cores()
    said = sink.getvalue()
    assert re.search(rf"threads:  {cores} \(-t 10000 is more than the {cores} CPU cores available\)", said), said


def test_a_history_entry_is_written_whole_or_not_at_all(tmp_path):
    """A line typed while the history's disk was full left the part that fitted (57,344 bytes of a 70 KB line), which
    came back at the next start as an entry of its own: an entry is now written whole or not at all."""
    from prompt_toolkit.history import FileHistory

    from bitnet_cpu.chat.repl import guarded_file_history
    from helpers import file_size_cap

    path = tmp_path / "history"
    h = guarded_file_history(str(path))
    h.store_string("first entry\nof two lines")
    size = path.stat().st_size
    with file_size_cap(size + 4096):   # "the disk is full" past 4 KiB more
        h.store_string("a long line " * 6_000)
    assert h.problem and "history kept in memory only" in h.problem and "\n" not in h.problem
    assert path.stat().st_size == size
    assert list(FileHistory(str(path)).load_history_strings()) == ["first entry\nof two lines"]


def _sized(small, words: str, least: int, most: int, system: bool = True) -> str:
    """A text of `words` repeated whose tokens (a system message rendered alone, else the text alone) are in
    least..most on this model, found by counting (no token counts assumed)."""
    for k in range(1, 400):
        text = words * k
        n = len(small.chat_prompt([{"role": "system", "content": text}])) if system else len(small.tokenize(text))
        if least <= n <= most:
            return text
    raise AssertionError(f"no repeat of {words!r} has {least}..{most} tokens")


def test_load_of_a_turn_that_fills_the_window_does_not_blame_the_system_prompt(llm, tmp_path):
    """A loaded conversation whose last answer ran to the context's end: /load said the system prompt alone could not
    fit ("shorten it"), /stats showed the turn in the window and nothing cached, and the next message was answered
    with that same system prompt. The turn leaves the model's view at load, said so; /stats counts it out."""
    from bitnet_cpu.engine.api import load_model

    small = load_model(llm.store.path, ctx=96, threads=1, progress=False)
    settings = Settings(temp=0.0, max_tokens=40)   # 40 kept for the answer: the rest, 56, for the prompt
    system = _sized(small, "rules ", 60, 70)         # over the prompt's share, yet a message fits beside it
    answer = _sized(small, "word ", 40, 50, system=False)
    path = tmp_path / "full.json"
    path.write_text(json.dumps({"format": "bitchat-conversation", "version": 1, "system": system,
                                "turns": [{"user": "Hello", "assistant": answer, "finish_reason": "context"}]}))
    sink = io.StringIO()
    s = ChatSession(small, settings, Output(sink, sink, interactive=False))
    s.run_command(parse_command(f"/load {path}"))
    out = sink.getvalue()
    assert "system prompt alone" not in out and "left out of the model's view" in out, out
    s.run_command(parse_command("/stats"))
    assert "1 turn (0 in the window, 1 dropped)" in sink.getvalue(), sink.getvalue()
    s.ask("hi")
    assert s.conv.turns[-1].assistant is not None and len(s.conv.turns) == 2, sink.getvalue()


def test_the_room_left_for_the_answer_is_said_as_it_is(llm):
    """"context full (N tokens, 40 kept for the answer)" was said when the system prompt and the message left far
    less, and /system with a text longer than the whole context answered "[system prompt set]" alone (only the next
    message was refused). The notices say the room there is, and /system says at once what its text leaves."""
    from bitnet_cpu.engine.api import load_model

    small = load_model(llm.store.path, ctx=96, threads=1, progress=False)
    sink = io.StringIO()
    s = ChatSession(small, Settings(temp=0.0, max_tokens=40), Output(sink, sink, interactive=False))
    s.ask("hi")
    long_system = _sized(small, "rules ", 60, 70)
    s.run_command(parse_command(f"/system {long_system}"))
    assert "answers will be cut short" in sink.getvalue().splitlines()[-1], sink.getvalue()
    mark = len(sink.getvalue())
    s.ask("hello")
    said, room = sink.getvalue()[mark:], small.n_ctx - len(s.last_prompt_ids) + 1
    assert room < 40 and f"only {room} left for the answer): dropped the 1 oldest turn" in said, said
    assert "kept for the answer" not in said, said
    mark = len(sink.getvalue())
    s.run_command(parse_command("/reset"))
    s.ask("again")   # nothing to drop: the room is still said
    room = small.n_ctx - len(s.last_prompt_ids) + 1
    assert f"[only {room} tokens left for the answer" in sink.getvalue()[mark:], sink.getvalue()[mark:]
    s.run_command(parse_command("/system " + "rules " * 200))
    assert "[system prompt set]" in sink.getvalue() and "the system prompt alone needs" in \
        sink.getvalue().splitlines()[-1], sink.getvalue()
    s.run_command(parse_command("/system Be brief."))
    mark = len(sink.getvalue())
    s.ask("hi")
    said = sink.getvalue()[mark:]   # a short system prompt: the whole reserve is kept (said, if a turn dropped)
    assert "left for the answer" not in said and all("40 kept for the answer" in x for x in said.splitlines()
                                                      if "context full" in x), said


def test_a_lone_surrogate_never_makes_the_session_unsavable(llm, tmp_path):
    """A loaded file with an unpaired "\\ud800" in a turn out of the model's view or in a setting, a /set value
    spelled with one, or a /system typed in a C locale: /load, /set and /system refuse it in one line, and the
    conversation can still be saved (every question, /save and /reset failed as an internal error)."""
    from bitnet_cpu.engine.api import load_model

    small = load_model(llm.store.path, ctx=128, threads=1, progress=False)
    sink = io.StringIO()
    s = ChatSession(small, Settings(temp=0.0, max_tokens=8), Output(sink, sink, interactive=False))
    s.ask("Kept?")
    old = [{"user": "old \\ud800 one", "assistant": "answer"}] + [{"user": "word " * 150, "assistant": "reply " * 100}
                                                                   for _ in range(4)]
    files = {
        "old_turn.json": {"turns": old},
        "breakers.json": {"turns": [{"user": "hi", "assistant": "ok"}],
                          "meta": {"settings": {"dry_sequence_breakers": ["a\\ud800"]}}},
        "budget.json": {"turns": [{"user": "hi", "assistant": "ok"}],
                        "meta": {"settings": {"reasoning_budget_message": "x\\ud800y"}}},
    }
    for name, body in files.items():
        p = tmp_path / name
        p.write_text(json.dumps(body).replace("\\\\u", "\\u"))
        with pytest.raises(CommandError, match=r"^/load: .*surrogate[^\n]*$"):
            s.run_command(parse_command(f"/load {p}"))
        assert [t.user for t in s.conv.turns] == ["Kept?"], name
    for line in ('/set dry_sequence_breakers ["a\\ud800"]', '/set reasoning_budget_message x\ud800y'):
        with pytest.raises(CommandError, match=r"surrogate"):
            s.run_command(parse_command(line))
    s.run_command(parse_command("/system caf" + "é".encode().decode("ascii", "surrogateescape")))
    assert s.conv.system == "café"
    with pytest.raises(CommandError, match=r"not UTF-8 text: byte 0xff"):
        s.run_command(parse_command("/system x" + b"\xff".decode("ascii", "surrogateescape")))
    assert s.conv.system == "café"
    out = tmp_path / "out.json"
    s.run_command(parse_command(f"/save {out}"))
    assert [t["user"] for t in json.loads(out.read_text(encoding="utf-8"))["turns"]] == ["Kept?"]
    assert "internal error" not in sink.getvalue()


def test_a_file_loaded_in_any_key_order_or_without_format_saves_back_to_its_path(llm, tmp_path):
    """/load accepts a file with "version" first (jq, an editor) or a hand-written one with no "format", but /save
    and /save! back to it said "exists and is not a bitchat conversation"; the file the session loaded is its own."""
    vfirst, minimal = tmp_path / "vfirst.json", tmp_path / "minimal.json"
    vfirst.write_text(json.dumps({"version": 1, "format": "bitchat-conversation", "system": None,
                                  "turns": [{"user": "a", "assistant": "b"}]}))
    minimal.write_text(json.dumps({"turns": [{"user": "hand written", "assistant": "yes"}]}))
    for path in (vfirst, minimal):
        s, sink = new_session(llm)
        s.run_command(parse_command(f"/load {path}"))
        s.ask("Hello?")
        s.run_command(parse_command(f"/save {path}"))
        assert len(json.loads(path.read_text())["turns"]) == 2
        s.ask("Again?")
        s.run_command(parse_command(f"/save! {path}"))
        assert len(json.loads(path.read_text())["turns"]) == 3, sink.getvalue()


def test_a_save_to_a_name_another_session_took_meanwhile_is_refused(llm, tmp_path):
    """Two sessions saving to one new name at once both said "saved" and one conversation was lost: the session
    that checked the name was free only creates the file, so the second is refused with the /save! hint. Run as
    two sessions in threads, many rounds: never both saved, and the file holds the one that was."""
    import threading

    a, _ = new_session(llm)
    b, _ = new_session(llm)
    a.conv.add_user("from A").assistant = "a"
    b.conv.add_user("from B").assistant = "b"
    b.conv.add_user("more B").assistant = "b"
    for round_ in range(20):
        path = tmp_path / f"x{round_}.json"
        barrier, saved = threading.Barrier(2), {}

        def save(name, session):
            barrier.wait()
            try:
                session.run_command(parse_command(f"/save {path}"))
                saved[name] = True
            except CommandError as e:
                assert "not replaced" in str(e) and "/save!" in str(e), str(e)
                saved[name] = False
        threads = [threading.Thread(target=save, args=x) for x in (("A", a), ("B", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(saved.values()) == [False, True], saved
        turns = len(json.loads(path.read_text())["turns"])
        assert turns == (1 if saved["A"] else 2)


def test_load_names_each_setting_it_does_not_know(llm, tmp_path):
    """ollama's spellings (temperature, num_predict) or a later bitchat's new setting in a file were dropped without
    a word: one line each, as a bad value gets."""
    path = tmp_path / "alias.json"
    path.write_text(json.dumps({"turns": [{"user": "a", "assistant": "b"}],
                                "meta": {"settings": {"temperature": 0.1, "num_predict": 5, "future_knob": 1,
                                                      "temp": 0.5}}}))
    s, sink = new_session(llm)
    s.run_command(parse_command(f"/load {path}"))
    out = sink.getvalue()
    for name in ("temperature", "num_predict", "future_knob"):
        lines = [line for line in out.splitlines() if f"setting {name} not restored" in line]
        assert len(lines) == 1, out
    assert "bitchat's files name it temp" in out and s.settings.temp == 0.5


def test_load_shows_an_unknown_setting_name_without_its_control_characters(llm, tmp_path):
    """A setting name in a file is text from whoever wrote the file: one holding an ESC sequence (a title change, a
    screen clear) went to the terminal as it was. It is shown quoted, each control character escaped."""
    name = "\u001b]0;owned\u0007\u001b[2J\u001b[31mx"
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps({"turns": [{"user": "a", "assistant": "b"}], "meta": {"settings": {name: 1}}}))
    s, sink = new_session(llm)
    s.run_command(parse_command(f"/load {path}"))
    out = sink.getvalue()
    lines = [line for line in out.splitlines() if "not restored" in line]
    assert len(lines) == 1 and "unknown to this bitchat" in lines[0], out
    assert not any(ord(c) < 32 or ord(c) == 127 for c in out.replace("\n", "")), repr(out)
    assert "owned" in lines[0] and "\\x1b" in lines[0], lines
