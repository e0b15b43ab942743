"""scripts/profile_mixed_wait.py on CPU: host ms per step by phase of the step path, by kind of
step launched, for both variants, then the bench's runs on the same engine (CPU: no overlapped
decode, so every step is planned after a read; no CUDA events, profiler window or sync check)."""

import json

from _script_loader import load_script


def test_profile_mixed_wait_tiny_cpu(tmp_path):
    script = load_script("profile_mixed_wait")
    report = script.main(["--window", "0", "--sync-check", "off", "--bench-first", "on", "--shape", "tiny",
                          "--device", "cpu", "--dtype", "float32", "--requests", "8", "--adapters", "3",
                          "--ranks", "4,8", "--prompt-median", "10", "--prompt-max", "30", "--output-median", "4",
                          "--output-max", "6", "--arrivals", "burst", "--runs", "lora", "--max-num-seqs", "4",
                          "--warm-up", "off", "--phase-max-s", "3600", "--out", str(tmp_path)])
    for variant in ("old", "new"):
        rows = report[f"phases_{variant}"]
        kinds = {r["kind"]: r for r in rows}
        assert {k.split()[0] for k in kinds} == {"decode", "mixed"}  # requests finish and others join
        assert all(k.endswith("after read") for k in kinds)  # (CPU: no overlapped decode)
        for name, r in kinds.items():
            assert r["steps"] > 0 and r["gpu_s"] is None and r["to_first"] is None
            if name.startswith("mixed"):  # its rows and tables built, its forward launched
                assert r["prepare"] >= r["upload_rows"] > 0 and r["forward"] > 0 and r["decode_forward"] == 0
            else:
                assert r["decode_forward"] > 0 and r["prepare"] == 0
        assert sum(r["steps"] for r in rows) > 0
    saved = json.loads((tmp_path / "profile_mixed_wait.json").read_text())
    assert saved["phases_new"] == json.loads(json.dumps(report["phases_new"]))
    bench = json.loads((tmp_path / "bench_tenants_tiny.json").read_text())
    assert [r["run"] for r in bench["runs"]] == ["lora"] and bench["errors"] == {}
