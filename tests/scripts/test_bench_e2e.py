"""scripts/bench_e2e.py on CPU (tiny shape): HF + PEFT and ours train the same samples, every
row carries its fields, and the JSON is written."""

import json
import math

from _script_loader import load_script


def test_bench_e2e_tiny_cpu(tmp_path):
    module = load_script("bench_e2e")
    rows = module.main(["--shape", "tiny", "--layers", "1", "--device", "cpu", "--variants", "hf,torch",
                        "--adapters", "2", "--samples", "2", "--global-batch", "2", "--max-length", "32",
                        "--capacity", "128", "--out", str(tmp_path)])
    assert [r["variant"] for r in rows] == ["hf", "torch"]
    assert rows[0]["real_tokens"] == rows[1]["real_tokens"] > 0  # the same samples both ways
    for r in rows:
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] >= 0 and r["seconds"] >= 0
    assert rows[1]["microbatches"] >= 1 and 0 < rows[1]["fill"] <= 1
    saved = json.loads((tmp_path / "e2e_tiny_xsum_c128.json").read_text())
    assert saved["device_name"] == "cpu" and [r["variant"] for r in saved["rows"]] == ["hf", "torch"]
