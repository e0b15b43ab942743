"""DoRA (weight-decomposed LoRA, PEFT's ``use_dora``): the per-row norm of ``W + s·B·A`` from
rank-r products, and the magnitude rescaling of one adapter's rows, as torch functions.

Math (PEFT's ``DoraLinearLayer``; ``W [N, K]`` frozen, ``A [r, K]``, ``B [N, r]``, ``s`` the
LoRA scale, ``m [N]`` the trained magnitude), for the rows ``x`` routed to the adapter:

    norm  = ||W + s B A||_row                         (over K, one value per output; detached)
    g     = m / norm                                  ([N]; m gets the gradient)
    y     = x W^T + bias + (g - 1) * (xd W^T) + g * s * (xd A^T) B^T

``xd`` is the dropped-out input when the adapter has dropout (PEFT then runs the frozen product
again on it), else ``x`` itself, and the whole reduces to ``y = g * (x W^T + s (x A^T) B^T) + bias``.

The norm never materialises ``W + s B A`` (``[N, K]``): row by row,

    ||W + s B A||^2 = ||W||^2 + 2 s rowsum(B * (W A^T)) + s^2 rowsum((B (A A^T)) * B)

``||W||^2`` is frozen (computed once per projection: ``weight_row_sq_norm``); ``W A^T`` is a
rank-r product ``[N, r]`` and ``A A^T`` is ``[r, r]``. The sums run in fp32.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from .fp8_linear import Fp8Weight, frozen_projections
from .nf4 import Nf4Weight


def dense_weight(weight: torch.Tensor | Fp8Weight | Nf4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The frozen weight ``[N, K]`` as a plain tensor of ``dtype`` (an FP8 or NF4 weight
    dequantized: DoRA normalises the weight the base computes with)."""
    if isinstance(weight, (Fp8Weight, Nf4Weight)):
        return weight.dequantize(dtype)
    return weight.to(dtype)


@torch.no_grad()
def weight_row_sq_norm(weight: torch.Tensor | Fp8Weight | Nf4Weight, chunk_rows: int = 4096) -> torch.Tensor:
    """``||W[n, :]||^2`` ``[N]`` fp32 of a frozen weight, a block of rows at a time (no fp32
    copy of the whole weight)."""
    n = weight.shape[0]
    if isinstance(weight, (Fp8Weight, Nf4Weight)):
        w = weight.dequantize(torch.float32)
        return w.square().sum(1)
    out = torch.empty(n, dtype=torch.float32, device=weight.device)
    for r0 in range(0, n, chunk_rows):
        out[r0:r0 + chunk_rows] = weight[r0:r0 + chunk_rows].float().square().sum(1)
    return out


@torch.no_grad()
def dora_row_norm(weight: torch.Tensor | Fp8Weight | Nf4Weight, a: torch.Tensor, b: torch.Tensor, scale: float,
                  weight_sq_norm: torch.Tensor | None = None) -> torch.Tensor:
    """``||W + scale B A||`` per output row, ``[N]`` fp32, from rank-r products (see the module
    docstring); ``weight_sq_norm``: ``weight_row_sq_norm(weight)`` if known. No gradient."""
    if weight_sq_norm is None:
        weight_sq_norm = weight_row_sq_norm(weight)
    a32, b32 = a.detach().float(), b.detach().float()
    # W A^T in the compute dtype (fp32 accumulation), like the frozen GEMM itself; a quantized
    # weight dequantized for it (a transient [N, K] in that dtype)
    dense = weight if isinstance(weight, torch.Tensor) else dense_weight(weight, a.dtype)
    wa = F.linear(a.detach().to(dense.dtype), dense).t().float()  # [N, r]
    cross = (b32 * wa).sum(1)
    ba_sq = ((b32 @ (a32 @ a32.t())) * b32).sum(1)
    return (weight_sq_norm.float() + (2.0 * scale) * cross + (scale * scale) * ba_sq).clamp_min(0.0).sqrt()


def dora_scale(magnitude: torch.Tensor, weight: torch.Tensor | Fp8Weight | Nf4Weight, a: torch.Tensor,
               b: torch.Tensor, scale: float, weight_sq_norm: torch.Tensor | None = None) -> torch.Tensor:
    """``g = magnitude / ||W + scale B A||_row`` ``[N]`` (fp32; the norm detached, so only
    ``magnitude`` gets a gradient through it, as in PEFT)."""
    return magnitude.float() / dora_row_norm(weight, a, b, scale, weight_sq_norm)


def dora_rows_reference(y: torch.Tensor, xs: torch.Tensor, weight, bias: torch.Tensor | None, a: torch.Tensor,
                        b: torch.Tensor, scale: float, g: torch.Tensor, *, dropped: bool) -> torch.Tensor:
    """One DoRA adapter's rows: ``y`` ``[m, N]`` the frozen product of its rows (with ``bias``),
    ``xs`` ``[m, K]`` its (dropped-out, when ``dropped``) input, ``g`` ``dora_scale``; returns
    the rows with the DoRA term added (PEFT's forward, term for term)."""
    lora = scale * ((xs @ a.to(xs.dtype).t()) @ b.to(xs.dtype).t())
    if dropped:  # PEFT runs the frozen product again on the dropped-out input
        base = frozen_projections(xs, [weight], [None])[0]
    else:
        base = y - bias if bias is not None else y
    g = g.to(y.dtype)
    return y + (g - 1.0) * base + g * lora


def dora_rescale(z: torch.Tensor, bias: torch.Tensor | None, rows: Sequence[tuple[int, int, torch.Tensor]]
                 ) -> torch.Tensor:
    """``z`` ``[M, N]`` = ``x W^T + s (x A^T) B^T`` (no bias) -> ``g * z + bias`` on each
    ``(start, end, g)`` row range, ``z + bias`` elsewhere: DoRA without dropout after the fused
    LoRA product (differentiable in ``z`` and in each ``g``)."""
    y = z.clone() if rows else z
    for start, end, g in rows:
        y[start:end] = z[start:end] * g.to(z.dtype)
    return y + bias if bias is not None else y


class DoraRescaleRows(torch.autograd.Function):
    """In place on ``y`` ``[M, N]`` (a fused product with its bias): ``y = g * (y - bias) + bias``
    on each ``(start, end)`` row range with its ``g`` ``[N]``; other rows are left as they are
    (no pass over them). Saves only the ranges' ``y - bias``, for ``g``'s gradient. The same
    math as ``dora_rescale``."""

    @staticmethod
    def forward(ctx, y, bias, ranges, *gs):
        saved = []
        for (start, end), g in zip(ranges, gs):
            rows = y[start:end]
            z = rows - bias if bias is not None else rows.clone()
            saved.append(z)
            torch.mul(z, g.to(y.dtype), out=rows)
            if bias is not None:
                rows.add_(bias)
        ctx.mark_dirty(y)
        ctx.ranges = ranges
        ctx.save_for_backward(*gs, *saved)
        return y

    @staticmethod
    def backward(ctx, dy):
        n = len(ctx.ranges)
        gs, saved = ctx.saved_tensors[:n], ctx.saved_tensors[n:]
        if len(ctx.ranges) == 1 and ctx.ranges[0] == (0, dy.shape[0]):  # one DoRA adapter, every row
            dz = dy * gs[0].to(dy.dtype)
        else:
            dz = dy.clone()
            for (start, end), g in zip(ctx.ranges, gs):
                dz[start:end].mul_(g.to(dz.dtype))
        acc = torch.promote_types(dy.dtype, torch.float32)  # g's gradient sums rows: fp32 at least
        dgs = [(dy[start:end] * z).sum(0, dtype=acc).to(g.dtype)
               for (start, end), g, z in zip(ctx.ranges, gs, saved)]
        return (dz, None, None, *dgs)


def dora_rescale_rows(y: torch.Tensor, bias: torch.Tensor | None, rows: Sequence[tuple[int, int, torch.Tensor]]
                      ) -> torch.Tensor:
    """``DoraRescaleRows`` over ``(start, end, g)`` runs (``y`` is returned, modified in place)."""
    if not rows:
        return y
    return DoraRescaleRows.apply(y, bias, tuple((s, e) for s, e, _ in rows), *(g for _, _, g in rows))


class DoraRescaleOwned(torch.autograd.Function):
    """In place on ``y`` ``[M, N]`` (a fused product with its bias): ``y = gains[owner] * (y -
    bias) + bias`` row by row, ``owner`` ``[M]`` int64 each row's gain row, ``gains`` ``[G, N]``
    (ones for plain-LoRA adapters and for rows of nobody). The fixed-shape form of
    ``DoraRescaleRows`` for a captured step: which rows are DoRA is read from the device, not
    from host row ranges. Saves ``y - bias`` for the gains' gradient (summed per owner)."""

    @staticmethod
    def forward(ctx, y, bias, owner, gains):
        z = y - bias if bias is not None else y.clone()
        torch.mul(z, gains.to(y.dtype).index_select(0, owner), out=y)
        if bias is not None:
            y.add_(bias)
        ctx.mark_dirty(y)
        ctx.save_for_backward(owner, gains, z)
        return y

    @staticmethod
    def backward(ctx, dy):
        owner, gains, z = ctx.saved_tensors
        dz = dy * gains.to(dy.dtype).index_select(0, owner)
        dgains = None
        if ctx.needs_input_grad[3]:
            acc = torch.promote_types(dy.dtype, torch.float32)  # sums of rows: fp32 at least
            dgains = torch.zeros(gains.shape, dtype=acc, device=gains.device)
            dgains.index_add_(0, owner, (dy * z).to(acc))
            dgains = dgains.to(gains.dtype)
        return dz, None, None, dgains


def dora_rescale_owned(y: torch.Tensor, bias: torch.Tensor | None, owner: torch.Tensor,
                       gains: torch.Tensor) -> torch.Tensor:
    """``DoraRescaleOwned`` (``y`` is returned, modified in place)."""
    if owner.shape != (y.shape[0],) or gains.shape[1:] != y.shape[1:]:
        raise ValueError(f"owner {tuple(owner.shape)} / gains {tuple(gains.shape)} do not fit y {tuple(y.shape)}")
    return DoraRescaleOwned.apply(y, bias, owner, gains)
