"""The training module's side of ``MultiAdapterPipelineStrategy``: this stage's layers and frozen
weights, its ``DecoderStage``, stepping an adapter on its own layers, and one planned window run
through the pipeline schedule. Functions over the training module's state."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
from lightning import LightningModule as Module

from ..parallel.partition import label_fraction
from ..parallel.stage import DecoderStage
from ..parallel.strategy import MultiAdapterPipelineStrategy
from .cuda_graphs import TrainingGraphs, graph_key
from .frozen_base import draw_stage_base, flatten_tree, stage_template
from .nonfinite_guard import agree_on_quarantine, step_adapter
from .stage_graphs import SplitStageGraphs


def pipeline_strategy(m: Module) -> MultiAdapterPipelineStrategy | None:
    strategy = m.trainer.strategy if m._trainer is not None else None
    return strategy if isinstance(strategy, MultiAdapterPipelineStrategy) else None


def is_last_stage(strategy: MultiAdapterPipelineStrategy | None) -> bool:
    """Whether this rank runs the pipeline's last stage (where a microbatch's backward follows its
    forward directly, so both can be one CUDA graph); False without the strategy."""
    return strategy is not None and strategy.stage_index == strategy.layout.pipeline_size - 1


def stage_graphs(m: Module, strategy: MultiAdapterPipelineStrategy | None, **kwargs: Any) -> TrainingGraphs:
    """The CUDA graphs of this rank's training steps (``kwargs``: ``TrainingGraphs``' common
    arguments): the fused forward + backward without the strategy and on the last stage, forward
    and backward apart per in-flight slot on the others (``pipeline_size - stage_index`` slots,
    what 1F1B holds at most: ``schedule.in_flight_slots``)."""
    if strategy is None:
        return TrainingGraphs(**kwargs)
    stage = {"layers": m._stage_layers, "is_first": strategy.stage_index == 0, "activation_dtype": m.base_dtype}
    if is_last_stage(strategy):
        return TrainingGraphs(**kwargs, **stage)
    return SplitStageGraphs(**kwargs, **stage, slots=strategy.layout.pipeline_size - strategy.stage_index)


def setup_stage(m: Module) -> None:
    """This process's layers: a random base drawn for them on the device, or a loaded base cut
    down to them (before the device move) under the pipeline strategy."""
    strategy = pipeline_strategy(m)
    if strategy is not None:
        dm = m.trainer.datamodule if m._trainer is not None else None
        layers = strategy.stage_layers(m.config, label_fraction=label_fraction(getattr(dm, "datasets", None) or ()),
                                       checkpoint_layers=m.activation_checkpointing, lm_head_loss=m.lm_head_loss)
        first, last = strategy.stage_index == 0, strategy.stage_index == strategy.layout.pipeline_size - 1
    else:
        layers, first, last = range(m.config.num_layers), True, True
    if m._param_template is None:  # random base: only this stage's weights, on its device
        device = m._trainer.strategy.root_device if m._trainer is not None else m.device
        m._register_base(draw_stage_base(m.config, layers, is_first=first, is_last=last, device=device,
                                         dtype=m.base_dtype, base_precision=m.base_precision,
                                         fp8_keep=m._fp8_keep))
        if m._bank_on_meta:  # zeros, then this stage's initial A factors (other layers unused)
            m.bank.to_empty(device=device)
            with torch.no_grad():
                for p in m.bank.parameters():
                    p.zero_()
            m.bank.draw_initial_a(layers)
            m._bank_on_meta = False
        # DoRA: the drawn base's row norms; magnitudes start there unless imported (init_from)
        m.bank.init_dora(m.base_params(), layers,
                         reset=[a for a, s in enumerate(m.adapter_specs) if not s.init_from])
        m._stage_layers = layers
    elif strategy is not None:
        keep_stage_params(m, layers, first, last)


def keep_stage_params(m: Module, layers: range, is_first: bool, is_last: bool) -> None:
    """Drop the frozen buffers of every layer this stage does not run."""
    template = stage_template(m._param_template, layers, is_first, is_last)
    needed = set(flatten_tree(template))
    needed |= {m._aliases[n] for n in needed if n in m._aliases}
    for name in [n for n in m._buffers if n.startswith("base__")]:
        if name[len("base__"):] not in needed:
            del m._buffers[name]
    m._aliases = {k: v for k, v in m._aliases.items() if k in needed}
    m._param_template = template
    m._stage_layers = layers


def build_stage(m: Module, layers: range, is_first: bool, is_last: bool) -> DecoderStage:
    m._stage_layers = layers
    return DecoderStage(
        params=m.base_params(), bank=m.bank, config=m.config, layers=layers,
        is_first=is_first, is_last=is_last, microbatches=lambda pos: m._window.microbatch(pos),
        backend=m.backend, on_loss_sums=m._on_pipeline_loss_sums if is_last else None,
        checkpoint_layers=m.activation_checkpointing, lm_head_loss=m.lm_head_loss,
        options=m.decoder_options, graphs=m._graphs,
    )


def step_adapter_on_stage(m: Module, adapter: int) -> None:
    """Step ``adapter`` on this stage's layers (its loss is logged by the last stage)."""
    strategy = pipeline_strategy(m)
    is_last = strategy.stage_index == strategy.layout.pipeline_size - 1
    if is_last and strategy.layout.data_parallel_size > 1:
        # each replica holds its share of the global batch's loss and tokens: log the whole
        stats = torch.tensor([float(m._gb_loss[adapter]), float(m._gb_tokens[adapter])],
                             dtype=torch.float64, device=strategy.root_device)
        strategy.sum_over_replicas(stats)
        m._gb_loss[adapter] = float(stats[0])
        m._gb_tokens[adapter] = int(stats[1])
    step_adapter(m, adapter, m.adapter_parameters(adapter, m._stage_layers), log_loss=is_last)


def train_window(m: Module, window: Any) -> None:
    """One ``PipelineWindow`` through the strategy's schedule, with its measured and simulated
    bubble ratios logged."""
    strategy = pipeline_strategy(m)
    if strategy is None:
        raise RuntimeError("a PipelineWindow batch needs MultiAdapterPipelineStrategy")
    m._window = window
    dtype = next(iter(m._buffers.values())).dtype
    # no synchronize: on CUDA the executor times actions by CUDA events (no host syncs)
    m._step_phases = [] if strategy.action_trace is not None else None
    record = strategy.run_pipeline(window.plan, activation_shape=(window.plan.capacity, m.config.hidden_size),
                                   dtype=dtype)
    # measured idle fraction (executor timestamps) next to the analytic simulator's prediction
    # the simulator's time model on this pipeline's split (stage_layers or the balanced default)
    simulated = strategy.simulate(window.plan, strategy.cost_model(m.config), head_rows=head_rows(m, window))
    m.log("pipeline/bubble_ratio", float(strategy.last_bubble_ratio), prog_bar=True, batch_size=1)
    m.log("pipeline/simulated_bubble_ratio", simulated.bubble_ratio, batch_size=1)
    for s, ratio in enumerate(strategy.last_stage_bubble_ratios):
        m.log(f"pipeline/bubble_ratio_stage{s}", float(ratio), batch_size=1)
        m.log(f"pipeline/simulated_bubble_ratio_stage{s}", simulated.stage_bubble_ratios[s], batch_size=1)
    if strategy.action_trace is not None:
        write_action_trace(m, strategy, window, record, simulated)
    dm = m.trainer.datamodule
    if dm is not None:
        dm.on_window_trained(window)
    m._window = None
    agree_on_quarantine(m, strategy)


def head_rows(m: Module, window: Any) -> dict[int, int]:
    """Rows the last stage's LM head computes per real microbatch of ``window`` (plan position),
    for the simulator: under CUDA graphs the label rows of the microbatch's graph key (padded to
    its bucket; a covering graph may pad further), else its label rows. The same on every rank
    (host metadata only)."""
    rows = {}
    for pos, planned in enumerate(window.plan.microbatches):
        if planned.is_noop:
            continue
        mb = window.microbatch(pos)
        if mb.num_label_rows is None:
            continue
        try:
            rows[pos] = graph_key(mb).label_rows if m._graphs is not None else mb.num_label_rows
        except ValueError:  # no host metadata: it runs eagerly, on its own rows
            rows[pos] = mb.num_label_rows
    return rows


def write_action_trace(m: Module, strategy: MultiAdapterPipelineStrategy, window: Any, record: Any,
                       simulated: Any) -> str:
    """Append this rank's line for ``window`` to ``<action_trace>/actions_rank<r>.jsonl`` (the
    strategy's ``action_trace`` option): measured action times, the simulator's for this stage,
    and each real microbatch's tokens, label rows and graph key; returns the file's path."""
    root = strategy.action_trace
    if not os.path.isabs(root):
        root = os.path.join(m.trainer.default_root_dir, root)
    os.makedirs(root, exist_ok=True)
    plan, stage = window.plan, strategy.stage_index
    microbatches = {}
    for pos, planned in enumerate(plan.microbatches):
        if planned.is_noop:
            continue
        mb = window.microbatch(pos)
        lengths = [s.length for s in planned.samples]
        try:
            key = list(dataclasses.astuple(graph_key(mb)))
        except ValueError:
            key = None
        microbatches[pos] = {"tokens": planned.padded_tokens(plan.pad_multiple), "real_tokens": sum(lengths),
                             "seq_sq": sum(n * n for n in lengths), "label_rows": mb.num_label_rows,
                             "graph_key": key}
    graphs = m._graphs
    held = sorted(dataclasses.astuple(k) for k in graphs._held()) if graphs is not None and hasattr(graphs, "_held") else []
    line = {
        "epoch": window.epoch, "rank": strategy.global_rank, "stage": stage,
        "stage_layers": list(strategy.stage_layer_counts or ()), "wall": record.wall,
        "events": [list(e) for e in record.events],
        "simulated": [[kind, label, t0, t1] for s, kind, label, t0, t1 in simulated.timeline if s == stage],
        "simulated_makespan": simulated.makespan, "microbatches": microbatches, "held_graph_keys": held,
        # host seconds per good optimizer step: queue norm + copy, device read, optimizer,
        # weights' check, the rest (nonfinite_guard.step_adapter)
        "step_phases": m._step_phases or [],
    }
    path = os.path.join(root, f"actions_rank{strategy.global_rank}.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
    return path
