"""What follows a serving step's q/k/v and gate/up GEMMs, fused with the decode rows' LoRA expand.

``rope_write_kv``: q, k, v ``(+)= LoRA``, RoPE on q and k, k and v written into their KV-cache
pages: one launch, a program per (row, head). ``swiglu``: ``silu(gate (+ LoRA)) * (up (+ LoRA))``:
one launch over (row, column block). With a ``GatheredLora`` (the decode rows' adapters) the
group's shrink (``lora_shrink``, one launch for all its projections) runs first and the expand
happens inside these kernels, so a projection's LoRA costs no launch of its own after the shrink.

The Triton kernels are in ``lora_epilogue_kernels.py``; this module holds the checks, the
references and the launchers. The references compose the existing ops in the engine's order:
``lora_gather_reference`` into each projection (fp32 sum, one rounding), then ``apply_rope`` / ``write_kv`` or ``silu * up``.
The kernels round at the same points (after the LoRA add; then once at the end, where the
reference rounds after each half-precision op), so fp32 agrees to rounding and half precision
to an ulp or so of the output.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from . import lora_gather as _gather
from .lora_gather import (BACKENDS, MAX_RANK, GatheredLora, _require_triton, lora_grouped_expand, lora_shrink,
                          row_blocks, takes_groups)
from .lora_ahead import ShrinkAhead
from .lora_epilogue_kernels import _rope_kv_kernel, _rope_kv_rows_kernel, _swiglu_kernel  # noqa: F401 (scripts import them here)
from .lora_grouped_kernels import _swiglu_grouped_kernel
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
    dots = rope_group_dots(q, r)
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


def rope_group_dots(q: torch.Tensor, rot: int) -> bool:
    """Whether the RoPE epilogue's hybrid group programs can run for q [T, Hq, D] with ``rot``
    rotated dims: a group's dot needs tiles of at least 16 columns on a GPU (the interpreter takes
    any); without them the groups' rows take the per-row arithmetic."""
    d = q.shape[-1]
    tiles = (triton.next_power_of_2(rot // 2), triton.next_power_of_2(d // 2),
             triton.next_power_of_2(max(d - rot, 1)) if d > rot else 16)
    return not q.is_cuda or min(tiles) >= 16


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
