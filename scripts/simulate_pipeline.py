"""Simulated bubble ratio of multi-adapter no-flush pipelines vs flushed 1F1B, plus a timeline PNG.

For each synthetic workload, adapter count and stage count:

- multi-adapter: every adapter's global batches packed together by the planner (greedy, with
  no-op slots for the bubble lemma), scheduled by ``build_pipeline_schedule`` (no flush);
- baseline: each adapter packed and trained alone, one after the other, with plain 1F1B that
  flushes the pipeline at every global batch (``build_1f1b_flushed_schedule``).

Costs come from ``CostModel.from_decoder_config`` for a Llama-3-8B-shaped decoder whose layers are
split by ``partition_decoder``. Usage::

    python scripts/simulate_pipeline.py --png docs/figures/pipeline_timeline.png
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

from lightning_lorafusion.data.synthetic import workload_lengths
from lightning_lorafusion.parallel.partition import partition_decoder
from lightning_lorafusion.parallel.schedule import build_1f1b_flushed_schedule, build_pipeline_schedule
from lightning_lorafusion.parallel.simulator import CostModel, SimulationResult, simulate
from lightning_lorafusion.planner import plan_microbatches

# Llama-3-8B shapes (public config.json of meta-llama/Meta-Llama-3-8B).
LLAMA3_8B = SimpleNamespace(
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, num_hidden_layers=32,
)


def cost_model(num_stages: int, args: argparse.Namespace) -> CostModel:
    stages = partition_decoder(LLAMA3_8B, num_stages)
    return CostModel.from_decoder_config(
        LLAMA3_8B,
        [len(r) for r in stages],
        flops_per_second=args.flops,
        launch_overhead=args.launch_overhead,
        optimizer_step_time=args.step_time,
        p2p_latency=args.p2p_latency,
        p2p_bandwidth=args.p2p_bandwidth,
    )


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


def main() -> None:
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
    p.add_argument("--flops", type=float, default=400e12, help="sustained FLOP/s per GPU")
    p.add_argument("--launch-overhead", type=float, default=2e-4, help="seconds per compute action")
    p.add_argument("--step-time", type=float, default=1e-4, help="seconds per adapter optimizer step")
    p.add_argument("--p2p-latency", type=float, default=2e-5)
    p.add_argument("--p2p-bandwidth", type=float, default=100e9, help="bytes/s between stages")
    p.add_argument("--png", default=None, help="timeline of --png-case to this path")
    p.add_argument("--png-case", nargs=3, default=["mixed", "4", "4"], metavar=("WORKLOAD", "ADAPTERS", "STAGES"))
    args = p.parse_args()

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
