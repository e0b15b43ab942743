"""The tensors of one engine step: its rows built into a ``StepBatch``, and the paged forward over
them run eagerly, padded as mixed-step pieces, or replayed as a decode CUDA graph.

Rows of a step: first every prefill request's tokens (from its first uncached position), then
one token per decode request. Prefill requests with nothing cached attend to their own tokens
(``prefill_attention`` "varlen") and come first; the others attend over their pages. Prefill
rows' LoRA goes by row tiles of one request each (one table of tiles and one of the step's
adapters' offsets serve every layer); decode rows' LoRA is gathered from the persistent decode
tables. The math of the forward is ``paged_forward.py``.

A decode-only step reads its inputs from persistent buffers (``DecodeInputs``) and, on CUDA,
replays a captured graph of the whole forward for its batch-size bucket (``DecodeGraphs``).
Steps with prefill rows run eagerly, or (``EngineTuning.mixed_graphs``, on by default on CUDA)
padded to a token bucket as captured pieces around attention (``mixed_graphs.MixedPieces``): then
the decode rows come first and take their LoRA from the persistent decode tables (one gather
over a fixed number of rows per bucket), the prefill rows' LoRA goes through ``lora_segments``.
DoRA rows in such steps read their gains from a fixed-shape slot table (``dora_rows.DoraSlots``).
"""

from __future__ import annotations

import dataclasses
import operator
from functools import partial
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..kernels.nf4 import nf4_decode_workspace
from ..kernels.options import KernelOptions
from ..kernels.skinny_gemm import SkinnyPlan
from ..model.decoder import DecoderConfig, rope_inv_freq
from ..specs import ALL_TARGET_MODULES
from .compile_ahead import compile_ahead, compile_variants, variants_of
from .decode_graphs import DecodeGraphs, DecodeInputs, bucket_for, captured_keys, graph_buckets, graph_key
from .dora_rows import DoraRows, DoraSlotRows, DoraSlots, step_dora_rows
from .mixed_graphs import MixedPieces
from .mixed_settings import MixedStepSettings
from .paged_forward import PagedDecoder, lm_logits, paged_forward
from .pool import ResidentAdapter, UnifiedPool
from .request import RequestState
from .staging import make_tables
from .page_in_layers import step_layer_waits
from .step_batch import PrefixRows, Queued, StepBatch, prefill_lora_tables
from .step_times import StepKind

_ALL_MODULES = frozenset(ALL_TARGET_MODULES)


class ModelRunner(MixedStepSettings):
    """Runs the functional decoder's weights over a ``StepBatch``; owns no request state.

    ``max_decode_rows`` (the engine's ``max_num_seqs``) and ``max_pages_per_row`` size the
    decode rows' persistent buffers. ``pad_decode``: decode-only steps run padded to the
    batch-size buckets (what the graphs do; on by ``capture_decode_graphs``, settable on the
    CPU to test the padding). ``prefill_attention``: how prefill rows from position 0 attend,
    "varlen", "paged" or "auto" (paged with the Triton prefill kernels, varlen with the torch
    references); resolved into ``self.prefill_attention``."""

    def __init__(self, config: DecoderConfig, params: Mapping[str, Any], pool: UnifiedPool, *,
                 backend: str = "auto", decode_backend: str | None = None, max_decode_rows: int = 256,
                 max_pages_per_row: int | None = None, prefill_attention: str = "varlen",
                 max_batched_tokens: int = 8192, nf4_gemm: str = "auto", prefill_lora_write: str = "auto",
                 decode_gemm: str = "auto", token_bucket_mode: str = "fine", decode_lora_beside: str = "few",
                 mixed_graph_max_tokens: int | None = None) -> None:
        self.config, self.params, self.pool = config, params, pool
        self.device = pool.device
        auto = "triton" if self.device.type == "cuda" else "torch"
        self.lora_backend = auto if backend == "auto" else backend  # prefill LoRA (lora_segments)
        self.segment_block_m = 64 if self.device.type == "cuda" else 16  # rows per prefill LoRA tile
        self.prefill_attention_backend = self.lora_backend  # paged prefill attention
        if prefill_attention not in ("auto", "varlen", "paged"):
            raise ValueError(f"prefill_attention={prefill_attention!r}; allowed: auto, varlen, paged")
        if prefill_attention == "auto":  # with the torch kernels "paged" is the per-request gather + SDPA reference
            prefill_attention = "paged" if self.prefill_attention_backend == "triton" else "varlen"
        self.prefill_attention = prefill_attention
        decode_backend = decode_backend or backend
        self.kernel_backend = auto if decode_backend == "auto" else decode_backend  # gather + paged attention
        self.inv_freq = rope_inv_freq(config, self.device)
        local = rope_inv_freq(config, self.device, local=True) if config.family.local_rope_theta is not None else None
        long = rope_inv_freq(config, self.device, long=True) if config.rope_type == "longrope" else None
        self.model = PagedDecoder(config=config, params=params, pool=pool, kernel_backend=self.kernel_backend,
                                  lora_backend=self.lora_backend,
                                  prefill_attention_backend=self.prefill_attention_backend, inv_freq=self.inv_freq,
                                  local_inv_freq=local, long_inv_freq=long,
                                  kernel_options=KernelOptions(nf4_gemm=nf4_gemm),
                                  nf4_workspace=nf4_decode_workspace(params, self.device),
                                  lora_stream=torch.cuda.Stream(self.device) if self.device.type == "cuda" else None,
                                  skinny=SkinnyPlan.for_mode(decode_gemm, self.device, params["norm"].dtype),
                                  wide_beside=decode_lora_beside == "wide")
        self._decode_gemm = decode_gemm
        self.buckets = graph_buckets(max_decode_rows)
        self.decode_inputs = DecodeInputs(
            max_rows=max_decode_rows, max_pages=max_pages_per_row or pool.num_pages, num_layers=config.num_layers,
            page_size=pool.page_size, scratch_page=pool.scratch_page, device=self.device)
        self.pad_decode = False
        self.host_tables = "packed"  # a step's host tables: one pinned buffer, one copy (staging.py)
        # mixed steps padded to token buckets, decode rows first with their LoRA from the decode
        # tables, the prefill rows' LoRA by row tiles: the fixed shapes a captured mixed step
        # needs; settable on the CPU to test
        self.pad_mixed = False
        self.max_batched_tokens = max_batched_tokens
        self._graph_max_tokens = mixed_graph_max_tokens  # padded mixed steps up to this many tokens
        self.token_bucket_mode = token_bucket_mode  # the token buckets of padded mixed steps
        # the split-K prefill LoRA's arrival counters for eager steps (its shrinks leave them zero;
        # a step of more tiles allocates its own): the tiles of a step of max_batched_tokens rows
        # in max_decode_rows segments, per module
        self.prefill_counters = torch.zeros(
            MixedPieces.max_tiles(max_batched_tokens, self.segment_block_m, max_decode_rows, covering=True)
            * len(ALL_TARGET_MODULES), dtype=torch.int32, device=self.device)
        # padded mixed steps as pieces around attention (mixed_graphs.py): None (one eager
        # forward), "eager" (the pieces on static buffers, run eagerly: the CPU path) or "graphs"
        self.mixed_pieces: str | None = None
        # prefill LoRA written first or added after (``PrefillLora.write``; None: no LoRA, the
        # steps none of whose rows has an adapter) -> token bucket -> its pieces (one set serves
        # every rank mix: mixed_graphs.py), and those for steps with DoRA rows (added after only)
        self._pieces_by_mode: dict[bool | None, tuple[dict[int, MixedPieces], dict[int, MixedPieces]]] = {
            True: ({}, {}), False: ({}, {}), None: ({}, {})}
        # the mixed-step pieces' LoRA (``set_mixed_lora``): base-only steps without LoRA kernels,
        # and the prefill LoRA's live grids (its padded tables' padding launching nothing)
        self.base_pieces, self.live_grids = True, True
        self._prefill_lora_write = "off"
        self.prefill_lora_write = prefill_lora_write
        # mixed-step captures: each piece run eagerly first ("every") or only the first of its
        # kind ("first"; ``EngineTuning.capture_warm_up``, ``MixedPieces.piece_kind``)
        self.capture_warm_up = "first"
        self.graphs: DecodeGraphs | None = None
        self.decode_graphs_s = 0.0  # seconds the decode graphs' capture took (their compiles ahead included)
        self.decode_compile: dict[str, Any] | None = None  # compile_ahead's report before that capture
        self._graph_logits: torch.Tensor | None = None  # [max rows, V] fp32, written by the graphs
        self._slots: DoraSlots | None = None  # DoRA gains of graph-shaped steps (decode and mixed)
        self._decode_dora_of: tuple[list, Any, Any] = ([], None, None)  # (rows, (padded, slots version), DoRA)
        self.step_kind: StepKind | None = None  # what the last step run was (step_times.py)

    @property
    def host_tables(self) -> str:
        """How a step's host tables reach the device (``EngineTuning.host_tables``): "packed"
        (one host buffer, pinned on CUDA, one asynchronous copy; ``staging.StagedTables``) or
        "separate" (one copy per table from pageable memory)."""
        return self._host_tables

    @host_tables.setter
    def host_tables(self, mode: str) -> None:
        self._tables = make_tables(mode, self.device)
        self.decode_inputs.tables = make_tables(mode, self.device)
        self._host_tables = mode

    @property
    def decode_gemm(self) -> str:
        """How the plain 16-bit frozen products of few rows run (``EngineTuning.decode_gemm``).
        Settable between steps: the mixed-step pieces are dropped (rebuilt on first use or by
        ``build_mixed_pieces``); captured decode graphs keep the products they captured until
        ``capture_decode_graphs`` runs again."""
        return self._decode_gemm

    @decode_gemm.setter
    def decode_gemm(self, mode: str) -> None:
        plan = SkinnyPlan.for_mode(mode, self.device, self.params["norm"].dtype)
        if mode != self._decode_gemm:
            self._clear_pieces()
            self.model = dataclasses.replace(self.model, skinny=plan)
        self._decode_gemm = mode

    @property
    def decode_lora_beside(self) -> str:
        """Where the decode rows' LoRA shrinks run beside the frozen GEMMs
        (``EngineTuning.decode_lora_beside``): "few" (decode steps of at most
        ``lora_gather.BESIDE_MAX_ROWS`` rows) or "wide" (every decode step, and mixed steps'
        decode rows). Settable between steps: the mixed-step pieces are dropped; captured decode
        graphs keep what they captured until ``capture_decode_graphs`` runs again."""
        return "wide" if self.model.wide_beside else "few"

    @decode_lora_beside.setter
    def decode_lora_beside(self, mode: str) -> None:
        if mode not in ("few", "wide"):
            raise ValueError(f"decode_lora_beside={mode!r}; allowed: few, wide")
        if mode != self.decode_lora_beside:
            self._clear_pieces()
            self.model = dataclasses.replace(self.model, wide_beside=mode == "wide")

    @property
    def attention_in_place(self) -> bool:
        """Whether attention's launches write their rows of a layer's output in place
        (``EngineTuning.attention_in_place``; ``PagedDecoder.attention_in_place``). Settable
        between steps: attention runs outside the captured graphs, so nothing is captured again."""
        return self.model.attention_in_place

    @attention_in_place.setter
    def attention_in_place(self, on: bool) -> None:
        self.model = dataclasses.replace(self.model, attention_in_place=bool(on))

    def capture_decode_graphs(self, find_variants: Callable[[Callable[[], list]], tuple[list, dict]] | None = None
                              ) -> float:
        """Capture the decode forward of every ``decode_graphs.captured_keys`` key (CUDA, Triton
        decode kernels); from now on decode-only steps replay them. Their kernel variants are
        compiled ahead first: those the keys' forwards record (``compile_ahead.variants_of``), or
        what ``find_variants(record)`` returns (``(variants, report)``: e.g. read from a record,
        ``variant_record.recorded_variants``). Returns seconds taken."""
        if self.device.type != "cuda" or self.kernel_backend != "triton":
            raise RuntimeError("decode CUDA graphs need a CUDA device and the Triton decode kernels "
                               f"(device {self.device}, decode backend {self.kernel_backend!r})")
        self._graph_logits = torch.empty(self.buckets[-1], self.config.vocab_size, dtype=torch.float32,
                                         device=self.device)
        self.pad_decode = True
        self.graphs = DecodeGraphs(self.buckets, self._graph_body)
        with torch.no_grad():
            # every bucket's kernel variants compiled at once, then captured (compile_ahead.py)
            units = [unit for _, unit in self.decode_compile_units()]
            if find_variants is None:
                self.decode_compile = compile_ahead(units, self.device)
            else:
                variants, found = find_variants(partial(variants_of, units))
                self.decode_compile = {**compile_variants(variants, self.device), **found}
            self.decode_graphs_s = self.graphs.capture() + self.decode_compile["seconds"] + \
                self.decode_compile["record_s"]
        return self.decode_graphs_s

    def decode_compile_units(self) -> list[tuple[str, Callable[[], None]]]:
        """(name, call) per decode graph key (``captured_keys``): the padded decode forward over the
        persistent decode tables (whatever ranks they hold: only the key picks the kernels)."""
        return [(f"decode rows={rows} lora={lora} rank bound={r}", partial(self._graph_body, rows, lora, False, r))
                for rows, lora, _, r in captured_keys(self.buckets)]

    def mixed_compile_units(self) -> list[tuple[str, Callable[[], None]]]:
        """(name, call) per token bucket of the mixed-step pieces (none with pieces off): every
        piece of that bucket run once (``MixedPieces.dry_run``; a bucket not built yet on
        temporary buffers). Nothing here depends on the adapters loaded or their ranks."""
        if self.mixed_pieces is None:
            return []
        return [(f"mixed rows={rows}", partial(self._dry_run_pieces, rows)) for rows in self.token_buckets]

    def _dry_run_pieces(self, rows: int) -> None:
        for write in self._write_modes() + ([None] if self.base_pieces else []):
            if not self._reachable(write, rows) or rows not in self.step_buckets(write is not None):
                continue
            pieces = self._pieces_by_mode[write][0].get(rows)
            (pieces or self._new_pieces(rows, write=write, defer_capture=True)).dry_run()

    def _graph_body(self, rows: int, lora: bool, dora: bool = False, rank_bound: int | None = None) -> None:
        batch = self._decode_batch(rows, _ALL_MODULES if lora else frozenset(), rank_bound)
        if dora:  # (the slot table exists: the step that asked for this graph filled it)
            batch.dora = DoraSlotRows(self._slots, 0, rows, self._slots.row_slot[:rows])
        hidden = self.forward(batch)
        lm_logits(self.model, hidden, out=self._graph_logits[:rows])

    def _dora_slots(self) -> DoraSlots:
        """The fixed-shape DoRA gain table of graph-shaped steps (made on first use)."""
        if self._slots is None:
            self._slots = DoraSlots(self.config, max_rows=self.decode_inputs.max_rows, device=self.device,
                                    dtype=self.pool.storage.dtype)
        return self._slots

    def _decode_dora(self, decode: Sequence[RequestState], rows: int) -> DoraRows | DoraSlotRows | None:
        """A decode-only step's DoRA rows: from the slot table when the step is padded (graph-
        shaped) and its DoRA adapters fit, else as row ranges; None without DoRA rows. Worked
        out again only when the rows, the padding or the slots (a mixed step's) change."""
        known, pad, found = self._decode_dora_of
        version = self._slots.version if self._slots is not None else 0
        if (pad != (self.pad_decode, version) or len(known) != len(decode)
                or not all(map(operator.is_, decode, known))):
            adapters = [st.adapter for st in decode]
            found = None
            if any(a is not None and a.dora_scales is not None for a in adapters):
                if self.pad_decode and self._dora_slots().load(adapters):
                    found = "slots"
                else:
                    found = step_dora_rows([(j, j + 1, a) for j, a in enumerate(adapters)], self.device,
                                           self.pool.storage.dtype)
            version = self._slots.version if self._slots is not None else 0
            self._decode_dora_of = (list(decode), (self.pad_decode, version), found)
        return DoraSlotRows(self._slots, 0, rows, self._slots.row_slot[:rows]) if found == "slots" else found

    # ------------------------------------------------------------------ decode-only steps

    def decode_logits(self, decode: Sequence[RequestState], next_tokens: Sequence[int] | None = None, *,
                      token_tensor: torch.Tensor | None = None) -> torch.Tensor:
        """A step with decode rows only: each request feeds its newest token -> fp32 logits of
        its next token ``[B, V]`` (a view valid until the next step). ``next_tokens``: those
        tokens, when the previous step was a decode-only step of the same rows in the same
        order (``DecodeInputs.load_step``); ``token_tensor``: the rows' newest tokens still on
        the device, not in their states (the previous step sampled them and may be running: the
        overlapped decode of engine.py)."""
        b = len(decode)
        rows = bucket_for(b, self.buckets) if self.pad_decode else b
        inputs = self.decode_inputs
        if inputs.load_tables(decode, self.pool.pages_moved):
            self.pool.wait_ready([st.resident for st in decode if st.resident is not None])
            next_tokens = None  # KV pages moved: every row's slot page is looked up again
        inputs.load_step(decode, rows, next_tokens, token_tensor)
        dora = self._decode_dora(decode, rows)
        adapters = "dora" if dora is not None else "lora" if inputs.has_lora else "base"
        if self.graphs is not None and not isinstance(dora, DoraRows):  # (ranges: more DoRA adapters than slots)
            self.graphs.replay(rows, inputs.has_lora, dora is not None, inputs.max_rank)
            self.step_kind = StepKind("decode", rows, adapters, "graph")
            return self._graph_logits[:b]
        # eager: padded steps run every module's gather, as the graphs do
        modules = _ALL_MODULES if self.pad_decode and inputs.has_lora else inputs.modules
        batch = self._decode_batch(rows, modules, graph_key(rows, bool(modules), False, inputs.max_rank)[3])
        batch.dora = dora
        logits = self.logits(self.forward(batch))[:b]
        self.step_kind = StepKind("decode", bucket_for(b, self.buckets), adapters, "eager")
        return logits

    def _decode_batch(self, rows: int, modules: frozenset[str], rank_bound: int | None = None) -> StepBatch:
        """A ``StepBatch`` of views into the decode buffers' first ``rows`` rows, its LoRA in rank
        variant ``rank_bound`` (derived tensors by device ops: part of a captured graph)."""
        inputs = self.decode_inputs
        positions = inputs.step[1, :rows]
        lora = bool(modules)
        return StepBatch(
            input_ids=inputs.step[0, :rows], positions=positions, slot_pages=inputs.step[2, :rows],
            slot_offsets=positions % self.pool.page_size, num_prefill_rows=0, num_fresh_rows=0, cu_seqlens=None,
            max_prefill_len=0, prefill_prefixes=None, prefill_lora=None, page_table=inputs.page_table[:rows],
            seq_lens=(positions + 1).to(torch.int32),
            decode_offsets=inputs.lora_offsets[..., :rows] if lora else None,
            decode_ranks=inputs.lora_ranks[:, :rows] if lora else None,
            decode_scales=inputs.lora_scales[:rows] if lora else None,
            decode_modules=modules, spans=[], output_rows=None, rope_long=self._rope_long_decode(positions),
            decode_groups=inputs.lora_groups[:, :rows] if lora else None,
            decode_rank_bound=rank_bound if lora else None)

    def _rope_long_decode(self, positions: torch.Tensor) -> torch.Tensor | None:
        """longrope: a decode row's request holds position + 1 tokens (device op: graph-safe)."""
        if self.config.rope_type != "longrope":
            return None
        return positions + 1 > self.config.rope_original_max_positions
    # ------------------------------------------------------------------ inputs

    def prepare(self, prefill: Sequence[RequestState], decode: Sequence[RequestState],
                prefill_lens: Sequence[int] | None = None, *, fed: torch.Tensor | None = None) -> StepBatch:
        """Host-side bookkeeping of a step -> device tensors. Prefill request i feeds
        ``prefill_lens[i]`` tokens (default: all the rest) from ``num_cached`` (0 unless a cached
        prefix was reused or an earlier chunk ran); decode requests feed their newest token.
        Output rows: a prefill's last row when it completes the request's tokens (every row
        when it wants prompt logprobs), each decode row. Rows: the prefill requests with nothing
        cached (varlen attention; none with ``prefill_attention`` "paged"), then the others (paged
        prefill attention), then the decode rows; padded (``pad_mixed``): the decode rows first,
        then the prefill rows, then padding. ``spans`` stay in the order of ``prefill + decode``.
        ``fed`` (``[len(decode)]`` on the device): the decode rows' newest tokens, not in their
        states yet (a step planned ahead of the one sampling them, the engine's overlapped
        decode): each row then feeds position ``num_tokens``, its token copied on the device."""
        self.decode_inputs.forget_step()  # its decode rows move on without load_step
        s = self.pool.page_size
        ids: list[int] = []
        pos: list[int] = []
        slot_pages: list[int] = []
        spans: list[tuple[int, int]] = [(0, 0)] * (len(prefill) + len(decode))
        out_rows: list[int] = []
        segments: list[tuple[int, int, int]] = []
        local: dict[int, int] = {}  # adapter key -> index in the step's LoRA tables
        residents: list[ResidentAdapter] = []

        def add_segment(state: RequestState, start: int, end: int) -> None:
            key = state.adapter.key
            if key not in local:  # the adapter's index in the step's LoRA tables
                local[key] = len(residents)
                residents.append(state.resident)
            segments.append((start, end, local[key]))

        # fresh: attend to their own tokens (varlen); paged: over their pages (one launch)
        own = [self.prefill_attention == "varlen" and st.num_cached == 0 for st in prefill]
        fresh = [i for i, o in enumerate(own) if o]
        paged = [i for i, o in enumerate(own) if not o]
        pad = self.pad_mixed
        ahead = int(fed is not None)
        if pad:  # decode rows first (their LoRA tables start at row 0 in any bucket), then prefill
            self._add_decode_rows(decode, len(prefill), ids, pos, slot_pages, spans, out_rows, ahead)
        n_decode_first = len(ids)
        # row bounds of the prefill requests in row order (fresh, then paged), from their first row
        cu = self._add_prefill_rows(prefill, fresh + paged, prefill_lens, ids, pos, slot_pages, spans, out_rows,
                                    add_segment)
        n_prefill = len(ids) - n_decode_first
        if not pad:
            self._add_decode_rows(decode, len(prefill), ids, pos, slot_pages, spans, out_rows, ahead)
        real = len(ids)
        if pad:  # inert rows up to the token bucket: token 0 at position 0, KV to the scratch page
            # (a prompt longer than the step budget runs whole, unchunked: no bucket holds it)
            # (a step none of whose rows has an adapter pads only up to mixed_graph_max_tokens)
            buckets = self.step_buckets(bool(segments) or any(st.adapter is not None for st in decode))
            extra = bucket_for(real, buckets) - real if real <= buckets[-1] else 0
            ids += [0] * extra
            pos += [0] * extra
            slot_pages += [self.pool.scratch_page] * extra

        batch = self._upload_rows(prefill, decode, prefill_lens, fresh, paged, cu, (ids, pos, slot_pages, out_rows),
                                  spans, segments, residents, n_prefill, real, ahead)
        ds = batch.first_decode_row
        if fed is not None and decode:  # (after the upload, on the same stream)
            batch.input_ids[ds:ds + len(decode)].copy_(fed)
        runs = ([(a, e, residents[i].adapter) for a, e, i in segments]
                + [(ds + j, ds + j + 1, st.adapter) for j, st in enumerate(decode)])
        batch.dora = step_dora_rows(runs, self.device, self.pool.storage.dtype)
        if batch.dora is not None and pad and self.mixed_pieces is not None:  # the pieces' fixed-shape form
            batch.dora = self._dora_slots().step_rows(runs, len(ids)) or batch.dora
        if decode or pad:  # (pad: rank-0 tables past the decode rows, which the pieces read)
            self._prepare_decode(batch, decode)
        decode_residents = [st.resident for st in decode if st.resident is not None]
        if self.pool.page_in_groups > 1:  # the prefill adapters' pending copies: waited for by layer
            self.pool.wait_ready(decode_residents)  # (issues the admissions' pending copies first)
            batch.layer_waits = step_layer_waits(residents, self.pool.order_after)
        else:
            self.pool.wait_ready(residents + decode_residents)
        return batch

    def _upload_rows(self, prefill: Sequence[RequestState], decode: Sequence[RequestState],
                     prefill_lens: Sequence[int] | None, fresh: list[int], paged: list[int], cu: list[int],
                     rows: tuple[list[int], list[int], list[int], list[int]], spans: list[tuple[int, int]],
                     segments: list[tuple[int, int, int]], residents: list[ResidentAdapter], n_prefill: int,
                     real: int, ahead: int = 0) -> StepBatch:
        """``prepare``'s rows (token ids, positions, KV pages, output rows) and the tables
        derived from them, queued on the step's host tables and uploaded in one copy
        (``staging.py``; with ``host_tables`` "separate", one copy each) -> the ``StepBatch``."""
        ids, pos, slot_pages, out_rows = rows
        s, pad = self.pool.page_size, self.pad_mixed
        tables = self._tables
        fresh_cu = cu[:len(fresh) + 1]
        queued = {"ids": tables.add(ids, torch.int64), "pos": tables.add(pos, torch.int64),
                  "pages": tables.add(slot_pages, torch.int64),
                  "offsets": tables.add(np.asarray(pos, dtype=np.int64) % s, torch.int64),
                  "out": tables.add(out_rows, torch.int64)}
        if fresh:
            queued["cu"] = tables.add(fresh_cu, torch.int32)
        prefix = self._prefix_rows([prefill[i] for i in paged], cu[len(fresh):]) if paged else None
        if self.config.rope_type == "longrope":
            queued["long"] = tables.add(self._rope_long_rows(prefill, fresh + paged, prefill_lens, decode, len(ids),
                                                             ahead), torch.bool)
        covering = self._prefill_lora_write != "off"
        write = covering and self._step_writes(sum(e - s for s, e, _ in segments), len(ids))
        lora = prefill_lora_tables(segments, residents, self.segment_block_m, tables,
                                   rows=len(ids) if covering else None, write=write,
                                   factor_align=self.pool.factor_align,
                                   counters=self.prefill_counters) if segments else None
        up = tables.upload()
        batch = StepBatch(
            input_ids=up[queued["ids"]], positions=up[queued["pos"]], slot_pages=up[queued["pages"]],
            slot_offsets=up[queued["offsets"]], num_prefill_rows=n_prefill, num_fresh_rows=cu[len(fresh)],
            cu_seqlens=up[queued["cu"]] if fresh else None,
            max_prefill_len=max((b - a for a, b in zip(fresh_cu, fresh_cu[1:])), default=0),
            prefill_prefixes=prefix.finish(up) if prefix is not None else None,
            prefill_lora=lora.finish(up) if lora is not None else None, page_table=None, seq_lens=None,
            decode_offsets=None, decode_ranks=None, decode_scales=None, decode_modules=frozenset(),
            spans=spans, output_rows=up[queued["out"]], real_rows=real if pad else None,
            decode_first=pad,
        )
        if "long" in queued:
            batch.rope_long = up[queued["long"]]
        return batch

    def _rope_long_rows(self, prefill: Sequence[RequestState], order: Sequence[int],
                        prefill_lens: Sequence[int] | None, decode: Sequence[RequestState], rows: int,
                        ahead: int = 0) -> list[bool]:
        """longrope, in ``prepare``'s row order: True on the rows of requests holding more tokens
        than ``original_max_position_embeddings`` (prompt and generated so far: the length of
        their cache once fed), as HF picks the long factors for a sequence longer than that
        (``ahead``: the decode rows hold one token more than their states)."""
        limit = self.config.rope_original_max_positions
        fed = [(prefill[i].num_tokens - prefill[i].num_cached if prefill_lens is None else prefill_lens[i],
                prefill[i].num_tokens > limit) for i in order]
        dec = [(1, st.num_tokens + ahead > limit) for st in decode]
        parts = dec + fed if self.pad_mixed else fed + dec
        flags = [long for n, long in parts for _ in range(n)]
        flags += [False] * (rows - len(flags))  # padding rows
        return flags

    def _add_prefill_rows(self, prefill: Sequence[RequestState], order: Sequence[int],
                          prefill_lens: Sequence[int] | None, ids: list[int], pos: list[int], slot_pages: list[int],
                          spans: list[tuple[int, int]], out_rows: list[int], add_segment) -> list[int]:
        """Append the rows of ``prefill[i]`` for i in ``order`` to the step's row lists (each
        adapted request's rows also to its LoRA segments, through ``add_segment(state, start,
        end)``) -> their row bounds, from their first row."""
        s = self.pool.page_size
        n_before = len(ids)
        cu = [0]
        for i in order:
            state = prefill[i]
            first = state.num_cached
            end = state.num_tokens if prefill_lens is None else first + prefill_lens[i]
            toks = state.all_ids[first:end]
            start = len(ids)
            ids += toks
            pos += range(first, first + len(toks))
            slot_pages += [state.pages[p // s] for p in range(first, first + len(toks))]
            cu.append(len(ids) - n_before)
            if state.resident is not None:
                add_segment(state, start, len(ids))
            first_out = (start if state.wants_prompt_logprobs
                         else len(ids) - 1 if end == state.num_tokens else len(ids))
            spans[i] = (len(out_rows), len(out_rows) + len(ids) - first_out)
            out_rows += range(first_out, len(ids))
        return cu

    def _add_decode_rows(self, decode: Sequence[RequestState], n_prefill_requests: int, ids: list[int],
                         pos: list[int], slot_pages: list[int], spans: list[tuple[int, int]],
                         out_rows: list[int], ahead: int = 0) -> None:
        """Append the decode rows (their newest tokens), in ``decode`` order (the order of the
        decode tables), to the step's row lists. ``ahead``: each row's newest token is not in its
        state yet (token 0 here, copied in on the device), at position ``num_tokens``."""
        s = self.pool.page_size
        for j, state in enumerate(decode):
            p = state.num_tokens - 1 + ahead
            ids.append(0 if ahead else state.last_token)
            pos.append(p)
            slot_pages.append(state.pages[p // s])
            spans[n_prefill_requests + j] = (len(out_rows), len(out_rows) + 1)
            out_rows.append(len(ids) - 1)

    def _prefix_rows(self, states: Sequence[RequestState], bounds: Sequence[int]) -> Queued:
        """Device tables of the prefill requests that attend over their pages (queued on the
        step's tables; ``finish`` -> ``PrefixRows``); ``bounds`` their rows' bounds in the step
        (consecutive)."""
        s = self.pool.page_size
        lens = [b - a for a, b in zip(bounds, bounds[1:])]
        pages = [st.pages[:-(-(st.num_cached + n) // s)] for st, n in zip(states, lens)]
        width = max(len(p) for p in pages)
        tables = self._tables
        queued = (tables.add([b - bounds[0] for b in bounds], torch.int32),
                  tables.add([st.num_cached for st in states], torch.int32),
                  tables.add([p + [0] * (width - len(p)) for p in pages], torch.int32))

        def finish(up: Sequence[torch.Tensor]) -> PrefixRows:
            cu_t, starts, table = (up[i] for i in queued)
            return PrefixRows(cu_seqlens=cu_t, starts=starts, page_table=table, max_seqlen=max(lens))

        return Queued(finish)

    def _prepare_decode(self, batch: StepBatch, decode: Sequence[RequestState]) -> None:
        inputs = self.decode_inputs
        inputs.load_tables(decode, self.pool.pages_moved)
        b, ds = len(decode), batch.first_decode_row
        batch.page_table = inputs.page_table[:b]
        batch.seq_lens = (batch.positions[ds:ds + b] + 1).to(torch.int32)
        if b and inputs.has_lora:
            batch.decode_offsets = inputs.lora_offsets[..., :b]
            batch.decode_ranks = inputs.lora_ranks[:, :b]
            batch.decode_scales = inputs.lora_scales[:b]
            batch.decode_modules = inputs.modules
            batch.decode_groups = inputs.lora_groups[:, :b]

    # ------------------------------------------------------------------ forward

    def capture_keys(self) -> dict[str, list]:
        """What this runner has captured (or, with eager pieces, built), by kind: the decode
        graphs' ``(batch bucket, with LoRA, with DoRA rows, rank bound)`` keys and the mixed-step
        pieces' token buckets (those for steps with DoRA rows are counted in ``capture_counts``'
        graphs). Neither depends on the adapters' ranks."""
        return {"decode_graphs": self.graphs.keys if self.graphs is not None else [],
                "mixed_pieces": sorted(self._mixed)}

    def capture_counts(self) -> dict[str, int]:
        """Counts of ``capture_keys`` by kind, plus the CUDA graphs behind them (a decode key is
        one graph; a token bucket's pieces are L + 1)."""
        keys = self.capture_keys()
        return {"decode_graph_keys": len(keys["decode_graphs"]), "mixed_piece_keys": len(keys["mixed_pieces"]),
                "cuda_graphs": len(keys["decode_graphs"]) + sum(
                    p.num_graphs for built in self._pieces_by_mode.values() for d in built for p in d.values())}

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """-> final-normed hidden states of ``batch.output_rows``: ``[R, H]``."""
        rows = batch.input_ids.shape[0]
        adapters = ("dora" if batch.dora is not None else
                    "lora" if batch.prefill_lora is not None or batch.decode_modules else "base")
        if (self.mixed_pieces is not None and batch.real_rows is not None
                and rows in self.step_buckets(adapters != "base")
                and not isinstance(batch.dora, DoraRows)):  # (ranges: more DoRA adapters than slots)
            # steps with DoRA rows run their own pieces (the gains' rescale in every projection)
            pre, dora = batch.prefill_lora, batch.dora is not None
            write = not dora and (pre.write if pre is not None else self._write_modes()[0])
            if self.base_pieces and pre is None and not dora and not batch.decode_modules:
                write = None  # no row adapted: the pieces without LoRA
            built = self._pieces_by_mode[write][1 if dora else 0]
            pieces = built.get(rows)
            if pieces is None:
                pieces = built[rows] = self._new_pieces(rows, dora=dora, write=write)
            self.step_kind = StepKind("mixed", rows, adapters, "graph" if self.mixed_pieces == "graphs" else "pieces")
            return pieces.run(batch)
        bucket = bucket_for(rows, self.token_buckets) if rows <= self.token_buckets[-1] else rows
        self.step_kind = StepKind("mixed", bucket, adapters, "eager")
        return paged_forward(self.model, batch)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, H]`` final-normed hidden states -> ``[R, V]`` fp32 logits."""
        return lm_logits(self.model, hidden)
