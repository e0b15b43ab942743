"""Frozen, validated configuration records shared by every part: adapters and the base model."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

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
# ``init_lora_weights`` values ``fit`` draws: PEFT's default (kaiming-uniform A, zero B) and
# "gaussian" (A ~ N(0, 1/r), zero B). PEFT inits starting with these prefixes rewrite the
# frozen base weight (W - s*BA at init), which one base shared by every adapter cannot allow.
INIT_LORA_WEIGHTS = (True, "gaussian")
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


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


def module_path(layer: int, module: str) -> str:
    """A projection's name in a Hugging Face decoder, ``model.layers.<layer>.<block>.<module>``:
    what PEFT matches ``rank_pattern`` / ``alpha_pattern`` keys and ``layers_to_transform``
    against, and the stem of its saved weight names."""
    block = "self_attn" if module in ATTENTION_MODULES or module == "qkv_proj" else "mlp"
    return f"model.layers.{layer}.{block}.{module}"


def _pattern_value(pattern: Mapping[str, Any], path: str) -> Any:
    """PEFT's lookup: the value of the first key (in order) that, as a regular expression,
    matches the whole of ``path`` or its end after a dot; None if no key does."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", path):
            return value
    return None


def _check_regex(where: str, field_name: str, key: Any) -> None:
    if not isinstance(key, str) or not key:
        raise ConfigError(f"{where}: {field_name} keys must be non-empty strings (module names or "
                          f"regular expressions); got {key!r}")
    try:
        re.compile(key)
    except re.error as error:
        raise ConfigError(f"{where}: {field_name} key {key!r} is not a regular expression ({error})") from None


@dataclass(frozen=True, kw_only=True)
class LoraLayout:
    """Which projections of a decoder one adapter adapts, with what rank and scale: PEFT's ``r``,
    ``lora_alpha``, ``target_modules``, ``use_rslora``, ``rank_pattern``, ``alpha_pattern``,
    ``layers_to_transform`` and ``layers_pattern``, resolved by PEFT's matching rules against
    ``module_path`` names. ``owner`` names the adapter in error messages."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None
    owner: str = field(default="adapter", compare=False)

    def __post_init__(self) -> None:
        where = self.owner
        _check_int(where, "rank", self.rank, minimum=1)
        _check_number(where, "alpha", self.alpha, low=0.0, low_open=True, high=MAX_ALPHA)
        if not isinstance(self.use_rslora, bool):
            raise ConfigError(f"{where}: use_rslora={self.use_rslora!r} must be true or false")
        for name in ("rank_pattern", "alpha_pattern"):
            pattern = getattr(self, name)
            if pattern is None:
                pattern = {}
            if not isinstance(pattern, Mapping):
                raise ConfigError(f"{where}: {name} must be a mapping {{module name or regex: value}}; "
                                  f"got {pattern!r}")
            for key, value in pattern.items():
                _check_regex(where, name, key)
                if name == "rank_pattern":
                    _check_int(where, f"rank_pattern[{key!r}]", value, minimum=1)
                else:
                    _check_number(where, f"alpha_pattern[{key!r}]", value, low=0.0, low_open=True, high=MAX_ALPHA)
            object.__setattr__(self, name, dict(pattern))
        self._normalise_layers(where)

    def _normalise_layers(self, where: str) -> None:
        layers = self.layers_to_transform
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = (layers,)
        if layers is not None:
            if isinstance(layers, str) or not isinstance(layers, Sequence):
                raise ConfigError(f"{where}: layers_to_transform={layers!r} must be a layer index or a list of them")
            for index in layers:
                _check_int(where, "layers_to_transform entry", index, minimum=0)
            layers = tuple(sorted(set(layers))) or None  # PEFT: an empty list adapts every layer
        patterns = self.layers_pattern
        if isinstance(patterns, str):
            patterns = (patterns,)
        if patterns is not None:
            for p in patterns:
                _check_regex(where, "layers_pattern", p)
            patterns = tuple(patterns) or None
        if patterns is not None and layers is None:
            raise ConfigError(f"{where}: layers_pattern={list(patterns)} needs layers_to_transform "
                              "(it names where the layer index is, as in PEFT); set both or neither")
        object.__setattr__(self, "layers_to_transform", layers)
        object.__setattr__(self, "layers_pattern", patterns)

    @property
    def scale(self) -> float:
        """The adapter's LoRA scale: alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def transforms(self, layer: int, module: str) -> bool:
        """Whether projection ``module`` of ``layer`` carries this adapter (PEFT's rule: the first
        index after ``layers_pattern``, or after the first dotted name, is the layer index)."""
        if module not in self.target_modules:
            return False
        if self.layers_to_transform is None:
            return True
        path = module_path(layer, module)
        for p in self.layers_pattern or (None,):
            found = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\." if p is None else rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.",
                             path)
            if found:
                return int(found["idx"]) in self.layers_to_transform
        return False

    def module_rank(self, layer: int, module: str) -> int:
        """Rank of one projection: ``rank_pattern``'s value for it, else ``rank``."""
        value = _pattern_value(self.rank_pattern, module_path(layer, module))
        return self.rank if value is None else value

    def module_alpha(self, layer: int, module: str) -> float:
        value = _pattern_value(self.alpha_pattern, module_path(layer, module))
        return float(self.alpha if value is None else value)

    def module_scale(self, layer: int, module: str) -> float:
        """Scale of one projection (PEFT's ``scaling``): its alpha over its rank (or sqrt(rank))."""
        r = self.module_rank(layer, module)
        return self.module_alpha(layer, module) / (math.sqrt(r) if self.use_rslora else r)

    def adapted(self, num_layers: int) -> list[tuple[int, str]]:
        """The (layer, module) pairs carrying the adapter in a ``num_layers`` decoder, layer-major;
        ``ConfigError`` if ``layers_to_transform`` names a layer it lacks or nothing is adapted."""
        beyond = [i for i in self.layers_to_transform or () if i >= num_layers]
        if beyond:
            raise ConfigError(f"{self.owner}: layers_to_transform names layer(s) {beyond} of a {num_layers}-layer "
                              f"model; use indices 0..{num_layers - 1}")
        pairs = [(layer, m) for layer in range(num_layers) for m in ADAPTABLE_MODULES if self.transforms(layer, m)]
        if not pairs:
            raise ConfigError(f"{self.owner}: no projection carries the adapter (layers_pattern="
                              f"{list(self.layers_pattern or ())} matches no layer); PEFT's layer names are "
                              "model.layers.<i>.<self_attn|mlp>.<module>, so use layers_pattern 'layers' or none")
        return pairs

    def peft_config(self) -> dict[str, Any]:
        """These options as adapter_config.json fields."""
        return {
            "r": self.rank, "lora_alpha": self.alpha,
            "target_modules": [m for m in ADAPTABLE_MODULES if m in self.target_modules],
            "use_rslora": self.use_rslora, "rank_pattern": dict(self.rank_pattern),
            "alpha_pattern": dict(self.alpha_pattern),
            "layers_to_transform": None if self.layers_to_transform is None else list(self.layers_to_transform),
            "layers_pattern": None if self.layers_pattern is None else list(self.layers_pattern),
        }


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
    # PEFT's LoRA options (docs/LORA_OPTIONS.md): scale alpha/sqrt(rank); B's lr = ratio x lr;
    # per-module ranks / alphas by module-name regex; only these layers carry the adapter; A's init
    use_rslora: bool = False
    loraplus_lr_ratio: float | None = None
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    init_lora_weights: bool | str = True  # true (kaiming-uniform A) or "gaussian"; B starts at zero
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
        self._check_lora_options(where)

    def _check_lora_options(self, where: str) -> None:
        self.layout  # noqa: B018 - builds and so validates the layout options
        if self.loraplus_lr_ratio is not None:
            _check_number(where, "loraplus_lr_ratio", self.loraplus_lr_ratio, low=0.0, low_open=True, high=MAX_LR)
            if self.lr * self.loraplus_lr_ratio > MAX_LR:
                raise ConfigError(f"{where}: lr x loraplus_lr_ratio = {self.lr * self.loraplus_lr_ratio:g} "
                                  f"exceeds {MAX_LR:g}; lower one of them")
        check_init_lora_weights(where, self.init_lora_weights)

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
    def layout(self) -> LoraLayout:
        """Where the adapter sits and with what ranks and scales (rank/alpha patterns, layers);
        built from the fields on each use (nothing beyond the fields is stored on a spec)."""
        return LoraLayout(rank=self.rank, alpha=self.alpha, target_modules=self.target_modules,
                          use_rslora=self.use_rslora, rank_pattern=self.rank_pattern or {},
                          alpha_pattern=self.alpha_pattern or {}, layers_to_transform=self.layers_to_transform,
                          layers_pattern=self.layers_pattern, owner=f"adapter {self.name!r}")

    @property
    def scale(self) -> float:
        """LoRA output scale: alpha / rank, or alpha / sqrt(rank) with ``use_rslora``."""
        return self.layout.scale


def check_init_lora_weights(where: str, init: Any) -> None:
    """``ConfigError`` unless ``init`` is an ``init_lora_weights`` that ``fit`` draws, with the
    reason a PEFT init is refused."""
    if any(init is allowed or (isinstance(init, str) and init == allowed) for allowed in INIT_LORA_WEIGHTS):
        return
    fix = "use init_lora_weights: true (kaiming-uniform A) or 'gaussian'"
    if isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS):
        raise ConfigError(f"{where}: init_lora_weights={init!r} rewrites the frozen base weight (it subtracts "
                          "the initial adapter from W), but one frozen base serves every adapter here; " + fix)
    if init is False:
        raise ConfigError(f"{where}: init_lora_weights=false starts B at random values (PEFT's debugging "
                          "init), so the adapter would not start at the base model; " + fix)
    if isinstance(init, str) and init.lower() == "eva":
        raise ConfigError(f"{where}: init_lora_weights='eva' draws A from an SVD of layer inputs over "
                          "training batches, which fit does not compute; " + fix)
    raise ConfigError(f"{where}: init_lora_weights={init!r} is not implemented here; " + fix)


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
