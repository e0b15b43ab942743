"""Test-wide setup: Triton kernels run in the interpreter when no GPU is present; the
``sync_guard`` fixture (no device->host syncs on the training forward); torch.compile caches
emptied per test module."""

import os
import threading

import pytest
import torch

# Must be set before any @triton.jit function is created (at import of the kernel modules).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Under pytest-xdist (`-n 2` on CI's two cores) each worker computes on one thread, so two
# workers do not oversubscribe the cores; subprocesses the tests start keep their own defaults.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


class _SyncGuard:
    """Within ``run()`` on this thread: ``nonzero`` raises, and varlen attention records the
    ``max_seqlen`` it is given. Other threads (the packing prefetcher) are unaffected."""

    def __init__(self, monkeypatch):
        from lightning_lorafusion.model import decoder as dec  # after TRITON_INTERPRET is set

        self.local = threading.local()
        self.max_seqlens: list = []
        nonzero, attention = torch.Tensor.nonzero, dec.varlen_causal_attention

        def guarded_nonzero(t, *args, **kwargs):
            if getattr(self.local, "on", False):
                raise AssertionError("nonzero() (a device->host sync) on the training forward")
            return nonzero(t, *args, **kwargs)

        def recording_attention(*args, max_seqlen=None, **kwargs):
            if getattr(self.local, "on", False):
                self.max_seqlens.append(max_seqlen)
            return attention(*args, max_seqlen=max_seqlen, **kwargs)

        monkeypatch.setattr(torch.Tensor, "nonzero", guarded_nonzero)
        monkeypatch.setattr(dec, "varlen_causal_attention", recording_attention)

    def run(self, fn, *args, **kwargs):
        self.local.on = True
        try:
            return fn(*args, **kwargs)
        finally:
            self.local.on = False


@pytest.fixture
def sync_guard(monkeypatch):
    """See ``_SyncGuard``: forbid nonzero() and record varlen attention's max_seqlen inside ``run``."""
    return _SyncGuard(monkeypatch)


@pytest.fixture(autouse=True, scope="module")
def _fresh_compile_caches():
    """Each test module starts with torch.compile's caches empty: the library compiles the same
    norm and activation functions at many shapes and dtypes across the suite, and Dynamo stops
    recompiling a function after ``recompile_limit`` variants in one process (a module's own
    compiles stay well under it)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
