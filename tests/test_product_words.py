"""The tree speaks of the product, not of the process that built it.

No work sessions, numbered calls, issues or items, and no numbered or ordinal work rounds, in
the package, tests, scripts, configs, README.md, docs/*.md, or any file name under
those (docs/results' machine logs are checked by name only). Legitimate uses stay allowed:
pytest's ``scope="session"``, identifiers such as ``ClientSession`` / ``start_new_session``,
``round(``, "rounding", "round trip", and the planner's rounds (batch r of every adapter), which
are never numbered with a digit or an ordinal here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ("lightning_lorafusion", "tests", "scripts", "configs", "docs", "examples")
TOP_FILES = ("README.md", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".ini", ".jsonl"}
RAW_DATA = ROOT / "docs" / "results"  # machine logs: names checked, contents not

_ORDINAL = r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(?:st|nd|rd|th))"
PATTERNS = {
    "a work session": re.compile(r"\bsessions?(?:\b|[_#-]?\d)(?<!scope=\"session)(?<!scope='session)", re.I),
    "a numbered call": re.compile(r"\bcalls?[ _#-]?\d+", re.I),
    "a numbered issue": re.compile(r"\bissues?[ _#-]?#?\d+", re.I),
    "a numbered item": re.compile(r"\bitems?[ _#-]?\d+", re.I),
    "a work round": re.compile(rf"\b{_ORDINAL}[ -]rounds?\b|\brounds?[ _#-]?\d+|--rounds\b", re.I),
}
_SCOPE = re.compile(r"scope=[\"']session[\"']")


def _files() -> list[Path]:
    out = [ROOT / name for name in TOP_FILES if (ROOT / name).exists()]
    for tree in TREES:
        base = ROOT / tree
        if base.exists():
            out += [p for p in base.rglob("*") if "__pycache__" not in p.parts]
    return sorted(out)


def find_product_words(text: str) -> list[str]:
    """Every (kind, match) of the patterns in ``text``, after dropping pytest's session scope."""
    text = _SCOPE.sub("", text)
    return [f"{kind}: {m.group(0)!r}" for kind, rx in PATTERNS.items() for m in rx.finditer(text)]


def test_no_process_words_in_file_names() -> None:
    bad = [str(p.relative_to(ROOT)) for p in _files() if find_product_words(p.name)]
    assert not bad, f"file names that speak of the process, rename them: {bad[:20]}"


def test_no_process_words_in_text() -> None:
    bad = []
    for path in _files():
        if (not path.is_file() or path.suffix not in TEXT_SUFFIXES or path == Path(__file__).resolve()
                or RAW_DATA in path.parents):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for hit in find_product_words(line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {hit}")
    assert not bad, "text that speaks of the process, say what is true instead:\n" + "\n".join(bad[:40])


# what the patterns must catch, built from each kind's noun so that this file quotes no history
_NOUNS = ("session", "call", "issue", "item", "round")
_CAUGHT = ([f"see the docs, {noun} {n}" for noun in _NOUNS for n in (0, 13)]
           + [f"results/h100/{noun}13.sh" for noun in ("session", "call", "issue")]
           + [f"the {ordinal} round of tuning" for ordinal in ("fourth", "2nd")]
           + ["bench_server.py --" + "rounds" + " 4", "Issue #16: the pipeline"])


@pytest.mark.parametrize("text", _CAUGHT)
def test_patterns_catch_process_words(text: str) -> None:
    assert find_product_words(text)


@pytest.mark.parametrize("text", [
    '@pytest.fixture(scope="session")', "aiohttp.ClientSession(url)", "start_new_session=True",
    "x = round(y, 2)", "one rounding of out + delta", "one round trip later",
    "round r = batch r of group 0's adapters", "later rounds first", "first_round + 1", "20 calls after a sync",
    "the first call of a launch", "make_engine_session(0)",
])
def test_patterns_leave_ordinary_words(text: str) -> None:
    assert find_product_words(text) == []
