"""What follows a serving step's q/k/v and gate/up GEMMs, fused with the decode rows' LoRA expand.

``rope_write_kv``: q, k, v ``(+)= LoRA``, RoPE on q and k, k and v written into their KV-cache
pages: one launch, a program per (row, head). ``swiglu``: ``silu(gate (+ LoRA)) * (up (+ LoRA))``:
one launch over (row, column block). With a ``GatheredLora`` (the decode rows' adapters) the
group's shrink (``lora_shrink``, one launch for all its projections) runs first and the expand
happens inside these kernels, so a projection's LoRA costs no launch of its own after the shrink.

The references compose the existing ops in the engine's order: ``lora_gather_reference`` into
each projection (fp32 sum, one rounding), then ``apply_rope`` / ``write_kv`` or ``silu * up``.
The kernels round at the same points (after the LoRA add; then once at the end, where the
reference rounds after each half-precision op), so fp32 agrees to rounding and half precision
to an ulp or so of the output.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import lora_gather as _gather
from .lora_gather import (BACKENDS, MAX_RANK, GatheredLora, _require_triton, lora_grouped_expand, lora_shrink,
                          row_blocks, takes_groups)
from .lora_ahead import ShrinkAhead, shrink_ahead
from .lora_grouped_kernels import (_swiglu_grouped_kernel, _with_lora, _with_lora_pair, gdc_wait, hybrid_row,
                                   lora_group_delta, swiglu_group)
from .paged_attention import _check_pool, write_kv
from .segment_swiglu import swiglu_segments
from .segment_tables import SegmentLora
from .reference import apply_rope

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# rows without LoRA in one rope_write_kv launch from which a program handles a whole row (all
# heads) instead of one head; module-level so tests and benchmarks can move it
ROPE_ROWS_KERNEL_MIN_ROWS = 64
ROPE_ROWS_WARPS = 4


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_cols(base, cols, ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, g, lora_rows, k_blocks,
               b_g_stride, r_g_stride, N, col0,
               HAS_LORA: tl.constexpr, MAX_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr,
               PRELOAD: tl.constexpr = False, GDC: tl.constexpr = False):
    """A head's columns ``cols`` (fp32 values of its dtype), with the row's LoRA added and rounded."""
    x = tl.load(base + cols, mask=ok, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_LORA:
        x = _with_lora(x, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, g, lora_rows, k_blocks,
                       b_g_stride, r_g_stride, N, col0 + cols, ok,
                       MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, PRELOAD=PRELOAD,
                       GDC=GDC).to(dtype).to(tl.float32)
    return x


@triton.jit
def _load_cols_pair(base, cols_a, cols_b, ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, g, lora_rows,
                    k_blocks, b_g_stride, r_g_stride, N, col0,
                    HAS_LORA: tl.constexpr, MAX_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr,
                    PRELOAD: tl.constexpr = False, GDC: tl.constexpr = False):
    """``_load_cols`` of two column sets of one head (RoPE's halves) of projection g: their LoRA
    in one rank loop (``_with_lora_pair``), the same values."""
    xa = tl.load(base + cols_a, mask=ok, other=0.0)
    dtype = xa.dtype
    xa = xa.to(tl.float32)
    xb = tl.load(base + cols_b, mask=ok, other=0.0).to(tl.float32)
    if HAS_LORA:
        xa, xb = _with_lora_pair(xa, xb, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, g, g, lora_rows,
                                 k_blocks, b_g_stride, r_g_stride, N, N, col0 + cols_a, ok, col0 + cols_b, ok,
                                 MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, PRELOAD=PRELOAD, GDC=GDC)
        xa = xa.to(dtype).to(tl.float32)
        xb = xb.to(dtype).to(tl.float32)
    return xa, xb


@triton.jit
def _load_halves(base, cols_a, cols_b, ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, g, lora_rows,
                 k_blocks, b_g_stride, r_g_stride, N, col0,
                 HAS_LORA: tl.constexpr, MAX_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr,
                 PAIR: tl.constexpr, PRELOAD: tl.constexpr = False, GDC: tl.constexpr = False):
    """A head's two column sets with their LoRA: in one rank loop (PAIR) or one after the other."""
    if PAIR:
        xa, xb = _load_cols_pair(base, cols_a, cols_b, ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow,
                                 g, lora_rows, k_blocks, b_g_stride, r_g_stride, N, col0,
                                 HAS_LORA=HAS_LORA, MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB,
                                 PRELOAD=PRELOAD, GDC=GDC)
    else:
        xa = _load_cols(base, cols_a, ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, g, lora_rows,
                        k_blocks, b_g_stride, r_g_stride, N, col0,
                        HAS_LORA=HAS_LORA, MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, PRELOAD=PRELOAD, GDC=GDC)
        xb = _load_cols(base, cols_b, ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, g, lora_rows,
                        k_blocks, b_g_stride, r_g_stride, N, col0,
                        HAS_LORA=HAS_LORA, MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, PRELOAD=PRELOAD, GDC=GDC)
    return xa, xb


@triton.jit(do_not_specialize=("slots", "min_group", "groups_stride"))
def _rope_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, q_hstride, k_hstride, v_hstride,
    cos_ptr, sin_ptr, cs_stride,
    kv_ptr, page_ptr, slot_ptr, kv_sp, kv_skv, kv_ss, kv_sh,
    pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, first_row, lora_rows, k_blocks, b_g_stride, r_g_stride,
    row0, groups_ptr, groups_stride, slots, min_group,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ROT_HALF: tl.constexpr, BLOCK_ROT: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
    HAS_LORA: tl.constexpr, MAX_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr,
    PAIR: tl.constexpr, PRELOAD: tl.constexpr = False, GDC: tl.constexpr = False, HYBRID: tl.constexpr = False,
    BLOCK_M: tl.constexpr = 16, DOT_PRECISION: tl.constexpr = "ieee", HALF_S: tl.constexpr = False,
):
    """Program (row0 + i, head): head < HQ is query head ``head`` (LoRA, RoPE, in place);
    otherwise kv head ``head - HQ``: its key (LoRA, RoPE, in place, into the page) and value
    (LoRA, in place, into the page). The KV slot is ``kv[page[row], 0 / 1, slot[row], kv head]``.
    RoPE rotates the head's first ``2 * ROT_HALF`` dims (cos, sin are that wide); the ``PASS``
    dims after them (partial rotary) only get their LoRA. PAIR: a head's two halves take their
    LoRA in one rank loop (``_load_cols_pair``), else one after the other (the same values).
    PRELOAD / GDC (``lora_gather.PDL``): every program waits for the shrink's grid in its first
    LoRA rank loop, before reading the partials and before any store. Programs (slots + i, head).
    HYBRID (``lora_gather.HYBRID_MIN_ROWS``): the first ``slots`` programs do the groups of at
    least ``min_group`` rows (``_rope_group``: one dot per head and projection for the group's
    rows, B^T read once), the rows' own programs nothing for them."""
    head = tl.program_id(1)
    pid = tl.program_id(0)
    if HYBRID:  # (compiled only where taken: the other launches keep their registers)
        if pid < slots:
            start = tl.load(groups_ptr + pid)
            end = tl.load(groups_ptr + groups_stride + pid)
            if end - start >= tl.maximum(min_group, 1):
                if GDC:
                    gdc_wait()
                _rope_group(q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, q_hstride, k_hstride, v_hstride,
                            cos_ptr, sin_ptr, cs_stride, kv_ptr, page_ptr, slot_ptr, kv_sp, kv_skv, kv_ss, kv_sh,
                            pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, part_ptr, first_row, lora_rows,
                            k_blocks, groups_stride, b_g_stride, r_g_stride, start, end, head,
                            HQ=HQ, HKV=HKV, HALF=HALF, BLOCK_HALF=BLOCK_HALF, ROT_HALF=ROT_HALF,
                            BLOCK_ROT=BLOCK_ROT, PASS=PASS, BLOCK_PASS=BLOCK_PASS, MAX_R=MAX_R, BLOCK_M=BLOCK_M,
                            BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, DOT_PRECISION=DOT_PRECISION, HALF_S=HALF_S)
        else:
            row = row0 + pid - slots
            grouped, lrow = hybrid_row(row - first_row, groups_ptr + 3 * groups_stride, lora_rows, min_group,
                                       HYBRID=True)
            if (slots == 0) | (grouped == 0):
                _rope_row(q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, q_hstride, k_hstride, v_hstride,
                          cos_ptr, sin_ptr, cs_stride, kv_ptr, page_ptr, slot_ptr, kv_sp, kv_skv, kv_ss, kv_sh,
                          pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lora_rows, k_blocks, b_g_stride,
                          r_g_stride, row, lrow, head,
                          HQ=HQ, HKV=HKV, HALF=HALF, BLOCK_HALF=BLOCK_HALF, ROT_HALF=ROT_HALF, BLOCK_ROT=BLOCK_ROT,
                          PASS=PASS, BLOCK_PASS=BLOCK_PASS, HAS_LORA=HAS_LORA, MAX_R=MAX_R, BLOCK_R=BLOCK_R,
                          BLOCK_KB=BLOCK_KB, PAIR=PAIR, PRELOAD=PRELOAD, GDC=GDC)
    else:
        row = row0 + pid
        _rope_row(q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, q_hstride, k_hstride, v_hstride,
                  cos_ptr, sin_ptr, cs_stride, kv_ptr, page_ptr, slot_ptr, kv_sp, kv_skv, kv_ss, kv_sh,
                  pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lora_rows, k_blocks, b_g_stride,
                  r_g_stride, row, row - first_row, head,
                  HQ=HQ, HKV=HKV, HALF=HALF, BLOCK_HALF=BLOCK_HALF, ROT_HALF=ROT_HALF, BLOCK_ROT=BLOCK_ROT,
                  PASS=PASS, BLOCK_PASS=BLOCK_PASS, HAS_LORA=HAS_LORA, MAX_R=MAX_R, BLOCK_R=BLOCK_R,
                  BLOCK_KB=BLOCK_KB, PAIR=PAIR, PRELOAD=PRELOAD, GDC=GDC)


@triton.jit
def _group_cols(base, cols, ok, m_ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, part_ptr, start, end,
                g, lora_rows, k_blocks, groups_stride, b_g_stride, r_g_stride, N, col0,
                MAX_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr,
                DOT_PRECISION: tl.constexpr, HALF_S: tl.constexpr):
    """``_load_cols`` for the rows of one group at once (``base [BLOCK_M]``: each row's head
    start): ``[BLOCK_M, len(cols)]`` fp32 values of the dtype, the group's LoRA added by one dot
    (``lora_group_delta``) and rounded."""
    live = m_ok[:, None] & ok[None, :]
    x = tl.load(base[:, None] + cols[None, :], mask=live, other=0.0)
    dtype = x.dtype
    _, _, rank_in, delta = lora_group_delta(
        part_ptr, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, start, end, g, lora_rows, k_blocks,
        groups_stride, b_g_stride, r_g_stride, N, col0 + cols, ok,
        MAX_R=MAX_R, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, DOT_PRECISION=DOT_PRECISION,
        HALF_S=HALF_S)
    return tl.where(rank_in > MAX_R, float("nan"), x.to(tl.float32) + delta).to(dtype).to(tl.float32)


@triton.jit
def _rope_group(
    q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, q_hstride, k_hstride, v_hstride,
    cos_ptr, sin_ptr, cs_stride, kv_ptr, page_ptr, slot_ptr, kv_sp, kv_skv, kv_ss, kv_sh,
    pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, part_ptr, first_row, lora_rows, k_blocks, groups_stride,
    b_g_stride, r_g_stride, start, end, head,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ROT_HALF: tl.constexpr, BLOCK_ROT: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
    MAX_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HALF_S: tl.constexpr,
):
    """``_rope_row`` for the rows ``perm[start:end]`` of one group (one adapter) and one head:
    each projection's LoRA by one dot for the group's rows, the same roundings per element."""
    offs_m = start + tl.arange(0, BLOCK_M)
    m_ok = offs_m < end
    row64 = (first_row + tl.load(groups_ptr + 2 * groups_stride + offs_m, mask=m_ok, other=0)).to(tl.int64)
    offs = tl.arange(0, BLOCK_ROT)
    ok = offs < ROT_HALF
    live = m_ok[:, None] & ok[None, :]
    cs = row64[:, None] * cs_stride + offs[None, :]
    cos1 = tl.load(cos_ptr + cs, mask=live, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + cs + ROT_HALF, mask=live, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + cs, mask=live, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + cs + ROT_HALF, mask=live, other=0.0).to(tl.float32)
    offs_p = 2 * ROT_HALF + tl.arange(0, BLOCK_PASS)
    ok_p = offs_p < 2 * ROT_HALF + PASS
    if head < HQ:
        base = q_ptr + row64 * q_stride + head * q_hstride
        n, col0 = HQ * 2 * HALF, head * 2 * HALF
        x1 = _group_cols(base, offs, ok, m_ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, part_ptr, start,
                         end, 0, lora_rows, k_blocks, groups_stride, b_g_stride, r_g_stride, n, col0, MAX_R=MAX_R,
                         BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, DOT_PRECISION=DOT_PRECISION,
                         HALF_S=HALF_S)
        x2 = _group_cols(base, ROT_HALF + offs, ok, m_ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr,
                         part_ptr, start, end, 0, lora_rows, k_blocks, groups_stride, b_g_stride, r_g_stride, n, col0,
                         MAX_R=MAX_R, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB,
                         DOT_PRECISION=DOT_PRECISION, HALF_S=HALF_S)
        tl.store(base[:, None] + offs[None, :], (x1 * cos1 - x2 * sin1).to(q_ptr.dtype.element_ty), mask=live)
        tl.store(base[:, None] + ROT_HALF + offs[None, :], (x2 * cos2 + x1 * sin2).to(q_ptr.dtype.element_ty),
                 mask=live)
        if PASS > 0:
            xp = _group_cols(base, offs_p, ok_p, m_ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, part_ptr,
                             start, end, 0, lora_rows, k_blocks, groups_stride, b_g_stride, r_g_stride, n, col0,
                             MAX_R=MAX_R, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB,
                             DOT_PRECISION=DOT_PRECISION, HALF_S=HALF_S)
            tl.store(base[:, None] + offs_p[None, :], xp.to(q_ptr.dtype.element_ty), mask=m_ok[:, None] & ok_p[None, :])
    else:
        j = head - HQ
        slot = (kv_ptr + tl.load(page_ptr + row64, mask=m_ok, other=0).to(tl.int64) * kv_sp
                + tl.load(slot_ptr + row64, mask=m_ok, other=0).to(tl.int64) * kv_ss + j * kv_sh)
        base = k_ptr + row64 * k_stride + j * k_hstride
        n, col0 = HKV * 2 * HALF, j * 2 * HALF
        x1 = _group_cols(base, offs, ok, m_ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, part_ptr, start,
                         end, 1, lora_rows, k_blocks, groups_stride, b_g_stride, r_g_stride, n, col0, MAX_R=MAX_R,
                         BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, DOT_PRECISION=DOT_PRECISION,
                         HALF_S=HALF_S)
        x2 = _group_cols(base, ROT_HALF + offs, ok, m_ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr,
                         part_ptr, start, end, 1, lora_rows, k_blocks, groups_stride, b_g_stride, r_g_stride, n, col0,
                         MAX_R=MAX_R, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB,
                         DOT_PRECISION=DOT_PRECISION, HALF_S=HALF_S)
        k1 = (x1 * cos1 - x2 * sin1).to(k_ptr.dtype.element_ty)
        k2 = (x2 * cos2 + x1 * sin2).to(k_ptr.dtype.element_ty)
        tl.store(base[:, None] + offs[None, :], k1, mask=live)
        tl.store(base[:, None] + ROT_HALF + offs[None, :], k2, mask=live)
        tl.store(slot[:, None] + offs[None, :], k1.to(kv_ptr.dtype.element_ty), mask=live)
        tl.store(slot[:, None] + ROT_HALF + offs[None, :], k2.to(kv_ptr.dtype.element_ty), mask=live)
        if PASS > 0:
            live_p = m_ok[:, None] & ok_p[None, :]
            kp = _group_cols(base, offs_p, ok_p, m_ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, part_ptr,
                             start, end, 1, lora_rows, k_blocks, groups_stride, b_g_stride, r_g_stride, n, col0,
                             MAX_R=MAX_R, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB,
                             DOT_PRECISION=DOT_PRECISION, HALF_S=HALF_S).to(k_ptr.dtype.element_ty)
            tl.store(base[:, None] + offs_p[None, :], kp, mask=live_p)
            tl.store(slot[:, None] + offs_p[None, :], kp.to(kv_ptr.dtype.element_ty), mask=live_p)
        base = v_ptr + row64 * v_stride + j * v_hstride
        offs_v = tl.arange(0, BLOCK_HALF)
        ok_v = offs_v < HALF
        live_v = m_ok[:, None] & ok_v[None, :]
        v1 = _group_cols(base, offs_v, ok_v, m_ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, part_ptr,
                         start, end, 2, lora_rows, k_blocks, groups_stride, b_g_stride, r_g_stride, n, col0,
                         MAX_R=MAX_R, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB,
                         DOT_PRECISION=DOT_PRECISION, HALF_S=HALF_S).to(v_ptr.dtype.element_ty)
        v2 = _group_cols(base, HALF + offs_v, ok_v, m_ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr,
                         part_ptr, start, end, 2, lora_rows, k_blocks, groups_stride, b_g_stride, r_g_stride, n, col0,
                         MAX_R=MAX_R, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB,
                         DOT_PRECISION=DOT_PRECISION, HALF_S=HALF_S).to(v_ptr.dtype.element_ty)
        tl.store(base[:, None] + offs_v[None, :], v1, mask=live_v)
        tl.store(base[:, None] + HALF + offs_v[None, :], v2, mask=live_v)
        tl.store(slot[:, None] + kv_skv + offs_v[None, :], v1.to(kv_ptr.dtype.element_ty), mask=live_v)
        tl.store(slot[:, None] + kv_skv + HALF + offs_v[None, :], v2.to(kv_ptr.dtype.element_ty), mask=live_v)


@triton.jit
def _rope_row(
    q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, q_hstride, k_hstride, v_hstride,
    cos_ptr, sin_ptr, cs_stride, kv_ptr, page_ptr, slot_ptr, kv_sp, kv_skv, kv_ss, kv_sh,
    pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lora_rows, k_blocks, b_g_stride, r_g_stride, row, lrow, head,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ROT_HALF: tl.constexpr, BLOCK_ROT: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
    HAS_LORA: tl.constexpr, MAX_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr,
    PAIR: tl.constexpr, PRELOAD: tl.constexpr = False, GDC: tl.constexpr = False,
):
    """``_rope_kv_kernel``'s program for row ``row`` and head ``head`` (its LoRA that of gathered
    row ``lrow``: rank 0 outside the gathered rows)."""
    row64 = row.to(tl.int64)
    offs = tl.arange(0, BLOCK_ROT)
    ok = offs < ROT_HALF
    cos1 = tl.load(cos_ptr + row64 * cs_stride + offs, mask=ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + row64 * cs_stride + ROT_HALF + offs, mask=ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + row64 * cs_stride + offs, mask=ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + row64 * cs_stride + ROT_HALF + offs, mask=ok, other=0.0).to(tl.float32)
    offs_p = 2 * ROT_HALF + tl.arange(0, BLOCK_PASS)
    ok_p = offs_p < 2 * ROT_HALF + PASS
    if head < HQ:
        base = q_ptr + row64 * q_stride + head * q_hstride
        n, col0 = HQ * 2 * HALF, head * 2 * HALF
        x1, x2 = _load_halves(base, offs, ROT_HALF + offs, ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr,
                              lrow, 0, lora_rows, k_blocks, b_g_stride, r_g_stride, n, col0,
                              HAS_LORA=HAS_LORA, MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, PAIR=PAIR,
                              PRELOAD=PRELOAD, GDC=GDC)
        tl.store(base + offs, (x1 * cos1 - x2 * sin1).to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(base + ROT_HALF + offs, (x2 * cos2 + x1 * sin2).to(q_ptr.dtype.element_ty), mask=ok)
        if PASS > 0 and HAS_LORA:
            xp = _load_cols(base, offs_p, ok_p, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow,
                            0, lora_rows, k_blocks, b_g_stride, r_g_stride, n, col0,
                            HAS_LORA=HAS_LORA, MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB,
                            PRELOAD=PRELOAD, GDC=GDC)
            tl.store(base + offs_p, xp.to(q_ptr.dtype.element_ty), mask=ok_p)
    else:
        j = head - HQ
        slot = (kv_ptr + tl.load(page_ptr + row).to(tl.int64) * kv_sp + tl.load(slot_ptr + row).to(tl.int64) * kv_ss
                + j * kv_sh)
        base = k_ptr + row64 * k_stride + j * k_hstride
        n, col0 = HKV * 2 * HALF, j * 2 * HALF
        x1, x2 = _load_halves(base, offs, ROT_HALF + offs, ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr,
                              lrow, 1, lora_rows, k_blocks, b_g_stride, r_g_stride, n, col0,
                              HAS_LORA=HAS_LORA, MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, PAIR=PAIR,
                              PRELOAD=PRELOAD, GDC=GDC)
        k1 = (x1 * cos1 - x2 * sin1).to(k_ptr.dtype.element_ty)
        k2 = (x2 * cos2 + x1 * sin2).to(k_ptr.dtype.element_ty)
        tl.store(base + offs, k1, mask=ok)
        tl.store(base + ROT_HALF + offs, k2, mask=ok)
        tl.store(slot + offs, k1.to(kv_ptr.dtype.element_ty), mask=ok)
        tl.store(slot + ROT_HALF + offs, k2.to(kv_ptr.dtype.element_ty), mask=ok)
        if PASS > 0:
            kp = _load_cols(base, offs_p, ok_p, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow,
                            1, lora_rows, k_blocks, b_g_stride, r_g_stride, n, col0,
                            HAS_LORA=HAS_LORA, MAX_R=MAX_R, BLOCK_R=BLOCK_R,
                            BLOCK_KB=BLOCK_KB, PRELOAD=PRELOAD, GDC=GDC).to(k_ptr.dtype.element_ty)
            if HAS_LORA:
                tl.store(base + offs_p, kp, mask=ok_p)
            tl.store(slot + offs_p, kp.to(kv_ptr.dtype.element_ty), mask=ok_p)
        base = v_ptr + row64 * v_stride + j * v_hstride
        offs_v = tl.arange(0, BLOCK_HALF)
        ok_v = offs_v < HALF
        v1, v2 = _load_halves(base, offs_v, HALF + offs_v, ok_v, pool_ptr, b_off_ptr, rank_ptr, scale_ptr,
                              part_ptr, lrow, 2, lora_rows, k_blocks, b_g_stride, r_g_stride, n, col0,
                              HAS_LORA=HAS_LORA, MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, PAIR=PAIR,
                              PRELOAD=PRELOAD, GDC=GDC)
        v1 = v1.to(v_ptr.dtype.element_ty)
        v2 = v2.to(v_ptr.dtype.element_ty)
        if HAS_LORA:
            tl.store(base + offs_v, v1, mask=ok_v)
            tl.store(base + HALF + offs_v, v2, mask=ok_v)
        tl.store(slot + kv_skv + offs_v, v1.to(kv_ptr.dtype.element_ty), mask=ok_v)
        tl.store(slot + kv_skv + HALF + offs_v, v2.to(kv_ptr.dtype.element_ty), mask=ok_v)


@triton.jit
def _rope_kv_rows_kernel(
    q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, q_hstride, k_hstride, v_hstride,
    cos_ptr, sin_ptr, cs_stride,
    kv_ptr, page_ptr, slot_ptr, kv_sp, kv_skv, kv_ss, kv_sh, row0,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr, ROT_HALF: tl.constexpr, BLOCK_ROT: tl.constexpr, PASS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """``_rope_kv_kernel`` without LoRA, a program per row (every head as one tile): for the
    rows of a prefill, where a program per (row, head) moves 128 elements and launches are what
    cost. The same arithmetic per element, so the same bits."""
    row = row0 + tl.program_id(0)
    row64 = row.to(tl.int64)
    offs = tl.arange(0, BLOCK_ROT)
    ok = offs < ROT_HALF
    cos1 = tl.load(cos_ptr + row64 * cs_stride + offs, mask=ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + row64 * cs_stride + ROT_HALF + offs, mask=ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + row64 * cs_stride + offs, mask=ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + row64 * cs_stride + ROT_HALF + offs, mask=ok, other=0.0).to(tl.float32)[None, :]
    hq = tl.arange(0, BLOCK_HQ)
    q_ok = (hq < HQ)[:, None] & ok[None, :]
    base = q_ptr + row64 * q_stride + hq[:, None] * q_hstride + offs[None, :]
    x1 = tl.load(base, mask=q_ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + ROT_HALF, mask=q_ok, other=0.0).to(tl.float32)
    tl.store(base, (x1 * cos1 - x2 * sin1).to(q_ptr.dtype.element_ty), mask=q_ok)
    tl.store(base + ROT_HALF, (x2 * cos2 + x1 * sin2).to(q_ptr.dtype.element_ty), mask=q_ok)
    hk = tl.arange(0, BLOCK_HKV)
    k_ok = (hk < HKV)[:, None] & ok[None, :]
    slot_h = (kv_ptr + tl.load(page_ptr + row).to(tl.int64) * kv_sp + tl.load(slot_ptr + row).to(tl.int64) * kv_ss
              + hk[:, None] * kv_sh)
    slot = slot_h + offs[None, :]
    k_base = k_ptr + row64 * k_stride + hk[:, None] * k_hstride
    base = k_base + offs[None, :]
    x1 = tl.load(base, mask=k_ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + ROT_HALF, mask=k_ok, other=0.0).to(tl.float32)
    k1 = (x1 * cos1 - x2 * sin1).to(k_ptr.dtype.element_ty)
    k2 = (x2 * cos2 + x1 * sin2).to(k_ptr.dtype.element_ty)
    tl.store(base, k1, mask=k_ok)
    tl.store(base + ROT_HALF, k2, mask=k_ok)
    tl.store(slot, k1.to(kv_ptr.dtype.element_ty), mask=k_ok)
    tl.store(slot + ROT_HALF, k2.to(kv_ptr.dtype.element_ty), mask=k_ok)
    if PASS > 0:  # partial rotary: the key's remaining dims go to the page as they are
        offs_p = 2 * ROT_HALF + tl.arange(0, BLOCK_PASS)
        p_ok = (hk < HKV)[:, None] & (offs_p < 2 * ROT_HALF + PASS)[None, :]
        kp = tl.load(k_base + offs_p[None, :], mask=p_ok, other=0.0)
        tl.store(slot_h + offs_p[None, :], kp.to(kv_ptr.dtype.element_ty), mask=p_ok)
    offs_v = tl.arange(0, BLOCK_HALF)
    v_ok = (hk < HKV)[:, None] & (offs_v < HALF)[None, :]
    slot = slot_h + offs_v[None, :]
    base = v_ptr + row64 * v_stride + hk[:, None] * v_hstride + offs_v[None, :]
    v1 = tl.load(base, mask=v_ok, other=0.0)
    v2 = tl.load(base + HALF, mask=v_ok, other=0.0)
    tl.store(slot + kv_skv, v1.to(kv_ptr.dtype.element_ty), mask=v_ok)
    tl.store(slot + kv_skv + HALF, v2.to(kv_ptr.dtype.element_ty), mask=v_ok)


@triton.jit(do_not_specialize=("slots", "min_group", "groups_stride"))
def _swiglu_kernel(
    g_ptr, u_ptr, out_ptr, N, g_stride, u_stride, out_stride,
    pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, first_row, lora_rows, k_blocks, b_g_stride, r_g_stride,
    row0, nx_pool_ptr, nx_a_ptr, nx_rank_ptr, nx_part_ptr, groups_ptr, groups_stride, slots, min_group,
    HAS_LORA: tl.constexpr, MAX_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr,
    BLOCK_N: tl.constexpr, AHEAD: tl.constexpr, NX_BLOCK_R: tl.constexpr, PAIR: tl.constexpr,
    PRELOAD: tl.constexpr = False, GDC: tl.constexpr = False, HYBRID: tl.constexpr = False,
    BLOCK_M: tl.constexpr = 16, DOT_PRECISION: tl.constexpr = "ieee", HALF_S: tl.constexpr = False,
    GROUP_N: tl.constexpr = 16,
):
    """out[row0 + i, n block] = silu(gate) * up, each (+ the row's LoRA) rounded to the dtype
    first; silu rounded before the product, as the eager ops do. AHEAD (a launch over the LoRA
    rows): the next projection's shrink partials of this block too (``lora_ahead``). PRELOAD /
    GDC (``lora_gather.PDL``): the LoRA rows wait for the shrink's grid in their first rank
    loop, before reading the partials and before any store. Programs (slots + i, n block).
    HYBRID (``lora_gather.HYBRID_MIN_ROWS``): rows in groups of at least ``min_group`` rows are
    their group's: the first ``slots`` programs write those groups' rows (``swiglu_group``: one
    dot per group, B^T read once) and the rows' own programs do nothing; with no slots the rows'
    programs write them without LoRA (the grouped launch after this one rewrites them)."""
    pid = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs < N
    if HYBRID:  # (compiled only where taken: the other launches keep their registers)
        if pid < slots:
            start = tl.load(groups_ptr + pid)
            end = tl.load(groups_ptr + groups_stride + pid)
            if end - start >= tl.maximum(min_group, 1):
                if GDC:
                    gdc_wait()
                for c in range(0, BLOCK_N, GROUP_N):  # (GROUP_N columns at a time: fewer live registers)
                    cols = tl.program_id(1) * BLOCK_N + c + tl.arange(0, GROUP_N)
                    swiglu_group(g_ptr, u_ptr, out_ptr, N, g_stride, u_stride, out_stride, pool_ptr, b_off_ptr,
                                 rank_ptr, scale_ptr, groups_ptr, part_ptr, first_row, lora_rows, k_blocks,
                                 groups_stride, b_g_stride, r_g_stride, start, end, cols, cols < N, MAX_R=MAX_R,
                                 BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, DOT_PRECISION=DOT_PRECISION,
                                 HALF_S=HALF_S)
        else:
            row = row0 + pid - slots
            grouped, lrow = hybrid_row(row - first_row, groups_ptr + 3 * groups_stride, lora_rows, min_group,
                                       HYBRID=True)
            if (slots == 0) | (grouped == 0):
                _swiglu_row(g_ptr, u_ptr, out_ptr, N, g_stride, u_stride, out_stride, pool_ptr, b_off_ptr,
                            rank_ptr, scale_ptr, part_ptr, lora_rows, k_blocks, b_g_stride, r_g_stride, row, lrow,
                            offs, ok, nx_pool_ptr, nx_a_ptr, nx_rank_ptr, nx_part_ptr,
                            HAS_LORA=HAS_LORA, MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, AHEAD=AHEAD,
                            NX_BLOCK_R=NX_BLOCK_R, PAIR=PAIR, PRELOAD=PRELOAD, GDC=GDC)
    else:
        row = row0 + pid
        _swiglu_row(g_ptr, u_ptr, out_ptr, N, g_stride, u_stride, out_stride, pool_ptr, b_off_ptr, rank_ptr,
                    scale_ptr, part_ptr, lora_rows, k_blocks, b_g_stride, r_g_stride, row, row - first_row, offs, ok,
                    nx_pool_ptr, nx_a_ptr, nx_rank_ptr, nx_part_ptr,
                    HAS_LORA=HAS_LORA, MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, AHEAD=AHEAD,
                    NX_BLOCK_R=NX_BLOCK_R, PAIR=PAIR, PRELOAD=PRELOAD, GDC=GDC)


@triton.jit
def _swiglu_row(g_ptr, u_ptr, out_ptr, N, g_stride, u_stride, out_stride, pool_ptr, b_off_ptr, rank_ptr,
                scale_ptr, part_ptr, lora_rows, k_blocks, b_g_stride, r_g_stride, row, lrow, offs, ok,
                nx_pool_ptr, nx_a_ptr, nx_rank_ptr, nx_part_ptr,
                HAS_LORA: tl.constexpr, MAX_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr,
                AHEAD: tl.constexpr, NX_BLOCK_R: tl.constexpr, PAIR: tl.constexpr,
                PRELOAD: tl.constexpr = False, GDC: tl.constexpr = False):
    """``_swiglu_kernel``'s row ``row`` at columns ``offs``, its LoRA that of gathered row ``lrow``."""
    row64 = row.to(tl.int64)
    g = tl.load(g_ptr + row64 * g_stride + offs, mask=ok, other=0.0)
    u = tl.load(u_ptr + row64 * u_stride + offs, mask=ok, other=0.0)
    dtype = g.dtype
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    if HAS_LORA and PAIR:  # gate's and up's LoRA in one rank loop
        g, u = _with_lora_pair(g, u, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, 0, 1,
                               lora_rows, k_blocks, b_g_stride, r_g_stride, N, N, offs, ok, offs, ok,
                               MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, PRELOAD=PRELOAD, GDC=GDC)
        g = g.to(dtype).to(tl.float32)
        u = u.to(dtype).to(tl.float32)
    elif HAS_LORA:
        g = _with_lora(g, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, 0, lora_rows, k_blocks,
                       b_g_stride, r_g_stride, N, offs, ok, MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB,
                       PRELOAD=PRELOAD, GDC=GDC).to(dtype).to(tl.float32)
        u = _with_lora(u, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, part_ptr, lrow, 1, lora_rows, k_blocks,
                       b_g_stride, r_g_stride, N, offs, ok, MAX_R=MAX_R, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB,
                       PRELOAD=PRELOAD, GDC=GDC).to(dtype).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    act = (s * u).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row64 * out_stride + offs, act, mask=ok)
    if AHEAD:
        shrink_ahead(act.to(tl.float32), nx_pool_ptr, nx_a_ptr, nx_rank_ptr, nx_part_ptr, lrow,
                     tl.program_id(1), tl.num_programs(1), N, offs, ok, MAX_R=MAX_R, NX_BLOCK_R=NX_BLOCK_R)


# ----------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------


def _check_rows(name: str, t: torch.Tensor, rows: int, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.shape[0] != rows or t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} must have {rows} rows, dtype {dtype} and device {device}; got "
                         f"{getattr(t, 'shape', type(t))} {getattr(t, 'dtype', '')} on {getattr(t, 'device', '')}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride along its last dim; got strides {t.stride()}")


def _check_rope(q, k, v, cos, sin, kv_pool, layer, slot_pages, slot_offsets, lora) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q must be a [tokens, heads, head_dim] tensor of {SUPPORTED_DTYPES}; got "
                         f"{getattr(q, 'shape', type(q))} {getattr(q, 'dtype', '')}")
    t, _, d = q.shape
    _check_pool(kv_pool, layer)
    hkv = kv_pool.shape[4]
    for name, x in (("k", k), ("v", v)):
        _check_rows(name, x, t, q.dtype, q.device)
        if tuple(x.shape[1:]) != (hkv, d):
            raise ValueError(f"{name} must be [{t}, {hkv}, {d}] (the pool's kv heads, q's head_dim); got "
                             f"{tuple(x.shape)}")
    if d % 2 or tuple(kv_pool.shape[5:]) != (d,) or kv_pool.dtype != q.dtype or kv_pool.device != q.device:
        raise ValueError(f"kv_pool {tuple(kv_pool.shape)} {kv_pool.dtype} on {kv_pool.device} does not hold "
                         f"heads of q's even head_dim {d} in {q.dtype} on {q.device}")
    r = cos.shape[-1] if isinstance(cos, torch.Tensor) else 0
    if r % 2 or not 0 < r <= d:
        raise ValueError(f"cos must be as wide as the rotated dims (even, 2..head_dim={d}); got "
                         f"{tuple(getattr(cos, 'shape', ()))}")
    for name, c in (("cos", cos), ("sin", sin)):
        if c.numel() != t * r or c.shape[0] != t or c.dtype != q.dtype or c.device != q.device:
            raise ValueError(f"{name} must be [{t}, {r}] or [{t}, 1, {r}] {q.dtype} on {q.device}; got "
                             f"{tuple(c.shape)} {c.dtype}")
    for name, s in (("slot_pages", slot_pages), ("slot_offsets", slot_offsets)):
        if s.shape != (t,) or s.dtype not in (torch.int32, torch.int64) or s.device != q.device:
            raise ValueError(f"{name} must be a [{t}] int32/int64 tensor on {q.device}; got {tuple(s.shape)} {s.dtype}")
    if lora is not None:
        lora.check((q.shape[1] * d, hkv * d, hkv * d), t)


@torch.no_grad()
def rope_write_kv_reference(q, k, v, cos, sin, kv_pool, layer, slot_pages, slot_offsets,
                            lora: GatheredLora | None = None) -> None:
    """In place: q ``[T, Hq, D]``, k, v ``[T, Hkv, D]`` (+)= the decode rows' LoRA (``lora``:
    projections q, k, v, rows from ``lora.first_row``); RoPE on q and k (cos, sin ``[T, R]`` or
    ``[T, 1, R]``: the same angle for every head; ``R`` < D rotates only each head's first R
    dims, partial rotary); k and v written to ``kv_pool`` at layer
    ``layer``, token t into page ``slot_pages[t]``, slot ``slot_offsets[t]`` (as ``write_kv``)."""
    _check_rope(q, k, v, cos, sin, kv_pool, layer, slot_pages, slot_offsets, lora)
    t, _, d = q.shape
    if lora is not None:
        lora.add_reference([q.view(t, -1), k.view(t, -1), v.view(t, -1)])
    r = cos.shape[-1]
    cos, sin = cos.reshape(t, 1, r), sin.reshape(t, 1, r)
    q.copy_(apply_rope(q, cos, sin))
    k.copy_(apply_rope(k, cos, sin))
    write_kv(kv_pool, layer, k, v, slot_pages, slot_offsets)


@torch.no_grad()
def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, lora: GatheredLora | None = None) -> torch.Tensor:
    """``silu(gate (+ LoRA)) * (up (+ LoRA))`` ``[T, I]``: the decode rows' LoRA (``lora``:
    projections gate, up) added to copies; gate and up are not written."""
    _check_swiglu(gate, up, lora)
    if lora is not None:
        gate, up = gate.clone(), up.clone()
        lora.add_reference([gate, up])
    return torch.nn.functional.silu(gate) * up


def _check_swiglu(gate, up, lora) -> None:
    if not isinstance(gate, torch.Tensor) or gate.dim() != 2 or gate.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"gate must be a [tokens, intermediate] tensor of {SUPPORTED_DTYPES}; got "
                         f"{getattr(gate, 'shape', type(gate))}")
    _check_rows("up", up, gate.shape[0], gate.dtype, gate.device)
    if up.shape != gate.shape or gate.stride(1) != 1:
        raise ValueError(f"gate and up must both be {tuple(gate.shape)} with unit column stride; got "
                         f"{tuple(up.shape)}, strides {gate.stride()}")
    if lora is not None:
        lora.check((gate.shape[1], gate.shape[1]), gate.shape[0])


# ----------------------------------------------------------------------------------------------
# Public functions and launchers
# ----------------------------------------------------------------------------------------------


def _resolve(backend: str, t: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {BACKENDS}")
    return ("triton" if t.is_cuda else "torch") if backend == "auto" else backend


_NO_LORA_META = {"HAS_LORA": False, "MAX_R": MAX_RANK, "BLOCK_R": 16, "BLOCK_KB": 1}


def _no_lora_args(ref: torch.Tensor) -> tuple:
    return (ref, ref, ref, ref, ref, 0, 0, 1, 0, 0)


def _row_launches(t: int, lora: GatheredLora | None) -> list[tuple[int, int, bool]]:
    """(first row, rows, with LoRA) per launch over ``t`` rows: the LoRA variant only over the
    gathered rows ``[first_row, first_row + B)`` (a padded step's decode rows), the plain one
    (wider blocks, no per-row table reads) over the rows before and after them (its prefill
    rows and padding), so a prefill of thousands of rows does not run the LoRA variant."""
    if lora is None:
        return [(0, t, False)]
    a, b = lora.first_row, lora.first_row + lora.ranks.shape[1]
    return [(r0, n, with_lora) for r0, n, with_lora in ((0, a, False), (a, b - a, True), (b, t - b, False)) if n > 0]


def _lora_args(lora: GatheredLora, block_k: int | None, block_r: int | None, num_warps: int):
    """The LoRA half of a kernel's arguments and its constexprs (the group's shrink launched now,
    or its ``partials`` launched beside the GEMM: no PDL edge then)."""
    part, k_blocks = lora_shrink(lora, block_k=block_k, block_r=block_r, num_warps=num_warps)
    _, block_r = row_blocks(lora.x.device, lora.ranks.shape[1], block_k, block_r)
    args = (lora.pool, lora.b_offsets, lora.ranks, lora.scales, part, lora.first_row, lora.ranks.shape[1], k_blocks,
            lora.b_offsets.stride(0), lora.ranks.stride(0))
    pdl_meta, pdl_launch, _ = _gather.pdl_options(lora.x.device, lora.ranks.shape[1], lora.rank_bound,
                                                  beside=lora.partials is not None)
    return args, {"HAS_LORA": True, "MAX_R": MAX_RANK, "BLOCK_R": block_r,
                  "BLOCK_KB": triton.next_power_of_2(k_blocks), **pdl_meta, **pdl_launch}


def rope_write_kv(q, k, v, cos, sin, kv_pool, layer, slot_pages, slot_offsets, *,
                  lora: GatheredLora | None = None, backend: str = "auto",
                  block_k: int | None = None, block_r: int | None = None, num_warps: int | None = None) -> None:
    """Same contract as ``rope_write_kv_reference``; ``backend``: "torch", "triton" or "auto".
    The Triton path: the q/k/v shrink (if ``lora``), then one launch over (row, Hq + Hkv
    heads); no host read, so it can be captured in a CUDA graph. q, k, v may be strided views
    (of one fused q|k|v GEMM output): unit stride along head_dim only. ``block_k`` /
    ``block_r`` / ``num_warps``: the shrink's knobs (``lora_shrink``)."""
    if _resolve(backend, q) == "torch":
        return rope_write_kv_reference(q, k, v, cos, sin, kv_pool, layer, slot_pages, slot_offsets, lora)
    _check_rope(q, k, v, cos, sin, kv_pool, layer, slot_pages, slot_offsets, lora)
    _require_triton(q)
    t, hq, d = q.shape
    hkv = kv_pool.shape[4]
    if t == 0:
        return None
    r = cos.shape[-1]
    cos, sin = cos.reshape(t, r), sin.reshape(t, r)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    kv_layer = kv_pool.select(1, layer)  # [P, 2, S, Hkv, D]: the pointer carries the layer's offset
    sp, skv, ss, sh, _ = kv_layer.stride()
    if lora is not None and _grouped(lora):
        # each group's B^T read once: the LoRA added into q, k, v in place (rounded as the
        # per-row kernel rounds it), then every row takes the plain kernels
        part, k_blocks = lora_shrink(lora, block_k=block_k, block_r=block_r, num_warps=num_warps)
        rows = slice(lora.first_row, lora.first_row + lora.ranks.shape[1])
        for g, y in enumerate((q, k, v)):
            lora_grouped_expand(lora, part, k_blocks, g, y[rows], head_dim=d, block_r=block_r)
        lora = None
    plain = (_no_lora_args(q), _NO_LORA_META)  # rows without LoRA: inert stand-ins
    gathered = plain if lora is None else _lora_args(lora, block_k, block_r, num_warps)
    half, block_half = d // 2, triton.next_power_of_2(d // 2)
    widths = dict(ROT_HALF=r // 2, BLOCK_ROT=triton.next_power_of_2(r // 2), PASS=d - r,
                  BLOCK_PASS=triton.next_power_of_2(max(d - r, 1)))
    no_groups, _, _ = _gather.hybrid_expand_options(0, None, q.dtype, q)
    # a group's dot needs tiles of at least 16 columns on a GPU (the interpreter takes any)
    dots = not q.is_cuda or min(widths["BLOCK_ROT"], block_half, widths["BLOCK_PASS"] if d > r else 16) >= 16
    for row0, rows, with_lora in _row_launches(t, lora):
        if not with_lora and rows >= ROPE_ROWS_KERNEL_MIN_ROWS:  # a prefill's rows: a program per row
            _rope_kv_rows_kernel[(rows,)](
                q, k, v, q.stride(0), k.stride(0), v.stride(0), q.stride(1), k.stride(1), v.stride(1),
                cos, sin, cos.stride(0), kv_layer, slot_pages, slot_offsets, sp, skv, ss, sh, row0,
                HQ=hq, HKV=hkv, HALF=half, BLOCK_HQ=triton.next_power_of_2(hq),
                BLOCK_HKV=triton.next_power_of_2(hkv), BLOCK_HALF=block_half, **widths, num_warps=ROPE_ROWS_WARPS,
            )
            continue
        args, meta = gathered if with_lora else plain
        groups_args, groups_meta, slots = (no_groups, {}, 0)
        if with_lora and _gather.HYBRID_QKV and _gather.HYBRID_FUSED and dots:
            groups_args, groups_meta, slots = _gather.hybrid_expand_options(rows, lora.groups, q.dtype, q)
        _rope_kv_kernel[(slots + rows, hq + hkv)](
            q, k, v, q.stride(0), k.stride(0), v.stride(0), q.stride(1), k.stride(1), v.stride(1),
            cos, sin, cos.stride(0), kv_layer, slot_pages, slot_offsets, sp, skv, ss, sh, *args, row0,
            *groups_args[1:], HQ=hq, HKV=hkv, HALF=half, BLOCK_HALF=block_half, **widths, **meta, **groups_meta,
            PAIR=_gather.PAIR_EPILOGUES, num_warps=num_warps or 4,
        )
    return None


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, lora: GatheredLora | None = None, backend: str = "auto",
           block_n: int | None = None, block_k: int | None = None, block_r: int | None = None,
           num_warps: int | None = None) -> torch.Tensor:
    """Same contract as ``swiglu_reference``; ``backend``: "torch", "triton" or "auto". The
    Triton path: the gate/up shrink (if ``lora``), then one launch over (row, column block);
    gate and up may be column slices of one fused gate|up GEMM output."""
    return swiglu_ahead(gate, up, lora=lora, backend=backend, block_n=block_n, block_k=block_k, block_r=block_r,
                        num_warps=num_warps)[0]


def swiglu_ahead(gate: torch.Tensor, up: torch.Tensor, *, lora: GatheredLora | None = None,
                 ahead: ShrinkAhead | None = None, backend: str = "auto", block_n: int | None = None,
                 block_k: int | None = None, block_r: int | None = None,
                 num_warps: int | None = None, prefill: tuple[SegmentLora, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, int] | None]:
    """``swiglu`` -> (its output, the next projection's shrink partials or None). With ``ahead``
    (down's A tables for ``lora``'s rows) the LoRA rows' launch also computes down's shrink
    (``lora_ahead``) where it applies (Triton, per-row LoRA, at most
    ``lora_gather.AHEAD_MAX_ROWS`` rows): ``(part, k_blocks)`` for ``lora_gather(partials=)``;
    None elsewhere (down's gather then runs its own shrink). ``prefill`` (Triton's kernels): the
    prefill rows' gate/up tables over a table covering every row and their split-K shrink's S
    (``segment_swiglu.swiglu_segments``): every row through that kernel, their LoRA added in it,
    instead of the plain launches; then ``lora``'s rows as without it, and the adapted prefill
    rows inside their range (a captured step's) once more through it; with the torch epilogue,
    the adapted prefill rows written again through it after the reference."""
    if _resolve(backend, gate) == "torch":
        out = swiglu_reference(gate, up, lora)
        if prefill is not None:  # (the prefill rows' kernels are Triton's: their rows written again)
            swiglu_segments(gate, up, prefill[0], prefill[1], out=out, adapted_only=True)
        return out, None
    _check_swiglu(gate, up, lora)
    _require_triton(gate)
    t, n = gate.shape
    out = torch.empty(t, n, dtype=gate.dtype, device=gate.device)
    if t == 0:
        return out, None
    grouped = lora if lora is not None and _grouped(lora) else None
    if grouped is not None:  # every row plain first, then the groups' rows again with their LoRA
        lora = None
    plain = (_no_lora_args(gate), _NO_LORA_META)  # rows without LoRA: inert stand-ins
    gathered = plain if lora is None else _lora_args(lora, block_k, block_r, num_warps)
    hybrid = lora is not None and _gather.hybrid_applies(lora.ranks.shape[1], lora.groups)
    fused = None if hybrid else _ahead_args(gate, lora, ahead, block_n)
    no_groups, _, _ = _gather.hybrid_expand_options(0, None, out.dtype, out)
    if prefill is not None:  # every row (the decode rows' rewritten below), the prefill rows' LoRA in
        swiglu_segments(gate, up, prefill[0], prefill[1], out=out)
    for row0, rows, with_lora in _row_launches(t, lora):
        if prefill is not None and not with_lora:
            continue
        args, meta = gathered if with_lora else plain
        groups_args, groups_meta, slots = (no_groups, {}, 0)
        if with_lora:
            groups_args, groups_meta, slots = _gather.hybrid_expand_options(
                rows, lora.groups, out.dtype, out, _gather.expand_block_n(gate.device, rows, block_n))
        groups_args = groups_args[1:]  # (the kernel has its rows already: lora_rows)
        # the plain rows: (2048, 8 warps) from 1,024 rows, as fast as any setting swept at 4,096
        # and 16,384 rows of the 8B shape on an H100 (docs/BENCHMARKS.md, generation engine)
        bn, warps = block_n, num_warps or (_gather.ROW_EXPAND_WARPS if with_lora else 4)
        if not with_lora and block_n is None and rows >= 1024 and gate.is_cuda:
            bn, warps = 2048, 8
        if with_lora:
            bn = _gather.expand_block_n(gate.device, rows, bn)
        nx, nx_meta = (fused[0], fused[1]) if with_lora and fused else ((gate, gate, gate, gate), _NO_AHEAD)
        if with_lora and fused:
            bn, warps = fused[2], num_warps or fused[3]
        bn = bn or (1024 if gate.is_cuda else 32)
        _swiglu_kernel[(slots + rows, triton.cdiv(n, bn))](
            gate, up, out, n, gate.stride(0), up.stride(0), out.stride(0), *args, row0, *nx, *groups_args,
            **meta, **nx_meta, **groups_meta, BLOCK_N=bn, PAIR=_gather.PAIR_EPILOGUES, num_warps=warps,
        )
        if groups_meta and not slots:  # the hybrid's groups by a launch of their own
            _swiglu_grouped(gate, up, out, dataclasses.replace(lora, partials=(args[4], args[7])), block_k, block_r,
                            num_warps, min_rows=_gather.HYBRID_MIN_GROUP)
    if grouped is not None:
        _swiglu_grouped(gate, up, out, grouped, block_k, block_r, num_warps)
    decode = grouped or lora
    if prefill is not None and decode is not None:  # prefill rows inside the decode rows' range, written again
        swiglu_segments(gate, up, prefill[0], prefill[1], out=out, adapted_only=True,
                        rows=(decode.first_row, decode.first_row + decode.ranks.shape[1]))
    return out, (None if not fused else (fused[0][3], triton.cdiv(n, fused[2])))


_NO_AHEAD = {"AHEAD": False, "NX_BLOCK_R": 16}


def _ahead_args(gate: torch.Tensor, lora: GatheredLora | None, ahead: ShrinkAhead | None, block_n: int | None):
    """(next-shrink pointers, constexprs, column block, warps) of a fused LoRA-row launch, or None
    where the next projection's shrink is not folded in (no ``ahead``, no per-row LoRA, more rows
    than ``AHEAD_MAX_ROWS``)."""
    rows = 0 if lora is None else lora.ranks.shape[1]
    if ahead is None or not _gather.ahead_rows(rows):
        return None
    ahead.check(rows, gate.device, gate.dtype)
    bn = block_n or (_gather.AHEAD_BLOCK_N if gate.is_cuda else 32)
    part = torch.empty(rows * triton.cdiv(gate.shape[1], bn) * MAX_RANK, dtype=torch.float32, device=gate.device)
    nx_block_r = row_blocks(gate.device, rows)[1]
    return (ahead.pool, ahead.a_offsets, ahead.ranks, part), {"AHEAD": True, "NX_BLOCK_R": nx_block_r}, bn, _gather.AHEAD_WARPS


def _grouped(lora: GatheredLora) -> bool:
    """Whether the epilogue takes the grouped expand (``lora_gather.GROUPED_EXPAND_MIN_ROWS``)."""
    return takes_groups(lora.ranks.shape[1], lora.groups, _gather.GROUPED_EXPAND_MIN_ROWS)


def _swiglu_grouped(gate, up, out, lora: GatheredLora, block_k, block_r, num_warps, min_rows: int = 0) -> None:
    """The gate/up shrink, then ``out``'s LoRA rows rewritten a group at a time (``min_rows``: only
    the groups of at least that many rows, over the first ``hybrid_slots`` columns)."""
    part, k_blocks = lora_shrink(lora, block_k=block_k, block_r=block_r, num_warps=num_warps)
    _, block_r = row_blocks(gate.device, lora.ranks.shape[1], block_k, block_r)
    n, groups = gate.shape[1], lora.groups
    bn = _gather.GROUPED_EXPAND_BLOCK_N if gate.is_cuda else 16
    width = _gather.hybrid_slots(groups) if min_rows > 1 else groups.shape[1]
    _swiglu_grouped_kernel[(width, triton.cdiv(n, bn))](
        gate, up, out, n, gate.stride(0), up.stride(0), out.stride(0), lora.pool, lora.b_offsets, lora.ranks,
        lora.scales, groups, part, lora.first_row, lora.ranks.shape[1], k_blocks, groups.stride(0),
        lora.b_offsets.stride(0), lora.ranks.stride(0), _gather.GROUPED_EXPAND_LOOP_ROWS, min_rows, MAX_R=MAX_RANK,
        BLOCK_M=_gather.group_block_m(), BLOCK_R=_gather.grouped_expand_block_r(block_r),
        BLOCK_KB=triton.next_power_of_2(k_blocks), BLOCK_N=bn, DOT_PRECISION=_gather.expand_dot_precision(out.dtype),
        ROW_LOOP=_gather.GROUPED_EXPAND_ROW_LOOP, HALF_S=_gather.expand_half_s(out.dtype),
        num_warps=_gather.GROUPED_EXPAND_WARPS, **(_gather.hybrid_stages() if min_rows > 1 else {}),
    )
