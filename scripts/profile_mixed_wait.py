"""Where the host's time goes around each engine step, above all the steps with prefill rows:
the phases between the device finishing one step and starting the next, with mixed steps
planned ahead (``EngineTuning.mixed_ahead``) and without, then optionally the many-tenant bench
on the same engine.

The engine, adapters and warm-up are ``bench_tenants.py``'s (``TenantsBench``; its options pass
through). For each of ``--variants`` (new: mixed steps planned ahead; old: not) the burst trace is
stepped in this thread with the step ledger on and each phase of the step path timed on the
host (wrapping the engine's own methods on the instance): ``plan_ahead`` (the scheduler planning
before the running step's tokens are read), ``complete`` (reading the running step's tokens:
``wait`` for the device, then ``emit``), ``schedule``, ``prepare`` (the step's rows and host
tables: ``upload_rows`` builds and uploads them, ``decode_tables`` the decode rows' persistent
tables), ``forward`` (``pieces_load``: the padded step's inputs copied into the pieces' buffers;
then the pieces' replays and attention launched), ``decode_forward`` (a decode-only step's
inputs and graph replay), ``logits``, ``sampled_rows`` / ``sample`` and ``prefetch``. The table:
per kind of step launched (decode or mixed, small or large, planned ahead or after a read), its
device span (``GPU ms``, the ledger's CUDA events from the step's start, before its tables are
built, to its launch's end), the device idle between the step before and that start (``gap``),
the device time from the end of the step before to this step's first piece or graph replay
(``1st``: what the device waited for the host's tables and launches, per step and in all), and
host ms per step of each phase.

``--window N`` then runs N steps of ``--window-variant`` under ``torch.profiler`` (CPU and CUDA
activity) from step ``--window-from``: the CUDA runtime calls the host made (synchronizations,
copies, host allocations) and the phases' ranges, as a short table; ``--sync-check on`` steps
the same part of the new variant under ``torch.cuda.set_sync_debug_mode``: each synchronizing
call in the step path, by source line.

    PYTHONPATH=. python3 scripts/profile_mixed_wait.py --shape 8b --arrivals burst --out $OUT
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import warnings
from typing import Any, Callable

from harness import logger, write_json

import torch  # noqa: E402
import bench_tenants  # noqa: E402
from bench_tenants import TenantsBench, relabel, run_all  # noqa: E402

from lightning_lorafusion.serving import engine_step  # noqa: E402
from lightning_lorafusion.serving.decode_graphs import DecodeGraphs  # noqa: E402
from lightning_lorafusion.serving.mixed_graphs import MixedPieces  # noqa: E402

log = logger("profile_mixed_wait")

PHASES = ("plan_ahead", "complete", "wait", "emit", "schedule", "prepare", "upload_rows", "decode_tables",
          "wait_ready", "forward", "pieces_load", "decode_forward", "logits", "sampled_rows", "sample", "prefetch")


class PhaseTimer:
    """Host seconds per phase of the current ``Engine.step`` call (``wrap`` the engine's methods
    on the instance); with ``ranges`` on, each phase is also a ``torch.profiler`` range."""

    def __init__(self) -> None:
        self.current: dict[str, float] = collections.defaultdict(float)
        self.marks: list = []  # CUDA events at the first piece / graph replay of this call's step
        self.ranges = False
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, attr: str, name: str, *, on_class: bool = False) -> None:
        real = getattr(owner, attr)
        timer = self

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            if timer.ranges:
                with torch.profiler.record_function(f"phase::{name}"):
                    out = real(*args, **kwargs)
            else:
                out = real(*args, **kwargs)
            timer.current[name] += time.perf_counter() - t0
            return out

        setattr(owner, attr, timed)
        if on_class:
            self._undo.append(lambda: setattr(owner, attr, real))
        else:
            self._undo.append(lambda: owner.__dict__.pop(attr, None))

    def mark(self, owner: Any, attr: str) -> None:
        """Record a CUDA timing event on the current stream when ``owner.attr`` is entered (the
        step's first piece or graph replay is queued right after): ``marks`` of this call."""
        real = getattr(owner, attr)
        timer = self

        def marked(*args, **kwargs):
            if torch.cuda.is_available():
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                timer.marks.append(e)
            return real(*args, **kwargs)

        setattr(owner, attr, marked)
        self._undo.append(lambda: setattr(owner, attr, real))

    def take(self) -> dict[str, float]:
        out, self.current = dict(self.current), collections.defaultdict(float)
        if "complete" in out:
            out["wait"] = out["complete"] - out.get("emit", 0.0)
        return out

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def instrument(engine) -> PhaseTimer:
    t = PhaseTimer()
    runner, scheduler = engine.runner, engine.scheduler
    t.wrap(scheduler, "plan_ahead", "plan_ahead")
    t.wrap(scheduler, "schedule", "schedule")
    t.wrap(engine, "_complete", "complete")
    t.wrap(engine, "_emit", "emit")
    t.wrap(engine, "_sampled_rows", "sampled_rows")
    t.wrap(engine, "_prefetch_after_launch", "prefetch")
    t.wrap(runner, "prepare", "prepare")
    t.wrap(runner, "_upload_rows", "upload_rows")
    t.wrap(runner, "_prepare_decode", "decode_tables")
    t.wrap(runner, "forward", "forward")
    t.wrap(runner, "decode_logits", "decode_forward")
    t.wrap(runner, "logits", "logits")
    t.wrap(engine.pool, "wait_ready", "wait_ready")
    t.wrap(engine_step, "sample_rows_checked", "sample", on_class=True)  # (a module function)
    t.wrap(MixedPieces, "load", "pieces_load", on_class=True)
    t.mark(MixedPieces, "run")
    t.mark(DecodeGraphs, "replay")
    return t


def group_of(kind, ahead: bool) -> str:
    if kind is None:
        return "none"
    if kind.phase == "decode":
        size = "1-64 rows" if kind.bucket <= 64 else "128-256 rows"
    else:
        size = "<=2048 tok" if kind.bucket <= 2048 else ">2048 tok"
    return f"{kind.phase} {size} {'ahead' if ahead else 'after read'}"


def step_trace(bench: TenantsBench, trace, timer: PhaseTimer, max_steps: int, on_step=None) -> list[dict]:
    """Submit ``trace`` at once and step it in this thread -> one record per ``step`` call."""
    engine = bench.engine
    if engine._thread is not None:
        raise RuntimeError("the engine's loop thread is running: close() it before stepping in this thread")
    for item in trace:
        engine.submit(item.request)
    ledger = engine.enable_step_ledger()
    records = []
    try:
        calls = 0
        while engine.has_work() and calls < max_steps:
            if on_step is not None:
                on_step(calls)
            before = dict(engine._counters)
            n_times = len(ledger.clock.times)
            prev = ledger.clock.times[-1] if ledger.clock.times else None
            timer.take()
            timer.marks = []
            engine.step()
            phases = timer.take()
            step = ledger.clock.times[-1] if len(ledger.clock.times) > n_times else None
            ahead = (engine._counters["mixed_steps_ahead_total"] + engine._counters["decode_steps_ahead_total"]
                     > before["mixed_steps_ahead_total"] + before["decode_steps_ahead_total"])
            # the device from the end of the step before to this step's first piece / replay
            first = (prev.events[1], timer.marks[0]) if (
                step is not None and timer.marks and prev is not None and prev.events is not None
                and prev.events[1] is not None) else None
            records.append({"phases": phases, "step": step, "ahead": ahead, "first": first})
            calls += 1
        if on_step is not None:
            on_step(-1)
        while engine.has_work():  # (past max_steps: finish without timing)
            for rid in list(engine._states):
                engine.abort(rid)
            engine.step()
        ledger.clock.resolve()
        for r in records:
            if r["first"] is not None:
                r["first"] = max(0.0, r["first"][0].elapsed_time(r["first"][1]))
    finally:
        engine.disable_step_ledger()
    return records


def summarize(records: list[dict]) -> list[dict]:
    groups: dict[str, list[dict]] = collections.defaultdict(list)
    for r in records:
        step = r["step"]
        groups[group_of(step.kind if step is not None else None, r["ahead"])].append(r)
    rows = []
    for name, rs in sorted(groups.items()):
        n = len(rs)
        row = {"kind": name, "steps": n}
        for p in PHASES:
            row[p] = 1e3 * sum(r["phases"].get(p, 0.0) for r in rs) / n
        gaps = [r["step"].gpu_gap_s for r in rs if r["step"] is not None and r["step"].gpu_gap_s is not None]
        spans = [r["step"].gpu_s for r in rs if r["step"] is not None and r["step"].gpu_s is not None]
        walls = [r["step"].wall_s for r in rs if r["step"] is not None]
        row["gpu_gap"] = 1e3 * sum(gaps) / len(gaps) if gaps else None
        firsts = [r["first"] for r in rs if r.get("first") is not None]
        row["to_first"] = sum(firsts) / len(firsts) if firsts else None  # ms (elapsed_time's unit)
        row["to_first_s"] = sum(firsts) / 1e3
        row["gpu_s"] = 1e3 * sum(spans) / len(spans) if spans else None
        row["wall"] = 1e3 * sum(walls) / len(walls) if walls else None
        row["device_idle_s"] = sum(gaps)
        rows.append(row)
    return rows


def phase_table(rows: list[dict]) -> str:
    shown = [p for p in PHASES if any(r[p] >= 0.005 for r in rows)]
    head = (f"  {'step launched':<30} {'steps':>6} {'GPU ms':>7} {'gap ms':>7} {'1st ms':>7} {'1st s':>7} "
            + " ".join(f"{p[:12]:>12}" for p in shown))
    lines = [head]
    for r in rows:
        lines.append(f"  {r['kind']:<30} {r['steps']:>6} {_f(r['gpu_s'], '7.2f')} {_f(r['gpu_gap'], '7.2f')} "
                     f"{_f(r['to_first'], '7.2f')} {r['to_first_s']:>7.3f} "
                     + " ".join(f"{r[p]:>12.3f}" for p in shown))
    return "\n".join(lines)


def _f(x, spec: str) -> str:
    return f"{'-':>{int(spec.split('.')[0])}}" if x is None else format(x, spec)


def profiler_window(bench: TenantsBench, trace, timer: PhaseTimer, start: int, steps: int) -> dict:
    """``steps`` steps from step ``start`` under torch.profiler (CPU + CUDA) -> the host's CUDA
    runtime calls and the phase ranges, by total host time."""
    from torch.profiler import ProfilerActivity, profile

    state: dict[str, Any] = {}

    def on_step(i: int) -> None:
        if i == start:
            timer.ranges = True
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
            state["prof"] = prof
        elif (i == start + steps or i == -1) and "prof" in state and "done" not in state:
            torch.cuda.synchronize()
            state["prof"].__exit__(None, None, None)
            state["done"] = True
            timer.ranges = False

    records = step_trace(bench, trace, timer, start + steps + 1, on_step)
    if "prof" not in state:
        return {"steps": 0, "kinds": {}, "rows": [], "phase_ms": {}}
    window = records[start:start + steps]
    kinds = collections.Counter(group_of(r["step"].kind if r["step"] else None, r["ahead"]) for r in window)
    events = list(state["prof"].events())
    phases = [(e.time_range.start, e.time_range.end, e.name[len("phase::"):]) for e in events
              if e.name.startswith("phase::")]
    blocking = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
                "cudaHostAlloc", "cudaMallocHost", "cudaMalloc", "cudaFree", "cudaGraphLaunch", "cudaLaunchKernel",
                "cudaMemcpyAsync", "aten::item", "aten::_local_scalar_dense")
    by: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if not e.name.startswith(blocking) or e.device_type != torch.autograd.DeviceType.CPU:
            continue
        s0, s1 = e.time_range.start, e.time_range.end
        inner = [p for p in phases if p[0] <= s0 and s1 <= p[1]]  # innermost: the latest start
        where = max(inner)[2] if inner else "-"
        acc = by[(where, e.name)]
        acc[0] += 1
        acc[1] += (s1 - s0) / 1e3
    rows = [{"phase": k[0], "name": k[1], "calls": v[0], "ms": v[1]} for k, v in by.items()]
    rows.sort(key=lambda r: -r["ms"])
    totals = collections.Counter()
    for p in phases:
        totals[p[2]] += (p[1] - p[0]) / 1e3
    return {"steps": steps, "kinds": dict(kinds), "rows": rows[:40],
            "phase_ms": dict(totals.most_common())}


def sync_check(bench: TenantsBench, trace, timer: PhaseTimer, start: int, steps: int) -> dict:
    """The same part of the trace with ``torch.cuda.set_sync_debug_mode("warn")``: each
    synchronizing call's source line, counted."""
    counts: collections.Counter = collections.Counter()
    caught: list = []

    def on_step(i: int) -> None:
        if i == start:
            torch.cuda.set_sync_debug_mode("warn")
        elif i == start + steps or i == -1:
            torch.cuda.set_sync_debug_mode(0)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step_trace(bench, trace, timer, start + steps + 1, on_step)
    torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            counts[f"{os.path.relpath(w.filename)}:{w.lineno}: {str(w.message)[:60]}"] += 1
    return {"steps": steps, "syncs": counts.most_common(25)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile-variants", default="old,new", help="mixed steps planned ahead: new; not: old")
    ap.add_argument("--max-steps", type=int, default=100000, help="step calls per variant at most")
    ap.add_argument("--window", type=int, default=40, help="profiled steps (0: none)")
    ap.add_argument("--window-from", type=int, default=400)
    ap.add_argument("--window-variant", choices=("old", "new"), default="new")
    ap.add_argument("--sync-check", choices=("on", "off"), default="on")
    ap.add_argument("--bench", choices=("on", "off"), default="on",
                    help="then bench_tenants' runs (its --variants/--old/--runs/--slora) on the same engine")
    ap.add_argument("--bench-first", choices=("on", "off"), default="off",
                    help="on: the bench's runs before the profile (its numbers first, if time runs out)")
    own, rest = ap.parse_known_args(argv)
    args = bench_tenants.parse_args(rest)
    bench = TenantsBench(args)
    report: dict[str, Any] = {"args": vars(own)}
    try:
        bench.warm_up()
        if own.bench == "on" and own.bench_first == "on":
            run_all(bench)
            print_bench(bench)
            # the bench's runs started the engine's loop thread: stop it, or it steps the engine
            # beside this thread and the phases below mix both threads' steps
            bench.engine.close()
        profile(bench, own, report)
        write_json(args.out, "profile_mixed_wait.json", report)
        if own.bench == "on" and own.bench_first == "off":
            run_all(bench)
            print_bench(bench)
    finally:
        bench.engine.close()
    return report


def print_bench(bench: TenantsBench) -> None:
    rep = bench.report
    print("\n" + bench_tenants.table(rep), flush=True)
    for r in rep["runs"]:
        print(f"\n{r['run']} {r['arrivals']}: time by step kind\n" + bench_tenants.breakdown_table(r["breakdown"]))
    sys.stdout.flush()


def profile(bench: TenantsBench, own, report: dict) -> None:
    """The phase tables of ``--profile-variants``, the profiler window and the sync check."""
    engine = bench.engine
    trace = bench.main_traces()["burst"]
    timer = instrument(engine)
    try:
        for variant in own.profile_variants.split(","):
            engine.mixed_ahead = variant == "new"
            t0 = time.perf_counter()
            records = step_trace(bench, relabel(trace, f"w{variant}-"), timer, own.max_steps)
            rows = summarize(records)
            report[f"phases_{variant}"] = rows
            print(f"\nhost ms per step by phase, mixed steps ahead {variant == 'new'} ({len(records)} step calls, "
                  f"{time.perf_counter() - t0:.1f} s)\n" + phase_table(rows), flush=True)
        if own.window > 0 and torch.cuda.is_available():
            engine.mixed_ahead = own.window_variant == "new"
            report["window"] = w = profiler_window(bench, relabel(trace, "pw-"), timer, own.window_from, own.window)
            print(f"\ntorch.profiler, {own.window_variant} variant, steps {own.window_from}..+{own.window} "
                  f"{w['kinds']}: host ms by phase {', '.join(f'{k} {v:.1f}' for k, v in w['phase_ms'].items())}\n"
                  f"  CUDA runtime calls by the phase they ran in: phase, call, calls, host ms")
            for r in w["rows"]:
                print(f"  {r['phase']:<16} {r['name'][:40]:<40} {r['calls']:>7} {r['ms']:>10.2f}")
        if own.sync_check == "on" and torch.cuda.is_available():
            engine.mixed_ahead = True
            report["syncs_new"] = s = sync_check(bench, relabel(trace, "sc-"), timer, own.window_from,
                                                 max(own.window, 40))
            print(f"\nsynchronizing calls, new variant, {s['steps']} steps: {len(s['syncs'])} sites")
            for site, n in s["syncs"]:
                print(f"  {n:>6}  {site}")
        sys.stdout.flush()
    finally:
        timer.restore()


if __name__ == "__main__":
    main()
