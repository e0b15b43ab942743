"""GPU benchmark of the FP8 base's decode product: few rows against the Llama-3.1-8B projections.

Per (M, K, N), median device time of a CUDA-graph replay (``triton.testing.do_bench_cudagraph``):
  bf16         F.linear with the bf16 weight (cuBLAS)
  fp8_rowwise  the training product: x quantized per row (fp8_triton.quantize_rows), then
               torch._scaled_mm with row-wise scales (what decode ran before weight-only)
  fp8_wo       fp8_triton.weight_only_linear: e4m3 weights converted in registers, bf16 x
and, per variant, the weight bytes read per microsecond (GB/s), plus the weight-only product's
error against x @ dequantized(W)^T in fp32. Each timed call runs the product over ``COPIES``
different weights (more bytes than the L2 cache holds, as in a decode step, where every layer's
weights are new), and reports the time per product. ``fp8_wo`` uses the tile sizes given by
``--configs`` (``bn/bk/split/warps`` items; the fastest per shape is reported) or the
defaults. One table, printed last; JSON with ``--out``.

    python scripts/bench_fp8_decode.py --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_lorafusion.kernels import fp8_linear as F8  # noqa: E402
from lightning_lorafusion.kernels.fp8_triton import quantize_rows, weight_only_linear  # noqa: E402

SHAPES = ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))  # (K, N) of q/o, k/v, gate/up, down
COPIES = 4


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--configs", default="", help="comma list of bn/bk/split/warps to sweep for fp8_wo")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not F8.fp8_supported("cuda"):
        raise SystemExit("needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")
    dev = torch.device("cuda")
    configs = [tuple(int(v) for v in c.split("/")) for c in args.configs.split(",") if c] or [None]
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        for k, n in SHAPES:
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(COPIES)]
            fws = [F8.quantize_weight(w) for w in ws]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)

            def rowwise():
                xq, sx = quantize_rows([x], None)
                for fw in fws:
                    F8._scaled_mm(xq, sx, fw.data, fw.scale.view(1, -1), torch.bfloat16, True)

            def wo(cfg):
                kw = {} if cfg is None else dict(block_n=cfg[0], block_k=cfg[1], split_k=cfg[2], num_warps=cfg[3])
                return lambda: [weight_only_linear(x, fw.data, fw.scale, **kw) for fw in fws]

            def timed(fn):
                return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") / COPIES

            want = x.float() @ fws[0].dequantize().t()
            row = {"m": m, "k": k, "n": n}
            row["bf16_us"] = timed(lambda: [F.linear(x, w) for w in ws])
            row["fp8_rowwise_us"] = timed(rowwise)
            best = None
            for cfg in configs:
                try:
                    us = timed(wo(cfg))
                except Exception as e:  # a config that does not fit (shared memory, K split)
                    print(f"config {cfg} at {m}x{k}x{n}: {type(e).__name__}", flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
            row["fp8_wo_us"], row["fp8_wo_config"] = best
            got = wo(best[1])()[0]
            row["wo_rel_err"] = float((got.float() - want).norm() / want.norm())
            for name in ("bf16", "fp8_rowwise", "fp8_wo"):
                row[name + "_gbps"] = n * k * (2 if name == "bf16" else 1) / row[name + "_us"] / 1e3
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"{'M':>3} {'K':>6} {'N':>6} | {'bf16 us':>8} {'rowwise us':>10} {'wo us':>8} | {'wo/bf16':>7} "
          f"{'wo GB/s':>8} {'wo err':>8}  wo config (bn/bk/split/warps)")
    for r in rows:
        print(f"{r['m']:>3} {r['k']:>6} {r['n']:>6} | {r['bf16_us']:>8.1f} {r['fp8_rowwise_us']:>10.1f} "
              f"{r['fp8_wo_us']:>8.1f} | {r['fp8_wo_us'] / r['bf16_us']:>7.2f} {r['fp8_wo_gbps']:>8.0f} "
              f"{r['wo_rel_err']:>8.1e}  {r['fp8_wo_config']}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_fp8_decode.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
