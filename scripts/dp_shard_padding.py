"""Padding cost of dealing global batches to data-parallel replicas (parallel.replica_shards).

Every replica runs the plan of replica 0's slots; a slot costs its group's longest sample on
every replica. Prints the share of planned tokens that are real, per workload, global batch
size and replica count (the rest is compute spent on slot padding).

    PYTHONPATH=. python scripts/dp_shard_padding.py
"""

from __future__ import annotations

import argparse

from lightning_lorafusion.data.synthetic import WORKLOADS, workload_lengths
from lightning_lorafusion.parallel.replica_shards import split_global_batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[16, 64])
    p.add_argument("--replicas", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--batches", type=int, default=16, help="global batches per adapter")
    p.add_argument("--max-length", type=int, default=8192)
    args = p.parse_args()
    print("| workload | global batch | " + " | ".join(f"DP={d}" for d in args.replicas) + " |")
    print("|---|---|" + "---|" * len(args.replicas))
    for workload in WORKLOADS:
        for gbs in args.batch_sizes:
            lengths = workload_lengths(workload, args.adapters, num_batches=args.batches, batch_size=gbs,
                                       seed=0, max_length=args.max_length)
            cells = []
            for dp in args.replicas:
                real = planned = 0
                for batches in lengths:
                    for batch in batches:
                        shards = split_global_batch(list(range(len(batch))), batch, dp)
                        real += sum(batch)
                        planned += dp * sum(batch[i] for i in shards[0])
                cells.append(f"{100 * real / planned:.1f}%")
            print(f"| {workload} | {gbs} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
