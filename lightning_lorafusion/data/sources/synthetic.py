"""Synthetic source: random token samples whose lengths follow a published dataset's length
distribution (``lightning_lorafusion.data.synthetic``); for tests and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...specs import ConfigError
from ..microbatch import IGNORE_INDEX
from ..tokenization import TokenizedSample, shifted_labels
from .rows import SPLITS, check_limit, normalize_split

@dataclass(frozen=True, kw_only=True)
class SyntheticSource:
    """Random token samples whose lengths follow a published dataset's length distribution
    (``lightning_lorafusion.data.synthetic``); for tests and benchmarks."""

    distribution: str
    num_samples: int
    seed: int = 0
    vocab_size: int | None = None  # None: the tokenizer's vocabulary size
    limit: int | None = None  # keep the first `limit` of the num_samples drawn
    kind: str = "synthetic"

    def __post_init__(self) -> None:
        check_limit(self.limit, self.kind)
        if self.num_samples < 1:
            raise ConfigError(
                f"dataset kind 'synthetic': num_samples={self.num_samples} must be >= 1"
            )
        from ..synthetic import DISTRIBUTION_NAMES  # lazy: numpy only for this kind

        if self.distribution not in DISTRIBUTION_NAMES:
            raise ConfigError(
                f"dataset kind 'synthetic': distribution={self.distribution!r}; "
                f"allowed: {list(DISTRIBUTION_NAMES)}"
            )
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ConfigError(f"dataset kind 'synthetic': vocab_size={self.vocab_size} must be >= 2")

    def build(
        self, tokenizer: Any, *, split: str, max_length: int | None, name: str
    ) -> list[TokenizedSample]:
        where = f"adapter dataset {name} (synthetic)"
        vocab_size = self.vocab_size
        if vocab_size is None:
            if tokenizer is None:
                raise ConfigError(f"{where}: without a tokenizer, set 'vocab_size' explicitly")
            vocab_size = len(tokenizer)
        from ..synthetic import synthetic_token_samples  # lazy: only this kind needs it

        # Each split gets its own stream so val/test never repeat train samples.
        seed = self.seed + 1_000_003 * SPLITS.index(normalize_split(split, where))
        try:
            pairs = synthetic_token_samples(
                self.distribution, self.num_samples,
                vocab_size=vocab_size, seed=seed, max_length=max_length,
            )
        except ConfigError:
            raise
        except ValueError as err:
            raise ConfigError(f"{where}: {err}") from err
        # synthetic_token_samples marks targets in place (labels == input_ids on the
        # completion); our samples carry pre-shifted labels.
        samples = [
            TokenizedSample(
                input_ids=tuple(ids),
                labels=shifted_labels(ids, [t != IGNORE_INDEX for t in targets]),
                source_index=i,
            )
            for i, (ids, targets) in enumerate(pairs[: self.limit])
        ]
        if not samples:
            raise ConfigError(f"adapter dataset {name} is empty")
        return samples
