"""The prefill rows' LoRA kernels of one 8B layer, side by side in one process: the row-tile
kernels the engine ran (``lora_segments``' "segments" form) against the split-K form
(``lora_splitk``) and its options, at small and large steps.

A case is ``rows`` prefill rows of requests (``min(256, rows / adapters)`` rows each, adapters
taken in turn) over ``adapters`` adapters of rank 16 or of ranks 4, 8, 16, 32, 64 in turn
(``--mixes``: ``1x16``, ``8x16``, ``64x16``, ``64xmix``), targeting q/k/v, o, gate/up and down.
The tables take the form a captured mixed step gives them: a covering tile table padded to
``MixedPieces.max_tiles`` with 256 sequences, S ``MAX_RANK`` wide, the live-tile count on the
device (the "segments" and "splitk" forms run their live grids up to ``LIVE_GRID_MAX_ROWS`` rows,
as the engine does; variants: ``VARIANTS``). Every variant writes first (the engine's ``prefill_lora_write`` in steps of adapted rows)
unless its name ends in ``-add``. Each variant's four groups are timed together as CUDA graph
replays (``do_bench_cudagraph``, median ms) and checked against ``segment_lora_reference``
(relative error of the delta). Floor: x read once per group, each present adapter's A and Bᵀ
once, each output written once, at the measured copy bandwidth.

    PYTHONPATH=. python3 scripts/bench_segment_forms.py --out $OUT/forms
    PYTHONPATH=. python3 scripts/bench_segment_forms.py --device cpu --dtype float32 --shape tiny --rows 48 \\
        --mixes 1x16,8xmix --variants segments,splitk
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

from harness import Report, add_device_args, add_output_args, comma_list, dtype_of, logger, timed_ms

import torch  # noqa: E402

log = logger("bench_segment_forms")
# (name, projections' N, K) of one layer's groups sharing an input
SHAPES = {
    "8b": (("qkv", (4096, 1024, 1024), 4096), ("o", (4096,), 4096), ("gate_up", (14336, 14336), 4096),
           ("down", (4096,), 14336)),
    "tiny": (("qkv", (64, 32, 32), 64), ("o", (64,), 64), ("gate_up", (96, 96), 64), ("down", (64,), 96)),
}
MIX_RANKS = (4, 8, 16, 32, 64)
# variant -> (form, options); "-add": additive instead of write-first, "-shrink": the shrink
# launch alone. "segments": the row-tile kernels as before; "splitk": ``lora_splitk``'s shrink
# (K split by the step's size, the splits summed in the shrink) before the segments' expand over
# the summed S (``per_sm``: the shrink's programs per SM, 0 = one per item; ``expand_align`` /
# ``expand_stages``: the expands' vector loads and num_stages, 0 = Triton's); "items":
# ``lora_splitk`` whole, its own expand by (tile, column block) items, and its options
VARIANTS = {
    "segments": ("segments", {}),
    "segments-add": ("segments", {}),
    "segments-shrink": ("segments", {}),
    "splitk": ("splitk", {}),
    "splitk-add": ("splitk", {}),
    "splitk-shrink": ("splitk", {}),
    "splitk-p0": ("splitk", {"per_sm": (0, None)}),
    "splitk-p4": ("splitk", {"per_sm": (4, None)}),
    "splitk-p16": ("splitk", {"per_sm": (16, None)}),
    "splitk-s4": ("splitk", {"split_k": 4}),
    "splitk-s8": ("splitk", {"split_k": 8}),
    "splitk-s16": ("splitk", {"split_k": 16}),
    "splitk-s16-nb1": ("splitk", {"split_k": 16, "n_blocks": 1}),
    # the large steps' split and column blocks at any size (what "splitk" ran before SMALL_STEP_ROWS)
    "splitk-s4-nb4": ("splitk", {"split_k": 4, "n_blocks": 4}),
    "splitk-nb1": ("splitk", {"n_blocks": 1}),
    "splitk-nb2": ("splitk", {"n_blocks": 2}),
    "splitk-e8": ("splitk", {"per_sm": (None, 8)}),
    "splitk-align": ("splitk", {"expand_align": True}),
    "splitk-st0": ("splitk", {"expand_stages": 0}),
    "segments-align": ("segments", {"expand_align": True}),
    # the held expand (``segment_expand``: a tile's S loaded once per program) after the split-K
    # shrink, with its options (``lora_segments.HELD_EXPAND`` updated by ``held``)
    "held": ("splitk", {"expand": "held"}),
    "held-add": ("splitk", {"expand": "held"}),
    "held-noalign": ("splitk", {"expand": "held", "held": {"align": False}}),
    "held-lp": ("splitk", {"expand": "held", "held": {"lowp": True}}),
    "held-nb8": ("splitk", {"expand": "held", "held": {"n_blocks": 8}}),
    "held-nb2": ("splitk", {"expand": "held", "held": {"n_blocks": 2}}),
    "held-bn64": ("splitk", {"expand": "held", "held": {"block_n": 64, "n_blocks": 8}}),
    "held-bn256": ("splitk", {"expand": "held", "held": {"block_n": 256, "n_blocks": 2, "warps": 8}}),
    "held-st2": ("splitk", {"expand": "held", "held": {"stages": 2}}),
    "held-st3": ("splitk", {"expand": "held", "held": {"stages": 3}}),
    "held-col": ("splitk", {"expand": "held", "held": {"col_fastest": True}}),
    "held-w2": ("splitk", {"expand": "held", "held": {"warps": 2}}),
    "held-w8": ("splitk", {"expand": "held", "held": {"warps": 8}}),
    "held-lp-st2": ("splitk", {"expand": "held", "held": {"lowp": True, "stages": 2}}),
    "held-lp-w8": ("splitk", {"expand": "held", "held": {"lowp": True, "warps": 8}}),
    # not a kernel of the LoRA: each group's output written once (``fill_``), the expand's write floor
    "fill": ("fill", {}),
    "items": ("items", {}),
    # the factors staged per step and two grouped GEMMs (``lora_grouped_gemm``; write-first only)
    "grouped": ("grouped", {}),
    "items-add": ("items", {}),
    "items-shrink": ("items", {}),
    "items-p8": ("items", {"programs": (8, 8)}),
    "items-p4": ("items", {"programs": (4, 4)}),
    "items-pr": ("items", {"programs": (-1, -1)}),
    "items-nb2": ("items", {"n_blocks": 2}),
    "items-nb4": ("items", {"n_blocks": 4}),
    "items-bn64": ("items", {"block_n": 64}),
    "items-bn256": ("items", {"block_n": 256}),
    "items-c16": ("items", {"rank_chunk": 16}),
    "items-c64": ("items", {"rank_chunk": 64}),
    "items-ew2": ("items", {"warps": (None, 2)}),
    "items-ew8": ("items", {"warps": (None, 8)}),
    "items-sw8": ("items", {"warps": (8, None)}),
    "items-s4": ("items", {"split_k": 4}),
    "items-s8": ("items", {"split_k": 8}),
    "items-k128": ("items", {"block_k": 128}),
    "items-st2": ("items", {"stages": (2, 2)}),
    "items-st4": ("items", {"stages": (4, 4)}),
    "items-est1": ("items", {"stages": (None, 1)}),
    "items-est1-bn64": ("items", {"stages": (None, 1), "block_n": 64}),
    "items-est1-nb4": ("items", {"stages": (None, 1), "n_blocks": 4}),
    "items-est1-pr": ("items", {"stages": (None, 1), "programs": (-1, -1)}),
    "items-hold": ("items", {"hold": True}),
    "items-hold-nb4": ("items", {"hold": True, "n_blocks": 4}),
}
DEFAULT_VARIANTS = ("segments", "splitk", "segments-shrink", "splitk-shrink", "splitk-p0", "segments-add",
                    "splitk-add", "items-est1-nb4")
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}


def parse_mix(mix: str) -> tuple[int, tuple[int, ...]]:
    n, ranks = mix.split("x", 1)
    return int(n), (MIX_RANKS if ranks == "mix" else (int(ranks),))


def build_case(args, rows: int, mix: str, dev: torch.device, dtype: torch.dtype):
    """The layer's inputs, the pool and each group's ``SegmentLora`` (graph-table form)."""
    from lightning_lorafusion.kernels.lora_gather import MAX_RANK
    from lightning_lorafusion.kernels.segment_tables import SegmentLora, segment_tiles
    from lightning_lorafusion.serving.mixed_graphs import MixedPieces

    n_ad, ranks = parse_mix(mix)
    groups = SHAPES[args.shape]
    g = torch.Generator(device=dev).manual_seed(rows * 7 + n_ad)
    length = max(1, min(args.request_len, rows // n_ad))
    segments, pos, i = [], 0, 0
    while pos < rows:
        end = min(rows, pos + length)
        segments.append((pos, end, i % n_ad))
        pos, i = end, i + 1
    present = sorted({a for _, _, a in segments})
    rank_of = [ranks[a % len(ranks)] for a in range(n_ad)]
    # the pool: per adapter and projection, A [r, K] then Bt [r, N] (K, N multiples of 16)
    sizes = [sum(rank_of[a] * (k + n) for _, ns, k in groups for n in ns) for a in range(n_ad)]
    pool = (torch.randn(sum(sizes) + 64, generator=g, device=dev, dtype=torch.float32) * 0.05).to(dtype)
    block_m = 64 if dev.type == "cuda" else 16
    tiles = segment_tiles(segments, block_m, rows=rows)
    cap = MixedPieces.max_tiles(rows, block_m, 256, covering=True) if args.graph_tables else len(tiles)
    cap = max(cap, len(tiles))
    tiles_t = torch.zeros(3, cap, dtype=torch.int32)
    tiles_t[:, :len(tiles)] = torch.tensor(tiles, dtype=torch.int32).t()
    tiles_t = tiles_t.to(dev)
    live = torch.tensor([len(tiles)], dtype=torch.int32, device=dev)
    scales = torch.full((n_ad,), 2.0, dtype=torch.float32, device=dev)
    loras, inputs, outs = {}, {}, {}
    offs = {}
    pos = 64
    for a in range(n_ad):
        for name, ns, k in groups:
            for p, n in enumerate(ns):
                r = rank_of[a]
                offs[(name, p, a)] = (pos, pos + r * k, r)
                pos += r * (k + n)
    for name, ns, k in groups:
        a_off = torch.tensor([[offs[(name, p, a)][0] for a in range(n_ad)] for p in range(len(ns))], dtype=torch.int64)
        b_off = torch.tensor([[offs[(name, p, a)][1] for a in range(n_ad)] for p in range(len(ns))], dtype=torch.int64)
        rk = torch.tensor([[offs[(name, p, a)][2] for a in range(n_ad)] for p in range(len(ns))], dtype=torch.int32)
        loras[name] = SegmentLora(pool=pool, tiles=tiles_t, a_offsets=a_off.to(dev), b_offsets=b_off.to(dev),
                                  ranks=rk.to(dev), scales=scales, segments=tuple(segments), block_m=block_m,
                                  block_r=MAX_RANK if args.graph_tables else 64, live=live,
                                  factor_align=16)  # (every offset below is a multiple of 16, as in the pool)
        inputs[name] = torch.randn(rows, k, generator=g, device=dev, dtype=torch.float32).to(dtype)
        outs[name] = torch.empty(rows, sum(ns), dtype=dtype, device=dev)
    elem = torch.finfo(dtype).bits // 8
    floor = 0
    for name, ns, k in groups:
        floor += rows * k * elem + rows * sum(ns) * elem
        floor += sum(rank_of[a] * (k + n) * elem for a in present for n in ns)
    info = {"rows": rows, "mix": mix, "segments": len(segments), "adapters": len(present), "tiles": len(tiles),
            "table": cap, "floor_bytes": floor}
    return groups, loras, inputs, outs, info


def make_run(variant: str, groups, loras, inputs, outs, dev):
    from lightning_lorafusion.kernels.lora_segments import _segment_launches, segment_lora_add
    from lightning_lorafusion.kernels.lora_splitk import splitk_launches, splitk_lora_add
    from lightning_lorafusion.serving.mixed_graphs import LIVE_GRID_MAX_ROWS

    form, opts = VARIANTS[variant]
    accumulate = variant.endswith("-add")
    rows = next(iter(inputs.values())).shape[0]
    counters = {name: torch.zeros(loras[name].tiles.shape[1] * len(ns), dtype=torch.int32, device=dev)
                for name, ns, _ in groups}
    # the engine's captured pieces run live grids up to LIVE_GRID_MAX_ROWS rows (both forms of
    # lora_segments); "items" always walks the live tiles
    use = {name: (loras[name] if form == "items" or rows <= LIVE_GRID_MAX_ROWS
                  else dataclasses.replace(loras[name], live=None)) for name, _, _ in groups}

    if form == "grouped":
        from lightning_lorafusion.kernels.lora_grouped_gemm import grouped_lora_delta, row_groups

        rgroups = {name: row_groups(loras[name].segments, rows, dev) for name, _, _ in groups}
        max_ranks = {name: loras[name].ranks.max(dim=1).values.tolist() for name, _, _ in groups}

    def run():
        for name, ns, _ in groups:
            y = outs[name]
            if form == "grouped":  # (the delta is a new tensor, as write-first takes it)
                outs[name] = grouped_lora_delta(inputs[name], loras[name], ns, max_ranks[name], groups=rgroups[name])
                continue
            if form == "fill":
                y.fill_(0.0)
                continue
            parts = list(y.split(list(ns), dim=1))
            if variant.endswith("-shrink"):
                launches = (splitk_launches(inputs[name], use[name], parts, accumulate=False, counters=counters[name])
                            if form == "items" else
                            _segment_launches(inputs[name], dataclasses.replace(use[name], counters=counters[name]),
                                              parts, n_blocks=None, split_k=None, warps=(None, None),
                                              accumulate=False, splitk=form == "splitk"))
                kernel, grid, a, meta = launches[0]
                kernel[grid](*a, **meta)
            elif form == "items":
                splitk_lora_add(inputs[name], use[name], parts, check=False, accumulate=accumulate,
                                counters=counters[name], **opts)
            else:
                segment_lora_add(inputs[name], dataclasses.replace(use[name], counters=counters[name]), parts,
                                 backend="triton", check=False, form=form, accumulate=accumulate,
                                 split_k=opts.get("split_k"), per_sm=opts.get("per_sm", (None, None)),
                                 n_blocks=opts.get("n_blocks"), expand_align=opts.get("expand_align"),
                                 expand_stages=opts.get("expand_stages"), expand=opts.get("expand"),
                                 held=opts.get("held"))
    return run


def check(variant, run, groups, loras, inputs, outs, cache: dict) -> float:
    """Relative error of the variant's delta against ``segment_lora_reference`` (the reference
    computed once per case and mode, kept in ``cache``)."""
    from lightning_lorafusion.kernels.segment_tables import segment_lora_reference

    accumulate = variant.endswith("-add")
    if accumulate not in cache:
        g = torch.Generator(device=next(iter(outs.values())).device).manual_seed(5)
        base = {name: (torch.randn(outs[name].shape, generator=g, device=outs[name].device).to(outs[name].dtype)
                       if accumulate else None) for name, _, _ in groups}
        want = {}
        for name, ns, _ in groups:
            want[name] = base[name].clone() if accumulate else torch.zeros_like(outs[name])
            segment_lora_reference(inputs[name], loras[name], list(want[name].split(list(ns), dim=1)))
        cache[accumulate] = (base, want)
    base, want = cache[accumulate]
    for name, _, _ in groups:
        outs[name].copy_(base[name]) if accumulate else outs[name].fill_(float("nan"))
    run()
    num = den = 0.0
    for name, _, _ in groups:
        ref0 = base[name].double() if accumulate else 0.0
        num += float((outs[name].double() - want[name].double()).norm() ** 2)
        den += float((want[name].double() - ref0).norm() ** 2)
    return math.sqrt(num / max(den, 1e-30))


def time_ms(fn, dev) -> float:
    if dev.type == "cuda":
        import triton

        try:
            return triton.testing.do_bench_cudagraph(fn, rep=args_rep, return_mode="median")
        except RuntimeError as exc:  # a variant that cannot be captured: timed eagerly, said in the log
            log(f"not captured ({str(exc)[:120]}): timed eagerly")
            torch.cuda.synchronize()
            return triton.testing.do_bench(fn, rep=args_rep, return_mode="median")
    return timed_ms(fn, dev, warmup=0, reps=1)["median_ms"]


args_rep = 30


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(ap)
    add_output_args(ap)
    ap.add_argument("--shape", choices=list(SHAPES), default="8b")
    ap.add_argument("--rows", type=comma_list(cast=int), default=[256, 512, 2048, 8192])
    ap.add_argument("--mixes", type=comma_list(), default=["1x16", "8x16", "64x16", "64xmix"])
    ap.add_argument("--variants", type=comma_list(tuple(VARIANTS)), default=list(DEFAULT_VARIANTS))
    ap.add_argument("--request-len", type=int, default=256)
    ap.add_argument("--graph-tables", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--rep", type=int, default=30, help="do_bench_cudagraph's rep (ms)")
    ap.add_argument("--deadline", type=float, default=220.0)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    global args_rep
    args = parse_args(argv)
    args_rep = args.rep
    t0 = time.monotonic()
    dev, dtype = torch.device(args.device), dtype_of(args.dtype)
    if dev.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if "lightning_lorafusion.kernels.lora_segments" in sys.modules and os.environ["TRITON_INTERPRET"] != "1":
            raise SystemExit("the CPU run needs TRITON_INTERPRET=1")
    report = Report(dev, args, out=args.out, log=log)
    src = torch.empty(512 * 2**20 if dev.type == "cuda" else 2**22, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timed_ms(lambda: dst.copy_(src), dev, warmup=1, reps=5)["min_ms"]
    bw = 2 * src.numel() / (t * 1e-3)
    report["bandwidth_gbs"] = bw / 1e9
    del src, dst
    report["cases"] = []
    for mix in args.mixes:
        for rows in args.rows:
            if time.monotonic() - t0 > args.deadline:
                break
            groups, loras, inputs, outs, info = build_case(args, rows, mix, dev, dtype)
            info["floor_ms"] = 1e3 * info["floor_bytes"] / bw
            info["variants"] = {}
            refs = {}
            for v in args.variants:
                if time.monotonic() - t0 > args.deadline:
                    info["variants"][v] = {"error": "skipped: deadline"}
                    continue
                row = {}
                try:
                    run = make_run(v, groups, loras, inputs, outs, dev)
                    row["rel_err"] = (0.0 if v.endswith("-shrink") or v == "fill"
                                      else check(v, run, groups, loras, inputs, outs, refs))
                    if v.endswith("-shrink"):
                        run()
                    row["ms"] = time_ms(run, dev)
                except Exception as exc:  # one broken variant must not lose the others
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                info["variants"][v] = row
                log(f"rows={rows} {mix} {v}: " + ", ".join(f"{k}={row[k]:.4g}" for k in ("ms", "rel_err") if k in row)
                    + (f" {row['error']}" if "error" in row else ""))
            report["cases"].append(info)
            report.save()
            del groups, loras, inputs, outs, refs
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    print_table(report, args, dtype)
    return 0


def print_table(report, args, dtype, checked: str = "the delta") -> None:
    """The variants' median ms per case (FAIL beside a time whose output missed ``TOL``), the
    errors, and the largest relative error of ``checked``."""
    print(f"\n{report.get('device_name')}  {report.get('date')}  copy bandwidth {report['bandwidth_gbs']:.0f} GB/s")
    vs = list(args.variants)
    print("| rows | mix | tiles | floor ms | " + " | ".join(vs) + " |")
    print("|---|---|---|---|" + "---|" * len(vs))
    for c in report["cases"]:
        cells = []
        for v in vs:
            row = c["variants"].get(v, {})
            if "ms" not in row:
                cells.append("err" if "error" in row and "deadline" not in row["error"] else "")
                continue
            bad = "" if row["rel_err"] <= TOL[dtype] else " FAIL"
            cells.append(f"{row['ms']:.3f}{bad}")
        print(f"| {c['rows']} | {c['mix']} | {c['tiles']} | {c['floor_ms']:.3f} | " + " | ".join(cells) + " |")
    errs = {(c["rows"], c["mix"], v): r["error"] for c in report["cases"] for v, r in c["variants"].items()
            if "error" in r and "deadline" not in r["error"]}
    for key, e in list(errs.items())[:8]:
        print("error", key, e)
    worst = max((r.get("rel_err", 0.0) for c in report["cases"] for r in c["variants"].values()), default=0.0)
    print(f"largest rel err of {checked}: {worst:.2e} (tolerance {TOL[dtype]:.1e})")


if __name__ == "__main__":
    raise SystemExit(main())
