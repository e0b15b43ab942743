"""scripts/bench_qlora_reference.py on CPU: ours against HF + PEFT (+ bitsandbytes NF4) on a tiny model."""

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
SCRIPT = ROOT / "scripts" / "bench_qlora_reference.py"

needs_reference = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None or importlib.util.find_spec("peft") is None,
    reason="needs bitsandbytes (CPU 4-bit) and peft")


def _tiny_case(steps=1, adapters=2, eval_samples=2):
    rq = load_script("bench_qlora_reference")
    args = rq.parser().parse_args(["--model", "tiny", "--layers", "1", "--steps", str(steps), "--adapters",
                                   str(adapters), "--eval-samples", str(eval_samples)])
    args.min_length = None
    case = rq.bc.build_case(args, "tiny", torch.device("cpu"), torch.float32)
    return rq, case


@needs_reference
def test_reference_variants_build_and_train_one_step(tmp_path):
    """The whole command on the tiny model, one step: the four runs (ours and PEFT, fp32 and NF4
    bases) report losses and held-out losses; ours and PEFT over the fp32 base are the same math
    and agree to fp32 rounding; bitsandbytes' NF4 model really is 4-bit (its losses differ
    from the fp32 base's) and its dequantized weights are compared with ours."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny", "--layers", "1", "--steps", "1", "--adapters", "2",
         "--eval-samples", "2", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "qlora_reference_tiny.json").read_text())
    runs = result["runs"]
    assert set(runs) == {"ours_fp32", "ours_nf4", "peft_fp32", "peft_nf4"}
    for r in runs.values():
        assert len(r["losses"]) == 2 and all(len(l) == 1 for l in r["losses"])
        assert all(torch.isfinite(torch.tensor(r[k])).all() for k in ("eval_before", "eval_after"))
    assert runs["peft_nf4"]["eval_before"] != runs["peft_fp32"]["eval_before"]
    agree = result["summary"]["ours_vs_peft"]["fp32"]
    assert agree["max_step_rel"] <= 1e-5 and agree["max_eval_rel"] <= 1e-5, agree
    dq = result["dequant_vs_bnb"]
    assert dq["projections"] == 7 and dq["values"] > 0 and 0 < dq["rel_error_bnb"] < 0.2
    per = result["summary"]["per_adapter"]
    assert len(per) == 2 and {"ours", "peft"} <= set(per[0]["gap_after"])
    assert "peft_nf4" in proc.stdout and "gap after" in proc.stdout


@needs_reference
def test_peft_run_starts_from_our_init_and_a_scale_error_is_caught():
    """PEFT's adapters start from our bank's factors: with B = 0 its held-out loss is the base's,
    and after one step it matches ours to fp32 rounding; the same PEFT run with adapter a0's A
    doubled (what a wrong LoRA scale does) ends past the tolerance the report checks, and a1,
    untouched, still matches (the comparison has teeth and is per adapter)."""
    import tempfile

    rq, case = _tiny_case()
    ours = rq.train_ours(case, case.params, rq.bc.DEFAULT_OPTIONS, "ours_fp32")
    with tempfile.TemporaryDirectory() as tmp:
        pm = rq.peft_model(rq.hf_base(case, nf4=False, workdir=Path(tmp)), case)
        peft = rq.train_peft(pm, case, "peft_fp32")
        bad = rq.peft_model(rq.hf_base(case, nf4=False, workdir=Path(tmp)), case)
        with torch.no_grad():
            for name, p in bad.named_parameters():
                if ".lora_A.a0." in name:
                    p.mul_(2.0)
        wrong = rq.train_peft(bad, case, "peft_a0_scaled")
    for a in range(2):
        assert peft["eval_before"][a] == pytest.approx(ours["eval_before"][a], rel=1e-6)
        assert abs(peft["eval_after"][a] / ours["eval_after"][a] - 1) <= 1e-5
        assert peft["eval_after"][a] != peft["eval_before"][a]  # one step moved it
    assert abs(wrong["eval_after"][0] / ours["eval_after"][0] - 1) > 1e-4
    assert abs(wrong["eval_after"][1] / ours["eval_after"][1] - 1) <= 1e-5
