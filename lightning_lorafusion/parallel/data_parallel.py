"""Data parallelism over pipeline replicas: the rank layout and per-adapter gradient all-reduce.

World rank ``r`` runs stage ``r % pipeline_size`` of replica ``r // pipeline_size``. Replicas
split every adapter's global batch between them; each microbatch's loss is normalised by the
label tokens of the adapter's *whole* global batch (all replicas), so summing the replicas'
gradients at the adapter's step gives exactly the one-process gradient. The all-reduce runs
among the ranks holding the same stage, for that adapter's parameters only, when it steps.
Replicas must therefore step adapters in the same order: run them on plans with identical
step order (``check_same_step_order`` verifies it before training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from .schedule import Action, OptimizerStep, ScheduleError


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """How ``pipeline_size * data_parallel_size`` ranks are arranged."""

    pipeline_size: int = 1
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("pipeline_size", "data_parallel_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"ParallelLayout.{name}={getattr(self, name)!r} must be an int >= 1")

    @property
    def world_size(self) -> int:
        return self.pipeline_size * self.data_parallel_size

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(
                f"pipeline_size={self.pipeline_size} x data_parallel_size={self.data_parallel_size} "
                f"needs {self.world_size} processes, but the world has {world_size}; set devices x "
                "num_nodes to their product"
            )

    def stage_of(self, rank: int) -> int:
        return rank % self.pipeline_size

    def replica_of(self, rank: int) -> int:
        return rank // self.pipeline_size

    def pipeline_ranks(self, replica: int) -> list[int]:
        """Global ranks of replica ``replica``'s stages, stage 0 first."""
        return [replica * self.pipeline_size + s for s in range(self.pipeline_size)]

    def data_parallel_ranks(self, stage: int) -> list[int]:
        """Global ranks holding stage ``stage``, one per replica."""
        return [d * self.pipeline_size + stage for d in range(self.data_parallel_size)]


def build_data_parallel_groups(layout: ParallelLayout) -> list[dist.ProcessGroup | None]:
    """One process group per stage over its replicas (None when there is one replica).

    Collective: every rank must call it, in the same order, after ``init_process_group``.
    """
    layout.check_world(dist.get_world_size())
    if layout.data_parallel_size == 1:
        return [None] * layout.pipeline_size
    return [dist.new_group(layout.data_parallel_ranks(s)) for s in range(layout.pipeline_size)]


def allreduce_adapter_grads(params: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum ``params``' gradients over ``group`` in one flat message (missing grads count as 0).

    Every rank of the group must pass the same parameters in the same order.
    """
    if group is None or dist.get_world_size(group) == 1 or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


def check_same_step_order(actions: Sequence[Action], group: dist.ProcessGroup | None) -> None:
    """Raise ``ScheduleError`` unless every replica in ``group`` steps adapters in the same order
    (the per-step all-reduces would otherwise pair up wrongly and hang)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    order = [(a.adapter, a.batch) for a in actions if isinstance(a, OptimizerStep)]
    gathered: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, order, group=group)
    for replica, other in enumerate(gathered):
        if other != order:
            diff = next((k for k, (x, y) in enumerate(zip(order, other)) if x != y), min(len(order), len(other)))
            raise ScheduleError(
                f"data-parallel replicas step adapters in different orders (first difference at "
                f"step {diff}: this rank {order[diff:diff + 1]}, replica {replica} "
                f"{other[diff:diff + 1]}); plan every replica's shard with the same step order, "
                "e.g. by planning the replicas' shards together"
            )
