"""``MultiAdapterPipelineStrategy``: Lightning's DDP launch and process groups, our PP x DP layout.

Lightning launches the processes (``devices``, ``num_nodes``, torchrun and SLURM environments,
``start_method="spawn"`` for notebooks and tests) and initialises the default process group
exactly as ``DDPStrategy`` does. This strategy then arranges the world as
``pipeline_size x data_parallel_size`` (``ParallelLayout``), never wraps the model in
DistributedDataParallel (adapters are all-reduced per adapter at their own step instead), and
gives the LightningModule one call that trains a planned window on this rank's stage:
``run_pipeline``.

Selecting it from YAML (LightningCLI)::

    trainer:
      devices: 4
      strategy:
        class_path: lightning_lorafusion.parallel.strategy.MultiAdapterPipelineStrategy
        init_args: {pipeline_size: 2}        # data_parallel_size defaults to world / pipeline_size
                                             # schedule: no_flush (default) or flushed_1f1b
                                             # overlap_grad_reduce: true (default), bucket_mb: 25
                                             # stage_layers: [16, 16] (default: split by time)

What it expects from the LightningModule (manual optimization):

- ``pipeline_stage(stage_index: int, layers: range, is_first: bool, is_last: bool) -> StageModule``:
  called once per fit after setup; the module keeps only what that stage needs.
- ``adapter_parameters(adapter: int, layers: range) -> list[Tensor]``: that adapter's
  parameters on these layers (the ones all-reduced over data-parallel replicas at its step).
- ``step_adapter(adapter: int, batch: int) -> None``: step (and zero) adapter ``adapter``'s
  optimizer and scheduler; called after the all-reduce.
- its ``training_step`` receives one planned window (a ``Plan`` plus its packed microbatches,
  the same on every stage of a replica, this replica's shard under data parallelism) and calls
  ``self.trainer.strategy.run_pipeline(plan, microbatch_lookup)``, which returns a
  ``StageRecord`` (for the measured bubble ratio).

Checkpoints: each stage of replica 0 writes its own file (stage 0 at the path Lightning asks
for, stage ``s`` at ``<path>.stage<s>``) and reads its own back on resume, so each stage's
adapter shard and optimizer state survive; ``gather_stage_states`` collects every stage's
layers on global rank 0 for a whole-adapter export (PEFT directories).
"""

from __future__ import annotations

import atexit
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch.nn import Module

from ..data.microbatch import Microbatch
from ..planner.plan import Plan
from ..specs import ConfigError
from .data_parallel import (
    DEFAULT_BUCKET_MB,
    AdapterGradReducer,
    ParallelLayout,
    allreduce_adapter_grads,
    build_data_parallel_groups,
    check_same_step_order,
)
from .executor import StageRecord, gather_busy_and_wall, measured_bubble_ratio, run_stage
from .partition import check_stage_layers, partition_decoder, partition_layers, ranges_of
from .schedule import SCHEDULES
from .cost_model import DEFAULT_LABEL_FRACTION, CostModel
from .simulator import simulate
from .stage import StageModule


class _ReleasingLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, whose worker releases its process group before it
    returns. Left to interpreter exit, gloo's threads were once torn down in use: a spawned rank
    aborted ("terminate called without an active exception", SIGABRT) after its fit had
    finished (one CI run of five, not reproduced in isolation). The worker's last collective is
    in ``on_fit_end`` (gathering pipeline stages for export), which runs after the strategy's
    teardown, so the group is released here, after everything."""

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        try:
            super()._wrapping_function(*args, **kwargs)
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()


def _release_process_group() -> None:
    """atexit hook for ranks that no launcher of ours wraps (Lightning's subprocess launcher
    on each node, torchrun, SLURM): the same release, before interpreter teardown. A PP=2 x
    DP=2 two-node fit once aborted this way in CI after its fit had finished. The mechanism, as
    described in pytorch/pytorch PR 179291 (an unmerged proposal to do this inside torch): gloo's
    worker threads still hold work objects whose tensors reach back into Python, and freeing
    them during interpreter finalization aborts the process."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class MultiAdapterPipelineStrategy(DDPStrategy):
    """Pipeline (``pipeline_size`` stages) x data parallel training of many LoRA adapters.

    ``schedule``: ``"no_flush"`` (default: one 1F1B stream over the whole plan, adapters step
    in flight) or ``"flushed_1f1b"`` (the baseline: the pipeline drains at every step point),
    both over the same planned microbatches.

    ``overlap_grad_reduce`` (data parallelism): each adapter's gradient all-reduce runs in
    ``bucket_mb`` MiB buckets started during the backward that completes its global batch, and
    its step waits for its own buckets only (``AdapterGradReducer``); False: one blocking
    all-reduce per adapter at its step.

    ``stage_layers`` (e.g. ``[16, 16]``): decoder layers per stage, contiguous from the first;
    one positive count per stage summing to the decoder's layers (checked once the model is
    known). None (default): ``partition_decoder``'s time model balances the stages, with the LM
    head charged for the labelled share of the training data's tokens (``stage_ranges``).

    ``action_trace`` (a directory; relative: under the trainer's ``default_root_dir``): every
    rank appends one JSON line per trained window to ``actions_rank<r>.jsonl``: its measured
    action times (``StageRecord``), the simulator's times for the same actions, and each
    microbatch's shape (tokens, label rows, graph key). ``scripts/pipeline_action_times.py``
    compares them per stage. None (default): nothing is written.
    """

    strategy_name = "lorafusion_pipeline"

    def __init__(self, pipeline_size: int = 1, data_parallel_size: int | None = None,
                 schedule: str = "no_flush", overlap_grad_reduce: bool = True,
                 bucket_mb: float = DEFAULT_BUCKET_MB, stage_layers: list[int] | None = None,
                 action_trace: str | None = None, **ddp_kwargs: Any) -> None:
        if not isinstance(pipeline_size, int) or pipeline_size < 1:
            raise ConfigError(f"pipeline_size={pipeline_size!r} must be an int >= 1")
        if data_parallel_size is not None and (not isinstance(data_parallel_size, int) or data_parallel_size < 1):
            raise ConfigError(f"data_parallel_size={data_parallel_size!r} must be an int >= 1 or None")
        if schedule not in SCHEDULES:
            raise ConfigError(f"strategy schedule={schedule!r}; allowed: {sorted(SCHEDULES)}")
        if not isinstance(overlap_grad_reduce, bool):
            raise ConfigError(f"strategy overlap_grad_reduce={overlap_grad_reduce!r} must be true or false")
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or bucket_mb <= 0:
            raise ConfigError(f"strategy bucket_mb={bucket_mb!r} must be a number of MiB > 0 (e.g. 25)")
        if action_trace is not None and (not isinstance(action_trace, str) or not action_trace):
            raise ConfigError(f"strategy action_trace={action_trace!r} must be a directory path or null")
        self.action_trace = action_trace
        self.requested_stage_layers = (None if stage_layers is None
                                       else check_stage_layers(stage_layers, pipeline_size))
        super().__init__(**ddp_kwargs)
        self._ranges: tuple[range, ...] | None = None  # every stage's layers, once known
        self._label_fraction: float | None = None
        self._checkpoint_layers: bool | int = False  # the module's activation_checkpointing, for the time model
        self._lm_head_loss = "checkpointed"  # the module's, for the time model
        self.overlap_grad_reduce = overlap_grad_reduce
        self.bucket_mb = float(bucket_mb)
        self._reducer: AdapterGradReducer | None = None
        self.pipeline_size = pipeline_size
        self.schedule = schedule
        self._requested_dp = data_parallel_size
        self.layout: ParallelLayout | None = None
        self._dp_groups: list = []
        self._stage: StageModule | None = None
        self._layers: range | None = None
        self.last_bubble_ratio: float | None = None  # measured over all ranks, last window
        self.last_stage_bubble_ratios: tuple[float, ...] = ()  # per stage, averaged over replicas

    # ---- process layout -----------------------------------------------------------------
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if type(self._launcher) is _MultiProcessingLauncher:
            self._launcher = _ReleasingLauncher(self, start_method=self._start_method)

    def setup_distributed(self) -> None:
        super().setup_distributed()
        atexit.unregister(_release_process_group)  # registered once per process
        atexit.register(_release_process_group)
        world = self.world_size
        if world % self.pipeline_size:
            raise ValueError(
                f"pipeline_size={self.pipeline_size} does not divide the {world} processes "
                "(devices x num_nodes); choose devices so that it does"
            )
        dp = self._requested_dp or world // self.pipeline_size
        self.layout = ParallelLayout(pipeline_size=self.pipeline_size, data_parallel_size=dp)
        self.layout.check_world(world)
        self._dp_groups = build_data_parallel_groups(self.layout)

    def _require_layout(self) -> ParallelLayout:
        if self.layout is None:
            raise RuntimeError("the process layout exists only after the strategy's setup_environment")
        return self.layout

    @property
    def stage_index(self) -> int:
        return self._require_layout().stage_of(self.global_rank)

    @property
    def replica(self) -> int:
        return self._require_layout().replica_of(self.global_rank)

    @property
    def data_parallel_group(self):
        return self._dp_groups[self.stage_index]

    def sum_over_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over the data-parallel replicas of this rank's stage (e.g. a
        replica's share of an adapter's global-batch loss, for logging); collective over them."""
        group = self.data_parallel_group
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of a replica must see the same data; replicas see different shards
        layout = self._require_layout()
        return {"num_replicas": layout.data_parallel_size, "rank": self.replica}

    def stage_ranges(self, config: Any = None, *, num_layers: int | None = None,
                     label_fraction: float | None = None,
                     checkpoint_layers: bool | int = False,
                     lm_head_loss: str = "checkpointed") -> tuple[range, ...]:
        """Every stage's layers, fixed at the first call: ``stage_layers`` as given, else for a
        decoder ``config`` balanced by the time model (``label_fraction``: the share of tokens the
        LM head sees; default ``DEFAULT_LABEL_FRACTION``; ``checkpoint_layers``: the module's
        ``activation_checkpointing``, whose layers cost one forward more; ``lm_head_loss``: the
        module's, charged by the time model), else ``num_layers``
        evenly. The split computed here is rank 0's, broadcast, so every rank runs the same one."""
        if self._ranges is not None:
            return self._ranges
        pp = self._require_layout().pipeline_size
        if config is None and num_layers is None:
            raise ValueError("stage_layers needs a decoder config or num_layers")
        if config is not None:
            ranges = partition_decoder(config, pp, stage_layers=self.requested_stage_layers,
                                       label_fraction=label_fraction, checkpoint_layers=checkpoint_layers,
                                       lm_head_loss=lm_head_loss)
        elif self.requested_stage_layers is not None:
            ranges = ranges_of(check_stage_layers(self.requested_stage_layers, pp, num_layers))
        else:
            ranges = partition_layers(num_layers, pp)
        if self.requested_stage_layers is None and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size() > 1:
            chosen = [[len(r) for r in ranges], label_fraction]
            dist.broadcast_object_list(chosen, src=0)
            ranges, label_fraction = ranges_of(chosen[0]), chosen[1]
        self._ranges, self._label_fraction = ranges, label_fraction
        self._checkpoint_layers = checkpoint_layers
        self._lm_head_loss = lm_head_loss
        return ranges

    @property
    def stage_layer_counts(self) -> tuple[int, ...] | None:
        """Decoder layers per stage of the split in use; None before ``stage_ranges`` fixed it."""
        return None if self._ranges is None else tuple(len(r) for r in self._ranges)

    def stage_layers(self, config: Any = None, *, num_layers: int | None = None,
                     label_fraction: float | None = None, checkpoint_layers: bool | int = False,
                     lm_head_loss: str = "checkpointed") -> range:
        """This rank's layers (``stage_ranges``)."""
        return self.stage_ranges(config, num_layers=num_layers, label_fraction=label_fraction,
                                 checkpoint_layers=checkpoint_layers, lm_head_loss=lm_head_loss)[self.stage_index]

    def cost_model(self, config: Any, **overrides: Any) -> CostModel:
        """The simulator's time model (``CostModel.timed``) of this pipeline's split and the
        training data's label share, for ``simulated_bubble_ratio``."""
        fraction = DEFAULT_LABEL_FRACTION if self._label_fraction is None else self._label_fraction
        counts = [len(r) for r in self.stage_ranges(config)]
        return CostModel.timed(config, counts, label_fraction=fraction, checkpoint_layers=self._checkpoint_layers,
                               **{"lm_head_loss": self._lm_head_loss, **overrides})

    # ---- no DDP wrapper: gradients are reduced per adapter at its step --------------------
    def _setup_model(self, model: Module) -> Module:
        return model

    def configure_ddp(self) -> None:
        self.model = self._setup_model(self.model)

    # ---- training -------------------------------------------------------------------------
    def run_pipeline(
        self,
        plan: Plan,
        microbatches: Callable[[int], Microbatch] | None = None,
        *,
        activation_shape: tuple[int, int],
        dtype: torch.dtype,
        synchronize: Callable[[], None] | None = None,
        measure_bubbles: bool = True,
    ) -> StageRecord:
        """Train one planned window on this rank's stage; adapters step inside as they finish.

        With ``measure_bubbles`` the idle fraction over all ranks (a small all-gather) lands in
        ``last_bubble_ratio`` and per stage in ``last_stage_bubble_ratios``; pass ``synchronize=torch.cuda.synchronize`` for device times.

        The module's stage comes from ``pipeline_stage`` (built on first use; ``layers`` from
        ``stage_layers(module.decoder_config)`` when the module has that attribute, else
        ``num_layers``). ``microbatches`` is accepted for stages that look data up per window.
        """
        layout = self._require_layout()
        module = self.lightning_module
        if self._stage is None:
            config = getattr(module, "decoder_config", None)
            self._layers = (self.stage_layers(config) if config is not None
                            else self.stage_layers(num_layers=module.num_layers))
            self._stage = module.pipeline_stage(
                self.stage_index, self._layers, self.stage_index == 0,
                self.stage_index == layout.pipeline_size - 1,
            )
        actions = SCHEDULES[self.schedule](plan, layout.pipeline_size)[self.stage_index]
        group = self.data_parallel_group
        check_same_step_order(actions, group)  # every window: a mismatch would hang, not fail
        layers = self._layers
        reducer = self._grad_reducer(module, group)

        def step(adapter: int, batch: int) -> None:
            # one replica: nothing to reduce (and no walk over this stage's parameters)
            if reducer is not None:
                reducer.wait(adapter)
            elif group is not None:
                allreduce_adapter_grads(module.adapter_parameters(adapter, layers), group)
            module.step_adapter(adapter, batch)

        record = run_stage(
            actions, self._stage, stage_index=self.stage_index, num_stages=layout.pipeline_size,
            activation_shape=activation_shape, dtype=dtype, device=self.root_device,
            optimizer_step=step, stage_ranks=layout.pipeline_ranks(self.replica),
            synchronize=synchronize, hooks=reducer,
        )
        if measure_bubbles:
            pairs = gather_busy_and_wall(record)
            self.last_bubble_ratio = measured_bubble_ratio(pairs)
            longest = max(wall for _, wall in pairs)
            per_stage = [[1.0 - busy / longest for r, (busy, _) in enumerate(pairs)
                          if layout.stage_of(r) == s] for s in range(layout.pipeline_size)]
            self.last_stage_bubble_ratios = tuple(sum(v) / len(v) for v in per_stage)
        return record

    def _grad_reducer(self, module: Any, group: Any) -> AdapterGradReducer | None:
        """The overlapped all-reduce of this stage's adapter gradients (built once), or None with
        one replica or ``overlap_grad_reduce=False``."""
        if group is None or not self.overlap_grad_reduce:
            return None
        if self._reducer is None:
            layers = self._layers
            self._reducer = AdapterGradReducer(lambda a: module.adapter_parameters(a, layers), group,
                                               bucket_mb=self.bucket_mb)
        return self._reducer

    def simulated_bubble_ratio(self, plan: Plan, cost_model: CostModel) -> float:
        """The simulator's prediction for ``plan`` on this pipeline, to log next to
        ``last_bubble_ratio``."""
        return self.simulate(plan, cost_model).bubble_ratio

    def simulate(self, plan: Plan, cost_model: CostModel, head_rows: Mapping[int, int] | None = None):
        """The simulator's run of ``plan`` on this pipeline (``SimulationResult``: the bubble
        ratio overall and per stage); ``head_rows``: the LM head's rows per microbatch
        (``simulator.simulate``)."""
        pp = self._require_layout().pipeline_size
        return simulate(plan, SCHEDULES[self.schedule](plan, pp), cost_model, head_rows=head_rows)

    # ---- checkpoints and export ------------------------------------------------------------
    def stage_checkpoint_path(self, filepath: str) -> str:
        return str(filepath) if self.stage_index == 0 else f"{filepath}.stage{self.stage_index}"

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        # data-parallel replicas hold identical adapters: replica 0 writes, one file per stage
        if self.replica == 0:
            self.checkpoint_io.save_checkpoint(checkpoint, self.stage_checkpoint_path(filepath),
                                               storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        torch.cuda.empty_cache()
        return self.checkpoint_io.load_checkpoint(self.stage_checkpoint_path(checkpoint_path),
                                                  weights_only=weights_only)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.replica == 0:
            self.checkpoint_io.remove_checkpoint(self.stage_checkpoint_path(filepath))

    def gather_stage_states(self, state: Mapping[str, torch.Tensor],
                            owns: Callable[[str], bool]) -> dict[str, torch.Tensor] | None:
        """Merge, on global rank 0, the entries of ``state`` each stage of replica 0 ``owns``
        (e.g. adapter keys of its layers); other ranks get None. Collective over the world."""
        mine = {k: v.detach().cpu() for k, v in state.items() if owns(k)} if self.replica == 0 else {}
        gathered: list[Any] = [None] * self.world_size if self.global_rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if self.global_rank != 0:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            overlap = set(merged) & set(part)
            if overlap:
                raise RuntimeError(f"two stages claim the same entries {sorted(overlap)[:3]}...; "
                                   "each key must be owned by exactly one stage")
            merged.update(part)
        return merged
