"""Pipeline schedules as pure data: a Plan and a stage count in, one action list per rank out.

Two builders share one vocabulary of actions:

- ``build_pipeline_schedule``: the multi-adapter schedule. One continuous 1F1B stream over
  every microbatch of the plan, no flush between global batches; each adapter steps on a stage
  right after the last backward of its global batch there.
- ``build_1f1b_flushed_schedule``: the baseline. The same 1F1B order, cut into independent
  pipelines that drain completely at every step point (plain 1F1B with a flush per global
  batch when the plan holds one adapter).

Conventions (the executor and the simulator rely on them):

- Rank ``s`` runs stage ``s``. Microbatches are named by their index in ``plan.microbatches``.
- Communication is explicit: ``RecvActivation(i)`` precedes ``Forward(i)`` on every stage but
  the first, ``SendActivation(i)`` follows it on every stage but the last; ``RecvGrad(i)`` /
  ``SendGrad(i)`` surround ``Backward(i)`` the same way. Consecutive communication actions are
  meant to be posted together (one batched P2P call); that is what keeps the 1F1B exchange
  ``send activation i / receive gradient k`` deadlock-free when P2P between a pair of ranks is
  serialised (NCCL).
- ``OptimizerStep(adapter, batch)`` comes immediately after ``Backward`` of the microbatch that
  completes that global batch (``plan.step_points``), before the gradient is sent upstream.
- No-op slots (planned microbatches without samples) keep their place in the 1F1B order, so
  they spread the microbatches around them exactly as the planner intended (that is how the
  planner pads a plan to satisfy the bubble lemma), but they emit no action: nothing is
  computed or sent for them, and every rank knows that from the plan alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from ..planner.plan import Plan


@dataclass(frozen=True)
class Forward:
    """Run the stage's forward on microbatch ``microbatch`` and keep its autograd graph."""

    microbatch: int


@dataclass(frozen=True)
class Backward:
    """Backward through the saved graph of ``microbatch``; frees it."""

    microbatch: int


@dataclass(frozen=True)
class SendActivation:
    """Send this stage's output for ``microbatch`` to the next stage."""

    microbatch: int


@dataclass(frozen=True)
class RecvActivation:
    """Receive the previous stage's output for ``microbatch``."""

    microbatch: int


@dataclass(frozen=True)
class SendGrad:
    """Send the gradient w.r.t. this stage's input for ``microbatch`` to the previous stage."""

    microbatch: int


@dataclass(frozen=True)
class RecvGrad:
    """Receive the gradient w.r.t. this stage's output for ``microbatch`` from the next stage."""

    microbatch: int


@dataclass(frozen=True)
class OptimizerStep:
    """Step adapter ``adapter``'s optimizer on this stage: its global batch ``batch`` is done."""

    adapter: int
    batch: int


Action = Union[Forward, Backward, SendActivation, RecvActivation, SendGrad, RecvGrad, OptimizerStep]
COMMUNICATION_ACTIONS = (SendActivation, RecvActivation, SendGrad, RecvGrad)


class ScheduleError(ValueError):
    """A plan or schedule the pipeline cannot run; the message says what and how to fix it."""


class BubbleLemmaError(ScheduleError):
    """A plan in which an adapter's next global batch would enter a stage before its step."""


def communication_runs(actions: Sequence[Action]) -> list[Action | tuple[Action, ...]]:
    """Compute actions stay single; each maximal run of communication actions becomes a tuple,
    posted as one batch by the executor and the simulator."""
    items: list[Action | tuple[Action, ...]] = []
    run: list[Action] = []
    for a in actions:
        if isinstance(a, COMMUNICATION_ACTIONS):
            run.append(a)
            continue
        if run:
            items.append(tuple(run))
            run = []
        items.append(a)
    if run:
        items.append(tuple(run))
    return items


def in_flight_slots(actions: Sequence[Action]) -> dict[int, int]:
    """``{microbatch: slot}``: each ``Forward`` takes the lowest slot no microbatch holds, its
    ``Backward`` frees it; a stage holds at most ``max(slots) + 1`` microbatches between their
    forward and backward (``num_stages - stage`` under 1F1B). Raises ``ScheduleError`` for a
    backward without its forward or a forward taken twice."""
    slots: dict[int, int] = {}
    held: dict[int, int] = {}  # microbatch -> slot, while in flight
    free: list[int] = []
    top = 0
    for a in actions:
        if isinstance(a, Forward):
            if a.microbatch in held:
                raise ScheduleError(f"Forward({a.microbatch}) twice before its Backward")
            if free:
                slot = min(free)
                free.remove(slot)
            else:
                slot, top = top, top + 1
            held[a.microbatch] = slots[a.microbatch] = slot
        elif isinstance(a, Backward):
            if a.microbatch not in held:
                raise ScheduleError(f"Backward({a.microbatch}) without a Forward before it")
            free.append(held.pop(a.microbatch))
    return slots


def one_f_one_b_order(
    slots: Sequence[int], stage: int, num_stages: int
) -> list[tuple[str, int]]:
    """The 1F1B order of ``slots`` on ``stage``: ``("F", slot)`` / ``("B", slot)`` pairs.

    ``num_stages - stage - 1`` warm-up forwards, then one forward and one backward in turn,
    then the cool-down backwards; at most ``num_stages - stage`` slots are in flight.
    """
    n = len(slots)
    warmup = min(num_stages - stage - 1, n)
    order = [("F", slots[i]) for i in range(warmup)]
    for k in range(n - warmup):
        order.append(("F", slots[warmup + k]))
        order.append(("B", slots[k]))
    order.extend(("B", slots[k]) for k in range(n - warmup, n))
    return order


def _check_inputs(plan: Plan, num_stages: int) -> dict[int, list[tuple[int, int]]]:
    """Validate the plan; return ``{microbatch: [(adapter, batch) stepping after it]}``."""
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ScheduleError(f"num_stages={num_stages!r} must be an int >= 1")
    computed = Plan.compute_step_points(plan.microbatches)
    if plan.step_points and dict(plan.step_points) != computed:
        wrong = sorted(
            k for k in set(computed) | set(plan.step_points)
            if computed.get(k) != plan.step_points.get(k)
        )
        a, b = wrong[0]
        raise ScheduleError(
            f"plan.step_points disagrees with its microbatches for adapter {a} batch {b}: "
            f"step_points says {plan.step_points.get((a, b))}, the last microbatch holding its "
            f"samples is {computed.get((a, b))}; rebuild step_points with "
            "Plan.compute_step_points(plan.microbatches)"
        )
    steps_after: dict[int, list[tuple[int, int]]] = {}
    for (adapter, batch), mb in sorted(computed.items()):
        steps_after.setdefault(mb, []).append((adapter, batch))
    # An adapter's global batches must run in order: batch j+1 may not start before batch j ends.
    first: dict[tuple[int, int], int] = {}
    for i, mb in enumerate(plan.microbatches):
        for s in mb.samples:
            first.setdefault((s.adapter, s.batch), i)
    for (a, b), b_next in _previous_batch_pairs(computed):
        if first[(a, b_next)] <= computed[(a, b)]:
            raise ScheduleError(
                f"microbatch {first[(a, b_next)]} holds adapter {a} batch {b_next}, but that "
                f"adapter's batch {b} still has samples in microbatch {computed[(a, b)]}; an "
                "adapter's global batches must be planned in order, one after the other"
            )
    return steps_after


def _previous_batch_pairs(step_points: dict[tuple[int, int], int]) -> list[tuple[tuple[int, int], int]]:
    """``((adapter, batch), next batch of that adapter)`` for every consecutive pair in the plan."""
    by_adapter: dict[int, list[int]] = {}
    for a, b in sorted(step_points):
        by_adapter.setdefault(a, []).append(b)
    return [((a, bs[k]), bs[k + 1]) for a, bs in by_adapter.items() for k in range(len(bs) - 1)]


def _expand(
    order: list[tuple[str, int]],
    stage: int,
    num_stages: int,
    steps_after: dict[int, list[tuple[int, int]]],
) -> list[Action]:
    actions: list[Action] = []
    first, last = stage == 0, stage == num_stages - 1
    for kind, i in order:
        if kind == "F":
            if not first:
                actions.append(RecvActivation(i))
            actions.append(Forward(i))
            if not last:
                actions.append(SendActivation(i))
        else:
            if not last:
                actions.append(RecvGrad(i))
            actions.append(Backward(i))
            actions.extend(OptimizerStep(a, b) for a, b in steps_after.get(i, ()))
            if not first:
                actions.append(SendGrad(i))
    return actions


def check_bubble_lemma(plan: Plan, schedule: Sequence[Sequence[Action]]) -> None:
    """Raise ``BubbleLemmaError`` unless, on every stage, no microbatch of adapter ``a``'s
    global batch ``j + 1`` enters forward before ``OptimizerStep(a, j)`` on that stage."""
    last_mb = Plan.compute_step_points(plan.microbatches)
    previous = {(a, b_next): b for (a, b), b_next in _previous_batch_pairs(last_mb)}
    num_stages = len(schedule)
    for stage, actions in enumerate(schedule):
        stepped: set[tuple[int, int]] = set()
        for action in actions:
            if isinstance(action, OptimizerStep):
                stepped.add((action.adapter, action.batch))
            elif isinstance(action, Forward):
                for s in plan.microbatches[action.microbatch].samples:
                    prev = previous.get((s.adapter, s.batch))
                    if prev is not None and (s.adapter, prev) not in stepped:
                        p = last_mb[(s.adapter, prev)]
                        raise BubbleLemmaError(
                            f"bubble lemma broken on stage {stage}: microbatch {action.microbatch} "
                            f"holds adapter {s.adapter} batch {s.batch}, which would enter forward "
                            f"before adapter {s.adapter}'s optimizer step for batch {prev} "
                            f"(its last microbatch is {p}). With {num_stages} pipeline stages the "
                            f"first microbatch of a global batch must come at least {num_stages} "
                            f"slots after the last microbatch of the same adapter's previous batch "
                            f"(here {action.microbatch - p}); let the planner pad the plan with "
                            f"no-op slots for num_stages={num_stages} (the plan was built for "
                            f"num_stages={plan.num_stages}) or interleave other adapters' microbatches"
                        )


def build_pipeline_schedule(plan: Plan, num_stages: int) -> list[list[Action]]:
    """Per-rank action lists of the no-flush multi-adapter 1F1B schedule of ``plan``.

    Refuses (``BubbleLemmaError``) a plan in which some adapter's global batch ``j + 1`` would
    enter forward on a stage before that adapter's step for batch ``j`` on the same stage.
    """
    steps_after = _check_inputs(plan, num_stages)
    slots = list(range(len(plan.microbatches)))
    noop = {i for i, mb in enumerate(plan.microbatches) if mb.is_noop}
    schedule = []
    for stage in range(num_stages):
        order = [(k, i) for k, i in one_f_one_b_order(slots, stage, num_stages) if i not in noop]
        schedule.append(_expand(order, stage, num_stages, steps_after))
    check_bubble_lemma(plan, schedule)
    return schedule


def build_1f1b_flushed_schedule(plan: Plan, num_stages: int) -> list[list[Action]]:
    """Per-rank action lists of plain 1F1B that drains the pipeline at every step point.

    The plan is cut after each microbatch that completes some adapter's global batch; each
    piece runs as its own 1F1B pipeline (warm-up, steady state, cool-down) and the next piece
    starts only after it. For a one-adapter plan this is 1F1B with a flush per global batch,
    the baseline multi-adapter pipelining is measured against. No-op slots are dropped.
    """
    steps_after = _check_inputs(plan, num_stages)
    pieces: list[list[int]] = []
    current: list[int] = []
    for i, mb in enumerate(plan.microbatches):
        if not mb.is_noop:
            current.append(i)
        if i in steps_after and current:
            pieces.append(current)
            current = []
    if current:
        pieces.append(current)
    schedule = []
    for stage in range(num_stages):
        actions: list[Action] = []
        for piece in pieces:
            actions.extend(_expand(one_f_one_b_order(piece, stage, num_stages), stage, num_stages, steps_after))
        schedule.append(actions)
    check_bubble_lemma(plan, schedule)
    return schedule


# Names a user picks a schedule by (the pipeline strategy's ``schedule`` argument).
SCHEDULES = {"no_flush": build_pipeline_schedule, "flushed_1f1b": build_1f1b_flushed_schedule}
