"""Packing planned microbatches into fixed-capacity tensors."""

from dataclasses import dataclass

import pytest
import torch

from lightning_lorafusion.data.microbatch import IGNORE_INDEX
from lightning_lorafusion.data.packing import PackingConfig, SampleLookup, pack_microbatch
from lightning_lorafusion.planner.plan import PlannedMicrobatch, SampleRef


@dataclass(frozen=True)
class _Sample:
    input_ids: tuple
    labels: tuple


def _sample(n, base):
    ids = tuple(base + i for i in range(n))
    labels = tuple([IGNORE_INDEX] * (n // 2) + list(ids[n // 2 + 1 :]) + [IGNORE_INDEX])
    return _Sample(ids, labels)


def _lookup():
    datasets = [[_sample(5, 100), _sample(3, 200)], [_sample(7, 300)]]
    batches = [[[0, 1]], [[0]]]
    return SampleLookup(datasets, batches)


def test_layout_segments_positions_and_boundaries():
    lookup = _lookup()
    planned = PlannedMicrobatch(
        (SampleRef(0, 0, 0, 5), SampleRef(0, 0, 1, 3), SampleRef(1, 0, 0, 7))
    )
    dens = {(0, 0): lookup.label_tokens(0, 0), (1, 0): lookup.label_tokens(1, 0)}
    mb = pack_microbatch(
        planned, lookup, config=PackingConfig(capacity=32, pad_multiple=4), num_adapters=2,
        denominators=dens, step_adapters=(0, 1), index=7,
    )
    assert mb.input_ids.shape == (32,)
    # adapter 0: 8 tokens (already a multiple of 4); adapter 1: 7 tokens padded to 8
    assert mb.segments == ((0, 8, 0), (8, 16, 1))
    assert mb.input_ids[:5].tolist() == [100, 101, 102, 103, 104]
    assert mb.input_ids[5:8].tolist() == [200, 201, 202]
    assert mb.input_ids[8:15].tolist() == list(range(300, 307))
    assert mb.position_ids[:8].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert mb.position_ids[8:15].tolist() == list(range(7))
    # every sample and each padding run is its own attention block
    assert mb.cu_seqlens.tolist() == [0, 5, 8, 15, 16, 32]
    assert (mb.labels[15:] == IGNORE_INDEX).all()
    assert mb.loss_denominators.tolist() == [float(dens[(0, 0)]), float(dens[(1, 0)])]
    assert dens[(0, 0)] == sum(1 for s in lookup.datasets[0] for t in s.labels if t != IGNORE_INDEX)
    assert mb.real_tokens == 15 and mb.index == 7


def test_overflow_and_length_mismatch_raise():
    lookup = _lookup()
    with pytest.raises(ValueError, match="exceeds|overflows"):
        pack_microbatch(
            PlannedMicrobatch((SampleRef(0, 0, 0, 5), SampleRef(1, 0, 0, 7))), lookup,
            config=PackingConfig(capacity=8, pad_multiple=1), num_adapters=2,
            denominators={(0, 0): 3, (1, 0): 3}, step_adapters=(), index=0,
        )
    with pytest.raises(ValueError, match="plan says"):
        pack_microbatch(
            PlannedMicrobatch((SampleRef(0, 0, 0, 4),)), lookup,
            config=PackingConfig(capacity=8), num_adapters=2,
            denominators={(0, 0): 3}, step_adapters=(), index=0,
        )
    with pytest.raises(ValueError, match="divide"):
        PackingConfig(capacity=10, pad_multiple=4)
