"""NF4 decode products: the decode kernel (``kernels/nf4_decode.py``) against bf16 cuBLAS and the
kernel's earlier tilings, at decode row counts, on one model's projection shapes (default
Llama-3.1-8B).

Sections (in this order; each is written to the JSON as soon as it is measured):

    shapes  per launch of the engine's decode step (``qkv``: q, k and v, one fused 16-bit weight
            and one NF4 group launch; ``o``; ``gate_up``: gate and up, likewise; ``down``) and row
            count of ``--rows``: ms of ``bf16`` (``F.linear`` on the fused weight, as the engine
            runs it), ``today`` (the kernel before groups: one launch pair per weight, its
            tilings then, ``today_config``), ``new`` (one launch for the group, the default
            tiling now), and ``max_rel``: the new result's largest difference from the reference
            (the weight dequantized by the torch reference, fp32 product), relative to its
            largest value
    layer   a decoder layer's frozen products as the engine runs them: ``bf16`` (4 GEMMs),
            ``today`` (7 products), ``new`` (4 launches)
    engine  the generation engine's decode step over ``--decode-layers`` layers: bf16 base, NF4
            base with ``auto`` (the decode kernel up to its rows) and ``auto-today`` (the same
            with ``today_config`` and no group launches)
    sweep   last, candidate tilings per launch and rows (``--sweep on``), within ``--sweep-budget``
            seconds, each with its ``max_rel``: best first

Every timed callable runs its products over ``--copies`` copies of the weights in turn (time per
copy), so the weights are read from memory as in a step over many layers, not from the L2 cache
(which holds a 4096 x 4096 bf16 weight).

Times: CUDA-graph medians of Triton's ``do_bench_cudagraph`` on a GPU (no launch overhead, as the
engine's captured decode steps run), wall-clock medians elsewhere. On a CPU the kernel runs in the
Triton interpreter: set ``TRITON_INTERPRET=1`` in the environment.

    python scripts/bench_nf4_decode.py --out $OUT                                   # 8B shapes, GPU
    TRITON_INTERPRET=1 python scripts/bench_nf4_decode.py --device cpu --dtype float32 --hidden 64 --intermediate 128 \\
        --heads 4 --kv-heads 2 --head-dim 16 --vocab 128 --rows 1,5 --decode-rows 1,2 --decode-layers 1 --reps 1
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, replace

from harness import (Report, add_device_args, add_layer_shape_args, add_output_args, comma_list,
                     dtype_of, logger, timed_ms)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_nf4 import make_weights, measure_decode, projection_shapes  # noqa: E402
from lightning_lorafusion.kernels.nf4 import Nf4Weight  # noqa: E402
from lightning_lorafusion.kernels.nf4_decode import (  # noqa: E402
    DecodeConfig, DecodeWorkspace, default_config, default_split, nf4_decode_group, nf4_linear_decode,
)

log = logger("bench_nf4_decode")
VARIANTS = ("bf16", "today", "new")
# (launch, rows) in the order the sweep takes them: the cases furthest behind bf16 first
SWEEP_ORDER = (("o", 64), ("qkv", 64), ("o", 16), ("o", 1), ("down", 64), ("gate_up", 64), ("qkv", 16),
               ("qkv", 1), ("down", 16), ("gate_up", 16), ("down", 1), ("gate_up", 1))
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_shape_args(ap)
    ap.add_argument("--vocab", type=int, default=128256, help="engine: the model's vocabulary")
    ap.add_argument("--rows", type=comma_list(cast=int), default=[1, 16, 64], help="token counts")
    ap.add_argument("--decode-rows", type=lambda s: [int(v) for v in s.split(",") if v], default=[1, 16, 64],
                    help="engine decode steps at these batch sizes ('' skips)")
    ap.add_argument("--decode-layers", type=int, default=8, help="engine: layers of the model")
    ap.add_argument("--decode-steps", type=int, default=16, help="engine: timed steps per batch size")
    ap.add_argument("--prompt", type=int, default=64, help="engine: prompt tokens per request")
    ap.add_argument("--cuda-graphs", default="auto", choices=("auto", "on", "off"),
                    help="engine: EngineConfig.cuda_graphs")
    ap.add_argument("--sweep", choices=("on", "off"), default="on", help="time other tilings of the kernel")
    ap.add_argument("--sweep-budget", type=float, default=60.0, help="seconds the sweep may take")
    ap.add_argument("--copies", type=int, default=4, help="weight copies each timing runs through (cold L2)")
    ap.add_argument("--warmup", type=int, default=2, help="CPU timing: untimed runs")
    ap.add_argument("--reps", type=int, default=5, help="CPU timing: timed runs (median)")
    add_device_args(ap)
    add_output_args(ap)
    return ap.parse_args(argv)


def _time(fn, device, args, rep: int = 40) -> float:
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return timed_ms(fn, device, warmup=args.warmup, reps=args.reps)["median_ms"]


def _reference(x, w) -> torch.Tensor:
    return x.float() @ w.dequantize(x.dtype, backend="torch").float().t()


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _copy_nf4(w: Nf4Weight) -> Nf4Weight:
    return Nf4Weight(*(t.clone() if t is not None else None for t in
                       (w.data, w.absmax, w.code, w.nested_absmax, w.nested_code, w.offset)))


def make_launches(args, device, dtype) -> dict[str, list[tuple[torch.Tensor, list[Nf4Weight]]]]:
    """Per launch of the engine's step (``GROUPS``): ``--copies`` of (the fused 16-bit weight,
    its members' NF4 weights)."""
    weights = make_weights(projection_shapes(args), device, dtype)
    out = {}
    for name, members in GROUPS.items():
        dense = torch.cat([weights[m][0] for m in members])
        nf4 = [weights[m][1] for m in members]
        out[name] = [(dense, nf4)] + [(dense.clone(), [_copy_nf4(w) for w in nf4]) for _ in range(args.copies - 1)]
    return out


def _launch_fn(variant: str, x, copies, config: DecodeConfig | None = None, workspace=None):
    """A no-argument callable running one launch's products on ``x`` over every copy."""
    if variant == "bf16":
        dense = [d for d, _ in copies]
        return lambda: [F.linear(x, d) for d in dense]
    groups = [ws for _, ws in copies]
    if variant == "today":
        cfg = today_config(x.shape[0])
        return lambda: [nf4_linear_decode(x, w, config=cfg) for ws in groups for w in ws]
    return lambda: [nf4_decode_group(x, ws, [None] * len(ws), config=config, workspace=workspace) for ws in groups]


def _inputs(m: int, k: int, device, dtype) -> torch.Tensor:
    return torch.randn(m, k, device=device, dtype=dtype, generator=torch.Generator(device=device).manual_seed(m))


def _group_rel(ys, x, ws) -> float:
    return max(_max_rel(y, _reference(x, w)) for y, w in zip(ys, ws))


def measure_shapes(args, launches, device, dtype) -> list[dict]:
    """Per launch and rows: bf16, today, new (with a kept workspace, as the engine runs it; the
    ``max_rel`` call after the timed replays checks that its counters stayed zeroed)."""
    out = []
    workspace = DecodeWorkspace.create(device)
    for m in args.rows:
        for name, copies in launches.items():
            dense, ws = copies[0]
            x = _inputs(m, dense.shape[1], device, dtype)
            row = {"what": name, "rows": m, "config": asdict(default_config(m, tuple(dense.shape)))}
            for variant in VARIANTS:  # a variant that fails is a result (NaN and its error), not a stop
                try:
                    fn = _launch_fn(variant, x, copies, workspace=workspace)
                    row[f"{variant}_ms"] = _time(fn, device, args, rep=20) / len(copies)
                except Exception as exc:
                    row[f"{variant}_ms"] = math.nan
                    row.setdefault("errors", {})[variant] = f"{type(exc).__name__}: {str(exc)[:300]}"
            row["max_rel"] = _group_rel(nf4_decode_group(x, ws, [None] * len(ws), workspace=workspace), x, ws)
            row["today_max_rel"] = _group_rel([nf4_linear_decode(x, w, config=today_config(m)) for w in ws], x, ws)
            out.append(row)
            log(f"{name} rows={m}: " + ", ".join(f"{v} {row[f'{v}_ms']:.4f} ms" for v in VARIANTS)
                + f", max_rel {row['max_rel']:.1e}")
    return out


def measure_layer(args, launches, device, dtype) -> list[dict]:
    out = []
    for m in args.rows:
        xs = {k: _inputs(m, k, device, dtype) for k in {c[0][0].shape[1] for c in launches.values()}}
        row = {"what": "layer", "rows": m}
        workspace = DecodeWorkspace.create(device)
        for variant in VARIANTS:
            fns = [_launch_fn(variant, xs[c[0][0].shape[1]], c, workspace=workspace) for c in launches.values()]
            row[f"{variant}_ms"] = _time(lambda: [f() for f in fns], device, args) / args.copies
        out.append(row)
        log(f"layer rows={m}: " + ", ".join(f"{v} {row[f'{v}_ms']:.4f} ms" for v in VARIANTS))
    return out


def today_config(m: int, shape=None) -> DecodeConfig:
    """The kernel's tilings before group launches and per-shape choices (one launch pair per
    weight), the baseline of the ``today`` columns."""
    if m == 1:
        return DecodeConfig(block_n=64, groups=4, fill=8, use_dot=False, num_warps=4, lookup=4)
    if m <= 16:
        return DecodeConfig(block_n=64, num_warps=4, num_stages=3, lookup=4, contiguous=True)
    return DecodeConfig(block_n=64, num_warps=4, num_stages=3, block_m=64, lookup=4, contiguous=True, x_first=True)


def sweep_configs(m: int, shape) -> list[DecodeConfig]:
    """Candidate tilings beside ``default_config(m, shape)``: GEMV against dots, ``W X^T`` against
    ``X W^T`` (the weight wgmma's shared-memory operand), rows of ``W`` x warps (wider tiles read
    ``X`` fewer times), stages, programs per SM, no split-K, split-K summed in the launch with
    kept counters (``fused_sum``, no fill kernel)."""
    p4 = DecodeConfig(lookup=4, contiguous=True)
    xw = replace(p4, x_first=True, block_n=64, num_warps=4, num_stages=3, block_m=64)
    if m == 1:
        gemv = replace(p4, block_n=64, groups=4, fill=8, use_dot=False, num_warps=4, contiguous=False)
        out = [gemv, replace(gemv, contiguous=True), replace(gemv, fused_sum=True),
               replace(gemv, contiguous=True, fused_sum=True), replace(gemv, fill=4), replace(gemv, fill=16),
               replace(gemv, block_n=32), replace(gemv, block_n=128, num_warps=8), replace(gemv, groups=2),
               replace(gemv, fill=4, fused_sum=True)]
    elif m <= 16:
        dot = replace(p4, block_n=64, num_warps=4, num_stages=3)
        out = [dot, replace(dot, fused_sum=True), replace(dot, fill=4), replace(dot, fill=4, fused_sum=True),
               replace(dot, fill=8, fused_sum=True), replace(dot, fill=4, fused_sum=True, num_stages=4),
               replace(dot, block_n=128), replace(dot, block_n=32, fill=4, fused_sum=True), replace(xw, block_m=16)]
    else:
        out = [xw, replace(xw, block_n=128), replace(xw, block_n=128, num_warps=8), replace(xw, block_n=32),
               replace(xw, block_n=32, fill=4), replace(xw, groups=1), replace(xw, groups=1, fill=4),
               replace(xw, num_warps=8), replace(xw, fill=3), replace(xw, num_stages=2), replace(xw, fused_sum=True),
               replace(xw, block_n=128, fused_sum=True)]
    return [c for c in dict.fromkeys(out) if c != default_config(m, shape)]


def measure_sweep(args, launches, device, dtype, out: list, saved=lambda: None) -> list[dict]:
    """Each (launch, rows): the default and the other tilings, best first, appended to ``out``
    (``saved()`` after each case, so a run cut short keeps them); stops starting new cases
    after ``--sweep-budget`` seconds."""
    start = time.perf_counter()
    workspace = DecodeWorkspace.create(device)
    cases = [c for c in SWEEP_ORDER if c[0] in launches and c[1] in args.rows]
    cases += [(n, m) for m in args.rows for n in launches if (n, m) not in cases]
    for name, m in cases:
        copies = launches[name]
        dense, ws = copies[0]
        if time.perf_counter() - start > args.sweep_budget:
            log(f"sweep: budget spent, {name} rows={m} and later cases skipped")
            return out
        x = _inputs(m, dense.shape[1], device, dtype)
        shape = tuple(dense.shape)
        configs = [default_config(m, shape), *sweep_configs(m, shape)]
        timed = []
        for cfg in configs:
            try:
                err = _group_rel(nf4_decode_group(x, ws, [None] * len(ws), config=cfg, workspace=workspace), x, ws)
                ms = _time(_launch_fn("new", x, copies, cfg, workspace), device, args, rep=10) / len(copies)
            except Exception as exc:  # a tiling the compiler refuses is a result, not a stop
                timed.append({"config": asdict(cfg), "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                continue
            timed.append({"config": asdict(cfg), "ms": ms, "max_rel": err,
                          "split": default_split(m, ws[0], cfg, shape[0])})
        timed.sort(key=lambda r: r.get("ms", float("inf")))
        out.append({"what": name, "rows": m, "results": timed})
        saved()
        best = timed[0]
        log(f"sweep {name} rows={m}: best {best.get('ms', float('nan')):.4f} ms {_knobs(best['config'])}; "
            + "; ".join(f"{_knobs(r['config'])} {r['ms']:.4f}" for r in timed[1:] if "ms" in r))
    return out


def measure_engine(args, device, dtype) -> list[dict]:
    """The engine's decode step: bf16 base, NF4 ``auto`` with the kernel now, and as it was
    (``today_config``, no group launches: ``nf4_decode`` swapped for the run, then put back)."""
    from lightning_lorafusion.kernels import nf4_decode

    out = measure_decode(argparse.Namespace(**{**vars(args), "variants": ["bf16", "auto"]}), device, dtype)
    current, groupable = nf4_decode.default_config, nf4_decode.groupable  # groupable: what nf4_outputs asks
    nf4_decode.default_config, nf4_decode.groupable = today_config, lambda *a: False
    try:
        today = measure_decode(argparse.Namespace(**{**vars(args), "variants": ["auto"]}), device, dtype)
    finally:
        nf4_decode.default_config, nf4_decode.groupable = current, groupable
    return out + [{**r, "variant": "auto-today"} for r in today]


def _knobs(c: dict) -> str:
    dot = ("xw" if c.get("x_first") else "dot") if c["use_dot"] else "gemv"
    return (f"l{c['lookup']}{'c' if c['contiguous'] else 's'} {dot} n{c['block_n']} "
            f"g{c['groups']} w{c['num_warps']} s{c['num_stages']} f{c['fill']}"
            + (f" m{c['block_m']}" if c['block_m'] else "") + (" fs" if c.get("fused_sum") else ""))


def print_tables(report: dict, args) -> None:
    print(f"\n{report['device_name']}, {args.dtype}; hidden {args.hidden}, intermediate {args.intermediate}; "
          f"ms per launch over {args.copies} weight copies")
    sweep = {(s["what"], s["rows"]): s["results"][0] for s in report.get("sweep") or [] if "ms" in s["results"][0]}
    print(f"{'what':8} {'rows':>4} {'bf16 ms':>9} {'today ms':>9} {'new ms':>9} {'today/bf16':>10} {'new/bf16':>8} "
          f"{'best/bf16':>9} {'max_rel':>8}  best tiling")
    for r in (report.get("shapes") or []) + (report.get("layer") or []):
        best = sweep.get((r["what"], r["rows"]))
        best_txt = (f"{best['ms'] / r['bf16_ms']:9.2f}", _knobs(best["config"])) if best else (f"{'-':>9}", "")
        rel = f"{r['max_rel']:8.1e}" if "max_rel" in r else f"{'-':>8}"
        print(f"{r['what']:8} {r['rows']:4d} {r['bf16_ms']:9.4f} {r['today_ms']:9.4f} {r['new_ms']:9.4f} "
              f"{r['today_ms'] / r['bf16_ms']:10.2f} {r['new_ms'] / r['bf16_ms']:8.2f} {best_txt[0]} {rel}  "
              f"{best_txt[1]}")
    if report.get("engine"):
        print(f"\nengine decode step ({args.decode_layers} layers), ms: variant, rows, step, forward")
        for r in report["engine"]:
            fwd = "-" if r["forward_ms"] is None else f"{r['forward_ms']:.3f}"
            print(f"  {r['variant']:13} {r['rows']:4d} {r['step_ms']:9.3f} {fwd:>9}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), dtype_of(args.dtype)
    torch.manual_seed(0)
    report = Report(device, args, out=args.out, file_name=f"nf4_decode_h{args.hidden}_i{args.intermediate}.json",
                    log=log, describe=lambda rows: f"{len(rows)} rows")
    with torch.no_grad():
        launches = make_launches(args, device, dtype)
        report.measure("shapes", lambda: measure_shapes(args, launches, device, dtype))
        report.measure("layer", lambda: measure_layer(args, launches, device, dtype))
        if args.decode_rows:
            report.measure("engine", lambda: measure_engine(args, device, dtype))
        print_tables(report, args)  # the side-by-side result first: a run cut short in the sweep keeps it
        if args.sweep == "on":
            report["sweep"] = []
            report.measure("sweep", lambda: measure_sweep(args, launches, device, dtype, report["sweep"], report.save))
            print_tables(report, args)
    if report["errors"]:
        print(f"errors: {report['errors']}", file=sys.stderr)
    return report


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
