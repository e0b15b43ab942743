"""Packed variable-length causal attention: no token attends across a ``cu_seqlens`` boundary."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from .flex_attention import flex_softcap_attention
from .rebuilt_copies import rebuilt_in_backward


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    max_seqlen: int | None = None,
    softcap: float | None = None,
    block_mask=None,
) -> torch.Tensor:
    """Causal attention inside each packed sequence.

    q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` (GQA: Hq a multiple of Hkv), cu_seqlens ``[n+1]``
    int (0 = cu_seqlens[0] <= ... <= cu_seqlens[n] = T; empty blocks are allowed) -> ``[T, Hq, D]``.
    ``sliding_window`` W (Mistral/Qwen2 style): query i sees keys j with i - W < j <= i.
    On CUDA uses ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention) when this torch
    has it and the dtype is half precision; elsewhere a per-sequence SDPA loop.
    ``softcap`` C (Gemma 2): scores become ``C * tanh(scores / C)`` before the softmax. The
    FlashAttention path has no soft-cap: on CUDA soft-capped attention runs as compiled
    FlexAttention (``flex_attention.py``), on a CPU (or if that fails) the reference loop
    (correct, not fast: it materialises ``[heads, L, L]`` per sequence). ``block_mask``: the
    FlexAttention mask of this ``cu_seqlens`` and window, built once per forward
    (``flex_attention.softcap_block_masks``); None builds it here.
    """
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[0] != k.shape[0]:
        raise ValueError(f"expected q [T, Hq, D], k/v [T, Hkv, D]; got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of kv heads {k.shape[1]}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap!r} must be > 0 or None")
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and softcap is None:
        out = _flash_varlen(q, k, v, cu_seqlens, scale, sliding_window, max_seqlen)
        if out is not None:
            return out
    if q.is_cuda and softcap is not None:
        out = flex_softcap_attention(q, k, v, cu_seqlens, scale=scale, softcap=softcap,
                                     sliding_window=sliding_window, block_mask=block_mask)
        if out is not None:
            return out
    return sdpa_varlen_loop(q, k, v, cu_seqlens, scale=scale, sliding_window=sliding_window, softcap=softcap)


def sdpa_varlen_loop(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Reference path: one causal SDPA call per sequence (cost is sum of L_i^2, not T^2);
    with ``softcap`` an explicit softmax over capped scores (SDPA has no soft-cap)."""
    bounds = cu_seqlens.tolist()  # host sync; fine for the CPU/reference path
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"cu_seqlens must start at 0, never decrease and end at T={q.shape[0]}; got {bounds}"
        )
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for start, end in zip(bounds, bounds[1:]):
        if end == start:  # an empty block (CUDA-graph padding of cu_seqlens to a fixed count)
            continue
        # SDPA wants [heads, L, D]
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        length = end - start
        if softcap is not None:
            outs.append(_softcapped_attention(qs, ks, vs, scale, softcap, sliding_window).transpose(0, 1))
            continue
        if sliding_window is not None and sliding_window < length:
            i = torch.arange(length, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, dim=0)


def _softcapped_attention(q, k, v, scale, softcap, sliding_window):
    """q ``[Hq, L, D]``, k/v ``[Hkv, L, D]`` -> ``[Hq, L, D]``: causal (and windowed) attention
    over ``softcap * tanh(q k^T * scale / softcap)``, softmax in fp32."""
    rep = q.shape[0] // k.shape[0]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    i = torch.arange(q.shape[1], device=q.device)
    allowed = i[None, :] <= i[:, None]
    if sliding_window is not None:
        allowed = allowed & (i[None, :] > i[:, None] - sliding_window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def _flash_varlen(q, k, v, cu_seqlens, scale, sliding_window, max_seqlen):
    """``varlen_attn`` across torch versions (2.10: ``is_causal``; later: ``window_size``,
    ``enable_gqa``); None when this torch has no usable variant."""
    if q.shape[-1] % 8 or q.shape[-1] > 256:  # FlashAttention's head-dim limits
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1 if sliding_window is None else sliding_window - 1, 0)
    elif "is_causal" in params and sliding_window is None:
        kwargs["is_causal"] = True
    else:
        return None
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        return None
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max())
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" not in params:
            return repeated_kv_attention(lambda k, v: varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs),
                                         k, v, q.shape[1] // k.shape[1])
        kwargs["enable_gqa"] = True
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


def repeated_kv_attention(attention, k: torch.Tensor, v: torch.Tensor, rep: int) -> torch.Tensor:
    """``attention(k', v')`` with k, v ``[T, Hkv, D]`` repeated ``rep`` times per head to the query
    heads (an attention without grouped heads). The repeated copies the attention keeps for
    backward are rebuilt there from k and v (``rebuilt_copies.py``): ``1 / rep`` of their bytes."""

    def repeat(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(rep, dim=1)

    k_rep, v_rep = repeat(k), repeat(v)
    with rebuilt_in_backward(k_rep, repeat, k), rebuilt_in_backward(v_rep, repeat, v):
        return attention(k_rep, v_rep)
