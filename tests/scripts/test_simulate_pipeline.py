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
