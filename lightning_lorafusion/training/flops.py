"""Useful FLOPs of multi-LoRA training over a frozen decoder, for model FLOPs utilisation (MFU)."""

from __future__ import annotations

from typing import Any, Sequence

from ..parallel.cost_model import causal_pairs, layer_windows

__all__ = ["H100_H200_BF16_PEAK_TFLOPS", "causal_pairs", "layer_windows", "lora_training_flops"]

# Dense bf16 datasheet peak of one H100/H200 SXM, TFLOP/s (the MFU denominator in BENCHMARKS.md).
H100_H200_BF16_PEAK_TFLOPS = 989.0


def lora_training_flops(config: Any, sample_lengths: Sequence[int]) -> float:
    """FLOPs that training over samples of these token counts must do: 4 x the linear weights
    per token (forward and input gradient; the base is frozen, so no weight gradients), the LM
    head likewise (a tied head is still a product), and attention 12 x pairs x (heads x head_dim)
    per layer per sample (QK^T and PV: 4 per pair forward, 8 backward), pairs from ``causal_pairs``
    with that layer's sliding window (full causal: the 6 x L^2 x heads x head_dim of a sample). Shapes are the family's: ``head_dim`` as
    the config names it (Gemma: 256, not hidden / heads), Phi-3's fused ``qkv_proj`` /
    ``gate_up_proj`` as the q/k/v and gate/up products they hold, the full vocabulary.
    Elementwise work (norms, q/k norms, soft-caps, activations, RoPE), LoRA's own FLOPs (< 1%
    at rank 16) and recomputation are left out, as matrix-product MFU conventions do.
    ``config``: an HF config or the project's ``DecoderConfig``."""
    from ..parallel.cost_model import CostModel

    windows = layer_windows(config)
    layers = len(windows)
    unit = CostModel.from_decoder_config(config, (layers,))  # forward FLOPs per token / pair
    lengths = [int(n) for n in sample_lengths]
    tokens = sum(lengths)
    pairs = sum(causal_pairs(n, w) for w in windows for n in lengths)  # over layers and samples
    linear = 2 * tokens * (layers * unit.layer_flops_per_token + unit.head_flops_per_token)
    attention = 3 * unit.attention_flops_per_pair * pairs
    return float(linear + attention)
