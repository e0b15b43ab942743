"""scripts/bench_warmup.py on CPU (tiny shape, fp32, mixed-step pieces run eagerly): every phase
runs, the trace finishes, and the adapter of a new rank loaded mid-traffic adds no capture."""

import json

from _script_loader import load_script


def test_bench_warmup_tiny_cpu(tmp_path):
    module = load_script("bench_warmup")
    report = module.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--adapters", "6",
                          "--ranks", "4,8,24", "--requests", "12", "--rate", "0", "--prompt-median", "8",
                          "--output-median", "3", "--max-len", "24", "--max-batched-tokens", "32",
                          "--max-num-seqs", "8", "--mixed-graphs", "eager", "--new-every", "2", "--no-restart",
                          "--out", str(tmp_path)])
    trace = report["trace"]
    assert trace["finished"] == trace["requests"] == 12 and not trace["cut"]
    assert trace["new_adapter_rank"] not in (4, 8, 24) and trace["ttft_counts"]["new_adapter"] == 3
    assert trace["captures_before"] == trace["captures_after"]
    assert report["warm_up"]["captures"]["mixed_piece_keys"] == 6  # token buckets 1 .. 32
    saved = json.loads((tmp_path / "bench_warmup.json").read_text())
    assert saved["warm_up"]["ranks"] == [4, 8, 24] and "restart" not in saved
