"""bitnet-cpu: fast, trustworthy CPU inference for BitNet b1.58 (ternary-weight) language models.

The one import package this distribution installs. Its subpackages are the repository's top-level folders
(mapped in pyproject.toml), each importing only those below it:

    simd     C SIMD kernels and their thin Cython wrappers (imports nothing of the others)
    engine   formats and the weight store, the runtime, the batching engine, the public API (engine.api)
    chat     the bitchat REPL (over engine.api)
    serve    the OpenAI-compatible HTTP server (over engine.api)
    cli      the `bitnet` and `bitchat` commands (over all of the above)
    models   the bundled default model and the code that trained it

`python -m bitnet_cpu ...` is the `bitnet` command. This file imports nothing, so `bitnet_cpu.simd` can be
used alone.
"""
