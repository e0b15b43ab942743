"""scripts/bench_multiturn.py on CPU (tiny shape, fp32): turn 2 reuses turn 1's prompt pages and
pages filled while decoding with prefix caching on, none with it off, and its tokens are equal."""

import json

from _script_loader import load_script


def test_bench_multiturn_tiny_cpu(tmp_path):
    bench = load_script("bench_multiturn")
    report = bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "5",
                         "--adapters", "2", "--prompt-min", "8", "--prompt-max", "24", "--new-tokens", "8",
                         "--user-tokens", "5", "--page-size", "4", "--out", str(tmp_path)])
    on, off = report["prefix_caching_on"], report["prefix_caching_off"]
    assert report["turn2_identical"] == 5
    assert on["turn2"]["prefix_hits"] == 5 and on["turn2"]["reused_past_turn1_prompt_pages"] >= 5 * 4
    assert off["turn2"]["prefix_tokens_reused"] == 0 and on["turn1"]["prefix_tokens_reused"] == 0
    assert on["turn2"]["generated_tokens"] == off["turn2"]["generated_tokens"] == 5 * 8
    saved = json.loads((tmp_path / "bench_multiturn_tiny.json").read_text())
    assert saved["turn2_identical"] == 5 and "turn2_tokens" not in saved["prefix_caching_on"]
