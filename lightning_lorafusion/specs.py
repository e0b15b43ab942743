"""Frozen, validated configuration records shared by every part: adapters and the base model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Names of the projections a LoRA adapter may target in a Llama-family decoder (PEFT's names).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ALL_TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the field and how to fix it."""


@dataclass(frozen=True, kw_only=True)
class AdapterSpec:
    """One LoRA adapter to train: its hyperparameters and where its samples come from.

    ``dataset`` is a plain mapping consumed by ``lightning_lorafusion.data.sources.build_source``
    (e.g. ``{"kind": "jsonl", "path": "train.jsonl"}``).
    """

    name: str
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ALL_TARGET_MODULES  # or "all-linear"
    lr: float = 2e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: str = "cosine"  # "cosine" | "linear" | "constant"
    min_lr_ratio: float = 0.1
    global_batch_size: int = 8  # samples per optimizer step
    max_steps: int | None = None  # None: as many global batches as the dataset gives per epoch
    seed: int = 0
    dataset: dict[str, Any] = field(default_factory=dict)
    init_from: str | None = None  # a PEFT adapter directory to continue training from

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "_").replace(".", "_").isidentifier():
            raise ConfigError(
                f"adapter name {self.name!r} must be a non-empty identifier-like string "
                "(letters, digits, '_', '-', '.'); it names the exported PEFT directory"
            )
        targets = self.target_modules
        if isinstance(targets, str):
            targets = (targets,)
        if tuple(targets) == ("all-linear",):  # PEFT's shorthand: every projection
            targets = ALL_TARGET_MODULES
        object.__setattr__(self, "target_modules", tuple(targets))
        if self.rank < 1:
            raise ConfigError(f"adapter {self.name!r}: rank={self.rank} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"adapter {self.name!r}: dropout={self.dropout} must be in [0, 1)")
        if self.alpha <= 0:
            raise ConfigError(f"adapter {self.name!r}: alpha={self.alpha} must be > 0")
        if self.lr <= 0:
            raise ConfigError(f"adapter {self.name!r}: lr={self.lr} must be > 0")
        if self.global_batch_size < 1:
            raise ConfigError(
                f"adapter {self.name!r}: global_batch_size={self.global_batch_size} must be >= 1"
            )
        if self.lr_schedule not in ("cosine", "linear", "constant"):
            raise ConfigError(
                f"adapter {self.name!r}: lr_schedule={self.lr_schedule!r}; "
                "allowed: 'cosine', 'linear', 'constant'"
            )
        if not self.target_modules:
            raise ConfigError(f"adapter {self.name!r}: target_modules is empty")
        unknown = [m for m in self.target_modules if m not in ALL_TARGET_MODULES]
        if unknown:
            raise ConfigError(
                f"adapter {self.name!r}: unknown target module(s) {unknown}; "
                f"allowed: {list(ALL_TARGET_MODULES)} (or 'all-linear')"
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"adapter {self.name!r}: max_steps={self.max_steps} must be >= 1")

    @property
    def scale(self) -> float:
        """LoRA output scale alpha / rank (PEFT's default, non-rsLoRA)."""
        return self.alpha / self.rank
