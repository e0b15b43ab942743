"""``KernelOptions``: the choices that change how the kernels compute, passed as an argument
(to the decoder through ``model.decoder.DecoderOptions``) instead of process-wide switches."""

from __future__ import annotations

from dataclasses import dataclass

NF4_GEMM_MODES = ("auto", "buffer", "fused")


@dataclass(frozen=True, kw_only=True)
class KernelOptions:
    """``fp8_fast_accum_forward`` / ``fp8_fast_accum_input_grad``: an FP8 base's forward (Y)
    and input-gradient (dX) products use cuBLAS's fast accumulation (``use_fast_accum``): the
    tensor cores' narrower accumulator sums more terms before promotion to fp32 (faster, about
    3e-3 relative on the product: docs/kernels.md "FP8 base"). Off keeps fp32 accumulation
    throughout; the emulated path (no FP8 tensor cores) has no such mode and ignores both.

    ``nf4_gemm``: how an NF4 base's frozen products read the 4-bit weight: ``buffer`` (each
    weight dequantized into a reused scratch buffer, then a cuBLAS GEMM), ``fused`` (the NF4
    GEMM kernel dequantizes inside its operand tiles, ``kernels.nf4_gemm``) or ``auto``
    (forward products of at most 64 rows on CUDA: the decode kernel, ``kernels.nf4_decode``;
    the rest ``buffer``, the fused GEMM being measured slower: docs/BENCHMARKS.md)."""

    fp8_fast_accum_forward: bool = False
    fp8_fast_accum_input_grad: bool = False
    nf4_gemm: str = "auto"

    def __post_init__(self) -> None:
        for name in ("fp8_fast_accum_forward", "fp8_fast_accum_input_grad"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"KernelOptions.{name}={getattr(self, name)!r} must be a bool")
        if self.nf4_gemm not in NF4_GEMM_MODES:
            raise ValueError(f"KernelOptions.nf4_gemm={self.nf4_gemm!r}; allowed: {NF4_GEMM_MODES}")
