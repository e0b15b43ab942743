"""scripts/bench_dora.py on CPU (tiny shape): ours and PEFT, LoRA and DoRA, one row each and the JSON."""

import json
import math

from _script_loader import load_script


def test_bench_dora_tiny_cpu(tmp_path):
    module = load_script("bench_dora")
    rows = module.main(["--device", "cpu", "--dtype", "float32", "--hidden", "32", "--intermediate", "48",
                        "--heads", "4", "--kv-heads", "2", "--layers", "1", "--vocab", "64", "--tokens", "32",
                        "--sample-len", "16", "--rank", "4", "--warmup", "0", "--reps", "1", "--out", str(tmp_path)])
    assert [r["variant"] for r in rows] == list(module.VARIANTS)
    assert all(math.isfinite(r["median_ms"]) and r["median_ms"] > 0 for r in rows)
    saved = json.loads((tmp_path / "dora_h32_l1_t32_r4.json").read_text())
    assert saved["device_name"] == "cpu" and [r["variant"] for r in saved["rows"]] == list(module.VARIANTS)
