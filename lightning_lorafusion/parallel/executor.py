"""Running one rank's pipeline action list with torch.distributed point-to-point messages.

Microbatches have a fixed token capacity, so every activation and gradient crossing a stage
boundary has the static shape ``activation_shape`` (``[capacity, hidden]``): receive buffers
are allocated without any shape exchange. Each run of consecutive communication actions is
posted as one ``batch_isend_irecv`` (the pairing the simulator's rendezvous check proves
deadlock-free even where P2P between two ranks is serialised, as with NCCL); the rank waits only
for that run's receives, while sends complete in the background, overlapping the next compute.
Backward runs through the autograd graph saved at forward; ``optimizer_step(adapter, batch)``
is called where the schedule places ``OptimizerStep``.

Where a microbatch's backward follows its forward directly (one stage, and the last stage of a
pipeline) and the stage offers ``fused_step`` (a captured CUDA graph of both), the pair runs as
one call. Elsewhere (the earlier stages, microbatches in flight between forward and backward) a
stage offering ``graphed_forward`` / ``graphed_backward`` gets each microbatch's in-flight slot
(``schedule.in_flight_slots``: taken at its forward, freed at its backward): a forward the stage
graphed returns its output from the slot's static buffer (sent from there) and its backward is
asked of the same slot; a forward it declines (None) runs and back-propagates eagerly. The
per-action host work is constant: no device synchronisation (on CUDA, actions are timed by CUDA
events read once at the end of the run), nothing per layer or per parameter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .schedule import (
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
    in_flight_slots,
)
from .stage import StageModule


@dataclass(frozen=True, kw_only=True)
class StageRecord:
    """Wall-clock record of one rank's run: ``events`` rows ``(kind, id, start, end)`` in seconds
    since the run began, kind ``"F"``/``"B"``/``"S"``/``"C"`` (waiting on communication) or
    ``"FB"`` (a microbatch's forward and backward as one fused step). On CUDA the times are the
    device's (CUDA events on the compute stream), elsewhere the host's."""

    events: tuple[tuple[str, int, float, float], ...] = field(repr=False)
    wall: float

    @property
    def busy(self) -> float:
        return sum(t1 - t0 for kind, _, t0, t1 in self.events if kind != "C")

    def count(self, kind: str) -> int:
        return sum(1 for k, *_ in self.events if k == kind)


def measured_bubble_ratio(busy_and_wall: Sequence[tuple[float, float]]) -> float:
    """Idle fraction of all ranks over the longest rank's wall time, from ``(busy, wall)`` per
    rank (the simulator's ``bubble_ratio``, measured)."""
    if not busy_and_wall:
        raise ValueError("need (busy, wall) of at least one rank")
    longest = max(wall for _, wall in busy_and_wall)
    if longest <= 0:
        return 0.0
    return 1.0 - sum(busy for busy, _ in busy_and_wall) / (len(busy_and_wall) * longest)


def gather_busy_and_wall(record: StageRecord, group: dist.ProcessGroup | None = None) -> list[tuple[float, float]]:
    """``(busy, wall)`` of every rank of ``group`` (default: the world), in rank order; collective."""
    pairs: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(pairs, (record.busy, record.wall), group=group)
    return [tuple(p) for p in pairs]  # type: ignore[misc]


class _HostClock:
    """Seconds since the run began by the host clock; ``synchronize`` (if given) is called before
    each reading of a compute action's bounds."""

    def __init__(self, synchronize: Callable[[], None] | None) -> None:
        self.synchronize = synchronize
        self.t_start = time.perf_counter()

    def mark(self, bound: bool = False) -> float:
        if bound and self.synchronize is not None:
            self.synchronize()
        return time.perf_counter() - self.t_start

    def seconds(self, marks: list) -> list[float]:
        return marks


class _DeviceClock:
    """CUDA events on the current stream: marks cost no synchronisation; ``seconds`` waits for
    the last one once and converts every mark to seconds since the first."""

    def __init__(self) -> None:
        self.start = self.mark()

    def mark(self, bound: bool = False) -> "torch.cuda.Event":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, marks: list) -> list[float]:
        if marks:
            marks[-1].synchronize()
        return [self.start.elapsed_time(e) / 1e3 for e in marks]


class StageHooks:
    """What the executor calls around compute besides the stage (all optional no-ops):
    ``before_backward(microbatch, adapters)`` before the backward of a microbatch after which
    ``adapters`` step on this stage (e.g. to start their gradient all-reduce as each bucket's
    gradients are final), ``after_backward(microbatch, adapters)`` once it is done."""

    def before_backward(self, microbatch: int, adapters: tuple[int, ...]) -> None:
        pass

    def after_backward(self, microbatch: int, adapters: tuple[int, ...]) -> None:
        pass


class _StageRun:
    """One rank's tensors in transit, pending sends and timed events while it runs its list."""

    def __init__(
        self,
        stage: StageModule,
        *,
        stage_index: int,
        num_stages: int,
        ranks: list[int],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
        optimizer_step: Callable[[int, int], None],
        group: dist.ProcessGroup | None,
        synchronize: Callable[[], None] | None,
        hooks: StageHooks | None = None,
        slots: dict[int, int] | None = None,
    ) -> None:
        self.stage = stage
        self.stage_index = stage_index
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.optimizer_step = optimizer_step
        self.group = group
        self.hooks = hooks or StageHooks()
        self.fused = getattr(stage, "fused_step", None)
        # graphed forward / backward of a microbatch in flight, by slot (earlier stages)
        self.slots = slots or {}
        self.graphed_forward = getattr(stage, "graphed_forward", None)
        self.graphed_backward = getattr(stage, "graphed_backward", None)
        self.graphed: dict[int, int] = {}  # microbatch -> slot of a graphed forward, until its backward
        self.armed: int | None = None  # the microbatch whose before_backward hook has run
        self.first, self.last = stage_index == 0, stage_index == num_stages - 1
        self.prev_rank = ranks[stage_index - 1] if not self.first else None
        self.next_rank = ranks[stage_index + 1] if not self.last else None
        self.inputs: dict[int, torch.Tensor] = {}  # received activation (leaf requiring grad)
        self.outputs: dict[int, torch.Tensor] = {}  # stage output, graph attached
        self.grads_in: dict[int, torch.Tensor] = {}  # received gradient w.r.t. our output
        self.grads_out: dict[int, torch.Tensor] = {}  # gradient w.r.t. our input, to send
        self.pending_sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.events: list[tuple[str, int, object, object]] = []
        # device time on CUDA unless the caller asks for synchronised host timing
        on_cuda = torch.device(device).type == "cuda" and synchronize is None
        self.clock = _DeviceClock() if on_cuda else _HostClock(synchronize)

    def p2p_op(self, a: Action) -> tuple[dist.P2POp, torch.Tensor, bool]:
        """The P2P operation of one communication action, its tensor, and whether it receives."""
        i = a.microbatch
        if isinstance(a, SendActivation):
            out = self.outputs[i].detach()
            if tuple(out.shape) != self.shape or out.dtype != self.dtype:
                raise ScheduleError(
                    f"stage {self.stage_index} produced {tuple(out.shape)} {out.dtype} for microbatch "
                    f"{i}; pipeline messages must be {self.shape} {self.dtype} (fixed microbatch capacity)"
                )
            tensor = out.contiguous()
            return dist.P2POp(dist.isend, tensor, self.next_rank, self.group), tensor, False
        if isinstance(a, SendGrad):
            tensor = self.grads_out.pop(i).contiguous()
            return dist.P2POp(dist.isend, tensor, self.prev_rank, self.group), tensor, False
        tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        if isinstance(a, RecvActivation):
            self.inputs[i] = tensor
            return dist.P2POp(dist.irecv, tensor, self.prev_rank, self.group), tensor, True
        assert isinstance(a, RecvGrad)
        self.grads_in[i] = tensor
        return dist.P2POp(dist.irecv, tensor, self.next_rank, self.group), tensor, True

    def post(self, run: tuple[Action, ...]) -> None:
        """Post ``run`` as one batch, wait for its receives and keep its sends pending."""
        ops: list[dist.P2POp] = []
        recv_works_idx: list[int] = []
        keep: list[torch.Tensor] = []
        for a in run:
            op, tensor, is_recv = self.p2p_op(a)
            if is_recv:
                recv_works_idx.append(len(ops))
            ops.append(op)
            keep.append(tensor)
        t0 = self.clock.mark()
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):
            for k, w in enumerate(works):
                if k in recv_works_idx:
                    w.wait()
                else:
                    self.pending_sends.append((w, keep[k]))
        else:  # one coalesced work for the whole batch (NCCL)
            for w in works:
                w.wait()
        self.events.append(("C", -1, t0, self.clock.mark()))
        # drop references to sends that have completed
        self.pending_sends[:] = [(w, t) for w, t in self.pending_sends if not w.is_completed()]

    def forward(self, item: Forward) -> tuple[str, int]:
        i = item.microbatch
        x = None
        if self.graphed_forward is not None and not self.last and i in self.slots:
            out = self.graphed_forward(None if self.first else self.inputs[i], i, self.slots[i])
            if out is not None:
                self.outputs[i] = out
                self.graphed[i] = self.slots[i]
                return "F", i
        if not self.first:
            x = self.inputs[i].requires_grad_(True)
        out = self.stage.forward(x, i)
        if self.last and out.dim() != 0:
            raise ScheduleError(
                f"the last stage must return the scalar loss to backward; got shape {tuple(out.shape)}"
            )
        self.outputs[i] = out
        return "F", i

    def backward(self, item: Backward, steps: tuple[int, ...] = ()) -> tuple[str, int]:
        i = item.microbatch
        out = self.outputs.pop(i)
        grad = None if self.last else self.grads_in.pop(i)
        if self.armed != i:  # not already, by a fused step that fell back to this eager one
            self.hooks.before_backward(i, steps)
        if i in self.graphed:
            input_grad = self.graphed_backward(i, self.graphed.pop(i), grad)
            self.hooks.after_backward(i, steps)
            self.armed = None
            if not self.first:
                self.inputs.pop(i)
                self.grads_out[i] = input_grad
            return "B", i
        # A data-parallel replica's share of a microbatch can be empty (all padding): on the
        # first stage its output then has no graph to adapters, and there is nothing to do.
        if out.requires_grad:
            torch.autograd.backward(out, grad_tensors=grad)
        self.hooks.after_backward(i, steps)
        self.armed = None
        if not self.first:
            x = self.inputs.pop(i)
            self.grads_out[i] = x.grad if x.grad is not None else torch.zeros_like(x)
        return "B", i

    def fused_step(self, item: Forward, steps: tuple[int, ...]) -> tuple[str, int] | None:
        """Forward and backward of ``item``'s microbatch as the stage's one fused step; None
        when the stage cannot fuse this microbatch (the caller runs both eagerly)."""
        i = item.microbatch
        self.hooks.before_backward(i, steps)
        self.armed = i
        done = self.fused(None if self.first else self.inputs[i], i)
        if done is None:
            return None
        self.hooks.after_backward(i, steps)
        self.armed = None
        if not self.first:
            self.inputs.pop(i)
            self.grads_out[i] = done.input_grad
        return "FB", i

    def step(self, item: OptimizerStep) -> tuple[str, int]:
        self.optimizer_step(item.adapter, item.batch)
        return "S", item.adapter

    def compute(self, item: Action, fuse_with: Backward | None = None,
                steps: tuple[int, ...] = ()) -> bool:
        """Run one Forward, Backward or OptimizerStep and record its time. With ``fuse_with``
        (the Backward of the same microbatch, next in the list) the pair may run as one fused
        step: returns True when it did (the Backward is then done)."""
        t0 = self.clock.mark(bound=True)
        if fuse_with is not None and self.fused is not None:
            fused = self.fused_step(item, steps)
            if fused is not None:
                self.events.append((*fused, t0, self.clock.mark(bound=True)))
                return True
        if isinstance(item, Forward):
            kind, label = self.forward(item)
        elif isinstance(item, Backward):
            kind, label = self.backward(item, steps)
        else:
            assert isinstance(item, OptimizerStep)
            kind, label = self.step(item)
        self.events.append((kind, label, t0, self.clock.mark(bound=True)))
        return False

    def finish(self) -> StageRecord:
        """Wait for the pending sends, check nothing was left unconsumed, and return the record."""
        for w, _ in self.pending_sends:
            w.wait()
        if self.outputs or self.grads_in or self.grads_out:
            raise ScheduleError(
                f"stage {self.stage_index} finished with unconsumed microbatches "
                f"{sorted(set(self.outputs) | set(self.grads_in) | set(self.grads_out))}; "
                "the action list is incomplete"
            )
        marks = [m for _, _, t0, t1 in self.events for m in (t0, t1)] + [self.clock.mark()]
        seconds = self.clock.seconds(marks)
        events = tuple((kind, label, seconds[2 * k], seconds[2 * k + 1])
                       for k, (kind, label, _, _) in enumerate(self.events))
        return StageRecord(events=events, wall=seconds[-1])


def _steps_after(items: list) -> dict[int, tuple[int, ...]]:
    """``{position of a Backward in items: adapters whose OptimizerStep follows it directly}``."""
    out: dict[int, tuple[int, ...]] = {}
    for k, item in enumerate(items):
        if isinstance(item, Backward):
            adapters = []
            for nxt in items[k + 1:]:
                if not isinstance(nxt, OptimizerStep):
                    break
                adapters.append(nxt.adapter)
            out[k] = tuple(adapters)
    return out


def run_stage(
    actions: Sequence[Action],
    stage: StageModule,
    *,
    stage_index: int,
    num_stages: int,
    activation_shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str,
    optimizer_step: Callable[[int, int], None],
    stage_ranks: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    synchronize: Callable[[], None] | None = None,
    hooks: StageHooks | None = None,
) -> StageRecord:
    """Execute ``actions`` (this rank's list from the schedule builder) on ``stage``.

    ``stage_ranks[s]`` is the global rank running stage ``s`` (default: rank ``s``), so
    several pipelines can share one world for data parallelism. On CUDA the record holds device
    times (CUDA events, one synchronisation at the end); ``synchronize`` (e.g.
    ``torch.cuda.synchronize``) instead times each compute action by the host clock between two
    synchronisations (slower: the launch queue drains at every action). ``hooks``: see
    ``StageHooks``.
    """
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index={stage_index} must be in [0, {num_stages})")
    ranks = list(range(num_stages)) if stage_ranks is None else list(stage_ranks)
    if len(ranks) != num_stages:
        raise ValueError(f"stage_ranks has {len(ranks)} entries for {num_stages} stages")
    state = _StageRun(
        stage,
        stage_index=stage_index,
        num_stages=num_stages,
        ranks=ranks,
        shape=tuple(int(n) for n in activation_shape),
        dtype=dtype,
        device=device,
        optimizer_step=optimizer_step,
        group=group,
        synchronize=synchronize,
        hooks=hooks,
        slots=in_flight_slots(actions),
    )
    items = communication_runs(actions)
    steps_after = _steps_after(items)
    k = 0
    while k < len(items):
        item = items[k]
        if isinstance(item, tuple):
            state.post(item)
        else:
            nxt = items[k + 1] if k + 1 < len(items) else None
            pair = (isinstance(item, Forward) and isinstance(nxt, Backward)
                    and nxt.microbatch == item.microbatch)
            if state.compute(item, nxt if pair else None, steps_after.get(k + 1 if pair else k, ())):
                k += 1  # the Backward ran fused with its Forward
        k += 1
    return state.finish()
