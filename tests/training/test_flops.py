"""lora_training_flops: the MFU numerator, against the formula written out by hand."""

import pytest

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
