"""scripts/bench_prefill_swiglu.py on the CPU (Triton interpreter): the gate/up LoRA written first,
added after the product and expanded inside SwiGLU give SwiGLU's reference output."""

from __future__ import annotations

import json

from _script_loader import load_script


def test_variants_match_the_reference(tmp_path, capsys):
    bench = load_script("bench_prefill_swiglu")
    assert bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--rows", "24", "--mixes", "3xmix",
                       "--request-len", "10", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "| 24 | 3xmix |" in out
    report = json.loads(next(tmp_path.rglob("*.json")).read_text())
    (case,) = report["cases"]
    assert set(case["variants"]) == set(bench.VARIANTS)
    for v, row in case["variants"].items():
        assert row["rel_err"] < 1e-4 and "ms" in row, v
    assert case["adapters"] == 3 and case["lora_rel"] > 1e-2  # the adapted variants' outputs carry a LoRA
