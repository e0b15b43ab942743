"""Convergence check: the fused Triton LoRA path vs the torch reference LoRA path, trained alike.

Both paths train the same adapters (same init, same samples, same planner-packed microbatches,
same dropout seeds and offsets, AdamW with the project's per-adapter schedule) for ``--steps``
optimizer steps each; only ``backend`` ("triton" vs "torch") differs. A third run, the torch
path in a higher precision (``--reference-dtype``, fp32 when training in bf16), measures how far
bf16 arithmetic alone moves the curves: that is the yardstick for ours-vs-torch.

Models: ``tiny`` (random, for CPU checks), ``llama8b`` (random weights, Llama-3.1-8B layer
shapes, ``--layers`` of them) learning a fixed small-vocabulary Markov chain per adapter, and
``smollm2`` (real SmolLM2-135M-Instruct weights from its GGUF via ``hf_loading``) on ACLSum
summaries read from a pre-tokenized ``--samples-file`` (written by ``--write-samples-file``).

Tolerance, 16-bit runs. Let d(x, y) be the relative difference of per-step losses. PASS when,
pooled over adapters and steps, mean d(ours, torch) <= 2 x mean d(torch, torch-fp32), the same
for the final weights (difference relative to the weight update), and max d(ours, torch) <= 2e-2.
Why: the two bf16 paths are the same math accumulated in different orders, so each sits about
one bf16 rounding-noise away from the exact (fp32) trajectory, and two independent such errors
differ by about sqrt(2) times one; 2 leaves room for sampling noise. A real defect (wrong
dropout mask, scale or gradient) gives a systematic gap that grows with the steps.
fp32 runs (CPU, Triton interpreter): max d(ours, torch) <= 1e-5 and final weights within 1e-3 of
the update (fp32 rounding gives ~1e-7 and ~1e-5; AdamW's m/sqrt(v) amplifies tiny gradients).
Loss alone is blunt over a few steps: a dropout-mask mismatch moved the tiny model's losses by
only 6e-5 in 3 steps but its weights by 68% of the update, which is why weights are checked.

FP8 base (``--base-precision fp8``): ours with the FP8 base against ours with the bf16 base
(same case, init, samples, masks), the torch fp32 run again as the bf16 yardstick, and a held-
out eval loss (``--eval-samples`` per adapter, dropout off) after training. PASS when every
adapter's final eval loss (train: mean of the last 5 steps, without eval samples) is within
``--fp8-final-rel`` (1%) of the bf16 base's, and no per-step loss differs by more than
``--fp8-max-rel`` (5%). Why: e4m3 rounds each operand by up to 2^-4 = 6.25% (16x bf16's 2^-8),
so a per-step loss gap of a few 1e-2 is one rounding of the frozen products; a defect (a
scale applied twice, a wrong layout) costs more than that, and grows or stays instead of the
adapters learning the same task to the same loss. With eval samples, both bases are also
scored before training (B = 0: the base alone), recorded as ``untrained_rel``: how far the FP8
base by itself moves the held-out loss, the yardstick for whether training widens the gap.
``--fp8-exempt-layers N`` keeps the first and last N layers' projections 16-bit in the FP8 run.
``--backend torch`` runs both paths through the torch reference LoRA (with the emulated FP8
products off the GPU): SmolLM2 on ACLSum on the CPU (docs/kernels.md "FP8 base").

NF4 base (``--base-precision nf4``, QLoRA): the same comparison and checks (``--fp8-final-rel``,
``--fp8-max-rel`` apply to whichever quantized base runs), the base quantized by
``quantize_base_nf4`` (blocks of 64, double-quantized absmax); ``--nf4-gemm`` picks the frozen
products (buffer: dequantize then matmul; fused: the NF4 GEMM kernel). NF4 keeps 4 bits per
weight, coarser than e4m3, so the untrained gap is larger; the 1% target is on the trained loss.

    python scripts/bench_convergence.py --model llama8b smollm2 --gguf /path/SmolLM2.gguf --png --out $OUT
    python scripts/bench_convergence.py --model llama8b --base-precision fp8 --steps 30 --eval-samples 8 --out $OUT
    TRITON_INTERPRET=1 python scripts/bench_convergence.py --model tiny --device cpu --dtype float32 --steps 3
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

from harness import device_info, sync, write_json

import torch  # noqa: E402

# Only modules whose import chain avoids mip/highspy/torchdata/wandb/jsonargparse (absent on the
# GPU machine): the greedy planner, packing, the functional decoder and the bank.
from lightning_lorafusion.data.microbatch import IGNORE_INDEX  # noqa: E402
from lightning_lorafusion.data.packing import PackingConfig, SampleLookup, pack_microbatch  # noqa: E402
from lightning_lorafusion.data.tokenization import shifted_labels  # noqa: E402
from lightning_lorafusion.kernels.options import KernelOptions  # noqa: E402
from lightning_lorafusion.model.adapter_bank import AdapterBank  # noqa: E402
from lightning_lorafusion.model.decoder import (DEFAULT_OPTIONS, DecoderConfig, DecoderOptions,  # noqa: E402
                                                embedding_device_dtype, forward_loss_sums)
from lightning_lorafusion.model.hf_loading import (  # noqa: E402
    fp8_exempt_layer_set,
    params_from_hf_model,
    params_to,
    quantize_base_fp8,
    quantize_base_nf4,
)
from lightning_lorafusion.parallel.stage import adapter_loss  # noqa: E402
from lightning_lorafusion.planner import plan_microbatches  # noqa: E402
from lightning_lorafusion.specs import ALL_TARGET_MODULES, AdapterSpec  # noqa: E402
from lightning_lorafusion.training.optim import build_adapter_optimizer  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64}
RANDOM_SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=512),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256),
}
# Per-model workload defaults: layers, samples per global batch, microbatch capacity, adapter
# segment padding, sample lengths (synthetic) or longest sample kept (smollm2). The tiny model
# keeps the interpreter's work small: one 256-token microbatch per step.
MODEL_DEFAULTS = {
    "tiny": dict(layers=2, global_batch=1, capacity=256, pad_multiple=32, min_length=16, max_length=60),
    "llama8b": dict(layers=4, global_batch=4, capacity=4096, pad_multiple=128, min_length=64, max_length=384),
    "smollm2": dict(layers=None, global_batch=4, capacity=8192, pad_multiple=128, min_length=1, max_length=2048),
}
DEFAULT_SAMPLES_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "docs", "results", "training_h200_202611",
                                    "smollm2_aclsum_samples.jsonl.gz")
MARKOV_STATES = 64
MARKOV_PROBS = (0.55, 0.25, 0.15, 0.05)  # successor probabilities: entropy 1.11 nats per token


class _Sample:
    def __init__(self, ids, labels):
        self.input_ids, self.labels = tuple(ids), tuple(labels)


# ----------------------------------------------------------------------------- samples
def markov_samples(num: int, *, vocab: int, seed: int, min_length: int, max_length: int) -> list[_Sample]:
    """``num`` sequences of one fixed first-order Markov chain over ``MARKOV_STATES`` token ids.

    The chain (its tokens and each state's 4 successors) is fixed by ``seed``, so each adapter
    has its own learnable task; every token after the first is a target. Loss starts near
    ln(vocab) and can fall to the chain's entropy (1.11 nats).
    """
    rng = random.Random(seed)
    states = min(MARKOV_STATES, vocab - 1)
    tokens = rng.sample(range(1, vocab), states)  # id 0 is the packing pad token
    successors = [rng.sample(range(states), min(len(MARKOV_PROBS), states)) for _ in range(states)]
    weights = MARKOV_PROBS[: len(successors[0])]
    out = []
    for _ in range(num):
        n = rng.randint(min_length, max_length)
        s = rng.randrange(states)
        ids = []
        for _ in range(n):
            ids.append(tokens[s])
            s = rng.choices(successors[s], weights=weights)[0]
        out.append(_Sample(ids, shifted_labels(ids, [False] + [True] * (n - 1))))
    return out


def write_samples_file(path: str, weights: str, *, max_document_tokens: int,
                       use_chat_template: bool | None = None) -> None:
    """Tokenize the ACLSum train split (3 aspects) with the tokenizer of ``weights`` (its chat
    template when it has one and ``use_chat_template`` is not False, else plain "Summary:"
    prompts) into a gzipped JSONL: ``{"aspect", "input_ids", "label_spans"}`` where ``labels[t] =
    input_ids[t+1]`` for t in each ``[start, end)`` span and IGNORE_INDEX elsewhere."""
    from transformers import AutoTokenizer

    from lightning_lorafusion.data.sources.aclsum import ACLSUM_ASPECTS, AclsumSource
    from lightning_lorafusion.model.hf_loading import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(_weights_name(weights)))
    rows = []
    for aspect in ACLSUM_ASPECTS:
        src = AclsumSource(aspect=aspect, split="train", max_document_tokens=max_document_tokens,
                           use_chat_template=use_chat_template)
        for s in src.build(tokenizer, split="train", max_length=None, name=f"aclsum-{aspect}"):
            spans, start = [], None
            for t, lab in enumerate(s.labels + (IGNORE_INDEX,)):
                if lab != IGNORE_INDEX:
                    assert lab == s.input_ids[t + 1], "labels are pre-shifted input ids"
                    start = t if start is None else start
                elif start is not None:
                    spans.append([start, t])
                    start = None
            rows.append({"aspect": aspect, "input_ids": list(s.input_ids), "label_spans": spans})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=9) as f:
        for r in rows:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    print(f"wrote {len(rows)} samples ({sum(len(r['input_ids']) for r in rows)} tokens) to {path} "
          f"({os.path.getsize(path) / 1024:.0f} KiB)")


def read_samples_file(path: str) -> dict[str, list[_Sample]]:
    """-> {aspect: samples} from a file written by ``write_samples_file``."""
    opener = gzip.open if path.endswith(".gz") else open
    by_aspect: dict[str, list[_Sample]] = {}
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            ids = row["input_ids"]
            labels = [IGNORE_INDEX] * len(ids)
            for start, end in row["label_spans"]:
                labels[start:end] = ids[start + 1 : end + 1]
            by_aspect.setdefault(row["aspect"], []).append(_Sample(ids, labels))
    return by_aspect


def aclsum_adapter_samples(by_aspect: dict[str, list[_Sample]], adapter: int, num: int,
                           max_length: int, held_out: int = 0) -> list[_Sample]:
    """Adapter a trains on aspect a mod 3, its papers in a fresh seeded order every epoch. The
    last ``held_out`` of the ``num`` samples are scored, not trained on: they must not repeat a
    training sample, so ``num`` may exceed the aspect's papers only without them."""
    aspects = sorted(by_aspect)
    pool = [s for s in by_aspect[aspects[adapter % len(aspects)]] if len(s.input_ids) <= max_length]
    if not pool:
        raise SystemExit(f"no sample of {aspects[adapter % len(aspects)]} is <= {max_length} tokens")
    if held_out and num > len(pool):
        raise SystemExit(f"{num - held_out} training + {held_out} held-out samples per adapter, but "
                         f"{aspects[adapter % len(aspects)]} has {len(pool)} papers: held-out samples would "
                         "repeat training ones; lower --steps, --global-batch or --eval-samples")
    rng = random.Random(1000 + adapter)
    out: list[_Sample] = []
    while len(out) < num:
        order = list(range(len(pool)))
        rng.shuffle(order)
        out.extend(pool[i] for i in order)
    return out[:num]


# ----------------------------------------------------------------------------- the case
@dataclass
class Case:
    """Everything both paths share: config, frozen base (compute dtype), specs, microbatches."""

    name: str
    config: DecoderConfig
    params: dict[str, Any]
    specs: list[AdapterSpec]
    microbatches: list
    steps: int
    fill: float
    real_tokens: int
    reference_params: dict[str, Any] | None = field(default=None, repr=False)
    eval_microbatches: list = field(default_factory=list)  # held-out, scored once after training
    # What the HF + PEFT reference runs (bench_qlora_reference.py) need: per adapter its training
    # samples in step order and its held-out samples; the HF model (random models) or its directory.
    train_samples: list = field(default_factory=list, repr=False)
    eval_samples: list = field(default_factory=list, repr=False)
    hf_source: Any = field(default=None, repr=False)


def _weights_name(weights: str) -> str:
    if os.path.isdir(weights) or not weights.endswith(".gguf"):
        return weights  # an HF directory or a built-in name
    return "gguf:" + weights


def build_case(args, model: str, device: torch.device, dtype: torch.dtype) -> Case:
    d = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in MODEL_DEFAULTS[model].items()}
    n_eval = getattr(args, "eval_samples", 0) or 0
    n_train = args.steps * d["global_batch"]
    if model == "smollm2":
        from lightning_lorafusion.model.hf_loading import load_base_model

        from lightning_lorafusion.model.hf_loading import resolve_model_dir

        hf_source = resolve_model_dir(_weights_name(args.gguf))
        config, params, _ = load_base_model(str(hf_source), dtype=torch.float32)
        if d["layers"] is not None and d["layers"] < config.num_layers:  # CPU checks: fewer layers
            config = replace(config, num_layers=d["layers"],
                             sliding_windows=config.sliding_windows[: d["layers"]])
            params["layers"] = params["layers"][: d["layers"]]
        params = params_to(params, device=device, dtype=dtype)
        by_aspect = read_samples_file(args.samples_file)
        data = [aclsum_adapter_samples(by_aspect, a, n_train + n_eval, d["max_length"], n_eval)
                for a in range(args.adapters)]
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        hf_cfg = LlamaConfig(num_hidden_layers=d["layers"], max_position_embeddings=8192, rms_norm_eps=1e-5,
                             tie_word_embeddings=False, **RANDOM_SHAPES[model])
        torch.manual_seed(0)
        with torch.device(device):
            hf_model = LlamaForCausalLM(hf_cfg).to(dtype)
        hf_model.requires_grad_(False)
        config, params = params_from_hf_model(hf_model)
        hf_source = hf_model
        vocab = hf_cfg.vocab_size
        data = [markov_samples(n_train + n_eval, vocab=vocab, seed=100 + a,
                               min_length=d["min_length"], max_length=d["max_length"])
                for a in range(args.adapters)]
    specs = [AdapterSpec(name=f"a{a}", rank=args.rank, alpha=args.alpha, dropout=args.dropout, lr=args.lr,
                         seed=a, global_batch_size=d["global_batch"], target_modules=ALL_TARGET_MODULES,
                         dataset={"kind": "synthetic"}) for a in range(args.adapters)]
    held_out = [d_[n_train:] for d_ in data]
    data = [d_[:n_train] for d_ in data]
    gb = d["global_batch"]
    batches = [[list(range(j * gb, (j + 1) * gb)) for j in range(args.steps)] for _ in data]
    lookup = SampleLookup(data, batches)
    plan = plan_microbatches(lookup.lengths(), capacity=d["capacity"], pad_multiple=d["pad_multiple"], method="greedy")
    dens = lookup.denominators()
    step_points = plan.step_adapters()
    pack = PackingConfig(capacity=d["capacity"], pad_multiple=d["pad_multiple"])
    mbs = [pack_microbatch(p, lookup, config=pack, num_adapters=len(specs), denominators=dens,
                           step_adapters=step_points.get(i, ()), index=i).to(device)
           for i, p in enumerate(plan.microbatches) if not p.is_noop]
    real = sum(m.real_tokens for m in mbs)
    eval_mbs = []
    if n_eval:  # one global batch of n_eval samples per adapter, packed the same way
        ev = SampleLookup(held_out, [[list(range(n_eval))] for _ in held_out])
        ev_plan = plan_microbatches(ev.lengths(), capacity=d["capacity"], pad_multiple=d["pad_multiple"],
                                    method="greedy")
        eval_mbs = [pack_microbatch(p, ev, config=pack, num_adapters=len(specs), denominators=ev.denominators(), step_adapters=(),
                                    index=10**6 + i).to(device)
                    for i, p in enumerate(ev_plan.microbatches) if not p.is_noop]
    return Case(name=model, config=config, params=params, specs=specs, microbatches=mbs, steps=args.steps,
                fill=real / (len(mbs) * d["capacity"]), real_tokens=real, eval_microbatches=eval_mbs,
                train_samples=data, eval_samples=[h[:n_eval] for h in held_out], hf_source=hf_source)


# ----------------------------------------------------------------------------- training
@dataclass
class RunResult:
    label: str
    backend: str
    dtype: str
    losses: list[list[float]]  # [adapter][step]
    weights: list[torch.Tensor]  # per adapter, all factors flattened, fp32 on CPU
    seconds: float
    eval_losses: list[float] | None = None  # per adapter, on case.eval_microbatches


def adapter_vectors(bank: AdapterBank) -> list[torch.Tensor]:
    return [torch.cat([p.detach().float().flatten().cpu() for p in bank.parameters_of(a)])
            for a in range(bank.num_adapters)]


def train(case: Case, *, label: str, backend: str, params: dict[str, Any], adapter_dtype: torch.dtype,
          dropout_index_shift: int = 0, options: DecoderOptions = DEFAULT_OPTIONS) -> RunResult:
    """Train every adapter for ``case.steps`` steps over the case's microbatches.

    ``dropout_index_shift`` moves the microbatch index that dropout offsets hash (so it changes
    the masks and nothing else); the test uses it to show the comparison catches a mask mismatch.
    """
    device = case.microbatches[0].input_ids.device
    bank = AdapterBank(case.specs, case.config, dtype=adapter_dtype, device=device)
    opts = [build_adapter_optimizer(bank.parameters_of(a), spec=s, total_steps=case.steps)
            for a, s in enumerate(case.specs)]
    n = len(case.specs)
    acc: list[Any] = [0.0] * n
    losses: list[list[torch.Tensor]] = [[] for _ in range(n)]
    sync(device)
    t0 = time.perf_counter()
    for mb in case.microbatches:
        routing = bank.routing(mb.segments, mb.index + dropout_index_shift, mb.capacity)
        sums = forward_loss_sums(params, bank.view(), mb.input_ids, mb.labels, mb.position_ids, mb.cu_seqlens,
                                 routing, config=case.config, backend=backend,
                                 max_seqlen=mb.max_seqlen, label_rows=mb.label_rows, options=options)
        adapter_loss(sums, mb.loss_denominators).backward()
        per = sums.detach().double() / mb.loss_denominators.double().clamp_min(1)
        for _, _, a in mb.segments:
            acc[a] = acc[a] + per[a]
        for a in mb.step_adapters:
            opt, sched = opts[a]
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            losses[a].append(acc[a])
            acc[a] = 0.0
    sync(device)
    seconds = time.perf_counter() - t0
    values = [torch.stack(l).tolist() for l in losses]  # one host sync per adapter, at the end
    if any(len(v) != case.steps for v in values):
        raise RuntimeError(f"{label}: steps per adapter {[len(v) for v in values]}, expected {case.steps}")
    return RunResult(label=label, backend=backend, dtype=str(embedding_device_dtype(params)[1]).replace("torch.", ""),
                     losses=values, weights=adapter_vectors(bank), seconds=seconds,
                     eval_losses=eval_losses(case, bank, params, backend, options) if case.eval_microbatches else None)


def eval_losses(case: Case, bank: AdapterBank, params: dict[str, Any], backend: str,
                options: DecoderOptions = DEFAULT_OPTIONS) -> list[float]:
    """Per-adapter mean token loss over the held-out microbatches, dropout off, no gradients."""
    total = torch.zeros(len(case.specs), dtype=torch.float64)
    with torch.no_grad():
        for mb in case.eval_microbatches:
            routing = bank.routing(mb.segments, mb.index, mb.capacity, train=False)
            sums = forward_loss_sums(params, bank.view(), mb.input_ids, mb.labels, mb.position_ids,
                                     mb.cu_seqlens, routing, config=case.config, backend=backend,
                                     max_seqlen=mb.max_seqlen, label_rows=mb.label_rows, options=options)
            total += (sums.double() / mb.loss_denominators.double().clamp_min(1)).cpu()
    return total.tolist()


# ----------------------------------------------------------------------------- comparison
def compare(x: RunResult, y: RunResult, init: list[torch.Tensor]) -> dict[str, Any]:
    """Per-step loss differences of x against y (y is the baseline), per adapter and pooled,
    and final-weight differences relative to y's weights and to y's update from ``init``."""
    per_adapter = []
    all_abs, all_rel = [], []
    for a, (lx, ly) in enumerate(zip(x.losses, y.losses)):
        tx, ty = torch.tensor(lx, dtype=torch.float64), torch.tensor(ly, dtype=torch.float64)
        ab = (tx - ty).abs()
        rel = ab / ty.abs().clamp_min(1e-12)
        all_abs.append(ab)
        all_rel.append(rel)
        wx, wy = x.weights[a].double(), y.weights[a].double()
        dw = (wx - wy).norm()
        per_adapter.append({
            "max_abs": ab.max().item(), "mean_abs": ab.mean().item(),
            "max_rel": rel.max().item(), "mean_rel": rel.mean().item(),
            "weights_rel": (dw / wy.norm().clamp_min(1e-30)).item(),
            "weights_rel_to_update": (dw / (wy - init[a].double()).norm().clamp_min(1e-30)).item(),
        })
    ab, rel = torch.cat(all_abs), torch.cat(all_rel)
    pooled = {"max_abs": ab.max().item(), "mean_abs": ab.mean().item(), "max_rel": rel.max().item(),
              "mean_rel": rel.mean().item(),
              "weights_rel_to_update": max(p["weights_rel_to_update"] for p in per_adapter),
              "mean_weights_rel_to_update": sum(p["weights_rel_to_update"] for p in per_adapter) / len(per_adapter)}
    return {"x": x.label, "y": y.label, "pooled": pooled, "per_adapter": per_adapter}


def verdict(ours_vs_torch: dict, torch_vs_ref: dict | None, *, factor: float, max_rel: float,
            max_weights_rel: float | None) -> dict[str, Any]:
    """PASS/FAIL of ours vs torch: the loss cap always; against the reference's own gap when
    there is a reference run; on absolute weight differences when ``max_weights_rel`` is set."""
    p = ours_vs_torch["pooled"]
    checks = {f"loss max_rel <= {max_rel:g}": p["max_rel"] <= max_rel}
    out: dict[str, Any] = {"max_rel_limit": max_rel}
    if torch_vs_ref is not None:
        r = torch_vs_ref["pooled"]
        loss_ratio = p["mean_rel"] / max(r["mean_rel"], 1e-30)
        w_ratio = p["mean_weights_rel_to_update"] / max(r["mean_weights_rel_to_update"], 1e-30)
        checks[f"loss mean_rel ratio <= {factor:g}"] = loss_ratio <= factor
        checks[f"weights rel-to-update ratio <= {factor:g}"] = w_ratio <= factor
        out.update(loss_ratio=loss_ratio, weights_ratio=w_ratio, factor=factor)
    if max_weights_rel is not None:
        checks[f"weights rel-to-update <= {max_weights_rel:g}"] = p["weights_rel_to_update"] <= max_weights_rel
        out["max_weights_rel_limit"] = max_weights_rel
    out["checks"] = checks
    out["pass"] = all(checks.values())
    return out


def quantized_base(args, case: Case) -> tuple[dict[str, Any], DecoderOptions]:
    """The case's base in ``args.base_precision`` (fp8 or nf4) and the decoder options to run it."""
    if args.base_precision == "nf4":
        return (quantize_base_nf4(case.params),
                DecoderOptions(kernels=KernelOptions(nf4_gemm=getattr(args, "nf4_gemm", "auto"))))
    keep = fp8_exempt_layer_set(case.config.num_layers, args.fp8_exempt_layers)
    fp8_params = quantize_base_fp8(case.params, embedding=not case.config.tie_word_embeddings, keep_layers=keep)
    return fp8_params, DecoderOptions(kernels=KernelOptions(
        fp8_fast_accum_forward=args.fp8_fast_accum in ("forward", "both"),
        fp8_fast_accum_input_grad=args.fp8_fast_accum == "both"))


def run_fp8_model(args, model: str, device: torch.device) -> dict[str, Any]:
    """Ours with the quantized (FP8 or NF4) base vs ours with the 16/32-bit base (module
    docstring: tolerance). Run labels and keys name the format (``ours_fp8``, ``nf4_vs_bf16``)."""
    dtype = DTYPES[args.dtype]
    adapter_dtype = DTYPES[args.adapter_dtype]
    q = args.base_precision
    t0 = time.perf_counter()
    case = build_case(args, model, device, dtype)
    fp8_params, options = quantized_base(args, case)
    print(f"[{model}] {case.config.num_layers} layers, {len(case.microbatches)} microbatches, "
          f"{len(case.eval_microbatches)} eval microbatches, built in {time.perf_counter() - t0:.1f}s", flush=True)
    init = adapter_vectors(AdapterBank(case.specs, case.config, dtype=adapter_dtype, device="cpu"))
    untrained: dict[str, list[float]] = {}
    if case.eval_microbatches:  # B = 0 before training: the held-out loss of each base alone
        bank0 = AdapterBank(case.specs, case.config, dtype=adapter_dtype, device=device)
        for label, params in ((f"ours_{args.dtype}", case.params), (f"ours_{q}", fp8_params)):
            untrained[label] = eval_losses(case, bank0, params, args.backend, options)
        print(f"[{model}] eval before training: {untrained}", flush=True)
    runs = {}
    for label, params in ((f"ours_{args.dtype}", case.params), (f"ours_{q}", fp8_params)):
        runs[label] = train(case, label=label, backend=args.backend, params=params, adapter_dtype=adapter_dtype,
                            options=options)
        r = runs[label]
        print(f"[{model}] {label}: {r.seconds:.1f}s, loss a0 {r.losses[0][0]:.4f} -> {r.losses[0][-1]:.4f}"
              f", eval {r.eval_losses}", flush=True)
    base, fp8 = runs[f"ours_{args.dtype}"], runs[f"ours_{q}"]
    ref_vs = None
    if args.reference_dtype != "none":
        ref_name = "float32" if args.reference_dtype == "auto" else args.reference_dtype
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        ref = runs[f"torch_{ref_name}"] = train(case, label=f"torch_{ref_name}", backend="torch",
                                                params=params_to(case.params, dtype=DTYPES[ref_name]),
                                                adapter_dtype=DTYPES[ref_name])
        ref_vs = compare(base, ref, init)
    fp8_vs = compare(fp8, base, init)

    def final(r: RunResult) -> list[float]:
        return r.eval_losses if r.eval_losses is not None else [sum(l[-5:]) / len(l[-5:]) for l in r.losses]

    final_rel = [abs(f - b) / abs(b) for f, b in zip(final(fp8), final(base))]
    checks = {f"final loss rel <= {args.fp8_final_rel:g}": max(final_rel) <= args.fp8_final_rel,
              f"per-step loss max_rel <= {args.fp8_max_rel:g}": fp8_vs["pooled"]["max_rel"] <= args.fp8_max_rel}
    verdict_ = {"checks": checks, "pass": all(checks.values()), "final_rel": final_rel,
                "final_kind": "eval" if base.eval_losses is not None else "train, last 5 steps",
                "max_rel_limit": args.fp8_max_rel}
    if untrained:  # how far the FP8 base alone moves the held-out loss (no training involved)
        verdict_["untrained_rel"] = [abs(f - b) / abs(b) for f, b in
                                     zip(untrained[f"ours_{q}"], untrained[f"ours_{args.dtype}"])]
    if ref_vs is not None:
        verdict_[f"{q}_vs_bf16_over_bf16_vs_ref"] = fp8_vs["pooled"]["mean_rel"] / max(ref_vs["pooled"]["mean_rel"], 1e-30)
    return {
        "model": model, "layers": case.config.num_layers, "microbatches": len(case.microbatches),
        "steps": case.steps, "adapters": len(case.specs), "base_precision": q,
        "fp8_exempt_layers": args.fp8_exempt_layers if q == "fp8" else None,
        "base_label": f"ours_{args.dtype}",
        "runs": {k: {"backend": r.backend, "dtype": r.dtype, "seconds": round(r.seconds, 2), "losses": r.losses,
                     "eval_losses": r.eval_losses} for k, r in runs.items()},
        "eval_untrained": untrained, f"{q}_vs_bf16": fp8_vs, "bf16_vs_reference": ref_vs, "verdict": verdict_,
        "seconds_total": round(time.perf_counter() - t0, 1),
    }


def print_fp8_table(results: list[dict[str, Any]]) -> None:
    for r in results:
        q = r["base_precision"]
        print(f"\n{'model':8} {'adapter':7} {f'train loss first->last (base | {q})':>38} {'eval base':>9} "
              f"{f'eval {q}':>9} {'final rel':>9} {'max step rel':>12} {'untrained rel':>13}")
        runs, v = r["runs"], r["verdict"]
        base, fp8 = runs[r["base_label"]], runs[f"ours_{q}"]
        for a, p in enumerate(r[f"{q}_vs_bf16"]["per_adapter"]):
            eb = base["eval_losses"][a] if base["eval_losses"] else float("nan")
            ef = fp8["eval_losses"][a] if fp8["eval_losses"] else float("nan")
            print(f"{r['model']:8} a{a:<6} {base['losses'][a][0]:8.4f} -> {base['losses'][a][-1]:7.4f} | "
                  f"{fp8['losses'][a][0]:7.4f} -> {fp8['losses'][a][-1]:7.4f} {eb:9.4f} {ef:9.4f} "
                  f"{v['final_rel'][a]:9.2e} {p['max_rel']:12.2e} "
                  f"{v['untrained_rel'][a] if 'untrained_rel' in v else float('nan'):13.2e}")
        extra = (f", {q}-vs-bf16 / bf16-vs-fp32 mean per-step gap {v[f'{q}_vs_bf16_over_bf16_vs_ref']:.1f}x"
                 if f"{q}_vs_bf16_over_bf16_vs_ref" in v else "")
        print(f"{r['model']:8} {'PASS' if v['pass'] else 'FAIL'} ({v['final_kind']}): "
              + ", ".join(f"{k}: {ok}" for k, ok in v["checks"].items()) + extra + f"; {r['seconds_total']}s")


def run_model(args, model: str, device: torch.device) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    ref_name = args.reference_dtype
    if ref_name == "auto":
        ref_name = "float32" if dtype in (torch.bfloat16, torch.float16) else "none"
    adapter_dtype = DTYPES[args.adapter_dtype]
    t0 = time.perf_counter()
    case = build_case(args, model, device, dtype)
    t_build = time.perf_counter() - t0
    print(f"[{model}] {case.config.num_layers} layers, {len(case.microbatches)} microbatches "
          f"(fill {case.fill:.1%}, {case.real_tokens} real tokens), built in {t_build:.1f}s", flush=True)
    init = adapter_vectors(AdapterBank(case.specs, case.config, dtype=adapter_dtype, device="cpu"))
    runs = {}
    for label, backend in ((f"ours_{args.dtype}", "triton"), (f"torch_{args.dtype}", "torch")):
        runs[label] = train(case, label=label, backend=backend, params=case.params, adapter_dtype=adapter_dtype)
        print(f"[{model}] {label}: {runs[label].seconds:.1f}s, loss a0 {runs[label].losses[0][0]:.4f} -> "
              f"{runs[label].losses[0][-1]:.4f}", flush=True)
    ours, ref16 = runs[f"ours_{args.dtype}"], runs[f"torch_{args.dtype}"]
    ref = None
    if ref_name != "none":
        # The same bf16-rounded base weights, upcast: the gap measures bf16 arithmetic only.
        ref_params = params_to(case.params, dtype=DTYPES[ref_name])
        ref_adapter = DTYPES[ref_name] if DTYPES[ref_name].itemsize > adapter_dtype.itemsize else adapter_dtype
        label = f"torch_{ref_name}"
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False  # a true fp32 reference, not TF32
            torch.backends.cudnn.allow_tf32 = False
        ref = runs[label] = train(case, label=label, backend="torch", params=ref_params, adapter_dtype=ref_adapter)
        del ref_params
        print(f"[{model}] {label}: {ref.seconds:.1f}s", flush=True)
    ours_vs_torch = compare(ours, ref16, init)
    torch_vs_ref = compare(ref16, ref, init) if ref is not None else None
    ours_vs_ref = compare(ours, ref, init) if ref is not None else None
    half = dtype.itemsize == 2
    max_rel = args.max_rel if args.max_rel is not None else (2e-2 if half else 1e-5)
    max_w = args.max_weights_rel if args.max_weights_rel is not None else (None if half else 1e-3)
    result = {
        "model": model, "layers": case.config.num_layers, "microbatches": len(case.microbatches),
        "fill": round(case.fill, 4), "real_tokens": case.real_tokens, "steps": case.steps,
        "adapters": len(case.specs), "global_batch": case.specs[0].global_batch_size,
        "task": "aclsum summaries (real text)" if model == "smollm2" else "fixed Markov chain per adapter",
        "runs": {k: {"backend": r.backend, "dtype": r.dtype, "seconds": round(r.seconds, 2), "losses": r.losses}
                 for k, r in runs.items()},
        "ours_vs_torch": ours_vs_torch, "torch_vs_reference": torch_vs_ref, "ours_vs_reference": ours_vs_ref,
        "verdict": verdict(ours_vs_torch, torch_vs_ref, factor=args.factor, max_rel=max_rel, max_weights_rel=max_w),
        "seconds_total": round(time.perf_counter() - t0, 1),
    }
    if args.out and args.png:
        result["png"] = plot(result, os.path.join(args.out, f"convergence_{model}.png"))
    return result


def plot(result: dict[str, Any], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = list(runs)
    n = result["adapters"]
    fig, axes = plt.subplots(1, n + 1, figsize=(3.6 * (n + 1), 3.4))
    styles = {0: dict(lw=2.2, alpha=0.7), 1: dict(lw=1.0, ls="--"), 2: dict(lw=0.8, ls=":", color="k")}
    for a in range(n):
        ax = axes[a]
        for i, label in enumerate(labels):
            ax.plot(range(1, result["steps"] + 1), runs[label]["losses"][a], label=label, **styles[min(i, 2)])
        ax.set_title(f"adapter a{a}")
        ax.set_xlabel("optimizer step")
        if a == 0:
            ax.set_ylabel("global-batch mean loss")
            ax.legend(fontsize=7)
    ax = axes[n]
    pairs = [("ours_vs_torch", labels[0], labels[1])]
    if len(labels) > 2:
        pairs.append(("torch_vs_reference", labels[1], labels[2]))
    for key, x, y in pairs:
        for a in range(n):
            lx, ly = runs[x]["losses"][a], runs[y]["losses"][a]
            rel = [abs(u - v) / max(abs(v), 1e-12) for u, v in zip(lx, ly)]
            ax.plot(range(1, result["steps"] + 1), [max(r, 1e-12) for r in rel],
                    color="C0" if key == "ours_vs_torch" else "C3", alpha=0.6, lw=0.9,
                    label=f"{x} vs {y}" if a == 0 else None)
    ax.set_yscale("log")
    ax.set_title("relative loss difference")
    ax.set_xlabel("optimizer step")
    ax.legend(fontsize=7)
    v = result["verdict"]
    fig.suptitle(f"{result['model']} ({result['layers']} layers): fused Triton LoRA vs torch reference, "
                 f"{'PASS' if v['pass'] else 'FAIL'}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"\n{'model':8} {'adapter':7} {'loss first->last (ours)':>24} {'max rel':>9} {'mean rel':>9} "
          f"{'ref mean rel':>12} {'W rel/upd':>9} {'ref W':>9}")
    for r in results:
        ovt, tvr = r["ours_vs_torch"], r["torch_vs_reference"]
        ours = next(iter(r["runs"].values()))["losses"]
        for a, p in enumerate(ovt["per_adapter"]):
            q = tvr["per_adapter"][a] if tvr else None
            print(f"{r['model']:8} a{a:<6} {ours[a][0]:>11.4f} -> {ours[a][-1]:<9.4f} {p['max_rel']:>9.2e} "
                  f"{p['mean_rel']:>9.2e} {q['mean_rel'] if q else float('nan'):>12.2e} "
                  f"{p['weights_rel_to_update']:>9.2e} {q['weights_rel_to_update'] if q else float('nan'):>9.2e}")
        v = r["verdict"]
        ratios = (f"loss ratio {v['loss_ratio']:.2f}, weights ratio {v['weights_ratio']:.2f} (<= {v['factor']}), "
                  if "loss_ratio" in v else "")
        print(f"{r['model']:8} {'PASS' if v['pass'] else 'FAIL'}: {ratios}max rel {ovt['pooled']['max_rel']:.2e} "
              f"(<= {v['max_rel_limit']:.0e}); {r['seconds_total']}s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["llama8b"], choices=sorted(MODEL_DEFAULTS))
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default: llama8b 4, tiny 2; smollm2 all 30, fewer keeps the first N)")
    ap.add_argument("--gguf", default="smollm2-135m-instruct",
                    help="SmolLM2 weights: a .gguf file, a converted HF directory, or the built-in name")
    ap.add_argument("--samples-file", default=DEFAULT_SAMPLES_FILE, help="pre-tokenized ACLSum samples (smollm2)")
    ap.add_argument("--write-samples-file", default=None, metavar="PATH",
                    help="tokenize ACLSum with the --gguf tokenizer into PATH and exit")
    ap.add_argument("--max-document-tokens", type=int, default=384, help="with --write-samples-file")
    ap.add_argument("--steps", type=int, default=50, help="optimizer steps per adapter")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--global-batch", type=int, default=None, help="samples per step (default per model)")
    ap.add_argument("--capacity", type=int, default=None, help="microbatch tokens (default per model)")
    ap.add_argument("--pad-multiple", type=int, default=None, help="adapter segment padding (default per model)")
    ap.add_argument("--min-length", type=int, default=None, help="synthetic sample length range")
    ap.add_argument("--max-length", type=int, default=None, help="synthetic: longest sample; smollm2: filter")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--adapter-dtype", default="float32", choices=["bfloat16", "float16", "float32"],
                    help="LoRA master weights and AdamW state (float32, as LoRAFusionModule keeps them)")
    ap.add_argument("--reference-dtype", default="auto", choices=["auto", "none", "float32", "float64"],
                    help="precision of the extra torch-path run (auto: float32 for 16-bit runs, else none)")
    ap.add_argument("--factor", type=float, default=2.0, help="allowed ours-vs-torch / torch-vs-reference ratio")
    ap.add_argument("--max-rel", type=float, default=None,
                    help="cap on per-step relative loss difference (default 2e-2 in 16-bit, 1e-5 in fp32)")
    ap.add_argument("--max-weights-rel", type=float, default=None,
                    help="cap on final-weight difference relative to the update (default: fp32 1e-3, "
                         "16-bit none: judged against the reference run instead)")
    ap.add_argument("--base-precision", default="bf16", choices=["bf16", "fp8", "nf4"],
                    help="fp8 / nf4: ours with the FP8 / NF4 base vs ours with the bf16 (--dtype) base "
                         "(see the docstring)")
    ap.add_argument("--nf4-gemm", default="auto", choices=["auto", "buffer", "fused"],
                    help="nf4: frozen products through a dequantized buffer or the fused NF4 GEMM")
    ap.add_argument("--eval-samples", type=int, default=0, help="held-out samples per adapter, scored after training")
    ap.add_argument("--fp8-fast-accum", default="off", choices=["off", "forward", "both"],
                    help="fp8: fast accumulation of the forward / forward and dX products (GPU)")
    ap.add_argument("--backend", default="triton", choices=["triton", "torch"],
                    help="fp8: LoRA path of both runs (torch: the reference path, e.g. a CPU run with "
                         "the emulated FP8 products instead of the Triton interpreter)")
    ap.add_argument("--fp8-exempt-layers", type=int, default=0,
                    help="fp8: the first and last N layers keep 16-bit projections (model.precision.fp8.exempt_layers)")
    ap.add_argument("--fp8-final-rel", type=float, default=1e-2, help="fp8: final-loss tolerance (relative)")
    ap.add_argument("--fp8-max-rel", type=float, default=5e-2, help="fp8: per-step loss tolerance (relative)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", action="store_true", help="write convergence_<model>.png under --out")
    args = ap.parse_args()
    if args.write_samples_file:
        write_samples_file(args.write_samples_file, args.gguf, max_document_tokens=args.max_document_tokens)
        return
    device = torch.device(args.device)
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the fused kernels are first imported
    fp8 = args.base_precision in ("fp8", "nf4")
    results = [(run_fp8_model if fp8 else run_model)(args, m, device) for m in args.model]
    info = device_info(device)
    name = info["device_name"]
    for r in results:
        write_json(args.out, f"convergence_{r['model']}{'_' + args.base_precision if fp8 else ''}.json", {**info, "args": vars(args), **r})
    print(f"\n{name}, torch {torch.__version__}, {args.dtype}, r={args.rank} alpha={args.alpha:g} "
          f"p={args.dropout} lr={args.lr:g}, {args.adapters} adapters x {args.steps} steps")
    (print_fp8_table if fp8 else print_table)(results)
    if not all(r["verdict"]["pass"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
