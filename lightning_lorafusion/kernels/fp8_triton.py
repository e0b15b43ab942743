"""Triton kernels of the FP8 base: per-row e4m3 quantization and the weight transpose for dX.

``quantize_rows`` must give the same bits as ``fp8_linear.quantize_rows_reference`` (power-of-
two scales from integer work on the fp32 bits of the row maximum, exact scaling, round to
nearest even); the GPU test checks it bit for bit.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import triton
import triton.language as tl

from .fp8_format import FP8_DTYPE

MAX_INPUTS = 3  # quantize_rows reads up to this many [M, N_i] inputs per launch
TRANSPOSE_BLOCK = 64
# A row is read twice (its maximum, then the stores); the second read should hit L2, so the rows
# in flight at once (SMs x programs per SM) must fit in a fraction of it. One program per row:
# wider rows get more warps per program, hence fewer programs per SM (at most 64 warps each).
L2_ROW_BUDGET = 24 * 2**20  # bytes of rows in flight, about half of H100/H200 L2 (50 / 60 MB)
ROW_ELEMENTS_PER_THREAD = 8  # one 16-byte load of bf16 per thread per step


@triton.jit
def _row_block(x_ptr, c_ptr, n, row, n0, HAS_COL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Columns n0 .. n0 + BLOCK_N - 1 of ``row`` in fp32 (times the column scales when given),
    their offsets and mask."""
    offs = n0 + tl.arange(0, BLOCK_N)
    ok = offs < n
    v = tl.load(x_ptr + row * n + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_COL:
        v = v * tl.load(c_ptr + offs, mask=ok, other=0.0)
    return v, offs, ok


@triton.jit
def _row_amax(x_ptr, c_ptr, n, row, amax, HAS_COL: tl.constexpr, BLOCK_N: tl.constexpr):
    for n0 in range(0, n, BLOCK_N):
        v, offs, ok = _row_block(x_ptr, c_ptr, n, row, n0, HAS_COL, BLOCK_N)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=0))
    return amax


@triton.jit
def _row_store(x_ptr, c_ptr, n, row, inv, q_row_ptr, HAS_COL: tl.constexpr, BLOCK_N: tl.constexpr):
    for n0 in range(0, n, BLOCK_N):
        v, offs, ok = _row_block(x_ptr, c_ptr, n, row, n0, HAS_COL, BLOCK_N)
        tl.store(q_row_ptr + offs, (v * inv).to(q_row_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _pow2_scale(amax):
    """``fp8_linear.pow2_scales`` of an fp32 row maximum, and its inverse (both exact powers of
    two): amax = (1 + mant / 2^23) 2^(e - 127), 448 = 1.75 * 2^8."""
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    p = e - 135 + (mant > 0x600000).to(tl.int32)
    p = tl.maximum(p, -126)
    p = tl.where(amax > 0, p, 0)
    scale = ((p + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - p) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def _quantize_rows_kernel(
    x0_ptr, c0_ptr, n0, x1_ptr, c1_ptr, n1, x2_ptr, c2_ptr, n2, q_ptr, s_ptr, nq,
    NUM_IN: tl.constexpr, HAS_COL: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Row ``row`` of ``[x0*c0 | x1*c1 | x2*c2]`` -> e4m3 row of q [M, nq] and its scale s[row]."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.full((), 0.0, tl.float32)
    amax = _row_amax(x0_ptr, c0_ptr, n0, row, amax, HAS_COL, BLOCK_N)
    if NUM_IN > 1:
        amax = _row_amax(x1_ptr, c1_ptr, n1, row, amax, HAS_COL, BLOCK_N)
    if NUM_IN > 2:
        amax = _row_amax(x2_ptr, c2_ptr, n2, row, amax, HAS_COL, BLOCK_N)
    scale, inv = _pow2_scale(amax)
    q_row = q_ptr + row * nq
    _row_store(x0_ptr, c0_ptr, n0, row, inv, q_row, HAS_COL, BLOCK_N)
    if NUM_IN > 1:
        _row_store(x1_ptr, c1_ptr, n1, row, inv, q_row + n0, HAS_COL, BLOCK_N)
    if NUM_IN > 2:
        _row_store(x2_ptr, c2_ptr, n2, row, inv, q_row + n0 + n1, HAS_COL, BLOCK_N)
    tl.store(s_ptr + row, scale)


@triton.jit
def _transpose_tile(src_ptr, dst_ptr, n, k, dst_stride, col_off, pid_n, pid_k, BLOCK: tl.constexpr):
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs_k = pid_k * BLOCK + tl.arange(0, BLOCK)
    ok = (offs_n < n)[:, None] & (offs_k < k)[None, :]
    tile = tl.load(src_ptr + offs_n.to(tl.int64)[:, None] * k + offs_k[None, :], mask=ok)
    dst = dst_ptr + offs_k.to(tl.int64)[None, :] * dst_stride + col_off + offs_n[:, None]
    tl.store(dst, tile, mask=ok)


@triton.jit
def _transpose_kernel(src0_ptr, n0, src1_ptr, n1, src2_ptr, n2, dst_ptr, k, dst_stride,
                      NUM_IN: tl.constexpr, BLOCK: tl.constexpr):
    """dst[kk, off_i + nn] = src_i[nn, kk] (bytes); axis 0 walks src_0's row blocks, then
    src_1's, then src_2's."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    b0 = tl.cdiv(n0, BLOCK)
    b1 = tl.cdiv(n1, BLOCK)
    if pid < b0:
        _transpose_tile(src0_ptr, dst_ptr, n0, k, dst_stride, 0, pid, pid_k, BLOCK)
    elif NUM_IN > 1 and pid < b0 + b1:
        _transpose_tile(src1_ptr, dst_ptr, n1, k, dst_stride, n0, pid - b0, pid_k, BLOCK)
    elif NUM_IN > 2:
        _transpose_tile(src2_ptr, dst_ptr, n2, k, dst_stride, n0 + n1, pid - b0 - b1, pid_k, BLOCK)


def row_launch(width: int, elem_bytes: int, sms: int = 132) -> tuple[int, int]:
    """(columns per step, warps) of the one-program-per-row kernel for rows of ``width``
    elements: enough warps that ``sms * 64 / warps`` rows fit ``L2_ROW_BUDGET`` (4 to 32)."""
    warps = 4
    while warps < 32 and sms * (64 // warps) * width * elem_bytes > L2_ROW_BUDGET:
        warps *= 2
    return warps * 32 * ROW_ELEMENTS_PER_THREAD, warps


def quantize_rows(xs: Sequence[torch.Tensor], col_scales: Sequence[torch.Tensor] | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[x_0 * c_0 | x_1 * c_1 | ...]`` (each ``[M, N_i]`` contiguous, ``c_i [N_i]`` fp32 or
    none) -> (e4m3 ``[M, sum N_i]``, fp32 scales ``[M, 1]``), one scale per row over all inputs."""
    if len(xs) > MAX_INPUTS:  # one row scale over all inputs: concatenate first (rare)
        xs = [torch.cat([x.float() * (c if c is not None else 1.0)
                         for x, c in zip(xs, col_scales or [None] * len(xs))], dim=1)]
        col_scales = None
    m = xs[0].shape[0]
    widths = [x.shape[1] for x in xs]
    q = torch.empty(m, sum(widths), dtype=FP8_DTYPE, device=xs[0].device)
    s = torch.empty(m, 1, dtype=torch.float32, device=xs[0].device)
    if m == 0:
        return q, s
    cols = list(col_scales) if col_scales is not None else [None] * len(xs)
    args = []
    for j in range(MAX_INPUTS):
        if j < len(xs):
            c = cols[j] if cols[j] is not None else xs[j]
            args += [xs[j], c, widths[j]]
        else:
            args += [xs[0], xs[0], 0]
    block, warps = row_launch(q.shape[1], xs[0].element_size(), _sm_count(xs[0].device))
    _quantize_rows_kernel[(m,)](
        *args, q, s, q.shape[1], NUM_IN=len(xs), HAS_COL=col_scales is not None, BLOCK_N=block,
        num_warps=warps,
    )
    return q, s


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    # a device's multiprocessor count never changes: ask CUDA once (132 for the interpreter)
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def transpose_concat(ws: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[W_0; W_1; ...]^T``: each e4m3 ``W_i [N_i, K]`` -> one ``[K, sum N_i]`` (K-major for
    the input-gradient product), up to ``MAX_INPUTS`` weights per launch."""
    k = ws[0].shape[1]
    total = sum(w.shape[0] for w in ws)
    out = torch.empty(k, total, dtype=torch.uint8, device=ws[0].device)
    for start in range(0, len(ws), MAX_INPUTS):
        chunk = [w.view(torch.uint8) for w in ws[start:start + MAX_INPUTS]]
        base = out[:, sum(w.shape[0] for w in ws[:start]):]  # column offset of this chunk
        args = []
        for j in range(MAX_INPUTS):
            args += [chunk[j], chunk[j].shape[0]] if j < len(chunk) else [chunk[0], 0]
        grid = (sum(triton.cdiv(w.shape[0], TRANSPOSE_BLOCK) for w in chunk), triton.cdiv(k, TRANSPOSE_BLOCK))
        _transpose_kernel[grid](*args, base, k, total, NUM_IN=len(chunk), BLOCK=TRANSPOSE_BLOCK, num_warps=4)
    return out.view(FP8_DTYPE)


# ------------------------------------------------------------ SwiGLU with the FP8 operands fused
# The MLP's row quantizations sit next to SwiGLU: the down projection quantizes h = silu(g) u,
# the gate/up input gradient quantizes [dg * sw_g | du * sw_u]. Done by the SwiGLU kernels
# themselves, the quantizer's first read of h (forward) and of dg, du (backward) from memory
# goes: one program per row computes and stores the row, tracking its maximum, then reads the
# row it just stored back (from L2, as the row quantizer's second pass does) to store the e4m3
# row. Bits as ``quantize_rows`` of the kernel's own outputs. (Recomputing the row from the
# inputs instead of reading it back, the first version, was slower than the unfused pair.)


@triton.jit
def _swiglu_quant_fwd_kernel(g_ptr, u_ptr, h_ptr, q_ptr, s_ptr, n, BLOCK_N: tl.constexpr):
    """Row ``row``: h = silu(g) u (fp32, rounded once to h's dtype), its e4m3 row and scale."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.full((), 0.0, tl.float32)
    for n0 in range(0, n, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        ok = offs < n
        g = tl.load(g_ptr + row * n + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * n + offs, mask=ok, other=0.0).to(tl.float32)
        h = (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * n + offs, h, mask=ok)
        amax = tl.maximum(amax, tl.max(tl.abs(h.to(tl.float32)), axis=0))
    scale, inv = _pow2_scale(amax)
    tl.debug_barrier()  # the row's stores are visible to the whole program
    for n0 in range(0, n, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        ok = offs < n
        h = tl.load(h_ptr + row * n + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * n + offs, (h * inv).to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row, scale)


@triton.jit
def _swiglu_quant_bwd_kernel(g_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, cg_ptr, cu_ptr, q_ptr, s_ptr, n,
                             BLOCK_N: tl.constexpr):
    """Row ``row``: dg, du (stored in their dtype) and the e4m3 row of [dg * cg | du * cu]."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.full((), 0.0, tl.float32)
    for n0 in range(0, n, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        ok = offs < n
        g = tl.load(g_ptr + row * n + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * n + offs, mask=ok, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + row * n + offs, mask=ok, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        du = (dh * g * sig).to(du_ptr.dtype.element_ty)
        dg = (dh * u * sig * (1.0 + g * (1.0 - sig))).to(dg_ptr.dtype.element_ty)
        tl.store(dg_ptr + row * n + offs, dg, mask=ok)
        tl.store(du_ptr + row * n + offs, du, mask=ok)
        cg = tl.load(cg_ptr + offs, mask=ok, other=0.0)
        cu = tl.load(cu_ptr + offs, mask=ok, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(dg.to(tl.float32) * cg), axis=0))
        amax = tl.maximum(amax, tl.max(tl.abs(du.to(tl.float32) * cu), axis=0))
    scale, inv = _pow2_scale(amax)
    tl.debug_barrier()  # the row's stores are visible to the whole program
    q_row = q_ptr + row * 2 * n
    for n0 in range(0, n, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        ok = offs < n
        dg = tl.load(dg_ptr + row * n + offs, mask=ok, other=0.0).to(tl.float32)
        du = tl.load(du_ptr + row * n + offs, mask=ok, other=0.0).to(tl.float32)
        cg = tl.load(cg_ptr + offs, mask=ok, other=0.0)
        cu = tl.load(cu_ptr + offs, mask=ok, other=0.0)
        tl.store(q_row + offs, (dg * cg * inv).to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(q_row + n + offs, (du * cu * inv).to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row, scale)


# One program per row, SWIGLU_BLOCK_N columns a step at 8 elements per thread: the H200 sweep's
# winner at the 8B MLP (N = 14336; docs/kernels.md "FP8 base"): 16 warps x 4096 columns beat
# the row quantizer's launch (32 warps, 2048 columns: slower than the unfused pair backward).
SWIGLU_BLOCK_N = 4096


def _swiglu_launch(n: int, warps: int | None, block_n: int | None) -> tuple[int, int]:
    """(columns per step, warps) for rows of ``n``: the given ones, else ``SWIGLU_BLOCK_N``
    columns (fewer for narrow rows) and one warp per 256 of them (the launch
    swept on an H200: docs/kernels.md)."""
    block = block_n or min(SWIGLU_BLOCK_N, max(32, triton.next_power_of_2(n)))
    return block, warps or max(1, min(16, block // 256))


def swiglu_quantize(g: torch.Tensor, u: torch.Tensor, q_dtype: torch.dtype = FP8_DTYPE, *,
                    num_warps: int | None = None, block_n: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``g, u [M, N]`` -> (h = silu(g) u in g's dtype, its rows quantized ``[M, N]`` (e4m3), fp32
    row scales ``[M, 1]``). ``q_dtype`` float32 keeps the scaled values unrounded (the Triton
    interpreter's e4m3 conversion is wrong at binade edges: CPU tests round them in torch)."""
    g, u = g.contiguous(), u.contiguous()
    m, n = g.shape
    h = torch.empty_like(g)
    q = torch.empty(m, n, dtype=q_dtype, device=g.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=g.device)
    if m:
        block, warps = _swiglu_launch(n, num_warps, block_n)
        _swiglu_quant_fwd_kernel[(m,)](g, u, h, q, s, n, BLOCK_N=block, num_warps=warps)
    return h, q, s


def swiglu_grads_quantize(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, scale_g: torch.Tensor,
                          scale_u: torch.Tensor, q_dtype: torch.dtype = FP8_DTYPE, *,
                          num_warps: int | None = None, block_n: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of h = silu(g) u: (dg, du in g's dtype, ``[dg * scale_g | du * scale_u]`` rows
    quantized ``[M, 2N]``, fp32 row scales ``[M, 1]``): ``quantize_rows([dg, du], [scale_g,
    scale_u])`` without its first read of dg, du. ``q_dtype`` as in ``swiglu_quantize``."""
    g, u, dh = g.contiguous(), u.contiguous(), dh.contiguous()
    m, n = g.shape
    dg, du = torch.empty_like(g), torch.empty_like(u)
    q = torch.empty(m, 2 * n, dtype=q_dtype, device=g.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=g.device)
    if m:
        block, warps = _swiglu_launch(n, num_warps, block_n)
        _swiglu_quant_bwd_kernel[(m,)](g, u, dh, dg, du, scale_g.float().contiguous(), scale_u.float().contiguous(),
                                       q, s, n, BLOCK_N=block, num_warps=warps)
    return dg, du, q, s


# ------------------------------------------------------------------ weight-only products (few rows)


@triton.jit
def _weight_only_kernel(x_ptr, w_ptr, s_ptr, y_ptr, m, n, k, k_per_split, stride_xm, stride_ym, stride_ys,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT: tl.constexpr):
    """``y[rows, cols] = x[rows, :] @ (w[cols, :] * s[cols])^T``: e4m3 ``w`` converted to x's
    dtype in registers (the bytes read are the FP8 ones), fp32 accumulation, the channel scale
    applied once at the end. ``n`` and ``k_per_split`` are multiples of BLOCK_N and BLOCK_K.
    With SPLIT > 1 each program sums one K range into its own fp32 slice ``y[split]``."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = (rows < m)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(0, k_per_split, BLOCK_K):
        kk = k_start + k0 + offs_k
        x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=row_ok, other=0.0)
        w = tl.load(w_ptr + cols[None, :] * k + kk[:, None])  # [BLOCK_K, BLOCK_N] e4m3
        acc += tl.dot(x, w.to(x.dtype))
    scale = tl.load(s_ptr + cols)
    y = acc * scale[None, :]
    out = y_ptr + pid_k * stride_ys + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def _largest_divisor(n: int, options: Sequence[int]) -> int:
    return next(b for b in options if n % b == 0)


def weight_only_config(m: int, n: int, k: int) -> tuple[int, int, int]:
    """``(block_n, block_k, split_k)`` for ``weight_only_linear`` at ``m`` rows, ``w [n, k]``: the
    winners of the H100 tile sweep (docs/BENCHMARKS.md, "FP8 base in the generation engine"; 18
    configurations at 16 and 64 rows over the 8B projections, four weight copies per timing):
    32 columns a program at <= 16 rows or n <= 1024, else 64; K steps of 128; K split over 4
    programs unless the weight is wide (n >= 2k: enough column blocks already). Shapes the rule
    cannot serve fall back to the largest dividing tiles and no split."""
    bn = 32 if m <= 16 or n <= 1024 else 64
    split = 1 if n >= 2 * k else 4
    if k % (128 * split):
        split = 1
    bn = bn if n % bn == 0 else _largest_divisor(n, (64, 32, 16))
    bk = 128 if (k // split) % 128 == 0 else _largest_divisor(k // split, (64, 32, 16))
    return bn, bk, split


def weight_only_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, *, block_n: int | None = None,
                       block_k: int | None = None, split_k: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """``x [M, K] @ (w * scale[:, None])^T -> [M, N]`` in ``x.dtype`` for few rows (decode):
    the e4m3 weight ``w [N, K]`` (N, K multiples of 16) is read once, converted in registers,
    and multiplied with the unquantized activations (no row quantization of ``x``).
    ``block_n`` / ``block_k``: tile sizes; ``split_k`` > 1 splits K over that many programs per
    column block (fp32 partial sums, added after); all three left None: ``weight_only_config``
    (the H100 sweep's winners). More than 64 rows make several row blocks, each reading ``w``
    again: ``torch._scaled_mm`` serves that case."""
    m, k = x.shape
    n = w.shape[0]
    if block_n is None and block_k is None and split_k is None:
        block_n, block_k, split_k = weight_only_config(m, n, k)
    split_k = 1 if split_k is None else split_k
    if w.shape[1] != k or scale.shape != (n,):
        raise ValueError(f"weight_only_linear: x {tuple(x.shape)}, w {tuple(w.shape)}, scale {tuple(scale.shape)}")
    if n % 16 or k % 16:
        raise ValueError(f"weight_only_linear needs N and K divisible by 16; w is {tuple(w.shape)}")
    if split_k < 1 or k % (16 * split_k):
        raise ValueError(f"split_k={split_k} must divide K={k} into multiples of 16")
    x = x if x.stride(1) == 1 else x.contiguous()
    k_split = k // split_k
    bn = block_n or _largest_divisor(n, (64, 32, 16))  # (a tile given without the others)
    bk = block_k or _largest_divisor(k_split, (256, 128, 64, 32, 16))
    bm = max(16, min(64, triton.next_power_of_2(max(m, 1))))
    if m == 0:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (n // bn, triton.cdiv(m, bm), split_k)
    if split_k == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        _weight_only_kernel[grid](x, w.view(FP8_DTYPE), scale.float(), y, m, n, k, k_split, x.stride(0),
                                  y.stride(0), 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=1, num_warps=num_warps)
        return y
    parts = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    _weight_only_kernel[grid](x, w.view(FP8_DTYPE), scale.float(), parts, m, n, k, k_split, x.stride(0),
                              parts.stride(1), parts.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split_k,
                              num_warps=num_warps)
    return parts.sum(0).to(x.dtype)
