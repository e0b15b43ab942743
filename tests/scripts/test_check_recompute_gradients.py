"""scripts/check_recompute_gradients.py on a tiny fp32 model, eager elementwise work: every
recomputation setting's losses and LoRA gradients equal the keeping step's bit for bit, and a
deliberately wrong rebuild of the norm outputs shows as a gap of the gradients' own size."""

from _script_loader import load_script

# dropout 0: the torch LoRA then keeps the norm output itself (as the fused kernels always do), so
# the rebuilt one is read
TINY = ["--bases", "bf16", "--fusions", "off", "--layers", "1", "--tokens", "64", "--hidden", "64",
        "--intermediate", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "96", "--dtype", "float32",
        "--dropout", "0", "--device", "cpu"]


def test_every_setting_matches_the_keeping_step_exactly(tmp_path):
    script = load_script("check_recompute_gradients")
    report = script.main([*TINY, "--out", str(tmp_path)])
    rows = report["rows"]
    assert len(rows) == len(script.SETTINGS) and not report["errors"]
    assert all(r["exact"] and r["loss_gap"] == 0 and r["bar_failures"] == 0 for r in rows), rows
    assert (tmp_path / "recompute_gradients.json").exists()
    wrong = script.main([*TINY, "--wrong-rebuild"])["rows"]
    assert all(r["exact"] != r["norms"] for r in wrong), wrong  # only the rebuilding rows are off
    assert min(r["rel_norm"] for r in wrong if r["norms"]) > 0.1, wrong
