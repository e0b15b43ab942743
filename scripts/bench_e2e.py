"""End-to-end LoRA fine-tuning throughput: HF transformers + PEFT vs ours, same samples, one GPU.

(a) HF + PEFT, padded micro-batches, adapters trained one after another (what most users run,
    variant "hf"), and the stronger variant on pre-packed sequences of up to --capacity tokens
    (position ids restart per sample, no padding; variant "hf_packed"); both again with Liger
    Kernel applied to the HF model (RMSNorm, RoPE, SwiGLU and fused linear cross-entropy
    kernels: "hf_liger", "hf_liger_packed"; needs liger-kernel, run after the plain HF variants);
(b) ours, all adapters together: planner-packed fixed-capacity microbatches through the
    functional decoder, with the fused Triton LoRA kernels ("triton"; norm/RoPE/SwiGLU groups
    compiled by torch.compile, see model.decoder.DecoderOptions), the same with those
    groups left eager ("triton_eager"), with each microbatch's forward + backward replayed as a
    CUDA graph ("triton_graphs", training/cuda_graphs.py; the first pass captures) and with the
    torch reference LoRA ("torch"). With
    ``--base-precision bf16,fp8`` each of our variants runs again with the FP8 base
    ("triton_fp8": projection weights and the untied input embedding quantized to e4m3, frozen
    GEMMs on FP8 tensor cores; ``--fp8-fast-accum off,forward,both`` repeats it per fast-
    accumulation setting, rows suffixed ``_fa-forward`` / ``_fa-both``); the FP8 runs come last
    and release the HF model's bf16 projection weights and embedding table, so their peak memory
    is the FP8 base's. ``nf4`` likewise runs them over an NF4 base (QLoRA: the projections in
    bitsandbytes' 4-bit format, dequantized per projection group into a reused buffer), and the
    variant "hf_qlora" is HF + PEFT over bitsandbytes' ``Linear4bit`` NF4 layers (double
    quantization, bf16 compute), the QLoRA baseline, run last.
(c) "hf_frozen": the floor under all of them, HF transformers' frozen base with no LoRA at all:
    forward + backward (input gradients only) on micro-batches of --hf-batch samples of like
    length (each global batch sorted by length, padded, attention-masked).
Each variant runs the whole workload twice and times the second pass (the first compiles
and warms up every shape). Reports real (non-padding) tokens/s and peak memory.

    python scripts/bench_e2e.py --shape llama8b --layers 8 --workload xsum --out $OUT
    python scripts/bench_e2e.py --shape llama8b --layers 32 --variants triton --base-precision bf16,fp8
    python scripts/bench_e2e.py --shape llama1b --layers 16 --capacity 8192 --variants hf_frozen,triton,triton_graphs
    python scripts/bench_e2e.py --shape llama8b --layers 32 --variants hf_qlora,triton --base-precision bf16,nf4
    python scripts/bench_e2e.py --shape tiny --device cpu --variants hf,torch   # smoke test
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

from harness import add_output_args, comma_list, device_info, sync, write_json

import torch  # noqa: E402

from lightning_lorafusion.data.packing import PackingConfig, SampleLookup, pack_microbatch  # noqa: E402
from lightning_lorafusion.data.synthetic import synthetic_token_samples  # noqa: E402
from lightning_lorafusion.data.tokenization import shifted_labels  # noqa: E402
from lightning_lorafusion.kernels.options import KernelOptions  # noqa: E402
from lightning_lorafusion.model.adapter_bank import AdapterBank  # noqa: E402
from lightning_lorafusion.model.decoder import DEFAULT_OPTIONS, DecoderOptions, forward_loss_sums  # noqa: E402
from lightning_lorafusion.model.hf_loading import (  # noqa: E402
    fp8_exempt_layer_set,
    params_from_hf_model,
    quantize_base_fp8,
    quantize_base_nf4,
)
from lightning_lorafusion.parallel.stage import adapter_loss  # noqa: E402
from lightning_lorafusion.planner import plan_microbatches  # noqa: E402
from lightning_lorafusion.specs import ALL_TARGET_MODULES, AdapterSpec  # noqa: E402
from lightning_lorafusion.training.epoch_planning import level_capacities, plan_needs, run_capacity_levels  # noqa: E402
from lightning_lorafusion.training.flops import lora_training_flops  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152),
    "llama1b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
}
DISTRIBUTIONS = {"xsum": ["xsum"] * 4, "cnn_dailymail": ["cnn_dailymail"] * 4, "wikisum": ["wikisum"] * 4,
                 "mixed": ["mixed"] * 4, "heterogeneous": ["xsum", "cnn_dailymail", "wikisum", "mixed"],
                 "fixed": []}  # every sample exactly --max-length tokens, the last 64 (at most) its completion


class _Sample:
    def __init__(self, ids, labels):
        self.input_ids, self.labels = tuple(ids), tuple(labels)


def build_model(args, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, attn_implementation="sdpa", **SHAPES[args.shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.requires_grad_(False)
    return cfg, model


def fixed_length_samples(n: int, length: int, *, vocab_size: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """``n`` random samples of exactly ``length`` tokens; the last ``min(64, length // 2)`` are the
    completion (labels), the rest the prompt."""
    gen = torch.Generator().manual_seed(seed)
    completion = max(1, min(64, length // 2))
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab_size, (length,), generator=gen).tolist()
        out.append((ids, [-100] * (length - completion) + ids[length - completion:]))
    return out


def workload(args, vocab):
    if args.workload == "fixed":
        return [fixed_length_samples(args.samples, args.max_length, vocab_size=vocab, seed=100 + a)
                for a in range(args.adapters)]
    data = []
    for a, dist in enumerate(DISTRIBUTIONS[args.workload][: args.adapters]):
        pairs = synthetic_token_samples(dist, args.samples, vocab_size=vocab, seed=100 + a, max_length=args.max_length)
        data.append(pairs)
    return data


def timed(device):
    """The clock after the device's queued work (a pass's start or end)."""
    sync(device)
    return time.perf_counter()


def packed_rows(samples, capacity):
    """First-fit-decreasing rows of whole samples, each at most ``capacity`` tokens."""
    rows: list[list] = []
    loads: list[int] = []
    for sample in sorted(samples, key=lambda s: -len(s[0])):
        for i, load in enumerate(loads):
            if load + len(sample[0]) <= capacity:
                rows[i].append(sample)
                loads[i] += len(sample[0])
                break
        else:
            rows.append([sample])
            loads.append(len(sample[0]))
    return rows


def target_modules(args) -> tuple[str, ...]:
    """The adapters' targets: ``args.target_modules`` where a caller sets it (a fused Phi-3
    checkpoint's ``qkv_proj`` / ``gate_up_proj``: scripts/bench_families.py), else all seven."""
    return tuple(getattr(args, "target_modules", None) or ALL_TARGET_MODULES)


def run_hf_peft(args, model, data, device, packed=False):
    from peft import LoraConfig, get_peft_model

    names = [f"a{i}" for i in range(len(data))]
    lcfg = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=args.dropout,
                      target_modules=list(target_modules(args)), task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lcfg, adapter_name=names[0])
    for n in names[1:]:
        peft_model.add_adapter(n, lcfg)
    checkpointing = args.hf_checkpointing
    try:
        if checkpointing:  # what PEFT's prepare_model_for_kbit_training turns on for QLoRA
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for timed_pass in (False, True):  # the first pass warms up every shape, untimed
            tokens, t_total = _hf_pass(args, peft_model, names, data, device, packed)
    finally:
        if checkpointing:
            model.gradient_checkpointing_disable()
        base = peft_model.unload()  # take PEFT's injected layers out of the shared base model
    return tokens / t_total, t_total, tokens, base


HF_PEFT_VARIANTS = ("hf", "hf_packed", "hf_liger", "hf_liger_packed")


def apply_liger(model):
    """Liger Kernel on the HF model (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy): the
    strongest single-adapter setup HF + PEFT users have. Patches ``model`` in place (call once)."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ImportError as e:
        raise SystemExit("variant hf_liger needs liger-kernel (pip install liger-kernel)") from e
    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=True, model=model)


def run_hf_frozen(args, model, data, device):
    """The frozen base alone (no PEFT): forward + backward to the input embeddings."""
    for timed_pass in (False, True):
        tokens, t0 = 0, timed(device)
        for samples in data:
            for g in range(0, len(samples), args.global_batch):
                batch = sorted(samples[g : g + args.global_batch], key=lambda s: len(s[0]))
                for m in range(0, len(batch), args.hf_batch):
                    ids, lab, att = _padded(batch[m : m + args.hf_batch])
                    embeds = model.model.embed_tokens(ids.to(device)).detach().requires_grad_(True)
                    out = model(inputs_embeds=embeds, attention_mask=att.to(device), labels=lab.to(device),
                                use_cache=False)
                    out.loss.backward()
                    tokens += int(att.sum())
        elapsed = timed(device) - t0
    return tokens / elapsed, elapsed, tokens


def _padded(micro):
    """input ids, labels (-100 on padding) and attention mask ``[B, longest]`` of some samples."""
    longest = max(len(ids) for ids, _ in micro)
    ids = torch.zeros(len(micro), longest, dtype=torch.long)
    lab = torch.full((len(micro), longest), -100, dtype=torch.long)
    att = torch.zeros(len(micro), longest, dtype=torch.long)
    for i, (x, y) in enumerate(micro):
        ids[i, : len(x)] = torch.tensor(x)
        lab[i, : len(y)] = torch.tensor(y)
        att[i, : len(x)] = 1
    return ids, lab, att


def _hf_pass(args, peft_model, names, data, device, packed):
    tokens, t_total = 0, 0.0
    for a, name in enumerate(names):
        peft_model.set_adapter(name)
        params = [p for n, p in peft_model.named_parameters() if f".{name}." in n]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.AdamW(params, lr=1e-4)
        samples = data[a]
        t0 = timed(device)
        for g in range(0, len(samples), args.global_batch):
            batch = samples[g : g + args.global_batch]
            if packed:
                for row in packed_rows(batch, args.capacity):
                    ids = torch.tensor([t for x, _ in row for t in x]).unsqueeze(0).to(device)
                    lab = torch.tensor([t for _, y in row for t in y]).unsqueeze(0).to(device)
                    pos = torch.cat([torch.arange(len(x)) for x, _ in row]).unsqueeze(0).to(device)
                    out = peft_model(input_ids=ids, position_ids=pos, labels=lab, use_cache=False)
                    out.loss.backward()
                    tokens += ids.shape[1]
                opt.step()
                opt.zero_grad(set_to_none=True)
                continue
            for m in range(0, len(batch), args.hf_batch):
                micro = batch[m : m + args.hf_batch]
                ids, lab, att = _padded(micro)
                out = peft_model(input_ids=ids.to(device), attention_mask=att.to(device), labels=lab.to(device),
                                 use_cache=False)
                out.loss.backward()
                tokens += sum(len(x) for x, _ in micro)
            opt.step()
            opt.zero_grad(set_to_none=True)
        t_total += timed(device) - t0
        for p in params:
            p.requires_grad_(False)
    return tokens, t_total


class OursSetup:
    """Our side of the benchmark: functional params, adapter bank and the samples as global
    batches (with lengths and loss denominators) ready for the planner and the packer."""

    def __init__(self, args, model, data, device, dtype):
        self.config, self.params = params_from_hf_model(model)
        self.specs = [AdapterSpec(name=f"a{i}", rank=args.rank, alpha=2 * args.rank, dropout=args.dropout, seed=i,
                                  global_batch_size=args.global_batch, dataset={"kind": "synthetic"},
                                  target_modules=target_modules(args))
                      for i in range(len(data))]
        self.bank = AdapterBank(self.specs, self.config, dtype=dtype, device=device)
        self.datasets = [[_Sample(x, shifted_labels(x, [t != -100 for t in y])) for x, y in d] for d in data]
        self.batches = [[list(range(g, min(g + args.global_batch, len(d)))) for g in range(0, len(d), args.global_batch)]
                        for d in self.datasets]
        self.lookup = SampleLookup(self.datasets, self.batches)
        self.lengths = self.lookup.lengths()
        self.denominators = self.lookup.denominators()


def model_and_workload(args):
    """Device, dtype (bf16 on CUDA, fp32 on CPU), the random-weight HF model and the samples."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf_config, model = build_model(args, device, dtype)
    return device, dtype, hf_config, model, workload(args, hf_config.vocab_size)


def add_workload_args(ap, layers: int) -> None:
    """Model shape, workload and adapter arguments shared with scripts/profile_capacity.py."""
    ap.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--workload", default="xsum", choices=sorted(DISTRIBUTIONS))
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--samples", type=int, default=64, help="samples per adapter")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--pad-multiple", type=int, default=128)
    ap.add_argument("--capacity-levels", type=int, default=0,
                    help="ours: pack each microbatch at the smallest of up to this many capacities holding its "
                         "tokens, as fit does without a pipeline (data.replica_capacity_levels); 0: all at --capacity")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--device", default="cuda")


def release_projection_weights(model, keep_layers=(), embedding=True) -> None:
    """Drop the HF model's seven projection weights per layer (but ``keep_layers``, which the
    FP8 base shares as they are) and its (untied) input embedding table (after
    ``quantize_base_fp8`` made the FP8 copies): the model cannot run afterwards; only the FP8
    variants may follow."""
    emb = model.get_input_embeddings()
    if embedding and emb.weight is not model.get_output_embeddings().weight:
        emb.weight = torch.nn.Parameter(emb.weight.new_empty(0), requires_grad=False)
    for i, layer in enumerate(model.model.layers):
        if i in keep_layers:
            continue
        for mod in (*[getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")],
                    *[getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]):
            mod.weight = torch.nn.Parameter(mod.weight.new_empty(0), requires_grad=False)


QUANTIZED = ("fp8", "nf4")


def quantize_all(args, w: "OursSetup", model, store: dict) -> None:
    """Every quantized base the run asks for (``store[precision]``), and the 4-bit layers of the
    HF + PEFT + bitsandbytes baseline (``store["bnb"]``) when it is planned, all from the bf16
    weights, which are then released (their memory would count in the quantized runs' peaks)."""
    keep = fp8_exempt_layer_set(w.config.num_layers, args.fp8_exempt_layers) if "fp8" in args.base_precision else set()
    if "fp8" in args.base_precision:
        store["fp8"] = quantize_base_fp8(w.params, embedding=not w.config.tie_word_embeddings, keep_layers=keep)
    if "nf4" in args.base_precision:
        store["nf4"] = quantize_base_nf4(w.params)
    if "hf_qlora" in args.variants.split(","):
        store["bnb"] = bnb_projection_layers(model)
    # the FP8 base holds its own embedding table; the NF4 base and the QLoRA baseline share HF's
    release_projection_weights(model, keep, embedding=set(store) == {"fp8"})


def bnb_projection_layers(model) -> dict:
    """{(layer, module name): bitsandbytes ``Linear4bit``} for the seven projections, NF4 with
    double quantization and bf16 compute, as ``BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)`` builds them."""
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise SystemExit("variant hf_qlora needs bitsandbytes (pip install bitsandbytes)") from e
    out = {}
    for i, layer in enumerate(model.model.layers):
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for n in names:
                lin = getattr(parent, n)
                q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                      compute_dtype=lin.weight.dtype, compress_statistics=True, quant_type="nf4",
                                      device="meta")
                q.weight = bnb.nn.Params4bit(lin.weight.data.to("cpu"), requires_grad=False, compress_statistics=True,
                                             quant_type="nf4").to(lin.weight.device)
                if lin.bias is not None:
                    q.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
                out[(i, n)] = q
    return out


def run_hf_qlora(args, model, data, device, layers: dict):
    """HF + PEFT over the bitsandbytes NF4 layers (QLoRA): the projections swapped in place,
    PEFT's LoRA on top, the same passes as ``run_hf_peft``."""
    for (i, n), q in layers.items():
        layer = model.model.layers[i]
        setattr(layer.self_attn if n in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp, n, q)
    return run_hf_peft(args, model, data, device)


def run_ours(args, hf_config, model, data, device, dtype, backend, base_precision="bf16", graphs=False, label=None,
             fp8_params=None, options=DEFAULT_OPTIONS, precapture=False, graph_kwargs=None, fused_adam=False):
    """``fp8_params``: a dict that keeps the FP8 base between FP8 runs (the first one quantizes
    and releases the HF model's bf16 weights, so later ones cannot quantize again).
    ``precapture``: with ``graphs``, capture graphs covering every planned shape key before the
    first pass, as ``fit`` does before an epoch (else keys are captured on first use).
    ``graph_kwargs``: more ``TrainingGraphs`` arguments (``memory``, ``max_precapture``).
    ``fused_adam``: torch's fused AdamW (one kernel, no temporaries) instead of the default
    (multi-tensor)."""
    w = OursSetup(args, model, data, device, dtype)
    if base_precision in QUANTIZED:
        fp8_params = {} if fp8_params is None else fp8_params
        if base_precision not in fp8_params:
            quantize_all(args, w, model, fp8_params)
        w.params = fp8_params[base_precision]
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    config, params, specs, bank, lookup, dens = w.config, w.params, w.specs, w.bank, w.lookup, w.denominators
    opts = [torch.optim.AdamW(bank.parameters_of(i), lr=1e-4, **({"fused": True} if fused_adam else {}))
            for i in range(len(specs))]
    plan = plan_microbatches(w.lengths, capacity=args.capacity, pad_multiple=args.pad_multiple, method="greedy")
    steps = plan.step_adapters()
    capacities = [args.capacity] * len(plan.microbatches)
    if getattr(args, "capacity_levels", 0):  # as the data module packs them without a pipeline
        needs = plan_needs(plan, args.pad_multiple)
        capacities = level_capacities(needs, run_capacity_levels([needs], args.capacity, args.capacity_levels),
                                      args.capacity)
    mbs = [pack_microbatch(p, lookup, config=PackingConfig(capacity=capacities[i], pad_multiple=args.pad_multiple),
                           num_adapters=len(specs), denominators=dens, step_adapters=steps.get(i, ()),
                           index=i).to(device)
           for i, p in enumerate(plan.microbatches) if not p.is_noop]
    runner = None
    if graphs:
        from lightning_lorafusion.training.cuda_graphs import TrainingGraphs, graph_key

        runner = TrainingGraphs(params=params, bank=bank, config=config, capture=device.type == "cuda",
                                options=options, checkpoint_layers=args.checkpoint_layers, **(graph_kwargs or {}))
        if precapture:
            runner.precapture(collections.Counter(graph_key(mb) for mb in mbs), device)
    at_capture = _peaks(device)  # before any optimizer step: no AdamW state yet
    # the first pass compiles every kernel variant (captures), untimed; then --timed-passes passes, summed
    _ours_pass(mbs, bank, opts, params, config, backend, device, runner, options, checkpoint_layers=args.checkpoint_layers)
    tokens, elapsed = 0, 0.0
    for _ in range(max(1, getattr(args, "timed_passes", 1))):  # callers without the argument time one
        pass_tokens, pass_seconds = _ours_pass(mbs, bank, opts, params, config, backend, device, runner, options,
                                               checkpoint_layers=args.checkpoint_layers)
        tokens, elapsed = tokens + pass_tokens, elapsed + pass_seconds
    label = label or (backend + ("_graphs" if graphs else ""))
    if args.profile and device.type == "cuda":
        _profile(args, label, lambda: _ours_pass(mbs[:4], bank, opts, params, config, backend, device, runner, options))
    if args.memory_peak and device.type == "cuda" and runner is None:  # graph replays allocate nothing
        from memory_peak import format_report, peak_report

        # the largest microbatch (most real tokens), after the timed pass: optimizer state exists
        big = max(mbs, key=lambda m: m.real_tokens)
        print(format_report(label, peak_report(lambda: _ours_pass([big], bank, opts, params, config, backend,
                                                                  device, options=options))), flush=True)
    fill = sum(m.real_tokens for m in mbs) / (len(mbs) * args.capacity)
    extra = {}
    if runner is not None:
        extra = {"graphs": runner.num_graphs, "keys": len({graph_key(mb) for mb in mbs}),
                 "replays": runner.replays, "capture_s": round(runner.capture_seconds, 1),
                 "refusals": {str(k): v for k, v in runner.refusals.items()},
                 "precaptured": runner.precaptures, "captures": runner.captures}
        if device.type == "cuda":  # while the graphs (their pool) are alive
            from lightning_lorafusion.capture import pool_usage

            extra.update(at_capture=at_capture, pools=pool_usage(device=device), eager_detail=eager_detail(device))
    if getattr(args, "capacity_levels", 0):  # the real share of the tokens computed at the levels
        extra["capacities"] = sorted({m.capacity for m in mbs})
        extra["computed_fill"] = round(sum(m.real_tokens for m in mbs) / sum(m.capacity for m in mbs), 4)
    return tokens / elapsed, elapsed, tokens, fill, len(mbs), extra


def _peaks(device) -> dict:
    """Peak allocated and reserved GiB so far (CUDA; empty elsewhere)."""
    if device.type != "cuda":
        return {}
    return {"peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)}


def kernel_time_summary(kernels, microbatches: int, short_us: float = 20.0) -> dict:
    """``kernels``: ``(name, launches, device µs in all)`` per kernel name -> per microbatch: the
    kernels launched, their device ms, and the part in kernels whose mean time is under
    ``short_us`` (work whose time hardly depends on the tokens), with the top names by time."""
    kernels = [(n, c, t) for n, c, t in kernels if c > 0]
    short = [(n, c, t) for n, c, t in kernels if t / c < short_us]
    per = max(microbatches, 1)
    return {"microbatches": microbatches, "kernels": sum(c for _, c, _ in kernels) / per,
            "device_ms": sum(t for _, _, t in kernels) / per / 1e3,
            "short_kernels": sum(c for _, c, _ in short) / per, "short_ms": sum(t for _, _, t in short) / per / 1e3,
            "short_us": short_us,
            "top": [(n[:80], c, round(t / per / 1e3, 3)) for n, c, t in sorted(kernels, key=lambda k: -k[2])[:12]]}


def _profile(args, label, fn, microbatches: int = 4) -> None:
    """Kernel time table (torch.profiler) of ``fn``: where a step's device time goes, and
    ``kernel_time_summary`` of it (the CUDA kernels of the steps, CUDA-graph replays included)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        fn()
    averages = prof.key_averages()
    table = averages.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
    print(f"--- profile: {label}, {microbatches} microbatches ---\n" + "\n".join(table.splitlines()[:25]), flush=True)
    kernels = [(e.key, e.count, getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0))
               for e in averages if getattr(e, "device_type", None) == DeviceType.CUDA]
    summary = kernel_time_summary(kernels, microbatches)
    print(f"--- kernels per microbatch: {summary['kernels']:.0f} launched, {summary['device_ms']:.1f} ms of device time, "
          f"{summary['short_ms']:.1f} ms in {summary['short_kernels']:.0f} kernels of mean < {summary['short_us']:.0f} µs",
          flush=True)
    ops = launching_ops(prof.key_averages(group_by_stack_n=12), microbatches)
    if ops:  # eager steps: which operators launch the kernels (a graph replay has none to name)
        print("--- operators by kernels launched per microbatch (launches, device ms, mean µs):\n"
              + "\n".join(f"{n[:110]:110} {c:8.1f} {t:8.3f} {u:8.1f}" for n, c, t, u in ops[:30]), flush=True)
        summary["ops"] = ops[:60]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"profile_{args.workload}_{label}.txt"), "w") as f:
            f.write(table)
        write_json(args.out, f"profile_{args.workload}_{label}.json", summary)


def launching_ops(averages, microbatches: int) -> list[tuple[str, float, float, float]]:
    """Host operators that launch kernels themselves (self device time > 0), most launches
    first: (name and the innermost caller in this repository, calls per microbatch, self device
    ms per microbatch, mean µs per call); ``averages`` grouped by stack."""
    from torch.autograd import DeviceType

    per = max(microbatches, 1)
    merged: dict[str, list[float]] = {}
    for e in averages:
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        if getattr(e, "device_type", None) != DeviceType.CPU or t <= 0 or e.count <= 0:
            continue
        here = [f for f in (e.stack or []) if "lightning_lorafusion" in f or "scripts" in f]
        name = e.key + (" @ " + here[0].split("lightning_lorafusion/")[-1] if here else "")
        m = merged.setdefault(name, [0.0, 0.0])
        m[0] += e.count
        m[1] += t
    out = [(n, round(c / per, 1), round(t / per / 1e3, 3), round(t / c, 1)) for n, (c, t) in merged.items()]
    return sorted(out, key=lambda o: -o[1])


def eager_detail(device: torch.device, top: int = 6) -> dict:
    """What the eager allocator (pool (0, 0)) holds, GiB: reserved and allocated in its small
    (blocks < 1 MiB, 2 MiB segments) and large segments, and its largest free blocks (MiB): the
    reserved-but-free memory that adds to a graph row's peak beside the graphs' pool."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    gib = 2.0**30
    out = {"small_reserved": 0.0, "small_allocated": 0.0, "large_reserved": 0.0, "large_allocated": 0.0}
    free = []
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", index) != index or tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            continue
        kind = "small" if seg.get("segment_type") == "small" else "large"
        out[f"{kind}_reserved"] += seg["total_size"] / gib
        out[f"{kind}_allocated"] += seg["allocated_size"] / gib
        free += [b["size"] for b in seg.get("blocks", ()) if b.get("state") == "inactive"]
    out = {k: round(v, 3) for k, v in out.items()}
    out["largest_free_mib"] = [round(f / 2**20, 1) for f in sorted(free, reverse=True)[:top]]
    out["free_blocks"] = len(free)
    return out


def _ours_pass(mbs, bank, opts, params, config, backend, device, runner=None, options=DEFAULT_OPTIONS,
               checkpoint_layers=0):
    t0 = timed(device)
    tokens = 0
    for mb in mbs:
        if runner is not None and runner.step(mb, mb.loss_denominators) is not None:
            for a in mb.step_adapters:
                opts[a].step()
                opts[a].zero_grad(set_to_none=False)
            tokens += mb.real_tokens
            continue
        routing = bank.routing(mb.segments, mb.index, mb.capacity)
        sums = forward_loss_sums(params, bank.view(), mb.input_ids, mb.labels, mb.position_ids, mb.cu_seqlens,
                                 routing, config=config, backend=backend,
                                 max_seqlen=mb.max_seqlen, label_rows=mb.label_rows, options=options,
                                 checkpoint_layers=checkpoint_layers)
        adapter_loss(sums, mb.loss_denominators).backward()
        for a in mb.step_adapters:
            opts[a].step()
            opts[a].zero_grad(set_to_none=True)
        tokens += mb.real_tokens
    return tokens, timed(device) - t0


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, layers=8)
    add_output_args(ap)
    ap.add_argument("--hf-batch", type=int, default=4, help="HF micro-batch (samples, padded)")
    ap.add_argument("--hf-checkpointing", action="store_true",
                    help="HF + PEFT rows with activation checkpointing of every layer (the QLoRA recipe's "
                         "default through PEFT's prepare_model_for_kbit_training)")
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--variants", default="hf,hf_packed,torch,triton")
    ap.add_argument("--base-precision", type=comma_list(("bf16", "fp8", "nf4")), default=["bf16"],
                    help="comma list of bf16 / fp8 / nf4: our variants run once per entry (quantized rows "
                         "last, suffixed _fp8 / _nf4); fp8 needs a GPU with FP8 tensor cores. The variant "
                         "hf_qlora (HF + PEFT + bitsandbytes NF4) needs fp8 or nf4 here")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100/H200 SXM datasheet)")
    ap.add_argument("--fp8-exempt-layers", type=int, default=0,
                    help="fp8: the first and last N layers keep 16-bit projections (model.precision.fp8.exempt_layers)")
    ap.add_argument("--fp8-fast-accum", type=comma_list(("off", "forward", "both")), default=["off"],
                    help="comma list of off / forward / both: the FP8 runs repeat per setting (fast "
                         "accumulation of the forward products, or of the forward and dX products)")
    ap.add_argument("--checkpoint-layers", type=int, default=0,
                    help="eager variants: activation checkpointing of the first N decoder layers (each keeps "
                         "only its input for backward and recomputes the rest; model.activation_checkpointing)")
    ap.add_argument("--profile", action="store_true", help="also write a kernel-time table of 4 microbatches")
    ap.add_argument("--timed-passes", type=int, default=1, help="passes over the workload timed (after one untimed)")
    ap.add_argument("--memory-peak", action="store_true",
                    help="eager variants: what is live at one microbatch's memory peak, by allocating line "
                         "(scripts/memory_peak.py)")
    return ap.parse_args(argv)


def planned_runs(args) -> list[tuple[str, str, str]]:
    """(variant, base precision, fast accumulation) in run order: HF variants (Liger's after the
    plain ones: Liger patches the shared HF model in place), ours in bf16, then ours in FP8 (last:
    they release the HF model's bf16 weights)."""
    variants = args.variants.split(",")
    ours = [v for v in variants if not v.startswith("hf")]
    runs = [(v, "bf16", "off") for v in variants
            if (v.startswith("hf") or "bf16" in args.base_precision) and v != "hf_qlora"]
    runs.sort(key=lambda r: r[0].startswith("hf_liger"))
    runs += [(v, "fp8", m) for v in ours if "fp8" in args.base_precision for m in args.fp8_fast_accum]
    runs += [(v, "nf4", "off") for v in ours if "nf4" in args.base_precision]
    # last: it needs the 4-bit layers made when the first quantized run released the bf16 weights
    runs += [("hf_qlora", "nf4", "off")] if "hf_qlora" in variants else []
    return runs


def run_variant(args, w: dict, variant: str, precision: str, accum: str) -> tuple[str, float, float, int, dict]:
    """One variant -> (row label, tokens/s, seconds, real tokens, extra columns). ``w`` holds the
    workload and the shared HF model (replaced when PEFT unloads)."""
    device = w["device"]
    if variant in HF_PEFT_VARIANTS:
        if variant.startswith("hf_liger") and not w["liger"]:
            apply_liger(w["model"])
            w["liger"] = True
        tps, secs, toks, w["model"] = run_hf_peft(args, w["model"], w["data"], device,
                                                   packed=variant.endswith("_packed"))
        return variant, tps, secs, toks, {}
    if variant == "hf_frozen":
        tps, secs, toks = run_hf_frozen(args, w["model"], w["data"], device)
        return variant, tps, secs, toks, {}
    if variant == "hf_qlora":
        if "bnb" not in w["fp8_params"]:
            raise SystemExit("variant hf_qlora needs a quantized run of ours before it (--base-precision ...,nf4)")
        tps, secs, toks, w["model"] = run_hf_qlora(args, w["model"], w["data"], device, w["fp8_params"]["bnb"])
        return variant, tps, secs, toks, {}
    options = DecoderOptions(
        elementwise_fusion="off" if variant == "triton_eager" else "auto",
        kernels=KernelOptions(fp8_fast_accum_forward=accum in ("forward", "both"),
                              fp8_fast_accum_input_grad=accum == "both"))
    backend = "triton" if variant.startswith("triton") else variant
    label = variant + ("" if precision == "bf16" else f"_{precision}") + ("" if accum == "off" else f"_fa-{accum}")
    tps, secs, toks, fill, n, extra = run_ours(args, w["hf_config"], w["model"], w["data"], device, w["dtype"],
                                               backend, base_precision=precision,
                                               graphs=label.startswith("triton_graphs"), label=label,
                                               fp8_params=w["fp8_params"], options=options)
    return label, tps, secs, toks, {"fill": round(fill, 3), "microbatches": n, **extra}


def print_table(rows: list[dict], args, device_name: str) -> None:
    print(f"\n{device_name}, torch {torch.__version__}, shape={args.shape} layers={args.layers} "
          f"workload={args.workload} adapters={args.adapters}x{args.samples} r={args.rank} p={args.dropout} "
          f"capacity={args.capacity} checkpoint_layers={args.checkpoint_layers}")
    base = next((r["tokens_per_s"] for r in rows if r["variant"] == "hf"), rows[0]["tokens_per_s"])
    best_hf = max((r["tokens_per_s"] for r in rows if r["variant"] in HF_PEFT_VARIANTS), default=base)
    frozen = next((r["tokens_per_s"] for r in rows if r["variant"] == "hf_frozen"), float("nan"))
    print(f"{'variant':14} {'tok/s':>10} {'vs hf':>7} {'vs best hf':>10} {'vs frozen':>9} {'MFU':>6} {'peak GiB':>9}")
    for r in rows:
        print(f"{r['variant']:14} {r['tokens_per_s']:>10.1f} {r['tokens_per_s'] / base:>6.2f}x "
              f"{r['tokens_per_s'] / best_hf:>9.2f}x {r['tokens_per_s'] / frozen:>8.2f}x {r['mfu']:>6.1%} "
              f"{r['peak_gib']:>9.2f}")
    by_name = {r["variant"]: r for r in rows}
    for r in rows:
        quant = next((q for q in QUANTIZED if f"_{q}" in r["variant"]), None)
        bf16 = by_name.get(r["variant"].split(f"_{quant}")[0]) if quant else None
        if bf16 is not None:
            print(f"{r['variant']}: {r['tokens_per_s'] / bf16['tokens_per_s']:.3f}x the tokens/s of "
                  f"{bf16['variant']}, peak {r['peak_gib'] - bf16['peak_gib']:+.2f} GiB")
    qlora = by_name.get("hf_qlora")
    for r in rows:
        if qlora is not None and r["variant"].endswith("_nf4"):
            print(f"{r['variant']}: {r['tokens_per_s'] / qlora['tokens_per_s']:.3f}x the tokens/s of hf_qlora "
                  f"(HF + PEFT + bitsandbytes NF4), peak {r['peak_gib'] - qlora['peak_gib']:+.2f} GiB")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device, dtype, hf_config, model, data = model_and_workload(args)
    w = {"device": device, "dtype": dtype, "hf_config": hf_config, "model": model, "data": data, "liger": False,
         "fp8_params": {}}
    flops = lora_training_flops(hf_config, [len(x) for d in data for x, _ in d])
    rows = []
    for variant, precision, accum in planned_runs(args):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            label, tps, secs, toks, extra = run_variant(args, w, variant, precision, accum)
        except torch.OutOfMemoryError:
            print(json.dumps({"variant": variant, "error": "out of memory"}), flush=True)
            continue
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        extra["mfu"] = round(flops / secs / args.peak_tflops / 1e12, 4)
        rows.append({"variant": label, "tokens_per_s": round(tps, 1), "seconds": round(secs, 2),
                     "real_tokens": toks, "peak_gib": round(peak, 2), **extra})
        print(json.dumps(rows[-1]), flush=True)
    info = device_info(device)
    print_table(rows, args, info["device_name"])
    write_json(args.out, f"e2e_{args.shape}_{args.workload}_c{args.capacity}.json",
               {**info, "args": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
