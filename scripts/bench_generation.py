"""Multi-adapter generation throughput: our engine vs HF transformers + PEFT on the same GPU.

A random-weight Llama of a real shape (``--shape 1b``: Llama-3.2-1B, ``8b``: Llama-3-8B) and
``--adapters`` random LoRA adapters of mixed ranks on all seven projections. ``--requests``
requests with random prompts of ``--prompt-min``..``--prompt-max`` tokens, each naming a random
adapter, generate ``--new-tokens`` tokens greedily (EOS ignored, so every request produces
exactly that many).

- ours: ``Engine.generate`` over all requests (continuous batching, unified pool), and over
  the first ``--hf-requests`` requests alone (the same work as the HF baseline);
- HF + PEFT: ``PeftModel.generate`` with every adapter loaded and ``adapter_names=`` per row
  (PEFT's mixed-adapter batch), left-padded batches of ``--hf-batch`` of those requests; and
  the same batches with adapters disabled (HF's base model, no LoRA) for reference.

``--graphs compare`` runs the engine phases twice, decode CUDA graphs on and then off (a new
engine over the same weights, the same requests; "eager_" rows), and each engine also times
``--step-batch`` requests' decode-only steps (``step_ms``: wall time per step; ``forward_ms``:
the step's forward, synchronised, the rest being host work: scheduling, sampling, events).

The engine runs with prefix caching off unless ``--prefix-caching``: the repeated runs send the
same prompts, which would otherwise hit the cache.

``--prefill-attention varlen,paged`` (``EngineConfig.prefill_attention``, a comma list) runs the
engine phases once per value, each in a new engine over the same weights ("varlen_" / "paged_"
rows). ``--prefill-reps N`` adds a ``prefill`` phase per engine: all requests with one new token
(each finishes in the step that prefills it), N times: wall time (the prefill steps and their
host work), prompt tokens/s and mean TTFT, min and median over the N.

``--base-precision bf16,fp8`` (a comma list) runs the engine phases once per base precision:
"fp8" serves the same weights quantized to e4m3 (``quantize_base_fp8``: the seven projections
per output channel, an untied embedding per row; "fp8_" rows), so decode reads half the
frozen bytes per step. On a CPU the FP8 products are emulated.

``--async-decode off,on`` (``EngineConfig.async_decode``, a comma list; default ``auto``) runs
the engine phases once per value ("async_off_" / "async_on_" rows): decode-only steps read
before the next is planned, or overlapped with the host (the next launched first).

``--mixed-graphs off,on`` (``EngineConfig.mixed_graphs``, a comma list; default ``auto``) runs
the engine phases once per value ("mixed_off_" / "mixed_on_" rows): steps with prefill rows
eager, or padded to token buckets and run as captured pieces around attention.

``--profile-steps N`` profiles N decode-only steps of the ``--step-batch`` requests, run eagerly
(the graphs bypassed, the same padded kernels), with adapters and on the base: device time per
step by kernel (``profile_adapters`` / ``profile_base``; on the CPU, host time by op).

Greedy agreement between ours and HF+PEFT on the first ``--check`` requests is reported as the
share of the first ``--check-tokens`` tokens that match and the mean length of the common
prefix (in bf16 two correct implementations drift apart once a near-tie flips).
``--fp32-check`` first runs a small fp32 model on the same device and requires ours to equal
HF + PEFT token for token.

    PYTHONPATH=. python3 scripts/bench_generation.py --shape 1b --out $OUT
    PYTHONPATH=. python3 scripts/bench_generation.py --shape tiny --device cpu --dtype float32 \
        --requests 6 --hf-requests 4 --new-tokens 4 --prompt-min 4 --prompt-max 12 --out /tmp/bg
    PYTHONPATH=. python3 scripts/bench_generation.py --shape tiny --device cpu --dtype float32 --skip-hf \
        --requests 8 --new-tokens 4 --prompt-min 4 --prompt-max 40 --prefill-attention varlen,paged \
        --prefill-reps 3 --out /tmp/bg
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from lightning_lorafusion.model.hf_loading import params_from_hf_model  # noqa: E402
from lightning_lorafusion.model.random_model import write_random_llama  # noqa: E402
from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from lightning_lorafusion.serving.config import PREFILL_ATTENTION  # noqa: E402
from lightning_lorafusion.specs import ALL_TARGET_MODULES  # noqa: E402

SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
               tie_word_embeddings=True, rope_theta=500000.0,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
               tie_word_embeddings=False, rope_theta=500000.0),
}


def log(msg: str) -> None:
    print(f"[bench_generation {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int, init_std: float | None = None):
    """A random HF LlamaForCausalLM on ``device`` and a word-level tokenizer of its vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok_dir = tempfile.mkdtemp(prefix="bench_gen_tok_")
    write_random_llama(tok_dir, vocab_size=shape["vocab_size"], hidden_size=8, intermediate_size=8, num_layers=1,
                       num_heads=1, num_kv_heads=1)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    config = LlamaConfig(**shape, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if init_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, init_std) if p.dim() > 1 else p.fill_(1.0)
    return model.eval(), tokenizer


def random_adapters(model_config, count: int, ranks: list[int], device, dtype, seed: int, b_std: float):
    """``count`` adapters: (name, rank, alpha, {(layer, module): (A [r, in], B [out, r])})."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for i in range(count):
        r = ranks[i % len(ranks)]
        factors = {}
        for layer in range(model_config.num_layers):
            for module in ALL_TARGET_MODULES:
                k, n = model_config.module_dims(module)
                a = (torch.randn(r, k, generator=g, device=device) / k ** 0.5).to(dtype)
                b = (torch.randn(n, r, generator=g, device=device) * b_std).to(dtype)
                factors[(layer, module)] = (a, b)
        out.append((f"adapter{i}", r, 2.0 * r, factors))
    return out


def attach_peft(model, adapters):
    """Wrap the HF model with PEFT holding every adapter (kept in the model's dtype)."""
    from peft import LoraConfig, get_peft_model

    def cfg(r, alpha):
        return LoraConfig(r=r, lora_alpha=alpha, target_modules=list(ALL_TARGET_MODULES), lora_dropout=0.0)

    name0, r0, alpha0, _ = adapters[0]
    peft_model = get_peft_model(model, cfg(r0, alpha0), adapter_name=name0, autocast_adapter_dtype=False)
    for name, r, alpha, _ in adapters[1:]:
        peft_model.add_adapter(name, cfg(r, alpha), autocast_adapter_dtype=False)
    by_name = {name: factors for name, _, _, factors in adapters}
    with torch.no_grad():
        for path, module in peft_model.named_modules():
            if not hasattr(module, "lora_A") or not hasattr(module, "base_layer"):
                continue
            parts = path.split(".")
            layer, proj = int(parts[parts.index("layers") + 1]), parts[-1]
            for name, factors in by_name.items():
                a, b = factors[(layer, proj)]
                module.lora_A[name].weight.copy_(a)
                module.lora_B[name].weight.copy_(b)
    return peft_model.eval()


def make_requests(n: int, vocab: int, lo: int, hi: int, adapters: list[str], new_tokens: int, seed: int,
                  adapter_weights: list[float] | None = None):
    """``n`` greedy requests (EOS ignored) with prompts of ``lo``..``hi`` random tokens, each naming an
    adapter drawn uniformly or, with ``adapter_weights``, in those proportions."""
    rng = random.Random(seed)
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def pick() -> str:
        return rng.choice(adapters) if adapter_weights is None else rng.choices(adapters, adapter_weights)[0]

    return [GenerationRequest(prompt_token_ids=[rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))],
                              adapter=pick(), sampling=sp, request_id=f"r{i}") for i in range(n)]


def timed_generate(engine: Engine, requests, device) -> tuple[list, float, dict, dict]:
    """Generate ``requests`` together -> (results, wall seconds, engine stats before, after)."""
    before = engine.stats()
    sync(device)
    t0 = time.perf_counter()
    results = engine.generate(requests)
    sync(device)
    return results, time.perf_counter() - t0, before, engine.stats()


def run_ours(engine: Engine, requests, device) -> dict:
    results, wall, before, after = timed_generate(engine, requests, device)
    tokens = sum(len(r.token_ids) for r in results)
    ttft = sorted(r.timings["ttft_s"] for r in results)
    return {"requests": len(requests), "generated_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in results),
            "ttft_mean_s": sum(ttft) / len(ttft), "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "steps": after["steps_total"] - before["steps_total"],
            "page_ins": after["adapter_page_ins_total"] - before["adapter_page_ins_total"],
            "preemptions": after["preemptions_total"] - before["preemptions_total"],
            "tokens": {r.request_id: list(r.token_ids) for r in results}}


def prefill_time(engine: Engine, requests, reps: int, device) -> dict:
    """``requests`` with one new token each (they finish in the step that prefills them), ``reps``
    times -> min / median wall, prompt tokens/s and mean TTFT."""
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    walls, ttfts, steps = [], [], []
    for i in range(reps):
        reqs = [GenerationRequest(prompt_token_ids=r.prompt_token_ids, adapter=r.adapter, sampling=one,
                                  request_id=f"f{i}{r.request_id}") for r in requests]
        out = run_ours(engine, reqs, device)
        walls.append(out["wall_s"])
        ttfts.append(out["ttft_mean_s"])
        steps.append(out["steps"])
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    walls, ttfts = sorted(walls), sorted(ttfts)
    return {"requests": len(requests), "prompt_tokens": prompt, "reps": reps, "steps": steps,
            "wall_s_min": walls[0], "wall_s_median": walls[len(walls) // 2],
            "prompt_tok_per_s_median": prompt / walls[len(walls) // 2],
            "ttft_mean_s_min": ttfts[0], "ttft_mean_s_median": ttfts[len(ttfts) // 2]}


def left_padded(requests) -> tuple[torch.Tensor, torch.Tensor]:
    """The requests' prompts left-padded with 0: input ids and attention mask ``[B, longest]``."""
    width = max(len(r.prompt_token_ids) for r in requests)
    ids = torch.zeros(len(requests), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for j, r in enumerate(requests):
        p = r.prompt_token_ids
        ids[j, width - len(p):] = torch.tensor(p)
        mask[j, width - len(p):] = 1
    return ids, mask


def run_hf(model, requests, batch: int, device, *, use_adapters: bool) -> dict:
    """Left-padded batches of ``batch`` requests through ``generate`` (greedy, EOS suppressed)."""
    tokens: dict[str, list[int]] = {}
    sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(requests), batch):
        chunk = requests[i:i + batch]
        ids, mask = left_padded(chunk)
        width = ids.shape[1]
        new = chunk[0].sampling.max_new_tokens
        kwargs = dict(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                      min_new_tokens=new, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            if use_adapters:
                out = model.generate(**kwargs, adapter_names=[r.adapter for r in chunk])
            elif hasattr(model, "disable_adapter"):  # a PeftModel: its base alone
                with model.disable_adapter():
                    out = model.generate(**kwargs)
            else:
                out = model.generate(**kwargs)
        for j, r in enumerate(chunk):
            tokens[r.request_id] = out[j, width:].tolist()
    sync(device)
    wall = time.perf_counter() - t0
    n = sum(len(t) for t in tokens.values())
    return {"requests": len(requests), "generated_tokens": n, "wall_s": wall, "tokens_per_s": n / wall,
            "tokens": tokens}


def build_workload(args, device, dtype):
    """The benchmark's random base (``args.shape``) and ``args.adapters`` random adapters of
    ``args.ranks``: (shape, HF model, tokenizer, DecoderConfig, params sharing the HF tensors,
    adapters)."""
    shape = SHAPES[args.shape]
    model, tokenizer = build_model(shape, device, dtype, seed=0)
    config, params = params_from_hf_model(model)  # shares the HF tensors (no copy)
    ranks = [int(r) for r in args.ranks.split(",")]
    adapters = random_adapters(config, args.adapters, ranks, device, dtype, seed=1, b_std=0.02)
    return shape, model, tokenizer, config, params, adapters


def step_time(engine: Engine, requests, steps: int, device) -> dict:
    """Admit ``requests`` (all prefilled), then time ``steps`` decode-only steps. With the
    overlapped decode the forward is not timed apart (``forward_ms`` None): synchronising it
    would undo the overlap."""
    ids = [engine.submit(r) for r in requests]
    while engine.stats()["waiting"]:
        engine.step()
    forward = None if engine._overlap else [0.0]
    if forward is not None:
        decode_logits = engine.runner.decode_logits

        def timed(decode, next_tokens=None):
            t = time.perf_counter()
            out = decode_logits(decode, next_tokens)
            sync(device)
            forward[0] += time.perf_counter() - t
            return out

        engine.runner.decode_logits = timed
    try:
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        wall = time.perf_counter() - t0
    finally:
        if forward is not None:
            del engine.runner.decode_logits  # back to the method
    running = engine.stats()["running"]
    for rid in ids:
        engine.abort(rid)
    while engine._has_work():  # the aborts, and a step still running under the overlap
        engine.step()
    return {"batch": len(requests), "running": running, "steps": steps, "step_ms": 1e3 * wall / steps,
            "forward_ms": None if forward is None else 1e3 * forward[0] / steps,
            "decode_tok_per_s": running * steps / wall, "steps_ahead": engine.stats()["decode_steps_ahead_total"]}


def _kernel_table(prof, steps: int, cuda: bool, top: int) -> dict:
    """Per-kernel (per-op on the CPU) self time of a profile, per step, largest first."""
    def self_time(evt) -> float:  # us; the attribute names moved between torch versions
        if cuda:
            return float(getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0))
        return float(evt.self_cpu_time_total)

    # on CUDA the kernels only (a CPU op's self device time repeats its kernels')
    events = [evt for evt in prof.key_averages() if not cuda or "CPU" not in str(evt.device_type)]
    rows = [(evt.key, evt.count, self_time(evt)) for evt in events]
    rows = sorted((r for r in rows if r[2] > 0), key=lambda r: -r[2])
    total = sum(r[2] for r in rows) / steps
    return {"steps": steps, "time_per_step_us": total, "kernels_per_step": sum(r[1] for r in rows) / steps,
            "top": [{"name": name[:90], "calls_per_step": count / steps, "us_per_step": t / steps,
                     "share": t / steps / total} for name, count, t in rows[:top]]}


def profile_steps(engine: Engine, requests, steps: int, device, top: int = 40) -> dict:
    """Admit ``requests`` (their prefill profiled: ``prefill``), then profile ``steps`` eager
    decode forwards of them (the same rows each time, graphs bypassed) -> per-kernel time per
    step, largest first."""
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    ids = [engine.submit(r) for r in requests]
    sync(device)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        prefill_steps = 0
        while engine.stats()["waiting"]:
            engine.step()
            prefill_steps += 1
        sync(device)
    prefill = {"wall_ms_profiled": 1e3 * (time.perf_counter() - t0), "engine_steps": prefill_steps,
               **_kernel_table(prof, 1, cuda, top)}
    decode = engine.scheduler.schedule().decode  # a decode-only step's rows, pages taken
    runner = engine.runner
    graphs, runner.graphs = runner.graphs, None
    try:
        with torch.no_grad():
            runner.decode_logits(decode)  # warm: tables loaded
            sync(device)
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(steps):
                    runner.decode_logits(decode)
                sync(device)
    finally:
        runner.graphs = graphs
    for rid in ids:
        engine.abort(rid)
    engine.step()
    return {"batch": len(decode), **_kernel_table(prof, steps, cuda, top), "prefill": prefill}


def agreement(ours: dict[str, list[int]], ref: dict[str, list[int]], ids: list[str], first: int) -> dict:
    same, prefix = 0, []
    for rid in ids:
        a, b = ours[rid][:first], ref[rid][:first]
        same += sum(x == y for x, y in zip(a, b))
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(k)
    return {"requests": len(ids), "first_tokens": first, "match_rate": same / (first * len(ids)),
            "mean_common_prefix": sum(prefix) / len(prefix), "exact": sum(p == first for p in prefix)}


def fp32_check(device: torch.device, args) -> dict:
    """Small fp32 model on the bench device: ours must equal HF + PEFT token for token."""
    shape = dict(SHAPES["tiny"], hidden_size=128, intermediate_size=256, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=1000)
    model, tokenizer = build_model(shape, device, torch.float32, seed=1, init_std=0.08)
    config, params = params_from_hf_model(model)
    adapters = random_adapters(config, 3, [4, 8, 16], device, torch.float32, seed=2, b_std=0.2)
    engine = Engine(config, params, tokenizer, EngineConfig(num_pages=512, page_size=16), device=device,
                    dtype=torch.float32)
    for name, r, alpha, factors in adapters:
        engine.add_adapter_weights(name, factors, rank=r, alpha=alpha)
    peft_model = attach_peft(model, adapters)
    reqs = make_requests(8, shape["vocab_size"], 5, 60, [a[0] for a in adapters], 12, seed=3)
    ours = run_ours(engine, reqs, device)["tokens"]
    ref = {}
    for r in reqs:  # one at a time: no padding in the reference
        ref.update(run_hf(peft_model, [r], 1, device, use_adapters=True)["tokens"])
    result = agreement(ours, ref, [r.request_id for r in reqs], 12)
    engine.close()
    del engine, peft_model, model
    gc.collect()
    return result


def _renamed(requests, prefix: str, *, adapter: str | None | bool = False):
    """Copies of ``requests`` with new ids (and, if ``adapter`` is not False, that adapter)."""
    return [GenerationRequest(prompt_token_ids=r.prompt_token_ids, sampling=r.sampling, request_id=prefix + r.request_id,
                              adapter=r.adapter if adapter is False else adapter) for r in requests]


def add_trace_args(ap: argparse.ArgumentParser, *, new_tokens: int) -> None:
    """Model shape, adapters and request lengths (shared with scripts/bench_server.py)."""
    ap.add_argument("--shape", choices=list(SHAPES), default="1b")
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--ranks", default="8,16,32,64")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-min", type=int, default=128)
    ap.add_argument("--prompt-max", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=new_tokens)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_args(ap, new_tokens=128)
    ap.add_argument("--hf-requests", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--check", type=int, default=16)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=16384)
    ap.add_argument("--memory-fraction", type=float, default=0.6)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--fp32-check", action="store_true")
    ap.add_argument("--skip-hf-mixed", action="store_true", help="no PEFT mixed-adapter baseline (slow at 8B)")
    ap.add_argument("--graphs", choices=("auto", "on", "off", "compare"), default="auto",
                    help="EngineConfig.cuda_graphs; compare = the engine phases with graphs on, then off")
    ap.add_argument("--step-batch", type=int, default=0, help="requests whose decode steps are timed (0: none)")
    ap.add_argument("--step-count", type=int, default=32)
    ap.add_argument("--profile-steps", type=int, default=0, help="profile this many eager decode steps (0: none)")
    ap.add_argument("--skip-hf", action="store_true", help="no HF baselines at all")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="EngineConfig.prefix_caching (off: the repeated runs send the same prompts again, "
                         "which would hit the cache and not measure the same work)")
    ap.add_argument("--prefill-attention", type=_choices(PREFILL_ATTENTION), default=["auto"],
                    help="EngineConfig.prefill_attention, a comma list: the engine phases once per value")
    ap.add_argument("--mixed-graphs", type=_choices(("auto", "on", "off", "eager")), default=["auto"],
                    help="EngineConfig.mixed_graphs (steps with prefill rows as CUDA graphs in pieces), a comma "
                         "list: the engine phases once per value (\"mixed_on_\" / \"mixed_off_\" rows)")
    ap.add_argument("--async-decode", type=_choices(("auto", "on", "off")), default=["auto"],
                    help="EngineConfig.async_decode (decode steps overlapped with the host), a comma list: the "
                         "engine phases once per value, in that order (\"async_on_\" / \"async_off_\" rows)")
    ap.add_argument("--base-precision", type=_choices(("bf16", "fp8", "fp8rq")), default=["bf16"],
                    help="the engine's frozen base: bf16 (as built), fp8 (quantized) and/or fp8rq (the same "
                         "FP8 base with row-quantized products only: no weight-only decode products), a comma list")
    ap.add_argument("--fp8-weight-only-rows", type=int, default=None,
                    help="fp8_linear.WEIGHT_ONLY_MAX_ROWS for fp8 engines (decode steps of at most this many rows "
                         "take weight-only products where fp8_linear.weight_only_wins; default: as set, 16)")
    ap.add_argument("--prefill-reps", type=int, default=0,
                    help="time a prefill-only pass (one new token per request) this many times (0: none)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    report: dict = {"args": vars(args), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                    "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "errors": {}}
    from lightning_lorafusion.kernels import fp8_linear

    module_weight_only_rows = fp8_linear.WEIGHT_ONLY_MAX_ROWS  # restored when the engines are done
    if args.fp8_weight_only_rows is not None:
        fp8_linear.WEIGHT_ONLY_MAX_ROWS = args.fp8_weight_only_rows
        report["fp8_weight_only_max_rows"] = args.fp8_weight_only_rows
    weight_only_rows = {"fp8": fp8_linear.WEIGHT_ONLY_MAX_ROWS, "fp8rq": 0}

    def save() -> None:
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            slim = {k: ({kk: vv for kk, vv in v.items() if kk != "tokens"} if isinstance(v, dict) else v)
                    for k, v in report.items()}
            with open(os.path.join(args.out, f"bench_generation_{args.shape}.json"), "w") as f:
                json.dump(slim, f, indent=1)

    def phase(name: str, fn) -> None:
        """Run one measurement; a failure is recorded and the others still run."""
        try:
            report[name] = fn()
            r = report[name]
            if isinstance(r, dict) and "tokens_per_s" in r:
                log(f"{name}: {r['requests']} requests, {r['generated_tokens']} tokens in {r['wall_s']:.2f}s = "
                    f"{r['tokens_per_s']:.0f} tok/s")
            else:
                log(f"{name}: {r}")
        except Exception as exc:  # keep going: one broken baseline must not lose the other numbers
            import traceback

            traceback.print_exc()
            report["errors"][name] = f"{type(exc).__name__}: {exc}"
        save()

    if args.fp32_check:
        phase("fp32_check", lambda: fp32_check(device, args))

    shape, model, tokenizer, config, params, adapters = build_workload(args, device, dtype)
    names = [a[0] for a in adapters]
    reqs = make_requests(args.requests, shape["vocab_size"], args.prompt_min, args.prompt_max, names,
                         args.new_tokens, seed=4)
    subset = reqs[:args.hf_requests]
    step_reqs = reqs[:min(args.step_batch, args.max_num_seqs)]
    modes = ("on", "off") if args.graphs == "compare" else (args.graphs,)
    # (cuda_graphs, prefill_attention, base precision, row prefix) per engine; an axis with one
    # value gets no label
    label = len(args.prefill_attention) > 1
    label_precision = len(args.base_precision) > 1
    label_mixed = len(args.mixed_graphs) > 1
    label_async = len(args.async_decode) > 1
    variants = [(graphs, pa, bp, (f"{bp}_" if label_precision else "") + ("eager_" if i else "")
                 + (f"{pa}_" if label else "") + (f"mixed_{mg}_" if label_mixed else "")
                 + (f"async_{ad}_" if label_async else ""), mg, ad)
                for bp in args.base_precision for pa in args.prefill_attention for mg in args.mixed_graphs
                for ad in args.async_decode for i, graphs in enumerate(modes)]
    prefixes = [v[3] for v in variants]
    base_params: dict = {"bf16": params}

    def params_of(precision: str):
        precision = "fp8" if precision == "fp8rq" else precision  # the same quantized base
        if precision not in base_params:  # quantized once, shared by that precision's engines
            from lightning_lorafusion.model.hf_loading import quantize_base_fp8

            base_params[precision] = quantize_base_fp8(params, embedding=not config.tie_word_embeddings)
        return base_params[precision]

    def engine_phases(graphs: str, prefill_attention: str, precision: str, prefix: str, mixed_graphs: str,
                      async_decode: str) -> None:
        t0 = time.perf_counter()
        if precision in weight_only_rows:  # decided where products are traced or captured: set per engine
            fp8_linear.WEIGHT_ONLY_MAX_ROWS = weight_only_rows[precision]
        engine = Engine(config, params_of(precision), tokenizer,
                        EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                                     gpu_memory_fraction=args.memory_fraction, backend=args.backend,
                                     cpu_pool_mib=1024, cuda_graphs=graphs, prefix_caching=args.prefix_caching,
                                     prefill_attention=prefill_attention, mixed_graphs=mixed_graphs,
                                     async_decode=async_decode),
                        device=device, dtype=dtype)
        report[prefix + "engine"] = {"cuda_graphs": engine.runner.graphs is not None, "base_precision": precision,
                                     "fp8_weight_only_max_rows": weight_only_rows.get(precision),
                                     "prefill_attention": engine.runner.prefill_attention,
                                     "mixed_graphs": engine.runner.mixed_pieces,
                                     "async_decode": engine._overlap,
                                     "build_s": time.perf_counter() - t0, "pool_pages": engine.pool.num_pages,
                                     "pool_gib": engine.pool.storage.numel() * engine.pool.storage.element_size()
                                     / 2**30}
        log(f"{prefix}engine: {report[prefix + 'engine']}")
        for name, r, alpha, factors in adapters:
            engine.add_adapter_weights(name, factors, rank=r, alpha=alpha)

        def warm_up():
            t0 = time.perf_counter()
            warm = make_requests(min(8, len(names)), shape["vocab_size"], args.prompt_min, args.prompt_min + 16,
                                 names, 4, seed=5)
            engine.generate(_renamed(warm, "w"))
            engine.generate(_renamed(warm, "wb", adapter=None))
            return {"seconds": time.perf_counter() - t0}

        def ours_all():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            out = run_ours(engine, reqs, device)
            if device.type == "cuda":
                out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            return out

        def ours_subset():
            out = run_ours(engine, _renamed(subset, "s"), device)
            out["tokens"] = {k[1:]: v for k, v in out["tokens"].items()}
            return out

        phase(prefix + "warm_up", warm_up)
        phase(prefix + "ours_all", ours_all)  # first pass: adapter page-ins, prefill compiles
        phase(prefix + "ours_all_again", lambda: run_ours(engine, _renamed(reqs, "a"), device))
        phase(prefix + "ours_all_base", lambda: run_ours(engine, _renamed(reqs, "b", adapter=None), device))
        if prefix == prefixes[0]:
            phase("ours_subset", ours_subset)
        if args.prefill_reps:
            phase(prefix + "prefill", lambda: prefill_time(engine, _renamed(reqs, "p"), args.prefill_reps, device))
        if step_reqs:
            steps = min(args.step_count, args.new_tokens // 2)
            phase(prefix + "step_adapters", lambda: step_time(engine, _renamed(step_reqs, "t"), steps, device))
            phase(prefix + "step_base", lambda: step_time(engine, _renamed(step_reqs, "tb", adapter=None), steps,
                                                          device))
        if step_reqs and args.profile_steps:
            phase(prefix + "profile_adapters", lambda: profile_steps(engine, _renamed(step_reqs, "p"),
                                                                     args.profile_steps, device))
            phase(prefix + "profile_base", lambda: profile_steps(engine, _renamed(step_reqs, "pb", adapter=None),
                                                                 args.profile_steps, device))
        engine.close()
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    try:
        for graphs, prefill_attention, precision, prefix, mixed_graphs, async_decode in variants:
            engine_phases(graphs, prefill_attention, precision, prefix, mixed_graphs, async_decode)
    finally:
        fp8_linear.WEIGHT_ONLY_MAX_ROWS = module_weight_only_rows
    base_params.pop("fp8", None)

    hf_model = model if args.skip_hf_mixed or args.skip_hf else attach_peft(model, adapters)
    if not args.skip_hf:
        phase("hf_warm_up", lambda: run_hf(hf_model, subset[:2], 2, device, use_adapters=False)["wall_s"])
        phase("hf_base", lambda: run_hf(hf_model, subset, args.hf_batch, device, use_adapters=False))
    if not (args.skip_hf_mixed or args.skip_hf):
        phase("hf_peft_mixed", lambda: run_hf(hf_model, subset, args.hf_batch, device, use_adapters=True))
    first = prefixes[0] + "ours_all"
    if "hf_peft_mixed" in report and first in report:
        ids = [r.request_id for r in subset[:args.check]]
        phase("agreement", lambda: agreement(report[first]["tokens"], report["hf_peft_mixed"]["tokens"], ids,
                                             min(args.check_tokens, args.new_tokens)))
    if (label or label_precision or label_async) and all(p + "ours_all" in report for p in prefixes):
        # every engine's greedy tokens against the first's
        phase("prefill_attention_agreement" if not (label_precision or label_async) else "engine_agreement", lambda: {
            p: agreement(report[p + "ours_all"]["tokens"], report[first]["tokens"], [r.request_id for r in reqs],
                         args.new_tokens) for p in prefixes[1:]})

    runs = [p + k for p in prefixes for k in ("ours_all", "ours_all_again", "ours_all_base")]
    rows = [(k, report[k]) for k in runs + ["ours_subset", "hf_base", "hf_peft_mixed"] if k in report]
    print(f"\n{'run':<22} {'requests':>8} {'gen tokens':>10} {'wall s':>8} {'tok/s':>9} {'steps':>6}")
    for name, r in rows:
        print(f"{name:<22} {r['requests']:>8} {r['generated_tokens']:>10} {r['wall_s']:>8.2f} "
              f"{r['tokens_per_s']:>9.0f} {r.get('steps', ''):>6}")
    for name in [p + k for p in prefixes for k in ("step_adapters", "step_base")]:
        if name in report:
            r = report[name]
            forward = "" if r["forward_ms"] is None else f", forward {r['forward_ms']:7.2f} ms"
            print(f"{name:<22} batch {r['running']:>4}: {r['step_ms']:7.2f} ms/step{forward}, "
                  f"{r['decode_tok_per_s']:>8.0f} tok/s")
    for name in [p + k for p in prefixes for k in ("profile_adapters", "profile_base")]:
        if name in report:
            r = report[name]
            print(f"\n{name}: batch {r['batch']}, {r['time_per_step_us'] / 1e3:.2f} ms of kernels per step, "
                  f"{r['kernels_per_step']:.0f} kernels per step")
            for k in r["top"][:25]:
                print(f"  {k['us_per_step']:9.1f} us {k['share']:6.1%} {k['calls_per_step']:6.0f}x  {k['name'][:70]}")
            pre = r["prefill"]
            print(f"  its prefill ({pre['engine_steps']} engine steps): {pre['time_per_step_us'] / 1e3:.1f} ms of kernels, "
                  f"{pre['wall_ms_profiled']:.1f} ms wall under the profiler")
            for k in pre["top"][:12]:
                print(f"  {k['us_per_step']:9.1f} us {k['share']:6.1%} {k['calls_per_step']:6.0f}x  {k['name'][:70]}")
    pre = [(p + "prefill", report[p + "prefill"]) for p in prefixes if p + "prefill" in report]
    if pre:
        print(f"\n{'prefill (1 new token)':<22} {'requests':>8} {'prompt tok':>10} {'wall s min':>10} {'median':>8} "
              f"{'prompt tok/s':>12} {'TTFT mean s':>11} {'steps':>6}")
        for name, r in pre:
            print(f"{name:<22} {r['requests']:>8} {r['prompt_tokens']:>10} {r['wall_s_min']:>10.4f} "
                  f"{r['wall_s_median']:>8.4f} {r['prompt_tok_per_s_median']:>12.0f} {r['ttft_mean_s_median']:>11.4f} "
                  f"{max(r['steps']):>6}")
    if report["errors"]:
        print("errors:", report["errors"])
    return report


def _choices(allowed):
    """argparse type: a comma list of ``allowed`` values."""
    def parse(text: str) -> list[str]:
        values = [v for v in text.split(",") if v]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: a comma list of {', '.join(allowed)}")
        return values
    return parse


if __name__ == "__main__":
    main()
