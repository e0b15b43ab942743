"""Brute-force references for tiny packing instances (exhaustive over set partitions)."""

from __future__ import annotations

from lightning_lorafusion.planner.greedy import padded_load


def set_partitions(items):
    """Every partition of ``items`` into non-empty blocks (restricted growth strings)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first]] + part
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1 :]


def brute_force_packing(samples, capacity, pad_multiple):
    """(fewest bins, smallest possible padded load of the emptiest bin among fewest-bin packings)."""
    best = None
    for part in set_partitions(list(samples)):
        loads = [padded_load(b, pad_multiple) for b in part]
        if max(loads) > capacity:
            continue
        key = (len(part), min(loads))
        if best is None or key < best:
            best = key
    return best


def refs(lengths_by_adapter, batch=0):
    """SampleRefs of one global batch: ``lengths_by_adapter[a][i]`` is sample i of adapter a."""
    from lightning_lorafusion.planner.plan import SampleRef

    return [SampleRef(a, batch, i, n) for a, ls in enumerate(lengths_by_adapter) for i, n in enumerate(ls)]
