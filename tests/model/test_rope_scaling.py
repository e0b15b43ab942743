"""RoPE scaling the checkpoints use beyond default / linear / llama3, against transformers.

YaRN (Qwen3 / Qwen2.5 long-context configs, DeepSeek's mscale attention factor), LongRoPE
(Phi-3-*-128k, Phi-3.5, Phi-4-mini: short or long factors by the sequence's length, attention
factor) and partial rotary (Phi-4-mini: 3/4 of each head rotates), on tiny random models whose
pretraining context is short (16 / 32 tokens) so the scaling acts in short sequences. Packed
samples of both sides of the LongRoPE switch are compared with HF on each sample alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lightning_lorafusion.model import decoder as D
from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.model.hf_loading import params_from_hf_model
from lightning_lorafusion.model.peft_io import export_peft_adapter
from lightning_lorafusion.specs import IGNORE_INDEX, AdapterSpec, ConfigError

from _tiny_hf import ROPE_VARIANTS, bank_with_nonzero_b, tiny_hf_config, tiny_hf_model

# two samples longer than the 32-token LongRoPE context (long factors), two shorter (short ones)
LENGTHS = (40, 9, 35, 13)


def _samples(vocab: int, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


def _packed(samples):
    ids = torch.cat(samples)
    positions = torch.cat([torch.arange(len(s)) for s in samples])
    cu = torch.tensor([0, *torch.tensor([len(s) for s in samples]).cumsum(0).tolist()])
    labels = torch.cat([torch.cat([s[1:], torch.tensor([IGNORE_INDEX])]) for s in samples])
    return ids, positions, cu, labels


def _logits_error(config, params, model) -> tuple[float, float]:
    samples = _samples(config.vocab_size)
    ids, positions, cu, _ = _packed(samples)
    with torch.no_grad():
        ours = D.logits(params, None, ids, positions, cu, None, config=config)
        ref = torch.cat([model(s[None]).logits[0] for s in samples])
    return (ours - ref).abs().max().item(), ref.abs().max().item()


def test_configs_read_the_scaling_fields():
    yarn = D.DecoderConfig.from_hf(tiny_hf_config("llama_yarn_mscale"))
    assert (yarn.rope_type, yarn.rope_factor, yarn.rope_original_max_positions) == ("yarn", 4.0, 16)
    assert (yarn.rope_beta_fast, yarn.rope_beta_slow) == (16.0, 2.0)
    # DeepSeek's ratio: (0.1 * 0.8 * ln 4 + 1) / (0.1 * 0.5 * ln 4 + 1)
    assert yarn.rope_attention_factor == pytest.approx((0.08 * 1.3862944 + 1) / (0.05 * 1.3862944 + 1))
    phi = D.DecoderConfig.from_hf(tiny_hf_config("phi3_partial_longrope"))
    assert (phi.rope_type, phi.head_dim, phi.rotary_dim, phi.rope_original_max_positions) == ("longrope", 16, 12, 32)
    assert len(phi.rope_short_factor) == len(phi.rope_long_factor) == 6
    # no factor in the config: max_position_embeddings / original (128 / 32), as HF derives it
    assert phi.rope_attention_factor == pytest.approx((1 + 1.3862944 / 3.4657359) ** 0.5)


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_packed_base_logits_equal_hf_per_sample(variant):
    model = tiny_hf_model(variant)
    config, params = params_from_hf_model(model)
    assert config.rope_type == model.config.rope_parameters["rope_type"]
    err, scale = _logits_error(config, params, model)
    assert err < 1e-4 * max(1.0, scale), f"{variant}: max |ours - HF| = {err}"


def _full_rotary(config):
    # every dim rotates: two more factor pairs so the lists cover the whole head
    extra = (config.head_dim - config.rotary_dim) // 2
    return dict(partial_rotary_factor=1.0, rope_short_factor=config.rope_short_factor + (1.0,) * extra,
                rope_long_factor=config.rope_long_factor + (2.0,) * extra)


# Per variant, changes of the scaling that must break the equality (mutation checks kept as tests).
MUTATIONS = {
    "qwen3_yarn": [dict(rope_attention_factor=1.0), dict(rope_type="linear"), dict(rope_original_max_positions=64)],
    "llama_yarn_mscale": [dict(rope_attention_factor=1.0), dict(rope_factor=2.0)],
    "phi3_longrope": [dict(rope_attention_factor=1.0), "long=short", "short=long"],
    "phi3_partial_longrope": [dict(rope_attention_factor=1.0), "long=short", "short=long", _full_rotary],
}


@pytest.mark.parametrize("variant, index", [(v, i) for v, ms in MUTATIONS.items() for i in range(len(ms))])
def test_a_wrong_scaling_breaks_the_equality(variant, index):
    model = tiny_hf_model(variant)
    config, params = params_from_hf_model(model)
    change = MUTATIONS[variant][index]
    if change == "long=short":
        change = dict(rope_long_factor=config.rope_short_factor)
    elif change == "short=long":
        change = dict(rope_short_factor=config.rope_long_factor)
    elif callable(change):
        change = change(config)
    err, scale = _logits_error(dataclasses.replace(config, **change), params, model)
    assert err > 1e-3 * max(1.0, scale), f"{variant}: {change} went unnoticed (max diff {err})"


def test_longrope_switch_is_per_packed_sample():
    """Each sample of a packed microbatch picks its factors by its own length (HF on it alone);
    without ``cu_seqlens`` the tokens are one sequence."""
    config = D.DecoderConfig.from_hf(tiny_hf_config("phi3_longrope"))
    _, positions, cu, _ = _packed(_samples(config.vocab_size))
    long = D.rope_long_rows(config, positions, cu)
    want = torch.cat([torch.full((n,), n > 32) for n in LENGTHS])
    assert torch.equal(long, want)
    assert D.rope_long_rows(config, positions, None).all()
    assert D.rope_long_rows(D.DecoderConfig.from_hf(tiny_hf_config("qwen3_yarn")), positions, cu) is None


def test_adapter_losses_and_gradients_equal_hf_peft(tmp_path):
    """Partial rotary + LongRoPE, several adapters packed in one microbatch, samples on both
    sides of the switch: per-adapter loss sums and LoRA gradients equal HF + PEFT's."""
    from peft import PeftModel

    variant = "phi3_partial_longrope"
    model = tiny_hf_model(variant)
    config, params = params_from_hf_model(model)
    specs = [AdapterSpec(name="all", rank=4, alpha=8.0, target_modules=("qkv_proj", "o_proj", "gate_up_proj",
                                                                         "down_proj"), seed=1),
             AdapterSpec(name="attn", rank=6, alpha=3.0, target_modules=("qkv_proj", "o_proj"), seed=2)]
    owners = (0, 1, 1, 0)  # sample -> adapter; rows are laid out per adapter below
    bank = bank_with_nonzero_b(AdapterBank(specs, config), 0)
    samples = _samples(config.vocab_size)
    order = sorted(range(len(samples)), key=lambda i: owners[i])
    ordered = [samples[i] for i in order]
    ids, positions, cu, labels = _packed(ordered)
    bounds = cu.tolist()
    segments = [(bounds[0], bounds[2], 0), (bounds[2], bounds[4], 1)]
    routing = bank.routing(segments, microbatch_index=0, num_rows=len(ids))
    sums = D.forward_loss_sums(params, bank.view(), ids, labels, positions, cu, routing, config=config)
    counts = [sum(len(s) - 1 for s, i in zip(ordered, order) if owners[i] == a) for a in range(len(specs))]
    (sums / torch.tensor(counts, dtype=torch.float32)).sum().backward()
    for a, spec in enumerate(bank.specs):
        out = export_peft_adapter(bank, a, tmp_path / spec.name)
        peft_model = PeftModel.from_pretrained(tiny_hf_model(variant), out, is_trainable=True)
        ref_sum = torch.zeros(())
        for s, owner in zip(samples, owners):
            if owner == a:
                logits = peft_model(input_ids=s[None]).logits[0]
                ref_sum = ref_sum + F.cross_entropy(logits[:-1].float(), s[1:], reduction="sum")
        torch.testing.assert_close(sums[a].detach(), ref_sum.detach(), rtol=1e-5, atol=1e-4)
        (ref_sum / counts[a]).backward()
        ref_grads = {n: p.grad for n, p in peft_model.named_parameters() if "lora_" in n}
        for layer in range(config.num_layers):
            for module in spec.target_modules:
                f = bank.factors(a, layer, module)
                block = "self_attn" if module in ("qkv_proj", "o_proj") else "mlp"
                for factor, ours in (("lora_A", f.lora_A.grad), ("lora_B", f.lora_B.grad)):
                    ref = ref_grads[f"base_model.model.model.layers.{layer}.{block}.{module}.{factor}.default.weight"]
                    scale = max(1e-3, ref.abs().max().item())
                    assert (ours - ref).abs().max().item() < 1e-4 * scale, f"{spec.name} {layer}.{module}.{factor}"
                    assert ours.abs().max() > 0


@pytest.mark.parametrize("family, overrides, match", [
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "dynamic NTK"),
    ("qwen3", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                    "partial_rotary_factor": 0.5}), "partial_rotary_factor=0.5"),
])
def test_uncovered_rope_configs_fail_in_one_line(family, overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        D.DecoderConfig.from_hf(tiny_hf_config(family, **overrides))
    assert "\n" not in str(info.value)


def test_bad_rotary_fields_fail_in_one_line():
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                head_dim=8)
    with pytest.raises(ConfigError, match="rotary_dim=5 of head_dim=8"):
        D.DecoderConfig(**base, partial_rotary_factor=0.7)
    with pytest.raises(ConfigError, match="longrope needs rope_short_factor"):
        D.DecoderConfig(**base, rope_type="longrope", rope_short_factor=(1.0,) * 4, rope_long_factor=(1.0,))
