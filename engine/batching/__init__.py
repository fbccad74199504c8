"""Many sequences through one model: paged KV pool (kv_pool), radix prefix index (prefix_cache), the batched
forward (batch_model) and the continuous-batching scheduler thread (scheduler). Public entry: engine.api.load_engine."""

# rows one batched step computes (each decoding sequence's token, then prompt tokens up to it): load_engine's and
# `bitnet serve --batch-size`'s default, and the most either takes (the step's buffers are sized by it)
BATCH_TOKENS_DEFAULT = 256
BATCH_TOKENS_MAX = 8192
