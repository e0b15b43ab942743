"""Frozen, validated configuration records shared by every part: adapters and the base model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Names of the projections a LoRA adapter may target in a Llama-family decoder (PEFT's names).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ALL_TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
# Fused checkpoints (Phi-3/4) hold q/k/v and gate/up as one projection each; PEFT targets them so.
FUSED_TARGET_MODULES = ("qkv_proj", "gate_up_proj")
ADAPTABLE_MODULES = ALL_TARGET_MODULES + FUSED_TARGET_MODULES
# Label of a token with no target (prompt, padding); cross-entropy skips it (torch's default).
IGNORE_INDEX = -100
# Task metrics an adapter can report on its generated val samples (training/val_samples.py).
METRICS = ("rouge",)


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
    # validation (docs/training.md): a dataset of its own, or a seeded split of ``dataset``
    val_dataset: dict[str, Any] | None = None
    val_fraction: float = 0.0  # share of ``dataset`` held out (by sample index hash), never trained on
    early_stopping: dict[str, Any] | None = None  # {patience: int >= 1, min_delta: float >= 0}
    # divergence guard: quarantine after this many consecutive non-finite global batches
    # (None: the model's ``max_nonfinite_steps``), or when a val loss exceeds
    # ``val_explode_factor`` x its best (None: never)
    max_bad_steps: int | None = None
    val_explode_factor: float | None = 3.0
    val_samples: int = 0  # greedy generations for this many fixed val prompts at each validation
    metric: str | None = None  # task metric on those generations: "rouge"

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
        unknown = [m for m in self.target_modules if m not in ADAPTABLE_MODULES]
        if unknown:
            raise ConfigError(
                f"adapter {self.name!r}: unknown target module(s) {unknown}; "
                f"allowed: {list(ADAPTABLE_MODULES)} (or 'all-linear')"
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"adapter {self.name!r}: max_steps={self.max_steps} must be >= 1")
        self._check_validation()

    def _check_validation(self) -> None:
        where = f"adapter {self.name!r}"
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"{where}: val_fraction={self.val_fraction} must be in [0, 1)")
        if self.val_dataset is not None and self.val_fraction > 0:
            raise ConfigError(
                f"{where}: set either val_dataset or val_fraction, not both "
                "(val_fraction holds out part of `dataset`; val_dataset reads other data)"
            )
        if self.val_dataset is not None and not isinstance(self.val_dataset, dict):
            raise ConfigError(f"{where}: val_dataset must be a mapping like dataset, e.g. "
                              "{kind: jsonl, path: {train: a.jsonl, val: b.jsonl}, split: val}")
        if self.early_stopping is not None:
            stop = dict(self.early_stopping)
            unknown = sorted(set(stop) - {"patience", "min_delta"})
            if unknown:
                raise ConfigError(f"{where}: unknown early_stopping key(s) {unknown}; "
                                  "allowed: ['patience', 'min_delta']")
            stop.setdefault("patience", 3)
            stop.setdefault("min_delta", 0.0)
            patience, min_delta = stop["patience"], stop["min_delta"]
            if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
                raise ConfigError(f"{where}: early_stopping.patience={patience!r} must be an int >= 1 "
                                  "(validations without improvement before the adapter stops)")
            if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or min_delta < 0:
                raise ConfigError(f"{where}: early_stopping.min_delta={min_delta!r} must be a number >= 0")
            object.__setattr__(self, "early_stopping", {"patience": patience, "min_delta": float(min_delta)})
        if self.max_bad_steps is not None and (isinstance(self.max_bad_steps, bool) or self.max_bad_steps < 1):
            raise ConfigError(f"{where}: max_bad_steps={self.max_bad_steps!r} must be an int >= 1 (or unset)")
        if isinstance(self.val_samples, bool) or not isinstance(self.val_samples, int) or self.val_samples < 0:
            raise ConfigError(f"{where}: val_samples={self.val_samples!r} must be an int >= 0")
        if self.metric is not None and self.metric not in METRICS:
            raise ConfigError(f"{where}: metric={self.metric!r}; allowed: {list(METRICS)} (or null)")
        if self.metric is not None and self.val_samples < 1:
            raise ConfigError(f"{where}: metric={self.metric!r} is computed on generated val samples; "
                              "set val_samples >= 1")
        if (self.val_samples or self.metric) and not self.has_validation:
            raise ConfigError(f"{where}: val_samples/metric need validation data; set val_dataset or val_fraction")
        if self.val_explode_factor is not None and not self.val_explode_factor > 1.0:
            raise ConfigError(f"{where}: val_explode_factor={self.val_explode_factor!r} must be > 1 "
                              "(or null to never quarantine on validation loss)")

    @property
    def has_validation(self) -> bool:
        """Whether this adapter has validation data (a val dataset or a held-out fraction)."""
        return self.val_dataset is not None or self.val_fraction > 0

    @property
    def scale(self) -> float:
        """LoRA output scale alpha / rank (PEFT's default, non-rsLoRA)."""
        return self.alpha / self.rank
