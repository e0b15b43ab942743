"""SwiGLU's decode rows with the down projection's LoRA shrink folded in (few decode rows).

Down's input is SwiGLU's output: the program that writes a block of columns of a row's
``silu(gate) * up`` holds exactly the K block of down's shrink for that row, so it also writes
``part[row, block, :rank] = act[row, block] A_down[:rank, block]^T`` (the per-row shrink's
partial sums, K blocks = SwiGLU's column blocks) and ``lora_gather`` for down then runs only its
expand (``partials``). At a few rows a decode step is latency-bound: this saves down's shrink
launch and its read of the activation. ``lora_gather.AHEAD_MAX_ROWS`` bounds where the engine
takes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class ShrinkAhead:
    """The next projection's A tables for the same decode rows as the SwiGLU's LoRA (down after
    SwiGLU): ``a_offsets [B]`` int64 into ``pool`` (1-D, SwiGLU's dtype), ``ranks [B]`` int32
    (0: none), on its device; A is ``[rank, N]`` with N SwiGLU's width."""

    pool: torch.Tensor
    a_offsets: torch.Tensor
    ranks: torch.Tensor

    def check(self, rows: int, device: torch.device, dtype: torch.dtype) -> None:
        if self.pool.dim() != 1 or self.pool.stride(0) != 1 or self.pool.dtype != dtype or self.pool.device != device:
            raise ValueError(f"ShrinkAhead.pool must be a contiguous 1-D {dtype} tensor on {device}; got "
                             f"{tuple(self.pool.shape)} {self.pool.dtype} on {self.pool.device}")
        for name, t, dtype in (("a_offsets", self.a_offsets, torch.int64), ("ranks", self.ranks, torch.int32)):
            if t.shape != (rows,) or t.dtype != dtype or t.device != device or t.stride(0) != 1:
                raise ValueError(f"ShrinkAhead.{name} must be a contiguous [{rows}] {dtype} tensor on {device}; got "
                                 f"{tuple(t.shape)} {t.dtype} on {t.device}")


@triton.jit
def shrink_ahead(act, nx_pool_ptr, nx_a_ptr, nx_rank_ptr, nx_part_ptr, lrow, nb, n_blocks, N, offs, ok,
                 MAX_R: tl.constexpr, NX_BLOCK_R: tl.constexpr):
    """``part[lrow, nb, :rank] = act (fp32 values of the output dtype at columns offs) @
    A^T[offs, :rank]`` of the next projection, whose A ``[rank, N]`` sits at ``nx_pool_ptr +
    a_offsets[lrow]``; rank clamped to MAX_R (the expand turns a larger one into NaN)."""
    rank = tl.minimum(tl.load(nx_rank_ptr + lrow), MAX_R)
    a_off = tl.load(nx_a_ptr + lrow)
    offs_r = tl.arange(0, NX_BLOCK_R)
    part_row = nx_part_ptr + (lrow.to(tl.int64) * n_blocks + nb) * MAX_R
    for r0 in range(0, rank, NX_BLOCK_R):
        r_ok = r0 + offs_r < rank
        a = tl.load(nx_pool_ptr + a_off + (r0 + offs_r)[:, None] * N + offs[None, :],
                    mask=r_ok[:, None] & ok[None, :], other=0.0)
        tl.store(part_row + r0 + offs_r, tl.sum(a.to(tl.float32) * act[None, :], axis=1), mask=r_ok)
