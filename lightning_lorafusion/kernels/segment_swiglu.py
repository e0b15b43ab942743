"""SwiGLU over a step's row tiles with the prefill rows' gate/up LoRA expand in it.

    S = segment_lora_shrink(x, lora)[0]          # [1, 2, T, s_width] fp32: gate's and up's shrink, summed
    act = swiglu_segments(gate, up, lora, S)     # silu(gate + scale S_g Bt_g) * (up + scale S_u Bt_u)

In a mixed step of thousands of adapted prompt rows the gate/up LoRA is two thirds of the
expands' bytes: written first it is every row of both 14,336-wide outputs written by the expand
and read back by cuBLAS (beta = 1), added after it is read and written again. Here the frozen
product is written once by cuBLAS (beta = 0) and the delta never reaches memory: a program per
(row tile, group of column blocks) reads its tile's gate and up blocks, adds each projection's
``scale · S Bᵀ`` (tensor-core dots over the tile's rank, S's first rank chunk held as in
``segment_expand``) in fp32, rounds each sum to the dtype (the additive expand's one rounding),
then silu and the product as the eager ops round them (``lora_epilogues.swiglu``). The table must
cover every row of the step (``covering_segments``): tiles of no adapter (-1) or rank 0 take the
plain SwiGLU; a padded table's empty tiles do nothing; with a live count (``SegmentLora.live``)
a fixed number of programs walks the live tiles' items. Runtime ranks, one compiled variant for
every rank mix and table length. The decode rows of a mixed step sit in no-adapter tiles: their
own LoRA (``lora_epilogues.swiglu_ahead``) rewrites their range afterwards, and where that range
reaches into prefill rows (a captured step's decode launch spans its bucket's first rows) a
second launch restricted to it (``rows``, ``adapted_only``) writes those rows again with theirs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .segment_tables import SegmentLora, segment_lora_reference, tile_header
from .triton_launch import sm_count

# columns per block and blocks per program; num_warps (a 64-row tile holds gate, up and two
# fp32 deltas of BLOCK_N columns)
BLOCK_N, N_BLOCKS, WARPS = 64, 4, 4
# the launch's num_stages: one, as the expands after the split-K shrink (a program's shared
# memory for sm_90 at Triton's 3 stages: 48 KB)
STAGES = 1
# the live grid's programs per SM; in the interpreter, a few programs in all
LIVE_PROGRAMS_PER_SM, LIVE_PROGRAMS_INTERPRETER = 4, 3
_UNSPECIALISED = ("tiles_ptr", "b_off_ptr", "rank_ptr", "scale_ptr", "n_tiles", "b_g_stride", "r_g_stride",
                  "s_g_stride", "s_width", "row_lo", "row_hi")
_LIVE_UNSPECIALISED = _UNSPECIALISED + ("live_ptr", "n_col")


@triton.jit
def _with_delta(y, s0, s_ptr, s_row, m_ok, pool_ptr, b_off, rank, offs_n, n_ok, N, scale,
                BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """y [BLOCK_M, BLOCK_N] fp32 + scale * S[rows, :rank] Bt[:rank, offs_n] (S's first chunk s0
    held; Bt at pool_ptr + b_off, rows N long), rounded to the pool's dtype and back."""
    offs_r = tl.arange(0, BLOCK_R)
    bt = tl.load(pool_ptr + b_off + offs_r[:, None] * N + offs_n[None, :],
                 mask=(offs_r < rank)[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    acc = tl.dot(s0, bt, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    for r0 in range(BLOCK_R, rank, BLOCK_R):  # ranks above the held chunk
        offs_rc = r0 + offs_r
        rc_ok = offs_rc < rank
        s = tl.load(s_ptr + s_row[:, None] + offs_rc[None, :], mask=m_ok[:, None] & rc_ok[None, :], other=0.0)
        btc = tl.load(pool_ptr + b_off + offs_rc[:, None] * N + offs_n[None, :], mask=rc_ok[:, None] & n_ok[None, :],
                      other=0.0).to(tl.float32)
        acc += tl.dot(s, btc, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    return (y + acc * scale).to(pool_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def swiglu_tile(
    g_ptr, u_ptr, out_ptr, s_ptr, pool_ptr, tiles_ptr, b_off_ptr, rank_ptr, scale_ptr, t, nb, N, g_stride, u_stride,
    out_stride, n_tiles, b_g_stride, r_g_stride, s_g_stride, s_width, row_lo, row_hi,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, N_BLOCKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ADAPTED_ONLY: tl.constexpr, FACTOR_ALIGN: tl.constexpr,
):
    """out[rows of tile t within [row_lo, row_hi), column blocks nb * N_BLOCKS ...] =
    silu(gate (+ LoRA)) * (up (+ LoRA)); ADAPTED_ONLY: only tiles with LoRA on gate or up."""
    start, end, adc, rank_g = tile_header(tiles_ptr, rank_ptr, 0, r_g_stride, t, n_tiles, s_width)
    has = tl.load(tiles_ptr + 2 * n_tiles + t) >= 0
    rank_u = tl.minimum(tl.load(rank_ptr + r_g_stride + adc, mask=has, other=0), s_width)
    start = tl.maximum(start, row_lo)
    end = tl.minimum(end, row_hi)
    run = end > start
    if ADAPTED_ONLY:
        run = run & ((rank_g > 0) | (rank_u > 0))
    if run:
        b_g = tl.load(b_off_ptr + adc, mask=rank_g > 0, other=0)
        b_u = tl.load(b_off_ptr + b_g_stride + adc, mask=rank_u > 0, other=0)
        scale = tl.load(scale_ptr + adc, mask=has, other=0.0)
        offs_m = start + tl.arange(0, BLOCK_M)
        m_ok = offs_m < end
        rows = offs_m.to(tl.int64)
        s_row = rows * s_width
        if FACTOR_ALIGN > 1:  # (Bt and S rows as 16-byte vectors: S's width is a multiple of 16)
            b_g = tl.multiple_of(b_g, FACTOR_ALIGN)
            b_u = tl.multiple_of(b_u, FACTOR_ALIGN)
            s_row = tl.multiple_of(s_row, 16)
        offs_r = tl.arange(0, BLOCK_R)
        sg0 = tl.load(s_ptr + s_row[:, None] + offs_r[None, :], mask=m_ok[:, None] & (offs_r < rank_g)[None, :],
                      other=0.0)
        su0 = tl.load(s_ptr + s_g_stride + s_row[:, None] + offs_r[None, :],
                      mask=m_ok[:, None] & (offs_r < rank_u)[None, :], other=0.0)
        for j in range(N_BLOCKS):
            offs_n = (nb * N_BLOCKS + j) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < N
            ok = m_ok[:, None] & n_ok[None, :]
            g = tl.load(g_ptr + rows[:, None] * g_stride + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
            u = tl.load(u_ptr + rows[:, None] * u_stride + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
            if rank_g > 0:
                g = _with_delta(g, sg0, s_ptr, s_row, m_ok, pool_ptr, b_g, rank_g, offs_n, n_ok, N, scale,
                                BLOCK_R=BLOCK_R, DOT_PRECISION=DOT_PRECISION)
            if rank_u > 0:
                u = _with_delta(u, su0, s_ptr + s_g_stride, s_row, m_ok, pool_ptr, b_u, rank_u, offs_n, n_ok, N,
                                scale, BLOCK_R=BLOCK_R, DOT_PRECISION=DOT_PRECISION)
            s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
            tl.store(out_ptr + rows[:, None] * out_stride + offs_n[None, :], (s * u).to(out_ptr.dtype.element_ty),
                     mask=ok)


@triton.jit(do_not_specialize=_UNSPECIALISED)
def _swiglu_segments_kernel(
    g_ptr, u_ptr, out_ptr, s_ptr, pool_ptr, tiles_ptr, b_off_ptr, rank_ptr, scale_ptr, N, g_stride, u_stride,
    out_stride, n_tiles, b_g_stride, r_g_stride, s_g_stride, s_width, row_lo, row_hi,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, N_BLOCKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ADAPTED_ONLY: tl.constexpr, FACTOR_ALIGN: tl.constexpr,
):
    """A program per (tile, column group): ``swiglu_tile``."""
    swiglu_tile(g_ptr, u_ptr, out_ptr, s_ptr, pool_ptr, tiles_ptr, b_off_ptr, rank_ptr, scale_ptr, tl.program_id(0),
                tl.program_id(1), N, g_stride, u_stride, out_stride, n_tiles, b_g_stride, r_g_stride, s_g_stride,
                s_width, row_lo, row_hi, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, N_BLOCKS=N_BLOCKS,
                DOT_PRECISION=DOT_PRECISION, ADAPTED_ONLY=ADAPTED_ONLY, FACTOR_ALIGN=FACTOR_ALIGN)


@triton.jit(do_not_specialize=_LIVE_UNSPECIALISED)
def _live_swiglu_segments_kernel(
    g_ptr, u_ptr, out_ptr, s_ptr, pool_ptr, tiles_ptr, live_ptr, b_off_ptr, rank_ptr, scale_ptr, N, g_stride,
    u_stride, out_stride, n_tiles, b_g_stride, r_g_stride, s_g_stride, s_width, row_lo, row_hi, n_col,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, N_BLOCKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ADAPTED_ONLY: tl.constexpr, FACTOR_ALIGN: tl.constexpr,
):
    """``swiglu_tile`` over the first ``live`` tiles only: item i = (tile, column group), taken by
    program i mod programs."""
    n_items = tl.minimum(tl.load(live_ptr), n_tiles) * n_col
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        t = item // n_col
        swiglu_tile(g_ptr, u_ptr, out_ptr, s_ptr, pool_ptr, tiles_ptr, b_off_ptr, rank_ptr, scale_ptr, t,
                    item - t * n_col, N, g_stride, u_stride, out_stride, n_tiles, b_g_stride, r_g_stride, s_g_stride,
                    s_width, row_lo, row_hi, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, N_BLOCKS=N_BLOCKS,
                    DOT_PRECISION=DOT_PRECISION, ADAPTED_ONLY=ADAPTED_ONLY, FACTOR_ALIGN=FACTOR_ALIGN)


@torch.no_grad()
def swiglu_segments_reference(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, lora: SegmentLora) -> torch.Tensor:
    """``silu(gate + LoRA) * (up + LoRA)`` over every row: the LoRA of ``lora`` (projections gate,
    up; input ``x``) added to copies by ``segment_lora_reference`` (fp32 sum, one rounding), then
    the eager ops; gate and up are not written."""
    gate, up = gate.clone(), up.clone()
    segment_lora_reference(x, lora, [gate, up])
    return torch.nn.functional.silu(gate) * up


def swiglu_segments(gate: torch.Tensor, up: torch.Tensor, lora: SegmentLora, s: torch.Tensor, *,
                    out: torch.Tensor | None = None, rows: tuple[int, int] | None = None, adapted_only: bool = False,
                    block_n: int | None = None, n_blocks: int | None = None, warps: int | None = None
                    ) -> torch.Tensor:
    """``silu(gate + LoRA_g) * (up + LoRA_u)`` ``[T, I]`` (Triton: CUDA, or the CPU under
    ``TRITON_INTERPRET=1``): ``lora`` the gate/up group's tables over a table covering every row
    (``covering_segments``), ``s`` its shrink (``segment_lora_shrink``'s S of the "splitk" form:
    ``[>= 1, 2, T, lora.block_r]`` fp32, slot 0 the sum). gate and up: ``[T, I]`` with unit column
    stride (column views of one gate|up output). ``out``: where to write (default a new tensor).
    ``rows``: only rows in ``[lo, hi)`` written (default all); ``adapted_only``: only the rows of
    tiles with LoRA on gate or up (the rewrite of prefill rows that another launch wrote plain)."""
    _check(gate, up, lora, s, out)
    t, n = gate.shape
    out = torch.empty(t, n, dtype=gate.dtype, device=gate.device) if out is None else out
    n_tiles = lora.tiles.shape[1]
    if t == 0 or n_tiles == 0:
        return out
    cuda = gate.is_cuda
    bn = (block_n or BLOCK_N) if cuda else 16
    per = max(1, min(n_blocks or N_BLOCKS, triton.cdiv(n, bn)))
    n_col = triton.cdiv(n, bn * per)
    s0 = s[0]
    args = (gate, up, out, s0, lora.pool, lora.tiles)
    lo, hi = (0, t) if rows is None else rows
    rest = (lora.b_offsets, lora.ranks, lora.scales, n, gate.stride(0), up.stride(0), out.stride(0), n_tiles,
            lora.b_offsets.stride(0), lora.ranks.stride(0), s0.stride(0), lora.block_r, lo, hi)
    meta = dict(BLOCK_M=lora.block_m, BLOCK_R=32 if cuda else 16, BLOCK_N=bn, N_BLOCKS=per,
                DOT_PRECISION="tf32" if cuda and gate.dtype != torch.float32 else "ieee", ADAPTED_ONLY=adapted_only,
                FACTOR_ALIGN=lora.factor_align, num_warps=warps or WARPS, num_stages=STAGES)
    if lora.live is None:
        _swiglu_segments_kernel[(n_tiles, n_col)](*args, *rest, **meta)
    else:
        programs = (LIVE_PROGRAMS_PER_SM * sm_count(gate.device, off_cuda=0) if cuda
                    else LIVE_PROGRAMS_INTERPRETER)
        programs = max(1, min(programs, n_tiles * n_col))
        _live_swiglu_segments_kernel[(programs,)](*args, lora.live, *rest, n_col, **meta)
    return out


def _check(gate, up, lora: SegmentLora, s, out) -> None:
    if gate.dim() != 2 or up.shape != gate.shape or gate.stride(1) != 1 or up.stride(1) != 1 or up.dtype != gate.dtype:
        raise ValueError(f"gate and up must be two [T, I] tensors of one dtype with unit column stride; got "
                         f"{tuple(gate.shape)} {gate.stride()}, {tuple(up.shape)} {up.stride()}")
    if lora.num_projections != 2:
        raise ValueError(f"lora must hold the gate and up projections' tables; got {lora.num_projections} projections")
    t = gate.shape[0]
    if s.dim() != 4 or s.shape[1:] != (2, t, lora.block_r) or s.dtype != torch.float32 or not s[0].is_contiguous():
        raise ValueError(f"s must be [>= 1, 2, {t}, {lora.block_r}] fp32 (segment_lora_shrink's); got "
                         f"{tuple(s.shape)} {s.dtype}")
    if out is not None and (out.shape != gate.shape or out.dtype != gate.dtype or out.stride(1) != 1):
        raise ValueError(f"out must be {tuple(gate.shape)} {gate.dtype} with unit column stride")
    if not gate.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("swiglu_segments needs CUDA tensors, or the CPU under TRITON_INTERPRET=1")
