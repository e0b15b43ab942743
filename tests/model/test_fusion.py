"""Elementwise fusion (torch.compile of norm/RoPE/SwiGLU groups) changes nothing but speed.

CI traces the fused groups with the ``aot_eager`` compiler (graph capture and the AOTAutograd
backward, no code generation, which would take minutes on 2 cores); the inductor path runs on
the GPU in scripts/bench_e2e.py and scripts/bench_convergence.py."""

import pytest
import torch

from _tiny_hf import tiny_hf_model
from lightning_lorafusion.model import decoder as D
from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.model.hf_loading import params_from_hf_model
from lightning_lorafusion.specs import AdapterSpec


@pytest.fixture
def fusion_mode():
    yield D.set_elementwise_fusion
    D.set_elementwise_fusion("auto")


def _loss_and_grads(config, params, bank, ids, labels, pos, cu):
    routing = bank.routing([(0, 12, 0), (12, 20, 1)], 5, 20)
    sums = D.forward_loss_sums(params, bank.view(), ids, labels, pos, cu, routing, config=config)
    grads = torch.autograd.grad(sums.sum(), list(bank.parameters()))
    return sums.detach(), grads


def test_fused_layers_equal_eager_layers(fusion_mode):
    model = tiny_hf_model("qwen2", num_hidden_layers=2)  # qkv bias too
    config, params = params_from_hf_model(model)
    specs = [AdapterSpec(name="a", rank=4, alpha=8, dropout=0.1, seed=1),
             AdapterSpec(name="b", rank=2, alpha=2, seed=2, target_modules=("q_proj", "down_proj"))]
    bank = AdapterBank(specs, config)
    with torch.no_grad():  # non-zero B so LoRA terms reach every fused group
        for p in bank.parameters():
            p.normal_(0.0, 0.1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (20,), generator=g)
    labels = torch.randint(0, config.vocab_size, (20,), generator=g)
    cu = torch.tensor([0, 7, 12, 20], dtype=torch.int32)
    pos = torch.cat([torch.arange(7), torch.arange(5), torch.arange(8)])

    fusion_mode("off")
    ref_sums, ref_grads = _loss_and_grads(config, params, bank, ids, labels, pos, cu)
    fusion_mode("on", compiler="aot_eager")
    assert D._fuse("torch", ids)
    sums, grads = _loss_and_grads(config, params, bank, ids, labels, pos, cu)
    assert any(fn is D._swiglu for fn, _ in D._COMPILED)  # the compiled groups really ran
    torch.testing.assert_close(sums, ref_sums, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(w.abs().sum() > 0 for w in ref_grads)


def test_fusion_mode_rules(fusion_mode):
    x = torch.zeros(2)
    fusion_mode("auto")
    assert not D._fuse("triton", x)  # CPU tensor: eager
    assert not D._fuse("torch", x)
    fusion_mode("off")
    assert not D._fuse("triton", x)
    with pytest.raises(ValueError, match="'auto', 'on', 'off'"):
        D.set_elementwise_fusion("always")
