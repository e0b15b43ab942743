"""FP8 frozen linear: e4m3 weights quantized once, activations and output gradients per row on the fly.

Math (the spec, written out by the emulated path, which runs anywhere). Every scale is a power
of two ``s = pow2_scales(amax)``, the smallest with ``amax / s <= 448`` (e4m3's largest value),
so multiplying by ``s`` or ``1 / s`` is exact in fp32 and the real and emulated paths quantize
to the same bits.

    W [N, K]   ~ Wq * sw[:, None]            quantized once, per output channel
    forward    Y  = (Xq * sx) (Wq * sw)^T    Xq, sx [M, 1]: rows of X quantized on the fly
    backward   dX = (Gq * sg) Wq             Gq, sg [M, 1]: rows of G = dY * sw[None, :]

Folding ``sw`` into dY makes the backward the exact input gradient of the forward's dequantized
weight (only dY is quantized) and lets both products use the same ``Wq``: no second copy of the
weight quantized along K. A group of projections sharing one input (q/k/v) quantizes X once
and sums the backward in one product over the concatenated ``[G_q | G_k | G_v]`` (one scale
per row for the group). The weight gets no gradient.

Real path (CUDA, compute capability >= 8.9): Triton kernels quantize rows and transpose
``Wq`` for the backward (``fp8_triton.py``); ``torch._scaled_mm`` multiplies with row-wise
scales (``scale_a [M, 1]``, ``scale_b [1, N]`` fp32, ``mat2`` column-major), bf16 out.
Emulated path: quantize, dequantize in fp32 with the same scales, matmul.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from . import fp8_triton
from .fp8_format import FP8_DTYPE, FP8_MAX  # noqa: F401  (FP8_MAX: part of this module's API)
from .nf4 import Nf4Weight, nf4_frozen_projections
from .options import KernelOptions

MIN_CAPABILITY = (8, 9)  # Ada / Hopper: FP8 tensor cores
GEMM_MULTIPLE = 16  # torch._scaled_mm needs every dimension divisible by 16
# Without autograd (inference), products of at most this many rows run weight-only on the GPU
# (``fp8_triton.weight_only_linear``: e4m3 weights, bf16 activations, fp32 accumulation), for
# the generation engine's decode steps, on the weights ``weight_only_wins`` picks (all of them
# at one row; o, k/v and down at 2-16 rows, where the H100 tile sweep's weight-only tiles beat
# the row-quantized product); more rows take the row-quantized ``_scaled_mm``. Measured in the
# engine on an H100 (docs/BENCHMARKS.md, "FP8 base in the generation engine"): faster decode
# steps at 1 and 16 rows than without weight-only products. 0 turns it off; the emulated path
# (CPU) ignores it.
WEIGHT_ONLY_MAX_ROWS = 16
# Params-pytree keys of a quantized projection (beside an optional "bias"): the e4m3 bits as
# uint8 (integer dtypes are left alone by Module.to(dtype) / Lightning's bf16-true casts) and
# the per-output-channel scales (powers of two: exact in bf16 too).
WEIGHT_KEY, SCALE_KEY = "weight_fp8", "weight_scale"
EMBED_BLOCK_ROWS = 8192  # rows per step of quantize_embedding


@dataclass(frozen=True)
class Fp8Weight:
    """A frozen weight ``W [N, K] ~ data * scale[:, None]`` (``data`` e4m3, ``scale`` [N] fp32)."""

    data: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.data.dtype != FP8_DTYPE or self.data.dim() != 2:
            raise ValueError(f"Fp8Weight.data must be a 2-D {FP8_DTYPE} tensor; got {self.data.dtype} "
                             f"{tuple(self.data.shape)}")
        if self.scale.shape != (self.data.shape[0],):
            raise ValueError(f"Fp8Weight.scale must be [{self.data.shape[0]}]; got {tuple(self.scale.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[N, K]`` in ``dtype`` (exact in fp32)."""
        return (self.data.float() * self.scale.float()[:, None]).to(dtype)

    @classmethod
    def from_params(cls, p: Mapping[str, torch.Tensor]) -> "Fp8Weight":
        """From a quantized projection's params dict (see ``quantize_projection``)."""
        return cls(p[WEIGHT_KEY].view(FP8_DTYPE), p[SCALE_KEY].float())


def is_quantized(p: Any) -> bool:
    """True for a quantized projection or embedding entry of the params pytree."""
    return isinstance(p, Mapping) and WEIGHT_KEY in p


def fp8_supported(device: torch.device | str) -> bool:
    """True where FP8 tensor-core products run: CUDA with compute capability >= 8.9."""
    device = torch.device(device)
    return device.type == "cuda" and _capability(device.index) >= MIN_CAPABILITY


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    # asked on every projection call: a device's capability never changes, so ask CUDA once
    return torch.cuda.get_device_capability(index)


# ------------------------------------------------------------------------------- quantization


def pow2_scales(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``s`` with ``amax / s <= 448``, elementwise, fp32; 1 where
    ``amax`` is 0; at least 2^-126 (fp32's smallest normal, so ``1 / s`` stays finite).

    ``amax = m * 2^e`` with ``m`` in [0.5, 1) and ``448 = 0.875 * 2^9``, so the exponent is
    ``e - 9``, plus one when ``m > 0.875``: integer work only, which the Triton kernel repeats
    bit for bit."""
    amax = amax.float()
    m, e = torch.frexp(amax)
    p = (e - 9 + (m > 0.875).to(e.dtype)).clamp_min(-126)
    one = torch.ones_like(amax)
    return torch.where(amax > 0, torch.ldexp(one, p), one)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 ``[M, K]``, fp32 scales ``[M, 1]``), one power-of-two scale per row."""
    xf = x.float()
    scale = pow2_scales(xf.abs().amax(dim=1, keepdim=True))
    return (xf * (1.0 / scale)).to(FP8_DTYPE), scale


def quantize_weight(w: torch.Tensor) -> Fp8Weight:
    """``W [N, K]`` -> e4m3 with one power-of-two scale per output channel (row)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_weight needs a 2-D weight [N, K]; got {tuple(w.shape)}")
    q, scale = quantize_rows_reference(w.detach())
    return Fp8Weight(q, scale.squeeze(1))


def quantize_projection(p: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A projection's params ``{"weight", "bias"?}`` -> ``{WEIGHT_KEY, SCALE_KEY, "bias"?}``;
    the bf16 weight is not kept (the caller drops its last reference)."""
    fw = quantize_weight(p["weight"])
    out = {WEIGHT_KEY: fw.data.view(torch.uint8), SCALE_KEY: fw.scale}
    if "bias" in p:
        out["bias"] = p["bias"]
    return out


def quantize_embedding(table: torch.Tensor) -> dict[str, torch.Tensor]:
    """A frozen embedding table ``[V, H]`` -> ``{WEIGHT_KEY: uint8 [V, H], SCALE_KEY: [V]}``,
    one power-of-two scale per row (a token's vector), the scales kept in the table's dtype
    (exact: powers of two), which ``fp8_embedding`` returns. Quantized in blocks of rows, so
    the fp32 temporaries stay small next to a 128k-row table."""
    if table.dim() != 2:
        raise ValueError(f"quantize_embedding needs a 2-D table [V, H]; got {tuple(table.shape)}")
    data = torch.empty(table.shape, dtype=torch.uint8, device=table.device)
    scale = torch.empty(table.shape[0], dtype=table.dtype, device=table.device)
    for r0 in range(0, table.shape[0], EMBED_BLOCK_ROWS):
        q, s = quantize_rows_reference(table[r0:r0 + EMBED_BLOCK_ROWS].detach())
        data[r0:r0 + EMBED_BLOCK_ROWS] = q.view(torch.uint8)
        scale[r0:r0 + EMBED_BLOCK_ROWS] = s.squeeze(1).to(table.dtype)
    return {WEIGHT_KEY: data, SCALE_KEY: scale}


def fp8_embedding(ids: torch.Tensor, p: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Rows ``ids [T]`` of a ``quantize_embedding`` table, dequantized: ``[T, H]`` in the
    scales' dtype. Only the gathered rows are converted (no full-table copy)."""
    rows = p[WEIGHT_KEY].index_select(0, ids).view(FP8_DTYPE).float()
    scale = p[SCALE_KEY].index_select(0, ids).float()
    return (rows * scale[:, None]).to(p[SCALE_KEY].dtype)


# --------------------------------------------------------- operands quantized by their producer
# A kernel that produces a product's operand may quantize it on the way (``Fp8SwiGLU``: h for the
# down projection, [dg * sw_g | du * sw_u] for the gate/up input gradient) and offer it to the
# products of the same layer through a ``QuantizedOperands`` the caller passes to both. A product
# takes an offer if its operand is that very tensor (same storage, shape, strides and version;
# the offer holds a reference, so the storage cannot be reused meanwhile), else quantizes as
# usual; looking empties the slot, so an offer is used at most once. The bits are the same
# either way (the spec's quantization of the same tensor): taking an offer changes speed only.


def _mark(t: torch.Tensor) -> tuple:
    """The tensor and what must not change for its quantized rows to stay valid."""
    return t, t.data_ptr(), t.shape, t.stride(), t.dtype, t._version


def _is_marked(mark: tuple, t: torch.Tensor) -> bool:
    return mark[1:] == (t.data_ptr(), t.shape, t.stride(), t.dtype, t._version)


class QuantizedOperands:
    """One decoder layer's hand-off of quantized operands from their producer (the FP8 SwiGLU)
    to the next FP8 products (down's forward, gate/up's input gradient): one slot each way."""

    __slots__ = ("input", "grad")

    def __init__(self) -> None:
        self.input: tuple | None = None
        self.grad: tuple | None = None

    def offer_input(self, x: torch.Tensor, xq: torch.Tensor, sx: torch.Tensor) -> None:
        """The next FP8 forward product whose input is ``x`` uses rows ``xq [M, K]``, scales ``sx [M, 1]``."""
        self.input = (_mark(x), xq, sx)

    def offer_grad(self, dys: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], gq: torch.Tensor,
                   sg: torch.Tensor) -> None:
        """The next FP8 input gradient over output gradients ``dys`` of weights with channel scales
        ``scales`` uses ``gq [M, sum N_i]`` = rows of ``[dy_i * scale_i | ...]`` quantized, ``sg [M, 1]``."""
        self.grad = (tuple(_mark(d) for d in dys), tuple(_mark(c) for c in scales), gq, sg)

    def take_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        offer, self.input = self.input, None
        if offer is None or not _is_marked(offer[0], x):
            return None
        return offer[1], offer[2]

    def take_grad(self, dys, weights) -> tuple[torch.Tensor, torch.Tensor] | None:
        offer, self.grad = self.grad, None
        if offer is None or len(offer[0]) != len(dys):
            return None
        offered_dys, scales, gq, sg = offer
        if not all(_is_marked(a, b) for a, b in zip(offered_dys, dys)):
            return None
        if not all(_is_marked(c, w.scale) for c, w in zip(scales, weights)):  # (no device sync here)
            return None
        return gq, sg


def _take_input(operands: QuantizedOperands | None, x: torch.Tensor):
    return None if operands is None else operands.take_input(x)


def _take_grad(operands: QuantizedOperands | None, dys, weights):
    return None if operands is None else operands.take_grad(dys, weights)


def _swiglu_reference(g: torch.Tensor, u: torch.Tensor):
    """The decoder's eager SwiGLU, op for op (so the emulated path matches it bit for bit)."""
    h = torch.nn.functional.silu(g) * u
    hq, sh = quantize_rows_reference(h)
    return h, hq, sh


def _swiglu_grads_reference(g, u, dh, scale_g, scale_u):
    """Autograd's backward of ``silu(g) * u``, op for op; then the spec's quantization of G."""
    du = dh * torch.nn.functional.silu(g)
    dg = torch.ops.aten.silu_backward(dh * u, g)
    gq, sg = quantize_rows_reference(torch.cat([dg.float() * scale_g.float()[None, :],
                                                du.float() * scale_u.float()[None, :]], dim=1))
    return dg, du, gq, sg


class Fp8SwiGLU(torch.autograd.Function):
    """``h = silu(g) * u`` of an FP8 MLP that also quantizes the operands of its neighbours'
    products (see "operands quantized by their producer"): h's rows for the down projection in
    the forward, ``[dg * sw_g | du * sw_u]``'s rows for the gate/up input gradient in the
    backward. Real path: one Triton kernel each way (``fp8_triton.swiglu_quantize`` /
    ``swiglu_grads_quantize``); emulated: the eager ops and the spec's quantization."""

    @staticmethod
    def forward(ctx, g, u, scale_g, scale_u, emulate, operands):
        if emulate:
            h, hq, sh = _swiglu_reference(g, u)
        else:
            h, hq, sh = fp8_triton.swiglu_quantize(g, u)
        operands.offer_input(h, hq, sh)
        ctx.save_for_backward(g, u, scale_g, scale_u)
        ctx.emulate, ctx.operands = emulate, operands
        return h

    @staticmethod
    def backward(ctx, dh):
        g, u, scale_g, scale_u = ctx.saved_tensors
        if ctx.emulate:
            dg, du, gq, sg = _swiglu_grads_reference(g, u, dh, scale_g, scale_u)
        else:
            dg, du, gq, sg = fp8_triton.swiglu_grads_quantize(g, u, dh, scale_g, scale_u)
        ctx.operands.offer_grad((dg, du), (scale_g, scale_u), gq, sg)
        return dg, du, None, None, None, None


def fp8_swiglu(g: torch.Tensor, u: torch.Tensor, gate: Fp8Weight, up: Fp8Weight, operands: QuantizedOperands,
               *, emulate: bool | None = None) -> torch.Tensor:
    """``silu(g) * u`` between FP8 gate/up and down projections (``Fp8SwiGLU``), offering its
    quantized operands through ``operands`` (pass the same object to down and gate/up); the
    real path needs bf16 on a GPU with FP8 tensor cores, like the products around it."""
    emulate = resolve_emulate(g.device, emulate)
    if not emulate and g.dtype != torch.bfloat16:
        raise TypeError(f"the FP8 base computes with bfloat16 activations; g is {g.dtype}")
    return Fp8SwiGLU.apply(g, u, gate.scale, up.scale, emulate, operands)


# ------------------------------------------------------------------------------- products


def _emulated_outputs(x, weights, biases, weight_only=False, fast_accum=False, operands=None):
    # the spec: always row-quantized (no weight-only product, no fast accumulation)
    xq, sx = _take_input(operands, x) or quantize_rows_reference(x)
    xd = xq.float() * sx
    ys = []
    for w, b in zip(weights, biases):
        y = (xd @ w.dequantize().t()).to(x.dtype)
        ys.append(y if b is None else y + b)
    return ys


def _emulated_input_grad(dys, weights, dtype, fast_accum=False, operands=None):  # (no fast accumulation)
    gq, sg = (_take_grad(operands, dys, weights) or quantize_rows_reference(
        torch.cat([dy.float() * w.scale.float()[None, :] for dy, w in zip(dys, weights)], dim=1)))
    wq = torch.cat([w.data.float() for w in weights], dim=0)  # [sum N, K]
    return ((gq.float() * sg) @ wq).to(dtype)


def _check_real(x: torch.Tensor, weights: Sequence[Fp8Weight]) -> None:
    if not fp8_supported(x.device):
        raise RuntimeError(
            f"the FP8 base needs a CUDA GPU with compute capability >= {MIN_CAPABILITY[0]}."
            f"{MIN_CAPABILITY[1]} (Ada/Hopper); x is on {x.device}. Use the bf16 base there"
        )
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the FP8 base computes with bfloat16 activations; x is {x.dtype}")
    for w in weights:
        n, k = w.shape
        if n % GEMM_MULTIPLE or k % GEMM_MULTIPLE:
            raise ValueError(
                f"FP8 products need in/out features divisible by {GEMM_MULTIPLE}; a weight is "
                f"[{n}, {k}]. Use the bf16 base for this model"
            )


def _scaled_mm(a_q, a_scale, b_t_q, b_scale, out_dtype, fast_accum: bool = False):
    """``(a_q * a_scale) @ (b_t_q * b_scale).T``; ``a_q [M, K]``, ``b_t_q [N, K]`` row-major
    e4m3, ``a_scale [M, 1]``, ``b_scale [1, N]`` fp32. Rows are zero-padded to a multiple of 16."""
    m = a_q.shape[0]
    pad = -m % GEMM_MULTIPLE
    if pad:
        a_q = torch.cat([a_q, a_q.new_zeros(pad, a_q.shape[1])])
        a_scale = torch.cat([a_scale, a_scale.new_ones(pad, 1)])
    out = torch._scaled_mm(a_q, b_t_q.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype,
                           use_fast_accum=fast_accum)
    return out[:m] if pad else out


def _real_outputs(x, weights, biases, weight_only=False, fast_accum=False, operands=None):
    _check_real(x, weights)
    m = x.shape[0]
    # decode: weight-only products read the e4m3 weights once and keep x in bf16 (for the
    # others a row quantization and _scaled_mm's small-M kernels cost what the halved bytes save)
    light = [weight_only and weight_only_wins(m, *w.shape) for w in weights]
    xq = sx = None
    if not all(light):
        xq, sx = _take_input(operands, x) or fp8_triton.quantize_rows([x.contiguous()], None)
    ys = []
    for w, b, wo in zip(weights, biases, light):
        if wo:
            y = fp8_triton.weight_only_linear(x, w.data, w.scale)
        else:
            y = _scaled_mm(xq, sx, w.data, w.scale.view(1, -1), x.dtype, fast_accum)
        ys.append(y if b is None else y + b)
    return ys


def weight_only_wins(m: int, n: int, k: int) -> bool:
    """Whether ``m`` rows times an e4m3 weight ``[n, k]`` take the weight-only product: at most
    ``WEIGHT_ONLY_MAX_ROWS`` rows, and for more than one row only weights no wider than deep
    (o, k/v, down at the 8B shape): there the H100 sweep's weight-only tiles beat the
    row-quantized product at 16 rows, on gate/up they do not (docs/BENCHMARKS.md)."""
    return m <= WEIGHT_ONLY_MAX_ROWS and (m <= 1 or n <= k)


def _real_input_grad(dys, weights, dtype, fast_accum=False, operands=None):
    gq, sg = (_take_grad(operands, dys, weights)
              or fp8_triton.quantize_rows([dy.contiguous() for dy in dys], [w.scale for w in weights]))
    wt = fp8_triton.transpose_concat([w.data for w in weights])  # [K, sum N]: Wq^T, the K-major operand
    ones = torch.ones(1, wt.shape[0], dtype=torch.float32, device=wt.device)
    return _scaled_mm(gq, sg, wt, ones, dtype, fast_accum)


def fp8_outputs(x: torch.Tensor, weights: Sequence[Fp8Weight], biases: Sequence[torch.Tensor | None],
                *, emulate: bool, weight_only: bool = False, fast_accum: bool = False,
                operands: QuantizedOperands | None = None) -> list[torch.Tensor]:
    """Forward of the frozen projections, no autograd: ``x [M, K] -> [M, N_i]`` in ``x.dtype``,
    ``x`` quantized once for all of them (or taken from ``operands``). ``weight_only``
    (inference): on the real path, at most ``WEIGHT_ONLY_MAX_ROWS`` rows multiply unquantized
    ``x`` with the e4m3 weights instead. ``fast_accum``: ``KernelOptions.fp8_fast_accum_forward``."""
    return (_emulated_outputs if emulate else _real_outputs)(x, weights, biases, weight_only, fast_accum,
                                                             operands)


def fp8_input_grad(dys: Sequence[torch.Tensor | None], weights: Sequence[Fp8Weight], *, m: int, k: int,
                   dtype: torch.dtype, device: torch.device, emulate: bool, fast_accum: bool = False,
                   operands: QuantizedOperands | None = None) -> torch.Tensor:
    """``dX [M, K] = sum_i dY_i W_i`` with each ``dY_i [M, N_i]`` (None: zero) quantized per
    row together with the others, after scaling its columns by ``W_i``'s channel scales (or
    taken from ``operands``). ``fast_accum``: ``KernelOptions.fp8_fast_accum_input_grad``."""
    pairs = [(dy, w) for dy, w in zip(dys, weights) if dy is not None]
    if not pairs:
        return torch.zeros(m, k, dtype=dtype, device=device)
    dys, weights = [p[0] for p in pairs], [p[1] for p in pairs]
    return (_emulated_input_grad if emulate else _real_input_grad)(dys, weights, dtype, fast_accum, operands)


class Fp8FrozenProjections(torch.autograd.Function):
    """``x -> [x W_i^T + b_i]`` through FP8; differentiable w.r.t. ``x`` only."""

    @staticmethod
    def forward(ctx, x, emulate, options, operands, n_proj, *rest):
        weights, biases = rest[:n_proj], rest[n_proj:]
        ctx.weights, ctx.emulate, ctx.x_meta = weights, emulate, (x.shape, x.dtype, x.device)
        ctx.fast_accum, ctx.operands = options.fp8_fast_accum_input_grad, operands
        return tuple(fp8_outputs(x, weights, biases, emulate=emulate, fast_accum=options.fp8_fast_accum_forward,
                                 operands=operands))

    @staticmethod
    def inference(x, emulate, options, operands, weights, biases):
        """No gradient will be asked for: the weight-only product may serve few rows."""
        return fp8_outputs(x, weights, biases, emulate=emulate, weight_only=True,
                           fast_accum=options.fp8_fast_accum_forward, operands=operands)

    @staticmethod
    def backward(ctx, *dys):
        (m, k), dtype, device = ctx.x_meta
        dx = None
        if ctx.needs_input_grad[0]:
            dx = fp8_input_grad(dys, ctx.weights, m=m, k=k, dtype=dtype, device=device, emulate=ctx.emulate,
                                fast_accum=ctx.fast_accum, operands=ctx.operands)
        return (dx, None, None, None, None) + (None,) * (2 * len(ctx.weights))


def resolve_emulate(device: torch.device, emulate: bool | None) -> bool:
    """``None``: emulate exactly where the device has no FP8 tensor cores."""
    return (not fp8_supported(device)) if emulate is None else emulate


def frozen_projections(x: torch.Tensor, weights: Sequence[torch.Tensor | Fp8Weight],
                       biases: Sequence[torch.Tensor | None], *, emulate: bool | None = None,
                       options: KernelOptions | None = None, operands: QuantizedOperands | None = None,
                       nf4_workspace=None) -> list[torch.Tensor]:
    """The frozen part of a projection group, ``x [M, K] -> [M, N_i]``: ``F.linear`` for plain
    weights, FP8 (``Fp8FrozenProjections``, with ``options``' accumulation, taking offers from
    ``operands``) when the weights are ``Fp8Weight``; NF4 (``nf4.nf4_frozen_projections``, with
    ``options.nf4_gemm`` and the caller's ``nf4_workspace``) when they are ``nf4.Nf4Weight``."""
    if any(isinstance(w, Nf4Weight) for w in weights):
        return nf4_frozen_projections(x, weights, biases, gemm=options.nf4_gemm if options is not None else "auto",
                                      workspace=nf4_workspace)
    kinds = {isinstance(w, Fp8Weight) for w in weights}
    if kinds == {False}:
        return [torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases)]
    if kinds != {True}:
        raise TypeError("a projection group mixes FP8 and plain weights; quantize all or none")
    emulate = resolve_emulate(x.device, emulate)
    options = options if options is not None else KernelOptions()
    if not (torch.is_grad_enabled() and x.requires_grad):  # inference (the generation engine)
        return Fp8FrozenProjections.inference(x, emulate, options, operands, weights, biases)
    return list(Fp8FrozenProjections.apply(x, emulate, options, operands, len(weights), *weights, *biases))


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None, *,
               emulate: bool | None = None) -> torch.Tensor:
    """One frozen FP8 linear ``x [M, K] -> [M, N]``, differentiable w.r.t. ``x``."""
    return frozen_projections(x, [weight], [bias], emulate=emulate)[0]

