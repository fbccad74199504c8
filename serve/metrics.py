"""Prometheus metrics of one server (one registry per app, so several apps in a process never collide).

Counters and histograms are updated by the request handlers; the engine's own numbers (running/waiting
sequences, KV pool pages, prefix-cache hits, prompt-lookup drafted / accepted tokens, faults) are read from
`engine.metrics()` at scrape time by a collector.
"""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class TokenClock:
    """One answer's token times, into the time-to-first-token and time-per-output-token histograms, and its
    tokens into bitnet_generated_tokens (metrics None: timed only). `first`: when its first token came (None
    before)."""

    def __init__(self, metrics=None):
        self.metrics, self.t0 = metrics, time.perf_counter()
        self.first = self.last = None
        self.n = 0
        self.generated = 0   # tokens counted into bitnet_generated_tokens so far

    def token(self, generated=1):
        """A piece of the answer came; `generated`: the tokens it holds, counted as they come, so that an answer
        whose client hangs up counts what it made too."""
        now = time.perf_counter()
        if self.metrics is not None:
            if self.last is None:
                self.metrics.ttft.observe(now - self.t0)
            else:
                self.metrics.tpot.observe(now - self.last)
        self.first = self.first or now
        self.last = now
        self.n += 1
        self.settle(self.generated + generated)

    def settle(self, n_generated):
        """The answer's whole count (usage's: an end-of-text token too, which comes in no piece): the part of it
        not counted yet."""
        if self.metrics is not None and n_generated > self.generated:
            self.metrics.generated_tokens.inc(n_generated - self.generated)
        self.generated = max(self.generated, n_generated)


class _EngineCollector:
    def __init__(self, get_metrics: Callable[[], dict | None]):
        self._get = get_metrics

    def collect(self):
        m = self._get() or {}
        gauges = [("bitnet_requests_running", "sequences being generated", "running"),
                  ("bitnet_requests_waiting", "requests queued for a slot", "waiting"),
                  ("bitnet_kv_pages_total", "pages in the KV pool", "kv_pages_total"),
                  ("bitnet_kv_pages_used", "KV pool pages in use (sequences and prefix cache)", "kv_pages_used"),
                  ("bitnet_kv_pages_evictable", "KV pool pages only the prefix cache holds (free to take)",
                   "kv_pages_evictable"),
                  ("bitnet_kv_page_tokens", "tokens per KV page", "kv_page_tokens"),
                  ("bitnet_kv_pool_bytes", "bytes of the KV pool (its dtype: /slots kv_dtype)", "kv_pool_bytes")]
        for name, doc, key in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(m.get(key, 0)))
            yield g
        if m.get("kv_pages_total"):
            # pages only the prefix cache holds are free to take (vLLM's count): with them, an idle server that
            # once answered read ~1.0 for ever, and a balancer sent it nothing
            g = GaugeMetricFamily("bitnet_kv_pool_usage_ratio", "share of KV pool pages sequences hold (prefix-cache"
                                  " pages no sequence holds are free to take)")
            g.add_metric([], (m.get("kv_pages_used", 0) - m.get("kv_pages_evictable", 0)) / m["kv_pages_total"])
            yield g
        c = CounterMetricFamily("bitnet_prefix_hit_tokens", "prompt tokens reused from the prefix cache")
        c.add_metric([], float(m.get("prefix_hits_tokens", 0)))
        yield c
        for name, doc, key in (("bitnet_lookup_drafted_tokens", "prompt-lookup draft tokens verified", "lookup_drafted_total"),
                               ("bitnet_lookup_accepted_tokens", "prompt-lookup draft tokens accepted", "lookup_accepted_total"),
                               ("bitnet_forced_drafted_tokens", "tokens a grammar forced, verified as drafts "
                                "(jump-forward)", "forced_drafted_total"),
                               ("bitnet_forced_accepted_tokens", "forced tokens the model's sampling kept",
                                "forced_accepted_total"),
                               ("bitnet_prefill_tokens", "prompt tokens run through the model (cached and shared excluded)",
                                "prefill_tokens_total"),
                               ("bitnet_sequence_errors", "sequences ended by a fault in their sampling or forward pass",
                                "sequence_errors_total"),
                               ("bitnet_steps_split", "batched steps run again in halves to find the sequence a fault came from",
                                "steps_split_total"),
                               ("bitnet_embedding_inputs", "texts embedded (/v1/embeddings, /api/embed, /api/embeddings)",
                                "embed_inputs_total")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(m.get(key, 0)))
            yield c
        yield from _llama_server_names(m)


# llama-server's names for the same numbers (its README's "Available metrics"): dashboards and autoscalers keyed to
# them read these
_LLAMA_COUNTERS = (("llamacpp:prompt_tokens", "prompt tokens processed", "prefill_tokens_total"),
                   ("llamacpp:tokens_predicted", "generation tokens processed", "tokens_generated_total"),
                   ("llamacpp:n_decode", "decode calls (batched steps)", "steps_total"))
_LLAMA_GAUGES = (("llamacpp:requests_processing", "requests processing", "running"),
                 ("llamacpp:requests_deferred", "requests deferred (waiting for a slot)", "waiting"))


def _llama_server_names(m: dict):
    for name, doc, key in _LLAMA_COUNTERS:
        c = CounterMetricFamily(name, doc)
        c.add_metric([], float(m.get(key, 0)))
        yield c
    for name, doc, key in _LLAMA_GAUGES:
        g = GaugeMetricFamily(name, doc)
        g.add_metric([], float(m.get(key, 0)))
        yield g


class ServerMetrics:
    def __init__(self, get_engine_metrics: Callable[[], dict | None]):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("bitnet_http_requests", "HTTP requests by route and status (a URL no route takes: other)", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("bitnet_prompt_tokens", "prompt tokens received", registry=r)
        self.generated_tokens = Counter("bitnet_generated_tokens", "tokens generated", registry=r)
        self.rejected = Counter("bitnet_requests_rejected_queue_full", "requests answered 503 because the queue was full", registry=r)
        self.ttft = Histogram("bitnet_time_to_first_token_seconds", "time from request to first token", buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("bitnet_time_per_output_token_seconds", "time between generated tokens", buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("bitnet_request_duration_seconds", "time from request to last token", registry=r)
        r.register(_EngineCollector(get_engine_metrics))

    def render(self) -> bytes:
        return generate_latest(self.registry)
