"""Pipeline-parallel training on 4 GPUs, all through `lightning-lorafusion fit`, one run after another, then one table.

1. Llama-3.1-70B-shaped random base (`random:llama70b`), 4 pipeline stages: 4 adapters on the
   heterogeneous and on the mixed workload, 1 adapter (mixed), and the 4 mixed adapters with the
   flushed 1F1B schedule (configs/gpu_pp4_70b.yaml + configs/pp4/*.yaml).
2. Llama-3.1-8B shape, 4 mixed adapters on 4 GPUs: one job as PP=2 x DP=2, one job as DP=4, and
   two independent 2-adapter jobs on 2 GPUs each, side by side (configs/gpu_8b_4gpu.yaml + overrides).

Ranks are started by torchrun (`--launcher torchrun`, all at once; `--launcher lightning` lets
Lightning's launcher start them after rank 0 has set up, one start-up longer). Every run has a
time limit (on expiry it is killed with every descendant; the next run starts anyway), all
under one overall deadline (the flushed run, last, is the first to be cut). Each run
writes `run_summary.json` (training.callbacks.RunSummary) after every epoch; the table reads
its last epoch (the first includes torch.compile and allocator warm-up); a run ends as soon as every
job's summary holds all its epochs (teardown is not waited for). NVLink multicast stays
off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).

    PYTHONPATH=. python3 scripts/bench_pipeline.py --out $OUT               # on a 4-GPU machine
    PYTHONPATH=. python3 scripts/bench_pipeline.py --out $OUT --only 8b_pp2xdp2,8b_dp4
    PYTHONPATH=. python3 scripts/bench_pipeline.py --out $OUT --gpus 2 --deadline 540 \
        --only 8b_single,8b_strategy_pp1,8b_pp2,8b_dp2,8b_2jobs_1gpu     # 2 GPUs: one GPU vs two
    PYTHONPATH=. python3 scripts/bench_pipeline.py --out $OUT --gpus 2 --deadline 305 \
        --only 8b_single,8b_pp2,8b_pp2_flops,8b_dp2      # the stage split: time-balanced vs FLOPs 17/15
    PYTHONPATH=. python3 scripts/bench_pipeline.py --out $OUT --gpus 2 --deadline 260 \
        --only 8b_pp2_ckpt16,8b_pp2_ckpt16_even          # recompute charged in the split vs even 16/16

Writes to --out: pp4_summary.md (the table), pp4_runs.json (every run's status and summary),
pp4_logs.tar.gz (each run's log, resolved config and summary). Measured bubble ratio = idle
fraction of all GPUs over the run's window (the executor's timestamps); simulated = the
analytic simulator on the same plan, schedule and split (the strategy's cost_model:
parallel.cost_model.CostModel.timed); per stage too, next to the split (layers per stage).
Graph captures of the timed epoch, from the logs: those made before its first step ("up front",
training/cuda_graphs.py) and those in the middle of it (0 when every planned key was covered).
Graph replays per pipeline stage, from the line each rank logs at an epoch's end: forward and
backward replays apart on a stage before the last (training/stage_graphs.py), with the
microbatches it ran eagerly, fused forward + backward replays on the last stage.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from typing import Callable

from harness import write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True, kw_only=True)
class Job:
    """One `fit` process tree: its config files, processes (= the config's trainer.devices) and
    GPUs (CUDA_VISIBLE_DEVICES, None = all)."""

    configs: tuple[str, ...]
    procs: int = 4
    gpus: str | None = None
    tag: str = ""


@dataclass(frozen=True, kw_only=True)
class Run:
    name: str
    what: str
    jobs: tuple[Job, ...]
    limit_s: float
    env: dict = field(default_factory=dict)


C70 = "configs/gpu_pp4_70b.yaml"
C8 = "configs/gpu_8b_4gpu.yaml"
RUNS = (  # in priority order: the last ones are the first to be cut by the deadline
    Run(name="70b_pp4_het_4ad", what="70B PP=4, 4 adapters, heterogeneous", jobs=(Job(configs=(C70,)),),
        limit_s=150),
    Run(name="70b_pp4_mixed_4ad", what="70B PP=4, 4 adapters, mixed",
        jobs=(Job(configs=(C70, "configs/pp4/mixed4.yaml")),), limit_s=120),
    Run(name="70b_pp4_mixed_1ad", what="70B PP=4, 1 adapter, mixed",
        jobs=(Job(configs=(C70, "configs/pp4/mixed1.yaml")),), limit_s=90),
    Run(name="8b_pp2xdp2", what="8B PP=2 x DP=2, 4 adapters, mixed", jobs=(Job(configs=(C8,)),), limit_s=90),
    Run(name="8b_dp4", what="8B DP=4, 4 adapters, mixed", jobs=(Job(configs=(C8, "configs/pp4/dp4.yaml")),),
        limit_s=90),
    Run(name="8b_2jobs_pp2", what="8B 2 jobs x (PP=2, 2 adapters), side by side",
        jobs=(Job(configs=(C8, "configs/pp4/job_a.yaml"), procs=2, gpus="0,1", tag="a"),
              Job(configs=(C8, "configs/pp4/job_b.yaml"), procs=2, gpus="2,3", tag="b")), limit_s=90),
    Run(name="70b_pp4_mixed_4ad_flushed", what="70B PP=4, 4 adapters, mixed, flushed 1F1B",
        jobs=(Job(configs=(C70, "configs/pp4/mixed4.yaml", "configs/pp4/flushed_1f1b.yaml")),), limit_s=150),
)
P2 = "configs/pp2/pp2_70b.yaml"
D2 = "configs/pp2/devices2.yaml"
ONE = "configs/pp2/single_gpu.yaml"
SINGLE = "configs/pp2/single_device.yaml"
RUNS_2GPU = (  # the fallback set for a 2-GPU machine (--gpus 2)
    Run(name="70b_pp2_mixed_4ad", what="70B PP=2, 4 adapters, mixed",
        jobs=(Job(configs=(C70, "configs/pp4/mixed4.yaml", P2), procs=2),), limit_s=170),
    Run(name="70b_pp2_mixed_1ad", what="70B PP=2, 1 adapter, mixed",
        jobs=(Job(configs=(C70, "configs/pp4/mixed1.yaml", P2), procs=2),), limit_s=110),
    Run(name="8b_single", what="8B one GPU, single-device path (strategy auto), 4 adapters, mixed",
        jobs=(Job(configs=(C8, SINGLE), procs=1, gpus="0"),), limit_s=150),
    Run(name="8b_strategy_pp1", what="8B one GPU, the strategy with one stage, 4 adapters, mixed",
        jobs=(Job(configs=(C8, ONE), procs=1, gpus="0"),), limit_s=130),
    Run(name="8b_pp2", what="8B PP=2, 4 adapters, mixed (default split: balanced by time)",
        jobs=(Job(configs=(C8, D2), procs=2),), limit_s=120),
    Run(name="8b_pp2_trace", what="8B PP=2 as 8b_pp2, each rank's action times written (action_trace)",
        jobs=(Job(configs=(C8, D2, "configs/pp2/action_trace.yaml"), procs=2),), limit_s=120),
    Run(name="8b_pp2_flops", what="8B PP=2, 4 adapters, mixed, the FLOPs split 17/15 (stage_layers)",
        jobs=(Job(configs=(C8, D2, "configs/pp2/split_flops.yaml"), procs=2),), limit_s=120),
    Run(name="8b_pp2_ckpt16", what="8B PP=2, first 16 layers recomputed, default split (charges it: 14/18)",
        jobs=(Job(configs=(C8, D2, "configs/pp2/ckpt16.yaml"), procs=2),), limit_s=120),
    Run(name="8b_pp2_ckpt16_even", what="8B PP=2, first 16 layers recomputed, even split 16/16 (stage_layers)",
        jobs=(Job(configs=(C8, D2, "configs/pp2/ckpt16.yaml", "configs/pp2/split_even.yaml"), procs=2),),
        limit_s=120),
    Run(name="8b_dp2", what="8B DP=2, 4 adapters, mixed",
        jobs=(Job(configs=(C8, D2, "configs/pp4/dp4.yaml"), procs=2),), limit_s=120),
    Run(name="8b_2jobs_1gpu", what="8B 2 jobs x (1 GPU, 2 adapters), side by side",
        jobs=(Job(configs=(C8, "configs/pp4/job_a.yaml", ONE), procs=1, gpus="0", tag="a"),
              Job(configs=(C8, "configs/pp4/job_b.yaml", ONE), procs=1, gpus="1", tag="b")), limit_s=120),
    Run(name="70b_pp2_mixed_4ad_flushed", what="70B PP=2, 4 adapters, mixed, flushed 1F1B",
        jobs=(Job(configs=(C70, "configs/pp4/mixed4.yaml", P2, "configs/pp4/flushed_1f1b.yaml"), procs=2),),
        limit_s=210),
)


def fit_command(python: str, job: Job, root: str, extra: list[str], launcher: str = "torchrun") -> list[str]:
    """``fit`` through the CLI module. ``torchrun`` starts every rank at once (Lightning sees a
    torchelastic environment); ``lightning`` lets Lightning's launcher start ranks 1.. after
    rank 0 has imported and built everything (slower by one start-up per run)."""
    cmd = [python, "-m", "lightning_lorafusion.cli", "fit"]
    if launcher == "torchrun":
        cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(job.procs),
               "-m", "lightning_lorafusion.cli", "fit"]
    for config in job.configs:
        cmd += ["--config", os.path.join(REPO, config)]
    return cmd + ["--trainer.default_root_dir", root] + extra


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            out.setdefault(ppid, []).append(int(entry))
    return out


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (torchrun starts its ranks under setsid, so the job's
    process group does not hold them)."""
    children, found, todo = _children(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGTERM the job (its process group and every descendant: launcher, ranks, compile
    workers), SIGKILL whatever is left 10 s later."""
    pids = {proc.pid}
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        pids |= set(_descendants(proc.pid))
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace
        while time.monotonic() < end:
            proc.poll()  # reap our direct child
            if not any(_running(pid) for pid in pids):
                return
            time.sleep(0.2)


def run_jobs(commands: list[tuple[list[str], dict, str]], limit_s: float,
             done: Callable[[], bool] | None = None) -> list[str]:
    """Start every ``(command, env, log path)`` at once, each in its own process group; wait up
    to ``limit_s`` for all, or until ``done()`` (polled) says the run has what it needs (its
    summaries hold every epoch: the rest is teardown). Returns one status per command: "ok",
    "exit <code>" or "timeout" (a job still running when ``done()`` held is "ok")."""
    procs = []
    for cmd, env, log in commands:
        with open(log, "w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True, cwd=REPO))
    deadline = time.monotonic() + limit_s
    complete = False
    while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
        if done is not None and done():
            complete = True
            break
        time.sleep(0.5)
    statuses = []
    for proc in procs:
        code = proc.poll()
        statuses.append(("ok" if complete else "timeout") if code is None else "ok" if code == 0 else f"exit {code}")
        _kill_tree(proc)  # also on success: no rank may hold a GPU into the next run
    return statuses


def summaries_complete(roots: list[str]) -> bool:
    """Every job's ``run_summary.json`` holds all its epochs (``max_epochs``, as RunSummary
    records it)."""
    for root in roots:
        summary = _read_json(os.path.join(root, "run_summary.json"))
        if not summary or not summary.get("max_epochs") or len(summary.get("epochs", ())) < summary["max_epochs"]:
            return False
    return True


def _wait_for_free_gpus(max_wait_s: float = 20.0) -> None:
    """Until no compute process holds a GPU (nvidia-smi), at most ``max_wait_s``."""
    end = time.monotonic() + max_wait_s
    while time.monotonic() < end:
        try:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return
        if not out:
            return
        time.sleep(1.0)


def _last_epoch(summary: dict | None) -> dict | None:
    return summary["epochs"][-1] if summary and summary.get("epochs") else None


def _overlap(intervals: list[tuple[float, float]]) -> float:
    """Shared time of the intervals over their union (1.0: they ran exactly side by side)."""
    start, end = max(s for s, _ in intervals), min(e for _, e in intervals)
    union = max(e for _, e in intervals) - min(s for s, _ in intervals)
    return max(0.0, end - start) / union if union > 0 else 1.0


def combine(summaries: list[dict | None]) -> dict | None:
    """One row from a run's jobs (two side-by-side jobs: rates add up, GPUs concatenate)."""
    epochs = [_last_epoch(s) for s in summaries]
    if not epochs or any(e is None for e in epochs):
        return None
    gpus = sum(s["gpus"] for s in summaries)
    peak = summaries[0]["peak_tflops"]
    row = {
        "epoch": min(e["epoch"] for e in epochs),
        "gpus": gpus,
        "layout": " + ".join(f"PP{s['pipeline_size']}xDP{s['data_parallel_size']}" for s in summaries),
        "adapters": sum(len(s["adapters"]) for s in summaries),
        "tokens_per_s": sum(e["tokens_per_s"] for e in epochs),
        "mfu": sum(e["useful_flops"] / e["wall_s"] for e in epochs) / (gpus * peak * 1e12),
        "bubble_ratio": _mean([e.get("bubble_ratio") for e in epochs]),
        "simulated_bubble_ratio": _mean([e.get("simulated_bubble_ratio") for e in epochs]),
        "peak_allocated_gib": [g for e in epochs for g in e["peak_allocated_gib"]],
        "microbatches": sum(e.get("microbatches", 0) for e in epochs),
        "noop_slots": sum(e.get("noop_slots", 0) for e in epochs),
        "schedule": summaries[0].get("schedule"),
        "wall_s": max(e["wall_s"] for e in epochs),
        # the pipeline's split (layers per stage) and per-stage bubble ratios, jobs one after another
        "stage_layers": " + ".join("/".join(map(str, s["stage_layers"])) for s in summaries
                                   if s.get("stage_layers")) or None,
        "stage_bubble_ratios": [v for e in epochs for v in e.get("stage_bubble_ratios") or []],
        "simulated_stage_bubble_ratios": [v for e in epochs for v in e.get("simulated_stage_bubble_ratios") or []],
    }
    if len(epochs) > 1:
        row["overlap"] = _overlap([(e["start_unix"], e["end_unix"]) for e in epochs])
    return row


_EPOCH_GRAPHS = re.compile(r"CUDA graphs: epoch (\d+): .* (\d+) graphs captured up front in ([\d.]+) s")
_CAPTURE = re.compile(r"CUDA graphs: captured GraphKey\(.*?\)( up front)? in ([\d.]+) s")


def graph_captures(log_text: str) -> dict[int, dict]:
    """Training-graph captures per epoch from a fit log (all ranks' lines): ``up_front`` graphs
    and seconds (the epoch-start line of each rank holding graphs), ``mid_epoch`` captures and
    seconds (a capture line without "up front" after an epoch's line, counted for the latest
    epoch seen: with ranks' lines interleaved, an approximation at epoch boundaries)."""
    out: dict[int, dict] = {}
    epoch = None
    for line in log_text.splitlines():
        m = _EPOCH_GRAPHS.search(line)
        if m:
            epoch = max(int(m.group(1)), epoch if epoch is not None else -1)
            e = out.setdefault(int(m.group(1)), {"up_front": 0, "up_front_s": 0.0, "mid_epoch": 0, "mid_epoch_s": 0.0})
            e["up_front"] += int(m.group(2))
            e["up_front_s"] += float(m.group(3))
            continue
        m = _CAPTURE.search(line)
        if m and not m.group(1) and epoch is not None:
            e = out.setdefault(epoch, {"up_front": 0, "up_front_s": 0.0, "mid_epoch": 0, "mid_epoch_s": 0.0})
            e["mid_epoch"] += 1
            e["mid_epoch_s"] += float(m.group(2))
    return out


_REPLAYS = re.compile(r"CUDA graphs: stage (\d+) replays: (\d+) forward, (\d+) backward, (\d+) fused; "
                      r"(\d+) eager; (\d+) captures")


def graph_replays(log_text: str) -> dict[int, dict]:
    """Per pipeline stage, the graph replays a rank logged at its last epoch's end (counts are
    cumulative; with several replicas of a stage, the largest): ``forward`` / ``backward`` (a stage
    before the last, captured apart), ``fused`` (the last stage or one GPU), ``eager`` microbatches
    and ``captures``."""
    out: dict[int, dict] = {}
    for m in _REPLAYS.finditer(log_text):
        counts = dict(zip(("forward", "backward", "fused", "eager", "captures"), map(int, m.groups()[1:])))
        stage = out.setdefault(int(m.group(1)), dict.fromkeys(counts, 0))
        for k, v in counts.items():
            stage[k] = max(stage[k], v)
    return out


def _replays_cell(replays: dict | None) -> str:
    if not replays:
        return "-"
    cells = []
    for s, c in sorted(replays.items()):
        if c["forward"] or c["backward"] or c["eager"]:
            cells.append(f"s{s}: F/B {c['forward']}/{c['backward']}, eager {c['eager']}, captures {c['captures']}")
        else:
            cells.append(f"s{s}: fused {c['fused']}, captures {c['captures']}")
    return "; ".join(cells)


def _captures_cell(captures: dict | None) -> str:
    if not captures:
        return "-"
    return (f"{captures['up_front']} ({captures['up_front_s']:.1f} s) / "
            f"{captures['mid_epoch']} ({captures['mid_epoch_s']:.1f} s)")


def _stages_cell(row: dict) -> str:
    """Per-stage bubble ratios, measured / simulated: ``s0 5.0% / 4.1%; s1 18.3% / 9.9%``."""
    measured = row.get("stage_bubble_ratios") or []
    simulated = row.get("simulated_stage_bubble_ratios") or []
    if len(measured) < 2:  # one stage: nothing to balance
        return "-"
    cells = []
    for s, m in enumerate(measured):
        sim = simulated[s] if s < len(simulated) else None
        cells.append(f"s{s} {_pct(m)} / {_pct(sim)}")
    return "; ".join(cells)


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def table(results: list[dict]) -> str:
    lines = ["| run | layout | adapters | tokens/s (real) | MFU | bubble measured | bubble simulated | "
             "peak GiB per GPU | microbatches (no-op) | timed epoch s | graph captures up front / "
             "mid-epoch (all ranks) | graph replays per stage (to the last epoch's end) | split (layers "
             "per stage) | bubble per stage, measured / simulated | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        row = r.get("row")
        if row is None:
            lines.append(f"| {r['name']} | - | - | - | - | - | - | - | - | - | - | - | - | - | {r['status']} |")
            continue
        warm = "" if row["epoch"] >= 1 else " (epoch 0 only: includes warm-up)"
        layout = row["layout"] + (f", {row['schedule']}" if row.get("schedule") == "flushed_1f1b" else "")
        lines.append(
            f"| {r['name']} | {layout} | {row['adapters']} | {row['tokens_per_s']:,.0f} | {_pct(row['mfu'])} | "
            f"{_pct(row['bubble_ratio'])} | {_pct(row['simulated_bubble_ratio'])} | "
            f"{', '.join(f'{g:.1f}' for g in row['peak_allocated_gib'])} | {row['microbatches']} "
            f"({row['noop_slots']}) | {row['wall_s']:.1f} | {_captures_cell(row.get('captures'))} | "
            f"{_replays_cell(row.get('replays'))} | {row.get('stage_layers') or '-'} | {_stages_cell(row)} | "
            f"{r['status']}{warm} |")
    rows = {r["name"]: r.get("row") for r in results}

    def ratio(a: str, b: str) -> str:
        if rows.get(a) and rows.get(b):
            return f"{rows[a]['tokens_per_s'] / rows[b]['tokens_per_s']:.2f}x"
        return "-"

    lines += [
        "",
        f"- 70B mixed, 4 adapters vs 1 adapter tokens/s: {ratio('70b_pp4_mixed_4ad', '70b_pp4_mixed_1ad')}",
        f"- 70B mixed, 4 adapters, no-flush vs flushed 1F1B tokens/s: "
        f"{ratio('70b_pp4_mixed_4ad', '70b_pp4_mixed_4ad_flushed')}",
        f"- 70B PP=2 mixed, 4 vs 1 adapter: {ratio('70b_pp2_mixed_4ad', '70b_pp2_mixed_1ad')}; no-flush vs "
        f"flushed: {ratio('70b_pp2_mixed_4ad', '70b_pp2_mixed_4ad_flushed')}",
        f"- 8B against one GPU's single-device path: strategy with one stage "
        f"{ratio('8b_strategy_pp1', '8b_single')}, PP=2 {ratio('8b_pp2', '8b_single')}, DP=2 "
        f"{ratio('8b_dp2', '8b_single')}, two 1-GPU jobs {ratio('8b_2jobs_1gpu', '8b_single')}",
        f"- 8B PP=2 with its action times written vs without: {ratio('8b_pp2_trace', '8b_pp2')} "
        f"(against the single-device path: {ratio('8b_pp2_trace', '8b_single')})",
        f"- 8B PP=2, split balanced by time vs the FLOPs split 17/15: {ratio('8b_pp2', '8b_pp2_flops')} "
        f"(against the single-device path: {ratio('8b_pp2', '8b_single')} vs {ratio('8b_pp2_flops', '8b_single')})",
        f"- 8B PP=2 with 16 layers recomputed, split charging the recompute vs even 16/16: "
        f"{ratio('8b_pp2_ckpt16', '8b_pp2_ckpt16_even')}",
        f"- 8B on 2 GPUs, PP=2 vs DP=2: {ratio('8b_pp2', '8b_dp2')}; PP=2 vs two 1-GPU jobs: "
        f"{ratio('8b_pp2', '8b_2jobs_1gpu')}; two jobs vs DP=2: {ratio('8b_2jobs_1gpu', '8b_dp2')}",
        f"- 8B on 4 GPUs, PP=2xDP=2 vs DP=4: {ratio('8b_pp2xdp2', '8b_dp4')}; "
        f"PP=2xDP=2 vs two 2-GPU jobs: {ratio('8b_pp2xdp2', '8b_2jobs_pp2')}; "
        f"two jobs vs DP=4: {ratio('8b_2jobs_pp2', '8b_dp4')}",
    ]
    two = rows.get("8b_2jobs_pp2")
    if two and "overlap" in two:
        lines.append(f"- the two jobs' timed epochs overlapped for {100 * two['overlap']:.0f}% of their union "
                     "(tokens/s is the sum of both jobs' rates)")
    return "\n".join(lines)


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _tail_bytes(path: str, limit: int = 3 << 20) -> None:
    """Keep a log's first 256 KiB and last ``limit`` bytes (the files sent back are capped)."""
    size = os.path.getsize(path)
    if size <= limit + (256 << 10):
        return
    with open(path, "rb") as f:
        head = f.read(256 << 10)
        f.seek(size - limit)
        tail = f.read()
    with open(path, "wb") as f:
        f.write(head + f"\n... [{size - len(head) - len(tail)} bytes cut] ...\n".encode() + tail)


def preflight(python: str, env: dict) -> str | None:
    """The CLI must import here (the device image lacks some wheels); None if it does."""
    probe = subprocess.run([python, "-c", "import lightning_lorafusion.cli, torchdata, jsonargparse; "
                            "import torch; print('cuda devices:', torch.cuda.device_count())"],
                           env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    print(probe.stdout.strip(), flush=True)
    return None if probe.returncode == 0 else probe.stderr[-3000:]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="where the table, JSON and logs archive go")
    ap.add_argument("--work", default="/tmp/pp4_runs", help="run directories (large; not sent back)")
    ap.add_argument("--deadline", type=float, default=480.0, help="seconds for everything, table included")
    ap.add_argument("--only", default="", help="comma-separated run names (default: all, in order)")
    ap.add_argument("--extra", default="", help="arguments appended to every fit command")
    ap.add_argument("--launcher", choices=["torchrun", "lightning"], default="torchrun",
                    help="who starts the ranks (see fit_command)")
    ap.add_argument("--gpus", type=int, choices=[2, 4], default=4,
                    help="4: the runs above; 2: the fallback set for a 2-GPU machine (70B in 2 stages)")
    ap.add_argument("--limit-scale", type=float, default=1.0,
                    help="multiply every run's time limit (a CPU smoke run with a tiny model via --extra)")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args(argv)
    run_set = RUNS if args.gpus == 4 else RUNS_2GPU
    known = {r.name for r in run_set}
    only = [n for n in args.only.split(",") if n]
    if set(only) - known:
        ap.error(f"unknown run(s) {sorted(set(only) - known)}; known: {[r.name for r in run_set]}")
    args.runs = [r for r in run_set if not only or r.name in only]
    return args


def job_commands(args, i: int, run: Run, base_env: dict) -> tuple[list, list[str]]:
    """Each job's (fit command, environment, log path) and run directory (summary cleared)."""
    commands, roots = [], []
    for k, job in enumerate(run.jobs):
        root = os.path.join(args.work, run.name + (f"_{job.tag}" if job.tag else ""))
        os.makedirs(root, exist_ok=True)
        summary = os.path.join(root, "run_summary.json")
        if os.path.exists(summary):
            os.remove(summary)  # never report an earlier run's numbers
        env = {**base_env, **run.env}
        if args.launcher == "lightning":  # torchrun --standalone picks free ports itself
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + 10 * i + k))
        if job.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = job.gpus
        commands.append((fit_command(args.python, job, root, args.extra.split(), args.launcher), env,
                         os.path.join(root, "fit.log")))
        roots.append(root)
    return commands, roots


def execute(args, i: int, run: Run, base_env: dict, limit: float, t_start: float) -> dict:
    """One run's jobs side by side under ``limit`` seconds -> its result (status, combined row)."""
    commands, roots = job_commands(args, i, run, base_env)
    t0 = time.monotonic()
    print(f"[{time.monotonic() - t_start:6.1f}s] {run.name}: {run.what} (limit {limit:.0f} s)", flush=True)
    statuses = run_jobs(commands, limit, done=lambda: summaries_complete(roots))
    _wait_for_free_gpus()
    summaries = [_read_json(os.path.join(root, "run_summary.json")) for root in roots]
    status = ", ".join(sorted(set(statuses)))
    row = combine(summaries)
    if row is not None:
        row["captures"] = _timed_captures(roots, row["epoch"])
        row["replays"] = _replays(roots)
    if row is None and status == "ok":
        status = "ok, no summary"
    print(f"[{time.monotonic() - t_start:6.1f}s] {run.name}: {status} after {time.monotonic() - t0:.0f} s"
          + (f", {row['tokens_per_s']:,.0f} tokens/s" if row else ""), flush=True)
    for root in roots:
        _tail_bytes(os.path.join(root, "fit.log"))
        if status != "ok":  # the end of a failed run's log, where the error is
            with open(os.path.join(root, "fit.log"), errors="replace") as f:
                print("".join(f.readlines()[-25:]), flush=True)
    return {"name": run.name, "what": run.what, "status": status, "row": row, "elapsed_s": time.monotonic() - t0,
            "summaries": summaries, "commands": [c for c, _, _ in commands]}


def _timed_captures(roots: list[str], epoch: int) -> dict | None:
    """The timed epoch's graph captures, summed over a run's jobs (None: no log line about them)."""
    total = None
    for root in roots:
        try:
            with open(os.path.join(root, "fit.log"), errors="replace") as f:
                found = graph_captures(f.read()).get(epoch)
        except OSError:
            continue
        if found is not None:
            total = total or {"up_front": 0, "up_front_s": 0.0, "mid_epoch": 0, "mid_epoch_s": 0.0}
            for k, v in found.items():
                total[k] += v
    return total


def _replays(roots: list[str]) -> dict | None:
    """Graph replays per stage from a run's logs (``graph_replays``; jobs' counts added)."""
    total: dict[int, dict] = {}
    for root in roots:
        try:
            with open(os.path.join(root, "fit.log"), errors="replace") as f:
                found = graph_replays(f.read())
        except OSError:
            continue
        for s, counts in found.items():
            into = total.setdefault(s, dict.fromkeys(counts, 0))
            for k, v in counts.items():
                into[k] += v
    return total or None


def write_outputs(args, results: list[dict]) -> str:
    """The table (pp4_summary.md), every result (pp4_runs.json) and the logs archive."""
    text = table(results)
    with open(os.path.join(args.out, "pp4_summary.md"), "w") as f:
        f.write(text + "\n")
    write_json(args.out, "pp4_runs.json", results)
    with tarfile.open(os.path.join(args.out, "pp4_logs.tar.gz"), "w:gz") as tar:
        for run in args.runs:
            for job in run.jobs:
                name = run.name + (f"_{job.tag}" if job.tag else "")
                for fname in ("fit.log", "config.yaml", "run_summary.json"):
                    path = os.path.join(args.work, name, fname)
                    if os.path.exists(path):
                        tar.add(path, arcname=f"{name}/{fname}")
                actions = os.path.join(args.work, name, "actions")  # the strategy's action_trace
                if os.path.isdir(actions):
                    tar.add(actions, arcname=f"{name}/actions")
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    base_env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)}
    error = preflight(args.python, base_env)
    if error is not None:
        print(f"the CLI does not import; no run started:\n{error}", flush=True)
        return 2
    results = []
    for i, run in enumerate(args.runs):
        left = args.deadline - (time.monotonic() - t_start) - 15.0  # keep time for the table
        if left < 30.0:
            results.append({"name": run.name, "what": run.what, "status": "skipped (deadline)", "row": None})
            continue
        results.append(execute(args, i, run, base_env, min(run.limit_s * args.limit_scale, left), t_start))
    text = write_outputs(args, results)
    print(f"\ntotal {time.monotonic() - t_start:.0f} s\n\n{text}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
