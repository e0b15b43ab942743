"""``model.precision.base: nf4`` (QLoRA) through the Lightning module and the console script."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_lorafusion.kernels.nf4 import ABSMAX_KEY, WEIGHT_KEY, Nf4Weight, dequantize_nf4_reference
from lightning_lorafusion.specs import ConfigError
from lightning_lorafusion.training.module import LoRAFusionModule

from _nf4_checkpoint import write_bnb_checkpoint
from test_cli import REPO, assert_clean_output, run_cli
from test_equivalence import fit_joint, tiny_specs, train_alone

NF4 = {"precision": {"base": "nf4"}}
TINY = os.path.join(REPO, "configs", "tiny.yaml")


def test_nf4_packed_training_equals_separate_runs(tiny_model_dir):
    """The base's projections are held 4-bit (uint8 codes, int32-stored absmax: no float
    buffer for a dtype cast to touch); packing several adapters still equals training each
    alone on the same NF4 base."""
    specs = tiny_specs()
    module, dm, _ = fit_joint(tiny_model_dir, specs, module_kwargs=NF4)
    assert module.steps_taken == [3, 3, 2]
    buffers = dict(module.named_buffers())
    assert buffers[f"base__layers__0__q_proj__{WEIGHT_KEY}"].dtype == torch.uint8
    assert not buffers[f"base__layers__1__down_proj__{ABSMAX_KEY}"].is_floating_point()
    assert not any(n.endswith("proj__weight") for n in buffers), "the 16-bit projection weights are dropped"
    assert buffers["base__embed"].is_floating_point()  # embeddings and norms stay
    for a in range(3):
        ref = train_alone(module, dm, a)  # module.base_params(): the same NF4 base
        alone = dict(ref.adapters[0].named_parameters())
        for name, p in module.bank.adapters[a].named_parameters():
            torch.testing.assert_close(p, alone[name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=f"{specs[a].name}.{name}": f"{n}\n{m}")


def test_nf4_base_survives_bf16_true(tiny_model_dir):
    """Lightning's bf16-true casts floating buffers; the NF4 state has none, so the 4-bit
    weights dequantize to the same values after the cast and training runs."""
    module, _, _ = fit_joint(tiny_model_dir, tiny_specs(), precision="bf16-true", module_kwargs=NF4)
    assert module.steps_taken == [3, 3, 2]
    reference = LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], backend="torch", **NF4)
    got, want = module.base_params()["layers"][1]["up_proj"], reference.base_params()["layers"][1]["up_proj"]
    assert torch.equal(dequantize_nf4_reference(Nf4Weight.from_params(got)),
                       dequantize_nf4_reference(Nf4Weight.from_params(want)))
    assert all(torch.isfinite(p).all() for p in module.bank.parameters())


def test_nf4_fit_console_script_exports_adapters(tiny_model_dir, tmp_path):
    out = run_cli(["fit", "--config", TINY, "--model.base_model", tiny_model_dir, "--model.precision.base", "nf4",
                   "--trainer.default_root_dir", str(tmp_path / "run")], tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    assert_clean_output(out)
    for name, rank in (("xsum", 4), ("cnndm", 2)):
        d = tmp_path / "run" / "adapters" / name
        assert json.loads((d / "adapter_config.json").read_text())["r"] == rank
        tensors = load_file(str(d / "adapter_model.safetensors"))
        lora_b = [t for k, t in tensors.items() if "lora_B" in k]
        assert lora_b and any(t.abs().sum() > 0 for t in lora_b)  # B starts at zero: it trained


def test_bitsandbytes_checkpoint_needs_precision_base_nf4(tiny_model_dir, tmp_path):
    pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is not installed")
    write_bnb_checkpoint(Path(tiny_model_dir), tmp_path / "bnb")
    with pytest.raises(ConfigError, match="bitsandbytes NF4 4-bit checkpoint; set model.precision.base: nf4"):
        LoRAFusionModule(base_model=str(tmp_path / "bnb"), adapters=tiny_specs()[:1], backend="torch")
    module = LoRAFusionModule(base_model=str(tmp_path / "bnb"), adapters=tiny_specs()[:1], backend="torch", **NF4)
    assert module.base_params()["layers"][0]["k_proj"][WEIGHT_KEY].dtype == torch.uint8


def test_random_base_is_quantized_to_nf4_at_setup(tmp_path):
    """A ``random:`` base is drawn in setup(); with ``precision.base: nf4`` its projections are
    quantized there (embeddings and norms stay)."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512).save_pretrained(tmp_path / "cfg")
    module = LoRAFusionModule(base_model=f"random:{tmp_path / 'cfg'}", adapters=tiny_specs()[:1], backend="torch",
                              **NF4)
    module.setup("fit")
    buffers = dict(module.named_buffers())
    assert buffers[f"base__layers__1__gate_proj__{WEIGHT_KEY}"].dtype == torch.uint8
    assert not any(n.endswith("proj__weight") for n in buffers) and buffers["base__embed"].is_floating_point()


def test_nf4_gemm_option_reaches_the_decoder_and_is_checked(tiny_model_dir):
    """``model.precision.nf4.gemm`` becomes the decoder's ``KernelOptions.nf4_gemm``; a wrong
    value, or the option without an NF4 base, is a ConfigError naming the field."""
    fused = {"precision": {"base": "nf4", "nf4": {"gemm": "fused"}}}
    module = LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], backend="torch", **fused)
    assert module.decoder_options.kernels.nf4_gemm == "fused"
    default = LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], backend="torch", **NF4)
    assert default.decoder_options.kernels.nf4_gemm == "auto"
    with pytest.raises(ConfigError, match=r"model.precision.nf4.gemm='tiles'; allowed: \('auto', 'buffer', 'fused'\)"):
        LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1],
                         precision={"base": "nf4", "nf4": {"gemm": "tiles"}})
    with pytest.raises(ConfigError, match="model.precision.nf4.gemm='fused' applies only with model.precision.base: nf4"):
        LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], precision={"nf4": {"gemm": "fused"}})


def test_mlp_recompute_option_trains_the_same_adapters(tiny_model_dir):
    """``model.mlp_recompute`` reaches the decoder; training with the MLP recomputed gives the
    same adapters, bit for bit, as keeping it (NF4 base, several adapters packed); a wrong
    value, or the option with an FP8 base, is a ConfigError naming the field."""
    kept, _, _ = fit_joint(tiny_model_dir, tiny_specs(), module_kwargs=NF4)
    rebuilt, _, _ = fit_joint(tiny_model_dir, tiny_specs(), module_kwargs={**NF4, "mlp_recompute": "gate_up"})
    assert rebuilt.decoder_options.mlp_recompute == "gate_up" and kept.decoder_options.mlp_recompute == "none"
    assert rebuilt.steps_taken == kept.steps_taken == [3, 3, 2]
    for (name, a), (_, b) in zip(kept.bank.named_parameters(), rebuilt.bank.named_parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ConfigError, match=r"model.mlp_recompute='mlp'; allowed: \('none', 'activation', 'gate_up'\)"):
        LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], mlp_recompute="mlp")
    with pytest.raises(ConfigError, match="model.mlp_recompute='activation' does not apply to an FP8 base"):
        LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], dtype="bfloat16",
                         mlp_recompute="activation", precision={"base": "fp8", "fp8": {"emulate": True}})


def test_norm_recompute_option_trains_the_same_adapters(tiny_model_dir):
    """``model.norm_recompute`` reaches the decoder; with the norm outputs rebuilt in backward
    (beside the recomputed activation) training gives the same adapters, bit for bit, as keeping
    them (NF4 base, several adapters packed); a value that is not a bool is a ConfigError."""
    kept, _, _ = fit_joint(tiny_model_dir, tiny_specs(), module_kwargs=NF4)
    rebuilt, _, _ = fit_joint(tiny_model_dir, tiny_specs(),
                              module_kwargs={**NF4, "norm_recompute": True, "mlp_recompute": "activation"})
    assert rebuilt.decoder_options.norm_recompute and not kept.decoder_options.norm_recompute
    assert rebuilt.steps_taken == kept.steps_taken == [3, 3, 2]
    for (name, a), (_, b) in zip(kept.bank.named_parameters(), rebuilt.bank.named_parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ConfigError, match="model.norm_recompute='yes' must be true or false"):
        LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], norm_recompute="yes")


def test_recompute_layer_counts_reach_the_decoder_and_are_checked(tiny_model_dir):
    """``model.mlp_recompute_layers`` / ``norm_recompute_layers`` reach ``decoder_options`` (the
    first n layers rebuild, the others keep); null is every layer; anything but an int >= 0 is a
    ConfigError naming the field."""
    module = LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], mlp_recompute="activation",
                              norm_recompute=True, mlp_recompute_layers=1, norm_recompute_layers=0)
    options = module.decoder_options
    assert (options.mlp_recompute_layers, options.norm_recompute_layers) == (1, 0)
    assert (options.for_layer(0).mlp_recompute, options.for_layer(1).mlp_recompute) == ("activation", "none")
    assert not options.for_layer(0).norm_recompute
    default = LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1]).decoder_options
    assert default.mlp_recompute_layers is None and default.norm_recompute_layers is None
    for name in ("mlp_recompute_layers", "norm_recompute_layers"):
        for bad in (-1, True, "4", 1.5):
            with pytest.raises(ConfigError, match=rf"model.{name}={bad!r} must be null \(every layer\) or an int >= 0"):
                LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], **{name: bad})


def test_embedding_on_host_option(tiny_model_dir, tmp_path):
    """``model.embedding_on_host``: checked at construction (a bool; not with an FP8 base, whose
    table is FP8 already, nor with tied embeddings); off a CUDA device the table stays where it
    is; on a GPU the buffer becomes a view of pinned host memory and training gives the same
    adapters as with the table on the device."""
    with pytest.raises(ConfigError, match="model.embedding_on_host='yes' must be true or false"):
        LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], embedding_on_host="yes")
    with pytest.raises(ConfigError, match="model.embedding_on_host does not apply to an FP8 base"):
        LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], dtype="bfloat16",
                         embedding_on_host=True, precision={"base": "fp8", "fp8": {"emulate": True}})
    tied = tmp_path / "tied"
    from transformers import AutoConfig

    from lightning_lorafusion.model.random_model import write_random_llama

    write_random_llama(tied)
    config = AutoConfig.from_pretrained(tied)
    config.tie_word_embeddings = True
    config.save_pretrained(tied)
    with pytest.raises(ConfigError, match="ties its input embedding to the LM head"):
        LoRAFusionModule(base_model=str(tied), adapters=tiny_specs()[:1], embedding_on_host=True)
    module = LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:1], embedding_on_host=True, **NF4)
    before = module.base__embed
    module._embedding_to_host()
    assert module.base__embed is before  # on the CPU: nothing to move
    if torch.cuda.is_available():
        on_host, _, _ = fit_joint(tiny_model_dir, tiny_specs(), module_kwargs={**NF4, "embedding_on_host": True},
                                  accelerator="gpu")
        on_device, _, _ = fit_joint(tiny_model_dir, tiny_specs(), module_kwargs=NF4, accelerator="gpu")
        assert on_host.steps_taken == on_device.steps_taken
        for (name, a), (_, b) in zip(on_device.bank.named_parameters(), on_host.bank.named_parameters()):
            # the same gathered rows; CUDA's atomic sums (index_add) may order additions apart
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}\n{m}")
