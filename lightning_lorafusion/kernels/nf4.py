"""NF4 frozen weights (QLoRA): bitsandbytes' 4-bit NormalFloat format, its torch reference
quantizer/dequantizer (the spec), and the frozen product that reads the 4-bit weight.

Format (what bitsandbytes writes with ``quant_type="nf4"``), for ``W [N, K]`` flattened row-major
into ``n = N * K`` values:

    blocks     consecutive runs of ``blocksize`` values (64 by default; the last may be short)
    absmax     [ceil(n / blocksize)] fp32, the largest |value| of each block
    codes      each value ``v`` of block ``b`` -> the index of the ``NF4_CODE`` entry nearest to
               ``v * (1 / absmax[b])`` (clamped to [-1, 1]; a value exactly between two entries
               takes the lower one)
    data       uint8 [n / 2]: two codes per byte, the FIRST value in the HIGH nibble
    W[i]      ~ NF4_CODE[code_i] * absmax[i // blocksize]   (fp32 product, then the model's dtype)

Double quantization (bitsandbytes' ``compress_statistics=True``): ``offset = mean(absmax)``;
``absmax - offset`` is itself quantized block-wise in blocks of 256 to uint8 indices into the
signed 8-bit dynamic code (``dynamic_code()``) with its own fp32 ``nested_absmax``; dequantizing
gives ``absmax = DYNAMIC[q] * nested_absmax[j // 256] + offset`` (fp32, multiply then add).

In the params pytree a projection ``{"weight": W}`` becomes ``{"weight_nf4": uint8 [N, K/2],
"nf4_absmax", "nf4_code", ("nf4_nested_absmax", "nf4_nested_code", "nf4_offset")}``; the fp32
pieces are stored bit-cast to int32 so that casts of floating buffers (``Module.to(bf16)``,
Lightning's bf16-true) leave them alone. Block sizes follow from the tensor sizes (powers of
two), so reading a weight never asks the device for a number.

Frozen product (``Nf4FrozenProjections``), two ways (``KernelOptions.nf4_gemm``): ``buffer``:
each weight is dequantized into one scratch buffer per projection group (the Triton kernel on
CUDA, the torch reference elsewhere: the same bits), then multiplied by cuBLAS; ``fused``: the
NF4 GEMM (``nf4_gemm.py``) dequantizes inside its operand tiles. Either way the backward's input
gradient reads the same 4-bit weight again (no dequantized copy is kept for backward). The
weight gets no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

# The 16 NF4 values (QLoRA, Dettmers et al. 2023, appendix E), as bitsandbytes stores them in
# checkpoints' ``quant_map``: sorted, exact 0 at index 7, +-1 at the ends.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
DEFAULT_BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256  # double quantization of the absmax (bitsandbytes' fixed choice)
# forward products of at most this many rows take the decode kernel under nf4_gemm="auto" on
# CUDA (nf4_decode.py; docs/BENCHMARKS.md "NF4 decode"), for blocks of at most 256 values
DECODE_ROWS, DECODE_MAX_BLOCKSIZE = 64, 256
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
WEIGHT_KEY = "weight_nf4"
ABSMAX_KEY, CODE_KEY = "nf4_absmax", "nf4_code"
NESTED_ABSMAX_KEY, NESTED_CODE_KEY, OFFSET_KEY = "nf4_nested_absmax", "nf4_nested_code", "nf4_offset"


def nf4_code(device: torch.device | str | None = None) -> torch.Tensor:
    """``NF4_CODE`` as fp32 ``[16]``."""
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


def dynamic_code(device: torch.device | str | None = None) -> torch.Tensor:
    """The signed 8-bit dynamic code of the nested absmax (Dettmers 2015, "8-bit approximations
    for parallelism"), fp32 ``[256]`` sorted: 0, 1, and for each decade ``e`` = 0..6 the
    ``2^e`` midpoints of ``linspace(0.1, 1, 2^e + 1)`` times ``10^(e - 6)``, with both signs."""
    parts = [torch.tensor([0.0, 1.0])]
    for e in range(7):
        edges = torch.linspace(0.1, 1.0, 2**e + 1, dtype=torch.float32)
        mag = (edges[:-1] + edges[1:]) / 2.0 * 10.0 ** (e - 6)
        parts += [mag, -mag]
    return torch.sort(torch.cat(parts)).values.to(device)


def _infer_blocksize(numel: int, blocks: int) -> int:
    """The smallest power of two ``b >= 32`` with ``ceil(numel / b) == blocks`` (unique up to
    choices that dequantize alike: one block covering everything)."""
    b = 32
    while -(-numel // b) > blocks:
        b *= 2
    if -(-numel // b) != blocks:
        raise ValueError(f"{blocks} absmax blocks do not cover {numel} values in power-of-two blocks")
    return b


def _f32(t: torch.Tensor) -> torch.Tensor:
    """An fp32 piece stored bit-cast to int32 in the params pytree, read back as fp32."""
    return t.view(torch.float32) if t.dtype == torch.int32 else t.float()


@dataclass(frozen=True, eq=False)
class Nf4Weight:
    """A frozen weight ``W [N, K]`` in NF4: ``data`` uint8 ``[N, K/2]`` (two codes per byte, first
    value high), ``absmax`` fp32 ``[blocks]`` (or uint8 indices into ``nested_code`` when
    double-quantized, with ``nested_absmax`` fp32 and ``offset`` fp32 ``[1]``), ``code`` fp32 [16]."""

    data: torch.Tensor
    absmax: torch.Tensor
    code: torch.Tensor
    nested_absmax: torch.Tensor | None = None
    nested_code: torch.Tensor | None = None
    offset: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"Nf4Weight.data must be 2-D uint8 [N, K/2]; got {self.data.dtype} "
                             f"{tuple(self.data.shape)}")
        if self.code.shape != (16,):
            raise ValueError(f"Nf4Weight.code must hold 16 values; got {tuple(self.code.shape)}")
        nested = (self.nested_absmax, self.nested_code, self.offset)
        if any(t is None for t in nested) and not all(t is None for t in nested):
            raise ValueError("Nf4Weight: give nested_absmax, nested_code and offset together (or none)")
        if self.nested and self.absmax.dtype != torch.uint8:
            raise ValueError(f"a double-quantized Nf4Weight's absmax must be uint8; got {self.absmax.dtype}")
        self.blocksize  # validates the block count

    @property
    def nested(self) -> bool:
        return self.offset is not None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], 2 * self.data.shape[1]))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def blocksize(self) -> int:
        return _infer_blocksize(self.data.numel() * 2, self.absmax.numel())

    @property
    def nested_blocksize(self) -> int:
        return _infer_blocksize(self.absmax.numel(), self.nested_absmax.numel()) if self.nested else 0

    def absmax_f32(self) -> torch.Tensor:
        """The per-block absmax as fp32 ``[blocks]`` (double quantization undone)."""
        if not self.nested:
            return self.absmax
        return dequantize_blockwise_reference(self.absmax, self.nested_absmax, self.nested_code,
                                              self.nested_blocksize) + self.offset

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None, *,
                   backend: str = "auto") -> torch.Tensor:
        """``[N, K]`` in ``dtype``; ``out``: a buffer of at least ``N * K`` elements of ``dtype``
        to fill. ``backend``: "triton" (the kernel), "torch" (the reference), "auto" (Triton on
        CUDA, torch elsewhere); bit-identical."""
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend={backend!r}; allowed: ('auto', 'torch', 'triton')")
        if backend == "triton" or (backend == "auto" and self.data.is_cuda):
            from .nf4_triton import dequantize_nf4_triton  # Triton is imported only when used

            nested = ((self.nested_absmax, self.nested_code, self.offset, self.nested_blocksize)
                      if self.nested else None)
            return dequantize_nf4_triton(self.data, self.absmax, self.code, self.blocksize, nested,
                                         dtype=dtype, out=out)
        w = dequantize_nf4_reference(self, dtype)
        if out is None:
            return w
        view = out.view(-1)[: w.numel()].view(w.shape)
        return view.copy_(w)

    @classmethod
    def from_params(cls, p: Mapping[str, torch.Tensor]) -> "Nf4Weight":
        """From a quantized projection's params dict (see ``quantize_projection_nf4``)."""
        nested = OFFSET_KEY in p
        return cls(p[WEIGHT_KEY], p[ABSMAX_KEY] if nested else _f32(p[ABSMAX_KEY]), _f32(p[CODE_KEY]),
                   _f32(p[NESTED_ABSMAX_KEY]) if nested else None, _f32(p[NESTED_CODE_KEY]) if nested else None,
                   _f32(p[OFFSET_KEY]) if nested else None)

    def to_params(self) -> dict[str, torch.Tensor]:
        """The params-pytree entries (fp32 pieces bit-cast to int32; see the module docstring)."""
        def bits(t: torch.Tensor) -> torch.Tensor:
            return t.float().contiguous().view(torch.int32)

        out = {WEIGHT_KEY: self.data, ABSMAX_KEY: self.absmax if self.nested else bits(self.absmax),
               CODE_KEY: bits(self.code)}
        if self.nested:
            out.update({NESTED_ABSMAX_KEY: bits(self.nested_absmax), NESTED_CODE_KEY: bits(self.nested_code),
                        OFFSET_KEY: bits(self.offset.reshape(1))})
        return out


def is_nf4(p: Any) -> bool:
    """True for an NF4 projection entry of the params pytree."""
    return isinstance(p, Mapping) and WEIGHT_KEY in p


# ------------------------------------------------------------------------ torch reference


def _blocks(flat: torch.Tensor, blocksize: int) -> torch.Tensor:
    """``flat [n]`` zero-padded to whole blocks: ``[ceil(n / blocksize), blocksize]``."""
    pad = -flat.numel() % blocksize
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, blocksize)


def quantize_blockwise_reference(x: torch.Tensor, code: torch.Tensor, blocksize: int
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any shape) -> (uint8 indices into the sorted ``code`` [flat n], fp32 absmax [blocks]):
    each value scaled by its block's ``1 / absmax``, clamped to [-1, 1], rounded to the nearest
    code entry (ties to the lower)."""
    flat = x.reshape(-1).float()
    blocks = _blocks(flat, blocksize)
    absmax = blocks.abs().amax(dim=1)
    scaled = (blocks * (1.0 / absmax.clamp_min(1e-38))[:, None]).clamp(-1.0, 1.0).reshape(-1)
    code = code.to(device=flat.device, dtype=torch.float32)
    idx = torch.bucketize(scaled, (code[:-1] + code[1:]) / 2, out_int32=True)
    return idx.to(torch.uint8), absmax


def dequantize_blockwise_reference(q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                                   blocksize: int) -> torch.Tensor:
    """Indices ``q [n]`` -> fp32 ``code[q] * absmax[i // blocksize]``."""
    values = code.float()[q.reshape(-1).long()]
    scale = absmax.float().repeat_interleave(blocksize)[: values.numel()]
    return values * scale


def quantize_nf4_reference(w: torch.Tensor, *, blocksize: int = DEFAULT_BLOCKSIZE,
                           double_quant: bool = False) -> Nf4Weight:
    """``W [N, K]`` (fp32/fp16/bf16, K even) -> ``Nf4Weight`` (bitsandbytes' ``quantize_4bit(...,
    quant_type="nf4", compress_statistics=double_quant)``)."""
    if w.dim() != 2:
        raise ValueError(f"NF4 quantizes 2-D weights [N, K]; got {tuple(w.shape)}")
    n, k = w.shape
    if k % 2:
        raise ValueError(f"NF4 packs two values per byte along K: in_features must be even; got [{n}, {k}]")
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"NF4 blocksize={blocksize!r}; allowed: {BLOCKSIZES}")
    code = nf4_code(w.device)
    idx, absmax = quantize_blockwise_reference(w.detach(), code, blocksize)
    idx = idx[: n * k]
    data = ((idx[0::2] << 4) | idx[1::2]).view(n, k // 2)
    if not double_quant:
        return Nf4Weight(data, absmax, code)
    offset = absmax.mean()
    dyn = dynamic_code(w.device)
    qabs, nested_absmax = quantize_blockwise_reference(absmax - offset, dyn, NESTED_BLOCKSIZE)
    return Nf4Weight(data, qabs[: absmax.numel()], code, nested_absmax, dyn, offset.reshape(1))


def dequantize_nf4_reference(w: Nf4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``Nf4Weight`` -> ``[N, K]`` in ``dtype``: ``code[c] * absmax[block]`` in fp32, then cast."""
    codes = torch.stack([w.data >> 4, w.data & 0xF], dim=-1).reshape(-1)
    return dequantize_blockwise_reference(codes, w.absmax_f32(), w.code, w.blocksize).view(w.shape).to(dtype)


def quantize_projection_nf4(p: Mapping[str, torch.Tensor], *, blocksize: int = DEFAULT_BLOCKSIZE,
                            double_quant: bool = True) -> dict[str, torch.Tensor]:
    """A projection's params ``{"weight", "bias"?}`` -> the NF4 entries (``Nf4Weight.to_params``)
    and the bias; the 16-bit weight is not kept."""
    out = quantize_nf4_reference(p["weight"], blocksize=blocksize, double_quant=double_quant).to_params()
    if "bias" in p:
        out["bias"] = p["bias"]
    return out


# ------------------------------------------------------------------------------- product


def _dequantized(weights: Sequence[Nf4Weight], dtype: torch.dtype):
    """Each weight dequantized in turn into one scratch buffer (sized for the largest)."""
    size = max(w.shape[0] * w.shape[1] for w in weights)
    buf = torch.empty(size, dtype=dtype, device=weights[0].device)
    for w in weights:
        yield w.dequantize(dtype, out=buf)


def resolve_nf4_gemm(gemm: str) -> str:
    """``KernelOptions.nf4_gemm`` -> "buffer" or "fused" for products of any size ("auto" is the
    buffer there; the fused GEMM is slower on the GPUs measured: docs/BENCHMARKS.md "NF4 frozen
    base"). Forward products of few rows may take the decode kernel instead: ``nf4_forward_kind``."""
    if gemm not in ("auto", "buffer", "fused"):
        raise ValueError(f"nf4_gemm={gemm!r}; allowed: ('auto', 'buffer', 'fused')")
    return "fused" if gemm == "fused" else "buffer"


def nf4_forward_kind(m: int, on_cuda: bool, weights: Sequence[Nf4Weight], gemm: str = "auto") -> str:
    """How the frozen forward ``x [m, K] @ W_i^T`` runs: "decode" (``nf4_decode``: the 4-bit
    weight read once, for ``gemm="auto"`` on CUDA with ``1 <= m <= DECODE_ROWS`` and whole absmax
    blocks per row of every weight), else ``resolve_nf4_gemm(gemm)``."""
    kind = resolve_nf4_gemm(gemm)
    if gemm != "auto" or not on_cuda or not 1 <= m <= DECODE_ROWS:
        return kind
    if all(w.shape[1] % w.blocksize == 0 and w.blocksize <= DECODE_MAX_BLOCKSIZE for w in weights):
        return "decode"
    return kind


def nf4_outputs(x: torch.Tensor, weights: Sequence[Nf4Weight], biases: Sequence[torch.Tensor | None],
                gemm: str = "auto", *, grouped: bool = False, workspace: Any = None) -> list[torch.Tensor]:
    """Forward of the frozen projections, no autograd: ``x [M, K] -> [M, N_i]`` in ``x.dtype``;
    ``gemm``: ``KernelOptions.nf4_gemm`` (a reused dequantized buffer, or the fused NF4 GEMM;
    "auto": the decode kernel for few rows, ``nf4_forward_kind``). ``grouped``: the decode
    kernel runs the group in one launch (``nf4_decode.nf4_decode_group``), its outputs column
    views of one tensor, as a fused 16-bit weight's are (the caller takes views). ``workspace``:
    the caller's ``nf4_decode.DecodeWorkspace`` (split-K counters kept across calls), or None."""
    kind = nf4_forward_kind(x.shape[0], x.is_cuda, weights, gemm)
    if kind == "decode":
        from .nf4_decode import groupable, nf4_decode_group, nf4_linear_decode  # Triton: imported when used

        if grouped and len(weights) > 1 and groupable(weights, biases):
            return nf4_decode_group(x, weights, biases, workspace=workspace)
        return [nf4_linear_decode(x, w, b, workspace=workspace) for w, b in zip(weights, biases)]
    if kind == "fused":
        from .nf4_gemm import nf4_linear_fused

        return [nf4_linear_fused(x, w, b) for w, b in zip(weights, biases)]
    return [torch.nn.functional.linear(x, wd, b) for wd, b in zip(_dequantized(weights, x.dtype), biases)]


def nf4_input_grad(dys: Sequence[torch.Tensor | None], weights: Sequence[Nf4Weight], *, m: int, k: int,
                   dtype: torch.dtype, device: torch.device, gemm: str = "auto") -> torch.Tensor:
    """``dX [M, K] = sum_i dY_i W_i`` (``dY_i`` None: zero), each ``W_i`` read from its 4 bits
    again (dequantized into the buffer, or inside the fused GEMM's tiles)."""
    pairs = [(dy, w) for dy, w in zip(dys, weights) if dy is not None]
    if pairs and resolve_nf4_gemm(gemm) == "fused":
        from .nf4_gemm import nf4_input_grad_fused

        dx = None
        for dy, w in pairs:
            dx = nf4_input_grad_fused(dy.to(dtype), w, out=dx)
        return dx
    if not pairs:
        return torch.zeros(m, k, dtype=dtype, device=device)
    dx = None
    for (dy, _), wd in zip(pairs, _dequantized([w for _, w in pairs], dtype)):
        # the first product writes dX (no zero fill to read back), the others add into it
        dx = torch.mm(dy.to(dtype), wd) if dx is None else dx.addmm_(dy.to(dtype), wd)
    return dx


class Nf4FrozenProjections(torch.autograd.Function):
    """``x -> [x W_i^T + b_i]`` with NF4 weights; differentiable w.r.t. ``x`` only."""

    @staticmethod
    def forward(ctx, x, gemm, n_proj, *rest):
        weights, biases = rest[:n_proj], rest[n_proj:]
        ctx.weights, ctx.gemm, ctx.x_meta = weights, gemm, (x.shape, x.dtype, x.device)
        return tuple(nf4_outputs(x, weights, biases, gemm))

    @staticmethod
    def backward(ctx, *dys):
        (m, k), dtype, device = ctx.x_meta
        dx = None
        if ctx.needs_input_grad[0]:
            dx = nf4_input_grad(dys, ctx.weights, m=m, k=k, dtype=dtype, device=device, gemm=ctx.gemm)
        return (dx, None, None) + (None,) * (2 * len(ctx.weights))


def nf4_decode_workspace(params: Mapping[str, Any], device: torch.device | str) -> Any:
    """A ``nf4_decode.DecodeWorkspace`` for a caller that runs the decode products of a base
    with NF4 projections on CUDA again and again (the generation engine keeps one; its counters
    are zeroed once here, before any graph capture); None for other bases or off CUDA."""
    layers = params.get("layers", [])
    layers = layers.values() if isinstance(layers, Mapping) else layers
    if torch.device(device).type != "cuda" or not any(is_nf4(p) for lp in layers for p in lp.values()):
        return None
    from .nf4_decode import DecodeWorkspace  # Triton is imported only when used

    return DecodeWorkspace.create(device)


def nf4_frozen_projections(x: torch.Tensor, weights: Sequence[Nf4Weight],
                           biases: Sequence[torch.Tensor | None], *, gemm: str = "auto",
                           workspace: Any = None) -> list[torch.Tensor]:
    """The frozen part of a projection group with NF4 weights, ``x [M, K] -> [M, N_i]``;
    ``gemm``: ``KernelOptions.nf4_gemm``; ``workspace``: the decode kernel's, kept by the caller
    (``nf4_decode.DecodeWorkspace``; inference only)."""
    if not all(isinstance(w, Nf4Weight) for w in weights):
        raise TypeError("a projection group mixes NF4 and other weights; quantize all or none")
    for w in weights:
        if w.shape[1] != x.shape[-1]:
            raise ValueError(f"an NF4 weight is {tuple(w.shape)} but x is {tuple(x.shape)}")
    if not (torch.is_grad_enabled() and x.requires_grad):  # inference (the generation engine): one launch a group
        return nf4_outputs(x, weights, biases, gemm, grouped=True, workspace=workspace)
    return list(Nf4FrozenProjections.apply(x, gemm, len(weights), *weights, *biases))
