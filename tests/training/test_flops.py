"""lora_training_flops: the MFU numerator, against the formula written out by hand."""

import pytest
import torch

from lightning_lorafusion.model.random_model import random_base_config
from lightning_lorafusion.training.flops import lora_training_flops


@pytest.mark.parametrize("shape", ["llama8b", "llama70b"])
def test_flops_are_four_times_the_linear_weights_per_token_plus_causal_attention(shape):
    cfg = random_base_config(f"random:{shape}")
    h, i, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * i  # q, o, k, v, gate, up, down
    lengths = [17, 1000, 2048]
    want = sum(4 * n * (layers * per_layer + v * h) + 6 * n * n * q * layers for n in lengths)
    assert lora_training_flops(cfg, lengths) == pytest.approx(want, rel=1e-12)
    assert lora_training_flops(cfg, []) == 0


# Tiny configs of every family, built by transformers (the per-family pieces live: Gemma's
# head_dim != hidden / heads and sliding windows, Phi-3's fused projections, q/k norms, soft-caps).
_TINY = dict(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_FAMILY_EXTRA = {
    "llama": {}, "qwen3": dict(head_dim=24), "olmo2": {}, "phi3": {},
    "gemma2": dict(head_dim=24, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),
    "gemma3_text": dict(head_dim=24, query_pre_attn_scalar=24, sliding_window=8, sliding_window_pattern=2),
}


def _hf_config(family):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoConfig.for_model(family, **_TINY, **_FAMILY_EXTRA[family])


def _linear_weights_of_one_layer(hf_config) -> int:
    """Weights of every nn.Linear in transformers' own decoder layer 0 of this config."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config)
    layer = model.model.layers[0]
    return sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("family", list(_FAMILY_EXTRA))
def test_flops_follow_each_familys_shapes_by_hand_count(family):
    from lightning_lorafusion.model.decoder_config import DecoderConfig

    hf = _hf_config(family)
    ours = DecoderConfig.from_hf(hf)
    h, i, v, heads, kv = 64, 96, 301, 4, 2
    d = _FAMILY_EXTRA[family].get("head_dim", h // heads)
    per_layer = 2 * h * heads * d + 2 * h * kv * d + 3 * h * i  # fused qkv / gate_up hold the same products
    assert _linear_weights_of_one_layer(hf) == per_layer  # the hand count is transformers' layer
    windows = {"gemma2": (8, None, 8, None), "gemma3_text": (8, None, 8, None)}.get(family, (None,) * 4)
    lengths = [5, 8, 30]
    attention = sum(
        12 * heads * d * (n * n / 2 if w is None or n <= w else n * w - w * w / 2) for w in windows for n in lengths)
    want = sum(4 * n * (4 * per_layer + v * h) for n in lengths) + attention
    for config in (hf, ours):  # an HF config and the project's DecoderConfig count alike
        assert lora_training_flops(config, lengths) == pytest.approx(want, rel=1e-12)


def test_sliding_windows_cut_attention_flops_and_only_on_their_layers():
    from lightning_lorafusion.training.flops import causal_pairs

    assert causal_pairs(10) == causal_pairs(10, 10) == causal_pairs(10, 64) == 50
    assert causal_pairs(10, 4) == 10 * 4 - 8  # 4 keys per query once the window is full
    gemma2 = _hf_config("gemma2")
    short, long = lora_training_flops(gemma2, [8]), lora_training_flops(gemma2, [40])
    # layers 0 and 2 slide (window 8): beyond it only the full layers 1 and 3 grow as n^2
    d = 24
    full_layers_extra = 2 * 12 * 4 * d * (40 * 40 / 2)
    sliding_layers_extra = 2 * 12 * 4 * d * causal_pairs(40, 8)
    linear_40 = 4 * 40 * (4 * (2 * 64 * 96 + 2 * 64 * 48 + 3 * 64 * 96) + 301 * 64)
    assert long == pytest.approx(linear_40 + full_layers_extra + sliding_layers_extra, rel=1e-12)
    assert short < long
