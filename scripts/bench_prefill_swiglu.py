"""One 8B layer's gate/up product, the prefill rows' gate/up LoRA and SwiGLU, side by side in one
process: the LoRA written into gate/up's outputs (first, with cuBLAS adding the product as its C
input, or added after the product) against expanded inside SwiGLU (``segment_swiglu``), and the
base model's product + SwiGLU alone.

Cases as ``bench_segment_forms`` builds them (its ``--mixes``, the tables of a captured mixed
step: covering, padded, a live count up to ``LIVE_GRID_MAX_ROWS`` rows as the engine runs them).
Variants (``VARIANTS``): "base" (the product, plain SwiGLU), "write" (written first, the tile
expand: the engine's path in steps mostly of adapted rows), "write-held" (the same with the held
expand, ``segment_expand``), "add" (the product, then the additive expand), "swiglu" (the
split-K shrink, the product, SwiGLU with the delta in it). Each variant's launches are timed
together as CUDA graph replays (median ms) and its SwiGLU output checked against
``swiglu_segments_reference`` over the same product (relative error). Floor: gate/up's product
written and read once, x, the weight and SwiGLU's output once, at the measured copy bandwidth
(the LoRA's own bytes are small beside them).

    PYTHONPATH=. python3 scripts/bench_prefill_swiglu.py --rows 8192,3072,512 --out $OUT/swiglu
    PYTHONPATH=. python3 scripts/bench_prefill_swiglu.py --device cpu --dtype float32 --shape tiny --rows 48 \\
        --mixes 3xmix --request-len 10
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

from harness import Report, add_device_args, add_output_args, comma_list, dtype_of, logger, timed_ms

import torch  # noqa: E402

import bench_segment_forms as bsf  # noqa: E402

log = logger("bench_prefill_swiglu")
VARIANTS = ("base", "write", "write-held", "add", "swiglu")


def make_run(variant: str, x, w, lora, dev):
    """``run() -> act`` of one variant over the gate/up group (fresh outputs each call, as a step)."""
    from lightning_lorafusion.kernels.lora_epilogues import swiglu_ahead
    from lightning_lorafusion.kernels.lora_segments import segment_lora_add, segment_lora_shrink

    n = w.shape[0] // 2
    backend = "triton" if dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"

    def run():
        if variant == "swiglu":
            s, _ = segment_lora_shrink(x, lora, form="splitk")
            y = x @ w.t()
            g, u = y.split([n, n], dim=1)
            return swiglu_ahead(g, u, prefill=(lora, s), backend="auto")[0]
        if variant.startswith("write"):
            y = x.new_empty(x.shape[0], 2 * n)
            segment_lora_add(x, lora, list(y.split([n, n], dim=1)), backend=backend, check=False, form="splitk",
                             accumulate=False, expand="held" if variant == "write-held" else "tile")
            y.addmm_(x, w.t())
        else:
            y = x @ w.t()
            if variant == "add":
                segment_lora_add(x, lora, list(y.split([n, n], dim=1)), backend=backend, check=False,
                                 form="splitk", expand="tile")
        g, u = y.split([n, n], dim=1)
        return swiglu_ahead(g, u, backend="auto")[0]
    return run


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(ap)
    add_output_args(ap)
    ap.add_argument("--shape", choices=list(bsf.SHAPES), default="8b")
    ap.add_argument("--rows", type=comma_list(cast=int), default=[512, 3072, 8192])
    ap.add_argument("--mixes", type=comma_list(), default=["64x16", "64xmix"])
    ap.add_argument("--variants", type=comma_list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--request-len", type=int, default=256)
    ap.add_argument("--graph-tables", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--rep", type=int, default=30, help="do_bench_cudagraph's rep (ms)")
    ap.add_argument("--deadline", type=float, default=220.0)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    from lightning_lorafusion.kernels.segment_swiglu import swiglu_segments_reference
    from lightning_lorafusion.serving.mixed_graphs import LIVE_GRID_MAX_ROWS

    args = parse_args(argv)
    t0 = time.monotonic()
    dev, dtype = torch.device(args.device), dtype_of(args.dtype)
    if dev.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    report = Report(dev, args, out=args.out, log=log)
    src = torch.empty(512 * 2**20 if dev.type == "cuda" else 2**22, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timed_ms(lambda: dst.copy_(src), dev, warmup=1, reps=5)["min_ms"]
    bw = 2 * src.numel() / (t * 1e-3)
    report["bandwidth_gbs"] = bw / 1e9
    del src, dst
    report["cases"] = []
    elem = torch.finfo(dtype).bits // 8
    for mix in args.mixes:
        for rows in args.rows:
            if time.monotonic() - t0 > args.deadline:
                break
            groups, loras, inputs, _outs, info = bsf.build_case(args, rows, mix, dev, dtype)
            (_, ns, k), = [gr for gr in groups if gr[0] == "gate_up"]
            lora = loras["gate_up"] if rows <= LIVE_GRID_MAX_ROWS else dataclasses.replace(loras["gate_up"], live=None)
            x = inputs["gate_up"]
            g = torch.Generator(device=dev).manual_seed(rows)
            w = (torch.randn(sum(ns), k, generator=g, device=dev, dtype=torch.float32) * k**-0.5).to(dtype)
            case = {"rows": rows, "mix": mix, "tiles": info["tiles"], "adapters": info["adapters"],
                    "floor_ms": 1e3 * (rows * k + sum(ns) * k + 2 * rows * sum(ns) + rows * ns[0]) * elem / bw,
                    "variants": {}}
            y = x @ w.t()
            want = swiglu_segments_reference(x, *y.split(list(ns), dim=1), lora).double()
            plain = torch.nn.functional.silu(y[:, :ns[0]]) * y[:, ns[0]:]
            # how far the LoRA moves SwiGLU's output (a check that the cases carry one)
            case["lora_rel"] = float((want - plain.double()).norm() / plain.double().norm().clamp_min(1e-30))
            for v in args.variants:
                if time.monotonic() - t0 > args.deadline:
                    case["variants"][v] = {"error": "skipped: deadline"}
                    continue
                row = {}
                try:
                    run = make_run(v, x, w, lora, dev)
                    act = run().double()
                    ref = plain.double() if v == "base" else want
                    row["rel_err"] = float((act - ref).norm() / ref.norm().clamp_min(1e-30))
                    row["ms"] = (triton_ms(run, args.rep) if dev.type == "cuda"
                                 else timed_ms(run, dev, warmup=0, reps=1)["median_ms"])
                except Exception as exc:  # one broken variant must not lose the others
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                case["variants"][v] = row
                log(f"rows={rows} {mix} {v}: " + ", ".join(f"{k}={row[k]:.4g}" for k in ("ms", "rel_err") if k in row)
                    + (f" {row['error']}" if "error" in row else ""))
            report["cases"].append(case)
            report.save()
            del groups, loras, inputs, _outs, x, w, y, want, plain
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    bsf.print_table(report, args, dtype, checked="SwiGLU's output")
    return 0


def triton_ms(fn, rep: int) -> float:
    import triton

    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


if __name__ == "__main__":
    raise SystemExit(main())
