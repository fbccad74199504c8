"""Hostile files and flags, each reproduced with a small generated model: one clear line and the
documented exit code (docs/usage.md "Errors": 0 ok, 2 bad input, 70 engine bug), never a traceback, a signal, a hang
or a misleading message; --seed -1 is a random seed; -c / -t beyond the model or the machine are handled."""
import json
import os
import re
import resource
import shutil
import struct
import subprocess
import sys
import time

import pytest

from bitnet_cpu.engine.runtime.chat_template import TemplateError, render
from bitnet_cpu.engine.formats.convert import convert
from bitnet_cpu.engine.errors import BitNetError
from bitnet_cpu.engine.synth import SynthModel, small_config, write_gguf_i2s, write_hf_dir
from bitnet_cpu.engine.runtime.template_sandbox import Limits, TemplateLimitError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    m = SynthModel(small_config(num_hidden_layers=1, vocab_size=300, max_position_embeddings=128), seed=4)
    hf = write_hf_dir(m, str(d / "hf"))
    return {"dir": d, "m": m, "hf": hf, "store": convert(hf, str(d / "m.bnstore"), progress=False)}


def bitnet(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "bitnet_cpu", *args], cwd=ROOT, env=env or ENV, capture_output=True,
                          text=True, timeout=timeout)


def _children_cpu_s() -> float:
    """CPU seconds used so far by this process's finished children."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def one_error_line(r, code=2) -> str:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "warning:" not in ln]
    assert len(lines) == 1, r.stderr
    return lines[0]


def hf_copy(model, tmp_path, name="hf"):
    d = str(tmp_path / name)
    shutil.copytree(model["hf"], d)
    return d


# ---- flags -------------------------------------------------------------------------------------------
def test_seed_minus_one_is_random_and_printed(model):
    seeds = []
    for _ in range(2):
        r = bitnet("run", "-m", model["store"], "-p", "Hi", "-n", "3", "--seed", "-1", "-v")
        assert r.returncode == 0, r.stderr
        seeds.append(int(re.search(r"seed (\d+)", r.stderr).group(1)))
    assert seeds[0] != seeds[1]   # 2^-32 chance of a false failure
    fixed = bitnet("run", "-m", model["store"], "-p", "Hi", "-n", "3", "--seed", str(seeds[0]), "-v")
    assert f"seed {seeds[0]}" in fixed.stderr
    assert "--seed -2" in one_error_line(bitnet("run", "-m", model["store"], "-p", "Hi", "--seed", "-2"))


def test_ctx_above_training_warns_and_impossible_ctx_is_refused(model):
    r = bitnet("run", "-m", model["store"], "-p", "Hi", "-n", "2", "-c", "1000")
    assert r.returncode == 0, r.stderr
    assert "warning: -c/--ctx 1000 is larger than the 128 tokens the model was trained on" in r.stderr
    line = one_error_line(bitnet("run", "-m", model["store"], "-p", "Hi", "-c", "2000000000"))
    assert "-c/--ctx 2000000000" in line and "would need" in line and "GiB" in line and "MemoryError" not in line


def test_threads_beyond_the_cores_are_capped(model):
    r = bitnet("run", "-m", model["store"], "-p", "Hi", "-n", "2", "-t", "999")
    assert r.returncode == 0, r.stderr
    cores = len(os.sched_getaffinity(0))
    assert f"warning: -t/--threads 999 is more than the {cores} CPU cores available; using {cores}" in r.stderr


def test_context_hint_only_when_ctx_can_grow(model):
    long_prompt = "hello " * 400
    full = one_error_line(bitnet("run", "-m", model["store"], "-p", long_prompt))   # default: the model's 128
    assert "raise -c" not in full and "already the model's full 128 tokens" in full
    small = one_error_line(bitnet("run", "-m", model["store"], "-p", long_prompt, "-c", "64"))
    assert "raise -c/--ctx" in small
    past = one_error_line(bitnet("run", "-m", model["store"], "-p", long_prompt * 2, "-c", "256"))   # past 128
    assert "raise -c" not in past and "the context (256) is already past the 128 tokens" in past


# ---- files -------------------------------------------------------------------------------------------
def test_empty_file_is_called_empty(tmp_path):
    for name in ("model.gguf", "model.bnstore"):
        p = tmp_path / name
        p.write_bytes(b"")
        assert "the file is empty (0 bytes)" in one_error_line(bitnet("run", "-m", str(p), "-p", "Hi"))


def test_corrupt_gguf_is_not_called_truncated(model, tmp_path):
    path = write_gguf_i2s(model["m"], str(tmp_path / "ok.gguf"))
    data = bytearray(open(path, "rb").read())
    bad = bytearray(data)
    struct.pack_into("<Q", bad, 24, (1 << 64) - 255)   # the first key's length: a wrapped-around negative
    (tmp_path / "corrupt.gguf").write_bytes(bytes(bad))
    line = one_error_line(bitnet("convert", str(tmp_path / "corrupt.gguf")))
    assert "corrupt GGUF" in line and "truncated" not in line and "18446744073709551361" in line
    (tmp_path / "short.gguf").write_bytes(bytes(data[:200]))   # cut inside the metadata: really truncated
    assert "truncated" in one_error_line(bitnet("convert", str(tmp_path / "short.gguf")))


def test_zero_heads_names_the_field(model, tmp_path):
    d = hf_copy(model, tmp_path)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["num_attention_heads"] = 0
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    line = one_error_line(bitnet("convert", d))
    assert "num_attention_heads must be a positive integer" in line and "ZeroDivision" not in line


@pytest.mark.parametrize("tokenizer, expect", [
    ({"model": 5}, '"model" must be an object'),
    ([], "the top level must be an object"),
    ({"model": {"type": "BPE", "vocab": {}, "merges": []}}, "empty vocabulary"),
    ({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "added_tokens": [{"id": "x"}]}, "added token"),
    ({"model": {"type": "Unigram", "vocab": [["a", 1.0]]}}, "cannot encode"),
])
def test_bad_tokenizer_json_names_the_users_file(model, tmp_path, tokenizer, expect):
    """Checked at conversion, so the error names the user's tokenizer.json, not the cached store."""
    d = hf_copy(model, tmp_path)
    json.dump(tokenizer, open(os.path.join(d, "tokenizer.json"), "w"))
    cache = str(tmp_path / "cache")
    line = one_error_line(bitnet("run", "-m", d, "-p", "Hi", env=dict(ENV, BITNET_CACHE=cache)))
    assert expect in line and os.path.join(d, "tokenizer.json") in line and cache not in line
    assert not os.path.isdir(cache) or not os.listdir(cache)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json",
                                  "generation_config.json", "model.safetensors.index.json"])
def test_json_nested_too_deeply_is_one_line(model, tmp_path, name):
    """A JSON file of a model directory nested thousands of levels deep (json nests by recursion: Python's
    stack runs out) is bad input naming the file, not "internal error ... please report it" (exit 70)."""
    d = hf_copy(model, tmp_path)
    open(os.path.join(d, name), "w").write("[" * 50000 + "]" * 50000)
    r = bitnet("inspect", d)
    assert r.returncode == 2, r.stderr
    line = one_error_line(r)
    assert "nested too deeply" in line and name in line


SHARD1 = "model-00001-of-00002.safetensors"


@pytest.mark.parametrize("index, expect", [
    ([1, 2], "shard index is not a JSON object"),
    ({"metadata": {}}, 'shard index has no "weight_map" object'),
    ({"weight_map": [SHARD1]}, 'shard index has no "weight_map" object'),
    ({"weight_map": {"a": SHARD1, "b": 5}}, "the shard name of tensor 'b' is not a string (5)"),
    ({"weight_map": {"a": None, "b": SHARD1}}, "the shard name of tensor 'a' is not a string (None)"),
    ({"weight_map": {}}, "shard index lists no shards"),
    ({"weight_map": {"a": "./" + SHARD1}}, "must be a plain file name in the model folder"),
    ({"weight_map": {"a": "x\0y.safetensors"}}, "'x\\x00y.safetensors'"),
])
def test_a_broken_shard_index_says_what_is_wrong(model, tmp_path, index, expect):
    """An index that is not {"weight_map": {tensor: file}} is named in words (it showed Python's own: "list
    indices must be integers", "corrupt shard index: 'weight_map'", a str/int sort failure) and an empty map is
    not "no *.safetensors files" (they are there)."""
    d = write_hf_dir(model["m"], str(tmp_path / "sharded"), shards=2)
    assert os.path.isfile(os.path.join(d, SHARD1))
    json.dump(index, open(os.path.join(d, "model.safetensors.index.json"), "w"))
    line = one_error_line(bitnet("inspect", d))
    assert expect in line and "model.safetensors.index.json" in line and "\0" not in line, line


def test_an_oversized_shard_index_is_refused_before_it_is_read(model, tmp_path):
    from bitnet_cpu.engine.formats.safetensors_io import MAX_INDEX

    d = write_hf_dir(model["m"], str(tmp_path / "sharded"), shards=2)
    with open(os.path.join(d, "model.safetensors.index.json"), "r+b") as f:
        f.truncate(MAX_INDEX + 1)   # sparse: what is read of it would be NULs, not JSON
    assert f"shard index is {MAX_INDEX + 1} bytes" in one_error_line(bitnet("inspect", d))


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_shard_that_is_not_a_file_is_not_called_missing(model, tmp_path, kind):
    d = write_hf_dir(model["m"], str(tmp_path / "sharded"), shards=2)
    shard = os.path.join(d, SHARD1)
    os.remove(shard)
    os.mkdir(shard) if kind == "folder" else os.mkfifo(shard)
    line = one_error_line(bitnet("inspect", d))
    assert SHARD1 in line and "not a regular file" in line and "missing" not in line, line


def _gguf_tensor_offset_field(data: bytes, name: str) -> int:
    """Where a GGUF tensor info's offset (u64) lies: after its name, dimension count, dimensions and type."""
    key = name.encode()
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    (n_dims,) = struct.unpack_from("<I", data, at)
    return at + 4 + 8 * n_dims + 4


def test_tensors_that_share_bytes_are_refused(model, tmp_path):
    """Two tensors pointing at the same bytes (GGUF or safetensors): a corrupt or hostile file, refused as
    llama.cpp refuses it. It used to load: 2,000 layers pointing at one layer's bytes made a 1.6 MB file a
    326 MB store."""
    path = write_gguf_i2s(model["m"], str(tmp_path / "ok.gguf"))
    data = bytearray(open(path, "rb").read())
    q = struct.unpack_from("<Q", data, _gguf_tensor_offset_field(data, "blk.0.attn_q.weight"))[0]
    struct.pack_into("<Q", data, _gguf_tensor_offset_field(data, "blk.0.attn_k.weight"), q)
    (tmp_path / "overlap.gguf").write_bytes(bytes(data))
    line = one_error_line(bitnet("inspect", str(tmp_path / "overlap.gguf")))
    assert "share bytes" in line and "attn_k" in line and "attn_q" in line
    d = hf_copy(model, tmp_path)
    st = os.path.join(d, "model.safetensors")
    raw = open(st, "rb").read()
    (hlen,) = struct.unpack_from("<Q", raw, 0)
    header = json.loads(raw[8:8 + hlen])
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]
    new = json.dumps(header, separators=(",", ":")).encode().ljust(hlen)
    assert len(new) == hlen
    open(st, "wb").write(raw[:8] + new + raw[8 + hlen:])
    line = one_error_line(bitnet("inspect", d))
    assert "share bytes" in line and "layernorm" in line


@pytest.mark.parametrize("old,new,words", [
    # a gpt2 tokenizer without merges made every word bytes (other ids, silently); llama.cpp refuses it
    (b"tokenizer.ggml.merges", b"tokenizer.ggml.mergez", "tokenizer.ggml.merges is missing"),
    # one layer's sub-norm missing turned them off for the whole model, the others' ignored
    (b"blk.0.attn_sub_norm.weight", b"blk.0.attn_sub_norx.weight", "'blk.0.attn_sub_norm.weight' is missing"),
])
def test_a_gguf_missing_a_part_is_refused(model, tmp_path, old, new, words):
    data = open(write_gguf_i2s(model["m"], str(tmp_path / "ok.gguf")), "rb").read()
    assert data.count(old) == 1
    (tmp_path / "bad.gguf").write_bytes(data.replace(old, new))
    assert words in one_error_line(bitnet("run", "-m", str(tmp_path / "bad.gguf"), "-p", "Hi", "-n", "2"))


def test_swapped_split_gguf_parts_are_called_swapped(model, tmp_path):
    """The file named as part 1 holding part 2 (parts swapped or misnamed): said so, not "give the first part"
    with a hint naming the very file given (a circle); a later part given still gets that hint."""
    from bitnet_cpu.engine.synth import write_gguf_tq

    write_gguf_tq(model["m"], str(tmp_path / "s.gguf"), "TQ2_0", split_max_tensors=4)
    parts = sorted(p for p in tmp_path.iterdir() if p.name.startswith("s-"))
    assert len(parts) >= 3, parts
    line = one_error_line(bitnet("inspect", str(parts[1])))   # the hint names the file, no flag (-m is run's)
    assert "give the first part" in line and f"give {parts[0]} instead" in line and "-m " not in line, line
    tmp = tmp_path / "t"
    os.rename(parts[0], tmp)
    os.rename(parts[1], parts[0])
    os.rename(tmp, parts[1])
    line = one_error_line(bitnet("inspect", str(parts[0])))
    assert "swapped" in line and "holds part 2" in line and f"give {parts[0]}" not in line, line


def test_a_metadata_key_given_twice_is_refused(model, tmp_path):
    """Two values for one key (llama.cpp refuses the file): which one counts would be a guess; the last one
    used to win, and an error then named something else."""
    data = open(write_gguf_i2s(model["m"], str(tmp_path / "ok.gguf")), "rb").read()
    bos, eos = b"tokenizer.ggml.bos_token_id", b"tokenizer.ggml.eos_token_id"
    assert data.count(bos) == data.count(eos) == 1
    (tmp_path / "dup.gguf").write_bytes(data.replace(bos, eos))
    assert "'tokenizer.ggml.eos_token_id' appears twice" in one_error_line(bitnet("inspect", str(tmp_path / "dup.gguf")))


def test_hostile_chat_template_is_one_line(model, tmp_path):
    d = hf_copy(model, tmp_path)
    p = os.path.join(d, "tokenizer_config.json")
    tc = json.load(open(p))
    tc["chat_template"] = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    json.dump(tc, open(p, "w"))
    store = convert(d, str(tmp_path / "t.bnstore"), progress=False)
    cpu0 = _children_cpu_s()
    line = one_error_line(bitnet("run", "-m", store, "--chat", "-p", "Hi"))
    # the iteration budget (200,000) stops it; on a loaded machine the render's 2 s wall deadline can come first:
    # either is the right one-line refusal. CPU seconds, not wall: what the process spent, whatever the load.
    assert "chat template" in line and ("iterations" in line or "rendering took more than" in line), line
    assert _children_cpu_s() - cpu0 < 30


# ---- bugs vs bad input -------------------------------------------------------------------------------
def test_kernel_error_is_reported_as_a_bug():
    """An engine bug (KernelError) exits 70 and asks for a report instead of blaming the input."""
    code = ("import sys; from bitnet_cpu import cli; from bitnet_cpu.engine.errors import KernelError; "
            "import bitnet_cpu.cli.info as info; "
            "info.main = lambda a: (_ for _ in ()).throw(KernelError('gemv_ternary: out has 3 rows, expected 4')); "
            "sys.exit(cli.main(['info']))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    line = one_error_line(r, code=70)
    assert line.startswith("bitnet: internal error: gemv_ternary") and "bug" in line and "report" in line


def test_bad_isa_choice_is_bad_input(model):
    line = one_error_line(bitnet("run", "-m", model["store"], "-p", "Hi", env=dict(ENV, BITNET_ISA="bogus")))
    assert "BITNET_ISA=bogus" in line and "internal error" not in line


# ---- the template sandbox ------------------------------------------------------------------------------
MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize("template", [
    "{% for i in range(10**9) %}x{% endfor %}",
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "{% set a = range(90000)|list %}{% for i in a %}{% for j in a %}{% endfor %}{% endfor %}",
    "{{ 'x' * 10000000000 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
    "{{ '%3000000000s'|format('x') }}", "{{ '%3000000000s' % 'x' }}", "{{ '{:>3000000000}'.format(1) }}",
    "{{ 'y'|center(5000000000) }}", "{{ messages|tojson(indent=3000000000) }}", "{{ range(5)|slice(3000000000) }}",
    "{{ ('x' * 100000)|replace('', 'y' * 100000) }}", "{{ ('y' * 100000).join(['a'] * 100000) }}",
    "{% for i in range(100000) %}{{ 'abcdefghijklmnopqrstuvwxyz' }}{% endfor %}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
])
def test_template_limits(template):
    t0 = time.process_time()   # CPU seconds: a busy machine stretches the wall time, not the work
    with pytest.raises(TemplateError if "macro" in template else TemplateLimitError) as e:
        render(template, MSGS)
    assert "\n" not in str(e.value) and time.process_time() - t0 < 10
    assert isinstance(e.value, BitNetError) and e.value.exit_code == 2


def test_template_deadline():
    slow = "{% for i in range(100000) %}{{ messages|length }}{% endfor %}{% for i in range(100000) %}{% endfor %}"
    with pytest.raises(TemplateLimitError, match="took more than"):
        render(slow, MSGS, limits=Limits(seconds=0.01))


def test_real_templates_still_render():
    llama3 = ("{{ bos_token }}{% for m in messages %}{% set content = '<|start_header_id|>' + m['role'] + "
              "'<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' %}{{ content }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
    out = render(llama3, MSGS, bos_token="<s>")
    assert out.startswith("<s><|start_header_id|>user") and out.endswith("assistant<|end_header_id|>\n\n")
    assert render("{% for m in messages %}{{ loop.index }}/{{ loop.length }} {% endfor %}", MSGS) == "1/2 2/2 "
    assert render("{% for x in [[1, [2]], [3]] recursive %}{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}"
                  "{% endif %}{% endfor %}", MSGS) == "123"
    assert render("{{ messages | tojson }}", MSGS[:1]) == '[{"role": "user", "content": "hi"}]'
    assert render("{{ ', '.join(['a', 'b']) }}{{ 'a b' | replace(' ', '_') }}{{ '%s!' % 'x' }}", MSGS) == "a, ba_bx!"


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_split_gguf_part_that_is_not_a_file_is_not_called_missing(model, tmp_path, kind):
    from bitnet_cpu.engine.synth import write_gguf_tq

    first = write_gguf_tq(model["m"], str(tmp_path / "s.gguf"), "TQ2_0", split_max_tensors=4)
    part = sorted(p for p in tmp_path.iterdir() if p.name.startswith("s-"))[1]
    os.remove(part)
    os.mkdir(part) if kind == "folder" else os.mkfifo(part)
    line = one_error_line(bitnet("inspect", first))
    assert "part 2 of" in line and "not a regular file" in line and "missing" not in line, line


def test_a_stdout_that_cannot_encode_unicode_never_ends_a_command(tmp_path):
    """PYTHONIOENCODING=ascii (or an ASCII locale without UTF-8 mode): bench's table (its +-) and inspect of a
    unicode path ended as "internal error: UnicodeEncodeError", exit 70, after the work; only run and bitchat
    replaced what the terminal cannot show. Every command does now ('?')."""
    store = tmp_path / "modèle.bnstore"
    shutil.copy(os.path.join(ROOT, "models", "default.bnstore"), store)
    env = dict(ENV, PYTHONIOENCODING="ascii")
    for args in (("bench", "-m", str(store), "-p", "8", "-n", "4", "-r", "1", "-t", "1"), ("inspect", str(store))):
        r = bitnet(*args, env=env, timeout=300)
        assert r.returncode == 0 and "internal error" not in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert "?" in r.stdout, (args, r.stdout)   # the unencodable characters, replaced
