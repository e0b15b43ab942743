"""The Microbatch contract: one packed, fixed-capacity tensor set plus its adapter routing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..planner.plan import SampleRef
from ..specs import IGNORE_INDEX  # noqa: F401  (the data contract's name for it)


@dataclass
class Microbatch:
    """At most ``capacity`` tokens of several samples (tensors are exactly ``[capacity]``).

    - ``input_ids``, ``labels`` (IGNORE_INDEX on prompt and padding), ``position_ids``
      (restart at 0 for every sample) : ``[capacity]`` int64.
    - ``cu_seqlens`` ``[n_seqs + 1]`` int32: boundaries of attention blocks; padding forms
      blocks of its own so no real token attends to it.
    - ``segments``: ``(start, end, adapter)`` contiguous row ranges per adapter present, each
      padded to the kernel block multiple; adapter indexes the AdapterBank.
    - ``samples``: which (adapter, global batch, index) each packed sample is.
    - ``loss_denominators`` ``[n_adapters]`` float: label tokens of each present adapter's
      whole global batch (0 for absent adapters), so per-adapter loss is a mean over the
      global batch however it was split across microbatches.
    - ``step_adapters``: adapters whose global batch completes with this microbatch.
    - ``index``: running microbatch counter (dropout offsets derive from it).
    - ``max_seqlen``: host int, the longest attention block in ``cu_seqlens`` (padding blocks
      included); None if unknown. Spares varlen attention a device->host sync.
    - ``label_rows`` ``[num_label_rows]`` int64: the rows whose label is not IGNORE_INDEX, in
      order; built on the host at packing and moved with the batch, so the LM head needs no
      ``nonzero()`` sync. None if unknown.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]
    samples: tuple[SampleRef, ...]
    loss_denominators: torch.Tensor
    step_adapters: tuple[int, ...]
    index: int = 0
    max_seqlen: int | None = None
    label_rows: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def real_tokens(self) -> int:
        return sum(s.length for s in self.samples)

    @property
    def num_label_rows(self) -> int | None:
        """Tokens with a label (a host int: the shape of ``label_rows``), None if unknown."""
        return None if self.label_rows is None else int(self.label_rows.shape[0])

    def adapters(self) -> tuple[int, ...]:
        return tuple(sorted({a for _, _, a in self.segments}))

    def to(self, device: torch.device | str) -> "Microbatch":
        return Microbatch(
            input_ids=self.input_ids.to(device, non_blocking=True),
            labels=self.labels.to(device, non_blocking=True),
            position_ids=self.position_ids.to(device, non_blocking=True),
            cu_seqlens=self.cu_seqlens.to(device, non_blocking=True),
            segments=self.segments,
            samples=self.samples,
            loss_denominators=self.loss_denominators.to(device, non_blocking=True),
            step_adapters=self.step_adapters,
            index=self.index,
            max_seqlen=self.max_seqlen,
            label_rows=None if self.label_rows is None else self.label_rows.to(device, non_blocking=True),
        )
