"""scripts/bench_fairness.py on CPU (tiny shape, fp32): every run serves every request of its
trace, and the report (JSON under --out) has each tenant class's TTFT summary."""

import json

from _script_loader import load_script


def test_bench_fairness_tiny_cpu(tmp_path):
    bench = load_script("bench_fairness")
    report = bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--flood-requests", "6",
                         "--light-tenants", "2", "--light-requests", "2", "--light-rate", "50", "--light-start",
                         "0.01", "--max-num-seqs", "2", "--max-batched-tokens", "64", "--new-tokens", "3",
                         "--prompt-min", "4", "--prompt-max", "8", "--cpu-pool-mib", "16",
                         "--out", str(tmp_path)])
    assert report["alone"]["generated_tokens"] == 2 * 2 * 3 and report["alone"]["flood"] == {"requests": 0}
    for run in ("fifo", "fair"):
        assert report[run]["generated_tokens"] == (6 + 4) * 3
        assert report[run]["light"]["requests"] == 4 and report[run]["flood"]["requests"] == 6
        assert 0 < report[run]["light"]["ttft_p50_s"] <= report[run]["light"]["ttft_max_s"]
    saved = json.loads((tmp_path / "bench_fairness_tiny.json").read_text())
    assert saved["fair"]["light"] == report["fair"]["light"] and saved["args"]["flood_requests"] == 6
