"""scripts/bench_fp8_swiglu.py on CPU (Triton interpreter, fp32, tiny width): the fused kernels
agree with the unfused path (the same row scales, h / dg / du to fp32 rounding) for the
default launch and a given one."""

from _script_loader import load_script


def test_bench_fp8_swiglu_tiny_cpu(tmp_path, capsys):
    module = load_script("bench_fp8_swiglu")
    results = module.main(["--rows", "3", "--width", "96", "--configs", "auto,4/32", "--out", str(tmp_path)])
    assert [f["config"] for f in results[0]["fused"]] == ["auto", "4/32"]
    for f in results[0]["fused"]:
        assert f["same_scales"] == (1.0, 1.0)
        assert f["rel_err"] < 1e-6
    assert "scales =" in capsys.readouterr().out
    assert (tmp_path / "bench_fp8_swiglu.json").exists()
