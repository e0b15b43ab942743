"""Residual add + RMSNorm in one pass (serving steps): ``h += delta; x = rms_norm(h) * weight``.

The reference is the decoder's own arithmetic (``reference.rms_norm``, which the decoder uses, after ``h + delta``):
the sum rounded to h's dtype, statistics in fp32, the normalised row rounded to h's dtype,
then times the weight (one more rounding). The Triton kernel rounds at the same points, so in
half precision the two differ only by the order of the fp32 sum of squares.

``weight_offset=1.0`` is Gemma's convention (``reference.offset_rms_norm``): the row times
``1 + w``, all in fp32, rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lora_gather import BACKENDS, _require_triton
from .reference import offset_rms_norm, rms_norm

WEIGHT_OFFSETS = (0.0, 1.0)  # x * w (Llama) or x * (1 + w) (Gemma)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _add_rms_norm_kernel(
    h_ptr, d_ptr, w_ptr, x_ptr, H, h_stride, d_stride, x_stride, eps,
    HAS_DELTA: tl.constexpr, BLOCK_H: tl.constexpr, ONE_PLUS_W: tl.constexpr,
):
    """Program per row: h[row] (+)= d[row] (stored back), x[row] = w * norm(h[row]) (or
    (1 + w) * norm(h[row]) in fp32 with ONE_PLUS_W)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    h = tl.load(h_ptr + row * h_stride + offs, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * d_stride + offs, mask=ok, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * h_stride + offs, h, mask=ok)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if ONE_PLUS_W:
        out = (hf * rstd) * (1.0 + w)
    else:
        out = w * (hf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(x_ptr + row * x_stride + offs, out.to(x_ptr.dtype.element_ty), mask=ok)


def _check(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> None:
    if not isinstance(h, torch.Tensor) or h.dim() != 2:
        raise ValueError(f"h must be a 2-D tensor [tokens, hidden]; got {getattr(h, 'shape', type(h))}")
    if h.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"h.dtype={h.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if delta is not None and (delta.shape != h.shape or delta.dtype != h.dtype or delta.device != h.device):
        raise ValueError(f"delta must match h ({tuple(h.shape)} {h.dtype} on {h.device}); got "
                         f"{tuple(delta.shape)} {delta.dtype} on {delta.device}")
    if weight.shape != (h.shape[1],) or weight.dtype != h.dtype or weight.device != h.device:
        raise ValueError(f"weight must be [{h.shape[1]}] {h.dtype} on {h.device}; got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")


@torch.no_grad()
def add_rms_norm_reference(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                           eps: float, *, weight_offset: float = 0.0) -> torch.Tensor:
    """``h [T, H]`` (+)= ``delta [T, H]`` in place (None: no add) -> ``rms_norm(h) [T, H]``
    (``weight_offset=1.0``: ``offset_rms_norm``, Gemma's ``1 + w``)."""
    _check(h, delta, weight)
    _check_offset(weight_offset)
    if delta is not None:
        h.add_(delta)
    return (offset_rms_norm if weight_offset else rms_norm)(h, weight, eps)


def _check_offset(weight_offset: float) -> None:
    if weight_offset not in WEIGHT_OFFSETS:
        raise ValueError(f"weight_offset={weight_offset!r}; allowed: {WEIGHT_OFFSETS}")


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                 backend: str = "auto", weight_offset: float = 0.0) -> torch.Tensor:
    """Same contract as ``add_rms_norm_reference``; ``backend``: "torch", "triton" (CUDA, or CPU
    under TRITON_INTERPRET=1) or "auto" (Triton on CUDA). The Triton path is one launch, a
    program per row (h and delta need unit stride along hidden)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {BACKENDS}")
    if backend == "auto":
        backend = "triton" if h.is_cuda else "torch"
    if backend == "torch":
        return add_rms_norm_reference(h, delta, weight, eps, weight_offset=weight_offset)
    _check_offset(weight_offset)
    _check(h, delta, weight)
    _require_triton(h)
    if h.stride(1) != 1 or (delta is not None and delta.stride(1) != 1):
        raise ValueError("h and delta must have unit stride along hidden (h is written in place)")
    t, hidden = h.shape
    x = torch.empty(t, hidden, dtype=h.dtype, device=h.device)
    if t:
        block = triton.next_power_of_2(hidden)
        _add_rms_norm_kernel[(t,)](
            h, h if delta is None else delta, weight.contiguous(), x, hidden, h.stride(0),
            0 if delta is None else delta.stride(0), x.stride(0), float(eps),
            HAS_DELTA=delta is not None, BLOCK_H=block, ONE_PLUS_W=bool(weight_offset),
            num_warps=4 if block <= 2048 else 8,
        )
    return x
