"""PEFT export/import: peft.PeftModel on the transformers model reproduces our adapted logits."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_lorafusion.model import decoder as D
from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.model.hf_loading import params_from_hf_model
from lightning_lorafusion.model.peft_io import export_peft_adapter, import_peft_adapter
from lightning_lorafusion.specs import AdapterSpec, ConfigError

from _tiny_hf import bank_with_nonzero_b, tiny_hf_model

SPECS = [
    AdapterSpec(name="all", rank=4, alpha=8.0, seed=1),
    AdapterSpec(name="attn", rank=6, alpha=3.0, dropout=0.1,
                target_modules=("q_proj", "v_proj", "o_proj"), seed=2),
    AdapterSpec(name="mlp", rank=3, alpha=12.0, target_modules=("up_proj", "down_proj"), seed=3),
]


def _bank(config, seed=0):
    return bank_with_nonzero_b(AdapterBank(SPECS, config), seed)


@pytest.mark.parametrize("adapter", [0, 1, 2])
def test_peft_model_from_exported_dir_gives_our_logits(tmp_path, adapter):
    from peft import PeftModel

    model = tiny_hf_model("qwen2", seed=7)
    config, params = params_from_hf_model(model)
    bank = _bank(config)
    out = export_peft_adapter(bank, adapter, tmp_path / SPECS[adapter].name, base_model_name_or_path="tiny")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["base_model_name_or_path"]) == (
        SPECS[adapter].rank, SPECS[adapter].alpha, "tiny")

    t = 13
    ids = torch.randint(0, config.vocab_size, (t,), generator=torch.Generator().manual_seed(2))
    routing = bank.routing(((0, t, adapter),), microbatch_index=0, num_rows=t, train=False)
    with torch.no_grad():
        ours = D.logits(params, bank.view(), ids, torch.arange(t), torch.tensor([0, t]), routing,
                        config=config)
        base = model(ids[None]).logits[0]
        peft_model = PeftModel.from_pretrained(model, out).eval()
        ref = peft_model(input_ids=ids[None]).logits[0]
    scale = max(1.0, ref.abs().max().item())
    assert (ours - ref).abs().max() < 1e-4 * scale
    assert (ref - base).abs().max() > 1e-2 * scale  # the adapter changes the model


def test_import_round_trip_and_overwrite(tmp_path):
    model = tiny_hf_model("llama", seed=3)
    config, _ = params_from_hf_model(model)
    bank = _bank(config, seed=0)
    out = tmp_path / "adapters" / "all"
    export_peft_adapter(bank, 0, out)
    export_peft_adapter(bank, 0, out)  # overwriting an existing export works
    assert sorted(p.name for p in out.parent.iterdir()) == ["all"]  # no temp dirs left
    fresh = AdapterBank([AdapterSpec(name="again", rank=4, alpha=8.0, seed=99)], config)
    assert not torch.equal(fresh.factors(0, 1, "k_proj").lora_A, bank.factors(0, 1, "k_proj").lora_A)
    import_peft_adapter(fresh, 0, out)
    for p_new, p_old in zip(fresh.parameters_of(0), bank.parameters_of(0)):
        assert torch.equal(p_new, p_old)


def test_import_mismatches_raise_clearly(tmp_path):
    model = tiny_hf_model("llama", seed=3)
    config, _ = params_from_hf_model(model)
    bank = _bank(config)
    out = export_peft_adapter(bank, 1, tmp_path / "attn")
    wrong_rank = AdapterBank([AdapterSpec(name="x", rank=5, alpha=3.0,
                                          target_modules=("q_proj", "v_proj", "o_proj"))], config)
    with pytest.raises(ConfigError, match=r"adapter 'x'.*rank: 6 there, 5 in the config"):
        import_peft_adapter(wrong_rank, 0, out)
    wrong_targets = AdapterBank([AdapterSpec(name="x", rank=6, alpha=3.0)], config)
    with pytest.raises(ConfigError, match="target_modules"):
        import_peft_adapter(wrong_targets, 0, out)
    with pytest.raises(ConfigError, match="no adapter_config.json"):
        import_peft_adapter(wrong_targets, 0, tmp_path / "missing")
    other_model = AdapterBank([SPECS[1]], params_from_hf_model(tiny_hf_model("llama", num_hidden_layers=3))[0])
    with pytest.raises(ConfigError, match="missing e.g.*layers.2"):
        import_peft_adapter(other_model, 0, out)
