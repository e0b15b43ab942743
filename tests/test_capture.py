"""``capture.gc_paused``: garbage collected on entry, the cyclic collector off inside (also when
the block raises) and back to its former state after."""

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
