"""Splitting the decoder's layers into contiguous pipeline stages balanced by a cost model."""

from __future__ import annotations

from typing import Any, Sequence


def partition_layers(
    num_layers: int,
    num_stages: int,
    *,
    layer_cost: float | Sequence[float] = 1.0,
    first_stage_extra: float = 0.0,
    last_stage_extra: float = 0.0,
) -> tuple[range, ...]:
    """Contiguous layer ranges, one per stage, that minimise the most expensive stage.

    Stage 0 also pays ``first_stage_extra`` (the embedding) and the last stage
    ``last_stage_extra`` (final norm, LM head and loss). Every stage gets at least one layer.
    Exact dynamic programme over split points; ties go to the earliest split.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    if num_layers < num_stages:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} pipeline stages; every stage "
            "needs at least one decoder layer: use fewer stages"
        )
    costs = [float(layer_cost)] * num_layers if isinstance(layer_cost, (int, float)) else [float(c) for c in layer_cost]
    if len(costs) != num_layers:
        raise ValueError(f"layer_cost has {len(costs)} entries for {num_layers} layers")
    if any(c < 0 for c in costs) or first_stage_extra < 0 or last_stage_extra < 0:
        raise ValueError("layer costs and stage extras must be >= 0")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(stage: int, start: int, end: int) -> float:
        extra = (first_stage_extra if stage == 0 else 0.0) + (
            last_stage_extra if stage == num_stages - 1 else 0.0
        )
        return prefix[end] - prefix[start] + extra

    inf = float("inf")
    # best[s][e]: least possible max cost of stages 0..s covering layers [0, e)
    best = [[inf] * (num_layers + 1) for _ in range(num_stages)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages)]
    for e in range(1, num_layers + 1):
        best[0][e] = stage_cost(0, 0, e)
    for s in range(1, num_stages):
        for e in range(s + 1, num_layers + 1):
            for start in range(s, e):
                value = max(best[s - 1][start], stage_cost(s, start, e))
                if value < best[s][e]:
                    best[s][e], cut[s][e] = value, start
    bounds = [num_layers]
    for s in range(num_stages - 1, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.append(0)
    bounds.reverse()
    return tuple(range(bounds[s], bounds[s + 1]) for s in range(num_stages))


def partition_decoder(config: Any, num_stages: int) -> tuple[range, ...]:
    """Balanced stages of a decoder (HF config or ``DecoderConfig``) by FLOPs per token: the
    embedding lookup is free, the last stage pays norm + LM head (``2 * hidden * vocab``)."""
    from .simulator import CostModel

    unit = CostModel.from_decoder_config(config, (1,))
    num_layers = getattr(config, "num_hidden_layers", None) or config.num_layers
    return partition_layers(
        num_layers,
        num_stages,
        layer_cost=unit.layer_flops_per_token,
        last_stage_extra=unit.head_flops_per_token,
    )
