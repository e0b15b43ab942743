"""Server-sent event streams of completions and chat: opening the choices' engine streams (engine
refusals become HTTP errors before the 200), merging them, and rendering OpenAI's chunks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from . import openai_api as oa
from .server_metrics import STARTED
from .server_state import ServerState


async def unless_disconnected(request: Request, work: Any) -> Any:
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


async def open_streams(request: Request, srv: ServerState, greqs: list) -> list[AsyncIterator[Any]]:
    """Submit every choice and wait for its first event before answering 200, so that engine
    refusals become HTTP errors instead of an error inside an event stream."""
    streams = [srv.events(g) for g in greqs]
    firsts = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        await unless_disconnected(request, asyncio.gather(*firsts))
    except BaseException:  # one refused, or the client left: close them all (aborting the others)
        for f in firsts:
            f.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        raise
    started = request.scope.get(STARTED)
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


def event_stream_response(chunks: AsyncIterator[bytes]) -> StreamingResponse:
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


async def _event_stream(srv: ServerState, streams: list, *, head: list[bytes], render: Callable[[int, Any], bytes],
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


def stream_completion(srv: ServerState, req: oa.CompletionRequest, plans: list, streams: list, rid: str,
                       created: int) -> AsyncIterator[bytes]:
    include_usage = req.include_usage_in_stream()
    if req.logprobs is None:  # the common case: chunks from a pre-encoded template
        write = oa.ChunkWriter(request_id=rid, model=req.model, created=created, chat=False,
                               with_usage_field=include_usage)

        def render(i: int, event: Any) -> bytes:
            return write(plans[i][0], event.text, event.finish_reason, _last_version(event))
    else:
        render = _render_completion_logprobs(srv, req, plans, rid, created, include_usage)

    def usage(generated: int) -> bytes:
        return oa.sse(oa.usage_chunk(request_id=rid, model=req.model, created=created, object_name="text_completion",
                                     prompt_tokens=sum(len(p[1].token_ids) for p in plans),
                                     completion_tokens=generated))

    return _event_stream(srv, streams, head=[], render=render, every_token=req.logprobs is not None,
                         usage=usage if include_usage else None)


def _render_completion_logprobs(srv: ServerState, req: oa.CompletionRequest, plans: list, rid: str, created: int,
                                include_usage: bool) -> Callable[[int, Any], bytes]:
    offsets = [0] * len(plans)  # characters streamed per choice: the logprobs' text_offset

    def render(i: int, event: Any) -> bytes:
        lp = oa.stream_event_logprobs(srv.tokenizer, event, chat=False, top=req.logprobs, text_offset=offsets[i])
        offsets[i] += len(event.text)
        return oa.sse(oa.completion_chunk(request_id=rid, model=req.model, created=created, index=plans[i][0],
                                          text=event.text, finish_reason=event.finish_reason, logprobs=lp,
                                          with_usage_field=include_usage, adapter_version=_last_version(event)))

    return render


def stream_chat(srv: ServerState, req: oa.ChatCompletionRequest, prompt: oa.Prompt, streams: list, rid: str,
                 created: int) -> AsyncIterator[bytes]:
    include_usage = req.include_usage_in_stream()
    top = (req.top_logprobs or 0) if req.logprobs else None

    def chunk(index: int, delta: dict, finish: str | None = None, lp: dict | None = None,
              version: int | None = None) -> bytes:
        return oa.sse(oa.chat_chunk(request_id=rid, model=req.model, created=created, index=index, delta=delta,
                                    finish_reason=finish, logprobs=lp, with_usage_field=include_usage,
                                    adapter_version=version))

    if req.logprobs:
        def render(j: int, event: Any) -> bytes:
            lp = oa.stream_event_logprobs(srv.tokenizer, event, chat=True, top=top)
            return chunk(j, {"content": event.text} if event.text else {}, event.finish_reason, lp,
                         _last_version(event))
    else:  # the common case: chunks from a pre-encoded template
        write = oa.ChunkWriter(request_id=rid, model=req.model, created=created, chat=True,
                               with_usage_field=include_usage)

        def render(j: int, event: Any) -> bytes:
            return write(j, event.text or None, event.finish_reason, _last_version(event))

    def usage(generated: int) -> bytes:
        return oa.sse(oa.usage_chunk(request_id=rid, model=req.model, created=created,
                                     object_name="chat.completion.chunk",
                                     prompt_tokens=len(prompt.token_ids) * len(streams), completion_tokens=generated))

    head = [chunk(j, {"role": "assistant", "content": ""}) for j in range(len(streams))]
    return _event_stream(srv, streams, head=head, render=render, every_token=req.logprobs,
                         usage=usage if include_usage else None)


def _last_version(event: Any) -> int | None:
    """The adapter version a choice's last chunk carries (its finishing event's); None before."""
    return None if event.finish_reason is None else event.adapter_version
