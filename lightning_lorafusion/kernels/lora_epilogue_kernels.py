"""The Triton kernels of the fused decode epilogues (``lora_epilogues.py`` holds their checks,
torch references and launchers): ``_rope_kv_kernel`` (a program per row and head) and
``_rope_kv_rows_kernel`` (a program per row without LoRA) add the LoRA delta to q, k, v, rotate q
and k and write k, v into their KV-cache pages; ``_swiglu_kernel`` computes ``silu(gate) * up``
with the LoRA delta added to gate and up. With the hybrid expands (``lora_gather.HYBRID_MIN_ROWS``)
their first programs are group programs (``_rope_group``, ``lora_group_delta``); the rest run
the per-row helpers (``_rope_row``, ``_swiglu_row``, ``_load_cols``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .lora_ahead import shrink_ahead
from .lora_grouped_kernels import _with_lora, _with_lora_pair, gdc_wait, hybrid_row, lora_group_delta, swiglu_group


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
def _group_rotated(base, offs, ok, m_ok, cos1, cos2, sin1, sin2, pool_ptr, b_off_ptr, rank_ptr, scale_ptr,
                   groups_ptr, part_ptr, start, end, g, lora_rows, k_blocks, groups_stride, b_g_stride, r_g_stride,
                   N, col0, ROT_HALF: tl.constexpr, MAX_R: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   HALF_S: tl.constexpr):
    """One head's two rotated halves for a group's rows (projection ``g``: its LoRA by one dot,
    ``_group_cols``), fp32 before the store's rounding."""
    x1 = _group_cols(base, offs, ok, m_ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr, part_ptr, start,
                     end, g, lora_rows, k_blocks, groups_stride, b_g_stride, r_g_stride, N, col0, MAX_R=MAX_R,
                     BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, DOT_PRECISION=DOT_PRECISION,
                     HALF_S=HALF_S)
    x2 = _group_cols(base, ROT_HALF + offs, ok, m_ok, pool_ptr, b_off_ptr, rank_ptr, scale_ptr, groups_ptr,
                     part_ptr, start, end, g, lora_rows, k_blocks, groups_stride, b_g_stride, r_g_stride, N, col0,
                     MAX_R=MAX_R, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB,
                     DOT_PRECISION=DOT_PRECISION, HALF_S=HALF_S)
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2


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
        r1, r2 = _group_rotated(base, offs, ok, m_ok, cos1, cos2, sin1, sin2, pool_ptr, b_off_ptr, rank_ptr,
                                scale_ptr, groups_ptr, part_ptr, start, end, 0, lora_rows, k_blocks, groups_stride,
                                b_g_stride, r_g_stride, n, col0, ROT_HALF=ROT_HALF, MAX_R=MAX_R, BLOCK_M=BLOCK_M,
                                BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, DOT_PRECISION=DOT_PRECISION, HALF_S=HALF_S)
        tl.store(base[:, None] + offs[None, :], r1.to(q_ptr.dtype.element_ty), mask=live)
        tl.store(base[:, None] + ROT_HALF + offs[None, :], r2.to(q_ptr.dtype.element_ty), mask=live)
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
        r1, r2 = _group_rotated(base, offs, ok, m_ok, cos1, cos2, sin1, sin2, pool_ptr, b_off_ptr, rank_ptr,
                                scale_ptr, groups_ptr, part_ptr, start, end, 1, lora_rows, k_blocks, groups_stride,
                                b_g_stride, r_g_stride, n, col0, ROT_HALF=ROT_HALF, MAX_R=MAX_R, BLOCK_M=BLOCK_M,
                                BLOCK_R=BLOCK_R, BLOCK_KB=BLOCK_KB, DOT_PRECISION=DOT_PRECISION, HALF_S=HALF_S)
        k1 = r1.to(k_ptr.dtype.element_ty)
        k2 = r2.to(k_ptr.dtype.element_ty)
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
