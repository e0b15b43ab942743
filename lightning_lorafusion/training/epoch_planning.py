"""Planning an epoch for the data module: the planner run over every adapter's global batches
(window by window), a checkpointed plan checked against this run's data, and each data-parallel
replica's share of a global batch."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from ..data.packing import PackingConfig, SampleLookup
from ..parallel.replica_shards import (
    ReplicaLookup,
    bundle_global_batch,
    capacity_levels,
    deal_slots,
    level_of,
    rounded_needs,
    slot_lengths,
)
from ..planner import PlannerConfig, join_plans, plan_stream
from ..planner.config import METHODS
from ..planner.plan import Plan
from ..planner.stream import num_windows
from ..planner.verify import verify_plan
from ..specs import ConfigError, parse_section

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PlanningConfig:
    """``data.planner``: how each epoch is planned. ``method`` and ``time_limit`` are the
    ``PlannerConfig`` fields of those names (capacity, padding, stages and seed come from the
    data module and the strategy).

    - ``method``: "greedy" or "milp" (two-stage MILP, greedy where not proven optimal).
    - ``time_limit``: wall-clock safety limit (s) per MILP solve (the MILP result is used only
      when proven optimal within a node budget, so plans do not depend on speed).
    - ``window``: global batches per adapter planned together (one planning job).
    - ``workers``: processes planning windows in parallel (0: in this process).
    """

    method: str = "greedy"
    time_limit: float = 5.0
    window: int = 8
    workers: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"data.planner.method={self.method!r}; allowed: {', '.join(map(repr, METHODS))}")
        if isinstance(self.time_limit, bool) or not isinstance(self.time_limit, (int, float)) or not self.time_limit > 0:
            raise ConfigError(f"data.planner.time_limit={self.time_limit!r} must be > 0 seconds")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ConfigError(f"data.planner.window={self.window!r} must be an int >= 1")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 0:
            raise ConfigError(f"data.planner.workers={self.workers!r} must be an int >= 0")

    @classmethod
    def parse(cls, value: "PlanningConfig | dict | None") -> "PlanningConfig":
        """A ``PlanningConfig`` from itself, a mapping (YAML, Python) or None (the default)."""
        return parse_section(cls, value, where="data.planner", scalar_field="method",
                             fields="method, time_limit, window, workers")

    def planner_config(self, *, capacity: int, pad_multiple: int, num_stages: int, seed: int,
                       method: str | None = None) -> PlannerConfig:
        """The planner's config for one planning run (``method`` overrides this section's)."""
        return PlannerConfig(capacity=capacity, pad_multiple=pad_multiple, num_stages=num_stages,
                             method=self.method if method is None else method, time_limit=self.time_limit,
                             seed=seed)


@dataclass(frozen=True)
class EpochPlan:
    """Everything needed to stream one epoch: the plan and how to find each sample."""

    epoch: int
    plan: Plan
    lookup: SampleLookup
    denominators: dict[tuple[int, int], int]
    step_adapters: dict[int, tuple[int, ...]]  # microbatch position -> adapters that step
    # per position, the capacity it is packed at (data parallel without a pipeline); None: the plan's
    capacities: tuple[int, ...] | None = None


def window_starts(plan: Plan, window: int) -> dict[int, int]:
    """Planning window -> position of its first sample in ``plan`` (windows hold rounds
    ``[w * window, (w + 1) * window)`` of every adapter and follow each other, so no global
    batch straddles these positions)."""
    starts: dict[int, int] = {}
    for pos, mb in enumerate(plan.microbatches):
        for s in mb.samples:
            starts.setdefault(s.batch // window, pos)
    return starts


def plan_fill(plan: Plan, capacity: int) -> float:
    """Real tokens over the slots of the plan's microbatches (no-op slots count as empty)."""
    real = sum(mb.real_tokens() for mb in plan.microbatches)
    return real / max(1, len(plan.microbatches) * capacity)


def plan_windows(lengths, config: PlannerConfig, *, window: int, workers: int, start_window: int = 0,
                 carry_in=None) -> Plan:
    """``lengths`` planned window by window from ``start_window`` and joined into one plan."""
    if start_window >= num_windows(lengths, window):  # nothing (left) to plan
        return Plan(capacity=config.capacity, pad_multiple=config.pad_multiple, num_stages=config.num_stages,
                    microbatches=())
    windows = plan_stream(lengths, config, window=window, workers=workers, start_window=start_window,
                          carry_in=carry_in)
    return join_plans([wp.plan for wp in windows])


def check_restored_plan(plan: Plan, lengths, *, packing: PackingConfig, excluded: frozenset[int],
                        epoch: int) -> None:
    """A checkpoint saved mid-epoch resumes that epoch's plan: it must fit this run's data."""
    problems = []
    if (plan.capacity, plan.pad_multiple) != (packing.capacity, packing.pad_multiple):
        problems.append(
            f"it was planned with data.capacity={plan.capacity}, data.pad_multiple="
            f"{plan.pad_multiple}; this run has {packing.capacity}, {packing.pad_multiple}"
        )
    # a stopped adapter's samples end where its planning stopped: at a window boundary, so
    # what the plan holds of it is whole global batches 0 .. k-1
    last: dict[int, int] = {}
    for mb in plan.microbatches:
        for ref in mb.samples:
            last[ref.adapter] = max(last.get(ref.adapter, -1), ref.batch)
    lengths = [batches[: last.get(a, -1) + 1] if a in excluded else batches for a, batches in enumerate(lengths)]
    problems += verify_plan(plan, lengths)
    if problems:
        raise ConfigError(
            f"the checkpoint stopped inside epoch {epoch}, but its plan for that epoch does "
            f"not match this run's data ({problems[0]}"
            + (f"; {len(problems) - 1} more problem(s)" if len(problems) > 1 else "")
            + "); resume with the data settings the checkpoint was saved with (datasets, "
            "max_length, capacity, pad_multiple, devices), or start without --ckpt_path"
        )


def replica_shards(datasets: Sequence[Sequence[Any]], lookup: SampleLookup, lengths, *, data_parallel_size: int,
                   replica: int) -> tuple[SampleLookup, list]:
    """This replica's share of every global batch, and the slot lengths to plan (each slot's
    longest bundle, which bounds every replica's bundle in it): one plan shape for all
    replicas, so they step adapters in the same order (``parallel.replica_shards``). Each slot's
    bundles in the order ``bundle_global_batch`` made them (``deal_replica_shards`` deals them
    once the plan is known)."""
    dp = data_parallel_size
    bundles = _bundles(lookup, lengths, dp)
    slots = [[slot_lengths(b, dict(zip(batch, lens)))
              for b, batch, lens in zip(per_adapter, lookup.batches[a], lengths[a])]
             for a, per_adapter in enumerate(bundles)]
    real = sum(n for per_adapter in lengths for batch in per_adapter for n in batch)
    planned = dp * sum(n for per_adapter in slots for batch in per_adapter for n in batch)
    log.info("data parallel x%d: replica %d of each global batch; slots padded to their longest "
             "bundle keep %.1f%% of the planned tokens real", dp, replica, 100 * real / max(1, planned))
    return _replica_lookup(datasets, bundles, replica, lambda a, j, k: replica), slots


def replica_needs(lookup: SampleLookup, lengths, plan: Plan, *, data_parallel_size: int,
                  pad_multiple: int) -> list[int]:
    """Each planned microbatch's need once its slots are dealt (``deal_slots``: its longest replica
    share), rounded up to the capacity-level step (``rounded_needs``); 0 for a no-op slot."""
    _, _, needs = _dealt(lookup, lengths, plan, data_parallel_size, pad_multiple)
    return rounded_needs(needs, plan.capacity, pad_multiple)


def plan_needs(plan: Plan, pad_multiple: int) -> list[int]:
    """One process's need per planned microbatch (no replicas to deal): its tokens with every
    adapter segment padded as packing pads it, rounded up to the capacity-level step
    (``rounded_needs``); 0 for a no-op slot."""
    needs = [0 if mb.is_noop else mb.padded_tokens(pad_multiple) for mb in plan.microbatches]
    return rounded_needs(needs, plan.capacity, pad_multiple)


def epoch_needs(lookup: SampleLookup, lengths, plan: Plan, *, data_parallel_size: int,
                pad_multiple: int) -> list[int]:
    """Each planned microbatch's need: one process's own tokens (``plan_needs``), or with replicas
    the longest replica share once dealt (``replica_needs``)."""
    if data_parallel_size == 1:
        return plan_needs(plan, pad_multiple)
    return replica_needs(lookup, lengths, plan, data_parallel_size=data_parallel_size, pad_multiple=pad_multiple)


def log_packed_levels(epoch: int, plan: Plan, capacities: Sequence[int]) -> None:
    """What packing at the levels saves over packing every microbatch at the plan's capacity."""
    live = [c for c, mb in zip(capacities, plan.microbatches) if not mb.is_noop]
    real = sum(mb.real_tokens() for mb in plan.microbatches)
    log.info("epoch %d packed at capacities %s: %.1f%% of the tokens computed real (%.1f%% at capacity %d "
             "for every microbatch)", epoch, sorted(set(live)), 100 * real / max(1, sum(live)),
             100 * real / max(1, plan.capacity * len(live)), plan.capacity)


def level_capacities(needs: Sequence[int], levels: Sequence[int], capacity: int) -> tuple[int, ...]:
    """The capacity each plan position is packed at: the smallest of ``levels`` holding its need
    (``capacity`` for a no-op slot)."""
    return tuple(level_of(n, levels) if n else capacity for n in needs)


def run_capacity_levels(needs: Sequence[Sequence[int]], capacity: int, levels: int) -> tuple[int, ...]:
    """The capacities a run packs at (``capacity_levels`` over the needs of the epochs given, the
    plan's ``capacity`` always among them, so every later epoch's microbatch fits one)."""
    return tuple(capacity_levels([n for epoch in needs for n in epoch] + [capacity], levels))


def deal_replica_shards(datasets: Sequence[Sequence[Any]], lookup: SampleLookup, lengths, plan: Plan, *,
                        data_parallel_size: int, replica: int, pad_multiple: int,
                        levels: Sequence[int] | None = None) -> tuple[SampleLookup, tuple[int, ...] | None]:
    """This replica's share once ``plan`` (the shape plan of ``replica_shards``' slot lengths) is
    known: each slot's bundles dealt so that every planned microbatch holds about as many tokens
    on every replica (``deal_slots``), and with capacity ``levels`` (only without a pipeline) the
    capacity each plan position is packed at, the smallest level holding its need, the same on
    every replica; None: the plan's."""
    dp = data_parallel_size
    bundles, deal, needs = _dealt(lookup, lengths, plan, dp, pad_multiple)
    mine = _replica_lookup(datasets, bundles, replica, lambda a, j, k: deal.get((a, j, k), (replica,) * dp)[replica])
    if not levels:
        return mine, None
    capacities = level_capacities(rounded_needs(needs, plan.capacity, pad_multiple), levels, plan.capacity)
    real = sum(n for per_adapter in lengths for batch in per_adapter for n in batch)
    packed = dp * sum(c for c, mb in zip(capacities, plan.microbatches) if not mb.is_noop)
    log.info("data parallel x%d without a pipeline: microbatches packed at capacities %s (%.1f%% of the tokens "
             "real; %.1f%% at the plan's capacity %d)", dp, sorted(set(capacities)), 100 * real / max(1, packed),
             100 * real / max(1, dp * plan.capacity * sum(not mb.is_noop for mb in plan.microbatches)), plan.capacity)
    return mine, capacities


def _dealt(lookup: SampleLookup, lengths, plan: Plan, replicas: int, pad_multiple: int):
    bundles = _bundles(lookup, lengths, replicas)
    length_of = [dict(zip((i for batch in lookup.batches[a] for i in batch),
                          (n for batch in lengths[a] for n in batch))) for a in range(len(lengths))]
    tokens = {(a, j, k): [sum(length_of[a][i] for i in per_replica[k]) for per_replica in b]
              for a, per_adapter in enumerate(bundles) for j, b in enumerate(per_adapter)
              for k in range(len(b[0]) if b else 0)}
    deal, needs = deal_slots(plan, tokens, pad_multiple=pad_multiple)
    return bundles, deal, needs


def _bundles(lookup: SampleLookup, lengths, replicas: int) -> list:
    return [[bundle_global_batch(batch, lens, replicas) for batch, lens in zip(lookup.batches[a], lengths[a])]
            for a in range(len(lengths))]


def _replica_lookup(datasets, bundles, replica: int, bundle_of) -> ReplicaLookup:
    """Replica ``replica``'s ``ReplicaLookup``: in slot ``k`` of adapter ``a``'s global batch ``j``
    it runs bundle ``bundle_of(a, j, k)``."""
    batches, positions = [], []
    for a, per_adapter in enumerate(bundles):
        flat, where = [], []
        for j, b in enumerate(per_adapter):
            mine = [b[bundle_of(a, j, k)][k] for k in range(len(b[0]) if b else 0)]
            starts = [sum(len(x) for x in mine[:k]) for k in range(len(mine))]
            flat.append([i for bundle in mine for i in bundle])
            where.append([tuple(range(s, s + len(bundle))) for s, bundle in zip(starts, mine)])
        batches.append(flat)
        positions.append(where)
    return ReplicaLookup(datasets, batches, positions)
