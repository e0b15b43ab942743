"""The FP8 MLP's SwiGLU with its neighbours' operands quantized on the way (``Fp8SwiGLU``).

- Triton kernels (CPU: interpreter, fp32; the interpreter's e4m3 conversion is wrong at binade
  edges, so they store the scaled values in fp32 there and torch rounds them): h / dg / du
  against autograd of ``silu(g) * u``, the row scales exactly the spec's, the stored rows exactly
  the scaled values. GPU: the same in bf16 with real e4m3 bits against ``quantize_rows``.
- The offer slots: taken only by the very tensor, emptied by the first look.
The decoder with it on or off: tests/model/test_fusion.py."""

import pytest
import torch

from lightning_lorafusion.kernels import fp8_linear as F8

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _inputs(m, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, n, generator=g) * 3).to(dtype)
    b = torch.randn(m, n, generator=g).to(dtype)
    dh = (torch.randn(m, n, generator=g) * torch.rand(m, 1, generator=g) * 1e-3).to(dtype)
    a[1], dh[2] = 0, 0  # a zero h row (u need not be), a zero gradient row
    b[1] = 0
    cg = torch.exp2(torch.randint(-8, 3, (n,), generator=g).float())
    cu = torch.exp2(torch.randint(-8, 3, (n,), generator=g).float())
    return [t.to(DEVICE) for t in (a, b, dh, cg, cu)]


def _autograd(g, u, dh):
    g32, u32 = g.float().requires_grad_(True), u.float().requires_grad_(True)
    h = torch.nn.functional.silu(g32) * u32
    dg, du = torch.autograd.grad(h, (g32, u32), dh.float())
    return h.detach(), dg, du


@pytest.mark.parametrize("m,n", [(5, 300), (3, 64)])
def test_swiglu_kernels_against_autograd_and_the_spec(m, n):
    from lightning_lorafusion.kernels.fp8_triton import swiglu_grads_quantize, swiglu_quantize

    dtype = torch.bfloat16 if CUDA else torch.float32
    q_dtype = F8.FP8_DTYPE if CUDA else torch.float32
    tol = 1e-2 if CUDA else 1e-5
    g, u, dh, cg, cu = _inputs(m, n, dtype)
    h_ref, dg_ref, du_ref = _autograd(g, u, dh)

    h, hq, sh = swiglu_quantize(g, u, q_dtype=q_dtype)
    torch.testing.assert_close(h.float(), h_ref, rtol=tol, atol=tol * 1e-2)
    spec_q, spec_s = F8.quantize_rows_reference(h)  # the spec, of the kernel's own h
    assert torch.equal(sh, spec_s) and sh[1].item() == 1.0
    if CUDA:
        assert torch.equal(hq.view(torch.uint8), spec_q.view(torch.uint8))
    else:
        assert torch.equal(hq, h.float() / sh)  # exact: the scale is a power of two
        assert torch.equal(hq.to(F8.FP8_DTYPE).view(torch.uint8), spec_q.view(torch.uint8))

    dg, du, gq, sg = swiglu_grads_quantize(g, u, dh, cg, cu, q_dtype=q_dtype)
    scale = dg_ref.abs().max().item()
    torch.testing.assert_close(dg.float(), dg_ref, rtol=tol, atol=tol * scale * 1e-2)
    torch.testing.assert_close(du.float(), du_ref, rtol=tol, atol=tol * scale * 1e-2)
    full = torch.cat([dg.float() * cg, du.float() * cu], dim=1)
    spec_q, spec_s = F8.quantize_rows_reference(full)
    assert torch.equal(sg, spec_s) and sg[2].item() == 1.0
    if CUDA:
        assert torch.equal(gq.view(torch.uint8), spec_q.view(torch.uint8))
    else:
        assert torch.equal(gq, full / sg)
        assert torch.equal(gq.to(F8.FP8_DTYPE).view(torch.uint8), spec_q.view(torch.uint8))


def test_offers_are_taken_only_by_their_tensor_and_only_once():
    gen = torch.Generator().manual_seed(5)  # (the shared generator's state is left to other tests)
    x = torch.randn(4, 8, generator=gen)
    xq, sx = F8.quantize_rows_reference(x)
    ops = F8.QuantizedOperands()
    ops.offer_input(x, xq, sx)
    assert ops.take_input(x.clone()) is None  # another tensor: declined ...
    assert ops.take_input(x) is None  # ... and the offer is gone
    ops.offer_input(x, xq, sx)
    assert F8.QuantizedOperands().take_input(x) is None  # another layer's hand-off holds nothing
    assert ops.take_input(x)[0] is xq
    ops.offer_input(x, xq, sx)
    x.add_(1)  # changed in place since the offer: its rows are no longer these
    assert ops.take_input(x) is None

    w = F8.quantize_weight(torch.randn(8, 6, generator=gen))
    dy = torch.randn(4, 8, generator=gen)
    ops.offer_grad((dy,), (w.scale,), xq, sx)
    other = F8.quantize_weight(torch.randn(8, 6, generator=gen))
    assert ops.take_grad([dy], [other]) is None  # other scales
    ops.offer_grad((dy,), (w.scale,), xq, sx)
    assert ops.take_grad([dy], [w]) == (xq, sx)
    assert ops.take_grad([dy], [w]) is None
