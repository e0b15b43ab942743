"""scripts/bench_planner.py on one small workload: every packer's row is written, each plan
holds every sample (the planner's count never below the bound), fills are shares."""

import json

from _script_loader import load_script


def test_bench_planner_small(tmp_path):
    module = load_script("bench_planner")
    rows = module.main(["--workloads", "xsum", "--adapters", "2", "--batches", "2", "--batch-size", "4",
                        "--capacities", "4096", "--stages", "1", "--time-limit", "2", "--max-nodes", "20",
                        "--json", str(tmp_path / "rows.json")])
    (row,) = rows
    assert (row["workload"], row["capacity"], row["stages"], row["solver"]) == ("xsum", 4096, 1, "highs")
    assert row["bound_mbs"] <= row["planner_mbs"] <= row["naive_mbs"]
    for key in ("naive_fill", "greedy_fill", "milp_merge_fill", "planner_fill"):
        assert 0 < row[key] <= 1
    assert row["cycles"] == 2 and row["gpu_s_per_cycle"] >= 0
    assert json.loads((tmp_path / "rows.json").read_text()) == json.loads(json.dumps(rows))
