"""The device work of a training microbatch that does not grow with its tokens, kernel by kernel.

Two parts, at one model's projection shapes (default Llama-3.1-8B: hidden 4096, intermediate
14336, 32 / 8 heads of 128), times as CUDA-graph medians (``do_bench_cudagraph``: no launch
overhead, as in a captured training step):

``dequant``: NF4 dequantization of each frozen weight into a 16-bit buffer (blocks of 64,
double-quantized absmax), the byte kernel (codebook gathered per byte) against the block kernel
(``nf4_triton``: absmax once per block, codes by byte permutes) at each tiling of
``--blocks`` x ``--warps``; ``GB/s`` counts the 4-bit bytes, absmax bytes and 16-bit output read
and written once. Every tiling's output is checked equal, bit for bit, to the byte kernel's.

``ds``: the LoRA ``dS`` kernel (``dS_i = scale * dY_i B_i``) and ``S`` kernel (``S =
dropout(X) A^T``, split over ``K`` alike) of each projection group of one layer, for ``--adapters`` adapters of rank ``--rank`` on every projection, the rows split evenly
between them (segments padded to the routing tiles), at each row count of ``--rows``: unsplit
(split 1, one program per row block walking all of ``N``) against the split the launch plan picks
(``LoraBlockSizes.ds_waves``; fp32 partial sums, then one summing kernel) and the splits of
``--splits``. The split results are checked against the unsplit one. Then dA and dB of the group
(with their summing kernel) at the device's ``split_waves`` and those of ``--split-waves``.

``accum``: the gradients of one layer's adapter factors added into their ``.grad`` at the end of
each group's backward, as a captured training step does (every adapter of the bank routed, the
fixed-shape tables of ``static_routing``), at each row count of ``--rows`` with all ``--adapters``
present and with only ``--present`` of them: ``old`` sums the fp32 partials into one gradient
buffer, then one ``add_`` per factor (what autograd's accumulation launches), ``new`` the one
launch of ``fused_lora_launch.GroupFactors`` (adapters without rows skipped on the device), for
factors of each dtype of ``--grad-dtypes``. The two results are checked equal (fp32: bit for bit;
16-bit: within one rounding), the absent adapters' ``.grad`` unchanged.

Every part runs on the CPU too (``--device cpu``, Triton interpreter: set ``TRITON_INTERPRET=1``;
``--dtype float32``), timed by the wall clock, to check the script at tiny shapes:

    PYTHONPATH=. python3 scripts/bench_fixed_costs.py --out $OUT
    TRITON_INTERPRET=1 PYTHONPATH=. python3 scripts/bench_fixed_costs.py --device cpu --dtype float32 \
        --grad-dtypes float32 --hidden 64 --intermediate 96 --heads 4 --kv-heads 2 --head-dim 16 --rows 64 \
        --blocks 1 --warps 4 --splits 2 --split-waves 4 --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from harness import Report, add_layer_shape_args, add_output_args, comma_list, dtype_of, kernel_ms, logger, timed_ms

import torch  # noqa: E402

from lightning_lorafusion.kernels.block_sizes import block_sizes_for  # noqa: E402
from lightning_lorafusion.kernels.fused_lora_launch import (  # noqa: E402
    GroupFactors, _launch_da, _launch_db, _launch_ds, _launch_s, _launch_split_sum, _Plan,
)
from lightning_lorafusion.kernels.nf4 import quantize_nf4_reference  # noqa: E402
from lightning_lorafusion.kernels.nf4_triton import dequantize_nf4_triton  # noqa: E402
from lightning_lorafusion.kernels.fused_lora import _factors  # noqa: E402
from lightning_lorafusion.kernels.reference import LoraModuleWeights, LoraRouting  # noqa: E402
from lightning_lorafusion.kernels.routing_table import build_launch_table  # noqa: E402
from lightning_lorafusion.kernels.static_routing import StaticLaunchTables  # noqa: E402

log = logger("bench_fixed_costs")
PARTS = ("dequant", "ds", "accum")
GROUPS = ("qkv", "o", "gate_up", "down")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_shape_args(ap)
    ap.add_argument("--parts", type=comma_list(PARTS), default=list(PARTS))
    ap.add_argument("--blocks", type=comma_list(cast=int), default=[32, 64, 128, 256],
                    help="dequant: absmax blocks per program of the block kernel")
    ap.add_argument("--warps", type=comma_list(cast=int), default=[4, 8], help="dequant: warps per program")
    ap.add_argument("--rows", type=comma_list(cast=int), default=[2816, 6912], help="ds: microbatch tokens")
    ap.add_argument("--splits", type=comma_list(cast=int), default=[2, 4, 8, 16], help="ds: splits to compare")
    ap.add_argument("--split-waves", type=comma_list(cast=int), default=[4, 8],
                    help="ds: LoraBlockSizes.split_waves to time dA and dB at, beside the device's")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--groups", type=comma_list(GROUPS), default=list(GROUPS),
                    help="ds, accum: the projection groups of a layer to time")
    ap.add_argument("--present", type=int, default=1, help="accum: adapters with rows in the second microbatch")
    ap.add_argument("--grad-dtypes", type=comma_list(), default=["float32", "bfloat16"],
                    help="accum: dtypes of the factors and their .grad (fit keeps them in float32)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (Triton interpreter, wall-clock times)")
    ap.add_argument("--dtype", default="bfloat16", help="activations and frozen weights")
    add_output_args(ap)
    return ap.parse_args(argv)


def _ms(fn, dev: torch.device) -> float:
    """CUDA-graph median on a GPU; on the CPU the wall clock of one run after one warm-up."""
    if dev.type == "cuda":
        return kernel_ms(fn, graph=True)
    return timed_ms(fn, dev, warmup=1, reps=1)["median_ms"]


def _groups(args) -> dict[str, tuple[int, tuple[int, ...]]]:
    """One layer's projection groups: input features and output features of each projection."""
    h, i = args.hidden, args.intermediate
    every = {"qkv": (h, (args.heads * args.head_dim, args.kv_heads * args.head_dim, args.kv_heads * args.head_dim)),
             "o": (args.heads * args.head_dim, (h,)), "gate_up": (h, (i, i)), "down": (i, (h,))}
    return {name: every[name] for name in args.groups}


def _shapes(args) -> dict[str, tuple[int, int]]:
    h, i, hd = args.hidden, args.intermediate, args.head_dim
    return {"q": (args.heads * hd, h), "k": (args.kv_heads * hd, h), "o": (h, args.heads * hd), "gate": (i, h),
            "down": (h, i)}


def bench_dequant(args, report: Report) -> None:
    dev, dtype = torch.device(args.device), dtype_of(args.dtype)
    for name, (n, k) in _shapes(args).items():
        w = quantize_nf4_reference(torch.randn(n, k, device=dev) * 0.02, double_quant=True)
        nested = (w.nested_absmax, w.nested_code, w.offset, w.nested_blocksize)
        out = torch.empty(n * k, dtype=dtype, device=dev)
        moved = w.data.numel() + w.absmax.numel() + 2 * n * k  # bytes read and written once

        def run(**kw):
            return dequantize_nf4_triton(w.data, w.absmax, w.code, w.blocksize, nested, dtype=dtype,
                                         out=out, **kw)

        ref = run(force_bytes=True).clone()
        base = _ms(lambda: run(force_bytes=True), dev)
        report.add(part="dequant", weight=name, shape=f"{n}x{k}", kernel="byte", blocks=None, warps=None,
                   ms=base, gbs=moved / base / 1e6, vs_byte=1.0, equal=True)
        log(f"dequant {name} {n}x{k}: byte {base * 1e3:.1f} us ({moved / base / 1e6:.0f} GB/s)")
        for blocks in args.blocks:
            for warps in args.warps:
                got = run(blocks=blocks, num_warps=warps)
                equal = bool(torch.equal(got, ref))
                ms = _ms(lambda: run(blocks=blocks, num_warps=warps), dev)
                report.add(part="dequant", weight=name, shape=f"{n}x{k}", kernel="block", blocks=blocks, warps=warps,
                           ms=ms, gbs=moved / ms / 1e6, vs_byte=ms / base, equal=equal)
                log(f"  block {blocks:4d} x {warps} warps: {ms * 1e3:.1f} us ({moved / ms / 1e6:.0f} GB/s, "
                    f"{ms / base:.2f}x byte) equal={equal}")


def _routing(m: int, adapters: int, pad: int) -> LoraRouting:
    per = (m // adapters) // pad * pad
    bounds = [a * per for a in range(adapters)] + [m]
    segs = tuple((bounds[a], bounds[a + 1], a) for a in range(adapters))
    return LoraRouting(num_rows=m, segments=segs, scales=(2.0,) * adapters, dropout_p=(0.0,) * adapters,
                       seeds=tuple(range(adapters)))


def bench_ds(args, report: Report) -> None:
    dev, dtype = torch.device(args.device), dtype_of(args.dtype)
    sizes = block_sizes_for(dev)
    groups = _groups(args)
    for m in args.rows:
        routing = _routing(m, args.adapters, sizes.block_m)
        totals: dict[str, float] = {}
        for gname, (k, ns) in groups.items():
            ranks = tuple((args.rank,) * args.adapters for _ in ns)
            table = build_launch_table(routing, ranks, sizes.block_m, dev)
            dys = [torch.randn(m, n, device=dev, dtype=dtype) for n in ns]
            b_cats = [torch.randn(n, bc, device=dev, dtype=dtype) * 0.1 for n, bc in zip(ns, table.b_cols)]
            auto = _Plan(table, sizes, m=m, k=k, ns=ns, b_cols=table.b_cols, dtype=dtype, device=dev).ds_split
            ref = None
            for split in dict.fromkeys([1, auto, *args.splits]):
                plan = _Plan(table, sizes, m=m, k=k, ns=ns, b_cols=table.b_cols,
                             dtype=dtype, device=dev)
                plan.ds_split = split
                ds = torch.zeros(max(table.s_numel, 1), dtype=dtype, device=dev)
                part = torch.empty(split, max(table.s_numel, 1), dtype=torch.float32, device=dev) if split > 1 else None

                def run():
                    for p, (dy, bc) in enumerate(zip(dys, b_cats)):
                        _launch_ds(dy, bc, ds if part is None else part, p, plan)
                    if part is not None:
                        _launch_split_sum(part, ds, plan, split)

                run()
                got = ds.float()
                if ref is None:
                    ref = got.clone()
                err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                ms = _ms(run, dev)
                kind = "unsplit" if split == 1 else ("auto" if split == auto else "split")
                report.add(part="ds", rows=m, group=gname, ns=list(ns), split=split, kind=kind, ms=ms,
                           max_rel_vs_unsplit=err)
                log(f"ds rows {m} {gname} {ns}: split {split:2d} ({kind}) {ms * 1e3:.1f} us, max rel {err:.1e}")
                if split == 1:
                    totals["unsplit"] = totals.get("unsplit", 0.0) + ms
                if split == auto:
                    totals["auto"] = totals.get("auto", 0.0) + ms
            # S = dropout(X) A^T of the group (one launch, all its projections' ranks), split over K
            x = torch.randn(m, k, device=dev, dtype=dtype)
            a_all = torch.randn(table.a_rows, k, device=dev, dtype=dtype) * 0.02
            s_auto = _Plan(table, sizes, m=m, k=k, ns=ns, b_cols=table.b_cols, dtype=dtype, device=dev).s_split
            s_ref = None
            for split in dict.fromkeys([1, s_auto, *args.splits]):
                plan = _Plan(table, sizes, m=m, k=k, ns=ns, b_cols=table.b_cols, dtype=dtype, device=dev)
                plan.s_split = split
                got = _launch_s(x, a_all, plan, 0).float()
                s_ref = got if s_ref is None else s_ref
                err = float((got - s_ref).abs().max() / s_ref.abs().max().clamp_min(1e-30))
                ms = _ms(lambda: _launch_s(x, a_all, plan, 0), dev)
                kind = "unsplit" if split == 1 else ("auto" if split == s_auto else "split")
                report.add(part="s", rows=m, group=gname, k=k, split=split, kind=kind, ms=ms, max_rel_vs_unsplit=err)
                log(f"s  rows {m} {gname} K={k}: split {split:2d} ({kind}) {ms * 1e3:.1f} us, max rel {err:.1e}")
                if split == 1:
                    totals["s_unsplit"] = totals.get("s_unsplit", 0.0) + ms
                if split == s_auto:
                    totals["s_auto"] = totals.get("s_auto", 0.0) + ms
            # dA and dB of the group (fp32 partials over shares of each adapter's tiles, summed
            # and cast once) at each LoraBlockSizes.split_waves
            s_vals = _launch_s(x, a_all, plan, 0)
            ds_vals = ref.to(dtype)
            grads = torch.empty(1, dtype=dtype, device=dev)
            for waves in dict.fromkeys([sizes.split_waves, *args.split_waves]):
                plan = _Plan(table, dataclasses.replace(sizes, split_waves=waves), m=m, k=k, ns=ns,
                             b_cols=table.b_cols, dtype=dtype, device=dev)
                part = torch.empty(plan.split, plan.part_numel, dtype=torch.float32, device=dev)
                grads = torch.empty(plan.part_numel, dtype=dtype, device=dev)

                def run_dadb():
                    for p, (dy, bc) in enumerate(zip(dys, b_cats)):
                        _launch_db(dy, s_vals, bc, part, p, plan)
                    _launch_da(x, ds_vals, part, plan, 0)
                    _launch_split_sum(part, grads, plan, plan.split, plan.part_numel)

                run_dadb()
                ms = _ms(run_dadb, dev)
                kind = "default" if waves == sizes.split_waves else "other"
                report.add(part="dadb", rows=m, group=gname, split_waves=waves, split=plan.split, kind=kind, ms=ms)
                log(f"dA+dB rows {m} {gname}: split_waves {waves} (split {plan.split}, {kind}) {ms * 1e3:.1f} us")
                if kind == "default":
                    totals["dadb"] = totals.get("dadb", 0.0) + ms
        report.add(part="layer", rows=m, **{f"{key}_ms": v for key, v in totals.items()})
        log(f"rows {m}, one layer's groups: dS unsplit {totals.get('unsplit', 0) * 1e3:.1f} us, "
            f"auto {totals.get('auto', 0) * 1e3:.1f} us; S unsplit {totals.get('s_unsplit', 0) * 1e3:.1f} us, "
            f"auto {totals.get('s_auto', 0) * 1e3:.1f} us; dA+dB {totals.get('dadb', 0) * 1e3:.1f} us")


def bench_accum(args, report: Report) -> None:
    dev, dtype = torch.device(args.device), dtype_of(args.dtype)
    sizes = block_sizes_for(dev)
    n = args.adapters
    for m in args.rows:
        template = LoraRouting(num_rows=m, segments=(), scales=(2.0,) * n, dropout_p=(0.0,) * n,
                               seeds=tuple(range(n)))
        tables = StaticLaunchTables(template, dev)
        routing = dataclasses.replace(template, launch_cache=tables.cache)
        for present in dict.fromkeys([n, min(args.present, n)]):
            tables.fill(_routing(m, present, sizes.block_m).segments, 0)
            for grad_name in args.grad_dtypes:
                grad_dtype = dtype_of(grad_name)
                totals: dict[str, float] = {}
                for gname, (k, ns) in _groups(args).items():
                    ranks = tuple((args.rank,) * n for _ in ns)
                    table = build_launch_table(routing, ranks, sizes.block_m, dev)
                    plan = _Plan(table, sizes, m=m, k=k, ns=ns, b_cols=table.b_cols, dtype=dtype, device=dev)

                    def leaf(*shape):
                        t = torch.randn(*shape, device=dev).to(grad_dtype).requires_grad_(True)
                        t.grad = torch.zeros_like(t)
                        return t

                    a_leaves = [leaf(args.rank, k) for _ in table.a_order]
                    b_leaves = [[leaf(ns[i], args.rank) for _ in order] for i, order in enumerate(table.b_order)]
                    group = GroupFactors(plan, a_leaves, b_leaves)
                    grads = group.grads()
                    absent = [fixed[4] >= present for fixed in group.fixed]
                    part = torch.randn(plan.split, plan.part_numel, device=dev)
                    for sp in range(plan.split):  # an absent adapter's partials are zeros, as the kernels write them
                        for view, skip in zip(group.split(*_grad_views(part[sp], plan)), absent):
                            if skip:
                                view.zero_()
                    flat = torch.empty(plan.part_numel, dtype=grad_dtype, device=dev)
                    views = group.split(*_grad_views(flat, plan))

                    def old():  # the summing kernel into one buffer, then autograd's add_ per factor
                        _launch_split_sum(part, flat, plan, plan.split, plan.part_numel)
                        for g, v in zip(grads, views):
                            g.add_(v)

                    def new():
                        group.accumulate(part, grads)

                    loras = _module_weights(table, a_leaves, b_leaves, n)

                    def gather_old():  # torch.cat of A_all and of each B_cat, as autograd's path builds them
                        return _factors(loras, table, dtype, keep_fp32=True)

                    def gather_new():
                        return group.gather(dtype)

                    # each present adapter's factors where the kernels read them (an absent one's are skipped)
                    was, now = (group.split(*gathered) for gathered in (gather_old(), gather_new()))
                    gather_ok = all(torch.equal(x, y) for x, y, skip in zip(was, now, absent) if not skip)
                    results = []
                    for fn in (old, new):
                        for g in grads:
                            g.fill_(0.5)
                        fn()
                        results.append([g.float().clone() for g in grads])
                    tol = 0.0 if grad_dtype == torch.float32 else 2.0 ** -7
                    err = max(float((x - y).abs().max()) for x, y in zip(*results))
                    unchanged = all(bool((r == 0.5).all()) for r, skip in zip(results[1], absent) if skip)
                    ok = err <= tol * max(float(r.abs().max()) for r in results[0]) and unchanged
                    old_ms, new_ms = _ms(old, dev), _ms(new, dev)
                    gather_old_ms, gather_new_ms = _ms(gather_old, dev), _ms(gather_new, dev)
                    cats = 1 + sum(1 for order in table.b_order if order)
                    for key, ms in (("old", old_ms), ("new", new_ms), ("gather_old", gather_old_ms),
                                    ("gather_new", gather_new_ms)):
                        totals[key] = totals.get(key, 0.0) + ms
                    report.add(part="accum", rows=m, present=present, grad_dtype=grad_name, group=gname,
                               factors=len(grads), old_ms=old_ms, new_ms=new_ms, launches_old=1 + len(grads),
                               launches_new=1, max_abs_diff=err, absent_unchanged=unchanged, equal=ok,
                               gather_old_ms=gather_old_ms, gather_new_ms=gather_new_ms, gather_launches_old=cats,
                               gather_equal=gather_ok)
                    log(f"accum rows {m} present {present}/{n} {grad_name} {gname}: {len(grads)} factors, old "
                        f"{old_ms * 1e3:.1f} us ({1 + len(grads)} launches), new {new_ms * 1e3:.1f} us (1), "
                        f"max diff {err:.1e}, ok={ok}; gather: cat {gather_old_ms * 1e3:.1f} us ({cats} launches), "
                        f"new {gather_new_ms * 1e3:.1f} us (1), equal={gather_ok}")
                report.add(part="accum_layer", rows=m, present=present, grad_dtype=grad_name,
                           **{f"{key}_ms": ms for key, ms in totals.items()})
                log(f"accum rows {m} present {present}/{n} {grad_name}, one layer: accumulation old "
                    f"{totals['old'] * 1e3:.1f} us, new {totals['new'] * 1e3:.1f} us; gather old "
                    f"{totals['gather_old'] * 1e3:.1f} us, new {totals['gather_new'] * 1e3:.1f} us")


def _module_weights(table, a_leaves, b_leaves, adapters: int) -> list[LoraModuleWeights]:
    """Per projection of the group the factors by adapter (None where absent), for ``_factors``."""
    n_proj = len(table.b_order)
    a = [[None] * adapters for _ in range(n_proj)]
    b = [[None] * adapters for _ in range(n_proj)]
    for (adapter, proj), leaf in zip(table.a_order, a_leaves):
        a[proj][adapter] = leaf
    for proj, (order, per) in enumerate(zip(table.b_order, b_leaves)):
        for adapter, leaf in zip(order, per):
            b[proj][adapter] = leaf
    return [LoraModuleWeights(tuple(a[i]), tuple(b[i])) for i in range(n_proj)]


def _grad_views(flat: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``flat [part_numel]`` in the plan's layout: dA_all ``[a_rows, K]`` and each dB_cat ``[N_i, b_cols_i]``."""
    t = plan.table
    da = flat[: t.a_rows * plan.k].view(t.a_rows, plan.k)
    dbs = [flat[off:off + n * bc].view(n, bc) for off, n, bc in zip(plan.part_offsets[1:], plan.ns, t.b_cols)]
    return da, dbs


class _Rows(Report):
    """The report with one row per measurement, written after each."""

    def add(self, **row) -> None:
        self.setdefault("rows", []).append(row)
        self.save()


def main(argv=None) -> int:
    args = parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        log("needs a CUDA GPU (the kernels are timed in CUDA graphs), or --device cpu")
        return 1
    report = _Rows(dev, args, out=args.out, file_name="fixed_costs.json", log=log)
    if "accum" in args.parts:
        bench_accum(args, report)
    if "dequant" in args.parts:
        bench_dequant(args, report)
    if "ds" in args.parts:
        bench_ds(args, report)
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
