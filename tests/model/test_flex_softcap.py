"""Soft-capped packed attention through FlexAttention (model/flex_attention.py) against the
per-sequence reference loop: the packing mask (own sample, causal, window), the cap, GQA and the
padding rows past the last boundary. CPU: forward, uncompiled (FlexAttention has no CPU
backward); CUDA: the compiled kernel, forward and backward."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.model import flex_attention as fa
from lightning_lorafusion.model.attention import sdpa_varlen_loop, varlen_causal_attention


def _case(device, dtype, *, total=80, bounds=(0, 30, 31, 64), hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(total, h, d, generator=g).mul(3.0).to(device=device, dtype=dtype)
               for h in (hq, hkv, hkv))
    cu = torch.tensor(list(bounds) + [total] if bounds[-1] != total else list(bounds), device=device)
    return q, k, v, cu


def test_sample_ids_follow_the_boundaries_and_padding_is_one_more_sample():
    cu = torch.tensor([0, 3, 3, 5])
    assert fa.sample_ids(cu, 7).tolist() == [0, 0, 0, 2, 2, 3, 3]


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("softcap", [2.0, 50.0])
def test_forward_equals_the_reference_loop_on_cpu(window, softcap):
    q, k, v, cu = _case("cpu", torch.float32)
    real = int(cu[-2])  # the last block is padding up to T
    out = fa.flex_softcap_attention(q, k, v, cu, scale=0.25, softcap=softcap, sliding_window=window,
                                    compiled=False)
    ref = sdpa_varlen_loop(q, k, v, cu, scale=0.25, softcap=softcap, sliding_window=window)
    torch.testing.assert_close(out[:real], ref[:real], rtol=1e-5, atol=1e-5)
    # the cap bites: without it the same inputs give another result
    uncapped = sdpa_varlen_loop(q, k, v, cu, scale=0.25, sliding_window=window)
    if softcap < 10:
        assert (uncapped[:real] - ref[:real]).abs().max() > 1e-2


def test_masks_built_once_per_forward_give_the_same_attention():
    """``decoder_layers`` builds one mask per window for all its layers; each layer's attention
    with it equals the attention that builds its own."""
    q, k, v, cu = _case("cpu", torch.float32)
    masks = fa.softcap_block_masks(cu, q.shape[0], {None, 7})
    assert set(masks) == {None, 7}
    for window in (None, 7):
        own = fa.flex_softcap_attention(q, k, v, cu, scale=0.25, softcap=2.0, sliding_window=window,
                                        compiled=False)
        shared = fa.flex_softcap_attention(q, k, v, cu, scale=0.25, softcap=2.0, sliding_window=window,
                                           compiled=False, block_mask=masks[window])
        torch.testing.assert_close(shared, own, rtol=0, atol=0)
    other = fa.flex_softcap_attention(q, k, v, cu, scale=0.25, softcap=2.0, sliding_window=None,
                                      compiled=False, block_mask=masks[7])
    assert (other - fa.flex_softcap_attention(q, k, v, cu, scale=0.25, softcap=2.0, compiled=False)).abs().max() > 0


def test_a_failure_is_logged_once_and_the_caller_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(fa, "_failed", None)

    def broken(*a, **k):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(fa, "_flex", lambda: (broken, broken))
    q, k, v, cu = _case("cpu", torch.float32)
    with caplog.at_level("WARNING"):
        assert fa.flex_softcap_attention(q, k, v, cu, scale=0.25, softcap=5.0, compiled=False) is None
        assert fa.flex_softcap_attention(q, k, v, cu, scale=0.25, softcap=5.0, compiled=False) is None
    assert sum("FlexAttention failed" in r.message for r in caplog.records) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled FlexAttention with backward needs a GPU")
@pytest.mark.parametrize("window", [None, 40])
def test_compiled_forward_and_backward_equal_the_reference_on_cuda(window):
    q, k, v, cu = _case("cuda", torch.float32, total=256, bounds=(0, 100, 101, 230), d=64)
    real = int(cu[-2])
    grads = []
    for path in ("flex", "ref"):
        x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        if path == "flex":
            out = varlen_causal_attention(*x, cu, scale=0.125, softcap=5.0, sliding_window=window)
        else:
            out = sdpa_varlen_loop(*x, cu, scale=0.125, softcap=5.0, sliding_window=window)
        out[:real].square().sum().backward()
        grads.append([out.detach()[:real]] + [t.grad for t in x])
    assert fa._failed is None
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
