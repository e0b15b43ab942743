"""The schedule builders and the simulator: semantics, bubble lemma, analytic bubble ratios."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_lorafusion.parallel.schedule import (
    Backward,
    BubbleLemmaError,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ScheduleError,
    SendActivation,
    SendGrad,
    build_1f1b_flushed_schedule,
    build_pipeline_schedule,
    in_flight_slots,
)
from lightning_lorafusion.parallel.executor import measured_bubble_ratio
from lightning_lorafusion.parallel.cost_model import CostModel
from lightning_lorafusion.parallel.simulator import DeadlockError, simulate
from lightning_lorafusion.planner.plan import Plan

from .plans import interleaved_groups, lemma_gap_violations, make_plan, pad_for_lemma


def uniform_costs(num_stages, *, backward_factor=1.0, p2p_latency=0.0):
    """Forward of any microbatch costs the same on every stage (no head, no attention term)."""
    return CostModel(
        stage_layers=(1,) * num_stages,
        layer_flops_per_token=0.0,
        launch_overhead=1.0,
        backward_factor=backward_factor,
        p2p_latency=p2p_latency,
    )


def token_costs(num_stages):
    return CostModel(
        stage_layers=(2,) * num_stages,
        layer_flops_per_token=1e9,
        attention_flops_per_pair=1e6,
        head_flops_per_token=3e9,
        flops_per_second=1e14,
        optimizer_step_time=1e-5,
        p2p_latency=1e-5,
        bytes_per_token=4096.0,
    )


@st.composite
def plans(draw):
    num_stages = draw(st.integers(1, 5))
    n_adapters = draw(st.integers(1, 4))
    batches = [draw(st.integers(1, 3)) for _ in range(n_adapters)]
    mbs_per_batch = [[draw(st.integers(1, 4)) for _ in range(n)] for n in batches]
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    groups = interleaved_groups(rng, batches, mbs_per_batch, noop_p=draw(st.sampled_from([0.0, 0.2])))
    return num_stages, groups


def positions(actions):
    return {a: k for k, a in enumerate(actions)}


@settings(max_examples=150, deadline=None)
@given(plans())
def test_padded_plans_schedule_cleanly_and_keep_every_promise(case):
    num_stages, groups = case
    plan = make_plan(pad_for_lemma(groups, num_stages), num_stages=num_stages)
    schedule = build_pipeline_schedule(plan, num_stages)
    assert len(schedule) == num_stages
    # The simulator re-checks dependencies, in-flight bound and step placement and detects
    # deadlocks; both P2P semantics must pass.
    for rendezvous in (True, False):
        result = simulate(plan, schedule, token_costs(num_stages), rendezvous=rendezvous)
        assert all(n <= num_stages - s for s, n in enumerate(result.max_in_flight))
        assert result.makespan > 0
    step_points = Plan.compute_step_points(plan.microbatches)
    noop = [i for i, mb in enumerate(plan.microbatches) if mb.is_noop]
    for stage, actions in enumerate(schedule):
        pos = positions(actions)
        assert not any(getattr(a, "microbatch", None) in noop for a in actions)
        for (a, b), p in step_points.items():
            step = pos[OptimizerStep(a, b)]
            # right after the last backward of the batch: only other steps may sit between
            between = actions[pos[Backward(p)] + 1 : step]
            assert all(isinstance(x, OptimizerStep) for x in between)
            for i, mb in enumerate(plan.microbatches):
                holds = {(s.adapter, s.batch) for s in mb.samples}
                if (a, b) in holds:
                    assert pos[Backward(i)] < step
                if (a, b + 1) in holds:  # the bubble lemma, stage by stage
                    assert pos[Forward(i)] > step
        # forwards and backwards both follow plan order on every stage (FIFO channels)
        fwd = [x.microbatch for x in actions if isinstance(x, Forward)]
        bwd = [x.microbatch for x in actions if isinstance(x, Backward)]
        assert fwd == sorted(fwd) and bwd == sorted(bwd)


@settings(max_examples=100, deadline=None)
@given(plans())
def test_in_flight_slots_are_taken_at_forward_and_freed_at_backward(case):
    """Each microbatch of a stage's action list gets a slot (what the CUDA graphs of a stage
    before the last hold per in-flight microbatch): no two microbatches in flight share one, a
    forward takes the lowest free slot, and 1F1B needs ``num_stages - stage`` of them at most
    (exactly that many once the stream is long enough to fill the pipeline)."""
    num_stages, groups = case
    plan = make_plan(pad_for_lemma(groups, num_stages), num_stages=num_stages)
    for builder in (build_pipeline_schedule, build_1f1b_flushed_schedule):
        for stage, actions in enumerate(builder(plan, num_stages)):
            slots = in_flight_slots(actions)
            forwards = [a.microbatch for a in actions if isinstance(a, Forward)]
            assert sorted(slots) == sorted(forwards)
            holding: dict[int, int] = {}  # slot -> microbatch
            for a in actions:
                if isinstance(a, Forward):
                    slot = slots[a.microbatch]
                    assert slot not in holding and slot == min(set(range(len(holding) + 1)) - set(holding))
                    holding[slot] = a.microbatch
                elif isinstance(a, Backward):
                    assert holding.pop(slots[a.microbatch]) == a.microbatch
            assert not holding
            if slots:
                assert max(slots.values()) + 1 <= num_stages - stage
    long_plan = make_plan([[(0, 0, 8)]] * 8, num_stages=3)
    assert [max(in_flight_slots(a).values()) + 1 for a in build_pipeline_schedule(long_plan, 3)] == [3, 2, 1]


def test_in_flight_slots_follow_the_1f1b_order_and_refuse_broken_lists():
    """Stage 0 of 2: F0 F1 B0 F2 B1 F3 B2 B3 -> slots 0 1 | 0 | 1 | 0 (freed and retaken)."""
    plan = make_plan([[(0, 0, 8)]] * 4, num_stages=2)
    actions = build_pipeline_schedule(plan, 2)[0]
    order = [(type(a).__name__[0], a.microbatch) for a in actions if isinstance(a, (Forward, Backward))]
    assert order == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert in_flight_slots(actions) == {0: 0, 1: 1, 2: 0, 3: 1}
    with pytest.raises(ScheduleError, match="without a Forward"):
        in_flight_slots([Backward(0)])
    with pytest.raises(ScheduleError, match="twice"):
        in_flight_slots([Forward(0), Forward(0)])


@settings(max_examples=150, deadline=None)
@given(plans())
def test_builder_refuses_exactly_the_plans_that_break_the_bubble_lemma(case):
    num_stages, groups = case
    plan = make_plan(groups, num_stages=num_stages)
    broken = lemma_gap_violations(plan, num_stages)
    if broken:
        with pytest.raises(BubbleLemmaError) as info:
            build_pipeline_schedule(plan, num_stages)
        message = str(info.value)
        assert "stage 0" in message
        assert any(f"adapter {a} batch {b}," in message for a, b in broken), (message, broken)
        assert "no-op slots" in message
    else:
        simulate(plan, build_pipeline_schedule(plan, num_stages), token_costs(num_stages))
    # the flushed baseline drains at every step point, so it never needs padding
    simulate(plan, build_1f1b_flushed_schedule(plan, num_stages), token_costs(num_stages))


@pytest.mark.parametrize("num_stages, per_batch", [(2, 3), (4, 4), (4, 8), (8, 8), (3, 1)])
def test_flushed_1f1b_bubble_matches_the_textbook_formula(num_stages, per_batch):
    # Equal forward/backward cost t on every stage, no latency: each flushed global batch of m
    # microbatches takes (m + S - 1) * 2t, so the idle fraction is (S - 1) / (m + S - 1).
    groups = [[(0, j, 100)] for j in range(3) for _ in range(per_batch)]
    plan = make_plan(groups, num_stages=num_stages)
    result = simulate(plan, build_1f1b_flushed_schedule(plan, num_stages), uniform_costs(num_stages))
    expected = (num_stages - 1) / (per_batch + num_stages - 1)
    assert result.bubble_ratio == pytest.approx(expected, abs=1e-12)
    assert result.makespan == pytest.approx(3 * (per_batch + num_stages - 1) * 2.0)


@pytest.mark.parametrize("num_stages", [2, 4, 8])
def test_no_flush_stream_drains_once(num_stages):
    # Four adapters in round robin, one microbatch per global batch: the gap between an
    # adapter's batches is 4 slots, enough for up to 4 stages; pad for 8.
    groups = [[(a, j, 100)] for j in range(6) for a in range(4)]
    groups = pad_for_lemma(groups, num_stages)
    plan = make_plan(groups, num_stages=num_stages)
    result = simulate(plan, build_pipeline_schedule(plan, num_stages), uniform_costs(num_stages))
    slots = len(groups)  # no-op slots are idle time for the whole pipeline
    real = 24
    assert result.makespan == pytest.approx((slots + num_stages - 1) * 2.0)
    assert result.bubble_ratio == pytest.approx(1 - real / (slots + num_stages - 1))
    flushed = simulate(plan, build_1f1b_flushed_schedule(plan, num_stages), uniform_costs(num_stages))
    assert flushed.bubble_ratio == pytest.approx((num_stages - 1) / num_stages)
    assert result.bubble_ratio < flushed.bubble_ratio


def test_action_lists_of_a_small_plan_are_1f1b_with_explicit_p2p():
    plan = make_plan([[(0, 0, 10)], [(1, 0, 10)], [(0, 1, 10)]], num_stages=2)
    first, last = build_pipeline_schedule(plan, 2)
    assert first == [
        Forward(0), SendActivation(0),
        Forward(1), SendActivation(1), RecvGrad(0), Backward(0), OptimizerStep(0, 0),
        Forward(2), SendActivation(2), RecvGrad(1), Backward(1), OptimizerStep(1, 0),
        RecvGrad(2), Backward(2), OptimizerStep(0, 1),
    ]
    assert last == [
        RecvActivation(0), Forward(0), Backward(0), OptimizerStep(0, 0), SendGrad(0),
        RecvActivation(1), Forward(1), Backward(1), OptimizerStep(1, 0), SendGrad(1),
        RecvActivation(2), Forward(2), Backward(2), OptimizerStep(0, 1), SendGrad(2),
    ]


def test_noop_slots_take_no_actions_but_keep_their_place():
    with_noops = make_plan([[(0, 0, 10)], [], [], [(0, 1, 10)]], num_stages=3)
    schedule = build_pipeline_schedule(with_noops, 3)
    assert all(getattr(a, "microbatch", 0) in (0, 3) for actions in schedule for a in actions)
    # without the two no-op slots, batch 1 would start only one slot after batch 0's step
    with pytest.raises(BubbleLemmaError, match="adapter 0 batch 1"):
        build_pipeline_schedule(make_plan([[(0, 0, 10)], [(0, 1, 10)]], num_stages=3), 3)
    assert build_pipeline_schedule(make_plan([[], []], num_stages=2), 2) == [[], []]


def test_bad_plans_and_arguments_are_refused_with_reasons():
    plan = make_plan([[(0, 0, 10)], [(0, 1, 10)], [(0, 0, 10)]], num_stages=1)
    with pytest.raises(ScheduleError, match="planned in order"):
        build_pipeline_schedule(plan, 1)
    good = make_plan([[(0, 0, 10)], [(0, 0, 10)]], num_stages=1)
    wrong_steps = Plan(
        capacity=good.capacity, pad_multiple=good.pad_multiple, num_stages=1,
        microbatches=good.microbatches, step_points={(0, 0): 0},
    )
    with pytest.raises(ScheduleError, match="step_points disagrees"):
        build_pipeline_schedule(wrong_steps, 1)
    with pytest.raises(ScheduleError, match="num_stages"):
        build_pipeline_schedule(good, 0)
    with pytest.raises(ValueError, match="one stage_layers entry per pipeline stage"):
        simulate(good, build_pipeline_schedule(good, 1), uniform_costs(2))


def test_simulator_detects_deadlock_and_broken_dependencies():
    plan = make_plan([[(0, 0, 10)]], num_stages=2)
    costs = uniform_costs(2)
    # rank 0 waits for a gradient before sending the activation rank 1 needs: a cycle
    deadlock = [
        [RecvGrad(0), Forward(0), SendActivation(0), Backward(0), OptimizerStep(0, 0)],
        [RecvActivation(0), Forward(0), Backward(0), OptimizerStep(0, 0), SendGrad(0)],
    ]
    with pytest.raises(DeadlockError, match="deadlocks"):
        simulate(plan, deadlock, costs)
    early_step = [
        [Forward(0), SendActivation(0), RecvGrad(0), OptimizerStep(0, 0), Backward(0)],
        [RecvActivation(0), Forward(0), Backward(0), OptimizerStep(0, 0), SendGrad(0)],
    ]
    with pytest.raises(ScheduleError, match="right after"):
        simulate(plan, early_step, costs)
    wrong_order = make_plan([[(0, 0, 10)], [(1, 0, 10)]], num_stages=2)
    swapped = build_pipeline_schedule(wrong_order, 2)
    swapped[1] = [
        RecvActivation(1), Forward(1), Backward(1), OptimizerStep(1, 0), SendGrad(1),
        RecvActivation(0), Forward(0), Backward(0), OptimizerStep(0, 0), SendGrad(0),
    ]
    with pytest.raises(ScheduleError, match="received in order"):
        simulate(wrong_order, swapped, costs)


def test_simulator_enforces_the_in_flight_bound():
    plan = make_plan([[(0, 0, 10)], [(1, 0, 10)], [(2, 0, 10)]], num_stages=2)
    greedy = [
        [Forward(0), SendActivation(0), Forward(1), SendActivation(1), Forward(2),
         SendActivation(2), RecvGrad(0), Backward(0), OptimizerStep(0, 0), RecvGrad(1),
         Backward(1), OptimizerStep(1, 0), RecvGrad(2), Backward(2), OptimizerStep(2, 0)],
        build_pipeline_schedule(plan, 2)[1],
    ]
    with pytest.raises(ScheduleError, match="3 microbatches in flight"):
        simulate(plan, greedy, uniform_costs(2), rendezvous=False)


def test_cost_model_counts_the_flops_of_a_real_llama_layer():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=96, intermediate_size=200, num_attention_heads=6, num_key_value_heads=2,
        num_hidden_layers=1, vocab_size=301,
    )
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, layer_idx=0)
    linear_params = sum(m.weight.numel() for m in layer.modules() if type(m).__name__ == "Linear")
    costs = CostModel.from_decoder_config(config, (3, 2), flops_per_second=1.0)
    assert costs.layer_flops_per_token == 2 * linear_params
    assert costs.head_flops_per_token == 2 * 96 * 301
    # last stage pays the head; backward is backward_factor times forward
    assert costs.forward_time(0, 10) == pytest.approx(3 * 10 * 2 * linear_params)
    assert costs.forward_time(1, 10) == pytest.approx(2 * 10 * 2 * linear_params + 10 * 2 * 96 * 301)
    assert costs.backward_time(1, 10) == pytest.approx(costs.backward_factor * costs.forward_time(1, 10))
    with pytest.raises(ValueError, match="flops_per_second"):
        CostModel(stage_layers=(1,), layer_flops_per_token=1.0, flops_per_second=0)
    ns = SimpleNamespace(hidden_size=8, intermediate_size=16, num_attention_heads=2, vocab_size=10)
    assert CostModel.from_decoder_config(ns, (1,)).layer_flops_per_token == 2 * (4 * 64 + 3 * 128)


def test_measured_bubble_ratio_agrees_with_the_simulators_definition():
    plan = make_plan([[(a, 0, 100)] for a in range(6)], num_stages=3)
    result = simulate(plan, build_pipeline_schedule(plan, 3), token_costs(3))
    # every rank's wall clock is the whole run, as when ranks start together
    pairs = [(busy, result.makespan) for busy in result.busy]
    assert measured_bubble_ratio(pairs) == pytest.approx(result.bubble_ratio)
    assert measured_bubble_ratio([(1.0, 2.0), (2.0, 2.0)]) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="at least one rank"):
        measured_bubble_ratio([])


def test_cost_model_counts_sliding_windows_per_stage():
    """A stage of windowed layers (Gemma 2's alternating pattern) costs its samples'
    ``causal_pairs`` per layer, not ``len^2 / 2``: a long sample's attention shrinks, a sample
    within the window costs as before, and the windows follow the stage split."""
    from types import SimpleNamespace

    from lightning_lorafusion.parallel.cost_model import causal_pairs

    shapes = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=100)
    windowed = SimpleNamespace(num_layers=4, sliding_windows=(8, None, 8, None), **shapes)
    full = SimpleNamespace(num_layers=4, sliding_windows=(), **shapes)
    costs = CostModel.from_decoder_config(windowed, (3, 1), flops_per_second=1.0)
    assert costs.stage_windows == ((8, None, 8), (None,))
    plain = CostModel.from_decoder_config(full, (3, 1), flops_per_second=1.0)
    assert plain.stage_windows == ()
    lengths = (40, 6)
    seq_sq = sum(n * n for n in lengths)
    assert costs.attention_pairs(0, seq_sq, lengths) == 2 * (causal_pairs(40, 8) + 18) + (800 + 18)
    assert costs.attention_pairs(1, seq_sq, lengths) == plain.attention_pairs(1, seq_sq, lengths) == seq_sq / 2
    assert costs.forward_time(0, 46, seq_sq, lengths) < plain.forward_time(0, 46, seq_sq, lengths)
    assert costs.forward_time(0, 6, 36, (6,)) == plain.forward_time(0, 6, 36, (6,))  # within the window
    with pytest.raises(ValueError, match="one window"):
        CostModel(stage_layers=(2,), layer_flops_per_token=1.0, stage_windows=((8,),))


def test_time_model_bubble_reflects_imbalanced_stages():
    """On the 8B shape and the mixed workload, the FLOPs split 17/15 looks balanced to the FLOPs
    model but leaves the last stage idle under the time model (as the GPU measured: stage 1 idle
    far more than stage 0); the time-balanced 16/16 idles less overall. A head's backward under
    the time model follows ``head_backward_factor`` (the checkpointed LM head recomputes)."""
    from lightning_lorafusion.data.synthetic import workload_lengths
    from lightning_lorafusion.planner import plan_microbatches

    config = SimpleNamespace(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256, num_hidden_layers=32)
    lengths = workload_lengths("mixed", 4, num_batches=4, batch_size=16, seed=0, max_length=8192)
    plan = plan_microbatches(lengths, capacity=8192, pad_multiple=128, num_stages=2, method="greedy")
    schedule = build_pipeline_schedule(plan, 2)
    flops_view = simulate(plan, schedule, CostModel.from_decoder_config(config, (17, 15)))
    timed_17 = simulate(plan, schedule, CostModel.timed(config, (17, 15), label_fraction=0.08))
    timed_16 = simulate(plan, schedule, CostModel.timed(config, (16, 16), label_fraction=0.08))
    s0, s1 = timed_17.stage_bubble_ratios
    assert s1 > s0 + 0.05  # the last stage waits on the first
    assert abs(flops_view.stage_bubble_ratios[0] - flops_view.stage_bubble_ratios[1]) < s1 - s0
    assert timed_17.bubble_ratio > flops_view.bubble_ratio
    assert timed_16.bubble_ratio < timed_17.bubble_ratio and timed_16.makespan < timed_17.makespan
    head = CostModel.timed(config, (0, 1), label_fraction=0.5, layer_flops_per_token=0.0,
                           layer_bytes_per_token=0.0, head_bytes_per_token=0.0)
    assert head.backward_time(1, 100) == pytest.approx(2.0 * head.forward_time(1, 100))
    assert head.forward_time(0, 100) == 0.0


def test_head_rows_per_microbatch_replace_the_label_fraction():
    """The LM head's rows given per microbatch (a CUDA graph's padded label rows) set the last
    stage's head time; the row's memory traffic (``head_row_bytes``) adds to its GEMM. Stages
    before the last and microbatches without an entry are unchanged."""
    config = SimpleNamespace(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256, num_hidden_layers=32)
    model = CostModel.timed(config, (16, 16), label_fraction=0.1, head_row_bytes=4e6)
    bare = CostModel.timed(config, (16, 16), label_fraction=0.1)
    per_row = 2 * 4096 * 128256 / model.head_flops_per_second + 4e6 / model.memory_bandwidth
    assert model.forward_time(1, 8192, head_rows=1000) - model.forward_time(1, 8192, head_rows=0) == \
        pytest.approx(1000 * per_row)
    assert model.forward_time(1, 8192, head_rows=819.2) == pytest.approx(model.forward_time(1, 8192))
    assert model.forward_time(0, 8192, head_rows=1000) == model.forward_time(0, 8192)
    assert model.head_time_per_token() > bare.head_time_per_token()
    plan = make_plan([[(0, 0, 160)], [(1, 0, 160)], [(2, 0, 160)]], num_stages=2)
    schedule = build_pipeline_schedule(plan, 2)
    plain = simulate(plan, schedule, model)
    padded = simulate(plan, schedule, model, head_rows={0: 90, 1: 90})
    same = simulate(plan, schedule, model, head_rows={0: 16, 1: 16, 2: 16})  # 0.1 x 160 tokens
    last = {(k, i): t1 - t0 for s, k, i, t0, t1 in padded.timeline if s == 1}
    base = {(k, i): t1 - t0 for s, k, i, t0, t1 in plain.timeline if s == 1}
    assert last[("F", 0)] > base[("F", 0)] and last[("F", 2)] == pytest.approx(base[("F", 2)])
    assert same.makespan == pytest.approx(plain.makespan)
