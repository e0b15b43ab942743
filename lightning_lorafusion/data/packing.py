"""Turn a planned microbatch (sample references) into fixed-capacity Microbatch tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..planner.plan import PlannedMicrobatch, SampleRef, padded_length
from .microbatch import IGNORE_INDEX, Microbatch


class SampleLookup:
    """Maps (adapter, global batch, index in batch) to a tokenized sample.

    ``batches[a][j]`` lists the dataset indices of adapter ``a``'s global batch ``j``;
    ``datasets[a]`` holds objects with ``input_ids`` and pre-shifted ``labels``.
    """

    def __init__(self, datasets: Sequence[Sequence], batches: Sequence[Sequence[Sequence[int]]]):
        self.datasets = datasets
        self.batches = batches

    def sample(self, ref: SampleRef):
        return self.datasets[ref.adapter][self.batches[ref.adapter][ref.batch][ref.index]]

    def label_tokens(self, adapter: int, batch: int) -> int:
        """Label (loss) tokens in adapter's whole global batch: the loss denominator."""
        ds = self.datasets[adapter]
        return sum(
            sum(1 for t in ds[i].labels if t != IGNORE_INDEX) for i in self.batches[adapter][batch]
        )

    def denominators(self) -> dict[tuple[int, int], int]:
        """``label_tokens`` of every (adapter, global batch): what ``pack_microbatch`` takes."""
        return {(a, j): self.label_tokens(a, j) for a in range(len(self.batches)) for j in range(len(self.batches[a]))}

    def lengths(self) -> list[list[list[int]]]:
        """Token lengths of every sample, per adapter and global batch: the planner's input."""
        return [[[len(self.datasets[a][i].input_ids) for i in batch] for batch in self.batches[a]]
                for a in range(len(self.batches))]


@dataclass(frozen=True, kw_only=True)
class PackingConfig:
    """Fixed microbatch shape: ``capacity`` tokens, adapter segments padded to ``pad_multiple``."""

    capacity: int
    pad_multiple: int = 1
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity={self.capacity} must be >= 1")
        if self.pad_multiple < 1 or self.capacity % self.pad_multiple:
            raise ValueError(
                f"pad_multiple={self.pad_multiple} must be >= 1 and divide capacity={self.capacity}"
            )


def pack_microbatch(
    planned: PlannedMicrobatch,
    lookup: SampleLookup,
    *,
    config: PackingConfig,
    num_adapters: int,
    denominators: Mapping[tuple[int, int], int],
    step_adapters: tuple[int, ...],
    index: int,
) -> Microbatch:
    """Lay samples out adapter by adapter: ``[a0 samples | pad][a1 samples | pad] ... [pad]``.

    Every sample and every padding run is its own attention block in ``cu_seqlens``; position
    ids restart at 0 per sample. ``denominators[(a, j)]`` is the label-token count of adapter
    a's global batch j. The host metadata ``max_seqlen`` (longest block) and ``label_rows``
    (rows with a label) are filled here, so the step needs no device->host sync for them.
    """
    cap = config.capacity
    input_ids = torch.full((cap,), config.pad_token_id, dtype=torch.long)
    labels = torch.full((cap,), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(cap, dtype=torch.long)
    boundaries = [0]
    segments: list[tuple[int, int, int]] = []
    dens = torch.zeros(num_adapters, dtype=torch.float32)
    cursor = 0
    by_adapter: dict[int, list[SampleRef]] = {}
    for ref in planned.samples:
        by_adapter.setdefault(ref.adapter, []).append(ref)
    for adapter in sorted(by_adapter):
        start = cursor
        batch = None
        for ref in by_adapter[adapter]:
            sample = lookup.sample(ref)
            n = len(sample.input_ids)
            if n != ref.length:
                raise ValueError(f"plan says {ref} has {ref.length} tokens; the sample has {n}")
            if cursor + n > cap:
                raise ValueError(f"microbatch {index} overflows capacity {cap} at {ref}")
            input_ids[cursor : cursor + n] = torch.as_tensor(sample.input_ids, dtype=torch.long)
            labels[cursor : cursor + n] = torch.as_tensor(sample.labels, dtype=torch.long)
            position_ids[cursor : cursor + n] = torch.arange(n)
            cursor += n
            boundaries.append(cursor)
            if batch is not None and batch != ref.batch:
                raise ValueError(
                    f"microbatch {index} holds two global batches ({batch}, {ref.batch}) of adapter "
                    f"{adapter}; the bubble lemma forbids that"
                )
            batch = ref.batch
        end = start + padded_length(cursor - start, config.pad_multiple)
        if end > cap:
            raise ValueError(f"microbatch {index}: adapter {adapter}'s padded segment exceeds {cap}")
        if end > cursor:  # padding of this segment: its own attention block
            position_ids[cursor:end] = torch.arange(end - cursor)
            cursor = end
            boundaries.append(cursor)
        segments.append((start, end, adapter))
        dens[adapter] = float(denominators[(adapter, batch)])
    if cursor < cap:
        position_ids[cursor:cap] = torch.arange(cap - cursor)
        boundaries.append(cap)
    return Microbatch(
        input_ids=input_ids,
        labels=labels,
        position_ids=position_ids,
        cu_seqlens=torch.tensor(boundaries, dtype=torch.int32),
        segments=tuple(segments),
        samples=tuple(planned.samples),
        loss_denominators=dens,
        step_adapters=step_adapters,
        index=index,
        max_seqlen=max(b - a for a, b in zip(boundaries, boundaries[1:])),
        label_rows=(labels != IGNORE_INDEX).nonzero().squeeze(1),  # host tensor: no device sync
    )
