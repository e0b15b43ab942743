"""Training and decode throughput of every decoder family at its 8B-class shape, beside Llama-8B,
against HF transformers + PEFT in the same run (one GPU, random weights, bf16).

Each family's shape is its published HF ``config.json`` (``FAMILIES``: the values written out
with the checkpoint they come from), cut to its first ``--layers`` decoder layers so the whole
run fits a few minutes; the embedding and LM head stay full size (Gemma's 256k vocabulary
included). Per layer the work is the family's: per-layer numbers scale with depth, while the
embedding / head cost is paid once, so a deeper cut moves tokens/s towards the full model's.
A cut keeps the family's own layer pattern from layer 0 (Gemma 2 alternates sliding and global
layers; Gemma 3's first global layer is layer 5, so ``--layers 4`` runs sliding layers only).

Per family:

- training, real tokens/s over the same synthetic samples (``--workload``, ``--adapters``
  adapters x ``--samples``, rank ``--rank`` on every projection of the family; Phi-3's fused
  ``qkv_proj`` / ``gate_up_proj`` as PEFT targets them):
  ours as ``fit`` trains (``--ours``: ``triton_graphs``, planner-packed microbatches of
  ``--capacity`` tokens, fused kernels, each microbatch's forward + backward as a CUDA graph; or
  ``triton``, the same eager) vs HF + PEFT (padded micro-batches of ``--hf-batch`` samples, the
  adapters one after another: scripts/bench_e2e.py's ``hf`` variant); each timed on its second
  pass (the first compiles and captures). MFU from ``training.flops.lora_training_flops`` (the
  family's shapes and sliding windows) over ``--peak-tflops``;
- decode: ``Engine`` decode-only steps of ``--decode-rows`` running requests of
  ``--prompt-len`` tokens spread over ``--decode-adapters`` adapters of rank ``--rank`` (and the
  same rows on the base): ms per step and generated tokens/s (scripts/bench_generation.py's
  ``step_time``); with ``--hf-decode`` also the same requests generated whole (prefill +
  decode) by the engine and by HF + PEFT ``generate`` (a mixed-adapter batch), tokens/s.

``--deadline S`` stops starting new measurements after S seconds; what was measured is kept
(the JSON under ``--out`` is rewritten after every measurement). Prints a table per family and
a summary. GPU::

    PYTHONPATH=. python3 scripts/bench_families.py --layers 4 --deadline 540 --out $OUT

CPU smoke run (the same families at tiny shapes, fp32, torch reference kernels)::

    PYTHONPATH=. python3 scripts/bench_families.py --scale tiny --device cpu --dtype float32 --ours torch \\
        --samples 2 --max-length 48 --capacity 128 --decode-rows 4 --decode-steps 2 --prompt-len 8
"""

from __future__ import annotations

import argparse
import gc
import time

from harness import Report, add_device_args, add_output_args, comma_list, dtype_of, logger, sync

import torch  # noqa: E402

import bench_e2e  # noqa: E402
import bench_generation  # noqa: E402
from lightning_lorafusion.model.decoder_config import DecoderConfig  # noqa: E402
from lightning_lorafusion.model.hf_loading import params_from_hf_model  # noqa: E402
from lightning_lorafusion.serving import Engine, EngineConfig  # noqa: E402
from lightning_lorafusion.training.flops import lora_training_flops  # noqa: E402

log = logger("families")

# Published config.json values (the fields the decoder reads), by checkpoint.
FAMILIES: dict[str, dict] = {
    "llama3_8b": dict(
        model_type="llama", source="meta-llama/Llama-3.1-8B",
        config=dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen3_8b": dict(
        model_type="qwen3", source="Qwen/Qwen3-8B",
        config=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, use_sliding_window=False)),
    "gemma2_9b": dict(
        model_type="gemma2", source="google/gemma-2-9b",
        config=dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096,
                    rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=8192,
                    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "gemma3_12b": dict(
        model_type="gemma3_text", source="google/gemma-3-12b-pt (text_config)",
        config=dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                    sliding_window=1024, sliding_window_pattern=6, rope_theta=1000000.0,
                    rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                    rms_norm_eps=1e-6, max_position_embeddings=131072, hidden_activation="gelu_pytorch_tanh",
                    attn_logit_softcapping=None, final_logit_softcapping=None, tie_word_embeddings=True)),
    "phi4_14b": dict(
        model_type="phi3", source="microsoft/phi-4",
        config=dict(vocab_size=100352, hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                    num_attention_heads=40, num_key_value_heads=10, max_position_embeddings=16384,
                    rms_norm_eps=1e-5, rope_theta=250000.0, sliding_window=None, tie_word_embeddings=False)),
    "olmo2_7b": dict(
        model_type="olmo2", source="allenai/OLMo-2-1124-7B",
        config=dict(vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                    rms_norm_eps=1e-6, rope_theta=500000.0, tie_word_embeddings=False)),
}
# --scale tiny: the same families (every piece live: head_dim != hidden / heads, windows shorter
# than the samples, soft-caps, fused projections) at CPU size.
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def hf_config(name: str, args: argparse.Namespace):
    """The transformers config of ``FAMILIES[name]`` cut to ``args.layers`` layers (tiny with
    ``--scale tiny``)."""
    from transformers import AutoConfig

    entry = FAMILIES[name]
    values = dict(entry["config"], num_hidden_layers=args.layers, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if args.scale == "tiny":
        values.update(TINY)
        if "head_dim" in values:
            values.update(head_dim=24, query_pre_attn_scalar=24 if "query_pre_attn_scalar" in values else None)
        if values.get("sliding_window"):
            values["sliding_window"] = 16
        values = {k: v for k, v in values.items() if v is not None or k.endswith("softcapping")}
    return AutoConfig.for_model(entry["model_type"], **values)


def build_model(config, device: torch.device, dtype: torch.dtype):
    """Random weights (transformers' own init) in ``dtype`` on ``device``, frozen. Attention:
    SDPA, but eager for a config with attention soft-capping (Gemma 2; HF's SDPA refuses it)."""
    from transformers import AutoModelForCausalLM

    attn = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    model.requires_grad_(False)
    return model.eval()


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def train_hf(args, w: dict) -> dict:
    """HF + PEFT: padded micro-batches, adapters one after another (bench_e2e's ``hf``)."""
    reset_peak(w["device"])
    tps, secs, tokens, w["model"] = bench_e2e.run_hf_peft(args, w["model"], w["data"], w["device"])
    return {"tokens_per_s": tps, "seconds": secs, "real_tokens": tokens, "mfu": w["flops"] / secs / args.peak,
            "peak_gib": peak_gib(w["device"])}


def train_ours(args, w: dict) -> dict:
    """Ours as fit trains: every adapter together in planner-packed microbatches."""
    reset_peak(w["device"])
    backend = "torch" if args.ours == "torch" else "triton"
    tps, secs, tokens, fill, n, extra = bench_e2e.run_ours(
        args, w["config"], w["model"], w["data"], w["device"], w["dtype"], backend,
        graphs=args.ours == "triton_graphs", label=args.ours)
    return {"variant": args.ours, "tokens_per_s": tps, "seconds": secs, "real_tokens": tokens,
            "mfu": w["flops"] / secs / args.peak, "peak_gib": peak_gib(w["device"]), "fill": fill,
            "microbatches": n, **extra}


def decode(args, w: dict) -> dict:
    """Engine decode-only steps of ``--decode-rows`` requests, with adapters and on the base."""
    device, dtype = w["device"], w["dtype"]
    config, params = params_from_hf_model(w["model"])  # shares the HF tensors
    adapters = bench_generation.random_adapters(config, args.decode_adapters, [args.rank], device, dtype,
                                                seed=1, b_std=0.02)
    names = [a[0] for a in adapters]
    steps = args.decode_steps
    requests = bench_generation.make_requests(args.decode_rows, config.vocab_size, args.prompt_len, args.prompt_len,
                                              names, 2 * steps + 8, seed=4)
    engine = Engine(config, params, None,
                    EngineConfig(max_num_seqs=args.decode_rows,
                                 max_num_batched_tokens=max(args.decode_rows, args.prompt_len * args.decode_rows),
                                 gpu_memory_fraction=args.memory_fraction, prefix_caching=False),
                    eos_token_ids=(), device=device, dtype=dtype)
    try:
        for name, rank, alpha, factors in adapters:
            engine.add_adapter_weights(name, factors, rank=rank, alpha=alpha)
        t0 = time.perf_counter()
        engine.generate(bench_generation._renamed(requests[: min(8, len(requests))], "w"))  # warm-up, captures
        sync(device)
        warm = time.perf_counter() - t0
        out = {"warm_up_s": warm}
        for kind, tag, adapter in (("adapters", "t", False), ("base", "b", None)):
            out[kind] = bench_generation.step_time(engine, bench_generation._renamed(requests, tag, adapter=adapter),
                                                   steps, device)
        out["cuda_graphs"] = engine.runner.graphs is not None
        out["peak_gib"] = peak_gib(device)
        if args.hf_decode:  # whole requests (prefill + decode) both ways, the same requests
            out["engine_generate"] = _without_tokens(
                bench_generation.run_ours(engine, bench_generation._renamed(requests, "g"), device))
    finally:
        engine.close()
    if args.hf_decode:
        peft_model = bench_generation.attach_peft(w["model"], adapters)
        try:
            out["hf_peft_generate"] = _without_tokens(
                bench_generation.run_hf(peft_model, requests, len(requests), device, use_adapters=True))
        finally:
            w["model"] = peft_model.unload()
    return out


def _without_tokens(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "tokens"}


def run_family(args, name: str, report: Report, started: float) -> None:
    """Every measurement of one family into ``report[name]``; stops at the deadline."""
    device, dtype = torch.device(args.device), dtype_of(args.dtype)
    reset_peak(device)
    config = hf_config(name, args)
    ours = DecoderConfig.from_hf(config)
    args.target_modules = ours.family.projections
    model = build_model(config, device, dtype)
    data = bench_e2e.workload(args, config.vocab_size)
    w = {"device": device, "dtype": dtype, "config": config, "model": model, "data": data,
         "flops": lora_training_flops(config, [len(x) for d in data for x, _ in d])}
    entry = FAMILIES[name]
    report[name] = {"source": entry["source"], "model_type": entry["model_type"], "layers": args.layers,
                    "published_layers": entry["config"]["num_hidden_layers"], "scale": args.scale,
                    "head_dim": ours.head_dim, "vocab_size": ours.vocab_size,
                    "targets": list(ours.family.projections), "useful_flops": w["flops"]}
    phases = [("train_ours", train_ours), ("train_hf_peft", None if args.skip_hf else train_hf),
              ("decode", None if args.skip_decode else decode)]
    try:
        for phase, fn in phases:
            key = f"{name}.{phase}"
            if fn is None:
                continue
            if args.deadline and time.perf_counter() - started > args.deadline:
                report["errors"][key] = f"skipped: past --deadline {args.deadline:g} s"
                report.save()
                continue
            gc.collect()  # the previous phase's graphs and caches go before this one sizes memory
            if device.type == "cuda":
                torch.cuda.empty_cache()
            result = report.measure(key, lambda f=fn: f(args, w))
            if result is not None:
                report[name][phase] = report.pop(key)
                report.save()
    finally:
        w.clear()  # the model, its data and its adapters go before the next family
        del model
        reset_peak(device)


def family_table(name: str, r: dict) -> str:
    """One family's rows (markdown)."""
    lines = [f"\n{name} ({r['source']}, {r['model_type']}): {r['layers']} of {r['published_layers']} layers, "
             f"head_dim {r['head_dim']}, vocab {r['vocab_size']}, targets {','.join(r['targets'])}",
             "| measure | value |", "|---|---|"]
    ours, hf, dec = r.get("train_ours"), r.get("train_hf_peft"), r.get("decode")
    if ours:
        lines.append(f"| training tok/s, ours ({ours['variant']}) | {ours['tokens_per_s']:,.0f} "
                     f"(MFU {ours['mfu']:.1%}, fill {ours['fill']:.2f}) |")
    if hf:
        lines.append(f"| training tok/s, HF + PEFT | {hf['tokens_per_s']:,.0f} (MFU {hf['mfu']:.1%}) |")
    if ours and hf:
        lines.append(f"| ours / HF + PEFT | {ours['tokens_per_s'] / hf['tokens_per_s']:.2f}x |")
    if dec:
        a, b = dec["adapters"], dec["base"]
        lines.append(f"| decode step ms, {a['running']} rows, adapters / base | {a['step_ms']:.2f} / "
                     f"{b['step_ms']:.2f} |")
        lines.append(f"| decode tok/s, adapters / base | {a['decode_tok_per_s']:,.0f} / {b['decode_tok_per_s']:,.0f} |")
        if "hf_peft_generate" in dec:
            ours_g, hf_g = dec["engine_generate"]["tokens_per_s"], dec["hf_peft_generate"]["tokens_per_s"]
            lines.append(f"| generate tok/s ({a['running']} requests), engine / HF + PEFT | {ours_g:,.0f} / "
                         f"{hf_g:,.0f} ({ours_g / hf_g:.2f}x) |")
    return "\n".join(lines)


def summary_table(report: dict, names: list[str]) -> str:
    """One row per family: training ours / HF + PEFT / ratio, decode ms and tok/s with adapters."""
    lines = ["\n| family | layers | train tok/s ours | HF + PEFT | ratio | MFU ours | decode ms (adapters) "
             "| decode tok/s |", "|---|---|---|---|---|---|---|---|"]

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    for name in names:
        r = report.get(name)
        if r is None:
            continue
        ours, hf, dec = r.get("train_ours") or {}, r.get("train_hf_peft") or {}, (r.get("decode") or {}).get("adapters", {})
        ratio = ours["tokens_per_s"] / hf["tokens_per_s"] if ours and hf else None
        lines.append(f"| {name} | {r['layers']}/{r['published_layers']} | {num(ours.get('tokens_per_s'), ',.0f')} | "
                     f"{num(hf.get('tokens_per_s'), ',.0f')} | {num(ratio, '.2f')} | {num(ours.get('mfu'), '.1%')} | "
                     f"{num(dec.get('step_ms'), '.2f')} | {num(dec.get('decode_tok_per_s'), ',.0f')} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", type=comma_list(tuple(FAMILIES)), default=list(FAMILIES))
    ap.add_argument("--layers", type=int, default=4, help="decoder layers kept of each published depth")
    ap.add_argument("--scale", choices=("published", "tiny"), default="published")
    ap.add_argument("--workload", default="xsum", choices=sorted(bench_e2e.DISTRIBUTIONS))
    ap.add_argument("--adapters", type=int, default=4, help="training adapters")
    ap.add_argument("--samples", type=int, default=32, help="training samples per adapter")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--pad-multiple", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--hf-batch", type=int, default=4, help="HF + PEFT micro-batch (samples, padded)")
    ap.add_argument("--ours", choices=("triton_graphs", "triton", "torch"), default="triton_graphs")
    ap.add_argument("--decode-rows", type=int, default=64)
    ap.add_argument("--decode-adapters", type=int, default=8)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--memory-fraction", type=float, default=0.3, help="EngineConfig.gpu_memory_fraction")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100/H200 SXM)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--hf-decode", action="store_true",
                    help="also generate the decode requests whole (prefill + decode) with the engine and with "
                         "HF + PEFT generate (mixed-adapter batch, adapter_names per row): tokens/s both ways")
    ap.add_argument("--deadline", type=float, default=0.0, help="seconds; start nothing after (0: none)")
    add_device_args(ap)
    add_output_args(ap)
    args = ap.parse_args(argv)
    if min(args.layers, args.adapters, args.samples, args.decode_rows, args.decode_adapters, args.decode_steps) < 1:
        ap.error("--layers, --adapters, --samples, --decode-rows, --decode-adapters and --decode-steps must be >= 1")
    # what bench_e2e's training functions read beside the workload
    args.peak = args.peak_tflops * 1e12
    args.checkpoint_layers, args.profile, args.memory_peak, args.hf_checkpointing = 0, False, False, False
    return args


def main(argv=None) -> Report:
    args = parse_args(argv)
    started = time.perf_counter()
    # the fused elementwise groups compile per shape (dynamic=False) and every family brings its
    # own: keep torch.compile from falling back to eager for the later families of the run
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(getattr(dynamo, "recompile_limit", 8), 64)
    report = Report(args.device, args, out=args.out, file_name="families_bench.json", log=log,
                    describe=lambda r: f"{r.get('tokens_per_s', r.get('adapters', {}).get('step_ms', ''))}")
    for name in args.families:
        if args.deadline and time.perf_counter() - started > args.deadline:
            report["errors"][name] = f"skipped: past --deadline {args.deadline:g} s"
            report.save()
            continue
        log(f"{name}: {FAMILIES[name]['source']} at {args.layers} layers ({args.scale})")
        try:
            run_family(args, name, report, started)
        except Exception as exc:  # a family that cannot even be built: the others still run
            report["errors"][name] = f"{type(exc).__name__}: {exc}"
            report.save()
    for name in args.families:
        if name in report:
            print(family_table(name, report[name]))
    print(summary_table(report, args.families))
    for key, err in report["errors"].items():
        print(f"{key}: {err}")
    report.save()
    return report


if __name__ == "__main__":
    main()
