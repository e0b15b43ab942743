"""The serving engine's elementwise kernels at prefill sizes: SwiGLU and RoPE + KV write over
thousands of rows, launch settings swept, against torch's ops on the same inputs.

At issue 12's 8B setting the 64 prompts of 256 tokens are prefilled in one 16,384-row step,
where these kernels' launch settings (chosen for decode rows and their fused LoRA expand)
matter: the step's profile (session 12, call 2) showed the SwiGLU moving its bytes at about a
third of the copy bandwidth. For each setting: median time of CUDA-event-timed repeats, the
bytes it must move, and the rate; outputs are checked against the torch composition first.

    python3 scripts/bench_prefill_epilogues.py --rows 4096,16384 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from lightning_lorafusion.kernels import lora_epilogues as epi
from lightning_lorafusion.kernels.lora_epilogues import rope_write_kv, rope_write_kv_reference, swiglu

SHAPES = {"8b": dict(hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128),
          "1b": dict(hidden=2048, inter=8192, heads=32, kv_heads=8, head_dim=64)}


def timed(fn, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` CUDA-event-timed calls (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench_swiglu(shape: dict, rows: int, reps: int, dtype) -> list[dict]:
    inter = shape["inter"]
    gu = torch.randn(rows, 2 * inter, device="cuda", dtype=dtype)
    g, u = gu[:, :inter], gu[:, inter:]
    want = torch.nn.functional.silu(g) * u
    moved = 3 * rows * inter * gu.element_size()  # gate and up read, the product written
    out = []
    for block_n in (1024, 2048, 4096):
        for warps in (4, 8, 16):
            if block_n // (32 * warps) < 1:
                continue
            got = swiglu(g, u, block_n=block_n, num_warps=warps)
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
            ms = timed(lambda: swiglu(g, u, block_n=block_n, num_warps=warps), reps)
            out.append({"kernel": "swiglu", "rows": rows, "config": f"block_n={block_n} warps={warps}", "ms": ms,
                        "tb_s": moved / ms / 1e9})
    ms = timed(lambda: swiglu(g, u), reps)
    out.append({"kernel": "swiglu", "rows": rows, "config": "default", "ms": ms, "tb_s": moved / ms / 1e9})
    ms = timed(lambda: torch.nn.functional.silu(g) * u, reps)
    out.append({"kernel": "swiglu", "rows": rows, "config": "torch silu(g) * u", "ms": ms, "tb_s": moved / ms / 1e9})
    return out


def bench_rope(shape: dict, rows: int, reps: int, dtype) -> list[dict]:
    hq, hkv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    page = 16
    pages = rows // page + 1
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, device="cuda", dtype=dtype)
    kv = torch.zeros(pages, 1, 2, page, hkv, d, device="cuda", dtype=dtype)
    pos = torch.arange(rows, device="cuda") % 256
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
    ang = pos[:, None].float() * inv[None]
    cos = torch.cat([ang.cos(), ang.cos()], dim=-1).to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], dim=-1).to(dtype)
    slot_pages = torch.arange(rows, device="cuda") // page
    slot_offsets = torch.arange(rows, device="cuda") % page

    def views(t):
        q, k, v = t.split([hq * d, hkv * d, hkv * d], dim=1)
        return q.view(rows, hq, d), k.view(rows, hkv, d), v.view(rows, hkv, d)

    ref_in, ref_kv = qkv.clone(), kv.clone()
    rope_write_kv_reference(*views(ref_in), cos, sin, ref_kv, 0, slot_pages, slot_offsets)
    # q and k read and written, v read, k and v written to the pool; cos and sin read
    moved = rows * d * qkv.element_size() * (2 * hq + 2 * hkv + hkv + 2 * hkv + 2)
    out = []
    # (label, program per row from this many rows, its warps): the per-(row, head) kernel, then
    # the per-row kernel at several warp counts
    settings = [("per head, warps=4", 10**9, 4)] + [(f"per row, warps={w}", 1, w) for w in (2, 4, 8)]
    saved = epi.ROPE_ROWS_KERNEL_MIN_ROWS, epi.ROPE_ROWS_WARPS
    try:
        for label, min_rows, warps in settings:
            epi.ROPE_ROWS_KERNEL_MIN_ROWS, epi.ROPE_ROWS_WARPS = min_rows, warps
            t, pool = qkv.clone(), kv.clone()
            rope_write_kv(*views(t), cos, sin, pool, 0, slot_pages, slot_offsets)
            torch.testing.assert_close(t, ref_in, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(pool, ref_kv, rtol=2e-2, atol=2e-2)
            work = qkv.clone()
            ms = timed(lambda: rope_write_kv(*views(work), cos, sin, kv, 0, slot_pages, slot_offsets), reps)
            out.append({"kernel": "rope_write_kv", "rows": rows, "config": label, "ms": ms, "tb_s": moved / ms / 1e9})
    finally:
        epi.ROPE_ROWS_KERNEL_MIN_ROWS, epi.ROPE_ROWS_WARPS = saved
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--rows", default="4096,16384")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_prefill_epilogues needs a GPU (its kernels are timed with CUDA events)")
    shape, dtype = SHAPES[args.shape], torch.bfloat16
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "shape": args.shape, "results": []}
    for rows in [int(r) for r in args.rows.split(",")]:
        report["results"] += bench_swiglu(shape, rows, args.reps, dtype) + bench_rope(shape, rows, args.reps, dtype)
    print(f"{'kernel':<14} {'rows':>6} {'config':<26} {'ms':>8} {'TB/s':>6}")
    for r in report["results"]:
        print(f"{r['kernel']:<14} {r['rows']:>6} {r['config']:<26} {r['ms']:>8.3f} {r['tb_s']:>6.2f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_prefill_epilogues.json"), "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
