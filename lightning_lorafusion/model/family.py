"""Decoder families as data: how a family's block differs from Llama's, and the per-piece functions.

A ``DecoderFamily`` names the few ways the supported decoder families differ (norm weight
convention and placement, q/k norms, MLP activation, embedding scale, soft-caps, query scale,
per-layer RoPE base). It is read once from the HF config (``DecoderFamily.from_hf``); the
training block (``decoder.decoder_layer``) is built from it through the pieces below, and the
serving engine's paged forward is meant to call the same pieces. Adding a family is one entry in
``_FAMILY_FIELDS`` (plus its checkpoint names in ``norm_keys``), not a copy of the block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..kernels.reference import offset_rms_norm, rms_norm
from ..specs import ConfigError

NORM_OFFSETS = (0.0, 1.0)
QK_NORMS = ("none", "head", "projection")
ACTIVATIONS = ("silu", "gelu_tanh")
_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True, kw_only=True)
class DecoderFamily:
    """How one decoder family's block differs from Llama's (the defaults are Llama's).

    ``norm_offset``: RMSNorm multiplies by ``w`` (0.0) or ``1 + w`` (1.0, Gemma; statistics and
    the product in fp32, cast after). ``input_norms``: a norm before attention and before the
    MLP (pre-norm). ``output_norms``: a norm of the attention output and of the MLP output before
    each residual add (Gemma 2/3: both kinds; OLMo 2: output norms only). ``qk_norm``: RMSNorm
    of q and k before RoPE, per head over ``head_dim`` ("head": Qwen3, Gemma 3) or over the whole
    projection ("projection": OLMo 2). ``activation``: the gated MLP's ``act(gate) * up``
    ("silu" or "gelu_tanh"). ``embedding_scale``: multiply embeddings by ``sqrt(hidden)``
    (rounded to the model dtype, as HF does). ``attn_logit_softcap`` / ``final_logit_softcap``:
    ``cap * tanh(x / cap)`` of attention scores / output logits. ``query_pre_attn_scalar``:
    attention scale ``s ** -0.5`` instead of ``head_dim ** -0.5``. ``local_rope_theta``: RoPE
    base of the sliding-window layers (Gemma 3; always default RoPE there), the global layers
    keep the config's RoPE. ``fused_qkv`` / ``fused_gate_up``: the checkpoint holds q/k/v as one
    ``qkv_proj`` and gate/up as one ``gate_up_proj`` (Phi-3/4); they stay fused here, LoRA
    targets them under those names (as PEFT does) and the outputs are split after the product.
    """

    name: str = "llama"
    norm_offset: float = 0.0
    input_norms: bool = True
    output_norms: bool = False
    qk_norm: str = "none"
    activation: str = "silu"
    embedding_scale: bool = False
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float | None = None
    fused_qkv: bool = False
    fused_gate_up: bool = False

    def __post_init__(self) -> None:
        if self.norm_offset not in NORM_OFFSETS:
            raise ConfigError(f"DecoderFamily.norm_offset={self.norm_offset!r}; allowed: {NORM_OFFSETS}")
        if self.qk_norm not in QK_NORMS:
            raise ConfigError(f"DecoderFamily.qk_norm={self.qk_norm!r}; allowed: {QK_NORMS}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"DecoderFamily.activation={self.activation!r}; allowed: {ACTIVATIONS}")
        if not (self.input_norms or self.output_norms):
            raise ConfigError(f"DecoderFamily {self.name!r}: a block needs input_norms or output_norms")
        for name in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"DecoderFamily.{name}={value!r} must be > 0 or None")

    @property
    def is_llama_block(self) -> bool:
        """True when the block is exactly Llama's (what a caller without the pieces computes)."""
        return self == DecoderFamily(name=self.name)

    @property
    def projections(self) -> tuple[str, ...]:
        """The layer's projection names in this family's checkpoints (and LoRA targets)."""
        attn = ("qkv_proj",) if self.fused_qkv else ("q_proj", "k_proj", "v_proj")
        mlp = ("gate_up_proj",) if self.fused_gate_up else ("gate_proj", "up_proj")
        return (*attn, "o_proj", *mlp, "down_proj")

    def norm_keys(self) -> dict[str, str]:
        """Our layer norm names -> HF names under ``model.layers.{i}.`` for this family."""
        keys: dict[str, str] = {}
        if self.input_norms:
            keys["attn_norm"] = "input_layernorm"
            keys["mlp_norm"] = "pre_feedforward_layernorm" if self.output_norms else "post_attention_layernorm"
        if self.output_norms:
            keys["attn_post_norm"] = "post_attention_layernorm"
            keys["mlp_post_norm"] = "post_feedforward_layernorm"
        if self.qk_norm != "none":
            keys["q_norm"] = "self_attn.q_norm"
            keys["k_norm"] = "self_attn.k_norm"
        return keys

    @classmethod
    def from_hf(cls, hf_config: Any) -> "DecoderFamily":
        """The family of a transformers config; ConfigError for a model type or feature not covered."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in _FAMILY_FIELDS:
            hint = (" (a multimodal Gemma 3: load its text model, model_type 'gemma3_text')"
                    if model_type == "gemma3" else "")
            raise ConfigError(f"model_type={model_type!r} is not supported{hint}; supported: {SUPPORTED_MODEL_TYPES}")
        fields = dict(_FAMILY_FIELDS[model_type])
        act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu")
        if _HF_ACTIVATIONS.get(act) is None:
            raise ConfigError(f"{model_type}: hidden_act={act!r} is not supported; allowed: {sorted(_HF_ACTIVATIONS)}")
        fields["activation"] = _HF_ACTIVATIONS[act]
        if getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None):
            raise ConfigError(f"{model_type}: mixture-of-experts configs are not supported")
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ConfigError(f"{model_type}: use_bidirectional_attention=True is not supported; the decoder is causal")
        if model_type in ("gemma2", "gemma3_text"):
            fields["attn_logit_softcap"] = getattr(hf_config, "attn_logit_softcapping", None)
            fields["final_logit_softcap"] = getattr(hf_config, "final_logit_softcapping", None)
            fields["query_pre_attn_scalar"] = getattr(hf_config, "query_pre_attn_scalar", None)
        if model_type == "gemma3_text":
            fields["local_rope_theta"] = _local_rope_theta(hf_config)
        return cls(name=model_type, **fields)


_GEMMA = dict(norm_offset=1.0, output_norms=True, embedding_scale=True)
_FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": dict(qk_norm="head"),
    "olmo2": dict(input_norms=False, output_norms=True, qk_norm="projection"),
    "phi3": dict(fused_qkv=True, fused_gate_up=True),
    "gemma2": dict(_GEMMA),
    "gemma3_text": dict(_GEMMA, qk_norm="head"),
}
SUPPORTED_MODEL_TYPES = tuple(_FAMILY_FIELDS)


def _local_rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if local is None:  # transformers v4 spelling
        theta = getattr(hf_config, "rope_local_base_freq", None)
        if theta is None:
            raise ConfigError("gemma3_text: the config names no RoPE base for sliding layers "
                              "(rope_parameters['sliding_attention'] or rope_local_base_freq)")
        return float(theta)
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"gemma3_text: sliding layers' rope_type={local.get('rope_type')!r}; only 'default'")
    return float(local["rope_theta"])


# --------------------------------------------------------------------------- per-piece functions
# Pure tensor functions the training block uses and the serving forward can share.


def family_norm(family: DecoderFamily):
    """The family's RMSNorm ``(x, weight, eps) -> y`` (Llama's ``w * x`` or Gemma's ``(1 + w) * x``)."""
    return offset_rms_norm if family.norm_offset else rms_norm


def add_rms_norm(h: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, eps: float):
    h = h + o
    return h, rms_norm(h, weight, eps)


def add_offset_rms_norm(h: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, eps: float):
    h = h + o
    return h, offset_rms_norm(h, weight, eps)


def family_add_norm(family: DecoderFamily):
    """``(h, o, weight, eps) -> (h + o, norm(h + o))`` with the family's RMSNorm (one group to fuse)."""
    return add_offset_rms_norm if family.norm_offset else add_rms_norm


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def geglu_tanh(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.gelu(g, approximate="tanh") * u


def gated_activation(family: DecoderFamily):
    """The MLP's ``(gate, up) -> act(gate) * up`` for the family."""
    return geglu_tanh if family.activation == "gelu_tanh" else swiglu


def qk_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
            eps: float, family: DecoderFamily) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[T, Hq, D]``, k ``[T, Hkv, D]`` normed per head ("head", weights ``[D]``) or over the
    whole projection ("projection", weights ``[Hq*D]`` / ``[Hkv*D]``); unchanged for "none"."""
    if family.qk_norm == "none":
        return q, k
    norm = family_norm(family)
    if family.qk_norm == "head":
        return norm(q, q_weight, eps), norm(k, k_weight, eps)
    t = q.shape[0]
    return (norm(q.reshape(t, -1), q_weight, eps).view_as(q), norm(k.reshape(t, -1), k_weight, eps).view_as(k))


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (identity for ``cap=None``)."""
    return x if cap is None else torch.tanh(x / cap) * cap


def embedding_multiplier(family: DecoderFamily, hidden_size: int, dtype: torch.dtype) -> float | None:
    """The factor embeddings are multiplied by (``sqrt(hidden)`` rounded to ``dtype`` as HF
    does), or None for families without one."""
    if not family.embedding_scale:
        return None
    return torch.tensor(math.sqrt(hidden_size), dtype=dtype).item()


def attention_scale(family: DecoderFamily, head_dim: int) -> float:
    """Softmax scale of the attention scores."""
    scalar = family.query_pre_attn_scalar
    return (scalar if scalar is not None else head_dim) ** -0.5
