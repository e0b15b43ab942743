"""FusedLoRA / FusedMultiLoRA: Triton kernels, launchers and the autograd Function.

One call handles a group of projections that share an input (q/k/v, gate/up, or a single
o/down projection) for every adapter routed in the microbatch. The graph is split at the small
tensor S = dropout(X) A^T (compact ``[rows, total rank of the row's adapter]``):

forward
  1. ``_lora_s_kernel``: S for all projections of a row tile in one pass over X (dropout mask
     drawn in-kernel from the hash, never stored).
  2. ``_lora_fwd_gemm_kernel``: Y_i = X W_i^T (+ bias) + scale * S_i B_i^T, the LoRA term
     accumulated into the GEMM's accumulator.
backward
  3. ``_lora_ds_kernel``: dS_i = scale * dY_i B_i (per row tile).
  4. ``_lora_db_kernel``: dB_i = scale * dY_i^T S_i (per adapter, split over its tiles).
  5. ``_lora_dx_gemm_kernel``: dX = sum_i dY_i W_i + (dS A) * mask / (1 - p), the LoRA term in
     the same accumulator as the frozen GEMM.
  6. ``_lora_da_kernel``: dA = dS^T (X * mask / (1 - p)), mask regenerated.

Saved for backward: X (held by the previous layer anyway), S, and references to the frozen
weights and the small concatenated A/B.

FP8 base (``fp8_linear.Fp8Weight`` weights): the frozen products of steps 2 and 5 go through
``fp8_linear`` (X quantized once per group; dX of the group in one product) and the LoRA terms
are added in place by ``_lora_add_kernel``, whatever ``LoraBlockSizes.gemm`` says. An NF4 base
(``nf4.Nf4Weight``) takes the same route: each weight dequantized into a scratch buffer and
multiplied by cuBLAS (``nf4.nf4_outputs`` / ``nf4_input_grad``). Routing is per row tile (``routing_table.py``), so any
segment layout is correct; segments padded to ``block_sizes.pad_multiple()`` avoid partial tiles.

Layout of the op: the Triton kernels are in
``fused_lora_kernels.py``; the host-side launch plans and launchers (and the backward's launch
sequence) in ``fused_lora_launch.py``; the torch custom ops used under torch.compile in
``fused_lora_ops.py``; this module holds the autograd Function, the input checks and the
public entry point ``fused_lora_projections``.
"""


from __future__ import annotations

import contextlib
import os
from typing import Sequence

import torch

from .block_sizes import LoraBlockSizes, block_sizes_for
from .dropout_triton import offset_hash_arg
from .fp8_linear import Fp8Weight, QuantizedOperands, frozen_projections
from .nf4 import Nf4Weight
from .fused_lora_launch import GroupFactors, _backward, _launch_fwd_fp8, _launch_fwd_gemm, _launch_s, _Plan
from .fused_lora_ops import _sizes_to_args, _table_to_args, fused_lora_fwd_op
from .options import KernelOptions
from .reference import LoraModuleWeights, LoraRouting
from .routing_table import PLAN_KEY, build_launch_table

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_NAME = "fp8 (Fp8Weight)"
NF4_NAME = "nf4 (Nf4Weight)"


class FusedLoraProjections(torch.autograd.Function):
    """Shared-input projections with per-row-tile LoRA; differentiable w.r.t. X, A and B.

    ``group`` None: the gradients of ``a_all`` and ``b_cats`` (concatenations of the factors) go
    back to autograd. A ``GroupFactors``: ``a_all`` and ``b_cats`` are its gather (no autograd
    history) and the factors themselves follow as inputs (``group.leaves``); backward adds their
    gradients into their ``.grad`` in one launch and returns None for them (or, where it cannot,
    their gradients as views, for autograd to accumulate)."""

    @staticmethod
    def forward(ctx, x, a_all, plan, off_h, operands, group, *rest):
        n_proj = len(plan.ns)
        weights = rest[:n_proj]
        biases = rest[n_proj:2 * n_proj]
        b_cats = rest[2 * n_proj:3 * n_proj]
        s = _launch_s(x, a_all, plan, off_h)
        # quantized frozen weights (FP8 or NF4) hold frozen buffers only: kept by reference
        ctx.fp8_weights = tuple(weights) if isinstance(weights[0], (Fp8Weight, Nf4Weight)) else None
        # with a group, A_all and B_cat are gathered again in backward instead of kept (their
        # values do not change in between; at 2,816 tokens they are ~4 % of what an 8B layer keeps)
        kept = (a_all, *b_cats) if group is None else ()
        if ctx.fp8_weights is not None:
            ys = tuple(_launch_fwd_fp8(x, weights, biases, s, b_cats, plan, operands))
            ctx.save_for_backward(x, s, *kept)  # Fp8Weights hold frozen buffers only
        else:
            ys = tuple(
                _launch_fwd_gemm(x, w, b, s, bc, i, plan)
                for i, (w, b, bc) in enumerate(zip(weights, biases, b_cats))
            )
            ctx.save_for_backward(x, s, *kept, *weights)
        ctx.plan, ctx.off_h, ctx.n_proj, ctx.operands, ctx.group = plan, off_h, n_proj, operands, group
        ctx.mark_non_differentiable(s)
        return ys

    @staticmethod
    def backward(ctx, *dys):
        x, s, *rest = ctx.saved_tensors
        n_proj, group = ctx.n_proj, ctx.group
        if group is None:
            a_all, b_cats, weights = rest[0], rest[1:1 + n_proj], rest[1 + n_proj:]
        else:
            (a_all, b_cats), weights = group.factors(x.dtype), rest
        if ctx.fp8_weights is not None:
            weights = ctx.fp8_weights
        rest = [*weights, *b_cats]
        need = ctx.needs_input_grad
        none = (None, None, None, None, None, None, *([None] * (3 * n_proj)))
        if group is None:
            need_db = [need[6 + 2 * n_proj + i] for i in range(n_proj)]
            dx, da, db_cats = _backward(list(dys), x, a_all, s, rest[:n_proj], rest[n_proj:], ctx.plan,
                                        ctx.off_h, need[0], need[1], need_db, ctx.operands)
            return (dx, da, *none[2:6], *([None] * (2 * n_proj)), *db_cats)
        grads = group.grads()
        dx, da, db_cats = _backward(list(dys), x, a_all, s, rest[:n_proj], rest[n_proj:], ctx.plan, ctx.off_h,
                                    need[0], True, [True] * n_proj, ctx.operands,
                                    None if grads is None else (group, grads))
        leaf_grads = [None] * len(group.leaves) if grads is not None else group.split(da, db_cats)
        return (dx, *none[1:], *leaf_grads)


def _check_inputs(x, weights, biases, loras, routing: LoraRouting) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [tokens, hidden]; got {getattr(x, 'shape', type(x))}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x.dtype={x.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors (x is on {x.device}); use backend='torch' or "
            "'auto' on the CPU, or set TRITON_INTERPRET=1 to run the kernels in the interpreter"
        )
    m, k = x.shape
    if m == 0 or k == 0:
        raise ValueError(f"x has an empty dimension {tuple(x.shape)}; pass at least one token and feature")
    if x.numel() >= 2**31:
        raise ValueError(f"x has {x.numel()} elements; the kernels index with int32 (< 2^31)")
    if not (len(weights) == len(biases) == len(loras)) or not weights:
        raise ValueError(
            f"weights, biases and loras need one entry per projection; got {len(weights)}, "
            f"{len(biases)}, {len(loras)}"
        )
    if routing.num_rows != m:
        raise ValueError(f"routing.num_rows={routing.num_rows} but x has {m} rows")
    if len({type(w) if isinstance(w, (Fp8Weight, Nf4Weight)) else torch.Tensor for w in weights}) > 1:
        raise TypeError("a projection group mixes quantized (FP8/NF4) and plain weights; quantize all or none")
    for i, (w, b, lora) in enumerate(zip(weights, biases, loras)):
        if len(w.shape) != 2 or w.shape[1] != k:
            raise ValueError(f"weights[{i}] must be [N, {k}] to match x [M, {k}]; got {tuple(w.shape)}")
        w_dtype = FP8_NAME if isinstance(w, Fp8Weight) else NF4_NAME if isinstance(w, Nf4Weight) else w.dtype
        if (w_dtype != x.dtype and w_dtype not in (FP8_NAME, NF4_NAME)) or w.device != x.device:
            raise TypeError(
                f"weights[{i}] is {w_dtype} on {w.device} but x is {x.dtype} on {x.device}; "
                "cast the frozen weights to the activation dtype"
            )
        if w.shape[0] * w.shape[1] >= 2**31 or m * w.shape[0] >= 2**31:
            raise ValueError(f"projection {i} is too large for int32 indexing; split the rows")
        if b is not None and (b.shape != (w.shape[0],) or b.dtype != x.dtype or b.device != x.device):
            raise ValueError(
                f"biases[{i}] must be [{w.shape[0]}] {x.dtype} on {x.device}; got "
                f"{tuple(b.shape)} {b.dtype} on {b.device}"
            )
        if lora is None:
            continue
        if len(lora.a) != routing.num_adapters or len(lora.b) != routing.num_adapters:
            raise ValueError(
                f"loras[{i}] has {len(lora.a)} A / {len(lora.b)} B entries but routing has "
                f"{routing.num_adapters} adapters; pass one (possibly None) per adapter"
            )
        for ad, (a, bb) in enumerate(zip(lora.a, lora.b)):
            if (a is None) != (bb is None):
                raise ValueError(f"loras[{i}] adapter {ad}: A and B must both be given or both None")
            if a is None:
                continue
            if a.dim() != 2 or a.shape[1] != k or a.shape[0] < 1:
                raise ValueError(f"loras[{i}].a[{ad}] must be [rank >= 1, {k}]; got {tuple(a.shape)}")
            if bb.shape != (w.shape[0], a.shape[0]):
                raise ValueError(
                    f"loras[{i}].b[{ad}] must be [{w.shape[0]}, {a.shape[0]}] (N, rank); got {tuple(bb.shape)}"
                )
            if a.dtype not in SUPPORTED_DTYPES or bb.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"loras[{i}] adapter {ad}: A/B dtype must be one of {SUPPORTED_DTYPES}")
            if a.device != x.device or bb.device != x.device:
                raise ValueError(f"loras[{i}] adapter {ad}: A/B must be on {x.device}")


def lora_ranks(loras: Sequence[LoraModuleWeights | None], num_adapters: int) -> tuple[tuple[int, ...], ...]:
    """``ranks[projection][adapter]``, 0 where the adapter has no LoRA on that projection."""
    return tuple(
        tuple(0 if l is None or l.a[a] is None else int(l.a[a].shape[0]) for a in range(num_adapters))
        for l in loras
    )


def _concat(parts: list[torch.Tensor], dim: int, dtype: torch.dtype, keep_fp32: bool) -> torch.Tensor:
    # Differentiable concatenation (gradients flow back to each adapter's factor); a single
    # factor is used as is, saving a copy and a launch in the common one-adapter case.
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
    if keep_fp32 and all(p.dtype == torch.float32 for p in parts):
        return out.contiguous()
    return out.to(dtype).contiguous()


def _factors(loras, table, dtype, keep_fp32: bool = False) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """A_all (active adapters' A factors stacked in ``table.a_order``) and per projection B_cat,
    in ``dtype``; with ``keep_fp32``, fp32 factors stay fp32: the kernels round each value to
    the activations' dtype as they load it (the rounding a cast would do) and their gradients
    come back in fp32, which saves a cast launch per concatenation and per gradient each call."""
    a_all = _concat([loras[i].a[a] for a, i in table.a_order], 0, dtype, keep_fp32)
    b_cats = [_concat([loras[i].b[a] for a in order], 1, dtype, keep_fp32) if order else None
              for i, order in enumerate(table.b_order)]
    return a_all, b_cats


def fused_lora_projections(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor | Fp8Weight],
    biases: Sequence[torch.Tensor | None],
    loras: Sequence[LoraModuleWeights | None],
    routing: LoraRouting,
    *,
    dropout_offset: int = 0,
    block_sizes: LoraBlockSizes | None = None,
    options: KernelOptions | None = None,
    operands: QuantizedOperands | None = None,
) -> list[torch.Tensor]:
    """Fused ``x [M, K] -> [M, N_i]`` per projection, same math as ``lora_projections_reference``.

    ``weights[i]`` [N_i, K] (a tensor of x's dtype, or an ``Fp8Weight``) and ``biases[i]`` [N_i]
    are frozen (no gradients). ``loras[i].a[a]``
    [r, K] / ``.b[a]`` [N_i, r] (or None) get gradients, as does ``x``. All projections share one
    dropout mask per adapter, drawn from (seed, ``dropout_offset``, row, col).
    ``options``: the FP8 products' accumulation (``KernelOptions``; default: fp32). ``operands``:
    an FP8 group's quantized input / output gradient offered by its neighbour (``fp8_swiglu``).
    """
    _check_inputs(x, weights, biases, loras, routing)
    x = x.contiguous()
    weights = [w if isinstance(w, (Fp8Weight, Nf4Weight)) else w.contiguous() for w in weights]
    biases = [None if b is None else b.contiguous() for b in biases]
    ranks = lora_ranks(loras, routing.num_adapters)
    if torch.compiler.is_compiling():
        return _compiled_projections(x, weights, biases, loras, routing, ranks, dropout_offset, block_sizes)
    # The plan (tables, grids, split counts, launch objects) is built by the first call of a
    # microbatch and reused by every layer: the per-call host work is the lookup below.
    # ``block_sizes`` is keyed by identity; the plan holds it, so the id stays unique.
    options = options if options is not None else KernelOptions()
    key = (PLAN_KEY, id(block_sizes), ranks, x.dtype, x.device, x.shape[1], tuple(w.shape[0] for w in weights),
           options)
    plan = routing.launch_cache.get(key)
    if plan is None:
        sizes = block_sizes if block_sizes is not None else block_sizes_for(x.device)
        table = build_launch_table(routing, ranks, sizes.block_m, x.device)
        plan = _NO_LORA if table.a_rows == 0 else _Plan(
            table, sizes, m=x.shape[0], k=x.shape[1], ns=key[6], b_cols=table.b_cols, dtype=x.dtype,
            device=x.device, options=options)
        routing.launch_cache[key] = plan
    if plan is _NO_LORA:  # no routed row has LoRA here: the frozen projections alone
        return frozen_projections(x, weights, biases, options=options, operands=operands)
    table = plan.table
    if routing.accumulate_grads and torch.is_grad_enabled():
        group = _group_factors(routing, plan, loras)
        if group is not None:
            a_all, b_cats = group.factors(x.dtype)
            return list(FusedLoraProjections.apply(x, a_all, plan, offset_hash_arg(dropout_offset), operands, group,
                                                   *weights, *biases, *b_cats, *group.leaves))
    a_all, b_cats = _factors(loras, table, x.dtype, keep_fp32=True)
    return list(FusedLoraProjections.apply(x, a_all, plan, offset_hash_arg(dropout_offset), operands, None,
                                           *weights, *biases, *b_cats))


def _group_factors(routing: LoraRouting, plan: _Plan, loras) -> GroupFactors | None:
    """The group's ``GroupFactors`` (cached with the routing's plans), or None where a factor is not
    a leaf that takes a gradient (e.g. a B scaled by a per-module alpha: autograd must see it)."""
    table = plan.table
    a_leaves = [loras[i].a[a] for a, i in table.a_order]
    b_leaves = [[loras[i].b[a] for a in order] for i, order in enumerate(table.b_order)]
    every = [*a_leaves, *(leaf for per in b_leaves for leaf in per)]
    key = (PLAN_KEY, "group-factors", id(plan), *(id(leaf) for leaf in every))
    group = routing.launch_cache.get(key)
    if group is None:
        if not all(leaf.is_leaf and leaf.requires_grad for leaf in every):
            return None
        cache = routing.launch_cache  # a captured step's tables say, when asked, where to allocate
        group = cache[key] = GroupFactors(
            plan, a_leaves, b_leaves, lambda: getattr(cache, "allocation_context", contextlib.nullcontext)())
    return group


_NO_LORA = object()  # plan-cache entry of a group none of whose routed rows has LoRA


def _compiled_projections(x, weights, biases, loras, routing, ranks, dropout_offset, block_sizes):
    """Under torch.compile: trace the custom ops (fake tensors for shapes), not the launches."""
    if isinstance(weights[0], (Fp8Weight, Nf4Weight)):
        raise NotImplementedError(
            "the FP8 and NF4 bases are not supported inside torch.compile of the LoRA projections (the "
            "custom ops take plain weights); run the projections eagerly"
        )
    sizes = block_sizes if block_sizes is not None else block_sizes_for(x.device)
    table = build_launch_table(routing, ranks, sizes.block_m, x.device)
    if table.a_rows == 0:
        return frozen_projections(x, weights, biases)
    a_all, b_cats = _factors(loras, table, x.dtype)
    tensors, meta = _table_to_args(table)
    empty = x.new_empty(0)
    out = fused_lora_fwd_op(
        x, a_all, weights, [empty if b is None else b for b in biases],
        [empty if bc is None else bc for bc in b_cats], tensors, meta, _sizes_to_args(sizes),
        offset_hash_arg(dropout_offset),
    )
    return list(out[:-1])
