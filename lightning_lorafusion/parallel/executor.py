"""Running one rank's pipeline action list with torch.distributed point-to-point messages.

Microbatches have a fixed token capacity, so every activation and gradient crossing a stage
boundary has the static shape ``activation_shape`` (``[capacity, hidden]``): receive buffers
are allocated without any shape exchange. Each run of consecutive communication actions is
posted as one ``batch_isend_irecv`` (the pairing the simulator's rendezvous check proves
deadlock-free even where P2P between two ranks is serialised, as with NCCL); the rank waits only
for that run's receives, while sends complete in the background, overlapping the next compute.
Backward runs through the autograd graph saved at forward; ``optimizer_step(adapter, batch)``
is called where the schedule places ``OptimizerStep``.
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
)
from .stage import StageModule


@dataclass(frozen=True, kw_only=True)
class StageRecord:
    """Wall-clock record of one rank's run: ``events`` rows ``(kind, id, start, end)`` in seconds
    since the run began, kind ``"F"``/``"B"``/``"S"``/``"C"`` (waiting on communication)."""

    events: tuple[tuple[str, int, float, float], ...] = field(repr=False)
    wall: float

    @property
    def busy(self) -> float:
        return sum(t1 - t0 for kind, _, t0, t1 in self.events if kind != "C")


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
    ) -> None:
        self.stage = stage
        self.stage_index = stage_index
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.optimizer_step = optimizer_step
        self.group = group
        self.synchronize = synchronize
        self.first, self.last = stage_index == 0, stage_index == num_stages - 1
        self.prev_rank = ranks[stage_index - 1] if not self.first else None
        self.next_rank = ranks[stage_index + 1] if not self.last else None
        self.inputs: dict[int, torch.Tensor] = {}  # received activation (leaf requiring grad)
        self.outputs: dict[int, torch.Tensor] = {}  # stage output, graph attached
        self.grads_in: dict[int, torch.Tensor] = {}  # received gradient w.r.t. our output
        self.grads_out: dict[int, torch.Tensor] = {}  # gradient w.r.t. our input, to send
        self.pending_sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.events: list[tuple[str, int, float, float]] = []
        self.t_start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t_start

    def sync(self) -> None:
        if self.synchronize is not None:
            self.synchronize()

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
        t0 = self.now()
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):
            for k, (w, op) in enumerate(zip(works, ops)):
                if k in recv_works_idx:
                    w.wait()
                else:
                    self.pending_sends.append((w, keep[k]))
        else:  # one coalesced work for the whole batch (NCCL)
            for w in works:
                w.wait()
        self.events.append(("C", -1, t0, self.now()))
        # drop references to sends that have completed
        self.pending_sends[:] = [(w, t) for w, t in self.pending_sends if not w.is_completed()]

    def forward(self, item: Forward) -> tuple[str, int]:
        i = item.microbatch
        x = None
        if not self.first:
            x = self.inputs[i].requires_grad_(True)
        out = self.stage.forward(x, i)
        if self.last and out.dim() != 0:
            raise ScheduleError(
                f"the last stage must return the scalar loss to backward; got shape {tuple(out.shape)}"
            )
        self.outputs[i] = out
        return "F", i

    def backward(self, item: Backward) -> tuple[str, int]:
        i = item.microbatch
        out = self.outputs.pop(i)
        grad = None if self.last else self.grads_in.pop(i)
        # A data-parallel replica's share of a microbatch can be empty (all padding): on the
        # first stage its output then has no graph to adapters, and there is nothing to do.
        if out.requires_grad:
            torch.autograd.backward(out, grad_tensors=grad)
        if not self.first:
            x = self.inputs.pop(i)
            self.grads_out[i] = x.grad if x.grad is not None else torch.zeros_like(x)
        return "B", i

    def step(self, item: OptimizerStep) -> tuple[str, int]:
        self.optimizer_step(item.adapter, item.batch)
        return "S", item.adapter

    def compute(self, item: Action) -> None:
        """Run one Forward, Backward or OptimizerStep and record its (synchronised) time."""
        self.sync()
        t0 = self.now()
        if isinstance(item, Forward):
            kind, label = self.forward(item)
        elif isinstance(item, Backward):
            kind, label = self.backward(item)
        else:
            assert isinstance(item, OptimizerStep)
            kind, label = self.step(item)
        self.sync()
        self.events.append((kind, label, t0, self.now()))

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
        return StageRecord(events=tuple(self.events), wall=self.now())


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
) -> StageRecord:
    """Execute ``actions`` (this rank's list from the schedule builder) on ``stage``.

    ``stage_ranks[s]`` is the global rank running stage ``s`` (default: rank ``s``), so
    several pipelines can share one world for data parallelism. ``synchronize`` (e.g.
    ``torch.cuda.synchronize``) is called around timed compute so the record measures the
    device, not the launch queue; leave it None on CPU.
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
    )
    for item in communication_runs(actions):
        if isinstance(item, tuple):
            state.post(item)
        else:
            state.compute(item)
    return state.finish()
