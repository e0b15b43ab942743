"""Engine outputs -> OpenAI API responses: one choice's accumulated output, completion and chat
responses with logprobs and usage, server-sent event chunks, and the models list. Pure functions
over dicts and engine types: no HTTP, no engine loop."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .openai_schemas import Prompt

SSE_DONE = b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------
# what one choice generated


@dataclass
class ChoiceOutput:
    """One choice's output, accumulated from the engine's token events (or a finished result):
    token ids, detokenized text, per-token logprobs / top-k and the prompt's logprobs for echo."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    adapter_version: int | None = None  # the version of the adapter that generated it (None: the base)

    def add(self, event: Any) -> None:
        """Fold in one ``TokenEvent``."""
        self.adapter_version = event.adapter_version
        if event.token_id is not None:
            self.token_ids.append(event.token_id)
            if event.logprob is not None:
                self.logprobs.append(event.logprob)
            if event.top_logprobs is not None:
                self.top_logprobs.append(dict(event.top_logprobs))
        self.text += event.text
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason

    @classmethod
    def from_result(cls, result: Any) -> "ChoiceOutput":
        """From a finished ``GenerationResult``."""
        return cls(token_ids=list(result.token_ids), text=result.text, finish_reason=result.finish_reason,
                   logprobs=list(result.logprobs or ()), top_logprobs=[dict(d) for d in result.top_logprobs or ()],
                   prompt_logprobs=None if result.prompt_logprobs is None else list(result.prompt_logprobs),
                   prompt_top_logprobs=None if result.prompt_top_logprobs is None
                   else list(result.prompt_top_logprobs), adapter_version=result.adapter_version)


# ---------------------------------------------------------------------------------------------
# responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[float | None],
                        top_logprobs: Sequence[dict[int, float] | None] | None, *, text_offset: int = 0) -> dict:
    """The legacy completions ``logprobs`` object: ``tokens``, ``token_logprobs``, ``top_logprobs``
    (token text -> logprob; None where unknown, e.g. the first prompt token) and ``text_offset``
    (each token's character offset in the returned text, from the tokens' own texts)."""
    tokens = [token_text(tokenizer, t) for t in token_ids]
    offsets = []
    pos = text_offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    tops = None if top_logprobs is None else [
        None if d is None else {token_text(tokenizer, k): v for k, v in d.items()} for d in top_logprobs
    ]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": tops, "text_offset": offsets}


def completion_choice(index: int, out: ChoiceOutput, tokenizer: Any, *, prompt: Prompt | None,
                      logprobs: int | None) -> dict:
    """One ``choices[i]`` of a (non-streamed) completion; ``prompt`` given = echo."""
    text = (prompt.text if prompt is not None else "") + out.text
    lp = None
    if logprobs is not None:
        ids: list[int] = []
        lps: list[float | None] = []
        tops: list[dict[int, float] | None] = []
        if prompt is not None:
            ids += prompt.token_ids
            lps += out.prompt_logprobs if out.prompt_logprobs is not None else [None] * len(prompt.token_ids)
            tops += out.prompt_top_logprobs or [None] * len(prompt.token_ids)
        ids += out.token_ids
        lps += out.logprobs
        tops += out.top_logprobs if out.top_logprobs else [None] * len(out.token_ids)
        lp = completion_logprobs(tokenizer, ids, lps, tops if logprobs > 0 else None)
    return _versioned({"index": index, "text": text, "logprobs": lp, "finish_reason": out.finish_reason},
                      out.adapter_version)


def _versioned(choice: dict, adapter_version: int | None) -> dict:
    """A choice naming the adapter version that generated it (an extra field OpenAI clients
    ignore; absent for the base model, which has no versions)."""
    if adapter_version is not None:
        choice["adapter_version"] = adapter_version
    return choice


def completion_response(*, request_id: str, model: str, created: int, choices: list[dict],
                        prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[float],
                  top_logprobs: Sequence[dict[int, float]] | None) -> dict:
    """Chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``."""
    def entry(tid: int, value: float) -> dict:
        text = token_text(tokenizer, tid)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    content = []
    for i, (tid, value) in enumerate(zip(token_ids, logprobs)):
        e = entry(tid, value)
        top = top_logprobs[i] if top_logprobs else {}
        e["top_logprobs"] = [entry(k, v) for k, v in sorted(top.items(), key=lambda kv: -kv[1])]
        content.append(e)
    return {"content": content}


def chat_choice(index: int, out: ChoiceOutput, tokenizer: Any, *, logprobs: bool) -> dict:
    lp = chat_logprobs(tokenizer, out.token_ids, out.logprobs, out.top_logprobs) if logprobs else None
    return _versioned({"index": index, "message": {"role": "assistant", "content": out.text}, "logprobs": lp,
                       "finish_reason": out.finish_reason}, out.adapter_version)


def chat_response(*, request_id: str, model: str, created: int, choices: list[dict], prompt_tokens: int,
                  completion_tokens: int) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


# ---------------------------------------------------------------------------------------------
# streaming (server-sent events in OpenAI's chunk format)


def sse(data: dict) -> bytes:
    """One server-sent event carrying a JSON chunk."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def _chunk(*, request_id: str, model: str, created: int, object_name: str, choice: dict,
           with_usage_field: bool) -> dict:
    chunk = {"id": request_id, "object": object_name, "created": created, "model": model, "choices": [choice]}
    if with_usage_field:  # with include_usage, every chunk but the last carries "usage": null
        chunk["usage"] = None
    return chunk


def completion_chunk(*, request_id: str, model: str, created: int, index: int, text: str,
                     finish_reason: str | None, logprobs: dict | None = None, with_usage_field: bool = False,
                     adapter_version: int | None = None) -> dict:
    choice = _versioned({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason},
                        adapter_version)
    return _chunk(request_id=request_id, model=model, created=created, object_name="text_completion", choice=choice,
                  with_usage_field=with_usage_field)


def chat_chunk(*, request_id: str, model: str, created: int, index: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None = None, with_usage_field: bool = False,
               adapter_version: int | None = None) -> dict:
    choice = _versioned({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason},
                        adapter_version)
    return _chunk(request_id=request_id, model=model, created=created, object_name="chat.completion.chunk",
                  choice=choice, with_usage_field=with_usage_field)


class ChunkWriter:
    """``sse(completion_chunk(...))`` / ``sse(chat_chunk(...))`` of one streamed response, byte for
    byte, for the chunks without logprobs (one per token): the parts that never change in the
    response are encoded once, so a token costs one ``json.dumps`` of its text. Keys in the
    order ``_chunk``, ``completion_chunk`` and ``chat_chunk`` build them (a test compares)."""

    def __init__(self, *, request_id: str, model: str, created: int, chat: bool, with_usage_field: bool):
        dumps = json.dumps
        kind = "chat.completion.chunk" if chat else "text_completion"
        self._head = (f'data: {{"id":{dumps(request_id)},"object":"{kind}","created":{dumps(created)},'
                      f'"model":{dumps(model)},"choices":[{{"index":').encode()
        self._tail = b"}]" + (b',"usage":null' if with_usage_field else b"") + b"}\n\n"
        self._chat = chat
        self._index: dict[int, bytes] = {}

    def __call__(self, index: int, text: str | None, finish_reason: str | None,
                 adapter_version: int | None = None) -> bytes:
        """The chunk of choice ``index``; for chat, ``text=None`` is an empty delta ``{}``;
        ``adapter_version`` (given on a choice's last chunk) is added to the choice."""
        head = self._index.get(index)
        if head is None:
            head = self._index[index] = self._head + str(index).encode()
        if self._chat:
            body = b',"delta":{}' if text is None else b',"delta":{"content":' + json.dumps(text).encode() + b"}"
        else:
            body = b',"text":' + json.dumps(text).encode()
        reason = b"null" if finish_reason is None else json.dumps(finish_reason).encode()
        if adapter_version is not None:
            reason += b',"adapter_version":' + str(int(adapter_version)).encode()
        return head + body + b',"logprobs":null,"finish_reason":' + reason + self._tail


def usage_chunk(*, request_id: str, model: str, created: int, object_name: str, prompt_tokens: int,
                completion_tokens: int) -> dict:
    """The extra last chunk of ``stream_options.include_usage``: no choices, the whole usage."""
    return {"id": request_id, "object": object_name, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def stream_event_logprobs(tokenizer: Any, event: Any, *, chat: bool, top: int | None,
                          text_offset: int = 0) -> dict | None:
    """The ``logprobs`` of one streamed token event (None when the event carries no token)."""
    if event.token_id is None or event.logprob is None:
        return None
    tops = [dict(event.top_logprobs or {})] if top else None
    if chat:
        return chat_logprobs(tokenizer, [event.token_id], [event.logprob], tops)
    return completion_logprobs(tokenizer, [event.token_id], [event.logprob], tops, text_offset=text_offset)


# ---------------------------------------------------------------------------------------------
# models list


def model_card(name: str, *, created: int, root: str | None = None, parent: str | None = None,
               rank: int | None = None, alpha: float | None = None, target_modules: Sequence[str] | None = None,
               adapter_version: int | None = None) -> dict:
    """One ``/v1/models`` entry; adapters carry ``parent`` (the base), their LoRA shape and
    ``adapter_version`` (up by one at each in-place update)."""
    card: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "lightning-lorafusion",
                            "root": root, "parent": parent}
    if rank is not None:
        card["lora"] = {"rank": rank, "alpha": alpha, "target_modules": list(target_modules or ())}
    if adapter_version is not None:
        card["adapter_version"] = adapter_version
    return card


def models_list(cards: list[dict]) -> dict:
    return {"object": "list", "data": cards}
