"""The OpenAI routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (whole answers
or server-sent events), translated by ``openai_api``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from . import openai_api as oa
from .event_streams import event_stream_response, open_streams, stream_chat, stream_completion, unless_disconnected
from .server_state import state_of

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    srv = state_of(request)
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
            streams = await open_streams(request, srv, greqs)
            return event_stream_response(stream_completion(srv, req, plans, streams, rid, created))
        if req.echo and req.logprobs is not None:  # the prompt's logprobs come with whole results only
            outs = await unless_disconnected(request, srv.generate(greqs))
        else:
            outs = await unless_disconnected(request, asyncio.gather(*(srv.collect(g) for g in greqs)))
    choices, completion_tokens = [], 0
    for (index, prompt, _), out in zip(plans, outs):
        completion_tokens += len(out.token_ids)
        choices.append(oa.completion_choice(index, out, srv.tokenizer, prompt=prompt if req.echo else None,
                                            logprobs=req.logprobs))
    prompt_tokens = sum(len(p.token_ids) for p in prompts) * req.n
    return oa.completion_response(request_id=rid, model=req.model, created=created, choices=choices,
                                  prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    srv = state_of(request)
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
            streams = await open_streams(request, srv, greqs)
            return event_stream_response(stream_chat(srv, req, prompt, streams, rid, created))
        outs = await unless_disconnected(request, asyncio.gather(*(srv.collect(g) for g in greqs)))
    choices = [oa.chat_choice(j, out, srv.tokenizer, logprobs=req.logprobs) for j, out in enumerate(outs)]
    return oa.chat_response(request_id=rid, model=req.model, created=created, choices=choices,
                            prompt_tokens=len(prompt.token_ids) * req.n,
                            completion_tokens=sum(len(o.token_ids) for o in outs))
