"""Prefill-time multi-adapter LoRA by row tiles, second form: options for the expand.

The same math, tables and contract as ``lora_segments`` (``SegmentLora``: row tiles of one
adapter each, offsets into the pool, a runtime rank per (projection, adapter), one compiled
variant for every rank mix, grids over the tile table's length), with:

- the shrink's grid putting the group's projections on the fastest axis (the programs reading
  one x tile run side by side and share it through L2), ranks in passes of ``shrink_rank``;
- the expand reading each output block before its rank work (the load in flight meanwhile),
  and as options: ``hold`` (the tile's S loaded once, K splits summed once, kept in registers
  over the program's column blocks: measured 27 % slower than re-reading it, register
  pressure), ``lowp`` (the dot in the pool's 16-bit dtype, S rounded to it), ``store_only``
  (write the delta into a buffer, read nothing: for a GEMM that adds it as its C input).

``tile_lora_add`` is a drop-in for ``segment_lora_add``'s Triton path (``form="tiles"``).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import triton
import triton.language as tl

from .segment_tables import (EXPAND_UNSPECIALISED, SHRINK_UNSPECIALISED, SegmentLora, segment_lora_reference,
                             shrink_tile)

# ranks held in one pass (S's register tile in the expand; the shrink's per-pass width) on CUDA;
# ranks <= SMALL_RANK use a tile of that width instead (less padding for ranks 4-32)
HELD_RANK_CUDA, HELD_RANK_INTERPRETER = 64, 32
SMALL_RANK_CUDA, SMALL_RANK_INTERPRETER = 32, 16
# column blocks per expand program: 4 (8: +7 %, 16: +26 % on the expand at 8,192 rows of the 8B
# layer on an H200, docs/BENCHMARKS.md "Prefill LoRA by row tiles")
TILE_EXPAND_BLOCKS = 4
# the shrink's K splits: one per TILE_SHRINK_K_PER_SPLIT of K, at most TILE_SHRINK_MAX_SPLITS
# (lora_segments' rule: 4 for every K >= 2,048). Measured on an H200 at the 8B layer, 8,192 rows:
# the shrink took 694 us in one split, 525-545 us with 1-4 by row blocks, 454 us with 4 splits
# and 32-rank passes (docs/BENCHMARKS.md "Prefill LoRA by row tiles").
# (serving/pool_sizing.py reserves S for lora_segments.SHRINK_MAX_SPLITS splits: at least this many)
TILE_SHRINK_K_PER_SPLIT, TILE_SHRINK_MAX_SPLITS = 512, 4

_SHRINK_UNSPECIALISED, _EXPAND_UNSPECIALISED = SHRINK_UNSPECIALISED, EXPAND_UNSPECIALISED


@triton.jit(do_not_specialize=_SHRINK_UNSPECIALISED)
def _tile_shrink_kernel(
    x_ptr, pool_ptr, tiles_ptr, a_off_ptr, rank_ptr, s_ptr, K, k_per_split, x_stride, n_tiles, a_g_stride,
    r_g_stride, s_g_stride, s_split_stride, s_width, G,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """S[split, g, rows of tile t, :rank] = x[rows, split's K range] A_g[:rank, range]^T (fp32).
    Program (g + G t, split): the group's projections of one tile are neighbours."""
    pid = tl.program_id(0)
    g = pid % G
    t = pid // G
    sp = tl.program_id(1)
    shrink_tile(x_ptr, pool_ptr, tiles_ptr, a_off_ptr, rank_ptr, s_ptr, t, g, sp, K, k_per_split, x_stride, n_tiles,
                a_g_stride, r_g_stride, s_g_stride, s_split_stride, s_width,
                BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION)


@triton.jit
def _held_s(s_ptr, offs_m, m_ok, rank, scale, s_width, s_split_stride, R: tl.constexpr, SPLIT: tl.constexpr):
    """scale * S[rows, :R] (ranks past ``rank`` zero), the K splits summed in a fixed order."""
    offs_r = tl.arange(0, R)
    s_ptrs = s_ptr + offs_m[:, None].to(tl.int64) * s_width + offs_r[None, :]
    s_ok = m_ok[:, None] & (offs_r < rank)[None, :]
    s = tl.load(s_ptrs, mask=s_ok, other=0.0)
    for sp in range(1, SPLIT):
        s += tl.load(s_ptrs + sp * s_split_stride, mask=s_ok, other=0.0)
    return s * scale


@triton.jit
def _store_block(out_ptrs, ok, y, acc, STORE_ONLY: tl.constexpr):
    """out = y + acc (one rounding), or acc alone with STORE_ONLY (a delta buffer, nothing read)."""
    if STORE_ONLY:
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=ok)
    else:
        tl.store(out_ptrs, (y + acc).to(out_ptrs.dtype.element_ty), mask=ok)


@triton.jit
def _load_block(out_ptrs, ok, STORE_ONLY: tl.constexpr):
    if STORE_ONLY:
        return tl.zeros(out_ptrs.shape, dtype=tl.float32)
    return tl.load(out_ptrs, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _expand_held(s, pool_ptr, b_off, rank, out_ptr, offs_m, m_ok, nb, N, out_stride, R: tl.constexpr,
                 BLOCK_N: tl.constexpr, N_BLOCKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 LOWP: tl.constexpr, STORE_ONLY: tl.constexpr):
    """out[rows, program's column blocks] += s [rows, R] B^T[:R, cols] (S held; LOWP: S rounded
    to the pool's dtype and B^T as stored, one 16-bit tensor-core dot)."""
    offs_r = tl.arange(0, R)
    r_ok = offs_r < rank
    if LOWP:
        s_dot = s.to(pool_ptr.dtype.element_ty)
    else:
        s_dot = s
    for j in range(N_BLOCKS):
        offs_n = (nb * N_BLOCKS + j) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * out_stride + offs_n[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        y = _load_block(out_ptrs, ok, STORE_ONLY)
        bt = tl.load(pool_ptr + b_off + offs_r[:, None] * N + offs_n[None, :],
                     mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        if LOWP:
            acc = tl.dot(s_dot, bt)
        else:
            acc = tl.dot(s_dot, bt.to(tl.float32), input_precision=DOT_PRECISION)
        _store_block(out_ptrs, ok, y, acc, STORE_ONLY)


@triton.jit
def _expand_chunks(s_ptr, pool_ptr, b_off, rank, scale, out_ptr, offs_m, m_ok, nb, N, out_stride, s_width,
                   s_split_stride, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   N_BLOCKS: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   LOWP: tl.constexpr, STORE_ONLY: tl.constexpr):
    """Per column block, the rank in chunks of R (S re-read per block); the output block is read
    before the chunks (its load in flight while they run)."""
    for j in range(N_BLOCKS):
        offs_n = (nb * N_BLOCKS + j) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * out_stride + offs_n[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        y = _load_block(out_ptrs, ok, STORE_ONLY)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rank, R):
            offs_r = r0 + tl.arange(0, R)
            r_ok = offs_r < rank
            s_ptrs = s_ptr + offs_m[:, None].to(tl.int64) * s_width + offs_r[None, :]
            s_ok = m_ok[:, None] & r_ok[None, :]
            s = tl.load(s_ptrs, mask=s_ok, other=0.0)
            for sp in range(1, SPLIT):
                s += tl.load(s_ptrs + sp * s_split_stride, mask=s_ok, other=0.0)
            bt = tl.load(pool_ptr + b_off + offs_r[:, None] * N + offs_n[None, :],
                         mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            if LOWP:
                acc += tl.dot(s.to(pool_ptr.dtype.element_ty), bt)
            else:
                acc += tl.dot(s, bt.to(tl.float32), input_precision=DOT_PRECISION)
        _store_block(out_ptrs, ok, y, acc * scale, STORE_ONLY)


@triton.jit(do_not_specialize=_EXPAND_UNSPECIALISED)
def _tile_expand_kernel(
    s_ptr, pool_ptr, tiles_ptr, b_off_ptr, rank_ptr, scale_ptr, out_ptr, N, out_stride, n_tiles, s_split_stride,
    s_width,
    BLOCK_M: tl.constexpr, SMALL_R: tl.constexpr, HELD_R: tl.constexpr, BLOCK_N: tl.constexpr,
    N_BLOCKS: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, HOLD: tl.constexpr,
    LOWP: tl.constexpr, STORE_ONLY: tl.constexpr,
):
    """out[rows of tile t, N_BLOCKS column blocks] += scale * S[rows, :rank] B^T[:rank, cols]
    (fp32 sum of the output and the delta, one rounding; STORE_ONLY: out = the delta). HOLD:
    ranks up to HELD_R load S once (SMALL_R wide when the rank fits it), above that chunks of
    HELD_R per column block; not HOLD: chunks of SMALL_R per column block for every rank."""
    t = tl.program_id(0)
    nb = tl.program_id(1)
    start = tl.load(tiles_ptr + t)
    end = tl.load(tiles_ptr + n_tiles + t)
    ad = tl.load(tiles_ptr + 2 * n_tiles + t)
    rank = tl.minimum(tl.load(rank_ptr + tl.maximum(ad, 0), mask=ad >= 0, other=0), s_width)  # -1: no LoRA
    if (end > start) & (rank > 0):
        b_off = tl.load(b_off_ptr + ad)
        scale = tl.load(scale_ptr + ad)
        offs_m = start + tl.arange(0, BLOCK_M)
        m_ok = offs_m < end
        # (each branch names its own tensors: Triton merges names both branches of an if define)
        if not HOLD:
            _expand_chunks(s_ptr, pool_ptr, b_off, rank, scale, out_ptr, offs_m, m_ok, nb, N, out_stride,
                           s_width, s_split_stride, SMALL_R, BLOCK_M, BLOCK_N, N_BLOCKS, SPLIT, DOT_PRECISION,
                           LOWP, STORE_ONLY)
        elif rank <= SMALL_R:
            s_small = _held_s(s_ptr, offs_m, m_ok, rank, scale, s_width, s_split_stride, SMALL_R, SPLIT)
            _expand_held(s_small, pool_ptr, b_off, rank, out_ptr, offs_m, m_ok, nb, N, out_stride, SMALL_R,
                         BLOCK_N, N_BLOCKS, DOT_PRECISION, LOWP, STORE_ONLY)
        else:
            if rank <= HELD_R:
                s_held = _held_s(s_ptr, offs_m, m_ok, rank, scale, s_width, s_split_stride, HELD_R, SPLIT)
                _expand_held(s_held, pool_ptr, b_off, rank, out_ptr, offs_m, m_ok, nb, N, out_stride, HELD_R,
                             BLOCK_N, N_BLOCKS, DOT_PRECISION, LOWP, STORE_ONLY)
            else:
                _expand_chunks(s_ptr, pool_ptr, b_off, rank, scale, out_ptr, offs_m, m_ok, nb, N, out_stride,
                               s_width, s_split_stride, HELD_R, BLOCK_M, BLOCK_N, N_BLOCKS, SPLIT, DOT_PRECISION,
                               LOWP, STORE_ONLY)


def held_ranks(device: torch.device) -> tuple[int, int]:
    """(SMALL_R, HELD_R) on ``device``: the two S tile widths the expand holds."""
    if device.type == "cuda":
        return SMALL_RANK_CUDA, HELD_RANK_CUDA
    return SMALL_RANK_INTERPRETER, HELD_RANK_INTERPRETER


def tile_shrink_splits(k: int, rows: int, block_m: int, projections: int) -> int:
    """K splits of the shrink: one per TILE_SHRINK_K_PER_SPLIT of K, at most
    TILE_SHRINK_MAX_SPLITS (a fixed function of the shapes: a captured launch keeps it; ``rows``,
    ``block_m`` and ``projections`` are for rules that count programs, measured slower)."""
    del rows, block_m, projections
    return max(1, min(TILE_SHRINK_MAX_SPLITS, k // TILE_SHRINK_K_PER_SPLIT))


def tile_launches(x: torch.Tensor, lora: SegmentLora, outs: Sequence[torch.Tensor], *, n_blocks: int | None = None,
                  split_k: int | None = None, warps: tuple[int | None, int | None] = (None, None),
                  hold: bool = False, lowp: bool = False, store_only: bool = False,
                  shrink_rank: int | None = None) -> list[tuple]:
    """``(kernel, grid, args, keywords)`` of ``tile_lora_add``: the shrink, then one expand per
    projection (none for an empty tile table). Allocates S."""
    n_tiles = lora.tiles.shape[1]
    if n_tiles == 0:
        return []
    x = x if x.stride(1) == 1 else x.contiguous()
    g, rows, k = lora.num_projections, x.shape[0], x.shape[1]
    block_m, block_r = lora.block_m, lora.block_r
    small, held = held_ranks(x.device)
    block_k = 64 if x.is_cuda else 16
    split = tile_shrink_splits(k, rows, block_m, g) if split_k is None else split_k
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    s = torch.empty(split, g, rows, block_r, dtype=torch.float32, device=x.device)
    precision = "tf32" if x.is_cuda and x.dtype != torch.float32 else "ieee"
    launches = [(_tile_shrink_kernel, (g * n_tiles, split), (
        x, lora.pool, lora.tiles, lora.a_offsets, lora.ranks, s, k, k_per_split, x.stride(0), n_tiles,
        lora.a_offsets.stride(0), lora.ranks.stride(0), s.stride(1), s.stride(0), block_r, g),
        dict(BLOCK_M=block_m, BLOCK_R=shrink_rank or small, BLOCK_K=block_k, DOT_PRECISION=precision,
             **({} if warps[0] is None else {"num_warps": warps[0]})))]
    block_n = 128 if x.is_cuda else 32
    for i, y in enumerate(outs):
        n = y.shape[1]
        per = max(1, min(TILE_EXPAND_BLOCKS if n_blocks is None else n_blocks, triton.cdiv(n, block_n)))
        launches.append((_tile_expand_kernel, (n_tiles, triton.cdiv(n, block_n * per)), (
            s[:, i], lora.pool, lora.tiles, lora.b_offsets[i], lora.ranks[i], lora.scales, y, n, y.stride(0),
            n_tiles, s.stride(0), block_r),
            dict(BLOCK_M=block_m, SMALL_R=small, HELD_R=held, BLOCK_N=block_n, N_BLOCKS=per, SPLIT=split,
                 DOT_PRECISION=precision, HOLD=hold, LOWP=lowp, STORE_ONLY=store_only,
                 **({} if warps[1] is None else {"num_warps": warps[1]}))))
    return launches


def tile_lora_add(x: torch.Tensor, lora: SegmentLora, outs: Sequence[torch.Tensor], *, backend: str = "triton",
                  check: bool = True, n_blocks: int | None = None, split_k: int | None = None,
                  warps: tuple[int | None, int | None] = (None, None), hold: bool = False, lowp: bool = False,
                  store_only: bool = False, shrink_rank: int | None = None) -> None:
    """``outs[g] +=`` the prefill rows' LoRA of projection g, in place (``segment_lora_add``'s
    contract). ``backend`` "torch": the reference; "triton": these kernels (CUDA, or the CPU
    under TRITON_INTERPRET=1). ``n_blocks``: column blocks per expand program (default
    ``TILE_EXPAND_BLOCKS``); ``split_k``: the shrink's K splits (default ``tile_shrink_splits``);
    ``warps``: the shrink's and the expand's num_warps (None: Triton's default); ``hold``: S
    loaded once per expand program (ranks up to ``HELD_R``) instead of per column block;
    ``lowp``: the expand's dot in the pool's 16-bit dtype (S rounded to it); ``store_only``:
    ``outs[g] =`` the delta, nothing read (rows outside every tile are not written);
    ``shrink_rank``: ranks per shrink pass (default the small held width, 32 on CUDA)."""
    if backend == "torch":
        if store_only:
            for y in outs:
                y.zero_()
        segment_lora_reference(x, lora, outs)
        return
    if backend != "triton":
        raise ValueError(f"backend={backend!r}; allowed: torch, triton")
    if check:
        lora.check(x, outs)
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"the row-tile LoRA kernels need CUDA tensors (got x on {x.device}); use backend='torch' "
                           "on the CPU, or set TRITON_INTERPRET=1")
    for kernel, grid, args, meta in tile_launches(x, lora, outs, n_blocks=n_blocks, split_k=split_k, warps=warps,
                                                  hold=hold, lowp=lowp, store_only=store_only,
                                                  shrink_rank=shrink_rank):
        kernel[grid](*args, **meta)


def tile_shrink(x: torch.Tensor, lora: SegmentLora, *, split_k: int | None = None) -> torch.Tensor | None:
    """Only the shrink of ``tile_lora_add``: ``S [split, G, T, block_r]`` fp32 (None for an empty
    tile table), for an expand fused elsewhere (``lora_linear``)."""
    launches = tile_launches(x, lora, [], split_k=split_k)
    for kernel, grid, args, meta in launches:
        kernel[grid](*args, **meta)
    return launches[0][2][5] if launches else None
