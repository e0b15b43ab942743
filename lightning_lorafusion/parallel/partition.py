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


COST_MODELS = ("time", "flops")


def check_stage_layers(stage_layers: Any, num_stages: int, num_layers: int | None = None) -> tuple[int, ...]:
    """``stage_layers`` (layers per pipeline stage, e.g. ``[16, 16]``) as a tuple, or ``ConfigError``:
    one positive int per stage and, when ``num_layers`` is known, summing to it."""
    from ..specs import ConfigError

    if (not isinstance(stage_layers, (list, tuple)) or not stage_layers
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in stage_layers)):
        raise ConfigError(f"strategy stage_layers={stage_layers!r} must list one positive layer count "
                          f"per pipeline stage, e.g. [16, 16]")
    if len(stage_layers) != num_stages:
        raise ConfigError(f"strategy stage_layers={list(stage_layers)} has {len(stage_layers)} entries for "
                          f"pipeline_size={num_stages}: give one layer count per stage")
    if num_layers is not None and sum(stage_layers) != num_layers:
        raise ConfigError(f"strategy stage_layers={list(stage_layers)} sums to {sum(stage_layers)}; the "
                          f"decoder has {num_layers} layers: the counts must add up to it")
    return tuple(int(n) for n in stage_layers)


def ranges_of(counts: Sequence[int]) -> tuple[range, ...]:
    """Contiguous layer ranges from layers per stage: ``[3, 2]`` -> ``(range(0, 3), range(3, 5))``."""
    bounds = [0]
    for n in counts:
        bounds.append(bounds[-1] + int(n))
    return tuple(range(a, b) for a, b in zip(bounds, bounds[1:]))


def partition_decoder(config: Any, num_stages: int, *, stage_layers: Sequence[int] | None = None,
                      cost: str = "time", label_fraction: float | None = None,
                      checkpoint_layers: bool | int = False,
                      lm_head_loss: str = "checkpointed") -> tuple[range, ...]:
    """Contiguous stages of a decoder (HF config or ``DecoderConfig``).

    ``stage_layers``: the split as given (checked: one positive count per stage, summing to the
    decoder's layers). Otherwise balanced by ``cost``: ``"time"`` (default: ``CostModel.timed``,
    a layer's GEMMs plus its memory-bound traffic against the LM head on the labelled
    ``label_fraction`` of tokens) or ``"flops"`` (FLOPs per token; the head costs
    ``2 * hidden * vocab`` on every token). The embedding lookup is free either way.
    ``checkpoint_layers`` (the module's ``activation_checkpointing``: True or a layer count ``n``,
    the layers of global index < n): those layers run their forward twice, so each costs
    ``CostModel.recompute_factor`` plain layers and the stages holding them get fewer.
    ``lm_head_loss``: the module's LM-head loss, which the time model charges (``CostModel.timed``).
    """
    from .cost_model import DEFAULT_LABEL_FRACTION, CostModel

    num_layers = getattr(config, "num_hidden_layers", None) or config.num_layers
    if stage_layers is not None:
        return ranges_of(check_stage_layers(stage_layers, num_stages, num_layers))
    if cost not in COST_MODELS:
        raise ValueError(f"cost={cost!r}; allowed: {COST_MODELS}")
    if cost == "flops":
        unit = CostModel.from_decoder_config(config, (1,))
        layer, head = unit.layer_flops_per_token, unit.head_flops_per_token
    else:
        fraction = DEFAULT_LABEL_FRACTION if label_fraction is None else label_fraction
        unit = CostModel.timed(config, (1,), label_fraction=fraction, lm_head_loss=lm_head_loss)
        layer, head = unit.layer_time_per_token(), unit.head_time_per_token()
    recomputed = num_layers if checkpoint_layers is True else min(int(checkpoint_layers or 0), num_layers)
    costs = [layer * unit.recompute_factor()] * recomputed + [layer] * (num_layers - recomputed)
    return partition_layers(num_layers, num_stages, layer_cost=costs, last_stage_extra=head)


def label_fraction(datasets: Sequence[Sequence[Any]], *, max_samples: int = 512) -> float | None:
    """Share of tokens that carry a label (the rows the LM head computes) over the first
    ``max_samples`` samples of each adapter's dataset (objects with pre-shifted ``labels``);
    None when there are none. Deterministic in the data, so every rank finds the same."""
    from itertools import islice

    from ..specs import IGNORE_INDEX

    labelled = total = 0
    for samples in datasets:
        for sample in islice(samples, max_samples):
            labels = sample.labels
            total += len(labels)
            labelled += sum(1 for t in labels if t != IGNORE_INDEX)
    return labelled / total if total else None
