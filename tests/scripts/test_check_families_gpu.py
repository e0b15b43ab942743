"""scripts/check_families_gpu.py on CPU (tiny shape, fp32): the engine's greedy tokens, its
teacher-forced log-probs and the training losses of two families (one with every Gemma 2 piece)
equal HF + PEFT's; a wrong norm convention or a missing soft-cap fails the log-prob bar."""

import dataclasses
import json

import pytest
from _script_loader import load_script

TINY = ["--device", "cpu", "--dtype", "float32", "--hidden", "64", "--intermediate", "96", "--layers", "2",
        "--heads", "4", "--kv-heads", "2", "--vocab", "128", "--prompts", "4", "--prompt-len", "16", "--max-new", "5",
        "--adapters", "2"]


def test_check_families_tiny_cpu(tmp_path):
    check = load_script("check_families_gpu")
    report = check.main(["--families", "llama,gemma2", *TINY, "--out", str(tmp_path)])
    assert report["ok"] and not report["errors"]
    for row in report["families"]:
        assert row["token_match"] == 1.0 and row["exact_requests"] == row["requests"] == 4
        assert row["loss_max_rel_diff"] < 1e-5 and len(row["loss_ours"]) == 2
        # every token after the first of 4 sequences of ~16 + 5 tokens, scored by both models
        assert row["logprob_tokens"] == sum(16 - 3 * (i % 4) + 5 - 1 for i in range(4))
        assert row["logprob_max_abs_diff"] < 1e-4
    saved = json.loads((tmp_path / "families.json").read_text())
    assert [r["family"] for r in saved["families"]] == ["llama", "gemma2"] and saved["ok"]


def _norms_plus_one(original):
    """Our side multiplies by (1 + w) where the checkpoint means w (new tensors: the HF model's stay)."""
    def mutated(model):
        config, params = original(model)
        layers = params["layers"].values() if isinstance(params["layers"], dict) else params["layers"]
        for layer in layers:
            for key in [k for k in layer if k.endswith("norm")]:
                layer[key] = layer[key] + 1.0
        return config, params
    return mutated


def _without_soft_caps(original):
    def mutated(model):
        config, params = original(model)
        family = dataclasses.replace(config.family, attn_logit_softcap=None, final_logit_softcap=None)
        return dataclasses.replace(config, family=family), params
    return mutated


@pytest.mark.parametrize("family, mutation", [("llama", _norms_plus_one), ("gemma2", _norms_plus_one),
                                              ("gemma2", _without_soft_caps)])
def test_a_wrong_family_piece_fails_the_logprob_bar(monkeypatch, family, mutation):
    check = load_script("check_families_gpu")
    monkeypatch.setattr(check, "params_from_hf_model", mutation(check.params_from_hf_model))
    report = check.main(["--families", family, *TINY])
    (row,) = report["families"]
    assert not row["ok"] and not report["ok"]
    assert row["logprob_mean_abs_diff"] > 4 * check.LOGPROB_ATOL


def test_logprob_bar_is_calibrated_by_hfs_own_rounding():
    check = load_script("check_families_gpu")
    row = {"logprob_mean_abs_diff": 0.066, "logprob_ours_vs_fp32": 0.05, "logprob_hf_vs_fp32": 0.04}
    assert check.logprob_ok(row, 0.05, 1.5)  # over the absolute bar, but no farther from fp32 than HF
    assert not check.logprob_ok({**row, "logprob_ours_vs_fp32": 0.5}, 0.05, 1.5)  # 12x HF's own error
    assert not check.logprob_ok({**row, "logprob_ours_vs_fp32": None, "logprob_hf_vs_fp32": None}, 0.05, 1.5)
    assert check.logprob_ok({**row, "logprob_mean_abs_diff": 0.01, "logprob_ours_vs_fp32": None}, 0.05, 1.5)


def test_bf16_check_scores_against_an_fp32_copy_of_hf(tmp_path, monkeypatch):
    """In bf16 (on the CPU) both distances to HF's fp32 log-probs are measured; a wrong norm
    convention lands far beyond HF's own bf16 distance, so the calibrated bar still fails it."""
    check = load_script("check_families_gpu")
    bf16 = [x if x != "float32" else "bfloat16" for x in TINY]
    (row,) = check.main(["--families", "gemma2", *bf16, "--out", str(tmp_path)])["families"]
    assert row["ok"] and 0 < row["logprob_hf_vs_fp32"] and row["logprob_ours_vs_fp32"] < 1.5 * row["logprob_hf_vs_fp32"] + 0.05
    monkeypatch.setattr(check, "params_from_hf_model", _norms_plus_one(check.params_from_hf_model))
    (bad,) = check.main(["--families", "gemma2", *bf16])["families"]
    assert not bad["ok"] and bad["logprob_ours_vs_fp32"] > 4 * bad["logprob_hf_vs_fp32"]
