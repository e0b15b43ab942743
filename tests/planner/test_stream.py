"""plan_stream: same plans for any worker count, exact resume, stitched windows keep the lemma."""

from lightning_lorafusion.data.synthetic import workload_lengths
from lightning_lorafusion.planner import PlannerConfig, join_plans, plan_microbatches, plan_stream, verify_plan


def test_workers_do_not_change_plans_and_resume_is_exact():
    lengths = workload_lengths("heterogeneous", 3, num_batches=6, batch_size=4, seed=7, max_length=2048)
    cfg = PlannerConfig(capacity=2048, pad_multiple=128, num_stages=2, method="milp", max_nodes=50)
    inline = list(plan_stream(lengths, cfg, window=2, workers=0))
    pooled = list(plan_stream(lengths, cfg, window=2, workers=2, prefetch=3))
    assert [w.plan.to_json() for w in inline] == [w.plan.to_json() for w in pooled]
    assert [w.window for w in pooled] == [0, 1, 2] and [w.first_round for w in pooled] == [0, 2, 4]
    joined = join_plans([w.plan for w in inline])
    assert verify_plan(joined, lengths) == []
    for w in inline:
        assert verify_plan(w.plan, carry_in=w.carry_in) == []
    assert plan_microbatches(
        lengths, capacity=2048, pad_multiple=128, num_stages=2, method="milp", max_nodes=50, window=2
    ) == joined
    resumed = list(plan_stream(lengths, cfg, window=2, start_window=1, carry_in=inline[1].carry_in))
    assert [w.plan for w in resumed] == [w.plan for w in inline[1:]]
    assert inline[-1].carry_out == {a: (5, inline[-1].carry_out[a][1]) for a in range(3)}


def test_window_boundaries_get_noops_when_needed():
    # One adapter, one sample per batch, S = 3: every window boundary needs two no-ops.
    lengths = [[[10]] * 5]
    cfg = PlannerConfig(capacity=64, num_stages=3)
    windows = list(plan_stream(lengths, cfg, window=2))
    joined = join_plans([w.plan for w in windows])
    assert verify_plan(joined, lengths) == []
    assert sum(mb.is_noop for mb in joined.microbatches) == 2 * 4
    # Without the stitching no-ops, the carried state exposes the boundary violation.
    bare = windows[1].plan.microbatches[2:]
    from lightning_lorafusion.planner import Plan

    unstitched = Plan(capacity=64, pad_multiple=1, num_stages=3, microbatches=bare,
                      step_points=Plan.compute_step_points(bare))
    assert any("bubble lemma" in m for m in verify_plan(unstitched, carry_in=windows[1].carry_in))
    assert joined == plan_microbatches(lengths, capacity=64, num_stages=3)


def test_uneven_adapters_and_bad_arguments():
    lengths = [[[5, 6]] * 5, [[7]] * 2]
    cfg = PlannerConfig(capacity=32, num_stages=1)
    windows = list(plan_stream(lengths, cfg, window=2))
    assert len(windows) == 3
    assert verify_plan(join_plans([w.plan for w in windows]), lengths) == []
    import pytest

    with pytest.raises(ValueError, match="window=0"):
        next(plan_stream(lengths, cfg, window=0))
    with pytest.raises(ValueError, match="set data.capacity >= 40"):
        next(plan_stream([[[40]]], cfg))
