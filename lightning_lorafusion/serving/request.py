"""A generation request, its streamed events and final result, and its state inside the engine."""

from __future__ import annotations

import enum
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from ..specs import ConfigError
from .adapters import HostAdapter
from .detokenize import IncrementalDetokenizer
from .pool import ResidentAdapter
from .sampling import SamplingParams


def _new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One prompt (token ids), the adapter to apply (None = the base model) and how to sample."""

    prompt_token_ids: tuple[int, ...]
    adapter: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=_new_request_id)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ConfigError(f"request {self.request_id!r}: prompt_token_ids is empty")


class TokenEvent(NamedTuple):
    """One generated token (``token_id``) and its text delta; the request's last event has
    ``finish_reason`` set (and may carry no token, e.g. after an abort). A named tuple
    (immutable): the engine makes one per running request per step, and ``TokenEvent._make``
    costs a third of a frozen dataclass's constructor."""

    request_id: str
    token_id: int | None
    text: str
    logprob: float | None
    top_logprobs: dict[int, float] | None
    finish_reason: str | None
    # the version of the request's adapter it runs on (fixed when it was submitted); None: the base
    adapter_version: int | None = None


@dataclass(frozen=True)
class GenerationResult:
    """A finished request. ``timings``: queued_s (arrival to first scheduled), ttft_s (arrival
    to first token), total_s (arrival to finish)."""

    request_id: str
    adapter: str | None
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    prompt_logprobs: list[float | None] | None
    timings: dict[str, float]
    # per prompt position the top-k logprobs (k = SamplingParams.prompt_logprobs; None first)
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    adapter_version: int | None = None  # the adapter's version it ran on (None: the base)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class RequestState:
    """What the engine tracks for one request. Tokens ``all_ids[:num_cached]`` have their keys
    and values in ``pages``; the next forward feeds ``all_ids[num_cached:]``."""

    request: GenerationRequest
    adapter: HostAdapter | None
    detokenizer: IncrementalDetokenizer
    seed: int | None  # sampled requests' seed in [0, 2^62) (sampling.uniform_draws); None when greedy
    eos_token_ids: frozenset[int]
    max_total_len: int  # prompt + generated may not exceed this (the model's context)
    on_event: Callable[[TokenEvent], None] | None = None
    arrival: float = field(default_factory=time.perf_counter)
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose KV is in the pages
    page_keys: list[bytes] = field(default_factory=list)  # prefix keys of its full pages (prefix caching)
    resident: ResidentAdapter | None = None  # set while running with an adapter
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    # prompt logprobs of the prefill chunks run so far (set complete into the two fields above)
    partial_prompt_logprobs: tuple[list[float | None], list[dict[int, float] | None]] | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_preemptions: int = 0
    queued_step: int = 0  # the scheduler's step count when it (last) joined the queue
    cacheable: bool = True  # its full pages may enter the prefix cache (False once its KV is suspect)
    rope_salt: bytes = b""  # LongRoPE: the factors its prefix pages were written with (scheduler)
    # what ends it, fixed at creation (checked for every row of every step)
    stop_ids: frozenset[int] = field(init=False)  # eos_token_ids and the request's stop_token_ids
    max_output: int = field(init=False)  # generated tokens that end it ("length"): max_new_tokens or the context
    # how it samples, fixed at creation (read for every row whenever a step's rows change)
    greedy: bool = field(init=False)
    adjusts_logits: bool = field(init=False)  # logit bias or penalties

    def __post_init__(self) -> None:
        sp = self.request.sampling
        if sp.logprobs is not None:
            self.logprobs, self.top_logprobs = [], []
        self.stop_ids = self.eos_token_ids | frozenset(sp.stop_token_ids)
        self.max_output = min(sp.max_new_tokens, self.max_total_len - len(self.request.prompt_token_ids))
        self.greedy, self.adjusts_logits = sp.greedy, sp.adjusts_logits

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def adapter_version(self) -> int | None:
        return None if self.adapter is None else self.adapter.version

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def all_ids(self) -> list[int]:
        return list(self.request.prompt_token_ids) + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.request.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling.prompt_logprobs is not None and self.prompt_logprobs is None

    def result(self) -> GenerationResult:
        assert self.finish_reason is not None, "result of an unfinished request"
        t0 = self.arrival
        timings = {"queued_s": (self.first_scheduled or self.finished) - t0,
                   "ttft_s": (self.first_token or self.finished) - t0, "total_s": self.finished - t0}
        return GenerationResult(
            request_id=self.request_id, adapter=self.request.adapter,
            prompt_token_ids=self.request.prompt_token_ids, token_ids=tuple(self.output_ids),
            text=self.detokenizer.text, finish_reason=self.finish_reason, logprobs=self.logprobs,
            top_logprobs=self.top_logprobs, prompt_logprobs=self.prompt_logprobs, timings=timings,
            prompt_top_logprobs=self.prompt_top_logprobs, adapter_version=self.adapter_version)
