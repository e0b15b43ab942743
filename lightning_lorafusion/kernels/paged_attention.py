"""Decode attention over the paged KV cache (one query token per row, GQA, sliding window).

KV pool layout ``kv_pool [P, L, 2, S, Hkv, D]``: P pages of S consecutive tokens of one
sequence, holding that token range's keys (index 0) and values (index 1) for all L layers.
Row b's tokens 0..seq_lens[b]-1 live in pages ``page_table[b, 0..]`` in order; token t sits
in page ``page_table[b, t // S]`` at slot ``t % S``. Inference only (no autograd).
"""

from __future__ import annotations

import math
import os

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("torch", "triton", "auto")


def _check_pool(kv_pool, layer) -> None:
    if not isinstance(kv_pool, torch.Tensor) or kv_pool.dim() != 6 or kv_pool.shape[2] != 2:
        raise ValueError(
            f"kv_pool must be [pages, layers, 2, page_size, kv_heads, head_dim]; got "
            f"{getattr(kv_pool, 'shape', type(kv_pool))}"
        )
    if kv_pool.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"kv_pool.dtype={kv_pool.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if not isinstance(layer, int) or not 0 <= layer < kv_pool.shape[1]:
        raise ValueError(f"layer={layer!r} is not in [0, {kv_pool.shape[1]})")


def _check_inputs(q, kv_pool, layer, page_table, seq_lens, scale, sliding_window) -> None:
    """Shapes, dtypes and devices only: no value is read (no device sync, CUDA-graph safe)."""
    _check_pool(kv_pool, layer)
    _, _, _, _, hkv, d = kv_pool.shape
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[2] != d:
        raise ValueError(f"q must be [rows, q_heads, {d}] (head_dim of kv_pool); got {getattr(q, 'shape', type(q))}")
    if q.dtype != kv_pool.dtype or q.device != kv_pool.device:
        raise TypeError(f"q is {q.dtype} on {q.device} but kv_pool is {kv_pool.dtype} on {kv_pool.device}")
    b, hq, _ = q.shape
    if hq % hkv:
        raise ValueError(f"q has {hq} heads, not a multiple of the pool's {hkv} kv heads (GQA)")
    if (
        not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or page_table.shape[0] != b
        or page_table.shape[1] < 1 or page_table.dtype != torch.int32 or page_table.device != q.device
    ):
        raise ValueError(
            f"page_table must be a [{b}, max_pages >= 1] int32 tensor on {q.device}; got "
            f"{getattr(page_table, 'shape', type(page_table))} {getattr(page_table, 'dtype', '')}"
        )
    if (
        not isinstance(seq_lens, torch.Tensor) or seq_lens.shape != (b,)
        or seq_lens.dtype != torch.int32 or seq_lens.device != q.device
    ):
        raise ValueError(
            f"seq_lens must be a [{b}] int32 tensor on {q.device}; got "
            f"{getattr(seq_lens, 'shape', type(seq_lens))} {getattr(seq_lens, 'dtype', '')}"
        )
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number (usually head_dim ** -0.5); got {scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int; got {sliding_window!r}")


@torch.no_grad()
def paged_decode_attention_reference(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of each row's newest token over its cached tokens: ``[B, Hq, D]`` in q.dtype.

    q ``[B, Hq, D]``; page_table ``[B, max_pages]`` int32 (entries past a row's last page are
    ignored, any value); seq_lens ``[B]`` int32 >= 1, the cached tokens including the current
    one. Query head h reads kv head ``h // (Hq // Hkv)``. Scores ``scale * q.k`` and softmax
    in fp32; with ``sliding_window`` W only the last W tokens (positions >= seq_len - W) count.
    Gathers the pages of the longest row for every row (reads seq_lens on the host: a sync).
    """
    _check_inputs(q, kv_pool, layer, page_table, seq_lens, scale, sliding_window)
    b, hq, d = q.shape
    s, hkv = kv_pool.shape[3], kv_pool.shape[4]
    max_len = int(seq_lens.max()) if b else 0
    if b and int(seq_lens.min()) < 1:
        raise ValueError(f"seq_lens must be >= 1 (the current token is cached); got {seq_lens.tolist()}")
    n_pages = -(-max_len // s)
    if n_pages > page_table.shape[1]:
        raise ValueError(f"seq_lens need {n_pages} pages but page_table has {page_table.shape[1]} columns")
    pos = torch.arange(n_pages * s, device=q.device)
    lens = seq_lens.long()[:, None]
    valid = pos[None, :] < lens  # [B, T]
    if sliding_window is not None:
        valid &= pos[None, :] >= lens - sliding_window
    used = torch.arange(n_pages, device=q.device)[None, :] * s < lens  # pages holding tokens
    pages = torch.where(used, page_table[:, :n_pages].long(), 0)
    if bool(((pages < 0) | (pages >= kv_pool.shape[0])).any()):
        raise ValueError(f"page_table holds page ids outside [0, {kv_pool.shape[0]}) within seq_lens")
    kv = kv_pool[:, layer][pages]  # [B, n_pages, 2, S, Hkv, D]
    k = kv[:, :, 0].reshape(b, n_pages * s, hkv, d).float()
    v = kv[:, :, 1].reshape(b, n_pages * s, hkv, d).float()
    qg = q.float().view(b, hkv, hq // hkv, d)
    scores = torch.einsum("bhgd,bthd->bhgt", qg, k) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgt,bthd->bhgd", probs, v)
    return out.reshape(b, hq, d).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Same contract as ``paged_decode_attention_reference``; ``backend``: "torch" (the
    reference), "triton" (CUDA, or CPU under TRITON_INTERPRET=1) or "auto" (Triton on CUDA).
    The Triton path reads no value on the host (CUDA-graph safe)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {BACKENDS}")
    if backend == "auto":
        backend = "triton" if q.is_cuda else "torch"
    if backend == "torch":
        return paged_decode_attention_reference(
            q, kv_pool, layer, page_table, seq_lens, scale=scale, sliding_window=sliding_window
        )
    raise NotImplementedError("the Triton decode-attention kernel is being written; use backend='torch'")


def write_kv(
    kv_pool: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_pages: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """Scatter new tokens' keys and values into their pages, in place.

    k, v ``[T, Hkv, D]``; token t goes to ``kv_pool[slot_pages[t], layer, 0 / 1,
    slot_offsets[t]]``. slot_pages / slot_offsets ``[T]`` integer tensors on the pool's
    device. Two index_put ops; no host sync, so it can be captured in a CUDA graph.
    """
    _check_pool(kv_pool, layer)
    shape = (kv_pool.shape[4], kv_pool.shape[5])
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != shape:
            raise ValueError(f"{name} must be [tokens, {shape[0]}, {shape[1]}]; got {getattr(t, 'shape', type(t))}")
        if t.device != kv_pool.device:
            raise ValueError(f"{name} is on {t.device} but kv_pool is on {kv_pool.device}")
    n = k.shape[0]
    for name, t in (("slot_pages", slot_pages), ("slot_offsets", slot_offsets)):
        if (
            not isinstance(t, torch.Tensor) or t.shape != (n,) or t.dtype not in (torch.int32, torch.int64)
            or t.device != kv_pool.device
        ):
            raise ValueError(f"{name} must be a [{n}] int32/int64 tensor on {kv_pool.device}; got {getattr(t, 'shape', t)}")
    if v.shape[0] != n:
        raise ValueError(f"k has {n} tokens but v has {v.shape[0]}")
    pages, offsets = slot_pages.long(), slot_offsets.long()
    kv_pool[:, layer, 0][pages, offsets] = k.to(kv_pool.dtype)
    kv_pool[:, layer, 1][pages, offsets] = v.to(kv_pool.dtype)
