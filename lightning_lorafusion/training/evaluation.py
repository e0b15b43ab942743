"""Per-adapter validation bookkeeping: best val loss, early stopping, quarantine, trainer_state.json."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ..specs import AdapterSpec

TRAINING, EARLY_STOPPED, QUARANTINED = "training", "early_stopped", "quarantined"
DONE = "done"  # how an adapter still training when fit ends is reported (never stored)
STATE_FILE = "trainer_state.json"


@dataclass
class AdapterProgress:
    """Where one adapter stands: its status, best validation loss so far and its history.

    Steps count the adapter's own optimizer steps (the weights after ``step`` steps).
    """

    status: str = TRAINING
    best_val_loss: float | None = None
    best_step: int | None = None
    evals_since_best: int = 0
    stopped_step: int | None = None
    message: str = ""
    val_history: list[tuple[int, float]] = field(default_factory=list)  # (step, val loss)

    @property
    def training(self) -> bool:
        return self.status == TRAINING

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AdapterProgress":
        d = dict(d)
        d["val_history"] = [tuple(x) for x in d.get("val_history", [])]
        return cls(**d)


def judge_validation(progress: AdapterProgress, loss: float, *, spec: AdapterSpec, step: int) -> str:
    """Record adapter ``spec``'s val ``loss`` measured after ``step`` optimizer steps and say what
    follows: ``"best"`` (a new best: keep these weights), ``"kept"`` (no improvement),
    ``"early_stop"`` (no improvement for ``patience`` validations) or ``"quarantine"`` (the loss
    is not finite or exceeds ``val_explode_factor`` x the best)."""
    progress.val_history.append((step, loss))
    best = progress.best_val_loss
    if not math.isfinite(loss):
        return "quarantine"
    if best is not None and spec.val_explode_factor is not None and loss > spec.val_explode_factor * best:
        return "quarantine"
    min_delta = spec.early_stopping["min_delta"] if spec.early_stopping else 0.0
    if best is None or loss < best - min_delta:
        progress.best_val_loss, progress.best_step, progress.evals_since_best = loss, step, 0
        return "best"
    progress.evals_since_best += 1
    if spec.early_stopping and progress.evals_since_best >= spec.early_stopping["patience"]:
        return "early_stop"
    return "kept"


def val_loss_at(progress: AdapterProgress, step: int) -> float | None:
    """The last val loss measured at exactly ``step`` (None if none was)."""
    for s, loss in reversed(progress.val_history):
        if s == step:
            return loss
    return None


def final_status(progress: AdapterProgress) -> str:
    """An adapter's status once fit has ended: ``done`` for one that trained to the end, else
    ``early_stopped`` or ``quarantined``. Checkpoints keep ``training`` (a resumed run trains on)."""
    return DONE if progress.status == TRAINING else progress.status


def write_trainer_state(directory: str | os.PathLike, **kwargs: Any) -> None:
    """Write ``trainer_state_json(**kwargs)`` to ``<directory>/trainer_state.json``."""
    with open(os.path.join(directory, STATE_FILE), "w") as f:
        f.write(trainer_state_json(**kwargs))


def trainer_state_json(*, adapter: str, weights: str, reason: str, step: int, progress: AdapterProgress,
                       steps_taken: int) -> str:
    """``trainer_state.json`` next to an exported adapter: which weights these are and why.

    ``weights``: "best" (lowest val loss), "last" (the final weights) or "last_good" (the last
    weights whose loss and gradients were finite, for a quarantined adapter). ``reason``: "best",
    "last", "early_stopped" or "quarantined". ``status``: ``final_status`` of the adapter.
    """
    def number(x: float | None) -> float | str | None:  # JSON has no NaN / Infinity
        return x if x is None or math.isfinite(x) else str(x)

    state = {
        "adapter": adapter,
        "weights": weights,
        "reason": reason,
        "step": step,
        "val_loss": number(val_loss_at(progress, step)),
        "status": final_status(progress),
        "steps_taken": steps_taken,
        "best_step": progress.best_step,
        "best_val_loss": number(progress.best_val_loss),
        "stopped_step": progress.stopped_step,
        "message": progress.message,
        "val_history": [{"step": s, "val_loss": number(v)} for s, v in progress.val_history],
    }
    return json.dumps(state, indent=2, allow_nan=False) + "\n"
