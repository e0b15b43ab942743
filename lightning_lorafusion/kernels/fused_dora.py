"""The fused LoRA projections with DoRA adapters among the routed ones (``dora.py``'s math
around ``fused_lora.fused_lora_projections``)."""

from __future__ import annotations

import torch

from .dora import dora_rescale_rows, dora_scale
from .fused_lora import fused_lora_projections
from .reference import lora_projections_reference


def dora_adapters_routed(loras, routing) -> set[int]:
    """The adapters routed in ``routing`` that are DoRA on some projection of ``loras``."""
    routed = {adapter for _, _, adapter in routing.segments}
    return {a for lora in loras if lora is not None and lora.magnitude is not None
            for a in routed if lora.magnitude[a] is not None}


def fused_dora_projections(x, weights, biases, loras, routing, *, dropout_offset: int = 0, options=None,
                           operands=None) -> list[torch.Tensor]:
    """``kernels.fused_lora.fused_lora_projections`` with DoRA adapters among the routed ones:
    the fused kernels compute ``y = x W^T + bias + s (x A^T) B^T`` for every row, then each DoRA
    adapter's rows become ``g * (y - bias) + bias`` in place (``dora_rescale_rows``: a pass over
    the DoRA rows only, after the fused product rather than inside its epilogue). A DoRA
    adapter with dropout needs PEFT's second frozen product on its dropped-out rows: that group
    runs the torch reference."""
    live = dora_adapters_routed(loras, routing)
    if not live:
        return fused_lora_projections(x, weights, biases, loras, routing, dropout_offset=dropout_offset,
                                      options=options, operands=operands)
    if any(routing.dropout_p[a] > 0.0 for a in live):
        return lora_projections_reference(x, weights, biases, loras, routing, dropout_offset, options=options,
                                          operands=operands)
    ys = fused_lora_projections(x, weights, biases, loras, routing, dropout_offset=dropout_offset,
                                options=options, operands=operands)
    out = []
    for y, weight, bias, lora in zip(ys, weights, biases, loras):
        rows, scales = [], {}
        for start, end, a in routing.segments if lora is not None else ():
            magnitude = lora.dora(a)
            if magnitude is None:
                continue
            if a not in scales:  # once per adapter, whatever its number of segments
                scales[a] = dora_scale(magnitude, weight, lora.a[a], lora.b[a], routing.scales[a],
                                       lora.weight_sq_norm)
            rows.append((start, end, scales[a]))
        out.append(dora_rescale_rows(y, bias, rows))
    return out
