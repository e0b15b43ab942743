"""The per-row Triton kernels of the decode LoRA (every row its own adapter and rank): the shrink
``x A^T`` per K block into fp32 partial sums, and the expand of those sums into the output.

Two launches, each over all rows (S-LoRA / Punica's shrink and expand). A first single-kernel
version (per (row, N-split) program: reduce x A^T over K, then sweep the split's columns)
measured 25-240 us per call on an H200 at 8B decode shapes: its K loop is a chain of dependent
loads per program (latency bound). Splitting the K reduction over programs puts every tile of
A and Bt in flight at once. The launchers, knobs and row bounds are in ``lora_gather.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .lora_grouped_kernels import (gdc_launch_dependents, gdc_wait, hybrid_row, lora_delta, lora_group_delta,
                                   lora_row_tables)


@triton.jit
def _lora_shrink_kernel(
    x_ptr, pool_ptr, a_off_ptr, rank_ptr, part_ptr, K, x_stride, a_g_stride, r_g_stride,
    MAX_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, RANK_SPLIT: tl.constexpr,
    GDC: tl.constexpr = False,
):
    """part[g, row, kb, :rank] = x[row, kb's columns] A_g^T[kb's columns, :rank] (fp32).

    Program (row, K block kb, projection g x rank split s): loads the row's A tile of
    projection g for its K block, BLOCK_R rank vectors at a time up to the row's own rank (a
    rank-8 row loads 8 rows of A, not the largest rank's), the rank blocks s, s + RANK_SPLIT,
    ... (RANK_SPLIT programs share a row's rank: at a few rows each walks one block instead of
    a chain of them; programs past the rank return). The G projections of a group share x.
    GDC: the expand launched after it as a programmatic dependent (``PDL``) may start once
    every program here has started; it waits for this grid before reading ``part``.
    """
    if GDC:
        gdc_launch_dependents()
    row = tl.program_id(0)
    kb = tl.program_id(1)
    g = tl.program_id(2) // RANK_SPLIT
    split = tl.program_id(2) % RANK_SPLIT
    rank = tl.minimum(tl.load(rank_ptr + g * r_g_stride + row), MAX_R)
    a_off = tl.load(a_off_ptr + g * a_g_stride + row)
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    k_ok = offs_k < K
    x = tl.load(x_ptr + row.to(tl.int64) * x_stride + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    part_row = part_ptr + ((g * tl.num_programs(0) + row).to(tl.int64) * tl.num_programs(1) + kb) * MAX_R
    for r0 in range(split * BLOCK_R, rank, RANK_SPLIT * BLOCK_R):
        r_ok = r0 + offs_r < rank
        a = tl.load(pool_ptr + a_off + (r0 + offs_r)[:, None] * K + offs_k[None, :],
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        tl.store(part_row + r0 + offs_r, tl.sum(a.to(tl.float32) * x[None, :], axis=1), mask=r_ok)


@triton.jit(do_not_specialize=("rows", "slots", "min_group", "groups_stride"))
def _lora_expand_kernel(
    pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, out_ptr, N, k_blocks, out_stride,
    rows, groups_ptr, groups_stride, slots, min_group,
    ACCUMULATE: tl.constexpr, MAX_R: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_KB: tl.constexpr, BLOCK_N: tl.constexpr, PRELOAD: tl.constexpr = False, GDC: tl.constexpr = False,
    HYBRID: tl.constexpr = False, BLOCK_M: tl.constexpr = 16, DOT_PRECISION: tl.constexpr = "ieee",
    HALF_S: tl.constexpr = False, GROUP_N: tl.constexpr = 16,
):
    """out[row, n block] (+)= scale * (sum over K blocks of part[row]) Bt[:rank, n block].

    Sum in fp32, one rounding to the output dtype (a read-modify-write when ACCUMULATE; rows of
    rank 0 are then not touched at all). A row whose rank exceeds MAX_R gets NaN: the shrink
    could not hold its sums, and a loud wrong answer beats a quiet one (no host check is
    possible without a device sync). PRELOAD / GDC: ``lora_delta``'s (``PDL``); every program
    waits before it reads ``part`` or ``out``.

    Programs (slots + row, n block) over ``rows`` rows. HYBRID (``lora_gather.HYBRID_MIN_ROWS``):
    a row in a group of at least ``min_group`` rows (the groups table's fourth row) is its
    group's: with ``slots`` > 0 the first ``slots`` programs are the groups' (group t's rows by
    one dot, B^T read once; groups of fewer rows return) and the row's own program does nothing;
    with no slots the row's program treats it as rank 0 (a grouped launch after this one adds it).
    """
    pid = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if HYBRID:  # (compiled only where taken: the per-row launches keep their registers)
        if pid < slots:
            _expand_group(pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, out_ptr, N, k_blocks, out_stride,
                          rows, groups_ptr, groups_stride, pid, min_group, tl.program_id(1) * BLOCK_N,
                          ACCUMULATE=ACCUMULATE, MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, GDC=GDC,
                          BLOCK_M=BLOCK_M, DOT_PRECISION=DOT_PRECISION, HALF_S=HALF_S, BLOCK_N=BLOCK_N,
                          GROUP_N=GROUP_N)
        else:
            grouped, lrow = hybrid_row(pid - slots, groups_ptr + 3 * groups_stride, rows, min_group, HYBRID=True)
            if (slots == 0) | (grouped == 0):
                _expand_row(pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, out_ptr, N, k_blocks, out_stride,
                            rows, pid - slots, lrow, offs_n, n_ok, ACCUMULATE=ACCUMULATE, MAX_R=MAX_R,
                            BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, PRELOAD=PRELOAD, GDC=GDC)
    else:
        _expand_row(pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, out_ptr, N, k_blocks, out_stride, rows,
                    pid, pid, offs_n, n_ok, ACCUMULATE=ACCUMULATE, MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB,
                    PRELOAD=PRELOAD, GDC=GDC)


@triton.jit
def _expand_row(pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, out_ptr, N, k_blocks, out_stride, rows, row,
                lrow, offs_n, n_ok, ACCUMULATE: tl.constexpr, MAX_R: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_KB: tl.constexpr, PRELOAD: tl.constexpr, GDC: tl.constexpr):
    """``_lora_expand_kernel``'s program for row ``row`` (its LoRA that of ``lrow``: -1, none)."""
    rank_in, rank, b_off, scale, part_row = lora_row_tables(
        b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, 0, rows, k_blocks, 0, 0, MAX_R)
    acc = lora_delta(part_row, pool_ptr, b_off, rank, scale, N, offs_n, n_ok, k_blocks,
                     MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, PRELOAD=PRELOAD, GDC=GDC)
    acc = tl.where(rank_in > MAX_R, float("nan"), acc)
    out_ptrs = out_ptr + row.to(tl.int64) * out_stride + offs_n
    if ACCUMULATE:
        live = n_ok & (rank_in > 0)
        acc += tl.load(out_ptrs, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=live)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _expand_group(pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, out_ptr, N, k_blocks, out_stride, rows,
                  groups_ptr, groups_stride, t, min_group, col0, ACCUMULATE: tl.constexpr,
                  MAX_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr, GDC: tl.constexpr,
                  BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr, HALF_S: tl.constexpr, BLOCK_N: tl.constexpr,
                  GROUP_N: tl.constexpr):
    """``_lora_expand_kernel``'s program for group t (nothing for a group under ``min_group`` rows):
    the BLOCK_N columns from ``col0``, GROUP_N at a time (fewer live registers per dot)."""
    start = tl.load(groups_ptr + t)
    end = tl.load(groups_ptr + groups_stride + t)
    if end - start >= tl.maximum(min_group, 1):
        if GDC:
            gdc_wait()
        for c in range(0, BLOCK_N, GROUP_N):
            offs_n = col0 + c + tl.arange(0, GROUP_N)
            n_ok = offs_n < N
            grow, m_ok, rank_in, delta = lora_group_delta(
                part_ptr, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, start, end, 0, rows, k_blocks,
                groups_stride, 0, 0, N, offs_n, n_ok,
                MAX_R=MAX_R, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, DOT_PRECISION=DOT_PRECISION,
                HALF_S=HALF_S)
            delta = tl.where(rank_in > MAX_R, float("nan"), delta)
            ptrs = out_ptr + grow[:, None].to(tl.int64) * out_stride + offs_n[None, :]
            if ACCUMULATE:
                live = m_ok[:, None] & n_ok[None, :] & (rank_in > 0)
                delta += tl.load(ptrs, mask=live, other=0.0).to(tl.float32)
            else:
                live = m_ok[:, None] & n_ok[None, :]
            tl.store(ptrs, delta.to(out_ptr.dtype.element_ty), mask=live)
