"""plan_microbatches: the planner's entry point; one window (``window.plan_window``) or a long
epoch in windows planned by worker processes (``stream.plan_stream``), joined."""

from __future__ import annotations

from typing import Sequence

from .config import Lengths, PlannerConfig
from .plan import Plan
from .stream import join_plans, plan_stream
from .window import plan_window


def plan_microbatches(
    lengths: Lengths,
    *,
    capacity: int,
    pad_multiple: int = 1,
    num_stages: int = 1,
    method: str = "greedy",
    time_limit: float = 20.0,
    seed: int = 0,
    max_nodes: int = 200,
    neighbourhood: int = 3,
    solver: str = "auto",
    grouping: bool = True,
    merge: bool = True,
    knapsack: bool = True,
    batch_offsets: Sequence[int] | None = None,
    window: int | None = None,
    workers: int = 0,
) -> Plan:
    """Pack ``lengths[adapter][global batch][sample]`` (token counts) into a verified Plan.

    Every sample appears exactly once; each microbatch holds at most ``capacity`` tokens once
    each adapter's segment is padded to ``pad_multiple``; samples inside a microbatch are
    sorted by (adapter, batch, index); adapter a's batch j+1 starts at least ``num_stages``
    microbatches after batch j's step point (no-op slots are inserted where needed).
    See ``PlannerConfig`` for the other arguments.

    With ``window`` set, the batches are planned in windows of that many rounds by ``workers``
    processes (``plan_stream``) and joined: the same result for any ``workers``, and the way
    to plan a long epoch with ``method="milp"`` without waiting for one process.
    """
    config = PlannerConfig(
        capacity=capacity,
        pad_multiple=pad_multiple,
        num_stages=num_stages,
        method=method,
        time_limit=time_limit,
        max_nodes=max_nodes,
        neighbourhood=neighbourhood,
        solver=solver,
        grouping=grouping,
        merge=merge,
        knapsack=knapsack,
        seed=seed,
    )
    if window is None:
        return plan_window(lengths, config, batch_offsets=batch_offsets)[0]
    if batch_offsets is not None:
        raise ValueError("batch_offsets cannot be combined with window (windows number batches from 0)")
    plans = [w.plan for w in plan_stream(lengths, config, window=window, workers=workers)]
    if not plans:
        return Plan(capacity=capacity, pad_multiple=pad_multiple, num_stages=num_stages, microbatches=())
    return join_plans(plans)
