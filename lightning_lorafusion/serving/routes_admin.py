"""The routes beside generation: ``GET /health``, ``GET /metrics``, ``GET /v1/models``, vLLM's
``/v1/load_lora_adapter`` (with ``replace``: an in-place update) and ``/v1/unload_lora_adapter``,
and ``/tokenize``, ``/detokenize``, ``/tokenizer_info``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from . import openai_api as oa
from .adapter_store import AdapterPathError
from .server_state import state_of

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    srv = state_of(request)
    if srv.closing:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    if getattr(srv.engine, "restarting", False):  # an EngineClient starting a new engine process
        return JSONResponse({"status": "restarting"}, status_code=503)
    if not getattr(srv.engine, "alive", True):  # an EngineClient whose engine process died
        return JSONResponse({"status": "engine process gone"}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request):
    srv = state_of(request)
    return Response(generate_latest(srv.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request):
    srv = state_of(request)
    srv.authorize(request)
    if srv.store is not None:
        await asyncio.to_thread(srv.store.scan)
    cards = [oa.model_card(srv.model_name, created=srv.started)]
    for a in sorted(srv.engine.adapters(), key=lambda a: a.name):
        cards.append(srv.adapter_card(a))
    return oa.models_list(cards)


@router.post("/tokenize")
async def tokenize(request: Request):
    """vLLM's: the token ids the server would run for a completions prompt or chat messages."""
    srv = state_of(request)
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


@router.post("/detokenize")
async def detokenize(request: Request):
    srv = state_of(request)
    srv.authorize(request)
    req = oa.parse_request(oa.DetokenizeRequest, await srv.read_json(request))
    if req.model is not None:
        await srv.resolve_adapter(req.model)
    oa.check_token_ids(req.tokens, srv.vocab_size, param="tokens")
    return {"prompt": srv.tokenizer.decode(req.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    """vLLM's: the tokenizer's configuration, for clients that tokenize through this server."""
    srv = state_of(request)
    srv.authorize(request)
    return oa.tokenizer_info(srv.tokenizer, max_model_len=srv.max_model_len)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request):
    srv = state_of(request)
    srv.authorize(request)
    body = await srv.read_json(request)
    name, path = (body.get("lora_name"), body.get("lora_path")) if isinstance(body, dict) else (None, None)
    replace = body.get("replace", False) if isinstance(body, dict) else False
    if not isinstance(name, str) or (path is not None and not isinstance(path, str)) or not isinstance(replace, bool):
        raise oa.APIError(400, "send {'lora_name': str, 'lora_path': str (inside the adapter store), "
                               "'replace': bool (optional: update a loaded adapter's weights in place)}")
    if srv.store is None:
        raise oa.APIError(400, "this server has no adapter_dir; adapters can only be loaded from its store")
    try:
        info = await asyncio.to_thread(srv.store.load, name, path, replace=replace)
    except AdapterPathError as e:
        raise oa.APIError(400, str(e), param="lora_path") from None
    except ValueError as e:  # already loaded, or the adapter does not fit the base (ConfigError)
        raise oa.APIError(400, str(e), param="lora_name") from None
    version = getattr(info, "version", None)
    if replace:
        return PlainTextResponse(f"Success: LoRA adapter '{name}' updated in place to version {version}.")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    srv = state_of(request)
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
