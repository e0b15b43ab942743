"""Decode-time multi-adapter LoRA (S-LoRA's MBGMV): every row its own adapter and rank, no padding.

For row i of ``x [B, K]`` with adapter weights stored anywhere in a flat ``pool``:

    A_i  = pool[a_offsets[i] : a_offsets[i] + r_i * K].view(r_i, K)    (PEFT's lora_A layout)
    Bt_i = pool[b_offsets[i] : b_offsets[i] + r_i * N].view(r_i, N)    (PEFT's lora_B, transposed)
    delta[i] = scales[i] * (x[i] @ A_i^T) @ Bt_i                        (fp32 accumulation)

``ranks[i] == 0`` means no LoRA for the row (delta 0); ranks go up to ``MAX_RANK`` (128).
Inference only: nothing here is differentiable (the Triton path has no autograd; the
reference runs under ``torch.no_grad``).

Projections that share an input (q/k/v, gate/up) are a group: ``GatheredLora`` holds the
tables of G projections, ``lora_shrink`` computes every projection's ``x A^T`` in one launch,
and the expand half (``lora_delta``, a Triton helper) runs inside whatever kernel consumes the
projection's output (``lora_epilogues.py``: RoPE + KV write, SwiGLU; ``lora_gather``: a plain
add).

This module holds the knobs, the blocks and variants a launch over so many rows takes, the
launchers, and the shrink (and a single projection's expand) launched on a second stream beside
the frozen GEMM (``shrink_beside``, ``expand_beside``); the per-row Triton kernels are in
``lora_row_kernels.py``, the grouped ones in ``lora_grouped_kernels.py``, the tables' contract
and the torch reference in ``gathered_lora.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Iterator, Sequence

import torch
import triton

# (SUPPORTED_DTYPES and lora_gather_reference: names callers import from here)
from .gathered_lora import (MAX_RANK, SUPPORTED_DTYPES, GatheredLora, check_gather_inputs,  # noqa: F401
                            lora_gather_reference)
from .lora_grouped_kernels import _lora_grouped_expand_kernel, _lora_grouped_shrink_kernel, gdc_wait
from .lora_row_kernels import _lora_expand_kernel, _lora_shrink_kernel

BACKENDS = ("torch", "triton", "auto")


# The per-row kernels' blocks on a GPU (module-level so scripts/profile_decode_lora.py can vary
# them): the shrink's K block and warps, the expand's column block and warps (``lora_gather``'s
# own expand for o and down; the SwiGLU epilogue's LoRA rows take ``ROW_EXPAND_BLOCK_N`` too)
ROW_SHRINK_BLOCK_K = 512
ROW_SHRINK_WARPS = 4
ROW_EXPAND_BLOCK_N = 256
ROW_EXPAND_WARPS = 4

# Few decode rows: launches over at most ``FEW_ROWS`` rows (None: none) take these blocks. A
# decode step of 1-16 rows is latency-bound, not byte-bound (a few MB of adapters): each
# program's chain of dependent loads is what it costs. So a row's whole rank (up to
# ``FEW_BLOCK_R``) is one tile instead of a loop of 16-rank blocks (one load of A or B^T per
# program instead of up to four in a row), and narrower K blocks (the shrink) and column blocks
# (the expands, SwiGLU's LoRA rows) spread one row's A and B^T over more programs; H100: faster
# up to 8 rows, slower from 16 (docs/kernels.md). Decode graphs are keyed by their bucket of rows.
FEW_ROWS: int | None = 8
FEW_SHRINK_BLOCK_K = 256
FEW_BLOCK_R = 64
FEW_EXPAND_BLOCK_N = 64

# the fused epilogues add two column sets' LoRA in one rank loop (RoPE's halves of a head, SwiGLU's
# gate and up: ``lora_grouped_kernels.lora_delta_pair``) instead of one after the other
PAIR_EPILOGUES = True

# the per-row shrink's rank blocks over this many programs per (row, K block, projection) for
# launches of at most RANK_SPLIT_MAX_ROWS rows (None: never): a row's rank blocks side by side
# instead of one after another (at rank 64 with 16-rank blocks: 4 programs of one block each)
RANK_SPLIT = 4
RANK_SPLIT_MAX_ROWS: int | None = 64

# SwiGLU's LoRA rows compute down's shrink too (``lora_ahead``; the engine passes down's tables)
# for at most this many decode rows (None: never), with this column block (down's K block) and warps
AHEAD_MAX_ROWS: int | None = None
AHEAD_BLOCK_N = 256
AHEAD_WARPS = 8

# Decode rows grouped by adapter (``GatheredLora.groups``): a program covers up to this many
# rows of one adapter, so the adapter's A tile is read once for them instead of once per row.
GROUP_ROWS = 16
# the grouped shrink serves batches of at least this many rows. With the shrinks beside the frozen
# GEMMs (EngineTuning.decode_lora_beside "wide"), on an H100 one 8B layer's decode LoRA took
# 0.66-0.69x the per-row shrink's at 32-64 rows on 1-8 adapters, 0.91x at 128 rows over 80, 1.02x
# at 32 rows on 32 distinct adapters, 1.00x at 256 (docs/kernels.md "The grouped shrink from 32
# rows"); below it the per-row kernels (and the few-rows ones up to FEW_ROWS)
GROUPED_MIN_ROWS = 32
# the grouped shrink's K tile, K columns per program (a multiple of the tile: fewer partials for
# the expand to sum) and warps; None: on a GPU ``GROUPED_SHRINK_GPU_TILES``, in the interpreter
# the per-row shrink's K block (tile and split); the per-row shrink's warps
GROUPED_SHRINK_BLOCK_K: int | None = None
GROUPED_SHRINK_SPLIT_K: int | None = None
GROUPED_SHRINK_WARPS: int | None = None
# (K tile, split) on a GPU: tiles of 256 in splits of 512 (8 partials, as the per-row shrink's
# K blocks of 512). One 512 tile staged two 16 KB operands for its dot and ran at 0 % estimated
# occupancy (25 % with 256); H100, docs/BENCHMARKS.md "Where one layer's decode LoRA spends its time"
GROUPED_SHRINK_GPU_TILES = (256, 512)
# a group of one row (an adapter alone in the batch) takes the per-row arithmetic inside the
# grouped shrink instead of a 16-row dot for it. With the GPU tiles above, on an H100 the layer's
# LoRA at 256 rows took 0.75-0.98x the per-row path's time at r=16 (8-128 adapters) against
# 0.77-1.04x for the grouped shrink before; mixed ranks 4-64 0.79-1.00x against 0.78-1.04x
GROUPED_SHRINK_SINGLE_ROWS = True
# the grouped shrink's rank chunks over this many programs per (group, K split, projection):
# program s walks chunks s, s + split, ... (as the per-row shrink's ``RANK_SPLIT``): shorter chains
# of dependent A loads for a rank-64 group, programs past a group's rank return. 1: one program
# walks them all (the default; the same partial sums either way). 4: the layer's grouped shrinks
# 1.15x slower at 256 rows over 104 adapters of ranks 4-64 (H100, docs/kernels.md)
GROUPED_RANK_SPLIT = 1
# the grouped shrink's rank chunk (None: the per-row shrink's rank block, 16; at least tl.dot's 16):
# a chunk of 64 loads a rank-64 group's whole A tile at once instead of four dependent ones, but
# its staged operands left no room for a second program (0 % estimated occupancy, 3.9x slower; 32:
# 1.2x slower; H100, docs/BENCHMARKS.md "The grouped shrink's occupancy")
GROUPED_SHRINK_BLOCK_R: int | None = None
# its software-pipelining stages (None: Triton's default, 3): 1 stages nothing ahead of its rank
# loop (each chunk's A load issued in turn, as before) in less shared memory: 31 % estimated
# occupancy against 25 %, the four grouped shrinks of an 8B layer at 256 rows over 104 Zipf-drawn
# adapters 142.3 against 153.7 µs, the decode steps of 256 rows 2 % less GPU time (H100, same sums)
GROUPED_SHRINK_STAGES: int | None = 1
# the grouped shrink's K tiles of a split unrolled (their loads all in flight at once) instead of a
# loop over them (the same sums in the same order); with tiles of 128 in splits of 512 1.11x the
# grouped shrinks' time of tiles of 256 (H100)
GROUPED_SHRINK_UNROLL_K = False


# the expand reads each group's B^T once (``lora_grouped_expand``) from this many decode rows;
# None: never. Off: on an H100 (one 8B layer's decode LoRA, 64-256 rows over 8-100 adapters of
# ranks 4-64, docs/BENCHMARKS.md) neither form beat the per-row expand after the grouped shrink
# (the dot, tf32: 0.99x of its time at 256 rows x 8 adapters, 1.10x with 32, 1.56x with 100,
# up to 1.9x at 64-128 rows; the row loop 1.04-3.2x)
GROUPED_EXPAND_MIN_ROWS: int | None = None
# the grouped expand's column block and warps (scripts/bench_decode_groups.py sweeps them)
GROUPED_EXPAND_BLOCK_N = 256
GROUPED_EXPAND_WARPS = 4
# its form: one dot for the group's rows (False) or the rows one after another through the
# per-row helpers (True: the per-row kernels' bits, B^T's tile from L1 after the first row;
# measured the slower of the two)
GROUPED_EXPAND_ROW_LOOP = False
# the dot form's groups of at most this many rows take the row loop instead (0: none): a
# group's dot costs the same for 1 row as for 16
GROUPED_EXPAND_LOOP_ROWS = 0
# the dot's precision; None: "tf32" for half-precision outputs (S, fp32 sums, rounded to tf32:
# no coarser than the output's rounding; its LoRA time 1.04-1.22x shorter than "ieee"'s),
# "ieee" for fp32; "half": S rounded to the output's half dtype, a half-precision dot (fp32 for fp32)
GROUPED_EXPAND_DOT: str | None = None


# Hybrid expands (one launch, whatever the step's adapters): from this many decode rows (None:
# never) with groups given, the expands (``lora_gather``'s, o's and down's beside, SwiGLU's LoRA
# rows; with ``HYBRID_QKV`` q/k/v's in the RoPE epilogue) read each group of at least ``HYBRID_MIN_GROUP`` rows' B^T
# once, a tensor-core dot for the group's rows (``lora_group_delta``), while the rows alone on
# their adapter (or in smaller groups) keep the per-row arithmetic. The groups table says which
# rows go which way (``adapter_groups``' fourth row), read on the device: a step of one adapter
# and a step of 64 take the same captured kernels. HYBRID_FUSED: the group programs are extra
# programs of the per-row launch (no launch more); else a launch of their own after it (q/k/v's
# then stay per row). HYBRID_QKV: q/k/v's in the RoPE + KV epilogue too (group programs per head;
# off: in an sm_90 compile its group path took the launch from 64 to 168 registers a thread, with
# spills, which its per-row programs would run at)
HYBRID_MIN_ROWS: int | None = None
HYBRID_MIN_GROUP = 2
HYBRID_FUSED = True
HYBRID_QKV = False
# the hybrid launches' software-pipelining stages (None: Triton's default, 3): with 3 the group
# programs' rank loop staged its B^T tiles and unrolled partial sums ahead, 66-74 KB of shared
# memory for o's / down's expand in an sm_90 compile, against 2-16 KB with 1 (the per-row launches:
# none; ``scripts/compile_decode_lora.py``)
HYBRID_STAGES: int | None = 1
# the group programs' columns per dot (at most the launch's column block; a power of two, at
# least 16): a [16, 256] fp32 delta and its B^T tile held the fused expand at 158 registers a
# thread in an sm_90 compile (the per-row path alone: 64); narrower, the launch's per-row programs
# keep more of their occupancy (``scripts/compile_decode_lora.py``)
HYBRID_GROUP_N = 64

# Programmatic dependent launch (Hopper and later, ``pdl_options``): the shrink lets the kernel
# launched after it start as soon as all of its programs have started, and that kernel (the
# expand, the RoPE + KV and SwiGLU epilogues' LoRA rows) loads its rows' tables and the first
# rank chunk of B^T, then waits for the shrink's grid (``gdc_wait``) before it reads the partial
# sums: the gap between the two kernels and the expand's first weight loads overlap the shrink's
# last programs. Same sums in the same order (the first chunk is peeled out of the rank loop).
# Not where the per-row shrink splits a row's rank over programs (``rank_split``, 9-64 rows):
# there the consumers did not start early and one 8B layer's LoRA took 1.06-1.07x longer with
# it at 64 rows, against 0.88x at 8 rows, 0.96x at one and 0.95x at 256 (H200, r = 16); in the
# engine (burst trace, ranks 4-64) decode steps of 1-8 rows took 0.12-0.21 ms less, those of
# 128-256 rows the same (docs/BENCHMARKS.md "Many tenants against their floor")
PDL = True

# Launches whose rows' ranks are known on the host to be at most this (``rank_bound``; None:
# never) take no rank split, and so PDL, at any row count: at rank <= 16 a row is one rank
# block and the split's other programs only exit; at 32, two blocks in one program still beat
# two programs without PDL. One 8B layer's decode LoRA at 16-64 rows on distinct adapters took
# 0.78-0.84x the split's time that way at r = 16 (ranks 4-16 mixed: 0.77-0.83x), 0.92-0.93x
# at r = 32, but 1.01-1.16x with ranks 4-64 mixed (H200, docs/BENCHMARKS.md "Many tenants
# against their floor"). The engine picks the variant per decode step from the step's largest
# rank (``decode_rank_bound``).
UNSPLIT_MAX_RANK: int | None = 32


# The shrink beside the frozen GEMM: a decode launch over at most this many rows (None: never)
# with a second CUDA stream given (``shrink_beside``) launches its group's shrink on that stream
# as soon as the group's input is written, so it runs while the frozen GEMM that reads the same
# input runs on the main stream; the kernel that reads the partials waits for both. At a few
# decode rows each shrink is a few µs of latency on the step's critical path (four per layer),
# while the frozen GEMMs beside them stream the layer's weights for tens of µs. The same kernels
# and sums (the consumers take no PDL edge then: their stream predecessor is the GEMM, whose
# outputs the epilogues read before their wait)
BESIDE_MAX_ROWS: int | None = 64
# where the shrink runs beside, a single projection's expand too (``expand_beside``: its rows'
# fp32 delta, which the kernel reading the projection's output adds: the residual add + RMSNorm
# after o, and after down the next layer's): the whole LoRA of o and down off the critical path.
# One 8B layer's decode LoRA took 0.51-0.65x its added time at one row, 0.87-0.98x at 8-64 rows
# (H200, docs/BENCHMARKS.md "Decode kernels")
EXPAND_BESIDE = True
# whether a launch that takes the grouped shrink (``GROUPED_MIN_ROWS`` rows or more) may run it
# beside too, where ``BESIDE_MAX_ROWS`` reaches that many rows (the same partial sums either way)
BESIDE_GROUPED = False


def decode_rank_bound(rows: int, max_rank: int) -> int | None:
    """The ``rank_bound`` a decode step over ``rows`` rows whose largest rank is ``max_rank``
    launches its LoRA with (and its CUDA graph is captured for): ``UNSPLIT_MAX_RANK`` where
    ``max_rank`` is within it and a launch over ``rows`` rows would otherwise split ranks; else
    None. So a bucket has at most two variants, whatever ranks are loaded."""
    if UNSPLIT_MAX_RANK is None or max_rank > UNSPLIT_MAX_RANK or rank_split(None, rows) == 1:
        return None
    return UNSPLIT_MAX_RANK


def decode_rank_bounds(rows: int) -> tuple[int | None, ...]:
    """Every ``decode_rank_bound`` a decode step over ``rows`` rows can take (what warm-up
    captures for its bucket): ``(None,)`` or ``(None, UNSPLIT_MAX_RANK)``."""
    return tuple(dict.fromkeys((None, decode_rank_bound(rows, 0))))


def pdl_applies(device: torch.device, rows: int, rank_bound: int | None = None) -> bool:
    """Whether a decode LoRA launch over ``rows`` rows takes ``PDL``: on, and the shrink over
    those rows does not split ranks (``rank_split`` 1)."""
    return PDL and rank_split(device, rows, rank_bound) == 1


def pdl_options(device: torch.device, rows: int, rank_bound: int | None = None,
                beside: bool = False) -> tuple[dict, dict, dict]:
    """(the consumer's constexprs, its launch options, the shrink's constexprs) for a decode
    LoRA launch over ``rows`` rows on ``device`` where ``pdl_applies``: on a CUDA device of
    compute capability 9.0 or more with a Triton that has grid dependency control, ``PRELOAD``
    and ``GDC`` on, ``launch_pdl``; elsewhere ``PRELOAD`` only (the same arithmetic, so the
    interpreter checks it); where it does not apply, none. ``beside``: the shrink ran on another
    stream (``shrink_beside``): the consumer takes none (the shrink's constexprs are unchanged)."""
    if not pdl_applies(device, rows, rank_bound):
        return {"PRELOAD": False, "GDC": False}, {}, {"GDC": False}
    if beside:
        return {"PRELOAD": False, "GDC": False}, {}, pdl_options(device, rows, rank_bound)[2]
    gdc = device.type == "cuda" and _pdl_supported(device.index if device.index is not None
                                                    else torch.cuda.current_device())
    return {"PRELOAD": True, "GDC": gdc}, ({"launch_pdl": True} if gdc else {}), {"GDC": gdc}


@functools.lru_cache(maxsize=8)
def _pdl_supported(index: int) -> bool:
    """Whether CUDA device ``index`` (compute capability 9.0 or more) and this Triton (grid
    dependency control, the ``launch_pdl`` option) take programmatic dependent launch."""
    if gdc_wait is None or torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def grouped_min_rows() -> int:
    """The fewest decode rows for which some LoRA kernel reads ``GatheredLora.groups`` (the
    engine builds the table only where its batches can reach this)."""
    return min(b for b in (GROUPED_MIN_ROWS, GROUPED_EXPAND_MIN_ROWS, HYBRID_MIN_ROWS) if b is not None)


def group_block_m() -> int:
    """The grouped kernels' block of rows: ``GROUP_ROWS`` as a power of two, at least tl.dot's 16."""
    return max(16, triton.next_power_of_2(GROUP_ROWS))


def grouped_expand_block_r(block_r: int) -> int:
    """The grouped expand's rank chunk: the per-row one's (its row loop), at least 16 (its dot)."""
    return block_r if GROUPED_EXPAND_ROW_LOOP else max(block_r, 16)


def takes_groups(rows: int, groups: torch.Tensor | None, bound: int | None) -> bool:
    """Whether a launch over ``rows`` decode rows reads ``groups`` (given, and rows >= bound;
    bound None: never)."""
    return groups is not None and bound is not None and rows > 0 and rows >= bound


def hybrid_applies(rows: int, groups: torch.Tensor | None) -> bool:
    """Whether a launch over ``rows`` decode rows takes the hybrid expands (``HYBRID_MIN_ROWS``;
    not where the grouped expand takes every group, ``GROUPED_EXPAND_MIN_ROWS``)."""
    return (takes_groups(rows, groups, HYBRID_MIN_ROWS) and not takes_groups(rows, groups, GROUPED_EXPAND_MIN_ROWS)
            and groups.shape[0] > 3)


def hybrid_slots(groups: torch.Tensor) -> int:
    """The group programs of a hybrid launch over a groups table of ``groups.shape[1]`` columns:
    ``adapter_groups`` puts the larger groups first, so at most ``width // HYBRID_MIN_GROUP``
    columns hold a group of ``HYBRID_MIN_GROUP`` rows or more."""
    return groups.shape[1] // max(HYBRID_MIN_GROUP, 1)


def hybrid_expand_options(rows: int, groups: torch.Tensor | None, out_dtype: torch.dtype,
                          stand_in: torch.Tensor, block_n: int | None = None) -> tuple[tuple, dict, int]:
    """(a per-row kernel's group arguments, its hybrid constexprs, its group programs) for a
    launch over ``rows`` rows: the hybrid's where ``hybrid_applies`` (with ``HYBRID_FUSED`` the
    group programs in this launch; else 0 of them: a grouped launch follows), else none
    (``stand_in``, any tensor on the device, for the table nothing reads). ``block_n``: the
    launch's column block, which its group programs walk ``HYBRID_GROUP_N`` at a time (None: the
    launch has no column blocks)."""
    if not hybrid_applies(rows, groups):
        return (rows, stand_in, 0, 0, 0), {}, 0
    slots = hybrid_slots(groups) if HYBRID_FUSED else 0
    columns = {} if block_n is None else {"GROUP_N": min(HYBRID_GROUP_N, block_n)}
    return ((rows, groups, groups.stride(0), slots, HYBRID_MIN_GROUP),
            {"HYBRID": True, "BLOCK_M": group_block_m(), "DOT_PRECISION": expand_dot_precision(out_dtype),
             "HALF_S": expand_half_s(out_dtype), **columns, **hybrid_stages()}, slots)


def hybrid_stages() -> dict:
    """The hybrid launches' ``num_stages`` option (``HYBRID_STAGES``; none: Triton's default)."""
    return {} if HYBRID_STAGES is None else {"num_stages": HYBRID_STAGES}


def expand_dot_precision(dtype: torch.dtype) -> str:
    """The grouped expand's fp32 dot precision (``GROUPED_EXPAND_DOT``, or by the output dtype)."""
    if GROUPED_EXPAND_DOT in (None, "half"):
        return "ieee" if dtype == torch.float32 else "tf32"
    return GROUPED_EXPAND_DOT


def expand_half_s(dtype: torch.dtype) -> bool:
    """Whether the grouped expand's dot takes S rounded to a half-precision output's dtype
    (``GROUPED_EXPAND_DOT`` "half")."""
    return GROUPED_EXPAND_DOT == "half" and dtype != torch.float32


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
    groups: torch.Tensor | None = None,
    partials: tuple[torch.Tensor, int] | None = None,
    rank_bound: int | None = None,
) -> torch.Tensor:
    """Same contract as ``lora_gather_reference``; ``rank_bound``: the rows' ranks are known to
    be at most this (``GatheredLora.rank_bound``: picks the kernels' variant, never the result);
    ``groups``: the rows grouped by adapter (``GatheredLora.groups``; the Triton shrink reads each
    group's A once); ``backend``: "torch" (the reference),
    "triton" (CUDA, or CPU under TRITON_INTERPRET=1) or "auto" (Triton on CUDA, torch
    elsewhere). The Triton path is two launches over all rows whatever the mix of adapters
    (shrink x A^T per K block, expand into N), reads no value on the host, and so can be
    captured in a CUDA graph; it cannot check ranks on the host either: rows of rank above
    ``MAX_RANK`` come out NaN (the reference raises). ``partials``: the shrink already done
    (``lora_epilogues.swiglu_ahead``'s ``(part, k_blocks)`` for these rows): only the expand runs."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {BACKENDS}")
    if backend == "auto":
        backend = "triton" if x.is_cuda else "torch"
    if backend == "torch":
        return lora_gather_reference(x, pool, a_offsets, b_offsets, ranks, scales, out_features, out=out)
    return _lora_gather_triton(x, pool, a_offsets, b_offsets, ranks, scales, out_features, out, groups=groups,
                               partials=partials, rank_bound=rank_bound)


def adapter_groups(keys: Sequence[int], width: int, group_rows: int | None = None) -> torch.Tensor:
    """``GatheredLora.groups`` of rows whose adapters are ``keys`` (row i's adapter; 0: none,
    left out): the rows sorted by adapter (stable), runs of one adapter cut into groups of at
    most ``group_rows`` (default ``GROUP_ROWS``, the kernels' block of rows). -> ``[4, width]``
    int32 (CPU): start, end, and the sorted rows from column 0 on; unused columns are empty
    groups (0, 0) and row 0; the groups' columns ordered by their rows, most first (stable), so
    the groups of at least m rows are the first columns, at most ``width // m`` of them (the
    hybrid expands' group programs, ``HYBRID_MIN_ROWS``); the fourth row: row i's group's rows
    (0: in none), by which the per-row kernels leave a grouped row's LoRA to its group."""
    group_rows = group_rows or GROUP_ROWS
    if len(keys) > width:
        raise ValueError(f"{len(keys)} rows do not fit groups of width {width}")
    order = sorted((i for i, k in enumerate(keys) if k), key=lambda i: keys[i])
    out = torch.zeros(4, width, dtype=torch.int32)
    bounds, n = [], 0
    while n < len(order):
        end = n + 1
        while end < len(order) and end - n < group_rows and keys[order[end]] == keys[order[n]]:
            end += 1
        bounds.append((n, end))
        n = end
    if bounds:
        bounds.sort(key=lambda se: se[0] - se[1])  # (stable: equal sizes keep the adapters' order)
        out[:2, :len(bounds)] = torch.tensor(bounds, dtype=torch.int32).t()
        out[2, :len(order)] = torch.tensor(order, dtype=torch.int32)
        for s, e in bounds:
            out[3, order[s:e]] = e - s
    return out


def _require_triton(t: torch.Tensor) -> None:
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors (got one on {t.device}); use backend='torch' or "
            "'auto' on the CPU, or set TRITON_INTERPRET=1 to run the kernels in the interpreter"
        )


def shrink_blocks(device: torch.device, block_k: int | None = None, block_r: int | None = None) -> tuple[int, int]:
    """(block_k, block_r) of the shrink and the expand's rank loop: the GPU's defaults, or small
    blocks in the interpreter (masks and rank loops exercised on tiny shapes)."""
    gpu = device.type == "cuda"
    # H100, 8B shapes, r=16, 16-256 rows (docs/kernels.md): K blocks of
    # 512 and rank blocks of 16 beat 256 / 32 by 1.3-2.1x in the fused epilogues (no masked lanes
    # at r=16, half the programs); mixed ranks 8-64 lost nothing
    return block_k or (ROW_SHRINK_BLOCK_K if gpu else 32), block_r or 16


def few_rows(rows: int) -> bool:
    """Whether a launch over ``rows`` decode rows takes the few-rows blocks (``FEW_ROWS``)."""
    return FEW_ROWS is not None and 0 < rows <= FEW_ROWS


def ahead_rows(rows: int) -> bool:
    """Whether SwiGLU's launch over ``rows`` decode rows folds down's shrink in (``AHEAD_MAX_ROWS``;
    never where those rows take the grouped shrink)."""
    return (AHEAD_MAX_ROWS is not None and 0 < rows <= AHEAD_MAX_ROWS and rows < GROUPED_MIN_ROWS
            and (GROUPED_EXPAND_MIN_ROWS is None or rows < GROUPED_EXPAND_MIN_ROWS))


def rank_split(device: torch.device | None, rows: int, rank_bound: int | None = None) -> int:
    """Programs sharing a row's rank blocks in the per-row shrink over ``rows`` rows:
    ``RANK_SPLIT`` up to ``RANK_SPLIT_MAX_ROWS`` rows, else 1 (and 1 where the few-rows blocks
    hold a row's rank in one tile, or the rows' ``rank_bound`` is within ``UNSPLIT_MAX_RANK``)."""
    if RANK_SPLIT_MAX_ROWS is None or not 0 < rows <= RANK_SPLIT_MAX_ROWS or few_rows(rows):
        return 1
    if rank_bound is not None and UNSPLIT_MAX_RANK is not None and rank_bound <= UNSPLIT_MAX_RANK:
        return 1
    return RANK_SPLIT


def row_blocks(device: torch.device, rows: int, block_k: int | None = None,
               block_r: int | None = None) -> tuple[int, int]:
    """(block_k, block_r) of the per-row shrink and the expands' rank loop for a launch over
    ``rows`` decode rows: ``shrink_blocks``, or the few-rows blocks (K blocks of
    ``FEW_SHRINK_BLOCK_K`` on a GPU, 16 in the interpreter; rank blocks of ``FEW_BLOCK_R``);
    a caller's block wins."""
    if few_rows(rows):
        return block_k or (FEW_SHRINK_BLOCK_K if device.type == "cuda" else 16), block_r or FEW_BLOCK_R
    return shrink_blocks(device, block_k, block_r)


def expand_block_n(device: torch.device, rows: int, block_n: int | None = None) -> int:
    """The per-row expands' column block for a launch over ``rows`` decode rows (``lora_gather``'s
    own expand, SwiGLU's LoRA rows): ``ROW_EXPAND_BLOCK_N``, ``FEW_EXPAND_BLOCK_N`` for few rows,
    32 in the interpreter; a caller's block wins."""
    if block_n:
        return block_n
    if device.type != "cuda":
        return 32
    return FEW_EXPAND_BLOCK_N if few_rows(rows) else ROW_EXPAND_BLOCK_N


def lora_shrink(lora: GatheredLora, *, block_k: int | None = None, block_r: int | None = None,
                num_warps: int | None = None, stream: torch.cuda.Stream | None = None) -> tuple[torch.Tensor, int]:
    """Triton: every projection's ``x A^T`` of the group in one launch -> (part, k_blocks):
    ``part [G, B, k_blocks, MAX_RANK]`` fp32 partial sums over K blocks (read by
    ``lora_delta``; entries past a row's rank are never written nor read). Rows grouped by
    adapter (from ``GROUPED_MIN_ROWS`` rows): ``lora_grouped_kernels``' shrink, its K blocks
    ``GROUPED_SHRINK_SPLIT_K`` wide where set. ``lora.partials`` set (launched already,
    ``shrink_beside``): those, nothing launched. ``stream``: launched on that CUDA stream, ``part``
    allocated on the current one (``shrink_beside`` orders the two)."""
    if lora.partials is not None:
        return lora.partials
    _require_triton(lora.x)
    if lora.pool.stride(0) != 1:
        raise ValueError("pool must be contiguous (a flat buffer of adapter weights)")
    x = lora.x if lora.x.stride(1) == 1 else lora.x.contiguous()
    g, rows = lora.ranks.shape
    k = x.shape[1]
    grouped = takes_groups(rows, lora.groups, GROUPED_MIN_ROWS)
    split_k = None
    if grouped:  # the grouped kernel's own knobs, where set and the caller set none
        gpu_tiles = GROUPED_SHRINK_GPU_TILES if x.is_cuda else (None, None)
        block_k = block_k or GROUPED_SHRINK_BLOCK_K or gpu_tiles[0]
        split_k = GROUPED_SHRINK_SPLIT_K or gpu_tiles[1]
        num_warps = num_warps or GROUPED_SHRINK_WARPS
        block_r = block_r or GROUPED_SHRINK_BLOCK_R
    num_warps = num_warps or ROW_SHRINK_WARPS
    block_k, block_r = row_blocks(x.device, rows, block_k, block_r)
    split_k = triton.cdiv(split_k or block_k, block_k) * block_k if grouped else block_k
    k_blocks = triton.cdiv(k, split_k)
    part = torch.empty(max(g * rows * k_blocks * MAX_RANK, 1), dtype=torch.float32, device=x.device)
    trigger = pdl_options(x.device, rows, lora.rank_bound)[2]
    if stream is not None:  # x, part and everything before them enqueued on the current stream first
        stream.wait_stream(torch.cuda.current_stream(x.device))
        if x is not lora.x:
            x.record_stream(stream)
    with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
        _launch_shrink(lora, x, part, grouped, g, rows, k, k_blocks, block_k, block_r, split_k, num_warps, trigger)
    return part, k_blocks


def _launch_shrink(lora: GatheredLora, x: torch.Tensor, part: torch.Tensor, grouped: bool, g: int, rows: int, k: int,
                   k_blocks: int, block_k: int, block_r: int, split_k: int, num_warps: int, trigger: dict) -> None:
    """``lora_shrink``'s launch: the grouped kernel or the per-row one (none for no rows)."""
    if grouped:
        groups = lora.groups
        stages = {} if GROUPED_SHRINK_STAGES is None else {"num_stages": GROUPED_SHRINK_STAGES}
        _lora_grouped_shrink_kernel[(groups.shape[1], k_blocks, g * GROUPED_RANK_SPLIT)](
            x, lora.pool, lora.a_offsets, lora.ranks, groups, part, k, x.stride(0), lora.a_offsets.stride(0),
            lora.ranks.stride(0), rows, groups.stride(0), k_blocks, MAX_R=MAX_RANK, BLOCK_M=group_block_m(),
            BLOCK_R=max(block_r, 16), BLOCK_K=block_k, SPLIT_K=split_k,
            DOT_PRECISION=dot_precision(x.dtype), SINGLE_ROWS=GROUPED_SHRINK_SINGLE_ROWS,
            RANK_SPLIT=GROUPED_RANK_SPLIT, UNROLL_K=GROUPED_SHRINK_UNROLL_K, num_warps=num_warps, **trigger,
            **stages,
        )
    elif rows:
        split = rank_split(x.device, rows, lora.rank_bound)
        _lora_shrink_kernel[(rows, k_blocks, g * split)](
            x, lora.pool, lora.a_offsets, lora.ranks, part, k, x.stride(0), lora.a_offsets.stride(0),
            lora.ranks.stride(0), MAX_R=MAX_RANK, BLOCK_R=block_r, BLOCK_K=block_k, RANK_SPLIT=split,
            num_warps=num_warps, **trigger,
        )


def beside_applies(lora: GatheredLora | None, stream: torch.cuda.Stream | None, wide: bool = False) -> bool:
    """Whether ``shrink_beside(lora, stream, wide)`` launches the shrink on ``stream``: a second
    stream given, CUDA tensors, not launched already, and at most ``BESIDE_MAX_ROWS`` rows of
    per-row shrink (the grouped one too with ``BESIDE_GROUPED``); ``wide``: any rows, either
    shrink (the engine's ``EngineTuning.decode_lora_beside`` "wide")."""
    if lora is None or stream is None or lora.partials is not None or not lora.x.is_cuda:
        return False
    rows = lora.ranks.shape[1]
    if wide:
        return rows > 0
    return BESIDE_MAX_ROWS is not None and 0 < rows <= BESIDE_MAX_ROWS and (
        BESIDE_GROUPED or not takes_groups(rows, lora.groups, GROUPED_MIN_ROWS))


def expand_beside(lora: GatheredLora, out_features: int, stream: torch.cuda.Stream | None) -> torch.Tensor:
    """The rows' LoRA of ``lora``'s one projection as an fp32 delta ``[B, out_features]`` (rows of
    rank 0: zeros), by the per-row expand launched on ``stream`` after the shrink that
    ``shrink_beside`` launched there (its partials), a programmatic dependent of it where
    ``pdl_applies``. Call it first in ``shrink_beside``'s block, before anything else is enqueued
    on the current stream: the delta is allocated there, and ``stream`` waited for that stream
    at the fork; the block's join orders the delta before the kernel that adds it
    (``add_rms_norm(lora=)``), whose sum rounds as an additive expand into the output rounds.
    ``stream`` None: the current stream (the interpreter)."""
    if lora.partials is None or lora.num_projections != 1:
        raise ValueError("expand_beside needs one projection's partials launched beside (shrink_beside)")
    part, k_blocks = lora.partials
    x, rows = lora.x, lora.ranks.shape[1]
    delta = torch.empty(rows, out_features, dtype=torch.float32, device=x.device)
    _, block_r = row_blocks(x.device, rows)
    block_n = expand_block_n(x.device, rows)
    with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
        _row_expand(lora, part, k_blocks, delta, block_r, block_n, accumulate=False, num_warps=ROW_EXPAND_WARPS)
    return delta


def _row_expand(lora: GatheredLora, part: torch.Tensor, k_blocks: int, out: torch.Tensor, block_r: int,
                block_n: int, *, accumulate: bool, num_warps: int) -> None:
    """The per-row expand of ``lora``'s one projection into ``out [rows, N]`` (``accumulate``:
    added to it), with the hybrid expands' group programs where ``hybrid_applies`` (without
    ``HYBRID_FUSED``: a grouped launch of those groups after it)."""
    rows, n = lora.ranks.shape[1], out.shape[1]
    pdl_meta, pdl_launch, _ = pdl_options(out.device, rows, lora.rank_bound)
    hyb_args, hyb_meta, slots = hybrid_expand_options(rows, lora.groups, out.dtype, part, block_n)
    _lora_expand_kernel[(slots + rows, triton.cdiv(n, block_n))](
        lora.pool, lora.b_offsets[0], lora.ranks[0], lora.scales, part, out, n, k_blocks, out.stride(0), *hyb_args,
        ACCUMULATE=accumulate, MAX_R=MAX_RANK, BLOCK_R=block_r, BLOCK_KB=triton.next_power_of_2(k_blocks),
        BLOCK_N=block_n, num_warps=num_warps, **pdl_meta, **pdl_launch, **hyb_meta,
    )
    if hyb_meta and not slots:
        lora_grouped_expand(lora, part, k_blocks, 0, out, block_r=block_r, min_rows=HYBRID_MIN_GROUP)


@contextlib.contextmanager
def shrink_beside(lora: GatheredLora | None, stream: torch.cuda.Stream | None,
                  wide: bool = False) -> Iterator[GatheredLora | None]:
    """Where ``beside_applies``: the group's shrink is launched on ``stream`` after the work
    enqueued so far on the current stream (``lora.x`` written), and the block runs with
    ``lora`` carrying those ``partials`` (enqueue the frozen GEMM there: it runs beside the
    shrink); on leaving, the current stream waits for ``stream``, so the consumer launched
    after it (the epilogue, ``lora_gather``) reads finished partials. Elsewhere: ``lora`` as
    it is, nothing launched. Works the same under CUDA graph capture (a fork and a join).
    ``wide``: ``beside_applies``'."""
    if not beside_applies(lora, stream, wide):
        yield lora
        return
    main = torch.cuda.current_stream(lora.x.device)
    part = lora_shrink(lora, stream=stream)
    try:
        yield dataclasses.replace(lora, partials=part)
    finally:
        main.wait_stream(stream)


def dot_precision(dtype: torch.dtype) -> str:
    """The grouped shrink's ``tl.dot`` precision: exact products (half inputs are exact in
    tf32; fp32 ones need "ieee")."""
    return "ieee" if dtype == torch.float32 else "tf32"


def lora_grouped_expand(lora: GatheredLora, part: torch.Tensor, k_blocks: int, g: int, out: torch.Tensor, *,
                        head_dim: int | None = None, block_r: int | None = None, min_rows: int = 0) -> None:
    """Triton, in place: ``out [B, N]`` (or ``[B, heads, head_dim]``, unit stride along
    head_dim) += projection g's delta of the grouped rows, a program per (group, column block)
    (``part``, ``k_blocks``: ``lora_shrink``'s). Rows in no group (no adapter, padding; rank
    0) are not touched. ``min_rows``: only the groups of at least that many rows (the hybrid
    expands': over the first ``hybrid_slots`` columns)."""
    n = out.shape[1] if out.dim() == 2 else out.shape[1] * out.shape[2]
    hd = head_dim or n
    hstride = out.stride(1) if out.dim() == 3 else 0
    _, block_r = row_blocks(out.device, lora.ranks.shape[1], None, block_r)  # the per-row expand's (its row loop)
    groups = lora.groups
    block_n = GROUPED_EXPAND_BLOCK_N if out.is_cuda else 16
    width = hybrid_slots(groups) if min_rows > 1 else groups.shape[1]
    _lora_grouped_expand_kernel[(width, triton.cdiv(n, block_n))](
        lora.pool, lora.b_offsets, lora.ranks, lora.scales, groups, part, out, n, out.stride(0), hstride, hd,
        g, lora.ranks.shape[1], k_blocks, groups.stride(0), lora.b_offsets.stride(0), lora.ranks.stride(0),
        GROUPED_EXPAND_LOOP_ROWS, min_rows,
        MAX_R=MAX_RANK, BLOCK_M=group_block_m(), BLOCK_R=grouped_expand_block_r(block_r),
        BLOCK_KB=triton.next_power_of_2(k_blocks), BLOCK_N=block_n, DOT_PRECISION=expand_dot_precision(out.dtype),
        ROW_LOOP=GROUPED_EXPAND_ROW_LOOP, HALF_S=expand_half_s(out.dtype), num_warps=GROUPED_EXPAND_WARPS,
        **(hybrid_stages() if min_rows > 1 else {}),
    )


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def _lora_gather_triton(
    x, pool, a_offsets, b_offsets, ranks, scales, out_features, out, *,
    block_k=None, block_n=None, block_r=None, num_warps=None, groups=None, partials=None, rank_bound=None,
):
    """The launcher; the keyword knobs exist for tests and tile sweeps."""
    check_gather_inputs(x, pool, a_offsets, b_offsets, ranks, scales, out_features, out)
    _require_triton(x)
    if out is not None and out.stride(1) != 1:
        raise ValueError(f"out must have unit stride along features (it is written in place); got strides {out.stride()}")
    rows = x.shape[0]
    n = out_features
    result = out if out is not None else torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return result
    lora = GatheredLora(x, pool, a_offsets[None], b_offsets[None], ranks[None], scales, groups=groups,
                        rank_bound=rank_bound)
    if partials is None:
        part, k_blocks = lora_shrink(lora, block_k=block_k, block_r=block_r, num_warps=num_warps)
    else:
        part, k_blocks = partials
        if part.numel() != rows * k_blocks * MAX_RANK or part.dtype != torch.float32:
            raise ValueError(f"partials must be [{rows} rows x {k_blocks} K blocks x {MAX_RANK}] fp32; got "
                             f"{part.numel()} {part.dtype}")
    _, block_r = row_blocks(x.device, rows, block_k, block_r)
    block_n = expand_block_n(x.device, rows, block_n)
    if takes_groups(rows, groups, GROUPED_EXPAND_MIN_ROWS):
        if out is None:
            result.zero_()
        lora_grouped_expand(lora, part, k_blocks, 0, result, block_r=block_r)
        return result
    _row_expand(lora, part, k_blocks, result, block_r, block_n, accumulate=out is not None,
                num_warps=num_warps or ROW_EXPAND_WARPS)
    return result
