"""Write the I2_S test files of tests/data/i2s with bitnet.cpp's own llama-quantize (see README.md there).

    PYTHONPATH=<dir holding bitnet_cpu> python tests/data/i2s/make_i2s_files.py LLAMA_QUANTIZE STEM [ARCH]

The weights: engine.synth's SynthModel(CONFIG, seed=SEED), a one-layer BitNet b1.58 2B-4T-style model (ARCH
`bitnet-b1.58` by default, what bitnet.cpp's 2B-4T GGUF uses; relu2, sub-norms, GQA, tied embedding; `bitnet`
for the 2024-11 release, which has no other BitNet architecture: written without a hidden_activation key, as
bitnet.cpp's converter writes it, so both engines run SiLU), written as an F32 GGUF
(ternary matrix times its per-tensor scale, as bitnet.cpp's setup_env.py converts to f32 first), then
`LLAMA_QUANTIZE in.gguf out.gguf I2_S 1`, setup_env.py's command (one thread: see README.md), and xz.
The test (tests/test_i2s_bitnet_cpp.py) regenerates the same SynthModel and compares.
"""
import lzma
import os
import subprocess
import sys
import tempfile

CONFIG = {"num_hidden_layers": 1}     # hidden 256, intermediate 512, 4 heads / 2 kv heads, vocab 512
SEED = 47
ARCH = "bitnet-b1.58"


def model():
    from bitnet_cpu.engine.synth import SynthModel
    return SynthModel(CONFIG, seed=SEED)


def main(argv):
    if len(argv) not in (2, 3):
        raise SystemExit(__doc__)
    quantize, stem, arch = (*argv, ARCH)[:3]
    from bitnet_cpu.engine.synth import write_gguf_tq
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{stem}.gguf.xz")
    with tempfile.TemporaryDirectory() as tmp:
        f32, i2s = os.path.join(tmp, "f32.gguf"), os.path.join(tmp, "i2_s.gguf")
        write_gguf_tq(model(), f32, "F32", embed_type="F32", arch=arch, hidden_activation=None)
        r = subprocess.run([quantize, f32, i2s, "I2_S", "1"], capture_output=True, text=True)
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
        if r.returncode:
            raise SystemExit(f"{quantize} failed (exit {r.returncode})")
        with open(i2s, "rb") as f, lzma.open(out, "wb", preset=9 | lzma.PRESET_EXTREME) as g:
            g.write(f.read())
    print(out, os.path.getsize(out))


if __name__ == "__main__":
    main(sys.argv[1:])
