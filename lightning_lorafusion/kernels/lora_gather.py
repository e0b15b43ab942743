"""Decode-time multi-adapter LoRA (S-LoRA's MBGMV): every row its own adapter and rank, one launch.

For row i of ``x [B, K]`` with adapter weights stored anywhere in a flat ``pool``:

    A_i  = pool[a_offsets[i] : a_offsets[i] + r_i * K].view(r_i, K)    (PEFT's lora_A layout)
    Bt_i = pool[b_offsets[i] : b_offsets[i] + r_i * N].view(r_i, N)    (PEFT's lora_B, transposed)
    delta[i] = scales[i] * (x[i] @ A_i^T) @ Bt_i                        (fp32 accumulation)

``ranks[i] == 0`` means no LoRA for the row (delta 0). Inference only: nothing here is
differentiable (the Triton path has no autograd; the reference runs under ``torch.no_grad``).
"""

from __future__ import annotations

import os

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("torch", "triton", "auto")


def _check_inputs(x, pool, a_offsets, b_offsets, ranks, scales, out_features, out) -> None:
    """Shapes, dtypes and devices only: no value is read (no device sync, CUDA-graph safe)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [rows, in_features]; got {getattr(x, 'shape', type(x))}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x.dtype={x.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if not isinstance(pool, torch.Tensor) or pool.dim() != 1:
        raise ValueError(f"pool must be a 1-D tensor of adapter weights; got {getattr(pool, 'shape', type(pool))}")
    if pool.dtype != x.dtype or pool.device != x.device:
        raise TypeError(f"pool is {pool.dtype} on {pool.device} but x is {x.dtype} on {x.device}; they must match")
    if not isinstance(out_features, int) or out_features < 1:
        raise ValueError(f"out_features must be a positive int; got {out_features!r}")
    b = x.shape[0]
    for name, t, dtype in (
        ("a_offsets", a_offsets, torch.int64),
        ("b_offsets", b_offsets, torch.int64),
        ("ranks", ranks, torch.int32),
        ("scales", scales, torch.float32),
    ):
        if not isinstance(t, torch.Tensor) or t.shape != (b,) or t.dtype != dtype or t.device != x.device:
            raise ValueError(
                f"{name} must be a [{b}] {dtype} tensor on {x.device} (one entry per row of x); got "
                f"{getattr(t, 'shape', type(t))} {getattr(t, 'dtype', '')} on {getattr(t, 'device', '')}"
            )
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != (b, out_features):
            raise ValueError(f"out must be [{b}, {out_features}]; got {getattr(out, 'shape', type(out))}")
        if out.dtype != x.dtype or out.device != x.device:
            raise TypeError(f"out is {out.dtype} on {out.device} but x is {x.dtype} on {x.device}; they must match")


def _add_into(delta: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    # One rounding to the output dtype, after the fp32 sum (what the kernel does).
    if out is None:
        return delta.to(dtype)
    out.copy_(out.float() + delta)
    return out


@torch.no_grad()
def lora_gather_reference(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    out_features: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row LoRA delta ``[B, N]`` (the spec of ``lora_gather``).

    x ``[B, K]``; pool 1-D (x's dtype and device); a_offsets / b_offsets ``[B]`` int64 element
    offsets into pool; ranks ``[B]`` int32 (0 = no LoRA); scales ``[B]`` fp32 (alpha / r);
    out_features N. Returns ``scale_i * (x_i A_i^T) Bt_i`` computed in fp32 and cast to
    x.dtype, or, with ``out [B, N]``, adds it into ``out`` in place (fp32 sum, one rounding)
    and returns ``out``. Rows with the same (offsets, rank) are computed as one matmul; the
    grouping reads the routing on the host (a device sync), so use it for CPU and tests.
    """
    _check_inputs(x, pool, a_offsets, b_offsets, ranks, scales, out_features, out)
    k, n = x.shape[1], out_features
    delta = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
    keys = torch.stack([a_offsets, b_offsets, ranks.to(torch.int64)], dim=1)
    live = ranks > 0
    if bool(live.any()):
        if bool((ranks < 0).any()):
            raise ValueError(f"ranks must be >= 0; got {ranks.tolist()}")
        groups, inverse = torch.unique(keys[live], dim=0, return_inverse=True)
        live_rows = live.nonzero().squeeze(1)
        for g, (a, b, r) in enumerate(groups.tolist()):
            if a < 0 or b < 0 or a + r * k > pool.numel() or b + r * n > pool.numel():
                raise ValueError(
                    f"adapter at a_offset={a}, b_offset={b}, rank={r} reaches past the pool "
                    f"({pool.numel()} elements, K={k}, N={n})"
                )
            rows = live_rows[inverse == g]
            s = x[rows].float() @ pool[a : a + r * k].view(r, k).float().T
            delta[rows] = (s * scales[rows, None]) @ pool[b : b + r * n].view(r, n).float()
    return _add_into(delta, x.dtype, out)


def lora_gather(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    out_features: int,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Same contract as ``lora_gather_reference``; ``backend``: "torch" (the reference),
    "triton" (one launch for all rows; CUDA, or CPU under TRITON_INTERPRET=1) or "auto"
    (Triton on CUDA, torch elsewhere). The Triton path reads no value on the host, so it can
    be captured in a CUDA graph. Ranks up to ``MAX_RANK_CHUNK`` are summed in one fp32
    accumulator; larger ranks are correct but add one rounding of ``out`` per chunk."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {BACKENDS}")
    if backend == "auto":
        backend = "triton" if x.is_cuda else "torch"
    if backend == "torch":
        return lora_gather_reference(x, pool, a_offsets, b_offsets, ranks, scales, out_features, out=out)
    raise NotImplementedError("the Triton lora_gather kernel is being written; use backend='torch'")
