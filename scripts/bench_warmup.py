"""Cold start of the generation engine: warm-up time, the first trace after it, an adapter of a new
rank loaded mid-traffic, and a restart that reuses the on-disk compile cache.

A random-weight Llama of a real shape (``--shape 8b`` / ``1b``; ``tiny`` for the CPU), N
adapters (``--adapters``) with ranks cycling through ``--ranks`` on all seven projections (one
random weight set per rank, shared by the adapters of that rank: each is still its own adapter
to the engine, paged in and out alone). The compile caches go to ``--cache-dir`` (default
``OUT/compile_cache``, emptied first unless ``--keep-cache``), so the first process compiles
from scratch and the second loads.

Phases (``--phases``, any of ``warm_up,trace,newrank,restart``; each its own time limit,
``--limits``), in one process unless said; when a phase runs past its limit the table of what
was measured so far is printed and written, and the script exits with status 3:
1. ``build`` (always, before the others): the engine (the decode graphs are compiled ahead and
   captured here) and its adapters.
2. ``warm_up``: ``Engine.warm_up()`` wall time and its report (captures by kind, Triton kernel
   variants compiled ahead, of them compiled fresh).
3. ``trace`` / ``newrank``: the first traffic after warm-up (the warm-up skipped if not asked): ``--requests`` requests arriving as a Poisson
   stream of ``--rate``/s (all at once with ``--rate 0``), adapters by Zipf popularity (alpha 1,
   the base model among them), prompt and output lengths lognormal (``--prompt-median``,
   ``--output-median``, sigma ``--sigma``, capped by ``--max-len``), cut after its limit. With
   ``newrank``: when half the requests have arrived, an adapter of rank ``--new-rank`` (a rank no
   loaded adapter has) is added (``Engine.add_host_adapter``, timed) and every
   ``--new-every``-th later request names it.
   Reported: the longest gap between two tokens while requests were running (an upper bound on
   the longest engine step), before and after the load; TTFT p50/p99 of the other tenants'
   requests before and after the load, and of the new adapter's; tokens/s; the engine's
   capture counts before and after (equal: nothing captured for the new rank).
4. ``restart`` (a second process, same cache directory; skip with ``--no-restart``): build and
   ``warm_up`` again, times and fresh compiles (0 expected: all loaded from the cache). Alone
   (``--phases restart``) it runs in this process on the cache a previous run left in
   ``--cache-dir`` (kept, not emptied).

Table on stdout, ``bench_warmup.json`` under ``--out``.

    PYTHONPATH=. python3 scripts/bench_warmup.py --shape 8b --adapters 160 --ranks 8,16,32,64,4,24,96,128 --requests 256 --rate 24 --phases warm_up,newrank,restart --limits build=90,warm_up=120,newrank=100,restart=150 --out $OUT
    PYTHONPATH=. python3 scripts/bench_warmup.py --shape tiny --device cpu --dtype float32 --adapters 8 --ranks 4,8,24 --requests 24 --rate 40 --prompt-median 12 --output-median 4 --max-len 48 --max-batched-tokens 64 --max-num-seqs 16 --mixed-graphs eager --out /tmp/bw
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness import add_device_args, add_output_args, device_info, dtype_of, logger, percentile, write_json

import torch  # noqa: E402

log = logger("bench_warmup")


PHASES = ("warm_up", "trace", "newrank", "restart")
DEFAULT_LIMITS = {"build": 120.0, "warm_up": 180.0, "trace": 90.0, "newrank": 90.0, "restart": 240.0}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _phases(text: str) -> list[str]:
    phases = [p for p in text.split(",") if p]
    bad = [p for p in phases if p not in PHASES]
    if bad or not phases:
        raise argparse.ArgumentTypeError(f"--phases {text!r}: each of {', '.join(PHASES)}, comma separated")
    return phases


def _limits(text: str) -> dict[str, float]:
    limits = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in DEFAULT_LIMITS or not value:
            raise argparse.ArgumentTypeError(f"--limits {item!r}: name=seconds with a name of "
                                             f"{', '.join(DEFAULT_LIMITS)}")
        limits[name] = float(value)
    return limits


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b", help="tiny, 1b or 8b (scripts/bench_generation.py's SHAPES)")
    ap.add_argument("--adapters", type=int, default=160)
    ap.add_argument("--ranks", type=_ints, default=[8, 16, 32, 64])
    ap.add_argument("--new-rank", type=int, default=None, help="rank of the adapter loaded mid-traffic "
                                                               "(default: one not in --ranks)")
    ap.add_argument("--new-every", type=int, default=8, help="after the load, every n-th request names it")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rate", type=float, default=24.0, help="requests/s (0: all at once)")
    ap.add_argument("--prompt-median", type=int, default=256)
    ap.add_argument("--output-median", type=int, default=96)
    ap.add_argument("--sigma", type=float, default=0.8, help="of the lognormal lengths")
    ap.add_argument("--max-len", type=int, default=2048, help="cap of prompt and output lengths")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=None, help="default: EngineConfig's")
    ap.add_argument("--memory-fraction", type=float, default=0.6)
    ap.add_argument("--mixed-graphs", choices=("auto", "off", "eager", "on"), default="auto",
                    help="EngineTuning.mixed_graphs (eager: the pieces without capture, e.g. on the CPU)")
    ap.add_argument("--variant-record", choices=("on", "off"), default="on",
                    help="EngineTuning.kernel_variant_record (off: every run records the variants again)")
    ap.add_argument("--capture-warm-up", choices=("first", "every"), default="first",
                    help="EngineTuning.capture_warm_up (every: each piece run eagerly before its capture)")
    ap.add_argument("--trace-max-s", type=float, default=None, help="the trace is cut after this long "
                                                                     "(default: its phase's limit)")
    ap.add_argument("--phases", type=_phases, default=list(PHASES), help=f"comma list of {', '.join(PHASES)}")
    ap.add_argument("--limits", type=_limits, default={}, help="seconds per phase, e.g. warm_up=120,restart=150 "
                                                                f"(defaults: {DEFAULT_LIMITS})")
    ap.add_argument("--cache-dir", default=None, help="compile caches (default: OUT/compile_cache or a temp dir)")
    ap.add_argument("--keep-cache", action="store_true", help="do not empty the cache directory first")
    ap.add_argument("--no-restart", action="store_true")
    ap.add_argument("--phase", choices=("all", "restart"), default="all", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0)
    add_device_args(ap)
    add_output_args(ap)
    return ap.parse_args(argv)


def build_engine(args, device: torch.device, dtype: torch.dtype):
    """-> (engine, model config, host adapters by rank, seconds of the model and of the engine)."""
    from bench_generation import SHAPES, build_model, random_adapters
    from bench_serving import host_adapters

    from lightning_lorafusion.model.hf_loading import params_from_hf_model
    from lightning_lorafusion.serving import Engine, EngineConfig
    from lightning_lorafusion.serving.config import EngineTuning

    t0 = time.perf_counter()
    model, tokenizer = build_model(SHAPES[args.shape], device, dtype, args.seed)
    config, params = params_from_hf_model(model)
    model_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    extra = {} if args.max_batched_tokens is None else {"max_num_batched_tokens": args.max_batched_tokens}
    engine = Engine(config, params, tokenizer,
                    EngineConfig(max_num_seqs=args.max_num_seqs, gpu_memory_fraction=args.memory_fraction,
                                 tuning=EngineTuning(mixed_graphs=args.mixed_graphs,
                                                      kernel_variant_record=args.variant_record,
                                                      capture_warm_up=args.capture_warm_up), **extra),
                    device=device, dtype=dtype)
    engine_s = time.perf_counter() - t1
    ranks = sorted(set(args.ranks) | {new_rank(args)})
    sets = random_adapters(config, len(ranks), ranks, device, dtype, args.seed + 1, b_std=0.02)
    pin = device.type == "cuda"
    by_rank = {r: host_adapters(config, [s], 1, dtype, pin)[0] for r, s in zip(ranks, sets)}
    return engine, config, by_rank, model_s, engine_s


def new_rank(args) -> int:
    if args.new_rank is not None:
        return args.new_rank
    return next(r for r in (48, 40, 56, 72, 80, 96, 112, 120, 128, 12, 20, 28) if r not in args.ranks)


def named(adapter, name: str):
    from lightning_lorafusion.serving.adapters import HostAdapter

    return HostAdapter(name=name, rank=adapter.rank, alpha=adapter.alpha, target_modules=adapter.target_modules,
                       slots=adapter.slots, flat=adapter.flat, num_layers=adapter.relative_offsets.shape[0])


def make_trace(args, vocab: int, names: list[str]) -> list[tuple[float, list[int], int, str | None]]:
    """(arrival s, prompt, output length, adapter) per request; adapter None = the base."""
    rng = random.Random(args.seed)
    choices = [None, *names]
    weights = [1.0 / (i + 1) for i in range(len(choices))]
    t, out = 0.0, []

    def length(median: int) -> int:
        return max(1, min(args.max_len, int(round(rng.lognormvariate(math.log(median), args.sigma)))))

    for _ in range(args.requests):
        if args.rate > 0:
            t += rng.expovariate(args.rate)
        prompt = [rng.randrange(1, vocab) for _ in range(length(args.prompt_median))]
        out.append((t, prompt, length(args.output_median), rng.choices(choices, weights)[0]))
    return out


def replay(engine, trace, args, new_adapter, max_s: float) -> dict:
    """Submit the trace at its arrival times into the engine's loop, load ``new_adapter`` halfway
    (None: load nothing); requests still running after ``max_s`` are aborted."""
    from lightning_lorafusion.serving import GenerationRequest, SamplingParams
    from lightning_lorafusion.serving.warm_up import compiled_kernel_variants

    n = len(trace)
    first = [None] * n
    arrival = [0.0] * n
    token_times: list[float] = []
    done = threading.Event()
    left = [n]
    lock = threading.Lock()

    def on_event(ev) -> None:
        now = time.perf_counter()
        i = int(ev.request_id[1:])
        with lock:
            if ev.token_id is not None:
                token_times.append(now)
                if first[i] is None:
                    first[i] = now
            if ev.finish_reason is not None:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    half = n // 2
    targets = [a for _, _, _, a in trace]
    new_name = new_adapter.name if new_adapter is not None else None
    if new_adapter is not None:
        for j in range(half, n, args.new_every):
            targets[j] = new_name
    kernels_before = sum(compiled_kernel_variants().values())
    page_ins_before = engine.stats()["adapter_page_ins_total"]
    engine.start()
    t0 = time.perf_counter() + 0.05
    load_at = load_s = None
    for i, (t, prompt, out_len, _) in enumerate(trace):
        while (now := time.perf_counter()) < t0 + t:
            time.sleep(min(0.01, t0 + t - now))
        if i == half:
            load_at = time.perf_counter()
            if new_adapter is not None:
                engine.add_host_adapter(new_adapter)
                load_s = time.perf_counter() - load_at
        arrival[i] = time.perf_counter()
        engine.submit(GenerationRequest(prompt_token_ids=prompt, adapter=targets[i], request_id=f"q{i}",
                                        sampling=SamplingParams(max_new_tokens=out_len, temperature=0.0,
                                                                ignore_eos=True)), on_event)
    cut = not done.wait(max_s)
    end = time.perf_counter()
    if cut:
        for i in range(n):
            engine.abort(f"q{i}")
        done.wait(30)
    ttft = {"others_before": [], "others_after": [], "new_adapter": []}
    for i in range(n):
        if first[i] is None:
            continue
        if new_name is not None and targets[i] == new_name:
            key = "new_adapter"
        else:
            key = "others_before" if i < half else "others_after"
        ttft[key].append(first[i] - arrival[i])
    times = sorted(token_times)
    gaps_before = [b - a for a, b in zip(times, times[1:]) if b <= load_at]
    gaps_after = [b - a for a, b in zip(times, times[1:]) if a >= load_at]
    # where the longest gap ended (seconds into the trace), and what the trace compiled or paged in
    longest = max(zip(times, times[1:]), key=lambda ab: ab[1] - ab[0], default=None)
    wall = (times[-1] if times else end) - t0
    return {"requests": n, "finished": sum(f is not None for f in first), "cut": cut, "wall_s": wall,
            "generated_tok_s": len(times) / wall if wall > 0 else 0.0,
            "new_adapter_rank": new_adapter.rank if new_adapter is not None else None,
            "new_adapter_load_s": load_s,
            "max_token_gap_ms_before_load": 1e3 * max(gaps_before, default=0.0),
            "max_token_gap_ms_after_load": 1e3 * max(gaps_after, default=0.0),
            "max_token_gap_ends_at_s": None if longest is None else longest[1] - t0,
            "triton_variants_compiled_in_trace": sum(compiled_kernel_variants().values()) - kernels_before,
            "adapter_page_ins_in_trace": engine.stats()["adapter_page_ins_total"] - page_ins_before,
            **{f"ttft_{k}_{q}_s": percentile(v, q) for k, v in ttft.items() for q in (50, 99)},
            "ttft_counts": {k: len(v) for k, v in ttft.items()},
            # per request: arrival (s into the trace), TTFT s (None: no token), prompt tokens, adapter
            "timeline": [[round(arrival[i] - t0, 4), None if first[i] is None else round(first[i] - arrival[i], 4),
                          len(trace[i][1]), targets[i]] for i in range(n)],
            "load_at_s": None if load_at is None else round(load_at - t0, 4)}


def tokens_digest(engine, vocab: int, names: list[str]) -> str:
    """Greedy tokens of a fixed set of requests (the base and five adapters, prompts of 24 to 600
    tokens: mixed steps of several token buckets, then decode steps) as a short hash: runs of the
    same model and adapters whose captures differ only in how they were made give the same one."""
    import hashlib

    from lightning_lorafusion.serving import GenerationRequest, SamplingParams

    rng = random.Random(1234)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    reqs = [GenerationRequest(prompt_token_ids=[rng.randrange(1, vocab) for _ in range(n)], adapter=a, sampling=sp,
                              request_id=f"check{i}")
            for i, (n, a) in enumerate(zip((24, 600, 130, 300, 57, 410), [None, *names[:5]]))]
    tokens = [r.token_ids for r in engine.generate(reqs)]
    engine.reset_prefix_cache()  # (what follows starts without their pages)
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def run_restart(args, device, dtype) -> dict:
    engine, _, by_rank, model_s, engine_s = build_engine(args, device, dtype)
    try:
        for i in range(args.adapters):
            engine.add_host_adapter(named(by_rank[args.ranks[i % len(args.ranks)]], f"a{i}"))
        t0 = time.perf_counter()
        report = engine.warm_up()
        warm_up_s = time.perf_counter() - t0
        return {"model_s": model_s, "engine_s": engine_s, "warm_up_s": warm_up_s, "warm_up": report,
                "decode_compile": engine.runner.decode_compile,
                "tokens_digest": tokens_digest(engine, engine.model_config.vocab_size,
                                               [f"a{i}" for i in range(args.adapters)])}
    finally:
        engine.close()


def restart_in_new_process(args, argv: list[str], limit_s: float) -> dict:
    """This script again with ``--phase restart`` (same arguments, same cache directory), cut
    after ``limit_s``."""
    argv = [*argv, "--phase", "restart", "--keep-cache", "--cache-dir", args.cache_dir]
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], env=dict(os.environ),
                              capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return {"error": f"cut after its limit of {limit_s:.0f} s", "cut": True}
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def set_cache_dir(args) -> None:
    import tempfile

    if args.cache_dir is None:
        args.cache_dir = str(Path(args.out) / "compile_cache") if args.out else tempfile.mkdtemp(prefix="bw_cache_")
    if not args.keep_cache and Path(args.cache_dir).exists():
        shutil.rmtree(args.cache_dir)
    os.environ["LORAFUSION_CACHE_DIR"] = args.cache_dir
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        os.environ.pop(var, None)  # the engine puts them under LORAFUSION_CACHE_DIR


class PhaseClock:
    """Each phase under its time limit: ``with clock.phase(name):``. A phase that runs past its
    limit cannot be stopped from outside (a compile, a capture): a timer thread then prints and
    writes the report as it stands, with the phase marked cut, and ends the process (status 3)."""

    def __init__(self, args, report: dict) -> None:
        self.args, self.report = args, report
        self.limits = {**DEFAULT_LIMITS, **args.limits}
        self.lock = threading.Lock()

    def limit(self, name: str) -> float:
        return self.limits[name]

    def _cut(self, name: str) -> None:
        with self.lock:
            self.report.setdefault("cut", []).append(name)
            self.report.setdefault(name, {})["cut_after_s"] = self.limits[name]
            log(f"phase {name} passed its limit of {self.limits[name]:.0f} s: partial report")
            print(table(self.report), flush=True)
            write_json(self.args.out, "bench_warmup.json", self.report)
            os._exit(3)

    @contextlib.contextmanager
    def phase(self, name: str, *, watchdog: bool = True):
        timer = threading.Timer(self.limits[name], self._cut, (name,)) if watchdog else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if timer is not None:
                timer.cancel()
            with self.lock:
                self.report.setdefault("phase_s", {})[name] = time.perf_counter() - t0


def _log_engine_progress() -> None:
    """The engine's INFO lines (each warm-up stage's time as it ends) on stderr, so a phase cut
    by its limit still shows where its time went."""
    engine_log = logging.getLogger("lightning_lorafusion.serving")
    if not any(getattr(h, "_bench_warmup", False) for h in engine_log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[engine %(asctime)s] %(message)s", "%H:%M:%S"))
        handler._bench_warmup = True
        engine_log.addHandler(handler)
    engine_log.setLevel(min(engine_log.level or logging.INFO, logging.INFO))


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    _log_engine_progress()
    restart_alone = args.phases == ["restart"]
    if restart_alone:
        args.keep_cache = True  # the cache a previous run left
    set_cache_dir(args)
    device, dtype = torch.device(args.device), dtype_of(args.dtype)
    if args.phase == "restart":
        print(json.dumps(run_restart(args, device, dtype), default=str))
        return {}
    report = {"device": device_info(device), "args": vars(args)}
    clock = PhaseClock(args, report)
    if restart_alone:
        with clock.phase("restart"):
            report["restart"] = run_restart(args, device, dtype)
    else:
        measure_in_process(args, device, dtype, clock, report)
        if "restart" in args.phases and not args.no_restart:
            log("restart in a second process")
            with clock.phase("restart", watchdog=False):  # (the child is cut by its own timeout)
                report["restart"] = restart_in_new_process(args, argv, clock.limit("restart"))
    print(table(report))
    write_json(args.out, "bench_warmup.json", report)
    return report


def measure_in_process(args, device, dtype, clock: PhaseClock, report: dict) -> None:
    """The phases of this process: build, then warm_up, trace / newrank as asked."""
    with clock.phase("build"):
        engine, config, by_rank, model_s, engine_s = build_engine(args, device, dtype)
    try:
        names = []
        t_add = time.perf_counter()
        for i in range(args.adapters):
            engine.add_host_adapter(named(by_rank[args.ranks[i % len(args.ranks)]], f"a{i}"))
            names.append(f"a{i}")
        report["build"] = {"model_s": model_s, "engine_s": engine_s, "adapters_s": time.perf_counter() - t_add,
                           "decode_graphs_s": engine.runner.decode_graphs_s,
                           "decode_compile": engine.runner.decode_compile}
        log(f"engine built in {engine_s:.1f} s (decode graphs {engine.runner.decode_graphs_s:.1f} s)")
        if "warm_up" in args.phases:
            with clock.phase("warm_up"):
                t0 = time.perf_counter()
                report["warm_up"] = engine.warm_up()
                report["warm_up"]["wall_s"] = time.perf_counter() - t0
            log(f"warm-up {report['warm_up']['wall_s']:.1f} s")
            report["warm_up"]["tokens_digest"] = tokens_digest(engine, config.vocab_size, names)
        newrank = "newrank" in args.phases
        if newrank or "trace" in args.phases:
            name = "newrank" if newrank else "trace"
            max_s = args.trace_max_s or clock.limit(name)
            with clock.phase(name, watchdog=False):  # (the trace cuts itself at max_s)
                before = engine.runner.capture_counts()
                new = named(by_rank[new_rank(args)], "new_rank_adapter") if newrank else None
                report["trace"] = replay(engine, make_trace(args, config.vocab_size, names), args, new, max_s)
                report["trace"]["captures_before"] = before
                report["trace"]["captures_after"] = engine.runner.capture_counts()
            log(f"{name}: {report['trace']['finished']}/{report['trace']['requests']} requests")
    finally:
        engine.close()
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the restart's process needs the memory


def _f(x, unit="") -> str:
    return "-" if x is None else f"{x:.2f}{unit}" if isinstance(x, float) else f"{x}{unit}"


def table(report: dict) -> str:
    """The report as a two-column table; phases not run (or cut) show "-"."""
    b, w, t, r = (report.get(k) or {} for k in ("build", "warm_up", "trace", "restart"))
    rw, ahead = r.get("warm_up") or {}, w.get("compile_ahead") or {}
    dc = b.get("decode_compile") or {}
    rows = [("phases run (s)", json.dumps({k: round(v, 1) for k, v in report.get("phase_s", {}).items()})),
            ("cut", ", ".join(report.get("cut", [])) or "-"),
            ("engine build s (decode graphs s; variants compiled ahead)",
             f"{_f(b.get('engine_s'))} ({_f(b.get('decode_graphs_s'))}; {dc.get('variants', '-')})"),
            ("warm_up() s (compile s, pieces s, requests s)",
             f"{_f(w.get('wall_s'))} ({_f(w.get('compile_s'))}, {_f(w.get('mixed_pieces_s'))}, "
             f"{_f(w.get('rounds_s'))})"),
            ("  variants compiled ahead / threads", f"{ahead.get('variants', '-')} / {ahead.get('workers', '-')}"),
            ("  captures", json.dumps(w.get("captures"))),
            ("  Triton variants / compiled fresh", f"{w.get('triton_kernels', '-')} / {w.get('triton_compiled', '-')}"),
            ("trace tok/s (finished / requests)",
             f"{_f(t.get('generated_tok_s'))} ({t.get('finished', '-')}/{t.get('requests', '-')})"),
            ("max token gap ms before / after new-rank load", f"{_f(_ms(t, 'before'))} / {_f(_ms(t, 'after'))}"),
            ("  longest gap ends at s; Triton variants compiled, adapter page-ins in the trace",
             f"{_f(t.get('max_token_gap_ends_at_s'))}; {t.get('triton_variants_compiled_in_trace', '-')}, "
             f"{t.get('adapter_page_ins_in_trace', '-')}"),
            ("TTFT p99 s others before / after load", f"{_f(t.get('ttft_others_before_99_s'))} / "
                                                       f"{_f(t.get('ttft_others_after_99_s'))}"),
            ("TTFT p50 / p99 s new-rank adapter",
             f"{_f(t.get('ttft_new_adapter_50_s'))} / {_f(t.get('ttft_new_adapter_99_s'))}"),
            ("new adapter rank, load s", f"{_f(t.get('new_adapter_rank'))}, {_f(t.get('new_adapter_load_s'))}"),
            ("captures before / after trace",
             f"{json.dumps(t.get('captures_before'))} / {json.dumps(t.get('captures_after'))}"),
            ("restart: engine s, warm_up() s", f"{_f(r.get('engine_s'))}, {_f(r.get('warm_up_s'))}"
             if "error" not in r else f"error: {r['error'][-300:]}"),
            ("restart: variant lists decode / mixed (s to find them)",
             f"{_source(r.get('decode_compile'))} / {_source(rw.get('compile_ahead'))}"),
            ("restart: warm_up() compile s, pieces s, requests s, CUDA graphs",
             f"{_f(rw.get('compile_s'))}, {_f(rw.get('mixed_pieces_s'))}, {_f(rw.get('rounds_s'))}, "
             f"{(rw.get('captures') or {}).get('cuda_graphs', '-')}"),
            ("tokens digest after warm_up / restart", f"{w.get('tokens_digest', '-')} / {r.get('tokens_digest', '-')}"),
            ("restart: Triton variants / compiled fresh", f"{rw.get('triton_kernels', '-')} / "
                                                           f"{rw.get('triton_compiled', '-')}")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _source(found: dict | None) -> str:
    """Where a list of kernel variants came from and how long finding it took."""
    if not found:
        return "-"
    return f"{found.get('source', 'off')} ({_f(found.get('record_s'))})"


def _ms(trace: dict, when: str) -> float | None:
    return trace.get(f"max_token_gap_ms_{when}_load")


if __name__ == "__main__":
    main()
