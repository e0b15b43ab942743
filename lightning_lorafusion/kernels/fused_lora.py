"""FusedLoRA / FusedMultiLoRA: Triton kernels, launchers and the autograd Function.

One call handles a group of projections that share an input (q/k/v, gate/up, or a single
o/down projection) for every adapter routed in the microbatch. The graph is split at the small
tensor S = dropout(X) A^T (compact ``[rows, total rank of the row's adapter]``):

forward
  1. ``_lora_s_kernel``: S for all projections of a row tile in one pass over X (dropout mask
     drawn in-kernel from the hash, never stored).
  2. ``_lora_fwd_gemm_kernel``: Y_i = X W_i^T (+ bias) + scale * S_i B_i^T, the LoRA term
     accumulated into the GEMM's accumulator.
backward
  3. ``_lora_ds_kernel``: dS_i = scale * dY_i B_i (per row tile).
  4. ``_lora_db_kernel``: dB_i = scale * dY_i^T S_i (per adapter, split over its tiles).
  5. ``_lora_dx_gemm_kernel``: dX = sum_i dY_i W_i + (dS A) * mask / (1 - p), the LoRA term in
     the same accumulator as the frozen GEMM.
  6. ``_lora_da_kernel``: dA = dS^T (X * mask / (1 - p)), mask regenerated.

Saved for backward: X (held by the previous layer anyway), S, and references to the frozen
weights and the small concatenated A/B.

FP8 base (``fp8_linear.Fp8Weight`` weights): the frozen products of steps 2 and 5 go through
``fp8_linear`` (X quantized once per group; dX of the group in one product) and the LoRA terms
are added in place by ``_lora_add_kernel``, whatever ``LoraBlockSizes.gemm`` says. Routing is per row tile (``routing_table.py``), so any
segment layout is correct; segments padded to ``block_sizes.pad_multiple()`` avoid partial tiles.

Host side: a ``_Plan`` (table, grids, constexprs, split counts, ``triton_launch.CachedLaunch``
objects) is built by the first call of a microbatch for each group shape and reused by every
layer, so a call costs a dictionary lookup plus the launches themselves.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .block_sizes import GEMM_MODES, LoraBlockSizes, block_sizes_for
from .fp8_linear import Fp8Weight, fp8_input_grad, fp8_outputs, frozen_projections, resolve_emulate
from .dropout_triton import hash_base, keep_bits16, offset_hash_arg, pair_hash, row_hash
from .reference import LoraModuleWeights, LoraRouting
from .routing_table import AI_FIRST_PROJ, AI_PER_PROJ, PLAN_KEY, LoraLaunchTable, build_launch_table
from .triton_launch import CachedLaunch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_FUSED_DX_PROJECTIONS = 3  # dX GEMM sums up to this many (dY_i, W_i) pairs per launch
FP8_NAME = "fp8 (Fp8Weight)"


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _grouped_pid(pid, num_m, num_n, GROUP_M: tl.constexpr):
    # Neighbouring programs share row blocks so their X / dY tiles stay in L2.
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _load_tile(tiles_ptr, t):
    row_start = tl.load(tiles_ptr + t * 4)
    row_end = tl.load(tiles_ptr + t * 4 + 1)
    adapter = tl.load(tiles_ptr + t * 4 + 2)
    s_off = tl.load(tiles_ptr + t * 4 + 3)
    return row_start, row_end, adapter, s_off


@triton.jit
def _row_window(row_start, row_end, sub, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr):
    """Even and odd rows of sub-window ``sub`` of the (block-aligned, so pair-aligned) row block
    holding a tile; the dropout hash serves each (even, odd) row pair with one 32-bit value."""
    win = (row_start // TILE_M) * TILE_M + sub * BLOCK_M
    pairs = win // 2 + tl.arange(0, BLOCK_M // 2)
    rows_e = pairs * 2
    rows_o = rows_e + 1
    ok_e = (rows_e >= row_start) & (rows_e < row_end)
    ok_o = (rows_o >= row_start) & (rows_o < row_end)
    live = (win < row_end) & (win + BLOCK_M > row_start)
    return pairs, rows_e, rows_o, ok_e, ok_o, live


@triton.jit(do_not_specialize=["offset_h"])
def _lora_s_kernel(
    x_ptr, a_ptr, s_ptr, tiles_ptr, ai_ptr, af_ptr, offset_h, K, subs,
    AI_STRIDE: tl.constexpr, HAS_DROPOUT: tl.constexpr, TILE_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """S[tile rows, rank block] = dropout(X[tile rows]) A_a^T over all of the adapter's A rows.

    Each row block is covered by ``subs`` programs of BLOCK_M rows (more programs in flight);
    a program handles its even and odd rows as two halves sharing one hash evaluation.
    """
    t = tl.program_id(0) // subs
    sub = tl.program_id(0) % subs
    rb = tl.program_id(1)
    row_start, row_end, adapter, s_off = _load_tile(tiles_ptr, t)
    width = tl.load(ai_ptr + adapter * AI_STRIDE)
    a_row = tl.load(ai_ptr + adapter * AI_STRIDE + 1)
    seed_h = tl.load(ai_ptr + adapter * AI_STRIDE + 2)
    threshold = tl.load(ai_ptr + adapter * AI_STRIDE + 3).to(tl.uint32)
    inv_keep = tl.load(af_ptr + adapter * 2 + 1)
    pairs, rows_e, rows_o, ok_e, ok_o, live = _row_window(row_start, row_end, sub, TILE_M, BLOCK_M)
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < width
    k_stop = tl.where((rb * BLOCK_R < width) & live, K, 0)
    pair_h = row_hash(hash_base(seed_h, offset_h), pairs)
    acc_e = tl.zeros((BLOCK_M // 2, BLOCK_R), dtype=tl.float32)
    acc_o = tl.zeros((BLOCK_M // 2, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, k_stop, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        xe = tl.load(x_ptr + rows_e[:, None] * K + offs_k[None, :],
                     mask=ok_e[:, None] & k_ok[None, :], other=0.0)
        xo = tl.load(x_ptr + rows_o[:, None] * K + offs_k[None, :],
                     mask=ok_o[:, None] & k_ok[None, :], other=0.0)
        if HAS_DROPOUT:  # 1 / (1 - p) is applied to the accumulator at the end
            h = pair_hash(pair_h, offs_k)
            xe = tl.where((h & 0xFFFF) >= threshold, xe, 0.0).to(x_ptr.dtype.element_ty)
            xo = tl.where((h >> 16) >= threshold, xo, 0.0).to(x_ptr.dtype.element_ty)
        at = tl.load(a_ptr + (a_row + offs_r)[None, :] * K + offs_k[:, None],
                     mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        acc_e = tl.dot(xe, at, acc_e, input_precision=DOT_PRECISION)
        acc_o = tl.dot(xo, at, acc_o, input_precision=DOT_PRECISION)
    s_cols = s_ptr + s_off + offs_r[None, :]
    tl.store(s_cols + (rows_e - row_start)[:, None] * width, (acc_e * inv_keep).to(s_ptr.dtype.element_ty),
             mask=ok_e[:, None] & r_ok[None, :])
    tl.store(s_cols + (rows_o - row_start)[:, None] * width, (acc_o * inv_keep).to(s_ptr.dtype.element_ty),
             mask=ok_o[:, None] & r_ok[None, :])


@triton.jit
def _lora_fwd_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, s_ptr, b_ptr,
    tiles_ptr, block_tiles_ptr, ai_ptr, af_ptr,
    M, N, K, b_stride, proj_col,
    AI_STRIDE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
    MAIN_LOOP: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Y[M, N] = X W^T (+ bias) + per-row scale * S_i B_i^T.

    With ``MAIN_LOOP=False`` only the LoRA term (+ bias; 0 on rows without LoRA) is written:
    cuBLAS then accumulates the frozen product onto it (``gemm="cublas_accumulate"``)."""
    pid_m, pid_n = _grouped_pid(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_m % M  # wrapped so full tiles load in bounds; the store is masked
    cols = offs_n % N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_LORA:
        t0 = tl.load(block_tiles_ptr + pid_m)
        t1 = tl.load(block_tiles_ptr + pid_m + 1)
        for t in range(t0, t1):
            row_start, row_end, adapter, s_off = _load_tile(tiles_ptr, t)
            width = tl.load(ai_ptr + adapter * AI_STRIDE)
            rank = tl.load(ai_ptr + adapter * AI_STRIDE + proj_col)
            s_col = tl.load(ai_ptr + adapter * AI_STRIDE + proj_col + 1)
            b_col = tl.load(ai_ptr + adapter * AI_STRIDE + proj_col + 2)
            scale = tl.load(af_ptr + adapter * 2)
            row_ok = (offs_m >= row_start) & (offs_m < row_end)
            s_rows = s_ptr + s_off + (offs_m - row_start) * width + s_col
            for r0 in range(0, rank, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_ok = offs_r < rank
                st = tl.load(s_rows[:, None] + offs_r[None, :],
                             mask=row_ok[:, None] & r_ok[None, :], other=0.0)
                st = (st.to(tl.float32) * scale).to(b_ptr.dtype.element_ty)
                bt = tl.load(b_ptr + cols[None, :] * b_stride + b_col + offs_r[:, None],
                             mask=r_ok[:, None], other=0.0)
                acc = tl.dot(st, bt, acc, input_precision=DOT_PRECISION)
    y_ptrs = y_ptr + offs_m[:, None] * N + offs_n[None, :]
    y_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if MAIN_LOOP:
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * K + offs_k[None, :]
        w_ptrs = w_ptr + cols[None, :] * K + offs_k[:, None]
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                xt = tl.load(x_ptrs)
                wt = tl.load(w_ptrs)
            else:
                k_ok = offs_k < K - k0
                xt = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                wt = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            acc = tl.dot(xt, wt, acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    elif HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit(do_not_specialize=["offset_h"])
def _lora_add_kernel(
    out_ptr, left_ptr, right_ptr, tiles_ptr, ai_ptr, af_ptr, offset_h, N, right_stride, proj_col,
    subs, AI_STRIDE: tl.constexpr, DX_MODE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    N_BLOCKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """In place, on the rows of one tile: out[rows, cols] += LoRA term (cuBLAS GEMM mode).

    forward (``DX_MODE=False``): out = Y [M, N_i], term = scale * S_i B_i^T;
    dX (``DX_MODE=True``): out = dX [M, K], term = (dS A_a) * mask / (1 - p).
    Rows outside every tile are never touched. Even and odd rows are handled as two halves.
    """
    t = tl.program_id(0) // subs
    sub = tl.program_id(0) % subs
    pid_n = tl.program_id(1)
    row_start, row_end, adapter, s_off = _load_tile(tiles_ptr, t)
    width = tl.load(ai_ptr + adapter * AI_STRIDE)
    if DX_MODE:
        rank = width
        left_col = 0
        right_off = tl.load(ai_ptr + adapter * AI_STRIDE + 1) * right_stride  # A rows a_row..
        factor = tl.load(af_ptr + adapter * 2 + 1)
    else:
        rank = tl.load(ai_ptr + adapter * AI_STRIDE + proj_col)
        left_col = tl.load(ai_ptr + adapter * AI_STRIDE + proj_col + 1)
        right_off = tl.load(ai_ptr + adapter * AI_STRIDE + proj_col + 2)  # B columns b_col..
        factor = tl.load(af_ptr + adapter * 2)
    pairs, rows_e, rows_o, ok_e, ok_o, live = _row_window(row_start, row_end, sub, TILE_M, BLOCK_M)
    if DX_MODE:
        if HAS_DROPOUT:
            seed_h = tl.load(ai_ptr + adapter * AI_STRIDE + 2)
            threshold = tl.load(ai_ptr + adapter * AI_STRIDE + 3).to(tl.uint32)
            pair_h = row_hash(hash_base(seed_h, offset_h), pairs)
    r_stop = tl.where(live, rank, 0)
    left_e = left_ptr + s_off + (rows_e - row_start) * width + left_col
    left_o = left_ptr + s_off + (rows_o - row_start) * width + left_col
    # Each program sweeps N_BLOCKS column blocks, so the table lookups above are paid once.
    n_begin = pid_n * N_BLOCKS * BLOCK_N
    n_end = tl.where(live, tl.minimum(N, n_begin + N_BLOCKS * BLOCK_N), n_begin)
    for n0 in range(n_begin, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        okn_e = ok_e[:, None] & n_ok[None, :]
        okn_o = ok_o[:, None] & n_ok[None, :]
        out_e = out_ptr + rows_e[:, None] * N + offs_n[None, :]
        out_o = out_ptr + rows_o[:, None] * N + offs_n[None, :]
        cur_e = tl.load(out_e, mask=okn_e, other=0.0)  # issued first: overlaps the small products
        cur_o = tl.load(out_o, mask=okn_o, other=0.0)
        part_e = tl.zeros((BLOCK_M // 2, BLOCK_N), dtype=tl.float32)
        part_o = tl.zeros((BLOCK_M // 2, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, r_stop, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_ok = offs_r < rank
            if DX_MODE:  # A_a[j, k] at a_ptr + (a_row + j) * K + k
                rt = tl.load(right_ptr + right_off + offs_r[:, None] * right_stride + offs_n[None, :],
                             mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            else:  # B_i[n, j] at b_ptr + n * b_stride + b_col + j
                rt = tl.load(right_ptr + right_off + offs_r[:, None] + offs_n[None, :] * right_stride,
                             mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            le = tl.load(left_e[:, None] + offs_r[None, :], mask=ok_e[:, None] & r_ok[None, :], other=0.0)
            lo = tl.load(left_o[:, None] + offs_r[None, :], mask=ok_o[:, None] & r_ok[None, :], other=0.0)
            part_e = tl.dot(le, rt, part_e, input_precision=DOT_PRECISION)
            part_o = tl.dot(lo, rt, part_o, input_precision=DOT_PRECISION)
        part_e = part_e * factor
        part_o = part_o * factor
        if DX_MODE:
            if HAS_DROPOUT:
                h = pair_hash(pair_h, offs_n)
                part_e = tl.where((h & 0xFFFF) >= threshold, part_e, 0.0)
                part_o = tl.where((h >> 16) >= threshold, part_o, 0.0)
        tl.store(out_e, (cur_e.to(tl.float32) + part_e).to(out_ptr.dtype.element_ty), mask=okn_e)
        tl.store(out_o, (cur_o.to(tl.float32) + part_o).to(out_ptr.dtype.element_ty), mask=okn_o)


@triton.jit
def _lora_ds_kernel(
    dy_ptr, b_ptr, ds_ptr, tiles_ptr, ai_ptr, af_ptr, N, b_stride, proj_col, subs,
    AI_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dS_i[tile rows, rank block] = scale * dY_i[tile rows] B_i (projection i's columns of dS)."""
    t = tl.program_id(0) // subs
    sub = tl.program_id(0) % subs
    rb = tl.program_id(1)
    row_start, row_end, adapter, s_off = _load_tile(tiles_ptr, t)
    width = tl.load(ai_ptr + adapter * AI_STRIDE)
    rank = tl.load(ai_ptr + adapter * AI_STRIDE + proj_col)
    s_col = tl.load(ai_ptr + adapter * AI_STRIDE + proj_col + 1)
    b_col = tl.load(ai_ptr + adapter * AI_STRIDE + proj_col + 2)
    scale = tl.load(af_ptr + adapter * 2)
    offs_m = row_start + sub * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < row_end
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    n_stop = tl.where((rb * BLOCK_R < rank) & (row_start + sub * BLOCK_M < row_end), N, 0)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for n0 in range(0, n_stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        dyt = tl.load(dy_ptr + offs_m[:, None] * N + offs_n[None, :],
                      mask=row_ok[:, None] & n_ok[None, :], other=0.0)
        bt = tl.load(b_ptr + offs_n[:, None] * b_stride + b_col + offs_r[None, :],
                     mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        acc = tl.dot(dyt, bt, acc, input_precision=DOT_PRECISION)
    ds_ptrs = ds_ptr + s_off + (offs_m - row_start)[:, None] * width + s_col + offs_r[None, :]
    tl.store(ds_ptrs, (acc * scale).to(ds_ptr.dtype.element_ty),
             mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _lora_db_kernel(
    dy_ptr, s_ptr, part_ptr, tiles_ptr, adapter_tiles_ptr, adapter_tile_ptr_ptr, ai_ptr, af_ptr,
    N, b_cols, part_stride, proj_col, num_rblocks, split,
    AI_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """part[sp] (``part_stride`` apart) as [N, b_cols]: scale * dY_i^T S_i over share ``sp`` of an
    adapter's row tiles."""
    pid_n = tl.program_id(0)
    adapter = tl.program_id(1) // num_rblocks
    rb = tl.program_id(1) % num_rblocks
    sp = tl.program_id(2)
    width = tl.load(ai_ptr + adapter * AI_STRIDE)
    rank = tl.load(ai_ptr + adapter * AI_STRIDE + proj_col)
    s_col = tl.load(ai_ptr + adapter * AI_STRIDE + proj_col + 1)
    b_col = tl.load(ai_ptr + adapter * AI_STRIDE + proj_col + 2)
    scale = tl.load(af_ptr + adapter * 2)
    j0 = tl.load(adapter_tile_ptr_ptr + adapter)
    j1 = tl.load(adapter_tile_ptr_ptr + adapter + 1)
    per = tl.cdiv(j1 - j0, split)
    js = j0 + sp * per
    je = tl.minimum(js + per, j1)
    je = tl.where(rb * BLOCK_R < rank, je, js)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for j in range(js, je):
        t = tl.load(adapter_tiles_ptr + j)
        row_start, row_end, _a, s_off = _load_tile(tiles_ptr, t)
        offs_m = row_start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < row_end
        dyt = tl.load(dy_ptr + offs_m[None, :] * N + offs_n[:, None],
                      mask=n_ok[:, None] & row_ok[None, :], other=0.0)
        st = tl.load(s_ptr + s_off + (offs_m - row_start)[:, None] * width + s_col + offs_r[None, :],
                     mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        acc = tl.dot(dyt, st, acc, input_precision=DOT_PRECISION)
    p_ptrs = part_ptr + sp * part_stride + offs_n[:, None] * b_cols + b_col + offs_r[None, :]
    tl.store(p_ptrs, acc * scale, mask=n_ok[:, None] & r_ok[None, :])


@triton.jit
def _dy_times_w(acc, dy_ptr, w_ptr, N, K, rows, kcols,
                EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    dy_ptrs = dy_ptr + rows[:, None] * N + offs_n[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * K + kcols[None, :]
    for n0 in range(0, N, BLOCK_N):
        if EVEN_N:
            dyt = tl.load(dy_ptrs)
            wt = tl.load(w_ptrs)
        else:
            n_ok = offs_n < N - n0
            dyt = tl.load(dy_ptrs, mask=n_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        acc = tl.dot(dyt, wt, acc, input_precision=DOT_PRECISION)
        dy_ptrs += BLOCK_N
        w_ptrs += BLOCK_N * K
    return acc


@triton.jit(do_not_specialize=["offset_h"])
def _lora_dx_gemm_kernel(
    dy0_ptr, w0_ptr, N0, dy1_ptr, w1_ptr, N1, dy2_ptr, w2_ptr, N2,
    prev_ptr, dx_ptr, ds_ptr, a_ptr, tiles_ptr, block_tiles_ptr, ai_ptr, af_ptr,
    offset_h, M, K,
    AI_STRIDE: tl.constexpr, NUM_PROJ: tl.constexpr, HAS_PREV: tl.constexpr,
    HAS_LORA: tl.constexpr, HAS_DROPOUT: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dX[M, K] = sum_i dY_i W_i (+ prev) + (dS A_a) * mask / (1 - p) per row.

    ``NUM_PROJ=0`` with ``prev_ptr == dx_ptr`` adds the LoRA term in place to a dX that cuBLAS
    already wrote (each program reads its tile before writing it)."""
    pid_m, pid_k = _grouped_pid(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_K), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = offs_m % M
    kcols = offs_k % K
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    if HAS_LORA:
        t0 = tl.load(block_tiles_ptr + pid_m)
        t1 = tl.load(block_tiles_ptr + pid_m + 1)
        for t in range(t0, t1):
            row_start, row_end, adapter, s_off = _load_tile(tiles_ptr, t)
            width = tl.load(ai_ptr + adapter * AI_STRIDE)
            a_row = tl.load(ai_ptr + adapter * AI_STRIDE + 1)
            row_ok = (offs_m >= row_start) & (offs_m < row_end)
            ds_rows = ds_ptr + s_off + (offs_m - row_start) * width
            part = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
            for r0 in range(0, width, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_ok = offs_r < width
                dst = tl.load(ds_rows[:, None] + offs_r[None, :],
                              mask=row_ok[:, None] & r_ok[None, :], other=0.0)
                at = tl.load(a_ptr + (a_row + offs_r)[:, None] * K + kcols[None, :],
                             mask=r_ok[:, None], other=0.0)
                part = tl.dot(dst, at, part, input_precision=DOT_PRECISION)
            if HAS_DROPOUT:
                seed_h = tl.load(ai_ptr + adapter * AI_STRIDE + 2)
                threshold = tl.load(ai_ptr + adapter * AI_STRIDE + 3).to(tl.uint32)
                inv_keep = tl.load(af_ptr + adapter * 2 + 1)
                keep = keep_bits16(hash_base(seed_h, offset_h), offs_m, offs_k) >= threshold
                part = tl.where(keep, part * inv_keep, 0.0)
            acc += part
    if NUM_PROJ > 0:
        acc = _dy_times_w(acc, dy0_ptr, w0_ptr, N0, K, rows, kcols, EVEN_N, BLOCK_N, DOT_PRECISION)
    if NUM_PROJ > 1:
        acc = _dy_times_w(acc, dy1_ptr, w1_ptr, N1, K, rows, kcols, EVEN_N, BLOCK_N, DOT_PRECISION)
    if NUM_PROJ > 2:
        acc = _dy_times_w(acc, dy2_ptr, w2_ptr, N2, K, rows, kcols, EVEN_N, BLOCK_N, DOT_PRECISION)
    out_mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    out_off = offs_m[:, None] * K + offs_k[None, :]
    if HAS_PREV:
        acc += tl.load(prev_ptr + out_off, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + out_off, acc.to(dx_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["offset_h"])
def _lora_da_kernel(
    x_ptr, ds_ptr, part_ptr, tiles_ptr, adapter_tiles_ptr, adapter_tile_ptr_ptr, ai_ptr, af_ptr,
    offset_h, K, part_stride, num_rblocks, split,
    AI_STRIDE: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """part[sp] (``part_stride`` apart) as [a_rows, K]: dS_a^T (X * mask / (1 - p)) over share
    ``sp`` of an adapter's tiles."""
    pid_k = tl.program_id(0)
    adapter = tl.program_id(1) // num_rblocks
    rb = tl.program_id(1) % num_rblocks
    sp = tl.program_id(2)
    width = tl.load(ai_ptr + adapter * AI_STRIDE)
    a_row = tl.load(ai_ptr + adapter * AI_STRIDE + 1)
    seed_h = tl.load(ai_ptr + adapter * AI_STRIDE + 2)
    threshold = tl.load(ai_ptr + adapter * AI_STRIDE + 3).to(tl.uint32)
    inv_keep = tl.load(af_ptr + adapter * 2 + 1)
    j0 = tl.load(adapter_tile_ptr_ptr + adapter)
    j1 = tl.load(adapter_tile_ptr_ptr + adapter + 1)
    per = tl.cdiv(j1 - j0, split)
    js = j0 + sp * per
    je = tl.minimum(js + per, j1)
    je = tl.where(rb * BLOCK_R < width, je, js)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < width
    base = hash_base(seed_h, offset_h)
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for j in range(js, je):
        t = tl.load(adapter_tiles_ptr + j)
        row_start, row_end, _a, s_off = _load_tile(tiles_ptr, t)
        pairs, rows_e, rows_o, ok_e, ok_o, _live = _row_window(row_start, row_end, 0, BLOCK_M, BLOCK_M)
        ds_cols = ds_ptr + s_off + offs_r[:, None]
        dse = tl.load(ds_cols + (rows_e - row_start)[None, :] * width,
                      mask=r_ok[:, None] & ok_e[None, :], other=0.0)
        dso = tl.load(ds_cols + (rows_o - row_start)[None, :] * width,
                      mask=r_ok[:, None] & ok_o[None, :], other=0.0)
        xe = tl.load(x_ptr + rows_e[:, None] * K + offs_k[None, :],
                     mask=ok_e[:, None] & k_ok[None, :], other=0.0)
        xo = tl.load(x_ptr + rows_o[:, None] * K + offs_k[None, :],
                     mask=ok_o[:, None] & k_ok[None, :], other=0.0)
        if HAS_DROPOUT:  # 1 / (1 - p) is applied to the accumulator at the end
            h = pair_hash(row_hash(base, pairs), offs_k)
            xe = tl.where((h & 0xFFFF) >= threshold, xe, 0.0).to(x_ptr.dtype.element_ty)
            xo = tl.where((h >> 16) >= threshold, xo, 0.0).to(x_ptr.dtype.element_ty)
        acc = tl.dot(dse, xe, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(dso, xo, acc, input_precision=DOT_PRECISION)
    acc = acc * inv_keep
    p_ptrs = part_ptr + sp * part_stride + (a_row + offs_r)[:, None] * K + offs_k[None, :]
    tl.store(p_ptrs, acc, mask=r_ok[:, None] & k_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Launch plans and launchers
# ----------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _round16b(numel: int) -> int:
    # fp32 elements up to the next multiple of 16 bytes (keeps sub-buffer pointers aligned)
    return _cdiv(numel, 4) * 4


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get full-precision dots (tests compare to float64); 16-bit ones ignore this.
    return "ieee" if dtype == torch.float32 else "tf32"


def _rank_block(rank: int, cap: int) -> int:
    return max(16, min(cap, _next_pow2(rank)))


def _split_count(programs: int, max_tiles: int, sms: int | None, waves: int) -> int:
    """How many shares to split an adapter's tiles into so the grid fills the GPU ``waves``
    times over (programs per SM); ``sms=None`` (interpreter): 2, to exercise the split path."""
    if max_tiles <= 1:
        return 1
    if sms is None:
        return min(2, max_tiles)
    return max(1, min(max_tiles, _cdiv(waves * sms, max(programs, 1))))


class _Plan:
    """Everything host-side about one projection group's launches on one routing table.

    Built once per (routing table, K, N_i, dtype, device, block sizes) and cached in the
    routing's ``launch_cache``, so every layer of a microbatch reuses it: grids, tile sizes and
    constexprs (``CachedLaunch`` objects, made on first use), the device's SM count, the dA/dB
    split count and the layout of their joint fp32 partial-sum buffer ``[split, part_numel]``
    (dA ``[a_rows, K]`` at ``part_offsets[0]``, dB_i ``[N_i, b_cols_i]`` at ``part_offsets[1 + i]``).
    """

    __slots__ = ("table", "sizes", "m", "k", "ns", "precision", "split", "part_offsets", "part_numel",
                 "launches")

    def __init__(self, table, sizes: LoraBlockSizes, *, m: int, k: int, ns: Sequence[int],
                 b_cols: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
        self.table, self.sizes, self.m, self.k, self.ns = table, sizes, m, k, tuple(ns)
        self.precision = _dot_precision(dtype)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
        # one split for dA and every dB (they share the partial buffer), sized for dA, which
        # reads X and is the largest of them
        rblocks = _cdiv(table.max_total_rank, _rank_block(table.max_total_rank, 64))
        programs = _cdiv(k, sizes.skinny_block_k) * len(table.active) * rblocks
        self.split = _split_count(programs, table.max_adapter_tiles, sms, sizes.split_waves)
        offsets, numel = [0], _round16b(table.a_rows * k)
        for n, bc in zip(self.ns, b_cols):
            offsets.append(numel)
            numel += _round16b(n * bc)
        self.part_offsets, self.part_numel = tuple(offsets), numel
        self.launches: dict = {}

    def get(self, key, build, *args):
        """The launch stored under ``key``, made by ``build(self, *args)`` on first use."""
        hit = self.launches.get(key)
        if hit is None:
            hit = self.launches[key] = build(self, *args)
        return hit


def _skinny_rows(plan: _Plan, block_m: int) -> tuple[int, int]:
    sub_m = min(block_m, plan.table.block_m)
    return sub_m, plan.table.block_m // sub_m


def _build_s(plan: _Plan):
    t, sz = plan.table, plan.sizes
    block_r = _rank_block(t.max_total_rank, 128)
    sub_m, subs = _skinny_rows(plan, sz.skinny_block_m)
    launch = CachedLaunch(
        _lora_s_kernel, (t.num_tiles * subs, _cdiv(t.max_total_rank, block_r)),
        num_warps=sz.skinny_warps if block_r <= 64 else 8, num_stages=sz.skinny_stages,
        AI_STRIDE=t.adapter_int.shape[1], HAS_DROPOUT=t.has_dropout, TILE_M=t.block_m, BLOCK_M=sub_m,
        BLOCK_R=block_r, BLOCK_K=sz.skinny_block_k, DOT_PRECISION=plan.precision,
    )
    return launch, (plan.k, subs)


def _launch_s(x, a_all, plan: _Plan, off_h: int) -> torch.Tensor:
    t = plan.table
    s = torch.empty(max(t.s_numel, 1), dtype=x.dtype, device=x.device)
    launch, fixed = plan.get("s", _build_s)
    launch(x, a_all, s, t.tiles, t.adapter_int, t.adapter_float, off_h, *fixed)
    return s


def _build_add(plan: _Plan, proj: int, dx_mode: bool, n: int, right_stride: int):
    t, sz = plan.table, plan.sizes
    sub_m, subs = _skinny_rows(plan, sz.add_block_m)
    rank = t.max_total_rank if dx_mode else t.max_rank[proj]
    launch = CachedLaunch(
        _lora_add_kernel, (t.num_tiles * subs, _cdiv(n, sz.add_block_n * sz.add_n_blocks)),
        num_warps=sz.add_warps, num_stages=2,
        AI_STRIDE=t.adapter_int.shape[1], DX_MODE=dx_mode, HAS_DROPOUT=t.has_dropout, TILE_M=t.block_m,
        BLOCK_M=sub_m, BLOCK_N=sz.add_block_n, BLOCK_R=_rank_block(rank, sz.rank_block),
        N_BLOCKS=sz.add_n_blocks, DOT_PRECISION=plan.precision,
    )
    return launch, (n, right_stride, AI_FIRST_PROJ + AI_PER_PROJ * proj, subs)


def _launch_add(out, left, right, proj: int, plan: _Plan, off_h: int, dx_mode: bool) -> None:
    """``out += LoRA term`` on the tiles' rows (see ``_lora_add_kernel``)."""
    t = plan.table
    launch, fixed = plan.get(("add", proj, dx_mode), _build_add, proj, dx_mode, out.shape[1], right.shape[1])
    launch(out, left, right, t.tiles, t.adapter_int, t.adapter_float, off_h, *fixed)


def _launch_fwd_fp8(x, weights, biases, s, b_cats, plan: _Plan) -> list[torch.Tensor]:
    """FP8 frozen products of the group (X quantized once), each LoRA term added in place."""
    ys = fp8_outputs(x, weights, biases, emulate=resolve_emulate(x.device, None))
    for proj, (y, b_cat) in enumerate(zip(ys, b_cats)):
        if b_cat is not None and plan.table.max_rank[proj] > 0:
            _launch_add(y, s, b_cat, proj, plan, 0, dx_mode=False)
    return ys


def _build_fwd_gemm(plan: _Plan, proj: int, has_bias: bool, has_lora: bool, n: int, b_stride: int):
    t, sz = plan.table, plan.sizes
    bm, bn, bk = sz.block_m, sz.fwd_block_n, sz.fwd_block_k
    launch = CachedLaunch(
        _lora_fwd_gemm_kernel, (_cdiv(plan.m, bm) * _cdiv(n, bn),),
        num_warps=sz.fwd_warps, num_stages=sz.fwd_stages,
        AI_STRIDE=t.adapter_int.shape[1], HAS_BIAS=has_bias, HAS_LORA=has_lora,
        MAIN_LOOP=sz.gemm == "triton",
        EVEN_K=plan.k % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_R=_rank_block(t.max_rank[proj], sz.rank_block), GROUP_M=sz.group_m,
        DOT_PRECISION=plan.precision,
    )
    return launch, (plan.m, n, plan.k, b_stride, AI_FIRST_PROJ + AI_PER_PROJ * proj)


def _launch_fwd_gemm(x, w, bias, s, b_cat, proj: int, plan: _Plan) -> torch.Tensor:
    t, gemm = plan.table, plan.sizes.gemm
    has_lora = b_cat is not None and t.max_rank[proj] > 0
    if gemm == "cublas" or (gemm == "cublas_accumulate" and not has_lora):
        y = torch.nn.functional.linear(x, w, bias)  # cuBLAS; the LoRA term is added in place
        if has_lora:
            _launch_add(y, s, b_cat, proj, plan, 0, dx_mode=False)
        return y
    n = w.shape[0]
    y = torch.empty(plan.m, n, dtype=x.dtype, device=x.device)
    launch, fixed = plan.get(("fwd", proj, bias is not None, has_lora), _build_fwd_gemm, proj,
                             bias is not None, has_lora, n, b_cat.shape[1] if has_lora else 0)
    launch(x, w, bias if bias is not None else w, y, s if has_lora else x, b_cat if has_lora else w,
           t.tiles, t.block_tiles, t.adapter_int, t.adapter_float, *fixed)
    if gemm == "cublas_accumulate":  # Y holds scale * S B^T (+ bias): add X W^T (beta = 1)
        y.addmm_(x, w.t())
    return y


def _build_ds(plan: _Plan, proj: int, n: int, b_stride: int):
    t, sz = plan.table, plan.sizes
    block_r = _rank_block(t.max_rank[proj], 128)
    sub_m, subs = _skinny_rows(plan, sz.skinny_block_m)
    launch = CachedLaunch(
        _lora_ds_kernel, (t.num_tiles * subs, _cdiv(t.max_rank[proj], block_r)),
        num_warps=sz.skinny_warps if block_r <= 64 else 8, num_stages=sz.skinny_stages,
        AI_STRIDE=t.adapter_int.shape[1], BLOCK_M=sub_m, BLOCK_R=block_r, BLOCK_N=sz.skinny_block_k,
        DOT_PRECISION=plan.precision,
    )
    return launch, (n, b_stride, AI_FIRST_PROJ + AI_PER_PROJ * proj, subs)


def _launch_ds(dy, b_cat, ds, proj: int, plan: _Plan) -> None:
    t = plan.table
    launch, fixed = plan.get(("ds", proj), _build_ds, proj, dy.shape[1], b_cat.shape[1])
    launch(dy, b_cat, ds, t.tiles, t.adapter_int, t.adapter_float, *fixed)


def _build_db(plan: _Plan, proj: int, n: int, b_cols: int):
    t, sz = plan.table, plan.sizes
    block_r = _rank_block(t.max_rank[proj], 64)
    block_n = sz.skinny_block_k
    rblocks = _cdiv(t.max_rank[proj], block_r)
    launch = CachedLaunch(
        _lora_db_kernel, (_cdiv(n, block_n), t.num_adapters * rblocks, plan.split),
        num_warps=sz.skinny_warps, num_stages=sz.skinny_stages,
        AI_STRIDE=t.adapter_int.shape[1], BLOCK_M=t.block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        DOT_PRECISION=plan.precision,
    )
    return launch, (n, b_cols, plan.part_numel, AI_FIRST_PROJ + AI_PER_PROJ * proj, rblocks, plan.split)


def _launch_db(dy, s, b_cat, part: torch.Tensor, proj: int, plan: _Plan) -> None:
    """dB_i's partial sums into ``part`` (the plan's joint partial buffer), at its offset."""
    t = plan.table
    launch, fixed = plan.get(("db", proj), _build_db, proj, dy.shape[1], b_cat.shape[1])
    off = plan.part_offsets[1 + proj]
    launch(dy, s, part[:, off:], t.tiles, t.adapter_tiles, t.adapter_tile_ptr, t.adapter_int,
           t.adapter_float, *fixed)


def _build_da(plan: _Plan):
    t, sz = plan.table, plan.sizes
    block_r = _rank_block(t.max_total_rank, 64)
    block_k = sz.skinny_block_k
    rblocks = _cdiv(t.max_total_rank, block_r)
    launch = CachedLaunch(
        _lora_da_kernel, (_cdiv(plan.k, block_k), t.num_adapters * rblocks, plan.split),
        num_warps=sz.skinny_warps, num_stages=sz.skinny_stages,
        AI_STRIDE=t.adapter_int.shape[1], HAS_DROPOUT=t.has_dropout, BLOCK_M=t.block_m,
        BLOCK_K=block_k, BLOCK_R=block_r, DOT_PRECISION=plan.precision,
    )
    return launch, (plan.k, plan.part_numel, rblocks, plan.split)


def _launch_da(x, ds, part: torch.Tensor, plan: _Plan, off_h: int) -> None:
    """dA_all's partial sums into ``part`` (the plan's joint partial buffer), at offset 0."""
    t = plan.table
    launch, fixed = plan.get("da", _build_da)
    launch(x, ds, part, t.tiles, t.adapter_tiles, t.adapter_tile_ptr, t.adapter_int, t.adapter_float,
           off_h, *fixed)


def _build_dx_gemm(plan: _Plan, n_list: tuple[int, ...], has_prev: bool, lora_here: bool):
    t, sz = plan.table, plan.sizes
    bm, bk, bn = sz.block_m, sz.dx_block_k, sz.dx_block_n
    return CachedLaunch(
        _lora_dx_gemm_kernel, (_cdiv(plan.m, bm) * _cdiv(plan.k, bk),),
        num_warps=sz.dx_warps, num_stages=sz.dx_stages,
        AI_STRIDE=t.adapter_int.shape[1], NUM_PROJ=len(n_list), HAS_PREV=has_prev,
        HAS_LORA=lora_here, HAS_DROPOUT=t.has_dropout, EVEN_N=all(n % bn == 0 for n in n_list),
        BLOCK_M=bm, BLOCK_K=bk, BLOCK_N=bn, BLOCK_R=_rank_block(t.max_total_rank, sz.rank_block),
        GROUP_M=sz.group_m, DOT_PRECISION=plan.precision,
    )


def _launch_dx(dys, weights, ds, a_all, plan: _Plan, off_h: int, dtype: torch.dtype, device) -> torch.Tensor:
    t, m, k = plan.table, plan.m, plan.k
    has_lora = ds is not None
    if isinstance(weights[0], Fp8Weight):
        dx = fp8_input_grad(dys, weights, m=m, k=k, dtype=dtype, device=device,
                            emulate=resolve_emulate(device, None))
        if has_lora:
            _launch_add(dx, ds, a_all, 0, plan, off_h, dx_mode=True)
        return dx
    pairs = [(dy, w) for dy, w in zip(dys, weights) if dy is not None]
    if plan.sizes.gemm == "cublas_accumulate" and has_lora:
        # the LoRA term written first (every row), the frozen products accumulated by cuBLAS
        dx = torch.empty(m, k, dtype=dtype, device=device)
        launch = plan.get(("dx", (), False, True), _build_dx_gemm, (), False, True)
        launch(dx, dx, 0, dx, dx, 0, dx, dx, 0, dx, dx, ds, a_all, t.tiles, t.block_tiles, t.adapter_int,
               t.adapter_float, off_h, m, k)
        for dy, w in pairs:
            dx.addmm_(dy, w)
        return dx
    if plan.sizes.gemm != "triton":
        dx = torch.zeros(m, k, dtype=dtype, device=device) if not pairs else pairs[0][0] @ pairs[0][1]
        for dy, w in pairs[1:]:
            dx.addmm_(dy, w)
        if has_lora:
            _launch_add(dx, ds, a_all, 0, plan, off_h, dx_mode=True)
        return dx
    if not pairs:
        pairs = [(torch.zeros(m, 1, dtype=dtype, device=device),
                  torch.zeros(1, k, dtype=dtype, device=device))]
    dx = None
    for start in range(0, len(pairs), MAX_FUSED_DX_PROJECTIONS):
        chunk = pairs[start:start + MAX_FUSED_DX_PROJECTIONS]
        n_list = tuple(w.shape[0] for _, w in chunk)
        lora_here = has_lora and start == 0
        launch = plan.get(("dx", n_list, dx is not None, lora_here), _build_dx_gemm, n_list, dx is not None,
                          lora_here)
        padded = chunk + [(None, None)] * (MAX_FUSED_DX_PROJECTIONS - len(chunk))
        out = torch.empty(m, k, dtype=dtype, device=device)
        launch(
            padded[0][0], padded[0][1], n_list[0],
            padded[1][0], padded[1][1], n_list[1] if len(n_list) > 1 else 0,
            padded[2][0], padded[2][1], n_list[2] if len(n_list) > 2 else 0,
            dx, out, ds if lora_here else out, a_all if lora_here else out,
            t.tiles, t.block_tiles, t.adapter_int, t.adapter_float, off_h, m, k,
        )
        dx = out
    return dx


# ----------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------


class FusedLoraProjections(torch.autograd.Function):
    """Shared-input projections with per-row-tile LoRA; differentiable w.r.t. X, A and B."""

    @staticmethod
    def forward(ctx, x, a_all, plan, off_h, *rest):
        n_proj = len(rest) // 3
        weights = rest[:n_proj]
        biases = rest[n_proj:2 * n_proj]
        b_cats = rest[2 * n_proj:]
        s = _launch_s(x, a_all, plan, off_h)
        ctx.fp8_weights = tuple(weights) if isinstance(weights[0], Fp8Weight) else None
        if ctx.fp8_weights is not None:
            ys = tuple(_launch_fwd_fp8(x, weights, biases, s, b_cats, plan))
            ctx.save_for_backward(x, a_all, s, *b_cats)  # Fp8Weights hold frozen buffers only
        else:
            ys = tuple(
                _launch_fwd_gemm(x, w, b, s, bc, i, plan)
                for i, (w, b, bc) in enumerate(zip(weights, biases, b_cats))
            )
            ctx.save_for_backward(x, a_all, s, *weights, *b_cats)
        ctx.plan, ctx.off_h, ctx.n_proj = plan, off_h, n_proj
        ctx.mark_non_differentiable(s)
        return ys

    @staticmethod
    def backward(ctx, *dys):
        x, a_all, s, *rest = ctx.saved_tensors
        n_proj = ctx.n_proj
        if ctx.fp8_weights is not None:
            rest = [*ctx.fp8_weights, *rest]
        need = ctx.needs_input_grad
        need_db = [need[4 + 2 * n_proj + i] for i in range(n_proj)]
        dx, da, db_cats = _backward(list(dys), x, a_all, s, rest[:n_proj], rest[n_proj:], ctx.plan,
                                    ctx.off_h, need[0], need[1], need_db)
        return (dx, da, None, None, *([None] * (2 * n_proj)), *db_cats)


def _backward(dys, x, a_all, s, weights, b_cats, plan: _Plan, off_h, need_dx, need_da, need_db):
    """dX, dA_all and per-projection dB_cat (None where not needed or no LoRA)."""
    t = plan.table
    n_proj = len(weights)
    m, k = x.shape
    dys = [None if dy is None else dy.contiguous() for dy in dys]
    lora_proj = [i for i in range(n_proj) if b_cats[i] is not None and t.max_rank[i] > 0]
    db_proj = [i for i in lora_proj if need_db[i]]
    ds = torch.empty(max(t.s_numel, 1), dtype=x.dtype, device=x.device)
    # dA and every dB share one fp32 partial-sum buffer: one reduction and one cast for all
    part = (torch.empty(plan.split, plan.part_numel, dtype=torch.float32, device=x.device)
            if db_proj or need_da else None)
    for i in lora_proj:
        dy = dys[i] if dys[i] is not None else torch.zeros(m, weights[i].shape[0], dtype=x.dtype, device=x.device)
        _launch_ds(dy, b_cats[i], ds, i, plan)
        if need_db[i]:
            _launch_db(dy, s, b_cats[i], part, i, plan)
    if need_da:
        _launch_da(x, ds, part, plan, off_h)
    dx = _launch_dx(dys, weights, ds, a_all, plan, off_h, x.dtype, x.device) if need_dx else None
    da, db_cats = None, [None] * n_proj
    if part is not None:
        grads = (part[0] if plan.split == 1 else part.sum(0)).to(a_all.dtype)
        if need_da:
            da = grads[:t.a_rows * k].view(t.a_rows, k)
        for i in db_proj:
            off, n, bc = plan.part_offsets[1 + i], plan.ns[i], b_cats[i].shape[1]
            db_cats[i] = grads[off:off + n * bc].view(n, bc)  # B_cat has A_all's dtype
    return dx, da, db_cats


# ----------------------------------------------------------------------------------------------
# torch custom ops (torch.compile / CUDA graphs see two opaque ops instead of Python launches)
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _TableArgs:
    """The parts of ``LoraLaunchTable`` the launchers read, rebuilt from op arguments."""

    tiles: torch.Tensor
    block_tiles: torch.Tensor
    adapter_tiles: torch.Tensor
    adapter_tile_ptr: torch.Tensor
    adapter_int: torch.Tensor
    adapter_float: torch.Tensor
    block_m: int
    num_tiles: int
    s_numel: int
    a_rows: int
    max_total_rank: int
    max_adapter_tiles: int
    active: tuple[int, ...]
    has_dropout: bool
    max_rank: tuple[int, ...]

    @property
    def num_adapters(self) -> int:
        return int(self.adapter_int.shape[0])


def _table_to_args(table: LoraLaunchTable) -> tuple[list[torch.Tensor], list[int]]:
    tensors = [table.tiles, table.block_tiles, table.adapter_tiles, table.adapter_tile_ptr,
               table.adapter_int, table.adapter_float]
    meta = [table.block_m, table.num_tiles, table.s_numel, table.a_rows, table.max_total_rank,
            table.max_adapter_tiles, len(table.active), int(table.has_dropout), *table.max_rank]
    return tensors, meta


def _table_from_args(tensors: list[torch.Tensor], meta: list[int]) -> _TableArgs:
    return _TableArgs(*tensors, block_m=meta[0], num_tiles=meta[1], s_numel=meta[2], a_rows=meta[3],
                      max_total_rank=meta[4], max_adapter_tiles=meta[5], active=tuple(range(meta[6])),
                      has_dropout=bool(meta[7]), max_rank=tuple(meta[8:]))


def _sizes_to_args(sizes: LoraBlockSizes) -> list[int]:
    return [GEMM_MODES.index(v) if f.name == "gemm" else v
            for f in dataclasses.fields(sizes) for v in (getattr(sizes, f.name),)]


def _sizes_from_args(values: list[int]) -> LoraBlockSizes:
    fields = dataclasses.fields(LoraBlockSizes)
    return LoraBlockSizes(**{f.name: GEMM_MODES[v] if f.name == "gemm" else v for f, v in zip(fields, values)})


def _none_if_empty(t: torch.Tensor) -> Optional[torch.Tensor]:
    # The ops take plain tensor lists; a [0]-shaped tensor stands for "no bias" / "no LoRA".
    return None if t.numel() == 0 else t


def _op_plan(x, weights, b_cats, table_tensors, table_meta, sizes) -> _Plan:
    # Rebuilt on every op call: under torch.compile the launches run from the compiled graph.
    return _Plan(_table_from_args(table_tensors, table_meta), _sizes_from_args(sizes), m=x.shape[0],
                 k=x.shape[1], ns=[w.shape[0] for w in weights], b_cols=[bc.shape[-1] for bc in b_cats],
                 dtype=x.dtype, device=x.device)


@torch.library.custom_op("lightning_lorafusion::fused_lora_fwd", mutates_args=())
def fused_lora_fwd_op(
    x: torch.Tensor, a_all: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
    b_cats: list[torch.Tensor], table_tensors: list[torch.Tensor], table_meta: list[int],
    sizes: list[int], offset_h: int,
) -> list[torch.Tensor]:
    """Forward as a custom op: returns ``[Y_0 .. Y_{P-1}, S]``; empty biases / b_cats = none."""
    plan = _op_plan(x, weights, b_cats, table_tensors, table_meta, sizes)
    s = _launch_s(x, a_all, plan, offset_h)
    ys = [_launch_fwd_gemm(x, w, _none_if_empty(b), s, _none_if_empty(bc), i, plan)
          for i, (w, b, bc) in enumerate(zip(weights, biases, b_cats))]
    return ys + [s]


@fused_lora_fwd_op.register_fake
def _(x, a_all, weights, biases, b_cats, table_tensors, table_meta, sizes, offset_h):
    return [x.new_empty(x.shape[0], w.shape[0]) for w in weights] + [x.new_empty(max(table_meta[2], 1))]


@torch.library.custom_op("lightning_lorafusion::fused_lora_bwd", mutates_args=())
def fused_lora_bwd_op(
    dys: list[torch.Tensor], x: torch.Tensor, a_all: torch.Tensor, s: torch.Tensor,
    weights: list[torch.Tensor], b_cats: list[torch.Tensor], table_tensors: list[torch.Tensor],
    table_meta: list[int], sizes: list[int], offset_h: int,
) -> list[torch.Tensor]:
    """Backward as a custom op: returns ``[dX, dA_all, dB_0 .. dB_{P-1}]`` (``[0]``-shaped
    for projections without LoRA)."""
    plan = _op_plan(x, weights, b_cats, table_tensors, table_meta, sizes)
    dx, da, dbs = _backward(list(dys), x, a_all, s, weights, [_none_if_empty(bc) for bc in b_cats],
                            plan, offset_h, True, True, [True] * len(weights))
    # dA and the dB_i are views of one buffer; an op's outputs must not alias each other
    return [dx, da.clone()] + [x.new_empty(0) if db is None else db.clone() for db in dbs]


@fused_lora_bwd_op.register_fake
def _(dys, x, a_all, s, weights, b_cats, table_tensors, table_meta, sizes, offset_h):
    return [torch.empty_like(x), torch.empty_like(a_all)] + [torch.empty_like(bc) for bc in b_cats]


def _op_setup_context(ctx, inputs, output):
    x, a_all, weights, biases, b_cats, table_tensors, table_meta, sizes, offset_h = inputs
    ctx.save_for_backward(x, a_all, output[-1], *weights, *b_cats, *table_tensors)
    ctx.n_proj, ctx.n_table = len(weights), len(table_tensors)
    ctx.table_meta, ctx.sizes, ctx.offset_h = table_meta, sizes, offset_h


def _op_backward(ctx, grads):
    x, a_all, s, *rest = ctx.saved_tensors
    n = ctx.n_proj
    weights, b_cats, table_tensors = rest[:n], rest[n:2 * n], rest[2 * n:]
    dys = [g if g is not None else torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
           for g, w in zip(grads[:n], weights)]
    out = fused_lora_bwd_op(dys, x, a_all, s, list(weights), list(b_cats), list(table_tensors),
                            ctx.table_meta, ctx.sizes, ctx.offset_h)
    dbs = [None if bc.numel() == 0 else db for db, bc in zip(out[2:], b_cats)]
    # one entry per input; tensor lists mirrored element by element
    return out[0], out[1], [None] * n, [None] * n, dbs, [None] * ctx.n_table, None, None, None


fused_lora_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


# ----------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------


def _check_inputs(x, weights, biases, loras, routing: LoraRouting) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [tokens, hidden]; got {getattr(x, 'shape', type(x))}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x.dtype={x.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors (x is on {x.device}); use backend='torch' or "
            "'auto' on the CPU, or set TRITON_INTERPRET=1 to run the kernels in the interpreter"
        )
    m, k = x.shape
    if m == 0 or k == 0:
        raise ValueError(f"x has an empty dimension {tuple(x.shape)}; pass at least one token and feature")
    if x.numel() >= 2**31:
        raise ValueError(f"x has {x.numel()} elements; the kernels index with int32 (< 2^31)")
    if not (len(weights) == len(biases) == len(loras)) or not weights:
        raise ValueError(
            f"weights, biases and loras need one entry per projection; got {len(weights)}, "
            f"{len(biases)}, {len(loras)}"
        )
    if routing.num_rows != m:
        raise ValueError(f"routing.num_rows={routing.num_rows} but x has {m} rows")
    if len({isinstance(w, Fp8Weight) for w in weights}) > 1:
        raise TypeError("a projection group mixes FP8 and plain weights; quantize all or none")
    for i, (w, b, lora) in enumerate(zip(weights, biases, loras)):
        if len(w.shape) != 2 or w.shape[1] != k:
            raise ValueError(f"weights[{i}] must be [N, {k}] to match x [M, {k}]; got {tuple(w.shape)}")
        w_dtype = FP8_NAME if isinstance(w, Fp8Weight) else w.dtype
        if (w_dtype != x.dtype and w_dtype != FP8_NAME) or w.device != x.device:
            raise TypeError(
                f"weights[{i}] is {w_dtype} on {w.device} but x is {x.dtype} on {x.device}; "
                "cast the frozen weights to the activation dtype"
            )
        if w.shape[0] * w.shape[1] >= 2**31 or m * w.shape[0] >= 2**31:
            raise ValueError(f"projection {i} is too large for int32 indexing; split the rows")
        if b is not None and (b.shape != (w.shape[0],) or b.dtype != x.dtype or b.device != x.device):
            raise ValueError(
                f"biases[{i}] must be [{w.shape[0]}] {x.dtype} on {x.device}; got "
                f"{tuple(b.shape)} {b.dtype} on {b.device}"
            )
        if lora is None:
            continue
        if len(lora.a) != routing.num_adapters or len(lora.b) != routing.num_adapters:
            raise ValueError(
                f"loras[{i}] has {len(lora.a)} A / {len(lora.b)} B entries but routing has "
                f"{routing.num_adapters} adapters; pass one (possibly None) per adapter"
            )
        for ad, (a, bb) in enumerate(zip(lora.a, lora.b)):
            if (a is None) != (bb is None):
                raise ValueError(f"loras[{i}] adapter {ad}: A and B must both be given or both None")
            if a is None:
                continue
            if a.dim() != 2 or a.shape[1] != k or a.shape[0] < 1:
                raise ValueError(f"loras[{i}].a[{ad}] must be [rank >= 1, {k}]; got {tuple(a.shape)}")
            if bb.shape != (w.shape[0], a.shape[0]):
                raise ValueError(
                    f"loras[{i}].b[{ad}] must be [{w.shape[0]}, {a.shape[0]}] (N, rank); got {tuple(bb.shape)}"
                )
            if a.dtype not in SUPPORTED_DTYPES or bb.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"loras[{i}] adapter {ad}: A/B dtype must be one of {SUPPORTED_DTYPES}")
            if a.device != x.device or bb.device != x.device:
                raise ValueError(f"loras[{i}] adapter {ad}: A/B must be on {x.device}")


def lora_ranks(loras: Sequence[LoraModuleWeights | None], num_adapters: int) -> tuple[tuple[int, ...], ...]:
    """``ranks[projection][adapter]``, 0 where the adapter has no LoRA on that projection."""
    return tuple(
        tuple(0 if l is None or l.a[a] is None else int(l.a[a].shape[0]) for a in range(num_adapters))
        for l in loras
    )


def _concat(parts: list[torch.Tensor], dim: int, dtype: torch.dtype) -> torch.Tensor:
    # Differentiable concatenation (gradients flow back to each adapter's factor); a single
    # factor is used as is, saving a copy and a launch in the common one-adapter case.
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
    return out.to(dtype).contiguous()


def _factors(loras, table, dtype) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """A_all (active adapters' A factors stacked in ``table.a_order``) and per projection B_cat."""
    a_all = _concat([loras[i].a[a] for a, i in table.a_order], 0, dtype)
    b_cats = [_concat([loras[i].b[a] for a in order], 1, dtype) if order else None
              for i, order in enumerate(table.b_order)]
    return a_all, b_cats


def fused_lora_projections(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor | Fp8Weight],
    biases: Sequence[torch.Tensor | None],
    loras: Sequence[LoraModuleWeights | None],
    routing: LoraRouting,
    *,
    dropout_offset: int = 0,
    block_sizes: LoraBlockSizes | None = None,
) -> list[torch.Tensor]:
    """Fused ``x [M, K] -> [M, N_i]`` per projection, same math as ``lora_projections_reference``.

    ``weights[i]`` [N_i, K] (a tensor of x's dtype, or an ``Fp8Weight``) and ``biases[i]`` [N_i]
    are frozen (no gradients). ``loras[i].a[a]``
    [r, K] / ``.b[a]`` [N_i, r] (or None) get gradients, as does ``x``. All projections share one
    dropout mask per adapter, drawn from (seed, ``dropout_offset``, row, col).
    """
    _check_inputs(x, weights, biases, loras, routing)
    x = x.contiguous()
    weights = [w if isinstance(w, Fp8Weight) else w.contiguous() for w in weights]
    biases = [None if b is None else b.contiguous() for b in biases]
    ranks = lora_ranks(loras, routing.num_adapters)
    if torch.compiler.is_compiling():
        return _compiled_projections(x, weights, biases, loras, routing, ranks, dropout_offset, block_sizes)
    # The plan (tables, grids, split counts, launch objects) is built by the first call of a
    # microbatch and reused by every layer: the per-call host work is the lookup below.
    # ``block_sizes`` is keyed by identity; the plan holds it, so the id stays unique.
    key = (PLAN_KEY, id(block_sizes), ranks, x.dtype, x.device, x.shape[1], tuple(w.shape[0] for w in weights))
    plan = routing.launch_cache.get(key)
    if plan is None:
        sizes = block_sizes if block_sizes is not None else block_sizes_for(x.device)
        table = build_launch_table(routing, ranks, sizes.block_m, x.device)
        plan = _NO_LORA if table.a_rows == 0 else _Plan(
            table, sizes, m=x.shape[0], k=x.shape[1], ns=key[6], b_cols=table.b_cols, dtype=x.dtype,
            device=x.device)
        routing.launch_cache[key] = plan
    if plan is _NO_LORA:  # no routed row has LoRA here: the frozen projections alone
        return frozen_projections(x, weights, biases)
    table = plan.table
    a_all, b_cats = _factors(loras, table, x.dtype)
    return list(FusedLoraProjections.apply(x, a_all, plan, offset_hash_arg(dropout_offset), *weights, *biases,
                                           *b_cats))


_NO_LORA = object()  # plan-cache entry of a group none of whose routed rows has LoRA


def _compiled_projections(x, weights, biases, loras, routing, ranks, dropout_offset, block_sizes):
    """Under torch.compile: trace the custom ops (fake tensors for shapes), not the launches."""
    if isinstance(weights[0], Fp8Weight):
        raise NotImplementedError(
            "the FP8 base is not supported inside torch.compile of the LoRA projections (the "
            "custom ops take plain weights); run the projections eagerly"
        )
    sizes = block_sizes if block_sizes is not None else block_sizes_for(x.device)
    table = build_launch_table(routing, ranks, sizes.block_m, x.device)
    if table.a_rows == 0:
        return frozen_projections(x, weights, biases)
    a_all, b_cats = _factors(loras, table, x.dtype)
    tensors, meta = _table_to_args(table)
    empty = x.new_empty(0)
    out = fused_lora_fwd_op(
        x, a_all, weights, [empty if b is None else b for b in biases],
        [empty if bc is None else bc for bc in b_cats], tensors, meta, _sizes_to_args(sizes),
        offset_hash_arg(dropout_offset),
    )
    return list(out[:-1])
