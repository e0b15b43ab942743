"""The prefill rows' LoRA of one decoder layer against its byte floor: the frozen products alone,
with the present row-tile kernels (``lora_segments``) and with each other variant.

One layer's projection groups at a real shape (``--shape 8b``: hidden 4096, q/k/v 4096 / 1024 /
1024 as one fused GEMM, o, gate/up 14336 x 2 as one, down), ``--rows`` prefill rows (default
8192,2048) cut into requests of lognormal lengths (``--median-len``, ``--sigma``, capped at
``--max-len``), each naming one of ``--adapters`` adapters (default 32) of ranks ``--ranks``
(cycled; 4..64) on all seven projections. The adapters sit in a ``UnifiedPool`` paged in as the
engine does, and the step's tables come from the engine's own builder
(``step_batch.prefill_lora_tables``), then take the form a captured mixed step gives them
(``--graph-tables``, default on: S as wide as ``MAX_RANK``, the tile table padded to
``MixedPieces.max_tiles``).

Variants (``--variants``; the first ten by default): ``base`` (the cuBLAS products only),
``segments`` (products + ``segment_lora_add``'s "segments" form, what the engine runs),
``segments-nb2`` / ``segments-split1`` (2 column blocks per expand program / the shrink's K
unsplit), ``tiles`` (``lora_tiles`` with its defaults: the shrink's projections side by side,
each output block read before its rank work), ``tiles-lowp`` (the expand's dot in bf16),
``tiles-hold`` / ``tiles-hold-lowp`` (S held in registers over the column blocks),
``tiles-nb2`` / ``tiles-nb8`` / ``tiles-nb16`` / ``tiles-split1`` / ``tiles-w2`` / ``tiles-w8``
(column blocks, K splits, expand warps), ``addmm`` (the expand writes the delta alone, then
cuBLAS adds it as the GEMM's C input: no read-modify-write pass), ``fused`` / ``fused-128``
(the shrink, then a Triton GEMM adding the expand in its epilogue, ``lora_linear``;
``fused-128``: 128 x 128 blocks, 4 warps, 4 stages), ``triton-base`` (that GEMM with no LoRA,
against cuBLAS), ``write`` (write-first, the engine's ``EngineTuning.prefill_lora_write``: the
"segments" expand writes the delta, zeros on rows without LoRA, into an uninitialised output, and
cuBLAS adds the frozen product onto it in place, ``y.addmm_(x, W^T)``, beta = 1; ``addmm`` above
instead adds into a new tensor, which copies the delta first), ``base-beta1`` (the frozen
products alone as ``y.addmm_`` onto an existing output: cuBLAS's speed with beta = 1),
``segments-live`` / ``write-live`` (``segments`` / ``write`` on the live grids: the padded table's
live-tile count on the device, ``SegmentLora.live``, a fixed number of programs per SM walking
those tiles only; what the engine's captured mixed steps run), ``-live-x4`` (4x the programs per
SM), ``-live-all`` (a program per item of the whole table, the padding's exiting after reading the
count), ``-live-sorted`` (the tiles of the largest ranks first in the table).
``--per-group``: also each projection group alone (q/k/v, o, gate/up, down) for ``base``,
``base-beta1``, ``segments`` and ``write``. Each timed as CUDA graph replays (Triton's ``do_bench_cudagraph``, median:
as the engine's captured mixed steps run them; ``do_bench`` where capture fails; on the CPU one
wall-clock run); "LoRA ms" = the variant's time minus ``base``. The floor of the LoRA part: x
read once per group, each adapter's A and B once per projection, every output read and written
once, at a measured copy bandwidth. Each variant is checked against the torch reference
(``segment_lora_reference`` after the cuBLAS products): relative error of the added delta. With
``--profile`` a torch.profiler table of one repetition of each of ``--profile-variants`` (kernel,
count, total us). ``--deadline``: variants not started by then are skipped (the table still prints).

    PYTHONPATH=. python3 scripts/bench_prefill_lora.py --out $OUT/prefill-lora
    PYTHONPATH=. python3 scripts/bench_prefill_lora.py --shape tiny --device cpu --dtype float32 --rows 96,160 \\
        --adapters 4 --ranks 4,8,16 --median-len 24 --max-len 64 --out /tmp/pl
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

from harness import add_device_args, add_output_args, comma_list, dtype_of, logger, timed_ms, Report

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

log = logger("bench_prefill_lora")
SHAPES = {
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=1,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048),
}
VARIANTS = ("base", "segments", "tiles", "tiles-lowp", "addmm", "tiles-hold", "tiles-hold-lowp", "tiles-nb2",
            "segments-nb2", "tiles-w2", "fused", "triton-base", "segments-split1", "tiles-nb8", "tiles-nb16",
            "tiles-split1", "tiles-w8", "fused-128", "write", "base-beta1", "segments-live", "write-live",
            "segments-live-x4", "write-live-x4", "segments-live-all", "write-live-all", "segments-live-sorted",
            "write-live-sorted")
# the live grids' variants: programs per SM (shrink, expand) as a multiple of the defaults, or every
# item of the table its own program (padding programs exit after reading the count); "sorted":
# the table's tiles heaviest rank first (the programs' round-robin shares of work even out)
LIVE_OPTS = {"": {}, "-x4": {"scale": 4}, "-all": {"scale": 0}, "-sorted": {"sorted": True}}
# per-group timings (``--per-group``): the frozen product, today's additive expand, write-first
PER_GROUP_VARIANTS = ("base", "base-beta1", "segments", "write")
DEFAULT_VARIANTS = VARIANTS[:10]
# groups: (name, members, input); members' weights are one fused matrix
GROUPS = (("qkv", ("q_proj", "k_proj", "v_proj"), "x"), ("o", ("o_proj",), "attn"),
          ("gate_up", ("gate_proj", "up_proj"), "x"), ("down", ("down_proj",), "act"))
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}


def setup(args, rows: int, kinds):
    """The layer's weights, inputs, pool with the adapters paged in, and the step's tables."""
    from transformers import LlamaConfig

    from lightning_lorafusion.kernels.lora_gather import MAX_RANK
    from lightning_lorafusion.model.decoder import DecoderConfig
    from lightning_lorafusion.serving.adapters import host_adapter_from_factors
    from lightning_lorafusion.serving.mixed_graphs import MixedPieces
    from lightning_lorafusion.serving.pool import UnifiedPool
    from lightning_lorafusion.serving.step_batch import prefill_lora_tables

    dev, dtype = kinds
    cfg = DecoderConfig.from_hf(LlamaConfig(**SHAPES[args.shape]))
    gen = torch.Generator(device="cpu").manual_seed(0)
    dgen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, std=1.0):  # drawn on the device (the 8B layer's weights are 436 M values)
        return (torch.randn(*shape, generator=dgen, device=dev, dtype=torch.float32) * std).to(dtype)

    weights = {name: randn(sum(cfg.module_dims(m)[1] for m in members), cfg.module_dims(members[0])[0],
                           std=cfg.module_dims(members[0])[0] ** -0.5) for name, members, _ in GROUPS}
    inputs = {"x": randn(rows, cfg.hidden_size), "attn": randn(rows, cfg.q_size),
              "act": randn(rows, cfg.intermediate_size)}
    adapters = []
    for i in range(args.adapters):
        r = args.ranks[i % len(args.ranks)]
        factors = {}
        for module in cfg.family.projections:
            k, n = cfg.module_dims(module)
            factors[(0, module)] = (torch.randn(r, k, generator=gen) * k ** -0.5,
                                    torch.randn(n, r, generator=gen) * 0.5 * r ** -0.5)
        adapters.append(host_adapter_from_factors(f"a{i}", factors, rank=r, alpha=2.0 * r, config=cfg, dtype=dtype,
                                                  pin=False))
    probe = UnifiedPool(num_pages=1, page_size=16, num_layers=1, num_kv_heads=cfg.num_kv_heads,
                        head_dim=cfg.head_dim, dtype=dtype, device="cpu")
    pages = sum(probe.pages_for_adapter(a) for a in adapters) + 4
    pool = UnifiedPool(num_pages=pages, page_size=16, num_layers=1, num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, dtype=dtype, device=dev)
    segments, used = request_segments(args, rows)
    residents = [pool.page_in(adapters[a]) for a in used]
    if dev.type == "cuda":
        torch.cuda.synchronize()
    block_m = 64 if dev.type == "cuda" else 16
    pre = prefill_lora_tables(segments, residents, block_m, dev)
    if args.graph_tables:  # what a captured mixed step launches with
        cap = MixedPieces.max_tiles(rows, block_m, 256)
        tiles = torch.zeros(3, cap, dtype=torch.int32, device=dev)
        tiles[:, :pre.tiles.shape[1]] = pre.tiles
        pre = dataclasses.replace(pre, tiles=tiles, block_r=MAX_RANK,
                                  live=torch.tensor([pre.tiles.shape[1]], dtype=torch.int32, device=dev))
    return cfg, weights, inputs, pool, pre, segments


def request_segments(args, rows: int):
    """Requests of lognormal lengths filling ``rows`` -> segments (start, end, index into the step's
    adapters) and the step's adapters (indices into the adapter list, in first-use order)."""
    rng = np.random.default_rng(1)
    segments, used, pos = [], [], 0
    while pos < rows:
        n = int(np.clip(round(rng.lognormal(math.log(args.median_len), args.sigma)), 1, args.max_len))
        n = min(n, rows - pos)
        a = int(rng.integers(args.adapters))
        if a not in used:
            used.append(a)
        segments.append((pos, pos + n, used.index(a)))
        pos += n
    return segments, used


def lora_floor_bytes(cfg, pre, segments, rows: int, elem: int) -> int:
    """x once per group, each adapter's A and B^T once per projection, outputs read + written once."""
    ranks = pre.ranks.cpu()
    present = sorted({a for _, _, a in segments})
    from lightning_lorafusion.serving.step_batch import MODULE_INDEX

    total = 0
    for _, members, _ in GROUPS:
        k = cfg.module_dims(members[0])[0]
        total += rows * k * elem
        for m in members:
            n = cfg.module_dims(m)[1]
            total += 2 * rows * n * elem
            total += sum(int(ranks[MODULE_INDEX[m], a]) * (k + n) * elem for a in present)
    return total


def make_runner(variant: str, cfg, weights, inputs, pool, pre, only: str | None = None):
    """``run() -> {group: output [T, N]}`` of one variant (base products + its LoRA); ``only``:
    that group alone."""
    from lightning_lorafusion.kernels.lora_linear import linear_lora, row_tables
    from lightning_lorafusion.kernels.lora_segments import segment_lora_add
    from lightning_lorafusion.kernels.lora_tiles import tile_lora_add, tile_shrink

    sizes = {name: [cfg.module_dims(m)[1] for m in members] for name, members, _ in GROUPS}
    live_opts = None
    if "-live" not in variant:  # the grids over the whole table; "-live": over its live tiles
        pre = dataclasses.replace(pre, live=None)
    else:
        variant, suffix = variant.split("-live")
        live_opts = LIVE_OPTS[suffix]
        if live_opts.get("sorted"):
            pre = heaviest_first(pre)
    per_sm = (None, None)
    if live_opts and "scale" in live_opts:
        from lightning_lorafusion.kernels import lora_segments as ls

        scale = live_opts["scale"]
        per_sm = (ls.LIVE_SHRINK_PROGRAMS_PER_SM * scale, ls.LIVE_EXPAND_PROGRAMS_PER_SM * scale)
    groups = {name: pre.group(pool.storage, 0, members) for name, members, _ in GROUPS}
    rows = inputs["x"].shape[0]
    ra, re_ = (torch.from_numpy(t).to(pool.device) for t in row_tables(pre.segments, rows))
    tile_opts = {"tiles": {}, "tiles-lowp": {"lowp": True}, "tiles-hold": {"hold": True},
                 "tiles-hold-lowp": {"hold": True, "lowp": True}, "tiles-nb2": {"n_blocks": 2},
                 "tiles-w2": {"warps": (None, 2)}, "tiles-nb8": {"n_blocks": 8}, "tiles-nb16": {"n_blocks": 16},
                 "tiles-split1": {"split_k": 1}, "tiles-w8": {"warps": (None, 8)}}
    big = (128, 128, 64, 8, 4, 4) if pool.device.type == "cuda" else None
    # beta = 1 outputs, allocated once (the values accumulate over repetitions; the first run's
    # are checked): what the frozen product costs when it adds onto an existing output
    held = {name: torch.zeros(rows, weights[name].shape[0], dtype=inputs["x"].dtype, device=pool.device)
            for name, _, _ in GROUPS} if variant == "base-beta1" else {}

    def run():
        ys = {}
        for name, _, inp in GROUPS:
            if only is not None and name != only:
                continue
            x, w = inputs[inp], weights[name]
            if variant == "base-beta1":
                ys[name] = held[name].addmm_(x, w.t())
                continue
            if variant == "write":  # write-first: the delta (zeros elsewhere), then beta = 1 in place
                y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
                segment_lora_add(x, groups[name], list(y.split(sizes[name], dim=1)), backend="triton", check=False,
                                 form="segments", accumulate=False, per_sm=per_sm)
                ys[name] = y.addmm_(x, w.t())
                continue
            if variant.startswith("fused") or variant == "triton-base":
                lora = None if variant == "triton-base" else groups[name]
                s = tile_shrink(x, lora) if lora is not None else None
                ys[name] = linear_lora(x, w, sizes[name], lora, s, ra, re_,
                                       config=big if variant == "fused-128" else None)
                continue
            if variant == "addmm":  # the delta written alone, then the GEMM adds it as its C input
                d = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
                tile_lora_add(x, groups[name], list(d.split(sizes[name], dim=1)), check=False, store_only=True)
                ys[name] = torch.addmm(d, x, w.t())
                continue
            y = F.linear(x, w)
            outs = list(y.split(sizes[name], dim=1))
            if variant.startswith("segments"):
                segment_lora_add(x, groups[name], outs, backend="triton", check=False, form="segments",
                                 split_k=1 if variant == "segments-split1" else None,
                                 n_blocks=2 if variant == "segments-nb2" else None, per_sm=per_sm)
            elif variant.startswith("tiles"):
                tile_lora_add(x, groups[name], outs, check=False, **tile_opts[variant])
            ys[name] = y
        return ys

    return run


def heaviest_first(pre):
    """``pre`` with its live tiles ordered by their adapter's largest rank, largest first (ties
    and rows of no adapter in row order, the latter last); the padding stays after them."""
    n = int(pre.live)
    tiles = pre.tiles[:, :n].cpu()
    rank = pre.ranks.max(dim=0).values.cpu()
    key = [(-(int(rank[a]) if a >= 0 else -1), i) for i, a in enumerate(tiles[2].tolist())]
    order = torch.tensor([i for _, i in sorted(key)], dtype=torch.int64)
    out = pre.tiles.clone()
    out[:, :n] = tiles[:, order].to(out.device)
    return dataclasses.replace(pre, tiles=out)


def reference(cfg, weights, inputs, pool, pre):
    """The cuBLAS products, and products + ``segment_lora_reference``."""
    from lightning_lorafusion.kernels.lora_segments import segment_lora_reference

    base, want = {}, {}
    for name, members, inp in GROUPS:
        x = inputs[inp]
        base[name] = F.linear(x, weights[name])
        want[name] = base[name].clone()
        segment_lora_reference(x, pre.group(pool.storage, 0, members),
                               list(want[name].split([cfg.module_dims(m)[1] for m in members], dim=1)))
    return base, want


def rel_err(got, base, want) -> float:
    num = sum(float(((got[k].double() - base[k].double()) - (want[k].double() - base[k].double())).norm() ** 2)
              for k in got)
    den = sum(float((want[k].double() - base[k].double()).norm() ** 2) for k in got)
    if den == 0.0:  # base against base: relative to the products themselves
        den = sum(float(base[k].double().norm() ** 2) for k in got)
    return math.sqrt(num / max(den, 1e-30))


def time_ms(fn, dev: torch.device) -> tuple[float, str]:
    """Median ms of ``fn``: replayed as a CUDA graph (as the engine's mixed steps run; no launch
    overhead), else Triton's ``do_bench``; on the CPU one wall-clock run."""
    if dev.type == "cuda":
        import triton

        try:
            return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median"), "graph"
        except Exception as exc:  # a variant that cannot be captured is timed eagerly
            log(f"graph timing failed ({type(exc).__name__}: {str(exc)[:120]}); do_bench instead")
            return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"), "eager"
    return timed_ms(fn, dev, warmup=0, reps=1)["median_ms"], "wall"


def profile_one(fn, dev: torch.device, top: int) -> list[dict]:
    """(kernel, count, total us) of one run of ``fn`` under torch.profiler, largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    acts = [ProfilerActivity.CUDA] if dev.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0) if dev.type == "cuda" else e.self_cpu_time_total
        if us > 0:
            rows.append({"kernel": e.key[:70], "count": e.count, "us": round(us, 1)})
    return sorted(rows, key=lambda r: -r["us"])[:top]


def measure_rows(args, rows: int, kinds, bandwidth: float, stop_at: float) -> dict:
    cfg, weights, inputs, pool, pre, segments = setup(args, rows, kinds)
    dev, dtype = kinds
    floor_b = lora_floor_bytes(cfg, pre, segments, rows, torch.finfo(dtype).bits // 8)
    out = {"rows": rows, "segments": len(segments), "adapters": len({a for _, _, a in segments}),
           "tiles": sum(1 for s, e, _ in segments for _ in range(s, e, pre.block_m)),
           "lora_floor_ms": 1e3 * floor_b / bandwidth, "lora_floor_bytes": floor_b, "variants": {}}
    base_ref, want = reference(cfg, weights, inputs, pool, pre)
    for v in args.variants:
        row = {}
        if time.monotonic() > stop_at:
            out["variants"][v] = {"error": "skipped: past --deadline"}
            continue
        try:
            run = make_runner(v, cfg, weights, inputs, pool, pre)
            got = run()
            row["rel_err"] = rel_err(got, base_ref, base_ref if v in ("base", "triton-base", "base-beta1") else want)
            if v == "triton-base":
                row["rel_err"] = max(float((got[k].float() - base_ref[k].float()).abs().max()) for k in got)
            row["ms"], row["timing"] = time_ms(run, dev)
            if args.profile and v in args.profile_variants:
                row["profile"] = profile_one(run, dev, args.profile_top)
        except Exception as exc:  # one broken variant must not lose the others
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            log(f"rows={rows} {v}: {row['error']}")
        out["variants"][v] = row
        log(f"rows={rows} {v}: " + ", ".join(f"{k}={row[k]:.4g}" for k in ("ms", "rel_err") if k in row))
    if args.per_group:
        out["groups"] = per_group(args, (cfg, weights, inputs, pool, pre), (base_ref, want), dev, stop_at)
    del weights, inputs, pool
    return out


def per_group(args, layer, refs, dev, stop_at: float) -> dict:
    """{group: {variant: {ms, rel_err} or {error}}} for ``PER_GROUP_VARIANTS``, each group alone."""
    base_ref, want = refs
    out = {}
    for name, _, _ in GROUPS:
        out[name] = {}
        for v in PER_GROUP_VARIANTS:
            if time.monotonic() > stop_at:
                out[name][v] = {"error": "skipped: past --deadline"}
                continue
            try:
                run = make_runner(v, *layer, only=name)
                got = run()
                ref = base_ref if v.startswith("base") else want
                row = {"rel_err": rel_err(got, {name: base_ref[name]}, {name: ref[name]})}
                row["ms"], row["timing"] = time_ms(run, dev)
            except Exception as exc:  # one broken variant must not lose the others
                row = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            out[name][v] = row
            log(f"{name} {v}: " + ", ".join(f"{k}={row[k]:.4g}" for k in ("ms", "rel_err") if k in row))
    return out


def print_groups(report: dict) -> None:
    """Per projection group: ms of the products alone, with beta = 1, and each LoRA path's
    time over the products (LoRA ms), with its relative error."""
    print("\n| rows | group | products ms | products, beta=1 ms | today's (additive) LoRA ms | write-first LoRA ms |"
          " rel err today / write-first |")
    print("|---|---|---|---|---|---|---|")
    for res in report["rows"]:
        for name, vs in res.get("groups", {}).items():
            def ms(v):
                return vs.get(v, {}).get("ms")
            base = ms("base")

            def cell(v, minus=True):
                m = ms(v)
                if m is None:
                    return vs.get(v, {}).get("error", "")[:30]
                return f"{m - base:.3f}" if minus and base is not None else f"{m:.3f}"
            errs = " / ".join(f"{vs.get(v, {}).get('rel_err', float('nan')):.1e}" for v in ("segments", "write"))
            print(f"| {res['rows']} | {name} | {cell('base', False)} | {cell('base-beta1', False)} | "
                  f"{cell('segments')} | {cell('write')} | {errs} |")


def print_tables(report: dict, args, dtype) -> None:
    if args.profile:
        for res in report["rows"]:
            for v, row in res["variants"].items():
                for p in row.get("profile", []):
                    print(f"  profile rows={res['rows']} {v:16s} {p['us']:10.1f} us  x{p['count']:<4d} {p['kernel']}")
    print(f"\n{report.get('device_name')}  {report.get('date')}  bandwidth {report['bandwidth_gbs']:.0f} GB/s")
    print("| rows | segs / adapters | variant | ms | LoRA ms (- base) | LoRA floor ms | LoRA / floor | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for res in report["rows"]:
        base = res["variants"].get("base", {}).get("ms")
        for v, row in res["variants"].items():
            if "ms" not in row:
                print(f"| {res['rows']} | | {v} | error | | | | {row.get('error', '')[:60]} |")
                continue
            lora = row["ms"] - base if base is not None and v not in ("base", "triton-base", "base-beta1") else None
            ok = "" if row.get("rel_err", 0) <= TOL[dtype] or v == "triton-base" else " FAIL"
            lora_s = "" if lora is None else f"{lora:.3f}"
            ratio = "" if lora is None else f"{lora / res['lora_floor_ms']:.1f}x"
            print(f"| {res['rows']} | {res['segments']} / {res['adapters']} | {v} | {row['ms']:.3f} | {lora_s} | "
                  f"{res['lora_floor_ms']:.3f} | {ratio} | {row.get('rel_err', 0):.2e}{ok} |")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(ap)
    add_output_args(ap)
    ap.add_argument("--shape", choices=list(SHAPES), default="8b")
    ap.add_argument("--rows", type=comma_list(cast=int), default=[8192, 2048])
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--ranks", type=comma_list(cast=int), default=[4, 8, 16, 32, 64])
    ap.add_argument("--median-len", type=float, default=256.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--variants", type=comma_list(VARIANTS), default=list(DEFAULT_VARIANTS))
    ap.add_argument("--graph-tables", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--profile-top", type=int, default=6)
    ap.add_argument("--profile-variants", type=comma_list(VARIANTS), default=["base", "segments", "tiles", "addmm"])
    ap.add_argument("--per-group", action=argparse.BooleanOptionalAction, default=False,
                    help="also time each projection group alone (base, base-beta1, segments, write)")
    ap.add_argument("--deadline", type=float, default=120.0,
                    help="seconds from the start after which remaining variants are skipped (default %(default)s)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    dev, dtype = torch.device(args.device), dtype_of(args.dtype)
    if dev.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' modules are imported
        if "lightning_lorafusion.kernels.lora_segments" in sys.modules and os.environ["TRITON_INTERPRET"] != "1":
            raise SystemExit("the CPU run needs TRITON_INTERPRET=1")
    report = Report(dev, args, out=args.out, log=log)
    src = torch.empty(512 * 2**20 if dev.type == "cuda" else 2**24, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timed_ms(lambda: dst.copy_(src), dev, warmup=1, reps=5)["min_ms"]
    report["bandwidth_gbs"] = 2 * src.numel() / (t * 1e-3) / 1e9
    del src, dst
    report["rows"] = []
    for rows in args.rows:
        report["rows"].append(measure_rows(args, rows, (dev, dtype), report["bandwidth_gbs"] * 1e9,
                                           t0 + args.deadline))
        report.save()
    print_tables(report, args, dtype)
    if args.per_group:
        print_groups(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
