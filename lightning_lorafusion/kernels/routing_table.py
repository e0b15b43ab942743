"""Device-side routing tables of the fused LoRA kernels, built once per microbatch and reused.

A microbatch's ``LoraRouting`` (row segments -> adapter) and the ranks of one group of
shared-input projections are turned into small integer tables the kernels index:

- row tiles: every segment of an adapter with LoRA weights, cut at multiples of ``block_m``,
  so each tile lies inside one GEMM row block (segments need not be padded; padding them to
  ``block_m`` only avoids partial tiles);
- per GEMM row block, the range of tiles inside it; per adapter, the list of its tiles;
- per adapter, its total rank over the projections (the row width of its slice of S), its rows
  in the concatenated A, dropout hash seed and keep threshold, scale and 1/(1-p); per
  (adapter, projection), the rank and the column offsets in S and in the concatenated B.

S (``[rows of active segments, total rank of the row's adapter]``) is stored compactly: a
segment's rows use only their adapter's width, so heterogeneous ranks cost no padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dropout import dropout_keep_threshold
from .dropout_triton import seed_hash
from .reference import LoraRouting

# Columns of ``adapter_int``: these four, then (rank, s_col, b_col) per projection.
AI_TOTAL_RANK, AI_A_ROW, AI_SEED_HASH, AI_THRESHOLD = 0, 1, 2, 3
AI_FIRST_PROJ = 4
AI_PER_PROJ = 3


@dataclass(frozen=True)
class LoraLaunchTable:
    """Tables for one (routing, projection-ranks, block_m, device); shapes in the field notes."""

    block_m: int
    num_rows: int
    num_tiles: int
    tiles: torch.Tensor  # [T, 4] int64: row_start, row_end, adapter, s_offset (elements)
    block_tiles: torch.Tensor  # [cdiv(M, block_m) + 1] int64: tile range of each row block
    adapter_tiles: torch.Tensor  # [T] int64: tile ids grouped by adapter
    adapter_tile_ptr: torch.Tensor  # [A + 1] int64: adapter a's tiles are adapter_tiles[ptr[a]:ptr[a+1]]
    adapter_int: torch.Tensor  # [A, 4 + 3P] int64 (see AI_* columns)
    adapter_float: torch.Tensor  # [A, 2] float32: scale, 1 / (1 - p)
    s_numel: int  # elements of the compact S (and dS)
    a_rows: int  # rows of the concatenated A over active adapters
    b_cols: tuple[int, ...]  # per projection, columns of its concatenated B
    max_total_rank: int
    max_rank: tuple[int, ...]  # per projection, largest rank of an active adapter
    max_adapter_tiles: int
    active: tuple[int, ...]  # adapters with tiles and LoRA weights, ascending
    a_order: tuple[tuple[int, int], ...]  # (adapter, projection) order of A's row blocks
    b_order: tuple[tuple[int, ...], ...]  # per projection, adapter order of B's column blocks
    has_dropout: bool

    @property
    def num_adapters(self) -> int:
        return int(self.adapter_int.shape[0])


# ``LoraRouting.launch_cache`` holds launch tables under (device string, block_m, ranks) and
# the fused kernels' launch plans under keys starting with this marker.
PLAN_KEY = "launch-plan"


def build_launch_table(
    routing: LoraRouting, ranks: tuple[tuple[int, ...], ...], block_m: int, device: torch.device
) -> LoraLaunchTable:
    """Build (or fetch from ``routing.launch_cache``) the tables for ``ranks[proj][adapter]``
    (0 where that adapter has no LoRA on that projection)."""
    key = (str(device), block_m, ranks)
    cached = routing.launch_cache.get(key)
    if cached is not None:
        return cached
    table = _build(routing, ranks, block_m, device)
    routing.launch_cache[key] = table
    return table


def _row_tiles(
    routing: LoraRouting, active: tuple[int, ...], total_rank: list[int], block_m: int
) -> tuple[list[tuple[int, int, int, int]], int]:
    """Active segments cut at multiples of ``block_m`` into ``(row_start, row_end, adapter,
    s_offset)`` tiles, and the element count of the compact S they cover."""
    tiles: list[tuple[int, int, int, int]] = []
    s_offset = 0
    for start, end, adapter in routing.segments:
        if adapter not in active:
            continue
        row = start
        while row < end:
            stop = min(end, (row // block_m + 1) * block_m)
            tiles.append((row, stop, adapter, s_offset + (row - start) * total_rank[adapter]))
            row = stop
        s_offset += (end - start) * total_rank[adapter]
    return tiles, s_offset


def _tile_indices(
    tiles: list[tuple[int, int, int, int]], num_rows: int, block_m: int, n_adapters: int
) -> tuple[list[int], list[list[int]], list[int], list[int]]:
    """Per GEMM row block the prefix sums of its tile counts (``block_tiles``); per adapter its
    tile ids (``by_adapter``), flattened (``adapter_tiles``) with their offsets (``adapter_tile_ptr``)."""
    n_blocks = -(-num_rows // block_m)
    block_tiles = [0] * (n_blocks + 1)
    for row_start, _, _, _ in tiles:
        block_tiles[row_start // block_m + 1] += 1
    for b in range(n_blocks):
        block_tiles[b + 1] += block_tiles[b]

    by_adapter: list[list[int]] = [[] for _ in range(n_adapters)]
    for t, (_, _, adapter, _) in enumerate(tiles):
        by_adapter[adapter].append(t)
    adapter_tiles = [t for lst in by_adapter for t in lst]
    adapter_tile_ptr = [0]
    for lst in by_adapter:
        adapter_tile_ptr.append(adapter_tile_ptr[-1] + len(lst))
    return block_tiles, by_adapter, adapter_tiles, adapter_tile_ptr


def _adapter_rows(
    routing: LoraRouting, ranks: tuple[tuple[int, ...], ...], active: tuple[int, ...], total_rank: list[int]
) -> tuple[list[list[int]], list[list[float]], list[tuple[int, int]], list[list[int]], list[int], int]:
    """The ``adapter_int`` and ``adapter_float`` rows of every adapter, the (adapter, projection)
    order of A's row blocks, per projection B's adapter order and column count, and A's row count."""
    n_adapters = routing.num_adapters
    n_proj = len(ranks)
    adapter_int = [[0] * (AI_FIRST_PROJ + AI_PER_PROJ * n_proj) for _ in range(n_adapters)]
    adapter_float = [[0.0, 1.0] for _ in range(n_adapters)]
    a_order: list[tuple[int, int]] = []
    b_order: list[list[int]] = [[] for _ in range(n_proj)]
    b_cols = [0] * n_proj
    a_row = 0
    for a in active:
        p = routing.dropout_p[a]
        row = adapter_int[a]
        row[AI_TOTAL_RANK] = total_rank[a]
        row[AI_A_ROW] = a_row
        row[AI_SEED_HASH] = seed_hash(routing.seeds[a])
        row[AI_THRESHOLD] = dropout_keep_threshold(p) if p > 0.0 else 0
        adapter_float[a] = [float(routing.scales[a]), 1.0 / (1.0 - p)]
        s_col = 0
        for i in range(n_proj):
            r = ranks[i][a]
            base = AI_FIRST_PROJ + AI_PER_PROJ * i
            row[base], row[base + 1], row[base + 2] = r, s_col, b_cols[i]
            if r:
                a_order.append((a, i))
                b_order[i].append(a)
            s_col += r
            b_cols[i] += r
        a_row += total_rank[a]
    return adapter_int, adapter_float, a_order, b_order, b_cols, a_row


def _to_device(
    int_parts: list[list], adapter_float: list[list[float]], device: torch.device
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Copy the int64 tables and the float32 table to ``device`` in one host->device transfer (the
    first layer of a microbatch pays it once): int64 sections padded to 16 bytes, then the
    float32 section, all in one byte buffer. Returns device views shaped like the inputs."""
    ints = [torch.tensor(part, dtype=torch.int64) for part in int_parts]
    floats = torch.tensor(adapter_float, dtype=torch.float32)
    starts, nbytes = [], 0
    for t in ints:
        starts.append(nbytes)
        nbytes += -(-t.numel() * 8 // 16) * 16
    host = torch.zeros(nbytes + floats.numel() * 4, dtype=torch.uint8)
    for t, start in zip(ints, starts):
        host[start:start + t.numel() * 8].view(torch.int64).copy_(t.flatten())
    host[nbytes:].view(torch.float32).copy_(floats.flatten())
    dev = host.to(device, non_blocking=True)
    views = [dev[start:start + t.numel() * 8].view(torch.int64).view(t.shape) for t, start in zip(ints, starts)]
    return views, dev[nbytes:].view(torch.float32).view(floats.shape)


def _build(
    routing: LoraRouting, ranks: tuple[tuple[int, ...], ...], block_m: int, device: torch.device
) -> LoraLaunchTable:
    n_adapters = routing.num_adapters
    n_proj = len(ranks)
    total_rank = [sum(ranks[i][a] for i in range(n_proj)) for a in range(n_adapters)]
    present = {a for _, _, a in routing.segments}
    active = tuple(a for a in range(n_adapters) if a in present and total_rank[a] > 0)

    tiles, s_offset = _row_tiles(routing, active, total_rank, block_m)
    block_tiles, by_adapter, adapter_tiles, adapter_tile_ptr = _tile_indices(
        tiles, routing.num_rows, block_m, n_adapters
    )
    adapter_int, adapter_float, a_order, b_order, b_cols, a_row = _adapter_rows(
        routing, ranks, active, total_rank
    )
    int_parts = [tiles if tiles else [[0, 0, 0, 0]], block_tiles, adapter_tiles if adapter_tiles else [0],
                 adapter_tile_ptr, adapter_int]
    views, adapter_float_t = _to_device(int_parts, adapter_float, device)
    tiles_t, block_tiles_t, adapter_tiles_t, adapter_tile_ptr_t, adapter_int_t = views

    return LoraLaunchTable(
        block_m=block_m,
        num_rows=routing.num_rows,
        num_tiles=len(tiles),
        tiles=tiles_t,
        block_tiles=block_tiles_t,
        adapter_tiles=adapter_tiles_t,
        adapter_tile_ptr=adapter_tile_ptr_t,
        adapter_int=adapter_int_t,
        adapter_float=adapter_float_t,
        s_numel=s_offset,
        a_rows=a_row,
        b_cols=tuple(b_cols),
        max_total_rank=max((total_rank[a] for a in active), default=0),
        max_rank=tuple(max((ranks[i][a] for a in active), default=0) for i in range(n_proj)),
        max_adapter_tiles=max((len(by_adapter[a]) for a in active), default=0),
        active=active,
        a_order=tuple(a_order),
        b_order=tuple(tuple(o) for o in b_order),
        has_dropout=any(routing.dropout_p[a] > 0.0 for a in active),
    )
