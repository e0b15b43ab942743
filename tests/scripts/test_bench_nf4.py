"""scripts/bench_nf4.py on CPU (tiny shape, Triton interpreter): every product row and decode row
is measured, the fused GEMM agrees with the buffer path, and the JSON holds them."""

import json
import math

from _script_loader import load_script


def test_bench_nf4_tiny_cpu(tmp_path):
    module = load_script("bench_nf4")
    report = module.main(["--device", "cpu", "--dtype", "float32", "--hidden", "64", "--intermediate", "128",
                          "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--vocab", "128", "--rows", "1,20",
                          "--per-linear", "off", "--decode-rows", "1,2", "--decode-layers", "1", "--decode-steps", "1",
                          "--prompt", "4", "--warmup", "0", "--reps", "1", "--out", str(tmp_path)])
    assert report["errors"] == {}
    rows = report["products"]
    assert [(r["rows"], r["pass"]) for r in rows] == [(1, "forward"), (1, "input_grad"), (20, "forward"),
                                                       (20, "input_grad")]
    for r in rows:
        assert all(math.isfinite(r[f"{v}_ms"]) and r[f"{v}_ms"] > 0 for v in module.VARIANTS)
        assert r["max_rel"] < 1e-5, r  # fp32: the same 4-bit weights, summed in another order
    assert [(d["variant"], d["rows"]) for d in report["decode"]] == [(v, n) for v in module.VARIANTS for n in (1, 2)]
    assert all(d["step_ms"] > 0 for d in report["decode"])
    saved = json.loads((tmp_path / "nf4_h64_i128.json").read_text())
    assert saved["device_name"] == "cpu" and len(saved["products"]) == 4 and len(saved["decode"]) == 6
