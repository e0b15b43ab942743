"""Decode LoRA shrink per row against rows grouped by adapter (``GatheredLora.groups``).

A decode batch of B rows over A adapters (each row draws one; ranks cycled from ``--ranks``),
the 8B shape's q/k/v (K 4096, outputs 4096 / 1024 / 1024). Timed per (B, A): what a layer
launches for them, the q/k/v shrink (one launch for the three, read by the fused RoPE epilogue)
plus o's shrink and expand (``lora_gather``), per row and grouped; with the largest difference
between the two paths' deltas of every projection, relative to the delta's size. Medians of CUDA-graph replays (``harness.kernel_ms``).

    PYTHONPATH=. python3 scripts/bench_decode_groups.py --out $OUT
    PYTHONPATH=. TRITON_INTERPRET=1 python3 scripts/bench_decode_groups.py --device cpu --dtype float32 \\
        --k 64 --batches 32 --adapters 4 --ranks 4,8 --out /tmp/dg
"""

from __future__ import annotations

import argparse
import random

from harness import add_device_args, add_output_args, comma_list, device_info, dtype_of, kernel_ms, logger, write_json

import torch  # noqa: E402

from lightning_lorafusion.kernels import lora_gather as lora_gather_module  # noqa: E402
from lightning_lorafusion.kernels.lora_gather import (GatheredLora, adapter_groups, lora_gather,  # noqa: E402
                                                      lora_shrink)

log = logger("bench_decode_groups")


def problem(b: int, a: int, ranks: list[int], k: int, outs: list[int], device, dtype, seed: int = 0):
    """A pool of ``a`` adapters (A [r, k] and B^T [r, n] per projection) and a batch of ``b`` rows
    drawn among them -> (x, pool, a_offsets [G, b], b_offsets, ranks, scales, keys)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    sizes = []
    pos = 0
    table = []
    for i in range(a):
        r = ranks[i % len(ranks)]
        per = []
        for n in outs:
            per.append((pos, pos + r * k, r))
            pos += r * (k + n)
        table.append(per)
        sizes.append(r)
    pool = (torch.randn(pos, generator=g) * 0.02).to(device, dtype)
    rows = [rng.randrange(a) for _ in range(b)]
    a_off = torch.tensor([[table[i][p][0] for i in rows] for p in range(len(outs))], dtype=torch.int64, device=device)
    b_off = torch.tensor([[table[i][p][1] for i in rows] for p in range(len(outs))], dtype=torch.int64, device=device)
    rk = torch.tensor([[table[i][p][2] for i in rows] for p in range(len(outs))], dtype=torch.int32, device=device)
    scales = torch.ones(b, dtype=torch.float32, device=device)
    x = torch.randn(b, k, generator=g).to(device, dtype)
    return x, pool, a_off, b_off, rk, scales, [i + 1 for i in rows]


def measure(args, b: int, a: int, device, dtype) -> dict:
    outs = [args.k, args.k // 4, args.k // 4]
    x, pool, a_off, b_off, rk, scales, keys = problem(b, a, args.ranks, args.k, outs, device, dtype)
    groups = adapter_groups(keys, b).to(device)
    ys = [torch.zeros(b, n, dtype=dtype, device=device) for n in outs]

    def run(grouped: bool):
        """What a layer's decode LoRA launches for q/k/v (one shrink of the three, read by the
        fused epilogue) and for o (shrink + expand added into its output)."""
        lora_shrink(GatheredLora(x, pool, a_off, b_off, rk, scales, groups=groups if grouped else None))
        lora_gather(x, pool, a_off[0], b_off[0], rk[0], scales, outs[0], out=ys[0], backend="triton",
                    groups=groups if grouped else None)

    def result(grouped: bool) -> list[torch.Tensor]:
        for p, y in enumerate(ys):
            y.zero_()
            lora_gather(x, pool, a_off[p], b_off[p], rk[p], scales, y.shape[1], out=y, backend="triton",
                        groups=groups if grouped else None)
        return [y.float().clone() for y in ys]

    want, got = result(False), result(True)
    diff = max(float((g - w).abs().max() / w.abs().max().clamp_min(1e-30)) for g, w in zip(got, want))
    row = {"rows": b, "adapters": a, "max_rel_diff": diff}
    if device.type == "cuda":
        row["per_row_us"] = 1e3 * kernel_ms(lambda: run(False), graph=True)
        row["grouped_us"] = 1e3 * kernel_ms(lambda: run(True), graph=True)
        row["grouped_over_per_row"] = row["grouped_us"] / row["per_row_us"]
    log(str(row))
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(ap)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--batches", type=comma_list(cast=int), default=[32, 64, 128, 256])
    ap.add_argument("--adapters", type=comma_list(cast=int), default=[8, 32, 100])
    ap.add_argument("--ranks", type=comma_list(cast=int), default=[8, 16, 32, 64])
    add_output_args(ap)
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), dtype_of(args.dtype)
    lora_gather_module.GROUPED_MIN_ROWS = min(args.batches)  # time the grouped kernel at every batch size
    rows = [measure(args, b, a, device, dtype) for b in args.batches for a in args.adapters if a <= 2 * b]
    report = {**device_info(device), "args": vars(args), "rows": rows}
    write_json(args.out, "bench_decode_groups.json", report)
    print("\n| rows | adapters | per row µs | grouped µs | grouped / per row | max rel diff |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} | {r['adapters']} | {r.get('per_row_us', float('nan')):.1f} | "
              f"{r.get('grouped_us', float('nan')):.1f} | {r.get('grouped_over_per_row', float('nan')):.2f} | "
              f"{r['max_rel_diff']:.2e} |")
    return report


if __name__ == "__main__":
    main()
