"""scripts/bench_e2e.py on CPU (tiny shape): HF + PEFT and ours train the same samples, every
row carries its fields, and the JSON is written."""

import json
import math

from _script_loader import load_script


def test_bench_e2e_tiny_cpu(tmp_path):
    module = load_script("bench_e2e")
    rows = module.main(["--shape", "tiny", "--layers", "1", "--device", "cpu", "--variants", "hf,torch",
                        "--adapters", "2", "--samples", "2", "--global-batch", "2", "--max-length", "32",
                        "--capacity", "128", "--out", str(tmp_path)])
    assert [r["variant"] for r in rows] == ["hf", "torch"]
    assert rows[0]["real_tokens"] == rows[1]["real_tokens"] > 0  # the same samples both ways
    for r in rows:
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] >= 0 and r["seconds"] >= 0
    assert rows[1]["microbatches"] >= 1 and 0 < rows[1]["fill"] <= 1
    saved = json.loads((tmp_path / "e2e_tiny_xsum_c128.json").read_text())
    assert saved["device_name"] == "cpu" and [r["variant"] for r in saved["rows"]] == ["hf", "torch"]


def test_fixed_workload_has_samples_of_exactly_max_length(tmp_path):
    module = load_script("bench_e2e")
    samples = module.fixed_length_samples(3, 40, vocab_size=50, seed=1)
    assert len(samples) == 3 and all(len(ids) == len(labels) == 40 for ids, labels in samples)
    assert all(labels[:20] == [-100] * 20 and labels[20:] == ids[20:] for ids, labels in samples)
    rows = module.main(["--shape", "tiny", "--layers", "1", "--device", "cpu", "--variants", "torch", "--workload",
                        "fixed", "--adapters", "2", "--samples", "2", "--global-batch", "2", "--max-length", "48",
                        "--capacity", "128", "--out", str(tmp_path)])
    assert rows[0]["real_tokens"] == 2 * 2 * 48


def test_hf_checkpointing_is_on_during_the_hf_passes_only_with_the_flag(tmp_path):
    module = load_script("bench_e2e")
    seen, real_pass = [], module._hf_pass

    def recording_pass(args, peft_model, names, data, device, packed):
        seen.append(peft_model.get_base_model().is_gradient_checkpointing)
        return real_pass(args, peft_model, names, data, device, packed)

    module._hf_pass = recording_pass
    rows = module.main(["--shape", "tiny", "--layers", "1", "--device", "cpu", "--variants", "hf",
                        "--hf-checkpointing", "--adapters", "2", "--samples", "2", "--global-batch", "2",
                        "--max-length", "32", "--capacity", "128", "--out", str(tmp_path)])
    assert seen == [True, True] and rows[0]["real_tokens"] > 0
    seen.clear()
    module.main(["--shape", "tiny", "--layers", "1", "--device", "cpu", "--variants", "hf", "--adapters", "2",
                 "--samples", "2", "--global-batch", "2", "--max-length", "32", "--capacity", "128",
                 "--out", str(tmp_path)])
    module._hf_pass = real_pass
    assert seen == [False, False]
