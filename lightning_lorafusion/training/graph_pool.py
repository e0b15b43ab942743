"""Where a training step's CUDA graphs allocate: torch's private calls that route one thread's
allocations to a graph memory pool (the warm-up runs before each capture allocate from the pool
the graphs will use), a way back to the ordinary allocator inside that routing (tables that
outlive the step), and handing cached blocks back to the device between captures."""

from __future__ import annotations

import contextlib
import functools

import torch


def release_cache(device: torch.device) -> None:
    """Hand the allocator's cached blocks back to the device once the work queued on it ended."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def _pool_calls(pool, device: torch.device):
    """torch's private calls that route a thread's allocations to a graph memory pool (what its
    own CUDA-graph trees use for their warm-ups) bound to ``pool`` on ``device``: (begin, end,
    release), each taking no argument; None when ``pool`` is None or torch lacks them."""
    names = ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool", "_cuda_releasePool")
    calls = [getattr(torch._C, n, None) for n in names]
    if pool is None or None in calls:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return tuple(functools.partial(call, index, pool) for call in calls)


@contextlib.contextmanager
def allocating_from(pool, device: torch.device):
    """Allocations of this thread come from the graphs' memory ``pool`` (no change when it is
    None or torch lacks the calls). A pool's freed blocks are reused only by the stream that freed
    them: enter this on the stream the graphs are captured on."""
    calls = _pool_calls(pool, device)
    if calls is None:
        yield
        return
    begin, end, release = calls
    begin()
    try:
        yield
    finally:
        end()
        release()


@contextlib.contextmanager
def outside_pool(pool, device: torch.device):
    """Inside ``allocating_from(pool)``: these allocations come from the ordinary allocator
    (tensors that outlive the step must not share memory with a graph's intermediates)."""
    calls = _pool_calls(pool, device)
    if calls is None:
        yield
        return
    begin, end, release = calls
    end()
    release()
    try:
        yield
    finally:
        begin()
