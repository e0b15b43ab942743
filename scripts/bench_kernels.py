"""GPU benchmark of the fused LoRA kernels against the frozen linear and PEFT-style torch LoRA.

For bf16, r=16, p=0.1 it times forward+backward of
  frozen:       the frozen linear  Y = X W^T (dX only: W is frozen),
  torch_lora:   torch LoRA (PEFT's math)  Y = X W^T + s * (dropout(X) A^T) B^T,
  ours_single:  ours, one adapter, the device's block sizes (``block_sizes_for``),
  ours_multi4:  ours, 4 adapters with uneven segments (40/30/20/10 % of the rows),
  *_acc:        the same with ``gemm="cublas_accumulate"``; ours_single_tgemm: ``gemm="triton"``;
  ours_single_default: one adapter with ``LoraBlockSizes()`` (the defaults of untuned GPUs),
over M in {4096, 8192, 16384} x (K, N) in {(4096,4096), (4096,14336), (14336,4096),
(5120,5120), (8192,8192)}, plus the seven projections of a Llama-3.1-8B decoder layer.
Every time is reported as a ratio to frozen measured in the same run, eager (CUDA events around
plain calls: counts the gaps where the host cannot launch fast enough) and CUDA-graph replay
(device time), with the host's enqueue time per call, TFLOP/s and the saved activations
(bytes held between forward and backward, outputs excluded). bf16 correctness against a
float64 reference runs first, in the same script.

    python scripts/tune_kernels.py   # optional: this GPU's block sizes into kernels/block_sizes.json
    python scripts/bench_kernels.py [--quick] [--variants a,b,..] [--skip-correctness] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import sys
import time
from pathlib import Path

from harness import device_info, kernel_ms, timer, write_json

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_lorafusion.kernels.api import lora_projections  # noqa: E402
from lightning_lorafusion.kernels.block_sizes import LoraBlockSizes, block_sizes_for  # noqa: E402
from lightning_lorafusion.kernels.dropout import dropout_keep_mask  # noqa: E402
from lightning_lorafusion.kernels.dropout_triton import triton_dropout_keep_mask  # noqa: E402
from lightning_lorafusion.kernels.fused_lora import fused_lora_projections  # noqa: E402
from lightning_lorafusion.kernels.reference import (  # noqa: E402
    LoraModuleWeights,
    LoraRouting,
    lora_projections_reference,
)

VARIANTS = ("frozen", "torch_lora", "ours_single", "ours_multi4", "ours_single_acc", "ours_multi4_acc",
            "ours_single_default", "ours_single_tgemm")
DEFAULT_VARIANTS = VARIANTS[:7]
SWEEP_M = (4096, 8192, 16384)
SWEEP_KN = ((4096, 4096), (4096, 14336), (14336, 4096), (5120, 5120), (8192, 8192))
RANK, P, ALPHA = 16, 0.1, 32.0
DT = torch.bfloat16


def log(msg: str, fh=None) -> None:
    print(msg, flush=True)
    if fh is not None:
        fh.write(msg + "\n")
        fh.flush()


def uneven_routing(m: int, n_adapters: int, p: float, scale: float, pad: int = 128) -> LoraRouting:
    """Segments of 40/30/20/10 % (for 4 adapters) of the rows, padded to ``pad``."""
    weights = [n_adapters - i for i in range(n_adapters)]
    segs, start = [], 0
    for a, wgt in enumerate(weights):
        length = m - start if a == n_adapters - 1 else (m * wgt // sum(weights)) // pad * pad
        segs.append((start, start + length, a))
        start += length
    return LoraRouting(num_rows=m, segments=tuple(segs), scales=(scale,) * n_adapters,
                       dropout_p=(p,) * n_adapters, seeds=tuple(range(11, 11 + n_adapters)))


def make_lora(n_adapters, ranks, k, ns, device, dtype=DT, requires_grad=True):
    """Per projection LoraModuleWeights with random A [r, K] and B [N, r] (B nonzero)."""
    out = []
    for n in ns:
        a = tuple((torch.randn(r, k, device=device, dtype=dtype) / k**0.5).requires_grad_(requires_grad) for r in ranks)
        b = tuple((torch.randn(n, r, device=device, dtype=dtype) / r**0.5).requires_grad_(requires_grad) for r in ranks)
        out.append(LoraModuleWeights(a, b))
    return out


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# correctness
# ---------------------------------------------------------------------------------------------


def check_correctness(device, fh) -> bool:
    ok = True
    for (seed, off, row0, rows, cols, p) in [(0, 0, 0, 300, 1000, 0.1), (987654321, 2**31 + 3, 77, 129, 4097, 0.5)]:
        same = torch.equal(triton_dropout_keep_mask(seed, off, row0, rows, cols, p, device),
                           dropout_keep_mask(seed, off, row0, rows, cols, p, device))
        ok &= same
        log(f"mask triton==torch seed={seed} p={p}: {same}", fh)
    cases = [
        ("single 4096x4096 r16 p0.1", 2048, 4096, (4096,), 1, (16,), 0.1, torch.bfloat16),
        ("multi4 qkv 8B r8/16/32/64 p0.1", 2048, 4096, (4096, 1024, 1024), 4, (8, 16, 32, 64), 0.1, torch.bfloat16),
        ("odd M=1000 K=4000 N=4097 r3 multi2 uneven", 1000, 4000, (4097,), 2, (3, 128), 0.2, torch.bfloat16),
        ("fp16 multi3 r16", 1536, 2048, (2048, 512), 3, (16, 16, 1), 0.1, torch.float16),
        ("fp32 single r16 p0", 1024, 1024, (1536,), 1, (16,), 0.0, torch.float32),
    ]
    for name, m, k, ns, n_ad, ranks, p, dtype in cases:
        torch.manual_seed(0)
        routing = uneven_routing(m, n_ad, p, 2.0, pad=1) if n_ad > 1 else \
            LoraRouting(num_rows=m, segments=((0, m, 0),), scales=(2.0,), dropout_p=(p,), seeds=(5,))
        if "odd" in name:  # leave uncovered rows and unpadded segment ends
            routing = LoraRouting(num_rows=m, segments=((3, 517, 0), (600, 999, 1)), scales=(2.0, 0.25),
                                  dropout_p=(p, 0.0), seeds=(1, 2))
        x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
        ws = [torch.randn(n, k, device=device, dtype=dtype) / k**0.5 for n in ns]
        bs = [torch.randn(n, device=device, dtype=dtype) for n in ns]
        loras = make_lora(n_ad, ranks, k, ns, device, dtype)
        ys = lora_projections(x, ws, bs, loras, routing, dropout_offset=123, backend="triton")
        params = [x] + [t for l in loras for t in l.a + l.b]
        gys = [torch.randn_like(y) for y in ys]
        grads = torch.autograd.grad(ys, params, gys, allow_unused=True)

        def up(t):
            return t.detach().double().requires_grad_(True)
        x64 = up(x)
        l64 = [LoraModuleWeights(tuple(up(t) for t in l.a), tuple(up(t) for t in l.b)) for l in loras]
        ys64 = lora_projections_reference(x64, [w.double() for w in ws], [b.double() for b in bs], l64, routing, 123)
        p64 = [x64] + [t for l in l64 for t in l.a + l.b]
        g64 = torch.autograd.grad(ys64, p64, [g.double() for g in gys], allow_unused=True)
        errs = [rel(y, y6) for y, y6 in zip(ys, ys64)]
        gerrs = [0.0 if (g is None and g6 is None) else rel(g, g6) for g, g6 in zip(grads, g64)]
        tol = 1e-2 if dtype != torch.float32 else 1e-3
        good = all(e < tol for e in errs + gerrs) and all(torch.isfinite(y).all() for y in ys)
        ok &= good
        log(f"correctness {name} {dtype}: {'PASS' if good else 'FAIL'} max rel err Y {max(errs):.2e}, "
            f"dX {gerrs[0]:.2e}, dA/dB max {max(gerrs[1:]):.2e} (tol {tol})", fh)
    return ok


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


def host_us(fn, calls: int = 20) -> float:
    """Host time to enqueue one fwd+bwd (the GPU is drained first, then left to run behind)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return host * 1e6


def group_fns(m, k, ns, device, variants):
    """fwd+bwd closures (and forward-only ones) of one shared-input projection group."""
    x = torch.randn(m, k, device=device, dtype=DT, requires_grad=True)
    ws = [torch.randn(n, k, device=device, dtype=DT) / k**0.5 for n in ns]
    gys = [torch.randn(m, n, device=device, dtype=DT) for n in ns]
    scale = ALPHA / RANK
    single = make_lora(1, (RANK,), k, ns, device)
    single_routing = LoraRouting(num_rows=m, segments=((0, m, 0),), scales=(scale,), dropout_p=(P,), seeds=(3,))
    multi = make_lora(4, (RANK,) * 4, k, ns, device)
    multi_routing = uneven_routing(m, 4, P, scale)
    # one LoraBlockSizes object per variant, made once: the launch plans are keyed by it
    gemms = {"cublas_accumulate": "_acc", "triton": "_tgemm"}
    gemm_sizes = {g: dataclasses.replace(block_sizes_for(device), gemm=g)
                  for g, tag in gemms.items() if any(v.endswith(tag) for v in variants)}
    gemm_sizes["default"] = LoraBlockSizes()

    def ours_fwd(loras, routing, gemm):
        if gemm is None:
            return lambda: lora_projections(x, ws, [None] * len(ws), loras, routing, dropout_offset=1,
                                            backend="triton")
        sizes = gemm_sizes.get(gemm)
        return lambda: fused_lora_projections(x, ws, [None] * len(ws), loras, routing, dropout_offset=1,
                                              block_sizes=sizes)

    def torch_lora_fwd():
        xd = F.dropout(x, P, training=True)
        return [F.linear(x, w) + scale * F.linear(F.linear(xd, l.a[0]), l.b[0]) for w, l in zip(ws, single)]

    forward = {
        "frozen": (lambda: [F.linear(x, w) for w in ws], [x]),
        "torch_lora": (torch_lora_fwd, [x] + [t for l in single for t in (l.a[0], l.b[0])]),
        "ours_single": (ours_fwd(single, single_routing, None), None),
        "ours_multi4": (ours_fwd(multi, multi_routing, None), None),
        "ours_single_acc": (ours_fwd(single, single_routing, "cublas_accumulate"), None),
        "ours_multi4_acc": (ours_fwd(multi, multi_routing, "cublas_accumulate"), None),
        "ours_single_tgemm": (ours_fwd(single, single_routing, "triton"), None),
        "ours_single_default": (ours_fwd(single, single_routing, "default"), None),
    }

    def fwd_bwd(fwd, params):
        def run():
            torch.autograd.grad(fwd(), params, gys)
        return run

    fns, fwd_only = {}, {}
    for v in variants:
        fwd, params = forward[v]
        if params is None:
            params = [x] + [t for l in (multi if "multi" in v else single) for t in l.a + l.b]
        fns[v], fwd_only[v] = fwd_bwd(fwd, params), fwd
    return fns, fwd_only, sum(ns)


def saved_bytes(fwd) -> int:
    """Bytes allocated by a forward beyond its outputs: what autograd holds for backward."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    ys = fwd()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    out = sum(y.numel() * y.element_size() for y in ys)
    del ys
    return after - before - out


def flops(m, k, n_total, lora: bool, n_groups_rank=RANK) -> float:
    f = 4.0 * m * k * n_total  # Y = X W^T and dX = dY W
    if lora:
        # fwd S, S B^T; bwd dS, dB, dS A, dA (rank r)
        f += 2.0 * m * n_groups_rank * (3 * k + 3 * n_total)
    return f


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only M=8192 of the sweep")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, from {','.join(VARIANTS)} (frozen is always timed)")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--no-layer", action="store_true", help="skip the Llama-3.1-8B layer")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    args.variants = ["frozen"] + [v for v in args.variants.split(",") if v != "frozen"]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    return args


def measure(m, k, ns, device, variants: list[str], fh):
    """Eager and graph ms, host us, saved bytes and FLOPs of every variant on one projection
    group; a variant that fails is reported and dropped from ``variants`` for the rest of the run."""
    torch.manual_seed(0)
    fns, fwd_only, n_total = group_fns(m, k, ns, device, variants)
    for v in list(fns):
        try:
            fns[v]()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - one broken variant must not lose the sweep
            log(f"variant {v} failed at M={m} K={k} N={ns}: {type(e).__name__}: {str(e)[:300]}", fh)
            del fns[v], fwd_only[v]
            variants.remove(v)
    times = {v: kernel_ms(fn) for v, fn in fns.items()}
    gtimes = {v: kernel_ms(fn, graph=True) for v, fn in fns.items()}
    host = {v: host_us(fn) for v, fn in fns.items()}
    mem = {v: saved_bytes(fwd_only[v]) for v in fns}
    flop = {v: flops(m, k, n_total, v != "frozen") for v in fns}
    del fns, fwd_only
    torch.cuda.empty_cache()
    return times, gtimes, host, mem, flop


def run_sweep(args, device, variants, results, fh) -> list[dict]:
    """Every (M, K, N) of the sweep: one row each, written to the JSON as it goes."""
    rows = []
    for m in (8192,) if args.quick else SWEEP_M:
        for k, n in SWEEP_KN:
            times, gtimes, host, mem, flop = measure(m, k, (n,), device, variants, fh)
            row = {"M": m, "K": k, "N": n, "ms": times, "saved_bytes": mem, "graph_ms": gtimes, "host_us": host,
                   "ratio": {v: times[v] / times["frozen"] for v in times},
                   "graph_ratio": {v: gtimes[v] / gtimes["frozen"] for v in gtimes},
                   "tflops": {v: flop[v] / times[v] / 1e9 for v in times}}
            rows.append(row)
            ours = [v for v in variants if v != "frozen"]
            log(f"M={m:6d} K={k:5d} N={n:5d} frozen {times['frozen']:.3f} ms (graph {gtimes['frozen']:.3f}, host "
                f"{host['frozen']:.0f} us) | " + " | ".join(
                    f"{v} x{row['ratio'][v]:.3f} g x{row['graph_ratio'][v]:.3f} h {host[v]:.0f}us" for v in ours)
                + " | saved MiB " + " ".join(f"{v} {mem[v] / 2**20:.1f}" for v in variants), fh)
            write_json(args.out, "bench_kernels.json", dict(results, rows=rows))
    return rows


def run_layer(device, variants, fh) -> dict:
    """Llama-3.1-8B decoder layer projections: hidden 4096, q 4096, k/v 1024 (GQA 8 heads),
    o 4096, gate/up 14336, down 14336 -> 4096; all seven adapted, M = 8192 tokens."""
    m = 8192
    groups = [("qkv", 4096, (4096, 1024, 1024)), ("o", 4096, (4096,)),
              ("gate_up", 4096, (14336, 14336)), ("down", 14336, (4096,))]
    layer = {v: 0.0 for v in variants}
    layer_graph, layer_host, layer_mem = dict(layer), dict(layer), {v: 0 for v in variants}
    for _, k, ns in groups:
        times, gtimes, host, mem, _ = measure(m, k, ns, device, variants, fh)
        for v in variants:
            layer[v] += times[v]
            layer_graph[v] += gtimes[v]
            layer_host[v] += host[v]
            layer_mem[v] += mem[v]
    for d in (layer, layer_graph, layer_host, layer_mem):
        for v in [v for v in d if v not in variants]:  # failed in a later group
            del d[v]
    return {"M": m, "ms": layer, "saved_bytes": layer_mem, "graph_ms": layer_graph, "host_us": layer_host,
            "ratio": {v: layer[v] / layer["frozen"] for v in layer},
            "graph_ratio": {v: layer_graph[v] / layer_graph["frozen"] for v in layer}}


def summarize(rows: list[dict], ours: list[str]) -> dict:
    def geo(v, key):
        return math.exp(sum(math.log(r[key][v]) for r in rows) / len(rows))

    return {v: {"geomean": geo(v, "ratio"), "max": max(r["ratio"][v] for r in rows),
                "graph_geomean": geo(v, "graph_ratio"), "graph_max": max(r["graph_ratio"][v] for r in rows)}
            for v in ours}


def print_summary(results: dict, ours: list[str], fh) -> None:
    rows, summary = results["rows"], results["summary"]
    log("", fh)
    log(f"== {results['device_name']}, bf16, r={RANK}, p={P}; fwd+bwd time / frozen linear (same run) ==", fh)
    log("eager = CUDA events around eager calls; graph = CUDA-graph replay (device time only); "
        "host = enqueue time per call, us", fh)
    short = {v: v.replace("ours_", "").replace("torch_lora", "torch") for v in ours}
    log(f"{'M':>6} {'K':>5} {'N':>5} {'frozen':>7} | eager: " + " ".join(f"{short[v]:>10}" for v in ours)
        + " | graph: " + " ".join(f"{short[v]:>10}" for v in ours) + " | host us: frozen "
        + " ".join(f"{short[v]:>10}" for v in ours), fh)
    for r in rows:
        log(f"{r['M']:6d} {r['K']:5d} {r['N']:5d} {r['ms']['frozen']:7.3f} |        "
            + " ".join(f"{r['ratio'][v]:10.3f}" for v in ours) + " |        "
            + " ".join(f"{r['graph_ratio'][v]:10.3f}" for v in ours) + f" |          {r['host_us']['frozen']:6.0f} "
            + " ".join(f"{r['host_us'][v]:10.0f}" for v in ours), fh)
    for v, s in summary.items():
        log(f"{v:18s} eager geomean x{s['geomean']:.3f} max x{s['max']:.3f} | graph geomean "
            f"x{s['graph_geomean']:.3f} max x{s['graph_max']:.3f}", fh)
    if "torch_lora" in ours:
        for v in [v for v in ours if v.startswith("ours")]:
            worse = [(r["M"], r["K"], r["N"]) for r in rows if r["ratio"][v] > r["ratio"]["torch_lora"]]
            log(f"{v}: eager slower than torch LoRA at {len(worse)} of {len(rows)} shapes {worse}", fh)
    if "llama8b_layer" in results:
        lr = results["llama8b_layer"]
        for key, label in (("ms", "eager"), ("graph_ms", "graph")):
            ratio = "ratio" if key == "ms" else "graph_ratio"
            log(f"Llama-3.1-8B layer projections M={lr['M']}: frozen {lr[key]['frozen']:.3f} ms {label}; " +
                ", ".join(f"{v} x{lr[ratio][v]:.3f}" for v in ours), fh)
        log("layer host us: " + ", ".join(f"{v} {b:.0f}" for v, b in lr["host_us"].items()), fh)
        log("layer saved activations MiB: " + ", ".join(f"{v} {b / 2**20:.0f}" for v, b in lr["saved_bytes"].items()), fh)
    if "correct" in results:
        log(f"correctness: {'PASS' if results['correct'] else 'FAIL'}", fh)


def main(argv=None) -> None:
    args = parse_args(argv)
    variants = args.variants
    args.out.mkdir(parents=True, exist_ok=True)
    fh = open(args.out / "bench_kernels.log", "w")
    device = torch.device("cuda")
    results = {**device_info(device), "args": {k: str(v) for k, v in vars(args).items()}, "rows": []}
    log(f"{results}; python {platform.python_version()}", fh)
    log("command: " + " ".join(sys.argv), fh)
    if not args.skip_correctness:
        with timer() as t:
            results["correct"] = check_correctness(device, fh)
        log(f"correctness done in {t.seconds:.0f}s", fh)
    log(f"block sizes in use: {block_sizes_for(device)}", fh)
    results["rows"] = rows = run_sweep(args, device, variants, results, fh)
    if not args.no_layer:
        results["llama8b_layer"] = run_layer(device, variants, fh)
    ours = [v for v in variants if v != "frozen" and all(v in r["ratio"] for r in rows)]
    results["summary"] = summarize(rows, ours)
    write_json(args.out, "bench_kernels.json", results)
    print_summary(results, ours, fh)


if __name__ == "__main__":
    main()
