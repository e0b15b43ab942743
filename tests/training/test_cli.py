"""The console entry point: YAML config, --print_config, training, checkpoints, PEFT export,
W&B offline, exit statuses, one-line errors before training for bad input, and no warnings
a user cannot act on."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "tiny.yaml")
# The installed console script (the README installs the package into the venv running pytest).
CONSOLE_SCRIPT = Path(sys.executable).parent / "lightning-lorafusion"
PYTHON_MODULE = (sys.executable, "-m", "lightning_lorafusion.cli")
# Lightning warnings that do not apply to this CLI; neither may reach the user.
ARGS_WARNING = "LightningCLI's args parameter"
CHECKPOINT_WARNING = "Using ModelCheckpoint with manual optimization"
LEAFSPEC_WARNING = "isinstance(treespec, LeafSpec)"  # Lightning's code on torch >= 2.10


def run_cli(args, cwd, env_extra=None, timeout=600, command=None):
    """Run the installed ``lightning-lorafusion`` (or ``command``) on ``args`` with our tree first
    on the path, HOME in ``cwd``; returns the CompletedProcess."""
    if command is None:
        assert CONSOLE_SCRIPT.is_file(), f"{CONSOLE_SCRIPT} is missing: pip install -e . into this venv"
        command = (str(CONSOLE_SCRIPT),)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "WANDB", "LORAFUSION"))}
    env.update({"HOME": str(cwd), "PYTHONPATH": REPO})
    env.update(env_extra or {})
    return subprocess.run(
        [*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


def assert_clean_output(out):
    """No stray object repr (the CLI object once went to sys.exit), no traceback, no
    inapplicable Lightning warning."""
    text = out.stdout + out.stderr
    for unwanted in ("object at 0x", "Traceback", ARGS_WARNING, CHECKPOINT_WARNING):
        assert unwanted not in text, f"{unwanted!r} in output:\n{text[-3000:]}"


def assert_one_error_line(out, message):
    """Exit status 2; stderr has exactly one 'error:' line (holding ``message``), a hint and no
    traceback."""
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], out.stderr[-3000:]
    assert any(line.startswith("hint:") for line in out.stderr.splitlines())
    assert "Traceback" not in out.stderr + out.stdout


def test_print_config_resolves_demo_yaml(tmp_path):
    out = run_cli(["fit", "--config", os.path.join(REPO, "configs", "demo.yaml"), "--print_config"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_clean_output(out)
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
         "--trainer.enable_checkpointing", "true",
         # checkpoints every 2 steps: Lightning's manual-optimization warning would fire here
         "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=2",
         "--trainer.callbacks.save_top_k=-1", f"--trainer.callbacks.dirpath={tmp_path / 'run' / 'checkpoints'}"],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert_clean_output(out)
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
    assert_clean_output(out)
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
    assert_one_error_line(out, message)
    assert not (tmp_path / "run" / "adapters").exists()


def _jsonl_config(tmp_path, model_dir):
    """The tiny config with one adapter reading a JSONL file whose second line is broken."""
    (tmp_path / "train.jsonl").write_text('{"prompt": "what ?", "completion": "one"}\n{"prompt": oops\n')
    cfg = yaml.safe_load(open(TINY))
    cfg["model"]["base_model"] = str(model_dir)
    cfg["model"]["adapters"][0]["dataset"] = {"kind": "jsonl", "path": str(tmp_path / "train.jsonl")}
    path = tmp_path / "jsonl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.parametrize("case", ["missing model", "malformed jsonl", "strategy refusal"])
def test_user_errors_are_one_line(tiny_model_dir, tmp_path, case):
    if case == "missing model":
        args = ["fit", "--config", TINY, "--model.base_model", str(tmp_path / "no-such-model")]
        message = "no-such-model': no such directory"
    elif case == "strategy refusal":  # a ConfigError of the strategy's __init__, wrapped by jsonargparse
        args = ["fit", "--config", TINY, "--model.base_model", tiny_model_dir, "--trainer.strategy",
                "lightning_lorafusion.MultiAdapterPipelineStrategy", "--trainer.strategy.stage_layers", "[0]"]
        message = "stage_layers=[0] must list one positive layer count per pipeline stage"
    else:
        args = ["fit", "--config", _jsonl_config(tmp_path, tiny_model_dir)]
        message = "train.jsonl line 2 is not valid JSON"
    # the second case through `python -m lightning_lorafusion.cli`: same exit status there
    command = None if case == "missing model" else PYTHON_MODULE
    out = run_cli([*args, "--trainer.default_root_dir", str(tmp_path / "run")], tmp_path, command=command)
    assert_one_error_line(out, message)


# In-process runs of cli.main (cheaper than a subprocess: no second import of torch/Lightning).


@pytest.fixture
def in_process(tmp_path, monkeypatch):
    """cli.main as a fresh program would run it: argv holds only the program name (LightningCLI
    warns when it gets args and sees others in sys.argv too), W&B and the working directory in
    tmp_path, our log handler and LORAFUSION_DEBUG restored afterwards."""
    import logging

    from lightning_lorafusion import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-lorafusion"])
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    monkeypatch.setattr(logging.getLogger("lightning_lorafusion"), "handlers", [logging.NullHandler()])
    return cli.main


def test_fit_warns_nothing_inapplicable_and_refuses_a_resume_that_does_not_fit(
    tiny_model_dir, tmp_path, in_process, capsys
):
    def fit_args(name):
        return ["fit", "--config", TINY, "--model.base_model", tiny_model_dir,
                "--trainer.default_root_dir", str(tmp_path / name),
                # every step: Lightning's manual-optimization checkpoint warning would fire each time
                "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=1",
                "--trainer.callbacks.save_top_k=-1", f"--trainer.callbacks.dirpath={tmp_path / name / 'ck'}",
                "--trainer.callbacks.filename={step}"]

    args = fit_args("run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("error", module="lightning_lorafusion")  # ours: none at all
        assert in_process(args) == 0
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if any(w in m for w in (ARGS_WARNING, CHECKPOINT_WARNING, LEAFSPEC_WARNING))], messages
    assert (tmp_path / "run" / "adapters" / "xsum" / "adapter_config.json").is_file()
    capsys.readouterr()
    # step=1 is inside epoch 0: its plan was made for capacity 128, not 64
    code = in_process([*fit_args("resumed"), "--data.capacity", "64",
                       "--ckpt_path", str(tmp_path / "run" / "ck" / "step=1.ckpt")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, err[-3000:]
    assert "checkpoint stopped inside epoch 0" in errors[0] and "data.capacity=128" in errors[0]
    assert "Traceback" not in err and not (tmp_path / "resumed" / "adapters").exists()


@pytest.mark.parametrize("switch", ["--debug", "LORAFUSION_DEBUG=1"])
def test_debug_shows_the_traceback(tmp_path, in_process, capsys, monkeypatch, switch):
    args = ["fit", "--config", TINY, "--model.base_model", str(tmp_path / "no-such-model")]
    if switch == "--debug":
        args.append(switch)
    else:
        monkeypatch.setenv("LORAFUSION_DEBUG", "1")
    assert in_process(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "ConfigError" in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no such directory" in errors[0]


def test_usage_errors_keep_argparse_exit_status(in_process, capsys):
    assert in_process(["fit", "--config", TINY, "--no_such_option", "1"]) == 2
    assert "no_such_option" in capsys.readouterr().err
    assert in_process(["--help"]) == 0
    out = capsys.readouterr().out
    assert "serve" in out and "Exit status" in out


def test_predict_is_not_offered(in_process, capsys):
    """The module has no predict_step: the subcommand is not listed, and asking for it is a
    usage error, not a crash."""
    assert in_process(["--help"]) == 0
    assert "predict" not in capsys.readouterr().out
    assert in_process(["predict", "--config", TINY]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'predict'" in err and "Traceback" not in err


def test_checkpoint_with_other_ranks_is_a_config_error(tiny_model_dir):
    from lightning_lorafusion.specs import AdapterSpec, ConfigError
    from lightning_lorafusion.training.module import LoRAFusionModule

    def module(rank):
        spec = AdapterSpec(name="a", rank=rank, target_modules=("q_proj",),
                           dataset={"kind": "synthetic", "distribution": "xsum", "num_samples": 2})
        return LoRAFusionModule(base_model=tiny_model_dir, adapters=[spec], backend="torch")

    saved = module(2)
    checkpoint = {"state_dict": saved.state_dict()}
    saved.on_save_checkpoint(checkpoint)
    with pytest.raises(ConfigError, match=r"adapter 'a' 0.q_proj.lora_A has shape \(2, 32\) in the checkpoint but \(4, 32\)"):
        module(4).on_load_checkpoint(checkpoint)


def test_fit_with_validation_then_validate_subcommand_in_process(tiny_model_dir, tmp_path, in_process):
    """configs/tiny_eval.yaml through the CLI (in this process): step-0 and periodic validation in
    the CSV log, best/last export; then `validate --ckpt_path` on the final checkpoint reproduces
    the last val losses."""
    import csv

    main = in_process
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
    # the checkpoint Lightning saved right after the last validation (last.ckpt, written when
    # training ends, holds the steps taken after it too)
    ckpt = sorted((p for p in run.rglob("*.ckpt") if p.name != "last.ckpt"), key=os.path.getmtime)[-1]
    main(["validate", *common, "--trainer.logger.init_args.name", "validate", "--ckpt_path", str(ckpt)])
    again = list(csv.DictReader(open(next((run / "validate").rglob("metrics.csv")))))
    assert len(again) == 1
    for name in ("xsum", "cnndm"):
        last = [r for r in val if r.get(f"val/loss/{name}")][-1]
        assert float(again[0][f"val/loss/{name}"]) == pytest.approx(float(last[f"val/loss/{name}"]), rel=1e-6)


def _tiny_with(tmp_path, name, edit):
    """configs/tiny.yaml with ``edit(cfg)`` applied, written to ``tmp_path/name``."""
    cfg = yaml.safe_load(open(TINY))
    edit(cfg)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def assert_usage_error(out, message, suggestion):
    """Exit 2, one 'error:' line holding ``message``, a 'did you mean' hint naming
    ``suggestion``, and no usage text (that is for --help)."""
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    lines = out.stderr.splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], out.stderr[-3000:]
    hints = [line for line in lines if line.startswith("hint:")]
    assert len(hints) == 1 and f"did you mean {suggestion}" in hints[0], out.stderr[-3000:]
    assert "usage:" not in out.stderr and "Traceback" not in out.stderr + out.stdout


def test_config_typos_get_one_error_line_and_a_hint(tmp_path):
    def rename_lr(cfg):
        cfg["model"]["adapters"][0]["learning_rate"] = cfg["model"]["adapters"][0].pop("lr")

    out = run_cli(["fit", "--config", _tiny_with(tmp_path, "typo.yaml", rename_lr)], tmp_path)
    assert_usage_error(out, "Option 'learning_rate' is not accepted", "'lr'")

    def misspell_max_epochs(cfg):
        cfg["trainer"]["max_epoch"] = cfg["trainer"].pop("max_epochs")

    out = run_cli(["fit", "--config", _tiny_with(tmp_path, "typo2.yaml", misspell_max_epochs)], tmp_path)
    assert_usage_error(out, "does not accept option 'trainer.max_epoch'", "'trainer.max_epochs'")
    out = run_cli(["fitt", "--config", TINY], tmp_path)
    assert_usage_error(out, "invalid choice: 'fitt'", "'fit'")
    out = run_cli(["fit", "--help"], tmp_path)  # the full usage, on request only
    assert out.returncode == 0 and "usage:" in out.stdout


def test_an_adapter_named_dot_is_refused_and_the_export_dir_is_untouched(tiny_model_dir, tmp_path):
    export = tmp_path / "exports"
    export.mkdir()
    (export / "keep.txt").write_text("the user's")

    def dot_name(cfg):
        cfg["model"]["adapters"][0]["name"] = "."

    out = run_cli(["fit", "--config", _tiny_with(tmp_path, "dot.yaml", dot_name), "--model.base_model",
                   tiny_model_dir, "--model.export_dir", str(export),
                   "--trainer.default_root_dir", str(tmp_path / "run")], tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "adapter name '.' must be identifier-like" in errors[0], out.stderr[-3000:]
    assert sorted(p.name for p in export.iterdir()) == ["keep.txt"]


def test_checkpoint_and_config_must_agree_for_resume_validate_and_test(tiny_model_dir, tmp_path, in_process):
    """A run trained with tiny_eval.yaml; resuming it with another rank, validating it with a
    config of other adapters, and `test` on it, through the console script."""
    run = tmp_path / "run"
    assert in_process(["fit", "--config", os.path.join(REPO, "configs", "tiny_eval.yaml"),
                       "--model.base_model", tiny_model_dir, "--trainer.default_root_dir", str(run),
                       "--trainer.logger", "false", "--trainer.max_epochs", "1",
                       "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={run / 'ck'}"]) == 0
    ckpt = str(next((run / "ck").glob("*.ckpt")))
    eval_yaml = os.path.join(REPO, "configs", "tiny_eval.yaml")
    common = ["--model.base_model", tiny_model_dir, "--trainer.logger", "false",
              "--trainer.default_root_dir", str(tmp_path / "again"), "--ckpt_path", ckpt]

    cfg = yaml.safe_load(open(eval_yaml))
    cfg["model"]["adapters"][0]["rank"] = 8
    (tmp_path / "rank8.yaml").write_text(yaml.safe_dump(cfg))
    out = run_cli(["fit", "--config", str(tmp_path / "rank8.yaml"), "--trainer.max_epochs", "2", *common], tmp_path)
    assert_one_error_line(out, "model.adapters[xsum].rank is 4 in the checkpoint but 8 in the config")
    assert not (tmp_path / "again" / "adapters").exists()

    def other_adapters(cfg):
        cfg["model"]["adapters"][0]["name"] = "challenge"

    out = run_cli(["validate", "--config", _tiny_with(tmp_path, "other.yaml", other_adapters), *common], tmp_path)
    assert_one_error_line(out, "the checkpoint's adapters do not match the config's")

    out = run_cli(["test", "--config", TINY, *common], tmp_path)  # tiny.yaml: no test_dataset
    assert_one_error_line(out, "no adapter sets one")
    out = run_cli(["test", "--config", eval_yaml, *common], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "adapters on their test data:" in text and "| xsum | 4 |" in text and "| cnndm | 3 |" in text


@pytest.mark.parametrize("edit, old, new", [
    (lambda cfg: cfg["model"].update(base_precision="bf16"), "model.base_precision", "model.precision.base"),
    (lambda cfg: cfg["model"].update(fp8_fast_accumulation=False), "model.fp8_fast_accumulation",
     "model.precision.fp8.fast_accumulation"),
    (lambda cfg: cfg["data"].update(planner="greedy"), "data.planner", "data.planner.method"),
    (lambda cfg: cfg["data"].update(planner_window=2), "data.planner_window", "data.planner.window"),
])
def test_a_renamed_key_is_one_error_line_whose_hint_names_the_new_key(tmp_path, edit, old, new):
    out = run_cli(["fit", "--config", _tiny_with(tmp_path, "old.yaml", edit), "--print_config"], tmp_path)
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    lines = out.stderr.splitlines()
    assert len([line for line in lines if line.startswith("error:")]) == 1, out.stderr[-3000:]
    hints = [line for line in lines if line.startswith("hint:")]
    assert len(hints) == 1 and f"'{old}' is now '{new}'" in hints[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout


def test_the_new_sections_parse_from_yaml(tmp_path):
    def nested(cfg):
        cfg["model"]["precision"] = {"base": "bf16", "fp8": {"fast_accumulation": False}}
        cfg["data"]["planner"] = {"method": "milp", "window": 3}

    out = run_cli(["fit", "--config", _tiny_with(tmp_path, "new.yaml", nested), "--print_config"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    printed = yaml.safe_load(out.stdout)
    assert printed["model"]["precision"] == {"base": "bf16", "fp8": {"fast_accumulation": False, "exempt_layers": 0,
                                                                      "emulate": False}, "nf4": {"gemm": "auto"}}
    assert printed["data"]["planner"] == {"method": "milp", "time_limit": 5.0, "window": 3, "workers": 0}
