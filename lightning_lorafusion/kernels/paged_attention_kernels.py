"""The Triton kernels of decode attention over the paged KV cache (``paged_attention.py`` holds
the layout's contract, the references, the knobs and the launchers).

Per row and KV head: the split kernel (``_paged_decode_kernel``) attends one range of a row's
tokens per program and writes fp32 partials that ``_combine_splits_kernel`` merges; the balanced
kernel (``_paged_decode_balanced_kernel``, ``_combine_items_kernel``) spreads a step's tokens over
work items of about equal size; the streamed kernel (``_paged_decode_stream_kernel``,
``_combine_stream_kernel``) walks the items in order. ``soft_cap_log2`` is shared with the
prefill kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
