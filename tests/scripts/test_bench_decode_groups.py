"""scripts/bench_decode_groups.py on CPU (interpreter, fp32): per-row and grouped decode LoRA agree."""

import json

from _script_loader import load_script


def test_bench_decode_groups_tiny_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    script = load_script("bench_decode_groups")
    report = script.main(["--device", "cpu", "--dtype", "float32", "--k", "64", "--batches", "32",
                          "--adapters", "3,40", "--ranks", "4,8", "--out", str(tmp_path)])
    assert [(r["rows"], r["adapters"]) for r in report["rows"]] == [(32, 3), (32, 40)]
    assert all(r["max_rel_diff"] < 1e-5 for r in report["rows"])
    saved = json.loads((tmp_path / "bench_decode_groups.json").read_text())
    assert len(saved["rows"]) == 2
