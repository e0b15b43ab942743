"""scripts/profile_step_host.py on CPU: the engine's host time per step by kind and phase, the
forward's math stubbed out, and its profile."""

import json

from _script_loader import load_script


def test_profile_step_host_tiny_cpu(tmp_path):
    script = load_script("profile_step_host")
    report = script.main(["--device", "cpu", "--dtype", "float32", "--requests", "24", "--max-num-seqs", "16",
                          "--adapters", "6", "--ranks", "4,8", "--prompt", "8", "--new", "6", "--repeat", "2",
                          "--profile", "5", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "profile_step_host.json").read_text())
    total, kinds = saved["breakdown"]["total"], saved["breakdown"]["kinds"]
    assert total["steps"] == sum(k["steps"] for k in kinds) > 0
    assert {k["kind"].split()[0] for k in kinds} == {"decode", "mixed"}  # requests finish and others join
    assert all(k["kind"].split()[2] == "lora" for k in kinds)  # every request has an adapter
    assert saved["decode_host_ms"]["steps"] > 0 and saved["mixed_host_ms"]["steps"] > 0
    assert len(saved["pass_seconds"]) == 2 and saved["cpu_ms_per_step"] > 0
    assert len(report["profile"]) == 5 and all(r["calls"] > 0 for r in report["profile"])
