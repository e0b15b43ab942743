"""Decode-time multi-adapter LoRA (S-LoRA's MBGMV): every row its own adapter and rank, one launch.

For row i of ``x [B, K]`` with adapter weights stored anywhere in a flat ``pool``:

    A_i  = pool[a_offsets[i] : a_offsets[i] + r_i * K].view(r_i, K)    (PEFT's lora_A layout)
    Bt_i = pool[b_offsets[i] : b_offsets[i] + r_i * N].view(r_i, N)    (PEFT's lora_B, transposed)
    delta[i] = scales[i] * (x[i] @ A_i^T) @ Bt_i                        (fp32 accumulation)

``ranks[i] == 0`` means no LoRA for the row (delta 0). Inference only: nothing here is
differentiable (the Triton path has no autograd; the reference runs under ``torch.no_grad``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("torch", "triton", "auto")
MAX_RANK_CHUNK = 128  # rank vectors per fp32 accumulation (and per-program scratch floats)


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _lora_gather_kernel(
    x_ptr, pool_ptr, a_off_ptr, b_off_ptr, rank_ptr, scale_ptr, out_ptr, s_ptr,
    K, N, x_stride, out_stride, n_per_split,
    ACCUMULATE: tl.constexpr, CHUNK_R: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[row, split's columns] (+)= scale * (x[row] A^T) Bt for the row's own adapter and rank.

    Program (row, split): phase 1 reduces s = scale * x A^T over K for up to CHUNK_R rank
    vectors (BLOCK_R at a time, so a rank-8 row loads 8 rows of A, not the largest rank's) into
    this program's fp32 scratch; phase 2 sweeps the split's column blocks, acc = s Bt in fp32,
    one read-modify-write of out per block. Splitting N over programs recomputes s per split
    (A re-read from L2) in exchange for more programs in flight at small batch.
    """
    row = tl.program_id(0)
    split = tl.program_id(1)
    rank = tl.load(rank_ptr + row)
    a_off = tl.load(a_off_ptr + row)
    b_off = tl.load(b_off_ptr + row)
    scale = tl.load(scale_ptr + row)
    x_row = x_ptr + row.to(tl.int64) * x_stride
    out_row = out_ptr + row.to(tl.int64) * out_stride
    s_row = s_ptr + (row.to(tl.int64) * tl.num_programs(1) + split) * CHUNK_R
    n_begin = split * n_per_split
    n_end = tl.minimum(N, n_begin + n_per_split)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    # A fresh output is written even for rank-0 rows (zeros): at least one chunk pass then.
    chunks = tl.cdiv(rank, CHUNK_R)
    if not ACCUMULATE:
        chunks = tl.maximum(chunks, 1)
    for c in range(0, chunks):
        c0 = c * CHUNK_R
        r_hi = tl.minimum(rank, c0 + CHUNK_R)
        for r0 in range(c0, r_hi, BLOCK_R):
            r_ok = r0 + offs_r < r_hi
            a_rows = pool_ptr + a_off + (r0 + offs_r)[:, None] * K
            s = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = k0 + offs_k < K
                xk = tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
                s += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
            tl.store(s_row + (r0 - c0) + offs_r, s * scale, mask=r_ok)
        tl.debug_barrier()  # phase 2 reads scratch written by other threads of this program
        for n0 in range(n_begin, n_end, BLOCK_N):
            n_ok = n0 + offs_n < n_end
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for r0 in range(c0, r_hi, BLOCK_R):
                r_ok = r0 + offs_r < r_hi
                s = tl.load(s_row + (r0 - c0) + offs_r, mask=r_ok, other=0.0)
                bt = tl.load(pool_ptr + b_off + (r0 + offs_r)[:, None] * N + (n0 + offs_n)[None, :],
                             mask=r_ok[:, None] & n_ok[None, :], other=0.0)
                acc += tl.sum(s[:, None] * bt.to(tl.float32), axis=0)
            if ACCUMULATE:
                acc += tl.load(out_row + n0 + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            else:  # ranks above CHUNK_R: later chunks add to what the first one wrote
                acc += tl.load(out_row + n0 + offs_n, mask=n_ok & (c > 0), other=0.0).to(tl.float32)
            tl.store(out_row + n0 + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
        tl.debug_barrier()  # the next chunk overwrites the scratch


def _check_inputs(x, pool, a_offsets, b_offsets, ranks, scales, out_features, out) -> None:
    """Shapes, dtypes and devices only: no value is read (no device sync, CUDA-graph safe)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [rows, in_features]; got {getattr(x, 'shape', type(x))}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x.dtype={x.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if not isinstance(pool, torch.Tensor) or pool.dim() != 1:
        raise ValueError(f"pool must be a 1-D tensor of adapter weights; got {getattr(pool, 'shape', type(pool))}")
    if pool.dtype != x.dtype or pool.device != x.device:
        raise TypeError(f"pool is {pool.dtype} on {pool.device} but x is {x.dtype} on {x.device}; they must match")
    if not isinstance(out_features, int) or out_features < 1:
        raise ValueError(f"out_features must be a positive int; got {out_features!r}")
    b = x.shape[0]
    for name, t, dtype in (
        ("a_offsets", a_offsets, torch.int64),
        ("b_offsets", b_offsets, torch.int64),
        ("ranks", ranks, torch.int32),
        ("scales", scales, torch.float32),
    ):
        if not isinstance(t, torch.Tensor) or t.shape != (b,) or t.dtype != dtype or t.device != x.device:
            raise ValueError(
                f"{name} must be a [{b}] {dtype} tensor on {x.device} (one entry per row of x); got "
                f"{getattr(t, 'shape', type(t))} {getattr(t, 'dtype', '')} on {getattr(t, 'device', '')}"
            )
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != (b, out_features):
            raise ValueError(f"out must be [{b}, {out_features}]; got {getattr(out, 'shape', type(out))}")
        if out.dtype != x.dtype or out.device != x.device:
            raise TypeError(f"out is {out.dtype} on {out.device} but x is {x.dtype} on {x.device}; they must match")


def _add_into(delta: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    # One rounding to the output dtype, after the fp32 sum (what the kernel does).
    if out is None:
        return delta.to(dtype)
    out.copy_(out.float() + delta)
    return out


@torch.no_grad()
def lora_gather_reference(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    out_features: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row LoRA delta ``[B, N]`` (the spec of ``lora_gather``).

    x ``[B, K]``; pool 1-D (x's dtype and device); a_offsets / b_offsets ``[B]`` int64 element
    offsets into pool; ranks ``[B]`` int32 (0 = no LoRA); scales ``[B]`` fp32 (alpha / r);
    out_features N. Returns ``scale_i * (x_i A_i^T) Bt_i`` computed in fp32 and cast to
    x.dtype, or, with ``out [B, N]``, adds it into ``out`` in place (fp32 sum, one rounding)
    and returns ``out``. Rows with the same (offsets, rank) are computed as one matmul; the
    grouping reads the routing on the host (a device sync), so use it for CPU and tests.
    """
    _check_inputs(x, pool, a_offsets, b_offsets, ranks, scales, out_features, out)
    k, n = x.shape[1], out_features
    delta = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
    keys = torch.stack([a_offsets, b_offsets, ranks.to(torch.int64)], dim=1)
    live = ranks > 0
    if bool(live.any()):
        if bool((ranks < 0).any()):
            raise ValueError(f"ranks must be >= 0; got {ranks.tolist()}")
        groups, inverse = torch.unique(keys[live], dim=0, return_inverse=True)
        live_rows = live.nonzero().squeeze(1)
        for g, (a, b, r) in enumerate(groups.tolist()):
            if a < 0 or b < 0 or a + r * k > pool.numel() or b + r * n > pool.numel():
                raise ValueError(
                    f"adapter at a_offset={a}, b_offset={b}, rank={r} reaches past the pool "
                    f"({pool.numel()} elements, K={k}, N={n})"
                )
            rows = live_rows[inverse == g]
            s = x[rows].float() @ pool[a : a + r * k].view(r, k).float().T
            delta[rows] = (s * scales[rows, None]) @ pool[b : b + r * n].view(r, n).float()
    return _add_into(delta, x.dtype, out)


def lora_gather(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    out_features: int,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Same contract as ``lora_gather_reference``; ``backend``: "torch" (the reference),
    "triton" (one launch for all rows; CUDA, or CPU under TRITON_INTERPRET=1) or "auto"
    (Triton on CUDA, torch elsewhere). The Triton path reads no value on the host, so it can
    be captured in a CUDA graph. Ranks up to ``MAX_RANK_CHUNK`` are summed in one fp32
    accumulator; larger ranks are correct but add one rounding of ``out`` per chunk."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {BACKENDS}")
    if backend == "auto":
        backend = "triton" if x.is_cuda else "torch"
    if backend == "torch":
        return lora_gather_reference(x, pool, a_offsets, b_offsets, ranks, scales, out_features, out=out)
    return _lora_gather_triton(x, pool, a_offsets, b_offsets, ranks, scales, out_features, out)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def _num_splits(rows: int, n: int, block_n: int, device: torch.device) -> int:
    """Column splits per row so about two programs per SM are in flight."""
    if device.type != "cuda":
        return min(2, triton.cdiv(n, block_n))  # exercise the split path in the interpreter
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(n, block_n), triton.cdiv(2 * sms, rows)))


def _lora_gather_triton(
    x, pool, a_offsets, b_offsets, ranks, scales, out_features, out, *,
    splits=None, block_n=None, block_k=None, block_r=16, num_warps=4,
):
    """The launcher; the keyword knobs exist for tests and scripts/bench_decode_kernels.py."""
    _check_inputs(x, pool, a_offsets, b_offsets, ranks, scales, out_features, out)
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors (x is on {x.device}); use backend='torch' or "
            "'auto' on the CPU, or set TRITON_INTERPRET=1 to run the kernel in the interpreter"
        )
    if pool.stride(0) != 1:
        raise ValueError("pool must be contiguous (a flat buffer of adapter weights)")
    if out is not None and out.stride(1) != 1:
        raise ValueError(f"out must have unit stride along features (it is written in place); got strides {out.stride()}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    n = out_features
    result = out if out is not None else torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return result
    block_n = block_n or (256 if x.is_cuda else 32)
    block_k = block_k or (256 if x.is_cuda else 32)
    splits = splits if splits is not None else _num_splits(rows, n, block_n, x.device)
    n_per_split = triton.cdiv(triton.cdiv(n, splits), block_n) * block_n
    splits = triton.cdiv(n, n_per_split)
    scratch = torch.empty(rows * splits * MAX_RANK_CHUNK, dtype=torch.float32, device=x.device)
    _lora_gather_kernel[(rows, splits)](
        x, pool, a_offsets, b_offsets, ranks, scales, result, scratch,
        k, n, x.stride(0), result.stride(0), n_per_split,
        ACCUMULATE=out is not None, CHUNK_R=MAX_RANK_CHUNK, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return result
