"""What draining the pipeline once per epoch costs: two epochs as two windows vs one stream.

`fit` under MultiAdapterPipelineStrategy runs each epoch as one planned window, so the
pipeline fills and drains once per epoch. This simulates, for the Llama-3-8B-shaped cost model
of simulate_pipeline.py, two epochs planned and run separately against the same global batches
as one continuous stream, and prints the makespan difference.

    PYTHONPATH=. python scripts/simulate_epoch_drain.py
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from simulate_pipeline import cost_model  # noqa: E402

from lightning_lorafusion.data.synthetic import workload_lengths  # noqa: E402
from lightning_lorafusion.parallel.schedule import build_pipeline_schedule  # noqa: E402
from lightning_lorafusion.parallel.simulator import simulate  # noqa: E402
from lightning_lorafusion.planner import plan_microbatches  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["xsum", "mixed"])
    p.add_argument("--stages", nargs="+", type=int, default=[2, 4])
    p.add_argument("--batches", nargs="+", type=int, default=[4, 16], help="global batches per adapter per epoch")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--capacity", type=int, default=8192)
    p.add_argument("--pad-multiple", type=int, default=128)
    p.add_argument("--flops", type=float, default=400e12)
    p.add_argument("--launch-overhead", type=float, default=2e-4)
    p.add_argument("--step-time", type=float, default=1e-4)
    p.add_argument("--p2p-latency", type=float, default=2e-5)
    p.add_argument("--p2p-bandwidth", type=float, default=100e9)
    args = p.parse_args()
    print("| workload | stages | global batches / adapter / epoch | microbatches / epoch | "
          "bubble, one epoch | drain per epoch vs one stream |")
    print("|---|---|---|---|---|---|")
    for workload in args.workloads:
        for stages in args.stages:
            costs = cost_model(stages, args)
            for n in args.batches:
                lengths = workload_lengths(workload, args.adapters, num_batches=2 * n,
                                           batch_size=args.batch_size, seed=0, max_length=args.capacity)

                def plan(ls):
                    return plan_microbatches(ls, capacity=args.capacity, pad_multiple=args.pad_multiple,
                                             num_stages=stages, method="greedy")

                epochs = [plan([b[e * n:(e + 1) * n] for b in lengths]) for e in range(2)]
                runs = [simulate(q, build_pipeline_schedule(q, stages), costs) for q in epochs]
                whole = plan(lengths)
                stream = simulate(whole, build_pipeline_schedule(whole, stages), costs).makespan
                per_epoch = sum(r.makespan for r in runs)
                print(f"| {workload} | {stages} | {n} | {len(epochs[0].microbatches)} | "
                      f"{100 * runs[0].bubble_ratio:.1f}% | +{100 * (per_epoch / stream - 1):.1f}% |")


if __name__ == "__main__":
    main()
