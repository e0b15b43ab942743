"""scripts/check_recompute_gradients.py on a tiny fp32 model, eager elementwise work: every
recomputation setting's losses and LoRA gradients equal the keeping step's bit for bit."""

from _script_loader import load_script


def test_every_setting_matches_the_keeping_step_exactly(tmp_path):
    script = load_script("check_recompute_gradients")
    report = script.main(["--bases", "bf16,nf4", "--fusions", "off", "--layers", "1", "--tokens", "64",
                          "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
                          "--vocab", "96", "--dtype", "float32", "--device", "cpu", "--out", str(tmp_path)])
    rows = report["rows"]
    assert len(rows) == 2 * len(script.SETTINGS) and not report["errors"]
    assert all(r["exact"] and r["loss_gap"] == 0 and r["bar_failures"] == 0 for r in rows), rows
    assert (tmp_path / "recompute_gradients.json").exists()
