"""Prometheus metrics of one app: its own registry, the engine's counters and gauges read at
scrape time, and the ASGI middleware that counts and times every answer."""

from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

STARTED = "lorafusion.started"  # the ASGI scope key: perf_counter() when the request reached the server
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
             "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/tokenize", "/detokenize", "/tokenizer_info"}


class EngineCollector:
    """Reads ``engine.stats()`` at scrape time, so the numbers are the engine's own."""

    _COUNTERS = (("generated_tokens_total", "lorafusion_generated_tokens", "Tokens generated (rate = tokens/s)"),
                 ("prompt_tokens_total", "lorafusion_prompt_tokens", "Prompt tokens prefilled"),
                 ("requests_total", "lorafusion_engine_requests", "Requests the engine accepted"),
                 ("adapter_page_ins_total", "lorafusion_adapter_page_ins", "Adapters copied host -> device pool"),
                 ("adapter_evictions_total", "lorafusion_adapter_evictions", "Adapters evicted from the device pool"),
                 ("preemptions_total", "lorafusion_preemptions", "Requests preempted for KV pages"),
                 ("rope_recomputes_total", "lorafusion_rope_recomputes",
                  "LongRoPE requests prefilled again on the long factors after decoding past the switch"),
                 ("prefix_cache_hits_total", "lorafusion_prefix_cache_hits", "Requests that reused cached prefix pages"),
                 ("prefix_tokens_reused_total", "lorafusion_prefix_tokens_reused",
                  "Prompt tokens not prefilled thanks to the prefix cache"),
                 ("prefill_chunks_total", "lorafusion_prefill_chunks",
                  "Prefill chunks that left part of their prompt for a later step (chunked prefill)"),
                 ("steps_total", "lorafusion_engine_steps", "Engine steps that ran a forward"),
                 ("prefill_steps_total", "lorafusion_engine_prefill_steps",
                  "Engine steps with prefill rows (these run eagerly; decode-only steps replay CUDA graphs)"),
                 ("step_seconds_total", "lorafusion_engine_busy_seconds",
                  "Seconds the engine spent in steps (rate = utilisation)"),
                 ("ttft_seconds_total", "lorafusion_engine_ttft_seconds",
                  "Arrival at the engine to first token, summed over requests (divide by first tokens)"),
                 ("first_tokens_total", "lorafusion_engine_first_tokens", "Requests that got their first token"),
                 ("nonfinite_logits_total", "lorafusion_nonfinite_logits",
                  "Requests aborted because their logits were NaN or infinite"),
                 ("decode_steps_ahead_total", "lorafusion_engine_decode_steps_ahead",
                  "Decode steps launched before the previous step's tokens were read (overlapped decode)"),
                 ("mixed_steps_ahead_total", "lorafusion_engine_mixed_steps_ahead",
                  "Steps admitting requests launched before the previous step's tokens were read"),
                 ("decode_rows_discarded_total", "lorafusion_engine_decode_rows_discarded",
                  "Rows of overlapped decode steps discarded: their request stopped during the step before"))
    _GAUGES = (("waiting", "lorafusion_queue_length", "Requests waiting for the engine"),
               ("running", "lorafusion_requests_running", "Requests in the running batch"),
               ("adapters_loaded", "lorafusion_adapters_loaded", "Adapters loaded (host memory)"),
               ("adapters_resident", "lorafusion_adapters_resident", "Adapters resident in the device pool"),
               ("kv_pages_used", "lorafusion_kv_pages_used", "KV-cache pages in use"),
               ("prefix_pages_cached", "lorafusion_prefix_pages_cached", "Cached prefix pages no request holds"),
               ("kv_pages_total", "lorafusion_kv_pages_total", "Pages in the pool (KV and adapters)"),
               ("warm_up_seconds", "lorafusion_warm_up_seconds", "Seconds the last Engine.warm_up took (0: none)"),
               ("decode_graph_keys", "lorafusion_decode_graph_keys",
                "Decode CUDA graphs captured: (batch bucket, with LoRA) keys, whatever the adapters' ranks"),
               ("mixed_piece_keys", "lorafusion_mixed_piece_keys",
                "Token buckets whose mixed-step pieces are captured (built): one set serves every rank mix"),
               ("cuda_graphs", "lorafusion_cuda_graphs", "CUDA graphs captured (decode graphs and mixed-step pieces)"))

    def __init__(self, engine: Any):
        self._engine = engine

    def collect(self):
        try:
            stats = self._engine.stats()
        except Exception as e:  # e.g. the engine process is gone: the HTTP metrics still answer
            log.warning("engine stats unavailable: %s", str(e).splitlines()[0])
            return
        for key, name, doc in self._COUNTERS:
            if key in stats:
                yield CounterMetricFamily(name, doc, value=stats[key])
        for key, name, doc in self._GAUGES:
            if key in stats:
                yield GaugeMetricFamily(name, doc, value=stats[key])


class ServerMetrics:
    """This app's own registry (several apps may live in one process, e.g. in tests)."""

    def __init__(self, engine: Any):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("lorafusion_http_requests", "HTTP requests answered", ["endpoint", "status"],
                                registry=self.registry)
        self.latency = Histogram("lorafusion_http_request_duration_seconds",
                                 "Time from request to the last byte of its answer", ["endpoint"],
                                 registry=self.registry,
                                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.first_token = Histogram("lorafusion_http_time_to_first_token_seconds",
                                     "Streamed requests: from the request reaching the server to its first "
                                     "token ready to send", ["endpoint"], registry=self.registry,
                                     buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                                              1, 2.5, 5, 10))
        self.registry.register(EngineCollector(engine))

    def observe(self, endpoint: str, status: int, started: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(time.perf_counter() - started)


class CountRequests:
    """ASGI middleware: counts answers by endpoint and status and times them to the last byte
    (streams included)."""

    def __init__(self, app: Any, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), 500
        scope[STARTED] = started  # for the time-to-first-token histogram

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.observe(endpoint, status, started)
