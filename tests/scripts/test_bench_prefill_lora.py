"""scripts/bench_prefill_lora.py on the CPU (Triton interpreter): the write-first variant and the
per-group timings agree with the torch reference."""

from __future__ import annotations

import json

from _script_loader import load_script


def test_write_first_and_per_group_rows_match_the_reference(tmp_path, capsys):
    bench = load_script("bench_prefill_lora")
    assert bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--rows", "20", "--adapters", "2",
                       "--ranks", "4", "--median-len", "8", "--max-len", "12", "--no-profile", "--per-group",
                       "--variants", "base,segments,write,base-beta1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "write-first LoRA ms" in out and "FAIL" not in out
    report = json.loads(next(tmp_path.rglob("*.json")).read_text())
    (res,) = report["rows"]
    for v in ("segments", "write", "base-beta1"):
        assert res["variants"][v]["rel_err"] < 1e-4, v
    assert set(res["groups"]) == {"qkv", "o", "gate_up", "down"}
    for name, vs in res["groups"].items():
        for v in ("base", "base-beta1", "segments", "write"):
            assert "ms" in vs[v] and vs[v]["rel_err"] < 1e-4, (name, v)
