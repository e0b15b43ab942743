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
    shape = tuple(int(n) for n in activation_shape)
    first, last = stage_index == 0, stage_index == num_stages - 1
    prev_rank = ranks[stage_index - 1] if not first else None
    next_rank = ranks[stage_index + 1] if not last else None

    inputs: dict[int, torch.Tensor] = {}  # received activation (leaf requiring grad)
    outputs: dict[int, torch.Tensor] = {}  # stage output, graph attached
    grads_in: dict[int, torch.Tensor] = {}  # received gradient w.r.t. our output
    grads_out: dict[int, torch.Tensor] = {}  # gradient w.r.t. our input, to send
    pending_sends: list[tuple[dist.Work, torch.Tensor]] = []
    events: list[tuple[str, int, float, float]] = []
    t_start = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t_start

    def sync() -> None:
        if synchronize is not None:
            synchronize()

    def post(run: tuple[Action, ...]) -> None:
        ops: list[dist.P2POp] = []
        recv_works_idx: list[int] = []
        keep: list[torch.Tensor] = []
        for a in run:
            i = a.microbatch
            if isinstance(a, SendActivation):
                out = outputs[i].detach()
                if tuple(out.shape) != shape or out.dtype != dtype:
                    raise ScheduleError(
                        f"stage {stage_index} produced {tuple(out.shape)} {out.dtype} for microbatch "
                        f"{i}; pipeline messages must be {shape} {dtype} (fixed microbatch capacity)"
                    )
                tensor = out.contiguous()
                ops.append(dist.P2POp(dist.isend, tensor, next_rank, group))
            elif isinstance(a, SendGrad):
                tensor = grads_out.pop(i).contiguous()
                ops.append(dist.P2POp(dist.isend, tensor, prev_rank, group))
            elif isinstance(a, RecvActivation):
                tensor = torch.empty(shape, dtype=dtype, device=device)
                inputs[i] = tensor
                recv_works_idx.append(len(ops))
                ops.append(dist.P2POp(dist.irecv, tensor, prev_rank, group))
            else:
                assert isinstance(a, RecvGrad)
                tensor = torch.empty(shape, dtype=dtype, device=device)
                grads_in[i] = tensor
                recv_works_idx.append(len(ops))
                ops.append(dist.P2POp(dist.irecv, tensor, next_rank, group))
            keep.append(tensor)
        t0 = now()
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):
            for k, (w, op) in enumerate(zip(works, ops)):
                if k in recv_works_idx:
                    w.wait()
                else:
                    pending_sends.append((w, keep[k]))
        else:  # one coalesced work for the whole batch (NCCL)
            for w in works:
                w.wait()
        events.append(("C", -1, t0, now()))
        # drop references to sends that have completed
        pending_sends[:] = [(w, t) for w, t in pending_sends if not w.is_completed()]

    for item in communication_runs(actions):
        if isinstance(item, tuple):
            post(item)
            continue
        sync()
        t0 = now()
        if isinstance(item, Forward):
            i = item.microbatch
            x = None
            if not first:
                x = inputs[i].requires_grad_(True)
            out = stage.forward(x, i)
            if last and out.dim() != 0:
                raise ScheduleError(
                    f"the last stage must return the scalar loss to backward; got shape {tuple(out.shape)}"
                )
            outputs[i] = out
            kind, label = "F", i
        elif isinstance(item, Backward):
            i = item.microbatch
            out = outputs.pop(i)
            grad = None if last else grads_in.pop(i)
            # A data-parallel replica's share of a microbatch can be empty (all padding): on the
            # first stage its output then has no graph to adapters, and there is nothing to do.
            if out.requires_grad:
                torch.autograd.backward(out, grad_tensors=grad)
            if not first:
                x = inputs.pop(i)
                grads_out[i] = x.grad if x.grad is not None else torch.zeros_like(x)
            kind, label = "B", i
        else:
            assert isinstance(item, OptimizerStep)
            optimizer_step(item.adapter, item.batch)
            kind, label = "S", item.adapter
        sync()
        events.append((kind, label, t0, now()))
    for w, _ in pending_sends:
        w.wait()
    if outputs or grads_in or grads_out:
        raise ScheduleError(
            f"stage {stage_index} finished with unconsumed microbatches "
            f"{sorted(set(outputs) | set(grads_in) | set(grads_out))}; the action list is incomplete"
        )
    return StageRecord(events=tuple(events), wall=now())
