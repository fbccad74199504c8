"""engine.convert: every source form of the same synthetic weights gives the same store, the store holds
exactly the source's ternary weights and scales (seen through layout.unpack_*), and bad input fails with one
line naming the file."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from bitnet_cpu.simd import layout
from bitnet_cpu.engine.formats.convert import convert, resolve_model
from bitnet_cpu.engine.errors import BitNetError, FormatError, UnsupportedError
from bitnet_cpu.engine.formats.store import Store
from bitnet_cpu.engine.runtime.chat_template import choose_template
from bitnet_cpu.engine.synth import SynthModel, write_gguf_i2s, write_gguf_tq, write_hf_dir

SHORT = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
FUSED = {"attn_qkv": ("q_proj", "k_proj", "v_proj"), "attn_output": ("o_proj",),
         "ffn_gate_up": ("gate_proj", "up_proj"), "ffn_down": ("down_proj",)}


def _prefix(i, kind):
    return f"model.layers.{i}.{'self_attn' if kind in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{kind}"


@pytest.fixture(scope="module")
def model():
    return SynthModel(seed=33)


@pytest.fixture(scope="module")
def stores(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("conv")
    srcs = {
        "hf": write_hf_dir(model, str(d / "hf")),
        "hf_sharded": write_hf_dir(model, str(d / "hf3"), shards=3, embed_dtype="f32"),
        "tq2": write_gguf_tq(model, str(d / "tq2.gguf"), "TQ2_0"),
        "tq1": write_gguf_tq(model, str(d / "tq1.gguf"), "TQ1_0", embed_type="F32"),
        "tq2_scales": write_gguf_tq(model, str(d / "tq2s.gguf"), "TQ2_0", scale_tensors=True,
                                    hidden_activation=None),
        "i2s": write_gguf_i2s(model, str(d / "i2s.gguf")),
    }
    out = {k: Store(convert(p, str(d / f"{k}.bnstore"), progress=False)) for k, p in srcs.items()}
    out["_srcs"] = srcs
    return out


def _ternary(store, name):
    e = store.info(name)
    return layout.unpack_ternary(store.tensor(name), e["rows"], e["cols"])


def test_store_holds_source_ternary_and_scales(model, stores):
    s = stores["hf"]
    c = s.config
    assert (c.hidden_size, c.intermediate_size, c.n_layers, c.hidden_act) == (model.D, model.I, model.L, "relu2")
    for i in range(model.L):
        for fused, kinds in FUSED.items():
            prefixes = [_prefix(i, k) for k in kinds]
            want = np.concatenate([model.ternary(p) for p in prefixes])
            assert np.array_equal(_ternary(s, f"blk.{i}.{fused}"), want), fused
            scale = s.tensor(f"blk.{i}.{fused}.scale")
            want_s = np.concatenate([np.full(model.ternary(p).shape[0], model.weight_scale(p), np.float32)
                                     for p in prefixes])
            assert scale.dtype == np.float32 and scale.size == layout.pad_to(want.shape[0], 16)
            assert np.array_equal(scale[:want.shape[0]], want_s)
        for short, hf in model.norm_names(i).items():
            assert np.array_equal(s.tensor(f"blk.{i}.{short}"), model.norm(hf))
    assert np.array_equal(s.tensor("token_embd"), model.embed().astype(np.float16))
    assert s.tensor("token_embd").dtype == np.float16
    st = s.meta["ternary_stats"]["blk.0.attn_q"]
    w = model.ternary("model.layers.0.self_attn.q_proj")
    assert st["zero"] == pytest.approx((w == 0).mean()) and st["scale"] == [model.weight_scale(_prefix(0, "q_proj"))]


@pytest.mark.parametrize("kind", ["hf_sharded", "tq2", "tq1", "tq2_scales", "i2s"])
def test_all_sources_give_identical_stores(stores, kind):
    a, b = stores["hf"], stores[kind]
    assert set(a.tensor_names) == set(b.tensor_names)
    for n in a.tensor_names:
        if n == "tokenizer.blob":
            continue
        assert np.array_equal(a.tensor(n), b.tensor(n)), n
    for f in ("hidden_size", "intermediate_size", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size",
              "rope_theta", "rms_norm_eps", "hidden_act", "bos_token_id", "eos_token_ids", "tie_word_embeddings",
              "sub_norms"):
        assert getattr(a.config, f) == getattr(b.config, f), f
    # the template each renders: a GGUF's broken official one is replaced by the built-in (trimming) form, which the
    # HF source's untrimmed copy of it is read as
    assert choose_template(a.chat_template) == choose_template(b.chat_template)


@pytest.mark.parametrize("kind", ["tq1", "tq2"])
def test_store_equals_gguf_dequantizer(stores, kind):
    gguf = pytest.importorskip("gguf")
    s = stores[kind]
    r = gguf.GGUFReader(stores["_srcs"][kind])
    t = {x.name: x for x in r.tensors}
    w = _ternary(s, "blk.1.ffn_gate_up").astype(np.float32) * s.tensor("blk.1.ffn_gate_up.scale")[:, None][:2 * 512]
    for j, short in enumerate(("ffn_gate", "ffn_up")):
        x = t[f"blk.1.{short}.weight"]
        assert np.array_equal(w[j * 512:(j + 1) * 512], gguf.quants.dequantize(x.data, x.tensor_type))


def test_gguf_tokenizer_gives_same_ids(stores):
    from tokenizers import Tokenizer

    from bitnet_cpu.engine.synth import TRAIN_TEXT

    ref = Tokenizer.from_str(stores["hf"].tokenizer_spec[1].decode())
    for kind in ("tq2", "i2s"):
        kind_, blob = stores[kind].tokenizer_spec
        assert kind_ == "hf_json"
        tok = Tokenizer.from_str(blob.decode())
        for text in (TRAIN_TEXT, "<|begin_of_text|>User: hé 🙂<|eot_id|>Assistant: ", "  a\n\n\tb 1234567"):
            assert tok.encode(text).ids == ref.encode(text).ids


def test_broken_official_template_replaced(stores):
    s = stores["i2s"]
    assert "BITNETAssistant" not in s.chat_template and s.meta["chat_template_note"]
    from jinja2 import Template

    text = Template(s.chat_template).render(messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                            bos_token="<|begin_of_text|>")
    assert text == "<|begin_of_text|>User: Hi<|eot_id|>Assistant: "


def test_lm_head_i8_and_f16(model, stores, tmp_path):
    s = stores["hf"]   # the default head: q4, rescored from token_embd (tied)
    assert s.info("output")["layout"] == "q4g_tile16" and s.meta["lm_head"] == "q4"
    assert "output.rows" not in s.tensor_names
    s = Store(convert(stores["_srcs"]["hf"], str(tmp_path / "i8.bnstore"), lm_head="i8", progress=False))
    e = s.info("output")
    assert e["layout"] == "i8_tile16" and s.meta["lm_head"] == "i8"
    q = layout.unpack_i8(s.tensor("output"), e["rows"], e["cols"])
    scale, rowsum = s.tensor("output.scale"), s.tensor("output.rowsum")
    V = model.V
    wq, ws = layout.quantize_rows_i8(model.embed().astype(np.float16).astype(np.float32))
    assert np.array_equal(q, wq) and np.array_equal(scale[:V], ws)
    assert np.array_equal(rowsum[:V], wq.sum(axis=1, dtype=np.int32)) and rowsum.dtype == np.int32
    f = Store(convert(stores["_srcs"]["hf"], str(tmp_path / "f16.bnstore"), lm_head="f16", progress=False))
    e = f.info("output")
    assert e["layout"] == "f16_tile16"
    assert np.array_equal(layout.unpack_f16(f.tensor("output"), V, model.D), model.embed().astype(np.float16))


def _reference_online(w):
    """Independent numpy restatement of transformers' WeightQuant (f32): scale = 1/clamp(mean|W|, 1e-5)."""
    w = w.astype(np.float32)
    s = np.float32(1) / max(np.float32(np.mean(np.abs(w.astype(np.float64)))), np.float32(1e-5))
    return np.clip(np.round(w * s), -1, 1), np.float32(1) / s


def test_online_bf16_checkpoint_ternarized_like_reference(model, tmp_path):
    src = write_hf_dir(model, str(tmp_path / "bf16"), form="online")
    s = Store(convert(src, str(tmp_path / "o.bnstore"), progress=False))
    assert s.meta["source_format"] == "hf-online-autobitlinear"
    for i in range(model.L):
        for fused, kinds in FUSED.items():
            refs = [_reference_online(model.master(_prefix(i, k))) for k in kinds]
            assert np.array_equal(_ternary(s, f"blk.{i}.{fused}"), np.concatenate([r[0] for r in refs]))
            rows = np.concatenate([np.full(r[0].shape[0], r[1], np.float32) for r in refs])
            assert np.array_equal(s.tensor(f"blk.{i}.{fused}.scale")[:rows.size], rows)


def test_legacy_bitlinear_divides(model, tmp_path):
    src = write_hf_dir(model, str(tmp_path / "bl"), linear_class="bitlinear")
    s = Store(convert(src, str(tmp_path / "bl.bnstore"), progress=False))
    p = _prefix(0, "down_proj")
    stored = np.float32(1.0 / model.weight_scale(p))  # what the checkpoint holds (the divisor)
    assert s.tensor("blk.0.ffn_down.scale")[0] == np.float32(1) / stored
    assert s.tensor("blk.0.ffn_down.scale")[0] == pytest.approx(model.weight_scale(p), rel=1e-6)


def test_rope_theta_left_out_takes_transformers_default_for_the_family(model, tmp_path):
    """A config.json without rope_theta: BitNetConfig's default is 500000 (it was read as LlamaConfig's 10000, a
    different model), a Llama-style one's stays 10000."""
    import json

    from bitnet_cpu.engine.formats.sources import open_source

    src = write_hf_dir(model, str(tmp_path / "bitnet"))
    cfg_path = os.path.join(src, "config.json")
    cfg = json.load(open(cfg_path))
    assert cfg["model_type"] == "bitnet"
    for key in ("rope_theta", "rope_parameters", "rope_scaling"):
        cfg.pop(key, None)
    json.dump(cfg, open(cfg_path, "w"))
    assert open_source(src).config.rope_theta == 500000.0
    cfg["rope_theta"] = 12345.0
    json.dump(cfg, open(cfg_path, "w"))
    assert open_source(src).config.rope_theta == 12345.0


def test_tie_word_embeddings_is_read_as_transformers_reads_it(tmp_path):
    """config.json decides: tied, a saved lm_head.weight is not used (transformers ties it; the file's head was
    taken); untied (said, or left out: LlamaConfig's and BitNetConfig's default), lm_head.weight must be there
    (it was tied in silence; transformers would start that head from random weights)."""
    import json

    from bitnet_cpu.engine.formats.sources import open_source

    def edit(src, **changes):
        path = os.path.join(src, "config.json")
        cfg = json.load(open(path))
        for k, v in changes.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        json.dump(cfg, open(path, "w"))

    untied = write_hf_dir(SynthModel(seed=6, style="llama"), str(tmp_path / "untied"))   # lm_head.weight saved
    assert not open_source(untied).config.tie_word_embeddings
    edit(untied, tie_word_embeddings=True)
    s = open_source(untied)
    assert s.config.tie_word_embeddings and s.lm_head(0, 4) is None
    tied = write_hf_dir(SynthModel(seed=6), str(tmp_path / "tied"))   # no lm_head.weight
    assert open_source(tied).config.tie_word_embeddings
    for value, words in ((False, "says tie_word_embeddings false"),
                         (None, r"leaves tie_word_embeddings out \(transformers reads false\)")):
        edit(tied, tie_word_embeddings=value)
        with pytest.raises(FormatError, match=f"{words} but there is no lm_head.weight"):
            convert(tied, str(tmp_path / "t.bnstore"), progress=False)


def test_1bitllm_style_and_odd_dims(tmp_path):
    # 1bitLLM-3B-like shapes: multiples of 4 but not of 16/64 (padded in the store)
    m = SynthModel(dict(hidden_size=200, intermediate_size=344, num_attention_heads=4, num_key_value_heads=4,
                        vocab_size=512), seed=4, style="1bitllm")
    src = write_hf_dir(m, str(tmp_path / "onebit"))
    s = Store(convert(src, str(tmp_path / "ob.bnstore"), lm_head="i8", progress=False))
    c = s.config
    assert c.hidden_act == "silu" and not c.tie_word_embeddings and c.rope_theta == 10000.0
    assert s.info("blk.0.ffn_down")["cols"] == 344
    w = _ternary(s, "blk.0.ffn_down")
    assert np.array_equal(w, _reference_online(m.master("model.layers.0.mlp.down_proj"))[0])
    assert np.array_equal(s.tensor("blk.0.attn_sub_norm"), m.norm("model.layers.0.self_attn.inner_attn_ln.weight"))
    e = s.info("output")
    q = layout.unpack_i8(s.tensor("output"), e["rows"], e["cols"])
    assert np.array_equal(q, layout.quantize_rows_i8(m.lm_head().astype(np.float16).astype(np.float32))[0])


def test_hidden_activation_key_and_inference(model, tmp_path):
    p = write_gguf_tq(model, str(tmp_path / "silu.gguf"), hidden_activation="silu")
    assert Store(convert(p, str(tmp_path / "a.bnstore"), progress=False)).config.hidden_act == "silu"
    p = write_gguf_tq(model, str(tmp_path / "nokey.gguf"), hidden_activation=None)
    s = Store(convert(p, str(tmp_path / "b.bnstore"), progress=False))
    assert s.config.hidden_act == "relu2" and "inferred" in s.meta["hidden_act_from"]


# ---- bad input -----------------------------------------------------------------------------------------
def _hf_copy(model, tmp_path, name="bad"):
    return write_hf_dir(model, str(tmp_path / name))


def _edit_config(d, **kw):
    p = os.path.join(d, "config.json")
    cfg = json.load(open(p))
    cfg.update(kw)
    json.dump(cfg, open(p, "w"))


def test_bad_sources(model, tmp_path):
    with pytest.raises(FormatError, match="no such file"):
        convert(str(tmp_path / "nothing"), progress=False)
    (tmp_path / "junk.bin").write_bytes(b"hello world" * 10)
    with pytest.raises(FormatError, match="not a GGUF file"):
        convert(str(tmp_path / "junk.bin"), progress=False)
    d = _hf_copy(model, tmp_path, "arch")
    _edit_config(d, architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(UnsupportedError, match="unsupported model"):
        convert(d, progress=False)
    _edit_config(d, architectures=["MiniCPM3ForCausalLM"], model_type="minicpm3")
    with pytest.raises(UnsupportedError, match="MiniCPM3 .multi-head latent attention"):
        convert(d, progress=False)
    _edit_config(d, architectures=["MiniCPMForCausalLM"], model_type="minicpm", num_experts=8)
    with pytest.raises(UnsupportedError, match="MiniCPM variant: mixture of experts"):
        convert(d, progress=False)
    d = _hf_copy(model, tmp_path, "shape")
    _edit_config(d, intermediate_size=768)
    with pytest.raises(FormatError, match="shape"):
        convert(d, str(tmp_path / "x.bnstore"), progress=False)
    assert not os.path.exists(tmp_path / "x.bnstore")
    d = _hf_copy(model, tmp_path, "no_tokenizer")   # a store without one would fail at every later run instead
    os.remove(os.path.join(d, "tokenizer.json"))
    with pytest.raises(FormatError, match="no tokenizer found"):
        convert(d, str(tmp_path / "y.bnstore"), progress=False)
    assert not os.path.exists(tmp_path / "y.bnstore")


def _rewrite_safetensors(path, edit):
    """Rewrite a safetensors file in place, each tensor as edit(name, dtype tag, array) -> (tag, array)."""
    from bitnet_cpu.engine.formats.safetensors_io import SafetensorsFile
    from bitnet_cpu.engine.synth.writers import write_safetensors

    f = SafetensorsFile(path)
    specs = []
    for n in f.names():
        tag, arr = edit(n, f.info(n)[0], np.array(f.get(n)))
        specs.append((n, tag, list(arr.shape), lambda a=arr: a))
    f.close()
    write_safetensors(path, specs)


@pytest.mark.parametrize("value", [0.0, float("nan")])
def test_zero_or_nan_scale(model, tmp_path, value):
    from bitnet_cpu.engine.synth.writers import hf_pack

    d = str(tmp_path / "ns")
    write_hf_dir(model, d)

    def bad_scale(n, tag, arr):   # one bad weight_scale (f32), the rest unchanged
        if n == "model.layers.1.mlp.up_proj.weight_scale":
            return "F32", np.full(arr.shape, value, np.float32)
        return tag, arr

    _rewrite_safetensors(os.path.join(d, "model.safetensors"), bad_scale)
    with pytest.raises(FormatError, match="up_proj.weight_scale.*(zero|NaN)"):
        convert(d, str(tmp_path / "ns.bnstore"), progress=False)
    assert hf_pack is not None


def test_mixed_block_scales_rejected(tmp_path):
    gguf = pytest.importorskip("gguf")
    from bitnet_cpu.engine.synth.writers import _gguf_tensor_order

    m = SynthModel(seed=2)
    p = str(tmp_path / "mixed.gguf")
    write_gguf_tq(m, p)
    # rewrite one tensor's second block with a different d
    from bitnet_cpu.engine.formats.gguf import GGUFFile

    g = GGUFFile(p)
    t = g.info("blk.0.attn_k.weight")
    g.close()
    data = bytearray(open(p, "rb").read())
    data[t.offset + 66 + 64: t.offset + 66 + 66] = np.float16(0.5).tobytes()
    open(p, "wb").write(bytes(data))
    with pytest.raises(UnsupportedError, match="attn_k.*different block scales"):
        convert(p, str(tmp_path / "m.bnstore"), progress=False)
    assert gguf and _gguf_tensor_order


def test_cli_errors_one_line_exit_2(tmp_path):
    (tmp_path / "t.gguf").write_bytes(b"GGUF\x03\0\0\0" + b"\xff" * 16)
    for args in (["convert", str(tmp_path / "t.gguf")], ["inspect", str(tmp_path / "missing")],
                 ["convert", str(tmp_path / "t.gguf"), "--lm-head", "f16"]):
        r = subprocess.run([sys.executable, "-m", "bitnet_cpu", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and str(tmp_path) in r.stderr


def test_cli_convert_and_inspect(model, tmp_path):
    src = write_gguf_i2s(model, str(tmp_path / "m.gguf"))
    out = str(tmp_path / "m.bnstore")
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "convert", src, "-o", out, "--lm-head", "f16"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == out, r.stderr
    for f in (out, src):
        r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "inspect", f], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "hidden 256" in r.stdout and "blk.1.ffn_down" in r.stdout and "hf_json (512 tokens" in r.stdout
        assert "Assistant: " in r.stdout and " / 0." in r.stdout
    # a negative --tensors printed every row but one, then "... N+1 more"; -o "" wrote next to SRC as without -o
    for args, words in ((["inspect", out, "--tensors", "-1"], "--tensors -1: must be 0 or more"),
                        (["convert", src, "-o", ""], "-o/--output: an empty path")):
        r = subprocess.run([sys.executable, "-m", "bitnet_cpu", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stdout == "" and f"bitnet: error: {words}" in r.stderr, r.stderr


def test_convert_never_writes_over_what_is_not_a_store(model, tmp_path):
    """-o is checked before any work: the source itself, a model directory's own file, a symbolic link (a rename
    would replace the link, e.g. /dev/stdout's), a directory, a missing one or a file in its place are refused with
    one line, and
    nothing changes; an earlier store is replaced, readable as open() would make a file (the umask), not 0600."""
    src = write_gguf_i2s(model, str(tmp_path / "m.gguf"))
    hf = write_hf_dir(model, str(tmp_path / "hf"))
    (tmp_path / "elsewhere").write_bytes(b"x")
    os.symlink(str(tmp_path / "elsewhere"), str(tmp_path / "link"))
    kept = (src, os.path.join(hf, "model.safetensors"), str(tmp_path / "elsewhere"))
    before = {p: open(p, "rb").read() for p in kept}
    for out, words in ((src, "not one this command writes"), (os.path.join(hf, "model.safetensors"), "refusing"),
                       (str(tmp_path / "link"), "symbolic link"), (str(tmp_path), "a directory"),
                       (str(tmp_path / "no" / "m.bnstore"), "does not exist"),
                       # a file where a directory should be: said as it is, not as a missing directory
                       (os.path.join(tmp_path, "elsewhere", "m.bnstore"),
                        f"{tmp_path / 'elsewhere'} is not a directory"),
                       (os.path.join(tmp_path, "elsewhere", "d", "m.bnstore"),
                        f"{tmp_path / 'elsewhere'} is not a directory")):
        source = hf if out.startswith(hf) else src
        r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "convert", source, "-o", out],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and words in r.stderr and r.stderr.count("\n") == 1, (out, r.stderr)
    assert {p: open(p, "rb").read() for p in before} == before and os.path.islink(str(tmp_path / "link"))
    assert not os.path.exists(str(tmp_path / "no"))
    out = str(tmp_path / "m.bnstore")
    for _ in range(2):   # the second run replaces the first's store
        r = subprocess.run([sys.executable, "-c", "import os, sys; os.umask(0o027); from bitnet_cpu.cli import main; "
                            f"sys.exit(main(['convert', {src!r}, '-o', {out!r}]))"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
    assert os.stat(out).st_mode & 0o777 == 0o640 and Store(out).config


def test_a_fifo_or_device_is_no_model(model, tmp_path):
    """A FIFO as -m would block the reader that sniffs its first bytes until a writer came: refused at once. So is
    one among a model directory's files (config.json, the weights, the tokenizer's: inspect, convert and run
    waited in open() for ever, and serve said "loading" for ever)."""
    import shutil
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    for m in (fifo, os.devnull):
        r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "run", "-m", m, "-p", "x", "-n", "1"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "not a regular file" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    src = write_hf_dir(model, str(tmp_path / "hf"))
    for name in sorted(os.listdir(src)):
        d = str(tmp_path / f"hf-{name}")
        shutil.copytree(src, d)
        os.remove(os.path.join(d, name))
        os.mkfifo(os.path.join(d, name))
        for cmd in (["inspect", d], ["convert", d, "-o", d + ".bnstore"], ["run", "-m", d, "-p", "x", "-n", "1"]):
            r = subprocess.run([sys.executable, "-m", "bitnet_cpu", *cmd], capture_output=True, text=True,
                               timeout=60, env=dict(os.environ, BITNET_CACHE=str(tmp_path / "cache")))
            assert r.returncode == 2 and f"{name}: not a regular file" in r.stderr, (cmd, r.stderr)


def test_resolve_model_caches(model, tmp_path, monkeypatch):
    monkeypatch.setenv("BITNET_CACHE", str(tmp_path / "cache"))
    src = write_gguf_i2s(model, str(tmp_path / "m.gguf"))
    p1 = resolve_model(src, progress=False)
    assert p1.startswith(str(tmp_path / "cache")) and os.path.exists(p1)
    t1 = os.stat(p1).st_mtime_ns
    assert resolve_model(src, progress=False) == p1 and os.stat(p1).st_mtime_ns == t1
    assert resolve_model(p1) == p1  # a store is itself
    os.utime(src, ns=(t1 + 10**9, t1 + 10**9))  # changed source -> converted again, in place of the first
    p2 = resolve_model(src, progress=False)
    assert p2 == p1 and os.stat(p2).st_mtime_ns != t1 and os.listdir(tmp_path / "cache") == [os.path.basename(p1)]
    p3 = resolve_model(src, lm_head="f16", progress=False, cache_dir=str(tmp_path / "c2"))
    assert Store(p3).meta["lm_head"] == "f16"
    with pytest.raises(BitNetError):
        resolve_model(str(tmp_path / "nope.gguf"))


class _NoIsatty:
    """A stderr stand-in with only write/flush (contextlib.redirect_stderr to a logger adapter)."""

    def write(self, s):
        return len(s)

    def flush(self):
        pass


@pytest.mark.parametrize("stderr", [None, _NoIsatty()], ids=["none", "no_isatty"])
def test_conversion_with_no_terminal_stderr_has_no_bar(model, tmp_path, monkeypatch, stderr):
    """sys.stderr None (pythonw, a frozen app) or without isatty: the conversion runs with no progress bar (it
    raised AttributeError from load_model(), progress=True being the default)."""
    monkeypatch.setenv("BITNET_CACHE", str(tmp_path / "cache"))
    src = write_hf_dir(model, str(tmp_path / "hf"))
    monkeypatch.setattr(sys, "stderr", stderr)
    path = resolve_model(src)
    assert Store(path).meta["lm_head"]


def test_sentencepiece_sources(tmp_path):
    """1bitLLM style: tokenizer.model is stored as is; a GGUF `llama` vocab is rebuilt as a tokenizer.json that
    gives SentencePiece's ids (best effort, checked on ordinary and byte-fallback text)."""
    spm = pytest.importorskip("sentencepiece")
    from tokenizers import Tokenizer

    from bitnet_cpu.engine.synth import TRAIN_TEXT

    m = SynthModel(seed=3, style="1bitllm")
    a = Store(convert(write_hf_dir(m, str(tmp_path / "hf")), str(tmp_path / "a.bnstore"), progress=False))
    b = Store(convert(write_gguf_tq(m, str(tmp_path / "t.gguf"), hidden_activation=None), str(tmp_path / "b.bnstore"),
                      progress=False))
    assert a.tokenizer_spec[0] == "sentencepiece" and a.tokenizer_spec[1] == m.tokenizer_info()["model"]
    assert b.config.hidden_act == "silu" and not b.config.tie_word_embeddings  # llama vocab -> 1bitLLM -> SiLU
    assert a.chat_template is None and b.chat_template is None
    sp = spm.SentencePieceProcessor(model_proto=a.tokenizer_spec[1])
    tok = Tokenizer.from_str(b.tokenizer_spec[1].decode())
    for line in TRAIN_TEXT.splitlines() + ["Hello  world", " leading space", "a\n\nb", "ZZZqqq!! 9876"]:
        ids = sp.encode(line)
        assert tok.encode(line, add_special_tokens=False).ids == ids, line
        assert tok.decode(ids) == line
    assert tok.encode("hi").ids[0] == 1  # <s> added like LLaMA-2
    assert np.array_equal(a.tensor("output"), b.tensor("output"))  # untied head, F16 in the GGUF


def test_gguf_tokenizer_matches_llama_cpp(model, tmp_path):
    """llama.cpp itself loads our TQ2_0 file, and its tokenizer (llama-bpe) gives the ids of the tokenizer.json
    we build from the same GGUF vocab."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (bench/setup_llama.sh)")
    from tokenizers import Tokenizer

    from bitnet_cpu.engine.synth import TRAIN_TEXT

    p = write_gguf_tq(model, str(tmp_path / "t.gguf"), pre="llama-bpe")
    llm = llama_cpp.Llama(p, verbose=False, n_ctx=64)
    tok = Tokenizer.from_str(Store(convert(p, str(tmp_path / "t.bnstore"), progress=False)).tokenizer_spec[1].decode())
    for text in TRAIN_TEXT.splitlines() + ["Hello  world\n\n  x", " 12345678 ab", "User: hi<|eot_id|>", "   a \n \n"]:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == tok.encode(text, add_special_tokens=False).ids


def test_unpacked_int8_checkpoint(model, stores, tmp_path):
    """Ternary weights stored unpacked as I8 (+ weight_scale) give the same store as the packed layout."""
    d = write_hf_dir(model, str(tmp_path / "i8"))
    _rewrite_safetensors(os.path.join(d, "model.safetensors"),
                         lambda n, tag, arr: ("I8", model.ternary(n[: -len(".weight")])) if tag == "U8" else (tag, arr))
    s = Store(convert(d, str(tmp_path / "i8.bnstore"), progress=False))
    ref = stores["hf"]
    for n in ref.tensor_names:
        assert np.array_equal(ref.tensor(n), s.tensor(n)), n


def test_cli_weights_t16_and_refusals(model, tmp_path):
    """`bitnet convert --weights t1.6` writes the base-3 layout (the same ternary matrices); a bad value is one
    line and exit 2, and so is t1.6 for a group-scaled (tg128) model."""
    from bitnet_cpu.engine.synth import write_bonsai_dir

    src = write_gguf_tq(model, str(tmp_path / "m.gguf"), "TQ2_0")
    out = str(tmp_path / "m.t16.bnstore")
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "convert", src, "-o", out, "--weights", "t1.6"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r2 = subprocess.run([sys.executable, "-m", "bitnet_cpu", "convert", src, "-o", out + "2", "--weights", "t1.6"],
                        capture_output=True, text=True, timeout=120, env=dict(os.environ, BITNET_ISA="scalar"))
    assert r2.returncode == 0 and "warning: --weights t1.6" in r2.stderr and "scalar" in r2.stderr, r2.stderr
    s, ref = Store(out), Store(convert(src, str(tmp_path / "m.bnstore"), progress=False))
    for name in ("blk.0.attn_qkv", "blk.1.ffn_down"):
        e = s.info(name)
        assert e["layout"] == "tile16b3"
        assert np.array_equal(layout.unpack_ternary_b3(s.tensor(name), e["rows"], e["cols"]), _ternary(ref, name))
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "convert", src, "--weights", "t1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "t1.6" in r.stderr and "Traceback" not in r.stderr
    q = SynthModel({"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 64, "vocab_size": 640, "tie_word_embeddings": True}, seed=2, style="llama")
    gsrc = write_bonsai_dir(q, str(tmp_path / "Ternary-Bonsai-tiny-unpacked"))
    with pytest.raises(BitNetError, match="only t2 applies"):
        convert(gsrc, str(tmp_path / "q.bnstore"), weights="t1.6", progress=False)
    assert not os.path.exists(str(tmp_path / "q.bnstore"))


@pytest.mark.parametrize("damage,msg", [(None, "is already a BitNet store"), ("truncate", "truncated or corrupt store"),
                                        ("index", "index checksum mismatch")])
def test_converting_a_store_says_whether_it_is_damaged(tmp_path, damage, msg):
    """A store given to convert: a sound one has nothing to convert; a damaged one is said damaged, in the words
    run and inspect use (it was called a store with nothing to convert, and the run then failed on it)."""
    from bitnet_cpu.engine.formats.convert import bundled_model

    data = bytearray(open(bundled_model(), "rb").read())
    if damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "index":
        data[-5] ^= 0xFF
    p = tmp_path / "m.bnstore"
    p.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=msg) as e:
        convert(str(p), str(tmp_path / "out.bnstore"), progress=False)
    assert str(e.value).startswith(f"{p}: ") and "nothing to convert" not in str(e.value) or damage is None


def test_a_safetensors_header_naming_a_tensor_twice_is_refused(tmp_path):
    """json.loads keeps the last of two equal keys: the first entry's bytes were a hole nothing checked."""
    from bitnet_cpu.engine.formats.safetensors_io import SafetensorsFile

    e = '{"dtype":"F32","shape":[2],"data_offsets":[%d,%d]}'
    hdr = ('{"a":%s,"b":%s,"a":%s}' % (e % (0, 8), e % (8, 16), e % (16, 24))).encode()
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", len(hdr)) + hdr + np.arange(6, dtype=np.float32).tobytes())
    with pytest.raises(FormatError, match="names 'a' twice"):
        SafetensorsFile(str(p))


def test_the_cache_ignores_a_relative_xdg_folder_and_follows_links(tmp_path, monkeypatch):
    """XDG_CACHE_HOME=rel was taken from the working directory (a model converted again in each); the XDG spec
    says a relative one is ignored. A link to a model folder was a second conversion (the key was its abspath)."""
    from bitnet_cpu.engine.formats.convert import cache_dir_default, cache_key
    monkeypatch.delenv("BITNET_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "rel")
    assert cache_dir_default() == str(tmp_path / "home" / ".cache" / "bitnet")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir_default() == str(tmp_path / "xdg" / "bitnet")
    (tmp_path / "model").mkdir()
    os.symlink(tmp_path / "model", tmp_path / "link")
    assert cache_key(str(tmp_path / "link"), "q4") == cache_key(str(tmp_path / "model"), "q4")
    assert cache_key(str(tmp_path / "model"), "q4") != cache_key(str(tmp_path / "model"), "f16")


def test_convert_help_names_every_ternary_gguf_it_takes():
    """`bitnet convert --help` left out bitnet.cpp's TL1 / TL2 files, which convert (the README lists them)."""
    r = subprocess.run([sys.executable, "-m", "bitnet_cpu", "convert", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for kind in ("I2_S", "TL1", "TL2", "TQ1_0", "TQ2_0"):
        assert kind in text, text
