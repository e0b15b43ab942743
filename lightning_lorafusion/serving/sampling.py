"""Sampling parameters of a request and the sampler: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..specs import ConfigError

MAX_LOGPROBS = 20


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature`` 0 is greedy (argmax); otherwise logits are divided by it, then ``top_k``
    (0 = off) and ``top_p`` (1 = off) filter, in that order (HF's order). ``seed`` fixes the
    request's own random stream, so the same seed gives the same tokens whatever else is in
    the batch. ``logprobs``: return the chosen token's logprob and the ``logprobs`` most likely
    (0 = only the chosen one). ``prompt_logprobs``: the same for every prompt token given the
    ones before it (``True`` = 0: the prompt tokens' own logprobs only; ``None``/``False`` = off);
    with it, ``max_new_tokens=0`` scores the prompt and generates nothing. Logprobs are of the
    model's distribution (log-softmax of the raw logits), before temperature and filtering.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        prompt_k = self.prompt_logprobs
        if isinstance(prompt_k, bool):  # True: the prompt tokens' logprobs without a top-k
            prompt_k = 0 if prompt_k else None
            object.__setattr__(self, "prompt_logprobs", prompt_k)
        if prompt_k is not None and not (isinstance(prompt_k, int) and 0 <= prompt_k <= MAX_LOGPROBS):
            raise ConfigError(f"SamplingParams.prompt_logprobs={prompt_k!r} must be an int in [0, {MAX_LOGPROBS}], "
                              "True or None")
        if self.max_new_tokens < 0 or (self.max_new_tokens == 0 and prompt_k is None):
            raise ConfigError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1 (0 only scores "
                              "the prompt: set prompt_logprobs with it)")
        if not self.temperature >= 0.0:
            raise ConfigError(f"SamplingParams.temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"SamplingParams.top_k={self.top_k} must be >= 0 (0 = off)")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ConfigError(f"SamplingParams.logprobs={self.logprobs} must be in [0, {MAX_LOGPROBS}] or None")
        if any(not s for s in stop):
            raise ConfigError("SamplingParams.stop: stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, then top-p, row by row: ``[B, V]`` fp32 -> ``[B, V]`` with
    filtered entries at ``-inf``. temperature ``[B]`` (> 0), top_k ``[B]`` int (0 = off),
    top_p ``[B]`` (1 = off); at least the most likely token always survives."""
    logits = logits / temperature[:, None]
    vocab = logits.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    if bool((k < vocab).any()) or bool((top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens strictly more likely already reach top_p
        before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill((before >= top_p[:, None]) & (ranks > 0), float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return logits


@dataclass(frozen=True)
class SamplingRows:
    """A batch's sampled (not greedy) rows and their settings as the sampler takes them: built
    once and reused while the batch keeps the same requests in the same order."""

    rows: tuple[int, ...]  # rows that draw, ascending
    index: torch.Tensor | None  # [S] int64 those rows (None when every row is greedy)
    temperature: torch.Tensor | None  # [S] fp32
    top_k: torch.Tensor | None  # [S] int64
    top_p: torch.Tensor | None  # [S] fp32
    generators: tuple[torch.Generator | None, ...]  # [S] each row's generator

    @classmethod
    def build(cls, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
              device: torch.device) -> "SamplingRows":
        rows = tuple(i for i, p in enumerate(params) if not p.greedy)
        if not rows:
            return cls((), None, None, None, None, ())
        return cls(
            rows, torch.tensor(rows, device=device),
            torch.tensor([params[i].temperature for i in rows], device=device, dtype=torch.float32),
            torch.tensor([params[i].top_k for i in rows], device=device, dtype=torch.int64),
            torch.tensor([params[i].top_p for i in rows], device=device, dtype=torch.float32),
            tuple(generators[i] for i in rows))


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One next token per row: logits ``[B, V]`` fp32 -> token ids ``[B]`` int64.

    Greedy rows take the argmax; sampled rows draw from their own ``generators[i]`` (one draw
    per row per step), so a row's tokens depend only on its logits and its seed."""
    return sample_rows(logits, SamplingRows.build(params, generators, logits.device))


def sample_rows(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """``sample_tokens`` with the batch's settings already gathered (``SamplingRows.build``)."""
    tokens = logits.argmax(dim=-1)
    if rows.index is None:
        return tokens
    sub = filter_logits(logits.index_select(0, rows.index), rows.temperature, rows.top_k, rows.top_p)
    probs = sub.softmax(dim=-1)
    drawn = [torch.multinomial(probs[j], 1, generator=g) for j, g in enumerate(rows.generators)]
    tokens[rows.index] = torch.cat(drawn)
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """logits ``[B, V]`` fp32, tokens ``[B]`` -> (chosen logprob ``[B]``, top-``top_n`` logprobs
    ``[B, top_n]`` and their ids ``[B, top_n]``, or None when ``top_n`` is 0)."""
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(1, tokens[:, None]).squeeze(1)
    if top_n <= 0:
        return chosen, None, None
    values, ids = lp.topk(top_n, dim=-1)
    return chosen, values, ids
