"""Validation inside `fit`: held-out splits, packed multi-adapter val loss equal to evaluating each
adapter alone, logging to the loggers, best/last export with trainer_state.json."""

import csv
import json
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_lorafusion.data.microbatch import IGNORE_INDEX
from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.model.decoder import forward_loss_sums
from lightning_lorafusion.specs import AdapterSpec, ConfigError
from lightning_lorafusion.training.datamodule import MultiAdapterDataModule, holdout_indices
from lightning_lorafusion.training.module import LoRAFusionModule
from test_equivalence import tiny_specs


def val_specs(dropout=0.1, **extra):
    """tiny_specs with validation: two held-out fractions and one val dataset of its own."""
    a, b, c = tiny_specs(dropout=dropout)
    syn = dict(c.dataset)
    return [
        AdapterSpec(**{**a.__dict__, "val_fraction": 0.3, **extra.get("a", {})}),
        AdapterSpec(**{**b.__dict__, "val_fraction": 0.4, **extra.get("b", {})}),
        AdapterSpec(**{**c.__dict__, "val_dataset": syn | {"num_samples": 5}, **extra.get("c", {})}),
    ]


def fit_val(model_dir, specs, *, max_epochs=1, export_dir=None, module_kwargs=None, ckpt_path=None, **trainer_kwargs):
    module = LoRAFusionModule(base_model=model_dir, adapters=specs, backend="torch", grad_clip=0.0,
                              export_on_fit_end=export_dir is not None, export_dir=export_dir,
                              **(module_kwargs or {}))
    dm = MultiAdapterDataModule(capacity=128, pad_multiple=8, max_length=48, prefetch=2, planner={"window": 2})
    kwargs = dict(accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    kwargs.update(trainer_kwargs)
    trainer = L.Trainer(**kwargs)
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return module, dm, trainer


def val_loss_alone(module, samples, adapter):
    """Reference: adapter ``adapter`` by itself, one val sample at a time (unpacked, no
    dropout), token-weighted mean over all its val samples."""
    spec = module.adapter_specs[adapter]
    bank = AdapterBank([spec], module.config, dtype=torch.float32)
    bank.load_state_dict({k.replace(f"adapters.{adapter}.", "adapters.0.", 1): v
                          for k, v in module.bank.state_dict().items() if k.startswith(f"adapters.{adapter}.")})
    total, tokens = 0.0, 0
    with torch.no_grad():
        for s in samples:
            ids, labels = torch.tensor(s.input_ids), torch.tensor(s.labels)
            n = len(ids)
            routing = bank.routing([(0, n, 0)], 0, n, train=False)
            sums = forward_loss_sums(module.base_params(), bank.view(), ids, labels, torch.arange(n),
                                     torch.tensor([0, n], dtype=torch.int32), routing, config=module.config)
            total += float(sums[0])
            tokens += sum(1 for t in s.labels if t != IGNORE_INDEX)
    return total / tokens


def test_holdout_is_stable_seeded_and_never_empty():
    held = holdout_indices(100, 0.2, seed=3)
    assert held == holdout_indices(100, 0.2, seed=3) and 5 < len(held) < 40
    assert holdout_indices(100, 0.2, seed=4) != held
    # a sample's side does not depend on the dataset size
    assert set(holdout_indices(150, 0.2, seed=3)) & set(range(100)) == set(held)
    assert len(holdout_indices(3, 0.01, seed=0)) == 1 and len(holdout_indices(2, 0.99, seed=0)) == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(val_fraction=1.0), r"val_fraction=1.0 must be in \[0, 1\)"),
    (dict(val_fraction=0.2, val_dataset={"kind": "synthetic"}), "either val_dataset or val_fraction"),
    (dict(early_stopping={"patience": 0}), "patience=0"),
    (dict(early_stopping={"patiense": 2}), "unknown early_stopping key"),
    (dict(early_stopping={"min_delta": -1}), "min_delta=-1"),
    (dict(max_bad_steps=0), "max_bad_steps=0"),
    (dict(val_explode_factor=1.0), "val_explode_factor=1.0 must be > 1"),
    (dict(val_samples=-1), "val_samples=-1"),
    (dict(val_fraction=0.1, metric="bleu"), "metric='bleu'; allowed"),
    (dict(val_fraction=0.1, metric="rouge"), "set val_samples >= 1"),
    (dict(val_samples=2), "val_samples/metric need validation data"),
])
def test_bad_validation_fields_raise_named_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        AdapterSpec(name="x", **kwargs)


def test_early_stopping_needs_validation_data(tiny_model_dir):
    spec = AdapterSpec(name="x", early_stopping={"patience": 2},
                       dataset={"kind": "synthetic", "distribution": "xsum", "num_samples": 4})
    assert spec.early_stopping == {"patience": 2, "min_delta": 0.0}
    with pytest.raises(ConfigError, match="early_stopping needs validation data"):
        LoRAFusionModule(base_model=tiny_model_dir, adapters=[spec])


def test_packed_val_loss_equals_each_adapter_alone_and_reaches_the_logger(tiny_model_dir, tmp_path):
    specs = val_specs(dropout=0.1)  # dropout must be off in validation
    module, dm, trainer = fit_val(tiny_model_dir, specs, max_epochs=2, logger=CSVLogger(tmp_path, name="logs"),
                                  export_dir=str(tmp_path / "adapters"))
    # held-out samples are never trained on: train + val is the whole dataset, disjoint
    assert len(dm.datasets[0]) + len(dm.val_datasets[0]) == 7 and len(dm.val_datasets[0]) >= 1
    assert len(dm.datasets[1]) + len(dm.val_datasets[1]) == 5 and len(dm.val_datasets[1]) >= 1
    assert len(dm.datasets[2]) == 8 and len(dm.val_datasets[2]) == 5
    train_ids = {tuple(s.input_ids) for s in dm.datasets[0]}
    assert not train_ids & {tuple(s.input_ids) for s in dm.val_datasets[0]}
    # the val plan packs several adapters together
    plan, _ = dm.val_plan()
    assert any(len(mb.adapters()) > 1 for mb in plan.microbatches)
    metrics = trainer.callback_metrics
    for a, spec in enumerate(specs):
        want = val_loss_alone(module, dm.val_datasets[a], a)
        got = float(metrics[f"val/loss/{spec.name}"])
        assert got == pytest.approx(want, rel=1e-5), spec.name
        assert float(metrics[f"val/ppl/{spec.name}"]) == pytest.approx(math.exp(want), rel=1e-4)
    rows = list(csv.DictReader(open(next((tmp_path / "logs").rglob("metrics.csv")))))
    logged = [r for r in rows if r.get("val/loss/a")]
    assert len(logged) == 2  # one validation per epoch
    # export: best-val weights at the top, final in last/, trainer_state.json in each
    for a, spec in enumerate(specs):
        top = tmp_path / "adapters" / spec.name
        state = json.loads((top / "trainer_state.json").read_text())
        assert state["weights"] == "best" and state["reason"] == "best"
        assert state["step"] == module.progress[a].best_step and state["val_loss"] == module.progress[a].best_val_loss
        last = json.loads((top / "last" / "trainer_state.json").read_text())
        assert last["weights"] == "last" and last["step"] == module.steps_taken[a]
        assert (top / "adapter_config.json").exists() and (top / "last" / "adapter_model.safetensors").exists()


def test_validating_inside_global_batches_changes_no_weights(tiny_model_dir, tmp_path):
    """Validation before training and after every microbatch (inside partial global batches,
    whose gradients wait in .grad), with generated samples, leaves training exactly as without."""
    specs = val_specs(dropout=0.1, a={"val_samples": 1, "metric": "rouge"})
    validated, _, _ = fit_val(tiny_model_dir, specs, val_check_interval=1, default_root_dir=str(tmp_path),
                              module_kwargs={"validate_before_training": True, "sample_max_new_tokens": 2})
    assert len(validated.progress[0].val_history) > validated.steps_taken[0]
    assert validated.progress[0].val_history[0][0] == 0 and (tmp_path / "samples.jsonl").exists()
    plain, _, _ = fit_val(tiny_model_dir, specs, limit_val_batches=0)
    assert not plain.progress[0].val_history
    want = dict(plain.bank.named_parameters())
    for name, p in validated.bank.named_parameters():
        torch.testing.assert_close(p, want[name], rtol=0, atol=0, msg=name)


def test_validation_under_a_multi_stage_pipeline_is_refused_clearly():
    from types import SimpleNamespace

    from lightning_lorafusion.parallel.data_parallel import ParallelLayout
    from lightning_lorafusion.parallel.strategy import MultiAdapterPipelineStrategy

    strategy = MultiAdapterPipelineStrategy(pipeline_size=2)
    strategy.layout = ParallelLayout(pipeline_size=2, data_parallel_size=1)
    dm = MultiAdapterDataModule(capacity=128, pad_multiple=8)
    dm.trainer = SimpleNamespace(strategy=strategy, lightning_module=SimpleNamespace(adapter_specs=val_specs()))
    with pytest.raises(ConfigError, match="validation .* is not supported under the pipeline strategy with pipeline_size=2"):
        dm._adopt_pipeline_layout()
    dm.trainer.lightning_module.adapter_specs = tiny_specs()  # no validation data: fine
    dm._adopt_pipeline_layout()
    assert dm.num_stages == 2
