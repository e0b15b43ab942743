"""The fused LoRA projections as two torch custom ops (forward, backward), so torch.compile
and CUDA graphs see two opaque ops instead of Python launches."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .block_sizes import GEMM_MODES, LoraBlockSizes
from .fused_lora_launch import _backward, _launch_fwd_gemm, _launch_s, _Plan
from .routing_table import LoraLaunchTable


@dataclasses.dataclass(frozen=True)
class _TableArgs:
    """The parts of ``LoraLaunchTable`` the launchers read, rebuilt from op arguments."""

    tiles: torch.Tensor
    block_tiles: torch.Tensor
    adapter_tiles: torch.Tensor
    adapter_tile_ptr: torch.Tensor
    adapter_int: torch.Tensor
    adapter_float: torch.Tensor
    block_m: int
    num_tiles: int
    s_numel: int
    a_rows: int
    max_total_rank: int
    max_adapter_tiles: int
    active: tuple[int, ...]
    has_dropout: bool
    max_rank: tuple[int, ...]

    @property
    def num_adapters(self) -> int:
        return int(self.adapter_int.shape[0])


def _table_to_args(table: LoraLaunchTable) -> tuple[list[torch.Tensor], list[int]]:
    tensors = [table.tiles, table.block_tiles, table.adapter_tiles, table.adapter_tile_ptr,
               table.adapter_int, table.adapter_float]
    meta = [table.block_m, table.num_tiles, table.s_numel, table.a_rows, table.max_total_rank,
            table.max_adapter_tiles, len(table.active), int(table.has_dropout), *table.max_rank]
    return tensors, meta


def _table_from_args(tensors: list[torch.Tensor], meta: list[int]) -> _TableArgs:
    return _TableArgs(*tensors, block_m=meta[0], num_tiles=meta[1], s_numel=meta[2], a_rows=meta[3],
                      max_total_rank=meta[4], max_adapter_tiles=meta[5], active=tuple(range(meta[6])),
                      has_dropout=bool(meta[7]), max_rank=tuple(meta[8:]))


def _sizes_to_args(sizes: LoraBlockSizes) -> list[int]:
    return [GEMM_MODES.index(v) if f.name == "gemm" else v
            for f in dataclasses.fields(sizes) for v in (getattr(sizes, f.name),)]


def _sizes_from_args(values: list[int]) -> LoraBlockSizes:
    fields = dataclasses.fields(LoraBlockSizes)
    return LoraBlockSizes(**{f.name: GEMM_MODES[v] if f.name == "gemm" else v for f, v in zip(fields, values)})


def _none_if_empty(t: torch.Tensor) -> Optional[torch.Tensor]:
    # The ops take plain tensor lists; a [0]-shaped tensor stands for "no bias" / "no LoRA".
    return None if t.numel() == 0 else t


def _op_plan(x, weights, b_cats, table_tensors, table_meta, sizes) -> _Plan:
    # Rebuilt on every op call: under torch.compile the launches run from the compiled graph.
    return _Plan(_table_from_args(table_tensors, table_meta), _sizes_from_args(sizes), m=x.shape[0],
                 k=x.shape[1], ns=[w.shape[0] for w in weights], b_cols=[bc.shape[-1] for bc in b_cats],
                 dtype=x.dtype, device=x.device)


@torch.library.custom_op("lightning_lorafusion::fused_lora_fwd", mutates_args=())
def fused_lora_fwd_op(
    x: torch.Tensor, a_all: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
    b_cats: list[torch.Tensor], table_tensors: list[torch.Tensor], table_meta: list[int],
    sizes: list[int], offset_h: int,
) -> list[torch.Tensor]:
    """Forward as a custom op: returns ``[Y_0 .. Y_{P-1}, S]``; empty biases / b_cats = none."""
    plan = _op_plan(x, weights, b_cats, table_tensors, table_meta, sizes)
    s = _launch_s(x, a_all, plan, offset_h)
    ys = [_launch_fwd_gemm(x, w, _none_if_empty(b), s, _none_if_empty(bc), i, plan)
          for i, (w, b, bc) in enumerate(zip(weights, biases, b_cats))]
    return ys + [s]


@fused_lora_fwd_op.register_fake
def _(x, a_all, weights, biases, b_cats, table_tensors, table_meta, sizes, offset_h):
    return [x.new_empty(x.shape[0], w.shape[0]) for w in weights] + [x.new_empty(max(table_meta[2], 1))]


@torch.library.custom_op("lightning_lorafusion::fused_lora_bwd", mutates_args=())
def fused_lora_bwd_op(
    dys: list[torch.Tensor], x: torch.Tensor, a_all: torch.Tensor, s: torch.Tensor,
    weights: list[torch.Tensor], b_cats: list[torch.Tensor], table_tensors: list[torch.Tensor],
    table_meta: list[int], sizes: list[int], offset_h: int,
) -> list[torch.Tensor]:
    """Backward as a custom op: returns ``[dX, dA_all, dB_0 .. dB_{P-1}]`` (``[0]``-shaped
    for projections without LoRA)."""
    plan = _op_plan(x, weights, b_cats, table_tensors, table_meta, sizes)
    dx, da, dbs = _backward(list(dys), x, a_all, s, weights, [_none_if_empty(bc) for bc in b_cats],
                            plan, offset_h, True, True, [True] * len(weights))
    # dA and the dB_i are views of one buffer; an op's outputs must not alias each other
    return [dx, da.clone()] + [x.new_empty(0) if db is None else db.clone() for db in dbs]


@fused_lora_bwd_op.register_fake
def _(dys, x, a_all, s, weights, b_cats, table_tensors, table_meta, sizes, offset_h):
    return [torch.empty_like(x), torch.empty_like(a_all)] + [torch.empty_like(bc) for bc in b_cats]


def _op_setup_context(ctx, inputs, output):
    x, a_all, weights, biases, b_cats, table_tensors, table_meta, sizes, offset_h = inputs
    ctx.save_for_backward(x, a_all, output[-1], *weights, *b_cats, *table_tensors)
    ctx.n_proj, ctx.n_table = len(weights), len(table_tensors)
    ctx.table_meta, ctx.sizes, ctx.offset_h = table_meta, sizes, offset_h


def _op_backward(ctx, grads):
    x, a_all, s, *rest = ctx.saved_tensors
    n = ctx.n_proj
    weights, b_cats, table_tensors = rest[:n], rest[n:2 * n], rest[2 * n:]
    dys = [g if g is not None else torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
           for g, w in zip(grads[:n], weights)]
    out = fused_lora_bwd_op(dys, x, a_all, s, list(weights), list(b_cats), list(table_tensors),
                            ctx.table_meta, ctx.sizes, ctx.offset_h)
    dbs = [None if bc.numel() == 0 else db for db, bc in zip(out[2:], b_cats)]
    # one entry per input; tensor lists mirrored element by element
    return out[0], out[1], [None] * n, [None] * n, dbs, [None] * ctx.n_table, None, None, None


fused_lora_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


# ----------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------
