"""``model.precision: {base: fp8}`` through the Lightning module, with the emulated FP8 products.

The FP8 base quantizes activations and output gradients per token row, so packing must still
not change what an adapter learns: the joint run is compared with each adapter trained alone
on the same quantized base (test_equivalence's reference).
"""

import pytest
import torch

from lightning_lorafusion.kernels.fp8_linear import SCALE_KEY, WEIGHT_KEY
from lightning_lorafusion.specs import ConfigError
from lightning_lorafusion.training.module import LoRAFusionModule

from test_equivalence import fit_joint, tiny_specs, train_alone



def fp8(**options) -> dict:
    """The module's ``precision`` argument for an emulated FP8 base with these ``fp8`` options."""
    return {"precision": {"base": "fp8", "fp8": {"emulate": True, **options}}}


FP8 = fp8()


def test_base_precision_is_validated(tiny_model_dir):
    with pytest.raises(ConfigError, match="precision.base='fp4'.*allowed"):
        LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], precision={"base": "fp4"})
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs FP8 tensor cores.*no CUDA GPU"):
            LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], precision={"base": "fp8"})


def test_fp8_base_packed_training_equals_separate_runs(tiny_model_dir):
    specs = tiny_specs()  # no dropout: masks depend on the microbatch layout
    module, dm, _ = fit_joint(tiny_model_dir, specs, module_kwargs=FP8)
    assert module.steps_taken == [3, 3, 2]
    buffers = dict(module.named_buffers())
    q = buffers[f"base__layers__0__q_proj__{WEIGHT_KEY}"]
    assert q.dtype == torch.uint8 and buffers[f"base__layers__0__q_proj__{SCALE_KEY}"].dtype == torch.float32
    assert not any(n.endswith("proj__weight") for n in buffers), "the 16-bit projection weights are dropped"
    # the tiny model's embeddings are untied: its table is stored in e4m3 too, per-row scales
    assert buffers[f"base__embed__{WEIGHT_KEY}"].dtype == torch.uint8 and "base__embed" not in buffers
    for a in range(3):
        ref = train_alone(module, dm, a)  # module.base_params(): the same quantized base
        alone = dict(ref.adapters[0].named_parameters())
        for name, p in module.bank.adapters[a].named_parameters():
            torch.testing.assert_close(p, alone[name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=f"{specs[a].name}.{name}": f"{n}\n{m}")


def test_fp8_base_trains_under_bf16_true(tiny_model_dir):
    """Lightning's bf16-true casts floating buffers: the e4m3 bits are stored as uint8 and the
    power-of-two scales survive the cast exactly; the step runs and the adapters learn."""
    module, _, _ = fit_joint(tiny_model_dir, tiny_specs(), precision="bf16-true", module_kwargs=FP8)
    assert module.steps_taken == [3, 3, 2]
    buffers = dict(module.named_buffers())
    assert buffers[f"base__layers__1__down_proj__{WEIGHT_KEY}"].dtype == torch.uint8
    scale = buffers[f"base__layers__1__down_proj__{SCALE_KEY}"].float()
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())
    assert all(torch.isfinite(p).all() for p in module.bank.parameters())
    assert any(p.abs().sum() > 0 for n, p in module.bank.named_parameters() if ".b" in n or "lora_B" in n)


def test_fp8_base_with_activation_checkpointing(tiny_model_dir):
    """Recomputing a layer re-quantizes the same activations to the same bits: adapter
    gradients with and without checkpointing are identical on the FP8 base."""
    from lightning_lorafusion.model.adapter_bank import AdapterBank
    from lightning_lorafusion.model.decoder import decoder_layers, embed
    from lightning_lorafusion.model.hf_loading import load_base_model, quantize_base_fp8

    config, params, _ = load_base_model(tiny_model_dir)
    params = quantize_base_fp8(params)
    specs = tiny_specs(dropout=0.1)
    ids = torch.randint(4, config.vocab_size, (64,))
    grads = []
    for ckpt in (False, True):
        bank = AdapterBank(specs, config, dtype=torch.float32)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in bank.parameters():
                p.normal_(0, 0.1)
        routing = bank.routing([(0, 24, 0), (24, 40, 1), (40, 64, 2)], 0, 64)
        h = decoder_layers(params, bank.view(), embed(params, ids), torch.arange(64),
                           torch.tensor([0, 24, 64], dtype=torch.int32), routing, config=config,
                           checkpoint_layers=ckpt)
        (h.float() ** 2).mean().backward()
        grads.append([p.grad.clone() for p in bank.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fp8_exempt_layers_keep_the_outermost_layers_16_bit(tmp_path, tiny_model_factory):
    """``precision.fp8.exempt_layers: 1`` on a 4-layer base: layers 0 and 3 keep 16-bit projection weights,
    layers 1 and 2 hold e4m3 bits; packed training still equals each adapter trained alone on
    that mixed base (so the mixed layers route through both product paths correctly)."""
    model_dir = str(tiny_model_factory(tmp_path / "four", num_layers=4))
    specs = tiny_specs()
    module, dm, _ = fit_joint(model_dir, specs, module_kwargs=fp8(exempt_layers=1))
    buffers = dict(module.named_buffers())
    for i in range(4):
        quantized = f"base__layers__{i}__gate_proj__{WEIGHT_KEY}" in buffers
        assert quantized == (i in (1, 2)), i
        assert (f"base__layers__{i}__gate_proj__weight" in buffers) == (i in (0, 3)), i
    for a in range(3):
        ref = train_alone(module, dm, a)
        alone = dict(ref.adapters[0].named_parameters())
        for name, p in module.bank.adapters[a].named_parameters():
            # 5e-5 as in test_equivalence's fused-head case: packing changes fp32 summation order,
            # AdamW scales near-zero-gradient entries to O(lr) moves, and here an e4m3 rounding of
            # the mixed base may flip with it (one entry moved 1.84e-5 on a CI host). A loss
            # normalisation bug moves weights by ~1e-3.
            torch.testing.assert_close(p, alone[name], rtol=1e-4, atol=5e-5)


def test_fp8_exempt_layers_is_validated(tiny_model_dir):
    """The tiny base has 2 layers: exempting 1 from each end leaves nothing in FP8."""
    with pytest.raises(ConfigError, match=r"precision.fp8.exempt_layers=1: give an int n >= 0 with 2n < 2"):
        LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], **fp8(exempt_layers=1))
    with pytest.raises(ConfigError, match=r"precision.fp8.exempt_layers=-1"):
        LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], **fp8(exempt_layers=-1))
    with pytest.raises(ConfigError, match="applies only with model.precision.base: fp8"):
        LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], precision={"fp8": {"exempt_layers": 1}})


def test_fp8_fast_accumulation_option_sets_both_products(tiny_model_dir):
    """``model.precision.fp8.fast_accumulation`` (default true) sets the FP8 products' accumulation mode
    in the module's own decoder options, which its forward, pipeline stages and CUDA graphs
    pass on; building another module (or an engine) changes nothing for this one."""
    from lightning_lorafusion.kernels.options import KernelOptions

    module = LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], **FP8)
    assert module.precision.fp8.fast_accumulation is True
    assert module.decoder_options.kernels == KernelOptions(fp8_fast_accum_forward=True,
                                                           fp8_fast_accum_input_grad=True)
    off = LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], **fp8(fast_accumulation=False))
    assert off.decoder_options.kernels == KernelOptions(fp8_fast_accum_forward=False, fp8_fast_accum_input_grad=False)
    assert module.decoder_options.kernels.fp8_fast_accum_forward  # not overwritten by the second module
    stage = module.pipeline_stage(0, range(module.config.num_layers), True, True)
    assert stage.options is module.decoder_options


def test_quantize_base_fp8_keeps_the_named_layers_of_a_list_or_a_stage_mapping():
    from lightning_lorafusion.model.hf_loading import fp8_exempt_layer_set, quantize_base_fp8

    assert fp8_exempt_layer_set(6, 2) == {0, 1, 4, 5} and fp8_exempt_layer_set(6, 0) == set()
    w = {m: {"weight": torch.randn(16, 16)} for m in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                       "gate_proj", "up_proj", "down_proj")}
    as_list = quantize_base_fp8({"layers": [w, w, w]}, keep_layers={0, 2})
    assert [WEIGHT_KEY in lp["q_proj"] for lp in as_list["layers"]] == [False, True, False]
    assert as_list["layers"][0]["q_proj"]["weight"] is w["q_proj"]["weight"]
    stage = quantize_base_fp8({"layers": {4: w, 5: w}}, keep_layers={5})  # a pipeline stage's layers
    assert WEIGHT_KEY in stage["layers"][4]["down_proj"] and "weight" in stage["layers"][5]["down_proj"]
