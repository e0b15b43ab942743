"""NF4 (QLoRA) convergence against the reference recipe: ours vs HF + PEFT over bitsandbytes.

Four runs train the same adapters (same init, same samples in the same steps, dropout 0, AdamW
with the project's per-adapter schedule) and score the same held-out samples before and after:

- ``ours_fp32``: our decoder, torch reference LoRA path, the fp32 base;
- ``ours_nf4``: the same over ``quantize_base_nf4`` (blocks of 64, double-quantized absmax, the
  seven projections; embeddings, norms and LM head kept);
- ``peft_fp32``: transformers + PEFT LoRA over the fp32 base;
- ``peft_nf4``: transformers loaded with ``BitsAndBytesConfig(load_in_4bit, nf4, double quant,
  compute dtype fp32)`` (bitsandbytes ``Linear4bit`` for every linear but the LM head, the
  QLoRA recipe) + PEFT LoRA.

Each adapter's NF4 gap is ``eval(nf4) / eval(fp32) - 1``, before training (the quantization
error of the model itself) and after. If PEFT + bitsandbytes shows the gap ours shows, the gap
belongs to NF4 on this model, not to our training path. The report also gives how far ours is
from PEFT at each base (per-step train loss and held-out loss, relative; fp32 rounding alone
gives ~1e-6) and how far our dequantized NF4 weights are from bitsandbytes' (the same bytes
give 0).

PEFT trains one adapter at a time, one sample per forward (no packing); ours trains them packed
together, which changes nothing each adapter learns (docs/DESIGN.md), so the losses agree to
rounding when the two paths compute the same thing.

    OMP_NUM_THREADS=1 python scripts/bench_qlora_reference.py --model smollm2 --steps 16 --out $OUT
    python3 scripts/bench_qlora_reference.py --model smollm2 --gguf /path/hf_dir --device cuda --out $OUT
    python scripts/bench_qlora_reference.py --model tiny --steps 2 --adapters 2 --eval-samples 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import device_info, logger, write_json

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bench_convergence as bc  # noqa: E402
from lightning_lorafusion.data.microbatch import IGNORE_INDEX  # noqa: E402
from lightning_lorafusion.kernels.nf4 import Nf4Weight, dequantize_nf4_reference  # noqa: E402
from lightning_lorafusion.specs import module_path  # noqa: E402
from lightning_lorafusion.training.optim import build_adapter_optimizer  # noqa: E402

log = logger("qlora-ref")
VARIANTS = ("ours_fp32", "ours_nf4", "peft_fp32", "peft_nf4")
# 100 ACLSum samples per aspect, the set the FP8 and NF4 CPU convergence runs used
SAMPLES_FILE = Path(__file__).resolve().parents[1] / "docs" / "results" / "fp8_cpu_202611" / "smollm2_aclsum80_samples.jsonl.gz"


# ----------------------------------------------------------------------------- HF + PEFT
def hf_base(case: bc.Case, *, nf4: bool, workdir: Path, double_quant: bool = True):
    """The case's base as a transformers model (fp32), or loaded in 4-bit NF4 by bitsandbytes."""
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    src = case.hf_source
    if not isinstance(src, (str, os.PathLike)):  # a random model: save it once to load it back
        path = workdir / "hf_base"
        if not (path / "config.json").is_file():
            src.save_pretrained(path)
        src = path
    cfg = AutoConfig.from_pretrained(src)
    if cfg.num_hidden_layers > case.config.num_layers:  # the case keeps the first N layers
        cfg.num_hidden_layers = case.config.num_layers
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = cfg.layer_types[: case.config.num_layers]
    kw: dict[str, Any] = {"config": cfg, "dtype": torch.float32, "device_map": str(case_device(case))}
    if nf4:
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(src, **kw)
    model.requires_grad_(False)
    return model


def case_device(case: bc.Case) -> torch.device:
    return case.microbatches[0].input_ids.device


def peft_model(model, case: bc.Case):
    """``model`` wrapped by PEFT with one LoRA adapter per spec, each starting from the factors
    our ``AdapterBank`` starts from (so both paths begin at the same point)."""
    from peft import LoraConfig, get_peft_model

    init = bc.AdapterBank(case.specs, case.config, dtype=torch.float32, device="cpu")
    pm = None
    for a, spec in enumerate(case.specs):
        cfg = LoraConfig(**{k: v for k, v in spec.layout.peft_config().items() if v is not None},
                         lora_dropout=spec.dropout, bias="none", task_type="CAUSAL_LM")
        if pm is None:
            pm = get_peft_model(model, cfg, adapter_name=spec.name)
        else:
            pm.add_adapter(spec.name, cfg)
        with torch.no_grad():
            for layer, module in spec.layout.adapted(case.config.num_layers):
                f = init.factors(a, layer, module)
                target = pm.base_model.model.get_submodule(module_path(layer, module))
                target.lora_A[spec.name].weight.copy_(f.lora_A)
                target.lora_B[spec.name].weight.copy_(f.lora_B)
    return pm


def token_loss_sum(model, sample) -> torch.Tensor:
    """Sum of the cross-entropy over one sample's label tokens (labels are pre-shifted). The LM
    head runs on the label rows only, as ours does (the same values, less work on the CPU)."""
    hf = model.base_model.model  # the *ForCausalLM under PEFT's wrapper (LoRA layers inside)
    device = hf.lm_head.weight.device
    labels = torch.tensor(sample.labels, device=device)
    rows = labels != IGNORE_INDEX
    hidden = hf.model(input_ids=torch.tensor([sample.input_ids], device=device), use_cache=False).last_hidden_state[0]
    logits = hf.lm_head(hidden[rows]).float()
    return F.cross_entropy(logits, labels[rows], reduction="sum")


def label_tokens(samples) -> int:
    return sum(sum(1 for t in s.labels if t != IGNORE_INDEX) for s in samples)


def peft_eval(pm, samples) -> float:
    """Mean token loss over ``samples`` with the active adapter, no dropout, no gradients."""
    pm.eval()
    with torch.no_grad():
        total = sum(token_loss_sum(pm, s).double().item() for s in samples)
    return total / max(label_tokens(samples), 1)


def train_peft(pm, case: bc.Case, label: str) -> dict[str, Any]:
    """Each adapter in turn: ``case.steps`` AdamW steps over its global batches, mean token loss
    per global batch (as ours), held-out loss before and after."""
    n = len(case.specs)
    losses: list[list[float]] = [[] for _ in range(n)]
    before, after = [0.0] * n, [0.0] * n
    t0 = time.perf_counter()
    for a, spec in enumerate(case.specs):
        pm.set_adapter(spec.name)
        params = [p for name, p in pm.named_parameters() if "lora_" in name and f".{spec.name}." in name]
        for p in params:
            p.requires_grad_(True)
        before[a] = peft_eval(pm, case.eval_samples[a])
        opt, sched = build_adapter_optimizer(params, spec=spec, total_steps=case.steps)
        gb = spec.global_batch_size
        for j in range(case.steps):
            pm.train()
            batch = case.train_samples[a][j * gb:(j + 1) * gb]
            denom = max(label_tokens(batch), 1)
            total = 0.0
            for s in batch:
                loss = token_loss_sum(pm, s)
                (loss / denom).backward()
                total += loss.double().item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            losses[a].append(total / denom)
        after[a] = peft_eval(pm, case.eval_samples[a])
        for p in params:
            p.requires_grad_(False)
        log(f"{label} {spec.name}: loss {losses[a][0]:.4f} -> {losses[a][-1]:.4f}, "
            f"eval {before[a]:.4f} -> {after[a]:.4f}")
    return {"losses": losses, "eval_before": before, "eval_after": after,
            "seconds": round(time.perf_counter() - t0, 1)}


# ----------------------------------------------------------------------------- ours
def train_ours(case: bc.Case, params: dict[str, Any], options, label: str) -> dict[str, Any]:
    bank0 = bc.AdapterBank(case.specs, case.config, dtype=torch.float32, device=case_device(case))
    before = bc.eval_losses(case, bank0, params, "torch", options)
    r = bc.train(case, label=label, backend="torch", params=params, adapter_dtype=torch.float32, options=options)
    log(f"{label}: {r.seconds:.1f}s, eval before {[round(x, 4) for x in before]}, "
        f"after {[round(x, 4) for x in r.eval_losses]}")
    return {"losses": r.losses, "eval_before": before, "eval_after": r.eval_losses, "seconds": round(r.seconds, 1)}


def dequant_difference(case: bc.Case, nf4_params: dict[str, Any], peft_nf4) -> dict[str, Any]:
    """Our dequantized NF4 projections against bitsandbytes' (``dequantize_4bit``) of the same
    fp32 weights: max |difference|, how many values differ, and each one's quantization error
    ``||W - dequant(W)|| / ||W||`` over all projections."""
    import bitsandbytes.functional as bnbf

    worst, differ, total, n = 0.0, 0, 0, 0
    err = {"ours": 0.0, "bnb": 0.0}
    norm = 0.0
    hf = peft_nf4.base_model.model
    layers = nf4_params["layers"]
    for i, lp in (layers.items() if isinstance(layers, dict) else enumerate(layers)):
        for module, p in lp.items():
            if not (isinstance(p, dict) and "weight_nf4" in p):
                continue
            layer = hf.get_submodule(module_path(i, module))
            base = getattr(layer, "base_layer", layer)
            theirs = bnbf.dequantize_4bit(base.weight.data, base.weight.quant_state).float()
            ours = dequantize_nf4_reference(Nf4Weight.from_params(p))
            w = case.params["layers"][i][module]["weight"].float()
            d = (ours - theirs).abs()
            worst, differ, total, n = max(worst, d.max().item()), differ + int((d > 0).sum()), total + d.numel(), n + 1
            err["ours"] += (w - ours).double().pow(2).sum().item()
            err["bnb"] += (w - theirs).double().pow(2).sum().item()
            norm += w.double().pow(2).sum().item()
    return {"projections": n, "values": total, "values_differing": differ, "max_abs": worst,
            "rel_error_ours": (err["ours"] / norm) ** 0.5, "rel_error_bnb": (err["bnb"] / norm) ** 0.5}


# ----------------------------------------------------------------------------- report
def rel(x: float, y: float) -> float:
    return x / y - 1.0


def summarize(runs: dict[str, dict[str, Any]], gap_tol: float, target: float, agree_tol: float) -> dict[str, Any]:
    n = len(runs["ours_fp32"]["eval_after"])
    per = []
    for a in range(n):
        ev = {k: (runs[k]["eval_before"][a], runs[k]["eval_after"][a]) for k in VARIANTS}
        per.append({
            "eval": ev,
            "gap_before": {"ours": rel(ev["ours_nf4"][0], ev["ours_fp32"][0]),
                           "peft": rel(ev["peft_nf4"][0], ev["peft_fp32"][0])},
            "gap_after": {"ours": rel(ev["ours_nf4"][1], ev["ours_fp32"][1]),
                          "peft": rel(ev["peft_nf4"][1], ev["peft_fp32"][1])},
        })

    def agreement(x: str, y: str) -> dict[str, float]:
        steps = [abs(rel(u, v)) for lx, ly in zip(runs[x]["losses"], runs[y]["losses"]) for u, v in zip(lx, ly)]
        evals = [abs(rel(runs[x][k][a], runs[y][k][a])) for k in ("eval_before", "eval_after") for a in range(n)]
        return {"max_step_rel": max(steps), "max_eval_rel": max(evals)}

    agree = {"fp32": agreement("ours_fp32", "peft_fp32"), "nf4": agreement("ours_nf4", "peft_nf4")}
    gap_diff = max(abs(p["gap_after"]["ours"] - p["gap_after"]["peft"]) for p in per)
    checks = {f"|NF4 gap ours - PEFT+bnb| <= {gap_tol:g}": gap_diff <= gap_tol,
              f"ours vs PEFT (fp32 base) <= {agree_tol:g}": max(agree["fp32"].values()) <= agree_tol,
              f"NF4 gap after training <= {target:g} (ours)": all(p["gap_after"]["ours"] <= target for p in per)}
    return {"per_adapter": per, "ours_vs_peft": agree, "max_gap_diff": gap_diff, "checks": checks}


def print_report(result: dict[str, Any]) -> None:
    s = result["summary"]
    print(f"\nheld-out loss (before -> after {result['steps']} steps); NF4 gap = nf4 / fp32 - 1")
    print(f"{'adapter':7} " + " ".join(f"{k:>17}" for k in VARIANTS)
          + f" {'gap before ours/peft':>21} {'gap after ours/peft':>20}")
    for a, p in enumerate(s["per_adapter"]):
        cells = " ".join(f"{p['eval'][k][0]:7.4f} -> {p['eval'][k][1]:6.4f}" for k in VARIANTS)
        gb, ga = p["gap_before"], p["gap_after"]
        print(f"a{a:<6} {cells} {gb['ours']:+10.2%} {gb['peft']:+9.2%} {ga['ours']:+10.2%} {ga['peft']:+8.2%}")
    for base, ag in s["ours_vs_peft"].items():
        print(f"ours vs PEFT, {base} base: per-step train loss max rel {ag['max_step_rel']:.2e}, "
              f"held-out max rel {ag['max_eval_rel']:.2e}")
    d = result["dequant_vs_bnb"]
    print(f"dequantized NF4 weights, ours vs bitsandbytes: {d['values_differing']} of {d['values']} values "
          f"differ (max |d| {d['max_abs']:.2e}) over {d['projections']} projections; quantization error "
          f"||W - dequant(W)|| / ||W||: ours {d['rel_error_ours']:.4e}, bitsandbytes {d['rel_error_bnb']:.4e}")
    print("; ".join(f"{k}: {ok}" for k, ok in s["checks"].items())
          + f"; seconds {', '.join(f'{k} {v}' for k, v in result['seconds'].items())}")


# ----------------------------------------------------------------------------- main
def run(args) -> dict[str, Any]:
    if args.dropout != 0.0:
        raise SystemExit(f"--dropout {args.dropout}: the reference comparison needs 0 (PEFT's dropout masks "
                         "cannot match ours); leave it at 0")
    device = torch.device(args.device)
    if device.type == "cuda":  # a true fp32 comparison: no TF32 in either path
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    case = bc.build_case(args, args.model, device, torch.float32)
    if not case.eval_samples or not case.eval_samples[0]:
        raise SystemExit("--eval-samples must be >= 1: the NF4 gap is measured on held-out samples")
    log(f"{args.model}: {case.config.num_layers} layers, {len(case.microbatches)} microbatches, built in "
        f"{time.perf_counter() - t0:.1f}s")
    nf4_params, options = bc.quantized_base(argparse.Namespace(base_precision="nf4", nf4_gemm="auto"), case)
    runs: dict[str, dict[str, Any]] = {}
    partial = f"qlora_reference_{args.model}_partial.json"  # each run as it ends (long CPU runs)
    runs["ours_fp32"] = train_ours(case, case.params, bc.DEFAULT_OPTIONS, "ours_fp32")
    write_json(args.out, partial, runs)
    runs["ours_nf4"] = train_ours(case, nf4_params, options, "ours_nf4")
    write_json(args.out, partial, runs)
    with tempfile.TemporaryDirectory() as tmp:
        pm = peft_model(hf_base(case, nf4=False, workdir=Path(tmp)), case)
        runs["peft_fp32"] = train_peft(pm, case, "peft_fp32")
        write_json(args.out, partial, runs)
        del pm
        pm = peft_model(hf_base(case, nf4=True, workdir=Path(tmp)), case)
        dq = dequant_difference(case, nf4_params, pm)
        log(f"dequantized weights vs bitsandbytes: {dq}")
        runs["peft_nf4"] = train_peft(pm, case, "peft_nf4")
    return {"model": args.model, "layers": case.config.num_layers, "steps": case.steps,
            "adapters": len(case.specs), "global_batch": case.specs[0].global_batch_size,
            "eval_samples": len(case.eval_samples[0]),
            "runs": runs, "dequant_vs_bnb": dq, "summary": summarize(runs, args.gap_tol, args.target, args.agree_tol),
            "seconds": {k: v["seconds"] for k, v in runs.items()} | {"total": round(time.perf_counter() - t0, 1)}}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (smollm2: all 30; fewer keeps the first N)")
    ap.add_argument("--gguf", default="smollm2-135m-instruct", help="SmolLM2 weights (see bench_convergence.py)")
    ap.add_argument("--samples-file", default=str(SAMPLES_FILE),
                    help="pre-tokenized ACLSum samples (smollm2)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--dropout", type=float, default=0.0, help="must stay 0 (masks cannot match PEFT's)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--global-batch", type=int, default=2)
    ap.add_argument("--eval-samples", type=int, default=8, help="held-out samples per adapter")
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--pad-multiple", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=None, help="smollm2: longest sample kept")
    ap.add_argument("--gap-tol", type=float, default=5e-3,
                    help="allowed |our NF4 gap - PEFT+bitsandbytes' NF4 gap| after training")
    ap.add_argument("--agree-tol", type=float, default=1e-4,
                    help="allowed relative difference of ours and PEFT over the fp32 base (the same math)")
    ap.add_argument("--target", type=float, default=1e-2, help="the NF4 gap target after training")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (bitsandbytes' CUDA kernels for PEFT's NF4 base)")
    ap.add_argument("--out", default=None)
    return ap


def main() -> None:
    args = parser().parse_args()
    args.min_length = None
    result = run(args)
    info = device_info(torch.device(args.device))
    write_json(args.out, f"qlora_reference_{args.model}.json", {**info, "args": vars(args), **result})
    print(f"\n{info['device_name']}, torch {torch.__version__}, {args.model} ({result['layers']} layers), "
          f"r={args.rank} alpha={args.alpha:g} lr={args.lr:g}, {args.adapters} adapters x {args.steps} steps of "
          f"{args.global_batch}, {args.eval_samples} held-out samples each")
    print_report(result)
    checks = list(result["summary"]["checks"].values())
    if not all(checks[:2]):
        sys.exit(1)  # ours differs from the reference recipe: a defect of ours, not NF4's


if __name__ == "__main__":
    main()
