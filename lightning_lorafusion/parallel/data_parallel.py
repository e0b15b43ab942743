"""Data parallelism over pipeline replicas: the rank layout and per-adapter gradient all-reduce.

World rank ``r`` runs stage ``r % pipeline_size`` of replica ``r // pipeline_size``. Replicas
split every adapter's global batch between them; each microbatch's loss is normalised by the
label tokens of the adapter's *whole* global batch (all replicas), so summing the replicas'
gradients at the adapter's step gives exactly the one-process gradient. The all-reduce runs
among the ranks holding the same stage, for that adapter's parameters only, when it steps.
Replicas must therefore step adapters in the same order: run them on plans with identical
step order (``check_same_step_order`` verifies it before training).

``AdapterGradReducer`` overlaps that all-reduce with the backward of the microbatch completing
the global batch: the adapter's parameters are cut into buckets (in the order backward finishes
them, last layer first), each bucket's asynchronous all-reduce starts as soon as its gradients
are final, and the adapter's step waits for its own buckets only. Buckets are launched in one
fixed order on every replica (a ready bucket waits for the ones before it), so the collectives
pair up even when a replica's share of the microbatch leaves some gradients untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .executor import StageHooks
from .schedule import Action, OptimizerStep, ScheduleError

DEFAULT_BUCKET_MB = 25.0


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


@dataclass
class _Bucket:
    adapter: int
    params: list[torch.Tensor]
    waiting: int = 0  # gradients not yet final in the armed backward
    flat: torch.Tensor | None = None
    work: dist.Work | None = None


class AdapterGradReducer(StageHooks):
    """Per-adapter, bucketed, asynchronous gradient all-reduce over ``group``, started during the
    backward that completes an adapter's global batch (executor ``StageHooks``); ``wait(adapter)``
    before the adapter's step.

    ``params_of(a)``: adapter ``a``'s parameters on this stage in forward order (the same list
    on every replica; asked once per adapter). ``bucket_mb``: bucket size in MiB of gradient.
    """

    def __init__(self, params_of: Callable[[int], Sequence[torch.Tensor]], group: dist.ProcessGroup,
                 *, bucket_mb: float = DEFAULT_BUCKET_MB) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb={bucket_mb!r} must be > 0")
        self.group = group
        self.params_of = params_of
        self.bucket_bytes = bucket_mb * 2**20
        self.buckets: dict[int, list[_Bucket]] = {}  # per adapter, in backward order
        self._order: list[_Bucket] = []  # the armed buckets, in launch order
        self._next = 0  # first armed bucket not launched yet
        self._handles: list = []
        self._bucket_of: dict[int, _Bucket] = {}

    def buckets_of(self, adapter: int) -> list[_Bucket]:
        if adapter not in self.buckets:
            out: list[_Bucket] = []
            size = 0
            for p in reversed(list(self.params_of(adapter))):  # backward ends with the first layers
                if not out or size + p.numel() * p.element_size() > self.bucket_bytes:
                    out.append(_Bucket(adapter=adapter, params=[]))
                    size = 0
                out[-1].params.append(p)
                size += p.numel() * p.element_size()
            self.buckets[adapter] = out
        return self.buckets[adapter]

    @property
    def launched(self) -> int:
        """Buckets launched so far in the current (or last) armed backward."""
        return self._next

    def before_backward(self, microbatch: int, adapters: tuple[int, ...]) -> None:
        if not adapters:
            return
        per = [self.buckets_of(a) for a in sorted(set(adapters))]
        # interleaved by position: each adapter's k-th bucket covers about the same layers
        self._order = [x[k] for k in range(max(len(x) for x in per)) for x in per if k < len(x)]
        self._next = 0
        self._bucket_of = {}
        for bucket in self._order:
            bucket.waiting, bucket.flat, bucket.work = len(bucket.params), None, None
            for p in bucket.params:
                self._bucket_of[id(p)] = bucket
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, p: torch.Tensor) -> None:
        bucket = self._bucket_of.get(id(p))
        if bucket is None:
            return
        bucket.waiting -= 1
        self._launch_ready()

    def _launch_ready(self, everything: bool = False) -> None:
        while self._next < len(self._order) and (everything or self._order[self._next].waiting <= 0):
            bucket = self._order[self._next]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
            bucket.flat = torch.cat([g.reshape(-1) for g in grads])
            bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self._next += 1

    def after_backward(self, microbatch: int, adapters: tuple[int, ...]) -> None:
        """Launch what the backward left (gradients it did not touch, or a fused step whose
        hooks did not run), in the same fixed order."""
        if not adapters:
            return
        for handle in self._handles:
            handle.remove()
        self._handles, self._bucket_of = [], {}
        self._launch_ready(everything=True)

    def wait(self, adapter: int) -> None:
        """Wait for ``adapter``'s buckets and write the summed gradients back (in place where a
        gradient tensor exists, so static gradient tensors of CUDA graphs stay bound)."""
        for bucket in self.buckets_of(adapter):
            if bucket.work is None:
                raise RuntimeError(f"adapter {adapter}'s gradients were never all-reduced: its step "
                                   "must follow the backward that completes its global batch")
            bucket.work.wait()
            offset = 0
            for p in bucket.params:
                n = p.numel()
                summed = bucket.flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = summed.clone()
                else:
                    p.grad.copy_(summed)
                offset += n
            bucket.flat, bucket.work = None, None
