"""DoRA's pieces against their specs: the in-place row rescale of the fused path equals the
autograd reference (values and the gradients of y and g), and the row norm reads FP8 / NF4
weights as their dequantized values."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.kernels.dora import dora_rescale, dora_rescale_owned, dora_rescale_rows, dora_row_norm
from lightning_lorafusion.kernels.fp8_linear import quantize_weight
from lightning_lorafusion.kernels.nf4 import quantize_nf4_reference


@pytest.mark.parametrize("with_bias,whole", [(False, False), (True, False), (False, True)])
def test_in_place_rescale_equals_the_reference(with_bias, whole):
    g = torch.Generator().manual_seed(0)
    m, n = 47, 123
    z = torch.randn(m, n, generator=g, dtype=torch.float64)
    bias = torch.randn(n, generator=g, dtype=torch.float64) if with_bias else None
    g1 = (1.0 + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_()
    g2 = (1.0 + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_()
    # rows 5..9 and 20..30: plain LoRA rows; ``whole``: one DoRA adapter on every row
    runs = [(0, m, g1)] if whole else [(0, 5, g1), (9, 20, g2), (30, 47, g1)]
    dy = torch.randn(m, n, generator=g, dtype=torch.float64)

    z_ref = z.clone().requires_grad_()
    ref = dora_rescale(z_ref, bias, runs)
    ref_grads = torch.autograd.grad(ref, [z_ref, g1, g2], dy, allow_unused=True)

    z_ours = z.clone().requires_grad_()
    y = z_ours + bias if with_bias else z_ours * 1.0  # the fused product holds its bias
    ours = dora_rescale_rows(y, bias, runs)
    assert ours is y  # in place: no copy of the rows outside the runs
    ours_grads = torch.autograd.grad(ours, [z_ours, g1, g2], dy, allow_unused=True)
    torch.testing.assert_close(ours, ref)
    for a, b in zip(ours_grads, ref_grads):
        if b is None:  # g2 unused when one adapter covers every row
            assert a is None or not a.any()
            continue
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind", ["fp8", "nf4"])
def test_row_norm_of_a_quantized_weight_is_that_of_its_dequantized_values(kind):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=g) / 10
    a, b = torch.randn(4, 96, generator=g), torch.randn(64, 4, generator=g) * 0.1
    q = quantize_weight(w) if kind == "fp8" else quantize_nf4_reference(w)
    dense = q.dequantize(torch.float32)
    assert not torch.equal(dense, w)  # the quantized weight differs from the original
    expected = torch.linalg.norm(dense.double() + 0.5 * (b.double() @ a.double()), dim=1)
    torch.testing.assert_close(dora_row_norm(q, a, b, 0.5).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_in_place_rescale_in_half_precision_is_the_fp64_result_rounded(dtype):
    """16-bit outputs: the rows rounded once; g's gradient summed in fp32 (half-precision
    products, so about 1e-2 relative: the half-precision tolerance of the other ops)."""
    g = torch.Generator().manual_seed(2)
    z = torch.randn(123, 47, generator=g, dtype=torch.float64)
    gv = (1.0 + 0.3 * torch.randn(47, generator=g, dtype=torch.float64))
    dy = torch.randn(123, 47, generator=g, dtype=torch.float64)
    ref = dora_rescale(z, None, [(3, 100, gv)])
    ref_dg = (dy[3:100] * z[3:100]).sum(0)
    y = z.to(dtype).requires_grad_()
    gh = gv.float().requires_grad_()
    out = dora_rescale_rows(y * 1.0, None, [(3, 100, gh)])
    (dg,) = torch.autograd.grad(out, [gh], dy.to(dtype))
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    assert dg.dtype == torch.float32
    torch.testing.assert_close(dg.double(), ref_dg, rtol=2e-2, atol=0.2)


@pytest.mark.parametrize("with_bias", [False, True])
def test_owner_rescale_equals_the_row_range_reference(with_bias):
    """The fixed-shape rescale (each row's gain row read from ``owner`` on the device) equals
    the row-range reference: values, y's gradient and each gain's gradient (summed over its
    rows); plain-LoRA rows (gain ones) and rows of nobody (the last gain row) are unchanged."""
    g = torch.Generator().manual_seed(3)
    m, n = 47, 123
    z = torch.randn(m, n, generator=g, dtype=torch.float64)
    bias = torch.randn(n, generator=g, dtype=torch.float64) if with_bias else None
    g0 = (1.0 + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_()
    g2 = (1.0 + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_()
    dy = torch.randn(m, n, generator=g, dtype=torch.float64)
    # adapter 0 (DoRA) on rows 0..5 and 30..40, adapter 1 (LoRA) 5..9, adapter 2 (DoRA) 9..30, nobody after 40
    owner = torch.full((m,), 3, dtype=torch.int64)
    for start, end, a in [(0, 5, 0), (5, 9, 1), (9, 30, 2), (30, 40, 0)]:
        owner[start:end] = a
    ones = torch.ones(n, dtype=torch.float64)

    z_ref = z.clone().requires_grad_()
    ref = dora_rescale(z_ref, bias, [(0, 5, g0), (9, 30, g2), (30, 40, g0)])
    ref_grads = torch.autograd.grad(ref, [z_ref, g0, g2], dy)

    z_ours = z.clone().requires_grad_()
    y = z_ours + bias if with_bias else z_ours * 1.0
    ours = dora_rescale_owned(y, bias, owner, torch.stack([g0, ones, g2, ones]))
    assert ours is y
    ours_grads = torch.autograd.grad(ours, [z_ours, g0, g2], dy)
    torch.testing.assert_close(ours, ref)
    for a, b in zip(ours_grads, ref_grads):
        torch.testing.assert_close(a, b)
