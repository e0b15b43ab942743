"""Splitting every global batch over data-parallel replicas so that all replicas run one plan.

Replicas must step adapters in the same order (each step is an all-reduce among them), so they
run plans of one shape: the same microbatch slots, the same step points. We get that without
planning the replicas jointly:

1. ``split_global_batch`` deals a global batch's samples to the replicas, longest first: sort
   by length (descending), cut into groups of ``replicas`` consecutive samples, and give the
   ``r``-th sample of group ``k`` to replica ``r`` as its ``k``-th sample ("slot ``k``").
   Replica 0 therefore holds the longest sample of every group and has every slot; the others
   may lack the last slot (when the batch size is not a multiple of ``replicas``).
2. The planner plans replica 0's shard (its lengths bound every replica's sample in the same
   slot), once, for everybody: that is the *shape plan*, the one the schedule is built from.
3. ``replica_microbatch`` turns each planned microbatch into replica ``r``'s: the same slots
   filled with replica ``r``'s samples (never longer, so they fit the same capacity), slots it
   lacks left out. A replica's microbatch may end up empty (all padding): it still runs, so the
   pipeline and the step points stay aligned, and contributes nothing.

The price is padding: a slot costs its group's longest length on every replica. Groups hold
samples adjacent in length order, so on realistic batches that is a few percent.
"""

from __future__ import annotations

from typing import Sequence

from ..data.packing import SampleLookup
from ..planner.plan import PlannedMicrobatch, SampleRef


def split_global_batch(indices: Sequence[int], lengths: Sequence[int], replicas: int) -> list[list[int]]:
    """Deal one global batch to ``replicas`` replicas; returns ``shards[r]`` = dataset indices in
    slot order.

    ``indices[i]`` is a sample's dataset index and ``lengths[i]`` its tokens. Replica ``r``'s
    slot ``k`` is the ``(k * replicas + r)``-th longest sample (ties by position), so its length
    is at most replica 0's slot ``k``. Deterministic: a resumed run recomputes the same shards.
    """
    if replicas < 1:
        raise ValueError(f"replicas={replicas} must be >= 1")
    if len(indices) != len(lengths):
        raise ValueError(f"{len(indices)} indices but {len(lengths)} lengths")
    order = sorted(range(len(indices)), key=lambda i: (-lengths[i], i))
    return [[indices[order[i]] for i in range(r, len(order), replicas)] for r in range(replicas)]


def replica_microbatch(planned: PlannedMicrobatch, lookup: SampleLookup) -> PlannedMicrobatch:
    """Planned microbatch ``planned`` of the shape plan, filled with the samples of the replica
    whose shard ``lookup`` holds (``lookup.batches[a][j]`` = that replica's slots).

    Slots the replica lacks are dropped; lengths become the replica's own (never more than
    planned). The result may be empty: pack it anyway (all padding), do not treat it as a no-op.
    """
    refs = []
    for ref in planned.samples:
        slots = lookup.batches[ref.adapter][ref.batch]
        if ref.index >= len(slots):
            continue
        length = len(lookup.sample(ref).input_ids)
        if length > ref.length:
            raise ValueError(
                f"replica sample {ref.adapter, ref.batch, ref.index} has {length} tokens, more than "
                f"the {ref.length} planned for its slot; shards must come from split_global_batch"
            )
        refs.append(SampleRef(ref.adapter, ref.batch, ref.index, length))
    return PlannedMicrobatch(tuple(refs))
