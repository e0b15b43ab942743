"""verify_plan finds every kind of problem; fix_plan inserts exactly the no-ops the lemma needs."""

import pytest

from lightning_lorafusion.planner import Plan, PlannedMicrobatch, PlanningError, SampleRef, fix_plan, verify_plan
from lightning_lorafusion.planner import plan_microbatches


def make_plan(mbs, *, capacity=10, pad=1, stages=1):
    micro = tuple(PlannedMicrobatch(tuple(SampleRef(*s) for s in mb)) for mb in mbs)
    return Plan(capacity=capacity, pad_multiple=pad, num_stages=stages, microbatches=micro,
                step_points=Plan.compute_step_points(micro))


def test_valid_plan_has_no_problems():
    p = make_plan([[(0, 0, 0, 4), (1, 0, 0, 5)], [(0, 1, 0, 3)]])
    assert verify_plan(p, [[[4], [3]], [[5]]]) == []


def test_each_problem_is_reported():
    over = make_plan([[(0, 0, 0, 6), (1, 0, 0, 5)]])
    assert any("capacity: microbatch 0 holds 11" in m for m in verify_plan(over))
    padded = make_plan([[(0, 0, 0, 5), (1, 0, 0, 1)]], capacity=8, pad=4)  # 8 + 4 > 8
    assert any("capacity" in m for m in verify_plan(padded))
    unsorted = make_plan([[(1, 0, 0, 1), (0, 0, 0, 1)]])
    assert any(m.startswith("order") for m in verify_plan(unsorted))
    dup = make_plan([[(0, 0, 0, 1)], [(0, 0, 0, 1)]])
    assert any("appears in microbatches 0 and 1" in m for m in verify_plan(dup))
    lemma = make_plan([[(0, 0, 0, 1)], [(0, 1, 0, 1)]], stages=2)
    assert any("adapter 0 batch 1 starts at microbatch 1" in m for m in verify_plan(lemma))
    good = make_plan([[(0, 0, 0, 1)]])
    assert any("adapter 0 batch 0 sample 1 is missing" in m for m in verify_plan(good, [[[1, 2]]]))
    assert any("has length 1 in the plan but 3" in m for m in verify_plan(good, [[[3]]]))
    stale = Plan(capacity=10, pad_multiple=1, num_stages=1, microbatches=good.microbatches, step_points={})
    assert any(m.startswith("step_points") for m in verify_plan(stale))


def test_fix_plan_inserts_minimal_noops():
    # Adapter 0: batch 0 steps at 1, batch 1 starts at 2; with S=3 it needs 2 no-ops before it.
    # Adapter 1's batch 1 (at 3) is then already far enough from its step at 0.
    p = make_plan(
        [[(0, 0, 0, 1), (1, 0, 0, 1)], [(0, 0, 1, 1)], [(0, 1, 0, 1)], [(1, 1, 0, 1)]], stages=3
    )
    fixed = fix_plan(p)
    assert verify_plan(fixed) == []
    assert [mb.is_noop for mb in fixed.microbatches] == [False, False, True, True, False, False]
    assert fixed.step_points[(0, 1)] == 4 and fixed.step_points[(1, 1)] == 5
    assert fix_plan(fixed) == fixed


def test_fix_plan_uses_carried_state():
    p = make_plan([[(0, 3, 0, 1)], [(1, 0, 0, 1)]], stages=4)
    # Adapter 0's batch 2 stepped 1 microbatch before this plan's start: 3 no-ops needed.
    fixed = fix_plan(p, carry_in={0: (2, 1)})
    assert [mb.is_noop for mb in fixed.microbatches] == [True, True, True, False, False]
    # A carried batch that is not the previous one does not constrain.
    assert fix_plan(p, carry_in={0: (1, 1)}) == p


def test_fix_plan_refuses_interleaved_batches():
    p = make_plan([[(0, 0, 0, 1)], [(0, 1, 0, 1)], [(0, 0, 1, 1)]])
    with pytest.raises(PlanningError, match="adapter 0 batch 1 starts at microbatch 1, before batch 0 completes"):
        fix_plan(p)
    with pytest.raises(PlanningError, match="capacity"):
        fix_plan(make_plan([[(0, 0, 0, 11)]]))


def test_too_long_sample_names_adapter_batch_sample_and_capacity():
    with pytest.raises(PlanningError) as e:
        plan_microbatches([[[10, 20]], [[5], [300, 129]]], capacity=256, pad_multiple=64)
    msg = str(e.value)
    assert "adapter 1, global batch 1, sample 0 has 300 tokens" in msg
    assert "set data.capacity >= 320" in msg


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(capacity=100, pad_multiple=64), "multiple of pad_multiple"),
        (dict(capacity=128, num_stages=0), "num_stages"),
        (dict(capacity=128, method="ilp"), "method='ilp'"),
        (dict(capacity=128, solver="gurobi"), "solver='gurobi'"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(PlanningError, match=match):
        plan_microbatches([[[1]]], **kwargs)


def test_bad_lengths_raise():
    with pytest.raises(PlanningError, match="adapter 0, global batch 0 has no samples"):
        plan_microbatches([[[]]], capacity=8)
    with pytest.raises(PlanningError, match="length 0"):
        plan_microbatches([[[0]]], capacity=8)
    with pytest.raises(PlanningError, match="lengths is empty"):
        plan_microbatches([], capacity=8)


def test_json_round_trip_keeps_noops():
    p = fix_plan(make_plan([[(0, 0, 0, 1)], [(0, 1, 0, 2)]], stages=3))
    assert any(mb.is_noop for mb in p.microbatches)
    assert Plan.from_json(p.to_json()) == p
