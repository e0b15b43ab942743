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
the same rows' decode forward alone, synchronised, the rest of a step being host work:
scheduling, sampling, events; not timed apart under the overlapped decode).

The engine runs with prefix caching off unless ``--prefix-caching``: the repeated runs send the
same prompts, which would otherwise hit the cache.

``--prefill-attention varlen,paged`` (``EngineTuning.prefill_attention``, a comma list) runs the
engine phases once per value, each in a new engine over the same weights ("varlen_" / "paged_"
rows). ``--prefill-reps N`` adds a ``prefill`` phase per engine: all requests with one new token
(each finishes in the step that prefills it), N times: wall time (the prefill steps and their
host work), prompt tokens/s and mean TTFT, min and median over the N.

``--base-precision bf16,fp8`` (a comma list) runs the engine phases once per base precision:
"fp8" serves the same weights quantized to e4m3 (``quantize_base_fp8``: the seven projections
per output channel, an untied embedding per row; "fp8_" rows), so decode reads half the
frozen bytes per step. On a CPU the FP8 products are emulated.

``--async-decode off,on`` (``EngineTuning.async_decode``, a comma list; default ``auto``) runs
the engine phases once per value ("async_off_" / "async_on_" rows): decode-only steps read
before the next is planned, or overlapped with the host (the next launched first).

``--mixed-graphs off,on`` (``EngineTuning.mixed_graphs``, a comma list; default ``auto``) runs
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
import random
import tempfile

from harness import Report, add_device_args, add_output_args, comma_list, dtype_of, logger, sync, timer

import torch  # noqa: E402

from lightning_lorafusion.model.hf_loading import params_from_hf_model, quantize_base_fp8  # noqa: E402
from lightning_lorafusion.model.random_model import write_random_llama  # noqa: E402
from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from lightning_lorafusion.serving.config import PREFILL_ATTENTION, EngineTuning  # noqa: E402

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


log = logger("bench_generation")


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
    """``count`` adapters on every projection of the family (Phi-3's fused ``qkv_proj`` /
    ``gate_up_proj`` as they are): (name, rank, alpha, {(layer, module): (A [r, in], B [out, r])})."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for i in range(count):
        r = ranks[i % len(ranks)]
        factors = {}
        for layer in range(model_config.num_layers):
            for module in model_config.family.projections:
                k, n = model_config.module_dims(module)
                a = (torch.randn(r, k, generator=g, device=device) / k ** 0.5).to(dtype)
                b = (torch.randn(n, r, generator=g, device=device) * b_std).to(dtype)
                factors[(layer, module)] = (a, b)
        out.append((f"adapter{i}", r, 2.0 * r, factors))
    return out


def attach_peft(model, adapters):
    """Wrap the HF model with PEFT holding every adapter (kept in the model's dtype), on the
    projections the adapters' factors name (the family's, fused ones included)."""
    from peft import LoraConfig, get_peft_model

    targets = list(dict.fromkeys(module for _, module in adapters[0][3]))

    def cfg(r, alpha):
        return LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)

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
    with timer(device) as t:
        results = engine.generate(requests)
    return results, t.seconds, before, engine.stats()


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
    with timer(device) as t:
        for i in range(0, len(requests), batch):
            tokens.update(_hf_batch(model, requests[i:i + batch], device, use_adapters))
    n = sum(len(t) for t in tokens.values())
    return {"requests": len(requests), "generated_tokens": n, "wall_s": t.seconds, "tokens_per_s": n / t.seconds,
            "tokens": tokens}


def _hf_batch(model, chunk, device, use_adapters: bool) -> dict[str, list[int]]:
    """One left-padded batch through ``generate`` -> each request's new tokens."""
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
    return {r.request_id: out[j, width:].tolist() for j, r in enumerate(chunk)}


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


def _admit(engine: Engine) -> int:
    """Step until no request waits (every submitted prompt prefilled) -> the steps it took."""
    steps = 0
    while engine.stats()["waiting"]:
        engine.step()
        steps += 1
    return steps


def _drain(engine: Engine, ids: list[str]) -> None:
    """Abort ``ids`` and step until the engine is idle (a step still running under the overlap)."""
    for rid in ids:
        engine.abort(rid)
    while engine.has_work():
        engine.step()


def step_time(engine: Engine, requests, steps: int, device) -> dict:
    """Admit ``requests`` (all prefilled), then time ``steps`` decode-only steps (``step_ms``).
    Without the overlapped decode, ``forward_ms`` is the same rows' decode forward alone,
    synchronised (the rest of a step is host work: scheduling, sampling, events); with it the
    forward is not timed apart (None): synchronising it would undo the overlap."""
    ids = [engine.submit(r) for r in requests]
    _admit(engine)
    with timer(device) as t:
        for _ in range(steps):
            engine.step()
    running = engine.stats()["running"]
    forward_ms = None if engine.async_decode else _forward_ms(engine, steps, device)
    _drain(engine, ids)
    return {"batch": len(requests), "running": running, "steps": steps, "step_ms": 1e3 * t.seconds / steps,
            "forward_ms": forward_ms, "decode_tok_per_s": running * steps / t.seconds,
            "steps_ahead": engine.stats()["decode_steps_ahead_total"]}


def _forward_ms(engine: Engine, steps: int, device) -> float:
    """Mean ms of the runner's decode forward over the running rows (as a step runs it)."""
    decode = engine.scheduler.schedule().decode
    with torch.no_grad(), timer(device) as t:
        for _ in range(steps):
            engine.runner.decode_logits(decode)
    return 1e3 * t.seconds / steps


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
    with timer(device) as t, torch.profiler.profile(activities=activities) as prof:
        prefill_steps = _admit(engine)
        sync(device)
    prefill = {"wall_ms_profiled": 1e3 * t.seconds, "engine_steps": prefill_steps,
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
    _drain(engine, ids)
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


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_args(ap, new_tokens=128)
    add_device_args(ap)
    add_output_args(ap)
    ap.add_argument("--hf-requests", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--check", type=int, default=16)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=16384)
    ap.add_argument("--memory-fraction", type=float, default=0.6)
    ap.add_argument("--backend", default="auto")
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
    ap.add_argument("--prefill-attention", type=comma_list(PREFILL_ATTENTION), default=["auto"],
                    help="EngineTuning.prefill_attention, a comma list: the engine phases once per value")
    ap.add_argument("--mixed-graphs", type=comma_list(("auto", "on", "off", "eager")), default=["auto"],
                    help="EngineTuning.mixed_graphs (steps with prefill rows as CUDA graphs in pieces), a comma "
                         "list: the engine phases once per value (\"mixed_on_\" / \"mixed_off_\" rows)")
    ap.add_argument("--async-decode", type=comma_list(("auto", "on", "off")), default=["auto"],
                    help="EngineTuning.async_decode (decode steps overlapped with the host), a comma list: the "
                         "engine phases once per value, in that order (\"async_on_\" / \"async_off_\" rows)")
    ap.add_argument("--base-precision", type=comma_list(("bf16", "fp8")), default=["bf16"],
                    help="the engine's frozen base: bf16 (as built) and/or fp8 (quantized), a comma list")
    ap.add_argument("--prefill-reps", type=int, default=0,
                    help="time a prefill-only pass (one new token per request) this many times (0: none)")
    return ap.parse_args(argv)


def engine_variants(args) -> list[dict]:
    """One engine per combination of the comma-list options; its row prefix names the values of
    the axes given more than one value ("eager_" for the graphs-off half of ``--graphs compare``)."""
    modes = ("on", "off") if args.graphs == "compare" else (args.graphs,)
    labelled = {axis: len(getattr(args, axis)) > 1
                for axis in ("base_precision", "prefill_attention", "mixed_graphs", "async_decode")}
    variants = []
    for bp in args.base_precision:
        for pa in args.prefill_attention:
            for mg in args.mixed_graphs:
                for ad in args.async_decode:
                    for i, graphs in enumerate(modes):
                        prefix = ((f"{bp}_" if labelled["base_precision"] else "") + ("eager_" if i else "")
                                  + (f"{pa}_" if labelled["prefill_attention"] else "")
                                  + (f"mixed_{mg}_" if labelled["mixed_graphs"] else "")
                                  + (f"async_{ad}_" if labelled["async_decode"] else ""))
                        variants.append(dict(prefix=prefix, precision=bp, cuda_graphs=graphs, prefill_attention=pa,
                                             mixed_graphs=mg, async_decode=ad))
    return variants


def describe(r) -> str:
    if isinstance(r, dict) and "tokens_per_s" in r:
        return (f"{r['requests']} requests, {r['generated_tokens']} tokens in {r['wall_s']:.2f}s = "
                f"{r['tokens_per_s']:.0f} tok/s")
    return str(r)


def _slim(report: dict) -> dict:
    """The report without the generated tokens (kept in memory for the agreement checks)."""
    return {k: ({kk: vv for kk, vv in v.items() if kk != "tokens"} if isinstance(v, dict) else v)
            for k, v in report.items()}


class Bench:
    """The workload (random base, adapters, requests) and the report the phases fill."""

    def __init__(self, args, report: Report):
        self.args, self.report = args, report
        self.device, self.dtype = torch.device(args.device), dtype_of(args.dtype)
        self.shape, self.model, self.tokenizer, self.config, self.params, self.adapters = build_workload(
            args, self.device, self.dtype)
        self.names = [a[0] for a in self.adapters]
        self.reqs = make_requests(args.requests, self.shape["vocab_size"], args.prompt_min, args.prompt_max,
                                  self.names, args.new_tokens, seed=4)
        self.subset = self.reqs[:args.hf_requests]
        self.step_reqs = self.reqs[:min(args.step_batch, args.max_num_seqs)]
        self.base_params = {"bf16": self.params}

    def params_of(self, precision: str):
        if precision not in self.base_params:  # quantized once, shared by that precision's engines
            self.base_params[precision] = quantize_base_fp8(self.params,
                                                            embedding=not self.config.tie_word_embeddings)
        return self.base_params[precision]

    def build_engine(self, v: dict) -> Engine:
        args = self.args
        with timer() as t:
            engine = Engine(self.config, self.params_of(v["precision"]), self.tokenizer,
                            EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                                         gpu_memory_fraction=args.memory_fraction, backend=args.backend,
                                         cpu_pool_mib=1024, cuda_graphs=v["cuda_graphs"],
                                         prefix_caching=args.prefix_caching,
                                         tuning=EngineTuning(prefill_attention=v["prefill_attention"],
                                                             mixed_graphs=v["mixed_graphs"],
                                                             async_decode=v["async_decode"])),
                            device=self.device, dtype=self.dtype)
        pool = engine.pool
        self.report[v["prefix"] + "engine"] = {
            "cuda_graphs": engine.runner.graphs is not None, "base_precision": v["precision"],
            "prefill_attention": engine.runner.prefill_attention, "mixed_graphs": engine.runner.mixed_pieces,
            "async_decode": engine.async_decode, "build_s": t.seconds, "pool_pages": pool.num_pages,
            "pool_gib": pool.storage.numel() * pool.storage.element_size() / 2**30}
        log(f"{v['prefix']}engine: {self.report[v['prefix'] + 'engine']}")
        for name, r, alpha, factors in self.adapters:
            engine.add_adapter_weights(name, factors, rank=r, alpha=alpha)
        return engine

    def warm_up(self, engine: Engine) -> dict:
        with timer(self.device) as t:
            warm = make_requests(min(8, len(self.names)), self.shape["vocab_size"], self.args.prompt_min,
                                 self.args.prompt_min + 16, self.names, 4, seed=5)
            engine.generate(_renamed(warm, "w"))
            engine.generate(_renamed(warm, "wb", adapter=None))
        return {"seconds": t.seconds}

    def ours_all(self, engine: Engine) -> dict:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        out = run_ours(engine, self.reqs, self.device)
        if self.device.type == "cuda":
            out["peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out

    def ours_subset(self, engine: Engine) -> dict:
        out = run_ours(engine, _renamed(self.subset, "s"), self.device)
        out["tokens"] = {k[1:]: v for k, v in out["tokens"].items()}
        return out

    def engine_phases(self, v: dict, first: bool) -> None:
        """Every engine measurement of one variant, in a fresh engine over the same weights."""
        args, device, measure, prefix = self.args, self.device, self.report.measure, v["prefix"]
        engine = self.build_engine(v)
        measure(prefix + "warm_up", lambda: self.warm_up(engine))
        measure(prefix + "ours_all", lambda: self.ours_all(engine))  # first pass: adapter page-ins, compiles
        measure(prefix + "ours_all_again", lambda: run_ours(engine, _renamed(self.reqs, "a"), device))
        measure(prefix + "ours_all_base", lambda: run_ours(engine, _renamed(self.reqs, "b", adapter=None), device))
        if first:
            measure("ours_subset", lambda: self.ours_subset(engine))
        if args.prefill_reps:
            measure(prefix + "prefill", lambda: prefill_time(engine, _renamed(self.reqs, "p"), args.prefill_reps,
                                                             device))
        if self.step_reqs:
            steps = min(args.step_count, args.new_tokens // 2)
            for kind, tag, adapter in (("adapters", "t", False), ("base", "tb", None)):
                measure(f"{prefix}step_{kind}",
                        lambda: step_time(engine, _renamed(self.step_reqs, tag, adapter=adapter), steps, device))
            if args.profile_steps:
                for kind, tag, adapter in (("adapters", "p", False), ("base", "pb", None)):
                    measure(f"{prefix}profile_{kind}", lambda: profile_steps(
                        engine, _renamed(self.step_reqs, tag, adapter=adapter), args.profile_steps, device))
        engine.close()
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def hf_phases(self) -> None:
        args, measure, device = self.args, self.report.measure, self.device
        self.base_params.pop("fp8", None)
        if args.skip_hf:
            return
        hf_model = self.model if args.skip_hf_mixed else attach_peft(self.model, self.adapters)
        measure("hf_warm_up", lambda: run_hf(hf_model, self.subset[:2], 2, device, use_adapters=False)["wall_s"])
        measure("hf_base", lambda: run_hf(hf_model, self.subset, args.hf_batch, device, use_adapters=False))
        if not args.skip_hf_mixed:
            measure("hf_peft_mixed", lambda: run_hf(hf_model, self.subset, args.hf_batch, device, use_adapters=True))

    def agreement_phases(self, prefixes: list[str]) -> None:
        """Ours against HF + PEFT on the first requests; every engine variant against the first."""
        args, report = self.args, self.report
        first = prefixes[0] + "ours_all"
        if "hf_peft_mixed" in report and first in report:
            ids = [r.request_id for r in self.subset[:args.check]]
            report.measure("agreement", lambda: agreement(report[first]["tokens"], report["hf_peft_mixed"]["tokens"],
                                                          ids, min(args.check_tokens, args.new_tokens)))
        several = [a for a in ("prefill_attention", "base_precision", "async_decode") if len(getattr(args, a)) > 1]
        if several and all(p + "ours_all" in report for p in prefixes):
            name = "prefill_attention_agreement" if several == ["prefill_attention"] else "engine_agreement"
            ids = [r.request_id for r in self.reqs]
            report.measure(name, lambda: {p: agreement(report[p + "ours_all"]["tokens"], report[first]["tokens"], ids,
                                                       args.new_tokens) for p in prefixes[1:]})


def print_summary(report: dict, prefixes: list[str]) -> None:
    runs = [p + k for p in prefixes for k in ("ours_all", "ours_all_again", "ours_all_base")]
    print(f"\n{'run':<22} {'requests':>8} {'gen tokens':>10} {'wall s':>8} {'tok/s':>9} {'steps':>6}")
    for name in runs + ["ours_subset", "hf_base", "hf_peft_mixed"]:
        if name in report:
            r = report[name]
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
            print_profile(name, report[name])
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


def print_profile(name: str, r: dict) -> None:
    print(f"\n{name}: batch {r['batch']}, {r['time_per_step_us'] / 1e3:.2f} ms of kernels per step, "
          f"{r['kernels_per_step']:.0f} kernels per step")
    for k in r["top"][:25]:
        print(f"  {k['us_per_step']:9.1f} us {k['share']:6.1%} {k['calls_per_step']:6.0f}x  {k['name'][:70]}")
    pre = r["prefill"]
    print(f"  its prefill ({pre['engine_steps']} engine steps): {pre['time_per_step_us'] / 1e3:.1f} ms of kernels, "
          f"{pre['wall_ms_profiled']:.1f} ms wall under the profiler")
    for k in pre["top"][:12]:
        print(f"  {k['us_per_step']:9.1f} us {k['share']:6.1%} {k['calls_per_step']:6.0f}x  {k['name'][:70]}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = Report(args.device, args, out=args.out, file_name=f"bench_generation_{args.shape}.json",
                    log=log, slim=_slim, describe=describe)
    if args.fp32_check:
        report.measure("fp32_check", lambda: fp32_check(torch.device(args.device), args))
    bench = Bench(args, report)
    variants = engine_variants(args)
    for i, v in enumerate(variants):
        bench.engine_phases(v, first=i == 0)
    bench.hf_phases()
    prefixes = [v["prefix"] for v in variants]
    bench.agreement_phases(prefixes)
    print_summary(report, prefixes)
    return report


if __name__ == "__main__":
    main()
