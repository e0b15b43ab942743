"""scripts/bench_generation.py on CPU (tiny shape, fp32): every phase runs and ours equals HF + PEFT."""

import json

from _script_loader import load_script


def test_bench_generation_tiny_cpu(tmp_path):
    module = load_script("bench_generation")
    report = module.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "5",
                          "--hf-requests", "3", "--hf-batch", "2", "--new-tokens", "3", "--prompt-min", "4",
                          "--prompt-max", "9", "--adapters", "3", "--check", "3", "--check-tokens", "3",
                          "--max-num-seqs", "8", "--max-batched-tokens", "128", "--step-batch", "3",
                          "--step-count", "1", "--profile-steps", "1", "--out", str(tmp_path)])
    assert report["errors"] == {}
    for run in ("ours_all", "ours_all_again", "ours_all_base", "ours_subset", "hf_base", "hf_peft_mixed"):
        assert report[run]["generated_tokens"] == report[run]["requests"] * 3
    for run in ("step_adapters", "step_base"):
        assert report[run]["running"] == 3 and report[run]["steps"] == 1 and report[run]["step_ms"] >= 0
    for run in ("profile_adapters", "profile_base"):
        assert report[run]["batch"] == 3 and report[run]["top"] and report[run]["time_per_step_us"] >= 0
    assert report["engine"]["cuda_graphs"] is False
    assert report["agreement"]["match_rate"] == 1.0  # fp32: token for token
    saved = json.loads((tmp_path / "bench_generation_tiny.json").read_text())
    assert saved["ours_all"]["requests"] == 5 and "tokens" not in saved["ours_all"]


def test_bench_generation_prefill_attention_variants_tiny_cpu(tmp_path):
    """``--prefill-attention varlen,paged --prefill-reps 2``: an engine per value (the paged one
    runs the torch paged prefill reference on the CPU), each with its prefill phase; fp32 greedy
    tokens equal across the two."""
    module = load_script("bench_generation")
    report = module.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "4",
                          "--new-tokens", "2", "--prompt-min", "4", "--prompt-max", "30", "--adapters", "2",
                          "--max-num-seqs", "8", "--max-batched-tokens", "128", "--skip-hf",
                          "--prefill-attention", "varlen,paged", "--prefill-reps", "2", "--out", str(tmp_path)])
    assert report["errors"] == {}
    for mode in ("varlen", "paged"):
        assert report[f"{mode}_engine"]["prefill_attention"] == mode
        assert report[f"{mode}_ours_all"]["generated_tokens"] == 4 * 2
        pre = report[f"{mode}_prefill"]
        assert pre["requests"] == 4 and pre["steps"] == [1, 1] and 0 <= pre["wall_s_min"] <= pre["wall_s_median"]
    assert report["prefill_attention_agreement"]["paged_"]["match_rate"] == 1.0


def test_bench_generation_fp8_base_variant_tiny_cpu(tmp_path):
    """``--base-precision bf16,fp8``: an engine over the same weights quantized to e4m3
    (emulated FP8 products on the CPU), with its own rows; both generate every token."""
    from lightning_lorafusion.kernels.fp8_linear import is_quantized

    module = load_script("bench_generation")
    seen = []
    real_engine = module.Engine

    def recording_engine(config, params, *args, **kwargs):
        seen.append(is_quantized(params["layers"][0]["q_proj"]))
        return real_engine(config, params, *args, **kwargs)

    module.Engine = recording_engine
    report = module.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "4",
                          "--new-tokens", "3", "--prompt-min", "4", "--prompt-max", "20", "--adapters", "2",
                          "--max-num-seqs", "8", "--max-batched-tokens", "128", "--skip-hf", "--step-batch", "4",
                          "--base-precision", "bf16,fp8", "--out", str(tmp_path)])
    assert report["errors"] == {}
    assert seen == [False, True]
    for precision in ("bf16", "fp8"):
        assert report[f"{precision}_engine"]["base_precision"] == precision
        assert report[f"{precision}_ours_all"]["generated_tokens"] == 4 * 3
        assert report[f"{precision}_step_adapters"]["steps"] >= 1
    agreement = report["engine_agreement"]["fp8_"]
    assert 0.0 <= agreement["match_rate"] <= 1.0


def test_bench_generation_mixed_graphs_variants_tiny_cpu(tmp_path):
    """``--mixed-graphs off,eager``: one engine per value over the same weights, with its own
    rows and the runner's mode recorded; both generate every token."""
    module = load_script("bench_generation")
    report = module.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "4",
                          "--new-tokens", "2", "--prompt-min", "4", "--prompt-max", "30", "--adapters", "2",
                          "--max-num-seqs", "8", "--max-batched-tokens", "128", "--skip-hf",
                          "--mixed-graphs", "off,eager", "--out", str(tmp_path)])
    assert report["errors"] == {}
    assert report["mixed_off_engine"]["mixed_graphs"] is None
    assert report["mixed_eager_engine"]["mixed_graphs"] == "eager"
    for mode in ("off", "eager"):
        assert report[f"mixed_{mode}_ours_all"]["generated_tokens"] == 4 * 2


def test_bench_generation_async_decode_variants_tiny_cpu(tmp_path):
    """``--async-decode off,on`` with timed decode steps: an engine per value with its own rows;
    the overlapped one ran steps ahead (its forward is not timed apart) and its fp32 greedy
    tokens equal the step-by-step engine's."""
    module = load_script("bench_generation")
    report = module.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "4",
                          "--new-tokens", "8", "--prompt-min", "4", "--prompt-max", "30", "--adapters", "2",
                          "--max-num-seqs", "8", "--max-batched-tokens", "128", "--skip-hf", "--step-batch", "4",
                          "--step-count", "3", "--async-decode", "off,on", "--out", str(tmp_path)])
    assert report["errors"] == {}
    assert report["async_off_engine"]["async_decode"] is False and report["async_on_engine"]["async_decode"] is True
    assert report["async_on_ours_all"]["generated_tokens"] == report["async_off_ours_all"]["generated_tokens"] == 32
    assert report["async_off_step_adapters"]["forward_ms"] >= 0  # timed apart: a number, not None
    assert report["async_on_step_adapters"]["forward_ms"] is None
    assert report["async_on_step_adapters"]["steps_ahead"] >= 2
    assert report["engine_agreement"]["async_on_"]["match_rate"] == 1.0
