"""`bitnet serve`: the OpenAI-compatible HTTP server (FastAPI app, request schemas, Prometheus metrics, the
chat page, the Ray Serve deployment) over the batching engine of engine.api. Knows nothing of kernels."""
