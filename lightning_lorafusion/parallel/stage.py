"""A pipeline stage of the functional decoder: its slice of layers behind the executor's interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch

from ..data.microbatch import Microbatch
from ..model import decoder as dec


class StageModule(Protocol):
    """What ``run_stage`` needs from a stage.

    ``forward(stage_input, microbatch)``: ``stage_input`` is None on the first stage (it reads
    its microbatch's token ids itself) and the previous stage's output ``[capacity, hidden]``
    (requiring grad) elsewhere. Returns ``[capacity, hidden]``, or on the last stage the scalar
    to call backward on: the sum over present adapters of each adapter's loss normalised by
    its global batch's label tokens.
    """

    def forward(self, stage_input: torch.Tensor | None, microbatch: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class FusedStep:
    """A microbatch's forward and backward done in one call: the gradient w.r.t. the stage's
    input (None on the first stage), to send upstream."""

    input_grad: torch.Tensor | None


def adapter_loss(loss_sums: torch.Tensor, denominators: torch.Tensor) -> torch.Tensor:
    """``sum_a loss_sums[a] / denominators[a]`` over adapters present (denominator > 0): each
    adapter's gradient is that of its own mean loss over its whole global batch."""
    # masked arithmetic, not boolean indexing: no nonzero() sync, and a CUDA graph can hold it
    present = denominators > 0
    per_adapter = loss_sums / denominators.to(loss_sums.dtype).clamp_min(1)
    return torch.where(present, per_adapter, torch.zeros_like(per_adapter)).sum()


@dataclass(frozen=True, kw_only=True)
class DecoderStage:
    """Layers ``layers`` of the functional decoder (plus embedding on stage 0, norm + head + loss
    on the last stage) over the frozen ``params`` and the adapters in ``bank``.

    ``microbatches(i)`` returns plan microbatch ``i`` as tensors on the stage's device.
    """

    params: Mapping[str, Any]
    bank: Any  # AdapterBank
    config: dec.DecoderConfig
    layers: range
    is_first: bool
    is_last: bool
    microbatches: Callable[[int], Microbatch]
    backend: str = "torch"
    train: bool = True
    checkpoint_layers: bool | int = False  # activation checkpointing (decoder.decoder_layers)
    lm_head_loss: str = "checkpointed"  # last stage: decoder.head_loss_sums' LM-head loss
    options: dec.DecoderOptions = dec.DEFAULT_OPTIONS  # how the layers compute (fusion, FP8 accumulation)
    # last stage: called with (microbatch, per-adapter summed losses [num_adapters], detached)
    # for logging; the loss to backward is unaffected
    on_loss_sums: Callable[[int, torch.Tensor], None] | None = None
    # last stage: forward + backward of a microbatch as one captured step (training.cuda_graphs.
    # TrainingGraphs over these layers): ``step(mb, denominators, stage_input)`` -> loss sums
    # [num_adapters] or None (run eagerly), the input's gradient in ``input_grad``. Other stages:
    # forward and backward captured apart per in-flight slot (training.stage_graphs.
    # SplitStageGraphs): ``forward(mb, stage_input, slot)`` -> output or None, ``backward(slot,
    # grad)`` -> the input's gradient
    graphs: Any = None

    def fused_step(self, stage_input: torch.Tensor | None, microbatch: int) -> FusedStep | None:
        """Forward and backward of ``microbatch`` through ``graphs`` (last stage only); None when
        there are none or they refuse it (the executor then runs ``forward`` and backward)."""
        if self.graphs is None or not self.is_last:
            return None
        mb = self.microbatches(microbatch)
        sums = self.graphs.step(mb, mb.loss_denominators, stage_input=stage_input)
        if sums is None:
            return None
        if self.on_loss_sums is not None:
            self.on_loss_sums(microbatch, sums)
        return FusedStep(input_grad=None if self.is_first else self.graphs.input_grad)

    def graphed_forward(self, stage_input: torch.Tensor | None, microbatch: int,
                        slot: int) -> torch.Tensor | None:
        """The forward of ``microbatch`` replayed in in-flight ``slot`` of ``graphs`` (a stage
        before the last): its output ``[capacity, hidden]`` (no autograd graph: the backward is
        ``graphed_backward`` of the same slot), or None (run ``forward`` eagerly)."""
        if self.graphs is None or self.is_last:
            return None
        return self.graphs.forward(self.microbatches(microbatch), stage_input, slot)

    def graphed_backward(self, microbatch: int, slot: int, grad: torch.Tensor) -> torch.Tensor | None:
        """The backward of the microbatch ``graphed_forward`` put in ``slot``, from ``grad`` (the
        gradient w.r.t. its output): the gradient w.r.t. the stage input (None on stage 0)."""
        return self.graphs.backward(slot, grad)

    def forward(self, stage_input: torch.Tensor | None, microbatch: int) -> torch.Tensor:
        mb = self.microbatches(microbatch)
        if self.is_first:
            h = dec.embed(self.params, mb.input_ids)
        else:
            if stage_input is None:
                raise ValueError("a stage other than the first needs the previous stage's output")
            h = stage_input
        routing = self.bank.routing(mb.segments, mb.index, mb.capacity, train=self.train)
        h = dec.decoder_layers(
            self.params, self.bank.view(self.layers), h, mb.position_ids, mb.cu_seqlens, routing,
            config=self.config, layers=self.layers, microbatch_index=mb.index, backend=self.backend,
            max_seqlen=mb.max_seqlen, checkpoint_layers=self.checkpoint_layers, options=self.options,
        )
        if not self.is_last:
            return h
        # every stage packs its microbatches on its host, so each has this metadata (no syncs)
        sums = dec.head_loss_sums(
            self.params, h, mb.labels, mb.segments, self.bank.num_adapters, config=self.config,
            label_rows=mb.label_rows, lm_head_loss=self.lm_head_loss,
        )
        if self.on_loss_sums is not None:
            self.on_loss_sums(microbatch, sums.detach())
        return adapter_loss(sums, mb.loss_denominators)
