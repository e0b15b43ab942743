"""scripts/check_families_gpu.py on CPU (tiny shape, fp32): the engine's greedy tokens and the
training losses of two families (one with every Gemma 2 piece) equal HF + PEFT's."""

import json

from _script_loader import load_script


def test_check_families_tiny_cpu(tmp_path):
    check = load_script("check_families_gpu")
    report = check.main(["--families", "llama,gemma2", "--device", "cpu", "--dtype", "float32", "--hidden", "64",
                         "--intermediate", "96", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "128",
                         "--prompts", "4", "--prompt-len", "16", "--max-new", "5", "--adapters", "2",
                         "--out", str(tmp_path)])
    assert report["ok"] and not report["errors"]
    for row in report["families"]:
        assert row["token_match"] == 1.0 and row["exact_requests"] == row["requests"] == 4
        assert row["loss_max_rel_diff"] < 1e-5 and len(row["loss_ours"]) == 2
    saved = json.loads((tmp_path / "families.json").read_text())
    assert [r["family"] for r in saved["families"]] == ["llama", "gemma2"] and saved["ok"]
