"""The OpenAI-compatible HTTP app over the generation engine (FastAPI): ``create_app`` wires the
app's state, error handlers, metrics middleware and routes (``routes_openai``, ``routes_admin``).
Translation lives in ``openai_api``, streaming in ``event_streams``."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import openai_api as oa
from . import routes_admin, routes_openai
from .adapter_store import AdapterStore
from .server_config import ServerConfig
from .server_metrics import CountRequests
from .server_state import ServerState

__all__ = ["ServerConfig", "create_app"]

log = logging.getLogger(__name__)


def _error_response(err: oa.APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def create_app(engine: Any, *, config: ServerConfig | None = None, store: AdapterStore | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (and the adapters of ``store``) the OpenAI way:
    ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
    ``GET /metrics``, ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's)."""
    srv = ServerState(engine, config or ServerConfig(), store)
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

    app.add_middleware(CountRequests, metrics=srv.metrics)

    app.include_router(routes_admin.router)
    app.include_router(routes_openai.router)
    return app
