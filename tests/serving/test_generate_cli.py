"""`lightning-lorafusion generate` as an installed console script on a tiny random model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams
from lightning_lorafusion.serving.generate_cli import run

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("lightning-lorafusion")
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "lightning_lorafusion.cli"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(launcher + ["generate", *args], env=env, capture_output=True, text=True, timeout=300)


def test_generate_command(model_dir, adapter_dirs, tmp_path):
    run_adapters = tmp_path / "run" / "adapters"  # what fit exports: one PEFT directory per adapter
    for name in ("all4", "attn2"):
        shutil.copytree(adapter_dirs[name], run_adapters / name)
    lines = [{"prompt": "w5 w9 w17", "adapter": "all4", "id": "a"},
             {"prompt": "w11 w4 w30 w22", "adapter": "attn2"},
             {"prompt": "w7 w13", "adapter": None, "max_new_tokens": 3},
             {"prompt": "w60 w2 w35", "adapter": "mlp", "ignore_eos": True}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    out = tmp_path / "out.jsonl"
    proc = _cli("--base_model", str(model_dir), "--adapters", str(run_adapters), f"mlp={adapter_dirs['mlp8']}",
                "--prompts", str(prompts), "--prompt", "w8 w16", "--adapter_name", "attn2", "--adapter_name", "base",
                "--out", str(out), "--max_new_tokens", "6", "--device", "cpu", "--dtype", "float32",
                "--prefill_attention", "paged")
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in results] == ["a", "prompts.jsonl:2", "prompts.jsonl:3", "prompts.jsonl:4",
                                          "prompt0-attn2", "prompt0-base"]
    assert [r["adapter"] for r in results] == ["all4", "attn2", None, "mlp", "attn2", None]

    # the same requests straight through an engine (its prompts attending varlen: auto on the CPU)
    engine = Engine.from_pretrained(str(model_dir), {"all4": adapter_dirs["all4"], "attn2": adapter_dirs["attn2"],
                                                     "mlp": adapter_dirs["mlp8"]},
                                    EngineConfig(num_pages=128), device="cpu", dtype=torch.float32)
    settings = [dict(), dict(), dict(max_new_tokens=3), dict(ignore_eos=True), dict(), dict()]
    texts = [x["prompt"] for x in lines] + ["w8 w16", "w8 w16"]
    reqs = [GenerationRequest(prompt_token_ids=engine.tokenizer(t)["input_ids"], adapter=r["adapter"],
                              sampling=SamplingParams(**{"max_new_tokens": 6, "temperature": 0.0, **s}))
            for t, r, s in zip(texts, results, settings)]
    for text, got, want in zip(texts, results, engine.generate(reqs)):
        assert got["prompt"] == text and got["tokens"] == list(want.token_ids) and got["completion"] == want.text
        assert got["finish_reason"] == want.finish_reason and got["prompt_tokens"] == len(want.prompt_token_ids)
    assert len(results[2]["tokens"]) <= 3 and len(results[3]["tokens"]) == 6 and results[3]["finish_reason"] == "length"
    engine.close()

    missing = _cli("--base_model", str(model_dir), "--adapters", str(tmp_path / "nope"), "--prompt", "w5",
                   "--device", "cpu")
    assert missing.returncode == 2 and missing.stdout == ""
    errors = [x for x in missing.stderr.splitlines() if "error:" in x]
    assert len(errors) == 1 and "nope" in errors[0] and "does not exist" in errors[0]


def test_generate_input_mistakes(model_dir, adapter_dirs, tmp_path, capsys):
    """Each refused with exit 2 and one error line, before the model is loaded."""
    prompts = tmp_path / "p.jsonl"
    out = tmp_path / "out.jsonl"
    cases = [
        ('{"prompt": "w5", "adapter": "ghost"}', "'ghost' is not loaded"),
        ('{"prompt": "w5"', "p.jsonl:1: not JSON"),
        ('{"text": "w5"}', 'needs a non-empty string "prompt"'),
        ('{"prompt": "w5", "temprature": 1}', "unknown keys ['temprature']"),
        ('{"prompt": "w5", "max_new_tokens": 0}', "p.jsonl:1: SamplingParams.max_new_tokens=0"),
    ]
    for line, message in cases:
        prompts.write_text(line + "\n")
        code = run(["--base_model", str(model_dir), "--adapters", f"x={adapter_dirs['attn2']}", "--prompts",
                    str(prompts), "--out", str(out), "--device", "cpu"])
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("error:") == 1, (line, err)
        assert not out.exists() and not list(tmp_path.glob(".out.jsonl*"))
    code = run(["--base_model", str(model_dir), "--device", "cpu"])
    assert code == 2 and "nothing to generate" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's own usage error
        run(["--prompt", "w5"])
    assert e.value.code == 2


def _progress_lines(err: str) -> list[str]:
    return [x for x in err.replace("\r", "\n").splitlines() if "requests," in x and "tokens/s" in x]


def test_generate_progress(model_dir, adapter_dirs, tmp_path, capsys, monkeypatch):
    """Progress on standard error when forced on or when it is a terminal; never otherwise, and
    never in the results."""
    out = tmp_path / "out.jsonl"
    base = ["--base_model", str(model_dir), "--adapters", f"x={adapter_dirs['attn2']}", "--prompt", "w5 w9",
            "--prompt", "w7", "--adapter_name", "x", "--max_new_tokens", "4", "--device", "cpu",
            "--dtype", "float32"]
    assert run(base + ["--out", str(out), "--progress", "on"]) == 0
    lines = _progress_lines(capsys.readouterr().err)
    assert lines and lines[-1].startswith("lightning-lorafusion generate: 2/2 requests, ")
    assert int(lines[-1].split(", ")[1].split()[0]) == sum(len(json.loads(x)["tokens"])
                                                          for x in out.read_text().splitlines())
    assert run(base + ["--progress", "on"]) == 0  # results on stdout stay clean
    captured = capsys.readouterr()
    assert _progress_lines(captured.err) and len([json.loads(x) for x in captured.out.splitlines()]) == 2
    for mode in ("auto", "off"):  # standard error is not a terminal here
        assert run(base + ["--out", str(out), "--progress", mode]) == 0
        assert not _progress_lines(capsys.readouterr().err), mode
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert run(base + ["--out", str(out)]) == 0
    assert _progress_lines(capsys.readouterr().err)


class _FakeEngine:
    def __init__(self, snapshots):
        self.snapshots = iter(snapshots)

    def stats(self):
        return next(self.snapshots)


def test_progress_counts_done_requests():
    """Done = submitted since the start minus running and waiting, never going back; tokens and
    requests counted from the engine's totals when the progress began."""
    import io

    from lightning_lorafusion.serving.generate_cli import Progress

    def snap(total, running, waiting, tokens):
        return {"requests_total": total, "running": running, "waiting": waiting, "generated_tokens_total": tokens}

    engine = _FakeEngine([snap(5, 0, 0, 100),  # at the start: 5 earlier requests, 100 earlier tokens
                          snap(9, 3, 1, 110), snap(9, 1, 1, 130), snap(9, 2, 1, 131), snap(9, 0, 0, 140)])
    stream = io.StringIO()
    progress = Progress(engine, 4, stream)
    assert progress.line().startswith("lightning-lorafusion generate: 0/4 requests, 10 tokens generated, ")
    assert progress.line().startswith("lightning-lorafusion generate: 2/4 requests, 30 tokens generated, ")
    assert progress.line().startswith("lightning-lorafusion generate: 2/4 requests, 31 tokens generated, ")
    progress._write(final=True, finished=True)
    assert stream.getvalue().startswith("\rlightning-lorafusion generate: 4/4 requests, 40 tokens generated, ")
    assert stream.getvalue().endswith(" s\n")
