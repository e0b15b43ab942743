"""What the training module adds to Lightning's checkpoints and checks when it loads one: the
partial global batches (gradients, losses), each adapter's progress and kept weights, a pipeline
stage's own layers only, and the end-of-training ``last`` checkpoint. Functions over the
training module's state."""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning import LightningModule as Module
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from ..specs import ConfigError
from .checkpoint_io import AtomicCheckpointIO, remove_stale_temporaries
from .evaluation import AdapterProgress
from .frozen_base import bank_layer
from .nonfinite_guard import sync_host_copies
from .resume_check import check_checkpoint_config
from .validation_hooks import validation_pending

log = logging.getLogger(__name__)


def _holds_other_stages(m: Module) -> bool:
    strategy = m._pipeline_strategy()
    return strategy is not None and strategy.layout.pipeline_size > 1


def save_state(m: Module, checkpoint: dict[str, Any]) -> None:
    """Partial global batches live in .grad: keep them in the checkpoint so resume is exact."""
    sync_host_copies(m)  # the host copies below may still be in flight from the device
    checkpoint["lorafusion"] = {
        "grads": {n: p.grad.detach().cpu().clone() for n, p in m.bank.named_parameters() if p.grad is not None},
        "gb_loss": m._gb_loss.cpu(),
        "gb_tokens": m._gb_tokens.clone(),
        "steps_taken": list(m.steps_taken),
        "nonfinite_streak": list(m._nonfinite_streak),
        "adapter_names": [s.name for s in m.adapter_specs],
        "progress": [p.to_dict() for p in m.progress],
        "best_weights": {a: {n: t.clone() for n, t in w.items()} for a, w in m._best_weights.items()},
        "last_good": {a: (step, {n: t.clone() for n, t in w.items()}) for a, (step, w) in m._last_good.items()},
        "validation_pending": validation_pending(m) if m._trainer is not None else False,
    }
    if _holds_other_stages(m):
        # a stage trains only its own layers' adapters; the bank's other layers are untouched
        # copies here, so its file keeps its own (a 70B bank is 4x smaller per stage file)
        owned = set(m._stage_layers)
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items()
                                    if bank_layer(k) is None or bank_layer(k) in owned}


def load_state(m: Module, checkpoint: dict[str, Any]) -> None:
    """Check the checkpoint against this run's config, then restore the module's own state."""
    if _holds_other_stages(m) and "state_dict" in checkpoint:
        # this stage's file lacks the other stages' adapter layers: keep ours for those
        owned = set(m._stage_layers)
        for key, value in m.state_dict().items():
            if bank_layer(key) is not None and bank_layer(key) not in owned:
                checkpoint["state_dict"].setdefault(key, value)
    stage = m.trainer.state.fn if m._trainer is not None else "fit"
    stage = str(getattr(stage, "value", stage))
    check_checkpoint_config(checkpoint.get("hyper_parameters"), dict(m.hparams), model_class=type(m),
                            stage=stage, log_changes=stage == "fit")
    state = checkpoint.get("lorafusion")
    if state is None:
        return
    names = [s.name for s in m.adapter_specs]
    if state["adapter_names"] != names:
        raise ConfigError(f"checkpoint holds adapters {state['adapter_names']} but the config lists {names}")
    check_checkpoint_shapes(m, checkpoint.get("state_dict", {}))
    # Trainer._run_stage zeroes all grads after restoring; re-applied in on_train_start.
    m._restored_grads = state["grads"]
    m._gb_loss = state["gb_loss"].clone()
    m._gb_tokens = state["gb_tokens"].clone()
    m.steps_taken = list(state["steps_taken"])
    m._nonfinite_streak = list(state["nonfinite_streak"])
    if "progress" in state:
        m.progress = [AdapterProgress.from_dict(d) for d in state["progress"]]
        m._best_weights = {int(a): dict(w) for a, w in state["best_weights"].items()}
        m._last_good = {int(a): (int(step), dict(w)) for a, (step, w) in state["last_good"].items()}
        m._val_due_on_resume = bool(state.get("validation_pending", False))


def check_checkpoint_shapes(m: Module, saved: dict[str, torch.Tensor]) -> None:
    """Name the adapter whose rank or targets changed, before a strict load fails on it."""
    own = m.state_dict()
    for key, tensor in saved.items():
        if key in own and tuple(tensor.shape) != tuple(own[key].shape):
            # bank keys: bank.adapters.<adapter>.<layer>.<module>.lora_A|lora_B
            parts = key.split(".")
            where = key
            if parts[:2] == ["bank", "adapters"] and parts[2].isdigit():
                where = f"adapter {m.adapter_specs[int(parts[2])].name!r} {'.'.join(parts[3:])}"
            raise ConfigError(
                f"checkpoint does not match the config: {where} has shape "
                f"{tuple(tensor.shape)} in the checkpoint but {tuple(own[key].shape)} in this run "
                "(rank changed?); resume with the adapter settings it was saved with"
            )


def restore_grads(m: Module) -> None:
    """Put back the partial global batches' gradients a resumed checkpoint held."""
    grads = getattr(m, "_restored_grads", None)
    if grads:
        params = dict(m.bank.named_parameters())
        for n, g in grads.items():
            params[n].grad = g.to(params[n].device, params[n].dtype)
    m._restored_grads = None


def remove_stale_checkpoint_temporaries(m: Module) -> None:
    for callback in m.trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            remove_stale_temporaries(callback.dirpath)


def save_end_of_training(m: Module) -> None:
    """Checkpoint the end of training into every checkpoint callback's directory as its
    ``last`` checkpoint, unless the last one it saved already holds this step."""
    trainer = m.trainer
    saved = set()
    metrics = {**trainer.callback_metrics, "epoch": trainer.current_epoch, "step": trainer.global_step}
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or callback.dirpath is None:
            continue
        if getattr(callback, "_last_global_step_saved", None) == trainer.global_step:
            continue
        path = callback.format_checkpoint_name(metrics, callback.CHECKPOINT_NAME_LAST)
        if path in saved:
            continue
        saved.add(path)
        trainer.save_checkpoint(path)
        log.info("end of training: checkpoint %s (global step %d)", path, trainer.global_step)


def use_atomic_checkpoint_io(m: Module) -> None:
    """Checkpoints are written beside their target and renamed into place."""
    strategy = m.trainer.strategy
    if type(strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default, not a user's
        strategy.checkpoint_io = AtomicCheckpointIO()
