"""scripts/bench_fixed_costs.py on CPU (tiny shape, Triton interpreter, fp32): every part runs,
its checks hold (dequantization bit for bit, splits against the unsplit sums, the one-launch
gradient accumulation equal to autograd's), and the JSON rows carry the documented fields."""

import json

from _script_loader import load_script


def test_bench_fixed_costs_tiny_cpu(tmp_path):
    module = load_script("bench_fixed_costs")
    rc = module.main(["--device", "cpu", "--dtype", "float32", "--grad-dtypes", "float32", "--hidden", "32",
                      "--intermediate", "48", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--rows", "64",
                      "--adapters", "2", "--present", "1", "--rank", "4", "--groups", "o", "--blocks", "1",
                      "--warps", "4", "--splits", "2", "--split-waves", "2", "--out", str(tmp_path)])
    assert rc == 0
    saved = json.loads((tmp_path / "fixed_costs.json").read_text())
    assert saved["device_name"] == "cpu" and saved["errors"] == {}
    rows = saved["rows"]
    accum = [r for r in rows if r["part"] == "accum"]
    assert [(r["present"], r["group"]) for r in accum] == [(2, "o"), (1, "o")]
    for r in accum:  # o: A and B of each of the 2 adapters
        assert r["equal"] and r["absent_unchanged"] and r["max_abs_diff"] == 0.0
        assert r["factors"] == 4 and r["launches_old"] == 5 and r["launches_new"] == 1
        assert r["gather_equal"] and r["gather_launches_old"] == 2
        assert all(r[key] > 0 for key in ("old_ms", "new_ms", "gather_old_ms", "gather_new_ms"))
    assert len([r for r in rows if r["part"] == "accum_layer"]) == 2
    dequant = [r for r in rows if r["part"] == "dequant"]
    assert {r["weight"] for r in dequant} == {"q", "k", "o", "gate", "down"}
    assert all(r["equal"] and r["ms"] > 0 for r in dequant)
    ds = [r for r in rows if r["part"] in ("ds", "s")]
    assert ds and all(r["group"] == "o" and r["max_rel_vs_unsplit"] < 1e-5 for r in ds)
    assert any(r["part"] == "dadb" for r in rows) and any(r["part"] == "layer" for r in rows)
