"""BitNet b1.58 CPU inference engine: formats, weight store, runtime, sampling, generation, CLI."""
__version__ = "0.1.0"
