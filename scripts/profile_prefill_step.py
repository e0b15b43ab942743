"""Where a mixed (prefill + decode) engine step's time goes, against the number of prompts in it.

Issue 13's HTTP runs spend their extra time in eager steps with prefill rows (session 8/9 runs:
~80 ms each on the 1B shape, whether they carry 12 prompts or 21, against ~5 ms for a decode
step). This measures that step directly: the benchmark's engine (``bench_server.build_engine``:
random ``--shape`` Llama, ``--adapters`` random adapters) with ``--decode`` requests decoding
(long answers, EOS ignored), then for each k in ``--prompts``: k new one-token requests of
``--prompt-len`` random tokens submitted, and one ``Engine.step`` run (their prefill + the decode
rows), ``--repeats`` times. Each step is timed three ways:

- wall: ``Engine.step`` with the device synchronized before and after;
- phases: ``runner.prepare`` / ``runner.forward`` / ``runner.logits`` / the rest, each timed on
  the host when its call returns (no synchronization: the host's own time for launches; the
  device catches up at the first read, which lands in "rest");
- device: CUDA events around the step (GPU time from the step's first launch to its last).

A step whose wall time is close to its host phases and far above its device time is bound by
the host (Python and launches), not the GPU. ``--warm-up`` runs ``Engine.warm_up`` first (what ``serve`` does); every step's own
wall time is printed too, so first-time stalls (Triton compiles) show. ``--torch-profile K`` adds a torch.profiler table of
one step with K prompts (top ops by self CPU and by device time).

    PYTHONPATH=. python3 scripts/profile_prefill_step.py --shape 1b --prompts 0,1,4,12,21 --out $OUT
    PYTHONPATH=. python3 scripts/profile_prefill_step.py --shape tiny --device cpu --dtype float32 \\
        --decode 4 --prompts 0,1,2 --prompt-len 8 --repeats 2 --adapters 2
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_generation import SHAPES  # noqa: E402
from bench_server import build_engine  # noqa: E402

from lightning_lorafusion.serving.config import EngineConfig  # noqa: E402
from lightning_lorafusion.serving.request import GenerationRequest  # noqa: E402
from lightning_lorafusion.serving.sampling import SamplingParams  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseTimer:
    """Wraps the runner's methods on the instance: host seconds per phase, summed until reset."""

    PHASES = ("prepare", "forward", "logits")

    def __init__(self, runner) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        for name in self.PHASES:
            setattr(runner, name, self._wrap(name, getattr(runner, name)))

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t
        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--ranks", default="8,16,32,64")
    ap.add_argument("--decode", type=int, default=60, help="requests decoding through every measured step")
    ap.add_argument("--prompts", default="0,1,4,12,21", help="prompts prefilled per measured step")
    ap.add_argument("--prompt-len", type=int, default=320)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--graphs", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--torch-profile", type=int, default=None, help="profile one step with this many prompts")
    ap.add_argument("--mixed-graphs", choices=("auto", "off", "eager", "on"), default="auto",
                    help="EngineConfig.mixed_graphs: steps with prefill rows as pieces around attention")
    ap.add_argument("--warm-up", action="store_true",
                    help="run Engine.warm_up() first, as serve does (else only this script's own mixed batch)")
    ap.add_argument("--cprofile", type=int, default=None, help="cProfile one step with this many prompts")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    counts = [int(k) for k in args.prompts.split(",")]
    engine = build_engine(args.shape, args.device, dtype, args.adapters, [int(r) for r in args.ranks.split(",")],
                          EngineConfig(max_num_seqs=max(256, args.decode + max(counts)), max_num_batched_tokens=65536,
                                       gpu_memory_fraction=0.5, cpu_pool_mib=512, cuda_graphs=args.graphs,
                                       mixed_graphs=args.mixed_graphs))
    names = [a.name for a in engine.adapters()]
    vocab = SHAPES[args.shape]["vocab_size"]
    gen = torch.Generator().manual_seed(args.seed)
    serial = iter(range(10**9))

    def request(new_tokens: int) -> GenerationRequest:
        i = next(serial)
        prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
        return GenerationRequest(prompt_token_ids=prompt, adapter=names[i % len(names)], request_id=f"r{i}",
                                 sampling=SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True))

    if args.warm_up:
        print(f"Engine.warm_up: {engine.warm_up()}")
    # warm: every adapter paged in, prefill shapes compiled
    engine.generate([request(2) for _ in range(max(len(names), max(counts)))])
    total_steps = len(counts) * args.repeats + (args.torch_profile is not None) + 8
    for _ in range(args.decode):
        engine.submit(request(total_steps + 16))
    for _ in range(6):  # their prefill (one step within the token budget), then decode-only steps
        engine.step()
    timer = PhaseTimer(engine.runner)
    cuda = device.type == "cuda"
    rows = []
    for k in counts:
        walls, phases, dev = [], [], []
        for _ in range(args.repeats):
            for _ in range(k):
                engine.submit(request(1))
            sync(device)
            timer.reset()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t = time.perf_counter()
            engine.step()
            if cuda:
                end.record()
            sync(device)
            walls.append(time.perf_counter() - t)
            phases.append(dict(timer.seconds))
            if cuda:
                dev.append(start.elapsed_time(end) / 1e3)
        row = {"prompts": k, "tokens": k * args.prompt_len + args.decode, "wall_ms": 1e3 * statistics.median(walls),
               "walls_ms": [round(1e3 * w, 2) for w in walls]}
        for name in PhaseTimer.PHASES:
            row[f"{name}_ms"] = 1e3 * statistics.median(p[name] for p in phases)
        row["rest_ms"] = row["wall_ms"] - sum(row[f"{n}_ms"] for n in PhaseTimer.PHASES)
        row["device_ms"] = 1e3 * statistics.median(dev) if dev else None
        rows.append(row)
    head = f"{'prompts':>7} {'tokens':>7} {'wall ms':>8} {'prepare':>8} {'forward':>8} {'logits':>8} {'rest':>8} {'device':>8}"
    print(f"{args.shape}, {args.decode} decoding, prompts of {args.prompt_len} tokens, {args.adapters} adapters "
          f"(median of {args.repeats}; prepare/forward/logits = host time until the call returns)")
    print(head)
    for r in rows:
        print(f"{r['prompts']:>7} {r['tokens']:>7} {r['wall_ms']:>8.2f} {r['prepare_ms']:>8.2f} {r['forward_ms']:>8.2f} "
              f"{r['logits_ms']:>8.2f} {r['rest_ms']:>8.2f} "
              + (f"{r['device_ms']:>8.2f}" if r["device_ms"] is not None else f"{'-':>8}"))
    for r in rows:
        print(f"  {r['prompts']} prompts, every step's wall ms: {r['walls_ms']}")
    report = {"args": vars(args), "rows": rows}
    if args.cprofile is not None:
        for _ in range(args.cprofile):
            engine.submit(request(1))
        sync(device)
        prof = cProfile.Profile()
        prof.enable()
        engine.step()
        sync(device)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue())
        report["cprofile"] = text.getvalue()
    if args.torch_profile is not None:
        from torch.profiler import ProfilerActivity, profile
        for _ in range(args.torch_profile):
            engine.submit(request(1))
        sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            engine.step()
            sync(device)
        averages = prof.key_averages()
        by_cpu = averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
        print(by_cpu)
        report["profile_self_cpu"] = by_cpu
        if cuda:
            by_dev = averages.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60)
            print(by_dev)
            report["profile_device"] = by_dev
    engine.close()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"profile_prefill_step_{args.shape}.json"), "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
