"""The frozen base of the training module: argument checks, loading, FP8 quantization, and the
parameter pytree kept as non-persistent buffers (flattened names, tied tensors kept once)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..data.sources import parse_source
from ..model.decoder import LM_HEAD_LOSSES, DecoderConfig
from ..model.mlp_recompute import MLP_RECOMPUTE_MODES
from ..model.hf_loading import fp8_exempt_layer_set, load_base_model, quantize_base_fp8, resolve_model_dir
from ..model.random_model import is_random_base, random_base_config, random_base_params
from ..specs import AdapterSpec, ConfigError, check_adapter_names
from .cuda_graphs import CUDA_GRAPH_MODES
from .precision import PrecisionConfig, check_base_precision

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_adapters(adapters: Sequence[AdapterSpec | dict]) -> tuple[AdapterSpec, ...]:
    """The adapter specs, with their datasets checked now, before the model loads."""
    if not adapters:
        raise ConfigError("model.adapters is empty: list at least one adapter to train")
    specs = tuple(a if isinstance(a, AdapterSpec) else AdapterSpec(**a) for a in adapters)
    check_adapter_names(specs)
    for spec in specs:
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
    return specs


def check_module_options(*, dtype: str, grad_clip: Any, max_nonfinite_steps: Any, precision: PrecisionConfig,
                         lm_head_loss: str, cuda_graphs: str | bool, mlp_recompute: str = "none",
                         cuda_graph_precapture: Any = 0, norm_recompute: Any = False,
                         embedding_on_host: Any = False, mlp_recompute_layers: Any = None,
                         norm_recompute_layers: Any = None) -> str:
    """``ConfigError`` naming the first model option out of range; returns ``cuda_graphs`` as a
    mode name (YAML reads a bare on/off as a boolean)."""
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype={dtype!r}; allowed: {sorted(DTYPES)}")
    if (isinstance(grad_clip, bool) or not isinstance(grad_clip, (int, float)) or not math.isfinite(grad_clip)
            or grad_clip < 0):
        raise ConfigError(f"model.grad_clip={grad_clip!r} must be a finite number >= 0 (0 disables clipping)")
    if isinstance(max_nonfinite_steps, bool) or max_nonfinite_steps < 1:
        raise ConfigError(f"model.max_nonfinite_steps={max_nonfinite_steps!r} must be an int >= 1")
    check_base_precision(precision, dtype)
    if lm_head_loss not in LM_HEAD_LOSSES:
        raise ConfigError(f"model.lm_head_loss={lm_head_loss!r}; allowed: {LM_HEAD_LOSSES}")
    if mlp_recompute not in MLP_RECOMPUTE_MODES:
        raise ConfigError(f"model.mlp_recompute={mlp_recompute!r}; allowed: {MLP_RECOMPUTE_MODES}")
    if mlp_recompute != "none" and precision.base == "fp8":
        raise ConfigError(f"model.mlp_recompute={mlp_recompute!r} does not apply to an FP8 base (its SwiGLU "
                          "hands quantized operands to the down projection); set it to 'none' or use "
                          "activation_checkpointing")
    if not isinstance(norm_recompute, bool):
        raise ConfigError(f"model.norm_recompute={norm_recompute!r} must be true or false")
    for name, n in (("mlp_recompute_layers", mlp_recompute_layers), ("norm_recompute_layers", norm_recompute_layers)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ConfigError(f"model.{name}={n!r} must be null (every layer) or an int >= 0 (the first n layers "
                              "recompute, the others keep)")
    if not isinstance(embedding_on_host, bool):
        raise ConfigError(f"model.embedding_on_host={embedding_on_host!r} must be true or false")
    if embedding_on_host and precision.base == "fp8":
        raise ConfigError("model.embedding_on_host does not apply to an FP8 base (its embedding table is stored "
                          "in FP8 on the device already); set it to false")
    if isinstance(cuda_graphs, bool):
        cuda_graphs = "on" if cuda_graphs else "off"
    if cuda_graphs not in CUDA_GRAPH_MODES:
        raise ConfigError(f"model.cuda_graphs={cuda_graphs!r}; allowed: {CUDA_GRAPH_MODES}")
    precapture = cuda_graph_precapture
    if isinstance(precapture, bool) or not isinstance(precapture, int) or precapture < 0:
        raise ConfigError(f"model.cuda_graph_precapture={cuda_graph_precapture!r} must be an int >= 0 (0: capture "
                          "each shape key when first met)")
    return cuda_graphs


@dataclass
class FrozenBase:
    """A loaded base: its decoder config, its weights (None for a random base, drawn at setup),
    its tokenizer, the layers FP8 leaves in 16 bits, and the directory exports name."""

    config: DecoderConfig
    params: Any
    tokenizer: Any
    fp8_keep: frozenset[int] | set[int] | None
    model_dir: str


def load_frozen_base(base_model: str, *, dtype: str, cache_dir: str | None, precision: PrecisionConfig,
                     activation_checkpointing: bool | int) -> FrozenBase:
    """Load (or describe, for ``random:``) the base, quantized to FP8 when asked."""
    if is_random_base(base_model):  # drawn at setup, on the device, this stage's layers only
        config, params, tokenizer = random_base_config(base_model), None, None
    else:
        config, params, tokenizer = load_base_model(base_model, dtype=DTYPES[dtype], cache_dir=cache_dir)
    if params is not None:  # NF4 (QLoRA): quantized here, or kept from a bitsandbytes 4-bit checkpoint
        from ..model.hf_loading import has_nf4_projections, quantize_base_nf4

        if precision.base != "nf4" and has_nf4_projections(params):
            raise ConfigError(f"{base_model} is a bitsandbytes NF4 4-bit checkpoint; set model.precision.base: nf4")
        params = quantize_base_nf4(params) if precision.base == "nf4" else params
    keep = None
    if precision.base == "fp8":
        from ..kernels.fp8_linear import GEMM_MULTIPLE

        try:
            keep = fp8_exempt_layer_set(config.num_layers, precision.fp8.exempt_layers)
        except ValueError as error:
            raise ConfigError(str(error).replace("fp8_exempt_layers=", "model.precision.fp8.exempt_layers=", 1)) from None
        dims = {m: config.module_dims(m) for m in ("q_proj", "k_proj", "o_proj", "gate_proj")}
        odd = {m: d for m, d in dims.items() if d[0] % GEMM_MULTIPLE or d[1] % GEMM_MULTIPLE}
        if odd and not precision.fp8.emulate:
            raise ConfigError(
                f"model.precision.base='fp8': FP8 products need projection sizes divisible by "
                f"{GEMM_MULTIPLE}; {base_model} has {odd} (in, out). Use precision: {{base: bf16}}"
            )
        if params is not None:  # a random base is quantized at setup, where it is drawn
            # the 16-bit projection weights (and an untied embedding table) are dropped here
            params = quantize_base_fp8(params, embedding=not config.tie_word_embeddings, keep_layers=keep)
    ckpt = activation_checkpointing
    if not isinstance(ckpt, bool) and not (isinstance(ckpt, int) and 0 <= ckpt <= config.num_layers):
        raise ConfigError(
            f"model.activation_checkpointing={ckpt!r}: give true/false or a layer count in "
            f"0..{config.num_layers}"
        )
    # exported adapters name the directory transformers can load the base from
    model_dir = base_model if params is None else str(resolve_model_dir(base_model, cache_dir=cache_dir).resolve())
    return FrozenBase(config=config, params=params, tokenizer=tokenizer, fp8_keep=keep, model_dir=model_dir)


def flatten_tree(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """A nested dict/list of tensors as ``{"layers__0__q_proj__weight": tensor}``."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(flatten_tree(value, f"{prefix}__{key}" if prefix else str(key)))
    return out


def unflatten_into(template: Any, flat: dict[str, torch.Tensor], prefix: str = "") -> Any:
    """``template``'s structure with its tensors taken from ``flat`` (``flatten_tree`` names)."""
    if isinstance(template, torch.Tensor):
        return flat[prefix]
    if isinstance(template, dict):
        return {k: unflatten_into(v, flat, f"{prefix}__{k}" if prefix else str(k)) for k, v in template.items()}
    return [unflatten_into(v, flat, f"{prefix}__{i}" if prefix else str(i)) for i, v in enumerate(template)]


def stage_template(template: dict[str, Any], layers: range, is_first: bool, is_last: bool) -> dict[str, Any]:
    """The part of a base's parameter tree one pipeline stage holds."""
    kept: dict[str, Any] = {"layers": {i: template["layers"][i] for i in layers}}
    if is_first:
        kept["embed"] = template["embed"]
    if is_last:
        kept["norm"] = template["norm"]
        kept["lm_head"] = template["lm_head"]
    return kept


def draw_stage_base(config: DecoderConfig, layers: range, *, is_first: bool, is_last: bool, device: Any,
                    dtype: torch.dtype, base_precision: str, fp8_keep: Any) -> Any:
    """A random base's weights for one stage, on its device (quantized to FP8 or NF4 when asked)."""
    params = random_base_params(config, layers, is_first=is_first, is_last=is_last, device=device, dtype=dtype)
    if base_precision == "fp8":
        params = quantize_base_fp8(params, embedding=not config.tie_word_embeddings, keep_layers=fp8_keep)
    elif base_precision == "nf4":
        from ..model.hf_loading import quantize_base_nf4

        params = quantize_base_nf4(params)
    return params


def bank_layer(key: str) -> int | None:
    """Decoder layer of an adapter-bank state key (``bank.adapters.<adapter>.<layer>.<module>...``),
    None for any other key."""
    parts = key.split(".")
    return int(parts[3]) if len(parts) > 3 and parts[:2] == ["bank", "adapters"] else None
