"""Light tenants' time to first token while one adapter floods the queue, with FIFO and with fair
scheduling (``EngineConfig.scheduling``), beside the light traffic alone.

A random-weight Llama of a real shape (``--shape``, as scripts/bench_generation.py builds it)
and random LoRA adapters of mixed ranks. The flood: ``--flood-requests`` requests of one
adapter, all arriving at once at t=0 (far more than ``--max-num-seqs`` can run). The light
tenants: ``--light-tenants`` other adapters, each a Poisson stream of ``--light-requests``
requests at ``--light-rate`` requests/s from ``--light-start`` seconds on. Prompts are
``--prompt-min``..``--prompt-max`` random tokens, ``--new-tokens`` greedy tokens each (EOS
ignored). The engine is stepped in this thread; requests are submitted when their arrival
time has come, and a request's TTFT runs from its submission to its first token's event.

Three runs on fresh engines over the same weights: ``alone`` (the light streams only, FIFO),
``fifo`` and ``fair`` (flood + light). Reported per run and tenant class: TTFT mean / p50 /
p99 / max, and the run's generated tok/s and wall time (the cost of fairness, if any).

    PYTHONPATH=. python3 scripts/bench_fairness.py --shape 1b --out $OUT
    PYTHONPATH=. python3 scripts/bench_fairness.py --shape tiny --device cpu --dtype float32 --flood-requests 24 \
        --light-tenants 2 --light-requests 3 --light-rate 20 --max-num-seqs 4 --new-tokens 6 \
        --prompt-min 8 --prompt-max 24 --out /tmp/bf
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from harness import add_device_args, add_output_args, device_info, dtype_of, logger, percentile, write_json

import torch  # noqa: E402
from bench_generation import SHAPES, build_workload, make_requests  # noqa: E402

from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams  # noqa: E402

log = logger("bench_fairness")
RUNS = ("alone", "fifo", "fair")


def light_trace(args, vocab: int, names: list[str]) -> list[tuple[float, GenerationRequest]]:
    """(arrival s, request) of every light tenant's Poisson stream, in arrival order."""
    rng = random.Random(7)
    sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    trace = []
    for tenant in names:
        t = args.light_start
        for i in range(args.light_requests):
            t += rng.expovariate(args.light_rate)
            prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(args.prompt_min, args.prompt_max))]
            trace.append((t, GenerationRequest(prompt_token_ids=prompt, adapter=tenant, sampling=sp,
                                               request_id=f"light-{tenant}-{i}")))
    return sorted(trace, key=lambda x: x[0])


def replay(engine: Engine, trace: list[tuple[float, GenerationRequest]]) -> dict:
    """Submit each request at its arrival time while stepping the engine -> per-request TTFT
    and the run's totals."""
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    generated = [0]

    def on_event(event) -> None:
        if event.token_id is not None:
            generated[0] += 1
            first.setdefault(event.request_id, time.perf_counter())

    pending = list(trace)
    t0 = time.perf_counter()
    while pending or engine.has_work():
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            _, request = pending.pop(0)
            submitted[request.request_id] = time.perf_counter()
            engine.submit(request, on_event)
        if engine.has_work():
            engine.step()
        elif pending:
            time.sleep(min(0.01, max(0.0, pending[0][0] - now)))
    wall = time.perf_counter() - t0
    ttft = {rid: first[rid] - submitted[rid] for rid in submitted if rid in first}
    return {"wall_s": wall, "generated_tokens": generated[0], "tokens_per_s": generated[0] / wall, "ttft": ttft}


def summarize(ttft: list[float]) -> dict:
    if not ttft:
        return {"requests": 0}
    return {"requests": len(ttft), "ttft_mean_s": sum(ttft) / len(ttft), "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99), "ttft_max_s": max(ttft)}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="1b")
    ap.add_argument("--ranks", default="8,16,32,64")
    ap.add_argument("--flood-requests", type=int, default=2048)
    ap.add_argument("--light-tenants", type=int, default=4)
    ap.add_argument("--light-requests", type=int, default=16, help="requests per light tenant")
    ap.add_argument("--light-rate", type=float, default=1.0, help="requests/s of each light tenant")
    ap.add_argument("--light-start", type=float, default=1.0, help="seconds after the flood the light streams start")
    ap.add_argument("--prompt-min", type=int, default=128)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=16384)
    ap.add_argument("--memory-fraction", type=float, default=0.6)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--cpu-pool-mib", type=int, default=1024, help="the engine's pool on a CPU")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}")
    add_device_args(ap)
    add_output_args(ap)
    args = ap.parse_args(argv)
    bad = [r for r in args.runs.split(",") if r not in RUNS]
    if bad or args.light_tenants < 1 or args.flood_requests < 1:
        ap.error(f"--runs takes {', '.join(RUNS)}; --light-tenants and --flood-requests must be >= 1")
    args.adapters = args.light_tenants + 1
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), dtype_of(args.dtype)
    report: dict = {**device_info(device), "args": vars(args)}
    shape, _model, tokenizer, config, params, adapters = build_workload(args, device, dtype)
    names = [a[0] for a in adapters]
    flood_name, light_names = names[0], names[1:]
    flood = [(0.0, r) for r in make_requests(args.flood_requests, shape["vocab_size"], args.prompt_min,
                                             args.prompt_max, [flood_name], args.new_tokens, seed=3)]
    light = light_trace(args, shape["vocab_size"], light_names)
    for run in args.runs.split(","):
        engine = Engine(config, params, tokenizer,
                        EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                                     gpu_memory_fraction=args.memory_fraction, backend=args.backend,
                                     cpu_pool_mib=args.cpu_pool_mib, scheduling="fair" if run == "fair" else "fifo"),
                        device=device, dtype=dtype)
        for adapter, r, alpha, factors in adapters:
            engine.add_adapter_weights(adapter, factors, rank=r, alpha=alpha)
        engine.generate(make_requests(len(names), shape["vocab_size"], args.prompt_min, args.prompt_min + 8, names,
                                      2, seed=9))  # compiles and pages every adapter in
        result = replay(engine, sorted(light + ([] if run == "alone" else flood), key=lambda x: x[0]))
        ttft = result.pop("ttft")
        result["light"] = summarize([v for k, v in ttft.items() if k.startswith("light-")])
        result["flood"] = summarize([v for k, v in ttft.items() if not k.startswith("light-")])
        result["preemptions"] = engine.stats()["preemptions_total"]
        report[run] = result
        log(f"{run}: {result['wall_s']:.1f} s, light TTFT p99 {result['light'].get('ttft_p99_s')}")
        write_json(args.out, f"bench_fairness_{args.shape}.json", report)
        engine.close()
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(report, args)
    return report


def print_table(report: dict, args) -> None:
    print(f"\n{'run':<6} {'tenants':<7} {'requests':>8} {'TTFT mean':>9} {'p50':>7} {'p99':>7} {'max':>7} "
          f"{'run tok/s':>9} {'wall s':>7}")
    for run in RUNS:
        if run not in report:
            continue
        r = report[run]
        for kind in ("light", "flood"):
            s = r[kind]
            if not s["requests"]:
                continue
            print(f"{run:<6} {kind:<7} {s['requests']:>8} {s['ttft_mean_s']:>9.3f} {s['ttft_p50_s']:>7.3f} "
                  f"{s['ttft_p99_s']:>7.3f} {s['ttft_max_s']:>7.3f} {r['tokens_per_s']:>9.0f} {r['wall_s']:>7.1f}")


if __name__ == "__main__":
    main()
