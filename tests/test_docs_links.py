"""Every relative link and every cited repository path in README.md and docs/*.md exists.

Checked: markdown links ``[text](target)`` that are not URLs or anchors, and every
``docs/results/...``, ``docs/figures/...``, ``scripts/...``, ``configs/...`` and ``examples/...``
path written anywhere in the text (inline code, commands, prose). Globs and brace lists in a
cited path (``e2e_{xsum,mixed}.json``, ``*.json``) must match at least one file each.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# A repository path: one of the cited top-level folders, then path characters (braces and
# globs allowed); stops at whitespace, quotes, backticks, brackets and sentence punctuation.
_PATH = re.compile(r"(?<![\w./$-])((?:docs/results|docs/figures|scripts|configs|examples)/[\w./*{},+-]*[\w*}/])")


def _expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",") for x in _expand_braces(path[: m.start()] + alt + path[m.end() :])]


def _exists(rel: str, base: Path) -> bool:
    for candidate in _expand_braces(rel):
        target = base / candidate
        if any(ch in candidate for ch in "*?["):
            if not glob.glob(str(target)):
                return False
        elif not target.exists():
            return False
    return True


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M)}


def _anchored_links(text: str) -> list[tuple[str, str]]:
    """(file, anchor) of every relative link with a ``#anchor`` (file "" = the same page)."""
    out = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or "#" not in target:
            continue
        path, anchor = target.split("#", 1)
        out.append((path, anchor))
    return out


def _links(text: str) -> list[str]:
    out = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # URL, mailto:, or an anchor in the same page
        out.append(target.split("#", 1)[0])
    return [t for t in out if t]


def _cited_paths(text: str) -> list[str]:
    return sorted({p.rstrip("/.") or p for p in _PATH.findall(text)})


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    text = doc.read_text()
    broken = [t for t in _links(text) if not _exists(t, doc.parent)]
    assert not broken, f"{doc.relative_to(ROOT)}: links to missing files: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_link_anchors_resolve(doc: Path) -> None:
    text = doc.read_text()
    broken = []
    for path, anchor in _anchored_links(text):
        target = (doc.parent / path) if path else doc
        if target.suffix == ".md" and target.exists() and anchor not in _anchors(target.read_text()):
            broken.append(f"{path}#{anchor}")
    assert not broken, f"{doc.relative_to(ROOT)}: links to missing headings: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_cited_repository_paths_exist(doc: Path) -> None:
    text = doc.read_text()
    missing = [p for p in _cited_paths(text) if not _exists(p, ROOT)]
    assert not missing, f"{doc.relative_to(ROOT)}: cites paths that do not exist: {missing}"


def test_the_checks_catch_a_broken_reference(tmp_path: Path) -> None:
    """The extractors find what a broken doc would hold (so the checks above can fail)."""
    text = "See [the guide](guide.md#top) and `docs/results/nowhere_h100_209901/run.json`, [web](https://x.y)."
    assert _links(text) == ["guide.md"]
    assert _cited_paths(text) == ["docs/results/nowhere_h100_209901/run.json"]
    assert not _exists("guide.md", tmp_path)
    assert not _exists("docs/results/nowhere_h100_209901/run.json", ROOT)
    assert _exists("scripts/{bench_kernels,bench_fp8}.py", ROOT)
    assert not _exists("scripts/{bench_kernels,no_such_bench}.py", ROOT)
    assert _slug("Decode kernels (generation)") == "decode-kernels-generation"
    assert _slug("`kernels/lora_gather.py`: decode rows") == "kernelslora_gatherpy-decode-rows"
    assert _anchored_links("[a](B.md#x-y) [b](#z) [c](https://h/#q)") == [("B.md", "x-y"), ("", "z")]
    assert "fused-lora-training" in _anchors("# T\n\n### Fused LoRA (training)\n")
