"""The package's import graph: no cycle between modules, and no import against the layer order.

Every import counts, at module level or inside a function (and under ``TYPE_CHECKING``): a
function-local import still ties the two modules together, it only hides the tie until run.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "lightning_lorafusion"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Lowest first. A module may import modules of its own layer or of lower layers only. specs.py
# (the user-facing records every layer reads) sits below everything; kernels and planner are
# independent of each other and of everything above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("specs", "capture"),
    ("kernels", "planner"),
    ("data",),
    ("model",),
    ("parallel", "serving"),
    ("training",),
    ("cli",),
    ("",),  # the package's __init__: exports the public API of every layer
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """Package modules that ``module`` imports anywhere in its source (a name imported from a
    package that is itself a submodule counts as that submodule)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a package: its deepest module
                target = target.rpartition(".")[0]
            if target.startswith(PACKAGE) and target != module:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    known = set(modules)
    return {m: imported_modules(m, p, known) for m, p in modules.items()}


def layer_of(module: str) -> int:
    top = module[len(PACKAGE) + 1:].split(".")[0] if module != PACKAGE else ""
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{module} is in no layer; add its top-level name to LAYERS")


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_graph_sees_module_and_function_level_imports(tmp_path):
    assert f"{PACKAGE}.planner.plan" in import_graph()[f"{PACKAGE}.planner.verify"]
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from ..specs import ConfigError\n"
        "if TYPE_CHECKING:\n    from ..serving import runner\n"
        "def f():\n    from .decoder import embed\n    import lightning_lorafusion.training.module\n"
    )
    known = set(package_modules())
    found = imported_modules(f"{PACKAGE}.model.probe", source, known)
    assert found == {f"{PACKAGE}.specs", f"{PACKAGE}.serving.runner", f"{PACKAGE}.model.decoder",
                     f"{PACKAGE}.training.module"}


def test_find_cycles_reports_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, f"import cycles between modules: {cycles}"


def test_no_import_against_the_layer_order():
    bad = sorted(
        f"{m} -> {t}"
        for m, targets in import_graph().items()
        for t in targets
        if layer_of(t) > layer_of(m)
    )
    assert not bad, "imports against the layer order (" + " < ".join("/".join(n) for n in LAYERS) + "):\n" + "\n".join(bad)
