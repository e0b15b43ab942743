"""``model.precision``: how the frozen base is stored and multiplied (``base``), with one
sub-section of options per low-precision format (``fp8``, ``nf4``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels.options import NF4_GEMM_MODES
from ..specs import ConfigError, parse_section

BASE_PRECISIONS = ("bf16", "fp8", "nf4")


@dataclass(frozen=True, kw_only=True)
class Fp8Config:
    """``model.precision.fp8``: options of an FP8 base (``precision.base: fp8``).

    - ``fast_accumulation``: the FP8 products (forward and input gradient) accumulate in the
      tensor cores' narrower accumulator (faster; docs/kernels.md "FP8 base"); false keeps
      fp32 accumulation. Passed to this module's decoder only, never process-wide.
    - ``exempt_layers``: the first and last n decoder layers keep their projections in
      ``model.dtype`` (0 quantizes every layer).
    - ``emulate``: for tests: allow an FP8 base without FP8 tensor cores (CPU) by emulating
      the FP8 products (quantize, dequantize, fp32 matmul).
    """

    fast_accumulation: bool = True
    exempt_layers: int = 0
    emulate: bool = False

    def __post_init__(self) -> None:
        for name in ("fast_accumulation", "emulate"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"model.precision.fp8.{name}={getattr(self, name)!r} must be true or false")
        if isinstance(self.exempt_layers, bool) or not isinstance(self.exempt_layers, int) or self.exempt_layers < 0:
            raise ConfigError(f"model.precision.fp8.exempt_layers={self.exempt_layers!r} must be an int >= 0")


@dataclass(frozen=True, kw_only=True)
class Nf4Config:
    """``model.precision.nf4``: options of an NF4 base (``precision.base: nf4``).

    - ``gemm``: how the frozen products read the 4-bit weights: ``buffer`` (each weight
      dequantized into a reused scratch buffer, then cuBLAS), ``fused`` (the NF4 GEMM kernel
      dequantizes inside its operand tiles; CUDA, or the Triton interpreter on CPU) or
      ``auto`` (``buffer`` for now: docs/BENCHMARKS.md "NF4 frozen base" has the comparison).
    """

    gemm: str = "auto"

    def __post_init__(self) -> None:
        if self.gemm not in NF4_GEMM_MODES:
            raise ConfigError(f"model.precision.nf4.gemm={self.gemm!r}; allowed: {NF4_GEMM_MODES}")


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """``model.precision``: ``base`` is the frozen projections' format: ``bf16`` (they multiply
    in ``model.dtype``), ``fp8`` (float8 e4m3 weights, products on FP8 tensor cores; options
    in ``fp8``) or ``nf4`` (QLoRA: bitsandbytes' 4-bit NF4 weights, blocks of 64 with a
    double-quantized absmax, quantized at load or kept from a ``*-bnb-4bit`` checkpoint; each
    products read the 4-bit weight as ``nf4.gemm`` says; docs/model.md "NF4 base (QLoRA)").
    The LoRA path, norms, attention, LM head and loss stay in ``model.dtype``."""

    base: str = "bf16"
    fp8: Fp8Config = field(default_factory=Fp8Config)
    nf4: Nf4Config = field(default_factory=Nf4Config)

    def __post_init__(self) -> None:
        if isinstance(self.fp8, dict):
            object.__setattr__(self, "fp8", Fp8Config(**self.fp8))
        if isinstance(self.nf4, dict):
            object.__setattr__(self, "nf4", Nf4Config(**self.nf4))
        if self.base not in BASE_PRECISIONS:
            raise ConfigError(f"model.precision.base={self.base!r}; allowed: {BASE_PRECISIONS}")
        if self.fp8.exempt_layers and self.base != "fp8":
            raise ConfigError(f"model.precision.fp8.exempt_layers={self.fp8.exempt_layers!r} applies only with "
                              "model.precision.base: fp8")
        if self.nf4.gemm != "auto" and self.base != "nf4":
            raise ConfigError(f"model.precision.nf4.gemm={self.nf4.gemm!r} applies only with "
                              "model.precision.base: nf4")

    @classmethod
    def parse(cls, value: "PrecisionConfig | dict | None") -> "PrecisionConfig":
        """A ``PrecisionConfig`` from itself, a mapping (YAML, Python) or None (the default)."""
        return parse_section(cls, value, where="model.precision", scalar_field="base",
                             fields="base, fp8 (fp8: fast_accumulation, exempt_layers, emulate), nf4 (nf4: gemm)")


def check_base_precision(precision: PrecisionConfig, dtype: str) -> None:
    """``ConfigError`` when the base's format cannot run here or with this ``dtype``."""
    if precision.base != "fp8" or precision.fp8.emulate:
        return
    from ..kernels.fp8_linear import MIN_CAPABILITY, fp8_supported

    if not torch.cuda.is_available() or not fp8_supported(torch.device("cuda")):
        found = (f"compute capability {torch.cuda.get_device_capability()}" if torch.cuda.is_available()
                 else "no CUDA GPU")
        raise ConfigError(
            f"model.precision.base='fp8' needs FP8 tensor cores: a CUDA GPU with compute capability "
            f">= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada, Hopper); found {found}. Use "
            "precision: {base: bf16}"
        )
    if dtype != "bfloat16":
        raise ConfigError(
            f"model.precision.base='fp8' computes with bfloat16 activations; model.dtype={dtype!r}. "
            "Set model.dtype: bfloat16 (and trainer.precision: bf16-true)"
        )
