"""Where the FP8 base's loss gap comes from: held-out loss of the untrained base (LoRA B = 0, so
only the frozen products differ) on SmolLM2 + ACLSum, for FP8 variants against the fp32 base.

Two families, each one row per variant, the gap in % of the fp32 loss per adapter's papers:
  layers       which layers keep 16-bit projections: none (every layer FP8: what
               ``model.base_precision: fp8`` does), the first, the last, the first and last n
               (``model.fp8_exempt_layers: n``), and each quarter of the stack;
  granularity  the scales' shape (emulated; everything else as ours): ours (X per row, W per
               output channel), X in 1 x B blocks along K with W per channel or in B x B blocks,
               and W in B x B blocks with X per row. Scales are powers of two in every variant.
Emulated FP8 (quantize, dequantize, fp32 product) on the CPU, the spec the GPU path matches;
the same case as ``bench_convergence.py --model smollm2 --steps 8 --global-batch 2`` (same
samples file; the held-out papers follow the 16 training ones).

    OMP_NUM_THREADS=1 python scripts/fp8_ablation.py --out docs/results/fp8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_convergence as bc  # noqa: E402
import lightning_lorafusion.kernels.reference as reference  # noqa: E402
from lightning_lorafusion.kernels import fp8_linear as F8  # noqa: E402
from lightning_lorafusion.model.adapter_bank import AdapterBank  # noqa: E402
from lightning_lorafusion.model.hf_loading import fp8_exempt_layer_set, quantize_base_fp8  # noqa: E402


def fake_quantize(t: torch.Tensor, rows: int | None, cols: int | None) -> torch.Tensor:
    """``t [R, C]`` rounded through e4m3 with one power-of-two scale per ``rows x cols`` block
    (None: the whole dimension; ``rows == 1``: every row at once), returned dequantized, fp32."""
    r_all, c_all = t.shape
    rows, cols = rows or r_all, cols or c_all
    out = torch.empty(t.shape, dtype=torch.float32)
    for r0 in range(0, r_all, rows):
        r1 = r_all if rows == 1 else r0 + rows
        for c0 in range(0, c_all, cols):
            block = t[r0:r1, c0:c0 + cols].float()
            amax = block.abs().amax(dim=1, keepdim=True) if rows == 1 else block.abs().amax().reshape(1, 1)
            scale = F8.pow2_scales(amax)
            out[r0:r1, c0:c0 + cols] = (block / scale).to(F8.FP8_DTYPE).float() * scale
        if rows == 1:
            break
    return out


def granular_products(x_block: int | None, w_rows: int, w_cols: int | None) -> Callable:
    """A stand-in for ``reference.frozen_projections`` over plain fp32 weights: X per row in
    ``1 x x_block`` blocks, W in ``w_rows x w_cols`` blocks (``w_rows == 1``: per output
    channel, split along K by ``w_cols``)."""
    cache: dict[int, torch.Tensor] = {}

    def products(x, weights, biases, emulate=None):
        xd = fake_quantize(x, 1, x_block)
        ys = []
        for w, b in zip(weights, biases):
            if id(w) not in cache:
                cache[id(w)] = fake_quantize(w, w_rows, w_cols)
            y = (xd @ cache[id(w)].t()).to(x.dtype)
            ys.append(y if b is None else y + b)
        return ys

    return products


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default="smollm2-135m-instruct", help="weights, as in bench_convergence.py")
    ap.add_argument("--samples-file", default=os.path.join(os.path.dirname(bc.DEFAULT_SAMPLES_FILE),
                                                            "smollm2_aclsum80_samples.jsonl.gz"))
    ap.add_argument("--adapters", type=int, default=3, help="ACLSum aspects scored (one adapter each)")
    ap.add_argument("--eval-samples", type=int, default=16, help="held-out papers per aspect")
    ap.add_argument("--layers", type=int, default=None, help="first N layers only (tests)")
    ap.add_argument("--block", type=int, default=128, help="block size of the granularity family")
    ap.add_argument("--families", default="layers,granularity")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    case_args = argparse.Namespace(
        gguf=args.gguf, samples_file=args.samples_file, eval_samples=args.eval_samples, steps=8,
        adapters=args.adapters, rank=16, alpha=32.0, dropout=0.0, lr=1e-4, layers=args.layers, global_batch=2,
        capacity=1024, pad_multiple=16, max_length=None, min_length=None)
    t0 = time.time()
    case = bc.build_case(case_args, "smollm2", torch.device("cpu"), torch.float32)
    bank = AdapterBank(case.specs, case.config, dtype=torch.float32, device="cpu")  # B = 0

    def gap(params: Any) -> list[float]:
        got = bc.eval_losses(case, bank, params, "torch")
        return [100.0 * (g - b) / b for g, b in zip(got, base)]

    base = bc.eval_losses(case, bank, case.params, "torch")
    n = case.config.num_layers
    rows: list[dict[str, Any]] = []

    def record(family: str, variant: str, kept: int, values: list[float]) -> None:
        rows.append({"family": family, "variant": variant, "layers_16bit": kept, "gap_pct": values})
        print(f"{family:11} {variant:34} {kept:3d}  " + "  ".join(f"{v:+7.3f}" for v in values), flush=True)

    print(f"SmolLM2 ({n} layers), {args.adapters} aspects x {args.eval_samples} held-out papers; "
          f"fp32 loss {[round(b, 4) for b in base]}\n{'family':11} {'variant':34} {'16b':>3}  gap % per aspect")
    families = args.families.split(",")
    if "layers" in families:
        q = max(1, n // 4)
        variants = [("none (all FP8)", frozenset()), ("first", frozenset({0})), ("last", frozenset({n - 1}))]
        variants += [(f"first+last {k} (fp8_exempt_layers={k})", fp8_exempt_layer_set(n, k))
                     for k in (1, 2) if 2 * k < n]
        ends = [n if i == 3 else min(n, (i + 1) * q) for i in range(4)]  # the last quarter takes the rest
        variants += [(f"quarter {i + 1} (layers {i * q}-{ends[i] - 1})", frozenset(range(i * q, ends[i])))
                     for i in range(4) if i * q < n]
        for name, keep in variants:
            params = quantize_base_fp8(case.params, embedding=not case.config.tie_word_embeddings, keep_layers=keep)
            record("layers", name, len(keep), gap(params))
    if "granularity" in families:
        b = args.block
        original = reference.frozen_projections
        try:
            for name, spec in [("ours: X row, W channel", (None, 1, None)),
                               (f"X 1x{b}, W channel", (b, 1, None)),
                               (f"X 1x{b}, W {b}x{b}", (b, b, b)),
                               (f"X row, W {b}x{b}", (None, b, b)),
                               (f"X 1x{b // 2}, W 1x{b // 2}", (b // 2, 1, b // 2))]:
                reference.frozen_projections = granular_products(*spec)
                record("granularity", name, 0, gap(case.params))
        finally:
            reference.frozen_projections = original
    print(f"({time.time() - t0:.0f} s)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8_ablation_smollm2.json"), "w") as f:
            json.dump({"layers": n, "adapters": args.adapters, "eval_samples": args.eval_samples,
                       "fp32_loss": base, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
