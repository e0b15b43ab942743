"""The P2P executor on gloo: a multi-adapter pipeline trains every adapter exactly as one process does."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_lorafusion.parallel.executor import run_stage
from lightning_lorafusion.parallel.partition import partition_layers
from lightning_lorafusion.parallel.schedule import build_pipeline_schedule
from lightning_lorafusion.parallel.stage import DecoderStage

from . import pipeline_case as case


def _pipeline_worker(rank: int, num_stages: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=num_stages)
    try:
        config = case.tiny_config()
        params = case.base_params(config)
        bank = case.make_bank(config)
        opts = case.optimizers(bank)
        plan, microbatches = case.samples_and_plan(num_stages)
        layers = partition_layers(config.num_layers, num_stages)[rank]
        stage = DecoderStage(
            params=params, bank=bank, config=config, layers=layers, is_first=rank == 0,
            is_last=rank == num_stages - 1, microbatches=microbatches.__getitem__,
        )

        def step(adapter: int, batch: int) -> None:
            opts[adapter].step()
            opts[adapter].zero_grad(set_to_none=True)

        schedule = build_pipeline_schedule(plan, num_stages)
        record = run_stage(
            schedule[rank], stage, stage_index=rank, num_stages=num_stages,
            activation_shape=(case.CAPACITY, config.hidden_size), dtype=torch.float32,
            device="cpu", optimizer_step=step,
        )
        state = {k: v.detach().clone() for k, v in bank.state_dict().items()}
        torch.save({"state": state, "layers": list(layers), "events": record.events},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _layer_of(key: str) -> int:
    return int(key.split(".")[2])  # adapters.<a>.<layer>.<module>.lora_A


@pytest.mark.parametrize("num_stages", [2, 4])
def test_pipeline_matches_single_process_training(num_stages):
    plan, microbatches = case.samples_and_plan(num_stages)
    steps = {b for (_, b) in plan.step_points}
    assert len(steps) == 3 and len({a for (a, _) in plan.step_points}) == 3
    assert any(len(mb.adapters()) > 1 for mb in plan.microbatches), "want mixed-adapter microbatches"
    reference = case.reference_training(plan, microbatches).state_dict()
    initial = case.make_bank(case.tiny_config()).state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _pipeline_worker, args=(num_stages, os.path.join(tmp, "init"), tmp),
            nprocs=num_stages, start_method="spawn",
        )
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(num_stages)]
    for rank, result in enumerate(results):
        mine = set(result["layers"])
        kinds = {kind for kind, *_ in result["events"]}
        assert {"F", "B", "S"} <= kinds
        for key, value in result["state"].items():
            if _layer_of(key) in mine:
                # the weights moved, and moved exactly as in the one-process run
                assert not torch.equal(value, initial[key]), key
                torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-6, msg=key)
            else:
                torch.testing.assert_close(value, initial[key], rtol=0, atol=0)
