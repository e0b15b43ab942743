"""Adapter grouping: head-tail pairing of long- and short-sequence adapters, checked against S.

Rule (documented in docs/planner.md):

1. Order adapters by mean sample length, longest first (ties: lower index first), and read
   that list head-tail: longest, shortest, second longest, second shortest, ...
2. For g = 1, 2, ..., A groups, deal adapters in head-tail order to the group with the
   fewest tokens per global batch so far (ties: lowest group). Long adapters thus share a
   group with short ones, so each group's wave of samples packs evenly.
3. Rounds run group after group: round r = batch r of group 0's adapters, then group 1's, ...
   Between two consecutive batches of an adapter lie the waves of every other group. A
   grouping is feasible if, in every round, those waves need at least S - 1 microbatches by
   a lower bound on their bin count (so any packing keeps S apart). With S = 1 every g is.
4. Among feasible groupings the planner keeps the one whose greedy+merge plan is shortest
   (ties: fewer groups), a cheap deterministic trial that replaces guessing how much
   mixing adapters buys against how much spacing the merge needs.
5. If no g works (e.g. one adapter, or S larger than the other groups can fill), fall back
   to singleton groups; the verifier then inserts no-op microbatches where needed.
"""

from __future__ import annotations

from typing import Callable

from .config import Lengths, PlannerConfig
from .greedy import bin_count_lower_bound
from .plan import SampleRef

Groups = tuple[tuple[int, ...], ...]


def head_tail_order(lengths: Lengths) -> list[int]:
    """Adapters as longest, shortest, second longest, second shortest, ... by mean sample length."""
    means = []
    for a, batches in enumerate(lengths):
        flat = [n for b in batches for n in b]
        means.append((-(sum(flat) / len(flat)) if flat else 0.0, a))
    by_length = [a for _, a in sorted(means)]
    order = []
    lo, hi = 0, len(by_length) - 1
    while lo <= hi:
        order.append(by_length[lo])
        if lo != hi:
            order.append(by_length[hi])
        lo, hi = lo + 1, hi - 1
    return order


def deal_groups(lengths: Lengths, num_groups: int) -> Groups:
    """Deal adapters in head-tail order to the group with the fewest tokens per batch so far."""
    tokens_per_batch = []
    for batches in lengths:
        tokens_per_batch.append(sum(sum(b) for b in batches) / max(len(batches), 1))
    members: list[list[int]] = [[] for _ in range(num_groups)]
    load = [0.0] * num_groups
    for a in head_tail_order(lengths):
        # Every group gets one adapter before any gets a second; then the lightest group.
        g = min(range(num_groups), key=lambda k: (len(members[k]) > 0, load[k], k))
        members[g].append(a)
        load[g] += tokens_per_batch[a]
    return tuple(tuple(sorted(m)) for m in members if m)


def wave_lower_bounds(lengths: Lengths, groups: Groups, config: PlannerConfig) -> list[list[int]]:
    """Lower bound on microbatches of each wave: ``bounds[r][g]`` for round r, group g."""
    rounds = max(len(b) for b in lengths)
    bounds = []
    for r in range(rounds):
        row = []
        for group in groups:
            samples = [
                SampleRef(a, r, i, n) for a in group if r < len(lengths[a]) for i, n in enumerate(lengths[a][r])
            ]
            row.append(bin_count_lower_bound(samples, config.capacity, config.pad_multiple) if samples else 0)
        bounds.append(row)
    return bounds


def groups_keep_stages_apart(lengths: Lengths, groups: Groups, config: PlannerConfig) -> bool:
    """True if, by lower bounds, every adapter's consecutive batches are >= S microbatches apart."""
    need = config.num_stages - 1
    if need == 0:
        return True
    bounds = wave_lower_bounds(lengths, groups, config)
    for g, group in enumerate(groups):
        for r in range(len(bounds) - 1):
            if not any(r + 1 < len(lengths[a]) for a in group):
                continue
            between = sum(bounds[r][k] for k in range(g + 1, len(groups)))
            between += sum(bounds[r + 1][k] for k in range(g))
            if between < need:
                return False
    return True


def feasible_groupings(lengths: Lengths, config: PlannerConfig) -> list[Groups]:
    """Every head-tail grouping (g = 1..A groups) that keeps batches S apart; singletons if none."""
    num_adapters = len(lengths)
    if not config.grouping:
        return [(tuple(range(num_adapters)),)]
    found = []
    for g in range(1, num_adapters + 1):
        groups = deal_groups(lengths, g)
        if groups not in found and groups_keep_stages_apart(lengths, groups, config):
            found.append(groups)
    return found or [tuple((a,) for a in head_tail_order(lengths))]


def group_adapters(lengths: Lengths, config: PlannerConfig, score: Callable[[Groups], int] | None = None) -> Groups:
    """The grouping to plan with: among ``feasible_groupings``, the one with the lowest
    ``score`` (the planner passes the length of the greedy+merge plan, which costs
    milliseconds); ties and ``score=None`` pick the fewest groups."""
    candidates = feasible_groupings(lengths, config)
    if score is None or len(candidates) == 1:
        return candidates[0]
    return min(candidates, key=lambda groups: (score(groups), len(groups)))
