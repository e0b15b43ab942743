"""Discrete-event simulation of per-rank pipeline action lists: timing, bubbles, deadlocks.

The simulator runs exactly the action lists the executor runs. Each rank executes its list in
order. Compute actions take the time the ``CostModel`` gives them. A maximal run of
consecutive communication actions is posted as one batch (as the executor does) and finishes
when every operation in it has matched its counterpart on the neighbouring rank:

- ``rendezvous=True`` (default, NCCL-like and the stricter check): a send completes only once
  the receiver has posted the matching receive, so a schedule that passes here cannot deadlock
  on blocking or pair-serialised P2P either.
- ``rendezvous=False``: sends are fire-and-forget (buffered, like gloo's isend when the
  executor defers waiting), only receives wait.

Besides timing, the simulator checks the schedule's semantics and raises ``ScheduleError`` on
any breach: matching send/receive sequences per channel, forward before backward, inputs
received before use, at most ``num_stages`` microbatches in flight per stage, every microbatch
forwarded and backwarded exactly once on every stage, each adapter stepping exactly once per
global batch right after the last backward of that batch on that stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..planner.plan import Plan, PlannedMicrobatch
from .cost_model import CostModel
from .schedule import (
    COMMUNICATION_ACTIONS,
    Action,
    Backward,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ScheduleError,
    SendActivation,
    SendGrad,
    communication_runs,
)


class DeadlockError(ScheduleError):
    """Every unfinished rank waits on a message that will never be posted."""


@dataclass(frozen=True, kw_only=True)
class SimulationResult:
    """What one simulated run of a schedule measured; ``timeline`` rows are
    ``(stage, kind, microbatch or adapter, start, end)`` with kind ``"F"``, ``"B"`` or ``"S"``."""

    makespan: float
    busy: tuple[float, ...]
    max_in_flight: tuple[int, ...]
    timeline: tuple[tuple[int, str, int, float, float], ...] = field(repr=False)

    @property
    def num_stages(self) -> int:
        return len(self.busy)

    @property
    def stage_bubble_ratios(self) -> tuple[float, ...]:
        if self.makespan == 0:
            return tuple(0.0 for _ in self.busy)
        return tuple(1.0 - b / self.makespan for b in self.busy)

    @property
    def bubble_ratio(self) -> float:
        """Idle fraction of all stages' time between the first action and the last."""
        if self.makespan == 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.num_stages * self.makespan)


def _peer_and_channel(action: Action, stage: int) -> tuple[int, tuple[int, int, str]]:
    """The neighbour rank of a communication action and its directed channel ``(src, dst, kind)``."""
    if isinstance(action, SendActivation):
        return stage + 1, (stage, stage + 1, "act")
    if isinstance(action, RecvActivation):
        return stage - 1, (stage - 1, stage, "act")
    if isinstance(action, SendGrad):
        return stage - 1, (stage, stage - 1, "grad")
    assert isinstance(action, RecvGrad)
    return stage + 1, (stage + 1, stage, "grad")


def _check_static(plan: Plan, schedule: Sequence[Sequence[Action]]) -> None:
    """Channel sequences match, every real microbatch runs once per stage, steps are complete."""
    num_stages = len(schedule)
    sends: dict[tuple[int, int, str], list[int]] = {}
    recvs: dict[tuple[int, int, str], list[int]] = {}
    real = [i for i, mb in enumerate(plan.microbatches) if not mb.is_noop]
    step_points = Plan.compute_step_points(plan.microbatches)
    for stage, actions in enumerate(schedule):
        forwards, backwards, steps = [], [], []
        for a in actions:
            if isinstance(a, COMMUNICATION_ACTIONS):
                peer, channel = _peer_and_channel(a, stage)
                if not 0 <= peer < num_stages:
                    raise ScheduleError(f"stage {stage}: {a} talks to rank {peer}, which does not exist")
                if plan.microbatches[a.microbatch].is_noop:
                    raise ScheduleError(f"stage {stage}: {a} communicates a no-op slot")
                book = sends if isinstance(a, (SendActivation, SendGrad)) else recvs
                book.setdefault(channel, []).append(a.microbatch)
            elif isinstance(a, Forward):
                forwards.append(a.microbatch)
            elif isinstance(a, Backward):
                backwards.append(a.microbatch)
            elif isinstance(a, OptimizerStep):
                steps.append((a.adapter, a.batch))
            else:
                raise ScheduleError(f"stage {stage}: unknown action {a!r}")
        if sorted(forwards) != real or sorted(backwards) != real:
            raise ScheduleError(
                f"stage {stage} must forward and backward each of the plan's {len(real)} real "
                f"microbatches exactly once; got {len(forwards)} forwards, {len(backwards)} backwards"
            )
        if sorted(steps) != sorted(step_points):
            raise ScheduleError(
                f"stage {stage} must step each (adapter, batch) of the plan exactly once; "
                f"missing {sorted(set(step_points) - set(steps))}, extra/duplicate "
                f"{sorted(set(steps) - set(step_points)) or [s for s in steps if steps.count(s) > 1]}"
            )
    for channel in set(sends) | set(recvs):
        if sends.get(channel, []) != recvs.get(channel, []):
            src, dst, kind = channel
            raise ScheduleError(
                f"{kind} messages from rank {src} to rank {dst} are sent in order "
                f"{sends.get(channel, [])} but received in order {recvs.get(channel, [])}"
            )


class _Simulation:
    """The clocks, message posts and per-stage bookkeeping of one simulated run."""

    def __init__(
        self, plan: Plan, schedule: Sequence[Sequence[Action]], cost_model: CostModel, rendezvous: bool,
        head_rows: Mapping[int, int] | None = None,
    ) -> None:
        num_stages = len(schedule)
        self.num_stages = num_stages
        self.cost_model = cost_model
        self.rendezvous = rendezvous
        self.step_points = Plan.compute_step_points(plan.microbatches)
        rows = head_rows or {}
        self.costs = [(*_work(plan, mb), rows.get(i)) for i, mb in enumerate(plan.microbatches)]
        self.message_time = cost_model.p2p_time(plan.capacity)
        self.programs = [communication_runs(actions) for actions in schedule]
        self.pc = [0] * num_stages
        self.clock = [0.0] * num_stages
        self.busy = [0.0] * num_stages
        # (posting rank, channel, microbatch) -> time the operation was posted
        self.posts: dict[tuple[int, tuple[int, int, str], int], float] = {}
        self.post_time: list[float | None] = [None] * num_stages  # of the run a rank is blocked in
        self.in_flight: list[set[int]] = [set() for _ in range(num_stages)]
        self.max_in_flight = [0] * num_stages
        self.have_input: list[set[int]] = [set() for _ in range(num_stages)]
        self.have_grad: list[set[int]] = [set() for _ in range(num_stages)]
        self.backwarded: list[set[int]] = [set() for _ in range(num_stages)]
        # microbatch of the last Backward when only optimizer steps ran since; else None
        self.after_backward: list[int | None] = [None] * num_stages
        self.timeline: list[tuple[int, str, int, float, float]] = []

    def forward_cost(self, stage: int, a: Forward) -> float:
        """Check that ``a`` may run now, mark its microbatch in flight and return its duration."""
        i = a.microbatch
        if stage != 0 and i not in self.have_input[stage]:
            raise ScheduleError(f"stage {stage}: Forward({i}) before its activation was received")
        duration = self.cost_model.forward_time(stage, *self.costs[i])
        self.in_flight[stage].add(i)
        self.max_in_flight[stage] = max(self.max_in_flight[stage], len(self.in_flight[stage]))
        if self.max_in_flight[stage] > self.num_stages:
            raise ScheduleError(
                f"stage {stage} holds {self.max_in_flight[stage]} microbatches in flight, more "
                f"than the 1F1B bound of num_stages={self.num_stages}"
            )
        return duration

    def backward_cost(self, stage: int, a: Backward) -> float:
        """Check that ``a`` may run now, retire its microbatch and return its duration."""
        i = a.microbatch
        if i not in self.in_flight[stage]:
            raise ScheduleError(f"stage {stage}: Backward({i}) before Forward({i})")
        if stage != self.num_stages - 1 and i not in self.have_grad[stage]:
            raise ScheduleError(f"stage {stage}: Backward({i}) before its output gradient was received")
        duration = self.cost_model.backward_time(stage, *self.costs[i])
        self.in_flight[stage].discard(i)
        self.backwarded[stage].add(i)
        return duration

    def step_cost(self, stage: int, a: OptimizerStep) -> float:
        """Check that ``a`` comes right after its batch's last backward and return its duration."""
        p = self.step_points.get((a.adapter, a.batch))
        if p is None or self.after_backward[stage] != p:
            raise ScheduleError(
                f"stage {stage}: OptimizerStep({a.adapter}, {a.batch}) must come right after "
                f"Backward({p}), the last microbatch of that global batch; the last backward "
                f"before it was {self.after_backward[stage]}"
            )
        return self.cost_model.optimizer_step_time

    def run_compute(self, stage: int, a: Action) -> None:
        start = self.clock[stage]
        if isinstance(a, Forward):
            duration = self.forward_cost(stage, a)
            kind, label = "F", a.microbatch
        elif isinstance(a, Backward):
            duration = self.backward_cost(stage, a)
            kind, label = "B", a.microbatch
        else:
            assert isinstance(a, OptimizerStep)
            duration = self.step_cost(stage, a)
            kind, label = "S", a.adapter
        self.clock[stage] = start + duration
        self.busy[stage] += duration
        if isinstance(a, Backward):
            self.after_backward[stage] = a.microbatch
        elif isinstance(a, Forward):
            self.after_backward[stage] = None
        self.timeline.append((stage, kind, label, start, start + duration))

    def try_comm(self, stage: int, run: tuple[Action, ...]) -> bool:
        """Post ``run`` (once) and finish it if every operation found its counterpart."""
        if self.post_time[stage] is None:
            self.post_time[stage] = self.clock[stage]
            for a in run:
                self.posts[(stage, _peer_and_channel(a, stage)[1], a.microbatch)] = self.clock[stage]
        mine = self.post_time[stage]
        done_at = mine
        for a in run:
            peer, channel = _peer_and_channel(a, stage)
            is_send = isinstance(a, (SendActivation, SendGrad))
            if is_send and not self.rendezvous:
                continue  # buffered send: the sender does not wait
            theirs = self.posts.get((peer, channel, a.microbatch))
            if theirs is None:
                return False
            if self.rendezvous:
                done_at = max(done_at, max(mine, theirs) + self.message_time)
            else:
                done_at = max(done_at, theirs + self.message_time)
        for a in run:
            if isinstance(a, RecvActivation):
                self.have_input[stage].add(a.microbatch)
            elif isinstance(a, RecvGrad):
                self.have_grad[stage].add(a.microbatch)
        self.clock[stage] = done_at
        self.post_time[stage] = None
        return True

    def run(self) -> None:
        """Advance every rank as far as it can go, round after round, until all lists are done;
        raise ``DeadlockError`` when a round moves no rank."""
        programs, pc = self.programs, self.pc
        remaining = sum(len(p) for p in programs)
        while remaining:
            progressed = False
            for stage in range(self.num_stages):
                while pc[stage] < len(programs[stage]):
                    item = programs[stage][pc[stage]]
                    if isinstance(item, tuple):
                        if not self.try_comm(stage, item):
                            break
                    else:
                        self.run_compute(stage, item)
                    pc[stage] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                waiting = {
                    stage: programs[stage][pc[stage]]
                    for stage in range(self.num_stages)
                    if pc[stage] < len(programs[stage])
                }
                raise DeadlockError(
                    "schedule deadlocks: every unfinished rank waits for a message that is never "
                    f"posted; blocked at {waiting}"
                )

    def result(self) -> SimulationResult:
        makespan = max(self.clock) if self.clock else 0.0
        return SimulationResult(
            makespan=makespan,
            busy=tuple(self.busy),
            max_in_flight=tuple(self.max_in_flight),
            timeline=tuple(self.timeline),
        )


def _work(plan: Plan, mb: PlannedMicrobatch) -> tuple[int, int, tuple[int, ...]]:
    """Padded tokens of ``mb``, the sum of its samples' squared lengths and the lengths (the cost
    model's inputs)."""
    lengths = tuple(s.length for s in mb.samples)
    return mb.padded_tokens(plan.pad_multiple), sum(n * n for n in lengths), lengths


def simulate(
    plan: Plan,
    schedule: Sequence[Sequence[Action]],
    cost_model: CostModel,
    *,
    rendezvous: bool = True,
    head_rows: Mapping[int, int] | None = None,
) -> SimulationResult:
    """Run ``schedule`` (one action list per stage) of ``plan`` on ``cost_model``'s clock.
    ``head_rows``: rows the last stage's LM head computes per microbatch (plan position; e.g. a
    CUDA graph's padded label rows); a microbatch without an entry uses the model's
    ``head_token_fraction``."""
    num_stages = len(schedule)
    if cost_model.num_stages != num_stages:
        raise ValueError(
            f"cost model has {cost_model.num_stages} stages, schedule has {num_stages}; "
            "build the CostModel with one stage_layers entry per pipeline stage"
        )
    _check_static(plan, schedule)
    simulation = _Simulation(plan, schedule, cost_model, rendezvous, head_rows)
    simulation.run()
    return simulation.result()
