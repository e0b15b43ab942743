"""Divergence guard: a NaN in one adapter skips its steps with a warning naming it, then quarantines
it (last good weights exported); an adapter whose val loss explodes (lr 1e6) is quarantined too.
Either way the other adapters end exactly as in a run without the bad adapter."""

import json

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file

from lightning_lorafusion.model.peft_io import peft_key
from lightning_lorafusion.specs import AdapterSpec
from test_equivalence import fit_joint, tiny_specs
from test_validation import fit_val


class PoisonAdapter(Callback):
    """From the second microbatch on, while it trains, adapter ``index``'s lora_B holds NaN."""

    def __init__(self, index):
        self.index = index

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx >= 1 and pl_module.progress[self.index].training:
            with torch.no_grad():
                for name, p in pl_module.bank.adapters[self.index].named_parameters():
                    if name.endswith("lora_B"):
                        p.fill_(float("nan"))


@pytest.fixture(scope="module")
def without_bad(tiny_model_dir):
    """Adapters a and c alone (indices 0 and 1, as in the runs with the bad adapter last)."""
    a, _, c = tiny_specs()
    module, _, _ = fit_joint(tiny_model_dir, [a, c], max_epochs=2)
    return {n: p.detach().clone() for n, p in module.bank.named_parameters()}


def _assert_others_unchanged(module, reference):
    got = {n: p for n, p in module.bank.named_parameters() if n.startswith(("adapters.0.", "adapters.1."))}
    assert got.keys() == reference.keys()
    for name, value in reference.items():
        # packing differs (the bad adapter's samples share microbatches): fp32 summation order only
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_nan_adapter_is_skipped_then_quarantined_and_the_others_train_on(tiny_model_dir, without_bad, tmp_path, caplog):
    a, b, c = tiny_specs()
    bad = AdapterSpec(**{**b.__dict__, "name": "bad", "max_bad_steps": 2})
    module, dm, _ = fit_val(tiny_model_dir, [a, c, bad], max_epochs=2, callbacks=[PoisonAdapter(2)],
                            export_dir=str(tmp_path / "adapters"))
    progress = module.progress[2]
    assert progress.status == "quarantined" and "2 consecutive global batches" in progress.message
    assert "adapter bad: non-finite loss/gradients at step 0" in caplog.text and "step skipped" in caplog.text
    assert "adapter bad quarantined at step 0" in caplog.text
    assert module.steps_taken[2] == 0 and module.progress[0].training and module.progress[1].training
    assert 2 in dm.excluded
    assert not any(s.adapter == 2 for mb in dm.epoch_plan(1).plan.microbatches for s in mb.samples)
    _assert_others_unchanged(module, without_bad)
    # exported: the last weights with a finite loss and gradients (here: its initial ones)
    out = tmp_path / "adapters" / "bad"
    state = json.loads((out / "trainer_state.json").read_text())
    assert (state["weights"], state["reason"], state["step"]) == ("last_good", "quarantined", 0)
    weights = load_file(out / "adapter_model.safetensors")
    good_step, snapshot = module._last_good[2]
    assert good_step == 0
    assert all(torch.isfinite(t).all() for t in weights.values())
    key = peft_key(0, "q_proj", "lora_A")
    torch.testing.assert_close(weights[key], snapshot["adapters.2.0.q_proj.lora_A"])


def test_val_loss_explosion_quarantines_an_lr_1e6_adapter(tiny_model_dir, without_bad, tmp_path, caplog):
    a, b, c = tiny_specs()
    # The tiny random model's loss stays near ln(vocab) whatever the adapter does (final RMSNorm,
    # head weights of std 0.02): lr 1e6 moves it from 5.64 to 5.68, so the factor sits just above 1.
    bad = AdapterSpec(**{**b.__dict__, "name": "bad", "lr": 1e6, "val_fraction": 0.4, "val_explode_factor": 1.001})
    module, dm, _ = fit_val(tiny_model_dir, [a, c, bad], max_epochs=2, export_dir=str(tmp_path / "adapters"),
                            module_kwargs={"validate_before_training": True})
    progress = module.progress[2]
    assert progress.status == "quarantined", progress
    assert "exceeds val_explode_factor=1.001 x its best" in progress.message
    assert progress.best_step == 0 and progress.val_history[0][0] == 0
    assert "adapter bad quarantined" in caplog.text
    _assert_others_unchanged(module, without_bad)
    # the exported adapter is its best (step 0) one; last/ its last good weights
    out = tmp_path / "adapters" / "bad"
    state = json.loads((out / "trainer_state.json").read_text())
    assert (state["weights"], state["reason"], state["step"]) == ("best", "quarantined", 0)
    assert json.loads((out / "last" / "trainer_state.json").read_text())["weights"] == "last_good"
    best = load_file(out / "adapter_model.safetensors")
    assert all(float(t.abs().max()) < 10 for t in best.values())  # not the diverged weights


def test_all_finite_checks_every_element_even_where_the_total_norm_overflows():
    """The post-step weight check: a NaN or inf anywhere is caught; finite weights too large for
    the one total norm (it overflows) fall back to the exact check and pass."""
    from lightning_lorafusion.training.nonfinite_guard import all_finite

    ok = [torch.randn(5, 3), torch.randn(7)]
    assert all_finite(ok) and all_finite([])
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(7)
        t[3] = bad
        assert not all_finite([ok[0], t]), bad
    assert all_finite([torch.full((4,), 1e30), ok[1]])  # squares overflow fp32, the values do not
    huge = torch.full((4,), 1e30)
    huge[1] = float("nan")
    assert not all_finite([huge])
