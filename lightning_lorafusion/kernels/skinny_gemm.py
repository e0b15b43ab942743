"""The frozen 16-bit product for few rows: ``Y [M, N] = X [M, K] @ W [N, K]^T`` for the
generation engine's decode steps (M up to ``MAX_ROWS``), reading ``W`` once; ``F.linear`` is the
spec (``skinny_linear_reference``).

At a decode step's row counts the product is a stream of the weight's bytes, and what decides
its time is how many of them are in flight: each program owns ``BLOCK_N`` rows of ``W`` and a
slice of ``K`` (split-K, so that ``N`` = 4,096 still fills the GPU), with ``X``'s rows padded to
one ``BLOCK_M`` tile. Split-K partials are fp32, in ``[splits, M, N]``, and each tile's last
program to finish (an int32 counter per tile, kept zeroed in a ``SkinnyWorkspace`` between calls,
so a CUDA graph replays it with no fill kernel) sums them in split order and writes ``Y``: one
launch, the same sums whatever the programs' order. The product is ``tl.dot`` either way round:
``Y^T = W X^T`` (the weight the MMA's first operand, ``X`` its narrow second) or ``Y = X W^T``
(``x_first``: the weight the second operand, as Hopper's wgmma reads it from shared memory).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .triton_launch import sm_count

MAX_ROWS = 256  # the largest M this kernel serves
MIN_STEPS = 2  # K loop steps a split-K program runs at least
WORKSPACE_COUNTERS = 8192  # a workspace's split-K counters: tiles of the largest launch


@triton.jit(do_not_specialize=["M", "splits"])  # one variant for every row count of a BLOCK_M (1 included)
def _skinny_kernel(x_ptr, w_ptr, part_ptr, y_ptr, count_ptr, M, N, K, k_per_split, splits, stride_xm, stride_wn,
                   stride_ym, stride_os, PARTIAL: tl.constexpr, X_FIRST: tl.constexpr, ASM: tl.constexpr,
                   EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``Y`` over ``K`` columns ``[pid_k * k_per_split,
    +k_per_split)``: the final values (``PARTIAL`` off), or an fp32 partial into ``part[pid_k]``
    that the tile's last program (``count_ptr``) sums into ``y``."""
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_mask, m_mask = rn < N, rm < M
    k0 = pid_k * k_per_split
    k_end = tl.minimum(k0 + k_per_split, K)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    if X_FIRST:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k0, k_end, BLOCK_K):
        kk = k + rk
        if EVEN_K:  # every step whole: only the rows are masked
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None], other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None], other=0.0)
        else:
            k_ok = kk < k_end
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_ok[None, :], other=0.0)
        if X_FIRST:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
    if X_FIRST:
        offs = rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
    else:
        offs = rm[None, :].to(tl.int64) * stride_ym + rn[:, None]
        mask = n_mask[:, None] & m_mask[None, :]
    if PARTIAL:
        tl.store(part_ptr + pid_k.to(tl.int64) * stride_os + offs, acc, mask=mask)
        count = count_ptr + pid_m * tl.num_programs(0) + pid_n
        if ASM:  # every thread: its partial visible at GPU scope before the count
            tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [rn], dtype=tl.int32,
                                      is_pure=False, pack=1)
        tl.debug_barrier()
        if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == splits - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(0, splits):  # split order: the same sums whatever order the programs ran in
                total += tl.load(part_ptr + s * stride_os + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class SkinnyConfig:
    """How ``skinny_linear`` tiles a product: ``block_n`` rows of ``W`` and ``block_k`` columns of
    ``K`` per loop step, ``split_k`` programs along ``K`` (0: as many as bring the grid to about
    ``fill`` programs per SM, each of at least ``MIN_STEPS`` steps), ``block_m`` rows of ``X`` per
    program (0: ``M`` rounded up to a power of two, at least 16), ``x_first`` (``Y = X W^T``)."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 0
    fill: int = 4
    block_m: int = 0
    x_first: bool = False
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"SkinnyConfig.{name}={v} must be a power of two >= 16")
        if self.block_m and (self.block_m < 16 or self.block_m & (self.block_m - 1)):
            raise ValueError(f"SkinnyConfig.block_m={self.block_m} must be 0 or a power of two >= 16")
        if self.split_k < 0 or self.fill < 1:
            raise ValueError(f"SkinnyConfig: split_k={self.split_k} must be >= 0 and fill={self.fill} >= 1")


def _sm_count_of(device: torch.device) -> int:
    """The device's SMs (a fixed guess off CUDA: the interpreter)."""
    return sm_count(device, off_cuda=4)


def block_m_of(m: int, cfg: SkinnyConfig) -> int:
    return cfg.block_m or max(16, triton.next_power_of_2(m))


def split_of(m: int, n: int, k: int, cfg: SkinnyConfig, device: torch.device) -> tuple[int, int]:
    """(programs along ``K``, ``K`` columns each, a multiple of ``block_k``) for ``m`` rows of an
    ``[n, k]`` weight."""
    steps = triton.cdiv(k, cfg.block_k)
    if cfg.split_k:
        split = cfg.split_k
    else:
        tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, block_m_of(m, cfg))
        split = max(1, min(steps // MIN_STEPS, round(cfg.fill * _sm_count_of(device) / tiles)))
    per_split = cfg.block_k * triton.cdiv(steps, min(split, steps))
    return triton.cdiv(k, per_split), per_split


@dataclass(frozen=True, eq=False)
class SkinnyWorkspace:
    """Split-K counters a caller keeps across calls (int32, zeroed once; each launch leaves them
    zeroed, so a call or a CUDA graph's replay needs no fill kernel). One stream at a time."""

    counters: torch.Tensor

    @classmethod
    def create(cls, device: torch.device | str, counters: int = WORKSPACE_COUNTERS) -> "SkinnyWorkspace":
        return cls(torch.zeros(counters, dtype=torch.int32, device=device))


def skinny_linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The spec: ``x [M, K] @ w [N, K]^T -> [M, N]``."""
    return F.linear(x, w)


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"skinny_linear: x [M, K] and w [N, K] must share K; got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"skinny_linear: x has {x.shape[0]} rows; this kernel serves at most {MAX_ROWS}")
    if x.dtype != w.dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"skinny_linear: x and w must share one of fp16, bf16, fp32; got {x.dtype} and {w.dtype}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("skinny_linear: x and w must be contiguous along K")
    if x.device != w.device:
        raise ValueError(f"skinny_linear: x on {x.device}, w on {w.device}")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("skinny_linear runs on CUDA, or on the CPU under TRITON_INTERPRET=1")


def skinny_linear(x: torch.Tensor, w: torch.Tensor, *, config: SkinnyConfig | None = None,
                  workspace: SkinnyWorkspace | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ w [N, K]^T -> [M, N]`` in ``x.dtype`` (fp32 sums), ``M <= MAX_ROWS``;
    ``config``: the tiling (``SkinnyConfig()`` when None); ``workspace``: kept split-K counters
    (else zeroed per call); ``out``: an ``[M, N]`` tensor with unit column stride to write."""
    _check(x, w)
    cfg = config or SkinnyConfig()
    m, k, n = x.shape[0], x.shape[1], w.shape[0]
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if y.shape != (m, n) or y.stride(1) != 1 or y.dtype != x.dtype:
        raise ValueError(f"skinny_linear: out must be [{m}, {n}] {x.dtype} with unit column stride")
    if m == 0:
        return y
    block_m = block_m_of(m, cfg)
    split, per_split = split_of(m, n, k, cfg, x.device)
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, block_m))
    part, counts = y, y  # (unused without split-K)
    if split > 1:
        part = torch.empty(split, m, n if out is None else y.stride(0), dtype=torch.float32, device=x.device)
        need = grid[0] * grid[2]
        counts = (workspace.counters if workspace is not None and workspace.counters.numel() >= need
                  else torch.zeros(need, dtype=torch.int32, device=x.device))
    _skinny_kernel[grid](
        x, w, part, y, counts, m, n, k, per_split, split, x.stride(0), w.stride(0), y.stride(0),
        part.stride(0) if split > 1 else 0, PARTIAL=split > 1, X_FIRST=cfg.x_first, ASM=x.is_cuda,
        EVEN_K=k % cfg.block_k == 0, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return y


DECODE_GEMM_MODES = ("auto", "cublas", "triton")


# the products this kernel takes by default: where it measured faster than cuBLAS in a sweep of
# the 8B products over cold weights (H200, 2026-11-27, scripts/bench_skinny_gemm.py;
# docs/BENCHMARKS.md "Many tenants against their floor"): the LM head ([128256, 4096]) up to 64
# rows (5-7 % faster; 7 % on an H100), gate/up ([28672, 4096]) up to 8 rows (equal at one row,
# 9 % at four; level on an H100); cuBLAS kept the square and narrow products (o, q/k/v, down:
# 3-80 % slower here) and wider steps
WIDE_N = 16384  # gate/up-like products: N at least this
HEAD_N = 65536  # LM-head-like products: N at least this
WIDE_MAX_ROWS = 8
HEAD_MAX_ROWS = 64


def default_config(m: int, n: int, k: int) -> SkinnyConfig | None:
    """The tiling for ``m`` rows of an ``[n, k]`` weight, or None where cuBLAS is the faster
    (``WIDE_N`` / ``HEAD_N``)."""
    if n >= HEAD_N and m <= HEAD_MAX_ROWS:  # 128 rows of W a program, no split (thousands of tiles)
        return SkinnyConfig(block_n=128, block_k=128, fill=2, num_warps=8, num_stages=3)
    if n >= WIDE_N and m <= WIDE_MAX_ROWS:  # 64 rows of W a program, split-K to about 4 programs per SM
        return SkinnyConfig(block_n=64, block_k=128, fill=4)
    return None


@dataclass(frozen=True, eq=False)
class SkinnyPlan:
    """Which frozen products of few rows a forward runs with ``skinny_linear`` (the rest:
    ``F.linear``): plain weights without bias, at most ``max_rows`` rows, where ``choose(m, n,
    k)`` (``default_config``) names a tiling; ``workspace``: the split-K counters all of them
    share (launches in stream order)."""

    workspace: SkinnyWorkspace
    max_rows: int = MAX_ROWS
    choose: Callable[[int, int, int], SkinnyConfig | None] = default_config

    @classmethod
    def for_mode(cls, mode: str, device: torch.device, dtype: torch.dtype) -> "SkinnyPlan | None":
        """The plan of ``EngineTuning.decode_gemm``: "triton" and "auto" on CUDA with a 16-bit
        dtype; None (cuBLAS everywhere) for "cublas", on a CPU or in fp32."""
        if mode not in DECODE_GEMM_MODES:
            raise ValueError(f"decode_gemm={mode!r}; allowed: {', '.join(DECODE_GEMM_MODES)}")
        if mode == "cublas" or device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
            return None
        return cls(SkinnyWorkspace.create(device))

    def config_for(self, x: torch.Tensor, w: torch.Tensor) -> SkinnyConfig | None:
        if (x.shape[0] > self.max_rows or x.dim() != 2 or w.dim() != 2 or x.dtype != w.dtype
                or x.stride(1) != 1 or w.stride(1) != 1):
            return None
        return self.choose(x.shape[0], w.shape[0], w.shape[1])


def plain_linear(plan: SkinnyPlan | None, x: torch.Tensor, w: torch.Tensor,
                 b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)``, by ``skinny_linear`` where ``plan`` has a tiling for it (no bias)."""
    cfg = plan.config_for(x, w) if plan is not None and b is None else None
    if cfg is None:
        return F.linear(x, w, b)
    return skinny_linear(x, w, config=cfg, workspace=plan.workspace)
