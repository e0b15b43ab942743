"""scripts/bench_segment_forms.py on the CPU (Triton interpreter): the "segments" and split-K forms,
written first and added, agree with the torch reference over a padded table."""

from __future__ import annotations

import json

from _script_loader import load_script


def test_forms_match_the_reference(tmp_path, capsys):
    bench = load_script("bench_segment_forms")
    assert bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--rows", "24", "--mixes", "3xmix",
                       "--request-len", "10", "--variants", "segments,splitk,splitk-add,splitk-shrink,items,items-shrink,held,held-add,fill",
                       "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "| 24 | 3xmix |" in out
    report = json.loads(next(tmp_path.rglob("*.json")).read_text())
    (case,) = report["cases"]
    assert case["segments"] == 3 and case["adapters"] == 3
    for v in ("segments", "splitk", "splitk-add", "items", "held", "held-add"):
        assert case["variants"][v]["rel_err"] < 1e-4, v
    assert "ms" in case["variants"]["splitk-shrink"] and "ms" in case["variants"]["items-shrink"]
    assert "ms" in case["variants"]["fill"]
