"""Two-stage MILP: optimal on tiny instances (vs brute force), never worse than greedy, both solvers."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_lorafusion.planner.greedy import bin_count_lower_bound, pack_first_fit_decreasing, padded_load
from lightning_lorafusion.planner.milp import pack_milp, solver_name

from planner_reference import brute_force_packing, refs


def run_milp(samples, capacity, pad, solver="auto", neighbourhood=16):
    greedy = pack_first_fit_decreasing(samples, capacity, pad)
    out = pack_milp(
        samples,
        capacity=capacity,
        pad_multiple=pad,
        greedy_bins=greedy,
        lower_bound=bin_count_lower_bound(samples, capacity, pad),
        time_limit=20.0,
        max_nodes=10_000,
        solver=solver,
        neighbourhood=neighbourhood,
    )
    return greedy, out


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_milp_beats_ffd_on_known_gap_instance(solver):
    samples = refs([[4, 4, 3, 3, 3, 3]])
    greedy, out = run_milp(samples, 10, 1, solver=solver)
    assert len(greedy) == 3 and out.fewer_bins and len(out.bins) == 2
    assert sorted(s for b in out.bins for s in b) == sorted(samples)
    assert all(padded_load(b, 1) <= 10 for b in out.bins)
    # Stage 2 cannot shrink the tail below 10: both bins are full.
    assert [padded_load(b, 1) for b in out.bins] == [10, 10]


def test_auto_prefers_highs_when_installed():
    import importlib.util

    import mip

    want = mip.HIGHS if importlib.util.find_spec("highspy") else mip.CBC
    assert solver_name("auto") == want
    assert solver_name("cbc") == mip.CBC


def test_stage_two_empties_the_tail():
    # FFD: [8,1] [4,4] [3,3] leaves a tail of 6; [8,1] [4,3,3] [4] has a tail of 4, the
    # smallest possible with three bins (brute force).
    samples = refs([[8, 4, 4, 3, 3, 1]])
    greedy, out = run_milp(samples, 10, 1)
    assert len(greedy) == 3 and min(padded_load(b, 1) for b in greedy) == 6
    assert brute_force_packing(samples, 10, 1) == (3, 4)
    assert out.smaller_tail and not out.fewer_bins
    assert [padded_load(b, 1) for b in out.bins][-1] == 4


tiny = st.lists(st.lists(st.integers(1, 64), min_size=1, max_size=3), min_size=1, max_size=3).filter(
    lambda x: sum(map(len, x)) <= 6
)


@settings(max_examples=12, deadline=None)
@given(tiny, st.sampled_from([(64, 1), (64, 16), (96, 32)]))
def test_milp_matches_brute_force_and_never_worse_than_greedy(lengths, cap_pad):
    capacity, pad = cap_pad
    samples = refs(lengths)
    greedy, out = run_milp(samples, capacity, pad)
    assert sorted(s for b in out.bins for s in b) == sorted(samples)
    assert all(padded_load(b, pad) <= capacity for b in out.bins)
    loads = [padded_load(b, pad) for b in out.bins]
    assert loads == sorted(loads, reverse=True)  # emptiest last
    assert len(out.bins) <= len(greedy)
    if len(out.bins) == len(greedy):
        assert loads[-1] <= min(padded_load(b, pad) for b in greedy)
    # With a neighbourhood covering every bin and a large node budget, both stages are exact.
    assert out.stage1_status in ("skipped", "OPTIMAL") and out.stage2_status in ("skipped", "OPTIMAL")
    assert (len(out.bins), loads[-1]) == brute_force_packing(samples, capacity, pad)
