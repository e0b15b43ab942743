"""The frozen products of a decode step at its row counts: cuBLAS (``F.linear``) against
``kernels/skinny_gemm.py``'s tilings, each over cold weights, against the weight's bytes at the
device's measured copy bandwidth.

For every projection of the shape (8B: q/k/v fused [6144, 4096], o [4096, 4096], gate/up fused
[28672, 4096], down [4096, 14336], the LM head [128256, 4096]) and every row count in ``--rows``,
each implementation runs as one CUDA graph of products over ``copies`` distinct weights (enough
to exceed the L2 cache several times, as a decode step's layers do), timed by CUDA events over
``--reps`` replays: µs per product, the weight's GB/s and the bytes floor. Outputs are checked
against cuBLAS's (max |diff| over max |y|); "default" is the tiling the engine takes
(``skinny_gemm.default_config``). Before the sweep, every projection at every row count runs once
with the default tiling and is checked against cuBLAS: the file ``defaults_ok`` under ``--out``
says all agreed (a GPU command can gate the engine's setting on it). Last, per row count, a decode
step's products (32 layers of the four plus the LM head) with cuBLAS and with the best tiling per
projection.

    PYTHONPATH=. python3 scripts/bench_skinny_gemm.py --rows 1,4,16,32,64,128,256 --out $OUT
"""

from __future__ import annotations

import argparse
import os
import time

from harness import add_output_args, copy_bandwidth, device_info, graph_us, logger, write_json

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_lorafusion.kernels.skinny_gemm import (SkinnyConfig, SkinnyWorkspace, default_config,  # noqa: E402
                                                      skinny_linear)

log = logger("bench_skinny_gemm")

SHAPES_8B = {"o": (4096, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "gate_up": (28672, 4096),
             "lm_head": (128256, 4096)}
LAYERS = 32

CONFIGS = {
    "n64k128": SkinnyConfig(block_n=64, block_k=128, fill=4),
    "n64k256s3": SkinnyConfig(block_n=64, block_k=256, fill=4, num_stages=3),
    "n128k128f2": SkinnyConfig(block_n=128, block_k=128, fill=2, num_warps=8, num_stages=3),
    "xw_n64k128": SkinnyConfig(block_n=64, block_k=128, fill=4, x_first=True, num_stages=3),
    "xw_m64n128k64": SkinnyConfig(block_m=64, block_n=128, block_k=64, fill=2, x_first=True, num_stages=4),
    "xw_m128n128k64w8": SkinnyConfig(block_m=128, block_n=128, block_k=64, fill=2, x_first=True, num_warps=8,
                                     num_stages=4),
}


def check_defaults(shapes: dict, rows: list[int], ws: SkinnyWorkspace, device, dtype) -> dict:
    """Each projection at each row count with ``default_config``'s tiling against cuBLAS:
    ``"name m": {"rel_err", "ok"}`` (ok: within 2e-2 of the output's largest value)."""
    out = {}
    for sname, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        for m in rows:
            cfg = default_config(m, n, k)
            if cfg is None:
                continue
            x = torch.randn(m, k, device=device, dtype=dtype)
            try:
                ref = F.linear(x, w).float()
                got = skinny_linear(x, w, config=cfg, workspace=ws).float()
                err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                out[f"{sname} {m}"] = {"rel_err": err, "ok": err < 2e-2}
            except Exception as exc:  # noqa: BLE001 - reported, the gate fails
                out[f"{sname} {m}"] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}", "ok": False}
        del w
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,32,64,128,256")
    ap.add_argument("--shapes", default=",".join(SHAPES_8B))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--cold-mib", type=int, default=512, help="weights per graph: at least this many MiB")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--stop-s", type=float, default=1e9, help="skip what is left after this many seconds")
    add_output_args(ap)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    device = torch.device("cuda")
    dtype = torch.bfloat16
    rows = [int(r) for r in args.rows.split(",")]
    shapes = {s: SHAPES_8B[s] for s in args.shapes.split(",")}
    configs = {c: CONFIGS[c] for c in args.configs.split(",")}
    bw = copy_bandwidth(device)
    report = {**device_info(device), "args": vars(args), "bandwidth": bw, "results": []}
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    ws = SkinnyWorkspace.create(device, 65536)
    torch.manual_seed(0)
    report["defaults"] = check_defaults(shapes, rows, ws, device, dtype)
    bad = {k: v for k, v in report["defaults"].items() if not v.get("ok")}
    log(f"default tilings against cuBLAS: {len(report['defaults']) - len(bad)} agree, {len(bad)} do not {bad}")
    if not bad and args.out:
        os.makedirs(args.out, exist_ok=True)
        open(os.path.join(args.out, "defaults_ok"), "w").close()
    write_json(args.out, "bench_skinny_gemm.json", report)
    for sname, (n, k) in shapes.items():
        copies = max(1, -(-args.cold_mib * 2**20 // (n * k * 2)))
        weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
        for m in rows:
            if time.perf_counter() - start > args.stop_s:
                log(f"stop: {sname} m={m} and after skipped")
                break
            x = torch.randn(m, k, device=device, dtype=dtype)
            outs = [torch.empty(m, n, device=device, dtype=dtype) for _ in range(copies)]
            ref = F.linear(x, weights[0])
            floor_us = (n * k + m * k + m * n) * 2 / bw * 1e6
            row = {"shape": sname, "n": n, "k": k, "m": m, "floor_us": floor_us, "copies": copies}
            row["cublas_us"] = graph_us(lambda i: torch.mm(x, weights[i].t(), out=outs[i]), copies, args.reps)
            row["configs"] = {}
            chosen = dict(configs)
            if default_config(m, n, k) is not None:
                chosen["default"] = default_config(m, n, k)
            for cname, cfg in chosen.items():
                try:
                    y = skinny_linear(x, weights[0], config=cfg, workspace=ws)
                    err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
                    us = graph_us(lambda i, cfg=cfg: skinny_linear(x, weights[i], config=cfg, workspace=ws,
                                                                    out=outs[i]), copies, args.reps)
                    row["configs"][cname] = {"us": us, "rel_err": err}
                except Exception as exc:  # noqa: BLE001 - a tiling that does not fit: recorded, others go on
                    row["configs"][cname] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
            ok = {c: v for c, v in row["configs"].items() if "us" in v and v["rel_err"] < 2e-2}
            best = min(ok, key=lambda c: ok[c]["us"]) if ok else None
            row["best"] = best
            row["best_us"] = ok[best]["us"] if best else None
            report["results"].append(row)
            log(f"{sname:8} m={m:4}: floor {floor_us:7.1f} us, cuBLAS {row['cublas_us']:7.1f} "
                f"({floor_us / row['cublas_us']:.0%}), best {best} {row['best_us'] or float('nan'):7.1f} us "
                + " ".join(f"{c}={v.get('us', float('nan')):.1f}" for c, v in row["configs"].items()))
            write_json(args.out, "bench_skinny_gemm.json", report)
        del weights
        torch.cuda.empty_cache()
    print(table(report, shapes, rows))
    return report


def table(report: dict, shapes: dict, rows: list[int]) -> str:
    """µs per product, cuBLAS / best tiling (its name), and a decode step's products summed."""
    by = {(r["shape"], r["m"]): r for r in report["results"]}
    lines = ["| rows | " + " | ".join(f"{s}: floor / cuBLAS / best µs" for s in shapes)
             + " | step's products: floor / cuBLAS / best-of-both ms |", "|---" * (len(shapes) + 2) + "|"]
    for m in rows:
        cells, tot = [], [0.0, 0.0, 0.0]
        for s in shapes:
            r = by.get((s, m))
            if r is None:
                cells.append("-")
                continue
            b = r["best_us"]
            cells.append(f"{r['floor_us']:.1f} / {r['cublas_us']:.1f} / "
                         + ("-" if b is None else f"{b:.1f} ({r['best']})"))
            times = r["floor_us"], r["cublas_us"], min(r["cublas_us"], b or float("inf"))
            mult = 1 if s == "lm_head" else LAYERS
            tot = [t + mult * v for t, v in zip(tot, times)]
        step = "-" if "-" in cells or len(shapes) < len(SHAPES_8B) else " / ".join(f"{t / 1e3:.2f}" for t in tot)
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {step} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
