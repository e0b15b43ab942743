"""scripts/bench_lora_segments.py on CPU (tiny shape, Triton interpreter, fp32): every mix and
group checked against the reference for each variant (column blocks per expand program x
shrink K splits); grouping decode rows by adapter cuts their tiles to one per adapter; the
padded mix carries the empty tiles of a captured step's table."""

import json

from _script_loader import load_script


def test_bench_lora_segments_tiny_cpu(tmp_path, capsys):
    module = load_script("bench_lora_segments")
    results = module.main(["--shape", "tiny", "--prompts", "2", "--prompt-len", "20", "--decode", "5",
                           "--adapters", "3", "--reps", "1", "--variants", "d,1x1,3x2x2x8", "--block-m", "16", "--max-num-seqs", "6",
                           "--out", str(tmp_path)])
    assert len(results) == 5 * 4 * 3  # mixes x groups x variants
    assert all(r["rel_err"] < 1e-5 for r in results)
    tiles = {r["mix"]: r["tiles"] for r in results}
    assert tiles == {"prefill": 2 * 2, "mixed": 4 + 5, "grouped": 4 + 3, "padded": 3 + 6, "decode": 5}
    assert "grouped" in capsys.readouterr().out
    saved = json.loads((tmp_path / "bench_lora_segments_tiny.json").read_text())
    assert len(saved["results"]) == len(results)
