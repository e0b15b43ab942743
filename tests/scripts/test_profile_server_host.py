"""scripts/profile_server_host.py on CPU: the real server over the stub engine streams every token
of every request to the clients, and the server process's CPU time is read."""

import json

from _script_loader import load_script


def test_profile_server_host_streams_every_token(tmp_path):
    module = load_script("profile_server_host")
    report = module.main(["--concurrency", "2", "--step-ms", "2", "--seconds", "1", "--prompt-tokens", "8",
                          "--new-tokens", "5", "--out", str(tmp_path)])
    assert report["requests"] >= 2
    assert report["tokens_per_s"] > 0 and report["server_cpu_s"] >= 0
    saved = json.loads((tmp_path / "profile_server_host.json").read_text())
    assert saved["requests"] == report["requests"] and saved["stub_tokens_per_s"] == 1000.0
    # each request ran to its end (the clients stop between requests): all 5 tokens streamed
    assert report["tokens"] == 5 * report["requests"]
