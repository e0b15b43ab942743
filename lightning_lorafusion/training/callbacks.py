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
