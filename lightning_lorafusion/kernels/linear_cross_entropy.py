"""Fused linear + cross-entropy summed per group, the input gradient formed in the forward.

For rows ``x [n, H]`` (through an optional row-wise differentiable ``pre``, e.g. the final
RMSNorm), a frozen weight ``W [V, H]``, targets ``[n]`` and owners ``[n]`` (the group each row
counts for; ``num_groups`` means nobody):

    sums[g] = sum over rows t owned by g of CE(pre(x_t) W^T, target_t)     -> [num_groups] fp32

Logits exist for ``chunk_size`` rows at a time and are never recomputed (the idea of Liger
Kernel's fused linear cross-entropy): while a chunk's logits are live, the forward also forms
d CE_t / d x_t = ((softmax - onehot) W) back through ``pre`` and keeps it, ``[n, H]`` in x's
dtype. Backward only scales row t's kept gradient by the incoming gradient of its owner's sum:
one logits GEMM fewer than recomputing checkpointed chunks. ``W`` and ``pre``'s parameters
get no gradient (frozen base).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def _chunk_losses(xc: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, pre, need_grad: bool,
                  ignore_index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row CE ``[C]`` fp32 (0 where ignored) and, if asked, its gradient w.r.t. ``xc``."""
    if need_grad and pre is not None:
        with torch.enable_grad():
            xin = xc.detach().requires_grad_(True)
            z = pre(xin)
    else:
        z = pre(xc) if pre is not None else xc
    logits = F.linear(z.detach(), weight).float()  # [C, V]; the same rounding as the checkpointed path
    lse = torch.logsumexp(logits, dim=-1)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    losses = torch.where(valid, lse - logits.gather(1, safe[:, None]).squeeze(1), 0.0)
    if not need_grad:
        return losses, None
    # d CE_t / d logits_t = softmax_t - onehot(target_t) on valid rows, 0 on ignored ones
    grad = logits.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, safe[:, None], -valid[:, None].to(grad.dtype))
    grad.mul_(valid[:, None])
    dz = grad.to(weight.dtype) @ weight  # [C, H]
    if pre is None:
        return losses, dz
    return losses, torch.autograd.grad(z, xin, dz)[0]


class _LinearCrossEntropySums(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, owners, num_groups, chunk_size, pre, ignore_index):
        need_grad = ctx.needs_input_grad[0]
        sums = torch.zeros(num_groups + 1, dtype=torch.float32, device=x.device)
        dx = torch.empty_like(x) if need_grad else None
        for c0 in range(0, x.shape[0], chunk_size):
            c1 = c0 + chunk_size
            losses, dxc = _chunk_losses(x[c0:c1], weight, targets[c0:c1], pre, need_grad, ignore_index)
            sums.index_add_(0, owners[c0:c1], losses)
            if need_grad:
                dx[c0:c1] = dxc
        ctx.save_for_backward(dx, owners)
        return sums[:num_groups].clone()

    @staticmethod
    def backward(ctx, grad_sums):
        dx, owners = ctx.saved_tensors
        # row t's share: the incoming gradient of its owner's sum (0 for rows owned by nobody),
        # applied in fp32 so a small 1/denominator is not rounded to x's dtype first
        per_group = torch.cat([grad_sums.float(), grad_sums.new_zeros(1, dtype=torch.float32)])
        scale = per_group.index_select(0, owners)
        return (dx * scale[:, None]).to(dx.dtype), None, None, None, None, None, None, None


def linear_cross_entropy_sums(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    owners: torch.Tensor,
    num_groups: int,
    *,
    chunk_size: int = 1024,
    pre: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """``[num_groups]`` fp32 sums of ``CE(pre(x) W^T, targets)`` per owner (see the module doc).

    x ``[n, H]``; weight ``[V, H]`` frozen; targets ``[n]`` int (``ignore_index``: no loss);
    owners ``[n]`` int64 in ``[0, num_groups]`` (``num_groups``: counted for nobody); ``pre``
    maps rows ``[C, H] -> [C, H]`` independently per row, differentiably (no gradient reaches
    its parameters). Differentiable w.r.t. ``x`` only.
    """
    n = x.shape[0]
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [n, H] and weight [V, H]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if targets.shape != (n,) or owners.shape != (n,):
        raise ValueError(f"targets and owners must be [{n}]; got {tuple(targets.shape)}, {tuple(owners.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    if weight.requires_grad:
        raise ValueError(
            "linear_cross_entropy_sums gives the weight no gradient (it is for a frozen LM head); "
            "detach it, or use the checkpointed LM-head loss"
        )
    return _LinearCrossEntropySums.apply(x, weight, targets, owners.to(torch.int64), num_groups, chunk_size,
                                         pre, ignore_index)
