"""Prefill-time multi-adapter LoRA over the unified pool (S-LoRA's MBGMM): row tiles, one adapter each.

A step's prefill rows come in segments, one per request, each with its own adapter (or none).
``segment_tiles`` cuts the segments into tiles of at most ``block_m`` rows; tile t covers rows
``[start_t, end_t)`` of ``x [T, K]`` and names adapter ``a_t`` (an index into the step's adapter
tables). For projection g of a group sharing the input x:

    A    = pool[a_offsets[g, a] : + r * K].view(r, K)     (r = ranks[g, a]; 0 = no LoRA there)
    Bt   = pool[b_offsets[g, a] : + r * N_g].view(r, N_g)   (PEFT's lora_B, transposed)
    out_g[start:end] += scales[a] * (x[start:end] @ A^T) @ Bt      (fp32 sums, one rounding)

The weights stay where the pool keeps them (no per-step concatenation of factors, unlike the
training kernels' A_all / B_cat), and the base product is a plain GEMM before this adds into its
output. Two launches per group: the shrink ``S[g] = x A^T`` for every projection of the group
(tensor-core dots over K, fp32 S), then one expand per projection (``S Bt`` added into its
output, which may be a column view of a fused GEMM's). Both loop over each tile's own rank in
chunks (``rank_chunk``): no kernel is compiled per rank or rank mix, and a rank-8 tile does
not pay for a rank-64 one beside it.
The grids run over the tile table's length; a tile with ``start == end`` (padding) does nothing.
A table padded to a fixed length (a captured mixed step's) may carry ``live``, a device count of
its leading tiles that hold rows: then a fixed number of programs per SM walks those tiles' work
only, and the padding launches no program (docs/kernels.md, "Live grids").
Inference only (no autograd). The torch reference (``segment_lora_reference``) computes the
same sums per segment from the host copy of the segments.
"""

from __future__ import annotations

import contextlib

import os
from typing import Sequence

import torch
import triton
import triton.language as tl

from . import lora_splitk, lora_tiles, segment_expand
from .lora_splitk import PROGRAMS_PER_SM_INTERPRETER, splitk_launches, splitk_lora_add, splitk_shrink_launch
from .lora_tiles import tile_launches, tile_lora_add
from .triton_launch import sm_count
from .segment_tables import (EXPAND_UNSPECIALISED, NO_ADAPTER, SHRINK_UNSPECIALISED, SegmentLora, block_r_for,
                             covering_segments, segment_lora_reference, segment_tiles, shrink_tile, store_delta,
                             tile_header)

__all__ = ["BACKENDS", "FORMS", "DEFAULT_FORM", "SegmentLora", "block_r_for", "segment_lora_reference",
           "segment_tiles", "covering_segments", "NO_ADAPTER", "segment_lora_add", "segment_kernel_variants", "rank_chunk", "shrink_splits",
           "expand_warps", "live_programs"]

BACKENDS = ("torch", "triton", "auto")
# the Triton path's kernels: "segments" (this module's) or "tiles" (``lora_tiles``: the expand's
# options); ``segment_lora_add``'s default, what the engine runs ("auto" / "triton"): the one
# measured fastest (docs/BENCHMARKS.md "Prefill LoRA by row tiles": the split-K shrink took
# 0.57-0.72x the segments shrink's time at 2,048-8,192 rows of an 8B layer on an H200)
# "splitk": the shrink of ``lora_splitk`` (vector loads, the splits summed in the shrink) before
# this module's expand over the one summed S; "items": ``lora_splitk`` whole (its
# own expand, by (tile, column block) items: measured slower than this module's)
FORMS = ("segments", "tiles", "splitk", "items")
DEFAULT_FORM = "splitk"
# column blocks of BLOCK_N an expand program covers (1-8 measured on an H100: docs/kernels.md)
EXPAND_BLOCKS_PER_PROGRAM = 4
# the shrink's K splits: one per this much of K, at most the max. 4 splits measured fastest or
# tied at every mix at the 1B and 8B shapes on an H100, 7-43 % less time than 1 split (docs/kernels.md)
SHRINK_K_PER_SPLIT = 512
SHRINK_MAX_SPLITS = 4
# the expand's num_warps for S tiles (block_m x ranks per dot) >= 64 x 64: 2 warps took 22-32 % off the
# mixes there on an H100 (1B and 8B), and added 13-70 % at 64 x 16, 64 x 32 and 32 x 64 (docs/kernels.md)
EXPAND_WIDE_TILE = 64 * 64
EXPAND_WIDE_TILE_WARPS = 2  # (measured with whole-rank-block dots; a dot now reads one rank chunk, 64 x 32)
# ranks are looped over in chunks of this many (the kernels' only rank constexpr; the shrink
# reads its x tile once per chunk): on CUDA 32, one pass for ranks <= 32, two at 64, four at
# 128; in the interpreter 16, so small test ranks run the loop
RANK_CHUNK_CUDA, RANK_CHUNK_INTERPRETER = 32, 16


# Arguments that change from step to step (the tile count, the step's adapter count in the
# table strides, its row count in S's stride) are not specialised: Triton would compile a variant
# per "== 1" and "divisible by 16" of each, and such first-time compiles stalled whole steps for
# seconds mid-run (docs/kernels.md, "kernels/lora_segments.py"). They only index tables. Nor is
# anything about ranks: a rank is a runtime loop bound (chunks of ``rank_chunk``, the one rank
# constexpr), and S's width (``SegmentLora.block_r``) a runtime stride, so one compiled variant
# serves every mix of ranks (docs/serving.md, "Cold start").
# The tables' pointers too: they are views at offsets that follow the step's adapter count and
# the layer (16-byte alignment or not), read one scalar at a time, so specialising on their
# alignment buys nothing and would compile a variant per parity of the adapter count.
_SHRINK_UNSPECIALISED, _EXPAND_UNSPECIALISED = SHRINK_UNSPECIALISED, EXPAND_UNSPECIALISED


@triton.jit(do_not_specialize=_SHRINK_UNSPECIALISED)
def _segment_shrink_kernel(
    x_ptr, pool_ptr, tiles_ptr, a_off_ptr, rank_ptr, s_ptr, K, k_per_split, x_stride, n_tiles, a_g_stride,
    r_g_stride, s_g_stride, s_split_stride, s_width,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """S[split, g, rows of tile t, :rank] = x[rows, split's K range] A_g[:rank, range]^T (fp32),
    A_g of the tile's adapter; the expand sums the splits. The tile's own rank is covered in
    chunks of BLOCK_R, one pass over the split's K each (the grid does not depend on ranks:
    a captured step serves any rank mix, and an empty or rank-0 tile returns at once).
    Splitting K gives a step of few tiles (decode rows, a short prompt) enough programs: one
    program over all of K = 8,192 is a long chain of dependent loads."""
    t = tl.program_id(0)
    g = tl.program_id(1)
    sp = tl.program_id(2)
    shrink_tile(x_ptr, pool_ptr, tiles_ptr, a_off_ptr, rank_ptr, s_ptr, t, g, sp, K, k_per_split, x_stride, n_tiles,
                a_g_stride, r_g_stride, s_g_stride, s_split_stride, s_width,
                BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION)


@triton.jit(do_not_specialize=_EXPAND_UNSPECIALISED)
def _segment_expand_kernel(
    s_ptr, pool_ptr, tiles_ptr, b_off_ptr, rank_ptr, scale_ptr, out_ptr, N, out_stride, n_tiles, s_split_stride,
    s_width,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, N_BLOCKS: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr, FACTOR_ALIGN: tl.constexpr = 1,
):
    """One program per (tile, N_BLOCKS column blocks): ``expand_tile``."""
    expand_tile(s_ptr, pool_ptr, tiles_ptr, b_off_ptr, rank_ptr, scale_ptr, out_ptr, tl.program_id(0),
                tl.program_id(1), N, out_stride, n_tiles, s_split_stride, s_width,
                BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, N_BLOCKS=N_BLOCKS, SPLIT=SPLIT,
                DOT_PRECISION=DOT_PRECISION, ACCUMULATE=ACCUMULATE, FACTOR_ALIGN=FACTOR_ALIGN)


@triton.jit
def expand_tile(
    s_ptr, pool_ptr, tiles_ptr, b_off_ptr, rank_ptr, scale_ptr, out_ptr, t, nb, N, out_stride, n_tiles,
    s_split_stride, s_width,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, N_BLOCKS: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr, FACTOR_ALIGN: tl.constexpr = 1,
):
    """out[rows of tile t, column blocks nb * N_BLOCKS ...] += scale * S[rows, :rank] Bt[:rank, cols]:
    fp32 sum of the output and the delta, one rounding. The rank is looped over in chunks of
    BLOCK_R (a runtime bound: the tile's own rank, not the step's largest). A program covers
    N_BLOCKS blocks of BLOCK_N columns: a tile of one decode row costs a program's fixed work
    (tables) once per N_BLOCKS blocks, not once per block. Not ACCUMULATE (write-first): out =
    the delta, read nothing; a tile of rank 0 (or adapter index -1, rows without LoRA) writes
    zeros, so a GEMM can add the frozen product onto it as its C input."""
    start, end, adc, rank = tile_header(tiles_ptr, rank_ptr, 0, 0, t, n_tiles, s_width)
    live = end > start
    if ACCUMULATE:
        live = live & (rank > 0)
    if live:
        b_off = tl.load(b_off_ptr + adc, mask=rank > 0, other=0)
        scale = tl.load(scale_ptr + adc, mask=rank > 0, other=0.0)
        offs_m = start + tl.arange(0, BLOCK_M)
        m_ok = offs_m < end
        s_row = offs_m.to(tl.int64) * s_width
        if FACTOR_ALIGN > 1:  # (vector loads of Bt rows and of S rows, whose width is a multiple of 16)
            b_off = tl.multiple_of(b_off, FACTOR_ALIGN)
            s_row = tl.multiple_of(s_row, 16)
        for j in range(N_BLOCKS):
            offs_n = (nb * N_BLOCKS + j) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_ok = offs_r < rank
                s_ptrs = s_ptr + s_row[:, None] + offs_r[None, :]
                s_ok = m_ok[:, None] & r_ok[None, :]
                s = tl.load(s_ptrs, mask=s_ok, other=0.0)
                for sp in range(1, SPLIT):  # the shrink's K splits, summed in a fixed order
                    s += tl.load(s_ptrs + sp * s_split_stride, mask=s_ok, other=0.0)
                bt = tl.load(pool_ptr + b_off + offs_r[:, None] * N + offs_n[None, :],
                             mask=r_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
                acc += tl.dot(s, bt, input_precision=DOT_PRECISION)
            store_delta(out_ptr, offs_m, m_ok, offs_n, n_ok, out_stride, acc, scale, ACCUMULATE=ACCUMULATE)


# The "live" grids (``SegmentLora.live``, a device count of the table's leading tiles that hold
# rows): a fixed number of programs per SM walks the (tile, K split / column block) items of those
# tiles only, so a captured step's padding tiles launch no program at all. Programs per SM: the
# expand holds a 64 x 128 fp32 tile in 2-4 warps (about four resident per SM), the shrink a
# 64 x 32 one.
LIVE_SHRINK_PROGRAMS_PER_SM = 8
# the split-K shrink's programs per SM (form "splitk"), walking the live tiles' items: a program
# per item of a captured step's padded table cost 25k programs at 256 rows (q/k/v, 16 splits)
SPLITK_SHRINK_PROGRAMS_PER_SM = 8
# the expands after it: one S to read (no loop over K splits), so Triton would pipeline the rank
# loop (3 stages: 40 KB of shared memory a program against 24 KB; the 8,192-token steps' expands
# took 9 % longer so on an H100); one stage keeps the segments expand's footprint. Bᵀ and S rows
# as vector loads (``SegmentLora.factor_align``): an option, 1.33-1.74x slower on an H100
SPLITK_EXPAND_STAGES = 1
SPLITK_EXPAND_ALIGN = False
# the expand after the split-K shrink: "tile" (``expand_tile`` above) or "held"
# (``segment_expand``: the tile's S loaded once per program, Bᵀ rows as vectors, options in
# HELD_EXPAND); ``segment_lora_add(..., expand=)`` picks per call. "held" took 1.27-1.47x the
# tile expand's time on an H100, 0.85-0.93x with its dot in bf16 ("lowp"), which the engine's
# runs did not show (docs/kernels.md "The held expand"): "tile" stays the default
SPLITK_EXPAND = "tile"
EXPANDS = ("tile", "held")
# the held expand's options: columns per block, blocks per program (capped by the width), num_warps,
# the column loop's software-pipeline stages (the launch's num_stages: one stage keeps a program's
# shared memory at 32 KB for sm_90, 12 KB with "lowp"; Triton's 3 took 64 KB), the dot in the
# pool's 16-bit dtype (S rounded to it), the grid (column group, tile) instead of (tile, column
# group), vector loads of Bᵀ / S
HELD_EXPAND = {"block_n": 128, "n_blocks": 4, "warps": 4, "stages": 1, "lowp": False, "col_fastest": False,
               "align": True}
# small steps (form "splitk", at most SMALL_STEP_ROWS rows, None: none; a captured mixed step's
# pieces are per token bucket, and a 256-token prompt beside decode rows is a step of the 512
# bucket): the shrink's K in SMALL_STEP_SPLITS parts and the expands' programs
# SMALL_STEP_EXPAND_BLOCKS column blocks each. A 256-token prompt has four row tiles: with K in
# 4 parts and 4 column blocks a program, each shrink program walks 1,024 of K and each expand
# program 4 blocks, chains of dependent loads on a few dozen programs. One 8B layer's four
# groups at 256 rows (H200): 0.085 against 0.114 ms (one adapter), 0.128 against 0.200 ms (8,
# ranks 4-64) (docs/kernels.md, "Small steps"); the 16 splits' partials fit
# the S that serving/pool_sizing.py reserves up to 1,024 rows
SMALL_STEP_ROWS: int | None = 512
SMALL_STEP_SPLITS = 16
SMALL_STEP_EXPAND_BLOCKS = 1
LIVE_EXPAND_PROGRAMS_PER_SM = 4
# in the interpreter: a few programs, so that each walks several items
LIVE_PROGRAMS_INTERPRETER = 3
_LIVE_SHRINK_UNSPECIALISED = _SHRINK_UNSPECIALISED + ("live_ptr", "n_groups", "n_split")
_LIVE_EXPAND_UNSPECIALISED = _EXPAND_UNSPECIALISED + ("live_ptr", "n_col")


@triton.jit(do_not_specialize=_LIVE_SHRINK_UNSPECIALISED)
def _live_shrink_kernel(
    x_ptr, pool_ptr, tiles_ptr, live_ptr, a_off_ptr, rank_ptr, s_ptr, K, k_per_split, x_stride, n_tiles,
    a_g_stride, r_g_stride, s_g_stride, s_split_stride, s_width, n_groups, n_split,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``_segment_shrink_kernel``'s work over the first ``live`` tiles only: item i = (tile,
    projection, K split), taken by program i mod programs. A step whose table holds no tile
    reads one scalar per program."""
    per_tile = n_groups * n_split
    n_items = tl.minimum(tl.load(live_ptr), n_tiles) * per_tile
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        t = item // per_tile
        rest = item - t * per_tile
        g = rest // n_split
        sp = rest - g * n_split
        shrink_tile(x_ptr, pool_ptr, tiles_ptr, a_off_ptr, rank_ptr, s_ptr, t, g, sp, K, k_per_split, x_stride,
                    n_tiles, a_g_stride, r_g_stride, s_g_stride, s_split_stride, s_width,
                    BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION)


@triton.jit(do_not_specialize=_LIVE_EXPAND_UNSPECIALISED)
def _live_expand_kernel(
    s_ptr, pool_ptr, tiles_ptr, live_ptr, b_off_ptr, rank_ptr, scale_ptr, out_ptr, N, out_stride, n_tiles,
    s_split_stride, s_width, n_col,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, N_BLOCKS: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr, FACTOR_ALIGN: tl.constexpr = 1,
):
    """``expand_tile`` over the first ``live`` tiles only: item i = (tile, group of N_BLOCKS
    column blocks), ``n_col`` groups a tile, taken by program i mod programs."""
    n_items = tl.minimum(tl.load(live_ptr), n_tiles) * n_col
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        t = item // n_col
        expand_tile(s_ptr, pool_ptr, tiles_ptr, b_off_ptr, rank_ptr, scale_ptr, out_ptr, t, item - t * n_col, N,
                    out_stride, n_tiles, s_split_stride, s_width,
                    BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, N_BLOCKS=N_BLOCKS, SPLIT=SPLIT,
                    DOT_PRECISION=DOT_PRECISION, ACCUMULATE=ACCUMULATE, FACTOR_ALIGN=FACTOR_ALIGN)


def live_programs(device: torch.device, items: int, per_sm: int) -> int:
    """Programs of a live grid: ``per_sm`` per SM (``LIVE_PROGRAMS_INTERPRETER`` off CUDA), at
    most ``items`` (the most items the table can hold), at least 1; ``per_sm`` 0: ``items`` (a
    program per item, those past the live tiles' exiting after reading the count)."""
    if per_sm == 0:
        n = items
    elif device.type == "cuda":
        n = per_sm * sm_count(device, off_cuda=0)
    else:
        n = LIVE_PROGRAMS_INTERPRETER
    return max(1, min(n, items))


def rank_chunk(device: torch.device) -> int:
    """Ranks per pass of the kernels' rank loops on ``device``."""
    return RANK_CHUNK_CUDA if device.type == "cuda" else RANK_CHUNK_INTERPRETER


def _shrink_block_k(device: torch.device) -> int:
    return 64 if device.type == "cuda" else 16


def small_step(rows: int) -> bool:
    """Whether a "splitk" launch over ``rows`` rows takes the small steps' split and blocks."""
    return SMALL_STEP_ROWS is not None and rows <= SMALL_STEP_ROWS


def shrink_splits(k: int) -> int:
    """K splits of the shrink: one per SHRINK_K_PER_SPLIT of K, at most SHRINK_MAX_SPLITS."""
    return max(1, min(SHRINK_MAX_SPLITS, k // SHRINK_K_PER_SPLIT))


def expand_warps(block_m: int, block_r: int) -> int | None:
    """The expand's num_warps: 2 for S tiles of >= 64 x 64 (block_m x the ranks each dot reads,
    ``rank_chunk``), Triton's default (4) for smaller ones."""
    return EXPAND_WIDE_TILE_WARPS if block_m * block_r >= EXPAND_WIDE_TILE else None


def _expand_blocks_per_program(col_blocks: int) -> int:
    """Column blocks per expand program: EXPAND_BLOCKS_PER_PROGRAM, fewer for narrow outputs."""
    return max(1, min(EXPAND_BLOCKS_PER_PROGRAM, col_blocks))


def segment_lora_add(x: torch.Tensor, lora: SegmentLora, outs: Sequence[torch.Tensor], *,
                     backend: str = "auto", check: bool = True, n_blocks: int | None = None,
                     split_k: int | None = None, warps: tuple[int | None, int | None] = (None, None),
                     form: str | None = None, accumulate: bool = True,
                     per_sm: tuple[int | None, int | None] = (None, None), expand_align: bool | None = None,
                     expand_stages: int | None = None, shrunk: tuple[torch.Tensor, int] | None = None,
                     expand: str | None = None, held: dict | None = None) -> None:
    """Add the prefill rows' LoRA of each projection into ``outs[g] [T, N_g]`` (in place).
    ``shrunk``: the shrink launched already (``segment_lora_shrink``'s S and splits, the same
    form and ``split_k``): only the expands run.
    ``accumulate=False`` (write-first): write the LoRA into ``outs`` instead, reading nothing of
    them, and zeros on the rows of rank-0 and ``NO_ADAPTER`` tiles: with a covering table
    (``segment_tiles(..., rows=T)``) every row is written, and a GEMM adds the frozen product
    onto it as its C input (``y.addmm_(x, W.t())``); rows outside every tile are left as they
    are. Not the "tiles" form.
    ``backend``: "torch" (the reference), "triton" (CUDA, or the CPU under TRITON_INTERPRET=1),
    "auto" (Triton on CUDA). ``form``: the Triton kernels, "segments" (below), "splitk" (the
    same expands after ``lora_splitk``'s shrink: vector loads, the splits summed in the shrink;
    ``split_k`` None: ``shrink_splits(K)``), "items" (``lora_splitk.splitk_lora_add``) or "tiles"
    (``lora_tiles.tile_lora_add`` with its defaults, which reads ``n_blocks`` / ``split_k`` /
    ``warps`` its own way); None: ``DEFAULT_FORM``. The Triton path reads nothing on the host: one shrink launch for
    the group, one expand per projection, grids over the tile table's length; ``n_blocks``:
    column blocks per expand program (default ``EXPAND_BLOCKS_PER_PROGRAM``, capped by the width);
    ``split_k``: K splits of the shrink (default ``shrink_splits(K)``); ``warps``: the shrink's and
    the expand's ``num_warps`` (None: Triton's default, 4, for the shrink; ``expand_warps(block_m,
    rank_chunk(device))`` for the expand). With ``lora.live`` (a device count: the table's tiles
    past it are padding) a fixed number of programs walks the live tiles' work only (``per_sm``:
    programs per SM of the shrink and the expand; None: ``LIVE_*_PROGRAMS_PER_SM``): what a
    captured step's padded table runs, its padding costing nothing; same sums, same rounding.
    ``expand_align`` / ``expand_stages`` (forms "segments" / "splitk"): the expands load Bᵀ and S
    rows as vectors (``lora.factor_align``) / their ``num_stages`` (0: Triton's); None: the form's
    (``SPLITK_EXPAND_ALIGN`` / ``SPLITK_EXPAND_STAGES`` for "splitk"; off / Triton's for "segments").
    ``expand`` (form "splitk"): "tile" or "held" (``segment_expand``, options ``HELD_EXPAND`` updated
    by ``held``); None: ``SPLITK_EXPAND``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {BACKENDS}")
    if backend == "auto":
        backend = "triton" if x.is_cuda else "torch"
    if backend == "torch":
        segment_lora_reference(x, lora, outs, accumulate=accumulate)
        return
    form = DEFAULT_FORM if form is None else form
    if form not in FORMS:
        raise ValueError(f"form={form!r}; allowed: {FORMS}")
    if shrunk is not None and form not in ("segments", "splitk"):
        raise ValueError(f"shrunk: the shrink launched apart runs the 'segments' or 'splitk' form; got form={form!r}")
    if form == "tiles":
        if not accumulate:
            raise ValueError("accumulate=False (write-first) runs the 'segments' or 'splitk' form; got form='tiles'")
        tile_lora_add(x, lora, outs, check=check, n_blocks=n_blocks, split_k=split_k, warps=warps)
        return
    if form == "items":
        splitk_lora_add(x, lora, outs, check=check, accumulate=accumulate, split_k=split_k, n_blocks=n_blocks,
                        warps=warps)
        return
    if check:
        lora.check(x, outs)
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"backend='triton' needs CUDA tensors (got x on {x.device}); use backend='torch' or "
                           "'auto' on the CPU, or set TRITON_INTERPRET=1")
    for kernel, grid, args, meta in _segment_launches(x, lora, outs, n_blocks=n_blocks, split_k=split_k, warps=warps,
                                                      accumulate=accumulate, per_sm=per_sm,
                                                      splitk=form == "splitk", expand_align=expand_align,
                                                      expand_stages=expand_stages, shrunk=shrunk,
                                                      expand=expand, held=held):
        kernel[grid](*args, **meta)


def segment_lora_shrink(x: torch.Tensor, lora: SegmentLora, *, form: str | None = None,
                        split_k: int | None = None, stream: "torch.cuda.Stream | None" = None
                        ) -> tuple[torch.Tensor, int] | None:
    """``segment_lora_add``'s shrink alone (Triton, forms "segments" / "splitk"; None: nothing
    launched for an empty tile table or another form) -> ``(S, splits)`` for its ``shrunk``: the
    scratch (and anything the launch needs, x made contiguous) allocated and enqueued on the
    current stream, the shrink launched on ``stream`` (None: the current one) after it, so it
    may run beside work enqueued on the current stream meanwhile (the frozen GEMM reading the
    same ``x``); order the expands after it (``torch.cuda.current_stream().wait_stream``)."""
    form = DEFAULT_FORM if form is None else form
    if form not in ("segments", "splitk") or lora.tiles.shape[1] == 0:
        return None
    lora.check(x, [x] * lora.num_projections)  # (the outputs come later: x stands in for their rows)
    plan = _segment_plan(x, lora, (), n_blocks=None, split_k=split_k, warps=(None, None),
                         splitk=form == "splitk")
    (kernel, grid, args, meta), = plan[0]
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(x.device))
    with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
        kernel[grid](*args, **meta)
    return plan[1], plan[2]


def _segment_launches(x: torch.Tensor, lora: SegmentLora, outs: Sequence[torch.Tensor], *, n_blocks: int | None,
                      split_k: int | None, warps: tuple[int | None, int | None],
                      accumulate: bool = True,
                      per_sm: tuple[int | None, int | None] = (None, None), splitk: bool = False,
                      expand_align: bool | None = None, expand_stages: int | None = None,
                      shrunk: tuple[torch.Tensor, int] | None = None, expand: str | None = None,
                      held: dict | None = None) -> list[tuple]:
    """``_segment_plan``'s launches."""
    return _segment_plan(x, lora, outs, n_blocks=n_blocks, split_k=split_k, warps=warps, accumulate=accumulate,
                         per_sm=per_sm, splitk=splitk, expand_align=expand_align, expand_stages=expand_stages,
                         shrunk=shrunk, expand=expand, held=held)[0]


def _segment_plan(x: torch.Tensor, lora: SegmentLora, outs: Sequence[torch.Tensor], *, n_blocks: int | None,
                  split_k: int | None, warps: tuple[int | None, int | None],
                  accumulate: bool = True,
                  per_sm: tuple[int | None, int | None] = (None, None), splitk: bool = False,
                  expand_align: bool | None = None, expand_stages: int | None = None,
                  shrunk: tuple[torch.Tensor, int] | None = None, expand: str | None = None,
                  held: dict | None = None) -> tuple[list[tuple], torch.Tensor | None, int]:
    """The launches of ``segment_lora_add``'s Triton path: ``(kernel, grid, args, keywords)``,
    the shrink's then one expand per projection (none for an empty tile table): grids over the
    tile table, or with ``lora.live`` the live grids (``per_sm``: their programs per SM, shrink
    and expand; None: ``LIVE_*_PROGRAMS_PER_SM``). ``splitk``: the shrink is ``lora_splitk``'s
    (``split_k`` None: ``shrink_splits(K)``; ``per_sm[0]`` of its programs, None:
    ``SPLITK_SHRINK_PROGRAMS_PER_SM``), which sums the splits itself: the expands read one S.
    ``expand_align`` / ``expand_stages``: see ``segment_lora_add``. Allocates S; ``shrunk``: S
    and its splits given (the shrink launched apart, ``segment_lora_shrink``): the expands only.
    ``expand`` / ``held``: see ``segment_lora_add`` ("held" only after the split-K shrink).
    -> (launches, S, splits the expands sum)."""
    expand = (SPLITK_EXPAND if splitk else "tile") if expand is None else expand
    if expand not in EXPANDS:
        raise ValueError(f"expand={expand!r}; allowed: {EXPANDS}")
    if expand == "held" and not splitk:
        raise ValueError("expand='held' reads one summed S: form 'splitk' only")
    if expand_align is None:
        expand_align = splitk and SPLITK_EXPAND_ALIGN
    if expand_stages is None:
        expand_stages = SPLITK_EXPAND_STAGES if splitk else 0
    n_tiles = lora.tiles.shape[1]
    if n_tiles == 0:
        return [], None, 0
    x = x if x.stride(1) == 1 else x.contiguous()
    g, rows, k = lora.num_projections, x.shape[0], x.shape[1]
    block_m, block_r = lora.block_m, lora.block_r
    chunk = rank_chunk(x.device)
    block_k = _shrink_block_k(x.device)
    if splitk:
        programs = per_sm[0] if per_sm[0] is not None else (
            SPLITK_SHRINK_PROGRAMS_PER_SM if x.is_cuda else PROGRAMS_PER_SM_INTERPRETER[0])
        # K in shrink_splits(K) parts (4 for K >= 2,048), as the segments shrink: on an H100 that
        # beat the step-size rule (``lora_splitk.shrink_split``) in 11 of 16 one-layer cases and
        # lost nowhere by more than 2 % (docs/BENCHMARKS.md "Prefill LoRA by row tiles")
        if small_step(rows):
            split_k = SMALL_STEP_SPLITS if split_k is None else split_k
            n_blocks = SMALL_STEP_EXPAND_BLOCKS if n_blocks is None else n_blocks
        if shrunk is None:
            shrink, s = splitk_shrink_launch(x, lora, split_k=shrink_splits(k) if split_k is None else split_k,
                                             programs=programs, warps=warps[0])
        else:
            s = shrunk[0]
        split = 1  # (the expand reads split 0's slot: the sum)
    elif shrunk is not None:
        s, split = shrunk
    else:
        split = shrink_splits(k) if split_k is None else split_k
        s = torch.empty(split, g, rows, block_r, dtype=torch.float32, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    # fp32 inputs: full-precision dots; 16-bit inputs: their products are exact in TF32, and the
    # expand's fp32 S is rounded to TF32's 10 mantissa bits (finer than the inputs' own)
    precision = "tf32" if x.is_cuda and x.dtype != torch.float32 else "ieee"
    live = lora.live
    per_sm = (LIVE_SHRINK_PROGRAMS_PER_SM if per_sm[0] is None else per_sm[0],
              LIVE_EXPAND_PROGRAMS_PER_SM if per_sm[1] is None else per_sm[1])
    shrink_meta = dict(BLOCK_M=block_m, BLOCK_R=chunk, BLOCK_K=block_k, DOT_PRECISION=precision,
                       **({} if warps[0] is None else {"num_warps": warps[0]}))
    shrink_args = (x, lora.pool, lora.tiles, lora.a_offsets, lora.ranks, s, k, k_per_split, x.stride(0), n_tiles,
                   lora.a_offsets.stride(0), lora.ranks.stride(0), s.stride(1), s.stride(0), block_r)
    if shrunk is not None:
        if s.shape[1:] != (g, rows, block_r) or s.shape[0] < split or s.dtype != torch.float32:
            raise ValueError(f"shrunk: S must be [>= {split}, {g}, {rows}, {block_r}] fp32 (segment_lora_shrink's); "
                             f"got {tuple(s.shape)} {s.dtype}")
        launches = []
    elif splitk:
        launches = [shrink]
    elif live is None:
        launches = [(_segment_shrink_kernel, (n_tiles, g, split), shrink_args, shrink_meta)]
    else:  # (tiles, pointers ..., the live count after the tile table)
        launches = [(_live_shrink_kernel, (live_programs(x.device, n_tiles * g * split, per_sm[0]),),
                     shrink_args[:3] + (live,) + shrink_args[3:] + (g, split), shrink_meta)]
    block_n = 128 if x.is_cuda else 32
    expand_w = expand_warps(block_m, chunk) if warps[1] is None else warps[1]
    if expand == "held":
        launches += _held_launches(x, lora, outs, s, block_r, chunk, precision, accumulate, live, per_sm[1],
                                   n_blocks, held)
        return launches, s, split
    for i, y in enumerate(outs):
        n = y.shape[1]
        per = _expand_blocks_per_program(triton.cdiv(n, block_n)) if n_blocks is None else n_blocks
        n_col = triton.cdiv(n, block_n * per)
        args = (s[:, i], lora.pool, lora.tiles, lora.b_offsets[i], lora.ranks[i], lora.scales, y, n, y.stride(0),
                n_tiles, s.stride(0), block_r)
        meta = dict(BLOCK_M=block_m, BLOCK_R=chunk, BLOCK_N=block_n, N_BLOCKS=per, SPLIT=split,
                    DOT_PRECISION=precision, ACCUMULATE=accumulate,
                    **({"FACTOR_ALIGN": lora.factor_align} if expand_align and lora.factor_align > 1 else {}),
                    **({"num_stages": expand_stages} if expand_stages else {}),
                    **({} if expand_w is None else {"num_warps": expand_w}))
        if live is None:
            launches.append((_segment_expand_kernel, (n_tiles, n_col), args, meta))
        else:
            launches.append((_live_expand_kernel, (live_programs(x.device, n_tiles * n_col, per_sm[1]),),
                             args[:3] + (live,) + args[3:] + (n_col,), meta))
    return launches, s, split


def _held_launches(x: torch.Tensor, lora: SegmentLora, outs: Sequence[torch.Tensor], s: torch.Tensor, block_r: int,
                   chunk: int, precision: str, accumulate: bool, live: torch.Tensor | None, per_sm: int,
                   n_blocks: int | None, held: dict | None) -> list[tuple]:
    """The held expands' launches (``segment_expand``), one per projection, over the summed S."""
    opts = dict(HELD_EXPAND)
    if held:
        unknown = set(held) - set(HELD_EXPAND)
        if unknown:
            raise ValueError(f"held: unknown options {sorted(unknown)}; allowed: {sorted(HELD_EXPAND)}")
        opts.update(held)
    block_n = opts["block_n"] if x.is_cuda else 32
    lowp = bool(opts["lowp"]) and lora.pool.dtype != torch.float32
    align = lora.factor_align if opts["align"] and lora.factor_align > 1 else 1
    launches = []
    for i, y in enumerate(outs):
        n = y.shape[1]
        per = max(1, min(opts["n_blocks"] if n_blocks is None else n_blocks, triton.cdiv(n, block_n)))
        n_col = triton.cdiv(n, block_n * per)
        args = (s[0, i], lora.pool, lora.tiles, lora.b_offsets[i], lora.ranks[i], lora.scales, y, n, y.stride(0),
                lora.tiles.shape[1], block_r)
        meta = dict(BLOCK_M=lora.block_m, BLOCK_R=chunk, BLOCK_N=block_n, N_BLOCKS=per, DOT_PRECISION=precision,
                    ACCUMULATE=accumulate, FACTOR_ALIGN=align, LOWP=lowp, STAGES=opts["stages"],
                    COL_FASTEST=bool(opts["col_fastest"]), num_stages=opts["stages"],
                    **({"num_warps": opts["warps"]} if opts["warps"] else {}))
        if live is None:
            grid = (n_col, lora.tiles.shape[1]) if opts["col_fastest"] else (lora.tiles.shape[1], n_col)
            launches.append((segment_expand._held_expand_kernel, grid, args, meta))
        else:
            launches.append((segment_expand._live_held_expand_kernel,
                             (live_programs(x.device, lora.tiles.shape[1] * n_col, per_sm),),
                             args[:3] + (live,) + args[3:] + (n_col,), meta))
    return launches


def _specialisation(value) -> object:
    """What Triton's JIT specialises a runtime argument on: a tensor's dtype and 16-byte
    alignment, an int's "== 1" and "divisible by 16"."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), value.data_ptr() % 16 == 0)
    if isinstance(value, int):
        return (value == 1, value % 16 == 0)
    return type(value).__name__


def segment_kernel_variants(x: torch.Tensor, lora: SegmentLora, outs: Sequence[torch.Tensor], *,
                            n_blocks: int | None = None, split_k: int | None = None,
                            warps: tuple[int | None, int | None] = (None, None),
                            form: str | None = None, accumulate: bool = True, expand: str | None = None,
                            held: dict | None = None) -> frozenset[tuple]:
    """The compiled variants ``segment_lora_add(x, lora, outs, ..., form=form)`` (Triton path)
    needs: per launch, the kernel's name, its constexprs and options, and what the JIT
    specialises its other arguments on (``do_not_specialize`` ones left out). Two calls with
    equal sets run the same compiled kernels: the count of distinct keys over a workload is the
    count of compiles."""
    form = DEFAULT_FORM if form is None else form
    if form == "tiles":
        launches = tile_launches(x, lora, outs, n_blocks=n_blocks, split_k=split_k, warps=warps)
        shrink, shrink_skip, expand_skip = (lora_tiles._tile_shrink_kernel, lora_tiles._SHRINK_UNSPECIALISED,
                                            lora_tiles._EXPAND_UNSPECIALISED)
    elif form == "items":
        launches = splitk_launches(x, lora, outs, accumulate=accumulate, split_k=split_k, n_blocks=n_blocks,
                                   warps=warps)
        shrink, shrink_skip, expand_skip = (lora_splitk._splitk_shrink_kernel, lora_splitk._SHRINK_UNSPECIALISED,
                                            lora_splitk._EXPAND_UNSPECIALISED)
    elif form == "splitk":
        launches = _segment_launches(x, lora, outs, n_blocks=n_blocks, split_k=split_k, warps=warps,
                                     accumulate=accumulate, splitk=True, expand=expand, held=held)
        shrink, shrink_skip, expand_skip = (lora_splitk._splitk_shrink_kernel, lora_splitk._SHRINK_UNSPECIALISED,
                                            _EXPAND_UNSPECIALISED)
    else:
        launches = _segment_launches(x, lora, outs, n_blocks=n_blocks, split_k=split_k, warps=warps,
                                     accumulate=accumulate)
        shrink, shrink_skip, expand_skip = _segment_shrink_kernel, _SHRINK_UNSPECIALISED, _EXPAND_UNSPECIALISED
    keys = set()
    for kernel, _grid, args, meta in launches:
        names = kernel.arg_names
        skip = (_LIVE_SHRINK_UNSPECIALISED if kernel is _live_shrink_kernel else
                _LIVE_EXPAND_UNSPECIALISED if kernel is _live_expand_kernel else
                segment_expand._UNSPECIALISED if kernel is segment_expand._held_expand_kernel else
                segment_expand._LIVE_UNSPECIALISED if kernel is segment_expand._live_held_expand_kernel else
                shrink_skip if kernel is shrink else expand_skip)
        spec = tuple(_specialisation(v) for name, v in zip(names, args) if name not in skip)
        keys.add((kernel.fn.__name__,
                  tuple(sorted(meta.items())), spec))
    return frozenset(keys)
