"""``ServerState``: what the routes of one app share (the engine, the adapter store, limits,
metrics, requests in flight) and the request plumbing they have in common: API key, body
limits, adapter lookup, admission, engine streams and whole results."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from ..specs import ConfigError
from . import openai_api as oa
from .adapter_store import AdapterStore
from .engine_process import RESTARTING, EngineDeadError
from .server_config import ServerConfig
from .server_metrics import ServerMetrics

log = logging.getLogger(__name__)


class ServerState:
    """State behind one app: the engine, the store, limits, metrics, requests in flight."""

    def __init__(self, engine: Any, config: ServerConfig, store: AdapterStore | None):
        from . import GenerationRequest, SamplingParams

        self.engine, self.config, self.store = engine, config, store
        self._GenerationRequest, self._SamplingParams = GenerationRequest, SamplingParams
        self.model_name = config.served_model_name or "base"
        self.tokenizer = engine.tokenizer
        self.max_model_len = int(engine.max_model_len)
        self.vocab_size = int(engine.model_config.vocab_size)
        self.metrics = ServerMetrics(engine)
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
                                 rank=a.rank, alpha=a.alpha, target_modules=a.target_modules,
                                 adapter_version=getattr(a, "version", None))
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


def state_of(request: Request) -> ServerState:
    """The state of the app ``request`` reached (``create_app`` puts it on ``app.state.server``)."""
    return request.app.state.server
