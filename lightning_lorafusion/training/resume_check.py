"""Does a checkpoint fit the run's config? The model and adapter fields it was trained with
against the ones given now: a mismatch is a ``ConfigError`` naming the first differing field;
the fields that may change on resume are listed here (docs/training.md, "Checkpoints and resume")."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Mapping

from ..specs import AdapterSpec, ConfigError

log = logging.getLogger(__name__)

# `model.*` fields a resumed run may change: how the same math runs (kernels, graphs,
# recomputation, the LM-head loss's form, FP8 accumulation), where and whether it exports, and
# what is done once at a fresh start. Every other model field must equal the checkpoint's.
MODEL_MAY_CHANGE = frozenset({
    "backend", "cuda_graphs", "cuda_graph_precapture", "activation_checkpointing", "mlp_recompute", "norm_recompute",
    "mlp_recompute_layers", "norm_recompute_layers", "lm_head_loss", "embedding_on_host",
    "precision.fp8.fast_accumulation",
    "export_dir", "export_on_fit_end", "cache_dir", "validate_before_training", "sample_max_new_tokens",
    "max_nonfinite_steps",
})
# `model.adapters[]` fields a resumed run may change: the guards and reports around training
# (the weights come from the checkpoint, so init_from no longer applies).
ADAPTER_MAY_CHANGE = frozenset({
    "init_from", "early_stopping", "max_bad_steps", "val_explode_factor", "val_samples", "metric",
})
# What evaluating a checkpoint (`validate`, `test`) needs to match: the base and each adapter's
# shape and scale. Training hyperparameters and data may differ there.
EVAL_MODEL_FIELDS = frozenset({"base_model", "dtype", "precision.base", "precision.fp8.exempt_layers"})
EVAL_ADAPTER_FIELDS = frozenset({"name", "rank", "alpha", "target_modules", "dora"})


def _plain(value: Any) -> Any:
    """Namespaces, dataclasses and tuples as plain dicts and lists (comparable with ==)."""
    if hasattr(value, "as_dict") and callable(value.as_dict):  # a jsonargparse Namespace
        value = value.as_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _model_defaults(model_class: type) -> dict[str, Any]:
    params = inspect.signature(model_class.__init__).parameters
    return {n: p.default for n, p in params.items()
            if n not in ("self", "adapters") and p.default is not inspect.Parameter.empty}


def _leaves(name: str, default: Any, old: Any, new: Any) -> list[tuple[str, Any, Any]]:
    """A model field as (dotted name, old, new) per leaf: a section (``precision``) by its fields,
    each missing one at its default."""
    default = _plain(default)
    if not isinstance(default, dict):
        return [(name, old, new)]
    old = old if isinstance(old, dict) else {}
    new = new if isinstance(new, dict) else {}
    return [leaf for key, value in default.items()
            for leaf in _leaves(f"{name}.{key}", value, old.get(key, _plain(value)), new.get(key, _plain(value)))]


def _adapters(entries: Any, where: str) -> list[dict[str, Any]]:
    """Adapter entries as complete field dicts (defaults filled in, lists for tuples)."""
    out = []
    for entry in _plain(entries) or []:
        try:
            spec = AdapterSpec(**entry)
        except TypeError as error:
            raise ConfigError(f"the {where}'s adapter entry {entry.get('name')!r} is not valid: {error}") from None
        out.append(_plain(spec))
    return out


def check_checkpoint_config(saved: Mapping[str, Any] | None, given: Mapping[str, Any], *, model_class: type,
                            stage: str = "fit", log_changes: bool = True) -> list[str]:
    """Compare a checkpoint's model hyperparameters ``saved`` with this run's ``given`` (both the
    ``model:`` section: init arguments, ``adapters`` a list of entries). ``stage``: ``fit``
    (resume: every field but the ``*_MAY_CHANGE`` ones must match) or ``validate``/``test``
    (only the ``EVAL_*`` fields). Returns the changed fields that are allowed, logged when
    ``log_changes``; raises ``ConfigError`` naming the first field that must match but does not.
    A checkpoint without hyperparameters (saved by hand) is not checked here."""
    if not saved:
        return []
    saved, given = _plain(saved), _plain(given)
    evaluating = stage != "fit"
    old_adapters = _adapters(saved.get("adapters"), "checkpoint")
    new_adapters = _adapters(given.get("adapters"), "config")
    old_names = [a["name"] for a in old_adapters]
    new_names = [a["name"] for a in new_adapters]
    hint = ("resume with the settings the checkpoint was saved with" if not evaluating else
            "use the config the checkpoint was trained with")
    if old_names != new_names:
        raise ConfigError(
            f"the checkpoint's adapters do not match the config's: the checkpoint holds {old_names}, the "
            f"config lists {new_names} (model.adapters); {hint}"
        )
    changed: list[str] = []

    def compare(field: str, old: Any, new: Any, may_change: bool) -> None:
        if old == new:
            return
        if not may_change:
            raise ConfigError(
                f"the checkpoint does not match the config: {field} is {old!r} in the checkpoint but "
                f"{new!r} in the config; {hint} (fields that may change on resume: docs/training.md)"
            )
        changed.append(f"{field}: {old!r} -> {new!r}")

    defaults = _model_defaults(model_class)
    for field_name, default in defaults.items():
        default = _plain(default)
        for name, old, new in _leaves(field_name, default, saved.get(field_name, default),
                                      given.get(field_name, default)):
            allowed = name not in EVAL_MODEL_FIELDS if evaluating else name in MODEL_MAY_CHANGE
            compare(f"model.{name}", old, new, allowed)
    for old, new in zip(old_adapters, new_adapters):
        for name in old:
            allowed = name not in EVAL_ADAPTER_FIELDS if evaluating else name in ADAPTER_MAY_CHANGE
            compare(f"model.adapters[{old['name']}].{name}", old[name], new[name], allowed)
    if changed and log_changes:
        log.info("the config changes these checkpoint settings (allowed%s): %s",
                 "" if evaluating else " on resume", "; ".join(changed))
    return changed
