"""Pick the fused LoRA kernels' block sizes for this GPU and write them into the shipped JSON table.

Coordinate descent over ``LoraBlockSizes``, each candidate timed as the whole forward + backward
of ``fused_lora_projections`` (r=16, p=0.1, one adapter) replayed from a CUDA graph, summed over
a few decoder shapes: the forward GEMM tiles (``gemm="triton"``), then the dX GEMM tiles with
the forward's ``block_m``, the rank-r kernels (S, dS, dB, dA), the in-place LoRA-term kernels
of the ``cublas_accumulate`` mode, and last the GEMM mode itself. The result is stored under the
device's name (``torch.cuda.get_device_name``) in ``block_sizes.json``; other devices' entries
are kept.

    python scripts/tune_kernels.py [--out lightning_lorafusion/kernels/block_sizes.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from harness import device_info, kernel_ms, logger

import torch  # noqa: E402

from lightning_lorafusion.kernels.block_sizes import GEMM_MODES, LoraBlockSizes  # noqa: E402
from lightning_lorafusion.kernels.fused_lora import fused_lora_projections  # noqa: E402
from lightning_lorafusion.kernels.reference import LoraModuleWeights, LoraRouting  # noqa: E402

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


def _problem(m, k, n, device, dtype=torch.bfloat16, rank=16):
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
    a = (torch.randn(rank, k, device=device, dtype=dtype) / k**0.5).requires_grad_(True)
    b = torch.randn(n, rank, device=device, dtype=dtype, requires_grad=True)
    routing = LoraRouting(num_rows=m, segments=((0, m, 0),), scales=(2.0,), dropout_p=(0.1,), seeds=(0,))
    return x, w, a, b, routing, LoraModuleWeights((a,), (b,))


def time_fwd_bwd(sizes: LoraBlockSizes, device) -> float:
    """Device ms of forward + backward with ``sizes``, summed over ``SHAPES``."""
    total = 0.0
    for m, k, n in SHAPES:
        x, w, a, b, routing, lora = _problem(m, k, n, device)
        dy = torch.randn(m, n, device=device, dtype=x.dtype)

        def fn():
            (y,) = fused_lora_projections(x, [w], [None], [lora], routing, dropout_offset=1, block_sizes=sizes)
            torch.autograd.grad([y], [x, a, b], [dy])

        total += kernel_ms(fn, graph=True)
    return total


def best_of(kind: str, base: LoraBlockSizes, candidates: list[dict], device, log) -> LoraBlockSizes:
    """``base`` with the fields of the fastest candidate (one the compiler rejects is skipped)."""
    results = []
    for fields in candidates:
        sizes = dataclasses.replace(base, **fields)
        try:
            ms = time_fwd_bwd(sizes, device)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for this tile
            log(f"tune {kind} {fields}: failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        log(f"tune {kind} {fields}: {ms:.3f} ms fwd+bwd over {len(SHAPES)} shapes")
        results.append((ms, sizes))
    if not results:
        raise RuntimeError(f"every {kind} candidate failed on this device")
    return min(results, key=lambda r: r[0])[1]


def tune(device: torch.device, log=print) -> LoraBlockSizes:
    sizes = LoraBlockSizes(gemm="triton")
    sizes = best_of("fwd", sizes, [dict(block_m=bm, fwd_block_n=bn, fwd_block_k=bk, fwd_warps=w, fwd_stages=st)
                                   for bm, bn, bk, w, st in FWD_CANDIDATES], device, log)
    # one block_m serves both GEMMs and the routing tiles: the forward's
    sizes = best_of("dx", sizes, [dict(dx_block_k=bn, dx_block_n=bk, dx_warps=w, dx_stages=st)
                                  for bm, bn, bk, w, st in DX_CANDIDATES if bm == sizes.block_m], device, log)
    sizes = best_of("skinny", sizes, SKINNY_CANDIDATES, device, log)
    accumulate = best_of("add", dataclasses.replace(sizes, gemm="cublas_accumulate"), ADD_CANDIDATES, device, log)
    sizes = dataclasses.replace(sizes, **{f.name: getattr(accumulate, f.name) for f in dataclasses.fields(sizes)
                                          if f.name.startswith("add_")})
    return best_of("gemm", sizes, [dict(gemm=mode) for mode in GEMM_MODES], device, log)


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
    name = device_info(device)["device_name"]
    sizes = tune(device, log=logger("tune_kernels"))
    write_table(name, sizes, args.out)
    print(f"{name}: {sizes}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
