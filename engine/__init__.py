"""BitNet b1.58 CPU inference engine. Rooms, each importing only those listed after it:

    api.py      the public API (load_model, load_engine)
    batching/   many sequences at once: paged KV, prefix cache, batched forward, scheduler
    synth/      synthetic models in every file format (tests and benchmarks only)
    runtime/    the transformer, sampling, the streaming generator, prompt lookup, chat templates
    formats/    model files in (GGUF, safetensors, tokenizers), the weight store, conversion, inspect
    errors.py, config.py, cpu.py, faults.py, fileio.py    the ground floor of the engine
"""
__version__ = "0.1.0"
