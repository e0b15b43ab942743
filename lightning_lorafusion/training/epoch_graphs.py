"""The training module's CUDA graphs at an epoch's start: the epoch's shape keys, agreed between
data-parallel replicas, and their covering graphs captured before the first step
(``TrainingGraphs.precapture``). Functions over the training module's state."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Any

import torch.distributed as dist

from .cuda_graphs import GraphKey, graph_key
from .pipeline_contract import pipeline_strategy

log = logging.getLogger(__name__)


def epoch_keys(dm: Any, lookahead: int = 0, last_epoch: int | None = None,
               cache: dict | None = None) -> tuple[int, Counter]:
    """The epoch the stream continues with and its shape keys with their number of microbatches
    (this replica's share, packed on the host), plus those of the ``lookahead`` epochs after it
    (none past ``last_epoch``). ``cache`` keeps each epoch's keys with the plan they came from, so
    the next epoch's start reuses its lookahead instead of packing that epoch on the host again."""
    epoch, start = dm.stream_start()
    keys: Counter = Counter()
    for e in range(epoch, epoch + 1 + lookahead):
        if e > epoch and last_epoch is not None and e > last_epoch:
            break
        keys.update(_keys_of(dm, e, start if e == epoch else 0, cache))
    return epoch, keys


def _keys_of(dm: Any, epoch: int, start: int, cache: dict | None) -> Counter:
    plan = dm.epoch_plan(epoch).plan if cache is not None and hasattr(dm, "epoch_plan") else None
    if plan is not None and cache.get((epoch, start), (None,))[0] is plan:  # a re-planned epoch is a new plan
        return cache[(epoch, start)][1]
    keys: Counter = Counter()
    for mb in dm.packed_epoch(epoch, start):
        try:
            keys[graph_key(mb)] += 1
        except ValueError:  # no host metadata: that microbatch runs eagerly anyway
            continue
    if plan is not None:
        for old in [k for k in cache if k[0] < epoch - 1]:
            del cache[old]
        cache[(epoch, start)] = (plan, keys)
    return keys


def _last_epoch(trainer: Any) -> int | None:
    """The trainer's last epoch index (None: no epoch limit)."""
    max_epochs = getattr(trainer, "max_epochs", None)
    return max_epochs - 1 if isinstance(max_epochs, int) and max_epochs > 0 else None


def union_over_replicas(keys: Counter, group: Any) -> Counter:
    """``keys`` summed over the ranks of ``group`` (collective over it; unchanged without one):
    every replica then chooses the same graphs, so none waits on another's capture."""
    if group is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return keys
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, sorted((dataclasses.astuple(k), n) for k, n in keys.items()), group=group)
    total: Counter = Counter()
    for part in gathered:
        for fields, n in part:
            total[GraphKey(*fields)] += n
    return total


def precapture_epoch(m: Any) -> list[GraphKey]:
    """Capture the graphs covering the coming epoch's microbatches and the next epoch's (all
    replicas' keys) before its first step: a later epoch whose plan brings keys no graph covers
    then finds them captured already, instead of stopping every replica to capture at its
    start. Nothing without graphs or a data module that can list the epoch."""
    graphs = m._graphs
    dm = m.trainer.datamodule if m._trainer is not None else None
    if graphs is None or dm is None or not hasattr(dm, "packed_epoch") or graphs.max_precapture == 0:
        return []
    if getattr(m, "_epoch_keys", None) is None:
        m._epoch_keys = {}
    epoch, keys = epoch_keys(dm, lookahead=1, last_epoch=_last_epoch(m.trainer), cache=m._epoch_keys)
    strategy = pipeline_strategy(m)
    keys = union_over_replicas(keys, strategy.data_parallel_group if strategy is not None else None)
    before = graphs.precapture_seconds
    done = graphs.precapture(keys, m.device)
    log.info("CUDA graphs: epoch %d: %d shape keys over %d microbatches of it and the next (all replicas); %d graphs "
             "captured up front in %.2f s: %s; %d graphs held", epoch, len(keys), sum(keys.values()),
             len(done), graphs.precapture_seconds - before, [dataclasses.astuple(k) for k in done],
             graphs.num_held)
    return done


def replay_counts(graphs: Any) -> dict[str, int]:
    """What a rank's training graphs ran so far: forward and backward replays apart (a stage
    before the last), fused forward + backward replays (the one-GPU step, the last stage),
    microbatches run eagerly (apart only) and captures (up front ones included)."""
    return {"forward": getattr(graphs, "forward_replays", 0), "backward": getattr(graphs, "backward_replays", 0),
            "fused": 0 if hasattr(graphs, "forward_replays") else graphs.replays,
            "eager": getattr(graphs, "eager_microbatches", 0), "captures": graphs.captures}


def log_replays(m: Any) -> dict[str, int] | None:
    """Log this rank's graph replays so far (``replay_counts``), under its pipeline stage (0
    without the strategy) at an epoch's end; None without graphs."""
    if m._graphs is None:
        return None
    strategy = pipeline_strategy(m)
    counts = replay_counts(m._graphs)
    log.info("CUDA graphs: stage %d replays: %d forward, %d backward, %d fused; %d eager; %d captures",
             strategy.stage_index if strategy is not None else 0, counts["forward"], counts["backward"],
             counts["fused"], counts["eager"], counts["captures"])
    return counts
