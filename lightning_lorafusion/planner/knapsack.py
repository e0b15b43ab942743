"""Window packing microbatch by microbatch, each one filled by an exact padded knapsack.

The wave packers (greedy, MILP) pack one round of one group at a time and leave the
cross-batch merge to fill the gaps between waves. This packer instead builds the window's
microbatches in execution order. At position i every adapter offers the rest of its current
global batch, if the bubble lemma lets that batch run at i (at least S microbatches after its
previous batch's step point). Microbatch i is the subset of the offered samples with the most
real tokens whose padded load fits the capacity, and it must hold the longest remaining sample
of the earliest pending wave (wave order = the grouping's order), so the waves advance in the
order the grouping staggered them and long samples are placed while short ones are still
around to fill the space beside them. The subset is exact: a subset-sum bitset per adapter
gives, for every number of padded blocks, the most tokens that adapter can put in them, and a
small dynamic programme shares the capacity's blocks between adapters. Padding is thus part
of the choice: two samples of one adapter share a segment and pay one padding, so the
knapsack prefers them when that fits more real tokens.

With S > 1 the planner also tries a staggered variant, where only the earliest offered wave's
batches may finish at a position: maximal knapsacks otherwise finish every adapter's batch in
the same microbatch, and then no adapter may run in the next S - 1 positions.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .greedy import Bin, decreasing_order
from .plan import SampleRef

# The block DP costs O(adapters x blocks^2) per microbatch; above this many blocks per
# microbatch (small pad multiples) it works in coarser blocks, which is conservative
# (a coarser block never under-counts padding) and only makes the fill slightly worse.
MAX_BLOCKS = 128


def _block_size(capacity: int, pad_multiple: int) -> int:
    """Smallest multiple of ``pad_multiple`` that splits ``capacity`` into <= MAX_BLOCKS blocks."""
    block = pad_multiple
    while capacity // block > MAX_BLOCKS:
        block += pad_multiple
    return block


def _subset_sums(lengths: Sequence[int], limit: int, base: int) -> list[int]:
    """history[k]: bitset of the sums <= limit reachable by ``base`` plus a subset of lengths[:k]."""
    mask = (1 << (limit + 1)) - 1
    bits = (1 << base) & mask
    history = [bits]
    for n in lengths:
        bits = (bits | (bits << n)) & mask
        history.append(bits)
    return history


def _subset_with_sum(lengths: Sequence[int], history: list[int], total: int, base: int) -> list[int]:
    """Indices of a subset of ``lengths`` summing to ``total - base`` (longest items preferred
    when ``lengths`` is sorted longest first: later items are skipped whenever possible)."""
    chosen = []
    for k in range(len(lengths), 0, -1):
        if (history[k - 1] >> total) & 1:
            continue
        chosen.append(k - 1)
        total -= lengths[k - 1]
    assert total == base, "subset-sum reconstruction out of step with its history"
    return chosen


def best_subset(
    offered: Mapping[int, Sequence[SampleRef]], capacity: int, pad_multiple: int, must: SampleRef
) -> list[SampleRef]:
    """The subset of ``offered`` (adapter -> samples) holding ``must`` with the most real tokens
    whose padded load (each adapter's tokens padded to ``pad_multiple``) is <= ``capacity``.

    Exact when ``capacity // pad_multiple <= MAX_BLOCKS``; otherwise exact in coarser blocks.
    Ties go to the longest samples and, between adapters, to fewer blocks for higher adapters.
    """
    block = _block_size(capacity, pad_multiple)
    blocks = capacity // block
    adapters = sorted(offered)
    tables = []  # per adapter: (samples, lengths, history, base, best[q] = most tokens in q blocks)
    for a in adapters:
        samples = decreasing_order(offered[a])
        base = 0
        if must.adapter == a:
            samples = [s for s in samples if s != must]
            base = must.length
        lengths = [s.length for s in samples]
        history = _subset_sums(lengths, blocks * block, base)
        reachable = history[-1]
        best = []
        for q in range(blocks + 1):
            below = reachable & ((1 << (q * block + 1)) - 1)
            best.append(below.bit_length() - 1 if below else -1)  # -1: nothing (not even base) fits
        tables.append((samples, lengths, history, base, best))
    # Share the blocks: value[k] = most tokens of the adapters so far in k blocks, with the
    # per-adapter block count that achieved it kept for the way back.
    value = [0] * (blocks + 1)
    picks = []
    for _samples, _lengths, _history, _base, best in tables:
        options = [q for q in range(blocks + 1) if best[q] >= 0 and (q == 0 or best[q] > best[q - 1])]
        new = [-1] * (blocks + 1)
        pick = [0] * (blocks + 1)
        for k in range(blocks + 1):
            for q in options:
                if q > k:
                    break
                if value[k - q] >= 0 and value[k - q] + best[q] > new[k]:
                    new[k], pick[k] = value[k - q] + best[q], q
        value = new
        picks.append(pick)
    assert value[blocks] >= must.length, "the must sample alone always fits (validated lengths)"
    chosen: list[SampleRef] = []
    k = blocks
    for (samples, lengths, history, base, best), pick in zip(reversed(tables), reversed(picks)):
        q = pick[k]
        k -= q
        if best[q] > 0:
            chosen += [samples[i] for i in _subset_with_sum(lengths, history, best[q], base)]
            if base:
                chosen.append(must)
    return chosen


def pack_in_order(
    waves: Sequence[Sequence[SampleRef]], capacity: int, pad_multiple: int, num_stages: int, *, staggered: bool = False
) -> list[Bin]:
    """Microbatches of a whole window, in execution order (see the module docstring).

    ``waves`` are the window's waves in the grouping's order; each adapter's batches must
    appear in increasing batch order. A position where no adapter may run (only with S > 1)
    yields an empty microbatch; the caller drops it and lets ``fix_plan`` insert the no-ops
    that are really needed.

    ``staggered``: only the batches of the earliest pending wave may finish at a position; a
    batch of a later wave keeps at least its shortest remaining sample for later. Without it
    the knapsack tends to finish every adapter's batch in the same microbatch, and with S > 1
    the next S - 1 positions then have no eligible work (a near-empty microbatch per round).
    """
    rank: dict[tuple[int, int], int] = {}
    for w, wave in enumerate(waves):
        for s in wave:
            rank.setdefault((s.adapter, s.batch), w)
    queue: dict[int, list[tuple[int, int]]] = {}
    for key in sorted(rank, key=lambda k: (rank[k], k)):
        queue.setdefault(key[0], []).append(key)
    remaining: dict[tuple[int, int], list[SampleRef]] = {key: [] for key in rank}
    for wave in waves:
        for s in wave:
            remaining[(s.adapter, s.batch)].append(s)
    position = {a: 0 for a in queue}  # index into queue[a] of the adapter's current batch
    last_step: dict[int, int] = {}
    left = sum(len(v) for v in remaining.values())
    bins: list[Bin] = []
    while left:
        i = len(bins)
        offered: dict[int, list[SampleRef]] = {}
        for a, keys in queue.items():
            if position[a] < len(keys) and (a not in last_step or i - last_step[a] >= num_stages):
                offered[a] = remaining[keys[position[a]]]
        if not offered:
            bins.append([])
            continue
        first = min(offered, key=lambda a: (rank[queue[a][position[a]]], a))
        must = decreasing_order(offered[first])[0]
        candidates = offered
        if staggered:
            earliest = rank[queue[first][position[first]]]
            candidates = {}
            for a, samples in offered.items():
                if rank[queue[a][position[a]]] == earliest:
                    candidates[a] = samples
                elif len(samples) > 1:
                    candidates[a] = decreasing_order(samples)[:-1]
        chosen = best_subset(candidates, capacity, pad_multiple, must)
        taken = {(s.adapter, s.batch, s.index) for s in chosen}
        for a in offered:
            key = queue[a][position[a]]
            remaining[key] = [s for s in remaining[key] if (s.adapter, s.batch, s.index) not in taken]
            if not remaining[key]:
                position[a] += 1
                last_step[a] = i
        left -= len(chosen)
        bins.append(chosen)
    return bins
