"""Each adapter's samples for training, validation and test: read and tokenized from its
dataset specs, the validation hold-out split, and the length checks against the microbatch."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import replace
from typing import Any, Sequence

from ..data.microbatch import IGNORE_INDEX
from ..data.packing import PackingConfig
from ..data.sources import SyntheticSource, build_source, parse_source
from ..planner.plan import padded_length
from ..specs import AdapterSpec, ConfigError

log = logging.getLogger(__name__)


def holdout_indices(num_samples: int, fraction: float, seed: int) -> list[int]:
    """Dataset indices held out for validation: those whose hash of (seed, index) falls below
    ``fraction``, so a sample's side does not depend on the others (adding samples moves none).
    At least one sample is held out and at least one kept for training."""
    if num_samples < 2:
        raise ConfigError(f"val_fraction needs at least 2 samples to split; the dataset has {num_samples}")
    keys = [int.from_bytes(hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest(), "little") / 2**64
            for i in range(num_samples)]
    held = [i for i, k in enumerate(keys) if k < fraction]
    if not held:
        held = [min(range(num_samples), key=keys.__getitem__)]
    if len(held) == num_samples:
        held.remove(max(held, key=keys.__getitem__))
    return held


def check_lengths(spec: AdapterSpec, samples: Sequence, packing: PackingConfig) -> None:
    """``ConfigError`` for a sample that cannot fit a microbatch or has no label tokens."""
    cap, pad = packing.capacity, packing.pad_multiple
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        if padded_length(n, pad) > cap:
            raise ConfigError(
                f"adapter {spec.name!r}: sample {i} has {n} tokens, more than the microbatch "
                f"capacity {cap} (after padding to a multiple of {pad}); set "
                f"data.capacity >= {padded_length(n, pad)} or data.max_length <= {cap}"
            )
        if not any(t != IGNORE_INDEX for t in s.labels):
            raise ConfigError(f"adapter {spec.name!r}: sample {i} has no label tokens (empty completion?)")


def load_train_and_val(spec: AdapterSpec, tokenizer: Any, *, vocab_size: int | None,
                       max_length: int) -> tuple[Sequence, Sequence]:
    """One adapter's training samples and validation samples (held out by ``val_fraction``, or
    read from ``val_dataset``; ``[]`` without either)."""
    if not spec.dataset:
        raise ConfigError(f"adapter {spec.name!r} has no dataset; set adapters[].dataset")
    source = parse_source(spec.dataset, name=spec.name)
    if isinstance(source, SyntheticSource) and source.vocab_size is None and tokenizer is None \
            and vocab_size is not None:
        source = replace(source, vocab_size=vocab_size)
    samples = build_source(source, tokenizer, split="train", max_length=max_length, name=spec.name)
    if len(samples) == 0:
        raise ConfigError(f"adapter {spec.name!r}: its dataset {spec.dataset} is empty")
    val: Sequence = []
    if spec.val_fraction > 0:
        if len(samples) < 2:
            raise ConfigError(f"adapter {spec.name!r}: val_fraction={spec.val_fraction} needs at "
                              f"least 2 samples to split; its dataset has {len(samples)}")
        held = set(holdout_indices(len(samples), spec.val_fraction, spec.seed))
        val = [s for i, s in enumerate(samples) if i in held]
        samples = [s for i, s in enumerate(samples) if i not in held]
    elif spec.val_dataset is not None:
        # a single file is read whole; path mappings, aclsum and synthetic give their 'val' split
        split = "train" if isinstance(spec.val_dataset.get("path"), str) else "val"
        val = build_source(spec.val_dataset, tokenizer, split=split, max_length=max_length,
                           name=f"{spec.name} (val)")
    return samples, val


def load_test(specs: Sequence[AdapterSpec], tokenizer: Any, *, max_length: int,
              packing: PackingConfig) -> list[Sequence]:
    """Each adapter's ``test_dataset`` (``[]`` for those without one), tokenized like training
    data; ``ConfigError`` when no adapter has one."""
    if not any(spec.test_dataset for spec in specs):
        raise ConfigError("`test` evaluates each adapter's test_dataset, and no adapter sets one; add "
                          "adapters[].test_dataset (a mapping like dataset, e.g. {kind: jsonl, path: "
                          "test.jsonl})")
    out = []
    for spec in specs:
        samples: Sequence = []
        if spec.test_dataset:
            # a single file is read whole; path mappings, aclsum and synthetic give their 'test' split
            split = "train" if isinstance(spec.test_dataset.get("path"), str) else "test"
            samples = build_source(spec.test_dataset, tokenizer, split=split, max_length=max_length,
                                   name=f"{spec.name} (test)")
            check_lengths(spec, samples, packing)
            log.info("adapter %s: %d test samples", spec.name, len(samples))
        out.append(samples)
    return out
