"""PEFT's everyday LoRA options (rsLoRA, LoRA+, rank/alpha patterns, layers_to_transform,
init_lora_weights): adapters trained by PEFT import with PEFT's logits and gradients, our
exports load in PEFT with our logits, and the options mean what PEFT means by them."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml

from lightning_lorafusion.model import decoder as D
from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.model.hf_loading import params_from_hf_model
from lightning_lorafusion.model.peft_io import export_peft_adapter, import_peft_adapter, peft_key
from lightning_lorafusion.specs import AdapterSpec, ConfigError
from lightning_lorafusion.training.optim import build_adapter_optimizer

from _tiny_hf import bank_with_nonzero_b, tiny_hf_model

LAYERS = 3
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# One PEFT config per option (fields of peft.LoraConfig beyond r / lora_alpha / target_modules).
KINDS = {
    "rslora": dict(use_rslora=True),
    "patterns": dict(rank_pattern={"q_proj": 2, "model.layers.1.mlp.down_proj": 7, r"layers\.2\.self_attn\.v_proj": 3},
                     alpha_pattern={"v_proj": 3.0, "up_proj": 20.0}),
    "patterns_rslora": dict(use_rslora=True, rank_pattern={"o_proj": 6}, alpha_pattern={"gate_proj": 2.0}),
    "layers": dict(layers_to_transform=[0, 2]),
    "layers_pattern": dict(layers_to_transform=1, layers_pattern="layers"),
    "gaussian": dict(init_lora_weights="gaussian"),
}


def _spec(kind: str, name: str = "a", **extra) -> AdapterSpec:
    return AdapterSpec(name=name, rank=4, alpha=8.0, target_modules=TARGETS, seed=5, **KINDS[kind], **extra)


def _peft_model(kind: str, seed: int = 11):
    """A tiny Llama wrapped by PEFT with option ``kind``, every lora_B drawn non-zero."""
    from peft import LoraConfig, get_peft_model

    model = tiny_hf_model("llama", seed=4, num_hidden_layers=LAYERS)
    cfg = LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules=list(TARGETS), **KINDS[kind])
    peft_model = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return peft_model.eval()


def _inputs(config, t: int = 11):
    ids = torch.randint(0, config.vocab_size, (t,), generator=torch.Generator().manual_seed(3))
    weights = torch.randn(t, config.vocab_size, generator=torch.Generator().manual_seed(4))
    return ids, weights


def _our_logits(params, bank, config, ids, adapter: int = 0, backend: str = "torch"):
    t = ids.shape[0]
    routing = bank.routing(((0, t, adapter),), microbatch_index=0, num_rows=t, train=False)
    return D.logits(params, bank.view(), ids, torch.arange(t), torch.tensor([0, t]), routing, config=config,
                    backend=backend)


@pytest.mark.parametrize("kind", list(KINDS))
def test_peft_trained_adapter_imports_with_peft_logits_and_gradients(tmp_path, kind):
    peft_model = _peft_model(kind)
    peft_model.save_pretrained(tmp_path / kind)
    config, params = params_from_hf_model(tiny_hf_model("llama", seed=4, num_hidden_layers=LAYERS))
    bank = AdapterBank([_spec("rslora", name="other"), _spec(kind)], config)  # a plain neighbour first
    import_peft_adapter(bank, 1, tmp_path / kind)
    ids, weights = _inputs(config)

    ours = _our_logits(params, bank, config, ids, adapter=1)
    (ours * weights).sum().backward()
    ref = peft_model(input_ids=ids[None]).logits[0]
    (ref * weights).sum().backward()
    scale = max(1.0, ref.abs().max().item())
    assert (ours - ref).abs().max() < 1e-4 * scale

    compared = 0
    for name, p in peft_model.named_parameters():
        if "lora_" not in name:
            continue
        layer, module = int(name.split(".layers.")[1].split(".")[0]), name.split(".lora_")[0].rsplit(".", 1)[1]
        f = bank.factors(1, layer, module)
        ours_p = f.lora_A if ".lora_A." in name else f.lora_B
        assert ours_p.shape == p.shape, name
        g_scale = max(1e-3, p.grad.abs().max().item())
        assert (ours_p.grad - p.grad).abs().max() < 1e-4 * g_scale, name
        compared += 1
    assert compared == 2 * len(bank.specs[1].layout.adapted(LAYERS))
    for f in bank.parameters_of(0):  # the neighbour saw no token
        assert f.grad is None or not f.grad.any()


@pytest.mark.parametrize("kind", list(KINDS))
def test_export_round_trips_through_peft(tmp_path, kind):
    from peft import PeftModel

    model = tiny_hf_model("llama", seed=4, num_hidden_layers=LAYERS)
    config, params = params_from_hf_model(model)
    bank = bank_with_nonzero_b(AdapterBank([_spec(kind)], config), seed=2)
    out = export_peft_adapter(bank, 0, tmp_path / kind, base_model_name_or_path="tiny")
    cfg = json.loads((out / "adapter_config.json").read_text())
    for key, value in KINDS[kind].items():
        expected = [value] if key == "layers_to_transform" and isinstance(value, int) else value
        expected = [value] if key == "layers_pattern" else expected
        assert cfg[key] == expected, key
    ids, _ = _inputs(config)
    with torch.no_grad():
        ours = _our_logits(params, bank, config, ids)
        base = model(ids[None]).logits[0]
        ref = PeftModel.from_pretrained(model, out).eval()(input_ids=ids[None]).logits[0]
    scale = max(1.0, ref.abs().max().item())
    assert (ours - ref).abs().max() < 1e-4 * scale
    assert (ref - base).abs().max() > 1e-2 * scale


def test_rank_pattern_gives_each_module_its_rank_and_scale():
    config, _ = params_from_hf_model(tiny_hf_model("llama", seed=4, num_hidden_layers=LAYERS))
    spec = _spec("patterns")
    bank = AdapterBank([spec], config)
    assert bank.factors(0, 0, "q_proj").lora_A.shape[0] == 2
    assert bank.factors(0, 1, "down_proj").lora_A.shape[0] == 7
    assert bank.factors(0, 0, "down_proj").lora_A.shape[0] == 4  # the pattern names layer 1 only
    assert bank.factors(0, 2, "v_proj").lora_B.shape[1] == 3
    assert bank.factors(0, 1, "v_proj").lora_B.shape[1] == 4
    assert spec.scale == 2.0
    assert spec.layout.module_scale(0, "q_proj") == 4.0  # alpha 8 / rank 2
    assert spec.layout.module_scale(1, "v_proj") == 0.75  # alpha 3 / rank 4
    assert bank.module_scale_ratio(0, 0, "q_proj") == 2.0
    assert bank.module_scale_ratio(0, 0, "k_proj") == 1.0


def test_rslora_scales_by_the_square_root_of_the_rank():
    spec = AdapterSpec(name="a", rank=16, alpha=8.0, use_rslora=True)
    assert spec.scale == 8.0 / 4.0
    assert AdapterSpec(name="a", rank=16, alpha=8.0).scale == 0.5
    config, _ = params_from_hf_model(tiny_hf_model("llama", seed=4))
    bank = AdapterBank([spec, AdapterSpec(name="b", rank=4, alpha=8.0)], config)
    assert bank.routing(((0, 4, 0),), 0, 4).scales == (2.0, 2.0)
    rs = AdapterSpec(name="p", rank=4, alpha=8.0, use_rslora=True, rank_pattern={"q_proj": 9})
    assert rs.layout.module_scale(0, "q_proj") == pytest.approx(8.0 / 3.0)


def test_layers_to_transform_leaves_other_layers_untouched(tmp_path):
    model = tiny_hf_model("llama", seed=4, num_hidden_layers=LAYERS)
    config, params = params_from_hf_model(model)
    bank = bank_with_nonzero_b(AdapterBank([_spec("layers")], config), seed=1)
    assert all(bank.factors(0, 1, m) is None for m in TARGETS)
    assert all(bank.factors(0, layer, m) is not None for layer in (0, 2) for m in TARGETS)
    ids, _ = _inputs(config)
    t = ids.shape[0]
    routing = bank.routing(((0, t, 0),), 0, t, train=False)
    h = D.embed(params, ids)
    args = (torch.arange(t), torch.tensor([0, t]))
    with torch.no_grad():
        one = D.decoder_layers(params, bank.view(), h, *args, routing, config=config, layers=[1])
        base = D.decoder_layers(params, None, h, *args, None, config=config, layers=[1])
        zero = D.decoder_layers(params, bank.view(), h, *args, routing, config=config, layers=[0])
        zero_base = D.decoder_layers(params, None, h, *args, None, config=config, layers=[0])
    assert torch.equal(one, base)
    assert (zero - zero_base).abs().max() > 1e-3
    out = export_peft_adapter(bank, 0, tmp_path / "layers")
    from safetensors.torch import load_file

    keys = load_file(str(out / "adapter_model.safetensors"))
    assert not any(".layers.1." in k for k in keys) and peft_key(2, "q_proj", "lora_A") in keys


def test_layers_options_are_checked():
    config, _ = params_from_hf_model(tiny_hf_model("llama", seed=4, num_hidden_layers=LAYERS))
    with pytest.raises(ConfigError, match=r"layers_to_transform names layer\(s\) \[5\]"):
        AdapterBank([AdapterSpec(name="a", layers_to_transform=[0, 5])], config)
    with pytest.raises(ConfigError, match="layers_pattern.*needs layers_to_transform"):
        AdapterSpec(name="a", layers_pattern="layers")
    with pytest.raises(ConfigError, match="no projection carries the adapter"):
        AdapterBank([AdapterSpec(name="a", layers_to_transform=[0], layers_pattern="h")], config)
    with pytest.raises(ConfigError, match=r"rank_pattern\['q_proj'\]=0 must be >= 1"):
        AdapterSpec(name="a", rank_pattern={"q_proj": 0})
    with pytest.raises(ConfigError, match="alpha_pattern key '\\(' is not a regular expression"):
        AdapterSpec(name="a", alpha_pattern={"(": 2.0})
    with pytest.raises(ConfigError, match="rank_pattern rank of layer 0=60 exceeds q_proj"):
        AdapterBank([AdapterSpec(name="a", rank_pattern={"q_proj": 60})], config)


def test_loraplus_steps_b_ratio_times_a():
    config, _ = params_from_hf_model(tiny_hf_model("llama", seed=4))
    spec = AdapterSpec(name="a", rank=4, lr=1e-3, loraplus_lr_ratio=16.0, lr_schedule="constant")
    bank = AdapterBank([spec, AdapterSpec(name="b", rank=4, lr=1e-3)], config)
    opt, _ = build_adapter_optimizer(bank.named_parameters_of(0), spec=spec, total_steps=10)
    a_group, b_group = opt.param_groups
    assert a_group["lr"] == 1e-3 and b_group["lr"] == 16e-3
    assert {id(p) for p in b_group["params"]} == {id(f.lora_B) for layer in bank.adapters[0] for f in layer.values()}
    plain, _ = build_adapter_optimizer(bank.named_parameters_of(1), spec=bank.specs[1], total_steps=10)
    assert [g["lr"] for g in plain.param_groups] == [1e-3]
    # one AdamW step moves each weight by about lr (the first step is lr * g / |g|)
    before = {id(p): p.detach().clone() for p in bank.parameters_of(0)}
    g = torch.Generator().manual_seed(0)
    for p in bank.parameters_of(0):
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    f = bank.factors(0, 0, "q_proj")
    step_a = (f.lora_A - before[id(f.lora_A)]).abs().mean().item()
    step_b = (f.lora_B - before[id(f.lora_B)]).abs().mean().item()
    assert step_b / step_a == pytest.approx(16.0, rel=1e-3)
    with pytest.raises(ConfigError, match="loraplus_lr_ratio=-1"):
        AdapterSpec(name="a", loraplus_lr_ratio=-1)


def test_gaussian_init_draws_a_with_std_one_over_rank_and_zero_b():
    config, _ = params_from_hf_model(tiny_hf_model("llama", seed=4, hidden_size=256, intermediate_size=512))
    bank = AdapterBank([AdapterSpec(name="g", rank=8, init_lora_weights="gaussian", rank_pattern={"o_proj": 4}),
                        AdapterSpec(name="k", rank=8)], config)
    a = torch.cat([bank.factors(0, layer, "up_proj").lora_A.flatten() for layer in range(2)])
    assert a.std().item() == pytest.approx(1 / 8, rel=0.05)
    assert bank.factors(0, 0, "o_proj").lora_A.std().item() == pytest.approx(1 / 4, rel=0.1)
    kaiming_bound = 1 / math.sqrt(256)  # kaiming_uniform(a=sqrt(5)) on [r, 256]: U(-1/16, 1/16)
    assert bank.factors(1, 0, "up_proj").lora_A.abs().max().item() <= kaiming_bound
    assert a.abs().max().item() > kaiming_bound
    assert not any(p.any() for n, p in bank.named_parameters() if n.endswith("lora_B"))


@pytest.mark.parametrize("init, reason", [
    ("pissa", "rewrites the frozen base weight"), ("pissa_niter_4", "rewrites the frozen base weight"),
    ("olora", "rewrites the frozen base weight"), ("corda", "rewrites the frozen base weight"),
    ("loftq", "rewrites the frozen base weight"), ("eva", "SVD of layer inputs"),
    (False, "starts B at random values"), ("orthogonal", "not implemented here"),
])
def test_inits_that_cannot_work_here_are_refused_with_the_reason(init, reason):
    with pytest.raises(ConfigError, match=f"adapter 'a': init_lora_weights=.*{reason}"):
        AdapterSpec(name="a", init_lora_weights=init)


def test_import_refuses_an_adapter_whose_init_rewrote_its_base(tmp_path):
    config, _ = params_from_hf_model(tiny_hf_model("llama", seed=4))
    bank = AdapterBank([AdapterSpec(name="a", rank=4, alpha=8.0)], config)
    out = export_peft_adapter(bank, 0, tmp_path / "a")
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["init_lora_weights"] = "pissa_niter_16"
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="init_lora_weights='pissa_niter_16', which rewrote its base weight"):
        import_peft_adapter(bank, 0, out)


def test_import_names_a_pattern_mismatch(tmp_path):
    config, _ = params_from_hf_model(tiny_hf_model("llama", seed=4, num_hidden_layers=LAYERS))
    bank = AdapterBank([_spec("patterns")], config)
    out = export_peft_adapter(bank, 0, tmp_path / "p")
    other = AdapterBank([AdapterSpec(name="a", rank=4, alpha=8.0, target_modules=TARGETS,
                                     rank_pattern={"q_proj": 2},
                                     alpha_pattern=KINDS["patterns"]["alpha_pattern"])], config)
    with pytest.raises(ConfigError, match="rank of layer 1 down_proj: 7 there, 4 in the config"):
        import_peft_adapter(other, 0, out)


def test_fused_kernels_take_per_module_ranks_and_scales():
    """The Triton path (interpreter on CPU) with one adapter's ranks differing per module and
    per layer and scales per module, beside a layers_to_transform adapter in the same
    microbatch: the torch reference's logits and A / B gradients."""
    model = tiny_hf_model("llama", seed=4, num_hidden_layers=LAYERS)
    config, params = params_from_hf_model(model)
    bank = bank_with_nonzero_b(AdapterBank([_spec("patterns"), _spec("layers", name="b")], config), seed=3)
    ids, weights = _inputs(config, t=20)
    routing = bank.routing(((0, 9, 0), (9, 20, 1)), microbatch_index=0, num_rows=20, train=False)
    positions = torch.cat([torch.arange(9), torch.arange(11)])
    results = {}
    for backend in ("torch", "triton"):
        bank.zero_grad(set_to_none=True)
        logits = D.logits(params, bank.view(), ids, positions, torch.tensor([0, 9, 20]), routing, config=config,
                          backend=backend)
        (logits * weights).sum().backward()
        results[backend] = (logits.detach(), {n: p.grad.clone() for n, p in bank.named_parameters()})
    (ref, ref_grads), (fused, fused_grads) = results["torch"], results["triton"]
    assert (fused - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item())
    assert ref_grads.keys() == fused_grads.keys() and len(ref_grads) > 40
    for name, g in ref_grads.items():
        assert (fused_grads[name] - g).abs().max() < 1e-4 * max(1e-2, g.abs().max().item()), name


def test_every_example_of_the_options_page_is_a_valid_adapter():
    page = (Path(__file__).resolve().parents[2] / "docs" / "LORA_OPTIONS.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", page, flags=re.S)
    entries = [entry for block in blocks for entry in yaml.safe_load(block)]
    specs = [AdapterSpec(**entry) for entry in entries]
    assert len(specs) == 6
    by_name = {s.name: s for s in specs}
    assert by_name["legal"].dora and not any(s.dora for s in specs if s.name != "legal")
    assert by_name["big-rank"].scale == 16 / math.sqrt(128)
    assert by_name["shaped"].layout.module_rank(0, "down_proj") == 32
    assert by_name["shaped"].layout.module_rank(1, "down_proj") == 16
    assert by_name["top-half"].layout.transforms(16, "q_proj") and not by_name["top-half"].layout.transforms(3, "q_proj")


def test_fit_trains_and_exports_every_option_from_yaml(tmp_path, monkeypatch):
    """`lightning-lorafusion fit` on YAML adapters using the options: they train packed
    together, and each export loads in PEFT with its options."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lightning_lorafusion import cli
    from lightning_lorafusion.model.random_model import write_random_llama

    model_dir = write_random_llama(tmp_path / "base", vocab_size=256, seed=0, num_layers=2)
    cfg = yaml.safe_load(open(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"))
    cfg["model"]["base_model"] = str(model_dir)
    cfg["trainer"]["default_root_dir"] = str(tmp_path / "run")
    data = {"kind": "synthetic", "distribution": "xsum", "num_samples": 6, "seed": 1}
    cfg["model"]["adapters"] = [
        dict(name="rs", rank=4, alpha=8, use_rslora=True, loraplus_lr_ratio=4.0, lr=3e-3, global_batch_size=3,
             dataset=data),
        dict(name="shaped", rank=4, alpha=8, rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 6},
             alpha_pattern={"v_proj": 2.0}, layers_to_transform=[1], init_lora_weights="gaussian", lr=3e-3,
             global_batch_size=2, dataset=dict(data, seed=2)),
    ]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning-lorafusion"])
    cli.main(["fit", "--config", str(tmp_path / "run.yaml")])

    ids = torch.arange(3, 40)
    for name, options in (("rs", {"use_rslora": True}),
                          ("shaped", {"rank_pattern": {"q_proj": 2, "layers.1.mlp.down_proj": 6},
                                      "alpha_pattern": {"v_proj": 2.0}, "layers_to_transform": [1],
                                      "init_lora_weights": "gaussian"})):
        out = tmp_path / "run" / "adapters" / name
        written = json.loads((out / "adapter_config.json").read_text())
        assert {k: written[k] for k in options} == options
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            before = base(ids[None]).logits
            after = PeftModel.from_pretrained(base, str(out)).eval()(input_ids=ids[None]).logits
        assert (after - before).abs().max() > 1e-6  # trained: B moved off zero
    # the run's checkpoint serves like the export (the spec's layout travels with it)
    from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams

    ckpt = next((tmp_path / "run").rglob("*.ckpt"))
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    dirs = {f"{n}-dir": str(tmp_path / "run" / "adapters" / n) for n in ("rs", "shaped")}
    with Engine.from_pretrained(str(model_dir), dirs, EngineConfig(num_pages=64, page_size=4), device="cpu",
                                dtype=torch.float32) as engine:
        engine.add_adapters_from_checkpoint(str(ckpt))
        names = ("rs", "rs-dir", "shaped", "shaped-dir")
        out = engine.generate([GenerationRequest(prompt_token_ids=[5, 9, 17, 30], adapter=n, sampling=greedy)
                               for n in names])
    tokens = dict(zip(names, (r.token_ids for r in out)))
    assert tokens["rs"] == tokens["rs-dir"] and tokens["shaped"] == tokens["shaped-dir"]
