"""The functional decoder against transformers' own forward, packing, and the chunked loss head."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lightning_lorafusion.data.microbatch import IGNORE_INDEX
from lightning_lorafusion.model import decoder as D
from lightning_lorafusion.model.hf_loading import params_from_hf_model
from lightning_lorafusion.specs import ConfigError

from _tiny_hf import tiny_hf_config, tiny_hf_model

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

CASES = {
    "llama-gqa": ("llama", {}),
    "llama-tied-bias": ("llama", {"tie_word_embeddings": True, "attention_bias": True,
                                  "mlp_bias": True, "num_key_value_heads": 4}),
    "llama-mqa-headdim": ("llama", {"num_key_value_heads": 1, "head_dim": 10}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "mistral-window": ("mistral", {"sliding_window": 5}),
    "qwen2-bias-gqa": ("qwen2", {}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
}
LENGTHS = (9, 1, 14, 5)  # packed samples: odd sizes, one single-token sample


def _pack(lengths):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return cu, pos


def _close(ours, ref):
    # fp32 on both sides; 1e-4 relative to the logit scale
    tol = 1e-4 * max(1.0, ref.abs().max().item())
    err = (ours - ref).abs().max().item()
    assert err < tol, f"max abs diff {err:.3g} >= {tol:.3g}"


@pytest.mark.parametrize("case", list(CASES))
def test_packed_logits_equal_transformers_per_sample(case):
    family, overrides = CASES[case]
    model = tiny_hf_model(family, seed=list(CASES).index(case), **overrides)
    config, params = params_from_hf_model(model)
    ids = torch.randint(0, config.vocab_size, (sum(LENGTHS),), generator=torch.Generator().manual_seed(1))
    cu, pos = _pack(LENGTHS)
    with torch.no_grad():
        ours = D.logits(params, None, ids, pos, cu, None, config=config)
        for start, end in zip(cu.tolist(), cu.tolist()[1:]):
            ref = model(ids[start:end][None]).logits[0]
            _close(ours[start:end], ref)
    if overrides.get("tie_word_embeddings"):
        assert params["lm_head"] is params["embed"]


def test_config_fields_from_hf():
    cfg = D.DecoderConfig.from_hf(tiny_hf_config("qwen2"))
    assert (cfg.qkv_bias, cfg.o_bias, cfg.num_kv_heads, cfg.head_dim) == (True, False, 2, 12)
    cfg = D.DecoderConfig.from_hf(tiny_hf_config("mistral", sliding_window=7))
    assert cfg.sliding_windows == (7, 7)
    cfg = D.DecoderConfig.from_hf(tiny_hf_config("qwen2", use_sliding_window=True, sliding_window=4,
                                                 max_window_layers=1))
    assert cfg.sliding_windows == (None, 4)
    cfg = D.DecoderConfig.from_hf(tiny_hf_config("llama", rope_scaling=LLAMA3_ROPE))
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_positions) == ("llama3", 8.0, 16)


def test_sliding_window_changes_the_output():
    # guards the window cases above against passing because the window never bites
    model = tiny_hf_model("mistral", sliding_window=3)
    config, params = params_from_hf_model(model)
    ids = torch.arange(12) % config.vocab_size
    cu, pos = _pack([12])
    full = dataclasses.replace(config, sliding_windows=())
    with torch.no_grad():
        a = D.logits(params, None, ids, pos, cu, None, config=config)
        b = D.logits(params, None, ids, pos, cu, None, config=full)
    assert torch.allclose(a[:3], b[:3], atol=1e-6)  # first tokens see the same keys
    assert (a[3:] - b[3:]).abs().max() > 1e-3


def test_unsupported_configs_raise_clearly():
    from transformers import GPT2Config

    with pytest.raises(ConfigError, match="model_type='gpt2'"):
        D.DecoderConfig.from_hf(GPT2Config())
    with pytest.raises(ConfigError, match="'dynamic'.*dynamic NTK"):
        D.DecoderConfig.from_hf(tiny_hf_config("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(ConfigError, match="num_kv_heads"):
        D.DecoderConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                        num_heads=3, num_kv_heads=2, head_dim=4)


def test_layer_slices_compose_like_pipeline_stages():
    model = tiny_hf_model("llama", num_hidden_layers=3)
    config, params = params_from_hf_model(model)
    ids = torch.randint(0, config.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    cu, pos = _pack([8, 12])
    with torch.no_grad():
        whole = D.decoder_layers(params, None, D.embed(params, ids), pos, cu, None, config=config)
        h = D.embed(params, ids)
        stage0 = {"layers": {0: params["layers"][0]}}
        stage1 = {"layers": {1: params["layers"][1], 2: params["layers"][2]}}
        h = D.decoder_layers(stage0, None, h, pos, cu, None, config=config, layers=range(0, 1))
        h = D.decoder_layers(stage1, None, h, pos, cu, None, config=config, layers=range(1, 3))
    assert torch.equal(h, whole)


def test_head_loss_sums_match_cross_entropy_and_chunking_keeps_gradients():
    model = tiny_hf_model("qwen2")
    config, params = params_from_hf_model(model)
    g = torch.Generator().manual_seed(3)
    t = 23
    h = torch.randn(t, config.hidden_size, generator=g, requires_grad=True)
    labels = torch.randint(0, config.vocab_size, (t,), generator=g)
    labels[[0, 5, 6, 22]] = IGNORE_INDEX
    segments = ((0, 7, 1), (7, 16, 0), (16, 21, 2))  # rows 21, 22 belong to no adapter
    full_logits = F.linear(D.rms_norm(h, params["norm"], config.rms_norm_eps), params["lm_head"])
    per_token = F.cross_entropy(full_logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    expected = torch.stack([per_token[7:16].sum(), per_token[0:7].sum(), per_token[16:21].sum()])
    weights = torch.tensor([1.0, 2.0, 3.0])
    (grad_ref,) = torch.autograd.grad((expected * weights).sum(), h)

    for chunk in (4, 1024):
        sums = D.head_loss_sums(params, h, labels, segments, 3, config=config, chunk_size=chunk)
        assert sums.dtype == torch.float32 and sums.shape == (3,)
        torch.testing.assert_close(sums, expected, rtol=1e-6, atol=1e-5)
        (grad,) = torch.autograd.grad((sums * weights).sum(), h)
        torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-6)
    assert grad_ref[21:].abs().sum() == 0  # tokens outside segments get no gradient



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family,overrides", [("mistral", {"sliding_window": 6}), ("qwen2", {})])
def test_bf16_cuda_decoder_matches_fp32_reference(family, overrides):
    model = tiny_hf_model(family, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=160, **overrides)
    config, params = params_from_hf_model(model)
    cuda_params = {"embed": params["embed"].cuda().bfloat16(), "norm": params["norm"].cuda().bfloat16(),
                   "layers": [{k: (v.cuda().bfloat16() if torch.is_tensor(v) else
                                   {n: t.cuda().bfloat16() for n, t in v.items()}) for k, v in lp.items()}
                              for lp in params["layers"]]}
    cuda_params["lm_head"] = params["lm_head"].cuda().bfloat16()
    ids = torch.randint(0, config.vocab_size, (sum(LENGTHS),), generator=torch.Generator().manual_seed(1))
    cu, pos = _pack(LENGTHS)
    with torch.no_grad():
        ours = D.logits(cuda_params, None, ids.cuda(), pos.cuda(), cu.cuda(), None, config=config).float().cpu()
        for start, end in zip(cu.tolist(), cu.tolist()[1:]):
            ref = model(ids[start:end][None]).logits[0]
            # bf16 weights and activations through 2 layers: 5% of the logit scale
            assert (ours[start:end] - ref).abs().max() < 5e-2 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("checkpoint_layers, recomputed", [(False, 0), (True, 3), (2, 2), (0, 0)])
def test_checkpoint_layer_count_recomputes_the_first_layers(monkeypatch, checkpoint_layers, recomputed):
    model = tiny_hf_model("llama", num_hidden_layers=3)
    config, params = params_from_hf_model(model)
    ids = torch.randint(0, config.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    cu, pos = _pack([8, 12])
    calls = []
    layer = D.decoder_layer

    def counting(*args, **kwargs):
        calls.append(kwargs["layer"])
        return layer(*args, **kwargs)

    monkeypatch.setattr(D, "decoder_layer", counting)

    def run(ckpt):
        h = D.embed(params, ids).requires_grad_(True)
        out = D.decoder_layers(params, None, h, pos, cu, None, config=config, checkpoint_layers=ckpt)
        (grad,) = torch.autograd.grad(out.square().sum(), h)
        return grad

    want = run(False)
    calls.clear()
    got = run(checkpoint_layers)
    assert calls[:3] == [0, 1, 2]  # forward
    assert sorted(calls[3:]) == list(range(recomputed))  # backward recomputes exactly those
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
