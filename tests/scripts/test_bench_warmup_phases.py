"""scripts/bench_warmup.py's phases and time limits on CPU (tiny shape): a phase runs alone, the
restart phase alone reuses the cache directory, and a phase past its limit prints and writes the
partial table and ends the process with status 3."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _script_loader import load_script

TINY = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--adapters", "3", "--ranks", "4,8",
        "--requests", "6", "--rate", "0", "--prompt-median", "6", "--output-median", "2", "--max-len", "12",
        "--max-batched-tokens", "16", "--max-num-seqs", "4"]


def test_trace_phase_alone_runs_without_warm_up_or_new_adapter(tmp_path):
    module = load_script("bench_warmup")
    report = module.main([*TINY, "--phases", "trace", "--out", str(tmp_path)])
    assert "warm_up" not in report and "restart" not in report
    trace = report["trace"]
    assert trace["finished"] == trace["requests"] == 6 and trace["new_adapter_rank"] is None
    assert trace["ttft_counts"]["new_adapter"] == 0
    assert set(report["phase_s"]) == {"build", "trace"}
    rows = dict(line.split("  ", 1) for line in module.table(report).splitlines())
    assert rows["warm_up() s (compile s, pieces s, requests s)"].strip() == "- (-, -, -)"


def test_restart_phase_alone_keeps_the_cache(tmp_path):
    module = load_script("bench_warmup")
    cache = tmp_path / "cache"
    (cache / "triton").mkdir(parents=True)
    (cache / "triton" / "left-by-an-earlier-run").write_text("x")
    report = module.main([*TINY, "--phases", "restart", "--cache-dir", str(cache), "--out", str(tmp_path)])
    assert (cache / "triton" / "left-by-an-earlier-run").exists()
    assert report["restart"]["warm_up"]["requests"] > 0 and set(report["phase_s"]) == {"restart"}


def test_phases_and_limits_are_checked():
    module = load_script("bench_warmup")
    args = module.parse_args(["--phases", "warm_up,restart", "--limits", "warm_up=5,restart=7.5"])
    assert args.phases == ["warm_up", "restart"] and args.limits == {"warm_up": 5.0, "restart": 7.5}
    for bad in (["--phases", "warmup"], ["--limits", "decode=3"], ["--limits", "warm_up"]):
        with pytest.raises(SystemExit):
            module.parse_args(bad)


def test_a_phase_past_its_limit_prints_the_partial_table(tmp_path):
    """warm_up limited to a hundredth of a second: the build's numbers are in the table and JSON,
    warm_up is marked cut, the process exits 3."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_warmup.py"
    env = {**os.environ, "PYTHONPATH": str(script.parents[1])}
    proc = subprocess.run([sys.executable, str(script), *TINY, "--phases", "warm_up,trace", "--limits",
                           "warm_up=0.01", "--out", str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "cut" in proc.stdout and "engine build s" in proc.stdout
    saved = json.loads((tmp_path / "bench_warmup.json").read_text())
    assert saved["cut"] == ["warm_up"] and saved["warm_up"]["cut_after_s"] == 0.01
    assert saved["build"]["engine_s"] > 0 and "trace" not in saved
