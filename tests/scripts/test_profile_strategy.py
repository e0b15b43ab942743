"""scripts/profile_strategy.py without a GPU: the comparison it prints (per-microbatch profiler
differences, largest first; tokens/s ratio) and its argument checks. The two fits themselves ran
on the CPU with a tiny model (the command is in the script's docstring)."""

import pytest

from _script_loader import load_script

PROFILE = load_script("profile_strategy")


def _result(path, tokens_per_s, microbatches, ops):
    return {"path": path, "tokens_per_s": tokens_per_s, "profiled_microbatches": microbatches,
            "cuda_graphs": None, "ops": ops, "fit_s": 1.0}


def test_differences_are_per_microbatch_and_largest_first():
    single = _result("single", 100.0, 4, {"gemm": {"cuda_us": 400.0, "cpu_us": 40.0, "count": 4},
                                         "sync": {"cuda_us": 0.0, "cpu_us": 4.0, "count": 4}})
    strategy = _result("strategy", 80.0, 2, {"gemm": {"cuda_us": 200.0, "cpu_us": 60.0, "count": 2},
                                            "sync": {"cuda_us": 0.0, "cpu_us": 402.0, "count": 8},
                                            "pack": {"cuda_us": 0.0, "cpu_us": 20.0, "count": 2}})
    cuda = PROFILE.differences(single, strategy, "cuda_us")
    assert cuda[0][0] == "gemm" and cuda[0][3] == pytest.approx(0.0)  # 100 us per microbatch each
    cpu = PROFILE.differences(single, strategy, "cpu_us", top=2)
    assert [r[0] for r in cpu] == ["sync", "gemm"]
    assert cpu[0][1:] == pytest.approx((201.0, 1.0, 200.0))
    text = PROFILE.report({"single": single, "strategy": strategy})
    assert "strategy / single-device tokens/s: 0.800" in text
    assert "| sync | 201.0 | 1.0 | +200.0 |" in text


def test_paths_are_checked():
    with pytest.raises(SystemExit, match="--paths"):
        PROFILE.main(["--paths", "single,ddp", "--device", "cpu"])
