"""Residual add + RMSNorm: reference vs float64 math, Triton (interpreter on CPU) vs reference.

Tolerances on ||got - want|| / ||want||: fp32 1e-5 (the same fp32 arithmetic, only the order of
the sum of squares differs); fp16 2e-3 (the kernel rounds where the eager ops do: the sum, the
normalised row and the product; a different fp32 rstd can move a rounding by one ulp, 4.9e-4).
"""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.kernels.rms_norm import add_rms_norm, add_rms_norm_reference

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def rel_err(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def test_reference_matches_float64_math():
    g = torch.Generator().manual_seed(0)
    h, d, w = torch.randn(5, 47, generator=g), torch.randn(5, 47, generator=g), torch.randn(47, generator=g)
    want_h = h.double() + d.double()
    want = w.double() * want_h * torch.rsqrt(want_h.pow(2).mean(-1, keepdim=True) + 1e-5)
    x = add_rms_norm_reference(h, d, w, 1e-5)
    assert rel_err(h, want_h) < 1e-6  # h was updated in place
    assert rel_err(x, want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [47, 128, 4097])
@pytest.mark.parametrize("with_delta", [True, False])
def test_triton_matches_reference(device, dtype, hidden, with_delta):
    g = torch.Generator().manual_seed(hidden)
    rows = 3 if hidden > 1000 else 7
    h = torch.randn(rows, hidden, generator=g).to(device, dtype)
    d = torch.randn(rows, hidden, generator=g).to(device, dtype) if with_delta else None
    w = (torch.rand(hidden, generator=g) + 0.5).to(device, dtype)
    h_ref = h.clone()
    want = add_rms_norm_reference(h_ref, d, w, 1e-6)
    got = add_rms_norm(h, d, w, 1e-6, backend="triton")
    assert got.dtype == dtype and got.shape == want.shape
    assert rel_err(got, want) < TOL[dtype]
    assert torch.equal(h, h_ref)  # the residual sum is rounded once, exactly as h + d


def test_triton_strided_rows(device):
    """h and delta as row-strided views (column slices of wider tensors)."""
    g = torch.Generator().manual_seed(3)
    h_wide = torch.randn(6, 80, generator=g).to(device)
    d_wide = torch.randn(6, 90, generator=g).to(device)
    w = torch.randn(47, generator=g).to(device)
    h_ref = h_wide[:, 5:52].clone()
    want = add_rms_norm_reference(h_ref, d_wide[:, 40:87], w, 1e-5)
    before = h_wide.clone()
    got = add_rms_norm(h_wide[:, 5:52], d_wide[:, 40:87], w, 1e-5, backend="triton")
    assert rel_err(got, want) < TOL[torch.float32]
    assert torch.equal(h_wide[:, 5:52], h_ref)
    assert torch.equal(h_wide[:, :5], before[:, :5]) and torch.equal(h_wide[:, 52:], before[:, 52:])


def test_bad_inputs_raise_clear_errors(device):
    h = torch.randn(3, 8, device=device)
    w = torch.randn(8, device=device)
    with pytest.raises(ValueError, match="delta must match h"):
        add_rms_norm(h, torch.randn(3, 7, device=device), w, 1e-5)
    with pytest.raises(ValueError, match="weight must be \\[8\\]"):
        add_rms_norm(h, None, w[:4], 1e-5)
    with pytest.raises(ValueError, match="h must be a 2-D"):
        add_rms_norm(h[0], None, w, 1e-5)
    with pytest.raises(ValueError, match="backend="):
        add_rms_norm(h, None, w, 1e-5, backend="cuda")


def test_offset_reference_matches_float64_math():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(4, 47, generator=g), torch.randn(47, generator=g)
    want = (1.0 + w.double()) * h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert rel_err(add_rms_norm_reference(h.clone(), None, w, 1e-6, weight_offset=1.0), want) < 1e-6
    with pytest.raises(ValueError, match="weight_offset=0.5"):
        add_rms_norm_reference(h.clone(), None, w, 1e-6, weight_offset=0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [47, 128])
@pytest.mark.parametrize("with_delta", [True, False])
def test_triton_one_plus_w_matches_reference(device, dtype, hidden, with_delta):
    """Gemma's ``1 + w`` weights (near 0, as trained Gemma norms are) through the same kernel."""
    g = torch.Generator().manual_seed(hidden + 1)
    h = torch.randn(5, hidden, generator=g).to(device, dtype)
    d = torch.randn(5, hidden, generator=g).to(device, dtype) if with_delta else None
    w = (0.3 * torch.randn(hidden, generator=g)).to(device, dtype)
    h_ref = h.clone()
    want = add_rms_norm_reference(h_ref, d, w, 1e-6, weight_offset=1.0)
    got = add_rms_norm(h, d, w, 1e-6, backend="triton", weight_offset=1.0)
    assert rel_err(got, want) < TOL[dtype]
    assert rel_err(got, add_rms_norm_reference(h.clone(), None, w, 1e-6)) > 0.1  # the offset matters
    assert torch.equal(h, h_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lora_rows_are_added_to_the_delta_first(device, dtype):
    """``lora=(rows, first)``: delta's rows first .. first + B - 1 take fp32 rows before the
    residual add (rounded to delta's dtype), the other rows as without; delta is not written;
    Triton = reference bit for bit on the residual (one rounding each); bad rows raise."""
    g = torch.Generator().manual_seed(7)
    h = torch.randn(6, 47, generator=g).to(device, dtype)
    d = torch.randn(6, 47, generator=g).to(device, dtype)
    w = (torch.rand(47, generator=g) + 0.5).to(device, dtype)
    rows = torch.randn(3, 47, generator=g).to(device)
    d_before = d.clone()
    want_h = h.clone()
    added = d.clone()
    added[2:5] = (rows + d[2:5].float()).to(dtype)
    want = add_rms_norm_reference(want_h, added, w, 1e-5)
    for backend in ("torch", "triton"):
        got_h = h.clone()
        got = add_rms_norm(got_h, d, w, 1e-5, backend=backend, lora=(rows, 2))
        assert torch.equal(got_h, want_h) and torch.equal(d, d_before), backend
        assert rel_err(got, want) < TOL[dtype], backend
    with pytest.raises(ValueError, match="lora needs the delta"):
        add_rms_norm(h.clone(), None, w, 1e-5, lora=(rows, 2))
    with pytest.raises(ValueError, match="lora must be"):
        add_rms_norm(h.clone(), d, w, 1e-5, lora=(rows, 4))
    with pytest.raises(ValueError, match="lora must be"):
        add_rms_norm(h.clone(), d, w, 1e-5, lora=(rows.to(dtype) if dtype != torch.float32 else rows[:, :5], 0))
