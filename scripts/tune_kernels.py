"""Pick the fused LoRA GEMM block sizes for this GPU and write them into the shipped JSON table.

Times the forward GEMM (``_lora_fwd_gemm_kernel``, LoRA epilogue on, r=16) and the dX GEMM
(``_lora_dx_gemm_kernel``) for a handful of tile configurations over a few decoder shapes and
keeps, per kernel, the configuration with the smallest total time. The result is stored under
the device's name (``torch.cuda.get_device_name``) in ``block_sizes.json``; other devices'
entries are kept.

    python scripts/tune_kernels.py [--out lightning_lorafusion/kernels/block_sizes.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
import triton
import triton.testing

from lightning_lorafusion.kernels.block_sizes import GEMM_MODES, LoraBlockSizes
from lightning_lorafusion.kernels.fused_lora import fused_lora_projections, lora_ranks
from lightning_lorafusion.kernels.fused_lora_launch import (
    _Plan,
    _launch_add,
    _launch_da,
    _launch_db,
    _launch_ds,
    _launch_dx,
    _launch_fwd_gemm,
    _launch_s,
)
from lightning_lorafusion.kernels.reference import LoraModuleWeights, LoraRouting
from lightning_lorafusion.kernels.routing_table import build_launch_table

TABLE = Path(__file__).resolve().parents[1] / "lightning_lorafusion" / "kernels" / "block_sizes.json"

# (block_m, block_n, block_k, warps, stages): forward tiles are [block_m, block_n] of Y with
# block_k reduction; dX tiles are [block_m, block_n] of dX with block_k reduction over N.
FWD_CANDIDATES = [
    (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 4),
    (128, 128, 128, 8, 3), (64, 256, 64, 4, 4), (128, 256, 32, 8, 5),
]
DX_CANDIDATES = [
    (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3),
    (64, 256, 64, 4, 4), (128, 128, 32, 8, 5),
]
SHAPES = [(8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096)]  # (M, K, N)


def _problem(m, k, n, device, dtype=torch.bfloat16, rank=16):
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
    a = torch.randn(rank, k, device=device, dtype=dtype) / k**0.5
    b = torch.randn(n, rank, device=device, dtype=dtype)
    routing = LoraRouting(num_rows=m, segments=((0, m, 0),), scales=(2.0,), dropout_p=(0.1,), seeds=(0,))
    lora = LoraModuleWeights((a,), (b,))
    return x, w, a, b, routing, lora


def time_config(kind: str, cfg: tuple, device) -> float:
    bm, bn, bk, warps, stages = cfg
    if kind == "fwd":
        sizes = LoraBlockSizes(block_m=bm, fwd_block_n=bn, fwd_block_k=bk, fwd_warps=warps,
                               fwd_stages=stages, gemm="triton")
    else:
        sizes = LoraBlockSizes(block_m=bm, dx_block_k=bn, dx_block_n=bk, dx_warps=warps,
                               dx_stages=stages, gemm="triton")
    total = 0.0
    for m, k, n in SHAPES:
        x, w, a, b, routing, lora = _problem(m, k, n, device)
        table = build_launch_table(routing, lora_ranks([lora], 1), sizes.block_m, device)
        plan = _plan(table, sizes, m, k, n, x)
        s = torch.randn(table.s_numel, device=device, dtype=x.dtype)
        if kind == "fwd":
            fn = lambda: _launch_fwd_gemm(x, w, None, s, b, 0, plan)  # noqa: E731
        else:
            dy = torch.randn(m, n, device=device, dtype=x.dtype)
            fn = lambda: _launch_dx([dy], [w], s, a, plan, 0, x.dtype, device)  # noqa: E731
        total += triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    return total


def _plan(table, sizes, m, k, n, x) -> _Plan:
    return _Plan(table, sizes, m=m, k=k, ns=(n,), b_cols=table.b_cols, dtype=x.dtype, device=x.device)


def tune(device: torch.device, log=print) -> LoraBlockSizes:
    best = {}
    for kind, candidates in (("fwd", FWD_CANDIDATES), ("dx", DX_CANDIDATES)):
        results = []
        for cfg in candidates:
            t0 = time.time()
            try:
                ms = time_config(kind, cfg, device)
            except Exception as e:  # a config the compiler rejects (e.g. out of shared memory)
                log(f"tune {kind} {cfg}: failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            log(f"tune {kind} {cfg}: {ms:.3f} ms total over {len(SHAPES)} shapes ({time.time() - t0:.1f}s)")
            results.append((ms, cfg))
        results.sort()
        best[kind] = results[0][1]
    fwd, dx = best["fwd"], best["dx"]
    # One block_m serves both GEMMs and the routing tiles: keep the forward's, and if the dX
    # winner wanted another, fall back to its best config with the forward's block_m.
    block_m = fwd[0]
    if dx[0] != block_m:
        same = [c for c in DX_CANDIDATES if c[0] == block_m]
        dx = min(same, key=lambda c: time_config("dx", c, device))
    skinny = _tune_fields("skinny", SKINNY_CANDIDATES, _time_skinny, device, log)
    add = _tune_fields("add", ADD_CANDIDATES, _time_add, device, log)
    tiles = LoraBlockSizes(**skinny, **add,
        block_m=block_m, fwd_block_n=fwd[1], fwd_block_k=fwd[2], fwd_warps=fwd[3], fwd_stages=fwd[4],
        dx_block_k=dx[1], dx_block_n=dx[2], dx_warps=dx[3], dx_stages=dx[4],
    )
    # Whole forward+backward with the frozen GEMMs in Triton vs in cuBLAS: keep the faster.
    mode_ms = {mode: time_fwd_bwd(dataclasses.replace(tiles, gemm=mode), device) for mode in GEMM_MODES}
    log(f"tune gemm mode fwd+bwd total ms: {mode_ms}")
    return dataclasses.replace(tiles, gemm=min(mode_ms, key=mode_ms.get))


SKINNY_CANDIDATES = [  # S / dS / dB / dA kernels
    dict(skinny_block_m=64, skinny_block_k=64, skinny_warps=4, skinny_stages=3, split_waves=2),
    dict(skinny_block_m=32, skinny_block_k=128, skinny_warps=4, skinny_stages=3, split_waves=2),
    dict(skinny_block_m=32, skinny_block_k=64, skinny_warps=4, skinny_stages=4, split_waves=4),
    dict(skinny_block_m=32, skinny_block_k=256, skinny_warps=4, skinny_stages=3, split_waves=8),
    dict(skinny_block_m=64, skinny_block_k=128, skinny_warps=4, skinny_stages=3, split_waves=8),
    dict(skinny_block_m=64, skinny_block_k=128, skinny_warps=8, skinny_stages=3, split_waves=4),
    dict(skinny_block_m=32, skinny_block_k=128, skinny_warps=4, skinny_stages=3, split_waves=8),
]
ADD_CANDIDATES = [  # in-place LoRA-term kernels of the cuBLAS mode
    dict(add_block_m=32, add_block_n=128, add_warps=4, add_n_blocks=1),
    dict(add_block_m=64, add_block_n=128, add_warps=8, add_n_blocks=1),
    dict(add_block_m=32, add_block_n=128, add_warps=4, add_n_blocks=4),
    dict(add_block_m=32, add_block_n=128, add_warps=4, add_n_blocks=8),
    dict(add_block_m=64, add_block_n=128, add_warps=4, add_n_blocks=4),
    dict(add_block_m=64, add_block_n=128, add_warps=8, add_n_blocks=8),
    dict(add_block_m=32, add_block_n=256, add_warps=4, add_n_blocks=4),
]
SKINNY_SHAPES = [(8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096)]


def _gpu_ms(fn) -> float:
    # CUDA-graph replay: the kernels' device time without host launch gaps
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


def _skinny_problem(m, k, n, sizes, device):
    x, w, a, b, routing, lora = _problem(m, k, n, device)
    table = build_launch_table(routing, lora_ranks([lora], 1), sizes.block_m, device)
    dy = torch.randn(m, n, device=device, dtype=x.dtype)
    s = torch.randn(table.s_numel, device=device, dtype=x.dtype)
    return x, w, a, b, _plan(table, sizes, m, k, n, x), dy, s


def _time_skinny(sizes, device) -> float:
    total = 0.0
    for m, k, n in SKINNY_SHAPES:
        x, w, a, b, plan, dy, s = _skinny_problem(m, k, n, sizes, device)
        ds = torch.empty_like(s)
        part = torch.empty(plan.split, plan.part_numel, device=device)

        def fn():
            _launch_s(x, a, plan, 5)
            _launch_ds(dy, b, ds, 0, plan)
            _launch_db(dy, s, b, part, 0, plan)
            _launch_da(x, ds, part, plan, 5)

        total += _gpu_ms(fn)
    return total


def _time_add(sizes, device) -> float:
    total = 0.0
    for m, k, n in SKINNY_SHAPES:
        x, w, a, b, plan, dy, s = _skinny_problem(m, k, n, sizes, device)
        dx = torch.randn(m, k, device=device, dtype=x.dtype)

        def fn():
            _launch_add(dy, s, b, 0, plan, 0, dx_mode=False)
            _launch_add(dx, s, a, 0, plan, 5, dx_mode=True)

        total += _gpu_ms(fn)
    return total


def _tune_fields(kind, candidates, timer, device, log) -> dict:
    results = []
    for fields in candidates:
        try:
            ms = timer(LoraBlockSizes(**fields), device)
        except Exception as e:
            log(f"tune {kind} {fields}: failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        log(f"tune {kind} {fields}: {ms:.3f} ms (CUDA graph)")
        results.append((ms, fields))
    return min(results, key=lambda r: r[0])[1]


def time_fwd_bwd(sizes: LoraBlockSizes, device) -> float:
    total = 0.0
    for m, k, n in SHAPES:
        x, w, a, b, routing, lora = _problem(m, k, n, device)
        x.requires_grad_(True)
        a.requires_grad_(True)
        b.requires_grad_(True)
        dy = torch.randn(m, n, device=device, dtype=x.dtype)

        def fn():
            (y,) = fused_lora_projections(x, [w], [None], [lora], routing, dropout_offset=1, block_sizes=sizes)
            torch.autograd.grad([y], [x, a, b], [dy])

        total += _gpu_ms(fn)
    return total


def write_table(name: str, sizes: LoraBlockSizes, path: Path) -> None:
    raw = json.loads(path.read_text()) if path.exists() else {}
    raw.setdefault("devices", {})[name] = dataclasses.asdict(sizes)
    raw["note"] = "written by scripts/tune_kernels.py; keys are torch.cuda.get_device_name()"
    path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TABLE)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_kernels.py needs a CUDA GPU")
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    sizes = tune(device)
    write_table(name, sizes, args.out)
    print(f"{name}: {sizes}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
