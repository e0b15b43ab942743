"""FusedLoRA launch plans and launchers: grids, block sizes and constexprs of each kernel of
``fused_lora_kernels.py`` for one routing table, and the backward's launch sequence.

A ``_Plan`` (table, grids, constexprs, split counts, ``triton_launch.CachedLaunch`` objects) is
built by the first call of a microbatch for each group shape and reused by every layer, so a
call costs a dictionary lookup plus the launches themselves.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from .block_sizes import LoraBlockSizes
from .fp8_linear import Fp8Weight, QuantizedOperands, fp8_input_grad, fp8_outputs, resolve_emulate
from .nf4 import Nf4Weight, nf4_input_grad, nf4_outputs
from .fused_lora_kernels import (_accumulate_grads_kernel, _gather_factors_kernel, _lora_add_kernel,
                                 _lora_da_kernel, _lora_db_kernel, _lora_ds_kernel, _lora_dx_gemm_kernel,
                                 _lora_fwd_gemm_kernel, _lora_s_kernel, _split_sum_kernel)
from .options import KernelOptions
from .routing_table import AI_FIRST_PROJ, AI_PER_PROJ
from .triton_launch import CachedLaunch

MAX_FUSED_DX_PROJECTIONS = 3  # dX GEMM sums up to this many (dY_i, W_i) pairs per launch
SPLIT_MIN_STEPS = 4  # loop steps along K (S) or N (dS) a split program runs at least
SPLIT_SUM_BLOCK = 1024
FACTOR_BLOCK = 1024  # elements per program of the factor gather / accumulation launches


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _round16b(numel: int) -> int:
    # fp32 elements up to the next multiple of 16 bytes (keeps sub-buffer pointers aligned)
    return _cdiv(numel, 4) * 4


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get full-precision dots (tests compare to float64); 16-bit ones ignore this.
    return "ieee" if dtype == torch.float32 else "tf32"


def _rank_block(rank: int, cap: int) -> int:
    return max(16, min(cap, _next_pow2(rank)))


def _split_count(programs: int, max_tiles: int, sms: int | None, waves: int) -> int:
    """How many shares to split an adapter's tiles into so the grid fills the GPU ``waves``
    times over (programs per SM); ``sms=None`` (interpreter): 2, to exercise the split path."""
    if max_tiles <= 1:
        return 1
    if sms is None:
        return min(2, max_tiles)
    return max(1, min(max_tiles, _cdiv(waves * sms, max(programs, 1))))


def _reduction_split_count(programs: int, steps: int, sms: int | None, waves: int) -> int:
    """Shares of its long reduction (``K`` for S, ``N`` for dS) a skinny rank kernel splits into
    so that its grid (``programs`` per share) fills the GPU ``waves`` times over, each share
    ``SPLIT_MIN_STEPS`` loop steps at least; ``sms=None`` (interpreter): 2 where there are 2
    steps, to exercise the split path."""
    if sms is None:
        return min(2, steps)
    return max(1, min(_cdiv(steps, SPLIT_MIN_STEPS), _cdiv(waves * sms, max(programs, 1))))


class _Plan:
    """Everything host-side about one projection group's launches on one routing table.

    Built once per (routing table, K, N_i, dtype, device, block sizes) and cached in the
    routing's ``launch_cache``, so every layer of a microbatch reuses it: grids, tile sizes and
    constexprs (``CachedLaunch`` objects, made on first use), the kernel options (FP8
    accumulation), the device's SM count, the dA/dB
    split count and the layout of their joint fp32 partial-sum buffer ``[split, part_numel]``
    (dA ``[a_rows, K]`` at ``part_offsets[0]``, dB_i ``[N_i, b_cols_i]`` at ``part_offsets[1 + i]``).
    """

    __slots__ = ("table", "sizes", "m", "k", "ns", "precision", "split", "s_split", "ds_split", "part_offsets",
                 "part_numel", "launches", "options")

    def __init__(self, table, sizes: LoraBlockSizes, *, m: int, k: int, ns: Sequence[int],
                 b_cols: Sequence[int], dtype: torch.dtype, device: torch.device,
                 options: KernelOptions | None = None) -> None:
        self.table, self.sizes, self.m, self.k, self.ns = table, sizes, m, k, tuple(ns)
        self.options = options if options is not None else KernelOptions()
        self.precision = _dot_precision(dtype)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
        # one split for dA and every dB (they share the partial buffer), sized for dA, which
        # reads X and is the largest of them
        rblocks = _cdiv(table.max_total_rank, _rank_block(table.max_total_rank, 64))
        programs = _cdiv(k, sizes.skinny_block_k) * len(table.active) * rblocks
        self.split = _split_count(programs, table.max_adapter_tiles, sms, sizes.split_waves)
        # S and dS split their long sums when the row tiles alone leave the GPU idle; dS: one
        # split for every projection of the group (they share dS and its partial buffer)
        _, subs = _skinny_rows(table, sizes.skinny_block_m)
        s_programs = table.num_tiles * subs * _cdiv(table.max_total_rank, _rank_block(table.max_total_rank, 128))
        self.s_split = _reduction_split_count(s_programs, _cdiv(k, sizes.skinny_block_k), sms, sizes.ds_waves)
        self.ds_split = _reduction_split_count(table.num_tiles * subs, _cdiv(max(self.ns), sizes.skinny_block_k), sms,
                                               sizes.ds_waves)
        offsets, numel = [0], _round16b(table.a_rows * k)
        for n, bc in zip(self.ns, b_cols):
            offsets.append(numel)
            numel += _round16b(n * bc)
        self.part_offsets, self.part_numel = tuple(offsets), numel
        self.launches: dict = {}

    def get(self, key, build, *args):
        """The launch stored under ``key``, made by ``build(self, *args)`` on first use."""
        hit = self.launches.get(key)
        if hit is None:
            hit = self.launches[key] = build(self, *args)
        return hit


def _skinny_rows(table, block_m: int) -> tuple[int, int]:
    sub_m = min(block_m, table.block_m)
    return sub_m, table.block_m // sub_m


def _build_s(plan: _Plan):
    t, sz = plan.table, plan.sizes
    block_r = _rank_block(t.max_total_rank, 128)
    sub_m, subs = _skinny_rows(plan.table, sz.skinny_block_m)
    split = plan.s_split
    k_per_split = _cdiv(_cdiv(plan.k, sz.skinny_block_k), split) * sz.skinny_block_k
    launch = CachedLaunch(
        _lora_s_kernel, (t.num_tiles * subs, _cdiv(t.max_total_rank, block_r), split),
        num_warps=sz.skinny_warps if block_r <= 64 else 8, num_stages=sz.skinny_stages,
        AI_STRIDE=t.adapter_int.shape[1], HAS_DROPOUT=t.has_dropout, TILE_M=t.block_m, BLOCK_M=sub_m,
        BLOCK_R=block_r, BLOCK_K=sz.skinny_block_k, PARTIAL=split > 1, DOT_PRECISION=plan.precision,
    )
    return launch, (plan.k, subs, k_per_split, max(t.s_numel, 1))


def _launch_s(x, a_all, plan: _Plan, off_h: int) -> torch.Tensor:
    t = plan.table
    s = torch.empty(max(t.s_numel, 1), dtype=x.dtype, device=x.device)
    part = (torch.empty(plan.s_split, max(t.s_numel, 1), dtype=torch.float32, device=x.device)
            if plan.s_split > 1 else None)
    launch, fixed = plan.get("s", _build_s)
    launch(x, a_all, s if part is None else part, t.tiles, t.adapter_int, t.adapter_float, off_h, *fixed)
    if part is not None:
        _launch_split_sum(part, s, plan, plan.s_split)
    return s


def _build_add(plan: _Plan, proj: int, dx_mode: bool, n: int, right_stride: int):
    t, sz = plan.table, plan.sizes
    sub_m, subs = _skinny_rows(plan.table, sz.add_block_m)
    rank = t.max_total_rank if dx_mode else t.max_rank[proj]
    launch = CachedLaunch(
        _lora_add_kernel, (t.num_tiles * subs, _cdiv(n, sz.add_block_n * sz.add_n_blocks)),
        num_warps=sz.add_warps, num_stages=2,
        AI_STRIDE=t.adapter_int.shape[1], DX_MODE=dx_mode, HAS_DROPOUT=t.has_dropout, TILE_M=t.block_m,
        BLOCK_M=sub_m, BLOCK_N=sz.add_block_n, BLOCK_R=_rank_block(rank, sz.rank_block),
        N_BLOCKS=sz.add_n_blocks, DOT_PRECISION=plan.precision,
    )
    return launch, (n, right_stride, AI_FIRST_PROJ + AI_PER_PROJ * proj, subs)


def _launch_add(out, left, right, proj: int, plan: _Plan, off_h: int, dx_mode: bool) -> None:
    """``out += LoRA term`` on the tiles' rows (see ``_lora_add_kernel``)."""
    t = plan.table
    launch, fixed = plan.get(("add", proj, dx_mode), _build_add, proj, dx_mode, out.shape[1], right.shape[1])
    launch(out, left, right, t.tiles, t.adapter_int, t.adapter_float, off_h, *fixed)


def _launch_fwd_fp8(x, weights, biases, s, b_cats, plan: _Plan,
                    operands: QuantizedOperands | None = None) -> list[torch.Tensor]:
    """Quantized frozen products of the group (FP8: X quantized once, or taken from
    ``operands``; NF4: weights dequantized), each LoRA term added in place."""
    if isinstance(weights[0], Nf4Weight):  # NF4: each weight dequantized, then cuBLAS
        ys = nf4_outputs(x, weights, biases, plan.options.nf4_gemm)
    else:
        ys = fp8_outputs(x, weights, biases, emulate=resolve_emulate(x.device, None),
                         fast_accum=plan.options.fp8_fast_accum_forward, operands=operands)
    for proj, (y, b_cat) in enumerate(zip(ys, b_cats)):
        if b_cat is not None and plan.table.max_rank[proj] > 0:
            _launch_add(y, s, b_cat, proj, plan, 0, dx_mode=False)
    return ys


def _build_fwd_gemm(plan: _Plan, proj: int, has_bias: bool, has_lora: bool, n: int, b_stride: int):
    t, sz = plan.table, plan.sizes
    bm, bn, bk = sz.block_m, sz.fwd_block_n, sz.fwd_block_k
    launch = CachedLaunch(
        _lora_fwd_gemm_kernel, (_cdiv(plan.m, bm) * _cdiv(n, bn),),
        num_warps=sz.fwd_warps, num_stages=sz.fwd_stages,
        AI_STRIDE=t.adapter_int.shape[1], HAS_BIAS=has_bias, HAS_LORA=has_lora,
        MAIN_LOOP=sz.gemm == "triton",
        EVEN_K=plan.k % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_R=_rank_block(t.max_rank[proj], sz.rank_block), GROUP_M=sz.group_m,
        DOT_PRECISION=plan.precision,
    )
    return launch, (plan.m, n, plan.k, b_stride, AI_FIRST_PROJ + AI_PER_PROJ * proj)


def _launch_fwd_gemm(x, w, bias, s, b_cat, proj: int, plan: _Plan) -> torch.Tensor:
    t, gemm = plan.table, plan.sizes.gemm
    has_lora = b_cat is not None and t.max_rank[proj] > 0
    if gemm == "cublas" or (gemm == "cublas_accumulate" and not has_lora):
        y = torch.nn.functional.linear(x, w, bias)  # cuBLAS; the LoRA term is added in place
        if has_lora:
            _launch_add(y, s, b_cat, proj, plan, 0, dx_mode=False)
        return y
    n = w.shape[0]
    y = torch.empty(plan.m, n, dtype=x.dtype, device=x.device)
    launch, fixed = plan.get(("fwd", proj, bias is not None, has_lora), _build_fwd_gemm, proj,
                             bias is not None, has_lora, n, b_cat.shape[1] if has_lora else 0)
    launch(x, w, bias if bias is not None else w, y, s if has_lora else x, b_cat if has_lora else w,
           t.tiles, t.block_tiles, t.adapter_int, t.adapter_float, *fixed)
    if gemm == "cublas_accumulate":  # Y holds scale * S B^T (+ bias): add X W^T (beta = 1)
        y.addmm_(x, w.t())
    return y


def _build_ds(plan: _Plan, proj: int, n: int, b_stride: int):
    t, sz = plan.table, plan.sizes
    block_r = _rank_block(t.max_rank[proj], 128)
    sub_m, subs = _skinny_rows(plan.table, sz.skinny_block_m)
    split = plan.ds_split
    n_per_split = _cdiv(_cdiv(n, sz.skinny_block_k), split) * sz.skinny_block_k
    launch = CachedLaunch(
        _lora_ds_kernel, (t.num_tiles * subs, _cdiv(t.max_rank[proj], block_r), split),
        num_warps=sz.skinny_warps if block_r <= 64 else 8, num_stages=sz.skinny_stages,
        AI_STRIDE=t.adapter_int.shape[1], BLOCK_M=sub_m, BLOCK_R=block_r, BLOCK_N=sz.skinny_block_k,
        PARTIAL=split > 1, DOT_PRECISION=plan.precision,
    )
    return launch, (n, b_stride, AI_FIRST_PROJ + AI_PER_PROJ * proj, subs, n_per_split, max(t.s_numel, 1))


def _launch_ds(dy, b_cat, ds, proj: int, plan: _Plan) -> None:
    """dS_i into ``ds``: the final values, or with ``plan.ds_split > 1`` the fp32 partial sums
    ``[ds_split, s_numel]`` that ``_launch_split_sum`` adds up."""
    t = plan.table
    launch, fixed = plan.get(("ds", proj), _build_ds, proj, dy.shape[1], b_cat.shape[1])
    launch(dy, b_cat, ds, t.tiles, t.adapter_int, t.adapter_float, *fixed)


def _build_split_sum(plan: _Plan, split: int, numel: int):
    launch = CachedLaunch(_split_sum_kernel, (_cdiv(numel, SPLIT_SUM_BLOCK),), num_warps=4, num_stages=1,
                          SPLIT=split, BLOCK=SPLIT_SUM_BLOCK)
    return launch, (numel,)


def _launch_split_sum(part: torch.Tensor, out: torch.Tensor, plan: _Plan, split: int,
                      numel: int | None = None) -> None:
    """``out [numel]`` (default: S or dS, ``s_numel``) = the sum of the ``split`` fp32 partials
    ``part [split, numel]``, cast to ``out``'s dtype: one launch."""
    numel = max(plan.table.s_numel, 1) if numel is None else numel
    launch, fixed = plan.get(("split_sum", split, numel), _build_split_sum, split, numel)
    launch(part, out, *fixed)


def _build_db(plan: _Plan, proj: int, n: int, b_cols: int, skip_empty: bool = False):
    t, sz = plan.table, plan.sizes
    block_r = _rank_block(t.max_rank[proj], 64)
    block_n = sz.skinny_block_k
    rblocks = _cdiv(t.max_rank[proj], block_r)
    launch = CachedLaunch(
        _lora_db_kernel, (_cdiv(n, block_n), t.num_adapters * rblocks, plan.split),
        num_warps=sz.skinny_warps, num_stages=sz.skinny_stages,
        AI_STRIDE=t.adapter_int.shape[1], BLOCK_M=t.block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        DOT_PRECISION=plan.precision, SKIP_EMPTY=skip_empty,
    )
    return launch, (n, b_cols, plan.part_numel, AI_FIRST_PROJ + AI_PER_PROJ * proj, rblocks, plan.split)


def _launch_db(dy, s, b_cat, part: torch.Tensor, proj: int, plan: _Plan, skip_empty: bool = False) -> None:
    """dB_i's partial sums into ``part`` (the plan's joint partial buffer), at its offset;
    ``skip_empty``: an adapter without rows leaves its slice unwritten (``GroupFactors`` reads)."""
    t = plan.table
    launch, fixed = plan.get(("db", proj, skip_empty), _build_db, proj, dy.shape[1], b_cat.shape[1], skip_empty)
    off = plan.part_offsets[1 + proj]
    launch(dy, s, part[:, off:], t.tiles, t.adapter_tiles, t.adapter_tile_ptr, t.adapter_int,
           t.adapter_float, *fixed)


def _build_da(plan: _Plan, skip_empty: bool = False):
    t, sz = plan.table, plan.sizes
    block_r = _rank_block(t.max_total_rank, 64)
    block_k = sz.skinny_block_k
    rblocks = _cdiv(t.max_total_rank, block_r)
    launch = CachedLaunch(
        _lora_da_kernel, (_cdiv(plan.k, block_k), t.num_adapters * rblocks, plan.split),
        num_warps=sz.skinny_warps, num_stages=sz.skinny_stages,
        AI_STRIDE=t.adapter_int.shape[1], HAS_DROPOUT=t.has_dropout, BLOCK_M=t.block_m,
        BLOCK_K=block_k, BLOCK_R=block_r, DOT_PRECISION=plan.precision, SKIP_EMPTY=skip_empty,
    )
    return launch, (plan.k, plan.part_numel, rblocks, plan.split)


def _launch_da(x, ds, part: torch.Tensor, plan: _Plan, off_h: int, skip_empty: bool = False) -> None:
    """dA_all's partial sums into ``part`` (the plan's joint partial buffer), at offset 0;
    ``skip_empty`` as in ``_launch_db``."""
    t = plan.table
    launch, fixed = plan.get(("da", skip_empty), _build_da, skip_empty)
    launch(x, ds, part, t.tiles, t.adapter_tiles, t.adapter_tile_ptr, t.adapter_int, t.adapter_float,
           off_h, *fixed)


def _build_dx_gemm(plan: _Plan, n_list: tuple[int, ...], has_prev: bool, lora_here: bool):
    t, sz = plan.table, plan.sizes
    bm, bk, bn = sz.block_m, sz.dx_block_k, sz.dx_block_n
    return CachedLaunch(
        _lora_dx_gemm_kernel, (_cdiv(plan.m, bm) * _cdiv(plan.k, bk),),
        num_warps=sz.dx_warps, num_stages=sz.dx_stages,
        AI_STRIDE=t.adapter_int.shape[1], NUM_PROJ=len(n_list), HAS_PREV=has_prev,
        HAS_LORA=lora_here, HAS_DROPOUT=t.has_dropout, EVEN_N=all(n % bn == 0 for n in n_list),
        BLOCK_M=bm, BLOCK_K=bk, BLOCK_N=bn, BLOCK_R=_rank_block(t.max_total_rank, sz.rank_block),
        GROUP_M=sz.group_m, DOT_PRECISION=plan.precision,
    )


def _launch_dx(dys, weights, ds, a_all, plan: _Plan, off_h: int, dtype: torch.dtype, device,
               operands: QuantizedOperands | None = None) -> torch.Tensor:
    t, m, k = plan.table, plan.m, plan.k
    has_lora = ds is not None
    if isinstance(weights[0], Nf4Weight):  # the same 4-bit weights dequantized again
        dx = nf4_input_grad(dys, weights, m=m, k=k, dtype=dtype, device=device, gemm=plan.options.nf4_gemm)
        if has_lora:
            _launch_add(dx, ds, a_all, 0, plan, off_h, dx_mode=True)
        return dx
    if isinstance(weights[0], Fp8Weight):
        dx = fp8_input_grad(dys, weights, m=m, k=k, dtype=dtype, device=device,
                            emulate=resolve_emulate(device, None),
                            fast_accum=plan.options.fp8_fast_accum_input_grad, operands=operands)
        if has_lora:
            _launch_add(dx, ds, a_all, 0, plan, off_h, dx_mode=True)
        return dx
    pairs = [(dy, w) for dy, w in zip(dys, weights) if dy is not None]
    if plan.sizes.gemm == "cublas_accumulate" and has_lora:
        # the LoRA term written first (every row), the frozen products accumulated by cuBLAS
        dx = torch.empty(m, k, dtype=dtype, device=device)
        launch = plan.get(("dx", (), False, True), _build_dx_gemm, (), False, True)
        launch(dx, dx, 0, dx, dx, 0, dx, dx, 0, dx, dx, ds, a_all, t.tiles, t.block_tiles, t.adapter_int,
               t.adapter_float, off_h, m, k)
        for dy, w in pairs:
            dx.addmm_(dy, w)
        return dx
    if plan.sizes.gemm != "triton":
        dx = torch.zeros(m, k, dtype=dtype, device=device) if not pairs else pairs[0][0] @ pairs[0][1]
        for dy, w in pairs[1:]:
            dx.addmm_(dy, w)
        if has_lora:
            _launch_add(dx, ds, a_all, 0, plan, off_h, dx_mode=True)
        return dx
    if not pairs:
        pairs = [(torch.zeros(m, 1, dtype=dtype, device=device),
                  torch.zeros(1, k, dtype=dtype, device=device))]
    dx = None
    for start in range(0, len(pairs), MAX_FUSED_DX_PROJECTIONS):
        chunk = pairs[start:start + MAX_FUSED_DX_PROJECTIONS]
        n_list = tuple(w.shape[0] for _, w in chunk)
        lora_here = has_lora and start == 0
        launch = plan.get(("dx", n_list, dx is not None, lora_here), _build_dx_gemm, n_list, dx is not None,
                          lora_here)
        padded = chunk + [(None, None)] * (MAX_FUSED_DX_PROJECTIONS - len(chunk))
        out = torch.empty(m, k, dtype=dtype, device=device)
        launch(
            padded[0][0], padded[0][1], n_list[0],
            padded[1][0], padded[1][1], n_list[1] if len(n_list) > 1 else 0,
            padded[2][0], padded[2][1], n_list[2] if len(n_list) > 2 else 0,
            dx, out, ds if lora_here else out, a_all if lora_here else out,
            t.tiles, t.block_tiles, t.adapter_int, t.adapter_float, off_h, m, k,
        )
        dx = out
    return dx


class GroupFactors:
    """The LoRA factors (leaf tensors) of one projection group, moved by one launch each way
    instead of one per factor: ``gather`` copies them into the launch layout (A_all and each
    B_cat, as ``fused_lora._factors`` concatenates them: one ``cat`` per A_all and per B_cat), and
    ``accumulate`` adds their gradients into their ``.grad`` from the dA / dB partial sums
    (autograd: one ``add_`` per factor, ~58 a layer for 4 adapters on 7 projections). A captured
    step routes every adapter of the bank; both launches skip, on the device, the factors of
    adapters without rows in the microbatch.

    ``a_leaves``: A factors in ``plan.table.a_order``; ``b_leaves[i]``: projection i's B factors in
    ``plan.table.b_order[i]``. Each launch reads a device table of every factor's slice of the
    launch layout (the plan's ``part_offsets``) and its tensor's address, made once per set of
    addresses (a captured step's factors and ``.grad`` tensors stay where they are)."""

    def __init__(self, plan: _Plan, a_leaves: Sequence[torch.Tensor], b_leaves: Sequence[Sequence[torch.Tensor]],
                 allocation_context=contextlib.nullcontext) -> None:
        t = plan.table
        self.plan = plan
        # entered around the device tables' allocation: in a captured step's warm-up, outside the
        # graphs' pool (a table lives on; a pool block may be a graph's intermediate in a replay)
        self.allocation_context = allocation_context
        self.leaves = (*a_leaves, *(leaf for per in b_leaves for leaf in per))
        rows = []  # (layout offset, rows, cols, layout row stride, adapter) of each factor
        self.views = []  # (projection or None for A, first row / column, width): where it sits in A_all / B_cat
        a_row = 0
        for (adapter, _), leaf in zip(t.a_order, a_leaves):
            r = int(leaf.shape[0])
            rows.append((plan.part_offsets[0] + a_row * plan.k, r, plan.k, plan.k, adapter))
            self.views.append((None, a_row, r))
            a_row += r
        for i, per in enumerate(b_leaves):
            col = 0
            for adapter, leaf in zip(t.b_order[i], per):
                r = int(leaf.shape[1])
                rows.append((plan.part_offsets[1 + i] + col, plan.ns[i], r, t.b_cols[i], adapter))
                self.views.append((i, col, r))
                col += r
        self.fixed = tuple(rows)
        self.grid = (_cdiv(max(r * c for _, r, c, _, _ in rows), FACTOR_BLOCK), len(rows))
        self._tables: dict[str, tuple[tuple, torch.Tensor]] = {}
        self._gather: CachedLaunch | None = None
        self._accumulate: CachedLaunch | None = None

    def _table(self, name: str, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
        """The device table of ``tensors`` (the factors or their ``.grad``), or None where a launch
        cannot use them (one missing, mixed dtypes, columns not unit-stride, or a new table needed
        during a capture)."""
        if any(x is None for x in tensors):
            return None
        dtype = tensors[0].dtype
        if any(x.dtype != dtype or x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1) for x in tensors):
            return None
        key = (dtype, *(x.data_ptr() for x in tensors), *(x.stride(0) for x in tensors))
        held = self._tables.get(name)
        if held is not None and held[0] == key:
            return held[1]
        device = tensors[0].device
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # a new table now would be a host copy inside the capture
        host = [(*fixed, x.stride(0), x.data_ptr()) for fixed, x in zip(self.fixed, tensors)]
        with self.allocation_context():
            table = torch.tensor(host, dtype=torch.int64).to(device)
        self._tables[name] = (key, table)
        return table

    def gather(self, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor | None]] | None:
        """A_all ``[a_rows, K]`` and each B_cat ``[N_i, b_cols_i]`` (None without LoRA), views of one
        buffer, in the factors' dtype where it is fp32 (the kernels round on load) else ``dtype``;
        None where the launch cannot read the factors (then ``factors`` concatenates them)."""
        table = self._table("factors", self.leaves)
        if table is None:
            return None
        plan, t = self.plan, self.plan.table
        like = self.leaves[0]
        out = torch.empty(plan.part_numel, dtype=like.dtype if like.dtype == torch.float32 else dtype,
                          device=like.device)
        if self._gather is None:
            self._gather = CachedLaunch(_gather_factors_kernel, self.grid, num_warps=4, num_stages=1,
                                        BLOCK=FACTOR_BLOCK)
        self._gather(out, table, t.adapter_tile_ptr, like)
        a_all = out[:t.a_rows * plan.k].view(t.a_rows, plan.k)
        b_cats = [out[off:off + n * bc].view(n, bc) if order else None
                  for off, n, bc, order in zip(plan.part_offsets[1:], plan.ns, t.b_cols, t.b_order)]
        return a_all, b_cats

    def factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """``gather(dtype)``, or where the launch cannot read the factors their concatenations
        (``torch.cat``, as ``fused_lora._factors`` makes them), without autograd history."""
        got = self.gather(dtype)
        if got is not None:
            return got
        like = self.leaves[0]
        out_dtype = like.dtype if all(leaf.dtype == torch.float32 for leaf in self.leaves) else dtype
        n_a = len(self.plan.table.a_order)
        with torch.no_grad():
            a_all = torch.cat(self.leaves[:n_a]).to(out_dtype).contiguous()
            b_iter = iter(self.leaves[n_a:])
            b_cats = [torch.cat([next(b_iter) for _ in order], dim=1).to(out_dtype).contiguous() if order else None
                      for order in self.plan.table.b_order]
        return a_all, b_cats

    def grads(self) -> list[torch.Tensor] | None:
        """The factors' ``.grad`` tensors when ``accumulate`` can add into them, else None (then
        autograd gets the gradients: ``split``)."""
        grads = [leaf.grad for leaf in self.leaves]
        return grads if self._table("grads", grads) is not None else None

    def accumulate(self, part: torch.Tensor, grads: list[torch.Tensor]) -> None:
        """Every factor's ``.grad += `` its summed partials ``part [split, part_numel]`` (one
        launch); ``grads`` as ``grads()`` returned them."""
        if self._accumulate is None:
            self._accumulate = CachedLaunch(_accumulate_grads_kernel, self.grid, num_warps=4, num_stages=1,
                                            SPLIT=self.plan.split, BLOCK=FACTOR_BLOCK)
        self._accumulate(part, self._tables["grads"][1], self.plan.table.adapter_tile_ptr, grads[0],
                         self.plan.part_numel)

    def split(self, da: torch.Tensor, db_cats: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """Each factor's gradient as a view of ``dA_all`` / ``dB_cat_i`` (for autograd)."""
        return [da[first:first + w] if proj is None else db_cats[proj][:, first:first + w]
                for proj, first, w in self.views]


def _backward(dys, x, a_all, s, weights, b_cats, plan: _Plan, off_h, need_dx, need_da, need_db,
              operands: QuantizedOperands | None = None, into_grads: tuple | None = None):
    """dX, dA_all and per-projection dB_cat (None where not needed or no LoRA); an FP8 dX may
    take its quantized gradient from ``operands``. ``into_grads``: ``(GroupFactors, its factors'
    .grad tensors)``: every factor's gradient is added into its ``.grad`` by one launch, and dA_all
    and dB_cat come back None."""
    t = plan.table
    n_proj = len(weights)
    m, k = x.shape
    dys = [None if dy is None else dy.contiguous() for dy in dys]
    lora_proj = [i for i in range(n_proj) if b_cats[i] is not None and t.max_rank[i] > 0]
    db_proj = [i for i in lora_proj if need_db[i]]
    ds = torch.empty(max(t.s_numel, 1), dtype=x.dtype, device=x.device)
    ds_part = (torch.empty(plan.ds_split, max(t.s_numel, 1), dtype=torch.float32, device=x.device)
               if plan.ds_split > 1 and lora_proj else None)
    # dA and every dB share one fp32 partial-sum buffer: one reduction and one cast for all
    part = (torch.empty(plan.split, plan.part_numel, dtype=torch.float32, device=x.device)
            if db_proj or need_da else None)
    for i in lora_proj:
        dy = dys[i] if dys[i] is not None else torch.zeros(m, weights[i].shape[0], dtype=x.dtype, device=x.device)
        _launch_ds(dy, b_cats[i], ds if ds_part is None else ds_part, i, plan)
        if need_db[i]:
            _launch_db(dy, s, b_cats[i], part, i, plan, into_grads is not None)
    if ds_part is not None:
        _launch_split_sum(ds_part, ds, plan, plan.ds_split)
    if need_da:
        _launch_da(x, ds, part, plan, off_h, into_grads is not None)
    dx = _launch_dx(dys, weights, ds, a_all, plan, off_h, x.dtype, x.device, operands) if need_dx else None
    da, db_cats = None, [None] * n_proj
    if part is not None and into_grads is not None:
        into_grads[0].accumulate(part, into_grads[1])
    elif part is not None:
        grads = torch.empty(plan.part_numel, dtype=a_all.dtype, device=x.device)
        _launch_split_sum(part, grads, plan, plan.split, plan.part_numel)  # one launch: sum and cast
        if need_da:
            da = grads[:t.a_rows * k].view(t.a_rows, k)
        for i in db_proj:
            off, n, bc = plan.part_offsets[1 + i], plan.ns[i], b_cats[i].shape[1]
            db_cats[i] = grads[off:off + n * bc].view(n, bc)  # B_cat has A_all's dtype
    return dx, da, db_cats


