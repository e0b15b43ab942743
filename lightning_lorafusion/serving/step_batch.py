"""The device-side inputs of one generation step (``StepBatch``) and its parts: the prefill
rows' LoRA tables and the prefix-attending requests' rows. Built by ``ModelRunner.prepare``,
read by the runner's forward and by the mixed-step graph pieces (``mixed_graphs``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..kernels.lora_segments import SegmentLora, block_r_for, segment_tiles
from ..specs import ALL_TARGET_MODULES

MODULE_INDEX = {m: i for i, m in enumerate(ALL_TARGET_MODULES)}


@dataclass(frozen=True)
class PrefixRows:
    """The prefill requests of a step that attend over their pages in one paged prefill launch:
    those that start after tokens already in their pages, and (``prefill_attention`` "paged")
    those that start at position 0; their rows follow the varlen ones (``StepBatch.num_fresh_rows`` on)."""

    cu_seqlens: torch.Tensor  # [m + 1] int32, over these rows (from 0)
    starts: torch.Tensor  # [m] int32 first position of each request's rows
    page_table: torch.Tensor  # [m, max pages] int32 each request's pages (0 past its last)
    max_seqlen: int  # most rows of one request


@dataclass(frozen=True)
class PrefillLora:
    """The prefill rows' LoRA tables of a step (``lora_segments``): row tiles of one request
    each, and the step's distinct adapters' element offsets in the pool."""

    tiles: torch.Tensor  # [3, tiles] int32: row start, row end, adapter index
    offsets: torch.Tensor  # [L, modules, 2, A] int64 (A, B^T), absolute in the pool
    ranks: torch.Tensor  # [modules, A] int32 (0 = the adapter does not target the module)
    scales: torch.Tensor  # [A] fp32
    segments: tuple[tuple[int, int, int], ...]  # (row start, row end, adapter index), host copy
    modules: frozenset[str]  # modules some prefill adapter targets
    block_m: int
    block_r: int
    # the tiles cover every row of the step (rows without LoRA in tiles of adapter -1): the
    # projections write the LoRA first and let the GEMM add the frozen product onto it
    # (``paged_forward.projections``, ``EngineTuning.prefill_lora_write``)
    covering: bool = False
    # this step's projections write the LoRA first (needs ``covering``); else it is added after
    write: bool = False
    # [1] int32: the count of ``tiles``' leading tiles that hold rows (the rest padding), for the
    # kernels' live grids (``SegmentLora.live``; a captured mixed step's); None: every tile
    live: torch.Tensor | None = None
    # int32 zeros, at least tiles x projections of a group: the split-K form's arrival counters,
    # kept here so that a captured step launches no zeroing (``SegmentLora.counters``); None: per call
    counters: torch.Tensor | None = None
    # the adapters' matrices sit at multiples of this many elements (``UnifiedPool.factor_align``)
    factor_align: int = 1

    def group(self, pool: torch.Tensor, layer: int, names: tuple[str, ...]) -> SegmentLora:
        m0, m1 = MODULE_INDEX[names[0]], MODULE_INDEX[names[-1]] + 1
        return SegmentLora(pool=pool, tiles=self.tiles, a_offsets=self.offsets[layer, m0:m1, 0],
                           b_offsets=self.offsets[layer, m0:m1, 1], ranks=self.ranks[m0:m1], scales=self.scales,
                           segments=self.segments, block_m=self.block_m, block_r=self.block_r, live=self.live,
                           counters=self.counters, factor_align=self.factor_align)


def prefill_lora_tables(segments: Sequence[tuple[int, int, int]], residents: Sequence[Any], block_m: int,
                        device: "torch.device | str | Any", *, rows: int | None = None, write: bool = False,
                        factor_align: int = 1, counters: torch.Tensor | None = None):
    """A step's prefill LoRA tables: ``segments`` (row start, row end, index into ``residents``,
    the step's resident adapters, ``pool.ResidentAdapter``) cut into tiles of ``block_m`` rows;
    the adapters' offsets are their ``lora_offsets`` (per layer and module, absolute in the
    pool). ``device``: a device -> the ``PrefillLora``, one copy per table; or a step's table
    queue (``staging.StagedTables`` / ``SeparateTables``) -> a ``Queued`` whose ``finish(uploaded)``
    gives it once the queue is uploaded. ``factor_align``: the pool's (``UnifiedPool.factor_align``);
    ``counters``: kept int32 zeros for the split-K form, used if they hold the step's tiles x
    ``len(ALL_TARGET_MODULES)`` (else that form allocates its own per call)."""
    from .staging import SeparateTables  # (staging imports nothing of this module)

    tables = SeparateTables(device) if isinstance(device, (torch.device, str)) else device
    tiles = segment_tiles(segments, block_m, rows=rows)
    if counters is not None and counters.numel() < len(tiles) * len(ALL_TARGET_MODULES):
        counters = None
    # (numpy: torch's CPU stack along the last dim costs the host more at 32 layers)
    offsets = np.stack([r.lora_offsets.numpy() for r in residents], axis=-1)  # [L, M, 2, A]
    ranks = np.stack([r.adapter.module_ranks.numpy() for r in residents], axis=-1)  # [M, A]
    queued = (tables.add(np.asarray(tiles, dtype=np.int32).reshape(-1, 3).T, torch.int32),  # [3, tiles]
              tables.add(offsets, torch.int64), tables.add(ranks, torch.int32),
              tables.add([r.adapter.scale for r in residents], torch.float32))

    def finish(up: Sequence[torch.Tensor]) -> PrefillLora:
        t, o, rk, sc = (up[i] for i in queued)
        return PrefillLora(
            tiles=t, offsets=o, ranks=rk, scales=sc, segments=tuple(segments),
            modules=frozenset(m for r in residents for m in r.adapter.target_modules),
            block_m=block_m, block_r=block_r_for(max(r.adapter.rank for r in residents)), covering=rows is not None,
            write=write, factor_align=factor_align, counters=counters)

    if tables is device:
        return Queued(finish)
    return finish(tables.upload())


class Queued:
    """Tables queued for a step's one upload: ``finish(uploaded)`` builds their holder from the
    upload's device tensors."""

    __slots__ = ("finish",)

    def __init__(self, finish) -> None:
        self.finish = finish


@dataclass
class StepBatch:
    """Device-side inputs of one step (built by ``ModelRunner.prepare``)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_pages: torch.Tensor  # [T] page of each row's KV
    slot_offsets: torch.Tensor  # [T] slot inside that page
    num_prefill_rows: int
    num_fresh_rows: int  # prefill rows [0, this) start at position 0, attend varlen; the rest are prefill_prefixes'
    cu_seqlens: torch.Tensor | None  # [n_fresh + 1] over the varlen prefill rows
    max_prefill_len: int  # of the varlen prefill rows
    prefill_prefixes: PrefixRows | None
    prefill_lora: PrefillLora | None
    page_table: torch.Tensor | None  # [B, max_pages] int32 for the decode rows
    seq_lens: torch.Tensor | None  # [B] int32
    decode_offsets: torch.Tensor | None  # [L, modules, 2, B] int64 element offsets of A and B^T
    decode_ranks: torch.Tensor | None  # [modules, B] int32 (0 = no LoRA on that row/module)
    decode_scales: torch.Tensor | None  # [B] fp32
    decode_modules: frozenset[str]  # modules some decode row adapts
    spans: list[tuple[int, int]]  # per request, its rows in the output hidden states
    output_rows: torch.Tensor | None  # [R] rows of the step whose hidden states are returned (None: all)
    real_rows: int | None = None  # rows [real_rows, T) are padding (pad_mixed); None: no padding
    # padded steps (pad_mixed) put the decode rows first, at rows [0, B), and the prefill rows
    # after them; otherwise prefill rows come first and decode rows follow them
    decode_first: bool = False
    # rows of DoRA adapters, their frozen products rescaled per column (serving/dora_rows.py)
    dora: Any = None  # dora_rows.DoraRows | None
    # [T] bool, longrope only: the rows whose request is longer than the pretraining context
    # (original_max_position_embeddings) take its long factors (docs/model.md, "RoPE scaling")
    rope_long: torch.Tensor | None = None
    # [4, B] int32: the decode rows grouped by adapter (kernels/lora_gather.py ``adapter_groups``):
    # the gather kernels' shrink reads each group's A once; None: per row
    decode_groups: torch.Tensor | None = None
    # the decode rows' ranks are at most this (``lora_gather.decode_rank_bound`` of the step's
    # largest rank: which variant the gather kernels launch); None: any
    decode_rank_bound: int | None = None
    # page-in copies still pending for the prefill rows' adapters, waited for layer by layer
    # (page_in_layers.LayerWaits: the forward calls ``before(layer)``); None: nothing pending
    layer_waits: Any = None

    @property
    def num_decode_rows(self) -> int:
        real = self.input_ids.shape[0] if self.real_rows is None else self.real_rows
        return real - self.num_prefill_rows

    @property
    def first_decode_row(self) -> int:
        return 0 if self.decode_first else self.num_prefill_rows

    @property
    def prefill_start(self) -> int:
        return self.num_decode_rows if self.decode_first else 0
