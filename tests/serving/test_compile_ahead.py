"""Kernel variants compiled ahead and concurrently (serving/compile_ahead.py, ``warm_up_variants``).

On the CPU nothing compiles: the Triton kernels run in the interpreter. What a GPU would compile
is read from the launches themselves: a pre-run hook on every kernel of the package (Triton's
public ``add_pre_run_hook``) records each launch's kernel, constexprs and options, and what the
JIT specialises its other arguments on (dtype; an int's "== 1" and "divisible by 16", unless the
kernel declares it ``do_not_specialize``). Each distinct record is one compiled variant.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import types

import pytest
import torch

from lightning_lorafusion.serving import compile_ahead
from lightning_lorafusion.serving.compile_ahead import KernelVariant, compile_variants, record_launches
from lightning_lorafusion.serving.warm_up import warm_up_variants

from test_cold_start import make_ranked_engine

EIGHT_RANKS = [4, 8, 16, 24, 32, 64, 96, 128]
# Triton kernels in the interpreter, pieces run eagerly; a step budget of 16 tokens (5 token
# buckets) keeps the interpreter's work small
TRITON = dict(backend="triton", mixed_graphs="eager", max_num_batched_tokens=16)
# the same with the decode rows' kernels as torch references outside the pieces (the requests'
# decode-only steps), where a whole warm-up runs
TRITON_PREFILL = dict(TRITON, decode_backend="torch")


def _package_kernels() -> list:
    """Every Triton kernel object of the package's kernel modules imported so far."""
    import lightning_lorafusion.kernels  # noqa: F401

    found = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("lightning_lorafusion.kernels.") and module is not None:
            for obj in vars(module).values():
                if hasattr(obj, "add_pre_run_hook") and hasattr(obj, "arg_names"):
                    found[id(obj)] = obj
    return list(found.values())


def _specialisation(value):
    if isinstance(value, torch.Tensor):
        return str(value.dtype)
    if isinstance(value, bool) or not isinstance(value, int):
        return repr(value)
    return (value == 1, value % 16 == 0)


@contextlib.contextmanager
def interpreter_launches():
    """Like ``compile_ahead.record_launches``, for the interpreter: yields the list of variants
    (one ``KernelVariant`` per launch; repeats included) of the launches made in the block. The
    launches still run."""
    found: list[KernelVariant] = []
    hooks = []
    for kernel in _package_kernels():
        skip = set(getattr(kernel, "kwargs", {}).get("do_not_specialize") or ())
        name = f"{kernel.fn.__module__}:{kernel.fn.__qualname__}"

        def hook(*args, _kernel=kernel, _skip=skip, _name=name, **kwargs):
            spec = [_specialisation(v) for n, v in zip(_kernel.arg_names, args) if n not in _skip]
            data = json.dumps([spec, sorted((k, repr(v)) for k, v in kwargs.items())])
            found.append(KernelVariant(_name, data, _kernel))

        kernel.add_pre_run_hook(hook)
        hooks.append((kernel, hook))
    try:
        yield found
    finally:
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)


def test_warm_up_variant_set_does_not_grow_with_the_number_of_ranks(make_engine, monkeypatch):
    """``warm_up_variants`` of an engine holding one adapter of rank 8 and of one holding eight
    ranks 4..128: the same set (not empty: every LoRA kernel of the pieces is in it)."""
    monkeypatch.setattr(compile_ahead, "record_launches", interpreter_launches)
    sets = []
    for ranks in ([8], EIGHT_RANKS):
        engine = make_ranked_engine(make_engine, ranks, **TRITON)
        sets.append(frozenset(warm_up_variants(engine)))
    assert sets[0] == sets[1]
    names = {v.name.rsplit(":", 1)[1] for v in sets[0]}
    # (the pieces' prefill LoRA: the split-K shrink, the engine's default form, then the row tiles'
    # expand on the live grids: ``ModelRunner.prefill_lora_form``, ``ModelRunner.live_grids``)
    assert {"_splitk_shrink_kernel", "_live_expand_kernel", "_lora_shrink_kernel", "_swiglu_kernel",
            "_rope_kv_kernel"} <= names


def test_everything_warm_up_launches_is_the_same_for_one_rank_and_eight(make_engine):
    """The whole warm-up (compiles ahead, pieces, synthetic requests through the base and an
    adapter) launches the same kernel variants and as many requests whether one rank or eight
    are loaded: nothing in it is per rank."""
    launched, reports = [], []
    for ranks in ([8], EIGHT_RANKS):
        engine = make_ranked_engine(make_engine, ranks, **TRITON_PREFILL)
        with interpreter_launches() as found:
            reports.append(engine.warm_up(prompt_len=3, max_new_tokens=2))
        launched.append(frozenset(found))
    assert launched[0] == launched[1] and launched[0]
    assert (reports[0]["requests"], reports[0]["rounds"]) == (reports[1]["requests"], reports[1]["rounds"]) == (8, 4)
    assert reports[1]["ranks"] == EIGHT_RANKS


def test_warm_up_compiles_the_listed_variants_concurrently(make_engine, monkeypatch):
    """``warm_up`` hands every variant of ``warm_up_variants`` to the compile function once, from
    the thread pool, before it builds the pieces; its report counts them."""
    monkeypatch.setattr(compile_ahead, "record_launches", interpreter_launches)
    engine = make_ranked_engine(make_engine, [4, 64], **TRITON_PREFILL)
    expected = warm_up_variants(engine)
    calls: list[tuple[KernelVariant, str]] = []
    lock = threading.Lock()
    built_before = []

    def fake_compile(variant, device):
        with lock:
            calls.append((variant, threading.current_thread().name))
            built_before.append(len(engine.runner._mixed))

    monkeypatch.setattr(compile_ahead, "compile_variant", fake_compile)
    report = engine.warm_up(prompt_len=3, max_new_tokens=2)
    compiled = [v for v, _ in calls]
    assert len(compiled) == len(set(compiled)) == len(expected) > 1
    assert set(compiled) == set(expected)
    assert all(name.startswith("triton-compile") for _, name in calls)
    assert set(built_before) == {0}  # compiled before any piece was built
    ahead = report["compile_ahead"]
    assert ahead["variants"] == len(expected) and ahead["failed"] == 0 and ahead["workers"] >= 1


def test_record_launches_skips_uncompiled_launches_and_restores_the_hook(monkeypatch):
    """With Triton's runtime knobs: inside the block the cache hook records this thread's
    variant and answers True (skip compile and launch); a launch without specialisation data,
    or from another thread, compiles as usual (the hook it replaced is asked); that hook comes
    back after. Without knobs nothing is recorded."""
    asked = []

    def previous(**kwargs):
        asked.append(kwargs["key"])
        return False

    runtime = types.SimpleNamespace(jit_cache_hook=previous)
    monkeypatch.setattr(compile_ahead, "_runtime_knobs", lambda: runtime)
    kernel = object()
    fn = types.SimpleNamespace(module="m", name="k", jit_function=kernel)

    def launch(key, data):
        compile = {} if data is None else {"specialization_data": data}
        return runtime.jit_cache_hook(key=key, repr="", fn=fn, compile=compile, is_manual_warmup=False,
                                      already_compiled=False)

    with record_launches() as found:
        assert launch(1, "{}") is True
        assert launch(2, None) is False
        other = []
        thread = threading.Thread(target=lambda: other.append(launch(3, "{}")))
        thread.start()
        thread.join()
        assert other == [False]
    assert found == [KernelVariant("m:k", "{}", kernel)] and found[0].kernel is kernel
    assert asked == [2, 3] and runtime.jit_cache_hook is previous
    monkeypatch.setattr(compile_ahead, "_runtime_knobs", lambda: None)
    with record_launches() as found:
        pass
    assert found == []


def test_compile_variants_counts_failures_and_drops_repeats(monkeypatch):
    """Repeats (a kernel recorded once per layer) compile once; a variant that fails is counted
    and logged, not raised (its first launch compiles it again and raises there)."""
    seen = []

    def fake_compile(variant, device):
        seen.append(variant.data)
        if variant.data == "bad":
            raise RuntimeError("no")

    monkeypatch.setattr(compile_ahead, "compile_variant", fake_compile)
    variants = [KernelVariant("m:k", d, None) for d in ("a", "b", "a", "bad", "b")]
    report = compile_variants(variants, torch.device("cpu"), workers=3)
    assert sorted(seen) == ["a", "b", "bad"]
    assert (report["variants"], report["failed"], report["workers"]) == (3, 1, 3)
    assert compile_variants([], torch.device("cpu"))["variants"] == 0


@pytest.mark.parametrize("mixed", [None, "eager"])
def test_mixed_compile_units_follow_the_token_buckets(make_engine, mixed):
    """One unit per token bucket with pieces on, none with them off; running one builds nothing
    that stays (a bucket not built yet runs on temporary buffers)."""
    engine = make_ranked_engine(make_engine, [8], **({} if mixed is None else {"mixed_graphs": mixed}))
    units = engine.runner.mixed_compile_units()
    if mixed is None:
        assert units == []
        return
    assert [name for name, _ in units] == [f"mixed rows={b}" for b in engine.runner.token_buckets]
    units[0][1]()
    assert engine.runner._mixed == {}
