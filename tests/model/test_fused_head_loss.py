"""The fused linear cross-entropy LM-head loss against the checkpointed chunks it replaces.

fp32 on the CPU: both paths run the same norm, GEMM and cross-entropy arithmetic, and differ
only in where the incoming gradient of the per-adapter sums is applied (before the LM-head
backward GEMM, or after it), so sums agree to fp32 rounding (rtol 1e-6) and input gradients
to the rounding of a [V]-term reduction (rtol 1e-5). bf16 on the GPU: both round the logits
gradient to bf16 before its GEMM; tolerance 2e-2 relative (two bf16 roundings, 2^-8 each, of
differently scaled values, plus bf16 rounding of the stored gradient).
"""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.data.microbatch import IGNORE_INDEX
from lightning_lorafusion.kernels.linear_cross_entropy import linear_cross_entropy_sums
from lightning_lorafusion.model import decoder as D
from lightning_lorafusion.model.hf_loading import params_from_hf_model
from lightning_lorafusion.specs import ConfigError

from _tiny_hf import tiny_hf_model


def _problem(t=41, seed=0, model_seed=0):
    model = tiny_hf_model("llama", seed=model_seed)
    config, params = params_from_hf_model(model)
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, config.hidden_size, generator=g)
    labels = torch.randint(0, config.vocab_size, (t,), generator=g)
    labels[[i for i in (0, 3, 4, 17, 29, 40) if i < t]] = IGNORE_INDEX
    # 4 adapters, adapter 2 twice; rows 20..22 and 38.. belong to nobody; no boundary on a
    # multiple of the chunk sizes below
    segments = ((0, 7, 1), (7, 13, 0), (13, 20, 2), (23, 31, 3), (31, 38, 2))
    return config, params, h, labels, segments


def _sums_and_grad(params, h, labels, segments, config, weights, **kw):
    h = h.detach().requires_grad_(True)
    sums = D.head_loss_sums(params, h, labels, segments, 4, config=config, **kw)
    (grad,) = torch.autograd.grad((sums * weights).sum(), h)
    return sums.detach(), grad


@pytest.mark.parametrize("chunk", [5, 9, 1024])
@pytest.mark.parametrize("with_label_rows", [False, True])
def test_fused_equals_checkpointed_sums_and_input_grads(chunk, with_label_rows):
    config, params, h, labels, segments = _problem()
    weights = torch.tensor([0.7, -1.3, 2.0, 0.01])  # the incoming gradient of the four sums
    kw = {"chunk_size": chunk}
    if with_label_rows:
        kw["label_rows"] = (labels != IGNORE_INDEX).nonzero().squeeze(1)
    want_sums, want_grad = _sums_and_grad(params, h, labels, segments, config, weights, **kw)
    got_sums, got_grad = _sums_and_grad(params, h, labels, segments, config, weights, lm_head_loss="fused", **kw)
    torch.testing.assert_close(got_sums, want_sums, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7)
    assert want_grad.abs().sum() > 0
    nobody = torch.zeros(h.shape[0], dtype=torch.bool)
    nobody[20:23] = nobody[38:] = True
    ignored = labels == IGNORE_INDEX
    assert got_grad[nobody | ignored].abs().sum() == 0  # rows that count for nobody: no gradient


def test_fused_with_tied_embeddings_and_no_grad():
    model = tiny_hf_model("llama", tie_word_embeddings=True)
    config, params = params_from_hf_model(model)
    assert params["lm_head"] is params["embed"]
    g = torch.Generator().manual_seed(1)
    h = torch.randn(12, config.hidden_size, generator=g)
    labels = torch.randint(0, config.vocab_size, (12,), generator=g)
    segments = ((0, 5, 0), (5, 12, 1))
    with torch.no_grad():
        want = D.head_loss_sums(params, h, labels, segments, 2, config=config, chunk_size=4)
        got = D.head_loss_sums(params, h, labels, segments, 2, config=config, chunk_size=4, lm_head_loss="fused")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_fused_head_rejects_trainable_head_and_unknown_option():
    config, params, h, labels, segments = _problem(t=8)
    segments = ((0, 8, 0),)
    with pytest.raises(ConfigError, match="lm_head_loss='chunked'"):
        D.head_loss_sums(params, h, labels, segments, 1, config=config, lm_head_loss="chunked")
    trainable = dict(params, norm=params["norm"].clone().requires_grad_(True))
    with pytest.raises(ValueError, match="final norm no gradient"):
        D.head_loss_sums(trainable, h, labels, segments, 1, config=config, lm_head_loss="fused")
    owners = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(ValueError, match="frozen LM head"):
        linear_cross_entropy_sums(h, params["lm_head"].clone().requires_grad_(True), labels, owners, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_matches_checkpointed_bf16_cuda():
    config, params, h, labels, segments = _problem(t=300, seed=2)
    params = {k: (v.cuda().bfloat16() if torch.is_tensor(v) else v) for k, v in params.items()}
    h, labels = h.cuda().bfloat16(), labels.cuda()
    weights = torch.tensor([0.5, 1.0, 2.0, 1e-3], device="cuda")
    want_sums, want_grad = _sums_and_grad(params, h, labels, segments, config, weights, chunk_size=64)
    got_sums, got_grad = _sums_and_grad(params, h, labels, segments, config, weights, chunk_size=64,
                                        lm_head_loss="fused")
    torch.testing.assert_close(got_sums, want_sums, rtol=1e-5, atol=1e-4)  # same logits, fp32 CE
    rel = ((got_grad.float() - want_grad.float()).norm() / want_grad.float().norm()).item()
    assert rel < 2e-2, rel
