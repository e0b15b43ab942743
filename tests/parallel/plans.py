"""Plans for the parallel tests, built by hand: a tiny interleaving packer and lemma padding.

Independent of the real planner on purpose: the schedule builder must accept any valid Plan.
"""

from __future__ import annotations

import random

from lightning_lorafusion.planner.plan import Plan, PlannedMicrobatch, SampleRef


def make_plan(groups, *, capacity=1024, pad_multiple=16, num_stages=4) -> Plan:
    """``groups``: per microbatch a list of ``(adapter, batch, length)``; [] is a no-op slot."""
    counters: dict[tuple[int, int], int] = {}
    mbs = []
    for g in groups:
        refs = []
        for a, b, length in sorted(g):
            k = counters.get((a, b), 0)
            counters[(a, b)] = k + 1
            refs.append(SampleRef(a, b, k, length))
        mbs.append(PlannedMicrobatch(tuple(refs)))
    mbs = tuple(mbs)
    return Plan(
        capacity=capacity,
        pad_multiple=pad_multiple,
        num_stages=num_stages,
        microbatches=mbs,
        step_points=Plan.compute_step_points(mbs),
    )


def interleaved_groups(rng: random.Random, batches_per_adapter, mbs_per_batch, *, noop_p=0.0):
    """Microbatch groups that interleave adapters at random, each adapter's batches in order.

    ``mbs_per_batch[a][j]`` microbatches for adapter ``a``'s batch ``j``; with some chance two
    adjacent chunks of different adapters share one microbatch.
    """
    queues = {
        a: [(a, j) for j in range(n) for _ in range(mbs_per_batch[a][j])]
        for a, n in enumerate(batches_per_adapter)
    }
    groups = []
    while any(queues.values()):
        live = [a for a, q in queues.items() if q]
        a = rng.choice(live)
        a_, j = queues[a].pop(0)
        group = [(a_, j, rng.randint(8, 200))]
        others = [b for b in live if b != a and queues[b]]
        if others and rng.random() < 0.3:
            b = rng.choice(others)
            b_, k = queues[b].pop(0)
            group.append((b_, k, rng.randint(8, 200)))
        groups.append(group)
        if rng.random() < noop_p:
            groups.append([])
    return groups


def pad_for_lemma(groups, num_stages):
    """Insert no-op slots so every adapter's batch j+1 starts >= num_stages slots after j's last."""
    out = []
    last: dict[tuple[int, int], int] = {}
    remaining: dict[tuple[int, int], int] = {}
    for g in groups:
        for a, b, _ in g:
            remaining[(a, b)] = remaining.get((a, b), 0) + 1
    started: set[tuple[int, int]] = set()
    for g in groups:
        need = 0
        for a, b, _ in g:
            if (a, b) not in started and (a, b - 1) in last:
                need = max(need, last[(a, b - 1)] + num_stages - len(out))
        out.extend([] for _ in range(max(0, need)))
        for a, b, _ in g:
            started.add((a, b))
            remaining[(a, b)] -= 1
            if remaining[(a, b)] == 0:
                last[(a, b)] = len(out)
        out.append(g)
    return out


def lemma_gap_violations(plan: Plan, num_stages: int) -> list[tuple[int, int]]:
    """``(adapter, batch)`` pairs whose first slot is < num_stages after the previous batch's last."""
    first: dict[tuple[int, int], int] = {}
    last: dict[tuple[int, int], int] = {}
    for i, mb in enumerate(plan.microbatches):
        for s in mb.samples:
            first.setdefault((s.adapter, s.batch), i)
            last[(s.adapter, s.batch)] = i
    return sorted(
        (a, b) for (a, b), f in first.items() if (a, b - 1) in last and f - last[(a, b - 1)] < num_stages
    )
