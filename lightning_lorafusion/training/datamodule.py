"""LightningDataModule: per-adapter datasets -> global batches -> planned, packed microbatches.

One Lightning epoch is one pass over every adapter's dataset. Each adapter's samples are
shuffled with its own seed, cut into its own global batches, planned together into
fixed-capacity microbatches (``lightning_lorafusion.planner``) and streamed through a
torchdata node graph that packs tensors in a background thread. The position in the
stream is part of the checkpoint, so a resumed run continues at the exact microbatch.
Validation samples (an adapter's ``val_dataset`` or held-out ``val_fraction``) are planned
and packed the same way, every adapter together, into the validation loader. Adapters that
stop (early stopping, quarantine) are left out of planning from the next planning window.

Beside this file: ``adapter_datasets`` (reading, hold-out, length checks), ``epoch_planning``
(the planner over an epoch, restored plans, replica shares), ``microbatch_stream`` (the
loaders Lightning iterates) and ``capacity`` (``capacity: auto``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Iterator, Sequence

import lightning as L
import numpy as np

from ..data.microbatch import Microbatch
from ..data.packing import PackingConfig, SampleLookup, pack_microbatch
from ..parallel.replica_shards import REPLICA_CAPACITY_LEVELS, replica_microbatch
from ..parallel.strategy import MultiAdapterPipelineStrategy
from ..planner.plan import Plan
from ..planner.verify import carry_state
from ..specs import AdapterSpec, ConfigError
from .adapter_datasets import check_lengths, holdout_indices, load_test, load_train_and_val
from .capacity import DEFAULT_CANDIDATES, profile_capacity
from .epoch_planning import (
    EpochPlan,
    PlanningConfig,
    check_restored_plan,
    deal_replica_shards,
    epoch_needs,
    level_capacities,
    log_packed_levels,
    plan_fill,
    plan_needs,
    plan_windows,
    replica_shards,
    run_capacity_levels,
    window_starts,
)
from .microbatch_stream import PipelineWindow, Sealed, ValLoader, train_loader

__all__ = ["EPOCH_STRIDE", "EpochPlan", "MultiAdapterDataModule", "PlanningConfig", "PipelineWindow", "holdout_indices",
           "plan_fill", "window_starts"]

log = logging.getLogger(__name__)

_PLAN_LOCK = threading.RLock()  # module-level: the data module itself must stay picklable (spawn)

# Microbatch.index = epoch * EPOCH_STRIDE + position: unique per run, feeds dropout offsets.
EPOCH_STRIDE = 1_000_000


class MultiAdapterDataModule(L.LightningDataModule):
    """Streams packed multi-adapter microbatches; adapters and tokenizer come from the module.

    Args:
        capacity: tokens per microbatch (the fixed tensor length), or ``"auto"``: profile
            ``capacity_candidates`` on the training device when fit starts and take the one
            with the most real tokens per second that fits in memory
            (``lightning_lorafusion.training.capacity``).
        capacity_candidates: capacities ``"auto"`` tries (default 1024 ... 16384); those below
            the longest (padded) sample are skipped.
        capacity_memory_fraction: ``"auto"`` rejects capacities whose measured peak memory
            exceeds this fraction of the device's memory (CUDA).
        pad_multiple: each adapter's segment is padded to this multiple (the kernel block M).
        planner: how epochs are planned (``PlanningConfig``: ``method``, ``time_limit``,
            ``window``, ``workers``).
        num_stages: pipeline depth the plan must respect (set by the pipeline strategy).
        max_length: samples are truncated to this many tokens by the tokenizer step
            (default: capacity); a longer sample than capacity is an error before training.
        prefetch: microbatches packed ahead of the training step.
        replica_capacity_levels: without a pipeline (one process, or data-parallel replicas), a
            run's microbatches are packed at up to this many capacities (multiples of
            ``capacity / 16``, ``capacity`` among them, chosen once), each position at the
            smallest holding its tokens (with replicas: its longest replica share,
            ``parallel.replica_shards``), so a microbatch the planner left part empty does not
            compute its empty tail; 0: every microbatch at ``capacity``. Each capacity compiles
            and captures once.
    """

    def __init__(
        self,
        *,
        capacity: int | str = 1024,
        capacity_candidates: list[int] | None = None,
        capacity_memory_fraction: float = 0.9,
        pad_multiple: int = 16,
        planner: PlanningConfig = PlanningConfig(),
        num_stages: int = 1,
        max_length: int | None = None,
        prefetch: int = 4,
        seed: int = 0,
        replica_capacity_levels: int = REPLICA_CAPACITY_LEVELS,
    ) -> None:
        super().__init__()
        if (isinstance(replica_capacity_levels, bool) or not isinstance(replica_capacity_levels, int)
                or replica_capacity_levels < 0):
            raise ConfigError(f"data.replica_capacity_levels={replica_capacity_levels!r} must be an int >= 0 "
                              "(0: every microbatch at data.capacity)")
        self.replica_capacity_levels = replica_capacity_levels
        # the capacities this run packs microbatches at without a pipeline (chosen once, checkpointed)
        self._capacity_levels: tuple[int, ...] | None = None
        self._shape_plans: dict[int, Plan] = {}  # epochs planned ahead to choose those levels
        planner = PlanningConfig.parse(planner)
        if isinstance(capacity, str) and capacity != "auto":
            raise ConfigError(f"data.capacity={capacity!r}; give a number of tokens or 'auto'")
        self.capacity_pending = capacity == "auto"
        self.capacity_candidates = sorted(set(capacity_candidates or DEFAULT_CANDIDATES))
        if self.capacity_pending and any(c % pad_multiple for c in self.capacity_candidates):
            raise ConfigError(
                f"data.capacity_candidates={self.capacity_candidates} must be multiples of "
                f"data.pad_multiple={pad_multiple}"
            )
        if not 0 < capacity_memory_fraction <= 1:
            raise ConfigError(f"data.capacity_memory_fraction={capacity_memory_fraction} must be in (0, 1]")
        self.capacity_memory_fraction = capacity_memory_fraction
        self._restored_capacity: int | None = None
        # until "auto" is resolved, the largest candidate bounds sample lengths
        initial = max(self.capacity_candidates) if self.capacity_pending else int(capacity)
        self.packing = PackingConfig(capacity=initial, pad_multiple=pad_multiple)
        self.planner = planner
        self.num_stages = num_stages
        self._restored_plan: tuple[int, Plan] | None = None
        self.pipeline = False  # set when the trainer runs MultiAdapterPipelineStrategy
        # Under data parallelism (that strategy with several replicas) every replica streams its
        # own share of each global batch, through one plan shape (parallel.replica_shards).
        self.data_parallel_size = 1
        self.replica = 0
        self.max_length = max_length
        self.prefetch = prefetch
        self.seed = seed
        self.specs: tuple[AdapterSpec, ...] = ()
        self.datasets: list[Sequence] = []
        self.tokenizer: Any = None
        self.vocab_size: int | None = None
        self.epoch = 0  # next epoch to stream
        self.position = 0  # next microbatch position inside that epoch
        # the last two epochs' plans: at an epoch boundary (and on resume) the finished epoch's
        # plan (is anything left?) and the next one's are both asked for, alternately
        self._plans: dict[int, EpochPlan] = {}
        self.val_datasets: list[Sequence] = []  # per adapter ([] without validation data)
        self.excluded: frozenset[int] = frozenset()  # adapters no longer planned (stopped)
        self._streamed: dict[int, int] = {}  # epoch -> last position the stream has begun packing
        self._val_plans: dict[tuple[str, tuple[int, ...]], tuple[Plan, SampleLookup]] = {}
        self.test_datasets: list[Sequence] = []  # per adapter, for `test` ([] without test data)

    # ----------------------------------------------------------------- setup
    def setup(self, stage: str | None = None) -> None:
        if self.trainer is not None:
            self._adopt_pipeline_layout()
        module = self.trainer.lightning_module if self.trainer is not None else None
        if not self.specs:
            if module is None:
                raise RuntimeError("attach adapters with configure(specs, tokenizer) before setup")
            self.configure(module.adapter_specs, module.tokenizer,
                           vocab_size=getattr(getattr(module, "config", None), "vocab_size", None))
        if stage == "test":  # only the test data: nothing trains or validates
            if not self.test_datasets:
                self.load_test_datasets()
            return
        if not self.datasets:
            self.load_datasets()

    def load_test_datasets(self) -> None:
        """Each adapter's ``test_dataset`` (``[]`` for those without one), tokenized like training
        data; ``ConfigError`` when no adapter has one."""
        self.test_datasets = load_test(self.specs, self.tokenizer, max_length=self.max_length or self.packing.capacity,
                                       packing=self.packing)

    def _adopt_pipeline_layout(self) -> None:
        strategy = self.trainer.strategy
        if not isinstance(strategy, MultiAdapterPipelineStrategy):
            return
        layout = strategy.layout
        if self.capacity_pending and layout.pipeline_size > 1:
            raise ConfigError(
                f"data.capacity=auto is not supported with pipeline_size={layout.pipeline_size} "
                "(the profiler times the whole model on one device); set data.capacity"
            )
        self.num_stages = layout.pipeline_size
        self.data_parallel_size = layout.data_parallel_size
        self.replica = strategy.replica
        self.pipeline = True
        specs = self.specs or getattr(self.trainer.lightning_module, "adapter_specs", ())
        with_val = [s.name for s in specs if s.has_validation]
        if layout.pipeline_size > 1 and with_val:
            raise ConfigError(
                f"validation (val_dataset / val_fraction of adapters {with_val}) is not supported "
                f"under the pipeline strategy with pipeline_size={layout.pipeline_size} yet; remove "
                "it, and validate the exported adapters on one device afterwards (`lightning-lorafusion "
                "validate` with adapters[].init_from set to them)"
            )

    def configure(self, specs: Sequence[AdapterSpec], tokenizer: Any, *, vocab_size: int | None = None) -> None:
        """Use these adapters and tokenizer (the LightningModule's, under Lightning).
        ``vocab_size`` (the model's) is what synthetic datasets draw token ids from when there is
        no tokenizer (a ``random:`` base) and they name no ``vocab_size`` themselves."""
        self.specs = tuple(specs)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        if self.tokenizer is not None and getattr(self.tokenizer, "pad_token_id", None) is not None:
            self.packing = PackingConfig(
                capacity=self.packing.capacity,
                pad_multiple=self.packing.pad_multiple,
                pad_token_id=int(self.tokenizer.pad_token_id),
            )

    def load_datasets(self) -> None:
        max_length = self.max_length or self.packing.capacity
        self.datasets, self.val_datasets = [], []
        for spec in self.specs:
            samples, val = load_train_and_val(spec, self.tokenizer, vocab_size=self.vocab_size, max_length=max_length)
            self.datasets.append(samples)
            self.val_datasets.append(val)
            if not self.capacity_pending:
                self._check_lengths(spec, samples)
                self._check_lengths(spec, val)
            tokens = [len(s.input_ids) for s in samples]
            log.info(
                "adapter %s: %d samples, mean %.0f tokens (max %d), %d global batches per epoch%s",
                spec.name, len(samples), float(np.mean(tokens)), max(tokens),
                self.batches_per_epoch(len(self.datasets) - 1),
                f"; {len(val)} validation samples" if val else "",
            )

    def _check_lengths(self, spec: AdapterSpec, samples: Sequence) -> None:
        check_lengths(spec, samples, self.packing)

    # ------------------------------------------------------------- schedule
    def batches_per_epoch(self, adapter: int) -> int:
        n, b = len(self.datasets[adapter]), self.specs[adapter].global_batch_size
        return -(-n // b)

    def total_steps(self, adapter: int, max_epochs: int) -> int:
        """Optimizer steps adapter will take over the run (its lr schedule's horizon)."""
        steps = self.batches_per_epoch(adapter) * max(1, max_epochs)
        limit = self.specs[adapter].max_steps
        return steps if limit is None else min(steps, limit)

    def global_batches(self, adapter: int, epoch: int) -> list[list[int]]:
        """Dataset indices of adapter's global batches in ``epoch`` (seeded shuffle, max_steps)."""
        spec = self.specs[adapter]
        n = len(self.datasets[adapter])
        rng = np.random.default_rng([self.seed, spec.seed, adapter, epoch])
        order = rng.permutation(n).tolist()
        batches = [order[i : i + spec.global_batch_size] for i in range(0, n, spec.global_batch_size)]
        if spec.max_steps is not None:
            done = epoch * len(batches)
            batches = batches[: max(0, spec.max_steps - done)]
        return batches

    def _lookup(self, epoch: int) -> SampleLookup:
        return SampleLookup(self.datasets, [self.global_batches(a, epoch) for a in range(len(self.specs))])

    def _plan(self, epoch: int, lengths, capacity: int, method: str, *, num_stages: int | None = None,
              start_window: int = 0, carry_in=None) -> Plan:
        config = self.planner.planner_config(
            capacity=capacity, pad_multiple=self.packing.pad_multiple,
            num_stages=self.num_stages if num_stages is None else num_stages, seed=self.seed + epoch, method=method)
        return plan_windows(lengths, config, window=self.planner.window, workers=self.planner.workers,
                            start_window=start_window, carry_in=carry_in)

    def _planned_lengths(self, lengths) -> list:
        """The planner's input with stopped adapters' batches left out."""
        return [[] if a in self.excluded else batches for a, batches in enumerate(lengths)]

    def plan_epoch(self, epoch: int) -> EpochPlan:
        """Plan every adapter's global batches of ``epoch`` (or reuse the checkpointed plan)."""
        if self.capacity_pending:
            raise RuntimeError("data.capacity=auto is resolved when fit starts (resolve_capacity)")
        lookup = self._lookup(epoch)
        lengths = lookup.lengths()
        denominators = lookup.denominators()  # each adapter's whole global batch, all replicas
        whole = (lookup, lengths)
        if self.data_parallel_size > 1:
            lookup, lengths = self._replica_shards(lookup, lengths)
        if self._restored_plan is not None and self._restored_plan[0] == epoch:
            plan = self._restored_plan[1]  # exactly what the interrupted run trained on
            self._check_restored_plan(plan, lengths)
        elif epoch in self._shape_plans:  # planned already, to choose the capacity levels
            plan = self._shape_plans.pop(epoch)
        else:
            plan = self._plan(epoch, self._planned_lengths(lengths), self.packing.capacity, self.planner.method)
            log.info(
                "epoch %d planned (%s): %d microbatches of %d tokens, fill %.1f%%",
                epoch, self.planner.method, len(plan.microbatches), self.packing.capacity,
                100 * plan_fill(plan, self.packing.capacity),
            )
        capacities = None
        levels = self._run_levels(epoch, whole, plan) if self.num_stages == 1 else None
        if self.data_parallel_size > 1:  # the slots dealt to the replicas, now that the plan is known
            lookup, capacities = deal_replica_shards(
                self.datasets, *whole, plan, data_parallel_size=self.data_parallel_size, replica=self.replica,
                pad_multiple=self.packing.pad_multiple, levels=levels)
        elif levels:  # one process: each position at the smallest level holding its tokens
            capacities = level_capacities(plan_needs(plan, self.packing.pad_multiple), levels, plan.capacity)
            log_packed_levels(epoch, plan, capacities)
        return EpochPlan(
            epoch=epoch,
            plan=plan,
            lookup=lookup,
            denominators=denominators,
            step_adapters=plan.step_adapters(),
            capacities=capacities,
        )

    def _run_levels(self, epoch: int, whole: tuple[SampleLookup, list], plan: Plan) -> tuple[int, ...] | None:
        """The run's capacity levels (``data.replica_capacity_levels`` of them, None when 0): chosen
        at the first epoch this process plans, from its needs and the next epoch's (planned here
        and kept for it), and kept for the whole run (and in checkpoints), so that the run compiles
        and captures a bounded set of shapes."""
        if not self.replica_capacity_levels:
            return None
        if self._capacity_levels is None:
            dp = self.data_parallel_size
            per = dict(data_parallel_size=dp, pad_multiple=self.packing.pad_multiple)
            needs = [epoch_needs(*whole, plan, **per)]
            last = getattr(self.trainer, "max_epochs", None) if self.trainer is not None else None
            if not isinstance(last, int) or last < 1 or epoch + 1 < last:
                lookup = self._lookup(epoch + 1)
                lengths = lookup.lengths()
                planned = self._replica_shards(lookup, lengths)[1] if dp > 1 else lengths
                ahead = self._plan(epoch + 1, self._planned_lengths(planned), self.packing.capacity,
                                   self.planner.method)
                self._shape_plans[epoch + 1] = ahead
                needs.append(epoch_needs(lookup, lengths, ahead, **per))
            self._capacity_levels = run_capacity_levels(needs, self.packing.capacity, self.replica_capacity_levels)
            log.info("%s without a pipeline: this run packs microbatches at capacities %s",
                     f"data parallel x{dp}" if dp > 1 else "one process", list(self._capacity_levels))
        return self._capacity_levels

    def _check_restored_plan(self, plan: Plan, lengths) -> None:
        check_restored_plan(plan, lengths, packing=self.packing, excluded=self.excluded, epoch=self.epoch)

    def _replica_shards(self, lookup: SampleLookup, lengths) -> tuple[SampleLookup, list]:
        return replica_shards(self.datasets, lookup, lengths, data_parallel_size=self.data_parallel_size,
                              replica=self.replica)

    # -------------------------------------------------------- capacity: auto
    def resolve_capacity(self, module: Any) -> int:
        """Fix ``capacity: auto`` (called by the LightningModule when fit starts, on the
        training device): reuse a checkpoint's capacity, else profile the candidates."""
        if not self.capacity_pending:
            return self.packing.capacity
        if self._restored_capacity is not None:
            chosen = self._restored_capacity
            log.info("data.capacity=auto: %d tokens, from the checkpoint", chosen)
        else:
            chosen = self._profile_capacity(module)
        strategy = self.trainer.strategy if self.trainer is not None else None
        if strategy is not None and getattr(strategy, "world_size", 1) > 1:
            chosen = int(strategy.broadcast(chosen, src=0))  # every replica plans the same shape
        self.packing = PackingConfig(
            capacity=chosen, pad_multiple=self.packing.pad_multiple, pad_token_id=self.packing.pad_token_id
        )
        self.capacity_pending = False
        for spec, samples, val in zip(self.specs, self.datasets, self.val_datasets):
            self._check_lengths(spec, samples)
            self._check_lengths(spec, val)
        return chosen

    def _profile_capacity(self, module: Any, probe_microbatches: int = 2) -> int:
        return profile_capacity(self, module, probe_microbatches)

    def epoch_plan(self, epoch: int) -> EpochPlan:
        # the loader's prefetch thread and the main thread may both ask: plan once
        with _PLAN_LOCK:
            if epoch not in self._plans:
                self._plans[epoch] = self.plan_epoch(epoch)
                for old in sorted(self._plans)[:-2]:
                    del self._plans[old]
            return self._plans[epoch]

    # ------------------------------------------------ stopping adapters
    def exclude_adapters(self, adapters: Sequence[int]) -> None:
        """Stop planning ``adapters`` (early stopped or quarantined): later epochs leave them out,
        and the epoch being streamed is re-planned from its next planning window that the stream
        has not reached (samples of theirs packed before it still arrive; the module ignores
        them). Under the pipeline strategy an epoch is one window: from the next epoch."""
        new = frozenset(adapters) - self.excluded
        if not new:
            return
        with _PLAN_LOCK:
            self.excluded = self.excluded | new
            self._shape_plans.clear()  # planned ahead with them
            for epoch in sorted(e for e in self._plans if e >= self.epoch):
                if epoch not in self._streamed:
                    del self._plans[epoch]  # planned ahead, not started: plan it again without them
                elif not self.pipeline:  # a started pipeline window keeps its plan to the end
                    self._plans[epoch] = self._replan_rest(self._plans[epoch])
        log.info("adapters %s are no longer planned", sorted(self.specs[a].name for a in new))

    def _replan_rest(self, ep: EpochPlan) -> EpochPlan:
        """``ep`` with every planning window from the first one the stream has not reached
        planned again without the excluded adapters. The cut sits a fixed distance ahead of the
        training position (further than the prefetch can run), so where it falls does not depend
        on the loader thread's timing."""
        plan = ep.plan
        earliest = self.position + self.prefetch + 4 if ep.epoch == self.epoch else 0
        earliest = max(earliest, self._streamed.get(ep.epoch, -1) + 1)
        cuts = sorted((pos, w) for w, pos in window_starts(plan, self.planner.window).items() if pos >= earliest)
        if not cuts:
            return ep  # its last window is already streaming; the next epoch leaves them out
        cut, first_window = cuts[0]
        head = plan.microbatches[:cut]
        head_plan = Plan(capacity=plan.capacity, pad_multiple=plan.pad_multiple, num_stages=plan.num_stages,
                         microbatches=head, step_points=Plan.compute_step_points(head))
        rest = self._plan(ep.epoch, self._planned_lengths(ep.lookup.lengths()), plan.capacity, self.planner.method,
                          start_window=first_window, carry_in=carry_state(head_plan))
        joined = head + rest.microbatches
        new = Plan(capacity=plan.capacity, pad_multiple=plan.pad_multiple, num_stages=plan.num_stages,
                   microbatches=joined, step_points=Plan.compute_step_points(joined))
        log.info("epoch %d re-planned from microbatch %d (window %d): %d microbatches instead of %d",
                 ep.epoch, cut, first_window, len(joined), len(plan.microbatches))
        return EpochPlan(epoch=ep.epoch, plan=new, lookup=ep.lookup, denominators=ep.denominators,
                         step_adapters=new.step_adapters())

    # ------------------------------------------------------------ validation
    @property
    def has_validation(self) -> bool:
        return any(len(v) > 0 for v in self.val_datasets)

    def val_plan(self, kind: str = "val") -> tuple[Plan, SampleLookup] | None:
        """Every validating adapter's val samples (``kind="test"``: test samples) planned
        together, cut into chunks of its global batch size like its training data; None if there
        are none. During fit, adapters that stopped training are left out (``validate`` and
        ``test`` evaluate them all)."""
        datasets = self.test_datasets if kind == "test" else self.val_datasets
        fitting = kind == "val" and (self.trainer is None or self.trainer.state.fn == "fit")
        skip = self.excluded if fitting else frozenset()
        active = tuple(a for a, v in enumerate(datasets) if len(v) and a not in skip)
        if not active:
            return None
        if (kind, active) not in self._val_plans:
            batches = [[list(range(i, min(i + self.specs[a].global_batch_size, len(v))))
                        for i in range(0, len(v), self.specs[a].global_batch_size)] if a in active else []
                       for a, v in enumerate(datasets)]
            lookup = SampleLookup(datasets, batches)
            plan = self._plan(0, lookup.lengths(), self.packing.capacity, self.planner.method, num_stages=1)
            self._val_plans[(kind, active)] = (plan, lookup)
        return self._val_plans[(kind, active)]

    def iter_val_microbatches(self, kind: str = "val") -> Iterator[Microbatch]:
        """This replica's share of the validation (or ``kind="test"``) microbatches (every
        ``data_parallel_size``-th)."""
        planned = self.val_plan(kind)
        if planned is None:
            return
        plan, lookup = planned
        denominators = lookup.denominators()
        for pos in range(self.replica, len(plan.microbatches), self.data_parallel_size):
            if not plan.microbatches[pos].is_noop:
                yield pack_microbatch(plan.microbatches[pos], lookup, config=self.packing,
                                      num_adapters=len(self.specs), denominators=denominators,
                                      step_adapters=(), index=pos)

    def pack_position(self, epoch: int, pos: int) -> Microbatch:
        """Plan position ``pos`` of ``epoch`` as tensors (no-op slots pack to empty tensors)."""
        ep = self.epoch_plan(epoch)
        planned = ep.plan.microbatches[pos]
        config = self.packing
        if self.data_parallel_size > 1:  # the shape plan's slots, filled with this replica's samples
            planned = replica_microbatch(planned, ep.lookup)
        if ep.capacities is not None:  # no pipeline: packed at the level its position needs
            config = dataclasses.replace(config, capacity=ep.capacities[pos])
        return pack_microbatch(
            planned,
            ep.lookup,
            config=config,
            num_adapters=len(self.specs),
            denominators=ep.denominators,
            step_adapters=ep.step_adapters.get(pos, ()),
            index=epoch * EPOCH_STRIDE + pos,
        )

    def stream_start(self) -> tuple[int, int]:
        """The (epoch, position) the training stream continues from: our own resume point, the
        next epoch once the rest of the current one holds only no-op slots."""
        epoch, start = self.epoch, self.position
        with _PLAN_LOCK:
            rest = self.epoch_plan(epoch).plan.microbatches[start:]
        if all(mb.is_noop for mb in rest):
            epoch, start = epoch + 1, 0
        return epoch, start

    def packed_epoch(self, epoch: int, start: int = 0) -> Iterator[Microbatch]:
        """This replica's microbatches of ``epoch`` from ``start``, packed on the host (no-op
        slots skipped): what depends on the whole epoch's shapes, such as the CUDA graphs
        captured before it, reads them here."""
        with _PLAN_LOCK:
            positions = [pos for pos, mb in enumerate(self.epoch_plan(epoch).plan.microbatches)
                         if pos >= start and not mb.is_noop]
        for pos in positions:
            yield self.pack_position(epoch, pos)

    def iter_windows(self, epoch: int, start: int = 0) -> Iterator[PipelineWindow]:
        """Pipeline mode: the whole epoch is one window, so the pipeline drains once per epoch.

        An epoch is where Lightning checkpoints and runs epoch-end hooks, and a checkpoint must
        find no microbatch in flight and no global batch half done on any stage; a stream across
        epochs would need both. The drain costs one warm-up and cool-down per epoch (about 0.3-2%
        with 16 global batches per adapter, docs/parallel.md).
        """
        if start == 0:
            with _PLAN_LOCK:
                ep = self.epoch_plan(epoch)
                self._streamed[epoch] = 0  # started: exclude_adapters keeps this plan
            if ep.plan.microbatches:  # empty once every adapter has stopped
                yield PipelineWindow(epoch, ep.plan, lambda pos: self.pack_position(epoch, pos))

    def on_window_trained(self, window: PipelineWindow) -> None:
        self.epoch, self.position = window.epoch, len(window.plan.microbatches)

    def iter_microbatches(self, epoch: int, start: int = 0) -> Iterator[Microbatch]:
        """Packed microbatches of ``epoch`` from position ``start`` (no-op slots skipped).

        The plan is looked up again at every position: ``exclude_adapters`` may re-plan the
        positions the stream has not reached yet."""
        pos = start
        while True:
            with _PLAN_LOCK:
                ep = self.epoch_plan(epoch)
                if pos >= len(ep.plan.microbatches):
                    return
                self._streamed[epoch] = pos
                for old in sorted(self._streamed)[:-2]:
                    del self._streamed[old]
                noop = ep.plan.microbatches[pos].is_noop
            if not noop:
                yield self.pack_position(epoch, pos)
            pos += 1

    # ------------------------------------------------------------ Lightning
    def train_dataloader(self):
        return train_loader(self)

    def val_dataloader(self):
        """Packed validation microbatches of the adapters still training (re-read at every
        validation; nothing when no adapter has validation data)."""
        return ValLoader(self)

    def test_dataloader(self):
        """Packed microbatches of every adapter's test data (``lightning-lorafusion test``)."""
        return ValLoader(self, kind="test")

    def transfer_batch_to_device(self, batch, device, dataloader_idx: int):
        if isinstance(batch, Sealed):
            batch = batch.item
        return batch.to(device)

    def on_microbatch_trained(self, mb: Microbatch) -> None:
        """Called by the LightningModule after a microbatch's step: advances the resume point."""
        self.epoch, pos = divmod(mb.index, EPOCH_STRIDE)
        self.position = pos + 1

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "epoch": self.epoch, "position": self.position, "capacity": self.packing.capacity,
            "excluded": sorted(self.excluded),
        }
        if self._capacity_levels is not None:
            state["capacity_levels"] = list(self._capacity_levels)
        current = self._plans.get(self.epoch)
        if current is not None:
            # The plan itself, so a resumed run never depends on re-planning identically.
            state["plan"] = current.plan.to_json()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        if "capacity" in state:
            self._restored_capacity = int(state["capacity"])
        if "plan" in state:
            self._restored_plan = (self.epoch, Plan.from_json(state["plan"]))
        self.excluded = frozenset(state.get("excluded", ()))
        if "capacity_levels" in state:
            self._capacity_levels = tuple(int(c) for c in state["capacity_levels"])
