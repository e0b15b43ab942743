"""NF4 base (QLoRA) in the functional decoder: quantized at load, or loaded from a transformers +
bitsandbytes 4-bit checkpoint as it is; the decoder on NF4 weights equals the decoder on the
same weights dequantized to fp32 (losses, logits and LoRA gradients)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lightning_lorafusion.kernels.nf4 import WEIGHT_KEY, Nf4Weight, dequantize_nf4_reference, is_nf4
from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.model.decoder import forward_loss_sums, logits
from lightning_lorafusion.model.hf_loading import _LAYER_KEYS, load_base_model, quantize_base_nf4
from lightning_lorafusion.model.random_model import write_random_llama
from lightning_lorafusion.specs import AdapterSpec, ConfigError

from _nf4_checkpoint import write_bnb_checkpoint

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # the Llama block


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # hidden 64 / intermediate 128: every projection spans whole 64-value blocks
    return write_random_llama(tmp_path_factory.mktemp("nf4_llama"), hidden_size=64, intermediate_size=128,
                              num_layers=2, num_heads=4, num_kv_heads=2)


def _dequantized(params):
    """The same pytree with every NF4 projection replaced by its fp32 dequantization."""
    def proj(p):
        if not is_nf4(p):
            return p
        out = {"weight": dequantize_nf4_reference(Nf4Weight.from_params(p))}
        if "bias" in p:
            out["bias"] = p["bias"]
        return out

    return {**params, "layers": [{k: proj(v) for k, v in lp.items()} for lp in params["layers"]]}


def _specs():
    return [AdapterSpec(name="a", rank=4, alpha=8, lr=1e-3, global_batch_size=1, seed=1,
                        dataset={"kind": "synthetic", "distribution": "xsum", "num_samples": 2, "seed": 1}),
            AdapterSpec(name="b", rank=2, alpha=2, lr=1e-3, global_batch_size=1, seed=2,
                        target_modules=("q_proj", "v_proj", "down_proj"),
                        dataset={"kind": "synthetic", "distribution": "xsum", "num_samples": 2, "seed": 2})]


def _loss_and_grads(params, config, seed=0):
    bank = AdapterBank(_specs(), config, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in bank.parameters():
            p.normal_(0, 0.1)
    t = 40
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, config.vocab_size, (t,), generator=gen)
    labels = torch.randint(4, config.vocab_size, (t,), generator=gen)
    routing = bank.routing([(0, 24, 0), (24, 40, 1)], 0, t)
    cu = torch.tensor([0, 24, 40], dtype=torch.int32)
    pos = torch.cat([torch.arange(24), torch.arange(16)])
    loss = forward_loss_sums(params, bank.view(), ids, labels, pos, cu, routing, config=config)
    loss.sum().backward()
    return loss.detach(), [p.grad.clone() for p in bank.parameters()]


def test_quantize_base_nf4_quantizes_projections_only(model_dir):
    config, params, _ = load_base_model(str(model_dir))
    nf4 = quantize_base_nf4(params)
    assert nf4["embed"] is params["embed"] and nf4["lm_head"] is params["lm_head"] and nf4["norm"] is params["norm"]
    for lp, orig in zip(nf4["layers"], params["layers"]):
        assert lp["attn_norm"] is orig["attn_norm"] and lp["mlp_norm"] is orig["mlp_norm"]
        for name in PROJECTIONS:
            assert is_nf4(lp[name]) and "weight" not in lp[name]
            w = Nf4Weight.from_params(lp[name])
            assert w.nested and w.blocksize == 64 and w.shape == orig[name]["weight"].shape
            # 4-bit: close to the original, not equal
            err = (dequantize_nf4_reference(w) - orig[name]["weight"]).abs().max()
            assert 0 < err <= 0.2 * orig[name]["weight"].abs().max()
    assert quantize_base_nf4(nf4)["layers"][0]["q_proj"] is nf4["layers"][0]["q_proj"]  # kept, not requantized


def test_nf4_decoder_equals_dequantized_model(model_dir):
    """Losses and every LoRA gradient of the NF4 decoder equal those of the fp32 decoder on the
    dequantized weights (the forward products are the same F.linear on the same values; the
    input gradient is summed in another order, hence the rounding tolerance)."""
    config, params, _ = load_base_model(str(model_dir))
    nf4 = quantize_base_nf4(params)
    loss_q, grads_q = _loss_and_grads(nf4, config)
    loss_d, grads_d = _loss_and_grads(_dequantized(nf4), config)
    loss_orig, _ = _loss_and_grads(params, config)
    torch.testing.assert_close(loss_q, loss_d, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(loss_q, loss_orig, rtol=1e-6, atol=1e-6)  # it really ran on 4-bit weights
    for gq, gd in zip(grads_q, grads_d):
        torch.testing.assert_close(gq, gd, rtol=1e-5, atol=1e-6)


def test_nf4_activation_checkpointing_gives_the_same_gradients(model_dir):
    """Recomputing a layer dequantizes the same 4-bit weights to the same values: LoRA
    gradients with and without activation checkpointing are identical on the NF4 base."""
    from lightning_lorafusion.model.decoder import decoder_layers, embed

    config, params, _ = load_base_model(str(model_dir))
    nf4 = quantize_base_nf4(params)
    ids = torch.randint(4, config.vocab_size, (32,), generator=torch.Generator().manual_seed(1))
    grads = []
    for ckpt in (False, True):
        bank = AdapterBank(_specs(), config, dtype=torch.float32)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in bank.parameters():
                p.normal_(0, 0.1)
        routing = bank.routing([(0, 16, 0), (16, 32, 1)], 0, 32)
        h = decoder_layers(nf4, bank.view(), embed(nf4, ids), torch.arange(32),
                           torch.tensor([0, 16, 32], dtype=torch.int32), routing, config=config,
                           checkpoint_layers=ckpt)
        (h ** 2).mean().backward()
        grads.append([p.grad.clone() for p in bank.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("double_quant", [True, False])
def test_bitsandbytes_checkpoint_loads_as_it_is(model_dir, tmp_path, double_quant):
    """A checkpoint saved by transformers + bitsandbytes in 4-bit loads with its bytes kept;
    our dequantization of each projection is bitsandbytes' bit for bit, and the decoder's logits
    equal the fp32 decoder's on bitsandbytes' dequantized weights exactly and transformers' own
    4-bit model's up to matmul rounding."""
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    from safetensors.torch import load_file

    hf_model = write_bnb_checkpoint(str(model_dir), tmp_path / "bnb", double_quant=double_quant)
    state = load_file(str(tmp_path / "bnb" / "model.safetensors"))
    config, params, _ = load_base_model(str(tmp_path / "bnb"))
    dense_layers = []
    for i, lp in enumerate(params["layers"]):
        dense = dict(lp)
        for ours in PROJECTIONS:
            key = f"model.layers.{i}.{_LAYER_KEYS[ours]}.weight"
            assert is_nf4(lp[ours]) and torch.equal(lp[ours][WEIGHT_KEY].view(-1), state[key].view(-1))
            qs = bnb.functional.QuantState.from_dict(
                {k[len(key) + 1:]: v for k, v in state.items() if k.startswith(key + ".")}, device=torch.device("cpu"))
            theirs_w = bnb.functional.dequantize_4bit(state[key], qs)
            w = Nf4Weight.from_params(lp[ours])
            assert w.nested == double_quant
            assert torch.equal(dequantize_nf4_reference(w), theirs_w)
            dense[ours] = {"weight": theirs_w}
        dense_layers.append(dense)
    t = 12
    ids = torch.randint(4, config.vocab_size, (t,), generator=torch.Generator().manual_seed(0))
    cu, pos = torch.tensor([0, t], dtype=torch.int32), torch.arange(t)
    got = logits(params, None, ids, pos, cu, None, config=config)
    want = logits({**params, "layers": dense_layers}, None, ids, pos, cu, None, config=config)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.no_grad():
        hf_logits = hf_model(ids[None]).logits[0].float()
    torch.testing.assert_close(got, hf_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}, "bnb_4bit_quant_type='fp4'"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "load_in_4bit=None"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
])
def test_other_quantized_checkpoints_are_refused(model_dir, tmp_path, qc, message):
    dst = tmp_path / "q"
    shutil.copytree(model_dir, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(ConfigError, match=f"quantization_config.*{message}.*not supported"):
        load_base_model(str(dst))
