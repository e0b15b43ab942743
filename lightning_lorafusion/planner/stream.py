"""Planning ahead of training: windows of global batches planned in worker processes, in order.

The global batches of every adapter are cut into windows of ``window`` rounds (round r holds
batch r of each adapter). Each window is planned by ``plan_window`` in a worker process; the
result depends only on that window's lengths and the config, so it is the same whatever the
number of workers or their timing. The consumer stitches windows in order: it inserts no-op
slots at the start of a window where an adapter's first batch there would come too soon after
its step point in the previous window (``fix_plan`` with the carried state). The carried
state is small plain data, so a checkpoint can record (window, position, carry) and a resumed
run re-plans exactly the same windows from there.
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

from .config import Lengths, PlannerConfig, validate_lengths
from .window import plan_window
from .plan import Plan, PlannedMicrobatch
from .verify import CarryState, carry_state, fix_plan


@dataclass(frozen=True, kw_only=True)
class WindowPlan:
    """The plan of window ``window`` (rounds ``first_round`` ..), stitched after the previous one.

    ``carry_in`` / ``carry_out``: per adapter (last global batch, microbatches from its step
    point to the end of the plans so far) before and after this window; record ``carry_in``
    with the window index in a checkpoint to resume with ``plan_stream(..., start_window=,
    carry_in=)``.
    """

    window: int
    first_round: int
    plan: Plan
    carry_in: dict[int, tuple[int, int]] = field(default_factory=dict)
    carry_out: dict[int, tuple[int, int]] = field(default_factory=dict)


def window_lengths(lengths: Lengths, first_round: int, num_rounds: int) -> list[list[list[int]]]:
    """Rounds ``[first_round, first_round + num_rounds)`` of every adapter (may be empty lists)."""
    return [[list(b) for b in batches[first_round : first_round + num_rounds]] for batches in lengths]


def num_windows(lengths: Lengths, window: int) -> int:
    rounds = max((len(b) for b in lengths), default=0)
    return -(-rounds // window)


def _plan_one(lengths: Lengths, config: PlannerConfig, first_round: int) -> Plan:
    offsets = [first_round] * len(lengths)
    return plan_window(lengths, config, batch_offsets=offsets)[0]


def plan_stream(
    lengths: Lengths,
    config: PlannerConfig,
    *,
    window: int = 8,
    workers: int = 0,
    prefetch: int | None = None,
    start_window: int = 0,
    carry_in: CarryState | None = None,
    mp_start_method: str = "spawn",
) -> Iterator[WindowPlan]:
    """Yield the stitched plan of every window of ``lengths[adapter][global batch][sample]``.

    ``workers=0`` plans in this process; ``workers=n`` keeps up to ``prefetch`` (default
    ``2 * n``) windows being planned by n processes ahead of the consumer. Samples longer than
    the capacity are rejected up front, before any planning starts. The ``spawn`` start
    method is the default because the consumer may already hold CUDA state.
    """
    if window < 1:
        raise ValueError(f"window={window} must be >= 1 (global batches per adapter per plan)")
    if workers < 0:
        raise ValueError(f"workers={workers} must be >= 0")
    validate_lengths(lengths, config)
    total = num_windows(lengths, window)
    if not 0 <= start_window <= total:
        raise ValueError(f"start_window={start_window} must be in [0, {total}]")
    carry: dict[int, tuple[int, int]] = dict(carry_in or {})
    todo = range(start_window, total)

    def stitched(w: int, plan: Plan) -> WindowPlan:
        nonlocal carry
        fixed = fix_plan(plan, carry_in=carry)
        out = WindowPlan(
            window=w,
            first_round=w * window,
            plan=fixed,
            carry_in=dict(carry),
            carry_out=carry_state(fixed, carry),
        )
        carry = dict(out.carry_out)
        return out

    if workers == 0:
        for w in todo:
            yield stitched(w, _plan_one(window_lengths(lengths, w * window, window), config, w * window))
        return
    ahead = prefetch if prefetch is not None else 2 * workers
    ctx = multiprocessing.get_context(mp_start_method)
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        pending: deque[tuple[int, Future]] = deque()
        it = iter(todo)
        for w in it:
            pending.append((w, pool.submit(_plan_one, window_lengths(lengths, w * window, window), config, w * window)))
            if len(pending) >= max(ahead, 1):
                break
        while pending:
            w, fut = pending.popleft()
            plan = fut.result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(
                    (nxt, pool.submit(_plan_one, window_lengths(lengths, nxt * window, window), config, nxt * window))
                )
            yield stitched(w, plan)


def join_plans(plans: list[Plan]) -> Plan:
    """One Plan executing ``plans`` back to back (step points re-indexed)."""
    if not plans:
        raise ValueError("join_plans needs at least one plan")
    first = plans[0]
    for p in plans[1:]:
        if (p.capacity, p.pad_multiple, p.num_stages) != (first.capacity, first.pad_multiple, first.num_stages):
            raise ValueError("join_plans: plans differ in capacity, pad_multiple or num_stages")
    mbs: tuple[PlannedMicrobatch, ...] = tuple(mb for p in plans for mb in p.microbatches)
    return Plan(
        capacity=first.capacity,
        pad_multiple=first.pad_multiple,
        num_stages=first.num_stages,
        microbatches=mbs,
        step_points=Plan.compute_step_points(mbs),
    )
