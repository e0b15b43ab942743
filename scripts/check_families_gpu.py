"""Does every decoder family train and serve like transformers + PEFT at a moderate size, in bf16?

Per family (random weights at ``--hidden`` x ``--layers``, built by transformers from the
family's config, so each family piece is live: soft-caps, windows shorter than the prompts,
local and global RoPE bases), with ``--adapters`` PEFT adapters of different ranks and targets:

- serving, teacher-forced: the engine's log-probability of every token of each request's
  prompt + the tokens it generated (``prompt_logprobs``, a heterogeneous batch of the base and
  every adapter, adapters loaded from their PEFT directories) against HF + PEFT's log-softmax
  at the same positions, each sequence alone: the mean and the largest absolute difference;
- serving, free-running: ``Engine.generate`` greedy tokens of the same batch (prefix caching
  and chunked prefill on) against HF + PEFT ``generate`` on each prompt alone: the fraction of
  generated tokens before the first disagreement, and how many requests agree to the end;
- training: each adapter's mean loss over its samples packed in one microbatch (our forward,
  adapters imported from the same PEFT directories) against HF + PEFT's on each sample alone.

Pass/fail rests on the losses (``--loss-rtol``) and the teacher-forced log-probabilities: both
compare the two models on the same tokens, so they stay meaningful on random weights. The
log-prob bar is calibrated by HF's own rounding: with a 16-bit ``--dtype`` the same tokens are
also scored by an fp32 copy of the HF + PEFT model, and a family passes when the engine's mean
absolute distance to that fp32 reference is at most ``--logprob-rel`` times HF's own 16-bit
distance to it (how far a correct bf16 implementation lands), or when its distance to HF's 16-bit
log-probs is within ``--logprob-atol`` (the bar in fp32, where HF's own distance is 0). The greedy columns are reported
but do not decide: random weights give near-flat logits whose argmax is a near-tie that bf16
rounding flips, so correct implementations part early (docs/BENCHMARKS.md, "Model families");
the exact greedy equality is shown in fp32 (``--dtype float32``, tests/serving). Prints a
table; JSON to ``--out``. Example (GPU)::

    python scripts/check_families_gpu.py --out results/families_gpu
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import tempfile
from pathlib import Path

from harness import Report, add_device_args, add_output_args, comma_list, dtype_of, logger

import torch  # noqa: E402  (after harness, which puts the repository on sys.path)
import torch.nn.functional as F  # noqa: E402

from lightning_lorafusion.model import decoder as D  # noqa: E402
from lightning_lorafusion.model.adapter_bank import AdapterBank  # noqa: E402
from lightning_lorafusion.model.hf_loading import params_from_hf_model  # noqa: E402
from lightning_lorafusion.model.peft_io import import_peft_adapter  # noqa: E402
from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from lightning_lorafusion.specs import IGNORE_INDEX, AdapterSpec  # noqa: E402

log = logger("families")
FAMILIES = ("llama", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2")
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGETS = (ALL, ("q_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj"))
# Pass bar on the mean |difference| of the token log-probs, nats. bf16 keeps 8 mantissa bits, so
# logits of unit scale differ by ~1e-2 between two correct implementations; a wrong piece moves
# them by tenths (tiny fp32 shapes, tests/scripts/test_check_families_gpu.py: norms multiplied by
# 1 + w instead of w 0.4-0.7, Gemma 2 without its soft-caps 1.4).
LOGPROB_ATOL = 0.05
# ... or, calibrated: the engine at most this many times as far from HF in fp32 as HF's own
# 16-bit forward is (bf16 rounding moves some families' log-probs more than others': Gemma 3's
# q/k norms and 262k-scale embeddings)
LOGPROB_REL = 1.5
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}


def family_config(family: str, a: argparse.Namespace):
    """A transformers config of ``family`` at the chosen size, every family feature live."""
    from transformers import AutoConfig

    head_dim = a.hidden // a.heads
    window = max(2, a.prompt_len // 2)
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(a.layers)]
    common = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                  num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False, head_dim=head_dim,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    extra = {
        "llama": {}, "qwen3": {}, "olmo2": {},
        "phi3": dict(sliding_window=window),
        # soft-caps near the logits' unit scale, so that they bite (Gemma 2's own 50 / 30 barely do here)
        "gemma2": dict(query_pre_attn_scalar=head_dim * 2, sliding_window=window, layer_types=layer_types,
                       attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=True),
        "gemma3_text": dict(query_pre_attn_scalar=head_dim * 2, sliding_window=window, layer_types=layer_types,
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
                            tie_word_embeddings=True),
    }[family]
    return AutoConfig.for_model(family, **{**common, **extra})


def build(family: str, a: argparse.Namespace, dtype: torch.dtype, device: str):
    """The HF model (random weights of unit-scale activations) in ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_config(family_config(family, a), attn_implementation="eager",
                                             dtype=torch.float32)
    g = torch.Generator().manual_seed(a.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else noise / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = None  # both sides generate max_new tokens, EOS unmasked
    return model.to(device=device, dtype=dtype).eval()


def write_adapters(model, root: Path, a: argparse.Namespace) -> dict[str, tuple[str, AdapterSpec]]:
    """``--adapters`` PEFT directories (random factors, B non-zero) -> name -> (dir, our spec)."""
    from peft import LoraConfig, get_peft_model

    fused = any(n.endswith("qkv_proj") for n, _ in model.named_modules())
    out = {}
    for i in range(a.adapters):
        rank, targets = (8, 16, 32, 64)[i % 4], TARGETS[i % len(TARGETS)]
        if fused:
            targets = tuple(dict.fromkeys(FUSED.get(m, m) for m in targets))
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2.0 * rank, lora_dropout=0.0,
                                                      target_modules=list(targets)))
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_" in n:
                    p.copy_((torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 * 0.5).to(p.dtype))
        name = f"a{i}_r{rank}"
        peft_model.save_pretrained(root / name)
        model = peft_model.unload()
        out[name] = (str(root / name), AdapterSpec(name=name, rank=rank, alpha=2.0 * rank, target_modules=targets))
    return out


def check_serving(model, config, params, adapters, prompts, a, dtype, device) -> dict:
    """Engine greedy tokens vs HF + PEFT ``generate`` per request, and both models' log-probs of
    the same tokens (each prompt + the engine's greedy continuation), teacher-forced."""
    from peft import PeftModel

    names = [None, *adapters]
    cases = [(p, names[i % len(names)]) for i, p in enumerate(prompts)]
    engine = Engine(config, params, None, EngineConfig(page_size=16, max_num_seqs=len(cases),
                                                       prefix_caching=True, enable_chunked_prefill=True,
                                                       max_num_batched_tokens=max(256, len(cases))),
                    eos_token_ids=(), device=device, dtype=dtype)
    try:
        for name, (path, _) in adapters.items():
            engine.add_adapter(name, path)
        sp = SamplingParams(max_new_tokens=a.max_new, temperature=0.0, ignore_eos=True)
        got = [list(r.token_ids) for r in engine.generate(
            [GenerationRequest(prompt_token_ids=p, adapter=n, sampling=sp) for p, n in cases])]
        scored = [(p + ours, n) for (p, n), ours in zip(cases, got)]
        score = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
        engine_lp = [list(r.prompt_logprobs[1:]) for r in engine.generate(
            [GenerationRequest(prompt_token_ids=ids, adapter=n, sampling=score) for ids, n in scored])]
    finally:
        engine.close()
    ref = PeftModel.from_pretrained(model, adapters[names[1]][0], adapter_name=names[1])
    for name in names[2:]:
        ref.load_adapter(adapters[name][0], adapter_name=name)
    ref32 = copy.deepcopy(ref).float() if dtype != torch.float32 else None
    match, exact, diffs, ours32, hf32 = [], 0, [], [], []
    with torch.no_grad():
        for (prompt, name), ours, (seq, _), lp in zip(cases, got, scored, engine_lp):
            with _reference_adapter(ref, name):
                ids = torch.tensor([prompt], device=device)
                expected = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=a.max_new, pad_token_id=0)[0, len(prompt):].tolist()
                hf = _hf_logprobs(ref, seq, device)
                diffs += (torch.tensor(lp) - hf).abs().tolist()
            if ref32 is not None:
                with _reference_adapter(ref32, name):
                    exact32 = _hf_logprobs(ref32, seq, device)
                ours32 += (torch.tensor(lp) - exact32).abs().tolist()
                hf32 += (hf - exact32).abs().tolist()
            same = next((i for i, (x, y) in enumerate(zip(ours, expected)) if x != y), len(expected))
            match.append(same / len(expected))
            exact += ours == expected
    ref.unload()
    return {"token_match": sum(match) / len(match), "exact_requests": exact, "requests": len(cases),
            "logprob_mean_abs_diff": _mean(diffs), "logprob_max_abs_diff": max(diffs),
            "logprob_tokens": len(diffs), "logprob_ours_vs_fp32": _mean(ours32), "logprob_hf_vs_fp32": _mean(hf32)}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def logprob_ok(result: dict, atol: float, rel: float) -> bool:
    """The log-prob bar (module docstring): within ``atol`` of HF at the same dtype, or (16-bit)
    at most ``rel`` times as far from HF's fp32 log-probs as HF's own forward at that dtype."""
    if result["logprob_mean_abs_diff"] <= atol:
        return True
    ours, hf = result.get("logprob_ours_vs_fp32"), result.get("logprob_hf_vs_fp32")
    return ours is not None and hf is not None and ours <= rel * hf


@contextlib.contextmanager
def _reference_adapter(ref, name: str | None):
    """The HF + PEFT model with adapter ``name`` active (None: the base, adapters disabled)."""
    if name is None:
        with ref.disable_adapter():
            yield
    else:
        ref.set_adapter(name)
        yield


def _hf_logprobs(ref, seq: list[int], device) -> torch.Tensor:
    """HF's log-probability of each token of ``seq`` after the first, given the ones before it."""
    x = torch.tensor([seq], device=device)
    logp = torch.log_softmax(ref(input_ids=x).logits[0, :-1].float(), dim=-1)
    return logp.gather(1, x[0, 1:, None]).squeeze(1).cpu()


def check_training(model, config, params, adapters, prompts, device, backend) -> dict:
    """Each adapter's mean loss over its samples (packed together) vs HF + PEFT's."""
    from peft import PeftModel

    specs = [spec for _, spec in adapters.values()]
    bank = AdapterBank(specs, config, device=device, dtype=params["norm"].dtype)
    for i, (path, _) in enumerate(adapters.values()):
        import_peft_adapter(bank, i, path)
    owners = [i % len(specs) for i in range(len(prompts))]
    order = sorted(range(len(prompts)), key=lambda i: owners[i])  # contiguous per adapter
    samples = [torch.tensor(prompts[i], device=device) for i in order]
    ids = torch.cat(samples)
    lens = [len(s) for s in samples]
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], device=device, dtype=torch.int32)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    labels = torch.cat([torch.cat([s[1:], torch.tensor([IGNORE_INDEX], device=device)]) for s in samples])
    bounds = cu.tolist()
    segments = []
    for a_i in range(len(specs)):
        rows = [j for j, i in enumerate(order) if owners[i] == a_i]
        segments.append((bounds[rows[0]], bounds[rows[-1] + 1], a_i))
    routing = bank.routing(segments, microbatch_index=0, num_rows=len(ids), train=False)
    with torch.no_grad():
        sums = D.forward_loss_sums(params, bank.view(), ids, labels, positions, cu, routing, config=config,
                                   backend=backend)
    counts = [sum(len(prompts[i]) - 1 for i in range(len(prompts)) if owners[i] == a_i) for a_i in range(len(specs))]
    ours = (sums / torch.tensor(counts, device=device)).tolist()
    paths = [p for p, _ in adapters.values()]
    ref = PeftModel.from_pretrained(model, paths[0], adapter_name="0")
    theirs = []
    with torch.no_grad():
        for a_i in range(len(specs)):
            if a_i:
                ref.load_adapter(paths[a_i], adapter_name=str(a_i))
            ref.set_adapter(str(a_i))
            total = 0.0
            for i in range(len(prompts)):
                if owners[i] == a_i:
                    x = torch.tensor([prompts[i]], device=device)
                    logits = ref(input_ids=x).logits[0, :-1].float()
                    total += F.cross_entropy(logits, x[0, 1:], reduction="sum").item()
            theirs.append(total / counts[a_i])
    ref.unload()
    rel = max(abs(o - t) / abs(t) for o, t in zip(ours, theirs))
    return {"loss_ours": ours, "loss_hf": theirs, "loss_max_rel_diff": rel}


def check_family(family: str, a: argparse.Namespace, dtype: torch.dtype) -> dict:
    model = build(family, a, dtype, a.device)
    config, params = params_from_hf_model(model)
    g = torch.Generator().manual_seed(a.seed + 1)
    prompts = [torch.randint(3, a.vocab, (a.prompt_len - 3 * (i % 4),), generator=g).tolist()
               for i in range(a.prompts)]
    backend = "triton" if torch.device(a.device).type == "cuda" else "torch"
    with tempfile.TemporaryDirectory() as root:
        adapters = write_adapters(model, Path(root), a)
        result = {"family": family}
        result.update(check_serving(model, config, params, adapters, prompts, a, dtype, a.device))
        result.update(check_training(model, config, params, adapters, prompts, a.device, backend))
    result["ok"] = result["loss_max_rel_diff"] <= a.loss_rtol and logprob_ok(result, a.logprob_atol, a.logprob_rel)
    return result


def main(argv=None) -> Report:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", type=comma_list(FAMILIES), default=list(FAMILIES))
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--adapters", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--loss-rtol", type=float, default=0.02, help="pass bar: max relative loss difference")
    ap.add_argument("--logprob-atol", type=float, default=LOGPROB_ATOL,
                    help="pass bar: mean absolute difference of the teacher-forced token log-probs (nats)")
    ap.add_argument("--logprob-rel", type=float, default=LOGPROB_REL,
                    help="or: the engine's mean distance to HF's fp32 log-probs at most this times HF's own (16-bit)")
    ap.add_argument("--seed", type=int, default=0)
    add_device_args(ap)
    add_output_args(ap)
    a = ap.parse_args(argv)
    if a.adapters < 1 or a.prompts < 1 or a.max_new < 1:
        ap.error("--adapters, --prompts and --max-new must be >= 1")
    dtype = dtype_of(a.dtype)
    report = Report(a.device, a, out=a.out, file_name="families.json", log=log)
    report["families"] = []
    for family in a.families:
        log(f"{family}: building {a.layers} layers x {a.hidden} hidden in {a.dtype}")
        result = report.measure(family, lambda f=family: check_family(f, a, dtype))
        if result is not None:
            report["families"].append(result)
            report.save()
    print("\n| family | max rel loss diff | log-prob mean / max abs diff | to fp32: ours / HF's own "
          "| greedy token match (not a bar) | exact requests | ok |\n| --- | --- | --- | --- | --- | --- | --- |")
    for r in report["families"]:
        fp32 = ("-" if r.get("logprob_ours_vs_fp32") is None
                else f"{r['logprob_ours_vs_fp32']:.2e} / {r['logprob_hf_vs_fp32']:.2e}")
        print(f"| {r['family']} | {r['loss_max_rel_diff']:.2e} | {r['logprob_mean_abs_diff']:.2e} / "
              f"{r['logprob_max_abs_diff']:.2e} | {fp32} | {r['token_match']:.3f} | "
              f"{r['exact_requests']}/{r['requests']} | {'yes' if r['ok'] else 'NO'} |")
    for name, err in report["errors"].items():
        print(f"| {name} | error: {err} | | | | | NO |")
    report["ok"] = all(r["ok"] for r in report["families"]) and not report["errors"]
    report.save()
    return report


if __name__ == "__main__":
    raise SystemExit(0 if main()["ok"] else 1)
