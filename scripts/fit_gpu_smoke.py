"""The whole `lightning-lorafusion fit` path on one GPU: LightningCLI config, Lightning Trainer
(bf16-true), `data.capacity: auto` profiled on the device, fused Triton LoRA kernels with the
compiled elementwise groups, greedy planner, checkpoint, then a resumed second epoch.

The base is a random-weight Llama written on the spot (no download; `--hidden`, `--layers`),
the four adapters train on synthetic XSum / CNN-DM / WikiSum / Mixed length distributions.
Prints the chosen capacity, each adapter's logged loss and the tokens/s the callback logged.

    PYTHONPATH=. python3 scripts/fit_gpu_smoke.py --out $OUT
    PYTHONPATH=. python3 scripts/fit_gpu_smoke.py --out /tmp/smoke --accelerator cpu --hidden 64 \
        --layers 2 --vocab 512 --samples 8 --candidates 2048,4096      # CPU check of the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_lorafusion.cli import main as cli_main  # noqa: E402
from lightning_lorafusion.model.random_model import write_random_llama  # noqa: E402


def config(args, model_dir: str, root: str, epochs: int) -> dict:
    gpu = args.accelerator == "gpu"
    adapters = []
    for i, dist in enumerate(["xsum", "cnn_dailymail", "wikisum", "mixed"]):
        adapters.append({
            "name": dist, "rank": 16, "alpha": 32, "dropout": 0.1, "lr": 2.0e-4, "global_batch_size": 8,
            "target_modules": "all-linear", "seed": i,
            "dataset": {"kind": "synthetic", "distribution": dist, "num_samples": args.samples, "seed": i},
        })
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": args.accelerator, "devices": 1, "max_epochs": epochs,
            "precision": "bf16-true" if gpu else "32-true", "default_root_dir": root,
            "log_every_n_steps": 1, "enable_model_summary": False, "enable_progress_bar": False,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": root, "name": "logs"}},
            "callbacks": [
                {"class_path": "lightning_lorafusion.training.callbacks.TokenThroughput", "init_args": {"window": 4}},
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"dirpath": os.path.join(root, "checkpoints"), "save_last": True}},
            ],
        },
        "model": {"base_model": model_dir, "dtype": "bfloat16" if gpu else "float32", "backend": "auto",
                  "adapters": adapters},
        "data": {"capacity": "auto", "capacity_candidates": [int(c) for c in args.candidates.split(",")],
                 "pad_multiple": 128, "planner": "greedy", "max_length": 2048},
    }


def fit(args, model_dir: str, root: str, epochs: int, ckpt: str | None = None):
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, f"run_{epochs}.json")  # JSON is valid YAML
    with open(path, "w") as f:
        json.dump(config(args, model_dir, root, epochs), f, indent=1)
    argv = ["fit", "--config", path] + (["--ckpt_path", ckpt] if ckpt else [])
    return cli_main(argv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--samples", type=int, default=64, help="samples per adapter")
    ap.add_argument("--candidates", default="2048,4096,8192")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model_dir = os.path.join(args.out, "base")
    heads = max(4, args.hidden // 128)
    write_random_llama(model_dir, vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                       num_layers=args.layers, num_heads=heads, num_kv_heads=max(1, heads // 4), init_std=0.02,
                       max_positions=8192)
    root = os.path.join(args.out, "run")
    first = fit(args, model_dir, root, epochs=1)
    chosen = first.datamodule.packing.capacity
    last = os.path.join(root, "checkpoints", "last.ckpt")
    second = fit(args, model_dir, root, epochs=2, ckpt=last)
    print(f"\ncapacity chosen: {chosen}; after resume: {second.datamodule.packing.capacity}")
    for name, cli in (("epoch 1", first), ("epoch 2 (resumed)", second)):
        metrics = {k: round(float(v), 4) for k, v in cli.trainer.callback_metrics.items()
                   if k.startswith(("loss/", "throughput/"))}
        print(name, json.dumps(metrics))
    print("steps per adapter:", second.model.steps_taken)


if __name__ == "__main__":
    main()
