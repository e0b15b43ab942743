"""Prefill/mixed-step LoRA by row tiles (``kernels/lora_segments.py``): time one layer's
segment LoRA (q/k/v, o, gate/up, down at a model shape) for several mixes of tiles and for
variants "NxS" or "NxSxWsxWe" (N column blocks per expand program, the shrink's K in S splits,
Ws / We the shrink's / expand's num_warps; "d" = the defaults), each checked against the torch
reference first.

Mixes (rows of one step): ``prefill`` P prompts of L tokens; ``mixed`` the same plus D decode
rows, each its own 1-row tile (round-robin adapters: the decode rows of an unsorted step);
``grouped`` the same D decode rows sorted by adapter (one tile per adapter, what a padded mixed
step builds); ``padded`` grouped plus the empty tiles a captured mixed step launches (its table
has room for ``--max-num-seqs`` segments more than the bucket's tiles); ``decode`` the D rows
alone, 1-row tiles.

    PYTHONPATH=. python3 scripts/bench_lora_segments.py --shape 1b --prompts 12 --prompt-len 320 --decode 60
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if not torch.cuda.is_available():  # the CPU smoke run: Triton's interpreter, set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lightning_lorafusion.kernels.lora_segments import (  # noqa: E402
    SegmentLora,
    block_r_for,
    segment_lora_add,
    segment_lora_reference,
    segment_tiles,
)

# hidden, q/k/v widths, intermediate (Llama-3.2-1B and Llama-3-8B shapes; "tiny" for CPU smoke runs)
SHAPES = {"1b": (2048, (2048, 512, 512), 8192), "8b": (4096, (4096, 1024, 1024), 14336),
          "tiny": (64, (64, 32, 32), 128)}


def groups(shape: str) -> list[tuple[str, int, tuple[int, ...]]]:
    """(name, K, output widths) of one layer's projection groups."""
    h, qkv, inter = SHAPES[shape]
    return [("qkv", h, qkv), ("o", h, (h,)), ("gate_up", h, (inter, inter)), ("down", inter, (h,))]


def make_tables(k: int, ns: tuple[int, ...], ranks: list[int], dtype, device) -> tuple:
    """A pool holding each adapter's A [r, K] and B^T [r, N] per projection -> pool, offsets, ranks."""
    g = torch.Generator().manual_seed(0)
    parts, pos = [], 0
    a_off = torch.zeros(len(ns), len(ranks), dtype=torch.int64)
    b_off = torch.zeros_like(a_off)
    rk = torch.zeros(len(ns), len(ranks), dtype=torch.int32)
    for ad, r in enumerate(ranks):
        for p, n in enumerate(ns):
            parts += [torch.randn(r * k, generator=g) * k ** -0.5, torch.randn(r * n, generator=g) * r ** -0.5]
            a_off[p, ad], b_off[p, ad], rk[p, ad] = pos, pos + r * k, r
            pos += r * (k + n)
    pool = torch.cat(parts).to(device=device, dtype=dtype)
    return pool, a_off.to(device), b_off.to(device), rk.to(device)


def mixes(prompts: int, prompt_len: int, decode: int, adapters: int) -> dict[str, list[tuple[int, int, int]]]:
    pre = [(i * prompt_len, (i + 1) * prompt_len, i % adapters) for i in range(prompts)]
    t = prompts * prompt_len
    rows = [(t + j, t + j + 1, j % adapters) for j in range(decode)]
    grouped, start = [], t
    for a in range(adapters):
        n = sum(1 for j in range(decode) if j % adapters == a)
        if n:
            grouped.append((start, start + n, a))
            start += n
    return {"prefill": pre, "mixed": pre + rows, "grouped": pre + grouped, "padded": pre + grouped,
            "decode": [(j, j + 1, a) for j, (_, _, a) in enumerate(rows)]}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="1b")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=320)
    ap.add_argument("--decode", type=int, default=60)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--ranks", default="8,16,32,64", help="adapter i has rank ranks[i % len]")
    ap.add_argument("--variants", default="d,4x1,4x2,4x4,4x8,1x4,8x4",
                    help="comma list of NxS (column blocks per expand program x shrink K splits), d = defaults")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="for the padded mix's empty tiles")
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20, help="replays of a graph of 10 calls")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    rank_list = [int(r) for r in args.ranks.split(",")]
    ranks = [rank_list[i % len(rank_list)] for i in range(args.adapters)]
    def parse(v: str) -> tuple:
        parts = [None] * 4 if v == "d" else [int(p) for p in v.split("x")]
        return tuple(parts + [None] * (4 - len(parts)))

    variants = {v: parse(v) for v in args.variants.split(",")}
    results = []
    for mix, segments in mixes(args.prompts, args.prompt_len, args.decode, args.adapters).items():
        rows = max(end for _, end, _ in segments)
        tiles = segment_tiles(segments, args.block_m)
        if mix == "padded":
            tiles += [(0, 0, 0)] * (-(-rows // args.block_m) + args.max_num_seqs - len(tiles))
        tiles_t = torch.tensor(tiles, dtype=torch.int32).t().contiguous().to(device)
        for name, k, ns in groups(args.shape):
            pool, a_off, b_off, rk = make_tables(k, ns, ranks, dtype, device)
            lora = SegmentLora(pool=pool, tiles=tiles_t, a_offsets=a_off, b_offsets=b_off, ranks=rk,
                               scales=torch.full((args.adapters,), 0.5, device=device), segments=tuple(segments),
                               block_m=args.block_m, block_r=block_r_for(max(ranks)))
            x = torch.randn(rows, k, device=device, dtype=dtype)
            base = torch.randn(rows, sum(ns), device=device, dtype=dtype)
            want = base.clone()
            segment_lora_reference(x, lora, list(want.split(ns, dim=1)))
            for variant, (nb, sk, ws, we) in variants.items():
                kw = dict(n_blocks=nb, split_k=sk, warps=(ws, we))
                got = base.clone()
                segment_lora_add(x, lora, list(got.split(ns, dim=1)), backend="triton", **kw)
                err = float(((got - base).double() - (want - base).double()).norm()
                            / (want - base).double().norm().clamp_min(1e-30))
                if err > 2e-2:
                    raise SystemExit(f"{mix} {name} {variant}: relative error {err:.3g} against the reference")
                outs = list(got.split(ns, dim=1))
                if cuda:  # GPU time: the launches captured as one CUDA graph (as a mixed step runs them),
                    # replayed; eager launches from Python would time the host for small mixes
                    for _ in range(2):
                        segment_lora_add(x, lora, outs, backend="triton", check=False, **kw)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for _ in range(10):
                            segment_lora_add(x, lora, outs, backend="triton", check=False, **kw)
                    graph.replay()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize()
                    start.record()
                    for _ in range(args.reps):
                        graph.replay()
                    end.record()
                    torch.cuda.synchronize()
                    us = start.elapsed_time(end) * 1e3 / (10 * args.reps)
                else:
                    us = float("nan")
                results.append(dict(mix=mix, group=name, rows=rows, tiles=len(tiles), variant=variant, us=us,
                                    rel_err=err))
    print(f"{args.shape}: {args.prompts} prompts x {args.prompt_len} + {args.decode} decode rows, "
          f"{args.adapters} adapters ranks {args.ranks}, {dtype}, block_m {args.block_m}; us per layer "
          f"(all groups), by variant NxS: N column blocks per expand program, S shrink K splits (d: defaults)")
    print(f"{'mix':>8} {'rows':>6} {'tiles':>6} " + " ".join(f"{v:>8}" for v in variants))
    for mix in dict.fromkeys(r["mix"] for r in results):
        sel = [r for r in results if r["mix"] == mix]
        line = f"{mix:>8} {sel[0]['rows']:>6} {sel[0]['tiles']:>6} "
        line += " ".join(f"{sum(r['us'] for r in sel if r['variant'] == v):>8.1f}" for v in variants)
        print(line)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"bench_lora_segments_{args.shape}.json"), "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
