"""The fused LoRA projections with DoRA adapters among the routed ones (``dora.py``'s math
around ``fused_lora.fused_lora_projections``)."""

from __future__ import annotations

import torch

from .dora import dora_rescale_owned, dora_rescale_rows, dora_scale
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
    runs the torch reference. A fixed-shape routing (``routing.row_owner``) goes to
    ``fixed_shape_dora_projections``."""
    if routing.row_owner is not None:
        return fixed_shape_dora_projections(x, weights, biases, loras, routing, dropout_offset=dropout_offset,
                                            options=options, operands=operands)
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


def dora_gains(weight, lora, routing) -> torch.Tensor | None:
    """``[A + 1, N]`` fp32: row ``a`` the DoRA scale ``g`` of adapter ``a`` on this projection
    (from its current factors and magnitude), ones for a plain-LoRA or untargeted adapter and in
    the last row (rows of nobody); None when no adapter is DoRA here. Every DoRA adapter of the
    bank, present in the microbatch or not: the shape and the work do not depend on it."""
    if lora is None or lora.magnitude is None:
        return None
    rows = []
    for a in range(routing.num_adapters + 1):
        magnitude = lora.dora(a) if a < routing.num_adapters else None
        if magnitude is None:
            rows.append(torch.ones(weight.shape[0], dtype=torch.float32, device=routing.row_owner.device))
        else:
            rows.append(dora_scale(magnitude, weight, lora.a[a], lora.b[a], routing.scales[a], lora.weight_sq_norm))
    return torch.stack(rows)


def fixed_shape_dora_projections(x, weights, biases, loras, routing, *, dropout_offset: int = 0, options=None,
                                 operands=None) -> list[torch.Tensor]:
    """DoRA in a fixed-shape step (a captured graph replayed over other microbatches): the rows
    of each adapter are read on the device (``routing.row_owner``), each DoRA adapter's scale
    ``g`` is recomputed from its current weights in the step, and every row gets the gain of
    its owner (``dora_rescale_owned``; ones for plain-LoRA rows). DoRA adapters with dropout
    would need PEFT's second frozen product on masks drawn per row on the device: refused."""
    dropped = [a for lora in loras if lora is not None and lora.magnitude is not None
               for a in range(routing.num_adapters) if lora.dora(a) is not None and routing.dropout_p[a] > 0.0]
    if dropped:
        raise ValueError(f"adapter {dropped[0]} is DoRA with dropout {routing.dropout_p[dropped[0]]}: a "
                         "fixed-shape (CUDA-graph) step runs DoRA adapters without dropout only")
    ys = fused_lora_projections(x, weights, biases, loras, routing, dropout_offset=dropout_offset,
                                options=options, operands=operands)
    out = []
    for y, weight, bias, lora in zip(ys, weights, biases, loras):
        gains = dora_gains(weight, lora, routing)
        out.append(y if gains is None else dora_rescale_owned(y, bias, routing.row_owner, gains))
    return out
