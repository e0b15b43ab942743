"""NF4 frozen products: 16-bit GEMM vs NF4 through a dequantized buffer vs the fused NF4 GEMM.

At one model's projection shapes (default Llama-3.1-8B: hidden 4096, intermediate 14336, 32 / 8
heads of 128), for each row count of ``--rows`` (decode sizes 1, 16, 64; training 2048, 8192):

    bf16    ``F.linear`` / ``dy @ W`` on the 16-bit weights (``--dtype``), cuBLAS
    buffer  NF4 (blocks of 64, double-quantized absmax): each weight dequantized into a reused
            scratch buffer, then the same GEMM (``KernelOptions.nf4_gemm="buffer"``)
    fused   the NF4 GEMM (``kernels/nf4_gemm.py``): the 4-bit weight dequantized inside the
            operand tiles (``nf4_gemm="fused"``)

per linear (each of the seven projections alone) and per layer (the decoder's four groups: q/k/v,
o, gate/up, down, one after another), for the forward ``x @ W^T`` and the backward's input
gradient ``dy @ W`` (summed over a group's members). Times: Triton's ``do_bench`` medians on a
GPU, wall-clock medians elsewhere. ``max_rel``: the fused result's largest difference from the
buffer's, relative to the buffer's largest value (both round the same weights; only the
summation order differs).

``--decode-rows`` (default 1,16,64): the generation engine's decode step (``step_ms``: wall time
per decode-only step; ``forward_ms``: its forward alone) over ``--decode-layers`` layers of the
same shape, bf16 base vs NF4 base with either ``EngineTuning.nf4_gemm``; ``--decode-rows ''``
skips it. On a CPU the fused GEMM runs in the Triton interpreter: set ``TRITON_INTERPRET=1`` in
the environment (Triton reads it when the kernels are defined, before this script runs).

    python scripts/bench_nf4.py --out $OUT                                        # 8B shapes, GPU
    TRITON_INTERPRET=1 python scripts/bench_nf4.py --device cpu --dtype float32 --hidden 64 --intermediate 128 --heads 4 \\
        --kv-heads 2 --head-dim 16 --vocab 256 --rows 1,16,40 --decode-rows 1,2 --decode-layers 1 --reps 1
"""

from __future__ import annotations

import argparse
import sys

from harness import (Report, add_device_args, add_layer_shape_args, add_output_args, comma_list,
                     dtype_of, kernel_ms, logger, timed_ms)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_lorafusion.kernels.nf4 import nf4_input_grad, nf4_outputs, quantize_nf4_reference  # noqa: E402
from lightning_lorafusion.model.decoder import DecoderConfig  # noqa: E402

log = logger("bench_nf4")
VARIANTS = ("bf16", "buffer", "fused")
PASSES = ("forward", "input_grad")
GROUPS = (("qkv", ("q_proj", "k_proj", "v_proj")), ("o", ("o_proj",)), ("gate_up", ("gate_proj", "up_proj")),
          ("down", ("down_proj",)))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_shape_args(ap)
    ap.add_argument("--vocab", type=int, default=128256, help="decode: the model's vocabulary")
    ap.add_argument("--rows", type=comma_list(cast=int), default=[1, 16, 64, 2048, 8192], help="token counts")
    ap.add_argument("--variants", type=comma_list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--passes", type=comma_list(PASSES), default=list(PASSES))
    ap.add_argument("--per-linear", choices=("on", "off"), default="on", help="also time each projection alone")
    ap.add_argument("--decode-rows", type=lambda s: [int(v) for v in s.split(",") if v], default=[1, 16, 64],
                    help="engine decode steps at these batch sizes ('' skips)")
    ap.add_argument("--decode-layers", type=int, default=8, help="decode: layers of the engine's model")
    ap.add_argument("--decode-steps", type=int, default=16, help="decode: timed steps per batch size")
    ap.add_argument("--prompt", type=int, default=64, help="decode: prompt tokens per request")
    ap.add_argument("--cuda-graphs", default="auto", choices=("auto", "on", "off"), help="decode: EngineConfig.cuda_graphs")
    ap.add_argument("--warmup", type=int, default=2, help="CPU timing: untimed runs")
    ap.add_argument("--reps", type=int, default=5, help="CPU timing: timed runs (median)")
    add_device_args(ap)
    add_output_args(ap)
    return ap.parse_args(argv)


def projection_shapes(args) -> dict[str, tuple[int, int]]:
    """``name -> (out_features N, in_features K)`` of the Llama block."""
    h, i, q, kv = args.hidden, args.intermediate, args.heads * args.head_dim, args.kv_heads * args.head_dim
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def make_weights(shapes, device, dtype) -> dict[str, tuple[torch.Tensor, object]]:
    """Per projection: the 16-bit weight and its NF4 quantization (blocks of 64, nested absmax)."""
    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device=device, generator=gen) * 0.02).to(dtype)
        out[name] = (w, quantize_nf4_reference(w, double_quant=True))
    return out


def group_fn(variant: str, pass_: str, names, weights, m: int, device, dtype):
    """A no-argument callable running one group's products, and the callable's result."""
    k = weights[names[0]][0].shape[1]
    gen = torch.Generator(device=device).manual_seed(m)
    dense = [weights[n][0] for n in names]
    nf4 = [weights[n][1] for n in names]
    if pass_ == "forward":
        x = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
        if variant == "bf16":
            return lambda: [F.linear(x, w) for w in dense]
        return lambda: nf4_outputs(x, nf4, [None] * len(nf4), variant)
    dys = [torch.randn(m, w.shape[0], device=device, dtype=dtype, generator=gen) for w in dense]
    if variant == "bf16":
        def dense_dx():
            dx = dys[0] @ dense[0]
            for dy, w in zip(dys[1:], dense[1:]):
                dx.addmm_(dy, w)
            return dx
        return dense_dx
    return lambda: nf4_input_grad(dys, nf4, m=m, k=k, dtype=dtype, device=device, gemm=variant)


def _time(fn, device, args) -> float:
    if device.type == "cuda":
        return kernel_ms(fn)
    return timed_ms(fn, device, warmup=args.warmup, reps=args.reps)["median_ms"]


def _max_rel(a, b) -> float:
    a = torch.cat([t.float().flatten() for t in (a if isinstance(a, list) else [a])])
    b = torch.cat([t.float().flatten() for t in (b if isinstance(b, list) else [b])])
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def measure_products(args, weights, device, dtype) -> list[dict]:
    """Rows of (scope, what, rows, pass) with each variant's ms and the fused-vs-buffer max_rel."""
    cases = [("layer", "layer", GROUPS)]
    if args.per_linear == "on":
        cases += [("linear", name, (("", (name,)),)) for name in projection_shapes(args)]
    out = []
    for m in args.rows:
        for pass_ in args.passes:
            for scope, what, groups in cases:
                row = {"scope": scope, "what": what, "rows": m, "pass": pass_}
                results = {}
                for variant in args.variants:
                    fns = [group_fn(variant, pass_, names, weights, m, device, dtype) for _, names in groups]
                    row[f"{variant}_ms"] = _time(lambda: [f() for f in fns], device, args)
                    results[variant] = [f() for f in fns]
                if "buffer" in results and "fused" in results:
                    row["max_rel"] = max(_max_rel(f, b) for f, b in zip(results["fused"], results["buffer"]))
                out.append(row)
                log(f"{what} rows={m} {pass_}: " + ", ".join(f"{v} {row[f'{v}_ms']:.3f} ms" for v in args.variants))
    return out


def _engine(config: DecoderConfig, params, variant: str, args, device, dtype):
    from lightning_lorafusion.serving import Engine, EngineConfig
    from lightning_lorafusion.serving.config import EngineTuning

    rows = max(args.decode_rows)
    pages = rows * (-(-(args.prompt + args.decode_steps + 8) // 16)) + 8
    tuning = EngineTuning(nf4_gemm="auto" if variant == "bf16" else variant)
    return Engine(config, params, None, EngineConfig(num_pages=pages, page_size=16, max_num_seqs=rows,
                                                     cuda_graphs=args.cuda_graphs, prefix_caching=False,
                                                     tuning=tuning), device=device, dtype=dtype)


def measure_decode(args, device, dtype) -> list[dict]:
    """The engine's decode step per batch size: bf16 base vs NF4 base (buffer, fused)."""
    from bench_generation import step_time  # the engine's decode-step timer, shared

    from lightning_lorafusion.model.hf_loading import quantize_base_nf4
    from lightning_lorafusion.model.random_model import random_base_params
    from lightning_lorafusion.serving import GenerationRequest, SamplingParams

    config = DecoderConfig(model_type="llama", vocab_size=args.vocab, hidden_size=args.hidden,
                           intermediate_size=args.intermediate, num_layers=args.decode_layers, num_heads=args.heads,
                           num_kv_heads=args.kv_heads, head_dim=args.head_dim)
    dense = random_base_params(config, device=device, dtype=dtype)
    nf4 = quantize_base_nf4(dense)
    prompts = torch.randint(4, args.vocab, (max(args.decode_rows), args.prompt),
                            generator=torch.Generator().manual_seed(1)).tolist()
    sampling = SamplingParams(max_new_tokens=args.decode_steps + 4, temperature=0.0, ignore_eos=True)

    def requests(tag: str, rows: int) -> list:
        return [GenerationRequest(prompt_token_ids=prompts[i], sampling=sampling, request_id=f"{tag}-{i}")
                for i in range(rows)]

    out = []
    for variant in args.variants:
        engine = _engine(config, dense if variant == "bf16" else nf4, variant, args, device, dtype)
        try:
            for rows in args.decode_rows:
                step_time(engine, requests(f"{variant}-{rows}-warm", rows), 2, device)  # graphs, first launches
                r = step_time(engine, requests(f"{variant}-{rows}", rows), args.decode_steps, device)
                out.append({"variant": variant, "rows": rows, "step_ms": r["step_ms"], "forward_ms": r["forward_ms"]})
                log(f"decode {variant} rows={rows}: step {r['step_ms']:.3f} ms")
        finally:
            engine.close()
    return out


def print_tables(report: dict, args) -> None:
    v = args.variants
    print(f"\n{report['device_name']}, {args.dtype}; hidden {args.hidden}, intermediate {args.intermediate}; "
          "ms per product (median); ratio = x / " + v[0])
    head = f"{'scope':6} {'what':9} {'rows':>5} {'pass':10} " + " ".join(f"{x + ' ms':>10}" for x in v)
    print(head + " " + " ".join(f"{x + '/' + v[0]:>12}" for x in v[1:]) + f" {'max_rel':>9}")
    for r in report.get("products", []):
        ms = [r[f"{x}_ms"] for x in v]
        print(f"{r['scope']:6} {r['what']:9} {r['rows']:5d} {r['pass']:10} " + " ".join(f"{t:10.3f}" for t in ms)
              + " " + " ".join(f"{t / ms[0]:12.2f}" for t in ms[1:]) + f" {r.get('max_rel', float('nan')):9.1e}")
    if report.get("decode"):
        print(f"\ndecode step ({args.decode_layers} layers), ms: variant, rows, step, forward")
        for r in report["decode"]:
            fwd = "-" if r["forward_ms"] is None else f"{r['forward_ms']:.3f}"
            print(f"  {r['variant']:7} {r['rows']:4d} {r['step_ms']:9.3f} {fwd:>9}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), dtype_of(args.dtype)
    torch.manual_seed(0)
    report = Report(device, args, out=args.out, file_name=f"nf4_h{args.hidden}_i{args.intermediate}.json", log=log,
                    describe=lambda rows: f"{len(rows)} rows")
    weights = make_weights(projection_shapes(args), device, dtype)
    with torch.no_grad():
        report.measure("products", lambda: measure_products(args, weights, device, dtype))
        del weights
        if args.decode_rows:
            report.measure("decode", lambda: measure_decode(args, device, dtype))
    print_tables(report, args)
    if report["errors"]:
        print(f"errors: {report['errors']}", file=sys.stderr)
    return report


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
