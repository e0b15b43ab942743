"""The one entry point the decoder calls for LoRA projections; picks torch or Triton."""

from __future__ import annotations

from typing import Sequence

import torch

from .fp8_linear import Fp8Weight, QuantizedOperands
from .options import KernelOptions
from .reference import LoraModuleWeights, LoraRouting, lora_projections_reference

BACKENDS = ("torch", "triton", "auto")


def lora_projections(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor | Fp8Weight],
    biases: Sequence[torch.Tensor | None],
    loras: Sequence[LoraModuleWeights | None],
    routing: LoraRouting | None,
    *,
    dropout_offset: int = 0,
    backend: str = "torch",
    options: KernelOptions | None = None,
    operands: QuantizedOperands | None = None,
) -> list[torch.Tensor]:
    """Projections ``x [M, K] -> [M, N_i]`` of one shared input, each with its LoRA term.

    ``backend``: "torch" (reference, any device), "triton" (fused kernels), "auto" (Triton on
    CUDA, torch elsewhere). ``weights`` may be ``Fp8Weight``s (an FP8 base): the frozen
    products then run through ``fp8_linear`` in either backend, with ``options``' accumulation
    and taking the quantized operands a neighbour offered through ``operands``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {BACKENDS}")
    if backend == "auto":
        backend = "triton" if x.is_cuda else "torch"
    if backend == "torch" or routing is None or all(l is None for l in loras):
        return lora_projections_reference(x, weights, biases, loras, routing, dropout_offset, options=options,
                                          operands=operands)
    if any(l is not None and l.magnitude is not None for l in loras):  # DoRA adapters in the group
        from .fused_dora import fused_dora_projections

        return fused_dora_projections(x, weights, biases, loras, routing, dropout_offset=dropout_offset,
                                      options=options, operands=operands)
    from .fused_lora import fused_lora_projections  # Triton is imported only when used

    return fused_lora_projections(x, weights, biases, loras, routing, dropout_offset=dropout_offset,
                                  options=options, operands=operands)
