"""Many sequences through one model: paged KV pool (kv_pool), radix prefix index (prefix_cache), the batched
forward (batch_model) and the continuous-batching scheduler thread (scheduler). Public entry: engine.api.load_engine."""
