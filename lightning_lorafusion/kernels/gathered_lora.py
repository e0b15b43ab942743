"""The decode rows' LoRA contract: per-row tables into a flat pool of adapter weights
(``lora_gather``'s arguments, ``GatheredLora`` for projections that share an input), their
checks, and the torch reference that is the spec of every decode LoRA kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_RANK = 128  # largest rank per row (the shrink's scratch holds this many sums per K block)


def check_gather_inputs(x, pool, a_offsets, b_offsets, ranks, scales, out_features, out) -> None:
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
    offsets into pool; ranks ``[B]`` int32 (0 = no LoRA, at most MAX_RANK = 128); scales
    ``[B]`` fp32 (alpha / r); out_features N. Returns ``scale_i * (x_i A_i^T) Bt_i`` computed in fp32 and cast to
    x.dtype, or, with ``out [B, N]``, adds it into ``out`` in place (fp32 sum, one rounding)
    and returns ``out``. Rows with the same (offsets, rank) are computed as one matmul; the
    grouping reads the routing on the host (a device sync), so use it for CPU and tests.
    """
    check_gather_inputs(x, pool, a_offsets, b_offsets, ranks, scales, out_features, out)
    k, n = x.shape[1], out_features
    delta = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
    keys = torch.stack([a_offsets, b_offsets, ranks.to(torch.int64)], dim=1)
    live = ranks > 0
    if bool(live.any()):
        if bool((ranks < 0).any()) or bool((ranks > MAX_RANK).any()):
            raise ValueError(f"ranks must be in [0, {MAX_RANK}]; got {ranks.tolist()}")
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



@dataclass(frozen=True)
class GatheredLora:
    """The decode rows' LoRA for G projections that share an input (q/k/v: G=3, gate/up: 2, or
    one projection): row i of ``x [B, K]`` uses, for projection g, ``A`` at ``a_offsets[g, i]``
    and ``B^T`` at ``b_offsets[g, i]`` in ``pool`` with rank ``ranks[g, i]`` (0 = none) and
    scale ``scales[i]``, as in ``lora_gather``. The projections' outputs hold these B rows from
    ``first_row`` on (rows outside ``[first_row, first_row + B)``, e.g. a step's prefill rows,
    get no LoRA from here).

    ``a_offsets`` / ``b_offsets [G, B]`` int64, ``ranks [G, B]`` int32 (unit stride along rows;
    any stride between projections), ``scales [B]`` fp32, all on x's device.
    """

    x: torch.Tensor
    pool: torch.Tensor
    a_offsets: torch.Tensor
    b_offsets: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    first_row: int = 0
    # the rows grouped by adapter (``decode_groups``): [4, n] int32 start / end into the third
    # row, the rows sorted by adapter; None: the per-row shrink
    groups: torch.Tensor | None = None
    # the rows' ranks are known on the host to be at most this (a decode step's largest rank,
    # bucketed: ``lora_gather.decode_rank_bound``); None: any up to MAX_RANK. It picks which
    # kernel variant the launches take, never what they compute: every variant takes every rank
    rank_bound: int | None = None
    # the group's shrink already launched, on another stream beside the frozen GEMM
    # (``lora_gather.shrink_beside``): ``(part, k_blocks)`` as ``lora_shrink`` returns them, which
    # the consumers read instead of launching it; None: the consumer launches it
    partials: tuple[torch.Tensor, int] | None = None

    @property
    def num_projections(self) -> int:
        return self.a_offsets.shape[0]

    def check(self, out_features: tuple[int, ...], rows: int) -> None:
        """Shapes only (no value read): one output width per projection; ``rows``: rows of the
        outputs, which must hold the gathered rows."""
        g, b = self.a_offsets.shape if self.a_offsets.dim() == 2 else (None, None)
        if g is None or len(out_features) != g:
            raise ValueError(f"GatheredLora.a_offsets must be [{len(out_features)}, rows]; got "
                             f"{tuple(self.a_offsets.shape)}")
        for name in ("b_offsets", "ranks"):
            t = getattr(self, name)
            if t.shape != (g, b) or t.stride(1) != 1:
                raise ValueError(f"GatheredLora.{name} must be [{g}, {b}] with unit row stride like "
                                 f"a_offsets; got {tuple(t.shape)} strides {t.stride()}")
        if self.a_offsets.stride(1) != 1:
            raise ValueError(f"GatheredLora.a_offsets needs unit row stride; got {self.a_offsets.stride()}")
        for i in range(g):
            check_gather_inputs(self.x, self.pool, self.a_offsets[i], self.b_offsets[i], self.ranks[i], self.scales,
                          out_features[i], None)
        if not 0 <= self.first_row or self.first_row + b > rows:
            raise ValueError(f"GatheredLora: {b} rows from first_row={self.first_row} must lie within the "
                             f"outputs' {rows} rows")

    def add_reference(self, outs: list[torch.Tensor]) -> None:
        """Add each projection's LoRA into ``outs[g] [rows, N_g]`` (rows from ``first_row``), in
        place, with ``lora_gather_reference``."""
        for g, y in enumerate(outs):
            lora_gather_reference(self.x, self.pool, self.a_offsets[g], self.b_offsets[g], self.ranks[g],
                                  self.scales, y.shape[1], out=y[self.first_row:self.first_row + self.x.shape[0]])
