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

from .paged_attention_kernels import (  # noqa: F401  (names tests and paged_prefill import from here)
    BALANCED_UNSPECIALISED, COMBINE_UNSPECIALISED, DECODE_UNSPECIALISED, _combine_items_kernel,
    _combine_splits_kernel, _combine_stream_kernel, _paged_decode_balanced_kernel, _paged_decode_kernel,
    _paged_decode_stream_kernel, soft_cap_log2,
)
from .triton_launch import sm_count

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("torch", "triton", "auto")
_LOG2E = 1.4426950408889634


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
