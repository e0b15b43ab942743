"""The OpenAI-compatible HTTP app over the generation engine (FastAPI): routes, API key, limits,
Prometheus metrics, streaming, adapter store rescans. Translation lives in ``openai_api``."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..specs import ConfigError
from . import openai_api as oa
from .adapter_store import AdapterPathError, AdapterStore
from .engine_process import RESTARTING, EngineDeadError

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The HTTP layer's settings (the engine's are ``EngineConfig``).

    served_model_name: the ``model`` that means the base model without adapter (``serve``
        defaults it to the base model's name; None here = "base").
    api_key: when set, every ``/v1/*`` request needs ``Authorization: Bearer <api_key>``
        (``/health`` and ``/metrics`` stay open for probes and scrapers).
    max_request_bytes: larger request bodies are refused (413).
    max_prompt_tokens: longer prompts are refused (400); None = the engine's context length.
    max_tokens_limit: the most tokens one choice may ask for.
    default_max_tokens: chat's ``max_tokens`` when unset (None = what fits in the context);
        completions default to 16 as OpenAI's do.
    max_n: the most choices (``n`` times the number of prompts) one request may ask for.
    max_pending_requests: engine requests in flight (queued or running) above which new
        requests get 503 with ``Retry-After: retry_after_s``.
    rescan_interval_s: how often the adapter store is rescanned (0 = only on requests for
        unknown names and on ``GET /v1/models``).
    max_header_bytes: a request's line and headers larger than this get 431 and a closed
        connection (``serve`` sets it on uvicorn: ``http_limits``).
    header_timeout_s: a request whose line and headers take longer to arrive gets 408 and a
        closed connection (slow-header clients).
    keep_alive_timeout_s: an idle kept-alive connection is closed after this many seconds.
    """

    served_model_name: str | None = None
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    max_tokens_limit: int = 4096
    default_max_tokens: int | None = 256
    max_n: int = 16
    max_pending_requests: int = 256
    retry_after_s: int = 1
    rescan_interval_s: float = 10.0
    max_header_bytes: int = 65536
    header_timeout_s: float = 10.0
    keep_alive_timeout_s: int = 5

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_tokens_limit", "max_n", "max_pending_requests", "max_header_bytes",
                     "keep_alive_timeout_s"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ServerConfig.{name}={getattr(self, name)} must be >= 1")
        for name in ("max_prompt_tokens", "default_max_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"ServerConfig.{name}={getattr(self, name)} must be >= 1 or null")
        if not self.header_timeout_s > 0:
            raise ConfigError(f"ServerConfig.header_timeout_s={self.header_timeout_s} must be > 0")
        if self.retry_after_s < 0 or self.rescan_interval_s < 0:
            raise ConfigError("ServerConfig.retry_after_s and rescan_interval_s must be >= 0")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("ServerConfig.api_key must not be empty (leave it null for no key)")


class _EngineCollector:
    """Reads ``engine.stats()`` at scrape time, so the numbers are the engine's own."""

    _COUNTERS = (("generated_tokens_total", "lorafusion_generated_tokens", "Tokens generated (rate = tokens/s)"),
                 ("prompt_tokens_total", "lorafusion_prompt_tokens", "Prompt tokens prefilled"),
                 ("requests_total", "lorafusion_engine_requests", "Requests the engine accepted"),
                 ("adapter_page_ins_total", "lorafusion_adapter_page_ins", "Adapters copied host -> device pool"),
                 ("adapter_evictions_total", "lorafusion_adapter_evictions", "Adapters evicted from the device pool"),
                 ("preemptions_total", "lorafusion_preemptions", "Requests preempted for KV pages"),
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
                 ("decode_rows_discarded_total", "lorafusion_engine_decode_rows_discarded",
                  "Rows of overlapped decode steps discarded: their request stopped during the step before"))
    _GAUGES = (("waiting", "lorafusion_queue_length", "Requests waiting for the engine"),
               ("running", "lorafusion_requests_running", "Requests in the running batch"),
               ("adapters_loaded", "lorafusion_adapters_loaded", "Adapters loaded (host memory)"),
               ("adapters_resident", "lorafusion_adapters_resident", "Adapters resident in the device pool"),
               ("kv_pages_used", "lorafusion_kv_pages_used", "KV-cache pages in use"),
               ("prefix_pages_cached", "lorafusion_prefix_pages_cached", "Cached prefix pages no request holds"),
               ("kv_pages_total", "lorafusion_kv_pages_total", "Pages in the pool (KV and adapters)"))

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


class _Metrics:
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
        self.registry.register(_EngineCollector(engine))

    def observe(self, endpoint: str, status: int, started: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(time.perf_counter() - started)


def _error_response(err: oa.APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class _Server:
    """State behind one app: the engine, the store, limits, metrics, requests in flight."""

    def __init__(self, engine: Any, config: ServerConfig, store: AdapterStore | None):
        from . import GenerationRequest, SamplingParams

        self.engine, self.config, self.store = engine, config, store
        self._GenerationRequest, self._SamplingParams = GenerationRequest, SamplingParams
        self.model_name = config.served_model_name or "base"
        self.tokenizer = engine.tokenizer
        self.max_model_len = int(engine.max_model_len)
        self.vocab_size = int(engine.model_config.vocab_size)
        self.metrics = _Metrics(engine)
        self.in_flight: set[str] = set()  # engine request ids submitted by this app and not finished
        self.closing = False
        self.started = oa.now()
        self._rescan_task: asyncio.Task | None = None
        # engine.generate calls (echo scoring) block a thread each while the engine loop works
        self._executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix="lorafusion-generate")

    # -- lifecycle ------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        if self.store is not None:
            await asyncio.to_thread(self.store.scan)
            if self.config.rescan_interval_s > 0:
                self._rescan_task = asyncio.create_task(self._rescan_forever())
        try:
            yield
        finally:
            self.closing = True
            if self._rescan_task is not None:
                self._rescan_task.cancel()
            # uvicorn has let open requests finish (timeout_graceful_shutdown): cancel the rest,
            # and give their handlers a moment to see the abort
            for rid in list(self.in_flight):
                self.engine.abort(rid)
            for _ in range(100):
                if not self.in_flight:
                    break
                await asyncio.sleep(0.05)
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _rescan_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.rescan_interval_s)
            try:
                await asyncio.to_thread(self.store.scan)
            except Exception:  # a scan error must not end rescanning
                log.exception("adapter store rescan failed")

    # -- request plumbing -----------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        if self.config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.config.api_key.encode()):
            raise oa.APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def read_json(self, request: Request) -> Any:
        limit = self.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise oa.APIError(413, f"request body of {declared} bytes exceeds this server's limit of {limit}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise oa.APIError(413, f"request body exceeds this server's limit of {limit} bytes")
        try:
            return json.loads(body)
        except ValueError as e:  # bad JSON or UTF-8, or an integer beyond Python's 4300-digit limit
            raise oa.APIError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
        except RecursionError:
            raise oa.APIError(400, "the request body is nested too deeply") from None

    async def resolve_adapter(self, model: str) -> str | None:
        """The engine adapter ``model`` names (None = the base); 404 when there is none."""
        if model == self.model_name:
            return None
        if model in {a.name for a in self.engine.adapters()}:
            return model
        if self.store is not None and await asyncio.to_thread(self.store.lookup, model):
            return model
        raise oa.model_not_found(model)

    @contextlib.contextmanager
    def admitted(self, greqs: list) -> Any:
        """Count ``greqs`` as in flight from now on, or refuse them (503) when the server is
        closing or ``max_pending_requests`` would be exceeded. Check and count happen with no
        await between them, so the limit is exact however many requests arrive at once; if the
        handler fails before the requests reach the engine, they are uncounted again (the
        engine streams uncount them when they end)."""
        retry = {"Retry-After": str(self.config.retry_after_s)}
        if self.closing:
            raise oa.APIError(503, "the server is shutting down", headers=retry)
        if len(self.in_flight) + len(greqs) > self.config.max_pending_requests:
            raise oa.APIError(503, f"the server is overloaded ({len(self.in_flight)} requests in flight); "
                                   "retry later", code="server_overloaded", headers=retry)
        ids = [g.request_id for g in greqs]
        self.in_flight.update(ids)
        try:
            yield
        except BaseException:
            self.in_flight.difference_update(ids)
            raise

    def shown_path(self, path: str | None) -> str | None:
        """An adapter's directory as ``/v1/models`` shows it: relative to the store, never the
        server's absolute paths (outside the store: the directory's name only)."""
        if path is None:
            return None
        p = Path(path)
        if self.store is not None:
            with contextlib.suppress(ValueError, OSError):
                return p.resolve().relative_to(self.store.root).as_posix()
        return p.name

    def adapter_card(self, a: Any) -> dict:
        """One adapter's ``/v1/models`` entry; metadata that cannot be shown (a non-finite
        number, say) is left out, so one adapter can never fail the listing for everyone."""
        try:
            card = oa.model_card(a.name, created=self.started, root=self.shown_path(a.path), parent=self.model_name,
                                 rank=a.rank, alpha=a.alpha, target_modules=a.target_modules)
            json.dumps(card, allow_nan=False)
            return card
        except Exception as e:  # noqa: BLE001 - logged; the listing goes on
            log.warning("adapter %r: its metadata cannot be listed (%s); listed by name only", a.name, e)
            return oa.model_card(str(a.name), created=self.started, parent=self.model_name)

    def check_prompt(self, prompt: oa.Prompt) -> None:
        limit = min(self.config.max_prompt_tokens or self.max_model_len, self.max_model_len)
        if len(prompt.token_ids) > limit:
            raise oa.APIError(400, f"prompt is {len(prompt.token_ids)} tokens; this server accepts at most {limit}",
                              param="prompt", code="context_length_exceeded")

    def engine_request(self, prompt: oa.Prompt, adapter: str | None, sampling: dict) -> Any:
        try:
            params = self._SamplingParams(**sampling)
        except ConfigError as e:
            raise oa.APIError(400, str(e)) from None
        return self._GenerationRequest(prompt_token_ids=prompt.token_ids, adapter=adapter, sampling=params,
                                       request_id=oa.new_id("req"))

    def aborted(self) -> oa.APIError:
        """What a client whose request the engine aborted gets (not a disconnect: nobody listens)."""
        if self.closing:
            return oa.APIError(503, "the request was cancelled: the server is shutting down",
                               headers={"Retry-After": str(self.config.retry_after_s)})
        return oa.APIError(500, "the engine aborted the request")

    def _engine_error(self, err: Exception, greq: Any) -> oa.APIError:
        if isinstance(err, EngineDeadError):  # the engine process is gone; /health says so too
            if getattr(self.engine, "restarting", False) or str(err).startswith(RESTARTING):
                return oa.APIError(503, RESTARTING, code="engine_restarting",
                                   headers={"Retry-After": str(self.config.retry_after_s)})
            return oa.APIError(503, "the engine is not running; the server must be restarted")
        if isinstance(err, KeyError):  # UnknownAdapterError: removed between lookup and submit
            return oa.model_not_found(greq.adapter or self.model_name)
        return oa.APIError(400, str(err))  # ConfigError: e.g. a request that can never fit the pool

    async def events(self, greq: Any) -> AsyncIterator[Any]:
        """The engine's token events of one request. Leaving early (client gone, shutdown)
        closes the engine's stream, which aborts the request and frees its pages."""
        rid = greq.request_id
        self.in_flight.add(rid)
        stream = self.engine.stream(greq)
        try:
            try:
                first = await anext(stream)
            except (KeyError, ConfigError, EngineDeadError) as e:
                raise self._engine_error(e, greq) from None
            yield first
            try:
                async for event in stream:
                    yield event
            except EngineDeadError as e:  # the engine process failed mid-request
                raise self._engine_error(e, greq) from None
        finally:
            self.in_flight.discard(rid)
            await stream.aclose()

    async def collect(self, greq: Any) -> oa.ChoiceOutput:
        out = oa.ChoiceOutput()
        async for event in self.events(greq):
            out.add(event)
        if out.finish_reason == "abort":
            raise self.aborted()
        return out

    async def generate(self, greqs: list) -> list[oa.ChoiceOutput]:
        """Whole results through ``engine.generate`` (the only way to the prompt's logprobs),
        run by the engine's background loop while a worker thread waits; cancelling aborts."""
        ids = [g.request_id for g in greqs]
        self.in_flight.update(ids)
        self.engine.start()
        try:
            results = await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.generate, greqs)
        except (KeyError, ConfigError, EngineDeadError) as e:
            raise self._engine_error(e, greqs[0]) from None
        except asyncio.CancelledError:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finally:
            self.in_flight.difference_update(ids)
        if any(r.finish_reason == "abort" for r in results):
            raise self.aborted()
        return [oa.ChoiceOutput.from_result(r) for r in results]


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Await ``work``; if the client goes away first, cancel it (aborting its engine requests)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while not task.done():
            if await request.is_disconnected():
                task.cancel()
                return
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise oa.APIError(499, "client closed the request") from None
        raise
    finally:
        watcher.cancel()


async def _open_streams(request: Request, srv: _Server, greqs: list) -> list[AsyncIterator[Any]]:
    """Submit every choice and wait for its first event before answering 200, so that engine
    refusals become HTTP errors instead of an error inside an event stream."""
    streams = [srv.events(g) for g in greqs]
    firsts = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        await _unless_disconnected(request, asyncio.gather(*firsts))
    except BaseException:  # one refused, or the client left: close them all (aborting the others)
        for f in firsts:
            f.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        raise
    started = request.scope.get(_STARTED)
    if started is not None:
        srv.metrics.first_token.labels(request.scope["path"]).observe(time.perf_counter() - started)
    return [_prepend(f.result(), s) for f, s in zip(firsts, streams)]


async def _prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    try:
        yield first
        async for event in rest:
            yield event
    finally:
        await rest.aclose()


def create_app(engine: Any, *, config: ServerConfig | None = None, store: AdapterStore | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (and the adapters of ``store``) the OpenAI way:
    ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
    ``GET /metrics``, ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's)."""
    srv = _Server(engine, config or ServerConfig(), store)
    app = FastAPI(title="lightning-lorafusion", lifespan=srv.lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = srv

    @app.exception_handler(oa.APIError)
    async def _api_error(request: Request, err: oa.APIError):
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        return JSONResponse(oa.error_body(err.status_code, str(err.detail)), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, err: Exception):
        log.error("unhandled error on %s", request.url.path, exc_info=err)
        return JSONResponse(oa.error_body(500, "internal server error"), status_code=500)

    app.add_middleware(_CountRequests, metrics=srv.metrics)

    @app.get("/health")
    async def health():
        if srv.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if getattr(srv.engine, "restarting", False):  # an EngineClient starting a new engine process
            return JSONResponse({"status": "restarting"}, status_code=503)
        if not getattr(srv.engine, "alive", True):  # an EngineClient whose engine process died
            return JSONResponse({"status": "engine process gone"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(srv.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        srv.authorize(request)
        if srv.store is not None:
            await asyncio.to_thread(srv.store.scan)
        cards = [oa.model_card(srv.model_name, created=srv.started)]
        for a in sorted(srv.engine.adapters(), key=lambda a: a.name):
            cards.append(srv.adapter_card(a))
        return oa.models_list(cards)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: the token ids the server would run for a completions prompt or chat messages."""
        srv.authorize(request)
        req = oa.parse_request(oa.TokenizeRequest, await srv.read_json(request))
        if req.model is not None:  # optional, as vLLM's: the base's tokenizer serves every adapter
            await srv.resolve_adapter(req.model)  # 404 for an unknown model, as everywhere
        if req.messages is not None:
            prompt = oa.chat_prompt(req, srv.tokenizer)
            ids = oa.text_token_ids(srv.tokenizer, prompt.text) if req.add_special_tokens else prompt.token_ids
        else:
            specials = True if req.add_special_tokens is None else req.add_special_tokens
            ids = oa.text_token_ids(srv.tokenizer, req.prompt, add_special_tokens=specials)
        return {"count": len(ids), "max_model_len": srv.max_model_len, "tokens": list(ids)}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        srv.authorize(request)
        req = oa.parse_request(oa.DetokenizeRequest, await srv.read_json(request))
        if req.model is not None:
            await srv.resolve_adapter(req.model)
        oa.check_token_ids(req.tokens, srv.vocab_size, param="tokens")
        return {"prompt": srv.tokenizer.decode(req.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        """vLLM's: the tokenizer's configuration, for clients that tokenize through this server."""
        srv.authorize(request)
        return oa.tokenizer_info(srv.tokenizer, max_model_len=srv.max_model_len)

    @app.post("/v1/completions")
    async def completions(request: Request):
        srv.authorize(request)
        req = oa.parse_request(oa.CompletionRequest, await srv.read_json(request))
        # the size limit before any work: a list of 50,000 prompts is refused, not tokenized
        if len(req.prompt) * req.n > srv.config.max_n:
            raise oa.APIError(400, f"n x prompts = {len(req.prompt) * req.n} choices; this server allows at most "
                                   f"{srv.config.max_n} per request", param="n")
        adapter = await srv.resolve_adapter(req.model)
        prompts = oa.completion_prompts(req, srv.tokenizer, vocab_size=srv.vocab_size)
        if req.echo and req.stream:
            raise oa.APIError(400, "echo is not supported with stream=true", param="echo")
        if req.max_tokens == 0 and not req.echo:
            raise oa.APIError(400, "max_tokens=0 only scores the prompt: it needs echo=true", param="max_tokens")
        plans = []  # (choice index, prompt, GenerationRequest)
        for p_i, prompt in enumerate(prompts):
            srv.check_prompt(prompt)
            requested = 16 if req.max_tokens is None else req.max_tokens
            max_tokens = oa.resolve_max_tokens(requested, prompt_len=len(prompt.token_ids),
                                               max_model_len=srv.max_model_len, default=None,
                                               limit=srv.config.max_tokens_limit)
            # echo with logprobs: the prompt's logprobs and top-k; max_tokens=0 only scores the prompt
            scoring = req.echo and (req.logprobs is not None or max_tokens == 0)
            for j in range(req.n):
                kwargs = oa.sampling_kwargs(req, max_new_tokens=max_tokens, choice=j, logprobs=req.logprobs,
                                            prompt_logprobs=(req.logprobs or 0) if scoring else None)
                plans.append((p_i * req.n + j, prompt, srv.engine_request(prompt, adapter, kwargs)))
        rid, created = oa.new_id("cmpl"), oa.now()
        greqs = [plan[2] for plan in plans]
        with srv.admitted(greqs):
            if req.stream:
                streams = await _open_streams(request, srv, greqs)
                return _sse(_stream_completion(srv, req, plans, streams, rid, created))
            if req.echo and req.logprobs is not None:  # the prompt's logprobs come with whole results only
                outs = await _unless_disconnected(request, srv.generate(greqs))
            else:
                outs = await _unless_disconnected(request, asyncio.gather(*(srv.collect(g) for g in greqs)))
        choices, completion_tokens = [], 0
        for (index, prompt, _), out in zip(plans, outs):
            completion_tokens += len(out.token_ids)
            choices.append(oa.completion_choice(index, out, srv.tokenizer, prompt=prompt if req.echo else None,
                                                logprobs=req.logprobs))
        prompt_tokens = sum(len(p.token_ids) for p in prompts) * req.n
        return oa.completion_response(request_id=rid, model=req.model, created=created, choices=choices,
                                      prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        srv.authorize(request)
        req = oa.parse_request(oa.ChatCompletionRequest, await srv.read_json(request))
        adapter = await srv.resolve_adapter(req.model)
        if req.n > srv.config.max_n:
            raise oa.APIError(400, f"n={req.n}; this server allows at most {srv.config.max_n}", param="n")
        prompt = oa.chat_prompt(req, srv.tokenizer)
        srv.check_prompt(prompt)
        requested = req.requested_max_tokens()
        if requested == 0:
            raise oa.APIError(400, "max_tokens must be >= 1 for chat completions", param="max_tokens")
        max_tokens = oa.resolve_max_tokens(requested, prompt_len=len(prompt.token_ids),
                                           max_model_len=srv.max_model_len, default=srv.config.default_max_tokens,
                                           limit=srv.config.max_tokens_limit)
        top = (req.top_logprobs or 0) if req.logprobs else None
        greqs = [srv.engine_request(prompt, adapter, oa.sampling_kwargs(req, max_new_tokens=max_tokens, choice=j,
                                                                        logprobs=top))
                 for j in range(req.n)]
        rid, created = oa.new_id("chatcmpl"), oa.now()
        with srv.admitted(greqs):
            if req.stream:
                streams = await _open_streams(request, srv, greqs)
                return _sse(_stream_chat(srv, req, prompt, streams, rid, created))
            outs = await _unless_disconnected(request, asyncio.gather(*(srv.collect(g) for g in greqs)))
        choices = [oa.chat_choice(j, out, srv.tokenizer, logprobs=req.logprobs) for j, out in enumerate(outs)]
        return oa.chat_response(request_id=rid, model=req.model, created=created, choices=choices,
                                prompt_tokens=len(prompt.token_ids) * req.n,
                                completion_tokens=sum(len(o.token_ids) for o in outs))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        srv.authorize(request)
        body = await srv.read_json(request)
        name, path = (body.get("lora_name"), body.get("lora_path")) if isinstance(body, dict) else (None, None)
        if not isinstance(name, str) or (path is not None and not isinstance(path, str)):
            raise oa.APIError(400, "send {'lora_name': str, 'lora_path': str (inside the adapter store)}")
        if srv.store is None:
            raise oa.APIError(400, "this server has no adapter_dir; adapters can only be loaded from its store")
        try:
            await asyncio.to_thread(srv.store.load, name, path)
        except AdapterPathError as e:
            raise oa.APIError(400, str(e), param="lora_path") from None
        except ValueError as e:  # already loaded, or the adapter does not fit the base (ConfigError)
            raise oa.APIError(400, str(e), param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        srv.authorize(request)
        body = await srv.read_json(request)
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str):
            raise oa.APIError(400, "send {'lora_name': str}")
        try:
            if srv.store is not None:
                await asyncio.to_thread(srv.store.unload, name)
            else:
                srv.engine.remove_adapter(name)
        except KeyError:
            raise oa.APIError(404, f"The model `{name}` does not exist.", param="lora_name",
                              code="model_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return app


_STARTED = "lorafusion.started"  # the ASGI scope key: perf_counter() when the request reached the server
_ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
              "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/tokenize", "/detokenize", "/tokenizer_info"}


class _CountRequests:
    """ASGI middleware: counts answers by endpoint and status and times them to the last byte
    (streams included)."""

    def __init__(self, app: Any, metrics: _Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), 500
        scope[_STARTED] = started  # for the time-to-first-token histogram

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            endpoint = scope["path"] if scope["path"] in _ENDPOINTS else "other"
            self.metrics.observe(endpoint, status, started)


class _EventStreamResponse(StreamingResponse):
    """Server-sent events whose generator is always closed when sending stops (a client that
    went away included), so the engine requests behind it are aborted at once."""

    def __init__(self, chunks: AsyncIterator[bytes]):
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


def _sse(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return _EventStreamResponse(chunks)


async def _merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, event) of several event streams as they come; closing it closes them all
    (which aborts what is unfinished)."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for event in stream:
                await queue.put((i, event))
        except Exception as e:  # handed to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _event_stream(srv: _Server, streams: list, *, head: list[bytes], render: Callable[[int, Any], bytes],
                        every_token: bool, usage: Callable[[int], bytes] | None) -> AsyncIterator[bytes]:
    """OpenAI's event stream over the choices' engine events: ``head``, a chunk ``render(choice,
    event)`` per event with text (per token when ``every_token``, for logprobs), ``usage(generated
    tokens)``, ``[DONE]``; an engine abort ends it with an error event instead."""
    for chunk in head:
        yield chunk
    generated = 0
    try:
        async for i, event in _merged(streams):
            if event.finish_reason == "abort":
                raise srv.aborted()
            if event.token_id is not None:
                generated += 1
            if not event.text and event.finish_reason is None and (not every_token or event.token_id is None):
                continue  # a token whose text is held back (stop-string prefix, partial UTF-8)
            yield render(i, event)
    except oa.APIError as e:
        yield oa.sse(e.body())
        return
    if usage is not None:
        yield usage(generated)
    yield oa.SSE_DONE


def _stream_completion(srv: _Server, req: oa.CompletionRequest, plans: list, streams: list, rid: str,
                       created: int) -> AsyncIterator[bytes]:
    include_usage = req.include_usage_in_stream()
    if req.logprobs is None:  # the common case: chunks from a pre-encoded template
        write = oa.ChunkWriter(request_id=rid, model=req.model, created=created, chat=False,
                               with_usage_field=include_usage)

        def render(i: int, event: Any) -> bytes:
            return write(plans[i][0], event.text, event.finish_reason)
    else:
        render = _render_completion_logprobs(srv, req, plans, rid, created, include_usage)

    def usage(generated: int) -> bytes:
        return oa.sse(oa.usage_chunk(request_id=rid, model=req.model, created=created, object_name="text_completion",
                                     prompt_tokens=sum(len(p[1].token_ids) for p in plans),
                                     completion_tokens=generated))

    return _event_stream(srv, streams, head=[], render=render, every_token=req.logprobs is not None,
                         usage=usage if include_usage else None)


def _render_completion_logprobs(srv: _Server, req: oa.CompletionRequest, plans: list, rid: str, created: int,
                                include_usage: bool) -> Callable[[int, Any], bytes]:
    offsets = [0] * len(plans)  # characters streamed per choice: the logprobs' text_offset

    def render(i: int, event: Any) -> bytes:
        lp = oa.stream_event_logprobs(srv.tokenizer, event, chat=False, top=req.logprobs, text_offset=offsets[i])
        offsets[i] += len(event.text)
        return oa.sse(oa.completion_chunk(request_id=rid, model=req.model, created=created, index=plans[i][0],
                                          text=event.text, finish_reason=event.finish_reason, logprobs=lp,
                                          with_usage_field=include_usage))

    return render


def _stream_chat(srv: _Server, req: oa.ChatCompletionRequest, prompt: oa.Prompt, streams: list, rid: str,
                 created: int) -> AsyncIterator[bytes]:
    include_usage = req.include_usage_in_stream()
    top = (req.top_logprobs or 0) if req.logprobs else None

    def chunk(index: int, delta: dict, finish: str | None = None, lp: dict | None = None) -> bytes:
        return oa.sse(oa.chat_chunk(request_id=rid, model=req.model, created=created, index=index, delta=delta,
                                    finish_reason=finish, logprobs=lp, with_usage_field=include_usage))

    if req.logprobs:
        def render(j: int, event: Any) -> bytes:
            lp = oa.stream_event_logprobs(srv.tokenizer, event, chat=True, top=top)
            return chunk(j, {"content": event.text} if event.text else {}, event.finish_reason, lp)
    else:  # the common case: chunks from a pre-encoded template
        write = oa.ChunkWriter(request_id=rid, model=req.model, created=created, chat=True,
                               with_usage_field=include_usage)

        def render(j: int, event: Any) -> bytes:
            return write(j, event.text or None, event.finish_reason)

    def usage(generated: int) -> bytes:
        return oa.sse(oa.usage_chunk(request_id=rid, model=req.model, created=created,
                                     object_name="chat.completion.chunk",
                                     prompt_tokens=len(prompt.token_ids) * len(streams), completion_tokens=generated))

    head = [chunk(j, {"role": "assistant", "content": ""}) for j in range(len(streams))]
    return _event_stream(srv, streams, head=head, render=render, every_token=req.logprobs,
                         usage=usage if include_usage else None)
