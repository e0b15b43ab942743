"""recomputed_mlp on plain tensors: the same values and gradients as the plain composition, and
the elementwise activation run once in backward (the down projection's rebuilt input and the
activation's own gradient share one rebuild)."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.model.family import swiglu
from lightning_lorafusion.model.mlp_recompute import recomputed_mlp


def _mlp_parts(seed: int = 0, t: int = 7, h: int = 5, i: int = 11):
    g = torch.Generator().manual_seed(seed)
    wg, wu = torch.randn(i, h, generator=g, dtype=torch.float64), torch.randn(i, h, generator=g, dtype=torch.float64)
    wd = torch.randn(h, i, generator=g, dtype=torch.float64, requires_grad=True)  # trained: down keeps its input
    x = torch.randn(t, h, generator=g, dtype=torch.float64, requires_grad=True)
    return x, wg, wu, wd


@pytest.mark.parametrize("mode", ["activation", "gate_up"])
def test_activation_runs_once_in_backward(mode):
    x, wg, wu, wd = _mlp_parts()
    calls = []

    def act(g, u):
        calls.append(torch.is_grad_enabled())
        return swiglu(g, u)

    def gate_up(x):
        return x @ wg.T, x @ wu.T

    def down(m):
        return m @ wd.T

    ref = down(swiglu(*gate_up(x)))
    dy = torch.randn_like(ref)
    ref_dx, ref_dwd = torch.autograd.grad(ref, (x, wd), dy)

    out = recomputed_mlp(x, gate_up, act, down, mode)
    assert len(calls) == 1  # the forward
    dx, dwd = torch.autograd.grad(out, (x, wd), dy)
    assert len(calls) == 2  # one rebuild serves the down projection and the activation's gradient
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dwd, ref_dwd, rtol=0, atol=0)


def test_activation_gradient_when_down_keeps_nothing_of_its_input():
    """A frozen down projection keeps no ``mid``: the activation's backward rebuilds it itself."""
    x, wg, wu, wd = _mlp_parts(seed=1)
    wd = wd.detach()
    out = recomputed_mlp(x, lambda x: (x @ wg.T, x @ wu.T), swiglu, lambda m: m @ wd.T, "activation")
    ref = swiglu(x @ wg.T, x @ wu.T) @ wd.T
    dy = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(out, x, dy)[0], torch.autograd.grad(ref, x, dy)[0],
                               rtol=1e-12, atol=1e-12)
