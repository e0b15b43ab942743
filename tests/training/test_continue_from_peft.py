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
