"""FusedLoRA / FusedMultiLoRA Triton kernels (the math of each step is in ``fused_lora.py``).

The launchers that pick grids and constexprs are in ``fused_lora_launch.py``; nothing here is
called directly from Python except through them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .dropout_triton import hash_base, keep_bits16, pair_hash, row_hash


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
    x_ptr, a_ptr, s_ptr, tiles_ptr, ai_ptr, af_ptr, offset_h, K, subs, k_per_split, split_stride,
    AI_STRIDE: tl.constexpr, HAS_DROPOUT: tl.constexpr, TILE_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """S[tile rows, rank block] = dropout(X[tile rows]) A_a^T over all of the adapter's A rows.

    Each row block is covered by ``subs`` programs of BLOCK_M rows (more programs in flight);
    a program handles its even and odd rows as two halves sharing one hash evaluation.
    ``PARTIAL``: program ``(.., .., sp)`` sums only columns ``[sp * k_per_split, +k_per_split)``
    of ``X`` into an fp32 partial at ``s + sp * split_stride`` (``_split_sum_kernel`` adds them).
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
    if PARTIAL:
        k_start = tl.program_id(2) * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        s_ptr += tl.program_id(2).to(tl.int64) * split_stride
    else:
        k_start = 0
        k_end = K
    k_stop = tl.where((rb * BLOCK_R < width) & live, k_end, k_start)
    pair_h = row_hash(hash_base(seed_h, offset_h), pairs)
    acc_e = tl.zeros((BLOCK_M // 2, BLOCK_R), dtype=tl.float32)
    acc_o = tl.zeros((BLOCK_M // 2, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        xe = tl.load(x_ptr + rows_e[:, None] * K + offs_k[None, :],
                     mask=ok_e[:, None] & k_ok[None, :], other=0.0)
        xo = tl.load(x_ptr + rows_o[:, None] * K + offs_k[None, :],
                     mask=ok_o[:, None] & k_ok[None, :], other=0.0)
        if HAS_DROPOUT:  # 1 / (1 - p) is applied to the accumulator at the end
            h = pair_hash(pair_h, offs_k)
            xe = tl.where((h & 0xFFFF) >= threshold, xe, 0.0).to(x_ptr.dtype.element_ty)
            xo = tl.where((h >> 16) >= threshold, xo, 0.0).to(x_ptr.dtype.element_ty)
        at = tl.load(a_ptr + (a_row + offs_r)[None, :] * K + offs_k[:, None],
                     mask=r_ok[None, :] & k_ok[:, None], other=0.0).to(x_ptr.dtype.element_ty)
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
                st = (st.to(tl.float32) * scale).to(x_ptr.dtype.element_ty)
                bt = tl.load(b_ptr + cols[None, :] * b_stride + b_col + offs_r[:, None],
                             mask=r_ok[:, None], other=0.0).to(x_ptr.dtype.element_ty)
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
                             mask=r_ok[:, None] & n_ok[None, :], other=0.0).to(left_ptr.dtype.element_ty)
            else:  # B_i[n, j] at b_ptr + n * b_stride + b_col + j
                rt = tl.load(right_ptr + right_off + offs_r[:, None] + offs_n[None, :] * right_stride,
                             mask=r_ok[:, None] & n_ok[None, :], other=0.0).to(left_ptr.dtype.element_ty)
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
    dy_ptr, b_ptr, ds_ptr, tiles_ptr, ai_ptr, af_ptr, N, b_stride, proj_col, subs, n_per_split, split_stride,
    AI_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dS_i[tile rows, rank block] = scale * dY_i[tile rows] B_i (projection i's columns of dS).

    ``PARTIAL``: program ``(.., .., sp)`` sums only columns ``[sp * n_per_split, +n_per_split)``
    of ``dY_i`` and stores its fp32 partial at ``ds + sp * split_stride`` (zeros where its share
    is empty), for ``_split_sum_kernel``: a microbatch of few row tiles then still fills the GPU
    instead of a few programs walking all of ``N``."""
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
    if PARTIAL:
        n_start = tl.program_id(2) * n_per_split
        n_end = tl.minimum(n_start + n_per_split, N)
        ds_ptr += tl.program_id(2).to(tl.int64) * split_stride
    else:
        n_start = 0
        n_end = N
    n_stop = tl.where((rb * BLOCK_R < rank) & (row_start + sub * BLOCK_M < row_end), n_end, n_start)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for n0 in range(n_start, n_stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_end
        dyt = tl.load(dy_ptr + offs_m[:, None] * N + offs_n[None, :],
                      mask=row_ok[:, None] & n_ok[None, :], other=0.0)
        bt = tl.load(b_ptr + offs_n[:, None] * b_stride + b_col + offs_r[None, :],
                     mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(dy_ptr.dtype.element_ty)
        acc = tl.dot(dyt, bt, acc, input_precision=DOT_PRECISION)
    ds_ptrs = ds_ptr + s_off + (offs_m - row_start)[:, None] * width + s_col + offs_r[None, :]
    tl.store(ds_ptrs, (acc * scale).to(ds_ptr.dtype.element_ty),
             mask=row_ok[:, None] & r_ok[None, :])


@triton.jit(do_not_specialize=["numel"])
def _split_sum_kernel(part_ptr, out_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum over sp of part[sp, i] (fp32, in split order), cast to ``out``'s dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for sp in tl.static_range(SPLIT):  # 64-bit offsets: split x numel may pass 2^31 (many adapters' dA)
        acc += tl.load(part_ptr + sp * numel.to(tl.int64) + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _factor_row(table_ptr, adapter_tile_ptr_ptr, BLOCK: tl.constexpr):
    """One program's share of a factor table row (``fused_lora_launch.GroupFactors``: launch-layout
    offset, rows, cols, launch-layout row stride, adapter, tensor row stride, tensor address):
    element offsets, their row and column, the mask (all off where the factor's adapter has no row
    tile in the microbatch, read on the device: a captured step replays any mix of adapters)."""
    row = table_ptr + tl.program_id(1) * 7
    numel = (tl.load(row + 1) * tl.load(row + 2)).to(tl.int32)  # one factor: < 2^31 elements
    cols = tl.load(row + 2).to(tl.int32)
    adapter = tl.load(row + 4)
    tiles = tl.load(adapter_tile_ptr_ptr + adapter + 1) - tl.load(adapter_tile_ptr_ptr + adapter)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = (offs < numel) & (tiles > 0)
    r = offs // cols
    c = offs % cols
    return row, r, c, mask, (tiles > 0) & (tl.program_id(0) * BLOCK < numel)


@triton.jit
def _gather_factors_kernel(out_ptr, table_ptr, adapter_tile_ptr_ptr, factor_like_ptr, BLOCK: tl.constexpr):
    """Every factor copied (cast to ``out``'s dtype) into its slice of ``out``, the launch layout of
    A_all and each B_cat; an adapter without rows is skipped (no kernel reads its slice)."""
    row, r, c, mask, live = _factor_row(table_ptr, adapter_tile_ptr_ptr, BLOCK)
    if live:
        src = tl.load(row + 6).to(factor_like_ptr.dtype) + r * tl.load(row + 5) + c
        v = tl.load(src, mask=mask, other=0.0)
        tl.store(out_ptr + tl.load(row) + r * tl.load(row + 3) + c, v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["numel"])
def _accumulate_grads_kernel(part_ptr, table_ptr, adapter_tile_ptr_ptr, grad_like_ptr, numel,
                             SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """Every factor's ``.grad += `` the sum over sp of its slice of ``part[sp]`` (fp32, in split
    order; ``part [SPLIT, numel]`` in the launch layout), one program per ``BLOCK`` elements of
    one factor (``program_id(1)``: its table row, with the ``.grad`` address). A factor whose
    adapter has no row in the microbatch has a zero gradient: its programs return."""
    row, r, c, mask, live = _factor_row(table_ptr, adapter_tile_ptr_ptr, BLOCK)
    if live:
        src = tl.load(row) + r * tl.load(row + 3) + c
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for sp in tl.static_range(SPLIT):
            acc += tl.load(part_ptr + sp * numel.to(tl.int64) + src, mask=mask, other=0.0)
        grad = tl.load(row + 6).to(grad_like_ptr.dtype) + r * tl.load(row + 5) + c
        old = tl.load(grad, mask=mask, other=0.0)
        tl.store(grad, (old.to(tl.float32) + acc).to(grad_like_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lora_db_kernel(
    dy_ptr, s_ptr, part_ptr, tiles_ptr, adapter_tiles_ptr, adapter_tile_ptr_ptr, ai_ptr, af_ptr,
    N, b_cols, part_stride, proj_col, num_rblocks, split,
    AI_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr, SKIP_EMPTY: tl.constexpr,
):
    """part[sp] (``part_stride`` apart) as [N, b_cols]: scale * dY_i^T S_i over share ``sp`` of an
    adapter's row tiles; ``SKIP_EMPTY``: nothing written for an adapter without rows (its reader,
    ``_accumulate_grads_kernel``, skips it too)."""
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
    live = (j1 > j0) | (not SKIP_EMPTY)
    tl.store(p_ptrs, acc * scale, mask=n_ok[:, None] & r_ok[None, :] & live)


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
                             mask=r_ok[:, None], other=0.0).to(ds_ptr.dtype.element_ty)
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
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr, SKIP_EMPTY: tl.constexpr,
):
    """part[sp] (``part_stride`` apart) as [a_rows, K]: dS_a^T (X * mask / (1 - p)) over share
    ``sp`` of an adapter's tiles; ``SKIP_EMPTY`` as in ``_lora_db_kernel``."""
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
    live = (j1 > j0) | (not SKIP_EMPTY)
    tl.store(p_ptrs, acc, mask=r_ok[:, None] & k_ok[None, :] & live)
