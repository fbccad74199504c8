"""`bitnet convert SRC [-o OUT] [--lm-head q4|i8|f16] [--weights t2|t1.6]`: write the engine's weight store from a GGUF file or a
Hugging Face model directory (progress on stderr, the store path on stdout)."""
HELP = "convert a GGUF file or Hugging Face model directory into the engine's weight store"


def add_arguments(p):
    p.add_argument("src", metavar="SRC", help="GGUF file (bitnet.cpp I2_S/TL1/TL2, llama.cpp TQ1_0/TQ2_0, or F16/Q8_0/"
                                              "K-quants of a ternary model), HF model directory, or a hub id "
                                              "REPO[:FILE|:TAG][@REV] already downloaded")
    p.add_argument("-o", "--output", dest="out", metavar="OUT", default=None,
                   help="store path (default: next to SRC, with the .bnstore extension)%(default).0s")
    p.add_argument("--lm-head", choices=["q4", "i8", "f16"], default=None,
                   help="LM head precision (default q4: 4-bit groups whose best 64 tokens get exact f16 logits at run "
                        "time, i8 where the hidden size is over 8192; i8: int8 rows; f16: the reference numerics)%(default).0s")
    p.add_argument("--weights", choices=["t2", "t1.6"], default="t2",
                   help="ternary layout of the linear layers: t2 (2 bits per weight, the default) or t1.6 (base 3, "
                        "1.6 bits per weight, the same results: 20%% fewer bytes per token, more work to decode; faster "
                        "where each core's share of the memory bandwidth is low, i.e. many cores, and needs AVX-512 "
                        "VNNI to keep up)")
    p.add_argument("--hidden-act", choices=["relu2", "silu"], default=None,
                   help="override the FFN activation (default: from the file; see `bitnet inspect` for how it was decided)%(default).0s")
    p.add_argument("--ternarize", action="store_true",
                   help="the directory holds BitNet latent (master) float weights without a quantization_config"
                        " (e.g. Falcon-E's bfloat16 revision): ternarize them per tensor (absmean) as BitNet does")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args) -> int:
    import os
    import sys

    from ..engine.formats.convert import convert

    from ..engine.errors import BitNetError

    if args.out is not None and not args.out.strip():   # "" was taken as no -o: the store went next to SRC
        raise BitNetError("-o/--output: an empty path (leave -o out to write next to SRC)")
    source_name = None
    if not os.path.exists(args.src):
        from ..engine.formats.hub import control_character, is_hub_ref, resolve_hub_ref

        bad = control_character(args.src)
        if bad:   # `$'o/r\n'` was converted as the hub id o/r
            raise BitNetError(f"{args.src!r}: no such file or directory, nor a hub id: it holds a control character "
                              f"({bad})", hint="check how the name was quoted or pasted")
        if is_hub_ref(args.src):   # a hub id already downloaded: convert that download (into the cwd by default)
            args.src, source_name = resolve_hub_ref(args.src)
            stem = source_name.split("@")[0].replace("/", "--").replace(":", "--").removesuffix(".gguf")
            args.out = args.out or stem + (f".{args.lm_head}.bnstore" if args.lm_head else ".bnstore")
    if args.weights == "t1.6":
        from ..simd import _kernels as K

        if K.active() not in ("avx512", "amx"):   # the store is still valid anywhere; only the speed differs
            print(f"bitnet: warning: --weights t1.6 decodes without unpacking only with AVX-512 VNNI; this CPU's kernel "
                  f"path is {K.active()}, where it runs about 3x slower than t2 (bitnet convert --weights t2)",
                  file=sys.stderr)
    out = convert(args.src, args.out, lm_head=args.lm_head, weights=args.weights, progress=not args.no_progress, hidden_act=args.hidden_act,
                  ternarize=args.ternarize, source_name=source_name)
    from ..engine.formats.store import Store, store_warnings

    with Store(out, load="mmap") as s:   # what the file left to a guess (every load of the store says it too)
        for w in store_warnings(s):
            print(f"bitnet: warning: {w}", file=sys.stderr)
    print(out)
    return 0
