"""Files in and out: model sources (GGUF, safetensors directories, tokenizer files), the engine's own weight
store, conversion between them, and the report `bitnet inspect` prints. Imports nothing of the runtime."""
