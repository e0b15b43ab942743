"""The console entry point: YAML config, --print_config, training, checkpoints, PEFT export,
W&B offline, and clear errors before training for bad input."""

import json
import os
import subprocess
import sys

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "tiny.yaml")


def run_cli(args, cwd, env_extra=None, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "WANDB"))}
    env.update({"HOME": str(cwd), "PYTHONPATH": REPO})
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "lightning_lorafusion.cli", *args], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=timeout,
    )


def test_print_config_resolves_demo_yaml(tmp_path):
    out = run_cli(["fit", "--config", os.path.join(REPO, "configs", "demo.yaml"), "--print_config"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = yaml.safe_load(out.stdout)
    names = [a["name"] for a in cfg["model"]["adapters"]]
    assert names == ["challenge", "approach", "outcome"]
    assert cfg["model"]["adapters"][1]["rank"] == 16 and cfg["data"]["capacity"] == 768


def test_fit_trains_checkpoints_exports_and_logs_wandb_offline(tiny_model_dir, tmp_path):
    out = run_cli(
        ["fit", "--config", TINY, "--model.base_model", tiny_model_dir,
         "--trainer.default_root_dir", str(tmp_path / "run"),
         "--trainer.logger", "lightning.pytorch.loggers.WandbLogger",
         "--trainer.logger.offline", "true", "--trainer.logger.save_dir", str(tmp_path / "run"),
         "--trainer.enable_checkpointing", "true"],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    for name, rank in (("xsum", 4), ("cnndm", 2)):
        d = tmp_path / "run" / "adapters" / name
        cfg = json.loads((d / "adapter_config.json").read_text())
        assert cfg["r"] == rank and (d / "adapter_model.safetensors").stat().st_size > 0
    ckpts = list((tmp_path / "run").rglob("*.ckpt"))
    assert ckpts, "no checkpoint written"
    wandb_runs = list((tmp_path / "run").rglob("offline-run-*"))
    assert wandb_runs, "W&B offline run directory missing"
    assert not (tmp_path / ".config" / "wandb").exists() and not (tmp_path / ".cache" / "wandb").exists()
    # resume from the CLI: LightningCLI re-parses the checkpoint's hyperparameters as the model's
    # arguments (once a crash: they held adapter names only), then trains one more epoch
    before = (tmp_path / "run" / "adapters" / "xsum" / "adapter_model.safetensors").read_bytes()
    last = sorted(ckpts, key=os.path.getmtime)[-1]
    out = run_cli(
        ["fit", "--config", TINY, "--model.base_model", tiny_model_dir,
         "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.max_epochs", "2",
         "--ckpt_path", str(last)],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "Restoring states from the checkpoint" in out.stderr + out.stdout
    after = (tmp_path / "run" / "adapters" / "xsum" / "adapter_model.safetensors").read_bytes()
    assert after != before  # the resumed run trained and exported again


@pytest.mark.parametrize(
    "override, message",
    [
        (["--model.adapters.rank", "0"], None),
        (["--data.capacity", "32", "--data.max_length", "48"], "capacity"),
    ],
)
def test_bad_config_fails_before_training(tiny_model_dir, tmp_path, override, message):
    cfg = yaml.safe_load(open(TINY))
    if override[0] == "--model.adapters.rank":
        cfg["model"]["adapters"][0]["rank"] = 0
        message = "rank=0 must be >= 1"
        override = []
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = run_cli(["fit", "--config", str(path), "--model.base_model", tiny_model_dir,
                   "--trainer.default_root_dir", str(tmp_path / "run"), *override], tmp_path)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr[-3000:]
    assert not (tmp_path / "run" / "adapters").exists()


@pytest.mark.parametrize("name", ["tiny.yaml", "tiny_eval.yaml", "gpu_1x.yaml", "gpu_pp2.yaml", "gpu_dp2.yaml"])
def test_every_shipped_config_parses(tmp_path, name):
    out = run_cli(["fit", "--config", os.path.join(REPO, "configs", name), "--print_config"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert yaml.safe_load(out.stdout)["model"]["adapters"]


def test_fit_with_validation_then_validate_subcommand_in_process(tiny_model_dir, tmp_path, monkeypatch):
    """configs/tiny_eval.yaml through the CLI (in this process): step-0 and periodic validation in
    the CSV log, best/last export; then `validate --ckpt_path` on the final checkpoint reproduces
    the last val losses."""
    import csv

    from lightning_lorafusion.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-lorafusion"])  # not pytest's arguments
    run = tmp_path / "run"
    common = ["--config", os.path.join(REPO, "configs", "tiny_eval.yaml"), "--model.base_model", tiny_model_dir,
              "--trainer.default_root_dir", str(run), "--trainer.logger.init_args.save_dir", str(run)]
    main(["fit", *common, "--trainer.enable_checkpointing", "true"])
    rows = list(csv.DictReader(open(next(run.rglob("metrics.csv")))))
    val = [r for r in rows if r.get("val/loss/xsum")]
    assert val[0]["step"] == "0" and len(val) >= 3  # before training, every 4 microbatches, epoch ends
    assert all(r.get("val/ppl/cnndm") for r in val)
    for name in ("xsum", "cnndm"):
        state = json.loads((run / "adapters" / name / "trainer_state.json").read_text())
        assert state["weights"] == "best" and state["val_loss"] is not None
        assert (run / "adapters" / name / "last" / "adapter_model.safetensors").exists()
    assert all(r.get("val/rouge1/xsum") and r.get("val/rougeL/xsum") for r in val)
    samples = [json.loads(line) for line in open(run / "samples.jsonl")]
    assert {s["adapter"] for s in samples} == {"xsum", "cnndm"} and samples[0]["step"] == 0
    assert sum(s["adapter"] == "xsum" for s in samples if s["step"] == 0) == 2
    assert all(s["prompt"] and s["reference"] and "generated" in s for s in samples)
    ckpt = sorted(run.rglob("*.ckpt"), key=os.path.getmtime)[-1]
    main(["validate", *common, "--trainer.logger.init_args.name", "validate", "--ckpt_path", str(ckpt)])
    again = list(csv.DictReader(open(next((run / "validate").rglob("metrics.csv")))))
    assert len(again) == 1
    for name in ("xsum", "cnndm"):
        last = [r for r in val if r.get(f"val/loss/{name}")][-1]
        assert float(again[0][f"val/loss/{name}"]) == pytest.approx(float(last[f"val/loss/{name}"]), rel=1e-6)
