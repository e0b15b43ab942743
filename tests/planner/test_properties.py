"""Property tests of plan_microbatches over random lengths, 1-8 adapters, capacities and S."""

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_lorafusion.planner import PlannerConfig, plan_microbatches, plan_window, verify_plan


@st.composite
def workloads(draw, max_adapters=8, max_batches=4, max_batch=8):
    capacity, pad = draw(st.sampled_from([(128, 1), (256, 16), (512, 64), (1024, 128), (4096, 128)]))
    num_adapters = draw(st.integers(1, max_adapters))
    # Each adapter gets its own length scale, so adapters differ as real datasets do.
    lengths = []
    for _ in range(num_adapters):
        top = draw(st.integers(1, capacity))
        batches = draw(st.integers(1, max_batches))
        lengths.append(
            [draw(st.lists(st.integers(1, top), min_size=1, max_size=max_batch)) for _ in range(batches)]
        )
    return lengths, capacity, pad


@settings(max_examples=150, deadline=None)
@given(workloads(), st.integers(1, 4), st.booleans(), st.booleans())
def test_greedy_plans_cover_fit_and_keep_the_lemma(work, stages, grouping, merge):
    lengths, capacity, pad = work
    plan = plan_microbatches(
        lengths, capacity=capacity, pad_multiple=pad, num_stages=stages, grouping=grouping, merge=merge
    )
    assert verify_plan(plan, lengths) == []
    assert plan.step_points == plan.compute_step_points(plan.microbatches)
    # Exactly once: the multiset of planned samples equals the input.
    planned = sorted((s.adapter, s.batch, s.index, s.length) for mb in plan.microbatches for s in mb.samples)
    want = sorted((a, j, i, n) for a, bs in enumerate(lengths) for j, b in enumerate(bs) for i, n in enumerate(b))
    assert planned == want
    # Deterministic: planning again gives the identical plan.
    again = plan_microbatches(
        lengths, capacity=capacity, pad_multiple=pad, num_stages=stages, grouping=grouping, merge=merge
    )
    assert again == plan


@settings(max_examples=15, deadline=None)
@given(workloads(max_adapters=4, max_batches=2, max_batch=5), st.integers(1, 3))
def test_milp_never_more_microbatches_than_greedy_and_deterministic(work, stages):
    lengths, capacity, pad = work
    common = dict(capacity=capacity, pad_multiple=pad, num_stages=stages)
    greedy = plan_microbatches(lengths, **common)  # greedy + merge, or the knapsack plan if shorter
    cfg = PlannerConfig(method="milp", time_limit=10.0, max_nodes=50, **common)
    milp, report = plan_window(lengths, cfg)
    assert verify_plan(milp, lengths) == []
    assert len(milp.microbatches) <= len(greedy.microbatches)
    waves_only = plan_microbatches(lengths, knapsack=False, **common)
    assert report.greedy_microbatches == len(waves_only.microbatches)
    assert len(greedy.microbatches) <= len(waves_only.microbatches)
    for wave in report.waves:
        assert wave.bins <= wave.greedy_bins
        assert wave.lower_bound <= wave.bins
        if wave.bins == wave.greedy_bins:
            assert wave.tail <= wave.greedy_tail
    assert plan_window(lengths, cfg)[0] == milp
