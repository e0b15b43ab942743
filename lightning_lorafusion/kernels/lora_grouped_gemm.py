"""The prefill rows' LoRA as two grouped GEMMs (``torch._grouped_mm``) over factors staged per step.

``lora_segments`` reads each adapter's A and Bᵀ where the pool keeps them, from Triton kernels
walking row tiles. This form instead copies the factors a step needs into two dense stacks, one
slot per row group (a run of consecutive rows of one adapter, ``row_groups``), and hands the
products to the grouped GEMM of the GPU library (CUTLASS on Hopper), as mixture-of-experts layers
do with their experts:

    A_stack  [G, R, K]    slot g: the group's adapter's A of every projection of the group, each
                          in its own band of rows (projection p in rows ``r0_p .. r0_p + R_p``,
                          ``R_p`` the step's largest rank on p, zeros past the adapter's rank)
    Bt_stack [G, N, R]    the same bands, transposed and block-diagonal: column block of
                          projection p (``n0_p .. n0_p + N_p``) holds ``scale * B_p`` in band p,
                          zeros elsewhere
    S     = grouped_mm(x, A_stack^T, offs)     [T, R]   (bf16, fp32 sums)
    delta = grouped_mm(S, Bt_stack^T, offs)    [T, N]   every projection of the group at once

A group with no adapter (rows without LoRA) stages zeros: its rows' delta is zero, so ``delta``
covers every row and a write-first projection (``paged_forward.write_first``) lets the frozen
GEMM add its product onto it. The extra work of the bands (each projection's rows of S meet
every column block, zeros outside its own) is ``R / R_p`` times the LoRA's FLOPs, small against
the frozen products; S is rounded to the input's dtype between the two GEMMs (the row-tile
kernels keep it in fp32) and the scale is folded into the staged Bᵀ.

Staging is one Triton launch per stack (``stage_factors``; ``stage_factors_reference`` is the
torch form the tests check it against); the grouped GEMMs run wherever ``torch._grouped_mm``
does (CUDA on Hopper, and its CPU fallback). The stacks' sizes follow the step (groups, the step's
largest ranks), so this form is for eager steps, not for captured ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from .segment_tables import NO_ADAPTER, SegmentLora, covering_segments

__all__ = ["RowGroups", "row_groups", "band_widths", "stage_factors", "stage_factors_reference",
           "grouped_lora_delta", "grouped_available"]

# a band's width is rounded up to this many ranks (the grouped GEMM wants 16-byte aligned rows)
BAND_ALIGN = 16
MAX_PROJECTIONS = 3


@dataclass(frozen=True)
class RowGroups:
    """Consecutive rows of one adapter each, covering rows ``[0, rows)``: ``bounds`` the host
    list of (start, end, adapter index or ``NO_ADAPTER``), ``ends`` int32 on the device (the
    grouped GEMM's ``offs``: each group's end row), ``adapters`` int32 on the device."""

    bounds: tuple[tuple[int, int, int], ...]
    ends: torch.Tensor
    adapters: torch.Tensor

    @property
    def count(self) -> int:
        return len(self.bounds)


def row_groups(segments: Sequence[tuple[int, int, int]], rows: int, device: torch.device) -> RowGroups:
    """The groups of ``rows`` rows from a step's segments (start, end, adapter): the rows no
    segment covers in groups without adapter (``covering_segments``), neighbours of the same
    adapter merged."""
    try:
        covering = covering_segments(sorted(s for s in segments if s[1] > s[0]), rows)
    except ValueError as exc:
        raise ValueError(f"a segment overlaps another or passes the {rows} rows: {list(segments)}") from exc
    merged: list[list[int]] = []
    for start, end, ad in covering or [(0, rows, NO_ADAPTER)]:
        if merged and merged[-1][2] == ad:
            merged[-1][1] = end
        else:
            merged.append([start, end, ad])
    bounds = tuple(tuple(g) for g in merged)
    ends = torch.tensor([e for _, e, _ in bounds], dtype=torch.int32).to(device, non_blocking=True)
    adapters = torch.tensor([a for _, _, a in bounds], dtype=torch.int32).to(device, non_blocking=True)
    return RowGroups(bounds, ends, adapters)


def band_widths(max_ranks: Sequence[int]) -> tuple[int, ...]:
    """Each projection's band of the stacks: its largest rank in the step, rounded up to
    ``BAND_ALIGN`` (at least one alignment: a projection no adapter of the step targets keeps a
    zero band, so the stacks keep their shape)."""
    return tuple(max(BAND_ALIGN, -(-int(r) // BAND_ALIGN) * BAND_ALIGN) for r in max_ranks)


def _check(lora: SegmentLora, k: int, ns: Sequence[int], bands: Sequence[int]) -> None:
    if not 1 <= len(ns) <= MAX_PROJECTIONS or len(bands) != len(ns):
        raise ValueError(f"{len(ns)} projections with {len(bands)} bands; 1 to {MAX_PROJECTIONS} projections, "
                         "one band each")
    if lora.ranks.shape[0] != len(ns):
        raise ValueError(f"the tables hold {lora.ranks.shape[0]} projections, the outputs {len(ns)}")


def stage_factors_reference(lora: SegmentLora, groups: RowGroups, k: int, ns: Sequence[int],
                            bands: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``stage_factors`` in torch, reading the tables on the host (a device sync): for tests."""
    _check(lora, k, ns, bands)
    pool = lora.pool
    a_off, b_off, ranks, scales = (t.cpu().tolist() for t in (lora.a_offsets, lora.b_offsets, lora.ranks,
                                                               lora.scales))
    g_n, r_total, n_total = groups.count, sum(bands), sum(ns)
    a_stack = torch.zeros(g_n, r_total, k, dtype=pool.dtype, device=pool.device)
    bt_stack = torch.zeros(g_n, n_total, r_total, dtype=pool.dtype, device=pool.device)
    for g, (_, _, ad) in enumerate(groups.bounds):
        if ad == NO_ADAPTER:
            continue
        r0 = n0 = 0
        for p, (n, band) in enumerate(zip(ns, bands)):
            r = min(ranks[p][ad], band)
            if r > 0:
                a_stack[g, r0:r0 + r] = pool[a_off[p][ad]:a_off[p][ad] + r * k].view(r, k)
                bt = pool[b_off[p][ad]:b_off[p][ad] + r * n].view(r, n).float() * scales[ad]
                bt_stack[g, n0:n0 + n, r0:r0 + r] = bt.t().to(pool.dtype)
            r0, n0 = r0 + band, n0 + n
    return a_stack, bt_stack


@triton.jit
def _stage_a_kernel(pool_ptr, a_off_ptr, rank_ptr, group_ad_ptr, band_p_ptr, band_r_ptr, out_ptr, K, r_total,
                    a_stride, BLOCK_K: tl.constexpr):
    """Program (g, j): row j of slot g of the A stack (band ``band_p[j]``, rank row
    ``band_r[j]``): the adapter's A row, or zeros past its rank / without adapter."""
    g = tl.program_id(0)
    j = tl.program_id(1)
    ad = tl.load(group_ad_ptr + g)
    p = tl.load(band_p_ptr + j)
    r = tl.load(band_r_ptr + j)
    has = ad >= 0
    safe = tl.maximum(ad, 0)
    rank = tl.load(rank_ptr + p * a_stride + safe, mask=has, other=0)
    live = has & (r < rank)
    src = tl.load(a_off_ptr + p * a_stride + safe, mask=live, other=0) + r.to(tl.int64) * K
    dst = out_ptr + (g.to(tl.int64) * r_total + j) * K
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        ok = offs < K
        v = tl.load(pool_ptr + src + offs, mask=ok & live, other=0.0)
        tl.store(dst + offs, v, mask=ok)


@triton.jit
def _stage_bt_kernel(pool_ptr, b_off_ptr, rank_ptr, scale_ptr, group_ad_ptr, band_p_ptr, band_r_ptr, out_ptr,
                     n0_1, n0_2, n_total, r_total, b_stride, N0, N1, N2,
                     BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program (g, column block): rows ``n`` of slot g of the Bᵀ stack, every band: element
    (n, j) = scale * Bt_p[band_r[j], n - n0_p] when column n and band row j are both projection
    p's and the rank row is under the adapter's rank, else zero."""
    g = tl.program_id(0)
    nb = tl.program_id(1)
    ad = tl.load(group_ad_ptr + g)
    has = ad >= 0
    safe = tl.maximum(ad, 0)
    scale = tl.load(scale_ptr + safe, mask=has, other=0.0)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_total
    p_n = (offs_n >= n0_1).to(tl.int32) + (offs_n >= n0_2).to(tl.int32)
    n_local = offs_n - tl.where(p_n == 0, 0, tl.where(p_n == 1, n0_1, n0_2))
    for j0 in range(0, r_total, BLOCK_R):
        offs_j = j0 + tl.arange(0, BLOCK_R)
        j_ok = offs_j < r_total
        p_j = tl.load(band_p_ptr + offs_j, mask=j_ok, other=-1)
        r_j = tl.load(band_r_ptr + offs_j, mask=j_ok, other=0)
        safe_p = tl.maximum(p_j, 0)
        rank_j = tl.load(rank_ptr + safe_p * b_stride + safe, mask=j_ok & has, other=0)
        b_j = tl.load(b_off_ptr + safe_p * b_stride + safe, mask=j_ok & has, other=0)
        width_j = tl.where(p_j == 0, N0, tl.where(p_j == 1, N1, N2))
        live_j = j_ok & has & (r_j < rank_j)
        take = (p_n[:, None] == p_j[None, :]) & live_j[None, :] & n_ok[:, None]
        src = b_j[None, :] + r_j[None, :].to(tl.int64) * width_j[None, :] + n_local[:, None]
        v = tl.load(pool_ptr + src, mask=take, other=0.0).to(tl.float32) * scale
        dst = out_ptr + (g.to(tl.int64) * n_total + offs_n[:, None]) * r_total + offs_j[None, :]
        tl.store(dst, v.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & j_ok[None, :])


_BAND_TABLES: dict[tuple[tuple[int, ...], str], tuple[torch.Tensor, torch.Tensor]] = {}


def _band_tables(bands: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each stack row's (projection, rank row), kept per band widths and device (a step reuses
    them, and a call under CUDA-graph capture makes no host-to-device copy once they exist)."""
    key = (tuple(bands), str(device))
    if key not in _BAND_TABLES:
        p = [i for i, b in enumerate(bands) for _ in range(b)]
        r = [j for b in bands for j in range(b)]
        _BAND_TABLES[key] = (torch.tensor(p, dtype=torch.int32).to(device),
                             torch.tensor(r, dtype=torch.int32).to(device))
    return _BAND_TABLES[key]


def stage_factors(lora: SegmentLora, groups: RowGroups, k: int, ns: Sequence[int],
                  bands: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The A and Bᵀ stacks of a group of projections (``[G, R, K]`` and ``[G, N, R]``, the
    pool's dtype; module docstring), one Triton launch each, no host read of the tables."""
    _check(lora, k, ns, bands)
    pool = lora.pool
    g_n, r_total, n_total = groups.count, sum(bands), sum(ns)
    a_stack = torch.empty(g_n, r_total, k, dtype=pool.dtype, device=pool.device)
    bt_stack = torch.empty(g_n, n_total, r_total, dtype=pool.dtype, device=pool.device)
    band_p, band_r = _band_tables(bands, pool.device)
    _stage_a_kernel[(g_n, r_total)](pool, lora.a_offsets, lora.ranks, groups.adapters, band_p, band_r, a_stack,
                                    k, r_total, lora.a_offsets.stride(0), BLOCK_K=512)
    widths = list(ns) + [0] * (MAX_PROJECTIONS - len(ns))
    starts = [sum(ns[:i]) if i < len(ns) else n_total for i in range(MAX_PROJECTIONS)]
    block_n = 64
    _stage_bt_kernel[(g_n, triton.cdiv(n_total, block_n))](
        pool, lora.b_offsets, lora.ranks, lora.scales, groups.adapters, band_p, band_r, bt_stack,
        starts[1], starts[2], n_total, r_total, lora.b_offsets.stride(0), widths[0], widths[1], widths[2],
        BLOCK_N=block_n, BLOCK_R=32)
    return a_stack, bt_stack


def grouped_available(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs these inputs: its CPU fallback, or CUDA with bf16 on a
    GPU of compute capability 9.0 and later (its CUTLASS kernels)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True
    return (x.device.type == "cuda" and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def grouped_lora_delta(x: torch.Tensor, lora: SegmentLora, ns: Sequence[int], max_ranks: Sequence[int], *,
                       staged: tuple[torch.Tensor, torch.Tensor] | None = None,
                       groups: RowGroups | None = None) -> torch.Tensor:
    """Every row's LoRA delta of a group of projections sharing ``x [T, K]``, side by side
    ``[T, sum(ns)]`` in ``x``'s dtype (zeros on rows without LoRA): the two grouped GEMMs over the
    stacks (``stage_factors``, or ``staged``). ``max_ranks``: each projection's largest rank
    among the step's adapters (host values: the bands' widths)."""
    if not grouped_available(x):
        raise RuntimeError("torch._grouped_mm does not run here (CPU, or bf16 on a GPU of compute capability >= 9.0)")
    groups = groups or row_groups(lora.segments, x.shape[0], x.device)
    bands = band_widths(max_ranks)
    if staged is None:
        staged = (stage_factors(lora, groups, x.shape[1], ns, bands) if x.device.type == "cuda"
                  else stage_factors_reference(lora, groups, x.shape[1], ns, bands))
    a_stack, bt_stack = staged
    s = torch._grouped_mm(x, a_stack.transpose(1, 2), offs=groups.ends)
    return torch._grouped_mm(s, bt_stack.transpose(1, 2), offs=groups.ends)
