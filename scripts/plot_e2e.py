"""Bar chart of bench_e2e.py results: real tokens/s per workload and variant (PNG)."""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results", nargs="+", help="JSON files written by scripts/bench_e2e.py --out")
    ap.add_argument("--png", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.load(open(p)) for p in args.results]
    variants: list[str] = []
    for run in runs:  # every variant any run has, in first-seen order
        variants += [r["variant"] for r in run["rows"] if "tokens_per_s" in r and r["variant"] not in variants]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(variants)
    for k, variant in enumerate(variants):
        found = [next((r["tokens_per_s"] for r in run["rows"] if r.get("variant") == variant), None) for run in runs]
        xs = [i + k * width for i, v in enumerate(found) if v is not None]  # variants a run lacks: no bar
        values = [v for v in found if v is not None]
        bars = ax.bar(xs, values, width, label=variant)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([i + width * (len(variants) - 1) / 2 for i in range(len(runs))])
    ax.set_xticklabels([f"{r['args']['workload']}\n{r['args']['layers']} layers" for r in runs])
    ax.set_ylabel("real tokens / s")
    ax.set_title(f"LoRA fine-tuning, 4 adapters, {runs[0]['device']}", fontsize=9)
    ax.set_ylim(0, 1.18 * ax.get_ylim()[1])
    ax.legend(fontsize=8, ncol=len(variants), loc="upper center")
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
