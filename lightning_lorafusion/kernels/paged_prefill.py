"""Prefill attention over the paged KV cache: many requests' new tokens, each after its cached prefix.

Same pool layout as ``paged_attention`` (``kv_pool [P, L, 2, S, Hkv, D]``, request i's token t
in page ``page_table[i, t // S]`` slot ``t % S``). Request i's new tokens are the packed query
rows ``cu_seqlens[i] .. cu_seqlens[i + 1] - 1`` at positions ``starts[i] ..``; their keys and
values are already in the pages (written before attention), so every key is read from the
pages: a cached prefix (prefix caching) and an earlier chunk of the same prompt (chunked
prefill) look the same. Inference only (no autograd).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import (
    _LOG2E, BACKENDS, _check_pool, check_page_table, check_scale_window, check_softcap, output_buffer,
    paged_prefix_attention_reference, soft_cap_log2, triton_prologue,
)

# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _attend_key_block(
    q, m, l, acc, t0, hi, qpos, window, pt_row, kv_head, offs_n, offs_d, d_ok, qk_scale, cap_log2,
    stride_p, stride_kv, stride_s,
    PAGE: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax update of a query tile with keys ``t0 .. t0 + BLOCK_N - 1`` (< hi).

    Keys are gathered token by token through the page table (any page size, any BLOCK_N).
    Without MASKED every key of the block is visible to every row (the caller guarantees it).
    """
    t = t0 + offs_n
    t_ok = t < hi
    page = tl.load(pt_row + t // PAGE, mask=t_ok, other=0).to(tl.int64)
    tok = kv_head + page * stride_p + (t % PAGE) * stride_s
    kv_mask = t_ok[:, None] & d_ok[None, :]
    k = tl.load(tok[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(tok[:, None] + stride_kv + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N], log2 units
    if HAS_SOFTCAP:
        s = soft_cap_log2(s, cap_log2)
    if MASKED:
        ok = t_ok[None, :] & (t[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            ok = ok & (t[None, :] > qpos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    # a row that has seen no visible key yet (window) keeps m = -inf: subtract 0 instead (no NaN)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l, acc


# The page table's row stride is its width, the step's longest request in pages: Triton would
# compile a variant for a width of 1 and one for widths divisible by 16 (it specialises integer
# arguments on both), and such a first-time compile stopped a serving step for 1.3 s mid-run on
# an H100 (docs/BENCHMARKS.md, "Many tenants against their floor"). It only indexes the table.
PREFILL_UNSPECIALISED = ("pt_stride",)


@triton.jit(do_not_specialize=PREFILL_UNSPECIALISED)
def _paged_prefill_kernel(
    q_ptr, kv_ptr, cu_ptr, start_ptr, pt_ptr, out_ptr,
    qk_scale, window, cap_log2, q_stride_t, q_stride_h, pt_stride,
    stride_p, stride_kv, stride_s, stride_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TOK_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (query tile, request, kv head): TOK_M consecutive new tokens of one request times
    the GROUP query heads of one kv head, flattened into BLOCK_M rows (row r: token r // GROUP,
    head r % GROUP), so each K/V tile is loaded once for the whole group. Tiles are numbered
    from the request's end (the longest causal rows start first); tiles past a request's length
    exit at once. Online softmax in fp32, base 2, the scale folded into ``qk_scale``.
    """
    req = tl.program_id(1)
    head = tl.program_id(2)
    q_begin = tl.load(cu_ptr + req)
    n = tl.load(cu_ptr + req + 1) - q_begin
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * TOK_M
    if m0 >= n:
        return
    start = tl.load(start_ptr + req)
    offs_r = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tok_idx = m0 + offs_r // GROUP
    r_ok = (offs_r < TOK_M * GROUP) & (tok_idx < n)
    d_ok = offs_d < HEAD_DIM
    q_heads = head * GROUP + offs_r % GROUP
    q_rows = (q_begin + tok_idx).to(tl.int64)
    io_mask = r_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_rows[:, None] * q_stride_t + q_heads[:, None] * q_stride_h + offs_d[None, :],
                mask=io_mask, other=0.0)
    qpos = start + tok_idx  # absolute position of each row's token
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    kv_head = kv_ptr + head * stride_h  # kv_ptr: the layer's slice of the pool
    pt_row = pt_ptr + req.to(tl.int64) * pt_stride
    hi = start + tl.minimum(m0 + TOK_M, n)  # keys < hi: up to the tile's last token
    if HAS_WINDOW:
        for t0 in range(tl.maximum(start + m0 - window + 1, 0), hi, BLOCK_N):
            m, l, acc = _attend_key_block(q, m, l, acc, t0, hi, qpos, window, pt_row, kv_head, offs_n, offs_d,
                                          d_ok, qk_scale, cap_log2, stride_p, stride_kv, stride_s,
                                          PAGE, True, True, HAS_SOFTCAP, DOT_PRECISION)
    else:
        # keys up to the tile's first token are visible to every row: no mask on those blocks
        full = (start + m0 + 1) // BLOCK_N * BLOCK_N
        for t0 in range(0, full, BLOCK_N):
            m, l, acc = _attend_key_block(q, m, l, acc, t0, hi, qpos, window, pt_row, kv_head, offs_n, offs_d,
                                          d_ok, qk_scale, cap_log2, stride_p, stride_kv, stride_s,
                                          PAGE, False, False, HAS_SOFTCAP, DOT_PRECISION)
        for t0 in range(full, hi, BLOCK_N):
            m, l, acc = _attend_key_block(q, m, l, acc, t0, hi, qpos, window, pt_row, kv_head, offs_n, offs_d,
                                          d_ok, qk_scale, cap_log2, stride_p, stride_kv, stride_s,
                                          PAGE, True, False, HAS_SOFTCAP, DOT_PRECISION)
    out = acc / l[:, None]
    tl.store(out_ptr + (q_rows[:, None] * (GROUP * tl.num_programs(2)) + q_heads[:, None]) * HEAD_DIM
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


# ----------------------------------------------------------------------------------------------
# Checks, reference, dispatch
# ----------------------------------------------------------------------------------------------


def _check_inputs(q, kv_pool, layer, cu_seqlens, starts, page_table, scale, sliding_window) -> None:
    """Shapes, dtypes and devices only: no value is read (no device sync)."""
    _check_pool(kv_pool, layer)
    hkv, d = kv_pool.shape[4], kv_pool.shape[5]
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[2] != d:
        raise ValueError(f"q must be [tokens, q_heads, {d}] (head_dim of kv_pool); got {getattr(q, 'shape', type(q))}")
    if q.dtype != kv_pool.dtype or q.device != kv_pool.device:
        raise TypeError(f"q is {q.dtype} on {q.device} but kv_pool is {kv_pool.dtype} on {kv_pool.device}")
    if q.shape[1] % hkv:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the pool's {hkv} kv heads (GQA)")
    if (
        not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1
        or cu_seqlens.dtype != torch.int32 or cu_seqlens.device != q.device
    ):
        raise ValueError(
            f"cu_seqlens must be a [requests + 1] int32 tensor on {q.device}; got "
            f"{getattr(cu_seqlens, 'shape', type(cu_seqlens))} {getattr(cu_seqlens, 'dtype', '')}"
        )
    n = cu_seqlens.shape[0] - 1
    if (
        not isinstance(starts, torch.Tensor) or starts.shape != (n,) or starts.dtype != torch.int32
        or starts.device != q.device
    ):
        raise ValueError(
            f"starts must be a [{n}] int32 tensor on {q.device} (one per request of cu_seqlens); got "
            f"{getattr(starts, 'shape', type(starts))} {getattr(starts, 'dtype', '')}"
        )
    check_page_table(page_table, n, q.device)
    check_scale_window(scale, sliding_window)


@torch.no_grad()
def paged_prefill_attention_reference(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    page_table: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its pages: ``[T, Hq, D]`` in q.dtype.

    q ``[T, Hq, D]``: request i's new tokens are rows ``cu_seqlens[i] .. cu_seqlens[i+1] - 1``
    (cu_seqlens ``[n + 1]`` int32, non-decreasing from 0 to T), at positions ``starts[i] ..``
    (``[n]`` int32 >= 0, the tokens already in its pages before them). Their keys and values and
    those of positions ``0 .. starts[i] - 1`` are in pages ``page_table[i, 0..]`` (``[n,
    max_pages]`` int32; entries past the last needed page are ignored). Query at position p sees
    positions j <= p (and, with ``sliding_window`` W, j > p - W); head h reads kv head
    ``h // (Hq // Hkv)``; ``softcap`` C: scores ``C * tanh(scores / C)``. One
    ``paged_prefix_attention_reference`` (gather + SDPA) per request;
    reads cu_seqlens and starts on the host (a sync).
    """
    _check_inputs(q, kv_pool, layer, cu_seqlens, starts, page_table, scale, sliding_window)
    bounds, firsts = cu_seqlens.tolist(), starts.tolist()
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0, not decrease and end at T={q.shape[0]}; got {bounds}")
    if any(f < 0 for f in firsts):
        raise ValueError(f"starts must be >= 0; got {firsts}")
    s = kv_pool.shape[3]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b == a:
            continue
        need = -(-(firsts[i] + b - a) // s)
        if need > page_table.shape[1]:
            raise ValueError(f"request {i} needs {need} pages but page_table has {page_table.shape[1]} columns")
        out[a:b] = paged_prefix_attention_reference(q[a:b], kv_pool, layer, page_table[i], firsts[i], scale=scale,
                                                    sliding_window=sliding_window, softcap=softcap)
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    page_table: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    max_seqlen: int | None = None,
    softcap: float | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``paged_prefill_attention_reference``; ``backend``: "torch" (the
    reference), "triton" (CUDA, or CPU under TRITON_INTERPRET=1) or "auto" (Triton on CUDA).
    ``max_seqlen``: an upper bound on any request's new tokens (sizes the Triton grid; read from
    cu_seqlens, a sync, when not given). The Triton path reads no other value on the host.
    ``out``: a contiguous tensor of q's shape the output is written into (and returned)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {BACKENDS}")
    if backend == "auto":
        backend = "triton" if q.is_cuda else "torch"
    if backend == "torch":
        result = paged_prefill_attention_reference(q, kv_pool, layer, cu_seqlens, starts, page_table, scale=scale,
                                                   sliding_window=sliding_window, softcap=softcap)
        return result if out is None else output_buffer(q, out).copy_(result)
    return _paged_prefill_attention_triton(q, kv_pool, layer, cu_seqlens, starts, page_table, scale, sliding_window,
                                           max_seqlen=max_seqlen, softcap=softcap, out=out)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def _default_blocks(head_dim: int, device: torch.device) -> dict:
    """Block sizes and launch knobs; the interpreter gets small tiles (fast on the CPU)."""
    if device.type != "cuda":
        return {"block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 1}
    if head_dim <= 64:  # H100, Llama-1B heads: the fastest of the four swept for prefix hits
        return {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3}
    # H100, Llama-8B heads (D 128): 292.8 / 594.5 µs (prefix hits / fresh) against 365.5 / 763.7
    # for m128 n64 8 warps (docs/results/kernels_h100_202611/prefill_attention/)
    return {"block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 3}


def _paged_prefill_attention_triton(
    q, kv_pool, layer, cu_seqlens, starts, page_table, scale, sliding_window, *,
    max_seqlen=None, softcap=None, block_m=None, block_n=None, num_warps=None, num_stages=None, out=None,
):
    """The launcher; the keyword knobs exist for tests and sweeps (scripts/bench_generation.py --prefill-attention).
    ``block_m`` counts rows of the flattened (token, query head of the group) tile."""
    _check_inputs(q, kv_pool, layer, cu_seqlens, starts, page_table, scale, sliding_window)
    check_softcap(softcap)
    page_table = triton_prologue(q, kv_pool, page_table)
    t, hq, d = q.shape
    _, _, _, page, hkv, _ = kv_pool.shape
    group = hq // hkv
    out = output_buffer(q, out)
    n = cu_seqlens.shape[0] - 1
    if t == 0 or n == 0:
        return out
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    knobs = _default_blocks(d, q.device)
    block_m = block_m or knobs["block_m"]
    block_m = max(block_m, 16, triton.next_power_of_2(group))  # at least one token per tile
    tok_m = block_m // group
    kv_layer = kv_pool.select(1, layer)  # [P, 2, S, Hkv, D] view: the pointer carries the offset
    sp, skv, ss, sh, _ = kv_layer.stride()
    _paged_prefill_kernel[(triton.cdiv(max(max_seqlen, 1), tok_m), n, hkv)](
        q, kv_layer, cu_seqlens, starts, page_table, out,
        scale * _LOG2E, sliding_window or 0, (softcap or 1.0) * _LOG2E, q.stride(0), q.stride(1),
        page_table.stride(0), sp, skv, ss, sh,
        GROUP=group, HEAD_DIM=d, PAGE=page, HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None, TOK_M=tok_m, BLOCK_M=block_m, BLOCK_N=block_n or knobs["block_n"],
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps or knobs["num_warps"], num_stages=num_stages or knobs["num_stages"],
    )
    return out
