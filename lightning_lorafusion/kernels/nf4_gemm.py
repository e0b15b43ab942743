"""The NF4 GEMM: frozen products that dequantize the 4-bit weight inside their operand tiles
(``nf4.Nf4Weight``; its torch reference ``nf4_matmul_reference`` is the spec).

Forward ``Y [M, N] = X [M, K] @ dequant(W)^T (+ b)`` and input gradient ``dX [M, K] = dY [M, N]
@ dequant(W)`` (optionally added to a ``dX`` already holding other projections' terms). Each
program loads its ``W`` tile as packed bytes plus the per-block absmax (undoing double
quantization in the tile: ``dyn[q] * nested_absmax[j // 256] + offset``), expands it to fp32
exactly as ``nf4.dequantize_nf4_reference`` does (code times absmax, rounded once to the
activations' dtype), and feeds it to ``tl.dot`` with fp32 accumulation. No dequantized copy of
``W`` is ever written to memory: the weight traffic is the 4-bit data, 0.5 byte per value.

Element ``(n, k)`` of ``W`` is flat value ``i = n * K + k``: byte ``i // 2`` (high nibble for even
``k``), absmax block ``i // blocksize``. A tile is read a byte at a time: the high nibbles are
the even ``k``, the low ones the odd ``k``, so the kernels multiply them against the even and
odd columns of ``X`` (or produce the even and odd columns of ``dX``) instead of interleaving
the weight. Floating-point contraction is off so the nested absmax's multiply-add rounds like
the reference's two ops.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .nf4_triton import nf4_byte_pair

# ``Nf4Weight`` below is ``nf4.Nf4Weight``, named only in annotations: nf4.py imports this module
# (lazily, when the fused GEMM is asked for), so this one does not import it back.


@triton.jit
def _nf4_pairs(data_ptr, absmax_ptr, code_ptr, nested_ptr, dyn_ptr, offset_ptr, n_idx, b_idx, half_k, mask,
               BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr):
    """fp32 ``(W[n, 2b], W[n, 2b + 1])`` for byte column ``b_idx`` of rows ``n_idx`` (broadcast
    index tensors; masked entries are 0)."""
    return nf4_byte_pair(data_ptr, absmax_ptr, code_ptr, nested_ptr, dyn_ptr, offset_ptr,
                         n_idx.to(tl.int64) * half_k + b_idx, mask, BLOCKSIZE, NESTED, NESTED_BLOCKSIZE)


@triton.jit
def _nf4_fwd_kernel(x_ptr, data_ptr, absmax_ptr, code_ptr, nested_ptr, dyn_ptr, offset_ptr, bias_ptr, y_ptr,
                    M, N, K, stride_xm, stride_xk, stride_ym,
                    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``Y = X @ W^T (+ b)``: one ``[BLOCK_M, BLOCK_N]`` tile. Each step reads ``BLOCK_K / 2``
    bytes per row of ``W`` as two ``[BLOCK_K / 2, BLOCK_N]`` operands (the high nibbles: even
    ``k``; the low: odd ``k``) against ``X``'s even and odd columns: two dots, no shuffle."""
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * grid_n)  # grouped order: programs sharing W tiles run together
    first_m = group * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % size_m
    pid_n = (pid % (GROUP_M * grid_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, BLOCK_K // 2)
    half_k = K // 2
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b0 in range(0, half_k, BLOCK_K // 2):
        bb = b0 + rb
        x_mask = (rm[:, None] < M) & (bb[None, :] < half_k)
        x_even = tl.load(x_rows + (2 * bb[None, :]) * stride_xk, mask=x_mask, other=0.0)
        x_odd = tl.load(x_rows + (2 * bb[None, :] + 1) * stride_xk, mask=x_mask, other=0.0)
        hi, lo = _nf4_pairs(data_ptr, absmax_ptr, code_ptr, nested_ptr, dyn_ptr, offset_ptr, rn[None, :],
                            bb[:, None], half_k, (rn[None, :] < N) & (bb[:, None] < half_k),
                            BLOCKSIZE, NESTED, NESTED_BLOCKSIZE)
        acc = tl.dot(x_even, hi.to(x_ptr.dtype.element_ty), acc, input_precision=DOT_PRECISION)
        acc = tl.dot(x_odd, lo.to(x_ptr.dtype.element_ty), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _nf4_dx_kernel(dy_ptr, data_ptr, absmax_ptr, code_ptr, nested_ptr, dyn_ptr, offset_ptr, dx_ptr,
                   M, N, K, stride_dym, stride_dyn, stride_dxm,
                   BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr,
                   ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``dX (+)= dY @ W``: one ``[BLOCK_M, BLOCK_K]`` tile, computed as its even and odd columns
    (``dY`` against the high and the low nibbles of ``BLOCK_K / 2`` byte columns), interleaved
    once at the store."""
    pid = tl.program_id(0)
    grid_m, grid_k = tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_K)
    group = pid // (GROUP_M * grid_k)
    first_m = group * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_k)) % size_m
    pid_k = (pid % (GROUP_M * grid_k)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rb = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    rn = tl.arange(0, BLOCK_N)
    half_k = K // 2
    acc_even = tl.zeros((BLOCK_M, BLOCK_K // 2), dtype=tl.float32)
    acc_odd = tl.zeros((BLOCK_M, BLOCK_K // 2), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        nn = n0 + rn
        dy = tl.load(dy_ptr + rm[:, None].to(tl.int64) * stride_dym + nn[None, :] * stride_dyn,
                     mask=(rm[:, None] < M) & (nn[None, :] < N), other=0.0)
        hi, lo = _nf4_pairs(data_ptr, absmax_ptr, code_ptr, nested_ptr, dyn_ptr, offset_ptr, nn[:, None],
                            rb[None, :], half_k, (nn[:, None] < N) & (rb[None, :] < half_k),
                            BLOCKSIZE, NESTED, NESTED_BLOCKSIZE)
        acc_even = tl.dot(dy, hi.to(dy_ptr.dtype.element_ty), acc_even, input_precision=DOT_PRECISION)
        acc_odd = tl.dot(dy, lo.to(dy_ptr.dtype.element_ty), acc_odd, input_precision=DOT_PRECISION)
    acc = tl.reshape(tl.join(acc_even, acc_odd), (BLOCK_M, BLOCK_K))  # column 2b + t = (b, t)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    out = dx_ptr + rm[:, None].to(tl.int64) * stride_dxm + rk[None, :]
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    if ACCUMULATE:  # the other projections' terms, rounded once more like ``addmm_``
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(dx_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------ launchers


def _block_m(m: int) -> int:
    # decode-sized M: the smallest tile tl.dot takes, so few rows are not padded to 128
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


def _weight_args(w: Nf4Weight) -> tuple:
    if w.nested:
        return (w.data, w.absmax, w.code, w.nested_absmax, w.nested_code, w.offset), w.nested_blocksize
    return (w.data, w.absmax, w.code, w.code, w.code, w.code), 1


def _check(a: torch.Tensor, w: Nf4Weight, inner: int, what: str) -> None:
    if a.dim() != 2 or a.shape[1] != inner:
        raise ValueError(f"nf4 GEMM: {what} must be 2-D [M, {inner}] for an NF4 weight {tuple(w.shape)}; "
                         f"got {tuple(a.shape)}")
    if a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"nf4 GEMM: {what} must be fp32/fp16/bf16; got {a.dtype}")
    if a.device != w.device:
        raise ValueError(f"nf4 GEMM: {what} is on {a.device} but the NF4 weight on {w.device}")
    if not a.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":  # read per call, never at import
        raise ValueError(f"nf4_gemm='fused' runs a Triton kernel: it needs a CUDA device (or TRITON_INTERPRET=1 "
                         f"on CPU); {what} is on {a.device}: use nf4_gemm: buffer")


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # 16-bit operands ignore it


def nf4_linear_fused(x: torch.Tensor, w: Nf4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(w)^T (+ bias) -> [M, N]`` in ``x.dtype``, fp32 accumulation."""
    n, k = w.shape
    _check(x, w, k, "x")
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    args, nested_bs = _weight_args(w)
    bm, bn, bk = _block_m(m), (64 if m <= 64 else 128), (128 if m <= 64 else 64)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _nf4_fwd_kernel[grid](
        x, *args, bias if bias is not None else y, y, m, n, k, x.stride(0), x.stride(1), y.stride(0),
        BLOCKSIZE=w.blocksize, NESTED=w.nested, NESTED_BLOCKSIZE=nested_bs, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=4, num_stages=3, enable_fp_fusion=False)
    return y


def nf4_input_grad_fused(dy: torch.Tensor, w: Nf4Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """``dy [M, N] @ dequant(w) -> [M, K]`` in ``dy.dtype`` (fp32 accumulation); ``out``: a
    contiguous-row ``[M, K]`` tensor to add the product to (``out += dy @ W``, in place)."""
    n, k = w.shape
    _check(dy, w, n, "dy")
    m = dy.shape[0]
    accumulate = out is not None
    if out is None:
        out = torch.empty(m, k, dtype=dy.dtype, device=dy.device)
    elif out.shape != (m, k) or out.stride(1) != 1:
        raise ValueError(f"nf4 GEMM: out must be [{m}, {k}] with unit column stride; got {tuple(out.shape)}")
    if m == 0:
        return out
    args, nested_bs = _weight_args(w)
    bm, bk, bn = _block_m(m), (64 if m <= 64 else 128), 64
    grid = (triton.cdiv(m, bm) * triton.cdiv(k, bk),)
    _nf4_dx_kernel[grid](
        dy, *args, out, m, n, k, dy.stride(0), dy.stride(1), out.stride(0),
        BLOCKSIZE=w.blocksize, NESTED=w.nested, NESTED_BLOCKSIZE=nested_bs, ACCUMULATE=accumulate,
        BLOCK_M=bm, BLOCK_K=bk, BLOCK_N=bn, GROUP_M=8, DOT_PRECISION=_dot_precision(dy.dtype),
        num_warps=4, num_stages=3, enable_fp_fusion=False)
    return out


# ------------------------------------------------------------------------ torch reference


def nf4_matmul_reference(a: torch.Tensor, w: Nf4Weight, *, transpose: bool, bias: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """The spec: ``a @ W^T (+ bias)`` (``transpose``, the forward) or ``a @ W`` (the input
    gradient), ``W`` dequantized to ``a.dtype`` first (each value rounded once), the product in
    fp32 and cast to ``a.dtype``."""
    wd = w.dequantize(a.dtype, backend="torch").float()
    y = a.float() @ (wd.t() if transpose else wd)
    if bias is not None:
        y = y + bias.float()
    return y.to(a.dtype)
