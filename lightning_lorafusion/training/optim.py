"""Per-adapter optimizers and learning-rate schedules (each adapter steps on its own clock)."""

from __future__ import annotations

import math
from typing import Iterable

import torch

from ..specs import AdapterSpec


def lr_multiplier(step: int, *, spec: AdapterSpec, total_steps: int) -> float:
    """Factor on ``spec.lr`` after ``step`` optimizer steps: linear warm-up, then the schedule
    decays to ``spec.min_lr_ratio`` at ``total_steps``."""
    if spec.warmup_steps > 0 and step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    if spec.lr_schedule == "constant":
        return 1.0
    span = max(1, total_steps - spec.warmup_steps)
    progress = min(1.0, (step - spec.warmup_steps) / span)
    floor = spec.min_lr_ratio
    if spec.lr_schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_adapter_optimizer(
    params: Iterable[torch.nn.Parameter | tuple[str, torch.nn.Parameter]], *, spec: AdapterSpec, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over one adapter's parameters with its own lr, weight decay and schedule.

    ``params``: parameters, or (name, parameter) pairs, which LoRA+ needs. With
    ``spec.loraplus_lr_ratio`` (LoRA+), two parameter groups as PEFT's ``create_loraplus_optimizer``
    makes them: ratio x ``lr`` for the B factors (names ending in ``lora_B``) and any 1-D
    parameter, ``lr`` for the rest (the A factors). The schedule scales both groups alike."""
    params = list(params)
    if not params:
        raise ValueError(f"adapter {spec.name!r} has no trainable parameters")
    named = all(isinstance(p, tuple) for p in params)
    if spec.loraplus_lr_ratio is None:
        groups = [{"params": [p for _, p in params] if named else params}]
    elif not named:
        raise ValueError(f"adapter {spec.name!r}: loraplus_lr_ratio needs (name, parameter) pairs "
                         "to tell the B factors apart")
    else:
        is_b = [n.endswith("lora_B") or p.dim() == 1 for n, p in params]
        groups = [{"params": [p for (_, p), b in zip(params, is_b) if not b], "lr": spec.lr},
                  {"params": [p for (_, p), b in zip(params, is_b) if b], "lr": spec.lr * spec.loraplus_lr_ratio}]
    # on CUDA the fused AdamW: one kernel per group and the step counts on the device, where
    # the multi-tensor one spends milliseconds of host time per step (per-parameter bias
    # corrections read from host step counters), with the device idle behind it
    fused = all(p.is_cuda for g in groups for p in g["params"]) or None
    optimizer = torch.optim.AdamW(groups, lr=spec.lr, weight_decay=spec.weight_decay, fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, spec=spec, total_steps=total_steps)
    )
    return optimizer, scheduler

