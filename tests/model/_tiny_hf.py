"""Tiny random decoder models built from transformers configs (no downloads); test helpers."""

from __future__ import annotations

import torch


# Per family: what a tiny config sets beyond the common shape, so each family feature is live
# (soft-caps small enough to bend the scores, a window shorter than the test sequences, a query
# scalar unlike head_dim, local and global RoPE bases that differ).
FAMILY_OVERRIDES = {
    "llama": {}, "mistral": {}, "qwen2": {},
    "qwen3": dict(head_dim=12),
    "olmo2": dict(eos_token_id=100),
    "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=7),
    "gemma2": dict(head_dim=12, query_pre_attn_scalar=20, sliding_window=5, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention"],
                   tie_word_embeddings=True),
    "gemma3_text": dict(head_dim=12, query_pre_attn_scalar=20, sliding_window=5, num_hidden_layers=3,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 1000.0}},
                        tie_word_embeddings=True),
}
NEW_FAMILIES = ("qwen3", "olmo2", "phi3", "gemma2", "gemma3_text")


def _longrope(rotated_pairs: int, partial: float = 1.0) -> dict:
    # factors unlike each other and unlike 1, so a swapped or dropped set shows
    return {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": partial,
            "short_factor": [1.0 + 0.15 * i for i in range(rotated_pairs)],
            "long_factor": [2.0 + 0.7 * i for i in range(rotated_pairs)]}


# RoPE scaling variants: name -> (model_type, overrides). The pretraining context is short
# (16 / 32 tokens of the 128), so YaRN's ramp and LongRoPE's long factors act in short tests.
ROPE_VARIANTS = {
    "qwen3_yarn": ("qwen3", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                  "original_max_position_embeddings": 16})),
    "llama_yarn_mscale": ("llama", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.8, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2})),
    "phi3_longrope": ("phi3", dict(original_max_position_embeddings=32, rope_parameters=_longrope(6))),
    # Phi-4-mini's shape of RoPE: 3/4 of each head (12 of 16 dims) rotates, with longrope
    "phi3_partial_longrope": ("phi3", dict(hidden_size=64, original_max_position_embeddings=32,
                                           rope_parameters=_longrope(6, 0.75))),
}


def tiny_hf_config(family: str, **overrides):
    """A 2-layer config of one family (or a ``ROPE_VARIANTS`` name); sizes are deliberately not
    powers of two."""
    from transformers import AutoConfig

    common = dict(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
    model_type, variant = ROPE_VARIANTS.get(family, (family, {}))
    common.update(FAMILY_OVERRIDES[model_type])
    common.update(variant)
    common.update(overrides)
    return AutoConfig.for_model(model_type, **common)


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


def bank_with_nonzero_b(bank, seed: int = 0):
    """``bank`` with every LoRA B factor drawn (B starts at zero, which would hide A's gradient
    and any routing mistake), seeded; returned for chaining."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in bank.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return bank
