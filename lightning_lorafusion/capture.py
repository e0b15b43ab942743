"""Helpers around CUDA-graph capture shared by the engine's and the trainer's graphs."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect garbage, then keep Python's cyclic collector off until the block ends.

    A collection inside a capture may free objects that own CUDA resources (another engine's
    pinned host buffers and events, left in reference cycles): freeing pinned memory queries
    or synchronises events, which invalidates the capture ("operation failed due to a previous
    error during capture", seen on an H100 when an engine was built after others in one
    process). ``torch.cuda.graph`` collects once when it starts; the Python that runs between
    its kernels can trigger another collection before it ends."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
