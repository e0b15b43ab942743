"""Every decoder family beside Llama's against transformers (+ PEFT) on tiny random models.

Per family: packed varlen base logits equal HF's forward on each sample alone; per-adapter loss
sums and LoRA gradients of several adapters packed in one microbatch equal HF + PEFT with the
same adapter; an exported adapter loads in ``peft.PeftModel`` with equal logits; an adapter
made and saved by PEFT imports into the bank with equal logits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lightning_lorafusion.model import decoder as D
from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.model.family import DecoderFamily
from lightning_lorafusion.model.hf_loading import params_from_hf_model
from lightning_lorafusion.model.peft_io import export_peft_adapter, import_peft_adapter
from lightning_lorafusion.specs import IGNORE_INDEX, AdapterSpec, ConfigError

from _tiny_hf import bank_with_nonzero_b, NEW_FAMILIES, tiny_hf_config, tiny_hf_model

LENGTHS = (9, 6, 11, 7)  # longer than the tiny Gemma window (5) in three of four samples
OWNERS = (0, 0, 1, 2)  # adapter of each sample (contiguous per adapter, as packing lays them)
SPECS = [
    AdapterSpec(name="all", rank=4, alpha=8.0, seed=1),
    AdapterSpec(name="attn", rank=6, alpha=3.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=2),
    AdapterSpec(name="mlp", rank=3, alpha=12.0, target_modules=("gate_proj", "up_proj", "down_proj"), seed=3),
]
# A fused checkpoint (Phi-3) is targeted by PEFT's names for its fused projections.
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}


def _specs(config) -> list[AdapterSpec]:
    if not config.family.fused_qkv:
        return SPECS
    return [dataclasses.replace(s, target_modules=tuple(dict.fromkeys(FUSED.get(m, m) for m in s.target_modules)))
            for s in SPECS]


def _samples(vocab: int, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


def _packed(samples):
    ids = torch.cat(samples)
    positions = torch.cat([torch.arange(len(s)) for s in samples])
    cu = torch.tensor([0] + [sum(LENGTHS[:i + 1]) for i in range(len(LENGTHS))])
    labels = torch.cat([torch.cat([s[1:], torch.tensor([IGNORE_INDEX])]) for s in samples])
    return ids, positions, cu, labels


def _bank(config, seed=0):
    return bank_with_nonzero_b(AdapterBank(_specs(config), config), seed)


def _family_model(family: str, seed: int = 0):
    model = tiny_hf_model(family, seed=seed)
    config, params = params_from_hf_model(model)
    return model, config, params


def _base_logits_error(family: str, config, params, model) -> tuple[float, float]:
    samples = _samples(config.vocab_size)
    ids, positions, cu, _ = _packed(samples)
    with torch.no_grad():
        ours = D.logits(params, None, ids, positions, cu, None, config=config)
        ref = torch.cat([model(s[None]).logits[0] for s in samples])
    return (ours - ref).abs().max().item(), ref.abs().max().item()


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_packed_base_logits_equal_hf_per_sample(family):
    model, config, params = _family_model(family)
    assert config.family.name == family and not config.family.is_llama_block
    err, scale = _base_logits_error(family, config, params, model)
    assert err < 1e-4 * max(1.0, scale), f"{family}: max |ours - HF| = {err}"


# One field per family whose flip must break the equality (mutation check, kept as a test):
# the wrong norm convention, a dropped soft-cap / q-k norm / post-norm / local RoPE base.
MUTATIONS = {
    "qwen3": dict(qk_norm="none"),
    "olmo2": dict(qk_norm="none"),
    "phi3": dict(activation="gelu_tanh"),
    "gemma2": dict(attn_logit_softcap=None),
    "gemma3_text": dict(local_rope_theta=None),
}


@pytest.mark.parametrize("family", NEW_FAMILIES)
@pytest.mark.parametrize("mutation", ["listed", "norm_offset"])
def test_a_wrong_family_field_breaks_the_equality(family, mutation):
    model, config, params = _family_model(family)
    fam = config.family
    change = MUTATIONS[family] if mutation == "listed" else dict(norm_offset=1.0 - fam.norm_offset)
    wrong = dataclasses.replace(config, family=dataclasses.replace(fam, **change))
    err, scale = _base_logits_error(family, wrong, params, model)
    assert err > 1e-2 * max(1.0, scale), f"{family}: {change} went unnoticed (max diff {err})"


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_packed_adapter_losses_and_gradients_equal_hf_peft(family, tmp_path):
    from peft import PeftModel

    model, config, params = _family_model(family)
    bank = _bank(config)
    samples = _samples(config.vocab_size)
    ids, positions, cu, labels = _packed(samples)
    starts = cu.tolist()
    segments = []
    for a in range(len(SPECS)):
        rows = [i for i, o in enumerate(OWNERS) if o == a]
        segments.append((starts[rows[0]], starts[rows[-1] + 1], a))
    routing = bank.routing(segments, microbatch_index=0, num_rows=len(ids))
    sums = D.forward_loss_sums(params, bank.view(), ids, labels, positions, cu, routing, config=config)
    counts = [sum(LENGTHS[i] - 1 for i, o in enumerate(OWNERS) if o == a) for a in range(len(SPECS))]
    (sums / torch.tensor(counts, dtype=torch.float32)).sum().backward()

    for a, spec in enumerate(bank.specs):
        out = export_peft_adapter(bank, a, tmp_path / spec.name)
        peft_model = PeftModel.from_pretrained(tiny_hf_model(family), out, is_trainable=True)
        ref_sum = torch.zeros(())
        for s, owner in zip(samples, OWNERS):
            if owner == a:
                logits = peft_model(input_ids=s[None]).logits[0]
                ref_sum = ref_sum + F.cross_entropy(logits[:-1].float(), s[1:], reduction="sum")
        torch.testing.assert_close(sums[a].detach(), ref_sum.detach(), rtol=1e-5, atol=1e-4)
        (ref_sum / counts[a]).backward()
        ref_grads = {n: p.grad for n, p in peft_model.named_parameters() if "lora_" in n}
        assert ref_grads
        for layer in range(config.num_layers):
            for module in spec.target_modules:
                f = bank.factors(a, layer, module)
                block = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")) else "mlp"
                for factor, ours in (("lora_A", f.lora_A.grad), ("lora_B", f.lora_B.grad)):
                    ref = ref_grads[f"base_model.model.model.layers.{layer}.{block}.{module}.{factor}.default.weight"]
                    scale = max(1e-3, ref.abs().max().item())
                    where = f"{family} {spec.name} {layer}.{module}.{factor}"
                    assert (ours - ref).abs().max().item() < 1e-4 * scale, where
                    assert ours.abs().max() > 0


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_exported_adapter_gives_our_logits_in_peft(family, tmp_path):
    from peft import PeftModel

    model, config, params = _family_model(family, seed=3)
    bank = _bank(config, seed=4)
    samples = _samples(config.vocab_size)
    for a, spec in enumerate(bank.specs):
        out = export_peft_adapter(bank, a, tmp_path / spec.name, base_model_name_or_path="tiny")
        peft_model = PeftModel.from_pretrained(tiny_hf_model(family, seed=3), out).eval()
        for s in samples[:2]:
            n = len(s)
            routing = bank.routing(((0, n, a),), microbatch_index=0, num_rows=n, train=False)
            with torch.no_grad():
                ours = D.logits(params, bank.view(), s, torch.arange(n), torch.tensor([0, n]), routing, config=config)
                ref = peft_model(input_ids=s[None]).logits[0]
                base = model(s[None]).logits[0]
            scale = max(1.0, ref.abs().max().item())
            assert (ours - ref).abs().max() < 1e-4 * scale
            assert (ref - base).abs().max() > 1e-2 * scale  # the adapter changes the model


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_peft_created_adapter_imports(family, tmp_path):
    from peft import LoraConfig, get_peft_model

    model, config, params = _family_model(family, seed=2)
    targets = ("qkv_proj", "down_proj") if config.family.fused_qkv else ("q_proj", "v_proj", "down_proj")
    peft_model = get_peft_model(tiny_hf_model(family, seed=2),
                                LoraConfig(r=5, lora_alpha=7, lora_dropout=0.0, target_modules=list(targets)))
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft_model.save_pretrained(tmp_path / "made_by_peft")
    bank = AdapterBank([AdapterSpec(name="imported", rank=5, alpha=7.0, target_modules=targets)], config)
    import_peft_adapter(bank, 0, tmp_path / "made_by_peft")
    s = _samples(config.vocab_size)[2]
    n = len(s)
    routing = bank.routing(((0, n, 0),), microbatch_index=0, num_rows=n, train=False)
    with torch.no_grad():
        ours = D.logits(params, bank.view(), s, torch.arange(n), torch.tensor([0, n]), routing, config=config)
        ref = peft_model.eval()(input_ids=s[None]).logits[0]
    assert (ours - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("family, overrides, match", [
    ("qwen3", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "rope type 'dynamic'"),
    ("olmo2", dict(hidden_act="relu"), "hidden_act='relu'"),
    ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    ("qwen3", dict(num_experts=4), "mixture-of-experts"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
])
def test_uncovered_configs_fail_in_one_line(family, overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        D.DecoderConfig.from_hf(tiny_hf_config(family, **overrides))
    assert "\n" not in str(info.value)


def test_unknown_and_multimodal_model_types_name_the_supported_ones():
    from transformers import Gemma3Config, PhiConfig

    with pytest.raises(ConfigError, match=r"model_type='phi'.*supported: \('llama'"):
        D.DecoderConfig.from_hf(PhiConfig())
    with pytest.raises(ConfigError, match="gemma3_text"):
        D.DecoderConfig.from_hf(Gemma3Config())


def test_llama_family_is_the_default_block():
    config, _ = params_from_hf_model(tiny_hf_model("mistral"))
    assert config.family.is_llama_block and config.family == DecoderFamily(name="mistral")
    assert D.DecoderConfig(vocab_size=7, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                           num_kv_heads=2, head_dim=4).family == DecoderFamily()
    with pytest.raises(ConfigError, match="norm_offset=0.5"):
        DecoderFamily(norm_offset=0.5)


def test_fused_checkpoint_refuses_per_projection_targets_in_one_line():
    config, _ = params_from_hf_model(tiny_hf_model("phi3"))
    message = r"target module 'q_proj' is not a projection of this phi3 base.*qkv_proj"
    with pytest.raises(ConfigError, match=message) as info:
        AdapterBank([AdapterSpec(name="x", rank=2, alpha=2.0, target_modules=("q_proj", "o_proj"))], config)
    assert "\n" not in str(info.value)
    assert config.module_dims("gate_up_proj") == (config.hidden_size, 2 * config.intermediate_size)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_random_base_has_the_loaded_pytree_layout_and_identity_norms(family):
    from lightning_lorafusion.model.random_model import random_base_params

    config, loaded = params_from_hf_model(tiny_hf_model(family))
    drawn = random_base_params(config)

    def shapes(tree):
        return {k: shapes(v) if isinstance(v, dict) else tuple(v.shape) for k, v in tree.items()}

    assert shapes(drawn["layers"][1]) == shapes(loaded["layers"][1])
    x = torch.randn(3, config.hidden_size)
    from lightning_lorafusion.model.family import family_norm

    norm = family_norm(config.family)
    torch.testing.assert_close(norm(x, drawn["layers"][0][next(iter(config.family.norm_keys()))], 1e-6),
                               norm(x, torch.ones(config.hidden_size) - config.family.norm_offset, 1e-6))
    torch.testing.assert_close(norm(x, drawn["norm"], 0.0), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)))


@pytest.mark.parametrize("family", ["gemma3_text", "phi3"])
def test_elementwise_fusion_keeps_family_math(family):
    """The compiled elementwise groups (the family's norm + residual, its activation) give the
    eager result, values and LoRA gradients."""
    _, config, params = _family_model(family)
    samples = _samples(config.vocab_size)
    ids, positions, cu, labels = _packed(samples)
    results = []
    for mode in ("off", "on"):
        bank = _bank(config)
        routing = bank.routing(((0, len(ids), 0),), microbatch_index=0, num_rows=len(ids))
        options = D.DecoderOptions(elementwise_fusion=mode, fusion_compiler="aot_eager")
        sums = D.forward_loss_sums(params, bank.view(), ids, labels, positions, cu, routing, config=config,
                                   options=options)
        sums.sum().backward()
        results.append((sums.detach(), [p.grad for p in bank.parameters_of(0)]))
    (ref, ref_grads), (got, grads) = results
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        # the compiled groups round differently (fp32, ~1e-6 of the gradient's scale); a wrong
        # norm or activation moves them by O(scale)
        scale = r.abs().max().item()
        assert (g - r).abs().max().item() < 1e-4 * scale


def test_the_generation_engine_still_runs_llama_family_bases():
    from lightning_lorafusion.serving import Engine, EngineConfig

    _, config, params = _family_model("qwen2")
    assert config.family.is_llama_block
    engine = Engine(config, params, None, EngineConfig(num_pages=64))
    engine.close()
