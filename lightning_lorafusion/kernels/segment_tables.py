"""The prefill rows' LoRA tables (``SegmentLora``: row tiles of one adapter each over the pool) and
their torch reference, shared by the Triton forms (``lora_segments``, ``lora_tiles``,
``lora_splitk``) and the fused-epilogue product (``lora_linear``), with the Triton helpers the
forms' kernels share (a tile's table entries, a rank chunk of the shrink, a whole shrink program,
an expand's output block)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from .lora_gather import MAX_RANK, SUPPORTED_DTYPES


NO_ADAPTER = -1  # a tile's adapter index for rows without LoRA (the gaps of a covering table)


def segment_tiles(segments: Sequence[tuple[int, int, int]], block_m: int,
                  rows: int | None = None) -> list[tuple[int, int, int]]:
    """Segments ``(start, end, adapter)`` -> tiles of at most ``block_m`` rows, in order.
    ``rows``: also cover every other row of ``[0, rows)`` with tiles of adapter ``NO_ADAPTER``
    (a covering table, what the write-first expand needs: it writes every row of its output,
    zeros where no LoRA); the segments must then be in row order and not overlap."""
    if rows is not None:
        segments = covering_segments(segments, rows)
    tiles = []
    for start, end, adapter in segments:
        tiles += [(s, min(s + block_m, end), adapter) for s in range(start, end, block_m)]
    return tiles


def covering_segments(segments: Sequence[tuple[int, int, int]], rows: int) -> list[tuple[int, int, int]]:
    """``segments`` in row order plus ``(start, end, NO_ADAPTER)`` for each run of the ``rows``
    rows they leave out."""
    out, pos = [], 0
    for start, end, adapter in segments:
        if start < pos or end < start or end > rows:
            raise ValueError(f"segments must be in row order, not overlap and end by row {rows}; got {list(segments)}")
        if start > pos:
            out.append((pos, start, NO_ADAPTER))
        out.append((start, end, adapter))
        pos = end
    if pos < rows:
        out.append((pos, rows, NO_ADAPTER))
    return out


def block_r_for(max_rank: int) -> int:
    """The width of S (a runtime stride, nothing compiled per value): a power of two >= 16
    holding ``max_rank``."""
    if not 0 <= max_rank <= MAX_RANK:
        raise ValueError(f"ranks must be in [0, {MAX_RANK}]; got {max_rank}")
    return max(16, triton.next_power_of_2(max(max_rank, 1)))


@dataclass(frozen=True)
class SegmentLora:
    """A step's prefill rows' LoRA for G projections sharing an input.

    ``tiles [3, n_tiles]`` int32 (row start, row end, adapter index; padding tiles have start ==
    end), ``a_offsets`` / ``b_offsets [G, A]`` int64 element offsets into ``pool`` (unit stride
    along adapters), ``ranks [G, A]`` int32 (0 = the adapter has no LoRA on that projection),
    ``scales [A]`` fp32, all on the pool's device. ``segments``: the host copy of what the
    tiles cover (for the reference); ``block_m`` the tile height the tiles were cut at,
    ``block_r`` >= every rank (``block_r_for``): the width of the shrink's fp32 scratch S, a
    runtime value (tables of any rank mix up to it run the same compiled kernels). ``live``:
    None, or ``[1]`` int32 on the pool's device, the count of the table's leading tiles that
    may hold rows (the rest are padding): the Triton kernels then walk those tiles only
    (``lora_segments``' live grids); the torch reference reads ``segments`` either way.
    ``counters``: None, or int32 zeros on the pool's device, at least ``tiles x G``: the split-K
    form's per-(tile, projection) arrival counters (``lora_splitk``; its shrink leaves them zero),
    kept by the caller so that a step launches no zeroing (None: that form allocates them).
    ``factor_align``: every offset in ``a_offsets`` / ``b_offsets`` is a multiple of this many
    elements (the engine's pool aligns each matrix to ``adapters.ALIGN``): the split-K form's
    loads of A and Bᵀ rows are then vector loads (1: no promise, element loads).
    """

    pool: torch.Tensor
    tiles: torch.Tensor
    a_offsets: torch.Tensor
    b_offsets: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]
    block_m: int
    block_r: int
    live: torch.Tensor | None = None
    counters: torch.Tensor | None = None
    factor_align: int = 1

    @property
    def num_projections(self) -> int:
        return self.a_offsets.shape[0]

    def check(self, x: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        """Shapes, dtypes and devices only (no device value read)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"x must be a 2-D tensor [rows, in_features]; got {getattr(x, 'shape', type(x))}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"x.dtype={x.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
        pool = self.pool
        if pool.dim() != 1 or pool.dtype != x.dtype or pool.device != x.device:
            raise TypeError(f"pool must be 1-D {x.dtype} on {x.device}; got {tuple(pool.shape)} {pool.dtype} "
                            f"on {pool.device}")
        g = self.num_projections
        if len(outs) != g:
            raise ValueError(f"{g} projections' tables but {len(outs)} outputs")
        n_ad = self.scales.shape[0]
        for name, t, dtype in (("a_offsets", self.a_offsets, torch.int64), ("b_offsets", self.b_offsets, torch.int64),
                               ("ranks", self.ranks, torch.int32)):
            if t.shape != (g, n_ad) or t.dtype != dtype or t.device != x.device or (n_ad > 1 and t.stride(1) != 1):
                raise ValueError(f"SegmentLora.{name} must be [{g}, {n_ad}] {dtype} on {x.device} with unit "
                                 f"stride along adapters; got {tuple(t.shape)} {t.dtype} on {t.device}")
        if self.tiles.dim() != 2 or self.tiles.shape[0] != 3 or self.tiles.dtype != torch.int32 \
                or not self.tiles.is_contiguous():
            raise ValueError(f"SegmentLora.tiles must be a contiguous [3, tiles] int32 tensor; got "
                             f"{tuple(self.tiles.shape)} {self.tiles.dtype}")
        if self.scales.dtype != torch.float32:
            raise TypeError(f"SegmentLora.scales must be float32; got {self.scales.dtype}")
        live = self.live
        if live is not None and (live.shape != (1,) or live.dtype != torch.int32 or live.device != x.device):
            raise ValueError(f"SegmentLora.live must be a [1] int32 tensor on {x.device} (the count of live tiles) "
                             f"or None; got {tuple(live.shape)} {live.dtype} on {live.device}")
        cnt = self.counters
        if cnt is not None and (cnt.dim() != 1 or cnt.dtype != torch.int32 or cnt.device != x.device
                                or cnt.numel() < self.tiles.shape[1] * g):
            raise ValueError(f"SegmentLora.counters must be 1-D int32 zeros on {x.device}, at least tiles x "
                             f"projections = {self.tiles.shape[1] * g}; got {tuple(cnt.shape)} {cnt.dtype} "
                             f"on {cnt.device}")
        if self.factor_align not in (1, 2, 4, 8, 16):
            raise ValueError(f"SegmentLora.factor_align must be 1, 2, 4, 8 or 16; got {self.factor_align}")
        if self.block_r < 16 or self.block_r & (self.block_r - 1) or self.block_r > MAX_RANK:
            raise ValueError(f"block_r must be a power of two in [16, {MAX_RANK}]; got {self.block_r}")
        rows = x.shape[0]
        for i, y in enumerate(outs):
            if y.dim() != 2 or y.shape[0] != rows or y.dtype != x.dtype or y.device != x.device or y.stride(1) != 1:
                raise ValueError(f"outs[{i}] must be [{rows}, N] {x.dtype} on {x.device} with unit column stride; "
                                 f"got {tuple(y.shape)} {y.dtype} strides {y.stride()}")
        if any(end > rows for _, end, _ in self.segments):
            raise ValueError(f"a segment ends past x's {rows} rows: {self.segments}")


@torch.no_grad()
def segment_lora_reference(x: torch.Tensor, lora: SegmentLora, outs: Sequence[torch.Tensor], *,
                           accumulate: bool = True) -> None:
    """``outs[g][segment rows] +=`` each segment's LoRA (fp32 sums, one rounding), in place.
    ``accumulate=False`` (write-first): ``outs[g]`` = the LoRA on the segments' rows, zeros on
    every other row. Reads the adapter tables on the host (a device sync): for the CPU and tests."""
    lora.check(x, outs)
    if not accumulate:
        for y in outs:
            y.zero_()
    k = x.shape[1]
    a_off, b_off, ranks, scales = (t.cpu().tolist() for t in (lora.a_offsets, lora.b_offsets, lora.ranks,
                                                               lora.scales))
    pool = lora.pool
    for g, y in enumerate(outs):
        n = y.shape[1]
        for start, end, ad in lora.segments:
            r = ranks[g][ad]
            if r == 0 or end <= start:
                continue
            if r > lora.block_r:
                raise ValueError(f"adapter {ad} has rank {r} on projection {g}, above block_r={lora.block_r}")
            a, b = a_off[g][ad], b_off[g][ad]
            if a < 0 or b < 0 or a + r * k > pool.numel() or b + r * n > pool.numel():
                raise ValueError(f"adapter {ad}, projection {g}: A at {a} / B^T at {b} (rank {r}, K={k}, N={n}) "
                                 f"reach past the pool ({pool.numel()} elements)")
            s = x[start:end].float() @ pool[a:a + r * k].view(r, k).float().T
            delta = (s @ pool[b:b + r * n].view(r, n).float()) * scales[ad]
            y[start:end] = (y[start:end].float() + delta).to(y.dtype)


# Arguments of the segment kernels that change from step to step and are not specialised
# (``lora_segments`` says why): shared by the shrinks and the expands of both forms
SHRINK_UNSPECIALISED = ("tiles_ptr", "a_off_ptr", "rank_ptr", "n_tiles", "a_g_stride", "r_g_stride", "s_g_stride",
                        "s_split_stride", "s_width")
EXPAND_UNSPECIALISED = ("tiles_ptr", "b_off_ptr", "rank_ptr", "scale_ptr", "n_tiles", "s_split_stride", "s_width")


@triton.jit
def tile_header(tiles_ptr, rank_ptr, g, r_g_stride, t, n_tiles, s_width):
    """Tile t of a ``SegmentLora`` table -> (row start, row end, adapter index clamped to >= 0,
    rank). ``rank_ptr``: one projection's ranks; the rank is 0 where the tile names no adapter
    (-1: rows without LoRA, a covering table's gap tile), at most ``s_width``."""
    start = tl.load(tiles_ptr + t)
    end = tl.load(tiles_ptr + n_tiles + t)
    ad = tl.load(tiles_ptr + 2 * n_tiles + t)
    has = ad >= 0
    adc = tl.maximum(ad, 0)
    rank = tl.minimum(tl.load(rank_ptr + g * r_g_stride + adc, mask=has, other=0), s_width)
    return start, end, adc, rank


@triton.jit
def shrink_chunk(x_ptr, pool_ptr, a_off, offs_m, m_ok, r0, rank, k_lo, k_hi, K, x_stride,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One rank chunk of a tile's shrink -> (acc, offs_r, r_ok): ``acc [BLOCK_M, BLOCK_R]`` fp32 =
    x[offs_m, k_lo:k_hi] A[r0:r0 + BLOCK_R, k_lo:k_hi]^T (A at ``pool_ptr + a_off``, rank vectors
    contiguous along K; ranks past ``rank`` and rows outside ``m_ok`` zero)."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * x_stride + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(pool_ptr + a_off + offs_r[:, None] * K + offs_k[None, :],
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(a), input_precision=DOT_PRECISION)
    return acc, offs_r, r_ok


@triton.jit
def store_delta(out_ptr, offs_m, m_ok, offs_n, n_ok, out_stride, acc, scale, ACCUMULATE: tl.constexpr):
    """An expand's block: out[offs_m, offs_n] = (out +) acc * scale, one rounding to out's dtype
    (ACCUMULATE: the fp32 sum with the output read; else the delta written, nothing read)."""
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * out_stride + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        y = tl.load(out_ptrs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (y + acc * scale).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out_ptrs, (acc * scale).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def shrink_tile(
    x_ptr, pool_ptr, tiles_ptr, a_off_ptr, rank_ptr, s_ptr, t, g, sp, K, k_per_split, x_stride, n_tiles, a_g_stride,
    r_g_stride, s_g_stride, s_split_stride, s_width,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program's shrink, shared by both prefill LoRA forms (``lora_segments``,
    ``lora_tiles``; they differ only in how the grid maps to (tile t, projection g, K split sp)):
    S[sp, g, rows of tile t, :rank] = x[rows, sp's K range] A_g[:rank, range]^T in fp32, the
    tile's own rank in chunks of BLOCK_R; an empty or rank-0 tile does nothing."""
    start, end, adc, rank = tile_header(tiles_ptr, rank_ptr, g, r_g_stride, t, n_tiles, s_width)
    if (end > start) & (rank > 0):
        a_off = tl.load(a_off_ptr + g * a_g_stride + adc)
        offs_m = start + tl.arange(0, BLOCK_M)
        m_ok = offs_m < end
        k_lo = sp * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        for r0 in range(0, rank, BLOCK_R):
            acc, offs_r, r_ok = shrink_chunk(x_ptr, pool_ptr, a_off, offs_m, m_ok, r0, rank, k_lo, k_hi, K, x_stride,
                                             BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
                                             DOT_PRECISION=DOT_PRECISION)
            s_ptrs = (s_ptr + sp * s_split_stride + g * s_g_stride + offs_m[:, None].to(tl.int64) * s_width
                      + offs_r[None, :])
            tl.store(s_ptrs, acc, mask=m_ok[:, None] & r_ok[None, :])
