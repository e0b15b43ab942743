"""An exported PEFT adapter can seed a new run (AdapterSpec.init_from) and keep training."""

import dataclasses

import torch

from lightning_lorafusion.training.module import LoRAFusionModule
from test_equivalence import fit_joint, tiny_specs


def test_init_from_exported_peft_dir_restores_weights(tiny_model_dir, tmp_path):
    specs = tiny_specs()
    trained, _, _ = fit_joint(tiny_model_dir, specs)
    paths = trained.export_adapters(str(tmp_path / "exported"))
    seeded_specs = [dataclasses.replace(s, init_from=p) for s, p in zip(specs, paths)]
    seeded = LoRAFusionModule(base_model=tiny_model_dir, adapters=seeded_specs, backend="torch")
    fresh = LoRAFusionModule(base_model=tiny_model_dir, adapters=specs, backend="torch")
    for (name, p), (_, q), (_, f) in zip(
        trained.bank.named_parameters(), seeded.bank.named_parameters(), fresh.bank.named_parameters()
    ):
        torch.testing.assert_close(q, p, msg=name)
        if name.endswith("lora_B"):
            assert not torch.equal(f, p)  # the trained B moved away from its zero init
    # and training continues from there
    continued, _, _ = fit_joint(tiny_model_dir, seeded_specs)
    assert all(n > 0 for n in continued.steps_taken)


def _peft_dora_dir(model_dir, out, targets):
    """A DoRA adapter trained by PEFT for a few steps on random tokens, saved by PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), use_dora=True))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    model.save_pretrained(out)
    return out


def test_dora_adapters_fit_export_and_continue_from_peft(tiny_model_dir, tmp_path):
    """DoRA adapters train beside a plain one (magnitudes start at the base's row norms and
    move), export with their magnitudes, and seed a run; so does a DoRA adapter PEFT trained."""
    from safetensors.torch import load_file

    specs = tiny_specs()
    specs = [dataclasses.replace(specs[0], dora=True), specs[1], dataclasses.replace(specs[2], dora=True)]
    trained, _, _ = fit_joint(tiny_model_dir, specs)
    fresh = LoRAFusionModule(base_model=tiny_model_dir, adapters=specs, backend="torch")
    w = fresh.base_params()["layers"][1]["o_proj"]["weight"]
    start = fresh.bank.factors(2, 1, "o_proj").lora_magnitude
    torch.testing.assert_close(start, torch.linalg.norm(w.float(), dim=1))  # PEFT's init at B = 0
    assert not torch.allclose(trained.bank.factors(2, 1, "o_proj").lora_magnitude, start)
    paths = trained.export_adapters(str(tmp_path / "exported"))
    seeded = LoRAFusionModule(base_model=tiny_model_dir, backend="torch",
                              adapters=[dataclasses.replace(s, init_from=p) for s, p in zip(specs, paths)])
    for (name, p), (_, q) in zip(trained.bank.named_parameters(), seeded.bank.named_parameters()):
        torch.testing.assert_close(q, p, msg=name)
    targets = ("q_proj", "v_proj", "down_proj")
    peft_dir = _peft_dora_dir(tiny_model_dir, tmp_path / "peft-dora", targets)
    spec = dataclasses.replace(specs[1], name="from-peft", rank=4, alpha=8, dora=True, init_from=str(peft_dir))
    module = LoRAFusionModule(base_model=tiny_model_dir, adapters=[spec], backend="torch")
    state = load_file(str(peft_dir / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.mlp.down_proj.lora_magnitude_vector"
    torch.testing.assert_close(module.bank.factors(0, 0, "down_proj").lora_magnitude, state[key])
    assert not torch.allclose(state[key], torch.linalg.norm(module.base_params()["layers"][0]["down_proj"]["weight"],
                                                            dim=1))  # trained, not the initial norms
