"""scripts/bench_memory.py on CPU (tiny shape): the bf16 reference row then every capacity x
setting over the NF4 base, each with the accounting's kept bytes; settings parse; rows past the
time budget are skipped, not run."""

import argparse
import json
import math
import re

import pytest
import torch

from _script_loader import load_script

from lightning_lorafusion.model.activation_memory import step_activation_bytes


def test_settings_parse():
    bench = load_script("bench_memory")
    Setting = bench.Setting
    assert bench.parse_setting("none") == Setting("none", 0)
    assert bench.parse_setting("ckpt8+gate_up") == Setting("gate_up", 8)
    assert bench.parse_setting("activation+ckpt2") == Setting("activation", 2)
    assert bench.parse_setting("activation+norms+graphs") == Setting("activation", 0, norm_recompute=True, graphs=True)
    assert bench.parse_setting("graphs") == Setting(graphs=True)
    assert bench.parse_setting("activation24+norms+graphs") == Setting(
        "activation", norm_recompute=True, graphs=True, mlp_recompute_layers=24)
    assert bench.parse_setting("activation+norms16") == Setting("activation", norm_recompute=True,
                                                                 norm_recompute_layers=16)
    for text in ("none4", "graphs2", "activation+norm8"):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"setting '{text}'")):
            bench.parse_setting(text)
    with pytest.raises(argparse.ArgumentTypeError, match="setting 'mlp'"):
        bench.parse_setting("mlp")
    assert bench.parse_setting("ckpt2+activation+graphs+hostembed") == bench.Setting(
        mlp_recompute="activation", checkpoint_layers=2, graphs=True, host_embedding=True)
    assert bench.parse_setting("activation+graphs+levels") == Setting("activation", graphs=True, capacity_levels=3)
    assert bench.parse_setting("none+levels2") == Setting(capacity_levels=2)
    with pytest.raises(argparse.ArgumentTypeError, match="setting 'levelsx'"):
        bench.parse_setting("levelsx")
    assert bench.parse_setting("activation+graphs+autogradacc") == Setting(
        "activation", graphs=True, autograd_accumulation=True)
    with pytest.raises(argparse.ArgumentTypeError, match="autogradacc apply to graphs"):
        bench.parse_setting("activation+autogradacc")
    with pytest.raises(SystemExit):
        bench.parse_args(["--settings", "none,ckptx"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--extra-rows", "none:2048"])
    args = bench.parse_args(["--capacities", "4096", "--settings", "none", "--extra-rows", "2048:activation"])
    assert bench.planned_rows(args) == [("bf16", 8192, "none"), ("nf4", 4096, "none"), ("nf4", 2048, "activation")]
    args = bench.parse_args(["--capacities", "4096", "--settings", "none", "--bf16-capacity", "4096",
                             "--bf16-setting", "none+graphs"])
    assert bench.planned_rows(args)[0] == ("bf16", 4096, "none+graphs")
    with pytest.raises(SystemExit):
        bench.parse_args(["--bf16-setting", "mlp"])


def test_bench_memory_tiny_cpu(tmp_path):
    bench = load_script("bench_memory")
    rows = bench.main(["--shape", "tiny", "--layers", "2", "--device", "cpu", "--backend", "torch",
                       "--adapters", "2", "--samples", "2", "--global-batch", "2", "--max-length", "64",
                       "--pad-multiple", "16", "--capacities", "128", "--bf16-capacity", "128",
                       "--settings", "none,gate_up,ckpt1+activation,gate_up+norms,graphs+levels2",
                       "--out", str(tmp_path)])
    assert [(r["base"], r["capacity"], r["setting"]) for r in rows] == [
        ("bf16", 128, "none"), ("nf4", 128, "none"), ("nf4", 128, "gate_up"), ("nf4", 128, "ckpt1+activation"),
        ("nf4", 128, "gate_up+norms"), ("nf4", 128, "graphs+levels2")]
    levels = rows[-1]  # the same microbatches (the step in graphs), each at the smaller of two capacities holding it
    assert 1 <= len(levels["capacities"]) <= 2 and max(levels["capacities"]) <= 128
    assert levels["computed_fill"] >= levels["fill"] and "capacities" not in rows[1]
    assert len({r["real_tokens"] for r in rows}) == 1 and rows[0]["real_tokens"] > 0  # the same samples
    for r in rows:
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
    config = load_script("bench_e2e").build_model(argparse.Namespace(layers=2, shape="tiny"), "cpu", torch.float32)[0]
    from lightning_lorafusion.model.decoder_config import DecoderConfig

    config = DecoderConfig.from_hf(config)
    kept = {r["setting"]: r["kept_bytes"] for r in rows[1:-1]}
    assert kept["gate_up"] == step_activation_bytes(config, 16, 128, dtype=torch.float32, mlp_recompute="gate_up",
                                                    elementwise_compiled=False)
    assert kept["none"] > kept["gate_up"]
    assert kept["gate_up+norms"] == step_activation_bytes(config, 16, 128, dtype=torch.float32, mlp_recompute="gate_up",
                                                          elementwise_compiled=False, norm_recompute=True)
    assert kept["gate_up+norms"] < kept["gate_up"]
    saved = json.loads((tmp_path / "memory_tiny_nf4.json").read_text())
    assert saved["device_name"] == "cpu" and len(saved["rows"]) == 6


def test_a_graphs_row_runs_the_captured_step_with_its_options(monkeypatch):
    """``graphs`` turns on the CUDA-graph step (precaptured, as ``fit`` does) for that row only,
    with the row's recomputation options; its replay counts reach the row."""
    bench = load_script("bench_memory")
    calls = []

    def fake_run_ours(args, *a, graphs=False, precapture=False, options=None, **k):
        calls.append((args.capacity, graphs, precapture, options.mlp_recompute, options.norm_recompute,
                      options.mlp_recompute_layers, options.norm_recompute_layers))
        extra = {"graphs": 1, "replays": 4, "refusals": {}} if graphs else {}
        return 100.0, 1.0, 100, 1.0, 2, extra

    monkeypatch.setattr(bench, "run_ours", fake_run_ours)
    w = _tiny_workload(layers=2)
    args = bench.parse_args(["--device", "cpu", "--rank", "4"])
    graphs_row = bench._run_row(args, w, "nf4", 64, "activation+norms+graphs")
    eager_row = bench._run_row(args, w, "nf4", 64, "activation")
    partial_row = bench._run_row(args, w, "nf4", 64, "activation1+norms0")
    assert calls == [(64, True, True, "activation", True, None, None),
                     (64, False, False, "activation", False, None, None), (64, False, False, "activation", True, 1, 0)]
    assert graphs_row["replays"] == 4 and "replays" not in eager_row
    # the kept bytes count the partial setting per layer (2 layers: the second keeps everything)
    plain_row = bench._run_row(args, w, "nf4", 64, "none")
    assert eager_row["kept_bytes"] < partial_row["kept_bytes"] < plain_row["kept_bytes"]


def test_rows_past_the_time_budget_are_skipped(tmp_path):
    bench = load_script("bench_memory")
    rows = bench.main(["--shape", "tiny", "--layers", "1", "--device", "cpu", "--backend", "torch",
                       "--adapters", "1", "--samples", "2", "--global-batch", "2", "--max-length", "32",
                       "--pad-multiple", "16", "--capacities", "64", "--bf16-capacity", "0",
                       "--settings", "none,activation", "--time-budget", "0"])
    assert [r.get("error") for r in rows] == ["skipped (time budget)"] * 2


def test_capture_memory_parts_parse_and_reach_the_graphs():
    """``largest``, ``release``, ``poolwarm`` and ``preN`` set the graphs' ``CaptureMemory`` and
    precapture budget of that row (graph rows only); ``expandable`` is the allocator's setting,
    for any row."""
    bench = load_script("bench_memory")
    from lightning_lorafusion.training.cuda_graphs import DEFAULT_CAPTURE_MEMORY, CaptureMemory
    from lightning_lorafusion.training.graph_cover import DEFAULT_PRECAPTURE

    s = bench.parse_setting("none+norms+graphs+largest+release+poolwarm+pre1+expandable")
    assert s == bench.Setting("none", 0, norm_recompute=True, graphs=True, precapture=1, expandable=True,
                              memory=CaptureMemory(largest_first=True, release=True, warm_in_pool=True))
    plain = bench.parse_setting("graphs+largest")
    assert plain.memory == CaptureMemory(largest_first=True) and plain.precapture == DEFAULT_PRECAPTURE
    assert bench.parse_setting("activation+expandable") == bench.Setting("activation", expandable=True)
    assert bench.parse_setting("graphs").memory == DEFAULT_CAPTURE_MEMORY
    for text in ("none+largest", "activation+pre2", "norms+poolwarm"):
        with pytest.raises(argparse.ArgumentTypeError, match="add \\+graphs"):
            bench.parse_setting(text)


def test_a_graphs_row_passes_its_capture_memory(monkeypatch):
    bench = load_script("bench_memory")
    seen = []

    def fake_run_ours(args, *a, graph_kwargs=None, **k):
        seen.append(graph_kwargs)
        return 100.0, 1.0, 100, 1.0, 2, {"graphs": 1, "replays": 4, "refusals": {},
                                         "pools": {"graphs": {"reserved": 1.0, "allocated": 0.1}}}

    monkeypatch.setattr(bench, "run_ours", fake_run_ours)
    from lightning_lorafusion.training.cuda_graphs import CaptureMemory

    w = _tiny_workload()
    args = bench.parse_args(["--device", "cpu", "--rank", "4"])
    row = bench._run_row(args, w, "nf4", 64, "none+graphs+largest+pre2")
    bench._run_row(args, w, "nf4", 64, "none+graphs+autogradacc")
    assert seen == [{"memory": CaptureMemory(largest_first=True), "max_precapture": 2, "accumulate_grads": True},
                    {"memory": CaptureMemory(), "max_precapture": bench.DEFAULT_PRECAPTURE, "accumulate_grads": False}]
    assert row["pools"]["graphs"]["reserved"] == 1.0
    bench.print_table([row], args, "cpu")  # the pool columns format


def test_earlier_rows_head_the_table_labelled_with_their_allocator_settings(tmp_path, capsys, monkeypatch):
    """Rows of another process (another PYTORCH_CUDA_ALLOC_CONF) come first, labelled with it, and
    count for the best tok/s the ratios are taken against."""
    bench = load_script("bench_memory")
    base = {"base": "nf4", "capacity": 64, "kept_bytes": 0, "seconds": 1.0, "peak_gib": 1.0, "reserved_gib": 2.0}
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"rows": [{**base, "setting": "graphs", "tokens_per_s": 200.0,
                                             "alloc_conf": ""}]}))
    monkeypatch.setattr(bench, "run_ours", lambda *a, **k: (100.0, 1.0, 100, 1.0, 2, {}))
    monkeypatch.setattr(bench, "model_and_workload", lambda args: (torch.device("cpu"), torch.float32, None,
                                                                    None, None))
    monkeypatch.setattr(bench, "step_activation_bytes", lambda *a, **k: 0)
    from lightning_lorafusion.model import hf_loading

    monkeypatch.setattr(hf_loading, "params_from_hf_model", lambda model: (None, None))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    rows = bench.main(["--device", "cpu", "--capacities", "64", "--settings", "none", "--bf16-capacity", "0",
                       "--earlier-rows", str(earlier), "--out", str(tmp_path / "out")])
    assert [r["alloc_conf"] for r in rows] == ["expandable_segments:True"]
    table = capsys.readouterr().out.split("PYTORCH_CUDA_ALLOC_CONF=")[1].splitlines()
    lines = [line for line in table if line.startswith("nf4")]
    assert lines[0].split()[2] == "graphs" and "2.000x" not in lines[0] and "1.000x" in lines[0]
    assert "none [expandable_segments:True]" in lines[1] and "0.500x" in lines[1]


def _tiny_workload(layers: int = 1) -> dict:
    """What ``bench_memory._run_row`` reads of a workload, for a tiny model on CPU (one layer)."""
    from lightning_lorafusion.model.decoder_config import DecoderConfig

    hf_config = load_script("bench_e2e").build_model(argparse.Namespace(layers=layers, shape="tiny"), "cpu",
                                                     torch.float32)[0]
    return {"device": torch.device("cpu"), "dtype": torch.float32, "hf_config": None, "model": None, "data": None,
            "quantized": {}, "config": DecoderConfig.from_hf(hf_config)}


def test_kernel_time_summary_splits_short_kernels():
    e2e = load_script("bench_e2e")
    s = e2e.kernel_time_summary([("gemm", 8, 8000.0), ("lora_add", 40, 400.0), ("idle", 0, 0.0)], microbatches=4)
    assert s["kernels"] == 12 and s["device_ms"] == 2.1
    assert s["short_kernels"] == 10 and s["short_ms"] == 0.1
    assert s["top"][0] == ("gemm", 8, 2.0)
    bench = load_script("bench_memory")
    args = bench.parse_args(["--profile-rows", "2816:activation+graphs,4096:none"])
    assert args.profile_rows == ["2816:activation+graphs", "4096:none"]
