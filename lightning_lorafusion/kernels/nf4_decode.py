"""The NF4 decode product: ``Y [M, N] = X [M, K] @ dequant(W)^T (+ b)`` for few rows (the
generation engine's decode steps, M <= 64), reading the 4-bit weight once (``nf4.Nf4Weight``;
``nf4_gemm.nf4_matmul_reference`` is the spec; docs/kernels.md "NF4 decode products").

Each program owns ``BLOCK_N`` rows of ``W`` and a slice of ``K`` (split-K, so that small ``N``
still fills the GPU: fp32 partials, summed by a second kernel or, ``FUSED_SUM``, by each tile's
last program, whose counter it sets back to 0 so that counters kept in a ``DecodeWorkspace`` need
no fill per call). Up to ``MAX_GROUP`` weights sharing ``K`` (q/k/v, gate/up) run as one launch
(``nf4_decode_group``): each program picks its weight's pointers by its column tile, and the
outputs are column views of one tensor. ``K`` is walked in whole absmax blocks (``GROUPS`` blocks
of ``blocksize`` values per step), so a block's absmax is one ``[BLOCK_N, GROUPS]`` load (double
quantization undone there, once per block) broadcast over the block, and the tile is decoded once
for all rows of ``X`` in the program. Codes become values by byte permutes (``LOOKUP=4``,
``nf4_lookup``: each block's 16 final values as byte tables, 8 codes per ``prmt`` word; 16-bit
activations), or the 16-entry codebook is gathered in registers (``LOOKUP=2``, ``tl.gather``),
read per value from its 64-byte table in global memory (0), selected by a tree of ``tl.where`` on
the 4 bits (1), or each block's 16 final values are gathered per value (3). The tile is either in
``k`` order (``CONTIG``: ``X`` read as it lies) or its high and low nibbles kept apart (even and
odd ``k``) against ``X``'s even and odd columns. The product is ``tl.dot`` (``Y^T = W X^T``, the
weight the MMA's register operand; or ``XW``: ``Y = X W^T``, the weight the operand Hopper's wgmma
reads from shared memory) or multiply-adds (GEMV: one row of ``X`` per program into a per-lane
accumulator reduced once at the end, several rows summed per step). Every weight value is
``code[c] * absmax`` in fp32 rounded once to the activations' dtype, exactly as
``nf4.dequantize_nf4_reference``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .nf4_lookup import nf4_words_to_values
from .triton_launch import sm_count

# ``Nf4Weight`` below is ``nf4.Nf4Weight``, named only in annotations: nf4.py imports this module
# (lazily, for few rows), so this one does not import it back.

MAX_ROWS = 64  # the largest M this kernel serves (nf4.DECODE_ROWS: the most ``auto`` sends it)
MAX_BLOCKSIZE = 256  # a loop step holds whole absmax blocks of a row (nf4.DECODE_MAX_BLOCKSIZE)
MIN_STEPS = 4  # loop steps a split-K program runs at least
MAX_GROUP = 3  # weights one launch serves (q, k, v)
SMALL_PRODUCT = 4096 * 4096  # N x K at most this: few tiles of 128 rows, 64 measured faster (64 rows of X)
WORKSPACE_COUNTERS = 8192  # a workspace's split-K counters: tiles of the largest launch


@triton.jit
def _code_select(c, code_ptr):
    """fp32 ``code[c]`` for 4-bit codes ``c`` (int32 tensor), by selects on the bits."""
    b0 = (c & 1) != 0
    b1 = (c & 2) != 0
    b2 = (c & 4) != 0
    b3 = (c & 8) != 0
    v01 = tl.where(b0, tl.load(code_ptr + 1), tl.load(code_ptr + 0))
    v23 = tl.where(b0, tl.load(code_ptr + 3), tl.load(code_ptr + 2))
    v45 = tl.where(b0, tl.load(code_ptr + 5), tl.load(code_ptr + 4))
    v67 = tl.where(b0, tl.load(code_ptr + 7), tl.load(code_ptr + 6))
    v89 = tl.where(b0, tl.load(code_ptr + 9), tl.load(code_ptr + 8))
    vab = tl.where(b0, tl.load(code_ptr + 11), tl.load(code_ptr + 10))
    vcd = tl.where(b0, tl.load(code_ptr + 13), tl.load(code_ptr + 12))
    vef = tl.where(b0, tl.load(code_ptr + 15), tl.load(code_ptr + 14))
    lo = tl.where(b2, tl.where(b1, v67, v45), tl.where(b1, v23, v01))
    hi = tl.where(b2, tl.where(b1, vef, vcd), tl.where(b1, vab, v89))
    return tl.where(b3, hi, lo)


@triton.jit
def _code(c, code_ptr, LOOKUP: tl.constexpr):
    if LOOKUP == 1:
        value = _code_select(c, code_ptr)
    elif LOOKUP == 2:  # the table held in registers, gathered there (shared memory or shuffles)
        flat = tl.reshape(c, (c.numel,))
        value = tl.reshape(tl.gather(tl.load(code_ptr + tl.arange(0, 16)), flat, 0), c.shape)
    else:
        value = tl.load(code_ptr + c)
    return value


@triton.jit
def _block_scale(absmax_ptr, nested_ptr, dyn_ptr, offset_ptr, blk, mask,
                 NESTED: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr):
    """fp32 absmax of blocks ``blk`` (masked: 0); with double quantization
    ``dyn[q] * nested_absmax[blk // NESTED_BLOCKSIZE] + offset`` (two roundings, as the reference)."""
    if NESTED:
        q = tl.load(absmax_ptr + blk, mask=mask, other=0).to(tl.int32)
        scale = tl.load(dyn_ptr + q) * tl.load(nested_ptr + blk // NESTED_BLOCKSIZE, mask=mask, other=0.0)
        scale = tl.where(mask, scale + tl.load(offset_ptr), 0.0)
    else:
        scale = tl.load(absmax_ptr + blk, mask=mask, other=0.0)
    return scale


@triton.jit
def _weight_tile(data_ptr, absmax_ptr, code_ptr, nested_ptr, dyn_ptr, offset_ptr, rn, g, n_mask, g_mask,
                 blocks_per_row, dtype: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
                 NESTED_BLOCKSIZE: tl.constexpr, LOOKUP: tl.constexpr, CONTIG: tl.constexpr, ASM: tl.constexpr):
    """The weight values in ``dtype`` for rows ``rn`` [BLOCK_N] and absmax block columns ``g``
    [GROUPS] of those rows: ``[BLOCK_N, GROUPS * BLOCKSIZE]`` in ``k`` order (``CONTIG``), else
    ``(W[n, even k], W[n, odd k])``, two ``[BLOCK_N, GROUPS, BLOCKSIZE / 2]`` tensors."""
    half: tl.constexpr = BLOCKSIZE // 2
    blk = rn[:, None] * blocks_per_row + g[None, :]
    scale = _block_scale(absmax_ptr, nested_ptr, dyn_ptr, offset_ptr, blk, n_mask[:, None] & g_mask[None, :],
                         NESTED, NESTED_BLOCKSIZE)
    mask = n_mask[:, None, None] & g_mask[None, :, None]
    if LOOKUP == 4:  # 32-bit words of 8 codes, looked up by byte permutes in per-block tables
        words_per_block: tl.constexpr = BLOCKSIZE // 8
        rw = tl.arange(0, words_per_block)
        row = rn.to(tl.int64)[:, None, None] * (blocks_per_row * words_per_block)
        words = tl.load(data_ptr.to(tl.pointer_type(tl.uint32)) + row + (g[None, :, None] * words_per_block
                        + rw[None, None, :]), mask=mask, other=0)
        return nf4_words_to_values(words, scale, code_ptr, dtype, CONTIG, ASM)
    rh = tl.arange(0, half)
    row = rn.to(tl.int64)[:, None, None] * (blocks_per_row * half)
    packed = tl.load(data_ptr + row + (g[None, :, None] * half + rh[None, None, :]), mask=mask, other=0)
    packed = packed.to(tl.int32)
    scale = scale[:, :, None]
    if LOOKUP == 3:  # each block's 16 final values, code * absmax rounded once, then one gather per value
        table = (tl.load(code_ptr + tl.arange(0, 16))[None, None, :] * scale).to(dtype)
        hi = tl.gather(table, packed >> 4, 2)
        lo = tl.gather(table, packed & 15, 2)
    else:
        hi = (_code(packed >> 4, code_ptr, LOOKUP) * scale).to(dtype)
        lo = (_code(packed & 15, code_ptr, LOOKUP) * scale).to(dtype)
    if CONTIG:
        return tl.reshape(tl.join(hi, lo), (hi.shape[0], hi.shape[1] * BLOCKSIZE))
    else:
        return hi, lo


@triton.jit
def _x_pairs(x_row, g, g_mask, stride_xk, half: tl.constexpr, GROUPS: tl.constexpr):
    """fp32 ``(X[even k], X[odd k])`` of one row over absmax block columns ``g``: two
    ``[GROUPS, half]`` tensors, read contiguous and split."""
    k = g[:, None] * (2 * half) + tl.arange(0, 2 * half)[None, :]
    x = tl.load(x_row + k * stride_xk, mask=g_mask[:, None], other=0.0).to(tl.float32)
    return tl.split(tl.reshape(x, (GROUPS, half, 2)))


@triton.jit
def _dot_step(acc, hi, lo, x_ptr, rm, m_mask, g0, g_end, stride_xm, stride_xk, half: tl.constexpr,
              GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr):
    """``Y^T [BLOCK_N, BLOCK_M] += W_even X_even^T + W_odd X_odd^T`` over one loop step."""
    kk = g0 * (2 * half) + tl.arange(0, GROUPS * 2 * half)  # columns of X in this step, read contiguous
    x_mask = m_mask[:, None] & ((kk < g_end * (2 * half)) | EVEN_K)[None, :]
    x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :] * stride_xk, mask=x_mask, other=0.0)
    x_even, x_odd = tl.split(tl.reshape(x, (x.shape[0], GROUPS * half, 2)))
    acc = tl.dot(tl.reshape(hi, (BLOCK_N, GROUPS * half)), tl.trans(x_even), acc, input_precision=DOT_PRECISION)
    return tl.dot(tl.reshape(lo, (BLOCK_N, GROUPS * half)), tl.trans(x_odd), acc, input_precision=DOT_PRECISION)


@triton.jit
def _dot_step_contig(acc, w, x_ptr, rm, m_mask, g0, g_end, stride_xm, stride_xk, BLOCKSIZE: tl.constexpr,
                     GROUPS: tl.constexpr, XW: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr):
    """``Y^T [BLOCK_N, BLOCK_M] += W X^T`` (or ``XW``: ``Y [BLOCK_M, BLOCK_N] += X W^T``) over one
    loop step, ``W`` in ``k`` order: ``X`` is read as it lies (straight into the dot's operand)."""
    kk = g0 * BLOCKSIZE + tl.arange(0, GROUPS * BLOCKSIZE)
    x_mask = m_mask[:, None] & ((kk < g_end * BLOCKSIZE) | EVEN_K)[None, :]
    x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :] * stride_xk, mask=x_mask, other=0.0)
    if XW:
        return tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    else:
        return tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)


@triton.jit
def _gemv_contig(acc, acc3, w, x_ptr, m0, M, g0, g_end, stride_xm, stride_xk, BLOCKSIZE: tl.constexpr,
                 GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_K: tl.constexpr):
    """Multiply-adds of rows ``m0 ..`` of ``X`` against ``W`` in ``k`` order: one row into the
    per-lane ``acc3`` (reduced after the loop), several summed per step into ``acc``."""
    kk = g0 * BLOCKSIZE + tl.arange(0, GROUPS * BLOCKSIZE)
    k_mask = (kk < g_end * BLOCKSIZE) | EVEN_K
    w = w.to(tl.float32)
    if BLOCK_M == 1:
        x = tl.load(x_ptr + m0.to(tl.int64) * stride_xm + kk * stride_xk, mask=k_mask & (m0 < M), other=0.0)
        acc3 = tl.fma(w, x.to(tl.float32)[None, :], acc3)
    else:
        cols = tl.arange(0, BLOCK_M)
        for i in tl.static_range(BLOCK_M):
            x = tl.load(x_ptr + (m0 + i).to(tl.int64) * stride_xm + kk * stride_xk, mask=k_mask & (m0 + i < M),
                        other=0.0)
            part = tl.sum(w * x.to(tl.float32)[None, :], axis=1)
            acc += tl.where(cols[None, :] == i, part[:, None], 0.0)
    return acc, acc3


@triton.jit
def _gemv_rows(acc, hi, lo, x_ptr, m0, M, g, g_mask, stride_xm, stride_xk, half: tl.constexpr,
               GROUPS: tl.constexpr, BLOCK_M: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_M]``: each of rows ``m0 ..`` of ``X`` against the weight tile by
    multiply-adds, summed over the step."""
    cols = tl.arange(0, BLOCK_M)
    hi = hi.to(tl.float32)
    lo = lo.to(tl.float32)
    for i in tl.static_range(BLOCK_M):
        x_even, x_odd = _x_pairs(x_ptr + (m0 + i).to(tl.int64) * stride_xm, g, g_mask & (m0 + i < M), stride_xk,
                                 half, GROUPS)
        part = tl.sum(tl.sum(tl.fma(hi, x_even[None, :, :], lo * x_odd[None, :, :]), axis=2), axis=1)
        acc += tl.where(cols[None, :] == i, part[:, None], 0.0)
    return acc


@triton.jit
def _pick(i, a0, a1, a2, NUM_W: tl.constexpr):
    """``(a0, a1, a2)[i]`` for a program's weight index ``i`` of a group (pointers or ints)."""
    out = a0
    if NUM_W > 1:
        out = tl.where(i == 1, a1, out)
    if NUM_W > 2:
        out = tl.where(i == 2, a2, out)
    return out


@triton.jit
def _nf4_decode_kernel(x_ptr, data0, absmax0, code0, nested0, dyn0, offset0, bias0, data1, absmax1, code1, nested1,
                       dyn1, offset1, bias1, data2, absmax2, code2, nested2, dyn2, offset2, bias2, out_ptr, y_ptr,
                       count_ptr, tile1, tile2, n0, n1, n2, col1, col2, M, blocks_per_row, blocks_per_split, splits,
                       stride_xm, stride_xk, stride_om, stride_os, NUM_W: tl.constexpr, BLOCKSIZE: tl.constexpr,
                       NESTED: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                       PARTIAL: tl.constexpr, FUSED_SUM: tl.constexpr, USE_DOT: tl.constexpr, LOOKUP: tl.constexpr,
                       CONTIG: tl.constexpr, ASM: tl.constexpr, XW: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       EVEN_K: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``Y`` over absmax block columns ``[pid_k *
    blocks_per_split, +blocks_per_split)`` of ``K``: the final values (``PARTIAL`` off) or an
    fp32 partial sum into ``out[pid_k]`` (the bias in split 0's); with ``FUSED_SUM`` the tile's
    last program to finish (``count_ptr``: zeroed counters, one per tile, left zeroed) sums the
    ``splits`` partials into ``y``. A group of ``NUM_W`` weights sharing ``K`` is one launch:
    weight ``i`` owns the tiles from ``tile_i`` on and ``Y``'s columns from ``col_i`` on."""
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    wi = (pid_n >= tile1).to(tl.int32) + (pid_n >= tile2).to(tl.int32)
    data_ptr, absmax_ptr = _pick(wi, data0, data1, data2, NUM_W), _pick(wi, absmax0, absmax1, absmax2, NUM_W)
    code_ptr, nested_ptr = _pick(wi, code0, code1, code2, NUM_W), _pick(wi, nested0, nested1, nested2, NUM_W)
    dyn_ptr, offset_ptr = _pick(wi, dyn0, dyn1, dyn2, NUM_W), _pick(wi, offset0, offset1, offset2, NUM_W)
    bias_ptr = _pick(wi, bias0, bias1, bias2, NUM_W)
    half: tl.constexpr = BLOCKSIZE // 2
    dtype = x_ptr.dtype.element_ty
    rn = (pid_n - _pick(wi, 0, tile1, tile2, NUM_W)) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask, m_mask = rn < _pick(wi, n0, n1, n2, NUM_W), rm < M
    g_start = pid_k * blocks_per_split
    g_end = tl.minimum(g_start + blocks_per_split, blocks_per_row)
    acc = _tile_product(x_ptr, data_ptr, absmax_ptr, code_ptr, nested_ptr, dyn_ptr, offset_ptr, rn, rm, n_mask,
                        m_mask, pid_m, M, g_start, g_end, blocks_per_row, stride_xm, stride_xk, dtype, BLOCKSIZE,
                        NESTED, NESTED_BLOCKSIZE, USE_DOT, LOOKUP, CONTIG, ASM, XW, BLOCK_M, BLOCK_N, GROUPS,
                        DOT_PRECISION, EVEN_K)
    if HAS_BIAS:  # in the final values, or in split 0's partial
        b = tl.load(bias_ptr + rn, mask=n_mask & (pid_k == 0), other=0.0).to(tl.float32)
        acc += b[:, None]
    cols = _pick(wi, 0, col1, col2, NUM_W) + rn
    offs = rm[None, :].to(tl.int64) * stride_om + cols[:, None]
    mask = n_mask[:, None] & m_mask[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_k.to(tl.int64) * stride_os + offs, acc, mask=mask)
        if FUSED_SUM:
            _sum_if_last(out_ptr, y_ptr, count_ptr + pid_m * tl.num_programs(0) + pid_n, splits, rn, offs, mask,
                         stride_os, ASM)
    else:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile_product(x_ptr, data_ptr, absmax_ptr, code_ptr, nested_ptr, dyn_ptr, offset_ptr, rn, rm, n_mask, m_mask,
                  pid_m, M, g_start, g_end, blocks_per_row, stride_xm, stride_xk, dtype: tl.constexpr,
                  BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr,
                  USE_DOT: tl.constexpr, LOOKUP: tl.constexpr, CONTIG: tl.constexpr, ASM: tl.constexpr,
                  XW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr):
    """fp32 ``Y^T [BLOCK_N, BLOCK_M]`` of rows ``rn`` of the weight against rows ``rm`` of ``X``
    over absmax block columns ``[g_start, g_end)`` (``EVEN_K``: a whole number of loop steps)."""
    half: tl.constexpr = BLOCKSIZE // 2
    if XW:  # Y = X W^T: the weight tile as the dot's second operand (read from shared memory)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if CONTIG:  # GEMV of one row: per-lane sums
        acc3 = tl.zeros((BLOCK_N, GROUPS * BLOCKSIZE), dtype=tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_N, GROUPS, half), dtype=tl.float32)
    for g0 in range(g_start, g_end, GROUPS):
        g = g0 + tl.arange(0, GROUPS)
        g_mask = (g < g_end) | EVEN_K  # whole steps: no mask along K (vector loads)
        if CONTIG:
            w = _weight_tile(data_ptr, absmax_ptr, code_ptr, nested_ptr, dyn_ptr, offset_ptr, rn, g, n_mask, g_mask,
                             blocks_per_row, dtype, BLOCKSIZE, NESTED, NESTED_BLOCKSIZE, LOOKUP, CONTIG, ASM)
            if USE_DOT:
                acc = _dot_step_contig(acc, w, x_ptr, rm, m_mask, g0, g_end, stride_xm, stride_xk, BLOCKSIZE,
                                       GROUPS, XW, DOT_PRECISION, EVEN_K)
            else:
                acc, acc3 = _gemv_contig(acc, acc3, w, x_ptr, pid_m * BLOCK_M, M, g0, g_end, stride_xm, stride_xk,
                                         BLOCKSIZE, GROUPS, BLOCK_M, EVEN_K)
        else:
            hi, lo = _weight_tile(data_ptr, absmax_ptr, code_ptr, nested_ptr, dyn_ptr, offset_ptr, rn, g, n_mask,
                                  g_mask, blocks_per_row, dtype, BLOCKSIZE, NESTED, NESTED_BLOCKSIZE, LOOKUP, CONTIG,
                                  ASM)
            acc, acc3 = _split_step(acc, acc3, hi, lo, x_ptr, rm, m_mask, pid_m, M, g, g_mask, g0, g_end, stride_xm,
                                    stride_xk, half, GROUPS, BLOCK_N, BLOCK_M, USE_DOT, DOT_PRECISION, EVEN_K)
    if XW:
        acc = tl.trans(acc)
    if not USE_DOT and BLOCK_M == 1:
        if CONTIG:
            acc = tl.reshape(tl.sum(acc3, axis=1), (BLOCK_N, 1))
        else:
            acc = tl.reshape(tl.sum(tl.sum(acc3, axis=2), axis=1), (BLOCK_N, 1))
    return acc


@triton.jit
def _sum_if_last(part_ptr, y_ptr, count_ptr, splits, rn, offs, mask, stride_os, ASM: tl.constexpr):
    """Count this program's partial in (each thread's stores made visible first); the program
    that counts last sums the tile's partials in split order (as ``_split_sum_kernel``) into
    ``y`` and sets the count back to 0 (the counters stay zeroed for the next launch: no fill
    kernel per call). Saves the second launch of split-K."""
    if ASM:  # every thread: its partial visible at GPU scope before the count
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [rn], dtype=tl.int32, is_pure=False,
                                  pack=1)
    tl.debug_barrier()
    if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == splits - 1:
        total = tl.zeros(mask.shape, dtype=tl.float32)
        for s in range(0, splits):
            total += tl.load(part_ptr + s * stride_os + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _split_step(acc, acc3, hi, lo, x_ptr, rm, m_mask, pid_m, M, g, g_mask, g0, g_end, stride_xm, stride_xk,
                half: tl.constexpr, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr):
    """One loop step with the weight as even and odd ``k``: dots, or multiply-adds."""
    if USE_DOT:
        acc = _dot_step(acc, hi, lo, x_ptr, rm, m_mask, g0, g_end, stride_xm, stride_xk, half, GROUPS, BLOCK_N,
                        DOT_PRECISION, EVEN_K)
    elif BLOCK_M == 1:  # multiply-adds per lane, reduced once after the loop
        x_even, x_odd = _x_pairs(x_ptr + pid_m.to(tl.int64) * stride_xm, g, g_mask & (pid_m < M), stride_xk,
                                 half, GROUPS)
        acc3 = tl.fma(hi.to(tl.float32), x_even[None, :, :], acc3)
        acc3 = tl.fma(lo.to(tl.float32), x_odd[None, :, :], acc3)
    else:
        acc = _gemv_rows(acc, hi, lo, x_ptr, pid_m * BLOCK_M, M, g, g_mask, stride_xm, stride_xk, half, GROUPS,
                         BLOCK_M)
    return acc, acc3


@triton.jit
def _split_sum_kernel(part_ptr, y_ptr, MN, SPLITS, BLOCK: tl.constexpr):
    """``y [M, N] = sum_s part[s]`` (fp32 sums in split order, then the output dtype; the bias
    is in split 0's partial)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------ launcher


@dataclass(frozen=True)
class DecodeConfig:
    """How ``nf4_linear_decode`` tiles a product: ``block_n`` rows of ``W`` per program,
    ``groups`` absmax blocks of ``K`` per loop step, ``split_k`` programs along ``K`` (0: as many
    as bring the grid to ``fill`` programs per SM), ``use_dot`` (else GEMV: multiply-adds),
    ``lookup`` 2 (codebook in registers), 0 (table in memory), 1 (selects), 3 (per-block
    tables of final values, gathered) or 4 (per-block tables looked up by byte permutes,
    ``nf4_lookup``; 16-bit activations: fp32 ones take 2), ``contiguous`` (the weight tile in
    ``k`` order, ``X`` read as it lies; else even and odd ``k`` apart, ``X`` split to match),
    ``block_m`` rows of ``X`` per program (0: one for GEMV, ``M`` rounded up to a power of two
    >= 16 for dots), ``x_first`` (dots in ``k`` order: ``Y = X W^T``, the weight tile the second
    operand, which the GPU's MMA reads from shared memory; else ``Y^T = W X^T``), ``fused_sum``
    (split-K partials summed by each tile's last program, one launch; else by a second kernel)."""

    block_n: int = 128
    groups: int = 2
    split_k: int = 0
    fill: int = 2
    use_dot: bool = True
    lookup: int = 2
    block_m: int = 0
    contiguous: bool = False
    x_first: bool = False
    fused_sum: bool = False
    num_warps: int = 8
    num_stages: int = 2


def _sm_count_of(device: torch.device) -> int:
    """The device's SMs (a fixed guess off CUDA: the interpreter)."""
    return sm_count(device, off_cuda=4)


def _block_m(m: int, cfg: DecodeConfig) -> int:
    if not cfg.use_dot:
        return cfg.block_m or 1
    return cfg.block_m or max(16, triton.next_power_of_2(m))


def default_split(m: int, w: Nf4Weight, cfg: DecodeConfig, n: int | None = None) -> int:
    """Programs along ``K`` for ``m`` rows of ``w`` (``n``: the rows of ``W`` a launch covers,
    a group's sum; ``w``'s own by default): ``cfg.split_k``, or (0) as many as bring the grid to
    about ``cfg.fill`` programs per SM (the weight's bytes in flight hide the memory's latency),
    each of at least ``MIN_STEPS`` loop steps (the pipeline's prologue amortized)."""
    if cfg.split_k:
        return cfg.split_k
    tiles = triton.cdiv(n or w.shape[0], cfg.block_n) * triton.cdiv(m, _block_m(m, cfg))
    steps = triton.cdiv(w.shape[1] // w.blocksize, cfg.groups)
    return max(1, min(steps // MIN_STEPS, round(cfg.fill * _sm_count_of(w.device) / tiles)))


def default_config(m: int, shape: tuple[int, int] | None = None) -> DecodeConfig:
    """The tiling for ``m`` rows of a launch of ``shape`` (``(N, K)``, a group's ``N`` summed):
    the candidate with the least time per row count and, where one shape was measured faster
    with another, per shape (docs/BENCHMARKS.md "NF4 decode, group launches", H100 sweep of the
    8B launches with cold weights); all with the byte-permute lookup."""
    if m == 1:  # multiply-adds, 64 rows of W a program, 4 absmax blocks a step, even/odd k apart
        return DecodeConfig(block_n=64, groups=4, fill=8, use_dot=False, num_warps=4, lookup=4)
    if m <= 16:  # Y^T = W X^T, 64 rows of W by 4 warps; split-K to 4 programs per SM, summed in the launch
        return DecodeConfig(block_n=64, num_warps=4, num_stages=3, lookup=4, contiguous=True, fill=4, fused_sum=True)
    # Y = X W^T: the weight tile is wgmma's shared-memory operand, the rows padded to its 64;
    # 128 rows of W a program (X read half as often) except on a square 4096 product (o)
    block_n = 64 if shape is not None and shape[0] * shape[1] <= SMALL_PRODUCT else 128
    return DecodeConfig(block_n=block_n, num_warps=4, num_stages=3, block_m=64, lookup=4, contiguous=True,
                        x_first=True)


@dataclass(frozen=True, eq=False)
class DecodeWorkspace:
    """Device memory a caller keeps for the decode kernel across calls (the generation engine
    owns one): ``counters`` int32, zeroed once, for split-K summed in the same launch
    (``fused_sum``); each launch leaves them zeroed, so a call (or a CUDA graph's replay) needs no
    fill kernel. One stream at a time: launches in stream order never share a live counter."""

    counters: torch.Tensor

    @classmethod
    def create(cls, device: torch.device | str, counters: int = WORKSPACE_COUNTERS) -> "DecodeWorkspace":
        return cls(torch.zeros(counters, dtype=torch.int32, device=device))


def _check(x: torch.Tensor, w: Nf4Weight) -> None:
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"nf4 decode: x must be 2-D [M, {k}] for an NF4 weight {tuple(w.shape)}; got {tuple(x.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"nf4 decode: x has {x.shape[0]} rows; this kernel serves at most {MAX_ROWS}")
    if k % w.blocksize or w.blocksize > MAX_BLOCKSIZE:
        raise ValueError(f"nf4 decode: in_features {k} must be a multiple of the weight's blocksize {w.blocksize}, "
                         f"at most {MAX_BLOCKSIZE}; use the buffer path (nf4_gemm: buffer)")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"nf4 decode: x must be fp32/fp16/bf16; got {x.dtype}")
    if x.device != w.device:
        raise ValueError(f"nf4 decode: x is on {x.device} but the NF4 weight on {w.device}")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":  # read per call, never at import
        raise ValueError(f"nf4 decode runs a Triton kernel: it needs a CUDA device (or TRITON_INTERPRET=1 on "
                         f"CPU); x is on {x.device}")


def _groupable(weights: Sequence[Nf4Weight], biases: Sequence[torch.Tensor | None]) -> bool:
    """True when ``nf4_decode_group`` runs ``weights`` as one launch: at most ``MAX_GROUP``, one
    ``K``, blocksize and absmax layout, biases on all or none."""
    w0, nb = weights[0], _nested_blocksize(weights)
    return (len(weights) <= MAX_GROUP and all(w.shape[1] == w0.shape[1] and w.blocksize == w0.blocksize
                                               and w.nested == w0.nested for w in weights)
            and all(w.nested_blocksize == nb or w.nested_absmax.numel() == 1 for w in weights if w.nested)
            and len({b is None for b in biases}) == 1)


groupable = _groupable  # what callers ask (nf4.nf4_outputs); the launcher checks with its own name


def _nested_blocksize(weights: Sequence[Nf4Weight]) -> int:
    """The absmax values per nested block, one for the launch (a weight whose absmax is one
    nested block reads alike with any larger one); 1 without double quantization."""
    return max(w.nested_blocksize for w in weights) or 1


def _weight_args(w: Nf4Weight, bias: torch.Tensor | None, y: torch.Tensor) -> tuple:
    pieces = (w.nested_absmax, w.nested_code, w.offset) if w.nested else (w.code,) * 3
    return (w.data, w.absmax, w.code, *pieces, bias if bias is not None else y)


def _lookup(cfg: DecodeConfig, x: torch.Tensor, weights: Sequence[Nf4Weight]) -> int:
    if cfg.lookup == 4 and (x.dtype == torch.float32 or any(w.data.data_ptr() % 4 or not w.data.is_contiguous()
                                                            for w in weights)):
        return 2  # byte permutes build 16-bit values from 32-bit words of codes
    return cfg.lookup


def nf4_linear_decode(x: torch.Tensor, w: Nf4Weight, bias: torch.Tensor | None = None, *,
                      config: DecodeConfig | None = None, workspace: DecodeWorkspace | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(w)^T (+ bias) -> [M, N]`` in ``x.dtype`` (fp32 accumulation), for
    ``M <= MAX_ROWS`` and ``K`` a multiple of ``w.blocksize``; ``config``: the tiling
    (``default_config(M, w.shape)`` when None); ``workspace``: kept counters for ``fused_sum``
    (else zeroed per call)."""
    return nf4_decode_group(x, [w], [bias], config=config, workspace=workspace)[0]


def nf4_decode_group(x: torch.Tensor, weights: Sequence[Nf4Weight], biases: Sequence[torch.Tensor | None],
                     *, config: DecodeConfig | None = None, workspace: DecodeWorkspace | None = None
                     ) -> list[torch.Tensor]:
    """``[x @ dequant(w_i)^T (+ b_i)]`` for weights sharing ``K`` (``groupable``) in one launch
    (and one split-K sum): column views ``[M, N_i]`` of one ``[M, sum N_i]`` output, as a fused
    16-bit weight's product gives them. ``config``: ``default_config(M, (sum N_i, K))`` when None."""
    if not _groupable(weights, biases):
        raise ValueError(f"nf4 decode: a group of {len(weights)} weights must be at most {MAX_GROUP} sharing K, "
                         "blocksize and absmax layout, with biases on all or none")
    for w in weights:
        _check(x, w)
    sizes = [w.shape[0] for w in weights]
    m, n, k, w0 = x.shape[0], sum(sizes), weights[0].shape[1], weights[0]
    cfg = config or default_config(m, (n, k))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return list(y.split(sizes, dim=1))
    block_m, blocks_per_row = _block_m(m, cfg), k // w0.blocksize
    per_split = cfg.groups * triton.cdiv(triton.cdiv(blocks_per_row, cfg.groups), default_split(m, w0, cfg, n))
    split = triton.cdiv(blocks_per_row, per_split)  # absmax blocks per program: whole loop steps
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    tiles = [triton.cdiv(s, cfg.block_n) for s in sizes] + [0] * (MAX_GROUP - len(sizes))
    fused_sum = cfg.fused_sum and split > 1
    counts = y  # (unused without fused_sum)
    if fused_sum:
        need = sum(tiles) * triton.cdiv(m, block_m)
        counts = (workspace.counters if workspace is not None and workspace.counters.numel() >= need
                  else torch.zeros(need, dtype=torch.int32, device=x.device))
    wargs = [a for w, b in zip(weights, biases) for a in _weight_args(w, b, y)]
    wargs += wargs[:7] * (MAX_GROUP - len(weights))  # unused slots: never selected
    big = 2 ** 30  # a tile index no program reaches: the slot is empty
    starts = [tiles[0], tiles[0] + tiles[1]]
    starts = [s if i + 1 < len(weights) else big for i, s in enumerate(starts)]
    cols = [sizes[0], sizes[0] + (sizes[1] if len(sizes) > 1 else 0)]
    grid = (sum(tiles), split, triton.cdiv(m, block_m))
    _nf4_decode_kernel[grid](
        x, *wargs, out, y, counts, *starts, *(sizes + [0] * (MAX_GROUP - len(sizes))), *cols, m, blocks_per_row,
        per_split, split, x.stride(0), x.stride(1), n, m * n, NUM_W=len(weights), BLOCKSIZE=w0.blocksize,
        NESTED=w0.nested, NESTED_BLOCKSIZE=_nested_blocksize(weights), HAS_BIAS=biases[0] is not None,
        PARTIAL=split > 1, FUSED_SUM=fused_sum, USE_DOT=cfg.use_dot, LOOKUP=_lookup(cfg, x, weights),
        CONTIG=cfg.contiguous, ASM=x.is_cuda, XW=cfg.x_first and cfg.use_dot and cfg.contiguous, BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, GROUPS=cfg.groups, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        EVEN_K=blocks_per_row % cfg.groups == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        enable_fp_fusion=False)
    if split > 1 and not fused_sum:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](out, y, m * n, split, BLOCK=block)
    return list(y.split(sizes, dim=1)) if len(weights) > 1 else [y]
