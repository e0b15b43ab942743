"""scripts/bench_decode_groups.py on CPU (interpreter, fp32): a tiny layer's decode LoRA per row and
grouped (shrink, expand in both forms) agree, and the sweep runs its settings."""

import json

from _script_loader import load_script


def test_bench_decode_groups_tiny_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    script = load_script("bench_decode_groups")
    from lightning_lorafusion.kernels import lora_gather

    names = script.KNOBS + ("GROUPED_MIN_ROWS", "GROUPED_EXPAND_MIN_ROWS")
    before = {name: getattr(lora_gather, name) for name in names}
    # the engine's knobs, then one change of form (the interpreter is slow: not the whole sweep)
    monkeypatch.setattr(script, "SWEEP", [{}, {"GROUPED_EXPAND_ROW_LOOP": True, "GROUP_ROWS": 2}])
    report = script.main(["--device", "cpu", "--dtype", "float32", "--tiny", "--batches", "16",
                          "--adapters", "3,40", "--ranks", "4,8", "--rank-mixes", "1", "--layers", "2",
                          "--sweep-rows", "16", "--budget-s", "1e9", "--stop-s", "1e9", "--out", str(tmp_path)])
    # the knobs and row bounds it set are back (later engines in this process use them)
    assert {name: getattr(lora_gather, name) for name in names} == before
    assert [(r["rows"], r["adapters"]) for r in report["rows"]] == [(16, 3), (16, 40)]
    assert all(r["max_rel_diff"] < 1e-5 for r in report["rows"])
    for r in report["rows"]:
        assert [x["setting"] for x in r["sweep"]] == ["engine", "loop=True,rows=2"]
        assert all(x["max_rel_diff"] < 1e-5 for x in r["sweep"])
    saved = json.loads((tmp_path / "bench_decode_groups.json").read_text())
    assert len(saved["rows"]) == 2
