"""The end of fit: every adapter written as a PEFT directory (its best-val weights, its final
ones beside them), with the table of how each adapter ended. Functions over the training
module's state."""

from __future__ import annotations

import logging
import os

from lightning import LightningModule as Module

from ..model.peft_io import check_export_target, export_peft_adapter
from .evaluation import EARLY_STOPPED, QUARANTINED, final_status, trainer_state_json
from .frozen_base import bank_layer
from .nonfinite_guard import host_copy, load_weights, named_params, nonfinite_weights, quarantine, sync_host_copies

log = logging.getLogger(__name__)


def export_root(m: Module) -> str:
    return m.export_dir or os.path.join(m.trainer.default_root_dir, "adapters")


def check_export_targets(m: Module, out_dir: str | None = None) -> None:
    """``ConfigError`` now, before training, if an export would have to replace a directory
    holding files it did not write (``peft_io.check_export_target``)."""
    root = out_dir or export_root(m)
    for spec in m.adapter_specs:
        check_export_target(os.path.join(root, spec.name))


def export_adapters(m: Module, out_dir: str | None = None) -> list[str]:
    """One PEFT directory per adapter (``LoRAFusionModule.export_adapters``); their paths."""
    root = out_dir or export_root(m)
    check_export_targets(m, root)
    paths = []
    sync_host_copies(m)
    for i, spec in enumerate(m.adapter_specs):
        bad = nonfinite_weights(m, i)
        if bad is not None and m.progress[i].status != QUARANTINED:
            quarantine(m, i, f"its weights are not finite at the end of training ({bad})")
        path = os.path.join(root, spec.name)
        try:
            _export_one(m, i, path)
        except FloatingPointError as error:
            log.error("adapter %s not exported: %s", spec.name, error)
            continue
        paths.append(path)
    log.info("exported %d PEFT adapters to %s", len(paths), root)
    return paths


def _export_one(m: Module, i: int, path: str) -> None:
    spec, progress, steps = m.adapter_specs[i], m.progress[i], m.steps_taken[i]
    quarantined = progress.status == QUARANTINED
    last_step = m._last_good[i][0] if quarantined and i in m._last_good else steps
    last_kind = "last_good" if quarantined else "last"
    reason = {QUARANTINED: "quarantined", EARLY_STOPPED: "early_stopped"}.get(progress.status)

    def export(where: str, *, weights: str, why: str, step: int | None) -> None:
        state = trainer_state_json(adapter=spec.name, weights=weights, reason=why, step=step,
                                   progress=progress, steps_taken=steps)
        export_peft_adapter(m.bank, i, where, base_model_name_or_path=m.base_model_dir,
                            extra_files={"trainer_state.json": state})

    if i in m._best_weights:
        current = host_copy(named_params(m, i))
        load_weights(m, i, m._best_weights[i])
        try:
            export(path, weights="best", why=reason or "best", step=progress.best_step)
        finally:
            load_weights(m, i, current)
        export(os.path.join(path, "last"), weights=last_kind, why=reason or "last", step=last_step)
    else:
        export(path, weights=last_kind, why=reason or "last", step=last_step)


def export_at_fit_end(m: Module) -> None:
    """Gather the pipeline stages' layers on rank 0, export there, and fail the run when every
    adapter was quarantined (their last good weights are exported first)."""
    strategy = m._pipeline_strategy()
    if strategy is not None:  # every stage trained its own layers: gather on rank 0
        owned = set(m._stage_layers)
        merged = strategy.gather_stage_states(m.bank.state_dict(prefix="bank."), lambda key: bank_layer(key) in owned)
        if merged is None:
            return
        m.bank.load_state_dict({k[len("bank."):]: v for k, v in merged.items()})
    if m.trainer.is_global_zero:
        export_adapters(m)
        log.info("%s", summary(m))
    if all(p.status == QUARANTINED for p in m.progress):
        raise FloatingPointError(
            "every adapter was quarantined (diverged): "
            + "; ".join(f"{s.name}: {p.message}" for s, p in zip(m.adapter_specs, m.progress))
            + ". Their last good weights were exported."
        )


def summary(m: Module) -> str:
    """A table: per adapter, status, steps, val loss at step 0 / best / last."""
    rows = ["| adapter | status | steps | val loss step 0 | best val loss (step) | last val loss (step) | sample |",
            "|---|---|---|---|---|---|---|"]
    for a, spec in enumerate(m.adapter_specs):
        p = m.progress[a]
        first = next((f"{v:.4f}" for s, v in p.val_history if s == 0), "-")
        best = f"{p.best_val_loss:.4f} ({p.best_step})" if p.best_step is not None else "-"
        last = f"{p.val_history[-1][1]:.4f} ({p.val_history[-1][0]})" if p.val_history else "-"
        sample = " ".join(m._last_samples.get(a, "-").split())[:80].replace("|", "/")
        rows.append(f"| {spec.name} | {final_status(p)} | {m.steps_taken[a]} | {first} | {best} | {last} | {sample} |")
    return "adapters at the end of fit:\n" + "\n".join(rows)
