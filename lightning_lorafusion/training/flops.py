"""Useful FLOPs of multi-LoRA training over a frozen decoder, for model FLOPs utilisation (MFU)."""

from __future__ import annotations

from typing import Any, Sequence

# Dense bf16 datasheet peak of one H100/H200 SXM, TFLOP/s (the MFU denominator in BENCHMARKS.md).
H100_H200_BF16_PEAK_TFLOPS = 989.0


def lora_training_flops(config: Any, sample_lengths: Sequence[int]) -> float:
    """FLOPs that training over samples of these token counts must do: 4 x the linear weights
    per token (forward and input gradient; the base is frozen, so no weight gradients), the LM
    head likewise, and causal attention 6 x L^2 x (heads x head_dim) per layer per sample
    (forward 2, backward 4). LoRA's own FLOPs (< 1% at rank 16) and recomputation are left out.
    ``config``: an HF config or the project's ``DecoderConfig``."""
    from ..parallel.simulator import CostModel

    layers = getattr(config, "num_hidden_layers", None) or config.num_layers
    unit = CostModel.from_decoder_config(config, (layers,))  # forward FLOPs per token / pair
    tokens = sum(int(n) for n in sample_lengths)
    pairs = sum(int(n) * int(n) for n in sample_lengths)
    linear = 2 * tokens * (layers * unit.layer_flops_per_token + unit.head_flops_per_token)
    attention = 3 * layers * unit.attention_flops_per_pair * pairs / 2
    return float(linear + attention)
