"""scripts/bench_memory.py on CPU (tiny shape): the bf16 reference row then every capacity x
setting over the NF4 base, each with the accounting's kept bytes; settings parse; rows past the
time budget are skipped, not run."""

import argparse
import json
import math

import pytest
import torch

from _script_loader import load_script

from lightning_lorafusion.model.activation_memory import step_activation_bytes


def test_settings_parse():
    bench = load_script("bench_memory")
    assert bench.parse_setting("none") == ("none", 0)
    assert bench.parse_setting("ckpt8+gate_up") == ("gate_up", 8)
    assert bench.parse_setting("activation+ckpt2") == ("activation", 2)
    with pytest.raises(argparse.ArgumentTypeError, match="setting 'mlp'"):
        bench.parse_setting("mlp")
    with pytest.raises(SystemExit):
        bench.parse_args(["--settings", "none,ckptx"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--extra-rows", "none:2048"])
    args = bench.parse_args(["--capacities", "4096", "--settings", "none", "--extra-rows", "2048:activation"])
    assert bench.planned_rows(args) == [("bf16", 8192, "none"), ("nf4", 4096, "none"), ("nf4", 2048, "activation")]


def test_bench_memory_tiny_cpu(tmp_path):
    bench = load_script("bench_memory")
    rows = bench.main(["--shape", "tiny", "--layers", "2", "--device", "cpu", "--backend", "torch",
                       "--adapters", "2", "--samples", "2", "--global-batch", "2", "--max-length", "64",
                       "--pad-multiple", "16", "--capacities", "128", "--bf16-capacity", "128",
                       "--settings", "none,gate_up,ckpt1+activation", "--out", str(tmp_path)])
    assert [(r["base"], r["capacity"], r["setting"]) for r in rows] == [
        ("bf16", 128, "none"), ("nf4", 128, "none"), ("nf4", 128, "gate_up"), ("nf4", 128, "ckpt1+activation")]
    assert len({r["real_tokens"] for r in rows}) == 1 and rows[0]["real_tokens"] > 0  # the same samples
    for r in rows:
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
    config = load_script("bench_e2e").build_model(argparse.Namespace(layers=2, shape="tiny"), "cpu", torch.float32)[0]
    from lightning_lorafusion.model.decoder_config import DecoderConfig

    config = DecoderConfig.from_hf(config)
    kept = {r["setting"]: r["kept_bytes"] for r in rows[1:]}
    assert kept["gate_up"] == step_activation_bytes(config, 16, 128, dtype=torch.float32, mlp_recompute="gate_up",
                                                    elementwise_compiled=False)
    assert kept["none"] > kept["gate_up"]
    saved = json.loads((tmp_path / "memory_tiny_nf4.json").read_text())
    assert saved["device_name"] == "cpu" and len(saved["rows"]) == 4


def test_rows_past_the_time_budget_are_skipped(tmp_path):
    bench = load_script("bench_memory")
    rows = bench.main(["--shape", "tiny", "--layers", "1", "--device", "cpu", "--backend", "torch",
                       "--adapters", "1", "--samples", "2", "--global-batch", "2", "--max-length", "32",
                       "--pad-multiple", "16", "--capacities", "64", "--bf16-capacity", "0",
                       "--settings", "none,activation", "--time-budget", "0"])
    assert [r.get("error") for r in rows] == ["skipped (time budget)"] * 2
