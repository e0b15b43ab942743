"""Tiny random Llama-family models built from transformers configs (no downloads); test helpers."""

from __future__ import annotations

import torch


def tiny_hf_config(family: str, **overrides):
    """A 2-layer config of one family; sizes are deliberately not powers of two."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
    common.update(overrides)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[family]
    return cls(**common)


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Re-draw every weight (norm gains near 1, biases non-zero) so each term matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
    return model


def tiny_hf_model(family: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    return randomize_(model, seed).eval()
