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
    h_ptr, d_ptr, w_ptr, x_ptr, H, h_stride, d_stride, x_stride, eps, l_ptr, l_stride, l_first, l_rows,
    HAS_DELTA: tl.constexpr, BLOCK_H: tl.constexpr, ONE_PLUS_W: tl.constexpr, HAS_LORA: tl.constexpr = False,
):
    """Program per row: h[row] (+)= d[row] (stored back), x[row] = w * norm(h[row]) (or
    (1 + w) * norm(h[row]) in fp32 with ONE_PLUS_W). HAS_LORA: rows ``l_first`` ... ``l_first +
    l_rows - 1`` of d first take their LoRA ``l [l_rows, H]`` (fp32): d rounded after the fp32
    sum, as an additive expand would have stored it."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    h = tl.load(h_ptr + row * h_stride + offs, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * d_stride + offs, mask=ok, other=0.0)
        if HAS_LORA:
            lrow = row - l_first
            live = (lrow >= 0) & (lrow < l_rows)
            lora = tl.load(l_ptr + tl.maximum(lrow, 0) * l_stride + offs, mask=ok & live, other=0.0)
            d = tl.where(live, (lora + d.to(tl.float32)).to(d_ptr.dtype.element_ty), d)
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


def _check_lora(h: torch.Tensor, delta: torch.Tensor | None, lora: tuple[torch.Tensor, int] | None) -> None:
    if lora is None:
        return
    rows, first = lora[0], lora[1]
    if delta is None:
        raise ValueError("lora needs the delta it is added to")
    if (rows.dim() != 2 or rows.shape[1] != h.shape[1] or rows.dtype != torch.float32 or rows.device != h.device
            or rows.stride(1) != 1 or not 0 <= first <= h.shape[0] - rows.shape[0]):
        raise ValueError(f"lora must be ([rows, {h.shape[1]}] fp32 on {h.device}, unit column stride; first row) "
                         f"within h's {h.shape[0]} rows; got {tuple(rows.shape)} {rows.dtype} from row {first}")


@torch.no_grad()
def add_rms_norm_reference(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                           eps: float, *, weight_offset: float = 0.0,
                           lora: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """``h [T, H]`` (+)= ``delta [T, H]`` in place (None: no add) -> ``rms_norm(h) [T, H]``
    (``weight_offset=1.0``: ``offset_rms_norm``, Gemma's ``1 + w``). ``lora``: ``(rows [B, H]
    fp32, first)``: delta's rows ``first ... first + B - 1`` take those first (fp32 sum, rounded
    to delta's dtype; delta itself is not written)."""
    _check(h, delta, weight)
    _check_offset(weight_offset)
    _check_lora(h, delta, lora)
    if lora is not None:
        rows, first = lora
        delta = delta.clone()
        delta[first:first + rows.shape[0]] = (rows + delta[first:first + rows.shape[0]].float()).to(delta.dtype)
    if delta is not None:
        h.add_(delta)
    return (offset_rms_norm if weight_offset else rms_norm)(h, weight, eps)


def _check_offset(weight_offset: float) -> None:
    if weight_offset not in WEIGHT_OFFSETS:
        raise ValueError(f"weight_offset={weight_offset!r}; allowed: {WEIGHT_OFFSETS}")


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                 backend: str = "auto", weight_offset: float = 0.0,
                 lora: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """Same contract as ``add_rms_norm_reference``; ``backend``: "torch", "triton" (CUDA, or CPU
    under TRITON_INTERPRET=1) or "auto" (Triton on CUDA). The Triton path is one launch, a
    program per row (h and delta need unit stride along hidden). ``lora``: the decode rows' LoRA
    of the projection that wrote ``delta`` (``lora_gather.expand_beside``), added here instead
    of by an expand into ``delta``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {BACKENDS}")
    if backend == "auto":
        backend = "triton" if h.is_cuda else "torch"
    if backend == "torch":
        return add_rms_norm_reference(h, delta, weight, eps, weight_offset=weight_offset, lora=lora)
    _check_offset(weight_offset)
    _check(h, delta, weight)
    _check_lora(h, delta, lora)
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
            *((h, 0, 0, 0) if lora is None else (lora[0], lora[0].stride(0), lora[1], lora[0].shape[0])),
            HAS_DELTA=delta is not None, BLOCK_H=block, ONE_PLUS_W=bool(weight_offset), HAS_LORA=lora is not None,
            num_warps=4 if block <= 2048 else 8,
        )
    return x
