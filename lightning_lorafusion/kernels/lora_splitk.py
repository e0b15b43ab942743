"""Prefill-time multi-adapter LoRA by row tiles, third form: K split by the step's size, the splits
summed once in the shrink, the expand by (tile, column block).

The same math, tables and contract as ``lora_segments`` (``SegmentLora``: row tiles of one
adapter each, offsets into the pool, a runtime rank per (projection, adapter), one compiled
variant for every rank mix, padding tiles do nothing, nothing read on the host). What differs:

- the shrink splits K as many ways as the step needs to give the GPU enough programs (a
  256-row prompt has 4 tiles: with K split in 4, a down projection's 16 programs each walked
  3,584 of K in one chain), a runtime count chosen from the step's rows (``shrink_split``:
  nothing compiled per count);
- the splits' fp32 partials are summed once, in the shrink, by the program of a (tile,
  projection) that finishes last (a counter per (tile, projection), ``atomic_add``; the sum is
  in split order whatever the arrival order, so the result is deterministic): the expand reads
  one S instead of every split's partial for each of its column blocks;
- the expand's item is (tile, ``n_blocks`` column blocks of ``BLOCK_N``), S read once per block
  (or its first rank chunk held over the blocks, ``hold``).

Both launches walk items ``pid, pid + P, ...`` over the live tiles (``SegmentLora.live`` or the
whole table), ``P`` a runtime choice (a program per item, or a fixed number per SM).
``splitk_lora_add`` is a drop-in for ``segment_lora_add``'s Triton path (``form="splitk"``).
The counters (``[tiles * G]`` int32) must be zero before a launch; the shrink leaves them zero.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import triton
import triton.language as tl

from . import triton_launch
from .segment_tables import SegmentLora, shrink_chunk, store_delta, tile_header

# K per split at least (4 chunks of BLOCK_K 64), and the shrink's programs the split aims at, per SM
SPLIT_MIN_K = 256
SPLIT_TARGET_PER_SM = 4
# the fp32 partials' rows (splits x projections x rows) a call may use: what 4 splits of 3
# projections of a 4,096-row step take (serving/pool_sizing.py reserves S for this many)
SPLIT_ROW_BUDGET = 4 * 3 * 4096
# SMs assumed off CUDA (the interpreter), so that small test steps still split K
INTERPRETER_SMS = 2
# programs per SM of the shrink and the expand on CUDA (0: a program per item of the table, those
# past the live tiles exiting at once); in the interpreter, which runs programs one by one in
# Python, a few programs walk the items instead
PROGRAMS_PER_SM = (0, 0)
PROGRAMS_PER_SM_INTERPRETER = (2, 2)
# the expand holds S's first rank chunk in registers over its column blocks (two dot sites:
# twice the shared memory of reading every chunk per block)
HOLD_S = False
# column blocks per expand item; num_stages of the shrink and the expand (None: Triton's)
EXPAND_BLOCKS = 1
STAGES = (None, None)
# the expand's column block and rank chunk on CUDA / in the interpreter
BLOCK_N_CUDA, BLOCK_N_INTERPRETER = 128, 32
RANK_CHUNK_CUDA, RANK_CHUNK_INTERPRETER = 32, 16

_SHRINK_UNSPECIALISED = ("tiles_ptr", "live_ptr", "a_off_ptr", "rank_ptr", "cnt_ptr", "n_tiles", "n_split",
                         "k_per_split", "a_g_stride", "r_g_stride", "s_g_stride", "s_split_stride", "s_width", "G")
_EXPAND_UNSPECIALISED = ("tiles_ptr", "live_ptr", "b_off_ptr", "rank_ptr", "scale_ptr", "n_tiles", "n_col",
                         "n_blocks", "s_width")


@triton.jit
def _shrink_item(
    x_ptr, pool_ptr, tiles_ptr, a_off_ptr, rank_ptr, s_ptr, cnt_ptr, t, g, sp, n_split, K, k_per_split, x_stride,
    n_tiles, a_g_stride, r_g_stride, s_g_stride, s_split_stride, s_width,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FACTOR_ALIGN: tl.constexpr,
):
    """Partial[sp, g, rows of tile t, :rank] = x[rows, sp's K range] A_g[:rank, range]^T (fp32);
    the last of the tile's n_split programs for g sums the partials in split order into
    partial[0] (= S) and resets the counter."""
    start, end, adc, rank = tile_header(tiles_ptr, rank_ptr, g, r_g_stride, t, n_tiles, s_width)
    if (end > start) & (rank > 0):
        a_off = tl.multiple_of(tl.load(a_off_ptr + g * a_g_stride + adc), FACTOR_ALIGN)
        offs_m = start + tl.arange(0, BLOCK_M)
        m_ok = offs_m < end
        k_lo = tl.multiple_of(sp * k_per_split, BLOCK_K)  # (k_per_split: a multiple of BLOCK_K)
        k_hi = tl.minimum(k_lo + k_per_split, K)
        # S's width and the projections' stride are multiples of 16 (vector stores and loads)
        rows = s_ptr + tl.multiple_of(g * s_g_stride, 16) + tl.multiple_of(offs_m.to(tl.int64) * s_width, 16)[:, None]
        for r0 in range(0, rank, BLOCK_R):
            acc, offs_r, r_ok = shrink_chunk(x_ptr, pool_ptr, a_off, offs_m, m_ok, r0, rank, k_lo, k_hi, K, x_stride,
                                             BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
                                             DOT_PRECISION=DOT_PRECISION)
            tl.store(rows + sp * s_split_stride + offs_r[None, :], acc, mask=m_ok[:, None] & r_ok[None, :])
        if n_split > 1:
            # every thread's partial stored before the one release below (threadfence-reduction order)
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + g * n_tiles + t, 1, sem="acq_rel", scope="gpu")
            if arrived == n_split - 1:  # the last of the tile's programs for g: sum in split order
                for r0 in range(0, rank, BLOCK_R):
                    offs_r = r0 + tl.arange(0, BLOCK_R)
                    ok = m_ok[:, None] & (offs_r < rank)[None, :]
                    ptrs = rows + offs_r[None, :]
                    acc = tl.load(ptrs, mask=ok, other=0.0, cache_modifier=".cg")
                    for j in range(1, n_split):
                        acc += tl.load(ptrs + j * s_split_stride, mask=ok, other=0.0, cache_modifier=".cg")
                    tl.store(ptrs, acc, mask=ok)
                tl.atomic_xchg(cnt_ptr + g * n_tiles + t, 0)


@triton.jit(do_not_specialize=_SHRINK_UNSPECIALISED)
def _splitk_shrink_kernel(
    x_ptr, pool_ptr, tiles_ptr, live_ptr, a_off_ptr, rank_ptr, s_ptr, cnt_ptr, K, k_per_split, n_split, x_stride,
    n_tiles, a_g_stride, r_g_stride, s_g_stride, s_split_stride, s_width, G,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_LIVE: tl.constexpr, FACTOR_ALIGN: tl.constexpr,
):
    """Items (tile, K split, projection), projection fastest (the programs reading one x block
    run side by side), walked ``pid, pid + P, ...`` over the live tiles."""
    n_live = n_tiles
    if HAS_LIVE:
        n_live = tl.minimum(tl.load(live_ptr), n_tiles)
    per_tile = G * n_split
    for item in range(tl.program_id(0), n_live * per_tile, tl.num_programs(0)):
        t = item // per_tile
        rest = item - t * per_tile
        sp = rest // G
        g = rest - sp * G
        _shrink_item(x_ptr, pool_ptr, tiles_ptr, a_off_ptr, rank_ptr, s_ptr, cnt_ptr, t, g, sp, n_split, K,
                     k_per_split, x_stride, n_tiles, a_g_stride, r_g_stride, s_g_stride, s_split_stride, s_width,
                     BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION,
                     FACTOR_ALIGN=FACTOR_ALIGN)


@triton.jit
def _expand_item(
    s_ptr, pool_ptr, tiles_ptr, b_off_ptr, rank_ptr, scale_ptr, out_ptr, t, c, n_blocks, N, out_stride, n_tiles,
    s_width,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ACCUMULATE: tl.constexpr, HOLD_S: tl.constexpr, FACTOR_ALIGN: tl.constexpr,
):
    """out[rows of tile t, column blocks c * n_blocks ...] (+)= scale * S[rows, :rank] Bt[:rank, cols]
    (fp32 sum, one rounding), the rank in chunks of BLOCK_R. HOLD_S: S's first rank chunk is
    loaded once and held over the column blocks (further chunks read per block); else every
    chunk is read per block (one dot in the loop: half the shared memory). Not ACCUMULATE
    (write-first): the delta is written, zeros on tiles of rank 0 or adapter -1."""
    start, end, adc, rank = tile_header(tiles_ptr, rank_ptr, 0, 0, t, n_tiles, s_width)
    live = end > start
    if ACCUMULATE:
        live = live & (rank > 0)
    if live:
        b_off = tl.multiple_of(tl.load(b_off_ptr + adc, mask=rank > 0, other=0), FACTOR_ALIGN)
        scale = tl.load(scale_ptr + adc, mask=rank > 0, other=0.0)
        offs_m = start + tl.arange(0, BLOCK_M)
        m_ok = offs_m < end
        s_rows = s_ptr + tl.multiple_of(offs_m.to(tl.int64) * s_width, 16)[:, None]
        if HOLD_S:
            offs_r = tl.arange(0, BLOCK_R)
            r_ok = offs_r < rank
            s0 = tl.load(s_rows + offs_r[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        for j in range(0, n_blocks):
            offs_n = (c * n_blocks + j) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < N
            if HOLD_S:
                bt = tl.load(pool_ptr + b_off + offs_r[:, None] * N + offs_n[None, :],
                             mask=r_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
                acc = tl.dot(s0, bt, input_precision=DOT_PRECISION)
                r_next = BLOCK_R
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                r_next = 0
            for r0 in range(r_next, rank, BLOCK_R):
                offs_q = r0 + tl.arange(0, BLOCK_R)
                q_ok = offs_q < rank
                s = tl.load(s_rows + offs_q[None, :], mask=m_ok[:, None] & q_ok[None, :], other=0.0)
                bq = tl.load(pool_ptr + b_off + offs_q[:, None] * N + offs_n[None, :],
                             mask=q_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
                acc += tl.dot(s, bq, input_precision=DOT_PRECISION)
            store_delta(out_ptr, offs_m, m_ok, offs_n, n_ok, out_stride, acc, scale, ACCUMULATE=ACCUMULATE)


@triton.jit(do_not_specialize=_EXPAND_UNSPECIALISED)
def _splitk_expand_kernel(
    s_ptr, pool_ptr, tiles_ptr, live_ptr, b_off_ptr, rank_ptr, scale_ptr, out_ptr, N, out_stride, n_tiles, n_col,
    n_blocks, s_width,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ACCUMULATE: tl.constexpr, HAS_LIVE: tl.constexpr, HOLD_S: tl.constexpr, FACTOR_ALIGN: tl.constexpr,
):
    """Items (column group, tile), tile fastest (neighbouring programs share an adapter's Bt
    block), walked ``pid, pid + P, ...`` over the live tiles."""
    n_live = n_tiles
    if HAS_LIVE:
        n_live = tl.minimum(tl.load(live_ptr), n_tiles)
    for item in range(tl.program_id(0), n_live * n_col, tl.num_programs(0)):
        c = item // n_live
        t = item - c * n_live
        _expand_item(s_ptr, pool_ptr, tiles_ptr, b_off_ptr, rank_ptr, scale_ptr, out_ptr, t, c, n_blocks, N,
                     out_stride, n_tiles, s_width, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N,
                     DOT_PRECISION=DOT_PRECISION, ACCUMULATE=ACCUMULATE, HOLD_S=HOLD_S,
                     FACTOR_ALIGN=FACTOR_ALIGN)


def sm_count(device: torch.device) -> int:
    """The device's SMs (``INTERPRETER_SMS`` off CUDA)."""
    return triton_launch.sm_count(device, off_cuda=INTERPRETER_SMS)


def shrink_split(k: int, groups: int, rows: int, block_m: int, sms: int) -> int:
    """K splits of the shrink for a step of ``rows`` rows (tiles of ``block_m``) and ``groups``
    projections: enough that tiles x projections x splits reach ``SPLIT_TARGET_PER_SM`` programs
    per SM, at least ``SPLIT_MIN_K`` of K each, the partials within ``SPLIT_ROW_BUDGET`` rows."""
    tiles = max(1, triton.cdiv(rows, block_m))
    want = triton.cdiv(SPLIT_TARGET_PER_SM * sms, groups * tiles)
    return max(1, min(want, k // SPLIT_MIN_K, SPLIT_ROW_BUDGET // max(1, groups * rows)))


def splitk_lora_add(x: torch.Tensor, lora: SegmentLora, outs: Sequence[torch.Tensor], *, check: bool = True,
                    accumulate: bool = True, split_k: int | None = None, n_blocks: int | None = None,
                    programs: tuple[int, int] | None = None, block_n: int | None = None, rank_chunk: int | None = None,
                    warps: tuple[int | None, int | None] = (None, None), block_k: int | None = None,
                    stages: tuple[int | None, int | None] | None = None, hold: bool | None = None,
                    counters: torch.Tensor | None = None) -> None:
    """``outs[g]`` (+)= the prefill rows' LoRA of projection g (``segment_lora_add``'s contract;
    ``accumulate=False`` writes first). ``split_k``: the shrink's K splits (None:
    ``shrink_split``); ``n_blocks``: column blocks per expand item (None: ``EXPAND_BLOCKS``); ``programs``: programs per SM
    of the shrink and the expand (0: a program per item of the table, those past the live tiles
    exiting at once; -1: a program per item of the tiles ``rows / block_m`` would fill, walking
    further items if the live tiles are more; None: ``PROGRAMS_PER_SM``, in the interpreter ``PROGRAMS_PER_SM_INTERPRETER``); ``block_n`` / ``rank_chunk``: the expand's column block and the rank chunk of
    both (None: the device's defaults); ``warps`` / ``stages``: the shrink's and the expand's
    ``num_warps`` / ``num_stages`` (None: Triton's; ``stages`` None: ``STAGES``); ``block_k``: the shrink's K block;
    ``hold``: the expand holds S's first rank chunk over its column blocks (None: ``HOLD_S``);
    ``counters``: ``[tiles * G]`` int32 zeros the shrink leaves zero (None: ``lora.counters``, or
    allocated zeroed here)."""
    if check:
        lora.check(x, outs)
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"the Triton path needs CUDA tensors (got x on {x.device}); set TRITON_INTERPRET=1 "
                           "on the CPU")
    for kernel, grid, args, meta in splitk_launches(x, lora, outs, accumulate=accumulate, split_k=split_k,
                                                    n_blocks=n_blocks, programs=programs, block_n=block_n,
                                                    rank_chunk=rank_chunk, warps=warps, block_k=block_k,
                                                    stages=stages, hold=hold, counters=counters):
        kernel[grid](*args, **meta)


def splitk_launches(x: torch.Tensor, lora: SegmentLora, outs: Sequence[torch.Tensor], *, accumulate: bool = True,
                    split_k: int | None = None, n_blocks: int | None = None,
                    programs: tuple[int, int] | None = None,
                    block_n: int | None = None, rank_chunk: int | None = None,
                    warps: tuple[int | None, int | None] = (None, None), block_k: int | None = None,
                    stages: tuple[int | None, int | None] | None = None, hold: bool | None = None,
                    counters: torch.Tensor | None = None) -> list[tuple]:
    """``(kernel, grid, args, keywords)`` of ``splitk_lora_add``: the shrink, then one expand per
    projection (none for an empty table). Allocates the partials (and the counters if None)."""
    if lora.tiles.shape[1] == 0:
        return []
    cuda = x.is_cuda
    if programs is None:
        programs = PROGRAMS_PER_SM if cuda else PROGRAMS_PER_SM_INTERPRETER
    n_blocks = EXPAND_BLOCKS if n_blocks is None else n_blocks
    stages = STAGES if stages is None else stages
    hold = HOLD_S if hold is None else hold
    shrink, s = splitk_shrink_launch(x, lora, split_k=split_k, programs=programs[0], rank_chunk=rank_chunk,
                                     warps=warps[0], block_k=block_k, stages=stages[0], counters=counters)
    n_tiles, width, block_m = lora.tiles.shape[1], lora.block_r, lora.block_m
    chunk = rank_chunk or (RANK_CHUNK_CUDA if cuda else RANK_CHUNK_INTERPRETER)
    precision = "tf32" if cuda and x.dtype != torch.float32 else "ieee"
    live = lora.live
    live_arg = live if live is not None else lora.tiles  # (never read without HAS_LIVE)
    launches = [shrink]
    bn = block_n or (BLOCK_N_CUDA if cuda else BLOCK_N_INTERPRETER)
    for i, y in enumerate(outs):
        n = y.shape[1]
        per = max(1, min(n_blocks, triton.cdiv(n, bn)))
        n_col = triton.cdiv(n, bn * per)
        launches.append((_splitk_expand_kernel, _grid(n_tiles, n_col, x.shape[0], block_m, programs[1], x.device),
                         (s[0, i], lora.pool, lora.tiles, live_arg, lora.b_offsets[i], lora.ranks[i], lora.scales, y,
                          n, y.stride(0), n_tiles, n_col, per, width),
                         dict(BLOCK_M=block_m, BLOCK_R=chunk, BLOCK_N=bn, DOT_PRECISION=precision,
                              ACCUMULATE=accumulate, HAS_LIVE=live is not None, HOLD_S=hold,
                              FACTOR_ALIGN=lora.factor_align,
                              **_options(warps[1], stages[1]))))
    return launches


def _grid(n_tiles: int, per_tile: int, rows: int, block_m: int, per_sm: int, device: torch.device) -> tuple[int]:
    """Programs walking ``n_tiles x per_tile`` items: ``per_sm`` per SM; 0: one per item; -1: one
    per item of as many tiles as the rows fill (more live tiles: walked)."""
    items = n_tiles * per_tile
    if per_sm == 0:
        return (max(1, items),)
    if per_sm < 0:
        return (max(1, min(n_tiles, triton.cdiv(rows, block_m)) * per_tile),)
    return (max(1, min(items, per_sm * sm_count(device))),)


def splitk_shrink_launch(x: torch.Tensor, lora: SegmentLora, *, split_k: int | None = None, programs: int = 0,
                         rank_chunk: int | None = None, warps: int | None = None, block_k: int | None = None,
                         stages: int | None = None, counters: torch.Tensor | None = None
                         ) -> tuple[tuple, torch.Tensor]:
    """The split-K shrink's launch ``(kernel, grid, args, keywords)`` (``programs`` per SM, see
    ``_grid``) and its scratch ``[splits, G, rows, block_r]`` fp32: after the launch, split 0's
    slot holds S (the splits summed). Allocates the scratch (and the counters if None and
    ``lora.counters`` is None)."""
    x = x if x.stride(1) == 1 else x.contiguous()
    cuda = x.is_cuda
    n_tiles = lora.tiles.shape[1]
    g, rows, k = lora.num_projections, x.shape[0], x.shape[1]
    block_m, width = lora.block_m, lora.block_r
    chunk = rank_chunk or (RANK_CHUNK_CUDA if cuda else RANK_CHUNK_INTERPRETER)
    block_k = block_k or (64 if cuda else 16)
    split = shrink_split(k, g, rows, block_m, sm_count(x.device)) if split_k is None else split_k
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty split: each must arrive at the counter
    s = torch.empty(split, g, rows, width, dtype=torch.float32, device=x.device)
    counters = lora.counters if counters is None else counters
    if counters is None:
        counters = torch.zeros(n_tiles * g, dtype=torch.int32, device=x.device)
    elif counters.numel() < n_tiles * g or counters.dtype != torch.int32:
        raise ValueError(f"counters must hold {n_tiles * g} int32 zeros; got {counters.numel()} {counters.dtype}")
    precision = "tf32" if cuda and x.dtype != torch.float32 else "ieee"
    live = lora.live
    live_arg = live if live is not None else lora.tiles  # (never read without HAS_LIVE)
    launch = (_splitk_shrink_kernel, _grid(n_tiles, g * split, rows, block_m, programs, x.device),
              (x, lora.pool, lora.tiles, live_arg, lora.a_offsets, lora.ranks, s, counters, k, k_per_split, split,
               x.stride(0), n_tiles, lora.a_offsets.stride(0), lora.ranks.stride(0), s.stride(1), s.stride(0),
               width, g),
              dict(BLOCK_M=block_m, BLOCK_R=chunk, BLOCK_K=block_k, DOT_PRECISION=precision,
                   HAS_LIVE=live is not None, FACTOR_ALIGN=lora.factor_align, **_options(warps, stages)))
    return launch, s


def _options(warps: int | None, stages: int | None) -> dict:
    return {**({} if warps is None else {"num_warps": warps}), **({} if stages is None else {"num_stages": stages})}
