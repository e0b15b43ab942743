"""scripts/bench_nf4_decode.py on CPU (tiny shape, Triton interpreter): every launch (q/k/v and
gate/up as groups), layer and engine row is measured (the kernel now and as it was), the decode
kernel agrees with the reference, the sweep times candidate tilings best first, and the JSON
holds them."""

import json
import math

from _script_loader import load_script


def test_bench_nf4_decode_tiny_cpu(tmp_path):
    module = load_script("bench_nf4_decode")
    report = module.main(["--device", "cpu", "--dtype", "float32", "--hidden", "64", "--intermediate", "128",
                          "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--vocab", "128", "--rows", "1,3",
                          "--decode-rows", "1,2", "--decode-layers", "1", "--decode-steps", "1", "--prompt", "4",
                          "--warmup", "0", "--reps", "1", "--sweep-budget", "0.001", "--copies", "2",
                          "--out", str(tmp_path)])
    assert report["errors"] == {}
    assert [(r["what"], r["rows"]) for r in report["shapes"]] == [
        (w, m) for m in (1, 3) for w in ("qkv", "o", "gate_up", "down")]
    assert [r["rows"] for r in report["layer"]] == [1, 3]
    for r in report["shapes"]:
        assert all(math.isfinite(r[f"{v}_ms"]) and r[f"{v}_ms"] > 0 for v in module.VARIANTS)
        assert r["max_rel"] < 1e-5 and r["today_max_rel"] < 1e-5, r  # fp32: the same weights, other sums
    for r in report["layer"]:
        assert all(math.isfinite(r[f"{v}_ms"]) and r[f"{v}_ms"] > 0 for v in module.VARIANTS)
    assert [(d["variant"], d["rows"]) for d in report["engine"]] == [
        (v, n) for v in ("bf16", "auto", "auto-today") for n in (1, 2)]
    (case,) = report["sweep"]  # the budget stops the sweep after its first case
    assert (case["what"], case["rows"]) == ("o", 1) and len(case["results"]) > 5
    times = [r["ms"] for r in case["results"]]
    assert times == sorted(times) and all(r["max_rel"] < 1e-5 for r in case["results"])
    saved = json.loads((tmp_path / "nf4_decode_h64_i128.json").read_text())
    assert saved["device_name"] == "cpu" and len(saved["shapes"]) == 8 and len(saved["engine"]) == 6
