"""Simulated bubble ratio of multi-adapter no-flush pipelines vs flushed 1F1B, plus a timeline PNG.

For each synthetic workload, adapter count and stage count:

- multi-adapter: every adapter's global batches packed together by the planner (greedy, with
  no-op slots for the bubble lemma), scheduled by ``build_pipeline_schedule`` (no flush);
- baseline: each adapter packed and trained alone, one after the other, with plain 1F1B that
  flushes the pipeline at every global batch (``build_1f1b_flushed_schedule``).

Costs come from ``CostModel.timed`` (``--cost time``, the default: GEMMs at a rate plus memory-bound
traffic, the LM head on ``--label-fraction`` of the tokens) or ``CostModel.from_decoder_config``
(``--cost flops``, at ``--flops``) for a Llama-3-8B-shaped decoder whose layers are split by
``partition_decoder`` with the same cost model, or as ``--stage-layers`` gives them. Usage::

    PYTHONPATH=. python scripts/simulate_pipeline.py --png docs/figures/pipeline_timeline.png

``--measure`` instead runs the real executor on random weights (an 8B-shaped model on CUDA,
``--tiny`` for a CPU smoke run with gloo) in three layouts, one GPU, PP=2 and DP=2, and reports
tokens/s, the measured bubble ratio of PP=2 and the simulator's prediction from a cost model
fitted to the one-GPU run's forward/backward times::

    PYTHONPATH=. python scripts/simulate_pipeline.py --measure --out measure.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from types import SimpleNamespace

import harness  # noqa: F401  (puts the repository on sys.path)

from lightning_lorafusion.data.synthetic import workload_lengths
from lightning_lorafusion.parallel.executor import measured_bubble_ratio
from lightning_lorafusion.parallel.partition import partition_decoder
from lightning_lorafusion.parallel.schedule import build_1f1b_flushed_schedule, build_pipeline_schedule
from lightning_lorafusion.parallel.cost_model import CostModel
from lightning_lorafusion.parallel.simulator import SimulationResult, simulate
from lightning_lorafusion.planner import plan_microbatches

# Llama-3-8B shapes (public config.json of meta-llama/Meta-Llama-3-8B).
LLAMA3_8B = SimpleNamespace(
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, num_hidden_layers=32,
)


def cost_model(num_stages: int, args: argparse.Namespace) -> CostModel:
    given = args.stage_layers if args.stage_layers and len(args.stage_layers) == num_stages else None
    stages = partition_decoder(LLAMA3_8B, num_stages, stage_layers=given, cost=args.cost,
                               label_fraction=args.label_fraction)
    common = dict(launch_overhead=args.launch_overhead, optimizer_step_time=args.step_time,
                  p2p_latency=args.p2p_latency, p2p_bandwidth=args.p2p_bandwidth)
    counts = [len(r) for r in stages]
    if args.cost == "flops":
        return CostModel.from_decoder_config(LLAMA3_8B, counts, flops_per_second=args.flops, **common)
    return CostModel.timed(LLAMA3_8B, counts, label_fraction=args.label_fraction, **common)


def run_case(workload: str, adapters: int, num_stages: int, args: argparse.Namespace):
    lengths = workload_lengths(
        workload, adapters, num_batches=args.batches, batch_size=args.batch_size, seed=args.seed,
        max_length=args.capacity,
    )
    costs = cost_model(num_stages, args)
    plan = plan_microbatches(
        lengths, capacity=args.capacity, pad_multiple=args.pad_multiple, num_stages=num_stages,
        method="greedy",
    )
    fused = simulate(plan, build_pipeline_schedule(plan, num_stages), costs)
    # Baseline: adapters one after another, each alone, flushed at each global batch.
    makespan = 0.0
    busy = [0.0] * num_stages
    baseline_timeline = []
    for a in range(adapters):
        alone = plan_microbatches(
            [lengths[a]], capacity=args.capacity, pad_multiple=args.pad_multiple, num_stages=1,
            method="greedy",
        )
        r = simulate(alone, build_1f1b_flushed_schedule(alone, num_stages), costs)
        baseline_timeline += [(s, k, a if k == "S" else -1 - a, t0 + makespan, t1 + makespan)
                              for s, k, _, t0, t1 in r.timeline]
        makespan += r.makespan
        busy = [b + rb for b, rb in zip(busy, r.busy)]
    flushed = SimulationResult(
        makespan=makespan, busy=tuple(busy), max_in_flight=(), timeline=tuple(baseline_timeline)
    )
    noops = sum(mb.is_noop for mb in plan.microbatches)
    return plan, fused, flushed, noops


def draw_timeline(path: str, plan, fused: SimulationResult, flushed: SimulationResult, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colours = plt.get_cmap("tab10").colors
    horizon = max(fused.makespan, flushed.makespan)
    fig, axes = plt.subplots(2, 1, figsize=(14, 5.5), sharex=True)
    for ax, result, name in ((axes[0], fused, "multi-adapter, no flush"),
                             (axes[1], flushed, "one adapter at a time, 1F1B flushed per global batch")):
        for stage, kind, label, t0, t1 in result.timeline:
            if kind == "S" or t1 <= t0:
                continue
            y = result.num_stages - 1 - stage
            if label >= 0:  # a planned microbatch: split the bar by each adapter's token share
                mb = plan.microbatches[label]
                share: dict[int, int] = {}
                for s in mb.samples:
                    share[s.adapter] = share.get(s.adapter, 0) + s.length
                total = sum(share.values())
                bottom = y - 0.4
                for a, tokens in sorted(share.items()):
                    h = 0.8 * tokens / total
                    ax.broken_barh([(t0 * 1e3, (t1 - t0) * 1e3)], (bottom, h), color=colours[a % 10],
                                   alpha=1.0 if kind == "F" else 0.55)
                    bottom += h
            else:  # baseline rows carry the adapter as -1 - adapter
                ax.broken_barh([(t0 * 1e3, (t1 - t0) * 1e3)], (y - 0.4, 0.8), color=colours[(-1 - label) % 10],
                               alpha=1.0 if kind == "F" else 0.55)
        ax.set_yticks(range(result.num_stages))
        ax.set_yticklabels([f"stage {s}" for s in reversed(range(result.num_stages))])
        ax.set_xlim(0, horizon * 1e3)
        ax.set_title(f"{name}: makespan {result.makespan * 1e3:.0f} ms, bubbles {100 * result.bubble_ratio:.1f}%",
                     fontsize=10)
    axes[1].set_xlabel("time (ms); dark = forward, light = backward")
    n_adapters = len({s.adapter for mb in plan.microbatches for s in mb.samples})
    axes[0].legend(handles=[Patch(color=colours[a % 10], label=f"adapter {a}") for a in range(n_adapters)],
                   loc="upper right", fontsize=8, ncol=n_adapters)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- measurement

def measure_config(args: argparse.Namespace):
    from lightning_lorafusion.model.decoder import DecoderConfig

    if args.tiny:
        return DecoderConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
                             num_heads=4, num_kv_heads=2, head_dim=16)
    return DecoderConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                         num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0)


def measure_lengths(args: argparse.Namespace, data_parallel: int):
    """Per adapter and global batch; DP replicas each get half of every global batch (the same
    lengths on both, so both replicas run one plan with one step order)."""
    lengths = workload_lengths(args.workload, args.measure_adapters, num_batches=args.measure_batches,
                               batch_size=args.batch_size, seed=args.seed, max_length=args.capacity)
    if data_parallel > 1:
        lengths = [[b[: len(b) // data_parallel] for b in batches] for batches in lengths]
    return lengths


def _measure_microbatches(args: argparse.Namespace, plan, lengths, config, num_adapters: int, replica: int,
                          dp: int, device) -> dict:
    """The plan's microbatches packed from random token ids (seeded per replica), on ``device``."""
    import torch

    from lightning_lorafusion.data.packing import PackingConfig, SampleLookup, pack_microbatch

    g = torch.Generator().manual_seed(100 + replica)
    datasets = [[SimpleNamespace(input_ids=(ids := torch.randint(0, config.vocab_size, (n,), generator=g).tolist()),
                                 labels=ids[1:] + [-100])
                 for batch in per_adapter for n in batch] for per_adapter in lengths]
    batches = []
    for per_adapter in lengths:
        k, idx = 0, []
        for batch in per_adapter:
            idx.append(list(range(k, k + len(batch))))
            k += len(batch)
        batches.append(idx)
    lookup = SampleLookup(datasets, batches)
    dens = {(a, j): lookup.label_tokens(a, j) * dp for a in range(len(lengths)) for j in range(len(lengths[a]))}
    packing = PackingConfig(capacity=args.capacity, pad_multiple=args.pad_multiple)
    return {i: pack_microbatch(mb, lookup, config=packing, num_adapters=num_adapters, denominators=dens,
                               step_adapters=(), index=i).to(device)
            for i, mb in enumerate(plan.microbatches) if not mb.is_noop}


def _measure_worker(rank: int, world: int, mode: str, args: argparse.Namespace, init_file: str,
                    out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from lightning_lorafusion.model.adapter_bank import AdapterBank
    from lightning_lorafusion.model.random_model import random_base_params
    from lightning_lorafusion.parallel.data_parallel import (
        ParallelLayout, allreduce_adapter_grads, build_data_parallel_groups, check_same_step_order)
    from lightning_lorafusion.parallel.executor import run_stage
    from lightning_lorafusion.parallel.stage import DecoderStage
    from lightning_lorafusion.specs import AdapterSpec

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world)
    try:
        pp = 2 if mode == "pp2" else 1
        dp = world // pp
        layout = ParallelLayout(pipeline_size=pp, data_parallel_size=dp)
        groups = build_data_parallel_groups(layout)
        stage_index, replica = layout.stage_of(rank), layout.replica_of(rank)
        config = measure_config(args)
        dtype = torch.bfloat16 if cuda else torch.float32
        layers = partition_decoder(config, pp)[stage_index]
        first, last = stage_index == 0, stage_index == pp - 1
        params = random_base_params(config, layers, is_first=first, is_last=last, device=device, dtype=dtype)
        specs = [AdapterSpec(name=f"a{k}", rank=16, alpha=32.0, seed=k, lr=1e-4)
                 for k in range(args.measure_adapters)]
        bank = AdapterBank(specs, config, dtype=dtype, device=device)
        opts = [torch.optim.AdamW(bank.parameters_of(a), lr=1e-4) for a in range(bank.num_adapters)]
        lengths = measure_lengths(args, dp)
        plan = plan_microbatches(lengths, capacity=args.capacity, pad_multiple=args.pad_multiple,
                                 num_stages=pp, method="greedy")
        mbs = _measure_microbatches(args, plan, lengths, config, len(specs), replica, dp, device)
        stage = DecoderStage(params=params, bank=bank, config=config, layers=layers, is_first=first,
                             is_last=last, microbatches=mbs.__getitem__, backend=args.lora_backend)
        dp_group = groups[stage_index]

        def step(adapter: int, batch: int) -> None:
            mine = [p for layer in layers for p in bank.adapters[adapter][layer].parameters()]
            allreduce_adapter_grads(mine, dp_group)
            opts[adapter].step()
            opts[adapter].zero_grad(set_to_none=True)

        actions = build_pipeline_schedule(plan, pp)[stage_index]
        check_same_step_order(actions, dp_group)
        sync = torch.cuda.synchronize if cuda else None
        kwargs = dict(stage_index=stage_index, num_stages=pp, activation_shape=(args.capacity, config.hidden_size),
                      dtype=dtype, device=device, optimizer_step=step,
                      stage_ranks=layout.pipeline_ranks(replica), synchronize=sync)
        dist.barrier()
        run_stage(actions, stage, **kwargs)  # warm-up: allocator, cuBLAS/flash/Triton selection
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        record = run_stage(actions, stage, **kwargs)
        result = {
            "mode": mode, "rank": rank, "stage": stage_index, "replica": replica, "plan": plan.to_json(),
            "layers": [layers.start, layers.stop], "wall": record.wall, "busy": record.busy,
            "events": record.events,
            "real_tokens": sum(mb.real_tokens() for mb in plan.microbatches) if first else 0,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
            "device": harness.device_info(device)["device_name"],
        }
        with open(os.path.join(out_dir, f"{mode}_rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _backward_ratio(fwd: dict, bwd: dict, intercept: float) -> float:
    """Median of backward / forward time above the per-launch overhead, never negative.

    On a tiny model the times are mostly noise and a backward can be shorter than the fitted
    overhead; the ratio of the plain times is used then.
    """
    import numpy as np

    ratio = float(np.median([(bwd[i] - intercept) / max(fwd[i] - intercept, 1e-9) for i in fwd]))
    if ratio <= 0:
        ratio = float(np.median([bwd[i] / max(fwd[i], 1e-9) for i in fwd]))
    return ratio


def _fit_cost_model(args: argparse.Namespace, one: dict, num_stages: int) -> CostModel:
    """Fit forward seconds = overhead + FLOPs / rate on the one-GPU run; backward as a ratio."""
    import numpy as np

    config = measure_config(args)
    plan = plan_microbatches(measure_lengths(args, 1), capacity=args.capacity,
                             pad_multiple=args.pad_multiple, num_stages=1, method="greedy")
    unit = CostModel.from_decoder_config(config, (config.num_layers,), flops_per_second=1.0)
    flops = {i: unit.forward_time(0, mb.padded_tokens(args.pad_multiple), sum(s.length ** 2 for s in mb.samples))
             for i, mb in enumerate(plan.microbatches) if not mb.is_noop}
    fwd = {i: t1 - t0 for kind, i, t0, t1 in one["events"] if kind == "F"}
    bwd = {i: t1 - t0 for kind, i, t0, t1 in one["events"] if kind == "B"}
    steps = [t1 - t0 for kind, _, t0, t1 in one["events"] if kind == "S"]
    x = np.array([flops[i] for i in fwd])
    y = np.array([fwd[i] for i in fwd])
    slope, intercept = np.polyfit(x, y, 1) if len(set(x.tolist())) > 1 else (y.mean() / x.mean(), 0.0)
    if slope <= 0:  # times do not grow with FLOPs (noise dominates, e.g. a tiny model): a pure rate
        slope, intercept = y.mean() / x.mean(), 0.0
    intercept = max(float(intercept), 0.0)
    ratio = _backward_ratio(fwd, bwd, intercept)
    stages = partition_decoder(config, num_stages)
    return CostModel.from_decoder_config(
        config, [len(r) for r in stages], flops_per_second=1.0 / float(slope),
        launch_overhead=intercept / num_stages, backward_factor=ratio,
        optimizer_step_time=float(np.mean(steps)) if steps else 0.0,
    )


def measure_main(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    results: dict[str, list[dict]] = {}
    for mode in args.modes:
        world = 1 if mode == "one" else 2
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            mp.start_processes(_measure_worker, args=(world, mode, args, os.path.join(tmp, "init"), tmp),
                               nprocs=world, start_method="spawn")
            results[mode] = [json.load(open(os.path.join(tmp, f"{mode}_rank{r}.json"))) for r in range(world)]
            print(f"{mode}: done in {time.perf_counter() - t0:.1f} s", flush=True)
    summary: dict[str, object] = {"device": results[args.modes[0]][0]["device"], "workload": args.workload,
                                  "adapters": args.measure_adapters, "global_batches": args.measure_batches,
                                  "batch_size": args.batch_size, "capacity": args.capacity,
                                  "pad_multiple": args.pad_multiple, "seed": args.seed, "tiny": args.tiny}
    print("| layout | wall s | real tokens | tokens/s | per-rank busy s | peak GiB |")
    print("|---|---|---|---|---|---|")
    for mode, ranks in results.items():
        wall = max(r["wall"] for r in ranks)
        tokens = sum(r["real_tokens"] for r in ranks)
        summary[mode] = {"wall": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                         "busy": [r["busy"] for r in ranks], "peak_gib": [r["peak_gib"] for r in ranks]}
        busy = ", ".join(f"{r['busy']:.2f}" for r in ranks)
        peak = ", ".join(f"{r['peak_gib']:.1f}" for r in ranks)
        print(f"| {mode} | {wall:.2f} | {tokens} | {tokens / wall:,.0f} | "
              f"{busy} | {peak} |")
    if "pp2" in results and "one" in results:
        ranks = sorted(results["pp2"], key=lambda r: r["stage"])
        wall = max(r["wall"] for r in ranks)
        measured = measured_bubble_ratio([(r["busy"], r["wall"]) for r in ranks])
        costs = _fit_cost_model(args, results["one"][0], 2)
        plan = plan_microbatches(measure_lengths(args, 1), capacity=args.capacity,
                                 pad_multiple=args.pad_multiple, num_stages=2, method="greedy")
        predicted = simulate(plan, build_pipeline_schedule(plan, 2), costs)
        summary["pp2_bubble_measured"] = measured
        summary["pp2_bubble_simulated"] = predicted.bubble_ratio
        summary["pp2_makespan_simulated"] = predicted.makespan
        summary["fitted_cost_model"] = {"flops_per_second": costs.flops_per_second,
                                        "launch_overhead": costs.launch_overhead,
                                        "backward_factor": costs.backward_factor}
        one = summary["one"]["tokens_per_s"]
        print(f"\nPP=2 bubble: measured {100 * measured:.1f}%, simulated {100 * predicted.bubble_ratio:.1f}% "
              f"(cost model fitted on the one-GPU run: {costs.flops_per_second / 1e12:.0f} TFLOP/s, "
              f"backward x{costs.backward_factor:.2f}); makespan measured {wall:.2f} s, simulated "
              f"{predicted.makespan:.2f} s")
        for mode in ("pp2", "dp2"):
            if mode in summary:
                print(f"{mode} / one GPU tokens/s: {summary[mode]['tokens_per_s'] / one:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "runs": results}, f)
        print(f"wrote {args.out}")


def plot_measured(path_json: str, png: str) -> None:
    """Measured PP=2 timeline (executor timestamps) above the simulated one (fitted costs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lightning_lorafusion.planner import Plan

    d = json.load(open(path_json))
    ranks = sorted(d["runs"]["pp2"], key=lambda r: r["stage"])
    summary = d["summary"]
    fitted = summary["fitted_cost_model"]
    one_steps = [t1 - t0 for kind, _, t0, t1 in d["runs"]["one"][0]["events"] if kind == "S"]
    if "plan" in ranks[0]:
        plan = Plan.from_json(ranks[0]["plan"])
    else:  # runs before plans were recorded: rebuild with the recorded settings
        lengths = workload_lengths(summary["workload"], summary["adapters"], num_batches=summary["global_batches"],
                                   batch_size=summary["batch_size"], seed=summary.get("seed", 0),
                                   max_length=summary["capacity"])
        plan = plan_microbatches(lengths, capacity=summary["capacity"],
                                 pad_multiple=summary.get("pad_multiple", 64), num_stages=2,
                                 method="greedy")
    config = measure_config(SimpleNamespace(tiny=summary.get("tiny", False)))
    costs = CostModel.from_decoder_config(
        config, [r["layers"][1] - r["layers"][0] for r in ranks], flops_per_second=fitted["flops_per_second"],
        launch_overhead=fitted["launch_overhead"], backward_factor=fitted["backward_factor"],
        optimizer_step_time=sum(one_steps) / max(len(one_steps), 1),
    )
    simulated = simulate(plan, build_pipeline_schedule(plan, 2), costs)
    fig, axes = plt.subplots(2, 1, figsize=(14, 3.8), sharex=True)
    rows = [[(r["stage"], kind, i, t0, t1) for kind, i, t0, t1 in r["events"] if kind in "FB"] for r in ranks]
    measured_wall = max(r["wall"] for r in ranks)
    measured_ratio = summary["pp2_bubble_measured"]
    for ax, timeline, name in (
        (axes[0], [x for row in rows for x in row], f"measured on {summary['device']} x2: "
         f"{measured_wall:.2f} s, bubbles {100 * measured_ratio:.1f}%"),
        (axes[1], [x for x in simulated.timeline if x[1] in "FB"], f"simulated (cost model fitted on the "
         f"one-GPU run): {simulated.makespan:.2f} s, bubbles {100 * simulated.bubble_ratio:.1f}%"),
    ):
        for stage, kind, _, t0, t1 in timeline:
            ax.broken_barh([(t0, t1 - t0)], (1 - stage - 0.4, 0.8),
                           color="tab:blue" if kind == "F" else "tab:orange")
        ax.set_yticks([0, 1])
        ax.set_yticklabels(["stage 1", "stage 0"])
        ax.set_title(name, fontsize=10)
    axes[1].set_xlabel("time (s); blue = forward, orange = backward; gaps = idle")
    model = "tiny" if summary.get("tiny") else "8B-shaped"
    fig.suptitle(f"PP=2, {summary['adapters']} adapters, {summary['workload']}, {model} random weights", fontsize=11)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    print(f"timeline: {png}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+",
                   default=["xsum", "cnn_dailymail", "wikisum", "mixed", "heterogeneous"])
    p.add_argument("--adapters", nargs="+", type=int, default=[1, 2, 3, 4])
    p.add_argument("--stages", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--batches", type=int, default=8, help="global batches per adapter")
    p.add_argument("--batch-size", type=int, default=16, help="samples per global batch")
    p.add_argument("--capacity", type=int, default=4096, help="tokens per microbatch")
    p.add_argument("--pad-multiple", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cost", choices=["time", "flops"], default="time",
                   help="cost model of the split and the simulation (see the module doc)")
    p.add_argument("--label-fraction", type=float, default=0.25,
                   help="share of tokens with a label (the LM head's rows), --cost time")
    p.add_argument("--stage-layers", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="layers per stage, e.g. 17,15 (used where --stages matches its length)")
    p.add_argument("--flops", type=float, default=400e12, help="sustained FLOP/s per GPU (--cost flops)")
    p.add_argument("--launch-overhead", type=float, default=2e-4, help="seconds per compute action")
    p.add_argument("--step-time", type=float, default=1e-4, help="seconds per adapter optimizer step")
    p.add_argument("--p2p-latency", type=float, default=2e-5)
    p.add_argument("--p2p-bandwidth", type=float, default=100e9, help="bytes/s between stages")
    p.add_argument("--png", default=None, help="timeline of --png-case to this path")
    p.add_argument("--png-case", nargs=3, default=["mixed", "4", "4"], metavar=("WORKLOAD", "ADAPTERS", "STAGES"))
    p.add_argument("--measure", action="store_true", help="run the real executor instead (see module doc)")
    p.add_argument("--modes", nargs="+", default=["one", "pp2", "dp2"], choices=["one", "pp2", "dp2"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke run)")
    p.add_argument("--workload", default="xsum")
    p.add_argument("--measure-adapters", type=int, default=4)
    p.add_argument("--measure-batches", type=int, default=4)
    p.add_argument("--lora-backend", default="torch", choices=["torch", "triton", "auto"])
    p.add_argument("--out", default=None, help="JSON with every rank's events (--measure)")
    p.add_argument("--plot-measured", default=None, metavar="JSON",
                   help="draw the PP=2 run of a --measure JSON (to --png) and exit")
    args = p.parse_args(argv)
    if args.plot_measured:
        plot_measured(args.plot_measured, args.png or "pipeline_measured_pp2.png")
        return
    if args.measure:
        measure_main(args)
        return

    print("| workload | adapters | stages | microbatches (no-op) | no-flush bubble | flushed 1F1B bubble | speed-up |")
    print("|---|---|---|---|---|---|---|")
    started = time.perf_counter()
    for workload in args.workloads:
        for n in args.adapters:
            for s in args.stages:
                plan, fused, flushed, noops = run_case(workload, n, s, args)
                print(f"| {workload} | {n} | {s} | {len(plan.microbatches)} ({noops}) | "
                      f"{100 * fused.bubble_ratio:.1f}% | {100 * flushed.bubble_ratio:.1f}% | "
                      f"{flushed.makespan / fused.makespan:.2f}x |", flush=True)
    print(f"\n({time.perf_counter() - started:.1f} s)")
    if args.png:
        workload, n, s = args.png_case[0], int(args.png_case[1]), int(args.png_case[2])
        plan, fused, flushed, _ = run_case(workload, n, s, args)
        draw_timeline(args.png, plan, fused, flushed,
                      f"{workload}, {n} adapters, {s} stages, Llama-3-8B-shaped costs (simulated)")
        print(f"timeline: {args.png}")


if __name__ == "__main__":
    main()
