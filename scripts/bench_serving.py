"""S-LoRA-style serving benchmark: a synthetic trace over N adapters replayed against the engine.

The trace (S-LoRA's synthetic workload): ``--requests`` requests arriving as a Poisson process
of ``--rate`` requests/s (``--cv`` other than 1: Gamma gaps of that coefficient of variation),
each naming one of N adapters (``--num-adapters``, a comma list swept: 1 .. thousands) drawn
uniformly or, with ``--popularity zipf``, with probability proportional to 1 / (i + 1)^alpha
(``--alpha``, adapter i of N), prompts of uniform length in ``--prompt-len LO,HI`` (random
tokens) and outputs of uniform length in ``--output-len LO,HI`` (greedy, EOS ignored, so each
request generates exactly that many). Adapter i has rank ``ranks[i % len(ranks)]`` (``--ranks``,
default 8/16/32/64) on all seven projections of a random-weight Llama of a real shape
(``--shape 1b`` / ``8b``, as scripts/bench_generation.py builds them; ``tiny`` for the CPU).
Random weights: ``--distinct-weights`` weight sets per rank, adapter i sharing the weights of
adapter ``i % (distinct * len(ranks))``; adapters sharing a set share one host buffer
(``Engine.add_host_adapter``) but are separate adapters to the engine, each paged into the GPU
pool and evicted on its own (what the benchmark measures); host memory stays small at 2048.

Ours: a new ``Engine`` per point (cold pool), a warm-up (one request per rank, then
``Engine.warm_up`` as ``serve`` runs it, which on a GPU captures the mixed-step pieces; not measured),
then the trace: this thread submits each request at its arrival time (``Engine.submit`` with a
per-token callback; the engine's background loop runs the steps, as under the HTTP server)
and every token's time is taken in that callback. Per point: generated tokens/s and
requests/s (from the first arrival to the last token), time to first token (from the
request's scheduled arrival) and time per output token (per request, (last - first token) /
(tokens - 1)) at p50/p90/p99, latency per output token (arrival to last token / tokens),
SLO attainment (share of all the trace's requests with a first token within ``--slo-ttft`` s,
6 s as in S-LoRA; requests cut by the deadline count as misses), adapter page-ins and
evictions, engine steps, prefill chunks, preemptions, pool use (pages, sampled every 0.1 s)
and peak GPU memory. The points run with chunked prefill on (``--chunked-prefill off``: off;
the engine's default is off, docs/serving.md) and ``--max-batched-tokens`` (default the
engine's); ``--unchunked N,..``: those points again with chunked prefill off.
``--prefill-attention``: every engine's ``EngineTuning.prefill_attention`` (each row records the
resolved value).

Baselines (HF transformers + PEFT, the model holding N adapters), at the points ``--baseline-at``
(default all) with N <= ``--baseline-max-adapters`` only, on the trace's first
``--baseline-requests`` requests (same arrivals), each stopped
after ``--baseline-max-s`` s (what was not served by then counts as missed): ``peft_switch``:
static batches of one adapter (the oldest waiting request's, with every waiting request of
that adapter up to ``--baseline-batch``), ``set_adapter`` then ``generate``; ``peft_mixed``: the
oldest ``--baseline-batch`` waiting requests whatever their adapters, ``generate(adapter_names=)``.
A batch generates the longest of its outputs; each request's tokens are timed by a logits
processor (one host sync per step). ``ours_subset``: the engine on the same requests. Greedy
tokens of each baseline's fully served requests are compared with ours (``agreement``:
token-identical in fp32; in bf16 near-ties drift).

``--deadline S``: stop starting phases S seconds after the start (a phase under way is cut at
the deadline and reported as far as it got); the JSON is rewritten after every phase.

    PYTHONPATH=. python3 scripts/bench_serving.py --shape 1b --num-adapters 1,16,256,1024 --rate 40 \\
        --requests 400 --baseline-at 16 --unchunked 16 --deadline 340 --out $OUT
    PYTHONPATH=. python3 scripts/bench_serving.py --shape tiny --device cpu --dtype float32 --num-adapters 1,4 \\
        --requests 12 --rate 30 --prompt-len 4,24 --output-len 2,8 --max-batched-tokens 16 --max-num-seqs 8
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import threading
import time
import traceback
from dataclasses import dataclass, field

from harness import add_device_args, add_output_args, device_info, dtype_of, logger, percentile, sync, write_json

import torch  # noqa: E402
from bench_generation import SHAPES, attach_peft, build_model, left_padded, random_adapters  # noqa: E402

from lightning_lorafusion.model.hf_loading import params_from_hf_model  # noqa: E402
from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from lightning_lorafusion.serving.adapters import HostAdapter, host_adapter_from_factors  # noqa: E402
from lightning_lorafusion.serving.config import PREFILL_ATTENTION, EngineTuning  # noqa: E402


log = logger("bench_serving")


# ---------------------------------------------------------------------------------------------
# the trace


@dataclass(frozen=True)
class TraceItem:
    arrival_s: float  # offset from the trace's start
    request: GenerationRequest


def adapter_weights(n: int, popularity: str, alpha: float) -> list[float]:
    """Relative popularity of adapters 0..n-1: equal, or Zipf 1 / (i + 1)^alpha."""
    if popularity == "uniform":
        return [1.0] * n
    return [1.0 / (i + 1) ** alpha for i in range(n)]


def make_trace(*, num_requests: int, rate: float, cv: float, adapters: list[str], popularity: str, alpha: float,
               prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int) -> list[TraceItem]:
    """S-LoRA's synthetic workload: Gamma-distributed gaps of mean 1 / rate and coefficient of
    variation ``cv`` (1: Poisson), adapters by popularity, uniform prompt and output lengths."""
    rng = random.Random(seed)
    cum, total = [], 0.0
    for w in adapter_weights(len(adapters), popularity, alpha):
        total += w
        cum.append(total)
    shape = 1.0 / (cv * cv)
    t, items = 0.0, []
    for i in range(num_requests):
        adapter = rng.choices(adapters, cum_weights=cum)[0]
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(*prompt_len))]
        sp = SamplingParams(max_new_tokens=rng.randint(*output_len), temperature=0.0, ignore_eos=True)
        items.append(TraceItem(t, GenerationRequest(prompt_token_ids=prompt, adapter=adapter, sampling=sp,
                                                    request_id=f"r{i}")))
        t += rng.gammavariate(shape, 1.0 / (rate * shape))
    return items


# ---------------------------------------------------------------------------------------------
# what happened to each request


@dataclass
class Record:
    arrival: float  # scheduled arrival (perf_counter)
    output_len: int
    submitted: float | None = None
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None


def summarize(records: list[Record], t0: float, slo_ttft: float) -> dict:
    """Throughput, latency percentiles and SLO attainment over a replayed trace (``records`` in
    trace order, every request of the trace; ``t0``: the first arrival)."""

    def spread(values: list[float]) -> dict:
        return {"mean": sum(values) / len(values) if values else None,
                **{f"p{q}": percentile(values, q) for q in (50, 90, 99)}}

    timed = [r for r in records if r.token_times]
    complete = [r for r in records if len(r.token_ids) == r.output_len]
    tokens = sum(len(r.token_ids) for r in records)
    end = max((r.token_times[-1] for r in timed), default=t0)
    wall = end - t0
    ttft = [r.token_times[0] - r.arrival for r in timed]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
            for r in timed if len(r.token_times) > 1]
    per_token = [(r.token_times[-1] - r.arrival) / len(r.token_times) for r in complete]
    lag = [r.submitted - r.arrival for r in records if r.submitted is not None]
    return {"requests": len(records), "complete": len(complete), "generated_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "requests_per_s": len(complete) / wall if wall > 0 else 0.0,
            "ttft_s": spread(ttft), "tpot_s": spread(tpot), "latency_per_token_s": spread(per_token),
            "slo_ttft_s": slo_ttft, "slo_attainment": sum(t <= slo_ttft for t in ttft) / len(records),
            "submit_lag_max_s": max(lag, default=0.0)}


# ---------------------------------------------------------------------------------------------
# ours


def replay_engine(engine: Engine, trace: list[TraceItem], *, deadline: float, slo_ttft: float) -> dict:
    """Submit each request at its arrival time into the engine's background loop; time every
    token in its callback. Cut at ``deadline`` (perf_counter): unfinished requests are aborted."""
    records = {it.request.request_id: Record(0.0, it.request.sampling.max_new_tokens) for it in trace}
    unfinished = [len(trace)]
    all_done = threading.Event()

    def on_event(ev) -> None:  # the engine's thread
        now = time.perf_counter()
        rec = records[ev.request_id]
        if ev.token_id is not None:
            rec.token_ids.append(ev.token_id)
            rec.token_times.append(now)
        if ev.finish_reason is not None:
            rec.finish_reason = ev.finish_reason
            unfinished[0] -= 1
            if unfinished[0] == 0:
                all_done.set()

    samples: list[dict] = []
    next_sample = [0.0]

    def sample() -> None:
        now = time.perf_counter()
        if now >= next_sample[0]:
            samples.append(engine.stats())
            next_sample[0] = now + 0.1

    before = engine.stats()
    engine.start()
    t0 = time.perf_counter() + 0.05
    for it in trace:
        rec = records[it.request.request_id]
        rec.arrival = t0 + it.arrival_s
        while (now := time.perf_counter()) < rec.arrival and now < deadline:
            sample()
            time.sleep(min(0.02, rec.arrival - now))
        if now >= deadline:
            break
        rec.submitted = time.perf_counter()
        engine.submit(it.request, on_event)
    submitted = [rid for rid, r in records.items() if r.submitted is not None]
    unfinished[0] -= len(trace) - len(submitted)
    if unfinished[0] == 0:
        all_done.set()
    while not all_done.wait(0.05) and time.perf_counter() < deadline:
        sample()
    cut = not all_done.is_set()
    if cut:
        for rid in submitted:
            if records[rid].finish_reason is None:
                engine.abort(rid)
        all_done.wait(60)
    after = engine.stats()
    out = summarize([records[it.request.request_id] for it in trace], t0, slo_ttft)
    counters = ("steps_total", "adapter_page_ins_total", "adapter_evictions_total", "preemptions_total",
                "prefill_chunks_total", "kv_pages_moved_total")
    out.update({k.removesuffix("_total"): after[k] - before[k] for k in counters})
    out["adapter_page_ins_per_s"] = out["adapter_page_ins"] / out["wall_s"] if out["wall_s"] > 0 else 0.0
    out["cut_at_deadline"] = cut
    out["submitted"] = len(submitted)
    if samples:
        out["pool"] = {"pages_total": after["kv_pages_total"],
                       "kv_pages_peak": max(s["kv_pages_used"] for s in samples),
                       "adapter_pages_peak": max(s["adapter_pages_used"] for s in samples),
                       "adapters_resident_peak": max(s["adapters_resident"] for s in samples),
                       "running_peak": max(s["running"] for s in samples),
                       "running_mean": sum(s["running"] for s in samples) / len(samples),
                       "waiting_peak": max(s["waiting"] for s in samples)}
    out["tokens"] = {rid: r.token_ids for rid, r in records.items()}
    return out


def host_adapters(config, weight_sets, count: int, dtype, pin: bool) -> list[HostAdapter]:
    """``count`` adapters named adapter0.. over the host buffers of ``weight_sets`` ((name, rank,
    alpha, factors) by rank, ``bench_generation.random_adapters``), adapter i on set i % sets."""
    built = [host_adapter_from_factors(name, {k: (a.cpu(), b.cpu()) for k, (a, b) in factors.items()},
                                       rank=r, alpha=alpha, config=config, dtype=dtype, pin=pin)
             for name, r, alpha, factors in weight_sets[:count]]
    return [built[i] if i < len(built) else
            HostAdapter(name=f"adapter{i}", rank=built[i % len(built)].rank, alpha=built[i % len(built)].alpha,
                        target_modules=built[i % len(built)].target_modules, slots=built[i % len(built)].slots,
                        flat=built[i % len(built)].flat, num_layers=config.num_layers)
            for i in range(count)]


def engine_config(args, chunked: bool) -> EngineConfig:
    extra = {} if args.max_batched_tokens is None else {"max_num_batched_tokens": args.max_batched_tokens}
    return EngineConfig(max_num_seqs=args.max_num_seqs, gpu_memory_fraction=args.memory_fraction,
                        cpu_pool_mib=args.cpu_pool_mib, enable_chunked_prefill=chunked,
                        tuning=EngineTuning(prefill_attention=args.prefill_attention, mixed_graphs=args.mixed_graphs,
                                            async_decode=args.async_decode), **extra)


def run_ours(model_bits, adapters: list[HostAdapter], trace: list[TraceItem], args, device, dtype, *,
             chunked: bool, deadline: float) -> dict:
    config, params, tokenizer = model_bits
    t_build = time.perf_counter()
    engine = Engine(config, params, tokenizer, engine_config(args, chunked), device=device, dtype=dtype)
    for a in adapters:
        engine.add_host_adapter(a)
    build_s = time.perf_counter() - t_build
    try:
        # warm-up (not measured): one request per rank, so every prefill kernel variant is compiled
        ranks = {}
        for a in adapters:
            ranks.setdefault(a.rank, a.name)
        lo, hi = args.prompt_len
        warm = [GenerationRequest(prompt_token_ids=[5 + j] * (lo + (hi - lo) * j // max(1, len(ranks))),
                                  adapter=name, request_id=f"warm{j}",
                                  sampling=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
                for j, name in enumerate(ranks.values())]
        t_warm = time.perf_counter()
        engine.generate(warm)
        # and serve's warm-up: on a GPU it also captures the mixed-step pieces of every token bucket
        serve_warm = engine.warm_up()
        warm_s = time.perf_counter() - t_warm
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        out = replay_engine(engine, trace, deadline=deadline, slo_ttft=args.slo_ttft)
        if device.type == "cuda":
            out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out.update(build_s=build_s, warm_up_s=warm_s, mixed_piece_keys=serve_warm["mixed_piece_keys"],
                   cuda_graphs=engine.runner.graphs is not None,
                   pool_gib=engine.pool.storage.numel() * engine.pool.storage.element_size() / 2**30,
                   max_num_batched_tokens=engine.config.max_num_batched_tokens, chunked_prefill=chunked,
                   prefill_attention=engine.runner.prefill_attention)
        return out
    finally:
        engine.close()
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# HF + PEFT baselines


def replay_hf(model, trace: list[TraceItem], *, mode: str, batch: int, device, deadline: float,
              slo_ttft: float) -> dict:
    """Static batches as requests arrive (``mode`` "switch": one adapter per batch via
    ``set_adapter``; "mixed": ``adapter_names``); each batch generates its longest output."""
    from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

    class StepClock(LogitsProcessor):
        """The time each generated token is ready (the step's logits, after a sync)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            sync(device)
            self.times.append(time.perf_counter())
            return scores

    class PastDeadline(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), time.perf_counter() > deadline, dtype=torch.bool,
                              device=input_ids.device)

    records = {it.request.request_id: Record(0.0, it.request.sampling.max_new_tokens) for it in trace}
    t0 = time.perf_counter() + 0.05
    for it in trace:
        records[it.request.request_id].arrival = t0 + it.arrival_s
    pending: list[GenerationRequest] = []
    nxt, batches = 0, 0
    while time.perf_counter() < deadline and (nxt < len(trace) or pending):
        now = time.perf_counter()
        while nxt < len(trace) and records[trace[nxt].request.request_id].arrival <= now:
            pending.append(trace[nxt].request)
            records[trace[nxt].request.request_id].submitted = now
            nxt += 1
        if not pending:
            time.sleep(min(0.02, max(0.0, records[trace[nxt].request.request_id].arrival - now)))
            continue
        if mode == "switch":
            chosen = [r for r in pending if r.adapter == pending[0].adapter][:batch]
        else:
            chosen = pending[:batch]
        taken = {r.request_id for r in chosen}
        pending = [r for r in pending if r.request_id not in taken]
        ids, mask = left_padded(chosen)
        new = max(r.sampling.max_new_tokens for r in chosen)
        clock = StepClock()
        kwargs = dict(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                      min_new_tokens=new, do_sample=False, pad_token_id=0,
                      logits_processor=LogitsProcessorList([clock]),
                      stopping_criteria=StoppingCriteriaList([PastDeadline()]))
        with torch.no_grad():
            if mode == "switch":
                model.set_adapter(chosen[0].adapter)
                out = model.generate(**kwargs)
            else:
                out = model.generate(**kwargs, adapter_names=[r.adapter for r in chosen])
        batches += 1
        produced = out.shape[1] - ids.shape[1]
        for j, r in enumerate(chosen):
            rec = records[r.request_id]
            n = min(r.sampling.max_new_tokens, produced, len(clock.times))
            rec.token_ids = out[j, ids.shape[1]:ids.shape[1] + n].tolist()
            rec.token_times = clock.times[:n]
    out = summarize([records[it.request.request_id] for it in trace], t0, slo_ttft)
    out.update(batches=batches, cut_at_deadline=any(len(r.token_ids) < r.output_len for r in records.values()),
               tokens={rid: r.token_ids for rid, r in records.items()})
    return out


def same_tokens(ours: dict[str, list[int]], theirs: dict[str, list[int]], ids: list[str]) -> dict:
    """How many of ``ids`` got the same greedy tokens, and the mean share of their common prefix."""
    prefix = [next((k for k, (x, y) in enumerate(zip(ours[i], theirs[i])) if x != y),
                   min(len(ours[i]), len(theirs[i]))) / max(1, len(theirs[i])) for i in ids]
    return {"compared": len(ids), "identical": sum(ours[i] == theirs[i] for i in ids),
            "mean_common_prefix_share": sum(prefix) / len(prefix) if prefix else None}


def detach_peft(peft_model):
    """The plain HF model back (LoRA layers removed, base weights untouched)."""
    return peft_model.unload()


# ---------------------------------------------------------------------------------------------
# main


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: want LO,HI with 1 <= LO <= HI")
    return lo, hi


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="1b")
    add_device_args(ap)
    ap.add_argument("--num-adapters", type=_ints, default=[1, 16, 256, 1024])
    ap.add_argument("--ranks", type=_ints, default=[8, 16, 32, 64])
    ap.add_argument("--distinct-weights", type=int, default=2, help="random weight sets per rank")
    ap.add_argument("--popularity", choices=("uniform", "zipf"), default="zipf")
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--rate", type=float, default=40.0, help="requests per second")
    ap.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of the gaps (1: Poisson)")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--prompt-len", type=_pair, default=(8, 512))
    ap.add_argument("--output-len", type=_pair, default=(8, 512))
    ap.add_argument("--slo-ttft", type=float, default=6.0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=None, help="default: EngineConfig's")
    ap.add_argument("--memory-fraction", type=float, default=0.6)
    ap.add_argument("--cpu-pool-mib", type=int, default=256)
    ap.add_argument("--chunked-prefill", choices=("on", "off"), default="on", help="for the points")
    ap.add_argument("--unchunked", type=_ints, default=[], help="points (N) run again with chunked prefill off")
    ap.add_argument("--prefill-attention", choices=PREFILL_ATTENTION, default="auto",
                    help="EngineTuning.prefill_attention of every engine")
    ap.add_argument("--mixed-graphs", choices=("auto", "off", "eager", "on"), default="auto",
                    help="EngineTuning.mixed_graphs: steps with prefill rows as pieces around attention")
    ap.add_argument("--async-decode", choices=("auto", "on", "off"), default="auto",
                    help="EngineTuning.async_decode: decode-only steps overlapped with the host")
    ap.add_argument("--baselines", default="peft_mixed,peft_switch")
    ap.add_argument("--baseline-max-adapters", type=int, default=64, help="no baseline above this N")
    ap.add_argument("--baseline-at", type=_ints, default=None, help="points (N) with baselines (default: all <= max)")
    ap.add_argument("--baseline-requests", type=int, default=64)
    ap.add_argument("--baseline-batch", type=int, default=32)
    ap.add_argument("--baseline-max-s", type=float, default=45.0)
    ap.add_argument("--point-max-s", type=float, default=120.0, help="a trace replay is cut after this long")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds from the start: no phase runs past it")
    ap.add_argument("--seed", type=int, default=0)
    add_output_args(ap)
    return ap.parse_args(argv)


class ServingBench:
    """The model, the host adapters and the report the points and baselines fill."""

    def __init__(self, args):
        self.args = args
        self.start = time.perf_counter()
        self.deadline = self.start + args.deadline
        self.device, self.dtype = torch.device(args.device), dtype_of(args.dtype)
        self.report: dict = {**device_info(self.device), "args": vars(args), "points": [], "baselines": [],
                             "skipped": [], "errors": {}}
        self.shape = SHAPES[args.shape]
        self.model, self.tokenizer = build_model(self.shape, self.device, self.dtype, seed=0)
        self.config, self.params = params_from_hf_model(self.model)  # shares the HF tensors (no copy)
        sets_needed = min(max(args.num_adapters), args.distinct_weights * len(args.ranks))
        self.weight_sets = random_adapters(self.config, sets_needed, args.ranks, self.device, self.dtype, seed=1,
                                           b_std=0.02)
        self.adapters = host_adapters(self.config, self.weight_sets, max(args.num_adapters), self.dtype,
                                      pin=self.device.type == "cuda")
        self.common = {"popularity": args.popularity, "alpha": args.alpha, "rate": args.rate}
        log(f"model {args.shape} and {len(self.adapters)} adapters ({sets_needed} weight sets) ready in "
            f"{time.perf_counter() - self.start:.1f} s")

    def save(self) -> None:
        slim = json.loads(json.dumps(self.report, default=str))
        for row in slim["points"] + slim["baselines"]:
            row.pop("tokens", None)
        write_json(self.args.out, f"bench_serving_{self.args.shape}.json", slim)

    def phase(self, kind: str, row: dict, fn) -> dict | None:
        """Run one measurement unless the deadline passed; a failure is recorded, the rest run."""
        name = f"{row['run']} N={row['num_adapters']}" + ("" if row.get("chunked_prefill", True) else " unchunked")
        if time.perf_counter() > self.deadline - 15:
            self.report["skipped"].append(name)
            log(f"skipped (deadline): {name}")
            return None
        try:
            row.update(fn())
            self.report["baselines" if kind.startswith("peft") else "points"].append(row)
            log(f"{name}: {row['complete']}/{row['requests']} requests, {row['tokens_per_s']:.0f} tok/s, TTFT p50 "
                f"{_s(row['ttft_s']['p50'])} p99 {_s(row['ttft_s']['p99'])}, SLO {100 * row['slo_attainment']:.0f}%")
            return row
        except Exception as exc:  # keep going: one broken phase must not lose the other numbers
            traceback.print_exc()
            self.report["errors"][name] = f"{type(exc).__name__}: {exc}"
            return None
        finally:
            self.save()

    def trace_for(self, n: int, count: int) -> list[TraceItem]:
        args = self.args
        return make_trace(num_requests=count, rate=args.rate, cv=args.cv,
                          adapters=[a.name for a in self.adapters[:n]], popularity=args.popularity, alpha=args.alpha,
                          prompt_len=args.prompt_len, output_len=args.output_len, vocab=self.shape["vocab_size"],
                          seed=args.seed + n)

    def ours(self, run: str, n: int, trace: list[TraceItem], chunked: bool) -> dict | None:
        row = {"run": run, "num_adapters": n, **self.common, "chunked_prefill": chunked}
        return self.phase("ours", row, lambda: run_ours(
            (self.config, self.params, self.tokenizer), self.adapters[:n], trace, self.args, self.device, self.dtype,
            chunked=chunked, deadline=min(self.deadline, time.perf_counter() + self.args.point_max_s)))

    def baselines_at(self, n: int, baselines: list[str], chunked: bool) -> None:
        """Ours on a shorter trace, then each HF + PEFT baseline on it, tokens compared."""
        args = self.args
        trace = self.trace_for(n, min(args.requests, args.baseline_requests))
        mine = self.ours("ours_subset", n, trace, chunked)
        peft_model = attach_peft(self.model, weight_sets_for(self.weight_sets, n))
        try:
            for b in baselines:
                row = self.phase(b, {"run": b, "num_adapters": n, **self.common}, lambda: replay_hf(
                    peft_model, trace, mode=b.removeprefix("peft_"), batch=args.baseline_batch, device=self.device,
                    deadline=min(self.deadline, time.perf_counter() + args.baseline_max_s), slo_ttft=args.slo_ttft))
                if row is not None and mine is not None:
                    served = [it.request.request_id for it in trace
                              if len(row["tokens"][it.request.request_id]) == it.request.sampling.max_new_tokens]
                    row["agreement"] = same_tokens(mine["tokens"], row["tokens"], served)
                    self.save()
        finally:
            self.model = detach_peft(peft_model)
            gc.collect()


def main(argv=None) -> dict:
    args = parse_args(argv)
    bench = ServingBench(args)
    chunked = args.chunked_prefill == "on"
    for n in args.num_adapters:
        bench.ours("ours", n, bench.trace_for(n, args.requests), chunked)
    baselines = [b for b in args.baselines.split(",") if b]
    at = args.num_adapters if args.baseline_at is None else args.baseline_at
    for n in [n for n in at if n <= args.baseline_max_adapters] if baselines else []:
        bench.baselines_at(n, baselines, chunked)
    for n in args.unchunked:
        bench.ours("ours", n, bench.trace_for(n, args.requests), False)
    report = bench.report
    print("\n" + table(report))
    if report["skipped"]:
        print("skipped (deadline):", ", ".join(report["skipped"]))
    if report["errors"]:
        print("errors:", report["errors"])
    return report


def weight_sets_for(weight_sets, n: int):
    """The first ``n`` adapters as (name, rank, alpha, factors) for PEFT (adapter i on weight set
    i % sets, as ``host_adapters`` lays them out)."""
    return [(f"adapter{i}", *weight_sets[i % len(weight_sets)][1:]) for i in range(n)]


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def table(report: dict) -> str:
    head = (f"{'run':<12} {'N':>5} {'chunk':>5} {'done':>9} {'tok/s':>7} {'req/s':>6} {'TTFT p50/p90/p99 s':>19} "
            f"{'TPOT p50/p90/p99 ms':>20} {'SLO':>5} {'page-ins':>8} {'evict':>6} {'KV pk':>6} {'steps':>6}")
    lines = [head]
    for r in report["points"] + report["baselines"]:
        t, p = r["ttft_s"], r["tpot_s"]
        pool = r.get("pool", {})
        lines.append(
            f"{r['run']:<12} {r['num_adapters']:>5} "
            f"{('-' if 'chunked_prefill' not in r else 'on' if r['chunked_prefill'] else 'off'):>5} "
            f"{r['complete']:>4}/{r['requests']:<4} {r['tokens_per_s']:>7.0f} {r['requests_per_s']:>6.2f} "
            f"{_s(t['p50']) + '/' + _s(t['p90']) + '/' + _s(t['p99']):>19} "
            f"{_ms(p['p50']) + '/' + _ms(p['p90']) + '/' + _ms(p['p99']):>20} {100 * r['slo_attainment']:>4.0f}% "
            f"{r.get('adapter_page_ins', '-'):>8} {r.get('adapter_evictions', '-'):>6} "
            f"{pool.get('kv_pages_peak', '-'):>6} {r.get('steps', r.get('batches', '-')):>6}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
