"""FP8 base quality on real weights: per-projection error of the FP8 forward and input gradient.

Runs SmolLM2-135M-Instruct (real weights, through ``hf_loading``) over ACLSum samples in fp32
with transformers, records every projection's input X and output gradient dY (hooks), rounds
W, X and dY to bf16 (what the bf16 base sees) and compares, against the fp64 products of those
bf16 tensors, the relative Frobenius error of
  bf16       Y = X W^T and dX = dY W in bf16 (the bf16 base),
  fp8        ours (kernels/fp8_linear.py, emulated: the spec the GPU path matches): W per output
             channel, X and dY * sw per row, power-of-two scales,
  fp8_tensor the alternative of one power-of-two scale for the whole weight.
Printed per projection (mean and max over layers). Also the input embedding table stored in
e4m3 with one power-of-two scale per row (``quantize_base_fp8(embedding=True)``, for untied
models; SmolLM2 ties its table to the LM head, so here only the lookup is swapped and the head
stays bf16): the table's relative error and the base model's mean token loss on the samples
with the FP8 lookup against the bf16 one. CPU only.

    python scripts/fp8_quality.py --samples 8 --out docs/results/fp8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_convergence import DEFAULT_SAMPLES_FILE, read_samples_file  # noqa: E402
from lightning_lorafusion.data.microbatch import IGNORE_INDEX  # noqa: E402
from lightning_lorafusion.kernels import fp8_linear as F8  # noqa: E402
from lightning_lorafusion.model.hf_loading import resolve_model_dir  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def errors(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> dict[str, float]:
    """bf16 x [T, K], w [N, K], dy [T, N] -> relative errors of Y and dX per method."""
    y64, dx64 = x.double() @ w.double().t(), dy.double() @ w.double()
    fw = F8.quantize_weight(w)
    y8 = F8.fp8_outputs(x.float(), [fw], [None], emulate=True)[0]
    dx8 = F8.fp8_input_grad([dy.float()], [fw], m=x.shape[0], k=x.shape[1], dtype=torch.float32,
                            device=x.device, emulate=True)
    st = F8.pow2_scales(w.float().abs().amax())  # one scale for the whole weight
    wt = (w.float() / st).to(F8.FP8_DTYPE).float() * st
    xq, sx = F8.quantize_rows_reference(x)
    gq, sg = F8.quantize_rows_reference(dy)
    return {"bf16_y": rel(x @ w.t(), y64), "bf16_dx": rel(dy @ w, dx64),
            "fp8_y": rel(y8, y64), "fp8_dx": rel(dx8, dx64),
            "fp8_tensor_y": rel((xq.float() * sx) @ wt.t(), y64),
            "fp8_tensor_dx": rel((gq.float() * sg) @ wt, dx64)}


def embedding_quality(model, samples) -> dict[str, float]:
    """The bf16 embedding table vs its e4m3 copy (per-row scales): table error, and the base
    model's mean token loss over ``samples`` with each lookup (fp32 compute, LM head as is)."""
    table = model.get_input_embeddings().weight.detach()
    t16 = table.bfloat16()
    q = F8.quantize_embedding(t16)
    deq = F8.fp8_embedding(torch.arange(table.shape[0]), q).float()
    losses = {}
    for name, rows in (("bf16", t16.float()), ("fp8", deq)):
        total, count = 0.0, 0
        with torch.no_grad():
            for s in samples:
                ids = torch.tensor(s.input_ids)
                labels = torch.tensor([[IGNORE_INDEX] + [t for t in s.labels[:-1]]])
                n = int((labels != IGNORE_INDEX).sum())
                total += float(model(inputs_embeds=rows[ids][None], labels=labels, use_cache=False).loss) * n
                count += n
        losses[name] = total / count
    return {"table_rel": rel(deq, t16.double()), "table_rel_bf16": rel(t16, table.double()),
            "loss_bf16": losses["bf16"], "loss_fp8": losses["fp8"],
            "loss_rel": (losses["fp8"] - losses["bf16"]) / losses["bf16"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="built-in name, HF directory or gguf:PATH")
    ap.add_argument("--samples-file", default=DEFAULT_SAMPLES_FILE)
    ap.add_argument("--samples", type=int, default=8, help="ACLSum samples (one batch each)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(args.model), dtype=torch.float32)
    model.requires_grad_(False)
    by_aspect = read_samples_file(args.samples_file)
    samples = [s for aspect in sorted(by_aspect) for s in by_aspect[aspect]][:: max(1, 300 // args.samples)][: args.samples]
    seen: dict[tuple[int, str], dict[str, list[torch.Tensor]]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for name in PROJECTIONS:
            mod = getattr(layer.self_attn if name in PROJECTIONS[:4] else layer.mlp, name)
            rec = seen.setdefault((i, name), {"x": [], "dy": []})
            hooks.append(mod.register_forward_hook(lambda m, inp, out, rec=rec: rec["x"].append(inp[0][0].detach())))
            hooks.append(mod.register_full_backward_hook(lambda m, gin, gout, rec=rec: rec["dy"].append(gout[0][0].detach())))
    embed = model.get_input_embeddings()
    for s in samples:
        ids = torch.tensor([s.input_ids])
        labels = torch.tensor([[IGNORE_INDEX] + [t for t in s.labels[:-1]]])  # HF shifts inside
        h = embed(ids).requires_grad_(True)  # a leaf with grad so the hooks see dY
        model(inputs_embeds=h, labels=labels, use_cache=False).loss.backward()
    for hk in hooks:
        hk.remove()
    emb = embedding_quality(model, samples)
    rows = []
    for (layer, name), rec in sorted(seen.items()):
        x = torch.cat(rec["x"]).bfloat16()
        dy = torch.cat(rec["dy"]).bfloat16()  # one backward per sample: same order as x
        mod = getattr(model.model.layers[layer].self_attn if name in PROJECTIONS[:4] else model.model.layers[layer].mlp, name)
        e = errors(x, mod.weight.detach().bfloat16(), dy)
        rows.append({"layer": layer, "module": name, **e})
    keys = [k for k in rows[0] if k not in ("layer", "module")]
    summary = {}
    print(f"SmolLM2-135M ({len(model.model.layers)} layers), {len(samples)} ACLSum samples, "
          f"{sum(len(s.input_ids) for s in samples)} tokens; relative Frobenius error vs fp64 of the bf16 tensors")
    print(f"{'module':10} " + " ".join(f"{k:>14}" for k in keys) + "   (mean over layers / max)")
    for name in PROJECTIONS:
        sel = [r for r in rows if r["module"] == name]
        summary[name] = {k: {"mean": sum(r[k] for r in sel) / len(sel), "max": max(r[k] for r in sel)} for k in keys}
        print(f"{name:10} " + " ".join(f"{summary[name][k]['mean']:6.4f}/{summary[name][k]['max']:6.4f}"
                                       for k in keys))
    print(f"embedding table in e4m3 (per-row scales): table rel error {emb['table_rel']:.4f} "
          f"(bf16: {emb['table_rel_bf16']:.4f}); base loss {emb['loss_bf16']:.4f} (bf16 lookup) vs "
          f"{emb['loss_fp8']:.4f} (FP8 lookup), relative {emb['loss_rel']:+.2e}")
    print(f"{time.time() - t0:.0f}s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8_quality_smollm2.json"), "w") as f:
            json.dump({"model": args.model, "samples": len(samples), "date": time.strftime("%Y-%m-%d", time.gmtime()),
                       "device": "cpu (emulated FP8)", "summary": summary, "embedding": emb, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
