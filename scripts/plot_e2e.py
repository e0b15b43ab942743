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
    variants = [r["variant"] for r in runs[0]["rows"] if "tokens_per_s" in r]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(variants)
    for k, variant in enumerate(variants):
        values = [next((r["tokens_per_s"] for r in run["rows"] if r.get("variant") == variant), 0.0) for run in runs]
        xs = [i + k * width for i in range(len(runs))]
        bars = ax.bar(xs, values, width, label=variant)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([i + width * (len(variants) - 1) / 2 for i in range(len(runs))])
    ax.set_xticklabels([f"{r['args']['workload']}\n{r['args']['layers']} layers" for r in runs])
    ax.set_ylabel("real tokens / s")
    ax.set_title(f"LoRA fine-tuning, 4 adapters, {runs[0]['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
