"""In-order knapsack packing: the per-microbatch subset is optimal (vs brute force), whole
windows cover every sample once, fit, keep the lemma and are deterministic."""

from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_lorafusion.planner import Plan, PlannedMicrobatch, PlannerConfig, SampleRef, plan_window, verify_plan
from lightning_lorafusion.planner.greedy import padded_load
from lightning_lorafusion.planner.knapsack import best_subset, pack_in_order


def brute_force_best(samples, capacity, pad, must):
    best = 0
    others = [s for s in samples if s != must]
    for k in range(len(others) + 1):
        for combo in combinations(others, k):
            chosen = [must, *combo]
            if padded_load(chosen, pad) <= capacity:
                best = max(best, sum(s.length for s in chosen))
    return best


@st.composite
def offers(draw):
    capacity, pad = draw(st.sampled_from([(64, 1), (256, 16), (512, 64), (1024, 128), (4096, 128)]))
    num_adapters = draw(st.integers(1, 4))
    samples = []
    for a in range(num_adapters):
        for i, n in enumerate(draw(st.lists(st.integers(1, capacity), min_size=1, max_size=4))):
            samples.append(SampleRef(a, 0, i, n))
    fitting = [s for s in samples if padded_load([s], pad) <= capacity]
    if not fitting:
        fitting = [SampleRef(0, 0, 99, 1)]
        samples.append(fitting[0])
    must = draw(st.sampled_from(fitting))
    return samples, capacity, pad, must


@settings(max_examples=200, deadline=None)
@given(offers())
def test_best_subset_is_optimal_and_fits(offer):
    samples, capacity, pad, must = offer
    by_adapter = {}
    for s in samples:
        by_adapter.setdefault(s.adapter, []).append(s)
    chosen = best_subset(by_adapter, capacity, pad, must)
    assert must in chosen
    assert len(set(chosen)) == len(chosen) and set(chosen) <= set(samples)
    assert padded_load(chosen, pad) <= capacity
    assert sum(s.length for s in chosen) == brute_force_best(samples, capacity, pad, must)


def test_best_subset_prefers_one_padded_segment():
    # Capacity 256, blocks of 128: 130 + 125 = 255 tokens would fit unpadded, but as two
    # adapters' segments they need 256 + 128. Adapter 0's 130 + 120 share one 256 segment.
    a0 = [SampleRef(0, 0, 0, 130), SampleRef(0, 0, 1, 120)]
    a1 = [SampleRef(1, 0, 0, 125)]
    chosen = best_subset({0: a0, 1: a1}, 256, 128, a0[0])
    assert sorted(chosen) == a0


def test_coarse_blocks_stay_within_capacity():
    # pad_multiple 1 with capacity 1000 exceeds MAX_BLOCKS: the DP uses coarser blocks.
    samples = [SampleRef(a, 0, i, n) for a in range(3) for i, n in enumerate([333, 271, 17, 5])]
    by_adapter = {}
    for s in samples:
        by_adapter.setdefault(s.adapter, []).append(s)
    chosen = best_subset(by_adapter, 1000, 1, samples[0])
    assert padded_load(chosen, 1) <= 1000 and samples[0] in chosen
    assert sum(s.length for s in chosen) >= 990  # 333+271+333+17+5+... nearly full


@st.composite
def windows(draw):
    capacity, pad = draw(st.sampled_from([(128, 1), (256, 16), (512, 64), (1024, 128)]))
    num_adapters = draw(st.integers(1, 5))
    rounds = draw(st.integers(1, 4))
    lengths = []
    for _ in range(num_adapters):
        top = draw(st.integers(1, capacity))
        batches = draw(st.integers(1, rounds))
        lengths.append([draw(st.lists(st.integers(1, top), min_size=1, max_size=6)) for _ in range(batches)])
    return lengths, capacity, pad


def single_adapter_waves(lengths):
    rounds = max(len(b) for b in lengths)
    return [
        [SampleRef(a, r, i, n) for i, n in enumerate(lengths[a][r])]
        for r in range(rounds)
        for a in range(len(lengths))
        if r < len(lengths[a])
    ]


@settings(max_examples=150, deadline=None)
@given(windows(), st.integers(1, 4), st.booleans())
def test_pack_in_order_covers_fits_and_keeps_the_lemma(work, stages, staggered):
    lengths, capacity, pad = work
    waves = single_adapter_waves(lengths)
    bins = pack_in_order(waves, capacity, pad, stages, staggered=staggered)
    assert bins == pack_in_order(waves, capacity, pad, stages, staggered=staggered)  # deterministic
    mbs = tuple(PlannedMicrobatch(tuple(sorted(b))) for b in bins)
    plan = Plan(
        capacity=capacity, pad_multiple=pad, num_stages=stages, microbatches=mbs,
        step_points=Plan.compute_step_points(mbs),
    )
    # Empty positions are no-op slots here, so the raw order already satisfies everything.
    assert verify_plan(plan, lengths) == []


@settings(max_examples=150, deadline=None)
@given(windows(), st.integers(1, 4))
def test_staggered_packing_finishes_one_wave_per_microbatch(work, stages):
    # Only the earliest wave offered at a position may finish there; with one adapter per
    # wave that is at most one global batch per microbatch, in wave order per adapter.
    lengths, capacity, pad = work
    waves = single_adapter_waves(lengths)
    bins = pack_in_order(waves, capacity, pad, stages, staggered=True)
    step = {}
    for i, b in enumerate(bins):
        for s in b:
            step[(s.adapter, s.batch)] = i
    assert len(step) == len(waves)
    assert len(set(step.values())) == len(step), f"two batches finish in one microbatch: {step}"


@settings(max_examples=60, deadline=None)
@given(windows(), st.integers(1, 4))
def test_knapsack_trial_never_lengthens_the_plan(work, stages):
    lengths, capacity, pad = work
    common = dict(capacity=capacity, pad_multiple=pad, num_stages=stages)
    with_knapsack, report = plan_window(lengths, PlannerConfig(**common))
    without, _ = plan_window(lengths, PlannerConfig(knapsack=False, **common))
    assert verify_plan(with_knapsack, lengths) == []
    assert len(with_knapsack.microbatches) <= len(without.microbatches)
    assert report.knapsack_microbatches is not None
    assert len(with_knapsack.microbatches) == min(len(without.microbatches), report.knapsack_microbatches)
    assert (report.used == "knapsack") == (report.knapsack_microbatches < len(without.microbatches))
