"""Per-adapter early stopping: a stopped adapter leaves the plan from the next planning window, its
best weights are exported, the others train exactly as without it; resume keeps all of it."""

import glob
import json
import os

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from lightning_lorafusion.model.peft_io import peft_key
from lightning_lorafusion.planner.verify import verify_plan
from lightning_lorafusion.specs import AdapterSpec
from lightning_lorafusion.training.datamodule import MultiAdapterDataModule, window_starts
from test_validation import fit_val, val_specs


def _synthetic(n, seed, distribution="xsum"):
    return {"kind": "synthetic", "distribution": distribution, "num_samples": n, "seed": seed, "vocab_size": 256}


def test_excluding_an_adapter_replans_the_epoch_from_the_next_window_the_stream_has_not_reached():
    specs = [AdapterSpec(name=f"x{i}", global_batch_size=1 + i % 2, seed=i, dataset=_synthetic(12, i))
             for i in range(3)]
    dm = MultiAdapterDataModule(capacity=128, pad_multiple=8, max_length=48, prefetch=2, planner={"window": 1})
    dm.configure(specs, None)
    dm.load_datasets()
    before = dm.epoch_plan(0).plan
    stream = dm.iter_microbatches(0)
    for _ in range(5):
        next(stream)  # the loader thread is ahead of training
    dm.position = 2  # two microbatches trained
    dm.exclude_adapters([1])
    after = dm.epoch_plan(0).plan
    cut = min(p for p in window_starts(before, 1).values() if p >= max(dm.position + dm.prefetch + 4, 5))
    assert after.microbatches[:cut] == before.microbatches[:cut]
    assert not any(s.adapter == 1 for mb in after.microbatches[cut:] for s in mb.samples)
    assert len(after.microbatches) < len(before.microbatches)
    # every sample of the others exactly once, and adapter 1's only before the cut
    def refs(plan, adapter):
        return sorted((s.batch, s.index) for mb in plan.microbatches for s in mb.samples if s.adapter == adapter)
    for a in (0, 2):
        assert refs(after, a) == refs(before, a)
    assert refs(after, 1) == sorted((s.batch, s.index) for mb in before.microbatches[:cut] for s in mb.samples
                                    if s.adapter == 1)
    assert verify_plan(after) == []
    # the stream goes on from where it was, through the new plan
    rest = list(stream)
    assert not any(ref.adapter == 1 for mb in rest[-3:] for ref in mb.samples)
    # the next epoch leaves it out altogether; the exclusion is part of the state
    assert not any(s.adapter == 1 for mb in dm.epoch_plan(1).plan.microbatches for s in mb.samples)
    assert dm.state_dict()["excluded"] == [1]


def _stop_b(patience=1):
    # min_delta 10: no validation after the first counts as an improvement
    return {"b": {"early_stopping": {"patience": patience, "min_delta": 10.0}}}


def test_early_stopped_adapter_keeps_best_weights_and_the_others_train_on(tiny_model_dir, tmp_path):
    trainer_kwargs = dict(max_epochs=2, val_check_interval=2)
    stopped, dm, _ = fit_val(tiny_model_dir, val_specs(dropout=0.0, **_stop_b()), export_dir=str(tmp_path / "es"),
                             **trainer_kwargs)
    full, _, _ = fit_val(tiny_model_dir, val_specs(dropout=0.0), **trainer_kwargs)
    b = stopped.progress[1]
    assert b.status == "early_stopped" and stopped.steps_taken[1] == b.stopped_step < full.steps_taken[1]
    assert [s for s, _ in b.val_history] == [b.best_step, b.stopped_step] and "did not improve" in b.message
    assert stopped.progress[0].training and stopped.progress[2].training
    assert stopped.steps_taken[0] == full.steps_taken[0] and stopped.steps_taken[2] == full.steps_taken[2]
    assert not any(s.adapter == 1 for mb in dm.epoch_plan(1).plan.microbatches for s in mb.samples)
    want = dict(full.bank.named_parameters())
    for name, p in stopped.bank.named_parameters():
        if not name.startswith("adapters.1."):
            torch.testing.assert_close(p, want[name], rtol=1e-4, atol=1e-5, msg=name)
    out = tmp_path / "es" / "b"
    state = json.loads((out / "trainer_state.json").read_text())
    assert (state["weights"], state["reason"], state["step"]) == ("best", "early_stopped", b.best_step)
    key = peft_key(1, "v_proj", "lora_B")
    best = load_file(out / "adapter_model.safetensors")[key]
    torch.testing.assert_close(best, stopped._best_weights[1]["adapters.1.1.v_proj.lora_B"])
    last = load_file(out / "last" / "adapter_model.safetensors")[key]
    torch.testing.assert_close(last, stopped.bank.adapters[1][1]["v_proj"].lora_B.detach())
    assert not torch.equal(best, last)


def test_resume_keeps_early_stopping_state_and_best_weights(tiny_model_dir, tmp_path):
    specs = val_specs(dropout=0.1, **_stop_b(patience=2))
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    kwargs = dict(max_epochs=2, val_check_interval=2)
    full, _, _ = fit_val(tiny_model_dir, specs, callbacks=[ckpt], enable_checkpointing=True, **kwargs)
    assert full.progress[1].status == "early_stopped"
    files = sorted(glob.glob(os.path.join(tmp_path, "step=*.ckpt")), key=os.path.getmtime)
    states = [torch.load(f, weights_only=False)["lorafusion"]["progress"][1] for f in files]
    # one checkpoint while b still trained (with a best), one after it stopped
    picks = [next(f for f, s in zip(files, states) if s["status"] == "training" and s["best_step"] is not None),
             next(f for f, s in zip(files, states) if s["status"] == "early_stopped")]
    for path in picks:
        resumed, _, _ = fit_val(tiny_model_dir, specs, ckpt_path=path, **kwargs)
        assert resumed.steps_taken == full.steps_taken, path
        assert [p.to_dict() for p in resumed.progress] == [p.to_dict() for p in full.progress], path
        want = dict(full.bank.named_parameters())
        for name, p in resumed.bank.named_parameters():
            torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=f"{path}: {name}")
        for a, weights in full._best_weights.items():
            for name, t in weights.items():
                torch.testing.assert_close(resumed._best_weights[a][name], t, rtol=1e-5, atol=1e-6)
