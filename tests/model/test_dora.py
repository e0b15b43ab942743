"""DoRA adapters equal PEFT's ``use_dora=True``: forward and every gradient (A, B, magnitude) on
packed microbatches with DoRA and plain LoRA adapters side by side, dropout included; the
initial magnitude; export (``lora_magnitude_vector``) into ``peft.PeftModel``; import of a
PEFT-trained DoRA adapter. All fp32 on the CPU."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from lightning_lorafusion.kernels.dora import dora_row_norm
from lightning_lorafusion.kernels.dropout import dropout_keep_mask, dropout_offset
from lightning_lorafusion.model import decoder as D
from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.model.hf_loading import params_from_hf_model
from lightning_lorafusion.model.peft_io import export_peft_adapter, import_peft_adapter, peft_key
from lightning_lorafusion.specs import ATTENTION_MODULES, IGNORE_INDEX, AdapterSpec, ConfigError

from _tiny_hf import bank_with_nonzero_b, tiny_hf_model

SPECS = [
    AdapterSpec(name="dora-all", rank=4, alpha=8.0, dora=True, seed=1),
    AdapterSpec(name="plain", rank=3, alpha=6.0, target_modules=("q_proj", "v_proj", "down_proj"), seed=2),
    AdapterSpec(name="dora-some", rank=5, alpha=5.0, dora=True,
                target_modules=("k_proj", "o_proj", "gate_proj", "up_proj"), seed=3),
]
# per adapter, the lengths of its samples in the packed microbatch (segments in this order)
SAMPLES = [(7, 5), (6,), (4, 8)]
SLOTS = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}


def _dora_bank(specs, config, params, seed=0):
    """A bank with non-zero B and magnitudes moved off their initial row norms (so g != 1 and
    every term of the forward and the gradients is live)."""
    bank = AdapterBank(specs, config)
    bank.init_dora(params)
    bank_with_nonzero_b(bank, seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in bank.named_parameters():
            if name.endswith("lora_magnitude"):
                p.mul_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return bank


def _packed(config, samples, seed=5):
    """(ids, labels, positions, cu_seqlens, segments, per-adapter sample ids) of one microbatch."""
    g = torch.Generator().manual_seed(seed)
    ids, labels, pos, cu, segments, per_adapter = [], [], [], [0], [], []
    for adapter, lengths in enumerate(samples):
        start = len(ids)
        mine = []
        for n in lengths:
            s = torch.randint(0, config.vocab_size, (n,), generator=g)
            mine.append(s)
            ids += s.tolist()
            labels += s[1:].tolist() + [IGNORE_INDEX]
            pos += list(range(n))
            cu.append(len(ids))
        segments.append((start, len(ids), adapter))
        per_adapter.append(mine)
    return (torch.tensor(ids), torch.tensor(labels), torch.tensor(pos), torch.tensor(cu), tuple(segments),
            per_adapter)


def _peft_model(family, seed, bank, tmp_path, adapters):
    """A fresh HF model with our exported adapters loaded into PEFT (trainable, train mode)."""
    from peft import PeftModel

    model = tiny_hf_model(family, seed=seed)
    first, *rest = adapters
    dirs = {a: export_peft_adapter(bank, a, tmp_path / bank.specs[a].name) for a in adapters}
    peft_model = PeftModel.from_pretrained(model, dirs[first], adapter_name=bank.specs[first].name,
                                           is_trainable=True)
    for a in rest:
        peft_model.load_adapter(dirs[a], adapter_name=bank.specs[a].name, is_trainable=True)
    return peft_model.train()


def _peft_param(peft_model, name, layer, module, factor):
    block = "self_attn" if module in ATTENTION_MODULES else "mlp"
    suffix = {"lora_A": f"lora_A.{name}.weight", "lora_B": f"lora_B.{name}.weight",
              "lora_magnitude": f"lora_magnitude_vector.{name}.weight"}[factor]
    return peft_model.get_parameter(f"base_model.model.model.layers.{layer}.{block}.{module}.{suffix}")


def _peft_loss(peft_model, samples):
    loss = 0.0
    for s in samples:
        logits = peft_model(input_ids=s[None]).logits[0]
        loss = loss + F.cross_entropy(logits[:-1].float(), s[1:], reduction="sum")
    return loss


def _check_grads(bank, a, peft_model, tol):
    spec = bank.specs[a]
    checked = 0
    for layer in range(bank.config.num_layers):
        for module in spec.target_modules:
            f = bank.factors(a, layer, module)
            for factor in ("lora_A", "lora_B", "lora_magnitude"):
                ours = getattr(f, factor)
                if ours is None:
                    assert factor == "lora_magnitude" and not spec.dora
                    continue
                ref = _peft_param(peft_model, spec.name, layer, module, factor).grad
                scale = max(ref.abs().max().item(), 1e-3)
                assert ours.grad is not None, (spec.name, layer, module, factor)
                assert (ours.grad - ref).abs().max().item() <= tol * scale, (spec.name, layer, module, factor)
                checked += 1
    return checked


@pytest.mark.parametrize("family,backend", [("llama", "torch"), ("qwen2", "torch"), ("llama", "triton")])
def test_packed_dora_and_lora_adapters_equal_peft_forward_and_grads(tmp_path, family, backend):
    model = tiny_hf_model(family, seed=7)
    config, params = params_from_hf_model(model)
    bank = _dora_bank(SPECS, config, params)
    ids, labels, pos, cu, segments, per_adapter = _packed(config, SAMPLES)
    routing = bank.routing(segments, microbatch_index=3, num_rows=len(ids))
    sums = D.forward_loss_sums(params, bank.view(), ids, labels, pos, cu, routing, config=config, backend=backend)
    sums.sum().backward()
    peft_model = _peft_model(family, 7, bank, tmp_path, [0, 1, 2])
    for a, spec in enumerate(SPECS):
        peft_model.set_adapter(spec.name)
        peft_model.zero_grad(set_to_none=True)
        loss = _peft_loss(peft_model, per_adapter[a])
        loss.backward()
        assert abs(sums[a].item() - loss.item()) <= 1e-5 * max(1.0, loss.item()), spec.name
        assert _check_grads(bank, a, peft_model, tol=1e-4) >= 2 * len(spec.target_modules) * config.num_layers


class _HashDropout(torch.nn.Module):
    """Stands in for PEFT's ``nn.Dropout`` with the mask our kernels draw for rows ``0..T``."""

    def __init__(self, seed: int, offset: int, p: float) -> None:
        super().__init__()
        self.seed, self.offset, self.p = seed, offset, p

    def forward(self, x):
        keep = dropout_keep_mask(self.seed, self.offset, 0, x.shape[-2], x.shape[-1], self.p, x.device)
        return x * keep.to(x.dtype) / (1.0 - self.p)


def test_dora_with_dropout_equals_peft_given_the_same_mask(tmp_path):
    """With dropout, PEFT runs the frozen product again on the dropped-out input; so do we."""
    spec = AdapterSpec(name="dropped", rank=4, alpha=8.0, dropout=0.3, dora=True, seed=4)
    model = tiny_hf_model("llama", seed=9)
    config, params = params_from_hf_model(model)
    bank = _dora_bank([spec], config, params, seed=1)
    ids, labels, pos, cu, segments, per_adapter = _packed(config, [(11,)], seed=2)
    mb = 2
    routing = bank.routing(segments, microbatch_index=mb, num_rows=len(ids))
    sums = D.forward_loss_sums(params, bank.view(), ids, labels, pos, cu, routing, config=config)
    sums.sum().backward()
    peft_model = _peft_model("llama", 9, bank, tmp_path, [0])
    for layer in range(config.num_layers):
        for module in spec.target_modules:
            block = "self_attn" if module in ATTENTION_MODULES else "mlp"
            lora_layer = peft_model.get_submodule(f"base_model.model.model.layers.{layer}.{block}.{module}")
            lora_layer.lora_dropout[spec.name] = _HashDropout(
                spec.seed, dropout_offset(mb, layer, SLOTS[module]), spec.dropout)
    loss = _peft_loss(peft_model, per_adapter[0])
    loss.backward()
    assert abs(sums[0].item() - loss.item()) <= 1e-5 * loss.item()
    assert _check_grads(bank, 0, peft_model, tol=1e-4) == 3 * 7 * config.num_layers


def test_initial_magnitude_is_peft_s(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = tiny_hf_model("qwen2", seed=3)
    config, params = params_from_hf_model(model)
    bank = AdapterBank([SPECS[0]], config)
    bank.init_dora(params)
    peft_model = get_peft_model(tiny_hf_model("qwen2", seed=3),
                                LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True))
    for layer in range(config.num_layers):
        for module in SPECS[0].target_modules:
            ours = bank.factors(0, layer, module).lora_magnitude
            ref = _peft_param(peft_model, "default", layer, module, "lora_magnitude")
            torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_row_norm_from_rank_r_products_equals_the_materialised_norm():
    g = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((47, 123), (5, 123), (47, 5)))
    ours = dora_row_norm(w, a, b, 1.7)
    ref = torch.linalg.norm(w + 1.7 * (b @ a), dim=1)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=1e-6)


def test_export_writes_magnitudes_and_peft_loads_it_with_equal_logits(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    model = tiny_hf_model("llama", seed=11)
    config, params = params_from_hf_model(model)
    bank = _dora_bank(SPECS, config, params, seed=3)
    out = export_peft_adapter(bank, 2, tmp_path / "dora-some")
    cfg = json.loads((out / "adapter_config.json").read_text())
    state = load_file(str(out / "adapter_model.safetensors"))
    assert cfg["use_dora"] is True
    key = "base_model.model.model.layers.1.self_attn.o_proj.lora_magnitude_vector"
    torch.testing.assert_close(state[key], bank.factors(2, 1, "o_proj").lora_magnitude.detach())
    assert sum(k.endswith("lora_magnitude_vector") for k in state) == 4 * config.num_layers
    t = 13
    ids = torch.randint(0, config.vocab_size, (t,), generator=torch.Generator().manual_seed(4))
    routing = bank.routing(((0, t, 2),), microbatch_index=0, num_rows=t, train=False)
    with torch.no_grad():
        ours = D.logits(params, bank.view(), ids, torch.arange(t), torch.tensor([0, t]), routing, config=config)
        peft_model = PeftModel.from_pretrained(model, out).eval()
        ref = peft_model(input_ids=ids[None]).logits[0]
        peft_model.base_model.disable_adapter_layers()
        base = peft_model(input_ids=ids[None]).logits[0]
    scale = max(1.0, ref.abs().max().item())
    assert (ours - ref).abs().max() < 1e-4 * scale
    assert (ref - base).abs().max() > 1e-2 * scale  # the adapter changes the model


def _peft_trained_dora_dir(tmp_path, family="llama", seed=5):
    """A DoRA adapter trained by PEFT itself for a few AdamW steps, saved by ``save_pretrained``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(tiny_hf_model(family, seed=seed), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], use_dora=True))
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=2e-2)
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(seed))
    for _ in range(4):
        opt.zero_grad()
        peft_model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    out = tmp_path / "peft-dora"
    peft_model.save_pretrained(out)
    return out, peft_model.eval()


def test_peft_trained_dora_adapter_imports_with_equal_logits(tmp_path):
    out, peft_model = _peft_trained_dora_dir(tmp_path)
    config, params = params_from_hf_model(tiny_hf_model("llama", seed=5))
    spec = AdapterSpec(name="imported", rank=4, alpha=8.0, dora=True,
                       target_modules=("q_proj", "v_proj", "up_proj", "down_proj"))
    bank = AdapterBank([spec], config)
    bank.init_dora(params)
    import_peft_adapter(bank, 0, out)
    ref_magnitude = _peft_param(peft_model, "default", 1, "up_proj", "lora_magnitude")
    torch.testing.assert_close(bank.factors(0, 1, "up_proj").lora_magnitude, ref_magnitude)
    t = 10
    ids = torch.randint(0, config.vocab_size, (t,), generator=torch.Generator().manual_seed(8))
    routing = bank.routing(((0, t, 0),), microbatch_index=0, num_rows=t, train=False)
    with torch.no_grad():
        ours = D.logits(params, bank.view(), ids, torch.arange(t), torch.tensor([0, t]), routing, config=config)
        ref = peft_model(input_ids=ids[None]).logits[0]
    assert (ours - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item())
    plain = AdapterBank([AdapterSpec(name="plain", rank=4, alpha=8.0, target_modules=spec.target_modules)], config)
    with pytest.raises(ConfigError, match=r"dora: True there, False in the config"):
        import_peft_adapter(plain, 0, out)


def test_dora_spec_is_checked():
    with pytest.raises(ConfigError, match=r"adapter 'x': dora='yes' must be true or false"):
        AdapterSpec(name="x", dora="yes")
    assert peft_key(0, "q_proj", "lora_A").endswith("q_proj.lora_A.weight")


def _dequantized(params):
    """The pytree with each quantized projection replaced by its dequantized fp32 weight."""
    out = dict(params)
    out["layers"] = [{k: ({"weight": D.frozen_weight(v)[0].dequantize(torch.float32), **(
        {"bias": v["bias"]} if "bias" in v else {})} if isinstance(v, dict) and k.endswith("proj") else v)
        for k, v in lp.items()} for lp in params["layers"]]
    return out


@pytest.mark.parametrize("base", ["nf4", "fp8"])
def test_dora_on_a_quantized_base_equals_dora_on_its_dequantized_weights(base):
    """Row norms, magnitudes' init and the forward/gradients read the dequantized weights."""
    from lightning_lorafusion.model.hf_loading import quantize_base_fp8, quantize_base_nf4

    model = tiny_hf_model("llama", seed=13)
    config, params = params_from_hf_model(model)
    quantized = quantize_base_nf4(params) if base == "nf4" else quantize_base_fp8(params)
    dense = _dequantized(quantized)
    specs = [SPECS[0], dataclasses.replace(SPECS[1], dropout=0.2)]
    ids, labels, pos, cu, segments, _ = _packed(config, SAMPLES[:2])
    results = []
    for p in (quantized, dense):
        bank = AdapterBank(specs, config)
        bank.init_dora(p)  # magnitudes: the row norms of the weights as the base holds them
        bank_with_nonzero_b(bank, 0)
        routing = bank.routing(segments, microbatch_index=1, num_rows=len(ids))
        sums = D.forward_loss_sums(p, bank.view(), ids, labels, pos, cu, routing, config=config)
        sums.sum().backward()
        results.append((sums.detach(), {n: t.grad for n, t in bank.named_parameters()},
                        bank.factors(0, 1, "down_proj").lora_magnitude.detach().clone()))
    (s_q, g_q, m_q), (s_d, g_d, m_d) = results
    torch.testing.assert_close(m_q, m_d)
    if base == "nf4":  # NF4: the frozen products read exactly the dequantized weights
        torch.testing.assert_close(s_q, s_d, rtol=1e-5, atol=1e-5)
        for name in g_d:
            torch.testing.assert_close(g_q[name], g_d[name], rtol=1e-5, atol=1e-5, msg=name)
        return
    # FP8's frozen products also quantize the activations and gradients (plain LoRA's gradients
    # move by ~25% on this tiny model too): the loss is close, the gradients only finite
    torch.testing.assert_close(s_q, s_d, rtol=0.02, atol=0.0)
    assert all(bool(torch.isfinite(g).all()) for g in g_q.values())
