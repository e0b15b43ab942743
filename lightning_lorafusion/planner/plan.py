"""The Plan contract: ordered microbatches of samples from many adapters, plus step points.

Plans are plain data (JSON round-trip), produced by the planner and consumed by the data
module (which turns each planned microbatch into tensors) and the pipeline schedule builder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class SampleRef:
    """Sample ``index`` of adapter ``adapter``'s global batch ``batch``; ``length`` in tokens."""

    adapter: int
    batch: int
    index: int
    length: int


def padded_length(tokens: int, pad_multiple: int) -> int:
    """Tokens an adapter segment occupies once padded to the kernel block multiple."""
    return -(-tokens // pad_multiple) * pad_multiple


@dataclass(frozen=True)
class PlannedMicrobatch:
    """Samples of one microbatch, grouped by adapter (ascending); empty means a no-op slot."""

    samples: tuple[SampleRef, ...] = ()

    @property
    def is_noop(self) -> bool:
        return not self.samples

    def adapters(self) -> tuple[int, ...]:
        return tuple(sorted({s.adapter for s in self.samples}))

    def real_tokens(self) -> int:
        return sum(s.length for s in self.samples)

    def padded_tokens(self, pad_multiple: int) -> int:
        per_adapter: dict[int, int] = {}
        for s in self.samples:
            per_adapter[s.adapter] = per_adapter.get(s.adapter, 0) + s.length
        return sum(padded_length(t, pad_multiple) for t in per_adapter.values())


@dataclass(frozen=True)
class Plan:
    """Microbatches in execution order; ``step_points[(adapter, batch)]`` is the index of the
    microbatch after whose backward that adapter's global batch is complete (it steps)."""

    capacity: int
    pad_multiple: int
    num_stages: int
    microbatches: tuple[PlannedMicrobatch, ...]
    step_points: dict[tuple[int, int], int] = field(default_factory=dict)

    @staticmethod
    def compute_step_points(microbatches: tuple[PlannedMicrobatch, ...]) -> dict[tuple[int, int], int]:
        points: dict[tuple[int, int], int] = {}
        for i, mb in enumerate(microbatches):
            for s in mb.samples:
                points[(s.adapter, s.batch)] = i
        return points

    def step_adapters(self) -> dict[int, tuple[int, ...]]:
        """Microbatch position -> adapters (ascending) whose global batch completes there."""
        by_position: dict[int, list[int]] = {}
        for (adapter, _batch), position in self.step_points.items():
            by_position.setdefault(position, []).append(adapter)
        return {p: tuple(sorted(a)) for p, a in by_position.items()}

    def to_json(self) -> str:
        return json.dumps(
            {
                "capacity": self.capacity,
                "pad_multiple": self.pad_multiple,
                "num_stages": self.num_stages,
                "microbatches": [
                    [[s.adapter, s.batch, s.index, s.length] for s in mb.samples]
                    for mb in self.microbatches
                ],
                "step_points": [[a, b, i] for (a, b), i in sorted(self.step_points.items())],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        return cls(
            capacity=d["capacity"],
            pad_multiple=d["pad_multiple"],
            num_stages=d["num_stages"],
            microbatches=tuple(
                PlannedMicrobatch(tuple(SampleRef(*s) for s in mb)) for mb in d["microbatches"]
            ),
            step_points={(a, b): i for a, b, i in d["step_points"]},
        )
