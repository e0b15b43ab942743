"""The engine's per-step host work at many rows and adapters: a tiny model, so what is timed is
the host's bookkeeping (scheduler, batch tables, LoRA tables, sampling, output), which grows with
rows and adapters and not with the model.

``--requests`` requests (default 384, ``--max-num-seqs`` 256) over ``--adapters`` adapters
(default 128, ranks ``--ranks`` cycled, all seven projections; ``--base-share`` of the requests
on the base) arrive at once with ``--prompt`` random tokens each and generate ``--new`` tokens
on average (uniform within ``--new-spread``: requests finish and others join every few steps,
so mixed steps of one new prompt and ~255 decode rows are frequent, as in a long trace; greedy,
EOS ignored). ``--forward stub`` (the default) replaces the model's math by random hidden
states (on a GPU it is device work, and on a CPU the torch references of the LoRA kernels would
swamp the host's bookkeeping): the step's inputs, LoRA tables, sampling and output are all still
built and run; ``--forward real`` keeps the math. The engine is stepped in this thread (no loop thread) with the step
ledger on: the table is each step kind's host time per step by phase (``serving/step_times.py``:
schedule, launch = tables + forward + sampling queued, wait, emit), and ``--profile N`` adds the
N functions with the most own time under ``cProfile`` over the same steps (a second pass, the
profiler's own overhead kept out of the first). On a CPU ``launch`` includes the tiny forward
itself; the phases beside it are host work on any device. ``--repeat`` passes over the same
requests: the fastest pass's table is shown, and the stepping thread's CPU time per step (best
pass; steadier than wall time on a shared machine).

    PYTHONPATH=. python3 scripts/profile_step_host.py --device cpu --dtype float32 --out /tmp/host

On a GPU (``--device cuda --dtype bfloat16 --forward real``) the tiny model's steps are bound by
the host: the table then shows that host's phases per step beside the graphs' device time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time
from typing import Callable

from harness import add_device_args, add_output_args, comma_list, dtype_of, logger, write_json

import torch  # noqa: E402
from bench_generation import SHAPES, build_model, random_adapters  # noqa: E402
from bench_serving import host_adapters  # noqa: E402
from bench_tenants import renamed  # noqa: E402

from lightning_lorafusion.model.hf_loading import params_from_hf_model  # noqa: E402
from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from lightning_lorafusion.serving.config import EngineTuning  # noqa: E402
from lightning_lorafusion.serving.floor import FloorShape, breakdown  # noqa: E402
from lightning_lorafusion.serving.step_times import breakdown_table  # noqa: E402

log = logger("profile_step_host")


def build_engine(args) -> tuple[Engine, list[str], FloorShape]:
    device, dtype = torch.device(args.device), dtype_of(args.dtype)
    model, tokenizer = build_model(SHAPES[args.shape], device, dtype, seed=0)
    config, params = params_from_hf_model(model)
    sets = random_adapters(config, len(args.ranks), args.ranks, device, dtype, seed=1, b_std=0.02)
    bases = host_adapters(config, sets, len(sets), dtype, pin=device.type == "cuda")
    names = [f"t{i}" for i in range(args.adapters)]
    engine = Engine(config, params, tokenizer, EngineConfig(
        max_num_seqs=args.max_num_seqs, prefix_caching=False, cpu_pool_mib=args.pool_mib, num_pages=args.num_pages,
        max_num_batched_tokens=args.max_batched_tokens, tuning=EngineTuning(async_decode=args.async_decode)),
        device=device, dtype=dtype)
    for a in renamed(bases, names):
        engine.add_host_adapter(a)
    return engine, names, FloorShape.from_config(config)


def stub_forward() -> Callable[[], None]:
    """The runner's eager forward returns random final hidden states of the rows it would
    return (random, so greedy picks ordinary tokens whose text the detokenizers work on).
    Returns what puts the real forward back."""
    from lightning_lorafusion.serving import runner

    real = runner.paged_forward

    gen = torch.Generator().manual_seed(0)

    def hidden(model, batch):
        rows = batch.input_ids.shape[0] if batch.output_rows is None else batch.output_rows.shape[0]
        embed = model.params["embed"]
        return torch.randn(rows, model.config.hidden_size, generator=gen).to(embed.device, embed.dtype)

    runner.paged_forward = hidden
    return lambda: setattr(runner, "paged_forward", real)


def requests(args, names: list[str], prefix: str, vocab: int) -> list[GenerationRequest]:
    rng = random.Random(args.seed)
    out = []
    for i in range(args.requests):
        adapter = None if rng.random() < args.base_share else names[i % len(names)]
        new = rng.randint(max(1, round(args.new * (1 - args.new_spread))), round(args.new * (1 + args.new_spread)))
        sp = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
        out.append(GenerationRequest(prompt_token_ids=[rng.randrange(4, vocab) for _ in range(args.prompt)],
                                     adapter=adapter, sampling=sp, request_id=f"{prefix}{i}"))
    return out


def run(engine: Engine, reqs: list[GenerationRequest], profiler: cProfile.Profile | None = None):
    """Submit ``reqs`` at once, step until done with the ledger on -> (ledger, seconds)."""
    for r in reqs:
        engine.submit(r)
    ledger = engine.enable_step_ledger()
    t0, cpu0 = time.perf_counter(), time.thread_time()
    if profiler is not None:
        profiler.enable()
    while engine.has_work():
        engine.step()
    if profiler is not None:
        profiler.disable()
    seconds, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    engine.disable_step_ledger()
    ledger.cpu_s = cpu  # (this thread's CPU time: what other processes on the machine take is not in it)
    return ledger, seconds


def top_functions(profiler: cProfile.Profile, n: int) -> tuple[str, list[dict]]:
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    for (path, line, name), (cc, nc, tt, ct, _) in stats.stats.items():
        rows.append({"function": f"{path.split('/')[-1]}:{line}({name})", "calls": nc, "own_s": tt, "cum_s": ct})
    rows.sort(key=lambda r: -r["own_s"])
    rows = rows[:n]
    text = "\n".join(f"  {r['own_s']:8.3f} {r['cum_s']:8.3f} {r['calls']:>8}  {r['function']}" for r in rows)
    return "  own s    cum s    calls  function\n" + text, rows


def host_ms(report: dict, phase: str, min_bucket: int = 0) -> dict:
    """Host ms per step of the kinds of ``phase`` ("decode" or "mixed") and bucket >=
    ``min_bucket``, by phase of the step (launch includes what the CPU computes itself)."""
    rows = [k for k in report["kinds"] if k["kind"].startswith(phase) and int(k["kind"].split()[1][1:]) >= min_bucket]
    steps = sum(k["steps"] for k in rows)
    out = {"steps": steps}
    for key in ("wall_s", "schedule_s", "launch_s", "wait_s", "emit_s"):
        out[key.replace("_s", "_ms")] = round(1e3 * sum(k[key] for k in rows) / steps, 3) if steps else None
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="tiny")
    add_device_args(ap, dtype="float32")
    ap.add_argument("--requests", type=int, default=384)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--adapters", type=int, default=128)
    ap.add_argument("--ranks", type=comma_list(cast=int), default=[4, 8, 16, 32, 64])
    ap.add_argument("--base-share", type=float, default=0.0, help="fraction of requests on the base")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--new-spread", type=float, default=0.75,
                    help="output lengths uniform in new * (1 -+ spread): requests finish and join every few steps")
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--num-pages", type=int, default=4096)
    ap.add_argument("--pool-mib", type=int, default=256)
    ap.add_argument("--async-decode", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--forward", choices=("stub", "real"), default="stub",
                    help="stub: random hidden states instead of the model's math (host work alone)")
    ap.add_argument("--repeat", type=int, default=5, help="passes over the same requests; the fastest is shown")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--profile", type=int, default=25, help="top N functions by own time (0: no profile)")
    ap.add_argument("--seed", type=int, default=0)
    add_output_args(ap)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    restore = stub_forward() if args.forward == "stub" else (lambda: None)
    try:
        report = profile(args)
    finally:
        restore()
        torch.set_num_threads(threads)
    write_json(args.out, "profile_step_host.json", report)
    return report


def profile(args) -> dict:
    engine, names, shape = build_engine(args)
    vocab = engine.model_config.vocab_size
    report: dict = {"args": vars(args)}
    try:
        run(engine, requests(args, names, "w", vocab)[:8])  # first-use costs out of the way
        passes = []  # the same requests each pass; the fastest pass is reported (a shared CPU is noisy)
        for i in range(args.repeat):
            ledger, seconds = run(engine, requests(args, names, f"a{i}-", vocab))
            passes.append((seconds, ledger))
        seconds, ledger = min(passes, key=lambda p: p[0])
        report["pass_seconds"] = [p[0] for p in passes]
        times = breakdown(ledger, shape, peak_flops=1e15, bandwidth=1e12)
        big = min(128, args.max_num_seqs)
        cpu_ms = min(1e3 * p[1].cpu_s / max(len(p[1].steps), 1) for p in passes)
        report.update(seconds=seconds, breakdown=times, decode_host_ms=host_ms(times, "decode", big),
                      mixed_host_ms=host_ms(times, "mixed"), cpu_ms_per_step=cpu_ms,
                      pass_cpu_ms_per_step=[1e3 * p[1].cpu_s / max(len(p[1].steps), 1) for p in passes])
        print(f"{args.requests} requests over {args.adapters} adapters, {seconds:.2f} s (passes "
              f"{', '.join(f'{p[0]:.2f}' for p in passes)}); host time by step kind")
        print(breakdown_table(times))
        print(f"decode steps of >= {big} rows, ms per step:", report["decode_host_ms"])
        print("mixed steps, ms per step:", report["mixed_host_ms"])
        print(f"CPU time of the stepping thread, ms per step (every step; best pass): {cpu_ms:.3f}")
        if args.profile:
            profiler = cProfile.Profile()
            run(engine, requests(args, names, "p", vocab), profiler)
            text, rows = top_functions(profiler, args.profile)
            report["profile"] = rows
            print(text)
    finally:
        engine.close()
    return report


if __name__ == "__main__":
    main()
