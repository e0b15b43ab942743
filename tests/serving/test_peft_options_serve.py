"""The engine serves PEFT adapters trained with rsLoRA, rank/alpha patterns, layers_to_transform
and gaussian init: greedy tokens equal HF + PEFT's, on the torch and the Triton paths."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.model.decoder import DecoderConfig
from lightning_lorafusion.model.peft_io import export_peft_adapter
from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams
from lightning_lorafusion.serving.adapters import adapter_numel, load_peft_adapter
from lightning_lorafusion.specs import ALL_TARGET_MODULES, AdapterSpec

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
# name -> peft.LoraConfig fields beyond r=4, lora_alpha=8, every projection
OPTIONS = {
    "rslora": dict(use_rslora=True),
    "patterns": dict(rank_pattern={"q_proj": 2, "model.layers.1.mlp.down_proj": 8, "v_proj": 6},
                     alpha_pattern={"v_proj": 3.0, "layers.0.mlp.up_proj": 24.0}),
    "layers": dict(layers_to_transform=[1], rank_pattern={"o_proj": 2}),
    "gaussian": dict(init_lora_weights="gaussian", use_rslora=True, alpha_pattern={"k_proj": 2.0}),
}
CASES = [
    ([11, 4, 30, 22, 8, 19, 40], "rslora"),
    ([7, 13, 21, 33, 45, 50, 6, 12, 28], "patterns"),
    ([60, 2, 35, 18, 26], "layers"),
    ([44, 41, 10, 20, 30], "gaussian"),
    ([5, 9, 17], None),
    ([8, 16, 3, 50], "patterns"),
]


def _write(model_dir, out_dir, options, seed):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8.0, target_modules=list(ALL_TARGET_MODULES), lora_dropout=0.0, **options)
    peft_model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # A keeps PEFT's init for the option; B is drawn so it matters
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft_model.save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="module")
def option_dirs(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("option-adapters")
    return {name: _write(model_dir, root / name, options, seed) for seed, (name, options) in enumerate(OPTIONS.items())}


def _reference(hf_reference_of, model_dir, option_dirs):
    return hf_reference_of(model_dir, option_dirs)


def _engine(model_dir, option_dirs, backend="torch"):
    return Engine.from_pretrained(str(model_dir), option_dirs, EngineConfig(num_pages=160, page_size=4, backend=backend),
                                  device="cpu", dtype=torch.float32)


def _requests(cases, sampling=GREEDY):
    return [GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sampling) for p, a in cases]


def test_option_adapters_generate_like_hf_peft(model_dir, option_dirs, hf_reference_of):
    reference = _reference(hf_reference_of, model_dir, option_dirs)
    with _engine(model_dir, option_dirs) as engine:
        results = engine.generate(_requests(CASES))
        for (prompt, adapter), res in zip(CASES, results):
            assert list(res.token_ids) == reference.generate(prompt, adapter, GREEDY.max_new_tokens), adapter
        outs = {a: engine.generate(_requests([(CASES[0][0], a)]))[0].token_ids for a in (None, *OPTIONS)}
    assert len(set(outs.values())) == len(outs)  # every adapter changes the output


def test_option_adapters_on_the_triton_path(model_dir, option_dirs, hf_reference_of):
    """Fused prefill segments and the decode gather (Triton interpreter, fp32)."""
    reference = _reference(hf_reference_of, model_dir, option_dirs)
    sp = SamplingParams(max_new_tokens=3, temperature=0.0)
    with _engine(model_dir, option_dirs, backend="triton") as engine:
        for (prompt, adapter), res in zip(CASES[:4], engine.generate(_requests(CASES[:4], sp))):
            assert list(res.token_ids) == reference.generate(prompt, adapter, 3), adapter


def test_host_layout_pads_ranks_per_module_and_shares_one_zero_slot(model_dir, option_dirs):
    from transformers import AutoConfig

    config = DecoderConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    patterns = load_peft_adapter("p", option_dirs["patterns"], config, dtype=torch.float32)
    ranks = dict(zip(ALL_TARGET_MODULES, patterns.module_ranks.tolist()))
    assert ranks == {"q_proj": 2, "k_proj": 4, "v_proj": 6, "o_proj": 4, "gate_proj": 4, "up_proj": 4,
                     "down_proj": 8}
    assert patterns.rank == 8 and patterns.scale == 2.0
    slot = patterns.slots[(0, "down_proj")]  # rank 4 padded to the module's 8: rows 4..7 zero
    assert not patterns.flat[slot.a + 4 * slot.in_features:slot.a + 8 * slot.in_features].any()
    assert patterns.flat[slot.a:slot.a + 4 * slot.in_features].any()

    layers = load_peft_adapter("l", option_dirs["layers"], config, dtype=torch.float32)
    zero = layers.slots[(0, "q_proj")]
    assert all(layers.slots[(0, m)] != layers.slots[(1, m)] for m in ALL_TARGET_MODULES)
    assert not layers.flat[zero.a:zero.b + 4 * zero.out_features].any()
    from lightning_lorafusion.model.peft_io import peft_layout, read_peft_adapter

    cfg, targets, _ = read_peft_adapter(option_dirs["layers"], "l")
    assert layers.numel == adapter_numel(config, 4, ALL_TARGET_MODULES, peft_layout(cfg, targets, "l"))
    assert layers.numel < adapter_numel(config, 4, ALL_TARGET_MODULES)


def test_bank_weights_serve_like_their_peft_export(model_dir, tmp_path):
    """What fit's val samples and checkpoint serving do (``add_adapter_weights`` with the spec's
    layout) gives the tokens of the exported PEFT directory."""
    from transformers import AutoConfig

    config = DecoderConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    spec = AdapterSpec(name="opts", rank=4, alpha=8.0, use_rslora=True, rank_pattern={"up_proj": 6},
                       alpha_pattern={"q_proj": 1.0}, layers_to_transform=[0], seed=3)
    bank = AdapterBank([spec], config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in bank.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    out = export_peft_adapter(bank, 0, tmp_path / "opts")
    factors = {(layer, m): (bank.factors(0, layer, m).lora_A, bank.factors(0, layer, m).lora_B)
               for layer, m in spec.layout.adapted(config.num_layers)}
    cases = [(CASES[0][0], "from_dir"), (CASES[0][0], "from_bank"), (CASES[1][0], "from_bank")]
    with Engine.from_pretrained(str(model_dir), {"from_dir": str(out)}, EngineConfig(num_pages=96, page_size=4),
                                device="cpu", dtype=torch.float32) as engine:
        engine.add_adapter_weights("from_bank", factors, rank=spec.rank, alpha=spec.alpha, layout=spec.layout)
        first, second, third = engine.generate(_requests(cases))
        base = engine.generate(_requests([(CASES[0][0], None)]))[0]
        direct = engine.generate(_requests([(CASES[1][0], "from_dir")]))[0]
    assert first.token_ids == second.token_ids and third.token_ids == direct.token_ids
    assert first.token_ids != base.token_ids
