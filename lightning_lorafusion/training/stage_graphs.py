"""CUDA graphs of a pipeline stage whose forward and backward of a microbatch are apart.

On every stage but the last, 1F1B keeps several microbatches between their forward and their
backward (at most ``pipeline_size - stage_index``). Each of those in-flight places is a slot
(``parallel.schedule.slot_assignment`` gives every microbatch of an action list its slot: taken
at its forward, freed at its backward). A slot owns its static inputs (``StaticInputs``, launch
tables, the received activation ``[capacity, hidden]`` on a stage after the first), its static
incoming gradient ``[capacity, hidden]``, one memory pool, and two graphs of one shape key: the
forward (its output and saved activations stay in the slot's pool, so the other slots' replays
cannot overwrite them) and the backward from the static incoming gradient (what
``torch.cuda.make_graphed_callables`` splits, here over the functional decoder, with the adapter
gradients accumulating into the same static ``.grad`` tensors as ``TrainingGraphs``).

A stage computes no LM head, so the label-row bucket does not matter (``stage_key``): one key per
slot, the join of the epoch's keys (``precapture``), covers every microbatch; a microbatch it does
not cover gets a new capture of the join (the slot's old graphs are released first, so a slot
never holds two sets of saved activations). Each capture warms up on an idle microbatch whose
backward takes a zero gradient (exact zeros accumulated), so captures can happen at any time.
What cannot be captured runs eagerly with the reason logged (``refusals``).

The warm-up allocates from the eager allocator (no pool routing) and its cached blocks are handed
back before the capture (``graph_pool.release_cache``); the captures allocate from the slot's pool
by stream, which takes the backward's allocations on autograd's device thread too. So nothing of
a capture stays cached in the eager allocator, unlike a warm-up routed to a pool by thread, whose
backward escapes the routing (``cuda_graphs.CaptureMemory``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..capture import capture_batch, graph_capture
from ..data.microbatch import Microbatch
from ..kernels.static_routing import StaticLaunchTables, StaticTableError
from ..model.decoder import decoder_layers, embed
from .cuda_graphs import StaticInputs, TrainingGraphs, graph_key, idle_microbatch
from .graph_pool import release_cache
from .graph_cover import GraphKey, covers, join

log = logging.getLogger(__name__)


def stage_key(mb: Microbatch) -> GraphKey:
    """``graph_key`` without the LM head's bucket (a stage before the last computes no head)."""
    return dataclasses.replace(graph_key(mb), label_rows=0)


@dataclass
class _Slot:
    """One in-flight place of a stage: its buffers, pool and the graphs of its one key."""

    tables: StaticLaunchTables
    inputs: StaticInputs
    activation: torch.Tensor | None  # the received stage input (leaf requiring grad), or None
    grad_out: torch.Tensor | None = None  # the incoming gradient w.r.t. the output
    pool: Any = None
    key: GraphKey | None = None  # the key its graphs hold
    forward: Any = None  # torch.cuda.CUDAGraph
    backward: Any = None
    output: torch.Tensor | None = None  # [capacity, hidden], graph attached (in the pool)
    input_grad: torch.Tensor | None = None  # gradient w.r.t. ``activation`` (in the pool)
    microbatch: int | None = None  # the microbatch in flight (None: free)


class SplitStageGraphs(TrainingGraphs):
    """Forward and backward of a stage that is not the last, as separate CUDA graphs per slot.

    ``forward(mb, stage_input, slot)`` returns the stage's output ``[capacity, hidden]`` (the
    slot's static buffer, detached: send it, do not keep it past the slot's backward) or None
    (run this microbatch eagerly); ``backward(slot, grad)`` accumulates the adapter gradients
    and returns the gradient w.r.t. the stage input (a fresh tensor; None on the first stage).
    ``capture=False`` runs the same fixed-shape steps without graphs (CPU tests of the logic).
    ``step`` (the fused step of ``TrainingGraphs``) does not apply.
    """

    def __init__(self, *, slots: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots={slots!r} must be an int >= 1 (microbatches in flight on the stage)")
        self.num_slots = slots
        self._slots: list[_Slot | None] = [None] * slots
        self.forward_replays = self.backward_replays = 0
        self.graphed_forwards = self.graphed_backwards = 0  # with or without capture
        self.eager_microbatches = 0  # forwards that returned None (run eagerly by the caller)

    @property
    def num_graphs(self) -> int:
        return sum(2 for s in self._slots if s is not None and s.forward is not None)

    def _held(self):
        return {s.key for s in self._slots if s is not None and s.key is not None}

    def step(self, mb, denominators, stage_input=None):
        raise TypeError("SplitStageGraphs runs a stage's forward and backward apart: use forward/backward")

    # ------------------------------------------------------------------ per microbatch
    def forward(self, mb: Microbatch, stage_input: torch.Tensor | None, slot: int) -> torch.Tensor | None:
        if (stage_input is None) != self.is_first:
            raise ValueError("a stage's graphs take the previous stage's output exactly when the stage "
                             f"is not the first (is_first={self.is_first})")
        if self.disabled is not None:
            self.eager_microbatches += 1
            return None
        if not 0 <= slot < self.num_slots:
            self._refuse(("slot", slot), f"slot {slot} is beyond the {self.num_slots} in-flight slots "
                                         "the stage's graphs hold; that microbatch runs eagerly")
            self.eager_microbatches += 1
            return None
        try:
            key = stage_key(mb)
        except ValueError as e:
            self._refuse("metadata", str(e))
            self.eager_microbatches += 1
            return None
        s = self._slot(slot, key.capacity, mb.input_ids.device)
        if s is None:
            self.eager_microbatches += 1
            return None
        if s.microbatch is not None:
            raise RuntimeError(f"slot {slot} still holds microbatch {s.microbatch}; a slot is freed by "
                               "its backward before the next forward takes it")
        if s.key is None or not covers(s.key, key):
            if not self._capture_slot(slot, join([key] if s.key is None else [s.key, key]), mb.input_ids.device):
                self.eager_microbatches += 1
                return None
        try:
            s.tables.fill(mb.segments, mb.index)
        except StaticTableError as e:
            self.disabled = f"launch tables: {e}"
            self._refuse(key, self.disabled)
            self.eager_microbatches += 1
            return None
        self._bind_grads()
        s.inputs.load(mb, mb.loss_denominators)
        if stage_input is not None:
            with torch.no_grad():
                s.activation.copy_(stage_input)
        if self.capture:
            s.forward.replay()
            self.forward_replays += 1
        else:
            # a graph's backward reads the weights as they are at its replay; so does this one
            # (saved tensors behind hooks are not version-checked): adapters absent from the
            # microbatch (the fixed-shape step computes them, with zero effect) may step while
            # it is in flight, present ones cannot (the bubble lemma)
            with torch.autograd.graph.saved_tensors_hooks(_same, _same):
                s.output = self._forward_static(s, s.key)
        s.microbatch = mb.index
        self.graphed_forwards += 1
        return s.output.detach()

    def backward(self, slot: int, grad: torch.Tensor) -> torch.Tensor | None:
        s = self._slots[slot] if 0 <= slot < self.num_slots else None
        if s is None or s.microbatch is None:
            raise RuntimeError(f"backward of slot {slot}, which no graphed forward holds")
        self._bind_grads()
        s.microbatch = None
        self.graphed_backwards += 1
        if self.capture:
            s.grad_out.copy_(grad)
            s.backward.replay()
            self.backward_replays += 1
            return None if s.input_grad is None else s.input_grad.clone()
        torch.autograd.backward(s.output, grad_tensors=grad)
        s.output = None
        return self._slot_input_grad(s)

    # ------------------------------------------------------------------ before an epoch
    def precapture(self, planned, device: torch.device) -> list[GraphKey]:
        """Every slot's graphs for the join of ``planned`` (the epoch's keys) per capacity, before
        the epoch's first step; a slot whose key covers it already keeps its graphs. Returns the
        keys captured (one per slot captured)."""
        self.planned = frozenset(planned)
        keys = [stage_key_of(k) for k in self.planned]
        if self.disabled is not None or not keys or self.max_precapture == 0:
            return []
        capacities = sorted({k.capacity for k in keys})
        if len(capacities) > 1:
            log.warning("CUDA graphs: the epoch plans capacities %s; stage graphs hold one (%d)",
                        capacities, capacities[-1])
        want = join(k for k in keys if k.capacity == capacities[-1])
        done: list[GraphKey] = []
        held = [s for s in self._slots if s is not None]
        if len(held) == self.num_slots and all(s.key is not None and covers(s.key, want) for s in held):
            return done  # every slot covers the epoch: no collection, device sync or cache release
        t0 = time.perf_counter()
        with capture_batch(device) if self.capture else contextlib.nullcontext():
            for slot in range(self.num_slots):
                s = self._slot(slot, want.capacity, device)
                if s is None or self.disabled is not None:
                    break
                if s.key is not None and covers(s.key, want):
                    continue
                target = want if s.key is None else join([s.key, want])
                if self._capture_slot(slot, target, device, up_front=True):
                    done.append(target)
        self.precaptures += len(done)
        self.precapture_seconds += time.perf_counter() - t0
        return done

    # ------------------------------------------------------------------ internals
    def _slot(self, slot: int, capacity: int, device: torch.device) -> _Slot | None:
        s = self._slots[slot]
        if s is None:
            template = self.bank.routing((), 0, capacity, train=True)
            activation = None
            if not self.is_first:
                dtype = self.activation_dtype or torch.float32
                activation = torch.zeros((capacity, self.config.hidden_size), dtype=dtype, device=device,
                                         requires_grad=True)
            s = self._slots[slot] = _Slot(tables=StaticLaunchTables(template, device),
                                          inputs=StaticInputs(capacity, self.bank.num_adapters, device),
                                          activation=activation)
        if s.inputs.capacity != capacity:
            self._refuse(("capacity", capacity), f"stage graphs hold capacity {s.inputs.capacity}; a "
                                                 f"capacity-{capacity} microbatch runs eagerly")
            return None
        return s

    def _forward_static(self, s: _Slot, key: GraphKey) -> torch.Tensor:
        """The forward a graph holds: the stage's layers over the slot's static buffers."""
        routing = dataclasses.replace(self.bank.routing((), 0, key.capacity, train=True),
                                      launch_cache=s.tables.cache, row_owner=s.inputs.row_owner)
        h = embed(self.params, s.inputs.input_ids) if self.is_first else s.activation
        return decoder_layers(self.params, self.bank.view(self.layers), h, s.inputs.position_ids,
                              s.inputs.cu_seqlens[: key.num_blocks + 1], routing, config=self.config,
                              layers=self.layers, microbatch_index=0, backend="triton",
                              max_seqlen=key.max_seqlen, checkpoint_layers=self.checkpoint_layers,
                              options=self.options)

    def _slot_input_grad(self, s: _Slot) -> torch.Tensor | None:
        if s.activation is None:
            return None
        grad = s.activation.grad if s.activation.grad is not None else torch.zeros_like(s.activation)
        s.activation.grad = None
        return grad

    def _release(self, s: _Slot, device: torch.device) -> None:
        """Drop a slot's graphs and their saved activations (the pool goes with them)."""
        had = s.forward is not None
        s.forward = s.backward = s.output = s.input_grad = None
        s.key, s.pool = None, None
        if had and self.capture:
            gc.collect()
            release_cache(device)

    def _capture_slot(self, slot: int, key: GraphKey, device: torch.device, up_front: bool = False) -> bool:
        """Warm up ``key`` on an idle microbatch in ``slot``'s buffers and capture its forward and
        backward (without capture: only mark the key held). False: the slot runs eagerly."""
        mb = idle_microbatch(key, self.bank.num_adapters, device)
        if mb is None:
            self._refuse(key, "no idle layout (fewer blocks than capacity / max_seqlen); runs eagerly")
            return False
        s = self._slots[slot]
        self._release(s, device)
        self._bind_grads()
        s.tables.fill(mb.segments, mb.index)
        s.inputs.load(mb, mb.loss_denominators)
        if s.activation is not None:
            with torch.no_grad():
                s.activation.zero_()
        if not self.capture:
            s.key = key
            return True
        t0 = time.perf_counter()
        try:
            self._graph_pair(s, key)
        except StaticTableError as e:
            self.disabled = f"launch tables: {e}"
        except Exception as e:  # noqa: BLE001 - any capture failure means: train eagerly
            self.disabled = f"capture failed: {type(e).__name__}: {e}"
        if self.disabled is not None:
            self._release(s, device)
            self._refuse(key, self.disabled)
            return False
        s.key = key
        self.captures += 1
        seconds = time.perf_counter() - t0
        self.capture_seconds += seconds
        log.info("CUDA graphs: captured %s%s in %.2f s (stage slot %d, forward and backward)", key,
                 " up front" if up_front else "", seconds, slot)
        return True

    def _graph_pair(self, s: _Slot, key: GraphKey) -> None:
        """Warm-up (forward, backward of a zero gradient: exact zeros accumulated), then the
        forward and the backward captured into the slot's own pool."""
        main = torch.cuda.current_stream()
        if self._side is None:
            self._side = torch.cuda.Stream(device=main.device)
        side = self._side
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out = self._forward_static(s, key)
            if out.requires_grad:
                torch.autograd.backward(out, grad_tensors=torch.zeros_like(out))
            self._slot_input_grad(s)
            del out
        main.wait_stream(side)
        release_cache(main.device)  # the warm-up's activations and backward transients, back for the slot's pool
        if s.tables.num_tables == 0:
            raise StaticTableError("the fused LoRA kernels did not take the fixed-shape launch tables")
        forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        s.tables.freeze()
        try:
            with graph_capture(forward, pool=None, stream=side, device=main.device):
                out = self._forward_static(s, key)
            s.pool = forward.pool()
            if s.grad_out is None or s.grad_out.shape != out.shape or s.grad_out.dtype != out.dtype:
                s.grad_out = torch.zeros(out.shape, dtype=out.dtype, device=out.device)
            with graph_capture(backward, pool=s.pool, stream=side, device=main.device):
                # without retain_graph (compiled pieces donate their buffers and refuse it, and
                # torch.cuda.make_graphed_callables does the same): the saved activations' memory
                # goes back to the slot's private pool, where no other graph is ever captured,
                # so only this backward's later kernels reuse it, after reading them, as they
                # will at every replay; each forward replay writes them again
                torch.autograd.backward(out, grad_tensors=s.grad_out)
            s.input_grad = self._slot_input_grad(s)
        finally:
            s.tables.freeze(False)
        s.forward, s.backward, s.output = forward, backward, out


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def stage_key_of(key: GraphKey) -> GraphKey:
    """A planned key as a stage before the last sees it (no LM-head bucket)."""
    return dataclasses.replace(key, label_rows=0)
