"""The frozen product with the prefill rows' LoRA expand in its epilogue: ``x W^T`` plus, for each
row, ``scale_a * S[row, :r_a] B^T_a`` of its adapter a, written once.

``y [T, N] = x [T, K] W^T`` where W [N, K] may hold a group's projections one after another
(q/k/v, gate/up: members at column starts ``0 < n1 < n2``, each a multiple of the column
block). The LoRA factors are where ``SegmentLora`` says (pool offsets per projection and
adapter, runtime ranks); S is the shrink's ``[split, G, T, width]`` fp32 output
(``lora_tiles``). Which adapter a row has comes from two row tables, refilled per step at
fixed length (a captured graph's launch stays valid): ``row_adapter [T]`` int32 (-1 = none)
and ``run_end [T]`` int32, the row after the last of the run of rows sharing it. A program's
epilogue walks its row block run by run: each run is one dot of its rows' S (masked to the
run) with its adapter's B^T block, added into the fp32 accumulator of the base product.
The rank is a runtime loop bound (chunks of ``R``): one compiled variant per (config, group
size) serves every rank mix.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from .segment_tables import SegmentLora

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) on CUDA; the interpreter's small one
LINEAR_CONFIG_CUDA = (128, 256, 64, 8, 8, 3)
LINEAR_CONFIG_INTERPRETER = (16, 32, 16, 2, 4, 1)
LINEAR_RANK_CHUNK_CUDA, LINEAR_RANK_CHUNK_INTERPRETER = 32, 16

_UNSPECIALISED = ("row_ad_ptr", "run_end_ptr", "b_off_ptr", "rank_ptr", "scale_ptr", "b_g_stride", "r_g_stride",
                  "s_split_stride", "s_width", "M")


@triton.jit(do_not_specialize=_UNSPECIALISED)
def _linear_lora_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, x_stride, w_stride, out_stride, n1, n2,
    s_ptr, s_g_stride, s_split_stride, s_width, pool_ptr, row_ad_ptr, run_end_ptr, b_off_ptr, b_g_stride, rank_ptr,
    r_g_stride, scale_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, R: tl.constexpr,
    SPLIT: tl.constexpr, HAS_LORA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * x_stride + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * w_stride + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_LORA:
        col0 = pid_n * BLOCK_N
        g = (col0 >= n1).to(tl.int32) + (col0 >= n2).to(tl.int32)  # the member holding this column block
        lo = tl.where(g == 0, 0, tl.where(g == 1, n1, n2))
        n_g = tl.where(g == 0, n1, tl.where(g == 1, n2, N)) - lo
        offs_c = col0 - lo + tl.arange(0, BLOCK_N)
        c_ok = offs_c < n_g
        row = pid_m * BLOCK_M
        block_end = tl.minimum(row + BLOCK_M, M)
        while row < block_end:
            ad = tl.load(row_ad_ptr + row)
            stop = tl.minimum(tl.load(run_end_ptr + row), block_end)
            if ad >= 0:
                rank = tl.minimum(tl.load(rank_ptr + g * r_g_stride + ad), s_width)
                b_off = tl.load(b_off_ptr + g * b_g_stride + ad)
                scale = tl.load(scale_ptr + ad)
                run_ok = (offs_m >= row) & (offs_m < stop)
                for r0 in range(0, rank, R):
                    offs_r = r0 + tl.arange(0, R)
                    r_ok = offs_r < rank
                    s_ptrs = s_ptr + g * s_g_stride + offs_m[:, None].to(tl.int64) * s_width + offs_r[None, :]
                    s_ok = run_ok[:, None] & r_ok[None, :]
                    s = tl.load(s_ptrs, mask=s_ok, other=0.0)
                    for sp in range(1, SPLIT):
                        s += tl.load(s_ptrs + sp * s_split_stride, mask=s_ok, other=0.0)
                    bt = tl.load(pool_ptr + b_off + offs_r[:, None] * n_g + offs_c[None, :],
                                 mask=r_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
                    acc += tl.dot(s * scale, bt, input_precision=DOT_PRECISION)
            row = tl.maximum(stop, row + 1)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * out_stride + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def row_tables(segments: Sequence[tuple[int, int, int]], rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``(row_adapter, run_end)`` int32 ``[rows]`` of segments ``(start, end, adapter)`` (sorted,
    disjoint): each row's adapter (-1 outside every segment) and the row after its run."""
    row_ad = np.full(rows, -1, dtype=np.int32)
    run_end = np.empty(rows, dtype=np.int32)
    pos = 0
    for start, end, adapter in sorted(segments):
        if start > pos:
            run_end[pos:start] = start
        row_ad[start:end] = adapter
        run_end[start:end] = end
        pos = end
    run_end[pos:] = rows
    return row_ad, run_end


def linear_config(device: torch.device) -> tuple[int, ...]:
    return LINEAR_CONFIG_CUDA if device.type == "cuda" else LINEAR_CONFIG_INTERPRETER


def linear_lora(x: torch.Tensor, w: torch.Tensor, out_sizes: Sequence[int], lora: SegmentLora | None,
                s: torch.Tensor | None, row_ad: torch.Tensor | None, run_end: torch.Tensor | None, *,
                config: tuple[int, ...] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T`` (``W [sum(out_sizes), K]``, the group's members in order) plus each row's LoRA of
    each member from the shrink's ``s`` and the row tables, one write of ``[T, N]`` (into ``out``
    when given). ``lora`` None: the plain product. Raises ValueError when a member's width is not
    a multiple of the column block (the caller then runs the product and the expand apart)."""
    cfg = linear_config(x.device) if config is None else config
    block_m, block_n, block_k, group_m, warps, stages = cfg
    t, k = x.shape
    n = w.shape[0]
    if sum(out_sizes) != n or len(out_sizes) > 3:
        raise ValueError(f"out_sizes {list(out_sizes)} must be 1-3 widths summing to W's {n} rows")
    if any(size % block_n for size in out_sizes[:-1]):
        raise ValueError(f"member widths {list(out_sizes)} are not multiples of the column block {block_n}")
    bounds = np.cumsum(out_sizes)
    n1 = int(bounds[0]) if len(out_sizes) > 1 else n
    n2 = int(bounds[1]) if len(out_sizes) > 2 else n
    y = torch.empty(t, n, dtype=x.dtype, device=x.device) if out is None else out
    has = lora is not None
    dummy = x if not has else None
    precision = "tf32" if x.is_cuda and x.dtype != torch.float32 else "ieee"
    chunk = LINEAR_RANK_CHUNK_CUDA if x.is_cuda else LINEAR_RANK_CHUNK_INTERPRETER
    grid = (triton.cdiv(t, block_m) * triton.cdiv(n, block_n),)
    _linear_lora_kernel[grid](
        x, w, y, t, n, k, x.stride(0), w.stride(0), y.stride(0), n1, n2,
        s if has else dummy, s.stride(1) if has else 0, s.stride(0) if has else 0, lora.block_r if has else 0,
        lora.pool if has else dummy, row_ad if has else dummy, run_end if has else dummy,
        lora.b_offsets if has else dummy, lora.b_offsets.stride(0) if has else 0,
        lora.ranks if has else dummy, lora.ranks.stride(0) if has else 0, lora.scales if has else dummy,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, R=chunk,
        SPLIT=s.shape[0] if has else 1, HAS_LORA=has, DOT_PRECISION=precision, num_warps=warps, num_stages=stages)
    return y
