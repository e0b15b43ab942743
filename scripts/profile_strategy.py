"""Where does the pipeline strategy with one stage lose against the single-device path?

Runs `fit` twice in this process on the same adapters, data and planner: the single-device path
(`strategy: auto`, CUDA graphs auto) and `MultiAdapterPipelineStrategy(pipeline_size=1)`. Each
fit trains one warm-up epoch (graph captures, compilation), then a timed epoch (real tokens per
second, the device synchronised at its ends), then profiles a few training batches with
torch.profiler and stops. Prints tokens/s of each and the 15 largest per-microbatch differences
in CUDA and in CPU time by op name; writes both Chrome traces (gzipped) and a JSON report under --out.

    PYTHONPATH=. python scripts/profile_strategy.py --out $OUT                     # H100, ~4 min
    PYTHONPATH=. python scripts/profile_strategy.py --out /tmp/p --shape tiny --device cpu \\
        --dtype float32 --capacity 128 --samples 4 --global-batch 2 --adapters 2 --rank 4 \\
        --profile-batches 2                                                        # CPU check

``--shape``: ``llama8b`` (random Llama-3.1-8B shape, the default), ``tiny`` (2 layers, hidden 64),
or a path to an HF config.json. Adapters: --adapters of rank --rank on all seven projections,
each with --samples synthetic `mixed` samples in global batches of --global-batch.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import tempfile
import time

import lightning as L
import torch

from harness import add_device_args, add_output_args, device_info, dtype_of, logger, sync, write_json

log = logger("profile_strategy")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(ap)
    add_output_args(ap)
    ap.add_argument("--shape", default="llama8b", help="llama8b, llama70b, tiny, or an HF config.json path")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--samples", type=int, default=32, help="synthetic samples per adapter")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--profile-batches", type=int, default=4,
                    help="single-device microbatches profiled (the strategy: one window)")
    ap.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--paths", default="single,strategy", help="which fits to run (comma list)")
    return ap.parse_args(argv)


def _base_model(shape: str, tmp: str) -> str:
    if shape != "tiny":
        return f"random:{shape}"
    from transformers import LlamaConfig

    path = os.path.join(tmp, "tiny_config.json")
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096).to_json_file(path)
    return f"random:{path}"


class _Probe(L.Callback):
    """Times epoch 1 (real tokens / s), profiles the first batches of epoch 2, then stops the fit."""

    def __init__(self, device, profile_batches: int, trace_path: str | None) -> None:
        self.device, self.profile_batches, self.trace_path = device, profile_batches, trace_path
        self.tokens = 0
        self.seconds = None
        self.t0 = 0.0
        self.profiler = None
        self.profiled_batches = 0
        self.profiled_microbatches = 0
        self.table: dict[str, dict[str, float]] = {}

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            sync(self.device)
            self.t0 = time.perf_counter()
        elif trainer.current_epoch == 2:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.device(self.device).type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 1:
            self.tokens += int(batch.real_tokens)
        elif trainer.current_epoch == 2 and self.profiler is not None:
            self.profiled_batches += 1
            plan = getattr(batch, "plan", None)
            self.profiled_microbatches += 1 if plan is None else sum(not m.is_noop for m in plan.microbatches)
            if self.profiled_batches >= self.profile_batches:
                self._stop()
                trainer.should_stop = True

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            sync(self.device)
            self.seconds = time.perf_counter() - self.t0
        elif trainer.current_epoch == 2 and self.profiler is not None:
            self._stop()

    def _stop(self) -> None:
        if self.profiler is None:
            return
        sync(self.device)
        prof, self.profiler = self.profiler, None
        prof.__exit__(None, None, None)
        if self.trace_path:  # gzipped: an eager 8B window is tens of MB of JSON
            prof.export_chrome_trace(self.trace_path)
            with open(self.trace_path, "rb") as src, gzip.open(self.trace_path + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(self.trace_path)
        for e in prof.key_averages():
            row = self.table.setdefault(e.key, {"cuda_us": 0.0, "cpu_us": 0.0, "count": 0})
            row["cuda_us"] += float(getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0))
            row["cpu_us"] += float(e.self_cpu_time_total)
            row["count"] += int(e.count)


def run_fit(args, path: str, tmp: str) -> dict:
    """One fit of ``path`` ("single" or "strategy"); its tokens/s and per-microbatch profile."""
    from lightning_lorafusion.parallel.strategy import MultiAdapterPipelineStrategy
    from lightning_lorafusion.specs import AdapterSpec
    from lightning_lorafusion.training.datamodule import MultiAdapterDataModule
    from lightning_lorafusion.training.module import LoRAFusionModule

    specs = [AdapterSpec(name=f"mixed{a + 1}", rank=args.rank, alpha=2 * args.rank, dropout=0.1, lr=1e-4,
                         global_batch_size=args.global_batch, target_modules="all-linear", seed=a + 1,
                         dataset={"kind": "synthetic", "distribution": "mixed", "num_samples": args.samples,
                                  "seed": a + 1})
             for a in range(args.adapters)]
    L.seed_everything(0, verbose=False)
    module = LoRAFusionModule(base_model=_base_model(args.shape, tmp), adapters=specs, dtype=args.dtype,
                              backend="auto", export_on_fit_end=False, cuda_graphs=args.cuda_graphs)
    dm = MultiAdapterDataModule(capacity=args.capacity, pad_multiple=128 if args.capacity >= 1024 else 16,
                                planner={"method": "greedy"})
    probe = _Probe(args.device, args.profile_batches if path == "single" else 1,
                   os.path.join(args.out, f"trace_{path}.json") if args.out else None)
    device = torch.device(args.device)
    precision = {"bfloat16": "bf16-true", "float16": "16-true"}.get(args.dtype, "32-true")
    strategy = ("auto" if path == "single" else
                MultiAdapterPipelineStrategy(pipeline_size=1))
    trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, max_epochs=3,
                        precision=precision, strategy=strategy, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
                        default_root_dir=os.path.join(tmp, path))
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=dm)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    graphs = getattr(module, "_graphs", None)
    result = {
        "path": path, "fit_s": time.perf_counter() - t0,
        "tokens_per_s": probe.tokens / probe.seconds if probe.seconds else None,
        "timed_tokens": probe.tokens, "timed_s": probe.seconds,
        "profiled_microbatches": probe.profiled_microbatches,
        "cuda_graphs": None if graphs is None else {"captures": graphs.captures, "replays": graphs.replays,
                                                    "refusals": {str(k): v for k, v in graphs.refusals.items()}},
        "ops": probe.table,
    }
    del module, trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def differences(single: dict, strategy: dict, field: str, top: int = 15) -> list[tuple[str, float, float, float]]:
    """``(op, strategy us, single us, difference)`` per microbatch, the ``top`` largest |difference|."""
    ns = max(1, single["profiled_microbatches"])
    nt = max(1, strategy["profiled_microbatches"])
    names = set(single["ops"]) | set(strategy["ops"])
    rows = []
    for name in names:
        a = strategy["ops"].get(name, {}).get(field, 0.0) / nt
        b = single["ops"].get(name, {}).get(field, 0.0) / ns
        rows.append((name, a, b, a - b))
    rows.sort(key=lambda r: (-abs(r[3]), r[0]))
    return rows[:top]


def report(results: dict[str, dict]) -> str:
    lines = ["| path | tokens/s (timed epoch) | profiled microbatches | CUDA graphs |", "|---|---|---|---|"]
    for path, r in results.items():
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        graphs = "-" if r["cuda_graphs"] is None else f"{r['cuda_graphs']['captures']} captured, " \
            f"{r['cuda_graphs']['replays']} replays"
        lines.append(f"| {path} | {tps} | {r['profiled_microbatches']} | {graphs} |")
    single, strategy = results.get("single"), results.get("strategy")
    if single and strategy:
        if single["tokens_per_s"] and strategy["tokens_per_s"]:
            lines.append(f"\nstrategy / single-device tokens/s: {strategy['tokens_per_s'] / single['tokens_per_s']:.3f}")
        for field, what in (("cuda_us", "CUDA"), ("cpu_us", "CPU (self)")):
            if not any(r["ops"].get(n, {}).get(field) for r in (single, strategy) for n in r["ops"]):
                continue  # no CUDA times on the CPU
            lines += ["", f"top {what} time differences per microbatch (us; strategy - single):",
                      "| op | strategy | single | difference |", "|---|---|---|---|"]
            for name, a, b, d in differences(single, strategy, field):
                lines.append(f"| {name[:70]} | {a:,.1f} | {b:,.1f} | {d:+,.1f} |")
    return "\n".join(lines)


def run_fit_isolated(args, path: str, tmp: str) -> dict:
    """``run_fit`` in a fresh process on CUDA: the first fit's CUDA-graph pools, compiled code and
    allocator cache otherwise stay in this process and the second fit of an 8B base runs out of
    memory on an 80 GB card. On the CPU it runs here (nothing to isolate, and no spawn cost)."""
    if torch.device(args.device).type != "cuda":
        return run_fit(args, path, tmp)
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(run_fit, (args, path, tmp))


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype_of(args.dtype)  # a clear error for a wrong name
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    paths = [p for p in args.paths.split(",") if p]
    if set(paths) - {"single", "strategy"}:
        raise SystemExit(f"--paths {args.paths!r}: a comma list of single, strategy")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            log(f"fit: {path}")
            results[path] = run_fit_isolated(args, path, tmp)
            log(f"{path}: {results[path]['tokens_per_s'] or 0:,.0f} tokens/s, fit {results[path]['fit_s']:.0f} s")
    text = report(results)
    print(text, flush=True)
    if args.out:
        with open(os.path.join(args.out, "profile_strategy.md"), "w") as f:
            f.write(text + "\n")
        write_json(args.out, "profile_strategy.json",
                   {"device": device_info(args.device), "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
