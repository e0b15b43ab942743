"""Two-stage MILP packing of one wave with python-mip: fewest microbatches, then emptiest tail.

Stage 1 minimises the number of microbatches. Stage 2 fixes that number K and minimises the
padded tokens of microbatch K-1 (by symmetry, the smallest microbatch), so the wave ends in
a nearly empty microbatch that the cross-batch merge can fill with the next wave's samples.
Both stages are warm-started from the best packing known so far (greedy first) and their
result is used only when it is proven optimal within ``max_nodes`` branch-and-bound nodes
and strictly better: a deterministic rule, so plans do not depend on machine speed.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from typing import Sequence

from .greedy import Bin, bin_count_lower_bound, emptiest_last, padded_load
from .plan import SampleRef


def solver_name(choice: str) -> str:
    """python-mip solver name: HiGHS if chosen (or "auto" and highspy is installed), else CBC."""
    import mip

    if choice == "cbc":
        return mip.CBC
    if choice == "highs" or importlib.util.find_spec("highspy") is not None:
        return mip.HIGHS
    return mip.CBC


@dataclass(frozen=True, kw_only=True)
class MilpOutcome:
    """Result of packing one wave with the MILP; ``bins`` is the packing to use."""

    bins: list[Bin]
    stage1_status: str  # "skipped" (greedy already at the lower bound) or a mip status name
    stage2_status: str
    fewer_bins: bool  # stage 1 beat greedy
    smaller_tail: bool  # stage 2 shrank the smallest microbatch
    seconds: float


def _new_model(name: str, seed: int):
    import mip

    model = mip.Model(sense=mip.MINIMIZE, solver_name=name)
    model.verbose = 0
    model.threads = 1  # deterministic search
    model.seed = seed
    return model


def _assignment_vars(model, samples: Sequence[SampleRef], num_bins: int, capacity: int, pad_multiple: int):
    """x[i][b] (sample i in bin b) and padded-load expressions per bin, with coverage and padding rows."""
    import mip

    adapters = sorted({s.adapter for s in samples})
    x = [[model.add_var(var_type=mip.BINARY) for _ in range(num_bins)] for _ in samples]
    for i in range(len(samples)):
        model += mip.xsum(x[i]) == 1
    loads = []
    blocks = {}
    for b in range(num_bins):
        load = []
        for a in adapters:
            members = [i for i, s in enumerate(samples) if s.adapter == a]
            q = model.add_var(var_type=mip.INTEGER, lb=0, ub=capacity // pad_multiple)
            blocks[(a, b)] = q
            model += pad_multiple * q >= mip.xsum(samples[i].length * x[i][b] for i in members)
            load.append(pad_multiple * q)
        loads.append(mip.xsum(load))
    return x, blocks, loads


def _start(x, blocks, samples: Sequence[SampleRef], bins: Sequence[Bin], pad_multiple: int):
    where = {(s.adapter, s.batch, s.index): b for b, content in enumerate(bins) for s in content}
    start = []
    for i, s in enumerate(samples):
        for b in range(len(x[i])):
            start.append((x[i][b], 1.0 if where[(s.adapter, s.batch, s.index)] == b else 0.0))
    for (a, b), q in blocks.items():
        tokens = sum(s.length for s in bins[b] if s.adapter == a) if b < len(bins) else 0
        start.append((q, float(-(-tokens // pad_multiple))))
    return start


def _read_bins(x, samples: Sequence[SampleRef], num_bins: int) -> list[Bin]:
    bins: list[Bin] = [[] for _ in range(num_bins)]
    for i, s in enumerate(samples):
        b = max(range(num_bins), key=lambda k: x[i][k].x)
        bins[b].append(s)
    return [content for content in bins if content]


def _split(bins: list[Bin], neighbourhood: int) -> tuple[list[Bin], list[Bin]]:
    """(fuller microbatches kept as they are, the ``neighbourhood`` emptiest to re-pack)."""
    cut = max(len(bins) - neighbourhood, 0)
    return bins[:cut], bins[cut:]


def _tail_lower_bound(samples: Sequence[SampleRef], num_bins: int, capacity: int, pad_multiple: int) -> int:
    """The smallest microbatch holds at least what the other ``num_bins - 1`` cannot, and (as
    stage 2 keeps every microbatch non-empty) at least one sample."""
    spill = sum(s.length for s in samples) - (num_bins - 1) * capacity
    smallest = min(s.length for s in samples)
    return max(-(-spill // pad_multiple) * pad_multiple, -(-smallest // pad_multiple) * pad_multiple, 0)


def pack_milp(
    samples: Sequence[SampleRef],
    *,
    capacity: int,
    pad_multiple: int,
    greedy_bins: list[Bin],
    lower_bound: int,
    time_limit: float,
    max_nodes: int,
    solver: str = "auto",
    seed: int = 0,
    neighbourhood: int = 3,
    tail_stage: bool = True,
) -> MilpOutcome:
    """Two-stage MILP packing of ``samples``, never worse than ``greedy_bins``.

    Each stage re-packs the samples of the ``neighbourhood`` emptiest microbatches of the best
    packing so far (all of them when there are no more); the fuller microbatches stay as
    they are. This keeps every solve small enough to be proven optimal in well under a
    second, which is what makes the deterministic acceptance rule useful.
    """
    import mip

    t0 = time.perf_counter()
    name = solver_name(solver)
    best = emptiest_last([list(c) for c in greedy_bins], pad_multiple)
    stage1, fewer = "skipped", False
    keep, free = _split(best, neighbourhood)
    samples = [s for c in free for s in c]
    local_bound = bin_count_lower_bound(samples, capacity, pad_multiple)
    if len(best) > lower_bound and len(free) > local_bound:
        model = _new_model(name, seed)
        n_bins = len(free)
        x, blocks, loads = _assignment_vars(model, samples, n_bins, capacity, pad_multiple)
        used = [model.add_var(var_type=mip.BINARY) for _ in range(n_bins)]
        for b in range(n_bins):
            model += loads[b] <= capacity * used[b]
            if b + 1 < n_bins:
                model += used[b] >= used[b + 1]  # symmetry: used bins come first
        longest = min(range(len(samples)), key=lambda i: (-samples[i].length, i))
        model += x[longest][0] == 1
        model += mip.xsum(used) >= local_bound
        model.objective = mip.minimize(mip.xsum(used))
        start = _start(x, blocks, samples, free, pad_multiple)
        start += [(used[b], 1.0) for b in range(n_bins)]
        model.start = start
        status = model.optimize(max_seconds=time_limit, max_nodes=max_nodes)
        stage1 = status.name
        if status == mip.OptimizationStatus.OPTIMAL:
            found = _read_bins(x, samples, n_bins)
            if len(found) < len(free):
                best, fewer = emptiest_last(keep + found, pad_multiple), True
    stage2, smaller = "skipped", False
    if tail_stage and len(best) > 1:
        keep, free = _split(best, neighbourhood)
        samples = [s for c in free for s in c]
        k = len(free)
        model = _new_model(name, seed)
        x, blocks, loads = _assignment_vars(model, samples, k, capacity, pad_multiple)
        for b in range(k):
            model += loads[b] <= capacity
        model.objective = mip.minimize(loads[k - 1])
        model += loads[k - 1] >= _tail_lower_bound(samples, k, capacity, pad_multiple)
        model.start = _start(x, blocks, samples, free, pad_multiple)
        status = model.optimize(max_seconds=time_limit, max_nodes=max_nodes)
        stage2 = status.name
        if status == mip.OptimizationStatus.OPTIMAL:
            found = _read_bins(x, samples, k)
            tail = min(padded_load(c, pad_multiple) for c in found)
            if len(found) < k or tail < padded_load(best[-1], pad_multiple):
                best, smaller = emptiest_last(keep + found, pad_multiple), True
    return MilpOutcome(
        bins=best,
        stage1_status=stage1,
        stage2_status=stage2,
        fewer_bins=fewer,
        smaller_tail=smaller,
        seconds=time.perf_counter() - t0,
    )
