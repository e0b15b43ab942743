"""CUDA graphs of pipeline stages (training/cuda_graphs.py over a stage's layers, driven by the
executor's fused forward+backward): the fixed-shape step a graph captures, run without capture
(Triton interpreter, fp32), against the eager stage. On a GPU the same code is captured
(tests/training/test_cuda_graphs.py covers capture and replay of the step itself)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from lightning_lorafusion.parallel.executor import run_stage
from lightning_lorafusion.parallel.schedule import Backward, Forward, OptimizerStep
from lightning_lorafusion.parallel.stage import DecoderStage
from lightning_lorafusion.training.cuda_graphs import TrainingGraphs, cuda_graphs_refusal, graph_key
from test_cuda_graphs import DEVICE, _setup, microbatches, tiny_config, tiny_specs


def _case(layers: int):
    config, specs = tiny_config(layers), tiny_specs()
    mbs = [mb.to(DEVICE) for mb in microbatches(config, capacity=64, samples=3, max_length=14, global_batch=2)]
    return config, specs, mbs


def _stage(params, bank, config, mbs, layers, *, is_first, is_last, graphs=None):
    return DecoderStage(params=params, bank=bank, config=config, layers=layers, is_first=is_first,
                        is_last=is_last, microbatches=mbs.__getitem__, backend="triton", graphs=graphs)


@pytest.mark.parametrize("precapture", [False, True])
def test_last_stage_graph_step_gives_the_eager_gradients_and_input_gradient(precapture):
    """Two stages in one process: the last stage's fused step (its layers from the static input
    buffer, norm, head, loss, backward) returns the same gradient for its input as the eager
    stage, and every adapter gradient on both stages matches. ``precapture``: the epoch's keys
    held before the first step (warm-ups on idle microbatches from a zero stage input)."""
    config, specs, mbs = _case(4)
    first, last = range(0, 2), range(2, 4)
    params, bank_e, _ = _setup(config, specs)
    _, bank_g, _ = _setup(config, specs)
    graphs = TrainingGraphs(params=params, bank=bank_g, config=config, capture=False, layers=last,
                            is_first=False, max_precapture=1)
    if precapture:
        held = graphs.precapture(Counter(graph_key(mb) for mb in mbs), DEVICE)
        assert len(held) == 1 and graphs.input_grad is None
        assert all(p.grad is None or not p.grad.any() for p in bank_g.parameters())
    s0_e = _stage(params, bank_e, config, mbs, first, is_first=True, is_last=False)
    s1_e = _stage(params, bank_e, config, mbs, last, is_first=False, is_last=True)
    s0_g = _stage(params, bank_g, config, mbs, first, is_first=True, is_last=False)
    s1_g = _stage(params, bank_g, config, mbs, last, is_first=False, is_last=True, graphs=graphs)
    assert s1_e.fused_step(torch.zeros(1), 0) is None  # no graphs: the executor runs it eagerly
    for i in range(len(mbs)):
        h = s0_e.forward(None, i)
        x = h.detach().requires_grad_(True)
        s1_e.forward(x, i).backward()
        h.backward(x.grad)
        h = s0_g.forward(None, i)
        done = s1_g.fused_step(h.detach(), i)
        assert done is not None and done.input_grad is not None
        torch.testing.assert_close(done.input_grad, x.grad, rtol=1e-4, atol=1e-6)
        h.backward(done.input_grad)
    assert not graphs.refusals
    if precapture:  # every step replayed the one precaptured key: no capture of its own
        assert graphs.num_held == 1 and graphs.covered_steps == sum(graph_key(mb) != held[0] for mb in mbs)
    for (name, pe), pg in zip(bank_e.named_parameters(), bank_g.parameters()):
        if pe.grad is None:
            assert pg.grad is None or not pg.grad.any(), name
            continue
        torch.testing.assert_close(pg.grad, pe.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_one_stage_executor_fuses_forward_and_backward_through_the_graph_step():
    """With one stage every Forward(i) is followed by Backward(i): the executor runs each pair as
    one fused step ("FB" events), and training equals the eager executor run."""
    config, specs, mbs = _case(2)
    actions = []
    for k, mb in enumerate(mbs):
        actions += [Forward(k), Backward(k)] + [OptimizerStep(a, 0) for a in mb.step_adapters]
    assert any(isinstance(a, OptimizerStep) for a in actions)
    banks, records = [], []
    for fused in (False, True):
        params, bank, opts = _setup(config, specs)
        graphs = TrainingGraphs(params=params, bank=bank, config=config, capture=False) if fused else None
        stage = _stage(params, bank, config, mbs, range(2), is_first=True, is_last=True, graphs=graphs)

        def step(adapter, batch, opts=opts):
            opts[adapter].step()
            opts[adapter].zero_grad(set_to_none=False)

        records.append(run_stage(actions, stage, stage_index=0, num_stages=1, activation_shape=(64, 32),
                                 dtype=torch.float32, device=DEVICE, optimizer_step=step))
        banks.append(bank)
    eager, fused = records
    assert eager.count("FB") == 0 and eager.count("F") == eager.count("B") == len(mbs)
    assert fused.count("FB") == len(mbs) and fused.count("F") == fused.count("B") == 0
    for (name, pe), pg in zip(banks[0].named_parameters(), banks[1].parameters()):
        torch.testing.assert_close(pg, pe, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_graphs_refused_only_for_stages_that_split_forward_and_backward():
    gpu = torch.device("cuda", 0)
    assert cuda_graphs_refusal(device=gpu, backend="triton", pipeline=True, fused_stage=True) is None
    assert cuda_graphs_refusal(device=gpu, backend="triton", pipeline=True, world_size=4, fused_stage=True) is None
    reason = cuda_graphs_refusal(device=gpu, backend="triton", pipeline=True, world_size=2)
    assert "last stage" in reason and "earlier stages" in reason
