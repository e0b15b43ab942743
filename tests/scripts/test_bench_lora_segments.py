"""scripts/bench_lora_segments.py on CPU (tiny shape, Triton interpreter, fp32): every mix and
group checked against the reference for each column-block count; grouping decode rows by
adapter cuts their tiles to one per adapter."""

import json

from _script_loader import load_script


def test_bench_lora_segments_tiny_cpu(tmp_path, capsys):
    module = load_script("bench_lora_segments")
    results = module.main(["--shape", "tiny", "--prompts", "2", "--prompt-len", "20", "--decode", "5",
                           "--adapters", "3", "--reps", "1", "--n-blocks", "1,3", "--block-m", "16",
                           "--out", str(tmp_path)])
    assert len(results) == 4 * 4 * 2  # mixes x groups x column-block counts
    assert all(r["rel_err"] < 1e-5 for r in results)
    tiles = {r["mix"]: r["tiles"] for r in results}
    assert tiles == {"prefill": 2 * 2, "mixed": 4 + 5, "grouped": 4 + 3, "decode": 5}
    assert "grouped" in capsys.readouterr().out
    saved = json.loads((tmp_path / "bench_lora_segments_tiny.json").read_text())
    assert len(saved["results"]) == len(results)
