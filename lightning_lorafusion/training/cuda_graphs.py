"""CUDA graphs of the training step: one captured forward + backward per microbatch shape key.

A microbatch has a fixed token capacity, so almost everything in its forward and backward has
static shapes. What still varies is bounded and bucketed here, so a handful of graphs covers a
run (``GraphKey``): the longest attention block (``max_seqlen``, a launch argument of varlen
attention: next power of two), the number of attention blocks (``cu_seqlens`` padded with empty
blocks to a power of two), and the number of label rows the LM head computes (padded to a
multiple of ``capacity / 16`` with a row that has no label). The fused LoRA
kernels get fixed-shape launch tables (``kernels/static_routing.py``): every adapter active,
tiles padded to a bound, the microbatch index folded into the seed column, so the adapters
present in a microbatch do not change the graph. DoRA adapters read which rows are theirs from
the static ``row_owner`` and recompute their norms from the current weights inside the step
(``kernels/fused_dora.py``), every DoRA adapter of the bank whether present or not.

A key with no graph of its own replays the cheapest captured graph whose buckets are all at
least as large (same capacity): the static buffers already pad with empty blocks and label rows
without a label, so the result is the same, for a few wasted LM-head rows. Such a key gets its
own capture only after ``CAPTURE_AFTER`` covered uses, so keys that first appear late in a run
(a new epoch's plan, a data-parallel replica's share) do not stall it with captures.

Before an epoch's first step the training module hands ``precapture`` every shape key of the
epoch (all data-parallel replicas' keys, so every replica captures the same graphs at the same
time): a few keys covering them all (``graph_cover.plan_captures``, at most ``max_precapture``)
are captured then, in one ``capture_batch``, each warmed up on an idle microbatch that trains
nothing. A planned key replays its cover for the whole epoch; ``CAPTURE_AFTER`` applies only to
keys the plan did not name, so no capture happens mid-epoch.

A step copies the microbatch into static buffers, refills the tables and replays; the first
microbatch of a key runs eagerly on a side stream (that is its real step: gradients count),
then the same function is captured, sharing one memory pool with the other keys' graphs
(never replayed concurrently; outputs are copied out at once). Gradients accumulate into
static ``.grad`` tensors (bound before every step, so ``zero_grad(set_to_none=True)`` or a
restored checkpoint is harmless). Optimizer steps stay outside the graph. What cannot be
captured falls back to the caller's eager step with the reason logged (``refusals``). How the
warm-ups and captures use the allocator (capture order, cache releases, the first warm-up's
pool) is ``CaptureMemory``'s choice: the pool stays reserved between replays, so it and the
eager allocator's reserve, not the allocated peak, are a graph run's memory.

A pipeline stage runs the same step over its layers (``layers``, ``is_first``): where a
microbatch's forward and backward are adjacent in the schedule (one stage, or the last stage of
a pipeline) the whole pair is one graph; a stage after the first reads its input activation from
a static buffer and leaves the gradient w.r.t. it in ``input_grad``. The earlier stages, whose
forward and backward are apart, have their own graphs (``stage_graphs.SplitStageGraphs``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..capture import capture_batch, graph_capture
from ..data.microbatch import IGNORE_INDEX, Microbatch
from ..kernels.static_routing import StaticLaunchTables, StaticTableError
from ..model.decoder import DEFAULT_OPTIONS, DecoderConfig, DecoderOptions, decoder_layers, embed, head_loss_sums
from ..parallel.stage import adapter_loss
from .graph_cover import DEFAULT_PRECAPTURE, GraphKey, cheapest_cover, plan_captures
from .graph_pool import allocating_from, outside_pool, release_cache

log = logging.getLogger(__name__)

CUDA_GRAPH_MODES = ("auto", "on", "off")
MAX_GRAPHS = 48  # shape keys captured per run; later new keys run eagerly
MIN_SEQLEN_BUCKET = 128
MIN_BLOCKS_BUCKET = 8
MIN_LABEL_ROWS_STEP = 128
CAPTURE_AFTER = 32  # uses under a covering graph before a key gets its own capture (a capture
# costs about as much as 300-400 covered steps' padded LM-head rows on the 8B shape)


@dataclass(frozen=True)
class CaptureMemory:
    """How captures use the allocator (what a captured step's pool and the eager allocator keep
    reserved). ``largest_first``: an epoch's keys are captured largest first (``capture_size``),
    so a smaller key's step fits in blocks the largest one freed in the shared pool instead of
    growing it. ``release``: the allocator's cached blocks are handed back before every capture
    too, not only after the first warm-up and after the captures. ``warm_in_pool``: the
    first key's eager warm-up allocates from the graphs' pool too (a ``torch.cuda.MemPool`` made
    before it), so the capture reuses the warm-up's blocks.

    Whatever the choice, the cached blocks are handed back once the captures are done: a
    warm-up routes its thread's allocations to the pool, but its backward runs on autograd's
    device thread, whose transients (a layer's backward: 0.6 GiB at the 8B shape and 3,008
    tokens) land in the eager allocator and would stay reserved there beside the pool."""

    largest_first: bool = False
    release: bool = False
    warm_in_pool: bool = False


DEFAULT_CAPTURE_MEMORY = CaptureMemory()


def capture_size(key: GraphKey) -> tuple[int, int, int, int]:
    """Sort order of keys by the memory a captured step takes: tokens, then the LM head's
    rows, attention's launch width, attention blocks."""
    return key.capacity, key.label_rows, key.max_seqlen, key.num_blocks


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def label_rows_step(capacity: int) -> int:
    """Label-row counts are padded to multiples of this: at most 64 buckets per capacity, and
    at most ``capacity / 64`` rows (1.6% of a microbatch's tokens) of LM head computed for
    nothing under a graph of the key's own (a replay costs ~8 us per LM-head row on the 8B
    shape: 512-row buckets left a quarter of an 8192-token microbatch's head padding)."""
    return min(capacity, max(MIN_LABEL_ROWS_STEP, capacity // 64))


def graph_key(mb: Microbatch) -> GraphKey:
    """The bucketed key of ``mb``, from host metadata only (no device reads).

    Raises ``ValueError`` when ``mb`` lacks ``max_seqlen`` / ``label_rows`` (built by packing).
    """
    if mb.max_seqlen is None or mb.label_rows is None:
        raise ValueError("the microbatch has no host-built max_seqlen/label_rows (data.packing adds them)")
    cap = mb.capacity
    step = label_rows_step(cap)
    return GraphKey(
        capacity=cap,
        max_seqlen=min(cap, _pow2_at_least(mb.max_seqlen, MIN_SEQLEN_BUCKET)),
        num_blocks=min(cap, _pow2_at_least(mb.cu_seqlens.shape[0] - 1, MIN_BLOCKS_BUCKET)),
        label_rows=min(cap, -(-max(mb.num_label_rows, 1) // step) * step),
    )


def idle_microbatch(key: GraphKey, num_adapters: int, device: torch.device | str = "cpu") -> Microbatch | None:
    """A microbatch of key ``key`` that trains nothing: no label (every row IGNORE_INDEX), zero
    loss denominators, every row adapter 0's; attention blocks of ``key.max_seqlen`` rows over
    the whole capacity (a graph's warm-up must see blocks it can launch). None when ``key`` has
    too few blocks for that (no packed microbatch has such a key: its blocks cover the capacity)."""
    cap, width = key.capacity, key.max_seqlen
    bounds = list(range(0, cap, width)) + [cap]
    if len(bounds) - 1 > key.num_blocks:
        return None
    i64 = dict(dtype=torch.int64, device=device)
    return Microbatch(
        input_ids=torch.zeros(cap, **i64), labels=torch.full((cap,), IGNORE_INDEX, **i64),
        position_ids=torch.cat([torch.arange(e - s, **i64) for s, e in zip(bounds, bounds[1:])]),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device), segments=((0, cap, 0),),
        samples=(), loss_denominators=torch.zeros(num_adapters, dtype=torch.float32, device=device),
        step_adapters=(), index=0, max_seqlen=min(width, cap), label_rows=torch.zeros(0, **i64))


def cuda_graphs_refusal(*, device: torch.device, backend: str, pipeline: bool,
                        world_size: int = 1, dora_dropout: str | None = None) -> str | None:
    """Why training steps cannot be graphs here (None: they can). Under the pipeline strategy
    every stage can: the last one fuses each microbatch's forward and backward, the earlier ones
    capture them apart per in-flight slot (``stage_graphs.SplitStageGraphs``). ``dora_dropout``:
    the name of a DoRA adapter with dropout."""
    if dora_dropout is not None:
        return (f"adapter {dora_dropout!r} is DoRA with dropout > 0, which runs PEFT's second frozen "
                "product on masks drawn on the host (kernels/fused_dora.py); set its dropout to 0 for graphs")
    if device.type != "cuda":
        return f"training runs on {device.type}, not on a CUDA GPU"
    if backend == "torch":
        return ("backend='torch': the torch reference LoRA draws its dropout masks from host "
                "integers; graphs need the fused Triton kernels (backend: auto or triton)")
    if pipeline:
        return None
    if world_size > 1:
        return (f"{world_size} processes without the multi-adapter strategy (e.g. strategy: ddp, "
                "whose gradient all-reduce hooks would run inside the captured backward); graphs "
                "are implemented for one GPU")
    return None


class StaticInputs:
    """The device buffers a graph reads, at fixed addresses, for one capacity C and A adapters.

    ``input_ids``, ``labels``, ``position_ids``, ``row_owner`` (each row's adapter, A = nobody)
    ``[C]`` int64; ``cu_seqlens`` ``[C + 1]`` int32 (a graph reads the first ``num_blocks + 1``:
    the microbatch's boundaries, then C repeated: empty blocks); ``label_rows`` ``[C]`` int64 (a
    graph reads the first ``label_rows``: the microbatch's, then row C - 1, whose label is
    IGNORE_INDEX by the pre-shifted label contract: padding, or the last token of a sample);
    ``denominators`` ``[A]`` fp32.
    """

    def __init__(self, capacity: int, num_adapters: int, device: torch.device) -> None:
        self.capacity, self.num_adapters = capacity, num_adapters

        def buf(n, dtype=torch.int64):
            return torch.zeros(n, dtype=dtype, device=device)

        self.input_ids, self.labels, self.position_ids = buf(capacity), buf(capacity), buf(capacity)
        self.row_owner = buf(capacity)
        self.cu_seqlens = buf(capacity + 1, torch.int32)
        self.label_rows = buf(capacity)
        self.denominators = buf(num_adapters, torch.float32)

    def load(self, mb: Microbatch, denominators: torch.Tensor) -> None:
        """Copy ``mb`` in (stream-ordered device copies and fills; no host sync)."""
        cap = self.capacity
        if mb.capacity != cap:
            raise ValueError(f"a capacity-{mb.capacity} microbatch in capacity-{cap} buffers")
        self.input_ids.copy_(mb.input_ids, non_blocking=True)
        self.labels.copy_(mb.labels, non_blocking=True)
        self.position_ids.copy_(mb.position_ids, non_blocking=True)
        n = mb.cu_seqlens.shape[0]
        self.cu_seqlens[:n].copy_(mb.cu_seqlens, non_blocking=True)
        self.cu_seqlens[n:].fill_(cap)
        rows = mb.num_label_rows
        self.label_rows[:rows].copy_(mb.label_rows, non_blocking=True)
        self.label_rows[rows:].fill_(cap - 1)
        self.row_owner.fill_(self.num_adapters)
        for start, end, adapter in mb.segments:
            self.row_owner[start:end].fill_(adapter)
        self.denominators.copy_(denominators, non_blocking=True)


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    sums: torch.Tensor  # the graph's output [A] fp32, inside its memory pool
    input_grad: torch.Tensor | None = None  # gradient w.r.t. the stage input, in the pool


class TrainingGraphs:
    """Forward + backward of training microbatches as CUDA graphs over ``params`` (frozen) and
    ``bank`` (an ``AdapterBank``; its parameters' ``.grad`` accumulate).

    ``step(mb, denominators)`` returns the per-adapter loss sums ``[A]`` fp32 (a fresh tensor)
    after accumulating the gradients of ``adapter_loss(sums, denominators)``, or None when this
    microbatch must take the caller's eager step (reason in ``refusals`` and the log).
    ``capture=False`` runs the same fixed-shape step without graphs (CPU tests of the logic).
    ``lm_head_loss``: the LM-head loss the step holds (``decoder.head_loss_sums``: "checkpointed"
    or "fused"), the module's option.
    """

    def __init__(self, *, params: Mapping[str, Any], bank, config: DecoderConfig,
                 checkpoint_layers: bool | int = False, chunk_size: int = 1024,
                 lm_head_loss: str = "checkpointed",
                 max_graphs: int = MAX_GRAPHS, capture: bool = True,
                 options: DecoderOptions = DEFAULT_OPTIONS, layers: range | None = None,
                 is_first: bool = True, activation_dtype: torch.dtype | None = None,
                 capture_after: int = CAPTURE_AFTER, max_precapture: int = DEFAULT_PRECAPTURE,
                 memory: CaptureMemory = DEFAULT_CAPTURE_MEMORY, accumulate_grads: bool = True) -> None:
        self.params, self.bank, self.config, self.options = params, bank, config, options
        self.memory = memory
        # the fused kernels add each projection group's factor gradients into their static
        # ``.grad`` in one launch (``LoraRouting.accumulate_grads``); False: autograd's add per factor
        self.accumulate_grads = accumulate_grads
        # a pipeline's last stage: these layers (then norm, head, loss), its input from the
        # previous stage unless ``is_first`` (then the embedding); ``input_grad`` after a step
        self.layers = range(config.num_layers) if layers is None else layers
        self.is_first = is_first
        self.activation_dtype = activation_dtype
        self.input_grad: torch.Tensor | None = None
        self._activation: dict[int, torch.Tensor] = {}
        self.checkpoint_layers, self.chunk_size = checkpoint_layers, chunk_size
        self.lm_head_loss = lm_head_loss
        self.max_graphs, self.capture = max_graphs, capture
        self.refusals: dict[Any, str] = {}
        self.disabled: str | None = None  # set after a failed capture: every later step is eager
        self.captures = self.replays = 0
        self.capture_seconds = 0.0
        self._graphs: dict[GraphKey, _Captured] = {}
        self._static_keys: set[GraphKey] = set()  # capture=False: the keys a graph would hold
        self._covered_uses: dict[GraphKey, int] = {}
        self.capture_after = capture_after
        self.max_precapture = max_precapture
        self.planned: frozenset[GraphKey] = frozenset()  # this epoch's keys (``precapture``)
        self.precaptures = 0
        self.precapture_seconds = 0.0
        self.covered_steps = 0  # steps replayed under a larger key's graph
        self._tables: dict[int, StaticLaunchTables] = {}
        self._inputs: dict[int, StaticInputs] = {}
        self._grads: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._pool = None
        self._mempool = None  # CaptureMemory.warm_in_pool: the pool made before the first warm-up
        self._side = None  # the warm-up stream

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @property
    def num_held(self) -> int:
        """Keys with a graph (without capture: keys a graph would hold)."""
        return len(self._held())

    def step(self, mb: Microbatch, denominators: torch.Tensor,
             stage_input: torch.Tensor | None = None) -> torch.Tensor | None:
        self.input_grad = None
        if (stage_input is None) != self.is_first:
            raise ValueError("a stage's graphs take the previous stage's output exactly when the stage "
                             f"is not the first (is_first={self.is_first})")
        if self.disabled is not None:
            return None
        try:
            key = graph_key(mb)
        except ValueError as e:
            self._refuse("metadata", str(e))
            return None
        if key in self.refusals:
            return None
        key = self._choose(key)
        captured = self._graphs.get(key)
        if captured is None and self.capture and len(self._graphs) >= self.max_graphs:
            self._refuse(key, f"{self.max_graphs} shape keys are captured already; this one runs eagerly")
            return None
        tables, inputs = self._buffers(mb.capacity, mb.input_ids.device)
        self._bind_grads()
        tables.fill(mb.segments, mb.index)
        inputs.load(mb, denominators)
        if stage_input is not None:
            with torch.no_grad():
                self._activation_buffer(mb.capacity, stage_input).copy_(stage_input)
        if captured is not None:
            captured.graph.replay()
            self.replays += 1
            if captured.input_grad is not None:
                self.input_grad = captured.input_grad.clone()
            return captured.sums.clone()
        if not self.capture:
            self._static_keys.add(key)
            sums = self._run_static(key, inputs, tables)
            self.input_grad = self._take_input_grad(key.capacity)
            return sums
        return self._warm_up_and_capture(key, inputs, tables)

    def precapture(self, planned, device: torch.device) -> list[GraphKey]:
        """Capture, before an epoch's first step, graphs covering every one of ``planned`` (the
        epoch's keys; a mapping: with their number of microbatches): ``plan_captures`` picks at
        most ``max_precapture`` keys, captured in one ``capture_batch``. A planned key then
        replays its cover for the whole epoch (no capture of its own, ``capture_after`` is for
        keys not planned). An epoch of more capacities than ``max_precapture`` (runs without a
        pipeline pack at a few) gets one graph per capacity. Each capture's
        warm-up step runs an idle microbatch (``idle_microbatch``: no label, zero loss
        denominators), so no gradient changes. Without capture the keys are
        only marked as held (CPU tests). Returns the keys captured."""
        self.planned = frozenset(planned)
        if self.disabled is not None:
            return []
        # one graph per capacity at least: a capacity left out would be captured mid-epoch
        limit = max(self.max_precapture, len({k.capacity for k in planned})) if self.max_precapture else 0
        room = max(0, self.max_graphs - len(self._graphs)) if self.capture else limit
        keys = plan_captures(planned, self._held(), limit=min(limit, room))
        if self.memory.largest_first:
            keys.sort(key=capture_size, reverse=True)
        done: list[GraphKey] = []
        if not keys:  # nothing to capture: no collection, device sync or cache release either
            return done
        t0 = time.perf_counter()
        with capture_batch(device) if self.capture else contextlib.nullcontext():
            for key in keys:
                if self.disabled is None and self._idle_step(key, device):
                    done.append(key)
            if self.capture and done:  # the warm-ups' backward transients (see CaptureMemory)
                release_cache(device)
        self.input_grad = None
        seconds = time.perf_counter() - t0
        self.precaptures += len(done)
        self.precapture_seconds += seconds
        return done

    def _idle_step(self, key: GraphKey, device: torch.device) -> bool:
        """Warm up and capture ``key`` on an idle microbatch; False when none fits the key."""
        mb = idle_microbatch(key, self.bank.num_adapters, device)
        if mb is None:
            log.info("CUDA graphs: %s has no idle layout (fewer blocks than capacity / max_seqlen); "
                     "it is captured on first use", key)
            return False
        tables, inputs = self._buffers(key.capacity, device)
        self._bind_grads()
        tables.fill(mb.segments, mb.index)
        inputs.load(mb, mb.loss_denominators)
        if not self.is_first:
            hidden = (key.capacity, self.config.hidden_size)
            with torch.no_grad():
                self._activation_buffer(key.capacity, torch.zeros(hidden, device=device)).zero_()
        if not self.capture:
            self._run_static(key, inputs, tables)
            self._take_input_grad(key.capacity)
            self._static_keys.add(key)
            return True
        self._warm_up_and_capture(key, inputs, tables, up_front=True)
        return key in self._graphs

    # ------------------------------------------------------------------ internals
    def _covering(self, key: GraphKey) -> GraphKey | None:
        """The cheapest key already captured that covers ``key`` (same capacity, every bucket at
        least as large), or None. Padding up is exact: the static buffers hold empty attention
        blocks and label rows without a label past the microbatch's own."""
        return cheapest_cover(key, self._held())

    def _held(self):
        """The keys that have a graph (without capture: that a graph would hold)."""
        return self._graphs.keys() if self.capture else self._static_keys

    def _choose(self, key: GraphKey) -> GraphKey:
        """The key this step runs under: its own graph when captured; else a covering graph
        until the key has come ``capture_after`` times (a capture, ~1 s on the 8B shape, is
        worth hundreds of covered steps: those only compute a few extra LM-head rows), then
        its own capture."""
        if key in self._graphs or key in self._static_keys:
            return key
        cover = self._covering(key)
        if cover is None:
            return key
        if key in self.planned:  # the epoch's captures were chosen for it: never its own mid-epoch
            self.covered_steps += 1
            return cover
        uses = self._covered_uses.get(key, 0) + 1
        self._covered_uses[key] = uses
        if uses > self.capture_after and len(self._graphs) < self.max_graphs:
            return key
        self.covered_steps += 1
        return cover

    def _refuse(self, key, reason: str) -> None:
        if key not in self.refusals:
            log.warning("CUDA graphs: %s runs eagerly: %s", key, reason)
        self.refusals[key] = reason

    def _buffers(self, capacity: int, device: torch.device) -> tuple[StaticLaunchTables, StaticInputs]:
        if capacity not in self._tables:
            template = self.bank.routing((), 0, capacity, train=True)
            self._tables[capacity] = StaticLaunchTables(template, device)
            self._inputs[capacity] = StaticInputs(capacity, self.bank.num_adapters, device)
        return self._tables[capacity], self._inputs[capacity]

    def _activation_buffer(self, capacity: int, like: torch.Tensor) -> torch.Tensor:
        """The static stage input ``[capacity, hidden]`` (a leaf requiring grad)."""
        if capacity not in self._activation:
            dtype = self.activation_dtype or like.dtype
            self._activation[capacity] = torch.zeros(tuple(like.shape), dtype=dtype, device=like.device,
                                                     requires_grad=True)
        return self._activation[capacity]

    def _take_input_grad(self, capacity: int) -> torch.Tensor | None:
        """The gradient the last step left on the static input (then detached from it)."""
        x = self._activation.get(capacity)
        if self.is_first or x is None:
            return None
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        x.grad = None
        return grad

    def _stage_parameters(self) -> list[torch.nn.Parameter]:
        """Every adapter's parameters on this stage's layers (the ones a step gives gradients)."""
        return [p for a in range(self.bank.num_adapters) for layer in self.layers
                for p in self.bank.adapters[a][layer].parameters()]

    def _bind_grads(self) -> None:
        """Every adapter parameter's ``.grad`` is its static tensor (the graphs add into it):
        one set to None since is zeroed, one replaced (a restored checkpoint) is copied in."""
        if not self._grads:
            for p in self._stage_parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._grads.append((p, p.grad))
            return
        stale = [(p, g) for p, g in self._grads if p.grad is not g]
        if not stale:
            return
        zero = [g for p, g in stale if p.grad is None]
        if zero:
            torch._foreach_zero_(zero)
        for p, g in stale:
            if p.grad is not None:
                g.copy_(p.grad)
            p.grad = g

    def _run_static(self, key: GraphKey, inputs: StaticInputs, tables: StaticLaunchTables) -> torch.Tensor:
        """The step a graph holds: forward over the static buffers, backward, loss sums [A]."""
        # microbatch 0, no segments: the fused kernels find their fixed-shape tables in the cache
        # (and DoRA reads each row's adapter from the static row_owner)
        routing = dataclasses.replace(self.bank.routing((), 0, key.capacity, train=True),
                                      launch_cache=tables.cache, row_owner=inputs.row_owner,
                                      accumulate_grads=self.accumulate_grads)
        h = embed(self.params, inputs.input_ids) if self.is_first else self._activation[key.capacity]
        h = decoder_layers(self.params, self.bank.view(self.layers), h, inputs.position_ids,
                           inputs.cu_seqlens[: key.num_blocks + 1], routing, config=self.config,
                           layers=self.layers, microbatch_index=0, backend="triton",
                           max_seqlen=key.max_seqlen, checkpoint_layers=self.checkpoint_layers,
                           options=self.options)
        sums = head_loss_sums(self.params, h, inputs.labels, (), self.bank.num_adapters, config=self.config,
                              chunk_size=self.chunk_size, label_rows=inputs.label_rows[: key.label_rows],
                              row_owner=inputs.row_owner, lm_head_loss=self.lm_head_loss)
        loss = adapter_loss(sums, inputs.denominators)
        if loss.requires_grad:
            loss.backward()
        return sums.detach()

    def _warm_up_and_capture(self, key: GraphKey, inputs: StaticInputs, tables: StaticLaunchTables,
                             up_front: bool = False) -> torch.Tensor | None:
        t0 = time.perf_counter()
        main = torch.cuda.current_stream()
        if self._side is None:
            self._side = torch.cuda.Stream(device=main.device)
        side = self._side
        side.wait_stream(main)
        try:
            # this microbatch's real step, eager: it compiles and warms up. Once graphs exist it
            # allocates from their pool, so its activations reuse the graphs' intermediate memory
            # instead of needing as much again (the 8B shape at capacity 8192 does not fit twice
            # on an 80 GB GPU)
            if self._pool is None and self.memory.warm_in_pool:
                # a MemPool holds a reference to its pool: a bare handle's pool is dropped when
                # the warm-up's routing ends (before any graph holds it)
                self._mempool = torch.cuda.MemPool()
                self._pool = self._mempool.id
            pool = self._pool
            tables.allocation_context = lambda: outside_pool(pool, main.device)
            try:
                with torch.cuda.stream(side), allocating_from(pool, main.device):
                    sums = self._run_static(key, inputs, tables)
            finally:
                tables.allocation_context = contextlib.nullcontext
            with torch.cuda.stream(side):
                sums = sums.clone()  # out of the pool: a later replay may reuse its memory
                grad = self._take_input_grad(key.capacity)
                self.input_grad = None if grad is None else grad.clone()
        except StaticTableError as e:  # raised in the forward, before any gradient was touched
            main.wait_stream(side)
            self.disabled = f"launch tables: {e}"
            self._refuse(key, self.disabled)
            return None
        main.wait_stream(side)
        if pool is None or self.memory.release:
            # the first warm-up's activations sit in the allocator's cache (unless it ran in the
            # pool); hand them back so the graphs' private pool can take that memory
            release_cache(main.device)
        if tables.num_tables == 0:
            self.disabled = "the fused LoRA kernels did not take the fixed-shape launch tables"
            self._refuse(key, self.disabled)
            return sums
        graph = torch.cuda.CUDAGraph()
        tables.freeze()
        try:
            with graph_capture(graph, pool=self._pool, stream=side, device=main.device):
                out = self._run_static(key, inputs, tables)
            input_grad = self._take_input_grad(key.capacity)  # inside the graph's pool
        except Exception as e:  # noqa: BLE001 - any capture failure means: train eagerly
            self.disabled = f"capture failed: {type(e).__name__}: {e}"
            self._refuse(key, self.disabled)
            return sums
        finally:
            tables.freeze(False)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[key] = _Captured(graph=graph, sums=out, input_grad=input_grad)
        self.captures += 1
        if not up_front:  # the warm-up's backward transients (CaptureMemory); a precapture releases once
            release_cache(main.device)
        seconds = time.perf_counter() - t0
        self.capture_seconds += seconds
        log.info("CUDA graphs: captured %s%s in %.2f s (%d graphs)", key, " up front" if up_front else "",
                 seconds, len(self._graphs))
        return sums

