"""MultiAdapterPipelineStrategy under a real Lightning Trainer: launch, layout, training (the
simulated two-node PP=2 x DP=2 launch runs `fit`: tests/training/test_dp_fit.py)."""

from __future__ import annotations

import os
import tempfile


import lightning as L
import pytest
import torch

from lightning_lorafusion.parallel.strategy import MultiAdapterPipelineStrategy

from . import pipeline_case as case
from .pipeline_case import PipelineCaseModule


@pytest.mark.parametrize("stage_layers", [None, [3, 1]], ids=["balanced", "stage_layers_3_1"])
def test_strategy_trains_a_two_stage_pipeline_like_one_process(stage_layers):
    """Any split trains like one process; ``stage_layers`` is the split every rank runs."""
    with tempfile.TemporaryDirectory() as tmp:
        module = PipelineCaseModule(tmp, num_stages=2)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
            strategy=MultiAdapterPipelineStrategy(pipeline_size=2, start_method="spawn",
                                                  process_group_backend="gloo", stage_layers=stage_layers),
        )
        trainer.fit(module)
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
        gathered = torch.load(os.path.join(tmp, "gathered.pt"))
        shards = [torch.load(os.path.join(tmp, name), weights_only=False)["state_dict"]
                  for name in ("last.ckpt", "last.ckpt.stage1")]
    plan, per_replica = case.samples_and_plan(2)
    reference = case.reference_training(plan, per_replica).state_dict()
    assert [r["stage"] for r in results] == [0, 1]
    assert sorted(i for r in results for i in r["layers"]) == list(range(4))
    if stage_layers is not None:
        assert [list(r["layers"]) for r in results] == [[0, 1, 2], [3]]
    for r, shard in zip(results, shards):
        for key in reference:
            if int(key.split(".")[2]) in r["layers"]:
                torch.testing.assert_close(r["state"][key], reference[key], rtol=1e-5, atol=1e-6, msg=key)
                # each stage's checkpoint file holds that stage's trained shard
                torch.testing.assert_close(shard[f"bank.{key}"], reference[key], rtol=1e-5, atol=1e-6)
    # rank 0 gathered every stage's layers: the whole adapters, as the one-process run has them
    assert sorted(gathered) == sorted(reference)
    for key, value in reference.items():
        torch.testing.assert_close(gathered[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_strategy_trains_a_pipeline_over_an_fp8_base():
    """The two-stage pipeline over an FP8 base (emulated products on CPU: the
    spec the GPU path matches) trains like one process over the same base, both on one
    intra-op thread (pipeline_case.case_params says why): within 1e-4 of the update (measured:
    identical), while the
    16-bit base's run is far from it (so the pipeline did run the FP8 products)."""
    with tempfile.TemporaryDirectory() as tmp:
        module = PipelineCaseModule(tmp, num_stages=2, fp8=True)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
            strategy=MultiAdapterPipelineStrategy(pipeline_size=2, start_method="spawn",
                                                  process_group_backend="gloo"),
        )
        trainer.fit(module)
        gathered = torch.load(os.path.join(tmp, "gathered.pt"))
    plan, per_replica = case.samples_and_plan(2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp8_ref = case.reference_training(plan, per_replica, fp8=True).state_dict()
    finally:
        torch.set_num_threads(threads)
    plain_ref = case.reference_training(plan, per_replica).state_dict()
    init = case.make_bank(case.tiny_config()).state_dict()
    assert sorted(gathered) == sorted(fp8_ref)

    def dist(a, b):  # relative to the training update of the one-process FP8 run
        num = sum(float((a[k] - b[k]).norm() ** 2) for k in fp8_ref) ** 0.5
        return num / sum(float((fp8_ref[k] - init[k]).norm() ** 2) for k in fp8_ref) ** 0.5

    assert dist(gathered, fp8_ref) < 1e-4
    assert dist(plain_ref, fp8_ref) > 0.05


def test_strategy_refuses_bad_sizes():
    with pytest.raises(ValueError, match="pipeline_size"):
        MultiAdapterPipelineStrategy(pipeline_size=0)
    with pytest.raises(ValueError, match="data_parallel_size"):
        MultiAdapterPipelineStrategy(pipeline_size=2, data_parallel_size=0)


def test_strategy_refuses_bad_gradient_overlap_options():
    with pytest.raises(ValueError, match="overlap_grad_reduce='yes'"):
        MultiAdapterPipelineStrategy(overlap_grad_reduce="yes")
    for bad in (0, -1.0, True, "25"):
        with pytest.raises(ValueError, match="bucket_mb"):
            MultiAdapterPipelineStrategy(bucket_mb=bad)
    strategy = MultiAdapterPipelineStrategy(bucket_mb=4)
    assert strategy.overlap_grad_reduce is True and strategy.bucket_mb == 4.0


def test_strategy_refuses_bad_stage_layers():
    """One positive int per stage at construction; the sum once the decoder's layer count is known."""
    from lightning_lorafusion.parallel.data_parallel import ParallelLayout
    from lightning_lorafusion.specs import ConfigError

    for bad, match in (([32], "1 entries for pipeline_size=2"), ([0, 32], "one positive layer count"),
                       ([16, "16"], "one positive layer count"), ([], "one positive layer count")):
        with pytest.raises(ConfigError, match=r"stage_layers=.*" + match):
            MultiAdapterPipelineStrategy(pipeline_size=2, stage_layers=bad)
    strategy = MultiAdapterPipelineStrategy(pipeline_size=2, stage_layers=[3, 2])
    strategy.layout = ParallelLayout(pipeline_size=2, data_parallel_size=1)
    with pytest.raises(ConfigError, match=r"stage_layers=\[3, 2\] sums to 5; the decoder has 4 layers"):
        strategy.stage_ranges(num_layers=4)
    assert strategy.stage_layer_counts is None
    assert strategy.stage_ranges(num_layers=5) == (range(0, 3), range(3, 5))
    assert strategy.stage_layer_counts == (3, 2)
    # fixed once computed: a later call (the executor's) gets the same split
    assert strategy.stage_ranges(num_layers=99) == (range(0, 3), range(3, 5))


def test_strategy_split_and_cost_model_charge_the_modules_recompute():
    """``stage_ranges(config, checkpoint_layers=n)`` (what the module's setup passes from its
    ``activation_checkpointing``) balances with the recompute, and the simulator's cost model of
    the strategy charges it on the stages that hold those layers."""
    from types import SimpleNamespace

    from lightning_lorafusion.parallel.data_parallel import ParallelLayout
    from lightning_lorafusion.parallel.partition import partition_decoder

    config = SimpleNamespace(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256, num_hidden_layers=32)
    strategy = MultiAdapterPipelineStrategy(pipeline_size=2)
    strategy.layout = ParallelLayout(pipeline_size=2, data_parallel_size=1)
    ranges = strategy.stage_ranges(config, label_fraction=0.1, checkpoint_layers=16)
    assert ranges == partition_decoder(config, 2, label_fraction=0.1, checkpoint_layers=16)
    assert len(ranges[0]) < 16
    model = strategy.cost_model(config)
    assert model.stage_layers == tuple(len(r) for r in ranges)
    assert model.stage_recomputed == (len(ranges[0]), 16 - len(ranges[0]))
