"""Training adapters pushed into a running generation engine without files: after each
validation, every adapter's current weights become the engine's newest version of it."""

from __future__ import annotations

import logging
from typing import Any, Iterable

import lightning as L
from lightning import LightningModule as Module

from ..specs import ConfigError

log = logging.getLogger(__name__)


def adapter_factors(m: Module, index: int) -> dict[tuple[int, str], tuple[Any, Any]]:
    """``{(layer, module): (lora_A [r, in], lora_B [out, r])}`` of adapter ``index`` of the
    training module's bank (its live parameters, detached; the engine copies them)."""
    spec = m.adapter_specs[index]
    factors = {}
    for layer in range(m.config.num_layers):
        for module in spec.target_modules:
            f = m.bank.factors(index, layer, module)
            factors[(layer, module)] = (f.lora_A.detach(), f.lora_B.detach())
    return factors


def publish_adapters(m: Module, engine: Any, names: Iterable[str] | None = None) -> dict[str, int]:
    """Update (or add) each adapter of ``m`` (``names``: a subset) in ``engine`` in place
    (``Engine.update_adapter``): requests submitted from now on use these weights, requests
    running finish on the previous ones. An adapter whose weights are not finite (a diverged
    one, quarantined by fit) is skipped with a warning and keeps its last good version.
    Returns name -> the engine's version of it now."""
    if m._pipeline_strategy() is not None:
        raise ConfigError("PublishToEngine: with pipeline stages each rank holds only its own layers; "
                          "publish from a single-device or data-parallel fit, or serve the exported adapters")
    wanted = None if names is None else set(names)
    versions = {}
    for i, spec in enumerate(m.adapter_specs):
        if wanted is not None and spec.name not in wanted:
            continue
        try:
            info = engine.update_adapter(spec.name, adapter_factors(m, i), alpha=spec.alpha, add=True)
        except ConfigError as e:  # non-finite weights: the engine keeps serving the last version
            log.warning("adapter %s was not published to the engine: %s", spec.name, e)
            continue
        versions[spec.name] = info.version
    return versions


class PublishToEngine(L.Callback):
    """After each validation during ``fit`` (on global rank 0), push every adapter's current
    weights into ``engine`` (an ``Engine`` or ``EngineClient`` over the same base), so a live
    endpoint serves the newest weights while training goes on: an RL or evaluation loop in the
    same process samples from them without exporting files. ``adapters``: names to publish
    (default all). ``versions``: each publish's name -> engine version, in order."""

    def __init__(self, engine: Any, adapters: Iterable[str] | None = None) -> None:
        self.engine = engine
        self.adapters = None if adapters is None else list(adapters)
        self.versions: list[dict[str, int]] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: Module) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero or trainer.state.fn != "fit":
            return
        self.versions.append(publish_adapters(pl_module, self.engine, self.adapters))
