"""docs/config.md lists every configuration field with the code's type and default."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest
import yaml

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
MARKER = re.compile(r"<!-- fields: ([\w.]+) -->")
REQUIRED = "required"


def documented_tables() -> dict[str, list[tuple[str, str, str]]]:
    """Object path -> rows (field, type, default) of the table after its marker."""
    tables: dict[str, list[tuple[str, str, str]]] = {}
    current = None
    for line in DOC.read_text().splitlines():
        marker = MARKER.search(line)
        if marker:
            current = tables.setdefault(marker.group(1), [])
            continue
        if current is None:
            continue
        if not line.startswith("|"):
            if current:  # the table ended
                current = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if cells[0] in ("field", "---"):
            continue
        name, type_, default = (c.replace("\\|", "|").strip("`") for c in cells[:3])
        current.append((name, type_, default))
    return tables


def code_fields(path: str) -> list[tuple[str, str, object]]:
    """(name, annotation, default or REQUIRED) of a dataclass's fields or a constructor's
    parameters (``**kwargs`` as ``**name`` with no default)."""
    module_name, _, attr = path.rpartition(".")
    obj = getattr(importlib.import_module(module_name), attr)
    if dataclasses.is_dataclass(obj):
        rows = []
        for f in dataclasses.fields(obj):
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = REQUIRED
            rows.append((f.name, str(f.type), default))
        return rows
    rows = []
    for name, p in inspect.signature(obj.__init__).parameters.items():
        if name == "self":
            continue
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            rows.append((f"**{name}", str(p.annotation), None))
            continue
        default = REQUIRED if p.default is inspect.Parameter.empty else p.default
        rows.append((name, str(p.annotation), default))
    return rows


def as_yaml_value(value: object) -> object:
    """The code's default as YAML would give it back (tuples are lists, sections mappings)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return list(value) if isinstance(value, tuple) else value


TABLES = documented_tables()


def test_every_config_object_has_a_table():
    assert set(TABLES) == {
        "lightning_lorafusion.specs.AdapterSpec",
        "lightning_lorafusion.training.module.LoRAFusionModule",
        "lightning_lorafusion.training.datamodule.MultiAdapterDataModule",
        "lightning_lorafusion.parallel.strategy.MultiAdapterPipelineStrategy",
        "lightning_lorafusion.training.precision.PrecisionConfig",
        "lightning_lorafusion.training.precision.Fp8Config",
        "lightning_lorafusion.training.precision.Nf4Config",
        "lightning_lorafusion.training.epoch_planning.PlanningConfig",
    }


@pytest.mark.parametrize("path", sorted(TABLES))
def test_table_matches_the_code(path):
    documented = TABLES[path]
    code = code_fields(path)
    assert [name for name, _, _ in documented] == [name for name, _, _ in code], "fields (in order)"
    for (name, doc_type, doc_default), (_, code_type, code_default) in zip(documented, code):
        assert doc_type == code_type, f"{name}: type"
        if name.startswith("**"):
            assert doc_default == "none", f"{name}: default"
        elif code_default == REQUIRED:
            assert doc_default == REQUIRED, f"{name}: default"
        else:
            assert yaml.safe_load(doc_default) == as_yaml_value(code_default), f"{name}: default"
