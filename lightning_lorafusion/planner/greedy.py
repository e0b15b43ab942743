"""Greedy first-fit-decreasing bin packing with per-adapter padded accounting."""

from __future__ import annotations

from typing import Sequence

from .plan import SampleRef, padded_length

Bin = list[SampleRef]


def padded_load(samples: Sequence[SampleRef], pad_multiple: int) -> int:
    """Tokens a set of samples occupies once each adapter's segment is padded."""
    per_adapter: dict[int, int] = {}
    for s in samples:
        per_adapter[s.adapter] = per_adapter.get(s.adapter, 0) + s.length
    return sum(padded_length(t, pad_multiple) for t in per_adapter.values())


def decreasing_order(samples: Sequence[SampleRef]) -> list[SampleRef]:
    """Longest first; ties broken by (adapter, batch, index) so the order is deterministic."""
    return sorted(samples, key=lambda s: (-s.length, s.adapter, s.batch, s.index))


def pack_first_fit_decreasing(samples: Sequence[SampleRef], capacity: int, pad_multiple: int) -> list[Bin]:
    """Pack samples into the fewest bins first-fit decreasing finds; bins in opening order.

    A sample goes into the first open bin where the bin's padded load (sum over adapters of
    that adapter's tokens padded to ``pad_multiple``) stays within ``capacity``.
    """
    bins: list[Bin] = []
    adapter_tokens: list[dict[int, int]] = []
    loads: list[int] = []
    for s in decreasing_order(samples):
        placed = False
        for b, per in enumerate(adapter_tokens):
            old = per.get(s.adapter, 0)
            grow = padded_length(old + s.length, pad_multiple) - padded_length(old, pad_multiple)
            if loads[b] + grow <= capacity:
                bins[b].append(s)
                per[s.adapter] = old + s.length
                loads[b] += grow
                placed = True
                break
        if not placed:
            need = padded_length(s.length, pad_multiple)
            assert need <= capacity, "validate_lengths must reject samples longer than capacity"
            bins.append([s])
            adapter_tokens.append({s.adapter: s.length})
            loads.append(need)
    return bins


def emptiest_last(bins: Sequence[Bin], pad_multiple: int) -> list[Bin]:
    """Bins fullest first (stable): a wave ends in its emptiest microbatch, where the
    cross-batch merge has room for the next wave's samples."""
    return sorted((list(b) for b in bins), key=lambda c: -padded_load(c, pad_multiple))


def bin_count_lower_bound(samples: Sequence[SampleRef], capacity: int, pad_multiple: int) -> int:
    """A lower bound on the number of bins of any packing.

    Two bounds: total padded tokens (padding is subadditive, so padding each adapter's total
    once underestimates any split) over capacity, and the number of samples that pairwise
    cannot share a bin (each has more than half the capacity in real tokens).
    """
    if not samples:
        return 0
    by_volume = -(-padded_load(samples, pad_multiple) // capacity)
    big = sum(1 for s in samples if 2 * s.length > capacity)
    return max(by_volume, big, 1)
