"""Frozen, validated configuration records shared by every part: adapters and the base model."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

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
# An adapter name becomes a directory name (``<export_dir>/<name>``) and a metric key: letters,
# digits, '.', '_' and '-', starting with a letter or digit (so never '.', '..' or hidden), no path
# separator, at most 64 characters.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# Upper bounds that catch overflow-sized typos (1e30) while leaving room for deliberate
# experiments: AdamW moves each weight by about lr per step, and LoRA weights are ~1e-2.
MAX_LR = 1e6
MAX_ALPHA = 1e6


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the field and how to fix it."""


def parse_section(cls: Any, value: Any, *, where: str, scalar_field: str, fields: str) -> Any:
    """A config section (a frozen dataclass ``cls``) from itself, a mapping (YAML, Python), a
    jsonargparse Namespace or None (the default). A plain string, the section's old flat form,
    is a ``ConfigError`` that shows the new spelling with it as ``scalar_field``; unknown keys
    name the section's ``fields``."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    name = where.rsplit(".", 1)[-1]
    if isinstance(value, str):
        raise ConfigError(f"{where}={value!r} is a section now; write {name}: {{{scalar_field}: {value}}}")
    if hasattr(value, "as_dict"):  # a jsonargparse Namespace
        value = value.as_dict()
    try:
        return cls(**dict(value))
    except TypeError as error:
        raise ConfigError(f"{where}: {error}; fields: {fields}") from None


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
    test_dataset: dict[str, Any] | None = None  # evaluated by `lightning-lorafusion test`
    early_stopping: dict[str, Any] | None = None  # {patience: int >= 1, min_delta: float >= 0}
    # divergence guard: quarantine after this many consecutive non-finite global batches
    # (None: the model's ``max_nonfinite_steps``), or when a val loss exceeds
    # ``val_explode_factor`` x its best (None: never)
    max_bad_steps: int | None = None
    val_explode_factor: float | None = 3.0
    val_samples: int = 0  # greedy generations for this many fixed val prompts at each validation
    metric: str | None = None  # task metric on those generations: "rouge"
    # DoRA (PEFT's use_dora): a trained magnitude per output row rescales W + scale * B A,
    # normalised per row (kernels/dora.py)
    dora: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not ADAPTER_NAME.fullmatch(self.name):
            raise ConfigError(
                f"adapter name {self.name!r} must be identifier-like: it names the exported PEFT "
                "directory, so use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit "
                "(no path separators, not '.' or '..')"
            )
        targets = self.target_modules
        if isinstance(targets, str):
            targets = (targets,)
        if tuple(targets) == ("all-linear",):  # PEFT's shorthand: every projection
            targets = ALL_TARGET_MODULES
        object.__setattr__(self, "target_modules", tuple(targets))
        where = f"adapter {self.name!r}"
        _check_int(where, "rank", self.rank, minimum=1)
        _check_number(where, "dropout", self.dropout, low=0.0, high=1.0, high_open=True)
        _check_number(where, "alpha", self.alpha, low=0.0, low_open=True, high=MAX_ALPHA)
        _check_number(where, "lr", self.lr, low=0.0, low_open=True, high=MAX_LR)
        _check_number(where, "weight_decay", self.weight_decay, low=0.0)
        _check_int(where, "warmup_steps", self.warmup_steps, minimum=0)
        _check_number(where, "min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        _check_int(where, "global_batch_size", self.global_batch_size, minimum=1)
        _check_int(where, "seed", self.seed, minimum=0)
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
        if self.max_steps is not None:
            _check_int(where, "max_steps", self.max_steps, minimum=1)
        if not isinstance(self.dora, bool):
            raise ConfigError(f"{where}: dora={self.dora!r} must be true or false")
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
        if self.test_dataset is not None and not isinstance(self.test_dataset, dict):
            raise ConfigError(f"{where}: test_dataset must be a mapping like dataset, e.g. "
                              "{kind: jsonl, path: {train: a.jsonl, test: c.jsonl}}")
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
            if (isinstance(min_delta, bool) or not isinstance(min_delta, (int, float))
                    or not math.isfinite(min_delta) or min_delta < 0):
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
        factor = self.val_explode_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                   or not math.isfinite(factor) or not factor > 1.0):
            raise ConfigError(f"{where}: val_explode_factor={factor!r} must be > 1 and finite "
                              "(or null to never quarantine on validation loss)")

    @property
    def has_validation(self) -> bool:
        """Whether this adapter has validation data (a val dataset or a held-out fraction)."""
        return self.val_dataset is not None or self.val_fraction > 0

    @property
    def scale(self) -> float:
        """LoRA output scale alpha / rank (PEFT's default, non-rsLoRA)."""
        return self.alpha / self.rank


def _check_int(where: str, field_name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: {field_name}={value!r} must be >= {minimum} (an int)")


def _check_number(where: str, field_name: str, value: Any, *, low: float, high: float | None = None,
                  low_open: bool = False, high_open: bool = False) -> None:
    """``value`` must be a finite real number in the interval [low, high] (ends open as told)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: {field_name}={value!r} must be a finite number")
    too_low = value <= low if low_open else value < low
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        if high is None:
            allowed = f"{'>' if low_open else '>='} {low:g}"
        elif low_open:
            allowed = f"> {low:g} and {'<' if high_open else '<='} {high:g}"
        else:
            allowed = f"in [{low:g}, {high:g}{')' if high_open else ']'}"
        raise ConfigError(f"{where}: {field_name}={value!r} must be {allowed}")


def check_adapter_names(specs: Sequence[AdapterSpec]) -> None:
    """Adapter names of one run must differ even ignoring case: each names a directory, and on a
    case-insensitive file system (macOS, Windows) 'Legal' and 'legal' are the same one."""
    seen: dict[str, str] = {}
    for spec in specs:
        key = spec.name.casefold()
        if key in seen:
            same = "the same name" if seen[key] == spec.name else "names that differ only in case"
            raise ConfigError(
                f"adapters {seen[key]!r} and {spec.name!r} have {same}; each adapter's name must be "
                "unique ignoring case (it names the export directory <export_dir>/<name>)"
            )
        seen[key] = spec.name
