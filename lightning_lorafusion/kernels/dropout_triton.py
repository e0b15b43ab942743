"""The dropout hash of ``kernels/dropout.py`` written in Triton (uint32), plus a mask kernel.

``keep_bits16`` / ``pair_hash`` must stay bit-identical to ``dropout.hash_uniform16``: the fused kernels
regenerate the forward's mask in backward from (seed, offset, row, col) with it, and the torch
reference draws its mask with the torch version. ``tests/kernels/test_dropout_triton.py``
checks the two against each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dropout import _C_COL, _C_OFFSET, _C_SEED, _MASK32, dropout_keep_threshold


def seed_hash(seed: int) -> int:
    """The seed's share of the hash base; xor it with ``offset_hash`` to get the base."""
    return (seed * _C_SEED) & _MASK32


def offset_hash(offset: int) -> int:
    """The dropout offset's share of the hash base (uint32 value)."""
    return (offset * _C_OFFSET) & _MASK32


def offset_hash_arg(offset: int) -> int:
    """``offset_hash`` as the kernels take it: the same 32 bits as a signed int32 value.

    The kernels read it as uint32 (``hash_base``). In int32's range, Triton types the argument
    the same for every offset; a value >= 2**31 would be typed uint32, and a launch compiled for
    int32 (``triton_launch.CachedLaunch`` reuses the first call's kernel) refuses it with an
    OverflowError."""
    h = offset_hash(offset)
    return h - (1 << 32) if h >= 1 << 31 else h


@triton.jit
def fmix32(x):
    """murmur3's 32-bit finaliser on uint32 values (multiplications wrap mod 2^32)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    x = x ^ (x >> 16)
    return x


@triton.jit
def row_hash(base, pairs):
    """First hash stage, once per row pair: ``pairs`` [BP] = row // 2 -> [BP] uint32."""
    return fmix32(base ^ (pairs.to(tl.uint32) * 0xC2B2AE3D))


@triton.jit
def pair_hash(pair_h, cols):
    """Second stage: [BP] x [BK] -> [BP, BK] uint32; low 16 bits for the even row of each pair,
    high 16 bits for the odd row."""
    col_h = cols.to(tl.uint32) * 0x27D4EB2F
    return fmix32(pair_h[:, None] ^ col_h[None, :])


@triton.jit
def keep_bits16(base, rows, cols):
    """Element-wise 16 random bits for rows [BM] x cols [BK] (any row alignment)."""
    h = pair_hash(row_hash(base, rows // 2), cols)
    return tl.where((rows % 2 == 1)[:, None], h >> 16, h & 0xFFFF)


@triton.jit
def hash_base(seed_h, offset_h):
    """uint32 base from the seed's and the offset's shares (either may arrive as int64)."""
    return seed_h.to(tl.uint32) ^ offset_h.to(tl.uint32)


@triton.jit
def _keep_mask_kernel(
    out_ptr, seed_h, offset_h, threshold, row_start, rows, cols,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    keep = keep_bits16(hash_base(seed_h, offset_h), row_start + offs_r, offs_c) >= threshold.to(tl.uint32)
    ok = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
    tl.store(out_ptr + offs_r[:, None] * cols + offs_c[None, :], keep.to(tl.int8), mask=ok)


def triton_dropout_keep_mask(
    seed: int, offset: int, row_start: int, rows: int, cols: int, p: float, device
) -> torch.Tensor:
    """Boolean keep-mask ``[rows, cols]`` drawn by the Triton hash (same contract as
    ``dropout.dropout_keep_mask``); used by tests and benchmarks to prove the two agree."""
    out = torch.empty(rows, cols, dtype=torch.int8, device=device)
    grid = (triton.cdiv(rows, 32), triton.cdiv(cols, 64))
    _keep_mask_kernel[grid](
        out, seed_hash(seed), offset_hash_arg(offset), dropout_keep_threshold(p), row_start, rows, cols,
        BLOCK_R=32, BLOCK_C=64,
    )
    return out.bool()
