"""Paged decode attention at a decode step's row counts against its KV bytes: the engine's
split modes side by side (``paged_attention.DECODE_SPLITS``: "per-row" splits from the rows,
"balanced" work items from the step's total tokens) and the balanced kernel's knobs.

Rows of the 8B attention shape (32 query heads, 8 KV heads, head_dim 128, pages of 16 tokens).
``--lengths``: "trace" draws each row's context as the many-tenant trace's decode rows hold it
(a lognormal prompt, ``--prompt-median``/``--prompt-sigma`` capped at ``--prompt-max``, plus a
uniform share of a lognormal output, ``--output-*``), a number gives every row that length. Pages
are scattered over a pool of up to ``--layers`` layers; the page table is ``--width`` tokens wide
(the engine's decode graphs: its model length; default the longest row). Each variant runs as one
CUDA graph of a launch per layer (the layers cycled, so a layer's KV is cold again when it comes
back), timed by CUDA events: µs per layer and the fraction of the KV bytes' time at the measured
copy bandwidth (``harness.copy_bandwidth``). Outputs are checked against the torch reference
(bf16) where it fits, else against the first variant's.

``--variants``: "old" (per-row splits), "new" (the defaults) or "new:ps=4/mc=128/bt=64/w=4/s=3/mr=128"
(balanced programs per SM, shortest item, token tile, warps, stages, register cap; 0: none);
"stream[:...]" the streamed mode (programs over the rows' tokens laid end to end), same knobs;
"auto" the engine's default (balanced items for ``paged_attention.BALANCED_ROWS`` rows).

    PYTHONPATH=. python3 scripts/bench_decode_attention.py --out $OUT
"""

from __future__ import annotations

import argparse
import math
import time

from harness import add_output_args, copy_bandwidth, device_info, graph_us, logger, write_json

import torch  # noqa: E402

from lightning_lorafusion.kernels import paged_attention  # noqa: E402

log = logger("bench_decode_attention")
HQ, HKV, D, PAGE = 32, 8, 128, 16
KNOBS = {"ps": "programs_per_sm", "mc": "min_chunk", "bt": "block_t", "w": "num_warps", "s": "num_stages",
         "mr": "max_registers"}


def parse_variant(text: str) -> dict:
    """"old" / "new" / "new:ps=8/bt=64" -> {"name", "mode", knobs...}."""
    mode, _, knobs = text.partition(":")
    modes = {"old": "per-row", "new": "balanced", "stream": "stream", "auto": "auto"}
    if mode not in modes:
        raise ValueError(f"variant {text!r}: 'old', 'auto', 'new[:knob=value/...]' or 'stream[:knob=value/...]'")
    out = {"name": text, "mode": modes[mode]}
    for kv in filter(None, knobs.split("/")):
        k, _, v = kv.partition("=")
        if k not in KNOBS:
            raise ValueError(f"variant {text!r}: knob {k!r} not in {sorted(KNOBS)}")
        out[KNOBS[k]] = int(v)
    return out


def trace_lengths(gen: torch.Generator, rows: int, args) -> list[int]:
    """Decode rows' contexts as the tenants trace holds them: prompt + a uniform share of the output."""
    z = torch.randn(2, rows, generator=gen)
    u = torch.rand(rows, generator=gen)
    out = []
    for i in range(rows):
        prompt = min(args.prompt_max, max(1, round(math.exp(math.log(args.prompt_median) + args.prompt_sigma * float(z[0, i])))))
        new = min(args.output_max, max(1, round(math.exp(math.log(args.output_median) + args.output_sigma * float(z[1, i])))))
        out.append(prompt + 1 + int(float(u[i]) * new))
    return out


def launcher(variant: dict, sms: int):
    kw = {k: variant[k] for k in ("min_chunk", "block_t", "num_warps", "num_stages", "max_registers") if k in variant}
    if variant["mode"] != "per-row" and "programs_per_sm" in variant:
        kw["target"] = -(-variant["programs_per_sm"] * sms // HKV)
    return {"mode": variant["mode"], **kw}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,32,64,128,256")
    ap.add_argument("--lengths", default="trace,512,2048,8192")
    ap.add_argument("--variants", default="old,new")
    ap.add_argument("--prompt-median", type=float, default=256.0)
    ap.add_argument("--prompt-sigma", type=float, default=0.8)
    ap.add_argument("--prompt-max", type=int, default=2048)
    ap.add_argument("--output-median", type=float, default=128.0)
    ap.add_argument("--output-sigma", type=float, default=0.8)
    ap.add_argument("--output-max", type=int, default=1024)
    ap.add_argument("--width", type=int, default=0, help="page-table width in tokens (0: the longest row)")
    ap.add_argument("--layers", type=int, default=8, help="the most layers (fewer where the pool would pass --pool-gib)")
    ap.add_argument("--pool-gib", type=float, default=12.0)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--stop-s", type=float, default=1e9)
    add_output_args(ap)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows = [int(r) for r in args.rows.split(",")]
    variants = [parse_variant(v) for v in args.variants.split(",")]
    bw = copy_bandwidth(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    report = {**device_info(device), "args": vars(args), "bandwidth": bw, "results": []}
    gen = torch.Generator().manual_seed(0)
    for lengths in args.lengths.split(","):
        for b in rows:
            if time.perf_counter() - start > args.stop_s:
                break
            lens = trace_lengths(gen, b, args) if lengths == "trace" else [int(lengths)] * b
            pages = [-(-n // PAGE) for n in lens]
            width = max(max(pages), -(-args.width // PAGE))
            total = sum(pages)
            layer_bytes = (total + 1) * 2 * PAGE * HKV * D * 2
            layers = max(1, min(args.layers, int(args.pool_gib * 2**30 // layer_bytes)))
            pool = torch.randn(total + 1, layers, 2, PAGE, HKV, D, device=device, dtype=dtype)
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
            ref, ref_name = None, "first variant"
            if b * max(lens) <= 2**20:
                ref = paged_attention.paged_decode_attention_reference(q, pool, 0, table, seq, scale=D ** -0.5).float()
                ref_name = "torch reference"
            for variant in variants:
                kw = launcher(variant, sms)

                def fn(layer, kw=kw):
                    return paged_attention._paged_decode_attention_triton(
                        q, pool, layer % layers, table, seq, D ** -0.5, None, **kw)

                out = fn(0).float()
                ref = out if ref is None else ref
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                us = graph_us(fn, 8, args.reps)
                row = {"lengths": lengths, "rows": b, "variant": variant["name"], "us": us, "floor_us": floor_us,
                       "fraction": floor_us / us, "rel_err": err, "checked_against": ref_name,
                       "max_len": max(lens), "mean_len": sum(lens) / b, "layers": layers}
                report["results"].append(row)
                log(f"{lengths:>5} rows {b:4} (mean {row['mean_len']:.0f}, max {row['max_len']}): "
                    f"{variant['name']:28} {us:8.1f} us per layer, floor {floor_us:7.1f} ({row['fraction']:.0%}), "
                    f"rel err {err:.1e}")
            write_json(args.out, "bench_decode_attention.json", report)
            del pool
            torch.cuda.empty_cache()
    names = [v["name"] for v in variants]
    print("| lengths | rows | " + " | ".join(names) + " | KV floor µs |")
    print("|---" * (len(names) + 3) + "|")
    for lengths in args.lengths.split(","):
        for b in rows:
            got = {r["variant"]: r for r in report["results"] if r["rows"] == b and r["lengths"] == lengths}
            if not got:
                continue
            cells = [f"{got[n]['us']:.1f} ({got[n]['fraction']:.0%})" if n in got else "-" for n in names]
            print(f"| {lengths} | {b} | " + " | ".join(cells) + f" | {next(iter(got.values()))['floor_us']:.1f} |")
    return report


if __name__ == "__main__":
    main()
