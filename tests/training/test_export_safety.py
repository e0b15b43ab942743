"""The export removes nothing it did not write, and never writes non-finite weights or alpha; an
adapter whose weights go non-finite is quarantined and reported so; finished adapters say done."""

import json
import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file

from lightning_lorafusion.model.peft_io import check_export_target, export_peft_adapter
from lightning_lorafusion.specs import AdapterSpec, ConfigError
from lightning_lorafusion.training.module import LoRAFusionModule
from test_equivalence import tiny_specs
from test_validation import fit_val


@pytest.fixture
def module(tiny_model_dir):
    return LoRAFusionModule(base_model=tiny_model_dir, adapters=tiny_specs()[:2], backend="torch")


def test_export_replaces_only_its_own_adapter_directory(module, tmp_path):
    root = tmp_path / "exports"
    (root / "unrelated").mkdir(parents=True)
    (root / "unrelated" / "keep.txt").write_text("mine")
    (root / "notes.txt").write_text("mine too")
    stale = root / ".a.tmp-abcd1234"  # what a killed export of adapter a leaves
    stale.mkdir()
    other_stale = root / ".unrelated.tmp-abcd1234"  # not adapter a's: left alone
    other_stale.mkdir()
    export_peft_adapter(module.bank, 0, root / "a")
    export_peft_adapter(module.bank, 0, root / "a" / "last")
    export_peft_adapter(module.bank, 0, root / "a")  # replaces a/ (and a/last/): both were ours
    export_peft_adapter(module.bank, 1, root / "b")
    assert sorted(p.name for p in root.iterdir()) == [".unrelated.tmp-abcd1234", "a", "b", "notes.txt", "unrelated"]
    assert (root / "unrelated" / "keep.txt").read_text() == "mine" and (root / "notes.txt").exists()
    assert not stale.exists() and other_stale.exists()
    # a directory holding anything an export does not write is refused, and left as it was
    (root / "b" / "README.md").write_text("the user's")
    with pytest.raises(ConfigError, match=r"holds files an export did not write \(README.md\)"):
        export_peft_adapter(module.bank, 1, root / "b")
    assert (root / "b" / "README.md").read_text() == "the user's"
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        export_peft_adapter(module.bank, 0, root / "notes.txt")
    for target in (str(root) + "/.", str(root) + "/.."):
        with pytest.raises(ConfigError, match="does not end in an adapter name"):
            check_export_target(str(target))
    assert (root / "unrelated" / "keep.txt").exists()


def test_module_refuses_an_export_dir_entry_holding_foreign_files_before_training(module, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "data.csv").write_text("1,2")
    with pytest.raises(ConfigError, match="data.csv"):
        module.check_export_targets(str(tmp_path))
    module.check_export_targets(str(tmp_path / "fresh"))  # nothing there: fine


def test_non_finite_weights_or_alpha_are_never_written(module, tmp_path):
    with torch.no_grad():
        next(p for n, p in module.bank.named_parameters() if n.startswith("adapters.0.")).fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="non-finite"):
        export_peft_adapter(module.bank, 0, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    spec = module.bank.specs[1]
    object.__setattr__(spec, "alpha", float("nan"))  # past the spec's own check, as a bug could
    try:
        with pytest.raises(ValueError, match="lora_alpha"):
            export_peft_adapter(module.bank, 1, tmp_path / "b")
    finally:
        object.__setattr__(spec, "alpha", 2.0)
    assert not (tmp_path / "b").exists()


class BlowUpWeights(Callback):
    """Sets adapter ``index``'s weights to inf right before its first optimizer step runs, after
    its loss and gradients were found finite: the step leaves non-finite weights."""

    def __init__(self, index):
        self.index = index
        self.done = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        target = pl_module.bank.parameters_of(self.index)
        if not self.done and any(p is q for group in optimizer.param_groups for p in group["params"] for q in target):
            self.done = True
            with torch.no_grad():
                for p in target:
                    p.fill_(float("inf"))


def test_weights_made_non_finite_by_a_step_quarantine_the_adapter(tiny_model_dir, tmp_path, caplog):
    a, b, c = tiny_specs()
    module, _, _ = fit_val(tiny_model_dir, [a, b], max_epochs=1, callbacks=[BlowUpWeights(1)],
                           export_dir=str(tmp_path / "adapters"))
    progress = module.progress[1]
    assert progress.status == "quarantined" and "weights became non-finite" in progress.message
    assert module.steps_taken[1] == 0 and module.steps_taken[0] > 0
    state = json.loads((tmp_path / "adapters" / "b" / "trainer_state.json").read_text())
    assert (state["status"], state["weights"], state["reason"]) == ("quarantined", "last_good", "quarantined")
    weights = load_file(tmp_path / "adapters" / "b" / "adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
    # an adapter that trained to the end is reported "done", in the table and the file
    assert json.loads((tmp_path / "adapters" / "a" / "trainer_state.json").read_text())["status"] == "done"
    table = module.summary()
    assert "| a | done |" in table and "| b | quarantined |" in table and "| training |" not in table
    assert module.progress[0].status == "training"  # stored status: a resumed run trains on


class PoisonAtTrainEnd(Callback):
    def on_train_end(self, trainer, pl_module):
        with torch.no_grad():
            for p in pl_module.bank.parameters_of(0):
                p.fill_(float("nan"))


def test_an_adapter_with_non_finite_final_weights_is_exported_as_quarantined(tiny_model_dir, tmp_path):
    a, b, _ = tiny_specs()
    module, _, _ = fit_val(tiny_model_dir, [a, b], max_epochs=1, callbacks=[PoisonAtTrainEnd()],
                           export_dir=str(tmp_path / "adapters"))
    assert module.progress[0].status == "quarantined" and "not finite at the end" in module.progress[0].message
    state = json.loads((tmp_path / "adapters" / "a" / "trainer_state.json").read_text())
    assert (state["status"], state["weights"]) == ("quarantined", "last_good")
    config = json.loads((tmp_path / "adapters" / "a" / "adapter_config.json").read_text())
    assert math.isfinite(config["lora_alpha"])
    weights = load_file(tmp_path / "adapters" / "a" / "adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert "| a | quarantined |" in module.summary() and "| b | done |" in module.summary()


def test_adapter_spec_nan_alpha_never_reaches_an_export():
    with pytest.raises(ConfigError, match="alpha=nan"):
        AdapterSpec(name="x", alpha=float("nan"))
