"""The engine's decode step at few rows: with adapters (the decode LoRA's few-rows blocks and as before) and on the base.

A random base of ``--shape`` (8B by default, ``--layers`` layers) in one ``Engine`` per variant
(graphs on where CUDA), ``--adapters`` random adapters of ``--ranks`` (cycled) on all seven
projections; for each batch of ``--rows``, that many requests (row i on adapter i %% adapters:
every row its own adapter up to ``--adapters`` rows) are admitted, then ``--steps`` decode-only
steps are timed (``bench_generation.step_time``: the step as the engine runs it, and the
forward alone). Variants (``--variants``):

- ``base``: the same requests without adapters;
- ``lora``: with adapters, the engine's decode LoRA (few-rows blocks up to
  ``lora_gather.FEW_ROWS`` rows);
- ``lora_old``: with adapters, the decode LoRA as before the few-rows blocks (``FEW_ROWS`` None,
  ``AHEAD_MAX_ROWS``, ``RANK_SPLIT_MAX_ROWS`` None, ``PAIR_EPILOGUES`` False, ``PDL`` False);
- ``lora_pair``: the epilogues' paired rank loops alone (``FEW_ROWS``, ``RANK_SPLIT_MAX_ROWS`` None);
- ``lora_rsplit``: the paired loops and the shrink's rank blocks over several programs up to 64
  rows, without the few-rows blocks;
- ``lora_nosplit``: ``lora`` without the shrink's rank blocks over several programs;
- ``lora_few16``: the few-rows blocks up to 16 rows;
- ``lora_ahead``: ``lora`` with SwiGLU computing down's shrink up to 16 rows (``AHEAD_MAX_ROWS``);
- ``lora_pdl`` / ``lora_nopdl``: ``lora`` with and without programmatic dependent launch
  between each shrink and the kernel consuming its partial sums (``PDL``);
- ``base_cublas`` / ``lora_cublas``: ``base`` / ``lora`` with the frozen products of few rows by
  cuBLAS (``EngineTuning.decode_gemm="cublas"``) instead of the engine's default.

Every variant's greedy tokens of a batch are compared with ``--ref``'s (default ``lora_old``; agreeing positions,
first tokens, mean common prefix; on a random model a bf16 rounding difference can change a
near-tied token and all after it).

    PYTHONPATH=. python3 scripts/bench_decode_step.py --out $OUT
    PYTHONPATH=. python3 scripts/bench_decode_step.py --device cpu --dtype float32 --shape tiny --rows 1,4 \\
        --steps 2 --out /tmp/bds
"""

from __future__ import annotations

import argparse
import time

from harness import add_device_args, add_output_args, comma_list, device_info, dtype_of, logger, write_json

import torch  # noqa: E402

from bench_generation import random_adapters, step_time  # noqa: E402
from lightning_lorafusion.kernels import lora_gather as lg  # noqa: E402
from lightning_lorafusion.model.decoder import DecoderConfig  # noqa: E402
from lightning_lorafusion.model.random_model import random_base_params  # noqa: E402
from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from lightning_lorafusion.serving.config import EngineTuning  # noqa: E402

log = logger("bench_decode_step")

# (hidden, heads, kv heads, head_dim, intermediate, vocab)
SHAPES = {"8b": (4096, 32, 8, 128, 14336, 128256), "tiny": (64, 4, 2, 16, 96, 256)}
# variant -> lora_gather settings for its engine (base: the requests without adapters)
OLD = {"FEW_ROWS": None, "AHEAD_MAX_ROWS": None, "PAIR_EPILOGUES": False, "RANK_SPLIT_MAX_ROWS": None, "PDL": False}
VARIANTS = {"base": {}, "lora": {}, "lora_old": OLD, "lora_pair": {"FEW_ROWS": None, "RANK_SPLIT_MAX_ROWS": None},
            "lora_rsplit": {"FEW_ROWS": None, "RANK_SPLIT_MAX_ROWS": 64}, "lora_nosplit": {"RANK_SPLIT_MAX_ROWS": None},
            "lora_few16": {"FEW_ROWS": 16}, "lora_ahead": {"AHEAD_MAX_ROWS": 16}, "lora_pdl": {"PDL": True},
            "lora_nopdl": {"PDL": False}, "base_cublas": {}, "lora_cublas": {}}
# variant -> EngineTuning fields for its engine
TUNING = {"base_cublas": {"decode_gemm": "cublas"}, "lora_cublas": {"decode_gemm": "cublas"}}


def build(args, device, dtype):
    h, hq, hkv, d, inter, vocab = SHAPES[args.shape]
    config = DecoderConfig(model_type="llama", vocab_size=vocab, hidden_size=h, intermediate_size=inter,
                           num_layers=args.layers, num_heads=hq, num_kv_heads=hkv, head_dim=d)
    params = random_base_params(config, device=device, dtype=dtype)
    adapters = random_adapters(config, args.adapters, args.ranks, device, dtype, seed=1, b_std=0.02)
    return config, params, adapters


def engine_for(args, config, params, adapters, device, dtype, tuning: dict | None = None) -> Engine:
    rows = max(args.rows)
    pages = None if device.type == "cuda" else 4096
    engine = Engine(config, params, None, EngineConfig(
        num_pages=pages, gpu_memory_fraction=args.memory_fraction, max_num_seqs=rows, prefix_caching=False,
        max_num_batched_tokens=max(256, rows * args.prompt),
        cuda_graphs="auto", tuning=EngineTuning(**(tuning or {}))), device=device, dtype=dtype)
    for name, r, alpha, factors in adapters:
        engine.add_adapter_weights(name, factors, rank=r, alpha=alpha)
    return engine


def measure(args, variant: str, built, device, dtype) -> list[dict]:
    config, params, adapters = built
    saved = {name: getattr(lg, name) for name in VARIANTS[variant]}
    for name, value in VARIANTS[variant].items():
        setattr(lg, name, value)
    base = variant.startswith("base")
    engine = engine_for(args, config, params, [] if base else adapters, device, dtype, TUNING.get(variant))
    vocab = config.vocab_size
    prompts = torch.randint(4, vocab, (max(args.rows), args.prompt), generator=torch.Generator().manual_seed(1)).tolist()
    sampling = SamplingParams(max_new_tokens=args.steps + 6, temperature=0.0, ignore_eos=True)

    def requests(tag: str, rows: int) -> list:
        return [GenerationRequest(prompt_token_ids=prompts[i], sampling=sampling, request_id=f"{tag}-{i}",
                                  adapter=None if base else adapters[i % len(adapters)][0])
                for i in range(rows)]

    out = []
    try:
        for rows in args.rows:
            step_time(engine, requests(f"{variant}-{rows}-warm", rows), 2, device)  # graphs, first launches
            r = step_time(engine, requests(f"{variant}-{rows}", rows), args.steps, device)
            out.append({"variant": variant, "rows": rows, "step_ms": r["step_ms"], "forward_ms": r["forward_ms"]})
            log(f"{variant} rows={rows}: step {r['step_ms']:.3f} ms, forward {r['forward_ms']}")
        check = engine.generate(requests(f"{variant}-check", min(max(args.rows), len(adapters) or 1)))
        tokens = {res.request_id.split("-", 2)[-1]: list(res.token_ids) for res in check}
    finally:
        engine.close()
        for name, value in saved.items():
            setattr(lg, name, value)
    return out, tokens


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(ap)
    ap.add_argument("--shape", choices=list(SHAPES), default="8b")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--ranks", type=comma_list(cast=int), default=[4, 8, 16, 32, 64])
    ap.add_argument("--rows", type=comma_list(cast=int), default=[1, 4, 16, 64])
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per batch")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--variants", type=comma_list(tuple(VARIANTS)), default=["base", "lora", "lora_old"])
    ap.add_argument("--ref", choices=tuple(VARIANTS), default="lora_old", help="the variant whose tokens the others "
                    "are compared with")
    ap.add_argument("--memory-fraction", type=float, default=0.4)
    add_output_args(ap)
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), dtype_of(args.dtype)
    torch.manual_seed(0)
    start = time.monotonic()
    with torch.no_grad():
        built = build(args, device, dtype)
    rows, tokens = [], {}
    errors = {}
    for variant in args.variants:
        try:
            got, tokens[variant] = measure(args, variant, built, device, dtype)
        except Exception as exc:  # noqa: BLE001 - keep the other variants' numbers
            errors[variant] = f"{type(exc).__name__}: {exc}"
            log(f"{variant} failed: {errors[variant]}")
            continue
        rows += got
        write_json(args.out, "bench_decode_step.json", {**device_info(device), "args": vars(args), "rows": rows})
    ref = tokens.get(args.ref)
    agree = {}
    for variant, t in tokens.items():
        if ref is not None and variant != "base":
            pairs = [(a, b) for k in ref for a, b in zip(ref[k], t.get(k, []))]
            agree[variant] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
            # greedy tokens of a random model: near-equal logits, so a rounding difference
            # changes a token and everything after it; the first tokens and prefixes say more
            prefix = [next((i for i, (a, b) in enumerate(zip(ref[k], t.get(k, []))) if a != b), len(ref[k]))
                      for k in ref]
            agree[variant] += (f", first tokens {sum(p > 0 for p in prefix)}/{len(prefix)}, "
                               f"mean common prefix {sum(prefix) / max(len(prefix), 1):.1f}")
    report = {**device_info(device), "args": vars(args), "rows": rows, f"same_tokens_as_{args.ref}": agree,
              "errors": errors, "seconds": time.monotonic() - start}
    write_json(args.out, "bench_decode_step.json", report)
    by = {(r["variant"], r["rows"]): r for r in rows}
    print(f"\ndecode step, {args.shape} shape, {args.layers} layers, {args.adapters} adapters of ranks {args.ranks} "
          f"(row i on adapter i % {args.adapters}); ms per step (forward alone); same tokens as {args.ref}: {agree}")
    lora = [v for v in args.variants if v != "base"]
    print("| rows | " + " | ".join(args.variants) + " | " + " | ".join(f"LoRA +ms ({v})" for v in lora) + " |")
    print("|" + "---|" * (len(args.variants) + len(lora) + 1))
    for n in args.rows:
        cells = [by.get((v, n)) for v in args.variants]
        txt = ["-" if c is None else f"{c['step_ms']:.3f} ({c['forward_ms'] or float('nan'):.3f})" for c in cells]
        base = by.get(("base", n))

        def over(v):
            c = by.get((v, n))
            return "-" if c is None or base is None else f"{c['step_ms'] - base['step_ms']:+.3f}"
        print(f"| {n} | " + " | ".join(txt + [over(v) for v in lora]) + " |")
    return report


if __name__ == "__main__":
    main()
