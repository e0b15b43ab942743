"""Which CUDA-graph shape keys to capture for an epoch: covers and the epoch's capture set.

A graph captured for key ``K`` replays any microbatch whose key ``k`` it covers (same capacity,
every bucket of ``K`` at least as large as ``k``'s: ``training/cuda_graphs.py``). When an epoch's
plan is known, ``plan_captures`` picks a few keys that cover every planned key, so the graphs can
be captured before the epoch's first step instead of one by one in the middle of it. Pure
functions over ``GraphKey`` values: no device, no torch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping

DEFAULT_PRECAPTURE = 4  # keys captured up front per epoch at most (each costs ~1-1.6 s on the 8B shape)


@dataclass(frozen=True)
class GraphKey:
    """What a captured step's launches depend on, bucketed (``cuda_graphs.graph_key``)."""

    capacity: int
    max_seqlen: int
    num_blocks: int
    label_rows: int


def replay_cost(key: GraphKey) -> tuple[int, int, int]:
    """Sort order of keys by what a replay costs: the LM head's rows cost the most, then
    attention's launch width, then empty attention blocks."""
    return key.label_rows, key.max_seqlen, key.num_blocks


def covers(big: GraphKey, small: GraphKey) -> bool:
    """Whether ``big``'s graph runs a ``small`` microbatch exactly (the static buffers pad with
    empty attention blocks and label rows without a label)."""
    return (big.capacity == small.capacity and big.max_seqlen >= small.max_seqlen
            and big.num_blocks >= small.num_blocks and big.label_rows >= small.label_rows)


def cheapest_cover(key: GraphKey, keys: Iterable[GraphKey]) -> GraphKey | None:
    """The cheapest of ``keys`` (``replay_cost``) that covers ``key``, or None."""
    return min((k for k in keys if covers(k, key)), key=replay_cost, default=None)


def join(keys: Iterable[GraphKey]) -> GraphKey:
    """The smallest key covering every one of ``keys`` (one capacity)."""
    keys = list(keys)
    if not keys or len({k.capacity for k in keys}) != 1:
        raise ValueError(f"join needs keys of one capacity, got {sorted({k.capacity for k in keys})}")
    return GraphKey(capacity=keys[0].capacity, max_seqlen=max(k.max_seqlen for k in keys),
                    num_blocks=max(k.num_blocks for k in keys), label_rows=max(k.label_rows for k in keys))


def plan_captures(planned: Iterable[GraphKey] | Mapping[GraphKey, int], captured: Iterable[GraphKey], *,
                  limit: int = DEFAULT_PRECAPTURE) -> list[GraphKey]:
    """Keys to capture so that every ``planned`` key (a mapping: with its number of microbatches)
    has a cover among ``captured`` and the result; at most ``limit`` keys.

    Greedy set cover over the planned keys that no captured graph covers: take the planned key
    that covers the most uncovered microbatches, the cheapest (``replay_cost``) of those that
    tie, until all are covered. When that would take more than ``limit`` keys, the last ones are
    the ``join`` of what is left per capacity (keys no microbatch has, but covering all of it).
    When some key needed a cover (a capture batch happens anyway), keys left in the budget then
    go to the planned keys whose own graph saves the most LM-head rows over the epoch
    (``padded_rows_saved``: a covered microbatch computes its cover's label rows), as long as
    one saves any; an epoch whose keys are all covered captures nothing (no capture batch only
    to save rows). Deterministic: every data-parallel replica given the same keys picks the
    same ones.
    """
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ValueError(f"limit={limit!r} must be an int >= 0")
    uses = Counter(planned) if not isinstance(planned, Mapping) else Counter(dict(planned))
    held = list(captured)
    todo = {k: n for k, n in uses.items() if cheapest_cover(k, held) is None}
    chosen: list[GraphKey] = []
    while todo and len(chosen) < limit:
        capacities = sorted({k.capacity for k in todo})
        if len(chosen) + len(capacities) >= limit:  # the budget's end: one join per capacity
            for cap in capacities[: limit - len(chosen)]:
                chosen.append(join(k for k in todo if k.capacity == cap))
            break
        best = min(todo, key=lambda c: (-sum(n for k, n in todo.items() if covers(c, k)), replay_cost(c),
                                        c.capacity))
        chosen.append(best)
        todo = {k: n for k, n in todo.items() if not covers(best, k)}
    while chosen and len(chosen) < limit:
        held_now = held + chosen
        gains = {c: padded_rows_saved(c, uses, held_now) for c in uses if c not in held_now}
        best = min(gains, key=lambda c: (-gains[c], replay_cost(c), c.capacity), default=None)
        if best is None or gains[best] <= 0:
            break
        chosen.append(best)
    return chosen


def padded_rows_saved(candidate: GraphKey, uses: Mapping[GraphKey, int], held: Iterable[GraphKey]) -> int:
    """LM-head rows an epoch of ``uses`` (planned keys with their microbatches) computes for
    nothing less if ``candidate`` is captured besides ``held``: over each key ``candidate``
    covers, its microbatches times the label rows by which ``candidate`` undercuts the key's
    cheapest held cover (uncovered keys count as gaining nothing)."""
    held = list(held)
    saved = 0
    for key, n in uses.items():
        if not covers(candidate, key):
            continue
        cover = cheapest_cover(key, held)
        if cover is not None and cover.label_rows > candidate.label_rows:
            saved += n * (cover.label_rows - candidate.label_rows)
    return saved
