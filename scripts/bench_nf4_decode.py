"""NF4 decode products: the decode kernel (``kernels/nf4_decode.py``) against bf16 cuBLAS and the
kernel's earlier tilings, at decode row counts, on one model's projection shapes (default
Llama-3.1-8B).

Sections (in this order; each is written to the JSON as soon as it is measured):

    shapes  per projection shape (qkv fused [q + 2 kv, hidden], o, gate (= up), down) and row
            count of ``--rows``: ms of ``bf16`` (``F.linear``), ``previous`` (the kernel with the
            tilings it had before the byte-permute lookup: ``previous_config``), ``decode`` (its
            default tiling now), and ``max_rel``: the decode result's largest difference from the
            reference (the weight dequantized by the torch reference, fp32 product), relative to
            its largest value
    sweep   candidate tilings per shape and rows (``--sweep on``), within ``--sweep-budget``
            seconds, each with its ``max_rel``: best first
    layer   a decoder layer's frozen products as the engine runs them (q, k, v, o, gate, up,
            down), ``bf16``, ``previous``, ``decode`` and ``buffer`` (dequantize into a scratch
            buffer, then the GEMM)
    engine  the generation engine's decode step over ``--decode-layers`` layers: bf16 base, NF4
            base with ``auto`` (the decode kernel up to its rows) and ``auto-previous`` (the same
            with ``previous_config``)

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

from harness import Report, add_device_args, add_output_args, comma_list, dtype_of, logger, timed_ms

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_nf4 import make_weights, measure_decode, projection_shapes  # noqa: E402
from lightning_lorafusion.kernels.nf4 import nf4_outputs  # noqa: E402
from lightning_lorafusion.kernels.nf4_decode import (  # noqa: E402
    DecodeConfig, default_config, default_split, nf4_linear_decode,
)

log = logger("bench_nf4_decode")
VARIANTS = ("bf16", "previous", "decode")
LAYER_VARIANTS = VARIANTS + ("buffer",)
SWEEP_ORDER = ("o", "gate", "down", "qkv")
LAYER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
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
    ap.add_argument("--warmup", type=int, default=2, help="CPU timing: untimed runs")
    ap.add_argument("--reps", type=int, default=5, help="CPU timing: timed runs (median)")
    add_device_args(ap)
    add_output_args(ap)
    return ap.parse_args(argv)


def shape_cases(args) -> dict[str, tuple[int, int]]:
    """``name -> (N, K)``: the four distinct product shapes of a Llama layer (qkv as one weight)."""
    p = projection_shapes(args)
    q, kv = p["q_proj"][0], p["k_proj"][0]
    return {"qkv": (q + 2 * kv, args.hidden), "o": p["o_proj"], "gate": p["gate_proj"], "down": p["down_proj"]}


def _time(fn, device, args, rep: int = 40) -> float:
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return timed_ms(fn, device, warmup=args.warmup, reps=args.reps)["median_ms"]


def _reference(x, w) -> torch.Tensor:
    return x.float() @ w.dequantize(x.dtype, backend="torch").float().t()


def _weight_bytes(w) -> int:
    """Bytes of an NF4 weight as the decode kernel reads them (packed codes and absmax pieces)."""
    return sum(t.numel() * t.element_size() for t in (w.data, w.absmax, w.nested_absmax) if t is not None)


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _products(variant: str, x, names, weights, config: DecodeConfig | None = None):
    """A no-argument callable running the products of ``names`` on ``x`` one after another."""
    if variant == "previous":
        config = previous_config(x.shape[0])
    if variant == "bf16":
        dense = [weights[n][0] for n in names]
        return lambda: [F.linear(x, w) for w in dense]
    nf4 = [weights[n][1] for n in names]
    if variant == "buffer":
        return lambda: nf4_outputs(x, nf4, [None] * len(nf4), "buffer")
    return lambda: [nf4_linear_decode(x, w, config=config) for w in nf4]


def _inputs(m: int, k: int, device, dtype) -> torch.Tensor:
    return torch.randn(m, k, device=device, dtype=dtype, generator=torch.Generator(device=device).manual_seed(m))


def measure_shapes(args, weights, device, dtype) -> list[dict]:
    out = []
    for m in args.rows:
        for name in weights:
            x = _inputs(m, weights[name][0].shape[1], device, dtype)
            row = {"what": name, "rows": m, "config": asdict(default_config(m))}
            want = _reference(x, weights[name][1])
            for variant in VARIANTS:  # a variant that fails is a result (NaN and its error), not a stop
                try:
                    row[f"{variant}_ms"] = _time(_products(variant, x, [name], weights), device, args, rep=20)
                    if variant != "bf16":
                        key = "max_rel" if variant == "decode" else f"{variant}_max_rel"
                        row[key] = _max_rel(_products(variant, x, [name], weights)()[0], want)
                except Exception as exc:
                    row[f"{variant}_ms"] = row["max_rel" if variant == "decode" else f"{variant}_max_rel"] = math.nan
                    row.setdefault("errors", {})[variant] = f"{type(exc).__name__}: {str(exc)[:300]}"
            row["decode_gbps"] = _weight_bytes(weights[name][1]) / row["decode_ms"] / 1e6
            row["bf16_gbps"] = weights[name][0].numel() * weights[name][0].element_size() / row["bf16_ms"] / 1e6
            out.append(row)
            log(f"{name} rows={m}: " + ", ".join(f"{v} {row[f'{v}_ms']:.4f} ms" for v in VARIANTS)
                + f", max_rel {row['max_rel']:.1e}, weight read at {row['decode_gbps']:.0f} GB/s")
    return out


def measure_layer(args, weights, device, dtype) -> list[dict]:
    out = []
    for m in args.rows:
        xs = {k: _inputs(m, k, device, dtype) for k in {weights[n][0].shape[1] for n in LAYER}}
        row = {"what": "layer", "rows": m}
        for variant in LAYER_VARIANTS:
            fns = [_products(variant, xs[weights[n][0].shape[1]], [n], weights) for n in LAYER]
            row[f"{variant}_ms"] = _time(lambda: [f() for f in fns], device, args)
        row["max_rel"] = max(_max_rel(nf4_linear_decode(xs[weights[n][0].shape[1]], weights[n][1]),
                                      _reference(xs[weights[n][0].shape[1]], weights[n][1])) for n in LAYER)
        out.append(row)
        log(f"layer rows={m}: " + ", ".join(f"{v} {row[f'{v}_ms']:.4f} ms" for v in LAYER_VARIANTS))
    return out


def previous_config(m: int) -> DecodeConfig:
    """The kernel's tilings before the byte-permute lookup (codebook gathered in registers,
    even and odd ``k`` apart), the baseline of the ``previous`` columns."""
    if m == 1:
        return DecodeConfig(block_n=64, groups=2, fill=8, use_dot=False, num_warps=4)
    if m <= 16:
        return DecodeConfig(block_n=128, num_warps=8, num_stages=4)
    return DecodeConfig(block_n=64, num_warps=4, num_stages=3, block_m=32 if m <= 32 else 64)


def sweep_configs(m: int) -> list[DecodeConfig]:
    """Candidate tilings beside ``default_config(m)``: the byte-permute lookup (4) with the
    weight in ``k`` order or even/odd apart, GEMV against dots, ``Y = X W^T`` (``x_first``: the
    weight the MMA's shared-memory operand, rows padded to 64 for Hopper's wgmma or 16), rows of
    ``W`` x warps, stages, programs per SM, split-K summed in the same launch (``fused_sum``);
    the register gather (2) to tell the lookup's share apart."""
    p4 = DecodeConfig(lookup=4, contiguous=True)
    xw = replace(p4, x_first=True, block_n=128, num_warps=4, num_stages=3, block_m=64)
    if m == 1:
        gemv = replace(p4, block_n=64, groups=2, fill=8, use_dot=False, num_warps=4)
        out = [gemv, replace(gemv, contiguous=False), replace(gemv, groups=4),
               replace(gemv, groups=4, contiguous=False),
               replace(gemv, block_n=32), replace(gemv, block_n=32, contiguous=False), replace(gemv, fill=12),
               replace(gemv, num_stages=3), xw, replace(xw, block_n=64), replace(xw, num_warps=8),
               replace(xw, block_m=16), replace(xw, fill=4), replace(p4, block_n=128, num_warps=4, num_stages=3),
               replace(gemv, contiguous=False, fused_sum=True), replace(gemv, lookup=2, contiguous=False)]
    elif m <= 16:
        dot = replace(p4, block_n=128, num_warps=4, num_stages=3)
        out = [dot, replace(dot, block_n=64), replace(dot, num_stages=4), replace(dot, fill=4), replace(dot, groups=4),
               xw, replace(xw, block_m=16), replace(xw, block_n=64), replace(xw, num_warps=8), replace(xw, fill=4),
               replace(xw, block_n=256, num_warps=8), replace(dot, contiguous=False),
               replace(dot, block_n=128, num_warps=8, num_stages=4), replace(dot, fused_sum=True),
               replace(dot, lookup=2)]
    else:
        dot = replace(p4, block_n=64, num_warps=4, num_stages=3, block_m=64)
        out = [dot, replace(dot, num_stages=4), replace(dot, fill=1), replace(dot, fill=4), replace(dot, block_n=32),
               replace(dot, block_n=128), replace(dot, groups=4), xw, replace(xw, block_n=256, num_warps=8, fill=1),
               replace(xw, block_n=64), replace(xw, num_warps=8), replace(xw, fill=1),
               replace(xw, block_n=256, num_warps=8), replace(xw, num_stages=4), replace(dot, contiguous=False),
               replace(dot, fused_sum=True), replace(dot, lookup=2)]
    return [c for c in dict.fromkeys(out) if c != default_config(m)]


def measure_sweep(args, weights, device, dtype, out: list, saved=lambda: None) -> list[dict]:
    """Each (shape, rows): the default and the other tilings, best first, appended to ``out``
    (``saved()`` after each case, so a run cut short keeps them); stops starting new cases
    after ``--sweep-budget`` seconds."""
    start = time.perf_counter()
    order = [n for n in SWEEP_ORDER if n in weights] + [n for n in weights if n not in SWEEP_ORDER]
    for name in order:  # shape by shape: each row count early, the smallest and largest N first
        w16, w = weights[name]
        for m in args.rows:
            if time.perf_counter() - start > args.sweep_budget:
                log(f"sweep: budget spent, {name} rows={m} and later cases skipped")
                return out
            x = _inputs(m, w16.shape[1], device, dtype)
            want = _reference(x, w)
            split = default_split(m, w, default_config(m))
            configs = [default_config(m), *sweep_configs(m)]
            timed = []
            for cfg in configs:
                try:
                    err = _max_rel(nf4_linear_decode(x, w, config=cfg), want)
                    ms = _time(lambda: nf4_linear_decode(x, w, config=cfg), device, args, rep=10)
                except Exception as exc:  # a tiling the compiler refuses is a result, not a stop
                    timed.append({"config": asdict(cfg), "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                    continue
                timed.append({"config": asdict(cfg), "ms": ms, "max_rel": err})
            timed.sort(key=lambda r: r.get("ms", float("inf")))
            out.append({"what": name, "rows": m, "default_split": split, "results": timed})
            saved()
            best = timed[0]
            log(f"sweep {name} rows={m}: best {best.get('ms', float('nan')):.4f} ms {best['config']}")
    return out


def measure_engine(args, device, dtype) -> list[dict]:
    """The engine's decode step: bf16 base, NF4 ``auto`` with the kernel's tilings now and with
    ``previous_config`` (``nf4_decode.default_config`` swapped for the run, then put back)."""
    from lightning_lorafusion.kernels import nf4_decode

    out = measure_decode(argparse.Namespace(**{**vars(args), "variants": ["bf16", "auto"]}), device, dtype)
    current = nf4_decode.default_config
    nf4_decode.default_config = previous_config
    try:
        previous = measure_decode(argparse.Namespace(**{**vars(args), "variants": ["auto"]}), device, dtype)
    finally:
        nf4_decode.default_config = current
    return out + [{**r, "variant": "auto-previous"} for r in previous]


def _knobs(c: dict) -> str:
    dot = ("xw" if c.get("x_first") else "dot") if c["use_dot"] else "gemv"
    return (f"l{c['lookup']}{'c' if c['contiguous'] else 's'} {dot} n{c['block_n']} "
            f"g{c['groups']} w{c['num_warps']} s{c['num_stages']} f{c['fill']}"
            + (f" m{c['block_m']}" if c['block_m'] else "") + (" fs" if c.get("fused_sum") else ""))


def print_tables(report: dict, args) -> None:
    print(f"\n{report['device_name']}, {args.dtype}; hidden {args.hidden}, intermediate {args.intermediate}")
    sweep = {(s["what"], s["rows"]): s["results"][0] for s in report.get("sweep") or [] if "ms" in s["results"][0]}
    print(f"{'what':6} {'rows':>4} {'bf16 ms':>9} {'prev ms':>9} {'decode ms':>9} {'prev/bf16':>9} {'dec/bf16':>8} "
          f"{'best/bf16':>9} {'max_rel':>8}  best tiling")
    for r in (report.get("shapes") or []) + (report.get("layer") or []):
        best = sweep.get((r["what"], r["rows"]))
        best_txt = (f"{best['ms'] / r['bf16_ms']:9.2f}", _knobs(best["config"])) if best else (f"{'-':>9}", "")
        print(f"{r['what']:6} {r['rows']:4d} {r['bf16_ms']:9.4f} {r['previous_ms']:9.4f} {r['decode_ms']:9.4f} "
              f"{r['previous_ms'] / r['bf16_ms']:9.2f} {r['decode_ms'] / r['bf16_ms']:8.2f} {best_txt[0]} "
              f"{r['max_rel']:8.1e}  {best_txt[1]}")
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
    shapes = shape_cases(args)
    with torch.no_grad():
        weights = make_weights(shapes, device, dtype)
        report.measure("shapes", lambda: measure_shapes(args, weights, device, dtype))
        if args.sweep == "on":
            report["sweep"] = []
            report.measure("sweep", lambda: measure_sweep(args, weights, device, dtype, report["sweep"], report.save))
        del weights
        layer = make_weights(projection_shapes(args), device, dtype)
        report.measure("layer", lambda: measure_layer(args, layer, device, dtype))
        del layer
        if args.decode_rows:
            report.measure("engine", lambda: measure_engine(args, device, dtype))
    print_tables(report, args)
    if report["errors"]:
        print(f"errors: {report['errors']}", file=sys.stderr)
    return report


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
