"""Per-kernel GPU time and host overhead of one fused LoRA forward+backward (torch.profiler).

    python scripts/profile_kernels.py [--m 8192 --k 4096 --n 4096 --adapters 1]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_lorafusion.kernels.api import lora_projections  # noqa: E402
from lightning_lorafusion.kernels.reference import LoraModuleWeights, LoraRouting  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    m, k, n, r = args.m, args.k, args.n, args.rank
    x = torch.randn(m, k, device=dev, dtype=dt, requires_grad=True)
    w = torch.randn(n, k, device=dev, dtype=dt) / k**0.5
    a = (torch.randn(r, k, device=dev, dtype=dt) / k**0.5).requires_grad_(True)
    b = torch.randn(n, r, device=dev, dtype=dt).requires_grad_(True)
    dy = torch.randn(m, n, device=dev, dtype=dt)
    routing = LoraRouting(num_rows=m, segments=((0, m, 0),), scales=(2.0,), dropout_p=(0.1,), seeds=(0,))
    lora = LoraModuleWeights((a,), (b,))

    def ours():
        (y,) = lora_projections(x, [w], [None], [lora], routing, dropout_offset=1, backend="triton")
        torch.autograd.grad([y], [x, a, b], [dy])

    def frozen():
        torch.autograd.grad([F.linear(x, w)], [x], [dy])

    variants = (("frozen", frozen), ("ours", ours))
    # Host times first, for every variant: after a torch.profiler session launches stay slower
    # (seen on an H100, 2026-11-23: "ours" enqueued in 1.13 ms/call timed after the frozen
    # variant's profile, 0.53 ms in bench_kernels.py's profiler-free timing of the same call).
    for name, fn in variants:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        host = (time.perf_counter() - t0) / 20
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 20
        print(f"{name}: host enqueue {host * 1e3:.3f} ms/call, wall {wall * 1e3:.3f} ms/call")
    for name, fn in variants:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        if name == "ours":
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(20):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            pstats.Stats(pr).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
