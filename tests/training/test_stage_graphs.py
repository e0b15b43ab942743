"""CUDA graphs of pipeline stages (training/cuda_graphs.py over a stage's layers, driven by the
executor's fused forward+backward): the fixed-shape step a graph captures, run without capture
(Triton interpreter, fp32), against the eager stage. On a GPU the same code is captured
(tests/training/test_cuda_graphs.py covers capture and replay of the step itself)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter

import pytest
import torch

from lightning_lorafusion.parallel.executor import run_stage
from lightning_lorafusion.parallel.schedule import Backward, Forward, OptimizerStep, in_flight_slots, one_f_one_b_order
from lightning_lorafusion.parallel.stage import DecoderStage
from lightning_lorafusion.training.cuda_graphs import TrainingGraphs, cuda_graphs_refusal, graph_key
from lightning_lorafusion.training.graph_cover import covers
from lightning_lorafusion.training.stage_graphs import SplitStageGraphs, stage_key
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


def test_every_pipeline_stage_may_have_graphs():
    """The last stage fuses forward and backward, the earlier ones capture them apart
    (``SplitStageGraphs``): no stage is refused for its place in the pipeline."""
    gpu = torch.device("cuda", 0)
    assert cuda_graphs_refusal(device=gpu, backend="triton", pipeline=True) is None
    assert cuda_graphs_refusal(device=gpu, backend="triton", pipeline=True, world_size=4) is None
    assert "torch reference" in cuda_graphs_refusal(device=gpu, backend="torch", pipeline=True)
    assert "2 processes" in cuda_graphs_refusal(device=gpu, backend="triton", pipeline=False, world_size=2)


# ------------------------------------------------------------------ stages before the last


def _emulate(stages, g, n, graphed):
    """Stage ``g``'s 1F1B order (``len(stages)`` stages) in one process: the stages before ``g``
    run their forward (graph kept) at ``g``'s forward and their backward at ``g``'s backward; the
    stages after ``g`` run forward and backward at once (their result depends only on ``g``'s
    output). Returns ``g``'s outputs and the losses per microbatch, and the slots used."""
    num = len(stages)
    actions = [Forward(i) if k == "F" else Backward(i) for k, i in one_f_one_b_order(list(range(n)), g, num)]
    slots = in_flight_slots(actions)
    outputs, losses, kept = {}, {}, {}
    for a in actions:
        i = a.microbatch
        if isinstance(a, Forward):
            h = None
            for s in stages[:g]:
                h = s.forward(h, i)
            x = None if h is None else h.detach()
            if graphed:
                out = stages[g].graphed_forward(x, i, slots[i])
                assert out is not None
            else:
                x = None if x is None else x.requires_grad_(True)
                out = stages[g].forward(x, i)
            outputs[i] = out.detach().clone()
            y = out.detach().requires_grad_(True)
            z = y
            for s in stages[g + 1:]:
                z = s.forward(z, i)
            z.backward()
            losses[i] = z.detach()
            kept[i] = (h, x, out, y.grad)
        else:
            h, x, out, grad = kept.pop(i)
            if graphed:
                x_grad = stages[g].graphed_backward(i, slots[i], grad)
            else:
                out.backward(grad)
                x_grad = None if x is None else x.grad
            if h is not None:
                h.backward(x_grad)
    return outputs, losses, slots


def _mixed_keys(config, n=2):
    """``2 n`` capacity-128 microbatches alternating between two attention buckets (8 and 16
    blocks)."""
    many = microbatches(config, capacity=128, samples=6, max_length=10, global_batch=4)[:n]
    few = microbatches(config, capacity=128, samples=4, max_length=40, global_batch=4, seed=5)[:n]
    mixed = [mb for pair in zip(many, few) for mb in pair]
    return [dataclasses.replace(mb, index=2000 + i).to(DEVICE) for i, mb in enumerate(mixed)]


@pytest.mark.parametrize("g", [0, 1])
def test_stage_graphs_in_flight_give_the_eager_outputs_losses_and_gradients(g):
    """A stage before the last (the first, or a middle one of three) with its forward and
    backward apart as in 1F1B (``3 - g`` microbatches in flight, one slot each): the fixed-shape
    forward and backward per slot (what the graphs capture, run without capture) give every
    microbatch the eager output, the same losses downstream and the same gradients on every
    stage, over microbatches of different shape keys (the slot's key grows to their join)."""
    config, specs = tiny_config(3), tiny_specs()
    mbs = _mixed_keys(config)
    keys = {stage_key(mb) for mb in mbs}
    assert len(keys) > 1, keys  # different keys in flight
    layers = [range(0, 1), range(1, 2), range(2, 3)]
    results = []
    for graphed in (False, True):
        params, bank, _ = _setup(config, specs)
        graphs = SplitStageGraphs(params=params, bank=bank, config=config, capture=False, layers=layers[g],
                                  is_first=g == 0, slots=3 - g) if graphed else None
        stages = [_stage(params, bank, config, mbs, r, is_first=s == 0, is_last=s == 2,
                         graphs=graphs if s == g else None) for s, r in enumerate(layers)]
        outputs, losses, slots = _emulate(stages, g, len(mbs), graphed)
        results.append((outputs, losses, bank))
        if graphed:
            assert max(slots.values()) == 2 - g
            assert graphs.graphed_forwards == graphs.graphed_backwards == len(mbs)
            assert graphs.eager_microbatches == 0 and not graphs.refusals
            held = {s.key for s in graphs._slots if s is not None}
            assert all(any(covers(k, key) for k in held) for key in keys)
    (out_e, loss_e, bank_e), (out_g, loss_g, bank_g) = results
    for i in range(len(mbs)):
        torch.testing.assert_close(out_g[i], out_e[i], rtol=1e-4, atol=1e-5, msg=lambda m, i=i: f"mb {i}: {m}")
        torch.testing.assert_close(loss_g[i], loss_e[i], rtol=1e-5, atol=1e-6)
    for (name, pe), pg in zip(bank_e.named_parameters(), bank_g.parameters()):
        if pe.grad is None:
            assert pg.grad is None or not pg.grad.any(), name
            continue
        torch.testing.assert_close(pg.grad, pe.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_each_slot_keeps_its_microbatch_until_its_backward():
    """The buffers are refilled per microbatch, per slot: after slot 1 takes the next
    microbatch, slot 0 still holds its own (input ids, launch-table seeds); a slot is taken
    twice only after its backward freed it."""
    config, specs = tiny_config(2), tiny_specs()
    mbs = [mb.to(DEVICE) for mb in microbatches(config, capacity=64, samples=3, max_length=14, global_batch=2)]
    params, bank, _ = _setup(config, specs)
    graphs = SplitStageGraphs(params=params, bank=bank, config=config, capture=False, layers=range(0, 1),
                              is_first=True, slots=2)
    out0 = graphs.forward(mbs[0], None, 0)
    graphs.forward(mbs[1], None, 1)
    s0, s1 = graphs._slots
    assert torch.equal(s0.inputs.input_ids, mbs[0].input_ids)
    assert torch.equal(s1.inputs.input_ids, mbs[1].input_ids)
    assert s0.tables._last_fill[1] == mbs[0].index and s1.tables._last_fill[1] == mbs[1].index
    with pytest.raises(RuntimeError, match="still holds microbatch"):
        graphs.forward(mbs[2], None, 0)
    assert graphs.backward(0, torch.ones_like(out0)) is None  # the first stage: no input gradient
    graphs.forward(mbs[2], None, 0)
    assert torch.equal(s0.inputs.input_ids, mbs[2].input_ids)
    graphs.backward(0, torch.ones_like(out0))
    with pytest.raises(RuntimeError, match="no graphed forward holds"):
        graphs.backward(0, torch.ones_like(out0))
    # beyond the slots it holds, a microbatch runs eagerly (logged once)
    assert graphs.forward(mbs[1], None, 2) is None and graphs.eager_microbatches == 1
    assert ("slot", 2) in graphs.refusals
    with pytest.raises(TypeError, match="forward/backward"):
        graphs.step(mbs[0], mbs[0].loss_denominators)


def test_each_stage_gets_its_kind_of_graphs_and_logs_its_replays(caplog):
    """Under the strategy, the last stage gets the fused ``TrainingGraphs``, the earlier ones
    ``SplitStageGraphs`` with ``pipeline_size - stage`` slots; the epoch-end line counts the
    replays apart (what scripts/bench_pipeline.py reads per stage)."""
    from types import SimpleNamespace

    from lightning_lorafusion.training.epoch_graphs import log_replays, replay_counts
    from lightning_lorafusion.training.pipeline_contract import stage_graphs

    config, specs = tiny_config(4), tiny_specs()
    params, bank, _ = _setup(config, specs)
    m = SimpleNamespace(_stage_layers=range(0, 2), base_dtype=torch.float32, _graphs=None, _trainer=None)
    common = dict(params=params, bank=bank, config=config, capture=False)
    kinds = []
    for index, size in ((0, 3), (1, 3), (2, 3), (0, 1)):
        strategy = SimpleNamespace(stage_index=index, layout=SimpleNamespace(pipeline_size=size))
        graphs = stage_graphs(m, strategy, **common)
        kinds.append((type(graphs).__name__, getattr(graphs, "num_slots", None), graphs.is_first))
    assert kinds == [("SplitStageGraphs", 3, True), ("SplitStageGraphs", 2, False), ("TrainingGraphs", None, False),
                     ("TrainingGraphs", None, True)]
    assert type(stage_graphs(m, None, **common)).__name__ == "TrainingGraphs"
    mbs = _case(2)[2]
    split = SplitStageGraphs(**common, layers=range(0, 1), is_first=True, slots=2)
    out = split.forward(mbs[0], None, 0)
    split.backward(0, torch.ones_like(out))
    assert split.forward(mbs[1], None, 5) is None
    m._graphs = split
    with caplog.at_level("INFO", logger="lightning_lorafusion.training.epoch_graphs"):
        assert log_replays(m) == {"forward": 0, "backward": 0, "fused": 0, "eager": 1, "captures": 0}
    assert "CUDA graphs: stage 0 replays: 0 forward, 0 backward, 0 fused; 1 eager; 0 captures" in caplog.text
    assert replay_counts(TrainingGraphs(**common))["fused"] == 0
    assert log_replays(SimpleNamespace(_graphs=None)) is None


def test_a_stage_whose_slots_cover_the_epoch_starts_it_without_a_capture_batch(monkeypatch):
    """Every slot already holding a key that covers the epoch: precapture returns at once, with
    no capture batch (collection, device sync, cache release); a slot still empty gets one."""
    from lightning_lorafusion.training import stage_graphs

    batches: list[int] = []

    @contextlib.contextmanager
    def recording(device):
        batches.append(1)
        yield

    monkeypatch.setattr(stage_graphs, "capture_batch", recording)
    config, specs = tiny_config(2), tiny_specs()
    mbs = [mb.to(DEVICE) for mb in microbatches(config, capacity=64, samples=3, max_length=14, global_batch=2)]
    params, bank, _ = _setup(config, specs)
    graphs = SplitStageGraphs(params=params, bank=bank, config=config, capture=False, layers=range(0, 1),
                              is_first=True, slots=2)
    graphs.capture = True  # the batch is entered only when capturing; the captures stay fake below
    monkeypatch.setattr(graphs, "_capture_slot", lambda slot, key, device, up_front=False: bool(
        setattr(graphs._slots[slot], "key", key)) or True)
    planned = Counter(stage_key(mb) for mb in mbs)
    assert len(graphs.precapture(planned, DEVICE)) == 2 and batches == [1]
    assert graphs.precapture(planned, DEVICE) == [] and batches == [1]
