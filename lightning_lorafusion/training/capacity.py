"""Token-capacity profiler: ``data.capacity: auto``.

The microbatch token capacity C trades three things: larger microbatches run bigger, more
efficient GEMMs; they need more activation memory; and the planner fills them differently
(fill = real tokens / C depends on how the run's sample lengths pack into C). The profiler
measures, on the actual device and model, for each candidate C:

- ``fill``: the planned fill of the first epoch's real samples at C (greedy plan, which is
  fast; the MILP planner's fill is higher but ranks candidates the same way);
- ``seconds``: mean wall time of forward + backward (no optimizer step) over a few real
  packed microbatches at C, after one untimed pass over the same microbatches (kernel
  compilation and autotuning happen there, also for each microbatch's own specialisations);
- ``peak``: peak allocated device memory during those calls (CUDA only).

and picks the candidate with the most real tokens per second, ``fill * C / seconds``, among
those whose peak stays within ``memory_fraction`` of the device's memory. Candidates are tried
in increasing order; the first that runs out of memory (or exceeds the limit) ends the sweep,
since memory grows with C. On CPU no memory is measured and the choice is by speed alone.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..data.microbatch import Microbatch
from ..data.packing import PackingConfig, pack_microbatch
from ..parallel.stage import adapter_loss
from ..planner.plan import padded_length
from ..specs import ConfigError
from .epoch_planning import plan_fill

log = logging.getLogger(__name__)

DEFAULT_CANDIDATES = (1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class CapacityProbe:
    """One candidate capacity as measured."""

    capacity: int
    fill: float
    seconds: float | None = None  # mean forward+backward time of one microbatch
    peak_bytes: int | None = None
    rejected: str | None = None  # why the candidate cannot be used (None: usable)

    @property
    def usable(self) -> bool:
        return self.rejected is None and self.seconds is not None

    @property
    def real_tokens_per_s(self) -> float:
        return self.fill * self.capacity / self.seconds if self.usable else 0.0


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def time_step(
    step: Callable[[Any], None],
    microbatches: Sequence[Any],
    device: torch.device,
    *,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, int | None]:
    """Mean seconds of ``step(mb)`` over ``microbatches`` after ``warmup`` untimed passes over
    them, and the peak allocated CUDA memory during all of them (None off CUDA)."""
    if not microbatches:
        raise ValueError("no microbatches to time")
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):  # every microbatch once: its kernel specialisations compile here
        for mb in microbatches:
            step(mb)
    sync()
    start = clock()
    for mb in microbatches:
        step(mb)
    sync()
    seconds = (clock() - start) / len(microbatches)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    return seconds, peak


def probe_capacities(
    candidates: Sequence[int],
    prepare: Callable[[int], tuple[float, Sequence[Any]]],
    step: Callable[[Any], None],
    device: torch.device,
    *,
    memory_limit: int | None = None,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> list[CapacityProbe]:
    """Measure each candidate (ascending). ``prepare(C)`` returns ``(fill, microbatches)`` of
    real data packed at capacity C; ``step(mb)`` runs forward and backward on one."""
    probes: list[CapacityProbe] = []
    stop: str | None = None
    for capacity in sorted(set(int(c) for c in candidates)):
        fill, mbs = prepare(capacity)
        if stop is not None:
            probes.append(CapacityProbe(capacity, fill, rejected=f"not tried ({stop})"))
            continue
        try:
            seconds, peak = time_step(step, mbs, device, warmup=warmup, clock=clock)
        except Exception as exc:  # noqa: BLE001 - only out-of-memory is expected, re-raised otherwise
            if not _is_oom(exc):
                raise
            if device.type == "cuda":
                torch.cuda.empty_cache()
            stop = f"{capacity} ran out of memory"
            probes.append(CapacityProbe(capacity, fill, rejected="out of memory"))
            continue
        if memory_limit is not None and peak is not None and peak > memory_limit:
            stop = f"{capacity} exceeded the memory limit"
            probes.append(
                CapacityProbe(capacity, fill, seconds, peak,
                              rejected=f"peak {peak / 2**30:.1f} GiB > limit {memory_limit / 2**30:.1f} GiB")
            )
            continue
        probes.append(CapacityProbe(capacity, fill, seconds, peak))
    return probes


def choose_capacity(probes: Sequence[CapacityProbe]) -> CapacityProbe:
    """The usable probe with the most real tokens per second (ties: the smaller capacity)."""
    usable = [p for p in probes if p.usable]
    if not usable:
        detail = "; ".join(f"{p.capacity}: {p.rejected}" for p in probes) or "no candidates"
        raise ConfigError(
            f"data.capacity=auto: no candidate capacity fits ({detail}); pass smaller "
            "data.capacity_candidates, enable activation checkpointing, or set data.capacity"
        )
    return max(usable, key=lambda p: (p.real_tokens_per_s, -p.capacity))


def format_probes(probes: Sequence[CapacityProbe], chosen: CapacityProbe | None = None) -> str:
    lines = ["capacity   fill   ms/microbatch   real tok/s   peak GiB   note"]
    for p in probes:
        ms = f"{1e3 * p.seconds:13.1f}" if p.seconds is not None else f"{'-':>13}"
        peak = f"{p.peak_bytes / 2**30:8.1f}" if p.peak_bytes is not None else f"{'-':>8}"
        note = p.rejected or ("chosen" if chosen is not None and p.capacity == chosen.capacity else "")
        lines.append(
            f"{p.capacity:8d}  {100 * p.fill:5.1f}%  {ms}   {p.real_tokens_per_s:10.0f}   {peak}   {note}"
        )
    return "\n".join(lines)


def device_memory_limit(device: torch.device, fraction: float) -> int | None:
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory * fraction)


def profile_capacity(dm: Any, module: Any, probe_microbatches: int = 2) -> int:
    """Profile ``dm.capacity_candidates`` with ``module`` on its device and return the chosen
    capacity: ``probe_microbatches`` of the fullest planned microbatches of epoch 0 each."""
    pad = dm.packing.pad_multiple
    longest = max(padded_length(len(s.input_ids), pad) for d in dm.datasets for s in d)
    candidates = [c for c in dm.capacity_candidates if c >= longest]
    if not candidates:
        raise ConfigError(
            f"data.capacity=auto: every candidate in {dm.capacity_candidates} is below the "
            f"longest sample ({longest} tokens after padding); add larger "
            "data.capacity_candidates or set data.max_length"
        )
    lookup = dm._lookup(0)
    lengths, denominators = lookup.lengths(), lookup.denominators()
    device = module.device

    def prepare(capacity: int):
        plan = dm._plan(0, lengths, capacity, "greedy")
        config = PackingConfig(capacity=capacity, pad_multiple=pad, pad_token_id=dm.packing.pad_token_id)
        real = [(mb.real_tokens(), pos) for pos, mb in enumerate(plan.microbatches) if not mb.is_noop]
        fullest = sorted(real, key=lambda t: (-t[0], t[1]))[:probe_microbatches]
        mbs = [
            pack_microbatch(
                plan.microbatches[pos], lookup, config=config, num_adapters=len(dm.specs),
                denominators=denominators, step_adapters=(), index=pos,
            ).to(device)
            for _, pos in fullest
        ]
        return plan_fill(plan, capacity), mbs

    params = [p for p in module.parameters() if p.requires_grad]
    precision = dm.trainer.precision_plugin if dm.trainer is not None else None

    def step(mb: Microbatch) -> None:
        with precision.forward_context() if precision is not None else contextlib.nullcontext():
            loss = adapter_loss(module.loss_sums(mb), mb.loss_denominators)
        loss.backward()
        for p in params:
            p.grad = None

    probes = probe_capacities(
        candidates, prepare, step, device,
        memory_limit=device_memory_limit(device, dm.capacity_memory_fraction),
    )
    chosen = choose_capacity(probes)
    log.info(
        "data.capacity=auto on %s (%s):\n%s", device,
        "by speed; memory not measured off CUDA" if device.type != "cuda" else
        f"memory limit {100 * dm.capacity_memory_fraction:.0f}% of the device",
        format_probes(probes, chosen),
    )
    return chosen.capacity
