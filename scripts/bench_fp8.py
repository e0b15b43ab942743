"""GPU benchmark of the FP8 frozen base (kernels/fp8_linear.py) against bf16, same run.

(1) The frozen linear alone, forward + input gradient (W frozen), M=8192 tokens, the Llama-3.1-8B
    shapes (K, N) in {(4096,4096), (4096,1024), (4096,14336), (14336,4096)}:
      bf16            F.linear, dX = dY W (cuBLAS)
      fp8             ours: X and dY*sw quantized per row, Wq^T made on the fly for dX
      fp8_fast_accum  ours with fast accumulation in both products
    plus the pieces of ours (quantize X, forward products, quantize dY, transpose, dX), and
    the relative error of Y and dX against fp32 (random data).
(1b) The row quantizer (fp8_triton.quantize_rows) on the inputs the 8B layer quantizes: X of
    q/k/v, o, gate/up (4096 wide), of down (14336); dY*sw of q/k/v (4096+1024+1024), o (4096),
    gate/up (14336+14336), down (4096): time and bandwidth (2 bytes read + 1 written per element).
(2) The whole LoRA projection of a Llama-3.1-8B layer (q/k/v, o, gate/up, down; r=16, p=0.1,
    one adapter and 4 adapters on 40/30/20/10 % of the rows): the fused Triton path with the
    bf16 base vs with the FP8 base (also with fast accumulation of the forward products,
    ``_fa-forward``, and of both products, ``_fa-both``), and the frozen bf16 linear for scale.
Times: median device time of fwd+bwd replayed from a CUDA graph (``graph``) and eager calls.

    python scripts/bench_fp8.py --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness import device_info, kernel_ms, write_json

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_kernels import ALPHA, P, RANK, log, make_lora, uneven_routing  # noqa: E402
from lightning_lorafusion.kernels import fp8_linear as F8  # noqa: E402
from lightning_lorafusion.kernels.api import lora_projections  # noqa: E402
from lightning_lorafusion.kernels.fp8_triton import quantize_rows, transpose_concat  # noqa: E402
from lightning_lorafusion.kernels.options import KernelOptions  # noqa: E402
from lightning_lorafusion.kernels.reference import LoraRouting  # noqa: E402

M = 8192
SHAPES = ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))
DT = torch.bfloat16
FAST = KernelOptions(fp8_fast_accum_forward=True, fp8_fast_accum_input_grad=True)
LAYER_GROUPS = (("qkv", 4096, (4096, 1024, 1024)), ("o", 4096, (4096,)),
                ("gate_up", 4096, (14336, 14336)), ("down", 14336, (4096,)))


def rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def linear_variants(m, k, n, device):
    """fwd + dX closures of the frozen linear (bf16, ours in FP8, ours with fast accumulation),
    the pieces of ours by public function, and the relative errors of Y and dX."""
    x = torch.randn(m, k, device=device, dtype=DT, requires_grad=True)
    w = torch.randn(n, k, device=device, dtype=DT) / k**0.5
    dy = torch.randn(m, n, device=device, dtype=DT)
    fw = F8.quantize_weight(w)

    def bf16():
        torch.autograd.grad(F.linear(x, w), [x], [dy])

    def fp8():
        torch.autograd.grad(F8.fp8_linear(x, fw), [x], [dy])

    def fp8_fast_accum():
        torch.autograd.grad(F8.frozen_projections(x, [fw], [None], options=FAST)[0], [x], [dy])

    pieces = {
        "quant_x": lambda: quantize_rows([x.detach()], None),
        "fwd": lambda: F8.fp8_outputs(x.detach(), [fw], [None], emulate=False),
        "quant_dy": lambda: quantize_rows([dy], [fw.scale]),
        "transpose": lambda: transpose_concat([fw.data]),
        "dx": lambda: F8.fp8_input_grad([dy], [fw], m=m, k=k, dtype=DT, device=device, emulate=False),
        "bf16_fwd": lambda: F.linear(x.detach(), w),
        "bf16_dx": lambda: dy @ w,
    }
    y_ref = F.linear(x.detach().float(), w.float())
    dx_ref = dy.float() @ w.float()

    def fp8_y_dx(options=None):
        xe = x.detach().requires_grad_(True)
        y = F8.frozen_projections(xe, [fw], [None], options=options)[0]
        return y, torch.autograd.grad(y, [xe], [dy])[0]

    y8, dx8 = fp8_y_dx()
    y_fast, dx_fast = fp8_y_dx(FAST)
    errors = {"fp8_y_vs_fp32": rel(y8, y_ref), "fp8_dx_vs_fp32": rel(dx8, dx_ref),
              "bf16_y_vs_fp32": rel(F.linear(x.detach(), w), y_ref), "bf16_dx_vs_fp32": rel(dy @ w, dx_ref),
              # fast accumulation: its own error, against the same products accumulated in fp32
              "fast_accum_y_vs_fp8": rel(y_fast, y8), "fast_accum_dx_vs_fp8": rel(dx_fast, dx8)}
    fns = {"bf16": bf16, "fp8": fp8, "fp8_fast_accum": fp8_fast_accum}
    return fns, pieces, errors


QUANT_INPUTS = (("x_qkv_o_gateup", (4096,), False), ("x_down", (14336,), False),
                ("dy_qkv", (4096, 1024, 1024), True), ("dy_o_down", (4096,), True),
                ("dy_gateup", (14336, 14336), True))


def quantize_inputs(m, device):
    """The row quantizer on the layer's inputs: {name: (fn, bytes moved)}."""
    out = {}
    for name, widths, cols in QUANT_INPUTS:
        xs = [torch.randn(m, n, device=device, dtype=DT) for n in widths]
        cs = [F8.pow2_scales(torch.rand(n, device=device) * 4) for n in widths] if cols else None
        out[name] = ((lambda xs=xs, cs=cs: quantize_rows(xs, cs)), 3 * m * sum(widths))
    return out


def group_variants(m, k, ns, device):
    x = torch.randn(m, k, device=device, dtype=DT, requires_grad=True)
    ws = [torch.randn(n, k, device=device, dtype=DT) / k**0.5 for n in ns]
    fws = [F8.quantize_weight(w) for w in ws]
    gys = [torch.randn(m, n, device=device, dtype=DT) for n in ns]
    scale = ALPHA / RANK
    single = make_lora(1, (RANK,), k, ns, device)
    single_routing = LoraRouting(num_rows=m, segments=((0, m, 0),), scales=(scale,), dropout_p=(P,), seeds=(3,))
    multi = make_lora(4, (RANK,) * 4, k, ns, device)
    multi_routing = uneven_routing(m, 4, P, scale)

    def frozen():
        torch.autograd.grad([F.linear(x, w) for w in ws], [x], gys)

    def ours(weights, loras, routing, options=None):
        def run():
            ys = lora_projections(x, weights, [None] * len(ns), loras, routing, dropout_offset=1, backend="triton",
                                  options=options)
            torch.autograd.grad(ys, [x] + [t for l in loras for t in l.a + l.b], gys)
        return run

    return {"frozen_bf16": frozen, "lora_bf16": ours(ws, single, single_routing),
            "lora_fp8": ours(fws, single, single_routing),
            "lora_fp8_fa-forward": ours(fws, single, single_routing, KernelOptions(fp8_fast_accum_forward=True)),
            "lora_fp8_fa-both": ours(fws, single, single_routing,
                                     KernelOptions(fp8_fast_accum_forward=True, fp8_fast_accum_input_grad=True)),
            "lora_bf16_multi4": ours(ws, multi, multi_routing),
            "lora_fp8_multi4": ours(fws, multi, multi_routing)}


def run_linear(device, results, fh) -> None:
    for k, n in SHAPES:
        fns, pieces, errors = linear_variants(M, k, n, device)
        graph = {v: kernel_ms(f, graph=True) for v, f in fns.items()}
        eager = {v: kernel_ms(f) for v, f in fns.items()}
        parts = {v: kernel_ms(f, graph=True) for v, f in pieces.items()}
        row = {"M": M, "K": k, "N": n, "graph_ms": graph, "eager_ms": eager, "pieces_ms": parts, "errors": errors,
               "tflops_graph": {v: 4.0 * M * k * n / t / 1e9 for v, t in graph.items()}}
        results["linear"].append(row)
        log(f"K={k:5d} N={n:5d} graph ms " + " ".join(f"{v} {t:.3f}" for v, t in graph.items())
            + " | pieces " + " ".join(f"{v} {t:.3f}" for v, t in parts.items())
            + " | errors " + " ".join(f"{v} {e:.2e}" for v, e in errors.items()), fh)
        del fns, pieces
        torch.cuda.empty_cache()


def run_quantize(device, results, fh) -> None:
    for qname, (fn, nbytes) in quantize_inputs(M, device).items():
        t = kernel_ms(fn, graph=True)
        results["quantize"][qname] = {"graph_ms": t, "gb_per_s": nbytes / t / 1e6}
        log(f"quantize {qname:16s} {t:.3f} ms {nbytes / t / 1e6:7.0f} GB/s", fh)
    torch.cuda.empty_cache()


def run_layer(device, results, fh) -> None:
    layer_graph: dict[str, float] = {}
    layer_eager: dict[str, float] = {}
    for gname, k, ns in LAYER_GROUPS:
        fns = group_variants(M, k, ns, device)
        for v, f in fns.items():
            g, e = kernel_ms(f, graph=True), kernel_ms(f)
            layer_graph[v] = layer_graph.get(v, 0.0) + g
            layer_eager[v] = layer_eager.get(v, 0.0) + e
            results["layer"].setdefault(gname, {})[v] = {"graph_ms": g, "eager_ms": e}
        log(f"group {gname}: graph ms " + " ".join(f"{v} {results['layer'][gname][v]['graph_ms']:.3f}" for v in fns), fh)
        del fns
        torch.cuda.empty_cache()
    results["layer_total"] = {"graph_ms": layer_graph, "eager_ms": layer_eager}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--sections", default="linear,quantize,layer",
                    help="comma list of the parts to run: linear (1), quantize (1b), layer (2)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    fh = open(args.out / "bench_fp8.log", "w")
    device = torch.device("cuda")
    results = {**device_info(device), "linear": [], "quantize": {}, "layer": {}, "layer_total": {}}
    log(f"{results}", fh)
    log("command: " + " ".join(sys.argv), fh)
    torch.manual_seed(0)
    sections = set(args.sections.split(","))
    for section, run in (("linear", run_linear), ("quantize", run_quantize), ("layer", run_layer)):
        if section in sections:
            run(device, results, fh)
    write_json(args.out, "bench_fp8.json", results)
    log("", fh)
    if results["linear"]:
        summarize_linear(results, results["device_name"], fh)
    layer_graph, layer_eager = results["layer_total"].get("graph_ms", {}), results["layer_total"].get("eager_ms", {})
    if layer_graph:
        log(f"== Llama-3.1-8B layer, all seven projections, M={M}, r={RANK}, p={P} ==", fh)
    for v in layer_graph:
        log(f"{v:18s} graph {layer_graph[v]:7.3f} ms ({layer_graph['lora_bf16'] / layer_graph[v]:.2f}x vs lora_bf16)"
            f"  eager {layer_eager[v]:7.3f} ms ({layer_eager['lora_bf16'] / layer_eager[v]:.2f}x)", fh)


def summarize_linear(results, name, fh) -> None:
    log(f"== {name}: frozen linear fwd+dX, M={M}, graph ms (ratio to bf16) ==", fh)
    variants = list(results["linear"][0]["graph_ms"])
    log(f"{'K':>5} {'N':>5} " + " ".join(f"{v:>20}" for v in variants), fh)
    for r in results["linear"]:
        b = r["graph_ms"]["bf16"]
        log(f"{r['K']:5d} {r['N']:5d} " + " ".join(f"{r['graph_ms'][v]:8.3f} ({b / r['graph_ms'][v]:4.2f}x)     "
                                               for v in variants), fh)
    log(f"== pieces of ours (graph ms): " + ", ".join(results["linear"][0]["pieces_ms"]), fh)
    for r in results["linear"]:
        log(f"{r['K']:5d} {r['N']:5d} " + " ".join(f"{t:7.3f}" for t in r["pieces_ms"].values()), fh)


if __name__ == "__main__":
    main()
