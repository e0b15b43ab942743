"""AdapterBank: PEFT-style init, validation, state round-trip, and multi-adapter routing."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from lightning_lorafusion.model import decoder as D
from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.model.hf_loading import params_from_hf_model
from lightning_lorafusion.specs import AdapterSpec, ConfigError

from _tiny_hf import tiny_hf_model

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def tiny():
    model = tiny_hf_model("qwen2", num_hidden_layers=2)
    config, params = params_from_hf_model(model)
    return model, config, params


def _specs():
    return [
        AdapterSpec(name="a", rank=4, alpha=8.0, seed=1),
        AdapterSpec(name="b", rank=7, alpha=3.0, target_modules=ATTN, seed=2),
        AdapterSpec(name="c", rank=2, alpha=16.0, target_modules=("v_proj", "down_proj"), seed=3),
    ]


def _randomize_b(bank, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in bank.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def test_init_is_peft_like_and_deterministic(tiny):
    _, config, _ = tiny
    bank = AdapterBank(_specs(), config)
    for a, spec in enumerate(bank.specs):
        for layer in range(config.num_layers):
            for module in spec.target_modules:
                f = bank.factors(a, layer, module)
                d_in, d_out = config.module_dims(module)
                assert f.lora_A.shape == (spec.rank, d_in) and f.lora_B.shape == (d_out, spec.rank)
                assert torch.count_nonzero(f.lora_B) == 0
                bound = 1 / math.sqrt(d_in)  # kaiming_uniform(a=sqrt(5)): U(-1/sqrt(fan_in), +)
                assert f.lora_A.abs().max() <= bound
                assert f.lora_A.abs().max() > 0.7 * bound
    # an adapter's init depends on its own seed only, not on its neighbours or its targets
    alone = AdapterBank([AdapterSpec(name="x", rank=7, alpha=1.0, target_modules=("k_proj",), seed=2)],
                        config)
    assert torch.equal(alone.factors(0, 1, "k_proj").lora_A, bank.factors(1, 1, "k_proj").lora_A)
    reseeded = AdapterBank([AdapterSpec(name="x", rank=7, alpha=1.0, target_modules=("k_proj",), seed=3)],
                           config)
    assert not torch.equal(alone.factors(0, 1, "k_proj").lora_A, reseeded.factors(0, 1, "k_proj").lora_A)
    assert not torch.equal(alone.factors(0, 0, "k_proj").lora_A, alone.factors(0, 1, "k_proj").lora_A)


def test_validation_errors_name_the_problem(tiny):
    _, config, _ = tiny
    kv = config.kv_size  # 24: k_proj is [H=48 -> 24]
    with pytest.raises(ConfigError, match=r"adapter 'big'.*rank=30.*k_proj.*in=48, out=24"):
        AdapterBank([AdapterSpec(name="big", rank=kv + 6, target_modules=("q_proj", "k_proj"))], config)
    AdapterBank([AdapterSpec(name="ok", rank=kv + 6, target_modules=("q_proj",))], config)
    with pytest.raises(ConfigError, match="repeated"):
        AdapterBank([AdapterSpec(name="d"), AdapterSpec(name="d", seed=1)], config)
    with pytest.raises(ConfigError, match="at least one"):
        AdapterBank([], config)


def test_state_dict_round_trip_and_per_adapter_parameters(tiny):
    _, config, _ = tiny
    bank = AdapterBank(_specs(), config)
    _randomize_b(bank)
    other = AdapterBank([AdapterSpec(name=s.name, rank=s.rank, alpha=s.alpha, seed=s.seed + 10,
                                     target_modules=s.target_modules) for s in _specs()], config)
    other.load_state_dict(bank.state_dict())
    for (k1, v1), (k2, v2) in zip(bank.state_dict().items(), other.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    assert "adapters.1.0.q_proj.lora_A" in bank.state_dict()
    groups = [bank.parameters_of(a) for a in range(3)]
    assert [len(g) for g in groups] == [2 * 7 * 2, 2 * 4 * 2, 2 * 2 * 2]
    ids = [{id(p) for p in g} for g in groups]
    assert not (ids[0] & ids[1]) and not (ids[1] & ids[2]) and sum(map(len, ids)) == len(list(bank.parameters()))
    assert all(p.requires_grad for p in bank.parameters())


def test_view_and_routing(tiny):
    _, config, _ = tiny
    bank = AdapterBank(_specs(), config)
    view = bank.view()
    w = view[(1, "v_proj")]
    assert all(t is not None for t in w.a)
    w = view[(0, "gate_proj")]
    assert w.a[1] is None and w.a[2] is None and w.a[0] is bank.factors(0, 0, "gate_proj").lora_A
    assert set(bank.view(layers=[1])) == {k for k in view if k[0] == 1}
    spec_drop = AdapterBank([AdapterSpec(name="p", rank=2, alpha=6.0, dropout=0.25, seed=9)], config)
    r = spec_drop.routing([(0, 5, 0)], microbatch_index=7, num_rows=8)
    assert (r.scales, r.dropout_p, r.seeds, r.microbatch_index) == ((3.0,), (0.25,), (9,), 7)
    assert spec_drop.routing([(0, 5, 0)], 7, 8, train=False).dropout_p == (0.0,)
    assert bank.names == ("a", "b", "c") and bank.index_of("c") == 2


def _merged_params(params, bank, adapter):
    """Reference: base weights with adapter's scale * B @ A folded in (no LoRA path at all)."""
    merged = copy.deepcopy(params)
    spec = bank.specs[adapter]
    for layer in range(len(params["layers"])):
        for module in spec.target_modules:
            f = bank.factors(adapter, layer, module)
            w = merged["layers"][layer][module]["weight"]
            merged["layers"][layer][module]["weight"] = w + spec.scale * (f.lora_B @ f.lora_A).detach()
    return merged


def test_packed_multi_adapter_logits_equal_merged_single_adapter_models(tiny):
    _, config, params = tiny
    bank = AdapterBank(_specs(), config)
    _randomize_b(bank)
    lengths, adapters = (6, 9, 4, 5), (0, 0, 1, 2)  # adapter 0 has two samples
    t = sum(lengths)
    ids = torch.randint(0, config.vocab_size, (t,), generator=torch.Generator().manual_seed(5))
    cu = torch.tensor([0, 6, 15, 19, 24])
    pos = torch.cat([torch.arange(n) for n in lengths])
    segments = ((0, 15, 0), (15, 19, 1), (19, 24, 2))
    routing = bank.routing(segments, microbatch_index=0, num_rows=t)
    with torch.no_grad():
        packed = D.logits(params, bank.view(), ids, pos, cu, routing, config=config)
        base = D.logits(params, None, ids, pos, cu, None, config=config)
        for (s, e), a in zip(zip(cu.tolist(), cu.tolist()[1:]), adapters):
            merged = _merged_params(params, bank, a)
            ref = D.logits(merged, None, ids[s:e], pos[s:e], torch.tensor([0, e - s]), None, config=config)
            # merging reorders the fp32 sums: 1e-4 relative to the logit scale
            assert (packed[s:e] - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item())
            assert (packed[s:e] - base[s:e]).abs().max() > 1e-3  # the adapter really acts


def test_gradients_reach_only_present_adapters_and_dropout_is_reproducible(tiny):
    _, config, params = tiny
    specs = [AdapterSpec(name="a", rank=3, dropout=0.3, seed=4), AdapterSpec(name="b", rank=5, seed=5)]
    bank = AdapterBank(specs, config)
    _randomize_b(bank, seed=1)
    t = 10
    ids = torch.randint(0, config.vocab_size, (t,), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1)
    cu, pos = torch.tensor([0, t]), torch.arange(t)
    routing = bank.routing(((0, t, 0),), microbatch_index=3, num_rows=t)
    loss = D.forward_loss_sums(params, bank.view(), ids, labels, pos, cu, routing, config=config)
    assert loss[1] == 0
    loss.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in bank.parameters_of(0))
    assert all(p.grad is None for p in bank.parameters_of(1))
    assert all(p.grad is None for layer in params["layers"] for p in (layer["attn_norm"],))
    with torch.no_grad():
        again = D.forward_loss_sums(params, bank.view(), ids, labels, pos, cu, routing, config=config)
        other_mb = bank.routing(((0, t, 0),), microbatch_index=4, num_rows=t)
        changed = D.forward_loss_sums(params, bank.view(), ids, labels, pos, cu, other_mb, config=config)
    assert torch.equal(again, loss.detach())  # same (seed, microbatch) -> same dropout masks
    assert not torch.equal(changed, loss.detach())


def test_checkpointed_layers_give_the_same_gradients(tiny):
    _, config, params = tiny
    specs = [AdapterSpec(name="a", rank=3, dropout=0.2, seed=4), AdapterSpec(name="b", rank=2, seed=5)]
    bank = AdapterBank(specs, config)
    _randomize_b(bank, seed=2)
    t = 12
    ids = torch.randint(0, config.vocab_size, (t,), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1)
    cu, pos = torch.tensor([0, 7, t]), torch.cat([torch.arange(7), torch.arange(5)])
    routing = bank.routing(((0, 7, 0), (7, t, 1)), microbatch_index=2, num_rows=t)
    grads = []
    for ckpt in (False, True):
        h = D.decoder_layers(params, bank.view(), D.embed(params, ids), pos, cu, routing,
                             config=config, checkpoint_layers=ckpt)
        sums = D.head_loss_sums(params, h, labels, routing.segments, 2, config=config, chunk_size=5)
        grads.append(torch.autograd.grad(sums.sum(), list(bank.parameters())))
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1, rtol=1e-6, atol=1e-7)


def test_deferred_a_draws_per_layer_equal_the_eager_bank(tiny):
    """``draw_a=False`` + ``draw_initial_a`` (what a pipeline stage does for its own layers on a
    random base) gives the eager bank's values; layers not drawn stay zero."""
    _, config, _ = tiny
    eager = AdapterBank(_specs(), config, dtype=torch.bfloat16).state_dict()
    lazy = AdapterBank(_specs(), config, dtype=torch.bfloat16, draw_a=False)
    assert all(not p.detach().any() for p in lazy.parameters())
    lazy.draw_initial_a([1], adapters=[0, 2])
    for key, value in lazy.state_dict().items():
        _, adapter, layer = key.split(".")[:3]
        drawn = key.endswith("lora_A") and layer == "1" and adapter in ("0", "2")
        torch.testing.assert_close(value, eager[key] if drawn else torch.zeros_like(value), rtol=0, atol=0,
                                   msg=key)
    lazy.draw_initial_a([0, 1])
    for key, value in lazy.state_dict().items():
        torch.testing.assert_close(value, eager[key], rtol=0, atol=0, msg=key)
