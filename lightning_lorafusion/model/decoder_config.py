"""The decoder's shape and math options (``DecoderConfig``, read from an HF config with
``from_hf``) and its rotary tables (``rope_inv_freq``, ``rope_cos_sin``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..specs import ConfigError
from .family import DecoderFamily

ROPE_TYPES = ("default", "linear", "llama3")


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
