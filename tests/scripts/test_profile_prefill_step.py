"""scripts/profile_prefill_step.py on CPU (tiny shape, fp32): a row per prompt count with every
step's wall time, host phases that fit inside the wall time, prompts that reach the forward
(more tokens, more prepare work), and the warm-up's report."""

from _script_loader import load_script


def test_profile_prefill_step_tiny_cpu(tmp_path, capsys):
    module = load_script("profile_prefill_step")
    report = module.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--decode", "3", "--prompts",
                          "0,2", "--prompt-len", "6", "--repeats", "2", "--adapters", "2", "--warm-up",
                          "--cprofile", "1", "--out", str(tmp_path)])
    rows = {r["prompts"]: r for r in report["rows"]}
    assert sorted(rows) == [0, 2] and rows[2]["tokens"] == 2 * 6 + 3 and rows[0]["tokens"] == 3
    for r in rows.values():
        assert len(r["walls_ms"]) == 2 and all(w > 0 for w in r["walls_ms"])
        assert r["prepare_ms"] + r["forward_ms"] + r["logits_ms"] <= r["wall_ms"] + 1e-6
        assert r["device_ms"] is None  # CPU: no CUDA events
    assert rows[0]["prepare_ms"] == 0 and rows[2]["prepare_ms"] > 0  # decode-only steps skip prepare
    assert "engine.py" in report["cprofile"] and "step" in report["cprofile"]
    out = capsys.readouterr().out
    assert "Engine.warm_up: {'requests': " in out and "every step's wall ms" in out
    assert (tmp_path / "profile_prefill_step_tiny.json").exists()
