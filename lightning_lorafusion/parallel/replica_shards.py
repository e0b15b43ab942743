"""Splitting every global batch over data-parallel replicas so that all replicas run one plan.

Replicas must step adapters in the same order (each step is an all-reduce among them), so they
run plans of one shape: the same microbatch slots, the same step points. We get that without
planning the replicas jointly:

1. ``bundle_global_batch`` cuts a global batch into *slots*: each slot holds, per replica, a
   bundle of samples, and is as long as its longest bundle (``slot_lengths``). Slots are made
   longest sample first: the longest sample left opens a slot for the replica with the fewest
   tokens so far, and every other replica fills its bundle of that slot with the longest samples
   left that still fit (first fit, decreasing). The bundles of a slot are therefore nearly equal,
   and a slot costs about ``1 / replicas`` of its samples, not the longest of ``replicas``
   samples each.
2. The planner plans the slot lengths, once, for everybody: that is the *shape plan*, the one the
   schedule is built from.
3. ``replica_microbatch`` turns each planned microbatch into replica ``r``'s: every slot replaced
   by replica ``r``'s bundle (never longer, so it fits the same capacity; a bundle's samples stay
   next to each other in the adapter's segment). A replica's microbatch may end up empty (all
   padding): it still runs, so the pipeline and the step points stay aligned, and contributes
   nothing.

``split_global_batch`` is the earlier one-sample-per-slot deal (replica ``r``'s slot ``k`` is the
``(k * replicas + r)``-th longest sample): a slot costs the longest of its ``replicas`` samples.
On the mixed workload of the 8B benchmark (4 adapters x 64 samples, global batches of 16,
capacity 8192, greedy planner) at two replicas, dealt slots keep 92.8% of the planned tokens real
and need 21 microbatches per replica; bundles keep 94.9% and need 20 (half the tokens take 18.7;
what is left is the room a bundle of 8 samples per replica cannot fill).
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
    With a ``ReplicaLookup`` (``bundle_global_batch``) each slot becomes the replica's bundle.
    """
    if isinstance(lookup, ReplicaLookup):
        return _bundles_of(planned, lookup)
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


class ReplicaLookup(SampleLookup):
    """A replica's samples: ``batches[a][j]`` lists its dataset indices of adapter ``a``'s global
    batch ``j`` bundle after bundle, and ``slots[a][j][k]`` = the positions in that list of its
    bundle in slot ``k`` (possibly empty)."""

    def __init__(self, datasets, batches, slots) -> None:
        super().__init__(datasets, batches)
        self.slots = slots


def bundle_global_batch(indices: Sequence[int], lengths: Sequence[int], replicas: int) -> list[list[list[int]]]:
    """Cut one global batch into slots; returns ``bundles[r][k]`` = the dataset indices replica
    ``r`` runs in slot ``k`` (module docstring, step 1).

    ``indices[i]`` is a sample's dataset index and ``lengths[i]`` its tokens. Every replica has
    the same number of slots; a bundle's tokens never exceed its slot's opening sample, which is
    the slot's length (``slot_lengths``). Deterministic (ties by position): every replica, and a
    resumed run, computes the same bundles.
    """
    if replicas < 1:
        raise ValueError(f"replicas={replicas} must be >= 1")
    if len(indices) != len(lengths):
        raise ValueError(f"{len(indices)} indices but {len(lengths)} lengths")
    left = sorted(range(len(indices)), key=lambda i: (-lengths[i], i))
    totals = [0] * replicas
    bundles: list[list[list[int]]] = [[] for _ in range(replicas)]
    while left:
        width = lengths[left[0]]
        order = sorted(range(replicas), key=lambda r: (totals[r], r))
        bundles[order[0]].append([indices[left[0]]])  # the slot's opening (longest) sample
        totals[order[0]] += width
        left = left[1:]
        for r in order[1:]:  # first fit, decreasing, within the opening sample's length
            room, mine, rest = width, [], []
            for i in left:
                if lengths[i] <= room:
                    mine.append(i)
                    room -= lengths[i]
                else:
                    rest.append(i)
            left = rest
            bundles[r].append([indices[i] for i in mine])
            totals[r] += width - room
    return bundles


def slot_lengths(bundles: Sequence[Sequence[Sequence[int]]], length_of) -> list[int]:
    """The planned length of each slot: its longest bundle's tokens (``length_of[index]``)."""
    slots = len(bundles[0]) if bundles else 0
    return [max(sum(length_of[i] for i in b[k]) for b in bundles) for k in range(slots)]


def _bundles_of(planned: PlannedMicrobatch, lookup: ReplicaLookup) -> PlannedMicrobatch:
    refs = []
    for ref in planned.samples:
        slots = lookup.slots[ref.adapter][ref.batch]
        total = 0
        for pos in (slots[ref.index] if ref.index < len(slots) else ()):
            mine = SampleRef(ref.adapter, ref.batch, pos, 0)
            length = len(lookup.sample(mine).input_ids)
            total += length
            refs.append(SampleRef(ref.adapter, ref.batch, pos, length))
        if total > ref.length:
            raise ValueError(
                f"replica bundle {ref.adapter, ref.batch, ref.index} has {total} tokens, more than the "
                f"{ref.length} planned for its slot; bundles must come from bundle_global_batch"
            )
    return PlannedMicrobatch(tuple(refs))
