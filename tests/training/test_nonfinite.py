"""A NaN in one adapter is skipped and logged, then stops the run with a clear error;
the other adapters keep training with finite weights."""

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from test_equivalence import fit_joint, tiny_specs


class PoisonAdapter(Callback):
    """From the second microbatch on, adapter 1's lora_B holds NaN."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx >= 1:
            with torch.no_grad():
                for name, p in pl_module.bank.adapters[1].named_parameters():
                    if name.endswith("lora_B"):
                        p.fill_(float("nan"))


def test_nan_adapter_is_skipped_then_stops_with_named_error(tiny_model_dir, caplog):
    specs = tiny_specs()
    with pytest.raises(FloatingPointError, match=r"adapter 'b': non-finite loss or gradients in 2 consecutive"):
        from lightning_lorafusion.training.module import LoRAFusionModule
        import lightning as L
        from lightning_lorafusion.training.datamodule import MultiAdapterDataModule

        module = LoRAFusionModule(base_model=tiny_model_dir, adapters=specs, backend="torch",
                                  export_on_fit_end=False, max_nonfinite_steps=2)
        dm = MultiAdapterDataModule(capacity=128, pad_multiple=8, max_length=48)
        trainer = L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, callbacks=[PoisonAdapter()])
        trainer.fit(module, datamodule=dm)
    assert "adapter b: non-finite loss/gradients" in caplog.text and "step skipped" in caplog.text
    for a in (0, 2):
        for p in module.bank.parameters_of(a):
            assert torch.isfinite(p).all()
    assert module.steps_taken[0] >= 1 and module.steps_taken[1] <= 1
