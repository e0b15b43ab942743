"""The package's public API: every exported name imports from the top level, lazily."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import lightning_lorafusion

INIT = Path(lightning_lorafusion.__file__)


def test_every_exported_name_imports_from_the_package():
    for name in lightning_lorafusion.__all__:
        value = getattr(lightning_lorafusion, name)
        exec(f"from lightning_lorafusion import {name}", {})
        assert value.__name__ == name, name
        assert value.__module__ == lightning_lorafusion._EXPORTS[name], name


def test_all_lists_every_export_and_the_type_checking_imports_match():
    assert sorted(lightning_lorafusion.__all__) == sorted(lightning_lorafusion._EXPORTS)
    for name in ("LoRAFusionModule", "MultiAdapterDataModule", "MultiAdapterPipelineStrategy", "Engine",
                 "EngineConfig", "AdapterSpec", "PlannerConfig"):
        assert name in lightning_lorafusion.__all__
    # the TYPE_CHECKING block names the same things as the table the lazy loader reads
    tree = ast.parse(INIT.read_text(encoding="utf-8"))
    typed = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1
             for alias in node.names}
    assert typed == set(lightning_lorafusion._EXPORTS)


def test_unknown_name_is_an_attribute_error():
    try:
        lightning_lorafusion.NoSuchThing  # noqa: B018
    except AttributeError as error:
        assert "NoSuchThing" in str(error)
    else:
        raise AssertionError("an unknown name was found")


def test_importing_the_package_imports_no_layer_module():
    code = ("import sys, lightning_lorafusion; "
            "print(sorted(m for m in sys.modules if m.startswith('lightning_lorafusion.') or m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=INIT.parents[1]).stdout
    assert out.strip() == "[]", out
