"""Planner settings (a frozen config), the planner's error type and input validation."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Sequence

METHODS = ("greedy", "milp")
SOLVERS = ("auto", "highs", "cbc")

# Lengths as the planner takes them: lengths[adapter][global batch][sample] in tokens.
Lengths = Sequence[Sequence[Sequence[int]]]


class PlanningError(ValueError):
    """Input the planner cannot plan, or a plan that breaks a rule; the message says how to fix it."""


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """How to pack samples of many adapters into fixed-capacity microbatches.

    - ``capacity``: tokens per microbatch (after per-adapter padding).
    - ``pad_multiple``: each adapter's segment of a microbatch is padded to a multiple of it.
    - ``num_stages``: pipeline depth S; batch j+1 of an adapter starts at least S microbatches
      after batch j's step point.
    - ``method``: "greedy" (first-fit decreasing) or "milp" (two-stage MILP, warm-started
      from greedy and never worse than it).
    - ``time_limit``: wall-clock safety limit (s) per MILP solve. ``max_nodes`` is the
      deterministic budget: a MILP result is used only when proven optimal within it, so
      plans do not depend on machine speed unless ``time_limit`` itself is hit.
    - ``neighbourhood``: the MILP re-packs the samples of this many emptiest microbatches
      of a wave (see ``milp.pack_milp``); larger is slower and rarely proven optimal.
    - ``solver``: "auto" (HiGHS when highspy is installed, else CBC), "highs" or "cbc".
    - ``grouping``: stagger adapters into head-tail groups (False: one group of all).
    - ``merge``: pull samples of later global batches into underfilled microbatches.
    - ``knapsack``: also build the window microbatch by microbatch with exact padded
      knapsacks (``knapsack.pack_in_order``, one trial per feasible grouping, and with S > 1
      a second, staggered one) and keep that plan when it is shorter than the wave packers'
      (greedy / MILP + merge).
    - ``seed``: passed to the MILP solver; planning is deterministic for a given seed.
    """

    capacity: int
    pad_multiple: int = 1
    num_stages: int = 1
    method: str = "greedy"
    time_limit: float = 20.0
    max_nodes: int = 200
    neighbourhood: int = 3
    solver: str = "auto"
    grouping: bool = True
    merge: bool = True
    knapsack: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("capacity", "pad_multiple", "num_stages", "max_nodes", "neighbourhood"):
            value = getattr(self, name)
            if isinstance(value, Integral) and not isinstance(value, bool):
                object.__setattr__(self, name, int(value))  # accept numpy integers
        if not isinstance(self.capacity, int) or self.capacity < 1:
            raise PlanningError(f"capacity={self.capacity!r} must be a positive int (tokens per microbatch)")
        if not isinstance(self.pad_multiple, int) or self.pad_multiple < 1:
            raise PlanningError(f"pad_multiple={self.pad_multiple!r} must be a positive int")
        if self.capacity % self.pad_multiple:
            raise PlanningError(
                f"capacity={self.capacity} must be a multiple of pad_multiple={self.pad_multiple}"
            )
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise PlanningError(f"num_stages={self.num_stages!r} must be an int >= 1")
        if self.method not in METHODS:
            raise PlanningError(f"method={self.method!r}; allowed: {list(METHODS)}")
        if self.solver not in SOLVERS:
            raise PlanningError(f"solver={self.solver!r}; allowed: {list(SOLVERS)}")
        if not self.time_limit > 0:
            raise PlanningError(f"time_limit={self.time_limit!r} must be > 0 seconds")
        if not isinstance(self.neighbourhood, int) or self.neighbourhood < 2:
            raise PlanningError(f"neighbourhood={self.neighbourhood!r} must be an int >= 2")
        if not isinstance(self.max_nodes, int) or self.max_nodes < 1:
            raise PlanningError(f"max_nodes={self.max_nodes!r} must be an int >= 1")


def validate_lengths(lengths: Lengths, config: PlannerConfig) -> None:
    """Raise PlanningError on malformed lengths or on a sample that cannot fit any microbatch."""
    from .plan import padded_length

    if len(lengths) == 0:
        raise PlanningError("lengths is empty: give one list of global batches per adapter")
    for a, batches in enumerate(lengths):
        for j, batch in enumerate(batches):
            if len(batch) == 0:
                raise PlanningError(f"adapter {a}, global batch {j} has no samples")
            for i, n in enumerate(batch):
                if isinstance(n, bool) or int(n) != n or n < 1:
                    raise PlanningError(
                        f"adapter {a}, global batch {j}, sample {i}: length {n!r} must be an int >= 1"
                    )
                need = padded_length(int(n), config.pad_multiple)
                if need > config.capacity:
                    raise PlanningError(
                        f"adapter {a}, global batch {j}, sample {i} has {n} tokens "
                        f"({need} padded to pad_multiple={config.pad_multiple}) > capacity "
                        f"{config.capacity}: set data.capacity >= {need}, or truncate samples "
                        f"to at most {config.capacity} tokens"
                    )
