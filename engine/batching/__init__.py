"""Many sequences through one model: paged KV pool (kv_pool), radix prefix index (prefix_cache), the batched
forward (batch_model) and the continuous-batching scheduler thread (scheduler). Public entry: engine.api.load_engine."""

from ..cpu import BATCH_TOKENS_DEFAULT, BATCH_TOKENS_MAX, BATCH_TOKENS_TILES  # noqa: F401 (re-exported)


def default_batch_tokens() -> int:
    """Rows a batched step computes when not told: BATCH_TOKENS_DEFAULT, or BATCH_TOKENS_TILES where the AMX tiles run.

    While a long prompt is read, every decoding stream waits for each step. Measured on 2-core Zen 5 (bitnet serve,
    2B-4T shape, 2 threads; 12 streams decoding when a 1,500-token prompt arrives; bench/serve_stall.py): at 256
    rows a step the streams' inter-token gap was p99 963 / 924 ms (two runs) and the prompt took 5.42 / 5.14 s; at
    128, p99 463 / 473 ms and 5.40 / 5.28 s; at 64, p99 239 ms and 6.10 s. The prompt alone took the same 4.8-4.9 s
    at 32-256 rows (12.2-13.4 s on the AVX2 path), and 16 clients of 32 + 64 tokens the same aggregate rate at 64
    and 256. The tiles gain more on more rows (unmeasured there at 128), so they keep the 256 the lease measured."""
    from ...simd import _kernels as K   # noqa: PLC0415 (the package stays importable without the extension)
    return BATCH_TOKENS_TILES if K.tiles() == "amx" else BATCH_TOKENS_DEFAULT
