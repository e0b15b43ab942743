"""Torch reference of the (multi-)adapter LoRA linear: the spec the fused kernels must match.

Math for token rows ``s..e`` routed to adapter ``a`` (PEFT's LoRA, scale = alpha / rank):

    Y[s:e] = X[s:e] W^T (+ bias) + scale_a * (dropout_a(X[s:e]) A_a^T) B_a^T

Rows not covered by any segment (or routed to an adapter that does not target this module)
get the frozen linear only. Shapes: X [M, K], W [N, K], A_a [r_a, K], B_a [N, r_a]. A frozen
weight may be an ``fp8_linear.Fp8Weight``: the frozen products then run in FP8 (emulated off
Ada/Hopper) and the LoRA terms, their dropout and gradients stay in X's dtype.

A DoRA adapter (``LoraModuleWeights.magnitude[a]`` given) rescales its rows as ``dora.py`` says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .dora import dora_rows_reference, dora_scale
from .dropout import dropout_keep_mask
from .fp8_linear import Fp8Weight, QuantizedOperands, frozen_projections
from .options import KernelOptions


@dataclass(frozen=True)
class LoraRouting:
    """Token-to-adapter routing of one microbatch, shared by every layer.

    ``segments`` are ``(start, end, adapter)`` row ranges, sorted and non-overlapping;
    ``adapter`` indexes the per-adapter tuples here and in ``LoraModuleWeights``.
    ``microbatch_index`` feeds the dropout offset so each microbatch draws fresh masks.
    """

    num_rows: int
    segments: tuple[tuple[int, int, int], ...]
    scales: tuple[float, ...]
    dropout_p: tuple[float, ...]
    seeds: tuple[int, ...]
    microbatch_index: int = 0
    # Device-side launch tables of the fused kernels, built once per microbatch on first use
    # (keyed by device, block size and ranks) and shared by every layer. Not part of equality.
    launch_cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    # A fixed-shape step (a captured graph; ``segments`` empty, its tables in ``launch_cache``):
    # each row's adapter ``[num_rows]`` int64 on the device, ``num_adapters`` for nobody. DoRA
    # reads its rows here (``fused_dora.py``). Not part of equality.
    row_owner: torch.Tensor | None = field(default=None, compare=False, hash=False, repr=False)
    # The fused kernels gather the factors and add their gradients into their ``.grad`` themselves,
    # one launch each per projection group (``fused_lora_launch.GroupFactors``), where ``backward()``
    # is what reads them: no ``torch.autograd.grad`` over the factors and no gradient hooks on them
    # (a captured step).
    accumulate_grads: bool = field(default=False, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.scales)
        if not (len(self.dropout_p) == len(self.seeds) == n):
            raise ValueError("scales, dropout_p and seeds must have one entry per adapter")
        prev_end = 0
        for start, end, adapter in self.segments:
            if not (prev_end <= start < end <= self.num_rows):
                raise ValueError(
                    f"segments must be sorted, non-empty, non-overlapping and inside "
                    f"[0, {self.num_rows}); got {self.segments}"
                )
            if not 0 <= adapter < n:
                raise ValueError(f"segment adapter {adapter} out of range for {n} adapters")
            prev_end = end

    @property
    def num_adapters(self) -> int:
        return len(self.scales)


@dataclass(frozen=True)
class LoraModuleWeights:
    """One projection's LoRA factors for every adapter in the bank (None: not targeted)."""

    a: tuple[torch.Tensor | None, ...]  # per adapter [r_a, K]
    b: tuple[torch.Tensor | None, ...]  # per adapter [N, r_a]
    # DoRA: per adapter its magnitude [N] (None: plain LoRA); None: no DoRA adapter here
    magnitude: tuple[torch.Tensor | None, ...] | None = None
    # DoRA: the frozen weight's ||W[n, :]||^2 [N] fp32, computed once (None: computed when needed)
    weight_sq_norm: torch.Tensor | None = None

    def dora(self, adapter: int) -> torch.Tensor | None:
        """Adapter ``adapter``'s DoRA magnitude ``[N]`` on this projection, None if plain LoRA."""
        return None if self.magnitude is None else self.magnitude[adapter]


def lora_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None,
    lora: LoraModuleWeights | None,
    routing: LoraRouting | None,
    dropout_offset: int = 0,
) -> torch.Tensor:
    """``[M, K] -> [M, N]``: frozen linear plus each row's adapter LoRA term."""
    return lora_projections_reference(x, [weight], [bias], [lora], routing, dropout_offset)[0]


def lora_projections_reference(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor | Fp8Weight],
    biases: Sequence[torch.Tensor | None],
    loras: Sequence[LoraModuleWeights | None],
    routing: LoraRouting | None,
    dropout_offset: int = 0,
    *,
    options: KernelOptions | None = None,
    operands: QuantizedOperands | None = None,
) -> list[torch.Tensor]:
    """Several projections of one input (q/k/v or gate/up); they share one dropout mask.

    The LoRA terms are added in place into each segment's rows of the frozen outputs (no
    full-size zero/concatenate temporaries), and each segment's dropped-out input is built
    once for all projections. ``options`` / ``operands``: as in ``fp8_linear.frozen_projections``.
    """
    ys = frozen_projections(x, weights, biases, options=options, operands=operands)
    if routing is None or all(l is None for l in loras):
        return ys
    if routing.row_owner is not None:
        raise ValueError("a fixed-shape routing (row_owner, no segments) runs on the fused kernels only")
    for start, end, adapter in routing.segments:
        active = [i for i, l in enumerate(loras) if l is not None and l.a[adapter] is not None]
        if not active:
            continue
        xs = x[start:end]
        p = routing.dropout_p[adapter]
        if p > 0.0:
            keep = dropout_keep_mask(
                routing.seeds[adapter], dropout_offset, start, end - start, x.shape[1], p, x.device
            )
            xs = xs * keep.to(xs.dtype) / (1.0 - p)
        scale = routing.scales[adapter]
        for i in active:
            a, b = loras[i].a[adapter], loras[i].b[adapter]
            magnitude = loras[i].dora(adapter)
            if magnitude is not None:
                g = dora_scale(magnitude, weights[i], a, b, scale, loras[i].weight_sq_norm)
                ys[i][start:end] = dora_rows_reference(ys[i][start:end].clone(), xs, weights[i], biases[i], a, b, scale, g,
                                                       dropped=p > 0.0)
                continue
            ys[i][start:end] += scale * ((xs @ a.to(xs.dtype).t()) @ b.to(xs.dtype).t())
    return ys


# ------------------------------------------------ the decoder's elementwise pieces
# (here, below the model, so the fused serving kernels can use them as their references)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``[T, H] -> [T, H]``; statistics in fp32, as in the reference implementation."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm ``[..., H]``: ``x / rms(x) * (1 + w)``, all in fp32, rounded once at the end."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``[T, heads, D]``, rotating the two halves of each head's first ``R`` dims (the HF/Llama
    convention); cos, sin ``[..., R]``: ``R < D`` is partial rotary (Phi-4-mini), the dims past
    ``R`` pass through unchanged."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
