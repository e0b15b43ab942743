"""The P2P executor on gloo with the stages before the last running their forward and backward
apart through ``SplitStageGraphs`` (the fixed-shape steps a CUDA graph captures, run without
capture on the CPU): a 3-stage pipeline trains exactly like the eager one."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_lorafusion.parallel.executor import run_stage
from lightning_lorafusion.parallel.partition import partition_layers
from lightning_lorafusion.parallel.schedule import build_pipeline_schedule, in_flight_slots
from lightning_lorafusion.parallel.stage import DecoderStage
from lightning_lorafusion.training.stage_graphs import SplitStageGraphs

from . import pipeline_case as case

STAGES = 3


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=STAGES)
    try:
        for graphed in (False, True):
            config = case.tiny_config()
            params, bank = case.base_params(config), case.make_bank(config)
            opts = case.optimizers(bank)
            plan, per_replica = case.samples_and_plan(STAGES)
            mbs = per_replica[0]
            layers = partition_layers(config.num_layers, STAGES)[rank]
            graphs = None
            if graphed and rank < STAGES - 1:
                graphs = SplitStageGraphs(params=params, bank=bank, config=config, capture=False, layers=layers,
                                          is_first=rank == 0, slots=STAGES - rank)
            stage = DecoderStage(params=params, bank=bank, config=config, layers=layers, is_first=rank == 0,
                                 is_last=rank == STAGES - 1, microbatches=mbs.__getitem__, backend="triton",
                                 graphs=graphs)

            def step(adapter: int, batch: int) -> None:
                opts[adapter].step()
                opts[adapter].zero_grad(set_to_none=True)  # the graphs' static gradients rebind

            actions = build_pipeline_schedule(plan, STAGES)[rank]
            record = run_stage(actions, stage, stage_index=rank, num_stages=STAGES,
                               activation_shape=(case.CAPACITY, config.hidden_size), dtype=torch.float32,
                               device="cpu", optimizer_step=step)
            counts = None if graphs is None else {
                "forwards": graphs.graphed_forwards, "backwards": graphs.graphed_backwards,
                "eager": graphs.eager_microbatches, "refusals": dict(graphs.refusals),
                "slots": max(in_flight_slots(actions).values()) + 1, "microbatches": len(mbs)}
            torch.save({"state": {k: v.detach().clone() for k, v in bank.state_dict().items()},
                        "counts": counts, "F": record.count("F"), "B": record.count("B")},
                       os.path.join(out_dir, f"graphed{int(graphed)}_rank{rank}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def test_stages_before_the_last_train_through_their_split_graph_steps_like_eager():
    """Every rank's adapter weights after 3 global batches of 3 adapters (dropout on one) are
    the eager pipeline's; stages 0 and 1 ran every microbatch's forward and backward through
    their graph steps (one slot per microbatch in flight: 3 and 2), none eagerly."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=STAGES, start_method="spawn")
        runs = {(g, r): torch.load(os.path.join(tmp, f"graphed{g}_rank{r}.pt")) for g in (0, 1) for r in range(STAGES)}
    for rank in range(STAGES):
        eager, graphed = runs[(0, rank)], runs[(1, rank)]
        changed = 0
        for key, value in eager["state"].items():
            torch.testing.assert_close(graphed["state"][key], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {key}")
        initial = case.make_bank(case.tiny_config()).state_dict()
        changed = sum(not torch.equal(v, initial[k]) for k, v in eager["state"].items())
        assert changed > 0
        assert graphed["F"] == eager["F"] and graphed["B"] == eager["B"]
        counts = graphed["counts"]
        if rank == STAGES - 1:
            assert counts is None
            continue
        n = counts["microbatches"]
        assert counts["forwards"] == counts["backwards"] == n and counts["eager"] == 0 and not counts["refusals"]
        assert counts["slots"] == STAGES - rank
