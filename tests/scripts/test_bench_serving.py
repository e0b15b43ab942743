"""scripts/bench_serving.py on CPU (tiny shape, fp32): a trace replayed in real time through the
engine and both PEFT baselines, every request served, the same greedy tokens everywhere."""

import json
import math

from _script_loader import load_script


def test_bench_serving_tiny_cpu(tmp_path):
    bench = load_script("bench_serving")
    trace = bench.make_trace(num_requests=200, rate=50.0, cv=1.0, adapters=["a", "b", "c"], popularity="zipf",
                             alpha=1.0, prompt_len=(4, 9), output_len=(2, 5), vocab=64, seed=0)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(trace, trace[1:])]
    assert 0.015 < sum(gaps) / len(gaps) < 0.025  # mean gap 1 / rate
    counts = [sum(it.request.adapter == a for it in trace) for a in "abc"]
    assert counts[0] > counts[1] > counts[2]  # Zipf: adapter 0 most popular
    assert all(4 <= len(it.request.prompt_token_ids) <= 9 and 2 <= it.request.sampling.max_new_tokens <= 5
               for it in trace)

    report = bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--num-adapters", "3",
                         "--requests", "8", "--rate", "40", "--prompt-len", "4,24", "--output-len", "2,6",
                         "--max-batched-tokens", "12", "--max-num-seqs", "6", "--unchunked", "3",
                         "--baseline-requests", "6", "--baseline-batch", "4", "--prefill-attention", "paged",
                         # no replay is cut by a clock: every request must be served however loaded the host
                         "--point-max-s", "3600", "--baseline-max-s", "3600", "--out", str(tmp_path)])
    assert report["errors"] == {} and report["skipped"] == []
    runs = {(r["run"], r.get("chunked_prefill")): r for r in report["points"] + report["baselines"]}
    assert set(runs) == {("ours", True), ("ours_subset", True), ("ours", False), ("peft_mixed", None),
                         ("peft_switch", None)}
    for r in runs.values():  # structure only: wall-clock outcomes (SLO, speed) depend on the host's load
        assert r["complete"] == r["requests"] and r["generated_tokens"] > 0
        assert all(math.isfinite(r[k]) and r[k] >= 0 for k in ("wall_s", "tokens_per_s", "requests_per_s"))
        assert 0.0 <= r["slo_attainment"] <= 1.0 and r["slo_ttft_s"] == 6.0
        assert r["ttft_s"]["p50"] <= r["ttft_s"]["p90"] <= r["ttft_s"]["p99"] and r["ttft_s"]["p50"] >= 0
    # ours: every prompt through the paged prefill reference (--prefill-attention paged)
    assert all(r["prefill_attention"] == "paged" for (run, _), r in runs.items() if run.startswith("ours"))
    assert runs[("ours", True)]["prefill_chunks"] > 0 and runs[("ours", False)]["prefill_chunks"] == 0
    assert runs[("ours", True)]["tokens"] == runs[("ours", False)]["tokens"]
    for b in ("peft_mixed", "peft_switch"):  # fp32: the baselines generate exactly our tokens
        assert runs[(b, None)]["agreement"]["identical"] == runs[(b, None)]["agreement"]["compared"] == 6
    saved = json.loads((tmp_path / "bench_serving_tiny.json").read_text())
    assert len(saved["points"]) == 3 and "tokens" not in saved["points"][0]
