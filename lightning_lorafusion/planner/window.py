"""plan_window: one window of global batches -> a verified Plan. Group adapters, pack each
wave (greedy or MILP) or the whole window in order (knapsack), merge, keep the shortest plan,
verify, fix."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Sequence

from .config import Lengths, PlannerConfig, validate_lengths
from .greedy import bin_count_lower_bound, emptiest_last, pack_first_fit_decreasing, padded_load
from .grouping import Groups, feasible_groupings, group_adapters
from .knapsack import pack_in_order
from .merge import merge_across_batches
from .plan import Plan, PlannedMicrobatch, SampleRef
from .verify import check_plan, fix_plan


@dataclass(frozen=True, kw_only=True)
class WaveReport:
    """How one wave (batch ``round`` of each adapter in ``group``) was packed."""

    round: int
    group: tuple[int, ...]
    num_samples: int
    lower_bound: int
    greedy_bins: int
    bins: int
    greedy_tail: int  # padded tokens of greedy's smallest microbatch
    tail: int
    method: str  # "greedy" or "milp": whose packing was kept
    stage1_status: str = "skipped"
    stage2_status: str = "skipped"
    seconds: float = 0.0


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """What the planner did for one plan; timings are informational, never part of the Plan."""

    groups: Groups
    waves: tuple[WaveReport, ...]
    microbatches_before_merge: int
    microbatches_after_merge: int
    noops: int
    seconds: float
    greedy_microbatches: int  # the all-greedy plan's length (incl. no-ops), for comparison
    used: str  # "greedy", "milp" or "knapsack": the plan-level winner (ties: in that order, MILP first)
    knapsack_microbatches: int | None = None  # the best knapsack plan's length; None if not tried
    knapsack_groups: Groups | None = None  # the grouping of that knapsack plan


def pack_wave(
    samples: Sequence[SampleRef], config: PlannerConfig, *, round_: int = 0, group: Sequence[int] = ()
) -> tuple[list[list[SampleRef]], list[list[SampleRef]], WaveReport]:
    """(chosen bins, greedy bins) for one wave, emptiest last, and which method won."""
    t0 = time.perf_counter()
    greedy = emptiest_last(pack_first_fit_decreasing(samples, config.capacity, config.pad_multiple), config.pad_multiple)
    lower = bin_count_lower_bound(samples, config.capacity, config.pad_multiple)
    greedy_tail = padded_load(greedy[-1], config.pad_multiple)
    bins, method, s1, s2 = greedy, "greedy", "skipped", "skipped"
    if config.method == "milp":
        from .milp import pack_milp

        outcome = pack_milp(
            samples,
            capacity=config.capacity,
            pad_multiple=config.pad_multiple,
            greedy_bins=greedy,
            lower_bound=lower,
            time_limit=config.time_limit,
            max_nodes=config.max_nodes,
            solver=config.solver,
            seed=config.seed,
            neighbourhood=config.neighbourhood,
        )
        s1, s2 = outcome.stage1_status, outcome.stage2_status
        if outcome.fewer_bins or outcome.smaller_tail:
            bins, method = outcome.bins, "milp"
    report = WaveReport(
        round=round_,
        group=tuple(group),
        num_samples=len(samples),
        lower_bound=lower,
        greedy_bins=len(greedy),
        bins=len(bins),
        greedy_tail=greedy_tail,
        tail=padded_load(bins[-1], config.pad_multiple),
        method=method,
        stage1_status=s1,
        stage2_status=s2,
        seconds=time.perf_counter() - t0,
    )
    return bins, greedy, report


def assemble_plan(bins: list[list[SampleRef]], config: PlannerConfig) -> tuple[Plan, int]:
    """Merge (if configured) and fix the concatenated wave bins; also the count after merge.

    Empty bins are dropped first: ``fix_plan`` re-inserts exactly the no-ops the lemma needs.
    """
    bins = [b for b in bins if b]
    if config.merge:
        bins = merge_across_batches(
            bins, capacity=config.capacity, pad_multiple=config.pad_multiple, num_stages=config.num_stages
        )
    mbs = tuple(PlannedMicrobatch(tuple(sorted(b))) for b in bins)
    plan = Plan(
        capacity=config.capacity,
        pad_multiple=config.pad_multiple,
        num_stages=config.num_stages,
        microbatches=mbs,
        step_points=Plan.compute_step_points(mbs),
    )
    return fix_plan(plan), len(bins)


def _waves(lengths: Lengths, groups: Groups, offsets: Sequence[int]):
    """(round, group, samples) of every non-empty wave in execution order."""
    out = []
    for r in range(max(len(b) for b in lengths)):
        for group in groups:
            samples = [
                SampleRef(a, offsets[a] + r, i, int(n))
                for a in group
                if r < len(lengths[a])
                for i, n in enumerate(lengths[a][r])
            ]
            if samples:
                out.append((r, group, samples))
    return out


def plan_window(
    lengths: Lengths, config: PlannerConfig, *, batch_offsets: Sequence[int] | None = None
) -> tuple[Plan, PlanReport]:
    """Plan ``lengths[a][j]`` (adapter a's global batch ``batch_offsets[a] + j``) and report how.

    Raises PlanningError on bad input (naming adapter, batch, sample and the capacity to set)
    and if the finished plan fails verification.
    """
    t0 = time.perf_counter()
    validate_lengths(lengths, config)
    offsets = list(batch_offsets) if batch_offsets is not None else [0] * len(lengths)
    if len(offsets) != len(lengths):
        raise ValueError(f"batch_offsets has {len(offsets)} entries for {len(lengths)} adapters")
    greedy_config = replace(config, method="greedy")

    def greedy_length(groups: Groups) -> int:
        bins = [b for wave in _waves(lengths, groups, offsets) for b in pack_wave(wave[2], greedy_config)[0]]
        return len(assemble_plan(bins, greedy_config)[0].microbatches)

    groups = group_adapters(lengths, config, score=greedy_length)
    bins: list[list[SampleRef]] = []
    greedy_bins: list[list[SampleRef]] = []
    waves = []
    for r, group, samples in _waves(lengths, groups, offsets):
        chosen, greedy, report = pack_wave(samples, config, round_=r, group=group)
        bins.extend(chosen)
        greedy_bins.extend(greedy)
        waves.append(report)
    plan, after = assemble_plan(bins, config)
    used = "milp" if config.method == "milp" else "greedy"
    greedy_count = len(plan.microbatches)
    if any(w.method == "milp" for w in waves):
        # The MILP wins wave by wave; the merge could still favour greedy's packing, so the
        # plan-level result is whichever is shorter (never worse than greedy).
        greedy_plan, greedy_after = assemble_plan(greedy_bins, config)
        greedy_count = len(greedy_plan.microbatches)
        if greedy_count < len(plan.microbatches):
            plan, after, used = greedy_plan, greedy_after, "greedy"
    knapsack_count, knapsack_groups = None, None
    if config.knapsack:
        # In-order knapsack trials per feasible grouping (with S > 1 also the staggered
        # variant), each a pure function of the window, kept only when strictly shorter: both
        # methods see the same candidates, so the MILP plan is still never longer than greedy's.
        variants = (False, True) if config.num_stages > 1 else (False,)
        for trial_groups in feasible_groupings(lengths, config):
            waves_in_order = [w[2] for w in _waves(lengths, trial_groups, offsets)]
            for staggered in variants:
                trial_bins = pack_in_order(
                    waves_in_order, config.capacity, config.pad_multiple, config.num_stages, staggered=staggered
                )
                trial, trial_after = assemble_plan(trial_bins, config)
                if knapsack_count is None or len(trial.microbatches) < knapsack_count:
                    knapsack_count, knapsack_groups = len(trial.microbatches), trial_groups
                if len(trial.microbatches) < len(plan.microbatches):
                    plan, after, used = trial, trial_after, "knapsack"
    check_plan(plan, lengths, batch_offsets=offsets)
    report = PlanReport(
        groups=groups,
        waves=tuple(waves),
        microbatches_before_merge=len(bins),
        microbatches_after_merge=after,
        noops=sum(1 for mb in plan.microbatches if mb.is_noop),
        seconds=time.perf_counter() - t0,
        greedy_microbatches=greedy_count,
        used=used,
        knapsack_microbatches=knapsack_count,
        knapsack_groups=knapsack_groups,
    )
    return plan, report
