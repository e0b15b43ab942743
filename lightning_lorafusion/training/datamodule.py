"""LightningDataModule: per-adapter datasets -> global batches -> planned, packed microbatches.

One Lightning epoch is one pass over every adapter's dataset. Each adapter's samples are
shuffled with its own seed, cut into its own global batches, planned together into
fixed-capacity microbatches (``lightning_lorafusion.planner``) and streamed through a
torchdata node graph that packs tensors in a background thread. The position in the
stream is part of the checkpoint, so a resumed run continues at the exact microbatch.
Validation samples (an adapter's ``val_dataset`` or held-out ``val_fraction``) are planned
and packed the same way, every adapter together, into the validation loader. Adapters that
stop (early stopping, quarantine) are left out of planning from the next planning window.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from dataclasses import dataclass, replace
from typing import Any, Iterator, Sequence

import lightning as L
import numpy as np

from ..data.microbatch import IGNORE_INDEX, Microbatch
from ..data.packing import PackingConfig, SampleLookup, pack_microbatch
from ..planner.plan import Plan, padded_length
from ..specs import AdapterSpec, ConfigError
from .capacity import DEFAULT_CANDIDATES

log = logging.getLogger(__name__)

_PLAN_LOCK = threading.RLock()  # module-level: the data module itself must stay picklable (spawn)

# Microbatch.index = epoch * EPOCH_STRIDE + position: unique per run, feeds dropout offsets.
EPOCH_STRIDE = 1_000_000


def holdout_indices(num_samples: int, fraction: float, seed: int) -> list[int]:
    """Dataset indices held out for validation: those whose hash of (seed, index) falls below
    ``fraction``, so a sample's side does not depend on the others (adding samples moves none).
    At least one sample is held out and at least one kept for training."""
    if num_samples < 2:
        raise ConfigError(f"val_fraction needs at least 2 samples to split; the dataset has {num_samples}")
    keys = [int.from_bytes(hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest(), "little") / 2**64
            for i in range(num_samples)]
    held = [i for i, k in enumerate(keys) if k < fraction]
    if not held:
        held = [min(range(num_samples), key=keys.__getitem__)]
    if len(held) == num_samples:
        held.remove(max(held, key=keys.__getitem__))
    return held


def window_starts(plan: Plan, window: int) -> dict[int, int]:
    """Planning window -> position of its first sample in ``plan`` (windows hold rounds
    ``[w * window, (w + 1) * window)`` of every adapter and follow each other, so no global
    batch straddles these positions)."""
    starts: dict[int, int] = {}
    for pos, mb in enumerate(plan.microbatches):
        for s in mb.samples:
            starts.setdefault(s.batch // window, pos)
    return starts


@dataclass(frozen=True)
class EpochPlan:
    """Everything needed to stream one epoch: the plan and how to find each sample."""

    epoch: int
    plan: Plan
    lookup: SampleLookup
    denominators: dict[tuple[int, int], int]
    step_adapters: dict[int, tuple[int, ...]]  # microbatch position -> adapters that step


class PipelineWindow:
    """One planned window for the pipeline strategy: the plan plus its microbatches, packed on
    demand (every stage asks for the same positions) and cached on the target device."""

    def __init__(self, epoch: int, plan: Plan, pack: Any, device: Any = None) -> None:
        self.epoch = epoch
        self.plan = plan
        self._pack = pack
        self._device = device
        self._cache: dict[int, Microbatch] = {}

    def microbatch(self, position: int) -> Microbatch:
        if position not in self._cache:
            mb = self._pack(position)
            self._cache[position] = mb if self._device is None else mb.to(self._device)
        return self._cache[position]

    def to(self, device: Any) -> "PipelineWindow":
        return PipelineWindow(self.epoch, self.plan, self._pack, device)

    def _real_positions(self) -> list[int]:
        return [pos for pos, mb in enumerate(self.plan.microbatches) if not mb.is_noop]

    def sample_lengths(self) -> list[int]:
        """Token counts of this replica's samples in the window (packs what is not packed yet)."""
        return [ref.length for pos in self._real_positions() for ref in self.microbatch(pos).samples]

    @property
    def real_tokens(self) -> int:
        """Non-padding tokens this replica trains in the window (as ``Microbatch.real_tokens``)."""
        return sum(self.sample_lengths())

    @property
    def capacity(self) -> int:
        """Token slots of the window's real microbatches (``TokenThroughput``'s fill denominator)."""
        return self.plan.capacity * len(self._real_positions())


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
        planner: "greedy" or "milp".
        planner_time_limit: wall-clock safety limit (s) per MILP solve (the MILP result is used
            only when proven optimal within a node budget, so plans do not depend on speed).
        planner_window: global batches per adapter planned together (one planning job).
        planner_workers: processes planning windows in parallel (0: in this process).
        num_stages: pipeline depth the plan must respect (set by the pipeline strategy).
        max_length: samples are truncated to this many tokens by the tokenizer step
            (default: capacity); a longer sample than capacity is an error before training.
        prefetch: microbatches packed ahead of the training step.
    """

    def __init__(
        self,
        *,
        capacity: int | str = 1024,
        capacity_candidates: list[int] | None = None,
        capacity_memory_fraction: float = 0.9,
        pad_multiple: int = 16,
        planner: str = "greedy",
        planner_time_limit: float = 5.0,
        planner_window: int = 8,
        planner_workers: int = 0,
        num_stages: int = 1,
        max_length: int | None = None,
        prefetch: int = 4,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if planner not in ("greedy", "milp"):
            raise ConfigError(f"data.planner={planner!r}; allowed: 'greedy', 'milp'")
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
        self.planner_time_limit = planner_time_limit
        self.planner_window = planner_window
        self.planner_workers = planner_workers
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
        from ..data.sources import build_source

        if not any(spec.test_dataset for spec in self.specs):
            raise ConfigError("`test` evaluates each adapter's test_dataset, and no adapter sets one; add "
                              "adapters[].test_dataset (a mapping like dataset, e.g. {kind: jsonl, path: "
                              "test.jsonl})")
        max_length = self.max_length or self.packing.capacity
        self.test_datasets = []
        for spec in self.specs:
            samples: Sequence = []
            if spec.test_dataset:
                # a single file is read whole; path mappings, aclsum and synthetic give their 'test' split
                split = "train" if isinstance(spec.test_dataset.get("path"), str) else "test"
                samples = build_source(spec.test_dataset, self.tokenizer, split=split, max_length=max_length,
                                       name=f"{spec.name} (test)")
                self._check_lengths(spec, samples)
                log.info("adapter %s: %d test samples", spec.name, len(samples))
            self.test_datasets.append(samples)

    def _adopt_pipeline_layout(self) -> None:
        from ..parallel.strategy import MultiAdapterPipelineStrategy

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
        from ..data.sources import SyntheticSource, build_source, parse_source

        max_length = self.max_length or self.packing.capacity
        self.datasets, self.val_datasets = [], []
        for spec in self.specs:
            if not spec.dataset:
                raise ConfigError(f"adapter {spec.name!r} has no dataset; set adapters[].dataset")
            source = parse_source(spec.dataset, name=spec.name)
            if (isinstance(source, SyntheticSource) and source.vocab_size is None and self.tokenizer is None
                    and self.vocab_size is not None):
                source = replace(source, vocab_size=self.vocab_size)
            samples = build_source(
                source, self.tokenizer, split="train", max_length=max_length, name=spec.name
            )
            if len(samples) == 0:
                raise ConfigError(f"adapter {spec.name!r}: its dataset {spec.dataset} is empty")
            val: Sequence = []
            if spec.val_fraction > 0:
                if len(samples) < 2:
                    raise ConfigError(f"adapter {spec.name!r}: val_fraction={spec.val_fraction} needs at "
                                      f"least 2 samples to split; its dataset has {len(samples)}")
                held = set(holdout_indices(len(samples), spec.val_fraction, spec.seed))
                val = [s for i, s in enumerate(samples) if i in held]
                samples = [s for i, s in enumerate(samples) if i not in held]
            elif spec.val_dataset is not None:
                # a single file is read whole; path mappings, aclsum and synthetic give their 'val' split
                split = "train" if isinstance(spec.val_dataset.get("path"), str) else "val"
                val = build_source(spec.val_dataset, self.tokenizer, split=split, max_length=max_length,
                                   name=f"{spec.name} (val)")
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
        cap, pad = self.packing.capacity, self.packing.pad_multiple
        for i, s in enumerate(samples):
            n = len(s.input_ids)
            if padded_length(n, pad) > cap:
                raise ConfigError(
                    f"adapter {spec.name!r}: sample {i} has {n} tokens, more than the microbatch "
                    f"capacity {cap} (after padding to a multiple of {pad}); set "
                    f"data.capacity >= {padded_length(n, pad)} or data.max_length <= {cap}"
                )
            if not any(t != IGNORE_INDEX for t in s.labels):
                raise ConfigError(
                    f"adapter {spec.name!r}: sample {i} has no label tokens (empty completion?)"
                )

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
        from ..planner import PlannerConfig, join_plans, plan_stream
        from ..planner.stream import num_windows

        config = PlannerConfig(
            capacity=capacity,
            pad_multiple=self.packing.pad_multiple,
            num_stages=self.num_stages if num_stages is None else num_stages,
            method=method,
            time_limit=self.planner_time_limit,
            seed=self.seed + epoch,
        )
        if start_window >= num_windows(lengths, self.planner_window):  # nothing (left) to plan
            return Plan(capacity=capacity, pad_multiple=config.pad_multiple, num_stages=config.num_stages,
                        microbatches=())
        windows = plan_stream(lengths, config, window=self.planner_window, workers=self.planner_workers,
                              start_window=start_window, carry_in=carry_in)
        return join_plans([wp.plan for wp in windows])

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
        if self.data_parallel_size > 1:
            lookup, lengths = self._replica_shards(lookup, lengths)
        if self._restored_plan is not None and self._restored_plan[0] == epoch:
            plan = self._restored_plan[1]  # exactly what the interrupted run trained on
            self._check_restored_plan(plan, lengths)
        else:
            plan = self._plan(epoch, self._planned_lengths(lengths), self.packing.capacity, self.planner)
            log.info(
                "epoch %d planned (%s): %d microbatches of %d tokens, fill %.1f%%",
                epoch, self.planner, len(plan.microbatches), self.packing.capacity,
                100 * plan_fill(plan, self.packing.capacity),
            )
        return EpochPlan(
            epoch=epoch,
            plan=plan,
            lookup=lookup,
            denominators=denominators,
            step_adapters=plan.step_adapters(),
        )

    def _check_restored_plan(self, plan: Plan, lengths) -> None:
        """A checkpoint saved mid-epoch resumes that epoch's plan: it must fit this run's data."""
        from ..planner.verify import verify_plan

        problems = []
        if (plan.capacity, plan.pad_multiple) != (self.packing.capacity, self.packing.pad_multiple):
            problems.append(
                f"it was planned with data.capacity={plan.capacity}, data.pad_multiple="
                f"{plan.pad_multiple}; this run has {self.packing.capacity}, {self.packing.pad_multiple}"
            )
        # a stopped adapter's samples end where its planning stopped: at a window boundary, so
        # what the plan holds of it is whole global batches 0 .. k-1
        last = {}
        for mb in plan.microbatches:
            for ref in mb.samples:
                last[ref.adapter] = max(last.get(ref.adapter, -1), ref.batch)
        lengths = [batches[: last.get(a, -1) + 1] if a in self.excluded else batches
                   for a, batches in enumerate(lengths)]
        problems += verify_plan(plan, lengths)
        if problems:
            raise ConfigError(
                f"the checkpoint stopped inside epoch {self.epoch}, but its plan for that epoch does "
                f"not match this run's data ({problems[0]}"
                + (f"; {len(problems) - 1} more problem(s)" if len(problems) > 1 else "")
                + "); resume with the data settings the checkpoint was saved with (datasets, "
                "max_length, capacity, pad_multiple, devices), or start without --ckpt_path"
            )

    def _replica_shards(self, lookup: SampleLookup, lengths) -> tuple[SampleLookup, list]:
        """This replica's share of every global batch, and the slot lengths to plan (replica
        0's, which bound every replica's sample in the same slot): one plan shape for all
        replicas, so they step adapters in the same order (``parallel.replica_shards``)."""
        from ..parallel.replica_shards import split_global_batch

        dp = self.data_parallel_size
        shards = [[split_global_batch(batch, lens, dp) for batch, lens in zip(lookup.batches[a], lengths[a])]
                  for a in range(len(lengths))]
        mine = [[s[self.replica] for s in per_adapter] for per_adapter in shards]
        slots = [[[len(self.datasets[a][i].input_ids) for i in s[0]] for s in shards[a]]
                 for a in range(len(lengths))]
        real = sum(n for per_adapter in lengths for batch in per_adapter for n in batch)
        planned = dp * sum(n for per_adapter in slots for batch in per_adapter for n in batch)
        log.info("data parallel x%d: replica %d of each global batch; slots padded to the longest "
                 "sample dealt with them keep %.1f%% of the planned tokens real", dp, self.replica,
                 100 * real / max(1, planned))
        return SampleLookup(self.datasets, mine), slots

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
        from ..parallel.stage import adapter_loss
        from .capacity import choose_capacity, device_memory_limit, format_probes, probe_capacities

        pad = self.packing.pad_multiple
        longest = max(padded_length(len(s.input_ids), pad) for d in self.datasets for s in d)
        candidates = [c for c in self.capacity_candidates if c >= longest]
        if not candidates:
            raise ConfigError(
                f"data.capacity=auto: every candidate in {self.capacity_candidates} is below the "
                f"longest sample ({longest} tokens after padding); add larger "
                "data.capacity_candidates or set data.max_length"
            )
        lookup = self._lookup(0)
        lengths, denominators = lookup.lengths(), lookup.denominators()
        device = module.device

        def prepare(capacity: int):
            plan = self._plan(0, lengths, capacity, "greedy")
            config = PackingConfig(capacity=capacity, pad_multiple=pad, pad_token_id=self.packing.pad_token_id)
            real = [(mb.real_tokens(), pos) for pos, mb in enumerate(plan.microbatches) if not mb.is_noop]
            fullest = sorted(real, key=lambda t: (-t[0], t[1]))[:probe_microbatches]
            mbs = [
                pack_microbatch(
                    plan.microbatches[pos], lookup, config=config, num_adapters=len(self.specs),
                    denominators=denominators, step_adapters=(), index=pos,
                ).to(device)
                for _, pos in fullest
            ]
            return plan_fill(plan, capacity), mbs

        params = [p for p in module.parameters() if p.requires_grad]
        precision = self.trainer.precision_plugin if self.trainer is not None else None

        def step(mb: Microbatch) -> None:
            with precision.forward_context() if precision is not None else contextlib.nullcontext():
                loss = adapter_loss(module.loss_sums(mb), mb.loss_denominators)
            loss.backward()
            for p in params:
                p.grad = None

        probes = probe_capacities(
            candidates, prepare, step, device,
            memory_limit=device_memory_limit(device, self.capacity_memory_fraction),
        )
        chosen = choose_capacity(probes)
        log.info(
            "data.capacity=auto on %s (%s):\n%s", device,
            "by speed; memory not measured off CUDA" if device.type != "cuda" else
            f"memory limit {100 * self.capacity_memory_fraction:.0f}% of the device",
            format_probes(probes, chosen),
        )
        return chosen.capacity

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
        from ..planner.verify import carry_state

        plan = ep.plan
        earliest = self.position + self.prefetch + 4 if ep.epoch == self.epoch else 0
        earliest = max(earliest, self._streamed.get(ep.epoch, -1) + 1)
        cuts = sorted((pos, w) for w, pos in window_starts(plan, self.planner_window).items() if pos >= earliest)
        if not cuts:
            return ep  # its last window is already streaming; the next epoch leaves them out
        cut, first_window = cuts[0]
        head = plan.microbatches[:cut]
        head_plan = Plan(capacity=plan.capacity, pad_multiple=plan.pad_multiple, num_stages=plan.num_stages,
                         microbatches=head, step_points=Plan.compute_step_points(head))
        rest = self._plan(ep.epoch, self._planned_lengths(ep.lookup.lengths()), plan.capacity, self.planner,
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
            plan = self._plan(0, lookup.lengths(), self.packing.capacity, self.planner, num_stages=1)
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
        if self.data_parallel_size > 1:  # the shape plan's slots, filled with this replica's samples
            from ..parallel.replica_shards import replica_microbatch

            planned = replica_microbatch(planned, ep.lookup)
        return pack_microbatch(
            planned,
            ep.lookup,
            config=self.packing,
            num_adapters=len(self.specs),
            denominators=ep.denominators,
            step_adapters=ep.step_adapters.get(pos, ()),
            index=epoch * EPOCH_STRIDE + pos,
        )

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
        import torchdata.nodes as tn

        if self.pipeline:
            return _MicrobatchLoader(_ResumableStream(self, windows=True))
        node = tn.IterableWrapper(_ResumableStream(self))
        node = tn.Prefetcher(node, prefetch_factor=max(1, self.prefetch))
        return _MicrobatchLoader(tn.Loader(node))

    def val_dataloader(self):
        """Packed validation microbatches of the adapters still training (re-read at every
        validation; nothing when no adapter has validation data)."""
        return _ValLoader(self)

    def test_dataloader(self):
        """Packed microbatches of every adapter's test data (``lightning-lorafusion test``)."""
        return _ValLoader(self, kind="test")

    def transfer_batch_to_device(self, batch, device, dataloader_idx: int):
        if isinstance(batch, _Sealed):
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


def plan_fill(plan: Plan, capacity: int) -> float:
    """Real tokens over the slots of the plan's microbatches (no-op slots count as empty)."""
    real = sum(mb.real_tokens() for mb in plan.microbatches)
    return real / max(1, len(plan.microbatches) * capacity)


class _MicrobatchLoader:
    """The torchdata loader without its state_dict: resume is by our own (epoch, position),
    which Lightning checkpoints through the data module; Lightning would otherwise try to
    fast-forward the node graph itself."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def __iter__(self):
        return (_Sealed(item) for item in self._loader)


class _ValLoader:
    """Iterable over this replica's validation microbatches, packed ahead in a thread; the plan
    (which adapters validate) is taken when each validation starts."""

    def __init__(self, dm: MultiAdapterDataModule, kind: str = "val") -> None:
        self.dm = dm
        self.kind = kind

    def __iter__(self):
        import torchdata.nodes as tn

        stream = _ValStream(self.dm, self.kind)
        node = tn.Prefetcher(tn.IterableWrapper(stream), prefetch_factor=max(1, self.dm.prefetch))
        return (_Sealed(item) for item in tn.Loader(node))


class _ValStream:
    def __init__(self, dm: MultiAdapterDataModule, kind: str = "val") -> None:
        self.dm = dm
        self.kind = kind

    def __iter__(self) -> Iterator[Microbatch]:
        return self.dm.iter_val_microbatches(self.kind)


class _Sealed:
    """A batch that Lightning's collection walkers leave alone until our
    ``transfer_batch_to_device`` opens it. Under ``precision: bf16-true`` / ``16-true`` the
    precision plugin casts every floating tensor of a batch (``convert_input``), which would
    fail on the frozen ``Microbatch`` and would round its fp32 loss denominators to 16 bits."""

    __slots__ = ("item",)

    def __init__(self, item: Any) -> None:
        self.item = item


class _ResumableStream:
    """Iterable over the current epoch from the data module's resume point."""

    def __init__(self, dm: MultiAdapterDataModule, windows: bool = False) -> None:
        self.dm = dm
        self.windows = windows

    def __iter__(self) -> Iterator[Microbatch]:
        dm = self.dm
        # Our own (epoch, position), restored from the checkpoint, decide what comes next, not
        # trainer.current_epoch: after a resume from an epoch-end checkpoint Lightning re-enters
        # the finished epoch under its old number and counts it as the next one.
        epoch, start = dm.epoch, dm.position
        if all(mb.is_noop for mb in dm.epoch_plan(epoch).plan.microbatches[start:]):
            epoch, start = epoch + 1, 0
        if self.windows:
            return dm.iter_windows(epoch, start)
        return dm.iter_microbatches(epoch, start)
