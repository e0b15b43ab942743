"""scripts/bench_pipeline.py without GPUs: every run's config resolves to the layout it claims; a job
over its time limit is killed with its whole process tree and the next one still runs; the
table adds up side-by-side jobs."""

import contextlib
import io
import os
import sys
import time

import pytest
import yaml

from _script_loader import load_script

BENCH_PIPELINE = load_script("bench_pipeline")
JOBS = [(run.name, job) for run in BENCH_PIPELINE.RUNS + BENCH_PIPELINE.RUNS_2GPU for job in run.jobs]


def _resolved_config(args, tmp_path, monkeypatch) -> dict:
    """``fit ... --print_config`` in this process (a subprocess per config costs ~20 s of imports)."""
    from lightning_lorafusion.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-lorafusion"])  # pytest's own arguments are not ours
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(args)  # the CLI returns its exit status (--print_config included)
    assert code == 0, out.getvalue()[-3000:]
    return yaml.safe_load(out.getvalue())


@pytest.mark.parametrize("name, job", JOBS, ids=[f"{n}{'_' + j.tag if j.tag else ''}" for n, j in JOBS])
def test_each_run_config_resolves_to_its_layout(tmp_path, monkeypatch, name, job):
    cmd = BENCH_PIPELINE.fit_command(sys.executable, job, str(tmp_path / "run"), [], launcher="lightning")
    assert cmd[1:4] == ["-m", "lightning_lorafusion.cli", "fit"]
    torchrun = BENCH_PIPELINE.fit_command(sys.executable, job, str(tmp_path / "run"), [])
    assert torchrun[torchrun.index("--nproc_per_node") + 1] == str(job.procs)
    assert torchrun[torchrun.index("lightning_lorafusion.cli"):] == cmd[2:]
    cfg = _resolved_config(cmd[3:] + ["--print_config"], tmp_path, monkeypatch)
    trainer, model = cfg["trainer"], cfg["model"]
    strategy = trainer["strategy"]["init_args"] if isinstance(trainer["strategy"], dict) else trainer["strategy"]
    adapters = [a["name"] for a in model["adapters"]]
    assert trainer["default_root_dir"] == str(tmp_path / "run") and trainer["devices"] == job.procs
    assert trainer["precision"] == "bf16-true" and trainer["max_epochs"] == 2
    import importlib

    from lightning_lorafusion.training.callbacks import RunSummary

    def import_object(path):
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)

    # the configs name the package-level export; it must be the training callback itself
    assert [import_object(c["class_path"]) for c in trainer["callbacks"]] == [RunSummary]
    assert model["backend"] == "auto" and model["export_on_fit_end"] is False
    assert all(a["rank"] == 16 and a["target_modules"] == "all-linear" for a in model["adapters"])
    if name.startswith("70b"):
        stages = 2 if "_pp2_" in name else 4
        assert model["base_model"] == "random:llama70b" and trainer["devices"] == stages
        assert strategy["pipeline_size"] == stages
        assert model["activation_checkpointing"] == (16 if stages == 2 else False)
        assert strategy["schedule"] == ("flushed_1f1b" if name.endswith("flushed") else "no_flush")
        assert len(adapters) == (1 if "_1ad" in name else 4)
        want = ["xsum", "cnndm", "wikisum", "mixed"] if "_het_" in name else None
        assert want is None or adapters == want
        assert all(a["dataset"]["distribution"] == "mixed" for a in model["adapters"]) or "_het_" in name
    else:
        assert model["base_model"] == "random:llama8b"
        if name.startswith("8b_single"):  # the single-device path: no strategy of ours
            assert (trainer["devices"], strategy) == (1, "auto")
        else:
            layout = {"8b_pp2xdp2": (4, 2), "8b_dp4": (4, 1), "8b_2jobs_pp2": (2, 2), "8b_pp2": (2, 2),
                      "8b_pp2_flops": (2, 2), "8b_dp2": (2, 1), "8b_2jobs_1gpu": (1, 1),
                      "8b_strategy_pp1": (1, 1), "8b_pp2_ckpt16": (2, 2), "8b_pp2_ckpt16_even": (2, 2),
                      "8b_pp2_trace": (2, 2)}[name]
            assert (trainer["devices"], strategy["pipeline_size"]) == layout
            # the FLOPs and even split rows name theirs; every other run takes the default (balanced by time)
            pinned = {"8b_pp2_flops": [17, 15], "8b_pp2_ckpt16_even": [16, 16]}.get(name)
            assert strategy.get("stage_layers") == pinned
            assert model["activation_checkpointing"] == (16 if "ckpt16" in name else False)
            assert strategy.get("action_trace") == ("actions" if name == "8b_pp2_trace" else None)
        assert model["lm_head_loss"] == "fused"
        want = {"a": ["mixed1", "mixed2"], "b": ["mixed3", "mixed4"]}.get(job.tag, ["mixed1", "mixed2", "mixed3", "mixed4"])
        assert adapters == want


def test_a_job_over_its_limit_is_killed_with_its_children_and_others_report(tmp_path):
    """The child runs under setsid, as torchrun's ranks do: killing the job's process
    group alone would leave it running (and holding its GPU)."""
    pid_file = tmp_path / "child.pid"
    sleeper = ("import subprocess, sys, time; "
               "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
               "start_new_session=True); "
               f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(600)")
    commands = [([sys.executable, "-c", sleeper], dict(os.environ), str(tmp_path / "slow.log")),
                ([sys.executable, "-c", "import sys; sys.exit(3)"], dict(os.environ), str(tmp_path / "bad.log")),
                ([sys.executable, "-c", "print('fine')"], dict(os.environ), str(tmp_path / "ok.log"))]
    statuses = BENCH_PIPELINE.run_jobs(commands, limit_s=5.0)
    assert statuses == ["timeout", "exit 3", "ok"]
    child = int(pid_file.read_text())
    time.sleep(0.5)
    assert not _alive(child), "the job's child process outlived the time limit"
    assert "fine" in (tmp_path / "ok.log").read_text()


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that never comes in some containers is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _summary(gpus, pp, adapters, epochs):
    return {"gpus": gpus, "pipeline_size": pp, "data_parallel_size": gpus // pp, "adapters": adapters,
            "schedule": "no_flush", "peak_tflops": 1000.0, "epochs": epochs}


def _epoch(epoch, tokens, wall, flops, start, peaks, bubble=0.1, sim=0.08):
    return {"epoch": epoch, "real_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "useful_flops": flops, "start_unix": start, "end_unix": start + wall, "bubble_ratio": bubble,
            "simulated_bubble_ratio": sim, "peak_allocated_gib": peaks, "microbatches": 10, "noop_slots": 1}


def test_side_by_side_jobs_add_rates_and_the_table_reads_the_last_epoch():
    a = _summary(2, 2, ["a1", "a2"], [_epoch(0, 100, 10.0, 1e15, 0.0, [9.0, 9.0]),
                                      _epoch(1, 1000, 4.0, 4e15, 10.0, [50.0, 40.0], bubble=0.05)])
    b = _summary(2, 2, ["b1", "b2"], [_epoch(0, 100, 10.0, 1e15, 0.0, [9.0, 9.0]),
                                      _epoch(1, 1200, 5.0, 6e15, 11.0, [51.0, 41.0], bubble=0.07)])
    row = BENCH_PIPELINE.combine([a, b])
    assert row["epoch"] == 1 and row["adapters"] == 4 and row["gpus"] == 4
    assert row["tokens_per_s"] == pytest.approx(1000 / 4.0 + 1200 / 5.0)
    assert row["mfu"] == pytest.approx((4e15 / 4.0 + 6e15 / 5.0) / (4 * 1000e12))
    assert row["bubble_ratio"] == pytest.approx(0.06)
    assert row["peak_allocated_gib"] == [50.0, 40.0, 51.0, 41.0]
    assert row["overlap"] == pytest.approx((14.0 - 11.0) / (16.0 - 10.0))
    single = BENCH_PIPELINE.combine([_summary(4, 4, ["x"], [_epoch(0, 500, 5.0, 2e15, 0.0, [1.0] * 4)])])
    results = [{"name": "8b_2jobs_pp2", "status": "ok", "row": row},
               {"name": "70b_pp4_mixed_1ad", "status": "timeout", "row": single},
               {"name": "8b_dp4", "status": "exit 1", "row": None}]
    text = BENCH_PIPELINE.table(results)
    assert "| 8b_2jobs_pp2 | PP2xDP1 + PP2xDP1 | 4 | 490 |" in text
    assert "| 8b_dp4 | - |" in text and "exit 1" in text
    assert text.splitlines()[0].count("|") == text.splitlines()[1].count("|") == text.splitlines()[4].count("|")
    assert "timeout (epoch 0 only: includes warm-up)" in text
    assert BENCH_PIPELINE.combine([a, None]) is None


def test_graph_captures_per_epoch_from_the_log():
    log = "\n".join([
        "[lorafusion] CUDA graphs: captured GraphKey(capacity=8192, max_seqlen=4096, num_blocks=16, "
        "label_rows=1024) up front in 6.07 s (1 graphs)",
        "[lorafusion] CUDA graphs: epoch 0: 9 shape keys over 42 microbatches (all replicas); 1 graphs captured "
        "up front in 6.50 s: [(8192, 4096, 16, 1024)]; 1 graphs held",
        "[lorafusion] CUDA graphs: epoch 0: 9 shape keys over 42 microbatches (all replicas); 1 graphs captured "
        "up front in 6.20 s: [(8192, 4096, 16, 1024)]; 1 graphs held",
        "[lorafusion] CUDA graphs: captured GraphKey(capacity=8192, max_seqlen=8192, num_blocks=8, "
        "label_rows=512) in 1.09 s (2 graphs)",
        "[lorafusion] epoch 1 planned (greedy): 20 microbatches of 8192 tokens, fill 96.3%",
        "[lorafusion] CUDA graphs: epoch 1: 7 shape keys over 40 microbatches (all replicas); 0 graphs captured "
        "up front in 0.00 s: []; 2 graphs held",
    ])
    got = BENCH_PIPELINE.graph_captures(log)
    assert got[0] == {"up_front": 2, "up_front_s": pytest.approx(12.7), "mid_epoch": 1,
                      "mid_epoch_s": pytest.approx(1.09)}
    assert got[1] == {"up_front": 0, "up_front_s": 0.0, "mid_epoch": 0, "mid_epoch_s": 0.0}
    assert BENCH_PIPELINE._captures_cell(got[0]) == "2 (12.7 s) / 1 (1.1 s)"
    assert BENCH_PIPELINE.graph_captures("no graphs here") == {}


def test_graph_replays_per_stage_from_the_log():
    """The epoch-end line of each rank (training/epoch_graphs.log_replays): counts are cumulative,
    the last epoch's (largest) per stage; stage 0 split into forward / backward, the last fused."""
    log = "\n".join([
        "[lorafusion] CUDA graphs: stage 0 replays: 20 forward, 20 backward, 0 fused; 1 eager; 2 captures",
        "[lorafusion] CUDA graphs: stage 1 replays: 0 forward, 0 backward, 21 fused; 0 eager; 1 captures",
        "[lorafusion] CUDA graphs: stage 0 replays: 40 forward, 40 backward, 0 fused; 1 eager; 2 captures",
        "[lorafusion] CUDA graphs: stage 1 replays: 0 forward, 0 backward, 41 fused; 0 eager; 1 captures",
    ])
    got = BENCH_PIPELINE.graph_replays(log)
    assert got == {0: {"forward": 40, "backward": 40, "fused": 0, "eager": 1, "captures": 2},
                   1: {"forward": 0, "backward": 0, "fused": 41, "eager": 0, "captures": 1}}
    assert BENCH_PIPELINE._replays_cell(got) == ("s0: F/B 40/40, eager 1, captures 2; "
                                                 "s1: fused 41, captures 1")
    assert BENCH_PIPELINE.graph_replays("no graphs here") == {} and BENCH_PIPELINE._replays_cell(None) == "-"


def test_rows_report_the_split_and_per_stage_bubbles():
    flops = _summary(2, 2, ["a"], [_epoch(1, 1000, 4.0, 4e15, 0.0, [9.0, 9.0], bubble=0.117)])
    flops["stage_layers"] = [17, 15]
    flops["epochs"][0].update(stage_bubble_ratios=[0.05, 0.183], simulated_stage_bubble_ratios=[0.021, 0.126])
    timed = _summary(2, 2, ["a"], [_epoch(1, 1100, 4.0, 4e15, 0.0, [9.0, 9.0], bubble=0.05)])
    timed["stage_layers"] = [16, 16]
    timed["epochs"][0].update(stage_bubble_ratios=[0.04, 0.06], simulated_stage_bubble_ratios=[0.039, 0.029])
    dp = _summary(2, 1, ["a"], [_epoch(1, 1050, 4.0, 4e15, 0.0, [9.0, 9.0])])
    dp["epochs"][0].update(stage_bubble_ratios=[0.0], simulated_stage_bubble_ratios=[0.0])
    rows = [{"name": n, "status": "ok", "row": BENCH_PIPELINE.combine([s])}
            for n, s in (("8b_pp2_flops", flops), ("8b_pp2", timed), ("8b_dp2", dp))]
    assert rows[0]["row"]["stage_layers"] == "17/15" and rows[2]["row"]["stage_layers"] is None
    text = BENCH_PIPELINE.table(rows + [{"name": "8b_single", "status": "ok",
                                         "row": BENCH_PIPELINE.combine([_summary(1, 1, ["a"], [_epoch(1, 600, 4.0, 1e15, 0.0, [9.0])])])}])
    assert "| 17/15 | s0 5.0% / 2.1%; s1 18.3% / 12.6% | ok |" in text
    assert "| 16/16 | s0 4.0% / 3.9%; s1 6.0% / 2.9% | ok |" in text
    assert "| - | - | ok |" in text  # DP=2: no split, one stage
    assert "time vs the FLOPs split 17/15: 1.10x (against the single-device path: 1.83x vs 1.67x)" in text


def test_a_run_ends_once_every_summary_holds_all_epochs(tmp_path):
    """Teardown after the last epoch is not waited for: the job still running is stopped, "ok"."""
    root = tmp_path / "run"
    root.mkdir()
    summary = root / "run_summary.json"
    writer = ("import json, time, sys; time.sleep(1.0); "
              f"json.dump({{'max_epochs': 2, 'epochs': [{{}}, {{}}]}}, open({str(summary)!r}, 'w')); "
              "time.sleep(600)")
    assert not BENCH_PIPELINE.summaries_complete([str(root)])
    statuses = BENCH_PIPELINE.run_jobs([([sys.executable, "-c", writer], dict(os.environ), str(tmp_path / "w.log"))],
                                       limit_s=60.0, done=lambda: BENCH_PIPELINE.summaries_complete([str(root)]))
    assert statuses == ["ok"]  # with the limit alone the sleeping job would be a "timeout"
    summary.write_text('{"max_epochs": 2, "epochs": [{}]}')
    assert not BENCH_PIPELINE.summaries_complete([str(root)])
