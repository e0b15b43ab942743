"""The Triton kernels of the decode LoRA for rows grouped by adapter (``GatheredLora.groups``).

A group is up to BLOCK_M decode rows of one adapter (``lora_gather.adapter_groups``: ``groups
[4, n]`` int32, start and end of each group in the third row, ``perm``, the rows sorted by
adapter; unused columns are empty groups; the fourth row each row's group size, which
``hybrid_row`` reads for the hybrid expands' per-row programs). The shrink reads the adapter's A once for the
group's rows (a tensor-core dot), the expand its B^T once (a dot, or the group's rows one after
another through the per-row helpers ``lora_row_tables`` / ``lora_delta``, which live here too,
with the tile in L1 after the first row); they write and read the per-row kernels' partial sums
(``part [G, rows, k_blocks, MAX_R]`` fp32), so a grouped half pairs with a per-row one. The launchers, knobs and row bounds are in ``lora_gather.py``; the
SwiGLU epilogue's grouped form in ``lora_epilogues.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # Hopper's grid dependency control (programmatic dependent launch); absent from older Tritons
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - the launchers then never set GDC
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def lora_delta(
    part_row, pool_ptr, b_off, rank, scale, N, offs_n, n_ok, k_blocks,
    MAX_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr,
    PRELOAD: tl.constexpr = False, GDC: tl.constexpr = False,
):
    """The expand half for one row and one block of output columns ``offs_n`` (fp32, shape of
    offs_n): ``scale * (sum over K blocks of part[kb, :rank]) @ Bt[:rank, offs_n]``.

    ``part_row`` points at the row's ``part[g, row, 0, 0]`` (written by the shrink); ``rank``
    already clamped to MAX_R (0: no LoRA, the loop does not run); ``Bt [rank, N]`` at
    ``pool_ptr + b_off``. PRELOAD: the first rank chunk of B^T is loaded before the partials
    and, with GDC, before waiting for the grid that wrote them (``gdc_wait``: a kernel launched
    as a programmatic dependent of the shrink reads the adapter's weights while the shrink
    finishes); the same sums in the same order.
    """
    offs_r = tl.arange(0, BLOCK_R)
    offs_kb = tl.arange(0, BLOCK_KB)
    kb_ok = offs_kb < k_blocks
    acc = tl.zeros(offs_n.shape, dtype=tl.float32)
    first = 0
    if PRELOAD:
        r_ok = offs_r < rank
        bt = tl.load(pool_ptr + b_off + offs_r[:, None] * N + offs_n[None, :],
                     mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        if GDC:
            gdc_wait()
        part = tl.load(part_row + offs_kb[:, None] * MAX_R + offs_r[None, :],
                       mask=kb_ok[:, None] & r_ok[None, :], other=0.0)
        s = tl.sum(part, axis=0) * scale
        acc += tl.sum(s[:, None] * bt.to(tl.float32), axis=0)
        first = BLOCK_R
    for r0 in range(first, rank, BLOCK_R):
        r_ok = r0 + offs_r < rank
        part = tl.load(part_row + offs_kb[:, None] * MAX_R + r0 + offs_r[None, :],
                       mask=kb_ok[:, None] & r_ok[None, :], other=0.0)
        s = tl.sum(part, axis=0) * scale
        bt = tl.load(pool_ptr + b_off + (r0 + offs_r)[:, None] * N + offs_n[None, :],
                     mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.sum(s[:, None] * bt.to(tl.float32), axis=0)
    return acc


@triton.jit
def lora_delta_pair(
    part_a, b_off_a, rank_a, N_a, offs_a, ok_a, part_b, b_off_b, rank_b, N_b, offs_b, ok_b, pool_ptr, scale,
    k_blocks, MAX_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr,
    PRELOAD: tl.constexpr = False, GDC: tl.constexpr = False,
):
    """Two ``lora_delta`` in one rank loop (up to the larger rank, each masked to its own): the
    same arithmetic per element, one chain of dependent loads instead of two (a decode step of
    few rows waits on those chains). a and b: the same projection's two column sets (RoPE's
    halves) or two projections of a row (gate and up). PRELOAD / GDC: as ``lora_delta``'s."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_kb = tl.arange(0, BLOCK_KB)
    kb_ok = offs_kb < k_blocks
    acc_a = tl.zeros(offs_a.shape, dtype=tl.float32)
    acc_b = tl.zeros(offs_b.shape, dtype=tl.float32)
    first = 0
    if PRELOAD:
        ra_ok = offs_r < rank_a
        rb_ok = offs_r < rank_b
        bta = tl.load(pool_ptr + b_off_a + offs_r[:, None] * N_a + offs_a[None, :],
                      mask=ra_ok[:, None] & ok_a[None, :], other=0.0)
        btb = tl.load(pool_ptr + b_off_b + offs_r[:, None] * N_b + offs_b[None, :],
                      mask=rb_ok[:, None] & ok_b[None, :], other=0.0)
        if GDC:
            gdc_wait()
        pa = tl.load(part_a + offs_kb[:, None] * MAX_R + offs_r[None, :], mask=kb_ok[:, None] & ra_ok[None, :],
                     other=0.0)
        pb = tl.load(part_b + offs_kb[:, None] * MAX_R + offs_r[None, :], mask=kb_ok[:, None] & rb_ok[None, :],
                     other=0.0)
        acc_a += tl.sum((tl.sum(pa, axis=0) * scale)[:, None] * bta.to(tl.float32), axis=0)
        acc_b += tl.sum((tl.sum(pb, axis=0) * scale)[:, None] * btb.to(tl.float32), axis=0)
        first = BLOCK_R
    for r0 in range(first, tl.maximum(rank_a, rank_b), BLOCK_R):
        ra_ok = r0 + offs_r < rank_a
        rb_ok = r0 + offs_r < rank_b
        pa = tl.load(part_a + offs_kb[:, None] * MAX_R + r0 + offs_r[None, :], mask=kb_ok[:, None] & ra_ok[None, :],
                     other=0.0)
        pb = tl.load(part_b + offs_kb[:, None] * MAX_R + r0 + offs_r[None, :], mask=kb_ok[:, None] & rb_ok[None, :],
                     other=0.0)
        bta = tl.load(pool_ptr + b_off_a + (r0 + offs_r)[:, None] * N_a + offs_a[None, :],
                      mask=ra_ok[:, None] & ok_a[None, :], other=0.0)
        btb = tl.load(pool_ptr + b_off_b + (r0 + offs_r)[:, None] * N_b + offs_b[None, :],
                      mask=rb_ok[:, None] & ok_b[None, :], other=0.0)
        acc_a += tl.sum((tl.sum(pa, axis=0) * scale)[:, None] * bta.to(tl.float32), axis=0)
        acc_b += tl.sum((tl.sum(pb, axis=0) * scale)[:, None] * btb.to(tl.float32), axis=0)
    return acc_a, acc_b


@triton.jit
def hybrid_row(lrow, sizes_ptr, rows, min_group, HYBRID: tl.constexpr):
    """(whether row ``lrow``'s LoRA is its group's, the row as the per-row helpers take it):
    with HYBRID, a row in a group of at least ``min_group`` rows (``sizes_ptr``: the groups
    table's fourth row, ``lora_gather.adapter_groups``) -> (True, -1: rank 0 for the per-row
    helpers, nothing read); else (False, ``lrow``)."""
    grouped = lrow < 0  # (a tensor of the right kind; False for every row a caller passes here)
    if HYBRID:
        live = (lrow >= 0) & (lrow < rows)
        size = tl.load(sizes_ptr + tl.maximum(lrow, 0), mask=live, other=0)
        grouped = live & (size >= min_group)
        lrow = tl.where(grouped, -1, lrow)
    return grouped, lrow


@triton.jit
def lora_row_tables(
    b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, g, rows, k_blocks, b_g_stride, r_g_stride,
    MAX_R: tl.constexpr,
):
    """Row ``lrow`` of a gathered group's tables for projection g -> (rank as given, rank
    clamped to MAX_R, B^T offset, scale, the row's partials in ``part``). ``lrow`` outside
    ``[0, rows)`` (a row before ``GatheredLora.first_row`` or after its rows): rank 0, nothing
    read."""
    live = (lrow >= 0) & (lrow < rows)
    safe = tl.maximum(lrow, 0)
    rank_in = tl.load(rank_ptr + g * r_g_stride + safe, mask=live, other=0)
    b_off = tl.load(b_off_ptr + g * b_g_stride + safe, mask=live, other=0)
    scale = tl.load(scale_ptr + safe, mask=live, other=0.0)
    part_row = part_ptr + ((g * rows + safe).to(tl.int64) * k_blocks) * MAX_R
    return rank_in, tl.minimum(rank_in, MAX_R), b_off, scale, part_row


@triton.jit(do_not_specialize=("rows", "groups_stride", "a_g_stride", "r_g_stride"))
def _lora_grouped_shrink_kernel(
    x_ptr, pool_ptr, a_off_ptr, rank_ptr, groups_ptr, part_ptr, K, x_stride, a_g_stride, r_g_stride, rows,
    groups_stride, k_blocks,
    MAX_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr, SINGLE_ROWS: tl.constexpr, GDC: tl.constexpr = False,
    RANK_SPLIT: tl.constexpr = 1, UNROLL_K: tl.constexpr = False,
):
    """``_lora_shrink_kernel``'s partial sums for rows that share an adapter: program (group t,
    K split kb, projection g) reads rows ``perm[start_t:end_t]`` (at most BLOCK_M, one adapter),
    loads that adapter's A tile once per rank chunk and writes each row's ``part[g, row, kb]``
    as the per-row kernel does, over the SPLIT_K columns of split kb (a multiple of BLOCK_K,
    walked BLOCK_K at a time: fewer splits, fewer partials for the expand to sum). An empty
    group (start == end) returns. SINGLE_ROWS: a group of one row takes the per-row kernel's
    arithmetic (a sum over K of A * x on the CUDA cores) instead of a 16-row dot for it. GDC:
    the kernel launched after it as a programmatic dependent (``lora_gather.PDL``) may start
    once every program here has started (it waits for this grid before reading the partials).
    RANK_SPLIT: programs (t, kb, g * RANK_SPLIT + s) share the group's rank chunks, s walking
    chunks s, s + RANK_SPLIT, ... (the same sums: each chunk's partials are its own). UNROLL_K: a
    split's K tiles unrolled (SPLIT_K / BLOCK_K of them, past K masked), so their loads can all be
    in flight at once; the same sums in the same order."""
    if GDC:
        gdc_launch_dependents()
    t = tl.program_id(0)
    kb = tl.program_id(1)
    g = tl.program_id(2) // RANK_SPLIT
    split = tl.program_id(2) % RANK_SPLIT
    start = tl.load(groups_ptr + t)
    end = tl.load(groups_ptr + groups_stride + t)
    if end > start:
        first = tl.load(groups_ptr + 2 * groups_stride + start)
        rank = tl.minimum(tl.load(rank_ptr + g * r_g_stride + first), MAX_R)
        a_off = tl.load(a_off_ptr + g * a_g_stride + first)
        k_end = tl.minimum(SPLIT_K, K - kb * SPLIT_K)
        if SINGLE_ROWS:
            if end - start == 1:
                _shrink_row(x_ptr, pool_ptr, part_ptr, first, g, kb, rank, a_off, K, k_end, x_stride, rows,
                            k_blocks, split, MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K,
                            RANK_SPLIT=RANK_SPLIT, UNROLL_K=UNROLL_K)
            else:
                _shrink_group(x_ptr, pool_ptr, groups_ptr, part_ptr, start, end, g, kb, rank, a_off, K, k_end,
                              x_stride, rows, groups_stride, k_blocks, split, MAX_R=MAX_R, BLOCK_M=BLOCK_M,
                              BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, DOT_PRECISION=DOT_PRECISION,
                              RANK_SPLIT=RANK_SPLIT, UNROLL_K=UNROLL_K)
        else:
            _shrink_group(x_ptr, pool_ptr, groups_ptr, part_ptr, start, end, g, kb, rank, a_off, K, k_end,
                          x_stride, rows, groups_stride, k_blocks, split, MAX_R=MAX_R, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R,
                          BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, DOT_PRECISION=DOT_PRECISION, RANK_SPLIT=RANK_SPLIT,
                          UNROLL_K=UNROLL_K)


@triton.jit
def _shrink_row(x_ptr, pool_ptr, part_ptr, row, g, kb, rank, a_off, K, k_end, x_stride, rows, k_blocks, split,
                MAX_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                RANK_SPLIT: tl.constexpr = 1, UNROLL_K: tl.constexpr = False):
    """One row's ``part[g, row, kb, :rank]`` over split kb's K columns (``_lora_shrink_kernel``'s
    arithmetic, BLOCK_K columns at a time); its rank chunks split, split + RANK_SPLIT, ..."""
    offs_k = kb * SPLIT_K + tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    x_row = x_ptr + row.to(tl.int64) * x_stride
    part_row = part_ptr + ((g * rows + row).to(tl.int64) * k_blocks + kb) * MAX_R
    for r0 in range(split * BLOCK_R, rank, RANK_SPLIT * BLOCK_R):
        r_ok = r0 + offs_r < rank
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        if UNROLL_K:
            for i in tl.static_range(SPLIT_K // BLOCK_K):
                acc = _row_tile(x_row, pool_ptr, a_off, offs_k, offs_r, r0, r_ok, i * BLOCK_K, K, acc)
        else:
            for k0 in range(0, k_end, BLOCK_K):
                acc = _row_tile(x_row, pool_ptr, a_off, offs_k, offs_r, r0, r_ok, k0, K, acc)
        tl.store(part_row + r0 + offs_r, acc, mask=r_ok)


@triton.jit
def _row_tile(x_row, pool_ptr, a_off, offs_k, offs_r, r0, r_ok, k0, K, acc):
    """``acc`` plus one row's sum over the K tile at ``offs_k + k0`` of its rank chunk's A * x."""
    ok = offs_k + k0 < K
    x = tl.load(x_row + k0 + offs_k, mask=ok, other=0.0).to(tl.float32)
    a = tl.load(pool_ptr + a_off + (r0 + offs_r)[:, None] * K + k0 + offs_k[None, :],
                mask=r_ok[:, None] & ok[None, :], other=0.0)
    return acc + tl.sum(a.to(tl.float32) * x[None, :], axis=1)


@triton.jit
def _shrink_group(x_ptr, pool_ptr, groups_ptr, part_ptr, start, end, g, kb, rank, a_off, K, k_end, x_stride, rows,
                  groups_stride, k_blocks, split, MAX_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  RANK_SPLIT: tl.constexpr = 1, UNROLL_K: tl.constexpr = False):
    """The rows ``perm[start:end]``' partial sums: the adapter's A tile read once for them, a dot;
    rank chunks split, split + RANK_SPLIT, ..."""
    offs_m = start + tl.arange(0, BLOCK_M)
    m_ok = offs_m < end
    row = tl.load(groups_ptr + 2 * groups_stride + offs_m, mask=m_ok, other=0)
    offs_k = kb * SPLIT_K + tl.arange(0, BLOCK_K)
    x_rows = x_ptr + row[:, None].to(tl.int64) * x_stride
    x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
    offs_r = tl.arange(0, BLOCK_R)
    part_rows = part_ptr + ((g * rows + row).to(tl.int64) * k_blocks + kb) * MAX_R
    for r0 in range(split * BLOCK_R, rank, RANK_SPLIT * BLOCK_R):
        r_ok = r0 + offs_r < rank
        a = tl.load(pool_ptr + a_off + (r0 + offs_r)[:, None] * K + offs_k[None, :],
                    mask=r_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        s = tl.dot(x, tl.trans(a), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_R] fp32
        if UNROLL_K:
            for i in tl.static_range(1, SPLIT_K // BLOCK_K):
                s = _group_tile(x_rows, pool_ptr, a_off, offs_k, offs_r, r0, r_ok, m_ok, i * BLOCK_K, K, s,
                                DOT_PRECISION=DOT_PRECISION)
        else:
            for k0 in range(BLOCK_K, k_end, BLOCK_K):  # (none: SPLIT_K == BLOCK_K)
                s = _group_tile(x_rows, pool_ptr, a_off, offs_k, offs_r, r0, r_ok, m_ok, k0, K, s,
                                DOT_PRECISION=DOT_PRECISION)
        tl.store(part_rows[:, None] + r0 + offs_r[None, :], s, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _group_tile(x_rows, pool_ptr, a_off, offs_k, offs_r, r0, r_ok, m_ok, k0, K, s, DOT_PRECISION: tl.constexpr):
    """``s`` plus the group's rows' dot over the K tile at ``offs_k + k0`` with their rank chunk of A."""
    ok = offs_k + k0 < K
    xk = tl.load(x_rows + k0 + offs_k[None, :], mask=m_ok[:, None] & ok[None, :], other=0.0)
    a = tl.load(pool_ptr + a_off + (r0 + offs_r)[:, None] * K + k0 + offs_k[None, :],
                mask=r_ok[:, None] & ok[None, :], other=0.0)
    return s + tl.dot(xk, tl.trans(a), input_precision=DOT_PRECISION)


@triton.jit
def lora_group_delta(
    part_ptr, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, start, end, g, rows, k_blocks,
    groups_stride, b_g_stride, r_g_stride, N, offs_n, n_ok,
    MAX_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HALF_S: tl.constexpr,
):
    """The expand half for the rows ``perm[start:end]`` of one group (one adapter, at most
    BLOCK_M) and columns ``offs_n`` of projection g -> (rows ``[BLOCK_M]``, their mask, the
    adapter's rank as given, delta ``[BLOCK_M, len(offs_n)]`` fp32 = ``scale_row * (sum over kb
    of part[g, row, kb, :rank]) @ Bt[:rank, offs_n]``): B^T read once for all the rows. HALF_S:
    the scaled S rounded to B^T's dtype before the dot (a half-precision dot; else tf32 / fp32)."""
    offs_m = start + tl.arange(0, BLOCK_M)
    m_ok = offs_m < end
    row = tl.load(groups_ptr + 2 * groups_stride + offs_m, mask=m_ok, other=0)
    first = tl.load(groups_ptr + 2 * groups_stride + start)
    rank_in = tl.load(rank_ptr + g * r_g_stride + first)
    rank = tl.minimum(rank_in, MAX_R)
    b_off = tl.load(b_off_ptr + g * b_g_stride + first)
    scale = tl.load(scale_ptr + row, mask=m_ok, other=0.0)
    part_rows = part_ptr + ((g * rows + row).to(tl.int64) * k_blocks) * MAX_R
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, offs_n.shape[0]), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r_ok = r0 + offs_r < rank
        # the partials summed as BLOCK_KB 2-D tiles, unrolled (all loads in flight at once): one
        # 3-D [BLOCK_M, BLOCK_KB, BLOCK_R] tile reduced over its middle axis spilled registers
        # with 28 K blocks (down's expand 2-5x the per-row one's time, docs/kernels.md)
        s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for kb in tl.static_range(BLOCK_KB):
            s += tl.load(part_rows[:, None] + kb * MAX_R + (r0 + offs_r)[None, :],
                         mask=m_ok[:, None] & r_ok[None, :] & (kb < k_blocks), other=0.0)
        s = s * scale[:, None]  # [BLOCK_M, BLOCK_R] fp32
        bt = tl.load(pool_ptr + b_off + (r0 + offs_r)[:, None] * N + offs_n[None, :],
                     mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        if HALF_S:  # S rounded to B's (half) dtype: a half-precision tensor-core dot, fp32 sums
            acc += tl.dot(s.to(bt.dtype), bt)
        else:
            acc += tl.dot(s, bt.to(tl.float32), input_precision=DOT_PRECISION)
    return row, m_ok, rank_in, acc


@triton.jit(do_not_specialize=("rows", "groups_stride", "b_g_stride", "r_g_stride", "g", "loop_rows", "min_rows"))
def _lora_grouped_expand_kernel(
    pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, part_ptr, out_ptr, N, out_stride, out_hstride, head_dim,
    g, rows, k_blocks, groups_stride, b_g_stride, r_g_stride, loop_rows, min_rows,
    MAX_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, ROW_LOOP: tl.constexpr, HALF_S: tl.constexpr,
):
    """out[rows of group t, n block] += their delta of projection g, one rounding to out's
    dtype (rows of rank 0 not touched; rank above MAX_R: NaN, as the per-row expand). Column n
    of a row lives at ``(n // head_dim) * out_hstride + n % head_dim`` (a [rows, heads,
    head_dim] view; a plain [rows, N] one: head_dim N). Program (t, n block). ROW_LOOP, or a
    group of at most ``loop_rows`` rows: the group's rows one after another through the per-row
    helpers (the per-row kernel's bits; the adapter's B^T tile comes from L1 after the first
    row); else ``lora_group_delta``'s dot. Groups of fewer than ``min_rows`` rows (at least 1)
    are left alone (the hybrid expands' per-row kernel adds theirs)."""
    t = tl.program_id(0)
    start = tl.load(groups_ptr + t)
    end = tl.load(groups_ptr + groups_stride + t)
    if end - start >= tl.maximum(min_rows, 1):
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        cols = (offs_n // head_dim) * out_hstride + offs_n % head_dim
        if ROW_LOOP:
            _expand_row_loop(pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, part_ptr, out_ptr, N, out_stride,
                             start, end, g, rows, k_blocks, groups_stride, b_g_stride, r_g_stride, offs_n, n_ok, cols,
                             MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB)
        elif end - start <= loop_rows:
            _expand_row_loop(pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, part_ptr, out_ptr, N, out_stride,
                             start, end, g, rows, k_blocks, groups_stride, b_g_stride, r_g_stride, offs_n, n_ok, cols,
                             MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB)
        else:
            row, m_ok, rank_in, delta = lora_group_delta(
                part_ptr, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, start, end, g, rows, k_blocks,
                groups_stride, b_g_stride, r_g_stride, N, offs_n, n_ok,
                MAX_R=MAX_R, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, DOT_PRECISION=DOT_PRECISION,
                HALF_S=HALF_S)
            delta = tl.where(rank_in > MAX_R, float("nan"), delta)
            ptrs = out_ptr + row[:, None].to(tl.int64) * out_stride + cols[None, :]
            live = m_ok[:, None] & n_ok[None, :] & (rank_in > 0)
            acc = delta + tl.load(ptrs, mask=live, other=0.0).to(tl.float32)
            tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _expand_row_loop(pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, part_ptr, out_ptr, N, out_stride,
                     start, end, g, rows, k_blocks, groups_stride, b_g_stride, r_g_stride, offs_n, n_ok, cols,
                     MAX_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr):
    """The rows ``perm[start:end]`` one after another: each row's delta added into ``out``."""
    for i in range(start, end):
        row = tl.load(groups_ptr + 2 * groups_stride + i)
        rank_in, rank, b_off, scale, part_row = lora_row_tables(
            b_off_ptr, rank_ptr, scale_ptr, part_ptr, row, g, rows, k_blocks, b_g_stride, r_g_stride, MAX_R)
        delta = lora_delta(part_row, pool_ptr, b_off, rank, scale, N, offs_n, n_ok, k_blocks,
                           MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB)
        ptrs = out_ptr + row.to(tl.int64) * out_stride + cols
        live = n_ok & (rank_in > 0)
        acc = tl.where(rank_in > MAX_R, float("nan"), delta)
        acc += tl.load(ptrs, mask=live, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=live)

@triton.jit
def _with_lora(x, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, g, lora_rows, k_blocks,
               b_g_stride, r_g_stride, N, offs_n, n_ok,
               MAX_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr,
               PRELOAD: tl.constexpr = False, GDC: tl.constexpr = False):
    """x (fp32 values of the output dtype at columns offs_n of projection g) + the row's LoRA
    delta, still fp32 (the caller rounds). NaN where the row's rank exceeds MAX_R. PRELOAD /
    GDC: ``lora_delta``'s."""
    rank_in, rank, b_off, scale, part_row = lora_row_tables(
        b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, g, lora_rows, k_blocks, b_g_stride, r_g_stride, MAX_R)
    delta = lora_delta(part_row, pool_ptr, b_off, rank, scale, N, offs_n, n_ok, k_blocks,
                       MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, PRELOAD=PRELOAD, GDC=GDC)
    return tl.where(rank_in > MAX_R, float("nan"), x + delta)


@triton.jit
def _with_lora_pair(xa, xb, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, ga, gb, lora_rows, k_blocks,
                    b_g_stride, r_g_stride, N_a, N_b, offs_a, ok_a, offs_b, ok_b,
                    MAX_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr,
                    PRELOAD: tl.constexpr = False, GDC: tl.constexpr = False):
    """``_with_lora`` of two column sets at once (projection ga at offs_a, gb at offs_b; the
    same or two projections of row ``lrow``): one rank loop (``lora_delta_pair``), the same values."""
    rank_a_in, rank_a, b_off_a, scale, part_a = lora_row_tables(
        b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, ga, lora_rows, k_blocks, b_g_stride, r_g_stride, MAX_R)
    rank_b_in, rank_b, b_off_b, _, part_b = lora_row_tables(
        b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, gb, lora_rows, k_blocks, b_g_stride, r_g_stride, MAX_R)
    da, db = lora_delta_pair(part_a, b_off_a, rank_a, N_a, offs_a, ok_a, part_b, b_off_b, rank_b, N_b, offs_b, ok_b,
                             pool_ptr, scale, k_blocks, MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB,
                             PRELOAD=PRELOAD, GDC=GDC)
    return (tl.where(rank_a_in > MAX_R, float("nan"), xa + da), tl.where(rank_b_in > MAX_R, float("nan"), xb + db))


@triton.jit(do_not_specialize=("first_row", "rows", "groups_stride", "b_g_stride", "r_g_stride", "loop_rows",
                               "min_rows"))
def _swiglu_grouped_kernel(
    g_ptr, u_ptr, out_ptr, N, g_stride, u_stride, out_stride,
    pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, part_ptr, first_row, rows, k_blocks, groups_stride,
    b_g_stride, r_g_stride, loop_rows, min_rows,
    MAX_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, ROW_LOOP: tl.constexpr, HALF_S: tl.constexpr,
):
    """``_swiglu_kernel``'s LoRA rows, a program per (group t, n block), the group's gate and up
    B^T read once for its rows: ROW_LOOP (or a group of at most ``loop_rows`` rows), the rows
    one after another through ``_with_lora`` (the per-row kernel's bits, the tile from L1 after
    the first row); else one dot for them all (``lora_group_delta``), the same roundings per
    element. Rows in no group, and groups of fewer than ``min_rows`` rows (at least 1), are left
    to the plain launch."""
    t = tl.program_id(0)
    start = tl.load(groups_ptr + t)
    end = tl.load(groups_ptr + groups_stride + t)
    if end - start >= tl.maximum(min_rows, 1):
        offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = offs < N
        if ROW_LOOP:
            _swiglu_row_loop(g_ptr, u_ptr, out_ptr, N, g_stride, u_stride, out_stride, pool_ptr, b_off_ptr, rank_ptr,
                             scale_ptr, groups_ptr, part_ptr, first_row, rows, k_blocks, groups_stride, b_g_stride,
                             r_g_stride, start, end, offs, ok, MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB)
        elif end - start <= loop_rows:
            _swiglu_row_loop(g_ptr, u_ptr, out_ptr, N, g_stride, u_stride, out_stride, pool_ptr, b_off_ptr, rank_ptr,
                             scale_ptr, groups_ptr, part_ptr, first_row, rows, k_blocks, groups_stride, b_g_stride,
                             r_g_stride, start, end, offs, ok, MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB)
        else:
            swiglu_group(g_ptr, u_ptr, out_ptr, N, g_stride, u_stride, out_stride, pool_ptr, b_off_ptr, rank_ptr,
                         scale_ptr, groups_ptr, part_ptr, first_row, rows, k_blocks, groups_stride, b_g_stride,
                         r_g_stride, start, end, offs, ok, MAX_R=MAX_R, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R,
                         BLOCK_KB=BLOCK_KB, DOT_PRECISION=DOT_PRECISION, HALF_S=HALF_S)


@triton.jit
def swiglu_group(g_ptr, u_ptr, out_ptr, N, g_stride, u_stride, out_stride, pool_ptr, b_off_ptr, rank_ptr,
                 scale_ptr, groups_ptr, part_ptr, first_row, rows, k_blocks, groups_stride, b_g_stride,
                 r_g_stride, start, end, offs, ok,
                 MAX_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, HALF_S: tl.constexpr):
    """SwiGLU's output for the rows ``perm[start:end]`` of one group at columns ``offs``, their
    gate and up LoRA by one dot each (``lora_group_delta``), each rounded as the per-row kernel
    rounds it."""
    row, m_ok, rank_g, dg = lora_group_delta(
        part_ptr, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, start, end, 0, rows, k_blocks,
        groups_stride, b_g_stride, r_g_stride, N, offs, ok,
        MAX_R=MAX_R, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, DOT_PRECISION=DOT_PRECISION,
        HALF_S=HALF_S)
    _, _, rank_u, du = lora_group_delta(
        part_ptr, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, start, end, 1, rows, k_blocks,
        groups_stride, b_g_stride, r_g_stride, N, offs, ok,
        MAX_R=MAX_R, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, DOT_PRECISION=DOT_PRECISION,
        HALF_S=HALF_S)
    row64 = (first_row + row).to(tl.int64)[:, None]
    live = m_ok[:, None] & ok[None, :]
    g = tl.load(g_ptr + row64 * g_stride + offs[None, :], mask=live, other=0.0)
    u = tl.load(u_ptr + row64 * u_stride + offs[None, :], mask=live, other=0.0)
    dtype = g.dtype
    g = tl.where(rank_g > MAX_R, float("nan"), g.to(tl.float32) + dg).to(dtype).to(tl.float32)
    u = tl.where(rank_u > MAX_R, float("nan"), u.to(tl.float32) + du).to(dtype).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row64 * out_stride + offs[None, :], (s * u).to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _swiglu_row_loop(g_ptr, u_ptr, out_ptr, N, g_stride, u_stride, out_stride, pool_ptr, b_off_ptr, rank_ptr,
                     scale_ptr, groups_ptr, part_ptr, first_row, rows, k_blocks, groups_stride, b_g_stride,
                     r_g_stride, start, end, offs, ok,
                     MAX_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr):
    """The rows ``perm[start:end]`` one after another through ``_with_lora`` (the per-row kernel's
    arithmetic)."""
    for i in range(start, end):
        lrow = tl.load(groups_ptr + 2 * groups_stride + i)
        row64 = (first_row + lrow).to(tl.int64)
        g = tl.load(g_ptr + row64 * g_stride + offs, mask=ok, other=0.0)
        u = tl.load(u_ptr + row64 * u_stride + offs, mask=ok, other=0.0)
        dtype = g.dtype
        g = _with_lora(g.to(tl.float32), pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, 0, rows,
                       k_blocks, b_g_stride, r_g_stride, N, offs, ok,
                       MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB).to(dtype).to(tl.float32)
        u = _with_lora(u.to(tl.float32), pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, 1, rows,
                       k_blocks, b_g_stride, r_g_stride, N, offs, ok,
                       MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB).to(dtype).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        tl.store(out_ptr + row64 * out_stride + offs, (s * u).to(out_ptr.dtype.element_ty), mask=ok)
