"""Functional decoder of the supported families (Llama, Mistral, Qwen2/3, OLMo 2, Gemma 2/3): pure
functions over a params pytree. How a family's block differs is ``config.family``
(``family.DecoderFamily``); the block below is built from its per-piece functions.

Params pytree (plain nested dicts; the frozen base tensors are never copied)::

    {"embed": [V, H],
     "layers": [{"attn_norm": [H],
                 "q_proj": {"weight": [Hq*D, H], "bias"?: [Hq*D]},
                 "k_proj": {"weight": [Hkv*D, H], "bias"?}, "v_proj": {...},
                 "o_proj": {"weight": [H, Hq*D], "bias"?},
                 "mlp_norm": [H],
                 "gate_proj": {"weight": [I, H]}, "up_proj": {...}, "down_proj": {"weight": [H, I]},
                 # by family (DecoderFamily.norm_keys): "attn_post_norm", "mlp_post_norm": [H]
                 # (Gemma, OLMo 2; OLMo 2 has no attn_norm/mlp_norm); "q_norm", "k_norm": [D]
                 # per head (Qwen3, Gemma 3) or [Hq*D] / [Hkv*D] whole projection (OLMo 2)
                 },
                ...],   # FP8 base: each {"weight": W} is {"weight_fp8": uint8 bits, "weight_scale": [N]}
                        # NF4 base: {"weight_nf4": uint8 [N, K/2], "nf4_absmax", ...} (kernels/nf4.py)
     "norm": [H],
     "lm_head": [V, H]}   # the same tensor object as "embed" when embeddings are tied

An FP8 base with untied embeddings may also hold "embed" as {"weight_fp8": [V, H], "weight_scale":
[V]} (per-row scales in the model's dtype; ``hf_loading.quantize_base_fp8(embedding=True)``).

Microbatches are packed: ``T`` tokens of several samples, ``cu_seqlens`` marks their
boundaries and ``position_ids`` restart at 0 per sample. Labels are PRE-SHIFTED by the data
layer: ``labels[t]`` is the target predicted from position ``t`` (IGNORE_INDEX where none), so
the model never shifts. A pipeline stage calls ``embed``, ``decoder_layers`` over its slice of
layers, and (last stage) ``head_loss_sums``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..kernels.api import lora_projections
from ..kernels.dropout import dropout_offset
from ..kernels.fp8_linear import SCALE_KEY, Fp8Weight, QuantizedOperands, fp8_embedding, fp8_swiglu, is_quantized
from ..kernels.linear_cross_entropy import linear_cross_entropy_sums
from ..kernels.nf4 import Nf4Weight, is_nf4
from ..kernels.options import KernelOptions
from ..kernels.reference import LoraModuleWeights, LoraRouting, apply_rope, rms_norm
from ..specs import IGNORE_INDEX, ConfigError
from .attention import varlen_causal_attention
from .family import (
    SUPPORTED_MODEL_TYPES,
    DecoderFamily,
    attention_scale,
    embedding_multiplier,
    family_add_norm,
    family_norm,
    gated_activation,
    qk_norm,
    soft_cap,
    swiglu,
)

ROPE_TYPES = ("default", "linear", "llama3")
LM_HEAD_LOSSES = ("checkpointed", "fused")  # head_loss_sums: recompute chunks / fused linear CE
ELEMENTWISE_FUSION_MODES = ("auto", "on", "off")

# (layer index, module name) -> that projection's LoRA factors over all adapters of the bank.
BankView = Mapping[tuple[int, str], LoraModuleWeights]


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Shape and math options of a decoder; build it with ``from_hf``. ``family``: how the
    block differs from Llama's (``DecoderFamily``; the default is Llama's block)."""

    model_type: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0  # "linear" and "llama3"
    rope_low_freq_factor: float = 1.0  # "llama3"
    rope_high_freq_factor: float = 4.0  # "llama3"
    rope_original_max_positions: int = 8192  # "llama3"
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer; () means none anywhere
    family: DecoderFamily = field(default_factory=DecoderFamily)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"DecoderConfig.{name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"DecoderConfig: num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ConfigError(f"DecoderConfig.head_dim={self.head_dim} must be even for RoPE")
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"DecoderConfig.rope_type={self.rope_type!r} is not supported; allowed: {ROPE_TYPES}"
            )
        if not isinstance(self.family, DecoderFamily):
            raise ConfigError(f"DecoderConfig.family must be a DecoderFamily; got {type(self.family).__name__}")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ConfigError(
                f"DecoderConfig.sliding_windows has {len(self.sliding_windows)} entries; "
                f"need one per layer ({self.num_layers}) or none"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def sliding_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    def local_rope(self, layer: int) -> bool:
        """True where the layer uses the family's local RoPE base (Gemma 3's sliding layers)."""
        return self.family.local_rope_theta is not None and self.sliding_window(layer) is not None

    def module_dims(self, module: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of a projection, e.g. ``"k_proj" -> (H, Hkv*D)``; also
        the fused ``qkv_proj`` / ``gate_up_proj``. Which ones a layer holds: ``family.projections``."""
        h, i = self.hidden_size, self.intermediate_size
        dims = {"q_proj": (h, self.q_size), "k_proj": (h, self.kv_size), "v_proj": (h, self.kv_size),
                "qkv_proj": (h, self.q_size + 2 * self.kv_size), "o_proj": (self.q_size, h),
                "gate_proj": (h, i), "up_proj": (h, i), "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
        if module not in dims:
            raise ConfigError(f"unknown module {module!r}; allowed: {list(dims)}")
        return dims[module]

    @classmethod
    def from_hf(cls, hf_config: Any) -> "DecoderConfig":
        """From a transformers config of a supported family (``SUPPORTED_MODEL_TYPES``; v4 or v5)."""
        family = DecoderFamily.from_hf(hf_config)  # ConfigError for an unknown type or feature
        model_type = hf_config.model_type
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        rope = _rope_fields(hf_config)
        n_layers = hf_config.num_hidden_layers
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type not in ("mistral", "qwen2", "phi3") and attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            sliding_windows=_sliding_windows(hf_config, model_type, n_layers),
            family=family,
            **rope,
        )


def _rope_fields(hf_config: Any) -> dict:
    # transformers v5 keeps everything in `rope_parameters`; v4 has rope_theta + rope_scaling.
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if "full_attention" in params:  # per layer type (Gemma 3): the global layers' RoPE here
        params = dict(params["full_attention"])
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"rope type {rope_type!r} is not supported (supported: {ROPE_TYPES}); "
            "dynamic/yarn/longrope scaling are not implemented"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("partial_rotary_factor != 1 is not supported by the Llama-family decoder")
    out = {"rope_theta": float(params["rope_theta"]), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        out["rope_factor"] = float(params["factor"])
    if rope_type == "llama3":
        out["rope_low_freq_factor"] = float(params["low_freq_factor"])
        out["rope_high_freq_factor"] = float(params["high_freq_factor"])
        out["rope_original_max_positions"] = int(params["original_max_position_embeddings"])
    return out


def _sliding_windows(hf_config: Any, model_type: str, n_layers: int) -> tuple[int | None, ...]:
    window = getattr(hf_config, "sliding_window", None)
    if window is None or (model_type in ("qwen2", "qwen3")
                          and not getattr(hf_config, "use_sliding_window", False)):
        return ()
    layer_types = getattr(hf_config, "layer_types", None)
    if model_type in ("gemma2", "gemma3_text") and layer_types is None:
        raise ConfigError(f"{model_type}: the config has sliding_window but no layer_types; "
                          "save it with a transformers version that writes layer_types")
    if model_type in ("qwen2", "qwen3", "gemma2", "gemma3_text") and layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if model_type in ("llama", "olmo2"):
        return ()
    return (window,) * n_layers


# --------------------------------------------------------------------------- building blocks


def rope_inv_freq(config: DecoderConfig, device=None, *, local: bool = False) -> torch.Tensor:
    """``[D/2]`` fp32 inverse frequencies for the config's RoPE variant; ``local=True``: the
    family's sliding-layer RoPE (default RoPE at ``family.local_rope_theta``, Gemma 3)."""
    d = config.head_dim
    exponents = torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d
    if local:
        return 1.0 / (config.family.local_rope_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_type == "linear":
        return inv_freq / config.rope_factor
    if config.rope_type == "llama3":
        # Llama 3.1: stretch low frequencies by `factor`, keep high ones, blend in between.
        factor, old_len = config.rope_factor, config.rope_original_max_positions
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, blended, scaled)
    return inv_freq


def rope_cos_sin(
    config: DecoderConfig, position_ids: torch.Tensor, dtype: torch.dtype, inv_freq: torch.Tensor | None = None,
    *, local: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids ``[T]`` -> cos, sin ``[T, 1, D]`` (broadcast over heads); ``inv_freq``: the
    config's ``rope_inv_freq`` if the caller keeps it (the serving loop does, per step);
    ``local``: see ``rope_inv_freq``."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(config, position_ids.device, local=local)
    freqs = position_ids.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


# ------------------------------------------------------------------- elementwise fusion
# Between the GEMMs a layer runs RMSNorm (twice), residual adds, RoPE on q and k and SwiGLU's
# silu(g) * u: about 40 memory-bound kernels per layer forward and backward in eager mode
# (docs/model.md, "Elementwise fusion (torch.compile)"). torch.compile (inductor) fuses each group below into
# one kernel forward and one backward. The functions are the eager ones, only compiled; "auto"
# fuses on CUDA with the Triton LoRA backend (the fast path) and leaves the torch reference
# path eager.


@dataclass(frozen=True, kw_only=True)
class DecoderOptions:
    """How the decoder computes (never what): passed to ``decoder_layers`` and the functions
    above it, instead of process-wide switches.

    ``elementwise_fusion``: "auto" (compile the elementwise groups on CUDA with the Triton
    backend), "on" (always) or "off"; ``fusion_compiler``: the torch.compile backend
    ("inductor"; "aot_eager" traces without code generation, for tests); ``kernels``: the
    kernels' options (``KernelOptions``: FP8 accumulation)."""

    elementwise_fusion: str = "auto"
    fusion_compiler: str = "inductor"
    kernels: KernelOptions = field(default_factory=KernelOptions)

    def __post_init__(self) -> None:
        if self.elementwise_fusion not in ELEMENTWISE_FUSION_MODES:
            raise ValueError(f"DecoderOptions.elementwise_fusion={self.elementwise_fusion!r}; "
                             "allowed: 'auto', 'on', 'off'")
        if not isinstance(self.kernels, KernelOptions):
            raise TypeError(f"DecoderOptions.kernels must be a KernelOptions; got {type(self.kernels).__name__}")


DEFAULT_OPTIONS = DecoderOptions()
_COMPILED: dict[tuple[Any, str], Any] = {}  # cache: (eager function, compiler) -> compiled


def _fuse(backend: str, x: torch.Tensor, options: DecoderOptions) -> bool:
    mode = options.elementwise_fusion
    return mode == "on" or (mode == "auto" and backend == "triton" and x.is_cuda)


def _compiled(fn, compiler: str):
    key = (fn, compiler)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, dynamic=False, fullgraph=True, backend=compiler)
    return _COMPILED[key]


def _rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


_swiglu = swiglu  # Llama's MLP group (the fusion tests look for it among the compiled ones)


def frozen_weight(p: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor | Fp8Weight | Nf4Weight, torch.Tensor | None]:
    """A projection's frozen weight and bias; an FP8 base (``hf_loading.quantize_base_fp8``)
    holds {"weight_fp8", "weight_scale"}, returned as an ``Fp8Weight``; an NF4 base
    (``hf_loading.quantize_base_nf4`` or a bitsandbytes 4-bit checkpoint) {"weight_nf4", ...},
    returned as an ``Nf4Weight``."""
    if is_nf4(p):
        return Nf4Weight.from_params(p), p.get("bias")
    return (Fp8Weight.from_params(p) if is_quantized(p) else p["weight"]), p.get("bias")


# --------------------------------------------------------------------------- the model


def embed(params: Mapping[str, Any], input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids ``[T]`` int -> hidden states ``[T, H]``."""
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be [tokens]; got shape {tuple(input_ids.shape)}")
    table = params["embed"]
    if is_quantized(table):  # FP8 table: gather, then dequantize the gathered rows only
        return fp8_embedding(input_ids, table)
    return F.embedding(input_ids, table)


def embedding_device_dtype(params: Mapping[str, Any]) -> tuple[torch.device, torch.dtype]:
    """Device and compute dtype of the base, read off its embedding (plain or FP8)."""
    table = params["embed"]
    if is_quantized(table):
        return table[SCALE_KEY].device, table[SCALE_KEY].dtype
    return table.device, table.dtype


def decoder_layer(
    lp: Mapping[str, Any],
    bank_view: BankView | None,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cu_seqlens: torch.Tensor,
    routing: LoraRouting | None,
    *,
    config: DecoderConfig,
    layer: int,
    microbatch_index: int,
    backend: str = "torch",
    max_seqlen: int | None = None,
    options: DecoderOptions = DEFAULT_OPTIONS,
) -> torch.Tensor:
    """One block ``h [T, H] -> [T, H]``: attention then gated MLP, each with LoRA, arranged as
    ``config.family`` says (Llama's pre-norm SwiGLU block by default). ``cos``/``sin``: this
    layer's RoPE (``decoder_layers`` picks the local or global one per layer)."""
    view = bank_view or {}
    kernel_options = options.kernels
    family, eps = config.family, config.rms_norm_eps

    def lora(*names: str) -> list[LoraModuleWeights | None]:
        return [view.get((layer, n)) for n in names]

    def offset(slot: int) -> int:
        return dropout_offset(microbatch_index, layer, slot)

    t = h.shape[0]
    norm, add_norm, act, rope_qk = family_norm(family), family_add_norm(family), gated_activation(family), _rope_qk
    if _fuse(backend, h, options):
        c = options.fusion_compiler
        norm, add_norm, rope_qk, act = (_compiled(norm, c), _compiled(add_norm, c),
                                        _compiled(_rope_qk, c), _compiled(act, c))
    x = norm(h, lp["attn_norm"], eps) if family.input_norms else h
    if family.fused_qkv:  # one product, split after (LoRA on the fused projection, as PEFT)
        wqkv, bqkv = frozen_weight(lp["qkv_proj"])
        (qkv,) = lora_projections(x, [wqkv], [bqkv], lora("qkv_proj"), routing, dropout_offset=offset(0),
                                  backend=backend, options=kernel_options)
        q, k, v = qkv.split([config.q_size, config.kv_size, config.kv_size], dim=-1)
    else:
        (wq, bq), (wk, bk), (wv, bv) = (frozen_weight(lp[m]) for m in ("q_proj", "k_proj", "v_proj"))
        q, k, v = lora_projections(x, [wq, wk, wv], [bq, bk, bv], lora("q_proj", "k_proj", "v_proj"),
                                   routing, dropout_offset=offset(0), backend=backend, options=kernel_options)
    q, k = q.reshape(t, config.num_heads, config.head_dim), k.reshape(t, config.num_kv_heads, config.head_dim)
    if family.qk_norm != "none":
        q, k = qk_norm(q, k, lp["q_norm"], lp["k_norm"], eps, family)
    q, k = rope_qk(q, k, cos, sin)
    v = v.reshape(t, config.num_kv_heads, config.head_dim)
    a = varlen_causal_attention(q, k, v, cu_seqlens, scale=attention_scale(family, config.head_dim),
                                sliding_window=config.sliding_window(layer), max_seqlen=max_seqlen,
                                softcap=family.attn_logit_softcap)
    wo, bo = frozen_weight(lp["o_proj"])
    (o,) = lora_projections(a.reshape(t, config.q_size), [wo], [bo], lora("o_proj"), routing,
                            dropout_offset=offset(1), backend=backend, options=kernel_options)
    if family.output_norms:
        o = norm(o, lp["attn_post_norm"], eps)
    if family.input_norms:
        h, x = add_norm(h, o, lp["mlp_norm"], eps)
    else:
        h = x = h + o
    wd, bd = frozen_weight(lp["down_proj"])
    operands = None
    if family.fused_gate_up:  # one product, chunked into gate and up after
        wgu, bgu = frozen_weight(lp["gate_up_proj"])
        (gu,) = lora_projections(x, [wgu], [bgu], lora("gate_up_proj"), routing, dropout_offset=offset(2),
                                 backend=backend, options=kernel_options)
        mid = act(*gu.chunk(2, dim=-1))
    else:
        (wg, bg), (wu, bu) = frozen_weight(lp["gate_proj"]), frozen_weight(lp["up_proj"])
        # FP8 MLP on the Triton backend: SwiGLU also quantizes h for down and the gate/up gradient
        # for dX, handed over through `operands` (the fused projections' backward takes the
        # gradient; the torch reference sums its gradient from slices and would not)
        fp8_mlp = (backend == "triton" and family.activation == "silu"
                   and all(isinstance(w, Fp8Weight) for w in (wg, wu, wd)))
        operands = QuantizedOperands() if fp8_mlp else None
        g, u = lora_projections(x, [wg, wu], [bg, bu], lora("gate_proj", "up_proj"), routing, dropout_offset=offset(2),
                                backend=backend, options=kernel_options, operands=operands)
        mid = fp8_swiglu(g, u, wg, wu, operands) if fp8_mlp else act(g, u)
    (d,) = lora_projections(mid, [wd], [bd], lora("down_proj"), routing,
                            dropout_offset=offset(3), backend=backend, options=kernel_options, operands=operands)
    if family.output_norms:
        d = norm(d, lp["mlp_post_norm"], eps)
    return h + d


def decoder_layers(
    params: Mapping[str, Any],
    bank_view: BankView | None,
    h: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    routing: LoraRouting | None,
    *,
    config: DecoderConfig,
    layers: range | Sequence[int] | None = None,
    microbatch_index: int | None = None,
    backend: str = "torch",
    max_seqlen: int | None = None,
    checkpoint_layers: bool | int = False,
    options: DecoderOptions = DEFAULT_OPTIONS,
) -> torch.Tensor:
    """Run ``params["layers"][i]`` for i in ``layers`` (global indices; default all): ``h [T, H]``.

    ``params["layers"]`` may be a list of all layers or a dict holding only this stage's.
    ``microbatch_index`` feeds dropout offsets; default ``routing.microbatch_index`` (or 0).
    ``max_seqlen``: longest attention block, if known (``Microbatch.max_seqlen``; spares the
    flash path a device->host sync).
    ``checkpoint_layers``: keep only a layer's input for backward and recompute the rest
    (dropout masks are hashes of (seed, offset), so the recomputation draws the same ones).
    ``True``: every layer; an int ``n``: the model's first ``n`` layers (global index < n), so
    a pipeline's early stages, which hold the most microbatches in flight, recompute first.
    ``options``: how the layers compute (``DecoderOptions``: elementwise fusion, FP8 accumulation).
    """
    t = h.shape[0]
    if h.dim() != 2 or h.shape[1] != config.hidden_size:
        raise ValueError(f"h must be [tokens, {config.hidden_size}]; got {tuple(h.shape)}")
    if position_ids.shape != (t,):
        raise ValueError(f"position_ids must be [{t}]; got {tuple(position_ids.shape)}")
    if routing is not None and routing.num_rows != t:
        raise ValueError(f"routing covers {routing.num_rows} rows but h has {t} tokens")
    if layers is None:
        layers = range(config.num_layers)
    if microbatch_index is None:
        microbatch_index = routing.microbatch_index if routing is not None else 0
    cos, sin = rope_cos_sin(config, position_ids, h.dtype)
    ropes = {False: (cos, sin)}
    if any(config.local_rope(i) for i in layers):
        ropes[True] = rope_cos_sin(config, position_ids, h.dtype, local=True)
    multiplier = embedding_multiplier(config.family, config.hidden_size, h.dtype)
    if multiplier is not None and 0 in layers:
        # the family's embedding scale (Gemma): applied here, before the first layer, so every
        # caller of ``embed`` (training, pipeline stages, CUDA graphs) gets it
        h = h * multiplier
    if isinstance(checkpoint_layers, bool):
        recompute_below = config.num_layers if checkpoint_layers else 0
    else:
        recompute_below = int(checkpoint_layers)
    recompute_below = recompute_below if torch.is_grad_enabled() else 0
    for i in layers:
        args = (params["layers"][i], bank_view, h, *ropes[config.local_rope(i)], cu_seqlens, routing)
        kwargs = dict(config=config, layer=i, microbatch_index=microbatch_index, backend=backend,
                      max_seqlen=max_seqlen, options=options)
        if i < recompute_below:
            # no torch RNG inside (dropout masks are hashes): nothing to preserve, and a CUDA
            # graph capture may not read or set the generator's state
            h = checkpoint(decoder_layer, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
        else:
            h = decoder_layer(*args, **kwargs)
    return h


def _token_losses(h: torch.Tensor, labels: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor,
                  eps: float, family: DecoderFamily | None = None) -> torch.Tensor:
    """``[C, H]`` -> per-token cross-entropy ``[C]`` fp32 (0 where label is IGNORE_INDEX)."""
    family = family or DecoderFamily()
    logits = F.linear(family_norm(family)(h, norm, eps), lm_head)  # [C, V], one chunk at a time
    logits = soft_cap(logits, family.final_logit_softcap).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")


def head_loss_sums(
    params: Mapping[str, Any],
    h: torch.Tensor,
    labels: torch.Tensor,
    segments: Sequence[tuple[int, int, int]],
    num_adapters: int,
    *,
    config: DecoderConfig,
    chunk_size: int = 1024,
    label_rows: torch.Tensor | None = None,
    lm_head_loss: str = "checkpointed",
    row_owner: torch.Tensor | None = None,
) -> torch.Tensor:
    """Final norm + LM head + cross-entropy, summed per adapter: ``[num_adapters]`` fp32.

    h ``[T, H]``, labels ``[T]`` (pre-shifted; IGNORE_INDEX = no target). Tokens outside every
    segment count for nobody. Logits exist for ``chunk_size`` tokens at a time; under autograd
    each chunk is checkpointed, so backward recomputes them instead of storing ``[T, V]``.
    Divide by the per-adapter label-token counts of the global batch to get mean losses.
    ``label_rows`` ``[n]`` int: the rows whose label is not IGNORE_INDEX, ascending (what
    ``Microbatch.label_rows`` holds, built on the host at packing); without it they are found
    with ``nonzero()``, a device->host sync. It is trusted, not checked (checking would sync).
    ``lm_head_loss``: "checkpointed" (backward recomputes each chunk's logits) or "fused"
    (``kernels.linear_cross_entropy``: the forward keeps the input gradient instead, one LM-head
    GEMM fewer; the final norm and LM head must be frozen). A family with a final logit
    soft-cap (Gemma 2) always takes the checkpointed path: the fused kernel has no soft-cap.
    ``row_owner`` ``[T]`` int64: each row's adapter (``num_adapters`` = nobody), given instead
    of ``segments`` (which are then ignored) by a CUDA graph that replays with new owners.
    """
    if lm_head_loss not in LM_HEAD_LOSSES:
        raise ConfigError(f"lm_head_loss={lm_head_loss!r}; allowed: {LM_HEAD_LOSSES}")
    t = h.shape[0]
    if labels.shape != (t,):
        raise ValueError(f"labels must be [{t}]; got {tuple(labels.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    if label_rows is not None and (label_rows.dim() != 1 or label_rows.shape[0] > t):
        raise ValueError(f"label_rows must be [n <= {t}] row indices; got {tuple(label_rows.shape)}")
    if row_owner is not None:
        if row_owner.shape != (t,):
            raise ValueError(f"row_owner must be [{t}]; got {tuple(row_owner.shape)}")
        owner = row_owner
    else:
        owner = torch.full((t,), num_adapters, dtype=torch.int64, device=h.device)  # last bucket: nobody
        for start, end, adapter in segments:
            if not 0 <= adapter < num_adapters:
                raise ValueError(f"segment adapter {adapter} out of range for {num_adapters} adapters")
            owner[start:end] = adapter
    sums = torch.zeros(num_adapters + 1, dtype=torch.float32, device=h.device)
    # Only label positions need logits: in instruction data most tokens are prompt, and the
    # LM head is the largest single GEMM of a small model. (Without label_rows: one host sync
    # for the count.)
    if label_rows is None:
        rows = (labels != IGNORE_INDEX).nonzero().squeeze(1)
    else:
        rows = label_rows.to(device=h.device, dtype=torch.int64, non_blocking=True)
    h, labels, owner = h.index_select(0, rows), labels.index_select(0, rows), owner.index_select(0, rows)
    if lm_head_loss == "fused" and config.family.final_logit_softcap is not None:
        lm_head_loss = "checkpointed"  # the fused linear cross-entropy has no logit soft-cap
    if lm_head_loss == "fused":
        if params["norm"].requires_grad:
            raise ValueError("lm_head_loss='fused' gives the final norm no gradient; it must be frozen")
        pre = functools.partial(family_norm(config.family), weight=params["norm"], eps=config.rms_norm_eps)
        return linear_cross_entropy_sums(h, params["lm_head"], labels, owner, num_adapters,
                                         chunk_size=chunk_size, pre=pre, ignore_index=IGNORE_INDEX)
    use_ckpt = torch.is_grad_enabled() and h.requires_grad
    for c0 in range(0, h.shape[0], chunk_size):
        args = (h[c0:c0 + chunk_size], labels[c0:c0 + chunk_size], params["norm"], params["lm_head"],
                config.rms_norm_eps, config.family)
        losses = (checkpoint(_token_losses, *args, use_reentrant=False, preserve_rng_state=False) if use_ckpt
                  else _token_losses(*args))
        sums = sums.index_add(0, owner[c0:c0 + chunk_size], losses)
    return sums[:num_adapters]


def logits(
    params: Mapping[str, Any],
    bank_view: BankView | None,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    routing: LoraRouting | None,
    *,
    config: DecoderConfig,
    backend: str = "torch",
    options: DecoderOptions = DEFAULT_OPTIONS,
) -> torch.Tensor:
    """Whole model, ``input_ids [T] -> logits [T, V]`` (for tests and inference)."""
    h = embed(params, input_ids)
    h = decoder_layers(params, bank_view, h, position_ids, cu_seqlens, routing, config=config,
                       backend=backend, options=options)
    out = F.linear(family_norm(config.family)(h, params["norm"], config.rms_norm_eps), params["lm_head"])
    return soft_cap(out, config.family.final_logit_softcap)


def forward_loss_sums(
    params: Mapping[str, Any],
    bank_view: BankView | None,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    routing: LoraRouting,
    *,
    config: DecoderConfig,
    backend: str = "torch",
    chunk_size: int = 1024,
    max_seqlen: int | None = None,
    label_rows: torch.Tensor | None = None,
    lm_head_loss: str = "checkpointed",
    options: DecoderOptions = DEFAULT_OPTIONS,
    checkpoint_layers: bool | int = False,
) -> torch.Tensor:
    """Whole model on one packed microbatch: per-adapter summed loss ``[num_adapters]`` fp32.
    ``max_seqlen`` / ``label_rows``: the microbatch's host-built metadata, if known (no syncs);
    ``lm_head_loss``: see ``head_loss_sums``; ``options`` and ``checkpoint_layers``: see
    ``decoder_layers``."""
    h = embed(params, input_ids)
    h = decoder_layers(params, bank_view, h, position_ids, cu_seqlens, routing, config=config,
                       backend=backend, max_seqlen=max_seqlen, options=options,
                       checkpoint_layers=checkpoint_layers)
    return head_loss_sums(params, h, labels, routing.segments, routing.num_adapters, config=config,
                          chunk_size=chunk_size, label_rows=label_rows, lm_head_loss=lm_head_loss)
