"""Paged decode attention at a decode step's row counts, over rows of long-tailed context lengths,
against its KV bytes: how finely the sequence splits cut the rows (``paged_attention``'s
``DECODE_PROGRAMS_PER_SM``) and its token tile.

Rows of the 8B attention shape (32 query heads, 8 KV heads, head_dim 128, pages of 16 tokens),
context lengths lognormal (``--median``, ``--sigma``, capped at ``--max-len``: a few long rows
beside many short ones, as a burst trace's decode steps hold), pages scattered over a pool of
``--layers`` layers. Each variant runs as one CUDA graph of a launch per layer (the layers cycled,
so a layer's KV is cold again when it comes back), timed by CUDA events: µs per layer and the
fraction of the KV bytes' time at the measured copy bandwidth. The outputs are checked against
the first variant's.

    PYTHONPATH=. python3 scripts/bench_decode_attention.py --out $OUT
"""

from __future__ import annotations

import argparse
import math
import time

from harness import add_output_args, copy_bandwidth, device_info, graph_us, logger, write_json

import torch  # noqa: E402
import triton  # noqa: E402

from lightning_lorafusion.kernels import paged_attention  # noqa: E402

log = logger("bench_decode_attention")
HQ, HKV, D, PAGE = 32, 8, 128, 16


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="8,32,64,128,256")
    ap.add_argument("--per-sm", default="2,4,8,16", help="DECODE_PROGRAMS_PER_SM values")
    ap.add_argument("--block-t", default="64", help="token tiles")
    ap.add_argument("--median", type=float, default=500.0)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--max-len", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--stop-s", type=float, default=1e9)
    add_output_args(ap)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows = [int(r) for r in args.rows.split(",")]
    per_sms = [int(v) for v in args.per_sm.split(",")]
    block_ts = [int(v) for v in args.block_t.split(",")]
    bw = copy_bandwidth(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    report = {**device_info(device), "args": vars(args), "bandwidth": bw, "results": []}
    gen = torch.Generator().manual_seed(0)
    saved = paged_attention.DECODE_PROGRAMS_PER_SM
    try:
        for b in rows:
            if time.perf_counter() - start > args.stop_s:
                break
            lens = [min(args.max_len, max(1, round(math.exp(math.log(args.median) + args.sigma * float(z)))))
                    for z in torch.randn(b, generator=gen)]
            pages = [-(-n // PAGE) for n in lens]
            width = max(pages)
            total = sum(pages)
            pool = torch.randn(total + 1, args.layers, 2, PAGE, HKV, D, device=device, dtype=dtype)
            order = torch.randperm(total, generator=gen).tolist()  # scattered pages
            table = torch.zeros(b, width, dtype=torch.int32)
            k = 0
            for i, n in enumerate(pages):
                table[i, :n] = torch.tensor(order[k:k + n], dtype=torch.int32)
                k += n
            table, seq = table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)
            q = torch.randn(b, HQ, D, device=device, dtype=dtype)
            kv_bytes = sum(lens) * 2 * HKV * D * 2
            floor_us = kv_bytes / bw * 1e6
            ref = None
            for per_sm in per_sms:
                for bt in block_ts:
                    paged_attention.DECODE_PROGRAMS_PER_SM = per_sm
                    splits = paged_attention._num_splits(b * HKV, triton.cdiv(width * PAGE, bt), device)

                    def fn(layer, bt=bt):
                        return paged_attention._paged_decode_attention_triton(
                            q, pool, layer, table, seq, 1 / math.sqrt(D), None, block_t=bt)

                    out = fn(0).float()
                    ref = out if ref is None else ref
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                    us = graph_us(fn, args.layers, args.reps)
                    row = {"rows": b, "per_sm": per_sm, "block_t": bt, "splits": splits, "us": us,
                           "floor_us": floor_us, "fraction": floor_us / us, "rel_err": err,
                           "max_len": max(lens), "mean_len": sum(lens) / b}
                    report["results"].append(row)
                    log(f"rows {b:4} (mean {row['mean_len']:.0f}, max {row['max_len']} tokens): per SM {per_sm:3}, "
                        f"block_t {bt:4}, splits {splits:3}: {us:8.1f} us per layer, floor {floor_us:7.1f} "
                        f"({row['fraction']:.0%}), rel err {err:.1e}")
            write_json(args.out, "bench_decode_attention.json", report)
            del pool
            torch.cuda.empty_cache()
    finally:
        paged_attention.DECODE_PROGRAMS_PER_SM = saved
    print("| rows | " + " | ".join(f"{p}/SM, t{bt}" for p in per_sms for bt in block_ts) + " | KV floor µs |")
    print("|---" * (len(per_sms) * len(block_ts) + 2) + "|")
    for b in rows:
        got = {(r["per_sm"], r["block_t"]): r for r in report["results"] if r["rows"] == b}
        if not got:
            continue
        cells = [f"{got[(p, bt)]['us']:.1f} ({got[(p, bt)]['fraction']:.0%})" if (p, bt) in got else "-"
                 for p in per_sms for bt in block_ts]
        print(f"| {b} | " + " | ".join(cells) + f" | {next(iter(got.values()))['floor_us']:.1f} |")
    return report


if __name__ == "__main__":
    main()
