"""Token-capacity profile of our training step on one device (what ``data.capacity: auto`` does
inside ``fit``, here on bench_e2e's random-weight shapes and synthetic workloads).

For each candidate capacity C: plan the workload's samples into C-token microbatches (greedy),
time forward + backward of the two fullest packed microbatches after a warm-up call, record
peak memory, and report real tokens/s = fill x C / time. The choice rule is
``lightning_lorafusion.training.capacity.choose_capacity``.

    PYTHONPATH=. python scripts/profile_capacity.py --shape llama8b --layers 32 --workload xsum \
        --candidates 2048,4096,8192,16384 --out $OUT
    PYTHONPATH=. python scripts/profile_capacity.py --shape tiny --layers 2 --device cpu \
        --backend torch --candidates 2048,4096           # CPU smoke run
"""

from __future__ import annotations

import argparse

from harness import add_output_args, device_info, write_json

import torch  # noqa: E402
from bench_e2e import OursSetup, add_workload_args, model_and_workload  # noqa: E402

from lightning_lorafusion.data.packing import PackingConfig, pack_microbatch  # noqa: E402
from lightning_lorafusion.model.decoder import forward_loss_sums  # noqa: E402
from lightning_lorafusion.parallel.stage import adapter_loss  # noqa: E402
from lightning_lorafusion.planner import plan_microbatches  # noqa: E402
from lightning_lorafusion.training.capacity import (  # noqa: E402
    choose_capacity,
    device_memory_limit,
    format_probes,
    probe_capacities,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, layers=32)
    ap.add_argument("--candidates", default="2048,4096,8192,16384")
    ap.add_argument("--backend", default="triton", choices=["torch", "triton"])
    ap.add_argument("--memory-fraction", type=float, default=0.9)
    add_output_args(ap)
    args = ap.parse_args()
    device, dtype, _, model, data = model_and_workload(args)
    w = OursSetup(args, model, data, device, dtype)
    lengths, lookup, dens, bank = w.lengths, w.lookup, w.denominators, w.bank

    def prepare(capacity: int):
        plan = plan_microbatches(lengths, capacity=capacity, pad_multiple=args.pad_multiple, method="greedy")
        fill = sum(p.real_tokens() for p in plan.microbatches) / (len(plan.microbatches) * capacity)
        real = sorted(((p.real_tokens(), i) for i, p in enumerate(plan.microbatches) if not p.is_noop),
                      key=lambda t: (-t[0], t[1]))[:2]
        cfg = PackingConfig(capacity=capacity, pad_multiple=args.pad_multiple)
        mbs = [pack_microbatch(plan.microbatches[i], lookup, config=cfg, num_adapters=len(w.specs),
                               denominators=dens, step_adapters=(), index=i).to(device) for _, i in real]
        return fill, mbs

    lora = list(bank.parameters())

    def step(mb) -> None:
        routing = bank.routing(mb.segments, mb.index, mb.capacity)
        sums = forward_loss_sums(w.params, bank.view(), mb.input_ids, mb.labels, mb.position_ids, mb.cu_seqlens,
                                 routing, config=w.config, backend=args.backend,
                                 max_seqlen=mb.max_seqlen, label_rows=mb.label_rows)
        adapter_loss(sums, mb.loss_denominators).backward()
        for p in lora:
            p.grad = None

    longest = max(-(-len(s.input_ids) // args.pad_multiple) * args.pad_multiple for d in w.datasets for s in d)
    candidates = [int(c) for c in args.candidates.split(",") if int(c) >= longest]
    if not candidates:
        raise SystemExit(f"every candidate is below the longest padded sample ({longest} tokens)")
    probes = probe_capacities(candidates, prepare, step, device,
                              memory_limit=device_memory_limit(device, args.memory_fraction))
    chosen = choose_capacity(probes)
    info = device_info(device)
    print(f"\n{info['device_name']}, torch {torch.__version__}, shape={args.shape} layers={args.layers} "
          f"workload={args.workload} backend={args.backend}; memory limit {args.memory_fraction:.0%}")
    print(format_probes(probes, chosen))
    rows = [{"capacity": p.capacity, "fill": round(p.fill, 4), "seconds": p.seconds,
             "real_tokens_per_s": round(p.real_tokens_per_s, 1),
             "peak_gib": None if p.peak_bytes is None else round(p.peak_bytes / 2**30, 2),
             "rejected": p.rejected} for p in probes]
    write_json(args.out, f"capacity_{args.shape}_{args.layers}l_{args.workload}.json",
               {**info, "args": vars(args), "chosen": chosen.capacity, "rows": rows})


if __name__ == "__main__":
    main()
