"""Helpers around CUDA-graph capture shared by the engine's and the trainer's graphs.

A capture's fixed costs, not its kernels, decide how long a warm-up takes: the engine captures
L + 1 graphs per token bucket (480 at the 8B shape) and ``torch.cuda.graph`` pays per graph
a device synchronisation, ``empty_cache`` (device and pinned host: every cached block is handed
back, and the next eager run allocates it again) and, with ``gc_paused``, a full garbage
collection. ``capture_batch`` pays the collection and the cache release once for a run of
captures and ``graph_capture`` records one graph without them. ``pool_usage`` says what the
caching allocator holds per memory pool (the eager one and each graph pool);
``expandable_segments_by_default`` asks for the allocator's expandable segments.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator, MutableMapping

import torch

_batch = threading.local()
_lock = threading.Lock()
_paused = 0  # capture batches open in the process (gc is process-wide)
_gc_was_enabled = True


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect garbage, then keep Python's cyclic collector off until the block ends.

    A collection inside a capture may free objects that own CUDA resources (another engine's
    pinned host buffers and events, left in reference cycles): freeing pinned memory queries
    or synchronises events, which invalidates the capture ("operation failed due to a previous
    error during capture", seen on an H100 when an engine was built after others in one
    process). The Python that runs between a capture's kernels can trigger a collection before
    it ends. Inside ``capture_batch`` (same thread) it does not collect: the batch did."""
    if not getattr(_batch, "depth", 0):
        gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def capture_batch(device: torch.device | None = None) -> Iterator[None]:
    """A run of captures: garbage collected and the allocators' caches released once on entry
    (on a CUDA ``device``), the cyclic collector off until the outermost batch of the process
    ends. ``graph_capture`` and ``gc_paused`` inside it (same thread) skip their own collection."""
    global _paused, _gc_was_enabled
    depth = getattr(_batch, "depth", 0)
    if depth == 0:
        gc.collect()
        with _lock:
            if _paused == 0:
                _gc_was_enabled = gc.isenabled()
                gc.disable()
            _paused += 1
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
    _batch.depth = depth + 1
    try:
        yield
    finally:
        _batch.depth = depth
        if depth == 0:
            with _lock:
                _paused -= 1
                if _paused == 0 and _gc_was_enabled:
                    gc.enable()


_side_streams: dict[int, "torch.cuda.Stream"] = {}


@contextlib.contextmanager
def graph_capture(graph: "torch.cuda.CUDAGraph", *, pool=None, stream: "torch.cuda.Stream | None" = None,
                  device: torch.device | None = None) -> Iterator[None]:
    """Record the block into ``graph`` (thread-local capture mode: another thread of the process
    may use the GPU meanwhile) on ``stream`` (default: one side stream per device), in the
    memory ``pool`` (None: a new one). What ``torch.cuda.graph`` does, less its per-graph
    ``empty_cache`` and host cache release; the garbage collector is paused as in ``gc_paused``
    (collected on entry unless inside ``capture_batch``)."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    if stream is None:
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        stream = _side_streams.get(index)
        if stream is None:
            stream = _side_streams[index] = torch.cuda.Stream(device=index)
    with gc_paused():
        torch.cuda.synchronize(dev)
        with torch.cuda.stream(stream):
            graph.capture_begin(*(() if pool is None else (pool,)), capture_error_mode="thread_local")
            try:
                yield
            finally:
                graph.capture_end()


def pool_usage(segments: list[dict] | None = None, device: torch.device | None = None) -> dict[str, dict]:
    """GiB the caching allocator holds per memory pool on ``device`` (the current CUDA device
    when None): ``"eager"`` (pool id (0, 0)) and ``"graphs"`` (every private pool: graph pools
    and pools that eager warm-ups were routed to), each with ``reserved``, ``allocated``,
    ``largest_free`` (the largest free block: what one more allocation could take without a new
    segment), ``segments`` and ``expandable`` (segments that grow in place). ``segments``:
    ``torch.cuda.memory_snapshot()``'s list (read when None)."""
    if segments is None:
        segments = torch.cuda.memory_snapshot()
    index = None
    if segments and device is not None:
        index = device.index if device.index is not None else torch.cuda.current_device()
    gib = 2.0**30
    out: dict[str, dict] = {}
    for seg in segments:
        if index is not None and seg.get("device", index) != index:
            continue
        name = "eager" if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0) else "graphs"
        row = out.setdefault(name, {"reserved": 0.0, "allocated": 0.0, "largest_free": 0.0, "segments": 0,
                                    "expandable": 0})
        row["reserved"] += seg["total_size"] / gib
        row["allocated"] += seg["allocated_size"] / gib
        row["segments"] += 1
        row["expandable"] += int(bool(seg.get("is_expandable", False)))
        free = [b["size"] for b in seg.get("blocks", ()) if b.get("state") == "inactive"]
        row["largest_free"] = max(row["largest_free"], max(free, default=0) / gib)
    return {name: {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
            for name, row in out.items()}


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads either
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def expandable_segments_by_default(environ: MutableMapping[str, str]) -> bool:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in ``environ`` unless allocator
    options are set there already (the user's stay as they are); True when it set it. torch reads
    it once, at the process's first CUDA allocation, so ``fit`` calls this before that. Why: with
    segments that grow in place, ``empty_cache`` (before a batch of graph captures) hands back
    free pages anywhere, not only segments with nothing live left in them; without, the blocks
    freed while the base was loaded and quantized stay reserved around what lives on (1.3 GiB
    of the 8B NF4 base's run on an H100, beside the graphs' pool: docs/training.md)."""
    if any(environ.get(name) for name in ALLOC_CONF_VARS):
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    return True
