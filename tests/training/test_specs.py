"""AdapterSpec validation: every bad field is named in the error."""

import pytest

from lightning_lorafusion.specs import ALL_TARGET_MODULES, AdapterSpec, ConfigError


def test_all_linear_expands_and_lists_become_tuples():
    assert AdapterSpec(name="x", target_modules="all-linear").target_modules == ALL_TARGET_MODULES
    assert AdapterSpec(name="x", target_modules=["q_proj"]).target_modules == ("q_proj",)
    assert AdapterSpec(name="x", rank=8, alpha=16).scale == 2.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=0), "rank=0 must be >= 1"),
        (dict(dropout=1.0), r"dropout=1.0 must be in \[0, 1\)"),
        (dict(target_modules=("qkv",)), r"unknown target module\(s\) \['qkv'\]"),
        (dict(target_modules=()), "target_modules is empty"),
        (dict(lr=0), "lr=0 must be > 0"),
        (dict(global_batch_size=0), "global_batch_size=0"),
        (dict(lr_schedule="step"), "lr_schedule='step'"),
        (dict(name="bad name"), "identifier-like"),
        (dict(max_steps=0), "max_steps=0"),
    ],
)
def test_bad_fields_raise_named_errors(kwargs, match):
    args = dict(name="x") | kwargs
    with pytest.raises(ConfigError, match=match):
        AdapterSpec(**args)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=float("inf")), "lr=inf must be a finite number"),
        (dict(lr=float("nan")), "lr=nan must be a finite number"),
        (dict(lr=1e30), r"lr=1e\+30 must be > 0 and <= 1e\+06"),
        (dict(min_lr_ratio=float("nan")), "min_lr_ratio=nan must be a finite number"),
        (dict(min_lr_ratio=1.5), r"min_lr_ratio=1.5 must be in \[0, 1\]"),
        (dict(alpha=float("nan")), "alpha=nan must be a finite number"),
        (dict(alpha=float("inf")), "alpha=inf must be a finite number"),
        (dict(warmup_steps=-5), "warmup_steps=-5 must be >= 0"),
        (dict(weight_decay=-1), "weight_decay=-1 must be >= 0"),
        (dict(dropout=float("nan")), "dropout=nan must be a finite number"),
        (dict(rank=True), "rank=True must be >= 1"),
        (dict(seed=-1), "seed=-1 must be >= 0"),
        (dict(early_stopping={"min_delta": float("nan")}), "early_stopping.min_delta=nan"),
        (dict(val_explode_factor=float("inf")), "val_explode_factor=inf must be > 1 and finite"),
        (dict(test_dataset="test.jsonl"), "test_dataset must be a mapping"),
    ],
)
def test_non_finite_and_out_of_range_numbers_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        AdapterSpec(**(dict(name="x", val_fraction=0.2) | kwargs))


@pytest.mark.parametrize("name", [".", "..", "a/b", "../up", "a\\b", ".hidden", "-dash", "", "x" * 65,
                                  "caf\u00e9", "a b"])
def test_names_that_are_not_safe_directory_names_are_refused(name):
    with pytest.raises(ConfigError, match="must be identifier-like"):
        AdapterSpec(name=name)


def test_safe_names_are_accepted():
    for name in ("legal", "Legal-v2", "xsum_1.5", "7b", "x" * 64):
        assert AdapterSpec(name=name).name == name


def test_names_that_collide_ignoring_case_are_refused():
    from lightning_lorafusion.specs import check_adapter_names

    check_adapter_names([AdapterSpec(name="legal"), AdapterSpec(name="medical")])
    with pytest.raises(ConfigError, match="'Legal' and 'legal' have names that differ only in case"):
        check_adapter_names([AdapterSpec(name="Legal"), AdapterSpec(name="legal")])
    with pytest.raises(ConfigError, match="have the same name"):
        check_adapter_names([AdapterSpec(name="a"), AdapterSpec(name="a")])
