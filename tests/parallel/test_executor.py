"""The P2P executor on gloo: a multi-adapter pipeline trains every adapter exactly as one process does."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_lorafusion.parallel.data_parallel import (
    AdapterGradReducer,
    ParallelLayout,
    allreduce_adapter_grads,
    build_data_parallel_groups,
    check_same_step_order,
)
from lightning_lorafusion.parallel.executor import run_stage
from lightning_lorafusion.parallel.partition import partition_layers
from lightning_lorafusion.parallel.schedule import OptimizerStep, ScheduleError, build_pipeline_schedule
from lightning_lorafusion.parallel.stage import DecoderStage

from . import pipeline_case as case


class _CountingReducer(AdapterGradReducer):
    """Records how many buckets were already on their way when each armed backward ended."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.during_backward: list[tuple[int, int]] = []  # (launched before the end, armed)

    def after_backward(self, microbatch, adapters):
        if adapters:
            self.during_backward.append((self.launched, len(self._order)))
        super().after_backward(microbatch, adapters)


def _worker(rank: int, world: int, layouts: list[tuple], init_file: str, out_dir: str) -> None:
    """Train the case once per ``(pipeline_size, data_parallel_size[, "overlap"])`` layout
    (overlap: gradients all-reduced by ``AdapterGradReducer`` during backward, in tiny buckets);
    save this rank's bank."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for pp, dp, *overlap in layouts:
            layout = ParallelLayout(pipeline_size=pp, data_parallel_size=dp)
            groups = build_data_parallel_groups(layout)
            stage_index, replica = layout.stage_of(rank), layout.replica_of(rank)
            config = case.tiny_config()
            params = case.base_params(config)
            bank = case.make_bank(config)
            opts = case.optimizers(bank)
            plan, per_replica = case.samples_and_plan(pp, replicas=dp)
            microbatches = per_replica[replica]
            layers = partition_layers(config.num_layers, pp)[stage_index]
            stage = DecoderStage(
                params=params, bank=bank, config=config, layers=layers, is_first=stage_index == 0,
                is_last=stage_index == pp - 1, microbatches=microbatches.__getitem__,
            )
            dp_group = groups[stage_index]

            def mine(adapter: int) -> list:
                return [p for layer in layers for p in bank.adapters[adapter][layer].parameters()]

            reducer = _CountingReducer(mine, dp_group, bucket_mb=0.002) if overlap else None

            def step(adapter: int, batch: int) -> None:
                if reducer is not None:
                    reducer.wait(adapter)
                else:
                    allreduce_adapter_grads(mine(adapter), dp_group)
                opts[adapter].step()
                opts[adapter].zero_grad(set_to_none=True)

            actions = build_pipeline_schedule(plan, pp)[stage_index]
            check_same_step_order(actions, dp_group)
            record = run_stage(
                actions, stage, stage_index=stage_index, num_stages=pp,
                activation_shape=(case.CAPACITY, config.hidden_size), dtype=torch.float32,
                device="cpu", optimizer_step=step, stage_ranks=layout.pipeline_ranks(replica),
                hooks=reducer,
            )
            state = {k: v.detach().clone() for k, v in bank.state_dict().items()}
            torch.save({"state": state, "layers": list(layers), "events": record.events,
                        "during_backward": reducer.during_backward if reducer else None},
                       os.path.join(out_dir, f"pp{pp}_dp{dp}{''.join(overlap)}_rank{rank}.pt"))
            dist.barrier()
        # replicas that would step adapters in different orders are refused, on every rank
        group = build_data_parallel_groups(ParallelLayout(pipeline_size=1, data_parallel_size=world))[0]
        try:
            check_same_step_order([OptimizerStep(rank % 2, 0), OptimizerStep(1 - rank % 2, 0)], group)
            refused = ""
        except ScheduleError as error:
            refused = str(error)
        torch.save(refused, os.path.join(out_dir, f"refused_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _layer_of(key: str) -> int:
    return int(key.split(".")[2])  # adapters.<a>.<layer>.<module>.lora_A


def test_pipeline_and_data_parallel_match_single_process_training():
    """After 3 global batches of 3 adapters (mixed-adapter microbatches, dropout on one adapter),
    every stage's adapter weights equal the one-process run, for PP=4, DP=2 x PP=2 and DP=4
    (one spawn of 4 gloo processes runs all three; the Strategy test covers PP=2 alone)."""
    world, layouts = 4, [(4, 1), (2, 2), (1, 4), (2, 2, "overlap"), (1, 4, "overlap")]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker, args=(world, layouts, os.path.join(tmp, "init"), tmp), nprocs=world,
            start_method="spawn",
        )
        results = {
            (pp, dp, r): torch.load(os.path.join(tmp, f"pp{pp}_dp{dp}_rank{r}.pt"))
            for pp, dp, *overlap in layouts if not overlap for r in range(world)
        }
        overlapped = {
            (pp, dp, r): torch.load(os.path.join(tmp, f"pp{pp}_dp{dp}overlap_rank{r}.pt"))
            for pp, dp, *overlap in layouts if overlap for r in range(world)
        }
        refused = [torch.load(os.path.join(tmp, f"refused_rank{r}.pt")) for r in range(world)]
    assert all("different orders" in message and "same step order" in message for message in refused), refused
    initial = case.make_bank(case.tiny_config()).state_dict()
    for (pp, dp, rank), result in overlapped.items():
        # the overlapped all-reduce trains exactly like the blocking one (same sums per element)
        plain = results[(pp, dp, rank)]["state"]
        for key, value in result["state"].items():
            torch.testing.assert_close(value, plain[key], rtol=1e-6, atol=1e-7,
                                       msg=f"overlap pp={pp} dp={dp} rank={rank} {key}")
        # every step point's buckets were launched, most while the backward was still running
        during = result["during_backward"]
        assert during and all(armed > 1 for _, armed in during), during
        assert sum(launched for launched, _ in during) > sum(armed for _, armed in during) // 2, during
    for pp, dp, *overlap in layouts:
        if overlap:
            continue
        plan, per_replica = case.samples_and_plan(pp, replicas=dp)
        assert len({b for (_, b) in plan.step_points}) == 3
        assert any(len(mb.adapters()) > 1 for mb in plan.microbatches), "want mixed-adapter microbatches"
        reference = case.reference_training(plan, per_replica).state_dict()
        for rank in range(world):
            result = results[(pp, dp, rank)]
            assert {"F", "B", "S"} <= {kind for kind, *_ in result["events"]}
            mine = set(result["layers"])
            for key, value in result["state"].items():
                if _layer_of(key) in mine:
                    # the weights moved, and moved exactly as in the one-process run
                    assert not torch.equal(value, initial[key]), key
                    torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-6,
                                               msg=f"pp={pp} dp={dp} rank={rank} {key}")
                else:
                    torch.testing.assert_close(value, initial[key], rtol=0, atol=0)


def test_one_stage_executor_is_plain_training_and_checks_the_loss_shape():
    """PP=1 needs no communication: run_stage alone must reproduce the reference run."""
    config = case.tiny_config()
    bank = case.make_bank(config)
    opts = case.optimizers(bank)
    plan, per_replica = case.samples_and_plan(1)
    stage = DecoderStage(params=case.base_params(config), bank=bank, config=config,
                         layers=range(config.num_layers), is_first=True, is_last=True,
                         microbatches=per_replica[0].__getitem__)
    steps = []

    def step(adapter, batch):
        steps.append((adapter, batch))
        opts[adapter].step()
        opts[adapter].zero_grad(set_to_none=True)

    kwargs = dict(stage_index=0, num_stages=1, activation_shape=(case.CAPACITY, config.hidden_size),
                  dtype=torch.float32, device="cpu", optimizer_step=step)
    record = run_stage(build_pipeline_schedule(plan, 1)[0], stage, **kwargs)
    assert sorted(steps) == sorted(plan.step_points)
    assert 0 <= record.busy <= record.wall
    reference = case.reference_training(plan, per_replica).state_dict()
    for key, value in bank.state_dict().items():
        torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-6, msg=key)

    class NotAScalar:
        def forward(self, stage_input, microbatch):
            return torch.zeros(3, requires_grad=True)

    with pytest.raises(ScheduleError, match="scalar loss"):
        run_stage(build_pipeline_schedule(plan, 1)[0], NotAScalar(), **kwargs)
