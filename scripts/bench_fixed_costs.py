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

    PYTHONPATH=. python3 scripts/bench_fixed_costs.py --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from harness import Report, add_layer_shape_args, add_output_args, comma_list, kernel_ms, logger

import torch  # noqa: E402

from lightning_lorafusion.kernels.block_sizes import block_sizes_for  # noqa: E402
from lightning_lorafusion.kernels.fused_lora_launch import (  # noqa: E402
    _launch_da, _launch_db, _launch_ds, _launch_s, _launch_split_sum, _Plan,
)
from lightning_lorafusion.kernels.nf4 import quantize_nf4_reference  # noqa: E402
from lightning_lorafusion.kernels.nf4_triton import dequantize_nf4_triton  # noqa: E402
from lightning_lorafusion.kernels.reference import LoraRouting  # noqa: E402
from lightning_lorafusion.kernels.routing_table import build_launch_table  # noqa: E402

log = logger("bench_fixed_costs")
PARTS = ("dequant", "ds")


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
    add_output_args(ap)
    return ap.parse_args(argv)


def _shapes(args) -> dict[str, tuple[int, int]]:
    h, i, hd = args.hidden, args.intermediate, args.head_dim
    return {"q": (args.heads * hd, h), "k": (args.kv_heads * hd, h), "o": (h, args.heads * hd), "gate": (i, h),
            "down": (h, i)}


def bench_dequant(args, report: Report) -> None:
    dev = torch.device("cuda")
    for name, (n, k) in _shapes(args).items():
        w = quantize_nf4_reference(torch.randn(n, k, device=dev) * 0.02, double_quant=True)
        nested = (w.nested_absmax, w.nested_code, w.offset, w.nested_blocksize)
        out = torch.empty(n * k, dtype=torch.bfloat16, device=dev)
        moved = w.data.numel() + w.absmax.numel() + 2 * n * k  # bytes read and written once

        def run(**kw):
            return dequantize_nf4_triton(w.data, w.absmax, w.code, w.blocksize, nested, dtype=torch.bfloat16,
                                         out=out, **kw)

        ref = run(force_bytes=True).clone()
        base = kernel_ms(lambda: run(force_bytes=True), graph=True)
        report.add(part="dequant", weight=name, shape=f"{n}x{k}", kernel="byte", blocks=None, warps=None,
                   ms=base, gbs=moved / base / 1e6, vs_byte=1.0, equal=True)
        log(f"dequant {name} {n}x{k}: byte {base * 1e3:.1f} us ({moved / base / 1e6:.0f} GB/s)")
        for blocks in args.blocks:
            for warps in args.warps:
                got = run(blocks=blocks, num_warps=warps)
                equal = bool(torch.equal(got, ref))
                ms = kernel_ms(lambda: run(blocks=blocks, num_warps=warps), graph=True)
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
    dev = torch.device("cuda")
    sizes = block_sizes_for(dev)
    h, i = args.hidden, args.intermediate
    groups = {"qkv": (h, (args.heads * args.head_dim, args.kv_heads * args.head_dim, args.kv_heads * args.head_dim)),
              "o": (args.heads * args.head_dim, (h,)), "gate_up": (h, (i, i)), "down": (i, (h,))}
    for m in args.rows:
        routing = _routing(m, args.adapters, sizes.block_m)
        totals: dict[str, float] = {}
        for gname, (k, ns) in groups.items():
            ranks = tuple((args.rank,) * args.adapters for _ in ns)
            table = build_launch_table(routing, ranks, sizes.block_m, dev)
            dys = [torch.randn(m, n, device=dev, dtype=torch.bfloat16) for n in ns]
            b_cats = [torch.randn(n, bc, device=dev, dtype=torch.bfloat16) * 0.1 for n, bc in zip(ns, table.b_cols)]
            auto = _Plan(table, sizes, m=m, k=k, ns=ns, b_cols=table.b_cols, dtype=torch.bfloat16, device=dev).ds_split
            ref = None
            for split in dict.fromkeys([1, auto, *args.splits]):
                plan = _Plan(table, sizes, m=m, k=k, ns=ns, b_cols=table.b_cols,
                             dtype=torch.bfloat16, device=dev)
                plan.ds_split = split
                ds = torch.zeros(max(table.s_numel, 1), dtype=torch.bfloat16, device=dev)
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
                ms = kernel_ms(run, graph=True)
                kind = "unsplit" if split == 1 else ("auto" if split == auto else "split")
                report.add(part="ds", rows=m, group=gname, ns=list(ns), split=split, kind=kind, ms=ms,
                           max_rel_vs_unsplit=err)
                log(f"ds rows {m} {gname} {ns}: split {split:2d} ({kind}) {ms * 1e3:.1f} us, max rel {err:.1e}")
                if split == 1:
                    totals["unsplit"] = totals.get("unsplit", 0.0) + ms
                if split == auto:
                    totals["auto"] = totals.get("auto", 0.0) + ms
            # S = dropout(X) A^T of the group (one launch, all its projections' ranks), split over K
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            a_all = torch.randn(table.a_rows, k, device=dev, dtype=torch.bfloat16) * 0.02
            s_auto = _Plan(table, sizes, m=m, k=k, ns=ns, b_cols=table.b_cols, dtype=torch.bfloat16, device=dev).s_split
            s_ref = None
            for split in dict.fromkeys([1, s_auto, *args.splits]):
                plan = _Plan(table, sizes, m=m, k=k, ns=ns, b_cols=table.b_cols, dtype=torch.bfloat16, device=dev)
                plan.s_split = split
                got = _launch_s(x, a_all, plan, 0).float()
                s_ref = got if s_ref is None else s_ref
                err = float((got - s_ref).abs().max() / s_ref.abs().max().clamp_min(1e-30))
                ms = kernel_ms(lambda: _launch_s(x, a_all, plan, 0), graph=True)
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
            ds_vals = ref.to(torch.bfloat16)
            grads = torch.empty(1, dtype=torch.bfloat16, device=dev)
            for waves in dict.fromkeys([sizes.split_waves, *args.split_waves]):
                plan = _Plan(table, dataclasses.replace(sizes, split_waves=waves), m=m, k=k, ns=ns,
                             b_cols=table.b_cols, dtype=torch.bfloat16, device=dev)
                part = torch.empty(plan.split, plan.part_numel, dtype=torch.float32, device=dev)
                grads = torch.empty(plan.part_numel, dtype=torch.bfloat16, device=dev)

                def run_dadb():
                    for p, (dy, bc) in enumerate(zip(dys, b_cats)):
                        _launch_db(dy, s_vals, bc, part, p, plan)
                    _launch_da(x, ds_vals, part, plan, 0)
                    _launch_split_sum(part, grads, plan, plan.split, plan.part_numel)

                run_dadb()
                ms = kernel_ms(run_dadb, graph=True)
                kind = "default" if waves == sizes.split_waves else "other"
                report.add(part="dadb", rows=m, group=gname, split_waves=waves, split=plan.split, kind=kind, ms=ms)
                log(f"dA+dB rows {m} {gname}: split_waves {waves} (split {plan.split}, {kind}) {ms * 1e3:.1f} us")
                if kind == "default":
                    totals["dadb"] = totals.get("dadb", 0.0) + ms
        report.add(part="layer", rows=m, **{f"{key}_ms": v for key, v in totals.items()})
        log(f"rows {m}, one layer's groups: dS unsplit {totals.get('unsplit', 0) * 1e3:.1f} us, "
            f"auto {totals.get('auto', 0) * 1e3:.1f} us; S unsplit {totals.get('s_unsplit', 0) * 1e3:.1f} us, "
            f"auto {totals.get('s_auto', 0) * 1e3:.1f} us; dA+dB {totals.get('dadb', 0) * 1e3:.1f} us")


class _Rows(Report):
    """The report with one row per measurement, written after each."""

    def add(self, **row) -> None:
        self.setdefault("rows", []).append(row)
        self.save()


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        log("needs a CUDA GPU (the kernels are timed in CUDA graphs)")
        return 1
    report = _Rows("cuda", args, out=args.out, file_name="fixed_costs.json", log=log)
    if "dequant" in args.parts:
        bench_dequant(args, report)
    if "ds" in args.parts:
        bench_ds(args, report)
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
