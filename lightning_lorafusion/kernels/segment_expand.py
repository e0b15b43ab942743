"""The prefill rows' LoRA expand with a tile's S held: ``out[tile rows] (+)= scale * S Bᵀ`` per
projection, S's first rank chunk loaded once per program and kept over its column blocks.

The expand of ``lora_segments`` (``expand_tile``) re-reads a tile's S for every column block
and pays a chain of loads per block; at 8,192 rows it moves an 8B layer's outputs at about a
third of the copy bandwidth (docs/BENCHMARKS.md "Where the adapters' device time goes"). Here a
program loads its tile's header and S chunk once, then per column block only Bᵀ's rows (16-byte
vectors where ``SegmentLora.factor_align`` allows), one tensor-core dot and the store; the
column-block loop may be software-pipelined (``STAGES``), and the dot may run in the pool's
16-bit dtype (``LOWP``: S rounded to it) instead of TF32. Ranks above the chunk loop as before.
The same tables, contract and rounding as ``expand_tile``: runtime ranks (one compiled variant
for every rank mix), padding tiles do nothing, written first (a tile of rank 0 or
``NO_ADAPTER`` writes zeros) or additive (one fp32 sum of output and delta, one rounding).
Grids: a program per (tile, group of column blocks) over the table, or with a live count a
fixed number of programs walking the live tiles' items (``lora_segments``' "Live grids").
"""

from __future__ import annotations

import triton
import triton.language as tl

from .segment_tables import EXPAND_UNSPECIALISED, store_delta, tile_header

_UNSPECIALISED = EXPAND_UNSPECIALISED
_LIVE_UNSPECIALISED = EXPAND_UNSPECIALISED + ("live_ptr", "n_col")


@triton.jit
def held_expand_tile(
    s_ptr, pool_ptr, tiles_ptr, b_off_ptr, rank_ptr, scale_ptr, out_ptr, t, nb, N, out_stride, n_tiles, s_width,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, N_BLOCKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr, FACTOR_ALIGN: tl.constexpr, LOWP: tl.constexpr,
    STAGES: tl.constexpr,
):
    """out[rows of tile t, column blocks nb * N_BLOCKS ...] (+)= scale * S[rows, :rank] Bt[:rank, cols]
    (S one summed fp32 slot, ``s_width`` wide): S's first BLOCK_R ranks loaded once, the rest in
    chunks per block."""
    start, end, adc, rank = tile_header(tiles_ptr, rank_ptr, 0, 0, t, n_tiles, s_width)
    live = end > start
    if ACCUMULATE:
        live = live & (rank > 0)
    if live:
        has = rank > 0
        b_off = tl.load(b_off_ptr + adc, mask=has, other=0)
        scale = tl.load(scale_ptr + adc, mask=has, other=0.0)
        offs_m = start + tl.arange(0, BLOCK_M)
        m_ok = offs_m < end
        s_row = offs_m.to(tl.int64) * s_width
        if FACTOR_ALIGN > 1:  # (Bt rows and S rows as 16-byte vectors; S's width is a multiple of 16)
            b_off = tl.multiple_of(b_off, FACTOR_ALIGN)
            s_row = tl.multiple_of(s_row, 16)
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < rank
        s0 = tl.load(s_ptr + s_row[:, None] + offs_r[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        if LOWP:
            s0 = s0.to(pool_ptr.dtype.element_ty)
        for j in tl.range(0, N_BLOCKS, num_stages=STAGES):
            offs_n = (nb * N_BLOCKS + j) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < N
            bt = tl.load(pool_ptr + b_off + offs_r[:, None] * N + offs_n[None, :], mask=r_ok[:, None] & n_ok[None, :],
                         other=0.0)
            if not LOWP:
                bt = bt.to(tl.float32)
            acc = tl.dot(s0, bt, input_precision=DOT_PRECISION, out_dtype=tl.float32)
            for r0 in range(BLOCK_R, rank, BLOCK_R):  # ranks above the held chunk
                offs_rc = r0 + offs_r
                rc_ok = offs_rc < rank
                s = tl.load(s_ptr + s_row[:, None] + offs_rc[None, :], mask=m_ok[:, None] & rc_ok[None, :],
                            other=0.0)
                btc = tl.load(pool_ptr + b_off + offs_rc[:, None] * N + offs_n[None, :],
                              mask=rc_ok[:, None] & n_ok[None, :], other=0.0)
                if LOWP:
                    s = s.to(pool_ptr.dtype.element_ty)
                else:
                    btc = btc.to(tl.float32)
                acc += tl.dot(s, btc, input_precision=DOT_PRECISION, out_dtype=tl.float32)
            store_delta(out_ptr, offs_m, m_ok, offs_n, n_ok, out_stride, acc, scale, ACCUMULATE=ACCUMULATE)


@triton.jit(do_not_specialize=_UNSPECIALISED)
def _held_expand_kernel(
    s_ptr, pool_ptr, tiles_ptr, b_off_ptr, rank_ptr, scale_ptr, out_ptr, N, out_stride, n_tiles, s_width,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, N_BLOCKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr, FACTOR_ALIGN: tl.constexpr, LOWP: tl.constexpr,
    STAGES: tl.constexpr, COL_FASTEST: tl.constexpr,
):
    """A program per (tile, column group): ``held_expand_tile``; COL_FASTEST: the grid is
    (column group, tile), so the programs of one tile (one S, one adapter's Bᵀ) run side by side."""
    if COL_FASTEST:
        t, nb = tl.program_id(1), tl.program_id(0)
    else:
        t, nb = tl.program_id(0), tl.program_id(1)
    held_expand_tile(s_ptr, pool_ptr, tiles_ptr, b_off_ptr, rank_ptr, scale_ptr, out_ptr, t, nb, N, out_stride,
                     n_tiles, s_width, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, N_BLOCKS=N_BLOCKS,
                     DOT_PRECISION=DOT_PRECISION, ACCUMULATE=ACCUMULATE, FACTOR_ALIGN=FACTOR_ALIGN, LOWP=LOWP,
                     STAGES=STAGES)


@triton.jit(do_not_specialize=_LIVE_UNSPECIALISED)
def _live_held_expand_kernel(
    s_ptr, pool_ptr, tiles_ptr, live_ptr, b_off_ptr, rank_ptr, scale_ptr, out_ptr, N, out_stride, n_tiles, s_width,
    n_col,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, N_BLOCKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr, FACTOR_ALIGN: tl.constexpr, LOWP: tl.constexpr,
    STAGES: tl.constexpr, COL_FASTEST: tl.constexpr,
):
    """``held_expand_tile`` over the first ``live`` tiles only: item i = (tile, column group),
    ``n_col`` groups a tile, taken by program i mod programs (COL_FASTEST has no meaning here:
    consecutive items share a tile either way)."""
    n_items = tl.minimum(tl.load(live_ptr), n_tiles) * n_col
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        t = item // n_col
        held_expand_tile(s_ptr, pool_ptr, tiles_ptr, b_off_ptr, rank_ptr, scale_ptr, out_ptr, t, item - t * n_col, N,
                         out_stride, n_tiles, s_width, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N,
                         N_BLOCKS=N_BLOCKS, DOT_PRECISION=DOT_PRECISION, ACCUMULATE=ACCUMULATE,
                         FACTOR_ALIGN=FACTOR_ALIGN, LOWP=LOWP, STAGES=STAGES)
