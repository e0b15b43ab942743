"""OpenAI API requests -> engine inputs: the request models and their validation, errors in
OpenAI's shape, prompts (completions, chat, tokenize), sampling parameters and token limits.
Pure functions over dicts and engine types: no HTTP, no engine loop."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# OpenAI's own bound for top-k logprobs in chat (completions allow 5; vLLM 20): one bound for both
MAX_TOP_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
# integers beyond what the engine's step tensors hold are refused here as a 400 naming the field
# (the engine checks them again: SamplingParams / Engine.submit)
MAX_INT32 = (1 << 31) - 1
INT64 = (-(1 << 63), (1 << 63) - 1)
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")


# ---------------------------------------------------------------------------------------------
# errors


class APIError(Exception):
    """An error answered to the client in OpenAI's JSON shape with an HTTP status."""

    _TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
              503: "service_unavailable_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API answers errors."""
    kind = APIError._TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


# ---------------------------------------------------------------------------------------------
# request models


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions. Unknown fields are ignored (clients send
    ``user`` and the like); known OpenAI features this server does not implement are refused."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0, le=MAX_INT32)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_INT32)  # vLLM's extension; 0 = off
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_INT32)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's JSON) -> bias in [-100, 100]
    repetition_penalty: float = Field(1.0, gt=0.0, le=1e6)  # vLLM's extension; 1 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM's extension; 0 = off
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)  # vLLM's extension: no stop before this many tokens
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_SEQUENCES)  # vLLM's extension

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, v):
        if not v:
            return None
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens")
        for key, bias in v.items():
            if _TOKEN_ID_KEY.fullmatch(key.strip()) is None:  # ASCII digits: "²" is a digit to str.isdigit
                raise ValueError(f"logit_bias keys are token ids (0 to {MAX_INT32}); got {key[:20]!r}")
            if int(key) > MAX_INT32:
                raise ValueError(f"logit_bias keys are token ids (0 to {MAX_INT32}); got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100]; got {bias} for token {key}")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def stop_sequences(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt``: a string, a list of strings, a list of token ids or a list
    of token-id lists (what lm-eval-harness sends); each prompt yields ``n`` choices."""

    prompt: Any
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_INT32)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v):
        def is_ids(x):
            return isinstance(x, list) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in x)

        if isinstance(v, str):
            return [v]
        if is_ids(v):
            return [v]
        if isinstance(v, list) and v and (all(isinstance(x, str) for x in v) or all(is_ids(x) for x in v)):
            return v
        raise ValueError("prompt must be a string, a list of strings, a non-empty list of token ids "
                         "or a list of non-empty token-id lists")

    @model_validator(mode="after")
    def _completion_only(self):
        if self.best_of not in (None, self.n):
            raise ValueError("best_of is not supported by this server (leave it unset or equal to n)")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions; the prompt is the tokenizer's chat template over ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_INT32)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_only(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.tools or self.tool_choice not in (None, "none"):
            raise ValueError("tools are not supported by this server")
        if self.response_format and self.response_format.get("type") != "text":
            raise ValueError("response_format other than {'type': 'text'} is not supported by this server")
        for m in self.messages:
            m.text()  # refuses non-text content parts here, as a 400
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_request(cls: type[BaseModel], body: Any):
    """Validate a decoded JSON body into ``cls``; a mistake becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = [str(x) for x in err["loc"]]
        param = loc[0] if loc else None
        msg = err["msg"].removeprefix("Value error, ")
        where = ".".join(loc)
        raise APIError(400, f"{where}: {msg}" if where else msg, param=param) from None


# ---------------------------------------------------------------------------------------------
# prompts


@dataclass(frozen=True)
class Prompt:
    """One prompt as the engine sees it (token ids) and as echo returns it (text)."""

    token_ids: tuple[int, ...]
    text: str


def completion_prompts(req: CompletionRequest, tokenizer: Any, *, vocab_size: int) -> list[Prompt]:
    """Tokenize (strings, with the tokenizer's special tokens as HF does by default) or check
    (token ids must be in ``[0, vocab_size)``) every prompt of a completions request."""
    prompts = []
    for p in req.prompt:
        if isinstance(p, str):
            ids = text_token_ids(tokenizer, p)
            if not ids:
                raise APIError(400, "prompt: an empty prompt has no token to condition on", param="prompt")
            prompts.append(Prompt(ids, p))
        else:
            check_token_ids(p, vocab_size, param="prompt")
            prompts.append(Prompt(tuple(p), tokenizer.decode(p)))
    return prompts


def text_token_ids(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> tuple[int, ...]:
    """A text prompt's token ids, with the tokenizer's special tokens as HF adds them by default
    (what completions run, and what /tokenize reports unless told ``add_special_tokens=False``)."""
    return tuple(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def tokenizer_info(tokenizer: Any, *, max_model_len: int) -> dict[str, Any]:
    """GET /tokenizer_info (vLLM's): the tokenizer's configuration as ``tokenizer_config.json``
    holds it, what a remote-tokenizer client (lm-eval's ``tokenizer_backend=remote``) reads:
    ``tokenizer_class``, the special tokens' texts, ``chat_template``, ``model_max_length``."""
    def text(token: Any) -> str | None:
        return None if token is None else str(token)

    info: dict[str, Any] = {
        "tokenizer_class": type(tokenizer).__name__,
        "model_max_length": max_model_len,
        "chat_template": getattr(tokenizer, "chat_template", None) or None,
        "add_bos_token": getattr(tokenizer, "add_bos_token", None),
        "add_eos_token": getattr(tokenizer, "add_eos_token", None),
        "padding_side": getattr(tokenizer, "padding_side", None),
        "truncation_side": getattr(tokenizer, "truncation_side", None),
        "clean_up_tokenization_spaces": getattr(tokenizer, "clean_up_tokenization_spaces", None),
    }
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = text(getattr(tokenizer, name, None))
    extra = getattr(tokenizer, "additional_special_tokens", None)
    info["additional_special_tokens"] = [str(t) for t in extra] if extra else []
    return info


def check_token_ids(ids: Any, vocab_size: int, *, param: str) -> None:
    """A 400 naming ``param`` for the first id outside ``[0, vocab_size)``."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"{param}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param=param)


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): ``prompt`` as completions tokenize it, or ``messages`` as chat
    completions do (``add_generation_prompt``, default true). ``model`` is optional (the base;
    the tokenizer is the base's for every adapter); ``add_special_tokens`` defaults, as vLLM's,
    to true for a prompt and false for messages (the chat template writes its own)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids -> text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, min_length=1)
    tokens: list[int]


def chat_prompt(req: ChatCompletionRequest | TokenizeRequest, tokenizer: Any) -> Prompt:
    """The base tokenizer's own chat template over the messages, with the generation prompt
    (a TokenizeRequest may leave it out)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "the served model's tokenizer has no chat template; use /v1/completions",
                       param="messages")
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=getattr(req, "add_generation_prompt", True),
                                            tokenize=True, return_dict=True)
    except Exception as e:  # jinja raises on roles or orders a template refuses
        raise APIError(400, f"messages: the chat template refused them: {e}", param="messages") from None
    ids = out["input_ids"] if not isinstance(out, list) else out
    return Prompt(tuple(int(t) for t in ids), tokenizer.decode(ids))


# ---------------------------------------------------------------------------------------------
# sampling


def sampling_kwargs(req: _SamplingFields, *, max_new_tokens: int, choice: int, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> dict[str, Any]:
    """Keyword arguments of the engine's ``SamplingParams`` for choice ``choice`` of ``n``: with a
    ``seed``, choice i samples with ``seed + i`` (reproducible and distinct); without, independently.
    ``prompt_logprobs``: top-k of every prompt position (for echo); with it ``max_new_tokens``
    may be 0 (score the prompt only)."""
    return {
        "max_new_tokens": max_new_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "seed": None if req.seed is None else req.seed + choice,
        "stop": req.stop_sequences(),
        "ignore_eos": req.ignore_eos,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "logit_bias": {int(k): b for k, b in (req.logit_bias or {}).items()},
        "min_p": req.min_p,
        "min_tokens": req.min_tokens,
        "stop_token_ids": tuple(req.stop_token_ids or ()),
    }


def resolve_max_tokens(requested: int | None, *, prompt_len: int, max_model_len: int, default: int | None,
                       limit: int) -> int:
    """How many tokens to generate: the request's, else ``default`` (None: what fits in the
    context); refused with a 400 when the prompt plus it exceed the context or ``limit``."""
    room = max_model_len - prompt_len
    if room < 0 or (room == 0 and requested != 0):
        raise APIError(400, f"prompt is {prompt_len} tokens; this model's context is {max_model_len} tokens",
                       param="prompt", code="context_length_exceeded")
    if requested is None:
        return min(room, limit, default if default is not None else room)
    if requested > limit:
        raise APIError(400, f"max_tokens: {requested} is above this server's limit of {limit}", param="max_tokens")
    if requested > room:
        raise APIError(400, f"max_tokens: prompt ({prompt_len} tokens) + max_tokens ({requested}) exceed "
                            f"this model's context of {max_model_len} tokens", param="max_tokens",
                       code="context_length_exceeded")
    return requested
