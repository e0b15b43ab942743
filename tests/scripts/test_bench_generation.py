"""scripts/bench_generation.py on CPU (tiny shape, fp32): every phase runs and ours equals HF + PEFT."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_generation_tiny_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_generation", ROOT / "scripts" / "bench_generation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    report = module.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "5",
                          "--hf-requests", "3", "--hf-batch", "2", "--new-tokens", "3", "--prompt-min", "4",
                          "--prompt-max", "9", "--adapters", "3", "--check", "3", "--check-tokens", "3",
                          "--max-num-seqs", "8", "--max-batched-tokens", "128", "--step-batch", "3",
                          "--step-count", "1", "--profile-steps", "1", "--out", str(tmp_path)])
    assert report["errors"] == {}
    for run in ("ours_all", "ours_all_again", "ours_all_base", "ours_subset", "hf_base", "hf_peft_mixed"):
        assert report[run]["generated_tokens"] == report[run]["requests"] * 3
    for run in ("step_adapters", "step_base"):
        assert report[run]["running"] == 3 and report[run]["steps"] == 1 and report[run]["step_ms"] > 0
    for run in ("profile_adapters", "profile_base"):
        assert report[run]["batch"] == 3 and report[run]["top"] and report[run]["time_per_step_us"] > 0
    assert report["engine"]["cuda_graphs"] is False
    assert report["agreement"]["match_rate"] == 1.0  # fp32: token for token
    saved = json.loads((tmp_path / "bench_generation_tiny.json").read_text())
    assert saved["ours_all"]["requests"] == 5 and "tokens" not in saved["ours_all"]
