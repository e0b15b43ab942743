"""Each adapter's optimizer step and the guard around it: non-finite losses, gradients or weights
skip the step or quarantine the adapter (its last good weights back in the bank), and stopped
adapters leave the plan while the others train on. Functions over the training module's state."""

from __future__ import annotations

import logging
import math
import time
from typing import Sequence

import torch
from lightning import LightningModule as Module

from .evaluation import QUARANTINED

log = logging.getLogger(__name__)


def _drop_global_batch(m: Module, a: int) -> None:
    m._gb_loss[a] = 0.0
    m._gb_tokens[a] = 0


def step_adapter(m: Module, a: int, params: Sequence[torch.nn.Parameter] | None = None,
                 log_loss: bool = True) -> None:
    """Clip, check and step adapter ``a``'s optimizer and schedule (its global batch is
    complete). A non-finite loss or gradient skips the step; too many in a row quarantine.
    With ``m._step_phases`` a list (the pipeline strategy's ``action_trace``), a good step
    appends its host seconds per phase: queueing the norm and the weights' copy, waiting for
    the device read, the optimizer, the weights' check, the rest (zeroing, schedule, logs)."""
    phases = getattr(m, "_step_phases", None)
    marks = [time.perf_counter()] if phases is not None else None
    spec = m.adapter_specs[a]
    optimizers = m.optimizers()
    schedulers = m.lr_schedulers()
    opt = optimizers[a] if isinstance(optimizers, list) else optimizers
    sched = schedulers[a] if isinstance(schedulers, list) else schedulers
    params = m.bank.parameters_of(a) if params is None else params
    if not m.progress[a].training:  # stopped: samples still in flight change nothing
        opt.zero_grad(set_to_none=True)
        _drop_global_batch(m, a)
        return
    grads = [p.grad for p in params if p.grad is not None]
    # Everything up to the one device->host read below is queued while the device still runs
    # the backward: the gradient norm as a few multi-tensor launches, and a copy of the weights
    # as they are into spare host buffers (kept as the last good weights only if the check
    # passes). After the read the device waits for the host.
    norm = (torch.nn.utils.get_total_norm([g.float() for g in grads], foreach=True) if grads
            else torch.tensor(0.0))
    copy = host_copy(named_params(m, a, params), m._spare_weights.pop(a, None))
    _mark(marks)
    loss, norm_value = _read_loss_and_norm(m._gb_loss, a, norm)
    _mark(marks)
    if not (math.isfinite(loss) and math.isfinite(norm_value)):
        m._spare_weights[a] = copy
        _skip_nonfinite_step(m, a, opt, loss, norm_value)
        return
    m._nonfinite_streak[a] = 0
    keep_last_good(m, a, params, copy)
    if m.grad_clip and m.grad_clip > 0:
        scale = min(1.0, m.grad_clip / (norm_value + 1e-6))
        if scale < 1.0:
            for g in grads:
                g.mul_(scale)
    opt.step()
    _mark(marks)
    # a finite gradient can still step to non-finite weights (an overflowing lr): those
    # weights would poison every later step, so the adapter is quarantined at once
    finite = all_finite(params)
    _mark(marks)
    if not finite:
        opt.zero_grad(set_to_none=True)
        _drop_global_batch(m, a)
        quarantine(m, a, f"its weights became non-finite in optimizer step {m.steps_taken[a] + 1}; "
                         f"lower its lr ({spec.lr})")
        return
    opt.zero_grad(set_to_none=m._graphs is None)  # graphs keep their .grad tensors
    sched.step()
    m.steps_taken[a] += 1
    name = spec.name
    if log_loss:
        m.log(f"loss/{name}", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=1)
        m.log(f"tokens/{name}", float(m._gb_tokens[a]), on_step=True, on_epoch=False, batch_size=1)
    m.log(f"lr/{name}", sched.get_last_lr()[0], on_step=True, on_epoch=False, batch_size=1)
    m.log(f"grad_norm/{name}", norm_value, on_step=True, on_epoch=False, batch_size=1)
    _drop_global_batch(m, a)
    if marks is not None:
        _mark(marks)
        phases.append([t1 - t0 for t0, t1 in zip(marks, marks[1:])])


def _mark(marks: list[float] | None) -> None:
    if marks is not None:
        marks.append(time.perf_counter())


def _read_loss_and_norm(gb_loss, a: int, norm: torch.Tensor) -> tuple[float, float]:
    """Adapter ``a``'s global-batch loss and its gradient norm as floats, in one device->host
    read when both are on one device."""
    if torch.is_tensor(gb_loss) and gb_loss.device == norm.device:
        loss, value = torch.stack([gb_loss[a].double(), norm.double()]).tolist()
        return loss, value
    return float(gb_loss[a]), float(norm)


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite. One total norm first (a few foreach
    launches and one sync, where a check per tensor launches two kernels each: this runs at every
    step, between the step's device sync and the next microbatch); only when that norm is not
    finite (a NaN or inf, or finite values too large to square) each tensor is checked exactly."""
    tensors = list(tensors)
    if not tensors:
        return True
    with torch.no_grad():
        if bool(torch.isfinite(torch.nn.utils.get_total_norm(tensors, foreach=True))):
            return True
        return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def _skip_nonfinite_step(m: Module, a: int, opt, loss: float, norm: float) -> None:
    spec = m.adapter_specs[a]
    m._nonfinite_streak[a] += 1
    log.warning(
        "adapter %s: non-finite loss/gradients at step %d (loss=%s, grad norm=%s); step "
        "skipped (%d in a row)", spec.name, m.steps_taken[a], loss, norm, m._nonfinite_streak[a],
    )
    opt.zero_grad(set_to_none=True)
    _drop_global_batch(m, a)
    limit = spec.max_bad_steps or m.max_nonfinite_steps
    if m._nonfinite_streak[a] >= limit:
        quarantine(m, a, f"non-finite loss or gradients in {m._nonfinite_streak[a]} "
                         f"consecutive global batches; lower its lr ({spec.lr}) or check its data")


def named_params(m: Module, a: int,
                 params: Sequence[torch.nn.Parameter] | None = None) -> dict[str, torch.nn.Parameter]:
    """Adapter ``a``'s parameters by bank name (only ``params`` if given: a pipeline stage's)."""
    if a not in m._adapter_params:  # the bank's parameters keep their identity (in-place moves)
        prefix = f"adapters.{a}."
        m._adapter_params[a] = {n: p for n, p in m.bank.named_parameters() if n.startswith(prefix)}
    named = m._adapter_params[a]
    if params is None:
        return named
    wanted = {id(p) for p in params}
    return {n: p for n, p in named.items() if id(p) in wanted}


def host_copy(named: dict[str, torch.Tensor], into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Copy tensors to host memory (into existing buffers when given: no allocation; pinned
    and asynchronous from CUDA, ordered before the optimizer step that follows on the stream)."""
    out = {}
    for n, p in named.items():
        buf = (into or {}).get(n)
        if buf is None or buf.shape != p.shape or buf.dtype != p.dtype:
            buf = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=p.is_cuda)
        buf.copy_(p.detach(), non_blocking=p.is_cuda)
        out[n] = buf
    return out


def sync_host_copies(m: Module) -> None:
    if m.device.type == "cuda":
        torch.cuda.synchronize(m.device)


def keep_last_good(m: Module, a: int, params: Sequence[torch.nn.Parameter],
                   copy: dict[str, torch.Tensor] | None = None) -> None:
    """Before a good step: these weights gave a finite loss and gradient norm. ``copy``: their
    host copy made already (the replaced copy's buffers become the spare for the next one)."""
    old = m._last_good.get(a)
    if copy is None:
        copy = host_copy(named_params(m, a, params), old and old[1])
    elif old is not None:
        m._spare_weights[a] = old[1]
    m._last_good[a] = (m.steps_taken[a], copy)


def load_weights(m: Module, a: int, weights: dict[str, torch.Tensor]) -> None:
    sync_host_copies(m)
    named = named_params(m, a)
    with torch.no_grad():
        for n, t in weights.items():
            named[n].copy_(t)


def nonfinite_weights(m: Module, a: int) -> str | None:
    """The name of a parameter of adapter ``a`` holding NaN/inf (None when all are finite)."""
    for name, p in named_params(m, a).items():
        if not bool(torch.isfinite(p.detach()).all()):
            return name
    return None


def stop_adapter(m: Module, a: int, status: str, why: str) -> None:
    """Adapter ``a`` trains no more: its partial global batch is dropped and it leaves the plan."""
    progress = m.progress[a]
    if not progress.training:
        return
    progress.status, progress.stopped_step, progress.message = status, m.steps_taken[a], why
    for p in m.bank.parameters_of(a):
        p.grad = None
    _drop_global_batch(m, a)
    dm = m.trainer.datamodule if m._trainer is not None else None
    if dm is not None and hasattr(dm, "exclude_adapters"):
        dm.exclude_adapters([a])
    if m._trainer is not None and not any(p.training for p in m.progress):
        log.warning("every adapter has stopped training: ending the run")
        m.trainer.should_stop = True


def quarantine(m: Module, a: int, why: str) -> None:
    """Stop adapter ``a`` for good and put its last good weights back in the bank."""
    spec = m.adapter_specs[a]
    step = m.steps_taken[a]
    if a in m._last_good:
        good_step, weights = m._last_good[a]
        load_weights(m, a, weights)
        kept = f"its last good weights (after step {good_step})"
    else:
        kept = "its weights as they are"
    if m.progress[a].best_step is not None:
        kept += f"; its best-val weights (step {m.progress[a].best_step}) are the exported adapter"
    stop_adapter(m, a, QUARANTINED, why)
    log.error("adapter %s quarantined at step %d: %s. It stops training and keeps %s; the other "
              "adapters train on as if it were not there.", spec.name, step, why, kept)


def agree_on_quarantine(m: Module, strategy) -> None:
    """Stages judge non-finite gradients on their own layers: after a window every rank
    quarantines what any rank did, so all plan the next epoch alike."""
    import torch.distributed as dist

    flags = torch.tensor([p.status == QUARANTINED for p in m.progress], dtype=torch.float64,
                         device=strategy.root_device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    for a, flag in enumerate(flags.tolist()):
        if flag and m.progress[a].status != QUARANTINED:
            quarantine(m, a, "quarantined on another pipeline stage or replica (non-finite gradients there)")
