"""Sampling parameters of a request and the sampler: greedy, temperature, top-k, top-p, min-p,
seeded; logit bias and repetition / frequency / presence penalties."""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Hashable, Iterable, Mapping, Sequence

import torch

from ..specs import ConfigError

MAX_LOGPROBS = 20
# the largest count or token id a request may carry: the batched step packs them into int32/int64
# tensors, where a larger Python int would fail the whole batch
MAX_INT32 = (1 << 31) - 1
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # OpenAI's seed is an int64


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    Before a token is picked (greedy or drawn), a request's logits may be changed, in this order
    (HF's and vLLM's): ``logit_bias`` ({token id: bias in [-100, 100]}) is added;
    ``repetition_penalty`` (1 = off; > 1 discourages) divides the positive and multiplies the
    negative logits of every token already in the prompt or the output (HF's, vLLM's); then
    ``frequency_penalty`` times a token's count in the output so far and ``presence_penalty``
    for each token in the output at all are subtracted (OpenAI's, both in [-2, 2]). Until
    ``min_tokens`` tokens are out, the request's stop tokens (EOS unless ``ignore_eos``, and
    ``stop_token_ids``) cannot be picked and its stop strings are not looked for (vLLM's).
    ``temperature`` 0 is greedy (argmax); otherwise logits are divided by it, then ``min_p``
    (0 = off: drop tokens less likely than min_p times the most likely one; vLLM's), ``top_k``
    (0 = off) and ``top_p`` (1 = off) filter, in that order. ``seed`` fixes the
    request's draws (``uniform_draws`` of the seed and the token's position), so the same seed
    gives the same tokens whatever else is in the batch. ``logprobs``: return the chosen token's logprob and the ``logprobs`` most likely
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; a mapping is accepted
    min_p: float = 0.0
    min_tokens: int = 0

    def __post_init__(self) -> None:
        self.check_ranges()
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        try:
            bias = tuple(sorted((int(t), float(b)) for t, b in bias))
        except (TypeError, ValueError):
            raise ConfigError(f"SamplingParams.logit_bias must map token ids to numbers; got {self.logit_bias!r}") from None
        object.__setattr__(self, "logit_bias", bias)
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in bias) or len({t for t, _ in bias}) != len(bias):
            raise ConfigError("SamplingParams.logit_bias: token ids must be >= 0 and distinct, biases in [-100, 100]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"SamplingParams.{name}={getattr(self, name)} must be in [-2, 2]")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise ConfigError(f"SamplingParams.repetition_penalty={self.repetition_penalty} must be > 0 (1 = off)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"SamplingParams.min_p={self.min_p} must be in [0, 1] (0 = off)")
        if not 0 <= self.min_tokens <= max(self.max_new_tokens, 0):
            raise ConfigError(f"SamplingParams.min_tokens={self.min_tokens} must be in [0, max_new_tokens="
                              f"{self.max_new_tokens}]")
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

    def check_ranges(self) -> None:
        """Types and ranges of every number, before anything is built from them: a value the step's
        tensors cannot hold is a ConfigError naming the field here, never a failed batch later."""
        for name in ("max_new_tokens", "top_k", "min_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not -MAX_INT32 <= value <= MAX_INT32:
                raise ConfigError(f"SamplingParams.{name}={_short(value)} must be an integer <= {MAX_INT32}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool) and not -MAX_INT32 <= value <= MAX_INT32:
                raise ConfigError(f"SamplingParams.{name}={_short(value)} must be in [0, {MAX_LOGPROBS}] or None")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ConfigError(f"SamplingParams.seed={_short(self.seed)} must be a 64-bit integer or None")
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ConfigError(f"SamplingParams.{name}={_short(value)} must be a finite number")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= MAX_INT32:
                raise ConfigError(f"SamplingParams.stop_token_ids: {_short(t)} is not a token id in [0, {MAX_INT32}]")
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        for pair in pairs:
            t = pair[0] if isinstance(pair, (tuple, list)) and pair else pair
            if isinstance(t, int) and not isinstance(t, bool) and not 0 <= t <= MAX_INT32:
                raise ConfigError(f"SamplingParams.logit_bias: {_short(t)} is not a token id in [0, {MAX_INT32}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether its logits change before a token is picked (bias or penalties)."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.repetition_penalty != 1.0 or self.min_tokens > 0


def _short(value: object) -> str:
    """``repr(value)``, cut short: a 5,000-digit number must not become a 5,000-character error."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's str() digit limit
        return "<an integer of more than 4300 digits>"
    return text if len(text) <= 40 else text[:37] + "..."


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p, row by row: ``[B, V]`` fp32 -> ``[B, V]`` with
    filtered entries at ``-inf``. temperature ``[B]`` (> 0), min_p ``[B]`` (0 = off; None: off
    for all), top_k ``[B]`` int (0 = off), top_p ``[B]`` (1 = off); at least the most likely
    token always survives."""
    logits = logits / temperature[:, None]
    if min_p is not None and bool((min_p > 0).any()):
        # p < min_p * p_max  <=>  logit < logit_max + log(min_p)
        floor = logits.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
        logits = logits.masked_fill(logits < floor, float("-inf"))
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
    once and reused while the batch keeps the same requests in the same order. ``draws`` counts
    each row's draws so far (its generated tokens): the sampler advances it in place."""

    rows: tuple[int, ...]  # rows that draw, ascending
    index: torch.Tensor | None  # [S] int64 those rows (None when every row is greedy)
    temperature: torch.Tensor | None  # [S] fp32
    top_k: torch.Tensor | None  # [S] int64
    top_p: torch.Tensor | None  # [S] fp32
    seeds: torch.Tensor | None  # [S] int64 each row's seed, in [0, 2^62)
    draws: torch.Tensor | None  # [S] int64 draws made so far (the next draw's counter)
    min_p: torch.Tensor | None = None  # [S] fp32 (None: no row filters by min-p)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int | None], draws: Sequence[int],
              device: torch.device) -> "SamplingRows":
        rows = tuple(i for i, p in enumerate(params) if not p.greedy)
        if not rows:
            return cls((), None, None, None, None, None, None)
        min_p = [params[i].min_p for i in rows]
        return cls(
            rows, _to_device(rows, device),
            _to_device([params[i].temperature for i in rows], device, torch.float32),
            _to_device([params[i].top_k for i in rows], device, torch.int64),
            _to_device([params[i].top_p for i in rows], device, torch.float32),
            _to_device([seeds[i] for i in rows], device, torch.int64),
            _to_device([draws[i] for i in rows], device, torch.int64),
            _to_device(min_p, device, torch.float32) if any(min_p) else None)


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for int64 ``x`` in [0, 2^32): ``c`` in 16-bit halves, so no product
    reaches 2^63."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift / multiply rounds; the constants of Chris Wellons'
    "lowbias32" from his hash-prospector search) on int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_draws(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) (float64, 53 random bits) per row from its ``seed`` and ``counter``
    alone (int64 ``[S]``, seeds in [0, 2^62)): a counter-based generator, so a row's draw
    depends on nothing else in the batch and needs no per-row state or call."""
    a = _hash32((counters & _M32) ^ _hash32((seeds >> 32) & _M32))
    h1 = _hash32(a ^ (seeds & _M32))
    h2 = _hash32(h1 ^ 0x9E3779B9)
    return ((h1 >> 6) * (1 << 27) + (h2 >> 5)).double() / float(1 << 53)


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int | None],
                  draws: Sequence[int] | None = None) -> torch.Tensor:
    """One next token per row: logits ``[B, V]`` fp32 -> token ids ``[B]`` int64.

    Greedy rows take the argmax; sampled rows draw with ``uniform_draws(seed, draws)`` (draws:
    how many tokens the row drew before; default 0), so a row's token depends only on its
    logits, its seed and its position."""
    draws = [0] * len(params) if draws is None else draws
    return sample_rows(logits, SamplingRows.build(params, seeds, draws, logits.device))


def sample_rows(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """``sample_tokens`` with the batch's settings already gathered (``SamplingRows.build``)."""
    return sample_rows_checked(logits, rows)[0]


def sample_rows_checked(logits: torch.Tensor, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_rows`` and, per row, whether its logits are free of NaN and +inf (``[B]`` bool,
    on the device): the greedy argmax's own pass gives it (a row's max is NaN or inf then).
    Sampled rows invert their filtered distribution's CDF (float64) at one uniform each, all
    rows in one pass; ``rows.draws`` advances by one."""
    top, tokens = logits.max(dim=-1)
    finite = torch.isfinite(top)
    if rows.index is None:
        return tokens, finite
    sub = filter_logits(logits.index_select(0, rows.index), rows.temperature, rows.top_k, rows.top_p, rows.min_p)
    probs = sub.softmax(dim=-1)
    # NaN / inf logits (the caller drops those rows' tokens): draw from anything rather than fail
    probs = probs.masked_fill(~torch.isfinite(probs).all(dim=-1, keepdim=True), 1.0)
    cdf = probs.double().cumsum(dim=-1)
    at = uniform_draws(rows.seeds, rows.draws) * cdf[:, -1]
    # the first token whose cumulative mass exceeds the draw: tokens of probability 0 never are
    drawn = torch.searchsorted(cdf, at[:, None], right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
    rows.draws.add_(1)
    tokens[rows.index] = drawn
    return tokens, finite


class LogitAdjustments:
    """The logit changes of a batch's rows that ask for them (``SamplingParams.adjusts_logits``),
    built once per batch composition, then kept up to date with each step's tokens (``note``)
    while the batch keeps its rows. On the device: the rows' output token counts ``[S, V]``
    int32, the tokens of their prompts ``[S, V]`` (with a repetition penalty) and their biases
    ``[S, V]`` (with a logit bias). ``ids`` identify the rows' requests: with ``previous`` (the last
    composition's), the rows of requests it held copy their counts and prompt tokens from it on
    the device, and only newcomers' are built from their token lists (in continuous batching
    the composition changes nearly every step; rebuilding every row's counts from its output
    would cost the host O(rows x output length) each time). ``ahead`` (0 or 1, or one such value
    per row): the rows with that many tokens more than ``outputs`` holds (a step planned before
    the last one was read; those rows are then held by ``previous``, whose counts have them)."""

    def __init__(self, rows: Sequence[int], params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
                 outputs: Sequence[Sequence[int]], vocab: int, device: torch.device,
                 stop_ids: Sequence[Iterable[int]] | None = None, *, ids: Sequence[Hashable] | None = None,
                 previous: "LogitAdjustments | None" = None, ahead: "int | Sequence[int]" = 0) -> None:
        self.rows = tuple(rows)
        self.index = _to_device(self.rows, device, torch.int64)
        n = len(self.rows)
        self.ids = tuple(ids) if ids is not None else None
        known = {} if previous is None or previous.ids is None or self.ids is None else \
            {rid: j for j, rid in enumerate(previous.ids)}
        kept = [(i, known[rid]) for i, rid in enumerate(self.ids or ()) if rid in known]

        def per_row(seqs: Sequence[Sequence[int]], old: torch.Tensor | None) -> torch.Tensor:
            """``_token_counts`` of ``seqs``, rows of kept requests copied from ``old`` instead."""
            if not kept or old is None:
                return _token_counts(seqs, n, vocab, device)
            out = torch.zeros(n, vocab, device=device, dtype=old.dtype)
            new_i, old_j = zip(*kept)
            out[_to_device(new_i, device)] = old[_to_device(old_j, device)]
            fresh = sorted(set(range(n)) - set(new_i))
            if fresh:
                out[_to_device(fresh, device)] = _token_counts([seqs[i] for i in fresh], len(fresh), vocab,
                                                                        device).to(old.dtype)
            return out

        self.counts = per_row(outputs, None if previous is None else previous.counts)
        self.frequency = _to_device([p.frequency_penalty for p in params], device, torch.float32)
        self.presence = _to_device([p.presence_penalty for p in params], device, torch.float32)
        self.penalized = any(p.frequency_penalty or p.presence_penalty for p in params)
        self.repetition = self.in_prompt = self.bias = None
        if any(p.repetition_penalty != 1.0 for p in params):
            self.repetition = _to_device([p.repetition_penalty for p in params], device, torch.float32)[:, None]
            self.in_prompt = per_row(prompts, None if previous is None else previous.in_prompt) > 0
        if any(p.logit_bias for p in params):
            self.bias = torch.zeros(n, vocab, device=device, dtype=torch.float32)
            pairs = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
            rows_i, tokens, values = zip(*pairs)
            self.bias[_to_device(rows_i, device), _to_device(tokens, device)] = _to_device(
                values, device, torch.float32)
        self.min_tokens = self.generated = self.stop_mask = None
        if any(p.min_tokens for p in params):  # each row's stop tokens, masked while it is short
            self.min_tokens = _to_device([p.min_tokens for p in params], device)
            aheads = [ahead] * n if isinstance(ahead, int) else ahead
            self.generated = _to_device([len(o) + a for o, a in zip(outputs, aheads)], device)
            self.stop_mask = torch.zeros(n, vocab, device=device, dtype=torch.bool)
            pairs = [(i, t) for i, stops in enumerate(stop_ids or [()] * n) for t in stops if 0 <= t < vocab]
            if pairs:
                rows_i, tokens = zip(*pairs)
                self.stop_mask[_to_device(rows_i, device), _to_device(tokens, device)] = True
        self._arange = torch.arange(n, device=device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [B, V]`` fp32 -> a copy with these rows changed (the input is left as it is:
        logprobs are of the model's own distribution)."""
        sub = logits.index_select(0, self.index)
        if self.bias is not None:
            sub = sub + self.bias
        if self.repetition is not None:
            seen = self.in_prompt | (self.counts > 0)
            sub = torch.where(seen, torch.where(sub > 0, sub / self.repetition, sub * self.repetition), sub)
        if self.penalized:
            counts = self.counts.float()
            sub = sub - self.frequency[:, None] * counts - self.presence[:, None] * (counts > 0).float()
        if self.stop_mask is not None:
            sub = sub.masked_fill(self.stop_mask & (self.generated < self.min_tokens)[:, None], float("-inf"))
        return logits.index_copy(0, self.index, sub)

    def note(self, tokens: torch.Tensor) -> None:
        """This step's tokens ``[B]`` (of every row): count those of these rows."""
        self.counts.index_put_((self._arange, tokens.index_select(0, self.index)),
                               torch.ones(len(self.rows), device=self.counts.device, dtype=self.counts.dtype),
                               accumulate=True)
        if self.generated is not None:
            self.generated += 1


def _to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` as a tensor on ``device``: on CUDA through pinned memory and an asynchronous
    copy (one from pageable memory waits for the stream, and a step planned ahead of the running
    one would wait for that step to end)."""
    cuda = torch.device(device).type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=cuda).to(device, non_blocking=True)


def _token_counts(seqs: Sequence[Sequence[int]], n: int, vocab: int, device: torch.device) -> torch.Tensor:
    """``[n, vocab]`` int32: how often each token occurs in each of ``seqs``."""
    longest = max((len(q) for q in seqs), default=0)
    counts = torch.zeros(n, vocab + 1, device=device, dtype=torch.int32)  # column vocab: padding
    if longest:
        ids = _to_device([list(q) + [vocab] * (longest - len(q)) for q in seqs], device, torch.int64)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab].contiguous()


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
