"""One source for each setting: the sampling defaults and checks are SamplingParams' (engine/runtime/sampling.py),
and `bitnet run`, `bitchat` and `bitnet serve` take the model / context / thread flags from one helper
(cli/flags.py): same spellings, same minimums, same help, same words for a bad value. In process, no model."""
import re
from dataclasses import fields

import pytest

from bitnet_cpu.chat.commands import FIELD_OF_SETTING, CommandError, Settings, parse_setting
from bitnet_cpu.cli import build_parser
from bitnet_cpu.cli.chat import build_parser as bitchat_parser
from bitnet_cpu.cli.flags import check_engine_args
from bitnet_cpu.engine.errors import BitNetError
from bitnet_cpu.engine.runtime.sampling import SamplingParams, setting_problem


def _parsers():
    subs = {}
    build_parser(subs)
    return {"bitnet run": subs["run"], "bitchat": bitchat_parser(), "bitnet serve": subs["serve"]}


PARSERS = _parsers()
ALL = list(PARSERS)
SAMPLING = ["bitnet run", "bitchat"]   # the server takes sampling per request


def _action(parser, flag):
    return next(a for a in parser._actions if flag in a.option_strings)


@pytest.mark.parametrize("prog", ALL)
@pytest.mark.parametrize("argv,dest,value", [
    (["-c", "64"], "ctx", 64), (["--ctx-size", "64"], "ctx", 64), (["--ctx", "64"], "ctx", 64),
    (["-t", "2"], "threads", 2), (["--threads", "2"], "threads", 2),
    (["-m", "x.gguf"], "model", "x.gguf"), (["--model", "x.gguf"], "model", "x.gguf"),
    ([], "ctx", None), ([], "threads", None), ([], "model", None),
])
def test_the_same_flag_gives_the_same_value(prog, argv, dest, value):
    assert getattr(PARSERS[prog].parse_args(argv), dest) == value


@pytest.mark.parametrize("argv,message", [
    (["-c", "-1"], "-c/--ctx -1: must be >= 0 (0: the model's trained context, as llama.cpp)"),
    (["--ctx-size", "-5"], "-c/--ctx -5: must be >= 0 (0: the model's trained context, as llama.cpp)"),
])
def test_the_same_bad_flag_gives_the_same_error(argv, message):
    got = {prog: check_engine_args(PARSERS[prog].parse_args(argv)) for prog in ALL}
    assert set(got.values()) == {message}, got


@pytest.mark.parametrize("prog", ALL)
def test_llama_cpp_s_automatic_values(prog):
    """llama.cpp's readings: -t 0 or -1 is the default thread count; a negative --temp is 0 (greedy), as its
    max(temp, 0)."""
    for n in ("0", "-1"):
        args = PARSERS[prog].parse_args(["-t", n])
        assert check_engine_args(args) is None and args.threads is None
    if prog in SAMPLING:
        args = PARSERS[prog].parse_args(["--temp", "-1"])
        assert check_engine_args(args) is None and args.temperature == 0.0


def test_a_negative_top_k_is_off_on_the_command_line_and_in_ollama_options():
    """llama.cpp's flags and ollama's Go sampler read top_k <= 0 as off: --top-k -1 and options.top_k -1 were refused
    (exit 2, 400)."""
    from bitnet_cpu.serve.ollama import sampling_from_options

    for prog in SAMPLING:
        for k in ("-1", "-5"):
            args = PARSERS[prog].parse_args(["--top-k", k])
            assert check_engine_args(args) is None and args.top_k == 0, (prog, k)
    for k in (-1, -5, -1.0):
        assert sampling_from_options({"top_k": k}, None).top_k == 0


def test_the_smallest_context_is_accepted_everywhere():
    assert all(check_engine_args(PARSERS[prog].parse_args(["-c", "1", "-t", "1"])) is None for prog in ALL)


@pytest.mark.parametrize("flag", ["-m", "-c", "-t"])
def test_the_same_help_text(flag):
    helps = {_action(PARSERS[prog], flag).help for prog in ALL}
    specs = {tuple(_action(PARSERS[prog], flag).option_strings) for prog in ALL}
    assert len(helps) == 1 and len(specs) == 1, (helps, specs)


@pytest.mark.parametrize("flag", ["--temp", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--repeat-last-n",
                                  "--seed", "-n", "--draft-max", "--lookup-ngram-min"])
def test_run_and_bitchat_share_the_rest(flag):
    assert len({_action(PARSERS[prog], flag).help for prog in SAMPLING}) == 1


def test_every_default_is_sampling_params():
    from bitnet_cpu.engine.runtime.sampling import REQUEST_ONLY_FIELDS

    d = SamplingParams()
    knobs = {k: v for k, v in vars(d).items() if k not in REQUEST_ONLY_FIELDS}
    for prog in SAMPLING:
        args = PARSERS[prog].parse_args([])
        assert {f.name: getattr(args, f.name) for f in fields(d) if f.name not in REQUEST_ONLY_FIELDS} == knobs, prog
    s = Settings()
    assert {field: getattr(s, name) for name, field in FIELD_OF_SETTING.items()} == knobs
    assert s.sampling_params() == d
    from bitnet_cpu.serve.schemas import ChatCompletionRequest

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert req.sampling_params() == d


# (field, flag, /set name, request field, bad value as typed)
# (a negative --temp or --top-k is not here: the command lines read it as llama.cpp, 0; /set and requests refuse it)
BAD = [("top_p", "--top-p", "top_p", "top_p", "1.5"), ("top_p", "--top-p", "top_p", "top_p", "-0.5"),
       ("min_p", "--min-p", "min_p", "min_p", "2"), ("repeat_penalty", "--repeat-penalty", "repeat_penalty",
                                                      "repeat_penalty", "0"),
       ("repeat_last_n", "--repeat-last-n", "repeat_last_n", "repeat_last_n", "-2"),
       ("seed", "--seed", "seed", "seed", "18446744073709551616"),   # (a negative request seed is int64: a seed)
       ("presence_penalty", "--presence-penalty", "presence_penalty", "presence_penalty", "3"),
       ("frequency_penalty", "--frequency-penalty", "frequency_penalty", "frequency_penalty", "-2.5")]


@pytest.mark.parametrize("field,flag,set_name,param,text", BAD)
def test_a_bad_sampling_value_gets_the_same_words_everywhere(field, flag, set_name, param, text):
    from pydantic import ValidationError

    from bitnet_cpu.serve.schemas import ChatCompletionRequest

    said = {}
    for prog in SAMPLING:
        said[prog] = check_engine_args(PARSERS[prog].parse_args([flag, text]))
    with pytest.raises(CommandError) as e:
        parse_setting(set_name, text)
    said["/set"] = str(e.value)
    kind = int if field in ("top_k", "repeat_last_n", "seed") else float
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **{param: kind(text)})
    said["server"] = e.value.errors()[0]["msg"]
    with pytest.raises(BitNetError) as e:
        SamplingParams(**{field: kind(text)}).check()
    said["engine"] = str(e.value)
    rule = setting_problem(field, kind(text)).split(": ", 1)[1]
    if field == "seed":   # a request's seed also takes OpenAI's negative int64 ones: the APIs' own range
        from bitnet_cpu.serve.schemas import SEED_RULE

        assert said.pop("server") == f"{param} {text}: {SEED_RULE}"
    names = {"bitnet run": flag, "bitchat": flag, "/set": f"/set {set_name}", "server": param, "engine": field}
    for where, message in said.items():
        assert message is not None and message.startswith(names[where] + " ") and message.endswith(": " + rule), \
            (where, message)


def test_valid_values_pass_everywhere():
    for field, value in vars(SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)).items():
        assert setting_problem(field, value) is None
    assert setting_problem("seed", None) is None
    # -1 is llama.cpp's "random seed" on the command line, in /set and in a request
    assert check_engine_args(PARSERS["bitchat"].parse_args(["--seed", "-1"])) is None
    assert parse_setting("seed", "-1") == ("seed", None)
    from bitnet_cpu.serve.schemas import ChatCompletionRequest

    assert ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], seed=-1).seed is None
    # OpenAI's seed is a signed int64: any other negative one is a seed (its unsigned 64-bit twin, as ollama's)
    for seed in (-5, -(1 << 63)):
        assert ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], seed=seed).seed == seed % (1 << 64)


def test_the_server_keeps_openai_temperature_range():
    from pydantic import ValidationError

    from bitnet_cpu.serve.schemas import ChatCompletionRequest

    assert setting_problem("temperature", 5.0) is None       # the engine takes it
    with pytest.raises(ValidationError, match="temperature 5: must be <= 2"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=5)


def test_no_sampling_number_takes_infinity_or_nan():
    """JSON's Infinity (what Python's json writes for inf) reached the sampler at temperature inf and then broke
    the answer's generation_settings (not JSON); every float setting must be finite, on every front end."""
    from pydantic import ValidationError

    from bitnet_cpu.serve.llama_api import NativeCompletionRequest
    from bitnet_cpu.serve.ollama import OllamaError, sampling_from_options

    floats = [f.name for f in fields(SamplingParams) if f.type in ("float", float)]
    assert "temperature" in floats and "dynatemp_range" in floats
    for field in floats:
        for bad in (float("inf"), float("-inf"), float("nan")):
            assert setting_problem(field, bad) is not None, (field, bad)
            if bad == float("-inf"):   # /completion reads a negative temperature as 0, a dry_base < 1 as 1.75
                continue
            with pytest.raises(ValidationError, match=field):
                NativeCompletionRequest(prompt="hi", **{field: bad})
            with pytest.raises(OllamaError, match=f"options.{field}"):
                sampling_from_options({field: bad}, None)
    for prog in SAMPLING:
        assert check_engine_args(PARSERS[prog].parse_args(["--temp", "inf"])) == \
            "--temp inf: must be >= 0 and finite (0 = greedy)"


def test_the_seed_message_says_what_each_front_end_takes():
    """It said "-1 or 'random' in flags and requests"; 'random' is /set's alone (a flag or a request refuses it)."""
    from pydantic import ValidationError

    from bitnet_cpu.serve.schemas import ChatCompletionRequest

    msg = setting_problem("seed", 1 << 64)
    assert "-1 in flags, requests and /set" in msg and "'random' in /set" in msg, msg
    assert check_engine_args(PARSERS["bitnet run"].parse_args(["--seed", "-1"])) is None
    assert parse_setting("seed", "random") == parse_setting("seed", "-1") == ("seed", None)
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], seed=-1).seed is None
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], seed="random")
    with pytest.raises(SystemExit):
        PARSERS["bitnet run"].parse_args(["--seed", "random"])


def test_an_out_of_range_value_is_echoed_as_sent_not_rounded():
    """A value just past a bound (2.0000001, float arithmetic's kind) was echoed rounded to six digits: "temperature
    2: must be <= 2" named a value in range. Every digit is kept; a whole number stays as a client writes it."""
    from pydantic import ValidationError

    from bitnet_cpu.serve.llama_api import NativeCompletionRequest
    from bitnet_cpu.serve.ollama import OllamaError, parse_keep_alive, sampling_from_options
    from bitnet_cpu.serve.schemas import ChatCompletionRequest, CompletionRequest

    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValidationError, match=r"temperature 2\.0000001: must be <= 2 \(this API's range\)"):
        ChatCompletionRequest(messages=hi, temperature=2.0000001)
    for field, bad in (("top_p", 1.0000001), ("min_p", 1.0000001), ("presence_penalty", -2.0000001),
                       ("frequency_penalty", 2.000000000000001), ("typical_p", 1.0000000000000002)):
        assert setting_problem(field, bad).startswith(f"{field} {bad!r}: "), field
        with pytest.raises(ValidationError, match=f"{field} {bad!r}: "):
            CompletionRequest(prompt="a", **{field: bad})
        with pytest.raises(ValidationError, match=f"{field} {bad!r}: "):
            NativeCompletionRequest(prompt="a", **{field: bad})
        with pytest.raises(OllamaError, match=f"options.{field} {bad!r}: "):
            sampling_from_options({field: bad}, None)
    assert check_engine_args(PARSERS["bitnet run"].parse_args(["--top-p", "1.0000001"])).startswith(
        "--top-p 1.0000001: ")
    assert setting_problem("xtc_threshold", 123456789.0).startswith("xtc_threshold 123456789: ")
    assert setting_problem("min_p", 1e-7 + 1).startswith("min_p 1.0000001: ")
    with pytest.raises(ValueError, match=r"keep_alive: 9223372036\.855 s is over"):
        parse_keep_alive(9223372036.855)


def test_a_request_seed_has_one_range_on_every_api_and_its_message_says_it():
    """OpenAI's, llama-server's and ollama's seeds: an integer in -2^63 .. 2^64-1 (OpenAI's signed int64 or an
    unsigned 64-bit one), -1 a fresh random seed, another negative one its unsigned twin. ollama's options took any
    negative (-2^70 too) where the others refused it, and their message said a seed "must be >= 0"."""
    from pydantic import ValidationError

    from bitnet_cpu.serve.llama_api import NativeCompletionRequest
    from bitnet_cpu.serve.ollama import OllamaError, sampling_from_options
    from bitnet_cpu.serve.schemas import ChatCompletionRequest, CompletionRequest

    hi = [{"role": "user", "content": "hi"}]
    apis = {"chat": lambda s: ChatCompletionRequest(messages=hi, seed=s).seed,
            "completions": lambda s: CompletionRequest(prompt="a", seed=s).seed,
            "/completion": lambda s: NativeCompletionRequest(prompt="a", seed=s).seed,
            "ollama": lambda s: sampling_from_options({"seed": s}, None).seed}
    for name, seed_of in apis.items():
        assert seed_of(-1) is None, name
        for sent, taken in ((-5, (1 << 64) - 5), (-(1 << 63), 1 << 63), (0, 0), ((1 << 64) - 1, (1 << 64) - 1)):
            assert seed_of(sent) == taken, (name, sent)
        for bad in (-(1 << 63) - 1, -(1 << 70), 1 << 64):
            with pytest.raises((ValidationError, OllamaError)) as e:
                seed_of(bad)
            msg = str(e.value)
            assert f"seed {bad}: must be an integer in -2^63 .. 2^64-1" in msg, (name, msg)
            assert "-1: a fresh random seed" in msg and ">= 0" not in msg, (name, msg)


def test_a_dry_base_below_1_is_refused_on_the_openai_endpoints_as_on_ollama():
    """The OpenAI endpoints replaced a dry_base below 1 with 1.75 in silence while ollama's options refused it;
    only llama-server's own /completion keeps its leniency (documented there)."""
    from pydantic import ValidationError

    from bitnet_cpu.serve.llama_api import NativeCompletionRequest
    from bitnet_cpu.serve.ollama import OllamaError, sampling_from_options
    from bitnet_cpu.serve.schemas import ChatCompletionRequest, CompletionRequest

    hi = [{"role": "user", "content": "hi"}]
    for bad, shown in ((0.5, "0.5"), (-1, "-1"), (0, "0")):
        for make in (lambda: ChatCompletionRequest(messages=hi, dry_multiplier=0.8, dry_base=bad),
                     lambda: CompletionRequest(prompt="a", dry_multiplier=0.8, dry_base=bad)):
            with pytest.raises(ValidationError, match=f"dry_base {shown}: must be >= 1 and finite"):
                make()
        with pytest.raises(OllamaError, match=f"options.dry_base {shown}: must be >= 1 and finite"):
            sampling_from_options({"dry_multiplier": 0.8, "dry_base": bad}, None)
        assert NativeCompletionRequest(prompt="a", dry_base=bad).sampling_params().dry_base == 1.75   # llama-server's
    assert CompletionRequest(prompt="a", dry_base=1).sampling_params().dry_base == 1.0


def test_tfs_z_other_than_off_is_refused_on_every_api():
    """Tail-free sampling is gone from llama.cpp and the engine has none: a tfs_z that would change sampling was a
    400 in ollama's options but taken and ignored on /completion and the OpenAI endpoints. 1 (off) is taken."""
    from bitnet_cpu.serve.llama_api import NativeCompletionRequest
    from bitnet_cpu.serve.ollama import OllamaError, sampling_from_options
    from bitnet_cpu.serve.schemas import ChatCompletionRequest, CompletionRequest

    hi = [{"role": "user", "content": "hi"}]
    why = "not supported (only 1.0, off: llama.cpp removed tail-free sampling)"
    for make in (lambda **kw: ChatCompletionRequest(messages=hi, **kw),
                 lambda **kw: CompletionRequest(prompt="a", **kw),
                 lambda **kw: NativeCompletionRequest(prompt="a", **kw)):
        assert make(tfs_z=0.5).unsupported() == ("tfs_z", f"tfs_z 0.5: {why}")
        assert make(tfs_z="0.5").unsupported() == ("tfs_z", f'tfs_z "0.5": {why}')
        for off in (1, 1.0, None):
            assert make(tfs_z=off).unsupported() is None
    with pytest.raises(OllamaError, match=f"^options.tfs_z 0.5: {re.escape(why)}$"):
        sampling_from_options({"tfs_z": 0.5}, None)
    with pytest.raises(OllamaError, match=f'^options.tfs_z "0.5": {re.escape(why)}$'):
        sampling_from_options({"tfs_z": "0.5"}, None)
    assert sampling_from_options({"tfs_z": 1}, None) == sampling_from_options({}, None)
