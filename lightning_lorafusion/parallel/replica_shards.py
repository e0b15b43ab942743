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

4. ``deal_slots`` chooses, once the shape plan is known, which of a slot's bundles each replica
   runs: per planned microbatch, the slots with the most uneven bundles first, each one's largest
   bundle to the replica holding the fewest tokens of that microbatch so far. The shape plan does
   not change (a slot's length is its longest bundle, whoever runs it), but the replicas, which
   wait for each other at every adapter's step, get microbatches of nearly equal tokens.
5. Without a pipeline (one stage: nothing crosses a stage boundary, so nothing fixes the
   activation shape) a microbatch need not be as long as the capacity. ``deal_slots`` also gives
   each planned microbatch's *need*: its longest replica share, adapter segments padded as
   packing pads them; rounded up to a multiple of ``capacity / LEVEL_STEPS`` (``rounded_needs``),
   ``capacity_levels`` picks at most ``REPLICA_CAPACITY_LEVELS`` of them for the whole run (the
   fewest tokens over the needs it is given: the data module gives its first two epochs', and
   the capacity), and every replica packs position ``i`` at the smallest level holding its need
   (``level_of``), the same on every replica. Few, coarse levels keep the shapes of a run few:
   each new capacity compiles the decoder's fused elementwise groups again and takes a CUDA
   graph of its own.

``split_global_batch`` is the earlier one-sample-per-slot deal (replica ``r``'s slot ``k`` is the
``(k * replicas + r)``-th longest sample): a slot costs the longest of its ``replicas`` samples.
On the mixed workload of the 8B benchmark (4 adapters x 64 samples, global batches of 16,
capacity 8192, greedy planner) at two replicas, dealt slots keep 92.8% of the planned tokens real
and need 21 microbatches per replica; bundles keep 94.9% and need 20 (half the tokens take 18.7;
what is left is the room a bundle of 8 samples per replica cannot fill).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..data.packing import SampleLookup
from ..planner.plan import Plan, PlannedMicrobatch, SampleRef, padded_length

# capacities a run's microbatches are packed at, at most, without a pipeline (module docstring, 5)
REPLICA_CAPACITY_LEVELS = 3
# levels are multiples of capacity / LEVEL_STEPS (rounded to pad_multiple): a few shapes per run,
# each of which compiles and captures once
LEVEL_STEPS = 16


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


Slot = tuple[int, int, int]  # (adapter, global batch, slot index)


def deal_slots(plan: Plan, tokens: Mapping[Slot, Sequence[int]], *, pad_multiple: int
               ) -> tuple[dict[Slot, tuple[int, ...]], list[int]]:
    """Which bundle of every slot each replica runs, and each planned microbatch's need (module
    docstring, steps 4 and 5).

    ``tokens[(a, j, k)][b]`` = tokens of bundle ``b`` of adapter ``a``'s global batch ``j``, slot
    ``k`` (``bundles[b][k]`` of ``bundle_global_batch``). Returns ``deal[(a, j, k)][r]`` = the
    bundle replica ``r`` runs there, and ``needs[i]`` = the longest replica share of planned
    microbatch ``i`` with every adapter segment padded to ``pad_multiple`` (0 for a no-op
    slot). Deterministic: every replica, and a resumed run, deals the same.
    """
    deal: dict[Slot, tuple[int, ...]] = {}
    needs: list[int] = []
    for mb in plan.microbatches:
        slots = [(ref.adapter, ref.batch, ref.index) for ref in mb.samples]
        if not slots:
            needs.append(0)
            continue
        replicas = len(tokens[slots[0]])
        load = [dict.fromkeys((a for a, _, _ in slots), 0) for _ in range(replicas)]
        spread = lambda slot: max(tokens[slot]) - min(tokens[slot])  # noqa: E731
        for slot in sorted(slots, key=lambda slot: (-spread(slot), slot)):
            padded = [sum(padded_length(n, pad_multiple) for n in mine.values()) for mine in load]
            emptiest = sorted(range(replicas), key=lambda r: (padded[r], r))
            largest = sorted(range(replicas), key=lambda b: (-tokens[slot][b], b))
            dealt = [0] * replicas
            for r, b in zip(emptiest, largest):
                dealt[r] = b
                load[r][slot[0]] += tokens[slot][b]
            deal[slot] = tuple(dealt)
        needs.append(max(sum(padded_length(n, pad_multiple) for n in mine.values()) for mine in load))
    return deal, needs


def capacity_levels(needs: Sequence[int], levels: int = REPLICA_CAPACITY_LEVELS) -> list[int]:
    """At most ``levels`` capacities, ascending, such that every need fits one of them and the
    microbatches, each packed at the smallest level holding its need, take the fewest tokens
    (exact: a dynamic programme over the distinct needs; the largest need is always a level).
    Needs of 0 (no-op slots) are ignored."""
    if levels < 1:
        raise ValueError(f"levels={levels} must be >= 1")
    values = sorted({n for n in needs if n > 0})
    if not values:
        return []
    count = [sum(1 for n in needs if n == v) for v in values]
    prefix = [0]
    for c in count:
        prefix.append(prefix[-1] + c)
    n, inf = len(values), float("inf")
    # best[m][i]: fewest tokens for the needs up to values[i], with m levels, the top one at values[i]
    best = [[inf] * n for _ in range(levels + 1)]
    back = [[-1] * n for _ in range(levels + 1)]
    for i in range(n):
        best[1][i] = values[i] * prefix[i + 1]
    for m in range(2, levels + 1):
        for i in range(n):
            for p in range(i):
                cost = best[m - 1][p] + values[i] * (prefix[i + 1] - prefix[p + 1])
                if cost < best[m][i]:
                    best[m][i], back[m][i] = cost, p
    m = min(range(1, levels + 1), key=lambda m: (best[m][n - 1], m))
    chosen, i = [], n - 1
    while i >= 0 and m >= 1:
        chosen.append(values[i])
        i, m = back[m][i], m - 1
    return sorted(chosen)


def level_step(capacity: int, pad_multiple: int) -> int:
    """The granularity of capacity levels: ``capacity / LEVEL_STEPS``, a multiple of
    ``pad_multiple`` (at least one)."""
    return max(pad_multiple, capacity // LEVEL_STEPS // pad_multiple * pad_multiple)


def rounded_needs(needs: Sequence[int], capacity: int, pad_multiple: int) -> list[int]:
    """``needs`` rounded up to the level step (``level_step``), never past ``capacity``; 0 stays 0."""
    step = level_step(capacity, pad_multiple)
    return [min(capacity, -(-n // step) * step) if n else 0 for n in needs]


def level_of(need: int, levels: Sequence[int]) -> int:
    """The smallest of ``levels`` holding ``need`` tokens."""
    fits = [c for c in levels if c >= need]
    if not fits:
        raise ValueError(f"no capacity level of {list(levels)} holds {need} tokens")
    return min(fits)
