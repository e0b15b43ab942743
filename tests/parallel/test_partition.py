"""Layer partitioning: contiguous, complete, and as balanced as brute force finds."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_lorafusion.parallel.partition import partition_decoder, partition_layers


def max_stage_cost(ranges, costs, first_extra, last_extra):
    totals = [sum(costs[i] for i in r) for r in ranges]
    totals[0] += first_extra
    totals[-1] += last_extra
    return max(totals)


@settings(max_examples=200, deadline=None)
@given(
    costs=st.lists(st.integers(0, 20), min_size=1, max_size=9),
    num_stages=st.integers(1, 4),
    first_extra=st.integers(0, 30),
    last_extra=st.integers(0, 30),
)
def test_partition_is_contiguous_complete_and_optimal(costs, num_stages, first_extra, last_extra):
    n = len(costs)
    if n < num_stages:
        with pytest.raises(ValueError, match="at least one decoder layer"):
            partition_layers(n, num_stages, layer_cost=costs)
        return
    ranges = partition_layers(n, num_stages, layer_cost=costs, first_stage_extra=first_extra,
                              last_stage_extra=last_extra)
    assert [i for r in ranges for i in r] == list(range(n)) and all(len(r) > 0 for r in ranges)
    best = min(
        max_stage_cost([range(a, b) for a, b in zip((0,) + cuts, cuts + (n,))], costs, first_extra, last_extra)
        for cuts in itertools.combinations(range(1, n), num_stages - 1)
    )
    assert max_stage_cost(ranges, costs, first_extra, last_extra) == best


def test_llama3_8b_last_stage_gets_fewer_layers_for_the_head():
    config = SimpleNamespace(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256, num_hidden_layers=32)
    stages = partition_decoder(config, 4)
    assert [i for r in stages for i in r] == list(range(32))
    assert len(stages[-1]) < min(len(r) for r in stages[:-1])
    assert [len(r) for r in partition_decoder(config, 1)] == [32]
