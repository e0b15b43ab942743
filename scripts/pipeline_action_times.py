"""Measured against simulated pipeline action times, per stage and per microbatch.

Reads the strategy's action trace (``MultiAdapterPipelineStrategy(action_trace=DIR)``: one
``actions_rank<r>.jsonl`` per rank, one line per trained window) from a directory or a
``.tar.gz`` holding such files, takes one epoch (default: the last one every rank has), and
prints per stage the measured busy time (CUDA events of each forward, backward, fused
forward + backward and optimizer step) against the simulator's for the same actions, the
optimizer step's host time by phase (what the device waits for behind it), then per
microbatch the last stage's compute minus the first stage's, measured and simulated, with the
microbatch's label rows and the rows its graph computes (the cheapest held graph key covering
it), and a least-squares line of that difference over the graph's label rows.

    PYTHONPATH=. python3 scripts/pipeline_action_times.py /tmp/pp4_runs/8b_pp2/actions --out $OUT
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import tarfile
from collections import defaultdict

_NAME = re.compile(r"actions_rank(\d+)\.jsonl$")


def load_trace(source: str) -> dict[int, list[dict]]:
    """``{rank: [window lines]}`` from a directory or a tar archive of ``actions_rank<r>.jsonl``."""
    texts: dict[int, str] = {}
    if os.path.isdir(source):
        for name in os.listdir(source):
            m = _NAME.search(name)
            if m:
                with open(os.path.join(source, name)) as f:
                    texts[int(m.group(1))] = f.read()
    else:
        with tarfile.open(source) as tar:
            for member in tar.getmembers():
                m = _NAME.search(member.name)
                if m and member.isfile():
                    texts[int(m.group(1))] = io.TextIOWrapper(tar.extractfile(member)).read()
    return {r: [json.loads(line) for line in t.splitlines() if line.strip()] for r, t in sorted(texts.items())}


def _per_microbatch(events) -> tuple[dict[int, float], float, float]:
    """Compute seconds per microbatch (F, B and FB rows), optimizer-step seconds, wait seconds."""
    per: dict[int, float] = defaultdict(float)
    steps = waits = 0.0
    for kind, label, t0, t1 in events:
        if kind in ("F", "B", "FB"):
            per[int(label)] += t1 - t0
        elif kind == "S":
            steps += t1 - t0
        elif kind == "C":
            waits += t1 - t0
    return dict(per), steps, waits


def _cover_rows(key, held) -> int | None:
    """Label rows of the cheapest held key covering ``key`` (same rule as graph_cover)."""
    if key is None:
        return None
    cap, seq, blocks, rows = key
    fits = [k for k in held if k[0] == cap and k[1] >= seq and k[2] >= blocks and k[3] >= rows]
    return min(fits, key=lambda k: (k[3], k[1], k[2]))[3] if fits else None


def _line_fit(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least-squares ``y = a + b x``: (a, b), None when x does not vary."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def summarize(trace: dict[int, list[dict]], epoch: int | None = None) -> dict:
    """Per-stage and per-microbatch comparison of one epoch (see the module docstring)."""
    if not trace:
        raise ValueError("no actions_rank<r>.jsonl found")
    if epoch is None:
        epoch = min(max(line["epoch"] for line in lines) for lines in trace.values())
    chosen = {r: [line for line in lines if line["epoch"] == epoch] for r, lines in trace.items()}
    stages: dict[int, dict] = {}
    per_mb: dict[int, dict[int, tuple[float, float]]] = {}
    info: dict[int, dict] = {}
    held_last: list = []
    last_stage = max(line["stage"] for lines in chosen.values() for line in lines)
    for rank, lines in chosen.items():
        for line in lines:
            s = line["stage"]
            measured, m_steps, m_waits = _per_microbatch(line["events"])
            simulated, s_steps, _ = _per_microbatch(line["simulated"])
            st = stages.setdefault(s, {"stage": s, "ranks": [], "microbatches": 0, "measured_compute_s": 0.0,
                                       "simulated_compute_s": 0.0, "measured_steps_s": 0.0,
                                       "simulated_steps_s": 0.0, "waits_s": 0.0, "wall_s": 0.0,
                                       "simulated_makespan_s": 0.0})
            if rank not in st["ranks"]:
                st["ranks"].append(rank)
            st["microbatches"] += len(measured)
            st["measured_compute_s"] += sum(measured.values())
            st["simulated_compute_s"] += sum(simulated.values())
            st["measured_steps_s"] += m_steps
            st["simulated_steps_s"] += s_steps
            st["waits_s"] += m_waits
            st["wall_s"] = max(st["wall_s"], line["wall"])
            st["simulated_makespan_s"] = max(st["simulated_makespan_s"], line["simulated_makespan"])
            mine = per_mb.setdefault(s, {})
            for i, t in measured.items():
                mine[int(i)] = (t, simulated.get(int(i), 0.0))
            for pos, mb in line["microbatches"].items():
                info.setdefault(int(pos), mb)
            if s == last_stage:
                held_last = [tuple(k) for k in line.get("held_graph_keys", [])]
            st.setdefault("step_phases", []).extend(line.get("step_phases", []))
    wall = max(st["wall_s"] for st in stages.values())
    makespan = max(st["simulated_makespan_s"] for st in stages.values())
    for st in stages.values():
        busy = st["measured_compute_s"] + st["measured_steps_s"]
        sim_busy = st["simulated_compute_s"] + st["simulated_steps_s"]
        st["bubble_measured"] = 1.0 - busy / (len(st["ranks"]) * wall) if wall else None
        st["bubble_simulated"] = 1.0 - sim_busy / makespan if makespan else None
        st["compute_measured_over_simulated"] = (st["measured_compute_s"] / st["simulated_compute_s"]
                                                 if st["simulated_compute_s"] else None)
        phases = st.pop("step_phases", [])
        st["step_phase_ms"] = ([1e3 * sum(p[k] for p in phases) / len(phases) for k in range(len(phases[0]))]
                               if phases else None)
    rows = []
    first, last = min(per_mb), max(per_mb)
    for pos in sorted(set(per_mb[first]) & set(per_mb[last])):
        mb = info.get(pos, {})
        m0, s0 = per_mb[first][pos]
        m1, s1 = per_mb[last][pos]
        rows.append({"microbatch": pos, "tokens": mb.get("tokens"), "label_rows": mb.get("label_rows"),
                     "graph_label_rows": _cover_rows(mb.get("graph_key"), held_last),
                     "first_measured_s": m0, "first_simulated_s": s0, "last_measured_s": m1, "last_simulated_s": s1})
    fit_rows = [r for r in rows if r["graph_label_rows"] is not None]
    fit = _line_fit([r["graph_label_rows"] for r in fit_rows],
                    [r["last_measured_s"] - r["first_measured_s"] for r in fit_rows])
    fit_real = _line_fit([r["label_rows"] for r in rows if r["label_rows"] is not None],
                         [r["last_measured_s"] - r["first_measured_s"] for r in rows if r["label_rows"] is not None])
    return {"epoch": epoch, "wall_s": wall, "simulated_makespan_s": makespan,
            "stages": [stages[s] for s in sorted(stages)], "microbatches": rows,
            "last_minus_first_over_graph_label_rows": fit, "last_minus_first_over_label_rows": fit_real,
            "held_graph_keys_last_stage": held_last}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.1f}"


def report(summary: dict) -> str:
    out = [f"epoch {summary['epoch']}: wall {summary['wall_s']:.3f} s measured, "
           f"{summary['simulated_makespan_s']:.3f} s simulated",
           "",
           "| stage | microbatches | compute s measured / simulated (ratio) | steps s measured / simulated | "
           "waits s | bubble measured / simulated |",
           "|---|---|---|---|---|---|"]
    for st in summary["stages"]:
        ratio = st["compute_measured_over_simulated"]
        out.append(f"| {st['stage']} | {st['microbatches']} | {st['measured_compute_s']:.3f} / "
                   f"{st['simulated_compute_s']:.3f} ({ratio:.3f}) | {st['measured_steps_s']:.3f} / "
                   f"{st['simulated_steps_s']:.3f} | {st['waits_s']:.3f} | "
                   f"{100 * st['bubble_measured']:.1f}% / {100 * st['bubble_simulated']:.1f}% |")
    out += ["", "Optimizer step, host ms per step (mean): queue norm + weights' copy / wait for the device "
            "read / optimizer / weights' check / the rest (zeroing, schedule, logs)"]
    for st in summary["stages"]:
        phases = st.get("step_phase_ms")
        out.append(f"- stage {st['stage']}: " + (" / ".join(f"{v:.2f}" for v in phases) if phases else "-"))
    out += ["", "| mb | tokens | label rows (graph's) | first stage ms meas / sim | last stage ms meas / sim | "
            "last - first ms meas / sim |", "|---|---|---|---|---|---|"]
    for r in summary["microbatches"]:
        out.append(f"| {r['microbatch']} | {r['tokens']} | {r['label_rows']} ({r['graph_label_rows']}) | "
                   f"{_ms(r['first_measured_s'])} / {_ms(r['first_simulated_s'])} | "
                   f"{_ms(r['last_measured_s'])} / {_ms(r['last_simulated_s'])} | "
                   f"{_ms(r['last_measured_s'] - r['first_measured_s'])} / "
                   f"{_ms(r['last_simulated_s'] - r['first_simulated_s'])} |")
    for name, label in (("last_minus_first_over_graph_label_rows", "graph's label rows"),
                        ("last_minus_first_over_label_rows", "label rows")):
        fit = summary[name]
        if fit is not None:
            out.append(f"\nlast - first stage per microbatch = {1e3 * fit[0]:.2f} ms + "
                       f"{1e6 * fit[1]:.2f} us x {label}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="a directory of actions_rank<r>.jsonl, or a .tar.gz holding them")
    ap.add_argument("--epoch", type=int, default=None)
    ap.add_argument("--out", default=None, help="also write action_times.json and action_times.md here")
    args = ap.parse_args(argv)
    summary = summarize(load_trace(args.source), args.epoch)
    text = report(summary)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "action_times.json"), "w") as f:
            json.dump(summary, f, indent=1)
        with open(os.path.join(args.out, "action_times.md"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
