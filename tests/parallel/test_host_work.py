"""The strategy's host work per executor action does not grow with the model: with one stage,
``MultiAdapterPipelineStrategy.run_pipeline`` dispatches no tensor op of its own and makes the
same number of Python calls per action beyond the stage's own forward/backward/step for a 2-layer
and a 4-layer decoder (counted with a torch dispatch mode and ``sys.setprofile``)."""

from __future__ import annotations

import dataclasses
import gc
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_lorafusion.parallel.data_parallel import ParallelLayout
from lightning_lorafusion.parallel.schedule import Backward, Forward, OptimizerStep, build_pipeline_schedule
from lightning_lorafusion.parallel.stage import DecoderStage
from lightning_lorafusion.parallel.strategy import MultiAdapterPipelineStrategy
from lightning_lorafusion.model.adapter_bank import AdapterBank

from . import pipeline_case as case


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _python_calls(fn) -> int:
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def _ops(fn) -> int:
    with _OpCount() as mode:
        fn()
    return mode.ops


class _Module:
    """The strategy's side of the contract over the tiny case with ``num_layers`` layers."""

    def __init__(self, num_layers: int):
        self.decoder_config = dataclasses.replace(case.tiny_config(), num_layers=num_layers)
        self.params = case.base_params(self.decoder_config)
        self.bank = AdapterBank(case.adapter_specs(), self.decoder_config)
        self.opts = case.optimizers(self.bank)
        self.plan, per_replica = case.samples_and_plan(1)
        self.microbatches = per_replica[0]

    def pipeline_stage(self, stage_index, layers, is_first, is_last):
        return DecoderStage(params=self.params, bank=self.bank, config=self.decoder_config, layers=layers,
                            is_first=is_first, is_last=is_last, microbatches=self.microbatches.__getitem__)

    def adapter_parameters(self, adapter, layers):
        return [p for layer in layers for p in self.bank.adapters[adapter][layer].parameters()]

    def step_adapter(self, adapter, batch):
        self.opts[adapter].step()
        self.opts[adapter].zero_grad(set_to_none=True)


def _one_stage_strategy(module: _Module) -> MultiAdapterPipelineStrategy:
    """The strategy as Lightning leaves it after setup on one CPU process (no process group is
    needed with one stage and one replica)."""
    strategy = MultiAdapterPipelineStrategy(pipeline_size=1)
    strategy.layout = ParallelLayout(pipeline_size=1, data_parallel_size=1)
    strategy._dp_groups = [None]
    strategy.parallel_devices = [torch.device("cpu")]
    strategy._lightning_module = module
    return strategy


def _overhead(num_layers: int) -> tuple[int, int, int]:
    """(Python calls, tensor ops) of one window through the strategy minus the same window's
    forward/backward/steps called directly, and the number of actions."""
    module = _Module(num_layers)
    strategy = _one_stage_strategy(module)
    shape = (case.CAPACITY, module.decoder_config.hidden_size)
    actions = build_pipeline_schedule(module.plan, 1)[0]
    stage = module.pipeline_stage(0, range(num_layers), True, True)

    def through_strategy():
        strategy.run_pipeline(module.plan, activation_shape=shape, dtype=torch.float32, measure_bubbles=False)

    def direct():
        outputs = {}
        for a in actions:
            if isinstance(a, Forward):
                outputs[a.microbatch] = stage.forward(None, a.microbatch)
            elif isinstance(a, Backward):
                torch.autograd.backward(outputs.pop(a.microbatch))
            elif isinstance(a, OptimizerStep):
                module.step_adapter(a.adapter, a.batch)

    through_strategy()  # the strategy builds its stage on first use; both paths warm
    direct()
    gc.collect()
    gc.disable()  # no finalizer runs at a collection's whim inside a count
    try:
        calls = _python_calls(through_strategy) - _python_calls(direct)
        ops = _ops(through_strategy) - _ops(direct)
    finally:
        gc.enable()
    return calls, ops, len(actions)


def test_strategy_host_work_per_action_does_not_grow_with_layers():
    calls_two_layers, ops_two_layers, actions_two_layers = _overhead(2)
    calls_four_layers, ops_four_layers, actions_four_layers = _overhead(4)
    assert actions_two_layers == actions_four_layers > 10  # the same plan: the same actions
    print(f"\nstrategy overhead per action: {calls_two_layers / actions_two_layers:.1f} Python calls "
          f"(2 layers), {calls_four_layers / actions_four_layers:.1f} (4 layers); tensor ops "
          f"{ops_two_layers}, {ops_four_layers}")
    assert ops_two_layers == ops_four_layers == 0, "the strategy dispatched tensor ops of its own on one stage"
    assert calls_four_layers == calls_two_layers, (
        f"the strategy's Python calls per window grew from {calls_two_layers} (2 layers) to "
        f"{calls_four_layers} (4 layers): per-layer or per-parameter host work per action")
