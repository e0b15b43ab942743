"""scripts/bench_server.py on CPU (tiny shape, fp32): every mode runs the same requests, none is lost,
the greedy texts agree, the JSON and the table are written; with --engine-process the server's
engine is built in a child process from the same seeds (same weights: same texts)."""

import json
import math

import pytest

from _script_loader import load_script

ARGS = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--new-tokens", "4", "--prompt-min", "4",
        "--prompt-max", "12", "--adapters", "3", "--ranks", "4,8", "--num-pages", "512", "--max-num-seqs", "8",
        "--max-batched-tokens", "256"]


@pytest.mark.parametrize("load,client", [(["--requests", "10", "--concurrency", "4", "--repeats", "2",
                                           "--client-lib", "httpx"], "thread"),
                                         (["--requests", "6", "--rate", "100", "--zipf", "1.0", "--new-tokens-max",
                                           "9"], "process"),
                                         (["--requests", "6", "--concurrency", "3", "--engine-process",
                                           "--compare-in-process", "--compare-direct-process", "--repeats", "2"],
                                          "thread")])
def test_bench_server_tiny_cpu(tmp_path, capsys, load, client):
    module = load_script("bench_server")
    report = module.main(ARGS + load + ["--client", client, "--out", str(tmp_path)])
    n = report["args"]["requests"]
    lengths = report["output_lengths"]  # each request's own length with --new-tokens-max
    if report["args"]["new_tokens_max"] is None:
        assert lengths == {"min": 4, "max": 4, "total": n * 4}
    else:
        assert 4 <= lengths["min"] < lengths["max"] <= 9
    modes = ["direct", "http"] + (["http_in_process"] if report["args"]["compare_in_process"] else [])
    if report["args"]["compare_direct_process"]:  # the child engine streamed without HTTP, same requests
        r = report["direct_process"]
        assert (r["complete"], r["errors"], r["generated_tokens"]) == (n, 0, lengths["total"])
        assert r["steps_total"] > 0 and report["direct_process_texts"]["equal"] == n
        assert report["http_vs_direct_process_overhead"] == pytest.approx(
            1 - report["http"]["tokens_per_s"] / r["tokens_per_s"])
        warm = report["repeats"][1:]
        rate = {m: sum(x[m]["generated_tokens"] for x in warm) / sum(x[m]["wall_s"] for x in warm)
                for m in ("http", "direct_process")}
        assert report["http_vs_direct_process_overhead_pooled_warm"] == pytest.approx(
            1 - rate["http"] / rate["direct_process"])
    for mode in modes:
        r = report[mode]
        assert (r["requests"], r["complete"], r["errors"], r["incomplete"]) == (n, n, 0, 0), r
        assert r["generated_tokens"] == lengths["total"]
        # structure only: which clock reads larger depends on the host's load
        assert r["ttft_s"]["p99"] >= r["ttft_s"]["p50"] >= 0 and r["itl_s"]["p99"] >= r["itl_s"]["p50"] >= 0
        assert r["steps_total"] > 0  # read from the engine that served the mode
        view = module.engine_view(r)
        assert view["rows_per_step"] >= 1 and view["busy_s"] >= 0 and view["decode_step_s"] >= 0
        # every request got a first token (the HTTP modes' counts include the clients' warm-up)
        assert r["first_tokens_total"] >= n and view["engine_ttft_s"] >= 0
        if mode != "direct":  # the server's histogram saw the measured requests
            assert math.isfinite(view["server_ttft_s"]) and view["server_ttft_s"] >= 0
            # the clients' own CPU, when they have a process of their own
            assert (r["client_cpu_s"] is None) == (client == "thread")
            assert client == "thread" or (math.isfinite(r["client_cpu_s"]) and r["client_cpu_s"] >= 0)
    view = module.engine_view(report["direct"])
    assert view["busy_s"] >= 0 and view["engine_ttft_s"] >= 0 and view["client_ttft_s"] >= 0
    assert report["direct"]["first_tokens_total"] == n
    for key in ("texts", "http_in_process_texts")[:len(modes) - 1]:
        assert report[key]["compared"] == n and report[key]["equal"] == n  # fp32 greedy: same text
        assert report[key]["mean_chars"] > 0
    assert report["http_overhead"] == 1 - report["http"]["tokens_per_s"] / report["direct"]["tokens_per_s"]
    repeats = report["repeats"]
    assert len(repeats) == report["args"]["repeats"] and repeats[-1]["http"] == report["http"]
    for row in repeats:  # every repeat ran every request in every mode
        assert all(row[m]["complete"] == n and row[m]["errors"] == 0 for m in modes)
    assert report["http_overhead_per_repeat"] == [r["http_overhead"] for r in repeats]
    direct_rate = sum(r["direct"]["generated_tokens"] for r in repeats) / sum(r["direct"]["wall_s"] for r in repeats)
    http_rate = sum(r["http"]["generated_tokens"] for r in repeats) / sum(r["http"]["wall_s"] for r in repeats)
    assert report["http_overhead_pooled"] == pytest.approx(1 - http_rate / direct_rate)
    warm = repeats[1:] or repeats
    direct_rate = sum(r["direct"]["generated_tokens"] for r in warm) / sum(r["direct"]["wall_s"] for r in warm)
    http_rate = sum(r["http"]["generated_tokens"] for r in warm) / sum(r["http"]["wall_s"] for r in warm)
    assert report["http_overhead_pooled_warm"] == pytest.approx(1 - http_rate / direct_rate)
    saved = json.loads((tmp_path / "bench_server_tiny.json").read_text())
    assert saved["http"]["complete"] == n and saved["direct"]["generated_tokens"] == lengths["total"]
    out = capsys.readouterr().out
    label = "http (engine process)" if report["args"]["engine_process"] else "http"
    assert out.rstrip().splitlines()[-len(modes) + 1] == f"greedy texts equal to direct, {label}: {n}/{n}"
    assert "direct " in out and f"{label} overhead" in out and "engine view" in out
    assert ("overhead against direct (engine process)" in out) == report["args"]["compare_direct_process"]
    if "http_in_process" in modes:
        assert "http (in-process) overhead" in out and report["http_in_process_overhead"] < 1
