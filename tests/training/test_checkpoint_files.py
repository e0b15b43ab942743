"""Checkpoint files: written through a temporary beside the target (a killed write leaves it
there, never in $TMPDIR, and the next run removes it); fit ends with a checkpoint of its last
step; a checkpoint that does not fit the config is refused, naming the field; `test` evaluates
each adapter's test_dataset with the validation forward."""

import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_lorafusion.specs import AdapterSpec, ConfigError
from lightning_lorafusion.training.checkpoint_io import AtomicCheckpointIO, remove_stale_temporaries
from test_equivalence import fit_joint, tiny_specs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_killed_checkpoint_write_leaves_its_temporary_beside_the_target_only(tmp_path):
    ckpt_dir, tmpdir = tmp_path / "ck", tmp_path / "tmpdir"
    ckpt_dir.mkdir()
    tmpdir.mkdir()
    (ckpt_dir / "notes.lorafusion-tmp").write_text("not ours: no random part")
    (ckpt_dir / "step=1.ckpt").write_bytes(b"an older checkpoint")
    # a process killed (SIGKILL) in the middle of writing step=2.ckpt
    script = textwrap.dedent(f"""
        import os, signal, torch
        from lightning_lorafusion.training.checkpoint_io import AtomicCheckpointIO

        def dying_save(obj, f, *args, **kwargs):
            f.write(b"x" * 4096)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = dying_save
        AtomicCheckpointIO().save_checkpoint({{"w": torch.zeros(3)}}, {str(ckpt_dir / "step=2.ckpt")!r})
    """)
    env = dict(os.environ, PYTHONPATH=REPO, TMPDIR=str(tmpdir))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=300)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    assert list(tmpdir.iterdir()) == []
    left = [p.name for p in ckpt_dir.iterdir() if p.name.endswith(".lorafusion-tmp") and p.name.startswith(".")]
    assert len(left) == 1 and left[0].startswith(".step=2.ckpt.")
    assert not (ckpt_dir / "step=2.ckpt").exists()  # never a half-written checkpoint under the real name
    assert remove_stale_temporaries(ckpt_dir) == left
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["notes.lorafusion-tmp", "step=1.ckpt"]
    # an uninterrupted write lands whole, nothing else left
    AtomicCheckpointIO().save_checkpoint({"w": torch.ones(2)}, ckpt_dir / "step=3.ckpt")
    assert torch.equal(torch.load(ckpt_dir / "step=3.ckpt")["w"], torch.ones(2))
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["notes.lorafusion-tmp", "step=1.ckpt", "step=3.ckpt"]


def test_fit_removes_stale_temporaries_and_ends_with_a_checkpoint_of_its_last_step(tiny_model_dir, tmp_path):
    ckpt_dir = tmp_path / "ck"
    ckpt_dir.mkdir()
    stale = ckpt_dir / ".step=6.ckpt.a1b2c3d4.lorafusion-tmp"
    stale.write_bytes(b"left by a killed write")
    every = 3
    callback = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every, save_top_k=-1, filename="{step}")
    module, _, trainer = fit_joint(tiny_model_dir, tiny_specs(), callbacks=[callback], enable_checkpointing=True)
    assert not stale.exists()
    assert trainer.global_step % every != 0  # else the periodic checkpoint would be the last one anyway
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    last = torch.load(ckpt_dir / "last.ckpt", weights_only=False)
    assert last["global_step"] == trainer.global_step
    assert last["lorafusion"]["steps_taken"] == module.steps_taken
    periodic = max(torch.load(p, weights_only=False)["global_step"] for p in ckpt_dir.glob("step=*.ckpt"))
    assert periodic < trainer.global_step
    for name, p in module.bank.state_dict().items():
        torch.testing.assert_close(last["state_dict"][f"bank.{name}"], p)
    # resuming from it re-trains nothing: the run had ended there
    resumed, _, _ = fit_joint(tiny_model_dir, tiny_specs(), ckpt_path=str(ckpt_dir / "last.ckpt"))
    assert resumed.steps_taken == module.steps_taken
    for (name, got), want in zip(resumed.bank.state_dict().items(), module.bank.state_dict().values()):
        torch.testing.assert_close(got, want, msg=name)


def test_resume_refuses_a_config_that_differs_from_the_checkpoint(tiny_model_dir, tmp_path, caplog):
    callback = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}")
    fit_joint(tiny_model_dir, tiny_specs(), callbacks=[callback], enable_checkpointing=True)
    path = str(tmp_path / "epoch=0.ckpt")
    a, b, c = tiny_specs()
    changed = [a, AdapterSpec(**{**b.__dict__, "lr": 5e-2}), c]
    with pytest.raises(ConfigError, match=r"model.adapters\[b\].lr is 0.01 in the checkpoint but 0.05 in the config"):
        fit_joint(tiny_model_dir, changed, max_epochs=2, ckpt_path=path)
    with pytest.raises(ConfigError, match=r"checkpoint holds \['a', 'b', 'c'\], the config lists \['a', 'b'\]"):
        fit_joint(tiny_model_dir, [a, b], max_epochs=2, ckpt_path=path)
    # a guard setting may change on resume; it is logged
    guarded = [a, AdapterSpec(**{**b.__dict__, "max_bad_steps": 5}), c]
    caplog.set_level(logging.INFO, logger="lightning_lorafusion")
    fit_joint(tiny_model_dir, guarded, max_epochs=2, ckpt_path=path)
    assert "model.adapters[b].max_bad_steps: None -> 5" in caplog.text


def test_test_stage_evaluates_test_datasets_with_the_validation_forward(tiny_model_dir, tmp_path):
    import json

    import lightning as L

    from lightning_lorafusion.training.datamodule import MultiAdapterDataModule
    from lightning_lorafusion.training.module import LoRAFusionModule

    a, b, c = tiny_specs()
    rows = [{"prompt": f"what is {i} plus {i} ?", "completion": f"it is {2 * i} of course"} for i in range(5)]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = {"kind": "jsonl", "path": str(tmp_path / "held.jsonl")}  # one file: read whole, any split
    other = {"kind": "synthetic", "distribution": "cnn_dailymail", "num_samples": 5, "seed": 9}
    specs = [AdapterSpec(**{**a.__dict__, "val_dataset": held, "test_dataset": held}),
             AdapterSpec(**{**c.__dict__, "test_dataset": other}), b]
    module = LoRAFusionModule(base_model=tiny_model_dir, adapters=specs, backend="torch", export_on_fit_end=False)
    dm = MultiAdapterDataModule(capacity=128, pad_multiple=8, max_length=48, prefetch=2, planner={"window": 2})
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    tested = trainer.test(module, datamodule=dm)[0]
    validated = trainer.validate(module, datamodule=dm)[0]
    # the same samples through `test` and `validate`: the same loss
    assert tested["test/loss/a"] == pytest.approx(validated["val/loss/a"], rel=1e-6)
    assert "test/loss/c" in tested and "test/loss/b" not in tested  # b has no test data
    table = module.test_summary(module.test_losses)
    assert "| a | 5 |" in table and "| c | 5 |" in table and "| b | 0 | - | - |" in table
