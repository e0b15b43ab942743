"""Callbacks: real-token throughput on the progress bar and in the logger."""

from __future__ import annotations

import time

import lightning as L


class TokenThroughput(L.Callback):
    """Logs ``throughput/tokens_per_s``: real (non-padding) tokens per wall-clock second over the
    last ``window`` microbatches, and the fill ratio (real tokens / capacity)."""

    def __init__(self, window: int = 10) -> None:
        self.window = max(1, window)
        self._t0: float | None = None
        self._tokens = 0
        self._capacity = 0
        self._count = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._tokens += batch.real_tokens
        self._capacity += batch.capacity
        self._count += 1
        if self._count >= self.window:
            elapsed = time.perf_counter() - (self._t0 or time.perf_counter())
            pl_module.log("throughput/tokens_per_s", self._tokens / max(elapsed, 1e-9), prog_bar=True, batch_size=1)
            pl_module.log("throughput/fill", self._tokens / max(self._capacity, 1), batch_size=1)
            self._t0, self._tokens, self._capacity, self._count = time.perf_counter(), 0, 0, 0


def _stage_layers(strategy) -> list[int] | None:
    """Decoder layers per pipeline stage as the strategy split them; None before the split or
    without the pipeline strategy."""
    counts = getattr(strategy, "stage_layer_counts", None)
    return list(counts) if counts else None


class RunSummary(L.Callback):
    """One JSON record per training epoch, written by global rank 0 to ``path`` (default
    ``<default_root_dir>/run_summary.json``) after every epoch, so a run stopped later keeps
    the epochs it finished. Per epoch: wall seconds between barriers at its start and end (CUDA
    synchronised), real tokens trained over all data-parallel replicas and their rate, useful
    FLOPs and MFU over ``world_size x peak_tflops``, the pipeline's measured and simulated
    bubble ratios (as the module logged them; per stage too), the plan's microbatches, and each rank's peak
    allocated and reserved GPU memory (reset at the epoch's start). Time the second epoch of a
    run: the first includes compilation and allocator warm-up. The run's ``stage_layers`` is the
    pipeline's split (decoder layers per stage; null without the pipeline strategy)."""

    def __init__(self, path: str | None = None, peak_tflops: float | None = None, name: str | None = None) -> None:
        from .flops import H100_H200_BF16_PEAK_TFLOPS

        self.path = path
        self.peak_tflops = peak_tflops or H100_H200_BF16_PEAK_TFLOPS
        self.name = name
        self.epochs: list[dict] = []
        self._lengths: list[int] = []
        self._plan: dict = {}
        self._t0 = 0.0
        self._start_unix = 0.0

    @staticmethod
    def _sync(trainer) -> None:
        import torch

        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        import torch

        self._sync(trainer)
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        trainer.strategy.barrier("run_summary_epoch_start")
        self._lengths, self._plan = [], {}
        self._start_unix, self._t0 = time.time(), time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if hasattr(batch, "sample_lengths"):  # a PipelineWindow: this replica's whole epoch
            self._lengths.extend(batch.sample_lengths())
            noop = sum(mb.is_noop for mb in batch.plan.microbatches)
            self._plan = {"microbatches": len(batch.plan.microbatches) - noop, "noop_slots": noop,
                          "capacity": batch.plan.capacity}
        else:
            self._lengths.extend(ref.length for ref in batch.samples)
            self._plan["microbatches"] = self._plan.get("microbatches", 0) + 1
            self._plan["capacity"] = batch.capacity

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        import torch

        from .flops import lora_training_flops

        self._sync(trainer)
        trainer.strategy.barrier("run_summary_epoch_end")
        wall = time.perf_counter() - self._t0
        strategy = trainer.strategy
        device = strategy.root_device
        layout = getattr(strategy, "layout", None)
        pp = layout.pipeline_size if layout is not None else 1
        # every stage of a replica trains the same samples: sum over the world, divide by stages
        local = torch.tensor([float(sum(self._lengths)), lora_training_flops(pl_module.config, self._lengths)],
                             dtype=torch.float64, device=device)
        tokens, flops = (float(v) / pp for v in strategy.reduce(local, reduce_op="sum"))
        if device.type == "cuda":
            mem = torch.tensor([torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)],
                               dtype=torch.float64, device=device) / 2**30
        else:
            mem = torch.zeros(2, dtype=torch.float64, device=device)
        mem = strategy.all_gather(mem).reshape(-1, 2)
        metrics = trainer.callback_metrics

        def metric(key: str) -> float | None:
            return float(metrics[key]) if key in metrics else None

        stages = [metric(f"pipeline/bubble_ratio_stage{s}") for s in range(pp)] if layout is not None else []
        simulated = [metric(f"pipeline/simulated_bubble_ratio_stage{s}") for s in range(pp)] if layout is not None else []
        gpus = strategy.world_size
        record = {
            "epoch": trainer.current_epoch, "wall_s": wall, "start_unix": self._start_unix,
            "end_unix": self._start_unix + wall, "real_tokens": int(tokens), "tokens_per_s": tokens / wall,
            "useful_flops": flops, "mfu": flops / wall / (gpus * self.peak_tflops * 1e12),
            "bubble_ratio": metric("pipeline/bubble_ratio"),
            "simulated_bubble_ratio": metric("pipeline/simulated_bubble_ratio"),
            "stage_bubble_ratios": stages, "simulated_stage_bubble_ratios": simulated, **self._plan,
            "peak_allocated_gib": [round(float(v), 2) for v in mem[:, 0]],
            "peak_reserved_gib": [round(float(v), 2) for v in mem[:, 1]],
        }
        self.epochs.append(record)
        if trainer.is_global_zero:
            self._write(trainer, pl_module, gpus, pp)

    def _write(self, trainer, pl_module, gpus: int, pp: int) -> None:
        import json
        import os

        import torch

        device = trainer.strategy.root_device
        summary = {
            "name": self.name, "base_model": getattr(pl_module, "base_model_name", None),
            "adapters": [s.name for s in getattr(pl_module, "adapter_specs", ())],
            "gpus": gpus, "pipeline_size": pp, "data_parallel_size": gpus // pp,
            "schedule": getattr(trainer.strategy, "schedule", None),
            "stage_layers": _stage_layers(trainer.strategy), "max_epochs": trainer.max_epochs,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "peak_tflops": self.peak_tflops, "epochs": self.epochs,
        }
        path = self.path or os.path.join(trainer.default_root_dir, "run_summary.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(tmp, path)
