"""What is live on the GPU at the peak of a piece of work, grouped by the Python line that
allocated it (torch.cuda.memory's allocation history).

``peak_report(fn)`` runs ``fn`` with the allocator's history on, replays the alloc / free events
to the moment the allocated bytes peak, and groups the blocks live then by the first frame in
this repository (``lightning_lorafusion/`` or ``scripts/``) that allocated them. Blocks allocated
before ``fn`` started (weights, optimizer state, saved tensors of earlier work) have no history:
they are one row, "before". CUDA-graph replays allocate nothing, so time eager variants.

Used by scripts/bench_e2e.py --memory-peak; ``live_at_peak`` (the replay) is tested on
synthetic events in tests/scripts/test_memory_peak.py.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Callable, Iterable, Mapping

import torch

OURS = ("lightning_lorafusion" + os.sep, "scripts" + os.sep)


def frame_label(frames: Iterable[Mapping]) -> str:
    """``file:line function`` of the innermost frame in this repository (else the innermost)."""
    frames = list(frames)
    for f in frames:
        name = f.get("filename", "")
        if any(tag in name for tag in OURS):
            return f"{os.path.basename(name)}:{f.get('line')} {f.get('name')}"
    if frames:
        f = frames[0]
        return f"{os.path.basename(f.get('filename', '?'))}:{f.get('line')} {f.get('name')}"
    return "?"


def live_at_peak(events: Iterable[Mapping], label: Callable[[Mapping], str] | None = None
                 ) -> tuple[int, dict[str, int], int]:
    """Replay ``alloc`` / ``free_completed`` events: (peak bytes above the start, bytes live at
    that moment per allocating frame, index of the peak event). Frees of blocks allocated before
    the history began lower the running total below the start; they count as "before" going
    down, so the peak is measured against the bytes live when recording began. ``label(event)``
    names a block (default: ``frame_label`` of its frames)."""
    label = label or (lambda e: frame_label(e.get("frames", ())))
    events = list(events)
    cur = peak = 0
    peak_at = -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            cur += e["size"]
            if cur > peak:
                peak, peak_at = cur, i
        elif e["action"] == "free_completed":
            cur -= e["size"]
    live: dict[int, tuple[int, str]] = {}
    freed_before = 0
    for e in events[:peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], label(e))
        elif e["action"] == "free_completed":
            if e["addr"] in live:
                del live[e["addr"]]
            else:
                freed_before += e["size"]
    by_frame: dict[str, int] = defaultdict(int)
    for size, name in live.values():
        by_frame[name] += size
    if freed_before:
        by_frame["(freed: allocated before the history)"] -= freed_before
    return peak, dict(by_frame), peak_at


def size_label(size: int) -> str:
    """A block's name when no frames are recorded: its size (the allocator rounds sizes up)."""
    return f"blocks of {size / 2**20:.2f} MiB"


def peak_report(fn: Callable[[], object], device: torch.device | None = None, top: int = 14,
                frames: bool = False) -> dict:
    """Run ``fn`` under the allocation history; the peak and what is live then (see module).
    ``frames=False`` (default) records no tracebacks and groups the live blocks by size: on torch
    2.11 / Python 3.12 recording Python frames made a backward through our autograd Functions
    fail (``SystemError: run_backward returned NULL``, H200, 2026-11-24). Leaves the
    allocator's peak statistics alone (callers read their own)."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    before_sizes: dict[str, int] = defaultdict(int)  # what is live already, by block size
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device") == (device.index if device.index is not None else torch.cuda.current_device()):
            for block in seg["blocks"]:
                if block["state"] == "active_allocated":
                    before_sizes[size_label(block["size"])] += block["size"]
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, context="alloc" if frames else None,
                                             stacks="python")
    try:
        fn()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    peak, by_frame, _ = live_at_peak(snap["device_traces"][index],
                                     None if frames else (lambda e: size_label(e["size"])))
    rows = sorted(by_frame.items(), key=lambda kv: -kv[1])
    return {"before_gib": before / 2**30, "peak_above_gib": peak / 2**30,
            "top": [(label, size / 2**30) for label, size in rows[:top]],
            "before_top": [(label, size / 2**30) for label, size in sorted(before_sizes.items(), key=lambda kv: -kv[1])[:top]],
            "rest_gib": sum(size for _, size in rows[top:]) / 2**30}


def format_report(label: str, rep: Mapping) -> str:
    total = rep["before_gib"] + rep["peak_above_gib"]
    lines = [f"--- memory peak: {label}: {total:.3f} GiB = {rep['before_gib']:.3f} live before + "
             f"{rep['peak_above_gib']:.3f} at the peak ---"]
    lines += [f"  {gib:8.3f} GiB  {name}" for name, gib in rep["top"]]
    lines.append(f"  {rep['rest_gib']:8.3f} GiB  (other frames)")
    if rep.get("before_top"):
        lines.append("  live before, by block size:")
        lines += [f"  {gib:8.3f} GiB  {name}" for name, gib in rep["before_top"]]
    return "\n".join(lines)
