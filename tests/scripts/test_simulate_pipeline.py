"""scripts/simulate_pipeline.py on CPU: the simulated table (no-flush vs flushed 1F1B) and the
real executor on a tiny model in one-GPU and PP=2 layouts (gloo), with its JSON."""

import json
import math

from _script_loader import load_script


def test_simulated_table(capsys):
    module = load_script("simulate_pipeline")
    module.main(["--workloads", "xsum", "--adapters", "2", "--stages", "2", "4", "--batches", "2",
                 "--batch-size", "4"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| xsum |")]
    assert len(rows) == 2
    for row in rows:  # bubble ratios are percentages, the speed-up a positive ratio
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert 0 <= float(cells[4].rstrip("%")) <= 100 and 0 <= float(cells[5].rstrip("%")) <= 100
        assert float(cells[6].rstrip("x")) > 0


def test_measure_tiny_cpu(tmp_path):
    module = load_script("simulate_pipeline")
    out = tmp_path / "measure.json"
    module.main(["--measure", "--tiny", "--device", "cpu", "--modes", "one", "pp2", "--measure-adapters", "2",
                 "--measure-batches", "2", "--batch-size", "4", "--capacity", "512", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert [r["stage"] for r in saved["runs"]["pp2"]] in ([0, 1], [1, 0]) and len(saved["runs"]["one"]) == 1
    summary = saved["summary"]
    # both layouts train the same samples; the numbers are well-formed, not compared with a clock
    assert summary["one"]["tokens"] == summary["pp2"]["tokens"] > 0
    assert 0 <= summary["pp2_bubble_measured"] <= 1 and 0 <= summary["pp2_bubble_simulated"] <= 1
    assert all(math.isfinite(summary[m]["tokens_per_s"]) and summary[m]["tokens_per_s"] >= 0 for m in ("one", "pp2"))


def test_cost_model_follows_the_split_and_cost_options():
    """Default: the time model and its balanced split (16/16 on the 8B shape); --stage-layers
    pins a split; --cost flops is the FLOPs model and its split (17/15)."""
    from argparse import Namespace

    module = load_script("simulate_pipeline")
    args = Namespace(stage_layers=None, cost="time", label_fraction=0.08, launch_overhead=0.0, step_time=0.0,
                     p2p_latency=0.0, p2p_bandwidth=1e11, flops=4e14)
    timed = module.cost_model(2, args)
    assert timed.stage_layers == (16, 16) and timed.head_token_fraction == 0.08
    pinned = module.cost_model(2, Namespace(**{**vars(args), "stage_layers": [17, 15]}))
    assert pinned.stage_layers == (17, 15) and pinned.layer_bytes_per_token == timed.layer_bytes_per_token > 0
    assert module.cost_model(4, Namespace(**{**vars(args), "stage_layers": [17, 15]})).stage_layers == (8, 8, 8, 8)
    flops = module.cost_model(2, Namespace(**{**vars(args), "cost": "flops"}))
    assert flops.stage_layers == (17, 15) and flops.head_token_fraction == 1.0 and flops.layer_bytes_per_token == 0


def test_backward_ratio_is_never_negative_when_backward_is_below_the_overhead():
    module = load_script("simulate_pipeline")
    fwd = {0: 0.010, 1: 0.012, 2: 0.011}
    bwd = {0: 0.004, 1: 0.005, 2: 0.006}  # shorter than the fitted per-launch overhead below
    ratio = module._backward_ratio(fwd, bwd, intercept=0.008)
    assert math.isclose(ratio, 0.005 / 0.012)  # median of the plain ratios 0.40, 0.42, 0.55
    # above the overhead: the ratio of the times above it
    assert math.isclose(module._backward_ratio({0: 0.010}, {0: 0.014}, intercept=0.002), 1.5)
