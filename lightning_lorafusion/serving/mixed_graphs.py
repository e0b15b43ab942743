"""Mixed (prefill + decode) steps as pieces around attention, over static inputs of one token
bucket: captured as CUDA graphs on a GPU, run eagerly on the CPU (the same code and buffers).

A padded mixed step (``ModelRunner.pad_mixed``: T rows padded to a token bucket, the decode
rows first with their LoRA gathered per row from the persistent decode tables, the prefill
rows' LoRA by row tiles) runs as L + 1 pieces: piece 0 embeds and runs layer 0 up to its KV write;
piece l runs layer l-1 after attention (o, MLP) and layer l up to its KV write; piece L ends
with the final norm over every row. Attention runs eagerly between them, from the pieces' q, k,
v into a static buffer: its grids depend on the step's requests. Each step copies its inputs
and its prefill LoRA tables into the static buffers (tables padded to fixed lengths: empty tiles
and rank-0 adapters do nothing; the decode rows' tables are the engine's persistent ones, rank 0
past the step's decode rows), so a captured piece reads every value at a fixed address and no
host value is baked in except the shapes: the token bucket is the key of a set of pieces. The
ranks are values in those tables (the LoRA kernels loop over each tile's and row's own rank,
up to ``MAX_RANK``, the width of the pieces' scratch), so one set of pieces per bucket serves
every mix of ranks, including ranks loaded after the capture. Steps with DoRA rows run their own
set of pieces per bucket (built on the first such step), whose projections rescale each row by
its gain from the fixed-shape slot table (``dora_rows.DoraSlots``, a per-row slot index copied in
like the other inputs). docs/serving.md, "Mixed steps as graphs" and "Cold start".
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping

import torch

from ..capture import capture_batch, graph_capture
from ..kernels.lora_gather import MAX_RANK
from ..kernels.segment_tables import segment_tiles
from ..specs import ALL_TARGET_MODULES
from .compile_ahead import compile_variants, record_launches
from .dora_rows import DoraSlotRows, DoraSlots
from .paged_forward import after_attention, attention, before_attention, embed_rows, final_norm
from .step_batch import PrefillLora, StepBatch


# the largest token bucket whose pieces run the prefill LoRA on live grids (larger ones: grids over
# the whole table). One 8B layer on an H100: the live grids took 18 % / 11 % off the LoRA at 512 /
# 2,048 rows and the burst trace's 4,096-token steps 1 %, but added 7-19 % at 8,192 rows, where
# ~130 live tiles keep the table-long grid busy (docs/BENCHMARKS.md "Many tenants against their floor")
LIVE_GRID_MAX_ROWS = 4096


def _meta(obj) -> object:
    """The shapes, dtypes and strides of the tensors in a parameter pytree, and its plain values;
    any other object stands for itself (its identity), so layers holding one never compare equal."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), str(obj.dtype), obj.stride(), obj.device.type)
    if isinstance(obj, Mapping):
        return ("dict", tuple((k, _meta(v)) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_meta(v) for v in obj))
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__name__, tuple((f.name, _meta(getattr(obj, f.name))) for f in dataclasses.fields(obj)))
    return ("object", id(obj))


def layer_kind(m, layer: int) -> tuple:
    """What a layer's part of a piece depends on besides the values it reads: its weights'
    shapes, dtypes and strides, its RoPE (Gemma 3's sliding layers: a local one) and window."""
    cfg = m.config
    return (cfg.local_rope(layer), cfg.sliding_window(layer), _meta(m.params["layers"][layer]))


class MixedPieces:
    """Static buffers and the L + 1 pieces of padded mixed steps of ``rows`` rows, adapters of
    any ranks up to ``MAX_RANK``; ``capture``: record each piece as a CUDA graph (into ``pool``,
    shared with the runner's other graphs), else run the pieces eagerly."""

    def __init__(self, runner: "ModelRunner", rows: int, *, max_tiles: int, max_adapters: int,
                 capture: bool, pool=None, dora: DoraSlots | None = None,
                 defer_capture: bool = False, write: bool = False, lora: bool = True,
                 live_grid: bool = False) -> None:
        # the prefill LoRA's scratch S is MAX_RANK wide (a runtime stride of the kernels, which
        # loop over each tile's own rank): tables of any rank mix fit the captured launches
        self.runner, self.rows, self.block_r = runner, rows, MAX_RANK
        cfg, dev = runner.config, runner.device
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.slot_pages = torch.full((rows,), runner.pool.scratch_page, dtype=torch.int64, device=dev)
        self.slot_offsets = torch.zeros(rows, dtype=torch.int64, device=dev)
        longrope = cfg.rope_type == "longrope"
        self.rope_long = torch.zeros(rows, dtype=torch.bool, device=dev) if longrope else None
        n_mod = len(ALL_TARGET_MODULES)
        # the count of the step's live tiles (the tables' padding past it launches nothing)
        self.live = torch.zeros(1, dtype=torch.int32, device=dev) if live_grid and lora else None
        self.lora = None if not lora else PrefillLora(
            tiles=torch.zeros(3, max_tiles, dtype=torch.int32, device=dev),
            offsets=torch.zeros(cfg.num_layers, n_mod, 2, max_adapters, dtype=torch.int64, device=dev),
            ranks=torch.zeros(n_mod, max_adapters, dtype=torch.int32, device=dev),
            scales=torch.zeros(max_adapters, dtype=torch.float32, device=dev), segments=(),
            modules=frozenset(ALL_TARGET_MODULES), block_m=runner.segment_block_m, block_r=self.block_r,
            covering=runner.prefill_lora_write != "off", write=write, live=self.live,
            counters=torch.zeros(max_tiles * n_mod, dtype=torch.int32, device=dev),
            factor_align=runner.pool.factor_align)
        # covering tables (write-first prefill LoRA): a step without prefill LoRA rows loads tiles
        # of no adapter over every row, so the write-first expand still writes each row
        self.no_lora_tiles = (torch.tensor(segment_tiles([], runner.segment_block_m, rows=rows), dtype=torch.int32,
                                           device=dev).reshape(-1, 3).t().contiguous()
                              if lora and self.lora.covering else None)
        if self.no_lora_tiles is not None:
            self.lora.tiles[:, :self.no_lora_tiles.shape[1]].copy_(self.no_lora_tiles)
            if self.live is not None:
                self.live.fill_(self.no_lora_tiles.shape[1])
        dtype = runner.pool.storage.dtype
        self.attn = torch.zeros(rows, cfg.q_size, dtype=dtype, device=dev)
        # what attention reads from piece l, at addresses fixed here: a tensor allocated inside a
        # capture lives where that capture's allocator put it, and piece l + 1's capture may put
        # its own q elsewhere (the pool reuses freed blocks as it sees fit), so attention after
        # piece l must not read "the last q captured". k and v only where fresh prompts attend to
        # their own tokens (varlen); paged attention reads them from the KV cache.
        self.q = torch.zeros(rows, cfg.num_heads, cfg.head_dim, dtype=dtype, device=dev)
        own_kv = runner.prefill_attention == "varlen"
        self.k, self.v = ((torch.zeros(rows, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=dev)
                           for _ in range(2)) if own_kv else (None, None))
        # the decode rows (rows [0, B) of a padded step) read the engine's persistent decode
        # tables (DecodeInputs), whose rows past B have rank 0: a fixed length per bucket, so the
        # gather kernels' grids are fixed too, and the rows they cover beyond the decode rows
        # (prefill or padding) get nothing from them
        inputs = runner.decode_inputs
        d = min(inputs.max_rows, rows)
        # pieces without LoRA (``lora`` False: steps none of whose rows has an adapter) launch
        # no LoRA kernel at all, and their GEMMs write their outputs (no write-first C input)
        decode_lora = capture and lora
        self.batch = StepBatch(
            input_ids=self.input_ids, positions=self.positions, slot_pages=self.slot_pages,
            slot_offsets=self.slot_offsets, num_prefill_rows=rows, num_fresh_rows=0, cu_seqlens=None,
            max_prefill_len=0, prefill_prefixes=None, prefill_lora=self.lora, page_table=None, seq_lens=None,
            decode_offsets=inputs.lora_offsets[..., :d] if lora else None,
            decode_ranks=inputs.lora_ranks[:, :d] if lora else None,
            decode_scales=inputs.lora_scales[:d] if lora else None,
            decode_modules=frozenset(ALL_TARGET_MODULES) if decode_lora else frozenset(), spans=[], output_rows=None,
            real_rows=None, decode_first=True, rope_long=self.rope_long,
            decode_groups=inputs.lora_groups[:, :d] if lora else None)
        # steps with DoRA rows: each row's slot in ``dora``'s gain table (dora_rows.py)
        self.dora_index = torch.zeros(rows, dtype=torch.int64, device=dev) if dora is not None else None
        self.batch.dora = DoraSlotRows(dora, 0, rows, self.dora_index) if dora is not None else None
        self.h = self.rope = self.final = None
        self.graphs: list[torch.cuda.CUDAGraph] | None = None
        if capture and not defer_capture:  # (deferred: ``capture`` later, e.g. after ``dry_run``)
            self.capture(pool)

    @classmethod
    def of_runner(cls, runner: "ModelRunner", rows: int, *, dora: bool, write: bool | None,
                  defer_capture: bool = False) -> "MixedPieces":
        """Pieces of ``rows`` rows as ``runner`` is set now; ``write``: the prefill LoRA written
        first or added after (None: no LoRA at all, for steps none of whose rows has an
        adapter); ``dora``: for steps with DoRA rows. The prefill LoRA runs on live grids with
        ``runner.live_grids`` up to ``LIVE_GRID_MAX_ROWS`` rows."""
        return cls(runner, rows, max_tiles=cls.max_tiles(rows, runner.segment_block_m, runner.decode_inputs.max_rows,
                                                         covering=runner.prefill_lora_write != "off"),
                   write=bool(write) and not dora, lora=write is not None,
                   live_grid=runner.live_grids and rows <= LIVE_GRID_MAX_ROWS,
                   max_adapters=runner.decode_inputs.max_rows, capture=runner.mixed_pieces == "graphs",
                   pool=runner.graphs.pool if runner.graphs is not None else None,
                   dora=runner._dora_slots() if dora else None, defer_capture=defer_capture)

    @property
    def num_graphs(self) -> int:
        """CUDA graphs these pieces hold (0 when run eagerly)."""
        return len(self.graphs) if self.graphs is not None else 0

    @staticmethod
    def max_tiles(rows: int, block_m: int, max_segments: int, *, covering: bool = False) -> int:
        """Tiles of any step of at most ``rows`` rows in at most ``max_segments`` segments
        (``covering``: plus the tiles of the up to ``max_segments + 1`` runs of rows between them)."""
        return -(-rows // block_m) + (2 * max_segments + 1 if covering else max_segments)

    # ------------------------------------------------------------------ the pieces

    def piece(self, i: int) -> None:
        """Piece i of L + 1 (see the module docstring), on the static buffers."""
        m, b = self.runner.model, self.batch
        layers = m.params["layers"]
        if i == 0:
            self.h, self.rope = embed_rows(m, b)
            d = None
        else:
            d = after_attention(m, i - 1, layers[i - 1], self.h, self.attn, b)
        if i < m.config.num_layers:
            q, k, v = before_attention(m, i, layers[i], self.h, d, self.rope, b)
            self.q.copy_(q)
            if self.k is not None:
                self.k.copy_(k)
                self.v.copy_(v)
        else:
            self.final = final_norm(m, self.h, d)

    def piece_kind(self, i: int) -> tuple:
        """What piece i launches, up to the tensors it reads: the first and the last piece are
        their own kinds; a middle piece's kind is the pair of its two layers' ``layer_kind``
        (pieces of one kind launch the same kernels on the same shapes)."""
        m = self.runner.model
        n = m.config.num_layers
        return (i == 0, i == n, layer_kind(m, i - 1) if i > 0 else None, layer_kind(m, i) if i < n else None)

    def dry_run(self) -> None:
        """Every piece once, as captured (every module's LoRA kernels launched), on whatever the
        static buffers hold, no attention between: what ``compile_ahead.variants_of`` records
        the kernel variants of."""
        lora, modules = self.batch.prefill_lora, self.batch.decode_modules
        if lora is not None:
            self.batch.prefill_lora = dataclasses.replace(lora, segments=(), modules=frozenset(ALL_TARGET_MODULES))
            self.batch.decode_modules = frozenset(ALL_TARGET_MODULES)
        try:
            with torch.no_grad():
                for i in range(self.runner.config.num_layers + 1):
                    self.piece(i)
        finally:
            self.batch.prefill_lora, self.batch.decode_modules = lora, modules

    def capture(self, pool) -> None:
        """Record each piece as a CUDA graph into ``pool`` (None: a new pool)."""
        graphs = []
        warmed: set = set()
        every = getattr(self.runner, "capture_warm_up", "first") == "every"
        with torch.no_grad(), capture_batch(torch.device("cuda", torch.cuda.current_device())):
            for i in range(self.runner.config.num_layers + 1):
                kind = self.piece_kind(i)
                if every or kind not in warmed:
                    # warm-up: Triton loads (or compiles) its kernels, cuBLAS picks its own; a
                    # piece of a kind already run launches the same kernels on the same shapes
                    self.piece(i)
                    torch.cuda.synchronize()
                    warmed.add(kind)
                graph = self._capture_piece(i, pool)
                if graph is None:  # it launched a variant not compiled yet: compiled now, then again
                    self.piece(i)
                    torch.cuda.synchronize()
                    graph = self._capture_piece(i, pool, record=False)
                pool = graph.pool() if pool is None else pool
                graphs.append(graph)
        torch.cuda.synchronize()
        self.graphs = graphs

    def _capture_piece(self, i: int, pool, *, record: bool = True) -> "torch.cuda.CUDAGraph | None":
        """Piece i recorded as a CUDA graph into ``pool``; with ``record``, None (its variants
        compiled now) if it launched a Triton variant not compiled yet, which a capture must not
        compile: a piece captured without its own eager run whose kind's run did not launch it."""
        graph = torch.cuda.CUDAGraph()
        # captured mid-run (the first step of its key): other threads of the engine may use the
        # GPU meanwhile, which the default ("global") mode turns into an error
        recording = record_launches() if record else contextlib.nullcontext([])
        with recording as missing, graph_capture(graph, pool=pool):
            self.piece(i)
        if missing:
            del graph
            compile_variants(missing, self.runner.device)
            return None
        return graph

    # ------------------------------------------------------------------ one step

    def load(self, batch: "StepBatch") -> None:
        """Copy a padded step's inputs and LoRA tables into the static buffers."""
        if batch.input_ids.shape[0] != self.rows:
            raise ValueError(f"a step of {batch.input_ids.shape[0]} rows for pieces of {self.rows}")
        self.input_ids.copy_(batch.input_ids, non_blocking=True)
        self.positions.copy_(batch.positions, non_blocking=True)
        self.slot_pages.copy_(batch.slot_pages, non_blocking=True)
        self.slot_offsets.copy_(batch.slot_offsets, non_blocking=True)
        if self.rope_long is not None:
            self.rope_long.copy_(batch.rope_long, non_blocking=True)
        captured = self.graphs is not None
        if self.lora is None:  # pieces without LoRA: only for steps none of whose rows has an adapter
            if batch.prefill_lora is not None or batch.decode_modules:
                raise ValueError("a step with adapted rows for the mixed-step pieces without LoRA")
        else:
            self._load_lora(batch.prefill_lora, captured)
        if not batch.decode_first:
            raise ValueError("pieces run padded steps, whose decode rows come first")
        if (batch.dora is not None) != (self.dora_index is not None):
            raise ValueError("a step with DoRA rows runs the pieces built for DoRA rows, and only those")
        if self.dora_index is not None:
            self.dora_index.copy_(batch.dora.index, non_blocking=True)
        if self.lora is not None:
            self.batch.decode_modules = frozenset(ALL_TARGET_MODULES) if captured else batch.decode_modules

    def _load_lora(self, pre: "PrefillLora | None", captured: bool) -> None:
        """Copy a step's prefill LoRA tables (None: no prefill row adapted) into the static ones,
        padded (empty tiles, rank-0 adapters), and the count of its live tiles."""
        lora = self.lora
        lora.tiles.zero_()
        lora.ranks.zero_()
        lora.scales.zero_()
        segments, modules = (), frozenset()
        # (pieces for DoRA rows add the LoRA after the product whatever the step's tables say)
        if pre is not None and (pre.covering != lora.covering
                                or (self.dora_index is None and pre.write != lora.write)):
            raise ValueError(f"a step's prefill LoRA tables with covering={pre.covering}, write={pre.write} for "
                             f"pieces of covering={lora.covering}, write={lora.write}")
        live = 0
        if pre is None and self.no_lora_tiles is not None:
            live = self.no_lora_tiles.shape[1]
            lora.tiles[:, :live].copy_(self.no_lora_tiles)
        if pre is not None:
            if pre.block_r > self.block_r:
                raise ValueError(f"a step of rank block {pre.block_r} for pieces of at most {self.block_r}")
            live, a = pre.tiles.shape[1], pre.scales.shape[0]
            lora.tiles[:, :live].copy_(pre.tiles, non_blocking=True)
            lora.offsets[..., :a].copy_(pre.offsets, non_blocking=True)
            lora.ranks[:, :a].copy_(pre.ranks, non_blocking=True)
            lora.scales[:a].copy_(pre.scales, non_blocking=True)
            segments, modules = pre.segments, pre.modules
        if self.live is not None:
            self.live.fill_(live)
        # the torch references read the segments on the host (eager pieces only; a captured
        # piece launches every group's kernels, and rank-0 tiles and rows do nothing)
        self.batch.prefill_lora = dataclasses.replace(lora, segments=segments, modules=(
            frozenset(ALL_TARGET_MODULES) if captured else modules))

    def run(self, batch: "StepBatch") -> torch.Tensor:
        """The step's forward -> final-normed hidden states of ``batch.output_rows``."""
        self.load(batch)
        r = self.runner
        in_place = r.model.attention_in_place  # attention writes its rows into ``attn`` (no copy)
        if in_place and batch.real_rows < self.rows:
            self.attn[batch.real_rows:].zero_()  # padding rows, which no launch writes: once a step
        waits = batch.layer_waits  # adapters' page-in slices still copying: piece i runs layer i's LoRA
        for i in range(r.config.num_layers + 1):
            if i:
                if in_place:
                    attention(r.model, i - 1, self.q, self.k, self.v, batch, out=self.attn)
                else:
                    self.attn.copy_(attention(r.model, i - 1, self.q, self.k, self.v, batch))
            if waits:
                waits.before(i)
            if self.graphs is not None:
                self.graphs[i].replay()
            else:
                self.piece(i)
        return self.final.index_select(0, batch.output_rows)
