"""Benchmark the microbatch planner on the synthetic XSum / CNN-DM / WikiSum / Mixed / Heterogeneous workloads.

For every workload (4 adapters), capacity and pipeline depth S it plans the same global
batches with: naive (each adapter alone, samples packed in arrival order, no padding
sharing), greedy (FFD per wave, no merge), greedy+merge, MILP (two-stage MILP per wave, no
merge), MILP+merge (the wave packers alone, ``knapsack=False``) and the full planner (MILP+merge
or the in-order knapsack plan, whichever is shorter: the default), and reports microbatch count, fill ratio (real tokens /
(microbatches x capacity), no-op slots included), planning time per global batch (one
cycle: one global batch of every adapter), the share of waves where the MILP packing was kept, and
the GPU time of one cycle at ``--gpu-tokens-per-s``. It can also compare CBC and HiGHS and
draws one PNG per workload: per-microbatch fill, greedy vs MILP+merge.

    python scripts/bench_planner.py --out docs/figures --json bench_planner.json
    python scripts/bench_planner.py --quick            # a smoke run (one capacity, S=1)
"""

from __future__ import annotations

import argparse
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import harness  # noqa: F401  (puts the repository on sys.path)

from lightning_lorafusion.data.synthetic import WORKLOADS, workload_lengths
from lightning_lorafusion.planner import Plan, PlannerConfig, plan_window, verify_plan
from lightning_lorafusion.planner.plan import padded_length


def naive_microbatches(lengths, capacity: int, pad_multiple: int) -> int:
    """Sequential single-adapter packing: samples in arrival order, one adapter per microbatch."""
    count = 0
    for batches in lengths:
        for batch in batches:
            used = None
            for n in batch:
                if used is None or padded_length(used + n, pad_multiple) > capacity:
                    count += 1
                    used = 0
                used += n
    return count


def fill(plan: Plan) -> float:
    real = sum(mb.real_tokens() for mb in plan.microbatches)
    return real / (len(plan.microbatches) * plan.capacity)


def run_case(lengths, *, capacity, pad, stages, solver, time_limit, max_nodes):
    cycles = max(len(b) for b in lengths)
    real = sum(n for bs in lengths for b in bs for n in b)
    naive = naive_microbatches(lengths, capacity, pad)
    row = {
        "cycles": cycles,
        "real_tokens": real,
        "naive_mbs": naive,
        "naive_fill": real / (naive * capacity),
        # No plan can use fewer microbatches than the real tokens need (padding ignored).
        "bound_mbs": -(-real // capacity),
        # The most microbatches a plan may have and still be >= 97% full.
        "max_mbs_97": int(real // (0.97 * capacity)),
    }
    variants = {
        "greedy": dict(method="greedy", merge=False, knapsack=False),
        "greedy_merge": dict(method="greedy", merge=True, knapsack=False),
        "milp": dict(method="milp", merge=False, knapsack=False),
        "milp_merge": dict(method="milp", merge=True, knapsack=False),
        "planner": dict(method="milp", merge=True, knapsack=True),
    }
    plans = {}
    for name, kw in variants.items():
        cfg = PlannerConfig(
            capacity=capacity, pad_multiple=pad, num_stages=stages, solver=solver,
            time_limit=time_limit, max_nodes=max_nodes, **kw,
        )
        t0 = time.perf_counter()
        plan, report = plan_window(lengths, cfg)
        dt = time.perf_counter() - t0
        problems = verify_plan(plan, lengths)
        assert not problems, problems
        plans[name] = plan
        row[f"{name}_mbs"] = len(plan.microbatches)
        row[f"{name}_noops"] = report.noops
        row[f"{name}_fill"] = fill(plan)
        row[f"{name}_s_per_cycle"] = dt / cycles
        if kw["method"] == "milp":
            row[f"{name}_wave_wins"] = sum(w.method == "milp" for w in report.waves)
            row[f"{name}_waves"] = len(report.waves)
            row[f"{name}_used"] = report.used
            row[f"{name}_knapsack_mbs"] = report.knapsack_microbatches
            row[f"{name}_proven"] = sum(
                w.stage2_status in ("OPTIMAL", "skipped") and w.stage1_status in ("OPTIMAL", "skipped")
                for w in report.waves
            )
        row["groups"] = [list(g) for g in report.groups]
    return row, plans


def draw(workload, plans, capacity, stages, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(12, 6), sharey=True)
    colors = plt.get_cmap("tab10")
    for ax, name, title in zip(axes, ("greedy", "planner"), ("greedy (FFD per wave)", "planner (default)")):
        plan = plans[name]
        for i, mb in enumerate(plan.microbatches):
            bottom = 0.0
            for a in mb.adapters():
                real = sum(s.length for s in mb.samples if s.adapter == a)
                ax.bar(i, real / capacity, bottom=bottom, color=colors(a), width=0.85)
                bottom += real / capacity
                pad = (padded_length(real, plan.pad_multiple) - real) / capacity
                ax.bar(i, pad, bottom=bottom, color="lightgrey", width=0.85)
                bottom += pad
            if mb.is_noop:
                ax.bar(i, 0.02, color="black", width=0.85)
        steps = sorted(set(plan.step_points.values()))
        for s in steps:
            ax.axvline(s + 0.5, color="black", alpha=0.15, linewidth=0.6)
        ax.axhline(1.0, color="red", linewidth=0.8)
        ax.set_title(f"{title}: {len(plan.microbatches)} microbatches, fill {fill(plan):.1%}", fontsize=10)
        ax.set_ylabel("tokens / capacity")
        ax.set_ylim(0, 1.05)
    axes[-1].set_xlabel("microbatch (colours: adapters; grey: padding; thin lines: step points)")
    fig.suptitle(f"{workload}: 4 adapters, capacity {capacity}, S={stages}")
    fig.tight_layout()
    path = f"{out_dir}/planner_{workload}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--batches", type=int, default=8, help="global batches per adapter (one planning window)")
    ap.add_argument("--batch-size", type=int, default=16, help="samples per global batch")
    ap.add_argument("--pad-multiple", type=int, default=128, help="kernel block multiple (kernels/block_sizes.py)")
    ap.add_argument("--capacities", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--solvers", nargs="+", default=["highs"], help="highs and/or cbc")
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--max-nodes", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu-tokens-per-s", type=float, default=10_000.0)
    ap.add_argument("--out", default=None, help="directory for planner_<workload>.png")
    ap.add_argument("--plot-capacity", type=int, default=8192)
    ap.add_argument("--plot-stages", type=int, default=1)
    ap.add_argument("--json", default=None, help="write all rows here")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.capacities, args.stages, args.batches = [8192], [1], 2

    rows = []
    print(f"# bench_planner {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.processor() or platform.machine()}")
    print(
        "| workload | C | S | solver | bound | max for 97% | naive | greedy | greedy+merge | MILP | MILP+merge | knapsack | "
        "planner | used | noops | fill naive/greedy/MILP+merge/planner | s/cycle greedy | s/cycle planner | GPU s/cycle | MILP wave wins |"
    )
    print("|" + "---|" * 20)
    for workload in args.workloads:
        for capacity in args.capacities:
            lengths = workload_lengths(
                workload, args.adapters, num_batches=args.batches, batch_size=args.batch_size,
                seed=args.seed, max_length=capacity,
            )
            for stages in args.stages:
                for solver in args.solvers:
                    row, plans = run_case(
                        lengths, capacity=capacity, pad=args.pad_multiple, stages=stages, solver=solver,
                        time_limit=args.time_limit, max_nodes=args.max_nodes,
                    )
                    row.update(workload=workload, capacity=capacity, stages=stages, solver=solver)
                    gpu = row["real_tokens"] / row["cycles"] / args.gpu_tokens_per_s
                    row["gpu_s_per_cycle"] = gpu
                    rows.append(row)
                    print(
                        f"| {workload} | {capacity} | {stages} | {solver} | {row['bound_mbs']} | {row['max_mbs_97']} | "
                        f"{row['naive_mbs']} | {row['greedy_mbs']} | "
                        f"{row['greedy_merge_mbs']} | {row['milp_mbs']} | {row['milp_merge_mbs']} | "
                        f"{row['planner_knapsack_mbs']} | **{row['planner_mbs']}** | {row['planner_used']} | "
                        f"{row['planner_noops']} | {row['naive_fill']:.1%} / {row['greedy_fill']:.1%} / "
                        f"{row['milp_merge_fill']:.1%} / **{row['planner_fill']:.1%}** | {row['greedy_s_per_cycle']:.3f} | "
                        f"{row['planner_s_per_cycle']:.2f} | {gpu:.1f} | "
                        f"{row['milp_merge_wave_wins']}/{row['milp_merge_waves']} |",
                        flush=True,
                    )
                    if args.out and capacity == args.plot_capacity and stages == args.plot_stages and solver == args.solvers[0]:
                        draw(workload, plans, capacity, stages, args.out)
    if args.json:
        path = Path(args.json).resolve()
        harness.write_json(path.parent, path.name, rows)
    return rows


if __name__ == "__main__":
    main()
