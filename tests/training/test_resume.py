"""Checkpoints mid-epoch and mid-global-batch resume to the uninterrupted run's weights."""

import glob
import os

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from test_equivalence import fit_joint, tiny_specs


def _weights(module):
    return {n: p.detach().clone() for n, p in module.bank.named_parameters()}


def test_resume_from_mid_epoch_checkpoint_reproduces_uninterrupted_run(tiny_model_dir, tmp_path):
    specs = tiny_specs(dropout=0.1)  # dropout masks must also line up after resume
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    full, dm, trainer = fit_joint(tiny_model_dir, specs, max_epochs=2, callbacks=[ckpt], enable_checkpointing=True)
    expected = _weights(full)
    files = sorted(glob.glob(os.path.join(tmp_path, "step=*.ckpt")), key=os.path.getmtime)
    assert len(files) >= 3
    # a checkpoint taken inside epoch 0, and one inside epoch 1
    for path in (files[0], files[len(files) // 2 + 1]):
        state = torch.load(path, weights_only=False)
        assert 0 < state["MultiAdapterDataModule"]["position"]
        assert "plan" in state["MultiAdapterDataModule"]  # the plan travels with the checkpoint
        assert "lorafusion" in state and state["lorafusion"]["adapter_names"] == ["a", "b", "c"]
        assert not any(k.startswith("base__") for k in state["state_dict"])  # frozen base not saved
        resumed, _, _ = fit_joint(tiny_model_dir, specs, max_epochs=2, ckpt_path=path)
        got = _weights(resumed)
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=f"{path}: {name}")
        assert resumed.steps_taken == full.steps_taken


def test_resume_from_epoch_end_checkpoint_trains_the_next_epoch(tiny_model_dir, tmp_path, monkeypatch):
    """Lightning re-enters a finished epoch under its old number after an epoch-end checkpoint;
    the data module must still stream the next epoch's data (and plan it only once)."""
    from lightning_lorafusion.training.datamodule import MultiAdapterDataModule

    specs = tiny_specs()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}")
    straight, _, _ = fit_joint(tiny_model_dir, specs, max_epochs=2, callbacks=[ckpt], enable_checkpointing=True)
    planned = []
    plan_epoch = MultiAdapterDataModule.plan_epoch
    monkeypatch.setattr(MultiAdapterDataModule, "plan_epoch",
                        lambda self, epoch: planned.append(epoch) or plan_epoch(self, epoch))
    resumed, _, _ = fit_joint(tiny_model_dir, specs, max_epochs=2, ckpt_path=str(tmp_path / "epoch=0.ckpt"))
    assert sorted(planned) == sorted(set(planned))  # each epoch planned (or restored) once
    assert resumed.steps_taken == straight.steps_taken
    want, got = _weights(straight), _weights(resumed)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
