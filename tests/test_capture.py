"""``capture.gc_paused`` and ``capture.capture_batch``: garbage collected on entry (once per batch),
the cyclic collector off inside (also when the block raises) and back to its former state after."""

from __future__ import annotations

import gc
import weakref

import pytest

from lightning_lorafusion.capture import gc_paused


class _Node:
    pass


def test_gc_paused_collects_first_then_holds_collection():
    a = _Node()
    a.self = a  # a reference cycle: only the cyclic collector frees it
    ref = weakref.ref(a)
    del a
    assert gc.isenabled()
    with gc_paused():
        assert ref() is None  # collected on entry
        assert not gc.isenabled()
        b = _Node()
        b.self = b
        ref_b = weakref.ref(b)
        del b
        # container objects kept alive: enough net allocations to trigger an automatic collection
        # (which would free b's cycle) were the collector on
        alive = [_Node() for _ in range(20000)]
        assert ref_b() is not None
        del alive
    assert gc.isenabled()
    gc.collect()
    assert ref_b() is None


def test_gc_paused_restores_the_state_on_errors_and_when_already_off():
    with pytest.raises(RuntimeError):
        with gc_paused():
            raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_capture_batch_collects_once_and_holds_the_collector_for_the_whole_batch():
    from lightning_lorafusion.capture import capture_batch

    a = _Node()
    a.self = a
    ref_a = weakref.ref(a)
    del a
    with capture_batch():
        assert ref_a() is None  # the batch collected on entry
        assert not gc.isenabled()
        b = _Node()
        b.self = b
        ref_b = weakref.ref(b)
        del b
        with gc_paused():  # a capture inside the batch: no collection of its own
            assert ref_b() is not None
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block does not turn the collector back on
        with capture_batch():  # nested batches neither collect nor re-enable
            assert ref_b() is not None
        assert not gc.isenabled()
        assert ref_b() is not None
    assert gc.isenabled()
    gc.collect()
    assert ref_b() is None


def test_capture_batch_restores_the_collector_on_errors_and_when_already_off():
    from lightning_lorafusion.capture import capture_batch

    with pytest.raises(RuntimeError):
        with capture_batch():
            raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with capture_batch():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
