"""Decode attention over the paged KV cache (one query token per row, GQA, sliding window).

KV pool layout ``kv_pool [P, L, 2, S, Hkv, D]``: P pages of S consecutive tokens of one
sequence, holding that token range's keys (index 0) and values (index 1) for all L layers.
Row b's tokens 0..seq_lens[b]-1 live in pages ``page_table[b, 0..]`` in order; token t sits
in page ``page_table[b, t // S]`` at slot ``t % S``. Inference only (no autograd).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .triton_launch import sm_count

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("torch", "triton", "auto")
_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def soft_cap_log2(s, cap_log2):
    """``cap * tanh(x / cap)`` of scores in log2 units (``s = x * log2(e)``, ``cap_log2 = cap *
    log2(e)``), in fp32; tanh(y) as ``1 - 2 / (exp(2y) + 1)``, exact at both saturations."""
    return cap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * s / cap_log2) + 1.0))


# Per-step integers that only index tables: the page table's width (a mixed step's eager decode
# part gets the step's longest request; see paged_prefill.PREFILL_UNSPECIALISED) and the split
# count of the combine; left unspecialised so that no width compiles a variant of its own mid-run.
DECODE_UNSPECIALISED = ("pt_stride",)
COMBINE_UNSPECIALISED = ("splits",)
# the balanced kernel's rows and item target (a launch of one row would specialise both to 1)
BALANCED_UNSPECIALISED = ("pt_stride", "rows", "target")


@triton.jit
def _attend_tokens(
    q, kv_head, pt_row, t_begin, t_end, qk_scale, cap_log2, stride_p, stride_kv, stride_s,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The query heads ``q [BLOCK_G, BLOCK_D]`` of one kv head over tokens ``t_begin ..
    t_end - 1`` of one row -> unnormalised ``(m, l, acc)`` (base-2 online softmax, fp32).

    Tokens are gathered through the page table one by one (token t: page t // PAGE, slot
    t % PAGE), so any page size works with any BLOCK_T; each K/V tile is loaded once for the
    whole group. An empty range leaves m = -inf, l = 0, acc = 0.
    """
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_T)
    d_ok = offs_d < HEAD_DIM
    m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for t0 in range(t_begin, t_end, BLOCK_T):
        t = t0 + offs_t
        t_ok = t < t_end
        page = tl.load(pt_row + t // PAGE, mask=t_ok, other=0).to(tl.int64)
        tok = kv_head + page * stride_p + (t % PAGE) * stride_s
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(tok[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(tok[:, None] + stride_kv + offs_d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G, T], log2 units
        if HAS_SOFTCAP:
            scores = soft_cap_log2(scores, cap_log2)
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    return m, l, acc


@triton.jit
def _group_query(q_ptr, row, head, q_stride_b, q_stride_h, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """The GROUP query heads of kv head ``head`` in ``row``: (q [BLOCK_G, BLOCK_D], their head
    indices, the dim offsets, the heads' mask, the output mask)."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    out_mask = g_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_heads = head * GROUP + offs_g
    q = tl.load(q_ptr + row.to(tl.int64) * q_stride_b + q_heads[:, None] * q_stride_h + offs_d[None, :],
                mask=out_mask, other=0.0)
    return q, q_heads, offs_d, g_ok, out_mask


@triton.jit(do_not_specialize=DECODE_UNSPECIALISED)
def _paged_decode_kernel(
    q_ptr, kv_ptr, pt_ptr, len_ptr, out_ptr, part_o_ptr, part_ml_ptr,
    qk_scale, window, cap_log2, q_stride_b, q_stride_h, pt_stride,
    stride_p, stride_kv, stride_s, stride_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (row, kv head, split): the GROUP query heads of one kv head attend together to
    the split's share of the row's tokens (``_attend_tokens``).

    With SPLIT (flash-decoding: the grid's third axis cuts each row's tokens into equal shares)
    each program writes its unnormalised output and (max, sum) for ``_combine_splits_kernel``;
    the split count is not a compile-time constant. (The engine's "per-row" splits; the
    balanced kernel below is the default.)
    """
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    seq_len = tl.load(len_ptr + row)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    share = tl.cdiv(tl.cdiv(seq_len - lo, splits), BLOCK_T) * BLOCK_T
    t_begin = lo + split * share
    t_end = tl.minimum(seq_len, t_begin + share)
    q, q_heads, offs_d, g_ok, out_mask = _group_query(q_ptr, row, head, q_stride_b, q_stride_h, GROUP, HEAD_DIM,
                                                      BLOCK_G, BLOCK_D)
    kv_head = kv_ptr + head * stride_h  # kv_ptr: the layer's slice of the pool
    pt_row = pt_ptr + row.to(tl.int64) * pt_stride
    m, l, acc = _attend_tokens(q, kv_head, pt_row, t_begin, t_end, qk_scale, cap_log2, stride_p, stride_kv,
                               stride_s, HEAD_DIM, PAGE, HAS_SOFTCAP, BLOCK_G, BLOCK_D, BLOCK_T, DOT_PRECISION)
    if not SPLIT:
        out = acc / l[:, None]
        tl.store(out_ptr + (row.to(tl.int64) * GROUP * tl.num_programs(1) + q_heads[:, None]) * HEAD_DIM
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # partials [B, Hq, splits, D] and [B, Hq, splits, 2]; an empty split leaves m = -inf, l = 0
        part = (row.to(tl.int64) * GROUP * tl.num_programs(1) + q_heads) * splits + split
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + part * 2, m, mask=g_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l, mask=g_ok)


@triton.jit(do_not_specialize=BALANCED_UNSPECIALISED)
def _paged_decode_balanced_kernel(
    q_ptr, kv_ptr, pt_ptr, len_ptr, out_ptr, part_o_ptr, part_ml_ptr, items_ptr,
    qk_scale, window, cap_log2, q_stride_b, q_stride_h, pt_stride, rows, target,
    stride_p, stride_kv, stride_s, stride_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, MIN_CHUNK: tl.constexpr, MAX_ITEMS: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (work item, kv head): work items are chunks of ``chunk`` consecutive tokens of
    one row, numbered row after row; ``chunk`` follows the step's total tokens, not its rows.

    Every program reads all ``rows`` lengths and derives the same ``chunk`` (a multiple of
    BLOCK_T, at least MIN_CHUNK, at least ``total / target`` and at least ``longest /
    MAX_ITEMS``), so a row holds ``ceil(len / chunk) <= MAX_ITEMS`` items and all rows together
    at most ``target + rows``: the grid's first axis, fixed by the launch's rows (CUDA-graph
    safe). A row's items share its tokens equally (in BLOCK_T multiples: no item is empty).
    Programs past the last item return at once. A row of one item writes its output;
    a row of several writes one partial (output, max, sum) per item into ``part_*`` at its item
    index, and its first item's program records (first item, items) in ``items_ptr`` for
    ``_combine_items_kernel``.
    """
    item = tl.program_id(0)
    head = tl.program_id(1)
    hq = GROUP * tl.num_programs(1)
    offs_b = tl.arange(0, BLOCK_B)
    lens = tl.load(len_ptr + offs_b, mask=offs_b < rows, other=0)
    spans = lens
    if HAS_WINDOW:
        spans = tl.minimum(lens, window)
    chunk = tl.maximum(tl.cdiv(tl.sum(spans), target), tl.cdiv(tl.max(spans), MAX_ITEMS))
    chunk = tl.cdiv(tl.maximum(chunk, MIN_CHUNK), BLOCK_T) * BLOCK_T
    counts = tl.cdiv(spans, chunk)
    ends = tl.cumsum(counts, axis=0)
    if item < tl.sum(counts):
        row = tl.sum((ends <= item).to(tl.int32))
        at_row = offs_b == row
        n_items = tl.sum(tl.where(at_row, counts, 0))
        first = tl.sum(tl.where(at_row, ends, 0)) - n_items
        seq_len = tl.sum(tl.where(at_row, lens, 0))
        span = tl.sum(tl.where(at_row, spans, 0))
        share = tl.cdiv(tl.cdiv(span, n_items), BLOCK_T) * BLOCK_T  # equal shares, none empty
        t_begin = seq_len - span + (item - first) * share
        t_end = tl.minimum(seq_len, t_begin + share)
        q, q_heads, offs_d, g_ok, out_mask = _group_query(q_ptr, row, head, q_stride_b, q_stride_h, GROUP,
                                                          HEAD_DIM, BLOCK_G, BLOCK_D)
        kv_head = kv_ptr + head * stride_h
        pt_row = pt_ptr + row.to(tl.int64) * pt_stride
        m, l, acc = _attend_tokens(q, kv_head, pt_row, t_begin, t_end, qk_scale, cap_log2, stride_p,
                                   stride_kv, stride_s, HEAD_DIM, PAGE, HAS_SOFTCAP, BLOCK_G, BLOCK_D, BLOCK_T,
                                   DOT_PRECISION)
        if n_items == 1:
            tl.store(out_ptr + (row.to(tl.int64) * hq + q_heads[:, None]) * HEAD_DIM + offs_d[None, :],
                     (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
        else:  # partials [items, Hq, D] and [items, Hq, 2]
            part = item.to(tl.int64) * hq + q_heads
            tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
            tl.store(part_ml_ptr + part * 2, m, mask=g_ok)
            tl.store(part_ml_ptr + part * 2 + 1, l, mask=g_ok)
        if (head == 0) & (item == first):
            tl.store(items_ptr + row * 2, first)
            tl.store(items_ptr + row * 2 + 1, n_items)


@triton.jit
def _combine_items_kernel(
    part_o_ptr, part_ml_ptr, items_ptr, out_ptr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (row, kv head): merge the partial softmaxes (base 2) of the GROUP query heads of
    a row of several work items (``_paged_decode_balanced_kernel``); a row of one item was
    written already."""
    row = tl.program_id(0)
    n_items = tl.load(items_ptr + row * 2 + 1)
    if n_items > 1:
        hq = GROUP * tl.num_programs(1)
        first = tl.load(items_ptr + row * 2)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < n_items
        d_ok = offs_d < HEAD_DIM
        for g in tl.static_range(GROUP):
            head = tl.program_id(1) * GROUP + g
            part = (first + offs_s).to(tl.int64) * hq + head
            m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=float("-inf"))
            l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
            w = tl.exp2(m - tl.max(m, axis=0))  # every item holds tokens: the max is finite
            o = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=s_ok[:, None] & d_ok[None, :], other=0.0)
            out = tl.sum(o * w[:, None], axis=0) / tl.sum(l * w, axis=0)
            tl.store(out_ptr + (row.to(tl.int64) * hq + head) * HEAD_DIM + offs_d,
                     out.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _stream_layout(len_ptr, rows, window, programs, HAS_WINDOW: tl.constexpr, MIN_CHUNK: tl.constexpr,
                   MAX_ITEMS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    """The streamed kernel's layout from all rows' lengths -> (lengths, spans, their running
    ends, tokens per program): each kv head's rows' tokens end to end, cut in equal ranges."""
    offs_b = tl.arange(0, BLOCK_B)
    lens = tl.load(len_ptr + offs_b, mask=offs_b < rows, other=0)
    spans = lens
    if HAS_WINDOW:
        spans = tl.minimum(lens, window)
    width = tl.maximum(tl.cdiv(tl.sum(spans), programs), tl.cdiv(tl.max(spans), MAX_ITEMS - 1))
    width = tl.cdiv(tl.maximum(width, MIN_CHUNK), BLOCK_T) * BLOCK_T
    return lens, spans, tl.cumsum(spans, axis=0), width


@triton.jit(do_not_specialize=BALANCED_UNSPECIALISED)
def _paged_decode_stream_kernel(
    q_ptr, kv_ptr, pt_ptr, len_ptr, out_ptr, part_o_ptr, part_ml_ptr,
    qk_scale, window, cap_log2, q_stride_b, q_stride_h, pt_stride, rows, target,
    stride_p, stride_kv, stride_s, stride_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, MIN_CHUNK: tl.constexpr, MAX_ITEMS: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (p, kv head) of ``target`` per kv head: the rows' tokens laid end to end, program p
    takes tokens ``[p * width, (p + 1) * width)`` of them (``_stream_layout``), row piece by row
    piece. A row inside the range writes its output; a piece of a row that begins before the
    range writes partial slot ``2p`` and one that ends after it slot ``2p + 1``, merged by
    ``_combine_stream_kernel``. ``width`` >= longest / (MAX_ITEMS - 1): a row touches at most
    MAX_ITEMS programs."""
    prog = tl.program_id(0)
    head = tl.program_id(1)
    hq = GROUP * tl.num_programs(1)
    offs_b = tl.arange(0, BLOCK_B)
    lens, spans, ends, width = _stream_layout(len_ptr, rows, window, target, HAS_WINDOW, MIN_CHUNK, MAX_ITEMS,
                                              BLOCK_B, BLOCK_T)
    total = tl.sum(spans)
    start = prog * width
    end = tl.minimum(start + width, total)
    if start < total:
        row = tl.sum((ends <= start).to(tl.int32))
        r_begin = tl.sum(tl.where(offs_b == row, ends - spans, 0))
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < GROUP
        d_ok = offs_d < HEAD_DIM
        out_mask = g_ok[:, None] & d_ok[None, :]
        q_heads = head * GROUP + offs_g
        kv_head = kv_ptr + head * stride_h
        while r_begin < end:
            seq_len = tl.load(len_ptr + row)
            span = seq_len
            if HAS_WINDOW:
                span = tl.minimum(seq_len, window)
            lo = tl.maximum(start, r_begin)
            hi = tl.minimum(end, r_begin + span)
            t_begin = seq_len - span + lo - r_begin
            q = tl.load(q_ptr + row.to(tl.int64) * q_stride_b + q_heads[:, None] * q_stride_h + offs_d[None, :],
                        mask=out_mask, other=0.0)
            pt_row = pt_ptr + row.to(tl.int64) * pt_stride
            m, l, acc = _attend_tokens(q, kv_head, pt_row, t_begin, t_begin + hi - lo, qk_scale, cap_log2,
                                       stride_p, stride_kv, stride_s, HEAD_DIM, PAGE, HAS_SOFTCAP, BLOCK_G, BLOCK_D,
                                       BLOCK_T, DOT_PRECISION)
            if (r_begin >= start) & (r_begin + span <= end):
                tl.store(out_ptr + (row.to(tl.int64) * hq + q_heads[:, None]) * HEAD_DIM + offs_d[None, :],
                         (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
            else:  # partials [2 * programs, Hq, D] and [2 * programs, Hq, 2]
                slot = 2 * prog + (r_begin >= start).to(tl.int32)
                part = slot.to(tl.int64) * hq + q_heads
                tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
                tl.store(part_ml_ptr + part * 2, m, mask=g_ok)
                tl.store(part_ml_ptr + part * 2 + 1, l, mask=g_ok)
            r_begin += span
            row += 1


@triton.jit(do_not_specialize=("rows", "target"))
def _combine_stream_kernel(
    part_o_ptr, part_ml_ptr, len_ptr, out_ptr, rows, target, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr, MIN_CHUNK: tl.constexpr,
    MAX_ITEMS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (row, kv head): merge a row's pieces over programs p0..p1 (slot 2 p0 + 1, then
    2 p for the others); a row inside one program was written already."""
    row = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    lens, spans, ends, width = _stream_layout(len_ptr, rows, window, target, HAS_WINDOW, MIN_CHUNK, MAX_ITEMS,
                                              BLOCK_B, BLOCK_T)
    r_end = tl.sum(tl.where(offs_b == row, ends, 0))
    r_begin = r_end - tl.sum(tl.where(offs_b == row, spans, 0))
    p0 = r_begin // width
    n = (r_end - 1) // width - p0 + 1
    if n > 1:
        hq = GROUP * tl.num_programs(1)
        offs_s = tl.arange(0, MAX_ITEMS)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < n
        d_ok = offs_d < HEAD_DIM
        slot = 2 * (p0 + offs_s) + (offs_s == 0).to(tl.int32)
        for g in tl.static_range(GROUP):
            head = tl.program_id(1) * GROUP + g
            part = slot.to(tl.int64) * hq + head
            m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=float("-inf"))
            l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
            w = tl.exp2(m - tl.max(m, axis=0))
            o = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=s_ok[:, None] & d_ok[None, :], other=0.0)
            out = tl.sum(o * w[:, None], axis=0) / tl.sum(l * w, axis=0)
            tl.store(out_ptr + (row.to(tl.int64) * hq + head) * HEAD_DIM + offs_d,
                     out.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit(do_not_specialize=COMBINE_UNSPECIALISED)
def _combine_splits_kernel(
    part_o_ptr, part_ml_ptr, out_ptr, splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (row * Hq + query head): merge the splits' partial softmaxes (base 2)."""
    pid = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < splits
    d_ok = offs_d < HEAD_DIM
    m = tl.load(part_ml_ptr + (pid * splits + offs_s) * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + (pid * splits + offs_s) * 2 + 1, mask=s_ok, other=0.0)
    m_all = tl.max(m, axis=0)  # finite: the first split always holds the newest tokens
    w = tl.exp2(m - m_all)
    o = tl.load(part_o_ptr + (pid * splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + pid * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def _check_pool(kv_pool, layer) -> None:
    if not isinstance(kv_pool, torch.Tensor) or kv_pool.dim() != 6 or kv_pool.shape[2] != 2:
        raise ValueError(
            f"kv_pool must be [pages, layers, 2, page_size, kv_heads, head_dim]; got "
            f"{getattr(kv_pool, 'shape', type(kv_pool))}"
        )
    if kv_pool.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"kv_pool.dtype={kv_pool.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if not isinstance(layer, int) or not 0 <= layer < kv_pool.shape[1]:
        raise ValueError(f"layer={layer!r} is not in [0, {kv_pool.shape[1]})")


def _check_inputs(q, kv_pool, layer, page_table, seq_lens, scale, sliding_window) -> None:
    """Shapes, dtypes and devices only: no value is read (no device sync, CUDA-graph safe)."""
    _check_pool(kv_pool, layer)
    _, _, _, _, hkv, d = kv_pool.shape
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[2] != d:
        raise ValueError(f"q must be [rows, q_heads, {d}] (head_dim of kv_pool); got {getattr(q, 'shape', type(q))}")
    if q.dtype != kv_pool.dtype or q.device != kv_pool.device:
        raise TypeError(f"q is {q.dtype} on {q.device} but kv_pool is {kv_pool.dtype} on {kv_pool.device}")
    b, hq, _ = q.shape
    if hq % hkv:
        raise ValueError(f"q has {hq} heads, not a multiple of the pool's {hkv} kv heads (GQA)")
    check_page_table(page_table, b, q.device)
    if (
        not isinstance(seq_lens, torch.Tensor) or seq_lens.shape != (b,)
        or seq_lens.dtype != torch.int32 or seq_lens.device != q.device
    ):
        raise ValueError(
            f"seq_lens must be a [{b}] int32 tensor on {q.device}; got "
            f"{getattr(seq_lens, 'shape', type(seq_lens))} {getattr(seq_lens, 'dtype', '')}"
        )
    check_scale_window(scale, sliding_window)


def check_page_table(page_table, rows: int, device: torch.device) -> None:
    """``page_table`` must be ``[rows, max_pages >= 1]`` int32 on ``device`` (no value read)."""
    if (
        not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or page_table.shape[0] != rows
        or page_table.shape[1] < 1 or page_table.dtype != torch.int32 or page_table.device != device
    ):
        raise ValueError(
            f"page_table must be a [{rows}, max_pages >= 1] int32 tensor on {device}; got "
            f"{getattr(page_table, 'shape', type(page_table))} {getattr(page_table, 'dtype', '')}"
        )


def triton_prologue(q: torch.Tensor, kv_pool: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """What every paged Triton launcher checks first (CUDA or the interpreter, unit strides
    along head_dim) -> ``page_table`` with unit column stride."""
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors (q is on {q.device}); use backend='torch' or "
            "'auto' on the CPU, or set TRITON_INTERPRET=1 to run the kernel in the interpreter"
        )
    if kv_pool.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("kv_pool and q must have unit stride along head_dim")
    return page_table if page_table.stride(1) == 1 else page_table.contiguous()


def output_buffer(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Where an attention launch writes its ``[rows, Hq, D]`` output: ``out`` (checked: q's
    shape, dtype and device, contiguous, as the kernels index it), else a new tensor."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype or out.device != q.device
            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {tuple(q.shape)} {q.dtype} tensor on {q.device}; got "
                         f"{getattr(out, 'shape', type(out))} {getattr(out, 'dtype', '')}")
    return out


def check_scale_window(scale, sliding_window) -> None:
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number (usually head_dim ** -0.5); got {scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int; got {sliding_window!r}")


def check_softcap(softcap) -> None:
    if softcap is not None and (not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"softcap must be None or a number > 0; got {softcap!r}")


def soft_capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` (Gemma 2's attention logit cap); identity for None."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


@torch.no_grad()
def paged_decode_attention_reference(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of each row's newest token over its cached tokens: ``[B, Hq, D]`` in q.dtype.

    q ``[B, Hq, D]``; page_table ``[B, max_pages]`` int32 (entries past a row's last page are
    ignored, any value); seq_lens ``[B]`` int32 >= 1, the cached tokens including the current
    one. Query head h reads kv head ``h // (Hq // Hkv)``. Scores ``scale * q.k`` and softmax
    in fp32; with ``sliding_window`` W only the last W tokens (positions >= seq_len - W) count;
    with ``softcap`` C (Gemma 2) the scores are ``C * tanh(scores / C)``. Gathers the pages of the longest row for every row (reads seq_lens on the host: a sync).
    """
    _check_inputs(q, kv_pool, layer, page_table, seq_lens, scale, sliding_window)
    b, hq, d = q.shape
    s, hkv = kv_pool.shape[3], kv_pool.shape[4]
    max_len = int(seq_lens.max()) if b else 0
    if b and int(seq_lens.min()) < 1:
        raise ValueError(f"seq_lens must be >= 1 (the current token is cached); got {seq_lens.tolist()}")
    n_pages = -(-max_len // s)
    if n_pages > page_table.shape[1]:
        raise ValueError(f"seq_lens need {n_pages} pages but page_table has {page_table.shape[1]} columns")
    pos = torch.arange(n_pages * s, device=q.device)
    lens = seq_lens.long()[:, None]
    valid = pos[None, :] < lens  # [B, T]
    if sliding_window is not None:
        valid &= pos[None, :] >= lens - sliding_window
    used = torch.arange(n_pages, device=q.device)[None, :] * s < lens  # pages holding tokens
    pages = torch.where(used, page_table[:, :n_pages].long(), 0)
    if bool(((pages < 0) | (pages >= kv_pool.shape[0])).any()):
        raise ValueError(f"page_table holds page ids outside [0, {kv_pool.shape[0]}) within seq_lens")
    kv = kv_pool[:, layer][pages]  # [B, n_pages, 2, S, Hkv, D]
    k = kv[:, :, 0].reshape(b, n_pages * s, hkv, d).float()
    # slots past a sequence's end hold whatever their page held before (a freed page's old
    # values, NaN included): zero them, as the Triton kernel's masked loads do (0 * NaN = NaN)
    v = kv[:, :, 1].reshape(b, n_pages * s, hkv, d).float().masked_fill(~valid[:, :, None, None], 0.0)
    qg = q.float().view(b, hkv, hq // hkv, d)
    scores = soft_capped(torch.einsum("bhgd,bthd->bhgt", qg, k) * scale, softcap)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgt,bthd->bhgd", probs, v)
    return out.reshape(b, hq, d).to(q.dtype)


@torch.no_grad()
def paged_prefix_attention_reference(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    pages: torch.Tensor,
    start: int,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its cached prefix and themselves.

    q ``[n, Hq, D]``: the queries of positions ``start .. start + n - 1``, whose keys and values
    (and those of positions ``0 .. start - 1``) are already in ``pages`` (``[>= ceil((start + n) /
    S)]`` int, the sequence's page list) of ``kv_pool [P, L, 2, S, Hkv, D]``. Query i sees
    positions j <= start + i (and, with ``sliding_window`` W, j > start + i - W). -> ``[n, Hq, D]``.
    A torch path (gathers the pages; SDPA), for prefills that reuse a cached prefix; with
    ``softcap`` C the scores are ``C * tanh(scores / C)`` (an explicit fp32 softmax: SDPA has none).
    """
    n, hq, d = q.shape
    s, hkv = kv_pool.shape[3], kv_pool.shape[4]
    total = start + n
    kv = kv_pool[pages[:-(-total // s)].long(), layer]  # [n_pages, 2, S, Hkv, D]
    k = kv[:, 0].reshape(-1, hkv, d)[:total].transpose(0, 1)
    v = kv[:, 1].reshape(-1, hkv, d)[:total].transpose(0, 1)
    qpos = torch.arange(start, total, device=q.device)[:, None]
    kpos = torch.arange(total, device=q.device)[None, :]
    mask = kpos <= qpos
    if sliding_window is not None:
        mask &= kpos > qpos - sliding_window
    if softcap is not None:
        k = k.repeat_interleave(hq // hkv, dim=0).float()  # [Hq, total, D]
        scores = soft_capped(torch.einsum("hnd,htd->hnt", q.transpose(0, 1).float(), k) * scale, softcap)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out = torch.einsum("hnt,htd->hnd", probs, v.repeat_interleave(hq // hkv, dim=0).float())
        return out.transpose(0, 1).to(q.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
    return out.transpose(0, 1)


def paged_decode_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``paged_decode_attention_reference``; ``backend``: "torch" (the
    reference), "triton" (CUDA, or CPU under TRITON_INTERPRET=1) or "auto" (Triton on CUDA).
    The Triton path reads no value on the host (CUDA-graph safe). ``out``: a contiguous tensor
    of q's shape the output is written into (and returned), e.g. rows of a static buffer."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {BACKENDS}")
    if backend == "auto":
        backend = "triton" if q.is_cuda else "torch"
    if backend == "torch":
        result = paged_decode_attention_reference(
            q, kv_pool, layer, page_table, seq_lens, scale=scale, sliding_window=sliding_window, softcap=softcap
        )
        return result if out is None else output_buffer(q, out).copy_(result)
    return _paged_decode_attention_triton(q, kv_pool, layer, page_table, seq_lens, scale, sliding_window,
                                          softcap=softcap, out=out)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


# the most sequence splits; the combine always reads this many (masked), so that the split
# count, which follows the step's rows and page-table width, never selects a kernel variant
MAX_SPLITS = 64


# programs per SM the sequence splits aim for. A step's rows differ in length (a long-tail
# request beside short ones), and a program walks its share of a row's tokens alone, so the
# longest rows set the kernel's time unless they are cut finer: launches of at most
# FINE_SPLIT_MAX_PROGRAMS (row, kv head) programs (32 rows of 8 KV heads) aim at 8 per SM, larger
# ones at 2. On an H100 the burst trace's decode steps of 8-64 rows took 0.05-0.21 ms less with 8
# (long-tailed rows), S-LoRA's 64-row steps (even rows of ~300 tokens) 0.34 ms more and the 128-row
# ones 0.35-1.2 ms more, hence the bound (docs/BENCHMARKS.md "Many tenants against their floor")
DECODE_PROGRAMS_PER_SM = 8
FINE_SPLIT_MAX_PROGRAMS = 256
COARSE_PROGRAMS_PER_SM = 2


def _num_splits(programs: int, max_blocks: int, device: torch.device) -> int:
    """Sequence splits per (row, kv head) so about ``DECODE_PROGRAMS_PER_SM`` programs per SM
    are in flight (``COARSE_PROGRAMS_PER_SM`` above ``FINE_SPLIT_MAX_PROGRAMS`` programs)."""
    if device.type != "cuda":
        return min(2, max_blocks)  # exercise the combine path in the interpreter
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_sm = DECODE_PROGRAMS_PER_SM if programs <= FINE_SPLIT_MAX_PROGRAMS else COARSE_PROGRAMS_PER_SM
    return max(1, min(max_blocks, MAX_SPLITS, triton.cdiv(per_sm * sms, programs)))


# How a step's rows are cut into programs. "balanced": work items of a token count that follows
# the step's total tokens (``_paged_decode_balanced_kernel``), about BALANCED_PROGRAMS_PER_SM
# items per SM, none shorter than MIN_CHUNK_TOKENS; a long row gets many items, a short one one.
# "per-row": every row cut into the same number of splits, from the rows and the page table's
# width (``_num_splits``), as the engine ran before. "stream": a fixed grid of
# BALANCED_PROGRAMS_PER_SM programs per SM, each an equal range of the rows' tokens laid end to
# end (``_paged_decode_stream_kernel``), measured beside the others. "auto" (the default):
# "balanced" for launches of BALANCED_ROWS rows, "per-row" for the others. On an H200 the
# balanced items took 33 % off 64 rows of long-tailed lengths (55 against 82 µs a layer) and
# 15 % off 128; in the engine's burst run its 64-row decode steps 5 % shorter, but steps of 1-8
# rows 2-4 % and of 256 rows 1-3 % longer (the items' prologue and combine where the per-row
# kernel already ran one wave), hence the range (docs/BENCHMARKS.md "Many tenants")
DECODE_SPLITS = "auto"
SPLIT_MODES = ("auto", "balanced", "per-row", "stream")
BALANCED_ROWS = (33, 128)


def decode_split_mode(rows: int, mode: str | None = None) -> str:
    """The split mode a launch of ``rows`` decode rows takes: ``mode`` (default DECODE_SPLITS),
    "auto" resolved by BALANCED_ROWS."""
    mode = mode or DECODE_SPLITS
    if mode not in SPLIT_MODES:
        raise ValueError(f"mode={mode!r}; allowed: {SPLIT_MODES}")
    if mode == "auto":
        return "balanced" if BALANCED_ROWS[0] <= rows <= BALANCED_ROWS[1] else "per-row"
    return mode


# Four programs per SM: the kernel (4 warps, 3 stages, registers capped at
# BALANCED_MAX_REGISTERS = 128) keeps four programs resident per SM, so a step of evenly long
# rows runs as one wave of one item per row, as the per-row splits did, and long rows are cut.
BALANCED_PROGRAMS_PER_SM = 4
MIN_CHUNK_TOKENS = 128
BALANCED_MAX_REGISTERS = 128


def balanced_items(seq_lens: list[int], *, target: int, min_chunk: int, block_t: int,
                   sliding_window: int | None = None) -> tuple[int, list[int]]:
    """The balanced kernel's rule on the host (for tests and benchmarks): -> (chunk, items per
    row) for these lengths; the kernel derives the same on the device from ``seq_lens``."""
    spans = [min(n, sliding_window) if sliding_window is not None else n for n in seq_lens]
    chunk = max(-(-sum(spans) // target), -(-max(spans) // MAX_SPLITS), min_chunk)
    chunk = -(-chunk // block_t) * block_t
    return chunk, [-(-n // chunk) for n in spans]


def _paged_decode_attention_triton(
    q, kv_pool, layer, page_table, seq_lens, scale, sliding_window, *,
    softcap=None, splits=None, mode=None, target=None, min_chunk=None, block_t=None, num_warps=4, num_stages=3,
    max_registers=None, out=None,
):
    """The launcher; the keyword knobs exist for tests and tile sweeps: ``splits`` forces the
    per-row mode with that many splits; ``mode`` one of SPLIT_MODES (``decode_split_mode``);
    ``target`` the balanced mode's items per kv head, ``min_chunk`` its shortest item and
    ``max_registers`` its register cap per thread (0: none)."""
    _check_inputs(q, kv_pool, layer, page_table, seq_lens, scale, sliding_window)
    check_softcap(softcap)
    page_table = triton_prologue(q, kv_pool, page_table)
    b, hq, d = q.shape
    mode = "per-row" if splits is not None else decode_split_mode(b, mode)
    _, _, _, page, hkv, _ = kv_pool.shape
    group = hq // hkv
    out = output_buffer(q, out)
    if b == 0:
        return out
    block_t = block_t or (64 if q.is_cuda else 16)
    kv_layer = kv_pool.select(1, layer)  # [P, 2, S, Hkv, D] view: the pointer carries the offset
    sp, skv, ss, sh, _ = kv_layer.stride()
    common = dict(GROUP=group, HEAD_DIM=d, PAGE=page, HAS_WINDOW=sliding_window is not None,
                  HAS_SOFTCAP=softcap is not None, BLOCK_G=max(16, triton.next_power_of_2(group)),
                  BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_T=block_t,
                  DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    if mode in ("balanced", "stream"):
        if target is None:
            target = triton.cdiv(BALANCED_PROGRAMS_PER_SM * sm_count(q.device, 2), hkv)
        min_chunk = min_chunk or MIN_CHUNK_TOKENS
        if target < 1 or min_chunk < 1:
            raise ValueError(f"target={target} and min_chunk={min_chunk} must be >= 1")
        cap = BALANCED_MAX_REGISTERS if max_registers is None else max_registers
        options = dict(num_warps=num_warps, num_stages=num_stages, **({"maxnreg": cap} if cap else {}))
        block_b = max(16, triton.next_power_of_2(b))
        block_d = max(16, triton.next_power_of_2(d))
        scalars = (scale * _LOG2E, sliding_window or 0, (softcap or 1.0) * _LOG2E, q.stride(0), q.stride(1),
                   page_table.stride(0), b, target, sp, skv, ss, sh)
        # the most partials: 2 slots per streamed program; for the items, the most items the
        # kernel's chunk can make (its docstring)
        slots = 2 * target if mode == "stream" else target + b
        part_o = torch.empty(slots * hq * d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(slots * hq * 2, dtype=torch.float32, device=q.device)
        if mode == "stream":
            _paged_decode_stream_kernel[(target, hkv)](
                q, kv_layer, page_table, seq_lens, out, part_o, part_ml, *scalars,
                MIN_CHUNK=min_chunk, MAX_ITEMS=MAX_SPLITS, BLOCK_B=block_b, **common, **options,
            )
            _combine_stream_kernel[(b, hkv)](
                part_o, part_ml, seq_lens, out, b, target, sliding_window or 0, GROUP=group, HEAD_DIM=d,
                HAS_WINDOW=sliding_window is not None, MIN_CHUNK=min_chunk, MAX_ITEMS=MAX_SPLITS,
                BLOCK_B=block_b, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4,
            )
            return out
        row_items = torch.empty(b * 2, dtype=torch.int32, device=q.device)
        _paged_decode_balanced_kernel[(target + b, hkv)](
            q, kv_layer, page_table, seq_lens, out, part_o, part_ml, row_items, *scalars,
            MIN_CHUNK=min_chunk, MAX_ITEMS=MAX_SPLITS, BLOCK_B=block_b, **common, **options,
        )
        _combine_items_kernel[(b, hkv)](
            part_o, part_ml, row_items, out, GROUP=group, HEAD_DIM=d, BLOCK_S=MAX_SPLITS, BLOCK_D=block_d,
            num_warps=4,
        )
        return out
    max_tokens = page_table.shape[1] * page
    if sliding_window is not None:
        max_tokens = min(max_tokens, sliding_window)
    if splits is None:
        splits = _num_splits(b * hkv, triton.cdiv(max_tokens, block_t), q.device)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits={splits} must be in [1, {MAX_SPLITS}]")
    if splits > 1:
        part_o = torch.empty(b * hq * splits * d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b * hq * splits * 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out  # unused
    _paged_decode_kernel[(b, hkv, splits)](
        q, kv_layer, page_table, seq_lens, out, part_o, part_ml,
        scale * _LOG2E, sliding_window or 0, (softcap or 1.0) * _LOG2E, q.stride(0), q.stride(1),
        page_table.stride(0), sp, skv, ss, sh, SPLIT=splits > 1, **common,
        num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        _combine_splits_kernel[(b * hq,)](
            part_o, part_ml, out, splits, HEAD_DIM=d, BLOCK_S=MAX_SPLITS,
            BLOCK_D=max(16, triton.next_power_of_2(d)), num_warps=4,
        )
    return out


def write_kv(
    kv_pool: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_pages: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """Scatter new tokens' keys and values into their pages, in place.

    k, v ``[T, Hkv, D]``; token t goes to ``kv_pool[slot_pages[t], layer, 0 / 1,
    slot_offsets[t]]``. slot_pages / slot_offsets ``[T]`` integer tensors on the pool's
    device. Two index_put ops; no host sync, so it can be captured in a CUDA graph.
    """
    _check_pool(kv_pool, layer)
    shape = (kv_pool.shape[4], kv_pool.shape[5])
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != shape:
            raise ValueError(f"{name} must be [tokens, {shape[0]}, {shape[1]}]; got {getattr(t, 'shape', type(t))}")
        if t.device != kv_pool.device:
            raise ValueError(f"{name} is on {t.device} but kv_pool is on {kv_pool.device}")
    n = k.shape[0]
    for name, t in (("slot_pages", slot_pages), ("slot_offsets", slot_offsets)):
        if (
            not isinstance(t, torch.Tensor) or t.shape != (n,) or t.dtype not in (torch.int32, torch.int64)
            or t.device != kv_pool.device
        ):
            raise ValueError(f"{name} must be a [{n}] int32/int64 tensor on {kv_pool.device}; got {getattr(t, 'shape', t)}")
    if v.shape[0] != n:
        raise ValueError(f"k has {n} tokens but v has {v.shape[0]}")
    pages, offsets = slot_pages.long(), slot_offsets.long()
    kv_pool[:, layer, 0][pages, offsets] = k.to(kv_pool.dtype)
    kv_pool[:, layer, 1][pages, offsets] = v.to(kv_pool.dtype)
