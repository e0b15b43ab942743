"""The fused LoRA backward adding every factor's gradient into its ``.grad`` in one launch
(``LoraRouting.accumulate_grads``, ``fused_lora_launch.GroupFactors``) against autograd's
accumulation of the same gradients, in the Triton interpreter on CPU (fp32 / fp16).

fp32 factors: the launch adds the same fp32 sums ``AccumulateGrad`` adds, so the results are
equal to rounding of the sum order only (1e-6). fp16 factors: autograd adds the fp16-rounded
gradient, the launch rounds once after adding, so they differ by one fp16 rounding (1e-3).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from lightning_lorafusion.kernels.block_sizes import INTERPRETER_BLOCK_SIZES
from lightning_lorafusion.kernels.fused_lora import fused_lora_projections
from lightning_lorafusion.kernels.fused_lora_launch import GroupFactors
from lightning_lorafusion.kernels.reference import LoraModuleWeights, LoraRouting
from lightning_lorafusion.kernels.static_routing import StaticLaunchTables

RANKS = ((4, 8, 0), (4, 0, 2), (0, 8, 2))  # projection x adapter
SCALES, DROPOUT, SEEDS = (2.0, 0.5, 1.0), (0.1, 0.0, 0.2), (1, 2, 3)


def _problem(dtype, device, m=70, k=48, ns=(40, 24, 16), seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    x = rnd(m, k)
    ws = [rnd(n, k, scale=k**-0.5) for n in ns]
    a = [[rnd(r, k, scale=k**-0.5) if r else None for r in rs] for rs in RANKS]
    b = [[rnd(n, r, scale=r**-0.5) if r else None for r in rs] for n, rs in zip(ns, RANKS)]
    gys = [rnd(m, n) for n in ns]
    # gradients already there (earlier microbatches of the global batch): some random, adapter 1's zero
    old = [[None if t is None else (rnd(*t.shape) if ad != 1 else torch.zeros_like(t)) for ad, t in enumerate(per)]
           for per in a + b]
    return x, ws, a, b, gys, old


def _step(x, ws, a, b, gys, old, routing, *, keep_none=(), saved=None):
    """One forward/backward; returns x.grad and every factor's .grad (None where no factor);
    ``saved``: a list that gets the shape of every tensor the forward keeps for backward."""
    x = x.clone().requires_grad_(True)
    a = [[None if t is None else t.clone().requires_grad_(True) for t in per] for per in a]
    b = [[None if t is None else t.clone().requires_grad_(True) for t in per] for per in b]
    for j, (t, o) in enumerate(zip([t for per in a + b for t in per], [o for per in old for o in per])):
        if t is not None and j not in keep_none:
            t.grad = o.clone()
    loras = [LoraModuleWeights(tuple(ai), tuple(bi)) for ai, bi in zip(a, b)]

    def pack(t):
        if saved is not None:
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ys = fused_lora_projections(x, ws, [None] * len(ws), loras, routing, dropout_offset=5,
                                    block_sizes=INTERPRETER_BLOCK_SIZES)
    torch.autograd.backward(ys, gys)
    return x.grad, [None if t is None else t.grad for per in a + b for t in per]


def _routing(m, segments, **kw):
    return LoraRouting(num_rows=m, segments=segments, scales=SCALES, dropout_p=DROPOUT, seeds=SEEDS, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_launch_accumulation_equals_autograds(device, dtype):
    x, ws, a, b, gys, old = _problem(dtype, device)
    segments = ((0, 32, 0), (32, 50, 2), (50, 70, 1))
    kept_ref, kept = [], []
    dx_ref, ref = _step(x, ws, a, b, gys, old, _routing(70, segments), saved=kept_ref)
    routing = _routing(70, segments, accumulate_grads=True)
    dx, got = _step(x, ws, a, b, gys, old, routing, saved=kept)
    # A_all [28, 48] and the three B_cat are gathered again in backward, not kept
    assert sorted(kept_ref) == sorted(kept + [(28, 48), (40, 12), (24, 6), (16, 10)])
    groups = [v for v in routing.launch_cache.values() if isinstance(v, GroupFactors)]
    assert len(groups) == 1 and len(groups[0].leaves) == 12  # the launch took every factor
    # the gather: A_all and each B_cat as the concatenations autograd's path makes
    group = groups[0]
    a_all, b_cats = group.gather(dtype)
    n_a = len(group.plan.table.a_order)
    assert torch.equal(a_all, torch.cat(group.leaves[:n_a]).detach())
    b_iter = iter(group.leaves[n_a:])
    for b_cat, order in zip(b_cats, group.plan.table.b_order):
        assert torch.equal(b_cat, torch.cat([next(b_iter) for _ in order], dim=1).detach())
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)  # the input gradient is untouched
    for j, (g, r) in enumerate(zip(got, ref)):
        assert (g is None) == (r is None)
        if g is not None:
            assert g.dtype == dtype
            torch.testing.assert_close(g, r, rtol=tol, atol=tol, msg=f"factor {j}")


def test_captured_layout_skips_absent_adapters_on_the_device(device):
    """Fixed-shape tables (every adapter routed, as in a captured step): an adapter with no row
    in the microbatch keeps its ``.grad`` bit for bit; the others get autograd's result."""
    x, ws, a, b, gys, old = _problem(torch.float32, device, m=64)
    segments = ((0, 40, 0), (40, 64, 2))  # adapter 1 absent
    _, ref = _step(x, ws, a, b, gys, old, _routing(64, segments))
    base = _routing(64, ())
    tables = StaticLaunchTables(base, device)
    tables.fill(segments, 0)
    entered = []  # the device tables live on: allocated where the step's owner says (outside a graph pool)
    tables.allocation_context = lambda: contextlib.nullcontext(entered.append(1))
    routing = dataclasses.replace(base, launch_cache=tables.cache, accumulate_grads=True)
    _, got = _step(x, ws, a, b, gys, old, routing)
    (group,) = [v for v in tables.cache.values() if isinstance(v, GroupFactors)]
    assert len(group.leaves) == 12
    assert len(entered) == 3  # the launch table, then the factors' and their gradients' tables
    adapters = [ad for per in RANKS for ad in range(3)] * 2
    for j, (g, r, o) in enumerate(zip(got, ref, [o for per in old for o in per])):
        if o is None:
            continue
        if adapters[j] == 1:
            assert torch.equal(g, o), f"factor {j} of the absent adapter changed"
        else:
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6, msg=f"factor {j}")


def test_factor_without_grad_falls_back_to_autograd(device):
    """A factor whose ``.grad`` is None (zeroed with set_to_none): autograd accumulates the
    group's gradients as before, the same values."""
    x, ws, a, b, gys, old = _problem(torch.float32, device)
    segments = ((0, 70, 0),)
    _, ref = _step(x, ws, a, b, gys, old, _routing(70, segments), keep_none=(0,))
    _, got = _step(x, ws, a, b, gys, old, _routing(70, segments, accumulate_grads=True), keep_none=(0,))
    for j, (g, r) in enumerate(zip(got, ref)):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6, msg=f"factor {j}")


def test_scaled_factor_is_left_to_autograd(device):
    """A B that is not a leaf (scaled by a per-module alpha, as the bank hands it): no group, and
    the gradient reaches the leaf through autograd."""
    x, ws, a, b, gys, _ = _problem(torch.float32, device)
    leaf = b[0][0].clone().requires_grad_(True)
    routing = _routing(70, ((0, 70, 0),), accumulate_grads=True)
    a = [[None if t is None else t.clone().requires_grad_(True) for t in per] for per in a]
    loras = [LoraModuleWeights(tuple(a[0]), (leaf * 3.0, *b[0][1:])),
             *(LoraModuleWeights(tuple(ai), tuple(bi)) for ai, bi in zip(a[1:], b[1:]))]
    ys = fused_lora_projections(x, ws, [None] * 3, loras, routing, dropout_offset=5,
                                block_sizes=INTERPRETER_BLOCK_SIZES)
    torch.autograd.backward(ys, gys)
    assert not any(isinstance(v, GroupFactors) for v in routing.launch_cache.values())
    assert leaf.grad is not None and a[0][0].grad is not None


def test_launch_reads_only_adapters_with_rows(device):
    """The launch itself: partials of all ones, adapter 1 without row tiles: its factors'
    ``.grad`` stay as they were, every other one gains ``split`` (the sum of its partials)."""
    x, ws, a, b, gys, old = _problem(torch.float32, device, m=64)
    base = _routing(64, ())
    tables = StaticLaunchTables(base, device)
    tables.fill(((0, 40, 0), (40, 64, 2)), 0)
    routing = dataclasses.replace(base, launch_cache=tables.cache, accumulate_grads=True)
    _step(x, ws, a, b, gys, old, routing)
    (group,) = [v for v in tables.cache.values() if isinstance(v, GroupFactors)]
    grads = group.grads()
    before = [g.clone() for g in grads]
    part = torch.ones(group.plan.split, group.plan.part_numel, device=device)
    group.accumulate(part, grads)
    absent = [ad == 1 for ad, _ in group.plan.table.a_order]
    absent += [ad == 1 for order in group.plan.table.b_order for ad in order]
    for g, was, skip in zip(grads, before, absent):
        assert torch.equal(g, was if skip else was + group.plan.split)
