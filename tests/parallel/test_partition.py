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


LLAMA3_8B = SimpleNamespace(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=128256, num_hidden_layers=32)


def test_llama3_8b_last_stage_gets_fewer_layers_for_the_head():
    """Under the FLOPs cost model (the head charged on every token) the last stage gives up layers."""
    config = LLAMA3_8B
    stages = partition_decoder(config, 4, cost="flops")
    assert [i for r in stages for i in r] == list(range(32))
    assert len(stages[-1]) < min(len(r) for r in stages[:-1])
    assert [len(r) for r in partition_decoder(config, 1, cost="flops")] == [32]


def test_time_cost_balances_llama3_8b_evenly_where_flops_gave_the_head_two_layers():
    """The measured 2-GPU fit ran 17/15 (FLOPs) with stage 1 idle 18% vs stage 0 5%: the head is
    charged on labelled rows only and a layer's memory-bound work counts, so 16/16."""
    assert [len(r) for r in partition_decoder(LLAMA3_8B, 2, cost="flops")] == [17, 15]
    assert [len(r) for r in partition_decoder(LLAMA3_8B, 2)] == [16, 16]
    assert [len(r) for r in partition_decoder(LLAMA3_8B, 2, label_fraction=0.08)] == [16, 16]
    # a head on every token (label_fraction 1) costs ~3 layers in time (its fp32 logits' traffic
    # counted): the last stage gives two up; the fused LM-head loss, ~2 layers: one
    assert [len(r) for r in partition_decoder(LLAMA3_8B, 2, label_fraction=1.0)] == [18, 14]
    assert [len(r) for r in partition_decoder(LLAMA3_8B, 2, label_fraction=1.0, lm_head_loss="fused")] == [17, 15]
    with pytest.raises(ValueError, match="cost='bytes'"):
        partition_decoder(LLAMA3_8B, 2, cost="bytes")


def test_time_cost_terms_of_a_layer_and_the_head():
    from lightning_lorafusion.parallel.cost_model import CostModel, layer_traffic_bytes

    unit = CostModel.timed(LLAMA3_8B, (1,), label_fraction=0.25)
    flops = CostModel.from_decoder_config(LLAMA3_8B, (1,))
    gemm = flops.layer_flops_per_token / unit.flops_per_second
    memory = layer_traffic_bytes(LLAMA3_8B) / unit.memory_bandwidth
    assert unit.layer_time_per_token() == pytest.approx((1 + unit.backward_factor) * (gemm + memory))
    assert memory > 0.1 * gemm  # the memory-bound share is not negligible on this shape
    # the head's GEMM scales with the labelled share; its norm does not
    quarter, whole = unit.head_time_per_token(), CostModel.timed(LLAMA3_8B, (1,), label_fraction=1.0).head_time_per_token()
    norm = (1 + unit.backward_factor) * unit.head_bytes_per_token / unit.memory_bandwidth
    assert (whole - norm) == pytest.approx(4 * (quarter - norm))
    # LoRA traffic grows with the rank
    assert layer_traffic_bytes(LLAMA3_8B, lora_rank=64) > layer_traffic_bytes(LLAMA3_8B, lora_rank=16)
    with pytest.raises(ValueError, match="head_token_fraction"):
        CostModel.timed(LLAMA3_8B, (1,), label_fraction=1.5)


def test_explicit_stage_layers_are_used_as_given_and_checked():
    from lightning_lorafusion.specs import ConfigError

    assert [(r.start, r.stop) for r in partition_decoder(LLAMA3_8B, 2, stage_layers=[20, 12])] == [(0, 20), (20, 32)]
    assert partition_decoder(LLAMA3_8B, 2, stage_layers=(17, 15)) == partition_decoder(LLAMA3_8B, 2, cost="flops")
    for bad, match in (([16, 15], "sums to 31; the decoder has 32"), ([32], "1 entries for pipeline_size=2"),
                       ([33, -1], "one positive layer count"), ([16.0, 16], "one positive layer count"),
                       ([True, 31], "one positive layer count"), ("16,16", "one positive layer count")):
        with pytest.raises(ConfigError, match=r"stage_layers=.*" + match):
            partition_decoder(LLAMA3_8B, 2, stage_layers=bad)


def test_label_fraction_counts_labelled_tokens_of_every_adapter():
    from lightning_lorafusion.parallel.partition import label_fraction

    def sample(labels):
        return SimpleNamespace(labels=tuple(labels))

    a = [sample([-100, -100, 5, 6]), sample([-100, 7])]
    b = [sample([-100] * 3 + [1])]
    assert label_fraction([a, b]) == pytest.approx(4 / 10)
    assert label_fraction([a, b], max_samples=1) == pytest.approx(3 / 8)
    assert label_fraction([]) is None and label_fraction([[]]) is None


LLAMA3_70B = SimpleNamespace(hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                             num_key_value_heads=8, vocab_size=128256, num_hidden_layers=80)


def test_recomputed_layers_per_stage_follow_the_global_layer_index():
    from lightning_lorafusion.parallel.cost_model import recomputed_per_stage

    assert recomputed_per_stage([40, 40], 16) == (16, 0)
    assert recomputed_per_stage([10, 10, 10], 25) == (10, 10, 5)
    assert recomputed_per_stage([16, 16], True) == (16, 16)
    assert recomputed_per_stage([16, 16], False) == () and recomputed_per_stage([16, 16], 0) == ()


def test_recomputing_stage_gets_fewer_layers_and_the_simulator_charges_its_second_forward():
    """The 70B PP=2 config recomputes the first 16 layers, all on stage 0: measured stage-0 idle
    0.8% against stage 1's 22% on the even 40/40 split. Each recomputed layer costs one forward
    more, so the split moves layers to stage 1 and the simulated backward of stage 0 grows."""
    from lightning_lorafusion.parallel.cost_model import CostModel

    assert [len(r) for r in partition_decoder(LLAMA3_70B, 2)] == [40, 40]
    split = [len(r) for r in partition_decoder(LLAMA3_70B, 2, checkpoint_layers=16)]
    assert split[0] < 40 and sum(split) == 80
    # every layer recomputed is the same as none for the balance
    assert partition_decoder(LLAMA3_70B, 2, checkpoint_layers=True) == partition_decoder(LLAMA3_70B, 2)
    assert [len(r) for r in partition_decoder(LLAMA3_8B, 2, checkpoint_layers=16)][0] < 16

    plain = CostModel.timed(LLAMA3_70B, (40, 40))
    ckpt = CostModel.timed(LLAMA3_70B, (40, 40), checkpoint_layers=16)
    assert ckpt.stage_recomputed == (16, 0) and plain.stage_recomputed == ()
    fwd = plain.forward_time(0, 2048, 2048 * 2048)
    assert ckpt.forward_time(0, 2048, 2048 * 2048) == pytest.approx(fwd)
    # stage 0's backward pays 16 of its 40 layers' forward again; stage 1 is unchanged
    assert ckpt.backward_time(0, 2048, 2048 * 2048) == pytest.approx(plain.backward_time(0, 2048, 2048 * 2048)
                                                                     + 16 / 40 * fwd)
    assert ckpt.backward_time(1, 2048, 2048 * 2048) == pytest.approx(plain.backward_time(1, 2048, 2048 * 2048))
    # the balanced split of the recomputing model: its stages' forward + backward are closer than 40/40's
    def stage_times(model):
        return [model.forward_time(s, 2048, 2048 * 2048) + model.backward_time(s, 2048, 2048 * 2048)
                for s in range(2)]
    even = stage_times(ckpt)
    moved = stage_times(CostModel.timed(LLAMA3_70B, split, checkpoint_layers=16))
    assert abs(moved[0] - moved[1]) < abs(even[0] - even[1])
    with pytest.raises(ValueError, match="stage_recomputed"):
        CostModel.timed(LLAMA3_70B, (40, 40), stage_recomputed=(41, 0))
