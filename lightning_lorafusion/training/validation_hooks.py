"""Validation and test inside Lightning: the packed forward without dropout or gradients,
token-weighted losses per adapter, greedy samples, and the verdicts after each validation during
fit (best weights, early stopping, quarantine). Functions over the training module's state."""

from __future__ import annotations

import json
import logging
import math
import os

import torch
from lightning import LightningModule as Module

from ..data.microbatch import IGNORE_INDEX, Microbatch
from .evaluation import EARLY_STOPPED, judge_validation
from .nonfinite_guard import host_copy, named_params, quarantine, stop_adapter, sync_host_copies

log = logging.getLogger(__name__)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 80.0))


def start_accumulation(m: Module) -> None:
    n = len(m.adapter_specs)
    m._val_sums = torch.zeros(n, dtype=torch.float64, device=m.device)
    m._val_tokens = torch.zeros(n, dtype=torch.float64, device=m.device)


def accumulate(m: Module, mb: Microbatch) -> None:
    """Add each adapter's summed token loss and label tokens of ``mb`` (no dropout, no grads)."""
    n = len(m.adapter_specs)
    sums = m.loss_sums(mb, train=False)
    owner = torch.full((mb.capacity,), n, dtype=torch.long, device=mb.labels.device)
    for start, end, a in mb.segments:
        owner[start:end] = a
    counts = torch.bincount(owner[mb.labels != IGNORE_INDEX], minlength=n + 1)
    m._val_sums += sums.double()
    m._val_tokens += counts[:n].double()


def mean_losses(m: Module) -> dict[int, float]:
    """Token-weighted mean loss per adapter over the whole val (or test) set (all replicas)."""
    stats = torch.stack([m._val_sums, m._val_tokens])
    strategy = m.trainer.strategy if m._trainer is not None else None
    if strategy is not None and getattr(strategy, "world_size", 1) > 1:
        import torch.distributed as dist

        dist.all_reduce(stats, op=dist.ReduceOp.SUM)  # every replica holds a share of the val set
    sums, tokens = stats[0].tolist(), stats[1].tolist()
    return {a: sums[a] / tokens[a] for a in range(len(m.adapter_specs)) if tokens[a] > 0}


def end_validation(m: Module) -> None:
    """Log the val losses and samples; during fit, judge each adapter on them."""
    losses = mean_losses(m)
    for a, loss in losses.items():
        name = m.adapter_specs[a].name
        m.log(f"val/loss/{name}", loss, batch_size=1)
        m.log(f"val/ppl/{name}", perplexity(loss), batch_size=1)
    for key, value in generate_val_samples(m).items():
        m.log(key, value, batch_size=1, rank_zero_only=True)
    if m.trainer.state.fn == "fit":
        judge(m, losses)
        m._validated_at = data_position(m)


def end_test(m: Module) -> None:
    losses = mean_losses(m)
    m.test_losses = losses
    for a, loss in losses.items():
        name = m.adapter_specs[a].name
        m.log(f"test/loss/{name}", loss, batch_size=1)
        m.log(f"test/ppl/{name}", perplexity(loss), batch_size=1)
    if m.trainer.is_global_zero:
        log.info("%s", test_summary(m, losses))


def test_summary(m: Module, losses: dict[int, float]) -> str:
    """A table: per adapter, its test samples, token-weighted mean test loss and perplexity."""
    dm = m.trainer.datamodule if m._trainer is not None else None
    counts = getattr(dm, "test_datasets", None) or []
    rows = ["| adapter | test samples | test loss | test ppl |", "|---|---|---|---|"]
    for a, spec in enumerate(m.adapter_specs):
        n = len(counts[a]) if a < len(counts) else 0
        loss = losses.get(a)
        shown = ("-", "-") if loss is None else (f"{loss:.4f}", f"{perplexity(loss):.2f}")
        rows.append(f"| {spec.name} | {n} | {shown[0]} | {shown[1]} |")
    return "adapters on their test data:\n" + "\n".join(rows)


def generate_val_samples(m: Module) -> dict[str, float]:
    """Greedy generations for each adapter's first ``val_samples`` val prompts (rank 0),
    appended to ``samples.jsonl`` and logged as a W&B table; returns the task metrics."""
    from .val_samples import greedy_generate, split_prompt

    dm = m.trainer.datamodule
    fitting = m.trainer.state.fn == "fit"
    wanted = [a for a, spec in enumerate(m.adapter_specs)
              if spec.val_samples and (m.progress[a].training or not fitting)]
    if not wanted or not m.trainer.is_global_zero or dm is None or not getattr(dm, "val_datasets", None):
        return {}
    prompts = [split_prompt(a, s) for a in wanted for s in dm.val_datasets[a][: m.adapter_specs[a].val_samples]]
    generated = greedy_generate(
        m.base_params(), m.bank, m.config, prompts, max_new_tokens=m.sample_max_new_tokens,
        eos_token_id=getattr(m.tokenizer, "eos_token_id", None), backend=m.backend,
    )

    def text(ids) -> str:  # a random-weight base has no tokenizer: token ids then
        if m.tokenizer is None:
            return " ".join(str(int(t)) for t in ids)
        return m.tokenizer.decode(list(ids), skip_special_tokens=True)

    rows = [{"step": m.global_step, "adapter": m.adapter_specs[p.adapter].name,
             "adapter_step": m.steps_taken[p.adapter], "prompt": text(p.prompt),
             "generated": text(g), "reference": text(p.reference)} for p, g in zip(prompts, generated)]
    metrics: dict[str, float] = {}
    for a in wanted:
        mine = [r for r in rows if r["adapter"] == m.adapter_specs[a].name]
        m._last_samples[a] = mine[0]["generated"]
        if m.adapter_specs[a].metric == "rouge":
            from .val_samples import rouge_scores

            for key, value in rouge_scores([r["generated"] for r in mine], [r["reference"] for r in mine]).items():
                metrics[f"val/{key}/{m.adapter_specs[a].name}"] = value
    _write_samples(m, rows)
    return metrics


def _write_samples(m: Module, rows: list[dict]) -> None:
    os.makedirs(m.trainer.default_root_dir, exist_ok=True)
    with open(os.path.join(m.trainer.default_root_dir, "samples.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    from lightning.pytorch.loggers import WandbLogger

    for logger in m.loggers:
        if isinstance(logger, WandbLogger):
            columns = list(rows[0])
            logger.log_table(key="val/samples", columns=columns, data=[[r[c] for c in columns] for r in rows],
                             step=m.global_step)


def data_position(m: Module) -> tuple[int, int] | None:
    dm = m.trainer.datamodule if m._trainer is not None else None
    return (dm.epoch, dm.position) if dm is not None and hasattr(dm, "position") else None


def validation_pending(m: Module) -> bool:
    """Lightning validates after a batch's ``on_train_batch_end``, where ModelCheckpoint saves,
    and skips that validation when resuming from such a checkpoint: say so in it."""
    loop = m.trainer.fit_loop
    try:
        due = loop.epoch_loop._should_check_val_fx(loop._data_fetcher)
    except Exception:  # not inside a training epoch
        return False
    return bool(due) and m._validated_at != data_position(m)


def judge(m: Module, losses: dict[int, float]) -> None:
    """Best weights, early stopping and quarantine after a validation during fit."""
    for a, loss in losses.items():
        spec, progress, step = m.adapter_specs[a], m.progress[a], m.steps_taken[a]
        if not progress.training:
            continue
        best = progress.best_val_loss
        verdict = judge_validation(progress, loss, spec=spec, step=step)
        if verdict == "best":
            m._best_weights[a] = host_copy(named_params(m, a), m._best_weights.get(a))
            sync_host_copies(m)
        elif verdict == "early_stop":
            stop_adapter(m, a, EARLY_STOPPED, (
                f"val loss did not improve by more than {spec.early_stopping['min_delta']} for "
                f"{progress.evals_since_best} validations (best {best:.4f} at step {progress.best_step})"))
            log.info("adapter %s: early stopped at step %d (best val loss %.4f at step %d)",
                     spec.name, step, best, progress.best_step)
        elif verdict == "quarantine":
            why = (f"val loss {loss:.4g} is not finite" if not math.isfinite(loss) else
                   f"val loss {loss:.4g} exceeds val_explode_factor={spec.val_explode_factor} x its "
                   f"best {best:.4g} (step {progress.best_step})")
            quarantine(m, a, why)


def validate_now(m: Module) -> None:
    """One validation pass outside Lightning's loop (``validate_before_training``, or the one
    a resumed run would skip): the same accumulation, logged to every logger."""
    dm = m.trainer.datamodule
    if dm is None or not getattr(dm, "has_validation", False):
        return
    precision = m.trainer.precision_plugin
    start_accumulation(m)
    with torch.no_grad(), precision.forward_context():
        for i, mb in enumerate(dm.iter_val_microbatches()):
            m.validation_step(mb.to(m.device), i)
    losses = mean_losses(m)
    with torch.no_grad(), precision.forward_context():
        metrics = generate_val_samples(m)
    for a, loss in losses.items():
        name = m.adapter_specs[a].name
        metrics[f"val/loss/{name}"] = loss
        metrics[f"val/ppl/{name}"] = perplexity(loss)
        log.info("adapter %s: val loss before training %.4f", name, loss)
    if m.trainer.is_global_zero:
        for logger in m.loggers:
            logger.log_metrics(metrics, step=m.global_step)
    judge(m, losses)
    m._validated_at = data_position(m)
