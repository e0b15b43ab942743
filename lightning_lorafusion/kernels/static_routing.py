"""Fixed-shape launch tables of the fused LoRA kernels for CUDA-graph replay, refilled in place.

A captured graph bakes every launch's grid and scalar arguments in, and reads its tables at
fixed addresses. The eager tables (``routing_table.py``) size both by the microbatch (its row
tiles, the adapters present); these keep one layout for every microbatch of a capacity:

- every adapter with LoRA in a projection group is active, present or not: the concatenated
  A/B, the ranks and every grid stay the same (an absent adapter routes no tile, so its
  gradients are zeros);
- the tile list is padded to ``max_tiles`` with empty tiles (``row_start == row_end``, listed
  under no row block and no adapter: every kernel masks them out), and S is sized for every
  row at the largest total rank;
- dropout: a graph is captured at microbatch 0, whose offsets are launch constants; each
  adapter's seed column holds ``seed_hash ^ microbatch_hash(index)``, which gives exactly the
  masks of an eager step at that index (``dropout.dropout_offset``).

``StaticLaunchTables.cache`` is what the graph's ``LoraRouting.launch_cache`` holds: a miss
makes the fixed-shape table for that ``(device, block_m, ranks)`` key; ``fill(segments,
index)`` rewrites every table's device buffers for the next microbatch (built on the host by
the eager builder, two copies per table).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

import torch

from .dropout import microbatch_hash
from .reference import LoraRouting
from .routing_table import AI_SEED_HASH, PLAN_KEY, LoraLaunchTable, build_launch_table


def max_tiles(capacity: int, block_m: int, num_adapters: int) -> int:
    """Bound on a microbatch's row tiles: each tile lies in one row block, and a block is split
    between adapters at most once per segment boundary (at most ``num_adapters`` segments)."""
    return -(-capacity // block_m) + num_adapters


def _with_index(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>``: the kernels key tables by ``str(x.device)``."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class StaticTableError(RuntimeError):
    """The fused kernels asked for a table this module cannot hold in fixed shape."""


class _StaticTableCache(dict):
    """``LoraRouting.launch_cache`` of a graph's routing: a miss makes a fixed-shape table
    (through ``get``, as ``routing_table.build_launch_table`` reads it, or ``[]``)."""

    def __init__(self, owner: "StaticLaunchTables") -> None:
        super().__init__()
        self._owner = owner

    def __missing__(self, key):
        if _is_plan_key(key):
            raise KeyError(key)
        table = self._owner._new_table(key)
        self[key] = table
        return table

    def get(self, key, default=None):
        # the fused kernels also keep their launch plans here (other keys): a plain dict for those
        return dict.get(self, key, default) if _is_plan_key(key) else self[key]

    @property
    def allocation_context(self):
        """Entered around device allocations that outlive the step (the fused kernels' own device
        tables too): ``StaticLaunchTables.allocation_context``."""
        return self._owner.allocation_context


def _is_plan_key(key) -> bool:
    """A key of ``fused_lora``'s launch plans (its first item is ``fused_lora.PLAN_KEY``);
    any other key is a launch table's and must be ``(device string, block_m, ranks)``."""
    return isinstance(key, tuple) and len(key) > 0 and key[0] == PLAN_KEY


@dataclasses.dataclass
class _Entry:
    """One fixed-shape table and its buffers (device, and host staging on CUDA)."""

    ranks: tuple[tuple[int, ...], ...]
    table: LoraLaunchTable  # tensors: views of dev64 / dev32 (adapter_float: its own)
    adapter_int: torch.Tensor  # [A, C] int64 host: the layout's adapter rows at microbatch 0
    dev64: torch.Tensor  # [T * 4 + A * C] int64: tiles, then adapter_int
    dev32: torch.Tensor  # [blocks + 1 + T + A + 1] int32: block_tiles, adapter_tiles, adapter_tile_ptr
    host64: list[torch.Tensor]  # two staging buffers each (pinned on CUDA), used alternately
    host32: list[torch.Tensor]


class StaticLaunchTables:
    """The fixed-shape tables of one capacity (``num_rows``), over the adapters of ``template``
    (a routing whose ``scales``, ``dropout_p`` and ``seeds`` are the training ones)."""

    def __init__(self, template: LoraRouting, device: torch.device) -> None:
        self.capacity = template.num_rows
        self.device = _with_index(torch.device(device))
        self._template = template
        self._entries: dict[tuple, _Entry] = {}
        self._frozen = False
        self._fills = 0
        self._events: list[torch.cuda.Event | None] = [None, None]
        self.cache = _StaticTableCache(self)
        # entered around a new table's allocations: the graphs' warm-up may be allocating from
        # their memory pool, where a table (it lives on) could share memory with a graph's
        # intermediates (training/cuda_graphs.py sets it)
        self.allocation_context = contextlib.nullcontext

    @property
    def num_tables(self) -> int:
        return len(self._entries)

    def tables(self) -> list[LoraLaunchTable]:
        """The fixed-shape tables made so far (the cache also holds the kernels' launch plans)."""
        return [e.table for e in self._entries.values()]

    def freeze(self, frozen: bool = True) -> None:
        """While frozen (a graph capture), asking for a new table raises: its buffers would be
        allocated inside the capture."""
        self._frozen = frozen

    def layout(self) -> tuple:
        """What the graphs' launches depend on: block size and per-group ranks of each table."""
        return tuple(sorted((block_m, ranks) for _, block_m, ranks in self._entries))

    def _new_table(self, key) -> LoraLaunchTable:
        try:
            device, block_m, ranks = key
            ranks = tuple(tuple(int(r) for r in per_proj) for per_proj in ranks)
        except (TypeError, ValueError) as e:
            raise StaticTableError(f"unexpected launch-table key {key!r} (routing_table changed?)") from e
        if _with_index(torch.device(device)) != self.device:
            raise StaticTableError(f"launch table asked for {device}; the static tables live on {self.device}")
        if self._frozen:
            raise StaticTableError(f"a new launch table (block_m={block_m}, ranks={ranks}) was asked for "
                                   "during capture; the warm-up step did not ask for it")
        n = self._template.num_adapters
        if any(len(r) != n for r in ranks):
            raise StaticTableError(f"ranks {ranks} do not give one rank per adapter ({n})")
        # the layout: one segment per adapter, so every adapter with LoRA here is active
        everyone = dataclasses.replace(
            self._template, num_rows=n * block_m,
            segments=tuple((a * block_m, (a + 1) * block_m, a) for a in range(n)), launch_cache={},
        )
        layout = build_launch_table(everyone, ranks, block_m, torch.device("cpu"))
        t = max_tiles(self.capacity, block_m, n)
        blocks = -(-self.capacity // block_m)
        cols = layout.adapter_int.shape[1]
        pin = self.device.type == "cuda"
        with self.allocation_context():
            dev64 = torch.zeros(t * 4 + n * cols, dtype=torch.int64, device=self.device)
            dev32 = torch.zeros(blocks + 1 + t + n + 1, dtype=torch.int32, device=self.device)
            adapter_float = layout.adapter_float.to(self.device)
        table = dataclasses.replace(
            layout, num_rows=self.capacity, num_tiles=t,
            tiles=dev64[: t * 4].view(t, 4), adapter_int=dev64[t * 4:].view(n, cols),
            block_tiles=dev32[: blocks + 1], adapter_tiles=dev32[blocks + 1: blocks + 1 + t],
            adapter_tile_ptr=dev32[blocks + 1 + t:], adapter_float=adapter_float,
            s_numel=self.capacity * layout.max_total_rank, max_adapter_tiles=t,
        )
        entry = _Entry(ranks=ranks, table=table, adapter_int=layout.adapter_int.clone(), dev64=dev64,
                       dev32=dev32, host64=[torch.zeros(dev64.shape, dtype=torch.int64, pin_memory=pin)
                                            for _ in range(2)],
                       host32=[torch.zeros(dev32.shape, dtype=torch.int32, pin_memory=pin) for _ in range(2)])
        self._entries[key] = entry
        if self._fills:  # a table made after the last fill: give it that microbatch's contents
            self._fill_entry(entry, *self._last_fill, slot=(self._fills - 1) % 2)
            if pin:  # once per table: its staging buffers are then free whatever the events say
                torch.cuda.current_stream(self.device).synchronize()
        return table

    def fill(self, segments: Sequence[tuple[int, int, int]], microbatch_index: int) -> None:
        """Write microbatch ``(segments, microbatch_index)`` into every table (stream-ordered
        copies: a replay enqueued after this reads the new contents)."""
        slot = self._fills % 2
        event = self._events[slot]
        if event is not None:  # the staging buffer's previous copy must have left the host
            event.synchronize()
        self._last_fill = (tuple(tuple(s) for s in segments), microbatch_index)
        for entry in self._entries.values():
            self._fill_entry(entry, *self._last_fill, slot=slot)
        if self.device.type == "cuda":
            event = self._events[slot] or torch.cuda.Event()
            event.record()
            self._events[slot] = event
        self._fills += 1

    def _fill_entry(self, entry: _Entry, segments, microbatch_index: int, *, slot: int) -> None:
        routing = dataclasses.replace(self._template, segments=segments, launch_cache={})
        table = entry.table
        eager = build_launch_table(routing, entry.ranks, table.block_m, torch.device("cpu"))
        t, n_tiles = table.num_tiles, eager.num_tiles
        if n_tiles > t:
            raise StaticTableError(f"{n_tiles} row tiles exceed the bound {t} (segments {segments})")
        h64, h32 = entry.host64[slot], entry.host32[slot]
        h64.zero_()  # padding tiles: (0, 0, 0, 0), empty
        h64[: n_tiles * 4] = eager.tiles[:n_tiles].reshape(-1)
        adapter_int = entry.adapter_int.clone()
        adapter_int[:, AI_SEED_HASH] ^= microbatch_hash(microbatch_index)
        h64[t * 4:] = adapter_int.reshape(-1)
        blocks = table.block_tiles.shape[0]
        h32[:blocks] = eager.block_tiles
        h32[blocks: blocks + t] = 0
        h32[blocks: blocks + n_tiles] = eager.adapter_tiles[:n_tiles]
        h32[blocks + t:] = eager.adapter_tile_ptr
        entry.dev64.copy_(h64, non_blocking=True)
        entry.dev32.copy_(h32, non_blocking=True)
