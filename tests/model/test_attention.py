"""Packed attention: boundaries hold; the CUDA FlashAttention path matches the SDPA loop."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.model.attention import _flash_varlen, sdpa_varlen_loop, varlen_causal_attention


def _qkv(lengths, hq, hkv, d, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return [x.to(device, dtype).requires_grad_() for x in (q, k, v)], cu.to(device)


def test_attention_never_crosses_sample_boundaries():
    (q, k, v), cu = _qkv([6, 4], 4, 2, 8, "cpu", torch.float32)
    with torch.no_grad():
        out = sdpa_varlen_loop(q, k, v, cu, scale=8**-0.5)
        v2 = v.clone()
        v2[:6] += 100.0  # perturb the first sample's values only
        out2 = sdpa_varlen_loop(q, k, v2, cu, scale=8**-0.5)
    assert torch.equal(out[6:], out2[6:])
    assert not torch.allclose(out[:6], out2[:6])
    with pytest.raises(ValueError, match="cu_seqlens"):
        sdpa_varlen_loop(q, k, v, torch.tensor([0, 6, 9]), scale=1.0)


def test_loop_matches_dense_masked_attention():
    # reference written out: softmax over keys of the same sample at or before the query
    (q, k, v), cu = _qkv([5, 1, 9], 4, 2, 8, "cpu", torch.float64)
    window = 3
    with torch.no_grad():
        out = sdpa_varlen_loop(q, k, v, cu, scale=0.3, sliding_window=window)
        sample = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 1, 9]))
        i = torch.arange(15)
        allowed = (sample[:, None] == sample[None, :]) & (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * 0.3
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        ref = torch.einsum("hqk,khd->qhd", probs, vv)
    torch.testing.assert_close(out, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 17])
def test_flash_varlen_matches_sdpa_loop_on_cuda(window):
    lengths = [37, 1, 130, 64, 200]
    (q, k, v), cu = _qkv(lengths, 8, 2, 64, "cuda", torch.bfloat16)
    assert _flash_varlen(q, k, v, cu, 64**-0.5, window, None) is not None, "flash path unavailable"
    out = varlen_causal_attention(q, k, v, cu, scale=64**-0.5, sliding_window=window)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = sdpa_varlen_loop(q32, k32, v32, cu, scale=64**-0.5, sliding_window=window)
    grad_out = torch.randn_like(ref)
    # bf16 inputs/outputs (8 mantissa bits): 3e-2 absolute on O(1) values
    assert (out.float() - ref).abs().max() < 3e-2
    out.backward(grad_out.to(out.dtype))
    ref.backward(grad_out)
    for a, b in ((q, q32), (k, k32), (v, v32)):
        assert (a.grad.float() - b.grad).abs().max() < 6e-2 * max(1.0, b.grad.abs().max().item())
