"""The ``model.precision`` and ``data.planner`` sections: validation, the old flat spellings
refused with the new key named, and resume checks field by field inside a section."""

from __future__ import annotations

import pytest

from lightning_lorafusion.specs import ConfigError
from lightning_lorafusion.training.datamodule import MultiAdapterDataModule
from lightning_lorafusion.training.epoch_planning import PlanningConfig
from lightning_lorafusion.training.module import LoRAFusionModule
from lightning_lorafusion.training.precision import Fp8Config, PrecisionConfig
from lightning_lorafusion.training.resume_check import check_checkpoint_config


def test_precision_section_parses_and_validates():
    parsed = PrecisionConfig.parse({"base": "fp8", "fp8": {"exempt_layers": 2, "fast_accumulation": False}})
    assert parsed == PrecisionConfig(base="fp8", fp8=Fp8Config(exempt_layers=2, fast_accumulation=False))
    assert PrecisionConfig.parse(None) == PrecisionConfig()
    with pytest.raises(ConfigError, match=r"model.precision.base='fp4'; allowed"):
        PrecisionConfig(base="fp4")
    with pytest.raises(ConfigError, match=r"model.precision='fp8' is a section now; write precision: \{base: fp8\}"):
        PrecisionConfig.parse("fp8")
    with pytest.raises(ConfigError, match=r"model.precision: .*fast_accum"):
        PrecisionConfig.parse({"fp8": {"fast_accum": True}})
    with pytest.raises(ConfigError, match=r"model.precision.fp8.emulate=1 must be true or false"):
        Fp8Config(emulate=1)


def test_planner_section_parses_and_validates():
    assert PlanningConfig.parse({"method": "milp", "workers": 2}) == PlanningConfig(method="milp", workers=2)
    config = PlanningConfig(method="milp", time_limit=3.0).planner_config(capacity=64, pad_multiple=8,
                                                                          num_stages=2, seed=5)
    assert (config.method, config.time_limit, config.capacity, config.num_stages, config.seed) == ("milp", 3.0, 64,
                                                                                                    2, 5)
    with pytest.raises(ConfigError, match=r"data.planner.method='ilp'; allowed: 'greedy', 'milp'"):
        PlanningConfig(method="ilp")
    with pytest.raises(ConfigError, match=r"data.planner.window=0 must be an int >= 1"):
        PlanningConfig(window=0)
    with pytest.raises(ConfigError, match=r"data.planner='milp' is a section now; write planner: \{method: milp\}"):
        MultiAdapterDataModule(planner="milp")


def test_old_flat_arguments_are_gone():
    with pytest.raises(TypeError, match="planner_window"):
        MultiAdapterDataModule(planner_window=2)
    with pytest.raises(TypeError, match="base_precision"):
        LoRAFusionModule(base_precision="fp8")


def _hparams(**precision) -> dict:
    return {"base_model": "m", "adapters": [{"name": "a", "dataset": {"kind": "synthetic"}}],
            "precision": {"base": "fp8", "fp8": {"fast_accumulation": True, "exempt_layers": 0, **precision}}}


def test_resume_compares_a_section_field_by_field():
    changed = check_checkpoint_config(_hparams(), _hparams(fast_accumulation=False), model_class=LoRAFusionModule)
    assert changed == ["model.precision.fp8.fast_accumulation: True -> False"]
    with pytest.raises(ConfigError, match=r"model.precision.fp8.exempt_layers is 0 in the checkpoint but 2"):
        check_checkpoint_config(_hparams(), _hparams(exempt_layers=2), model_class=LoRAFusionModule)
    with pytest.raises(ConfigError, match=r"model.precision.fp8.exempt_layers is 0 in the checkpoint but 2"):
        check_checkpoint_config(_hparams(), _hparams(exempt_layers=2), model_class=LoRAFusionModule, stage="validate")
    assert check_checkpoint_config(_hparams(), _hparams(emulate=True), model_class=LoRAFusionModule,
                                   stage="validate") == ["model.precision.fp8.emulate: False -> True"]
