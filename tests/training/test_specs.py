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
