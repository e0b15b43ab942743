"""GPU benchmark of the FP8 MLP's SwiGLU: fused with its neighbours' row quantization or not.

At the Llama-3.1-8B MLP (N = 14336) and M token rows, bf16, median device time of a CUDA-graph
replay (``triton.testing.do_bench_cudagraph``) of
  forward   unfused: SwiGLU compiled by inductor (what the decoder runs), then
                     ``fp8_triton.quantize_rows`` of h (the down projection's input)
            fused:   ``fp8_triton.swiglu_quantize`` (h and its e4m3 rows in one kernel)
  backward  unfused: SwiGLU's backward compiled by inductor, then ``quantize_rows([dg, du],
                     [sw_g, sw_u])``
            fused:   ``fp8_triton.swiglu_grads_quantize``
per ``--configs`` item ``warps/block_n`` of the fused kernels ("auto": their default launch).
Each fused result is checked against the unfused one (row scales equal, h / dg / du within
bf16 rounding). GB/s counts the bytes the fused kernel must move once (inputs read, outputs
written). One table, printed last; JSON with ``--out``.

    python scripts/bench_fp8_swiglu.py --rows 8192,16384 --configs auto,8/1024,16/2048 --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_lorafusion.kernels import fp8_linear as F8  # noqa: E402
from lightning_lorafusion.kernels.fp8_triton import (  # noqa: E402
    quantize_rows,
    swiglu_grads_quantize,
    swiglu_quantize,
)


def _swiglu(g, u):
    return torch.nn.functional.silu(g) * u


def _swiglu_backward(g, u, dh):
    """What autograd derives for ``_swiglu`` (written out: autograd cannot run inside the
    graph capture that times it); compiled, one inductor kernel like the decoder's backward."""
    gf, sig, dhf = g.float(), torch.sigmoid(g.float()), dh.float()
    return (dhf * u.float() * sig * (1 + gf * (1 - sig))).to(g.dtype), (dhf * gf * sig).to(g.dtype)


def _time(fn, cuda: bool) -> float:
    if not cuda:  # (CPU smoke run: one call, wall time)
        import time

        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton

    return triton.testing.do_bench_cudagraph(fn, rep=50)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="8192,16384")
    ap.add_argument("--width", type=int, default=14336, help="intermediate size N")
    ap.add_argument("--configs", default="auto", help="comma list of auto or warps/block_n (fused kernels)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda and not F8.fp8_supported("cuda"):
        raise SystemExit("needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    q_dtype = F8.FP8_DTYPE if cuda else torch.float32  # (the interpreter's e4m3 cast is unreliable)
    swiglu, swiglu_bwd = ((torch.compile(f, dynamic=False, fullgraph=True) for f in (_swiglu, _swiglu_backward))
                          if cuda else (_swiglu, _swiglu_backward))
    configs = [None if c == "auto" else tuple(int(v) for v in c.split("/")) for c in args.configs.split(",")]
    n = args.width
    results = []
    for m in (int(r) for r in args.rows.split(",")):
        gen = torch.Generator(device=dev).manual_seed(m)
        g = torch.randn(m, n, device=dev, dtype=dtype, generator=gen) * 2
        u = torch.randn(m, n, device=dev, dtype=dtype, generator=gen)
        dh = torch.randn(m, n, device=dev, dtype=dtype, generator=gen) * 1e-3
        cg = torch.exp2(torch.randint(-9, -5, (n,), device=dev, generator=gen).float())
        cu = torch.exp2(torch.randint(-9, -5, (n,), device=dev, generator=gen).float())
        h_ref = swiglu(g, u)
        dg_ref, du_ref = swiglu_bwd(g, u, dh)
        _, s_ref = quantize_rows([h_ref], None)
        _, sg_ref = quantize_rows([dg_ref, du_ref], [cg, cu])

        def unfused_fwd():
            h = swiglu(g, u)
            quantize_rows([h], None)

        def unfused_bwd():
            dg, du = swiglu_bwd(g, u, dh)
            quantize_rows([dg, du], [cg, cu])

        unfused_fwd(), unfused_bwd()  # compiles (inductor, Triton) before any capture
        row = {"m": m, "n": n, "unfused_fwd_us": _time(unfused_fwd, cuda) * 1e3,
               "unfused_bwd_us": _time(unfused_bwd, cuda) * 1e3, "fused": []}
        for cfg in configs:
            kw = {} if cfg is None else {"num_warps": cfg[0], "block_n": cfg[1]}
            h, _, s = swiglu_quantize(g, u, q_dtype, **kw)
            dg, du, _, sg = swiglu_grads_quantize(g, u, dh, cg, cu, q_dtype, **kw)
            same_scales = float((s == s_ref).float().mean()), float((sg == sg_ref).float().mean())
            err = max(float((a.float() - b.float()).norm() / b.float().norm())
                      for a, b in ((h, h_ref), (dg, dg_ref), (du, du_ref)))
            fwd = _time(lambda: swiglu_quantize(g, u, q_dtype, **kw), cuda) * 1e3
            bwd = _time(lambda: swiglu_grads_quantize(g, u, dh, cg, cu, q_dtype, **kw), cuda) * 1e3
            size = g.element_size()
            fwd_bytes = m * n * (2 * size + size + 1)  # g, u read; h, e4m3 h written
            bwd_bytes = m * n * (3 * size + 2 * size + 2)  # g, u, dh read; dg, du, e4m3 [dg | du] written
            row["fused"].append({"config": "auto" if cfg is None else f"{cfg[0]}/{cfg[1]}", "fwd_us": fwd,
                                 "bwd_us": bwd, "fwd_gbs": fwd_bytes / fwd / 1e3, "bwd_gbs": bwd_bytes / bwd / 1e3,
                                 "same_scales": same_scales, "rel_err": err})
        results.append(row)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"\n{name}, torch {torch.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"{'M':>6} {'config':>8} {'fwd us':>8} {'unfused':>8} {'bwd us':>8} {'unfused':>8} "
          f"{'fwd GB/s':>8} {'bwd GB/s':>8} {'scales =':>10} {'rel err':>8}")
    for r in results:
        for f in r["fused"]:
            print(f"{r['m']:>6} {f['config']:>8} {f['fwd_us']:>8.1f} {r['unfused_fwd_us']:>8.1f} "
                  f"{f['bwd_us']:>8.1f} {r['unfused_bwd_us']:>8.1f} {f['fwd_gbs']:>8.0f} {f['bwd_gbs']:>8.0f} "
                  f"{min(f['same_scales']):>10.4f} {f['rel_err']:>8.1e}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "bench_fp8_swiglu.json", "w") as f:
            json.dump({"device": name, "args": vars(args), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
