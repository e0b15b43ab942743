"""The decoder's shape and math options (``DecoderConfig``, read from an HF config with
``from_hf``) and its rotary tables (``rope_inv_freq``, ``rope_cos_sin``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..specs import ConfigError
from .family import DecoderFamily

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
PARTIAL_ROTARY_TYPES = ("phi3",)  # model types whose HF model rotates only part of each head


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
    rope_factor: float = 1.0  # "linear", "llama3", "yarn", "longrope" (longrope: only its attention factor)
    rope_low_freq_factor: float = 1.0  # "llama3"
    rope_high_freq_factor: float = 4.0  # "llama3"
    rope_original_max_positions: int = 8192  # "llama3", "yarn", "longrope"
    rope_attention_factor: float = 1.0  # "yarn", "longrope": cos and sin are multiplied by it
    rope_beta_fast: float = 32.0  # "yarn"
    rope_beta_slow: float = 1.0  # "yarn"
    rope_truncate: bool = True  # "yarn"
    rope_short_factor: tuple[float, ...] = ()  # "longrope": one per rotated frequency
    rope_long_factor: tuple[float, ...] = ()  # "longrope"
    partial_rotary_factor: float = 1.0  # the first int(head_dim * this) dims of each head rotate
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
        rd = self.rotary_dim
        if not 0 < self.partial_rotary_factor <= 1 or rd < 2 or rd % 2:
            raise ConfigError(f"DecoderConfig.partial_rotary_factor={self.partial_rotary_factor} gives "
                              f"rotary_dim={rd} of head_dim={self.head_dim}; it must be even and >= 2")
        if self.rope_type == "longrope" and not (len(self.rope_short_factor) == len(self.rope_long_factor) == rd // 2):
            raise ConfigError(f"DecoderConfig: longrope needs rope_short_factor and rope_long_factor of "
                              f"rotary_dim / 2 = {rd // 2} entries each; got {len(self.rope_short_factor)} and "
                              f"{len(self.rope_long_factor)}")
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

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that RoPE rotates (``head_dim`` unless partial rotary)."""
        return int(self.head_dim * self.partial_rotary_factor)

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
    # transformers v5 keeps everything in `rope_parameters`; v4 has rope_theta + rope_scaling
    # (+ partial_rotary_factor and Phi-3's original_max_position_embeddings at the top level).
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if "full_attention" in params:  # per layer type (Gemma 3): the global layers' RoPE here
        params = dict(params["full_attention"])
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su" and hf_config.model_type == "phi3":  # Phi-3's old name (as transformers maps it)
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"rope type {rope_type!r} is not supported (supported: {ROPE_TYPES}); dynamic NTK scaling "
            "changes the frequencies with the sequence length and is not implemented"
        )
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial not in (None, 1.0) and hf_config.model_type not in PARTIAL_ROTARY_TYPES:
        raise ConfigError(f"{hf_config.model_type}: partial_rotary_factor={partial} is not applied by this "
                          f"family's transformers model (it rotates whole heads); only {PARTIAL_ROTARY_TYPES} "
                          "rotate part of each head: remove the field or use one of those model types")
    out = {"rope_theta": float(params["rope_theta"]), "rope_type": rope_type,
           "partial_rotary_factor": float(1.0 if partial is None else partial)}
    if rope_type == "default":
        return out
    max_pos = hf_config.max_position_embeddings
    original = getattr(hf_config, "original_max_position_embeddings", None)  # Phi-3 keeps it outside
    original = int(original or params.get("original_max_position_embeddings") or max_pos)
    factor = params.get("factor")
    if rope_type in ("linear", "llama3"):
        out["rope_factor"] = float(factor)
    if rope_type == "llama3":
        out["rope_low_freq_factor"] = float(params["low_freq_factor"])
        out["rope_high_freq_factor"] = float(params["high_freq_factor"])
        out["rope_original_max_positions"] = int(params["original_max_position_embeddings"])
    if rope_type in ("yarn", "longrope"):
        # no factor: the ratio of the context to the pretraining one (DeepSeek-V3, Phi-3)
        factor = float(max_pos / original if factor is None else factor)
        out.update(rope_factor=factor, rope_original_max_positions=original,
                   rope_attention_factor=_rope_attention_factor(rope_type, params, factor, original))
    if rope_type == "yarn":
        out.update(rope_beta_fast=float(params.get("beta_fast") or 32), rope_beta_slow=float(params.get("beta_slow") or 1),
                   rope_truncate=bool(params.get("truncate", True)))
    if rope_type == "longrope":
        out.update(rope_short_factor=tuple(float(x) for x in params["short_factor"]),
                   rope_long_factor=tuple(float(x) for x in params["long_factor"]))
    return out


def _rope_attention_factor(rope_type: str, params: dict, factor: float, original: int) -> float:
    """The factor cos and sin are multiplied by: the config's ``attention_factor``, else YaRN's
    ``0.1 ln(s) + 1`` (with DeepSeek's ``mscale`` / ``mscale_all_dim`` ratio) or LongRoPE's
    ``sqrt(1 + ln(s) / ln(original))``."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if rope_type == "yarn":
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        return yarn_mscale(factor)
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


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


def rope_inv_freq(config: DecoderConfig, device=None, *, local: bool = False, long: bool = False) -> torch.Tensor:
    """``[rotary_dim/2]`` fp32 inverse frequencies for the config's RoPE variant; ``local=True``:
    the family's sliding-layer RoPE (default RoPE at ``family.local_rope_theta``, Gemma 3);
    ``long``: longrope's long factors (else its short ones; see ``rope_long_rows``)."""
    d = config.rotary_dim
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
    if config.rope_type == "yarn":
        return _yarn_inv_freq(config, device)
    if config.rope_type == "longrope":
        factors = config.rope_long_factor if long else config.rope_short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=device) * config.rope_theta**exponents)
    return inv_freq


def _yarn_inv_freq(config: DecoderConfig, device) -> torch.Tensor:
    # YaRN: interpolate (divide by `factor`) the low frequencies, keep (extrapolate) the high
    # ones, with a linear ramp over the dims whose rotations over the pretraining context fall
    # between beta_slow and beta_fast.
    d, base, original = config.rotary_dim, config.rope_theta, config.rope_original_max_positions

    def correction_dim(rotations: float) -> float:
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(config.rope_beta_fast), correction_dim(config.rope_beta_slow)
    if config.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # a one-point ramp
    pos_freqs = base ** (torch.arange(0, d, 2, device=device, dtype=torch.float) / d)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    return (1.0 / (config.rope_factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_long_rows(config: DecoderConfig, position_ids: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    """``[T]`` bool: the tokens that take longrope's long factors (None for other RoPE types).

    The rule is HF's for one forward of a sequence: its frequencies are the long ones when the
    sequence is longer than ``original_max_position_embeddings`` (its last position + 1), the
    short ones otherwise, for every token of it. Packed samples (``cu_seqlens``) decide each
    for itself, as HF on each sample alone; without ``cu_seqlens`` the tokens are one sequence."""
    if config.rope_type != "longrope":
        return None
    t = position_ids.shape[0]
    if cu_seqlens is None:
        return (position_ids.max() + 1 > config.rope_original_max_positions).expand(t)
    cu = cu_seqlens.to(device=position_ids.device, dtype=torch.int64)
    sample = torch.searchsorted(cu[1:], torch.arange(t, device=position_ids.device), right=True)
    last = (cu[1:].index_select(0, sample.clamp(max=cu.numel() - 2)) - 1).clamp(0, t - 1)
    return position_ids.index_select(0, last) + 1 > config.rope_original_max_positions


def rope_cos_sin(
    config: DecoderConfig, position_ids: torch.Tensor, dtype: torch.dtype, inv_freq: torch.Tensor | None = None,
    *, local: bool = False, long: torch.Tensor | None = None, long_inv_freq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids ``[T]`` -> cos, sin ``[T, 1, rotary_dim]`` (broadcast over heads), times the
    RoPE's attention factor (YaRN, LongRoPE; computed in fp32, rounded once, as HF does).
    ``inv_freq``: the config's ``rope_inv_freq`` if the caller keeps it; ``local``: see
    ``rope_inv_freq``; ``long``: ``[T]`` bool, longrope's long factors on those rows
    (``rope_long_rows``; None: the short ones), ``long_inv_freq`` their frequencies if kept."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(config, position_ids.device, local=local)
    if long is not None and not local:
        if long_inv_freq is None:
            long_inv_freq = rope_inv_freq(config, position_ids.device, long=True)
        inv_freq = torch.where(long[:, None], long_inv_freq[None, :], inv_freq[None, :])
    freqs = position_ids.float()[:, None] * inv_freq  # [T, rotary_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    scale = 1.0 if local else config.rope_attention_factor
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)
