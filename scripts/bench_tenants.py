"""Many tenants against the physical floor: a trace over ~100 adapters of mixed ranks, each run's
throughput beside the least time its own steps could take on this device.

The trace: ``--requests`` requests (default 384) with lognormal prompt and output lengths
(``--prompt-median``/``--prompt-sigma``, ``--output-median``/``--output-sigma``, capped at
``--prompt-max``/``--output-max``; random tokens, greedy, EOS ignored so each request generates
exactly its output length), each naming one of ``--adapters`` adapters (default 128) of ranks
``--ranks`` (cycled; default 4,8,16,32,64, all seven projections) drawn with Zipf popularity
1 / (i + 1)^``--zipf``. Two arrival modes (``--arrivals``): ``burst`` (all at once) and
``poisson`` (``--rate`` requests/s). Beside each, the same requests on the base model alone
(``--runs lora,base``). Random weights of a real shape (``--shape 8b`` on a GPU, ``tiny`` on the
CPU); ``--distinct-weights`` weight sets per rank shared by host buffer, each adapter still paged
into the GPU pool on its own (scripts/bench_serving.py's ``host_adapters``).

``--slora`` adds the S-LoRA setting: ``--slora-requests`` (64) requests of ``--slora-prompt``
(256) tokens generating ``--slora-new`` (64) tokens, all at once, over ``--slora-adapters`` (64)
distinct adapters of rank ``--slora-rank`` (16) on all seven projections; then every request on
one adapter; then the base alone (``--slora-repeat N``: the three N times in turn).

One engine serves every run (prefix caching off: the runs repeat prompts), after its warm-up
(``Engine.warm_up``, as ``serve`` runs it; timed, not part of any run). Each run replays its trace
through the engine's background loop (scripts/bench_serving.py's ``replay_engine``) with the step
ledger on (``Engine.enable_step_ledger``), and reports generated tok/s, wall (first arrival to
last token), TTFT p50/p99 and the floor (``serving/floor.py``): the sum over its steps of
max(FLOPs / peak, bytes / bandwidth), peak the GPU's dense bf16 data-sheet figure
(``harness.dense_bf16_tflops``; on a CPU or an unknown GPU a measured matmul; ``--peak-tflops``
overrides) and bandwidth a large device-to-device copy measured here (``--bandwidth-gbs``
overrides). ``fraction`` = floor / wall; ``busy fraction`` = floor / the engine's time inside
steps (a Poisson run waits for arrivals, which no engine can shorten).

``--deadline S``: no phase starts past S seconds from the start and a run under way is cut there
(reported as far as it got); the JSON (``--out``) is rewritten after every phase and the table
printed with what ran.

Where each run's time goes (``serving/step_times.py``): per step kind (decode-only by batch
bucket, mixed by token bucket; base / LoRA / DoRA rows; captured graph, padded pieces or eager)
its steps, wall s (host, step start to end), GPU s (CUDA events around the step's device work),
floor s and floor / GPU, with each step's host phases (schedule, launch, wait for the device,
emit) in ms per step; then the host time between steps and the device's idle time between them.
In the JSON as each run's ``breakdown``. On CUDA, ``--profile-steps N`` also profiles the first N
steps of the runs named in ``--profile-runs`` (``scripts/profile_steps.py``: each step's device
span split into kernel-busy and idle time, and its costliest kernels, by step kind; the run's
``profile`` in the JSON): a span much longer than its kernels means the device waited for the host.
The profiler slows the steps it records: ``--profile-again on`` runs each of those runs plain for
its numbers, then once more profiled (named "<run>-profiled") for its kernels. A profiled run also
gets its ``ceiling`` (``profile_steps.ceiling``): the share of its floor it could reach with its
frozen products running as profiled and every other part at its own floor.

    PYTHONPATH=. python3 scripts/bench_tenants.py --shape 8b --slora --deadline 370 --out $OUT
    PYTHONPATH=. python3 scripts/bench_tenants.py --shape tiny --device cpu --dtype float32 --requests 12 \\
        --adapters 6 --ranks 4,8 --prompt-median 12 --prompt-max 40 --output-median 4 --output-max 8 \\
        --rate 50 --slora --slora-requests 4 --slora-prompt 16 --slora-new 4 --slora-adapters 4 --slora-rank 4
"""

from __future__ import annotations

import argparse
import ast
import gc
import math
import os
import random
import time

from harness import (add_device_args, add_output_args, comma_list, dense_bf16_tflops, device_info, dtype_of, logger,
                     percentile, timer, write_json)

import torch  # noqa: E402
from bench_generation import SHAPES, build_model, random_adapters  # noqa: E402
from bench_serving import TraceItem, adapter_weights, host_adapters, replay_engine  # noqa: E402

from lightning_lorafusion.kernels import lora_gather, lora_segments, paged_attention  # noqa: E402
from lightning_lorafusion.model.hf_loading import params_from_hf_model  # noqa: E402
from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from lightning_lorafusion.serving.adapters import HostAdapter  # noqa: E402
from lightning_lorafusion.serving.config import EngineTuning  # noqa: E402
from lightning_lorafusion.serving.decode_graphs import graph_token_limit  # noqa: E402
from lightning_lorafusion.serving.floor import FloorShape, breakdown, run_floor  # noqa: E402
from lightning_lorafusion.serving.page_in_layers import page_in_groups  # noqa: E402
from lightning_lorafusion.serving import paged_forward  # noqa: E402
from lightning_lorafusion.serving.step_times import breakdown_table  # noqa: E402
from profile_steps import (StepProfile, category_table, ceiling, ceiling_table, lora_kernel_table,  # noqa: E402
                           lora_traffic, part_table, table as profile_table)

log = logger("bench_tenants")

OLD_PROGRAMS_PER_SM = 2  # --old attention-splits: the decode attention's sequence splits as they were
# --old grouped-shrink: the decode LoRA's grouped shrink and per-row expand knobs as they were (lora_gather)
OLD_GROUPED_KNOBS = {"GROUPED_MIN_ROWS": 256, "GROUPED_RANK_SPLIT": 1, "GROUPED_SHRINK_BLOCK_R": None,
                     "GROUPED_SHRINK_STAGES": None, "GROUPED_SHRINK_WARPS": None, "GROUPED_SHRINK_BLOCK_K": None,
                     "GROUPED_SHRINK_SPLIT_K": None, "GROUPED_SHRINK_UNROLL_K": False, "ROW_EXPAND_WARPS": 4,
                     "ROW_EXPAND_BLOCK_N": 256}
# ``--old decode-hybrid``: the decode rows' LoRA before the hybrid expands and the grouped shrink
# below 256 rows (per-row kernels up to 255 rows, the expands per row at every row count)
OLD_HYBRID_KNOBS = {"HYBRID_MIN_ROWS": None, "GROUPED_MIN_ROWS": 256}


# ---------------------------------------------------------------------------------------------
# the trace


def lognormal_lengths(rng: random.Random, count: int, median: float, sigma: float, lo: int, hi: int) -> list[int]:
    """``count`` lengths, lognormal of that median and log-space sigma, rounded and clipped to lo..hi."""
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(count)]


def make_trace(*, num_requests: int, adapters: list[str | None], zipf: float, prompt: tuple[float, float, int],
               output: tuple[float, float, int], arrivals: str, rate: float, vocab: int,
               seed: int) -> list[TraceItem]:
    """Requests with lognormal lengths (``prompt`` / ``output``: median, sigma, cap), adapters by
    Zipf popularity (``[None]``: the base), arriving at once (``burst``) or as a Poisson process
    (the same requests either way)."""
    rng = random.Random(seed)
    prompts = lognormal_lengths(rng, num_requests, prompt[0], prompt[1], 1, prompt[2])
    outputs = lognormal_lengths(rng, num_requests, output[0], output[1], 1, output[2])
    weights = adapter_weights(len(adapters), "zipf", zipf)
    names = rng.choices(adapters, weights, k=num_requests)
    clock = random.Random(seed + 7919)  # its own draws: both arrival modes get the same requests
    t, items = 0.0, []
    for i, (p, o, name) in enumerate(zip(prompts, outputs, names)):
        sp = SamplingParams(max_new_tokens=o, temperature=0.0, ignore_eos=True)
        items.append(TraceItem(t, GenerationRequest(prompt_token_ids=[rng.randrange(4, vocab) for _ in range(p)],
                                                    adapter=name, sampling=sp, request_id=f"r{i}")))
        if arrivals == "poisson":
            t += clock.expovariate(rate)
    return items


def relabel(trace: list[TraceItem], prefix: str, adapter: str | None | bool = False) -> list[TraceItem]:
    """The same requests with ids ``prefix``-ed and, unless ``adapter`` is False, that adapter
    (None: the base) for every request."""
    out = []
    for it in trace:
        r = it.request
        out.append(TraceItem(it.arrival_s, GenerationRequest(
            prompt_token_ids=r.prompt_token_ids, sampling=r.sampling, request_id=prefix + r.request_id,
            adapter=r.adapter if adapter is False else adapter)))
    return out


# ---------------------------------------------------------------------------------------------
# the device's limits


def copy_bandwidth(device: torch.device, mib: int) -> float:
    """Bytes/s of a ``mib`` MiB device-to-device copy (read + write), best of 5."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(5):
        with timer(device) as t:
            dst.copy_(src)
        best = min(best, t.seconds)
    return 2 * src.numel() / best


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an n x n x n matmul, best of 5 (the peak where no data-sheet figure is known)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    best = math.inf
    for _ in range(5):
        with timer(device) as t:
            a @ b
        best = min(best, t.seconds)
    return 2 * n ** 3 / best


def device_limits(args, device: torch.device, dtype: torch.dtype) -> dict:
    """Peak FLOP/s and bandwidth the floors use, and where each came from."""
    cuda = device.type == "cuda"
    if args.peak_tflops is not None:
        peak, source = args.peak_tflops * 1e12, "given"
    elif cuda and dense_bf16_tflops(torch.cuda.get_device_name(device)) is not None:
        peak, source = dense_bf16_tflops(torch.cuda.get_device_name(device)) * 1e12, "data sheet (dense bf16)"
    else:
        peak, source = matmul_flops(device, dtype, 8192 if cuda else 512), "measured matmul"
    if args.bandwidth_gbs is not None:
        bw, bw_source = args.bandwidth_gbs * 1e9, "given"
    else:
        bw, bw_source = copy_bandwidth(device, 2048 if cuda else 64), "measured copy"
    return {"peak_flops": peak, "peak_source": source, "bandwidth": bw, "bandwidth_source": bw_source}


# ---------------------------------------------------------------------------------------------
# the runs


def renamed(adapters: list[HostAdapter], names: list[str]) -> list[HostAdapter]:
    """Adapters named ``names``, adapter i over the host buffer of ``adapters[i % len]`` (each is
    still its own adapter to the engine: paged in and evicted on its own)."""
    out = []
    for i, name in enumerate(names):
        a = adapters[i % len(adapters)]
        out.append(HostAdapter(name=name, rank=a.rank, alpha=a.alpha, target_modules=a.target_modules,
                               slots=a.slots, flat=a.flat, num_layers=a.relative_offsets.shape[0]))
    return out


def run_trace(bench: "TenantsBench", trace: list[TraceItem], deadline: float, name: str = "",
              profiled: bool | None = None) -> dict:
    """Replay ``trace`` with the step ledger on -> throughput, TTFT and the floor of its steps;
    with ``--profile-steps`` and ``profiled`` (default: ``name`` in ``--profile-runs``), the
    kernels of its first steps by step kind (``profile_steps.StepProfile``) too."""
    engine = bench.engine
    before = engine.stats()
    ledger = engine.enable_step_ledger()
    args = bench.args
    profile = None
    if profiled is None:
        profiled = name in args.profile_runs
    if args.profile_steps > 0 and profiled and bench.device.type == "cuda":
        tag = name.replace(" ", "_")
        os.makedirs(args.out, exist_ok=True)
        profile = StepProfile(engine, args.profile_steps, f"/tmp/profile_{tag}.json",
                              os.path.join(args.out, f"profile_{tag}_steps.json.gz"))
    try:
        if profile is None:
            out = replay_engine(engine, trace, deadline=deadline, slo_ttft=args.slo_ttft)
        else:
            with profile:
                out = replay_engine(engine, trace, deadline=deadline, slo_ttft=args.slo_ttft)
            out["profile"] = profile.rows
            runner = engine.runner
            out["lora_traffic"] = lora_traffic(
                profile.kinds, profile.records, profile.ledger, bench.shape, max_rows=runner.decode_inputs.max_rows,
                grouped_min_rows=lora_gather.GROUPED_MIN_ROWS, group_rows=lora_gather.GROUP_ROWS,
                block_m=runner.segment_block_m)
    finally:
        engine.disable_step_ledger()
    after = engine.stats()
    busy = after["step_seconds_total"] - before["step_seconds_total"]
    paging = {k: after[f"adapter_{k}_total"] - before[f"adapter_{k}_total"]
              for k in ("page_ins", "prefetches", "prefetch_hits", "prefetch_misses", "prefetch_wasted")}
    limits = {"peak_flops": bench.limits["peak_flops"], "bandwidth": bench.limits["bandwidth"]}
    floor = run_floor(ledger, bench.shape, **limits)
    wall = out["wall_s"]
    out.pop("tokens", None)
    out.update(floor=floor, floor_s=floor["floor_s"], busy_s=busy, ledger=ledger.summary(),
               breakdown=breakdown(ledger, bench.shape, **limits),
               fraction_of_floor=floor["floor_s"] / wall if wall > 0 else None,
               busy_fraction_of_floor=floor["floor_s"] / busy if busy > 0 else None,
               trace_adapters=len({it.request.adapter for it in trace} - {None}), paging=paging,
               prompt_tokens=sum(len(it.request.prompt_token_ids) for it in trace))
    return out


class TenantsBench:
    """The model, its adapters, one engine, the device's limits and the report."""

    def __init__(self, args):
        self.args, self.start = args, time.perf_counter()
        self.deadline = self.start + args.deadline
        self.device, self.dtype = torch.device(args.device), dtype_of(args.dtype)
        self.report: dict = {**device_info(self.device), "args": vars(args), "runs": [], "skipped": [],
                             "errors": {}}
        shape = SHAPES[args.shape]
        self.vocab = shape["vocab_size"]
        model, tokenizer = build_model(shape, self.device, self.dtype, seed=0)
        config, params = params_from_hf_model(model)
        self.shape = FloorShape.from_config(config)
        ranks = sorted(set(args.ranks) | ({args.slora_rank} if args.slora else set()))
        sets = random_adapters(config, args.distinct_weights * len(ranks), ranks, self.device, self.dtype, seed=1,
                               b_std=0.02)
        pin = self.device.type == "cuda"
        bases = host_adapters(config, sets, len(sets), self.dtype, pin=pin)
        by_rank = {r: [a for a in bases if a.rank == r] for r in ranks}
        mixed = [by_rank[args.ranks[i % len(args.ranks)]][(i // len(args.ranks)) % args.distinct_weights]
                 for i in range(args.adapters)]
        self.tenants = renamed(mixed, [f"t{i}" for i in range(args.adapters)])
        self.slora = renamed(by_rank[args.slora_rank], [f"s{i}" for i in range(args.slora_adapters)]) \
            if args.slora else []
        del sets, model  # the device copies of the factors (the host buffers stay); params keep the weights
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # before the engine sizes its pool from the free memory
        self.engine = Engine(config, params, tokenizer, EngineConfig(
            max_num_seqs=args.max_num_seqs, gpu_memory_fraction=args.memory_fraction, prefix_caching=False,
            enable_chunked_prefill=args.chunked_prefill == "on", cpu_pool_mib=args.cpu_pool_mib,
            tuning=EngineTuning(decode_gemm=args.decode_gemm, decode_lora_beside=args.decode_lora_beside,
                                mixed_graph_max_tokens=(
                                    "all" if "old" in args.variants and "padded-large" in args.old else "auto")),
            **({} if args.max_batched_tokens is None else {"max_num_batched_tokens": args.max_batched_tokens})),
            device=self.device, dtype=self.dtype)
        for a in self.tenants + self.slora:
            self.engine.add_host_adapter(a)
        self.limits = self.report["limits"] = device_limits(args, self.device, self.dtype)
        self.report["setup_s"] = time.perf_counter() - self.start
        log(f"model {args.shape}, {len(self.tenants)} + {len(self.slora)} adapters, limits "
            f"{self.limits['peak_flops'] / 1e12:.3g} TFLOP/s ({self.limits['peak_source']}), "
            f"{self.limits['bandwidth'] / 1e9:.0f} GB/s ({self.limits['bandwidth_source']}); "
            f"{self.report['setup_s']:.1f} s")

    def save(self) -> None:
        write_json(self.args.out, f"bench_tenants_{self.args.shape}.json", self.report)

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def warm_up(self) -> None:
        if self.args.warm_up == "off" or self.left() <= 0:
            return
        with timer(self.device) as t:
            info = self.engine.warm_up()
        self.report["warm_up"] = {"seconds": t.seconds, "captures": info.get("captures"),
                                  "ranks": info.get("ranks"), "mixed_pieces_s": info.get("mixed_pieces_s"),
                                  "decode_graphs_s": info.get("decode_graphs_s")}
        log(f"warm-up {t.seconds:.1f} s (decode graphs at build {_f(info.get('decode_graphs_s'), '.1f')} s)")
        if "old" in self.args.variants and "rank-variant" in self.args.old:
            self.recapture_rank_variants()
        self.save()

    def recapture_rank_variants(self) -> None:
        """``--old rank-variant``: the decode graphs captured again without the rank variant
        (``lora_gather.UNSPLIT_MAX_RANK`` None: the keys of before), then with it, timed (the
        kernels compiled already: what the variant's extra captures cost), into the report's
        ``decode_recapture``."""
        runner, default = self.engine.runner, lora_gather.UNSPLIT_MAX_RANK
        if runner.graphs is None:
            return
        out = self.report["decode_recapture"] = []
        try:
            for bound in (None, default):
                lora_gather.UNSPLIT_MAX_RANK = bound
                with self.engine._step_lock, timer(self.device) as t:
                    runner.capture_decode_graphs()
                out.append({"unsplit_max_rank": bound, "seconds": t.seconds, "captures": runner.capture_counts()})
                log(f"decode graphs captured again with UNSPLIT_MAX_RANK={bound}: {t.seconds:.2f} s, "
                    f"{runner.capture_counts()}")
        finally:
            lora_gather.UNSPLIT_MAX_RANK = default

    def set_variant(self, variant: str) -> None:
        """``--variants``: "new" runs the engine's defaults, "old" the paths named in ``--old`` as
        they were, on the same engine: "host" (``EngineTuning.prefetch_ahead="off"``,
        ``host_tables="separate"``), "prefill-lora" (``prefill_lora_write="off"``: the LoRA
        read-added after the product; that mode's mixed-step pieces are built before the run, not
        timed), "page-in" (``page_in_wait="step"``: one copy, waited for before the step),
        "base-pieces" (steps none of whose rows has an adapter run the LoRA pieces, their LoRA
        kernels on empty tables), "table-grids" (the prefill LoRA's grids over the whole padded
        table): ``ModelRunner.set_mixed_lora``, and "prefill-form" (the prefill LoRA's "segments"
        kernels instead of the default form, ``ModelRunner.prefill_lora_form``) and "small-steps"
        (``lora_segments.SMALL_STEP_ROWS`` None: small steps' prefill LoRA split as large ones') and
        "prefill-expand" (``lora_segments.SPLITK_EXPAND`` "tile": the prefill rows' expand re-reading
        S per column block instead of the held expand; the new variant's: ``--splitk-expand``) and
        "prefill-swiglu" (``paged_forward.PREFILL_SWIGLU`` off: gate/up's prefill LoRA written into
        their outputs; the new variant's: ``--prefill-swiglu``), the pieces rebuilt before the run
        (time and CUDA graphs in the report's "pieces_builds"); and
        "decode-gemm" (the frozen products of few rows by cuBLAS, ``ModelRunner.decode_gemm``:
        the decode graphs captured again, the pieces rebuilt) and "token-buckets" (mixed steps
        padded to powers of two only, ``ModelRunner.token_bucket_mode``: the pieces rebuilt) and
        "attention-splits" (the decode attention's sequence splits aiming at 2 programs per SM,
        ``paged_attention.DECODE_PROGRAMS_PER_SM``: the decode graphs captured again),
        "lora-beside" (``ModelRunner.decode_lora_beside`` "few": the decode rows' LoRA shrinks beside
        the frozen GEMMs only in decode steps of at most 64 rows; the decode graphs captured again,
        the pieces rebuilt), "in-place"
        (attention's outputs concatenated and copied, ``ModelRunner.attention_in_place`` off: no
        capture) and "padded-large" (every mixed step padded and run as pieces,
        ``ModelRunner.mixed_graph_max_tokens`` None: the larger buckets' pieces built) and
        "quarter-buckets" (the "fine" token buckets, ``ModelRunner.token_bucket_mode``; pieces
        built for either set are kept, so switching back captures nothing)."""
        engine, old = self.engine, set(self.args.old) if variant == "old" else set()
        knobs_changed = self.set_decode_lora(old)
        engine.scheduler.prefetch_ahead = "host" not in old
        engine.mixed_ahead = "mixed-ahead" not in old  # (EngineTuning.mixed_ahead; no capture)
        engine.runner.host_tables = "separate" if "host" in old else "packed"
        engine.pool.page_in_groups = page_in_groups(engine.model_config.num_layers,
                                                    "step" if "page-in" in old else "layer")
        write = "off" if "prefill-lora" in old else engine.config.tuning.prefill_lora_write
        runner = engine.runner
        lora = {"base_pieces": "base-pieces" not in old, "live_grids": "table-grids" not in old}
        form = "segments" if "prefill-form" in old else None
        gemm = "cublas" if "decode-gemm" in old else engine.config.tuning.decode_gemm
        buckets = ("pow2" if "token-buckets" in old else "fine" if "quarter-buckets" in old
                   else engine.config.tuning.token_buckets)
        gemm_changed = runner.decode_gemm != gemm
        beside = "few" if "lora-beside" in old else engine.config.tuning.decode_lora_beside
        beside_changed = runner.decode_lora_beside != beside
        runner.decode_lora_beside = beside  # (pieces dropped when it changes: rebuilt below; graphs captured again)
        if not hasattr(self, "graph_max_tokens"):  # --old padded-large: every bucket padded, as pieces
            self.graph_max_tokens = graph_token_limit("auto", self.shape.projection_params)
        graph_max = None if "padded-large" in old else self.graph_max_tokens
        pieces_changed = (gemm_changed or beside_changed or knobs_changed or runner.token_bucket_mode != buckets
                          or runner.mixed_graph_max_tokens != graph_max)
        if knobs_changed:  # (the pieces captured the decode rows' LoRA kernels with the knobs of before)
            runner.clear_mixed_pieces()
        runner.token_bucket_mode = buckets  # (pieces dropped when the buckets change: rebuilt below)
        runner.mixed_graph_max_tokens = graph_max
        runner.attention_in_place = "in-place" not in old  # (attention runs outside the graphs: no capture)
        if not hasattr(self, "programs_per_sm"):
            self.programs_per_sm = paged_attention.DECODE_PROGRAMS_PER_SM
        per_sm = OLD_PROGRAMS_PER_SM if "attention-splits" in old else self.programs_per_sm
        splits_changed = paged_attention.DECODE_PROGRAMS_PER_SM != per_sm
        paged_attention.DECODE_PROGRAMS_PER_SM = per_sm  # (the decode graphs keep theirs: captured again)
        if not hasattr(self, "split_mode"):  # --old attention-items: per-row splits
            self.split_mode = paged_attention.DECODE_SPLITS
        mode = "per-row" if "attention-items" in old else self.split_mode
        splits_changed |= paged_attention.DECODE_SPLITS != mode
        paged_attention.DECODE_SPLITS = mode
        if gemm_changed or splits_changed or beside_changed:
            with engine._step_lock:
                runner.decode_gemm = gemm
                if runner.graphs is not None:
                    with timer(self.device) as t:
                        runner.capture_decode_graphs()
                    log(f"decode graphs captured again with decode_gemm={gemm}, {per_sm} attention programs "
                        f"per SM, decode LoRA beside {beside} in {t.seconds:.1f} s")
        if not hasattr(self, "small_step_rows"):
            self.small_step_rows = lora_segments.SMALL_STEP_ROWS
        small = None if "small-steps" in old else self.small_step_rows
        if not hasattr(self, "splitk_expand"):  # --old prefill-expand: the tile expand re-reading S per block
            self.splitk_expand = self.args.splitk_expand or lora_segments.SPLITK_EXPAND
            self.prefill_swiglu = {"on": True, "off": False}.get(self.args.prefill_swiglu, paged_forward.PREFILL_SWIGLU)
        expand = "tile" if "prefill-expand" in old else self.splitk_expand
        swiglu = False if "prefill-swiglu" in old else self.prefill_swiglu  # --old prefill-swiglu: written
        if (runner.prefill_lora_write != write or (runner.base_pieces, runner.live_grids) != tuple(lora.values())
                or runner.prefill_lora_form != form or pieces_changed or lora_segments.SMALL_STEP_ROWS != small
                or lora_segments.SPLITK_EXPAND != expand or paged_forward.PREFILL_SWIGLU != swiglu):
            with engine._step_lock:
                if (lora_segments.SMALL_STEP_ROWS != small or lora_segments.SPLITK_EXPAND != expand
                        or paged_forward.PREFILL_SWIGLU != swiglu):
                    lora_segments.SMALL_STEP_ROWS = small
                    lora_segments.SPLITK_EXPAND = expand
                    paged_forward.PREFILL_SWIGLU = swiglu
                    runner.clear_mixed_pieces()
                runner.prefill_lora_write = write
                runner.set_mixed_lora(**lora)
                runner.prefill_lora_form = form
                if self.args.warm_up == "on":
                    with timer(self.device) as t:
                        runner.build_mixed_pieces()
                    log(f"mixed-step pieces of prefill_lora_write={write}, {lora}, form {form or 'default'} built in "
                        f"{t.seconds:.1f} s")
                    self.report.setdefault("pieces_builds", []).append(
                        {"variant": variant, "prefill_lora_write": write, **lora, "prefill_lora_form": form,
                         "small_step_rows": small, "splitk_expand": expand, "prefill_swiglu": swiglu,
                         "decode_gemm": gemm, "token_buckets": buckets, "decode_lora_beside": beside,
                         "mixed_graph_max_tokens": graph_max,
                         "seconds": t.seconds,
                         "captures": runner.capture_counts()})

    def set_decode_lora(self, old: set[str]) -> bool:
        """``--old decode-lora``: the decode LoRA's blocks as before the few-rows ones
        (``lora_gather.FEW_ROWS``, ``AHEAD_MAX_ROWS`` and ``RANK_SPLIT_MAX_ROWS`` None,
        ``PAIR_EPILOGUES`` False); ``--old pdl``: without programmatic dependent launch
        (``lora_gather.PDL`` False); ``--old rank-variant``: every decode step in the split
        variant (``UNSPLIT_MAX_RANK`` None; its graphs were captured at warm-up, so nothing is
        captured again for it alone); ``--old beside``: every decode step's LoRA shrinks in stream
        order after the frozen GEMMs (``BESIDE_MAX_ROWS`` None); ``--old grouped-shrink``: the grouped
        shrink's and the per-row expands' knobs as they were (``OLD_GROUPED_KNOBS``; the new variant
        runs the module's, with ``--decode-lora-knobs`` over them). The decode graphs are captured
        again when the others change (not timed; the mixed-step pieces keep what they captured at
        warm-up, except after the grouped knobs change: -> True, the caller rebuilds them);
        ``--old decode-hybrid``: the expands per row at every row count and the grouped shrink from
        256 rows only (``OLD_HYBRID_KNOBS``: no hybrid expands, ``HYBRID_MIN_ROWS`` None)."""
        if not hasattr(self, "decode_knobs"):
            names = ("FEW_ROWS", "AHEAD_MAX_ROWS", "PAIR_EPILOGUES", "RANK_SPLIT_MAX_ROWS", "PDL", "UNSPLIT_MAX_RANK",
                     "BESIDE_MAX_ROWS", "HYBRID_FUSED", "HYBRID_MIN_GROUP")
            names += tuple(OLD_GROUPED_KNOBS) + tuple(OLD_HYBRID_KNOBS)
            names = tuple(dict.fromkeys(names))
            self.decode_knobs = {n: getattr(lora_gather, n) for n in names}
        want = dict(self.decode_knobs)
        if "decode-lora" in old:
            want.update(FEW_ROWS=None, AHEAD_MAX_ROWS=None, PAIR_EPILOGUES=False, RANK_SPLIT_MAX_ROWS=None)
        if "pdl" in old:
            want.update(PDL=False)
        if "rank-variant" in old:
            want.update(UNSPLIT_MAX_RANK=None)
        if "beside" in old:
            want.update(BESIDE_MAX_ROWS=None)
        if "grouped-shrink" in old:
            want.update(OLD_GROUPED_KNOBS)
        if "decode-hybrid" in old:
            want.update(OLD_HYBRID_KNOBS)
        changed = {n for n, v in want.items() if getattr(lora_gather, n) != v}
        for n in changed:
            setattr(lora_gather, n, want[n])
        if changed - {"UNSPLIT_MAX_RANK"} and self.engine.runner.graphs is not None:
            with self.engine._step_lock, timer(self.device) as t:
                self.engine.runner.capture_decode_graphs()
            log(f"decode graphs captured again ({sorted(old) or 'new'} decode LoRA) in {t.seconds:.1f} s")
        if changed:
            self.report.setdefault("decode_knobs", []).append(
                {"old": sorted(old), **{n: getattr(lora_gather, n) for n in self.decode_knobs}})
        return bool(changed & (set(OLD_GROUPED_KNOBS) | set(OLD_HYBRID_KNOBS) | {"HYBRID_FUSED", "HYBRID_MIN_GROUP"}))

    def page_out(self) -> None:
        """``--page-out on``: evict every idle adapter, so each run pages its adapters in as the
        first one did (the same page-ins for every variant)."""
        pool = self.engine.pool
        with self.engine._step_lock:
            for r in pool.resident_adapters():
                if r.users == 0:
                    pool.evict(r.adapter)

    def phase(self, run: str, arrivals: str, trace: list[TraceItem]) -> None:
        """One run unless the deadline passed; a failure is recorded and the others go on. With
        ``--profile-again on``, a run named in ``--profile-runs`` runs plain (its numbers) and
        then once more under the profiler as "<run>-profiled" (its kernels)."""
        name = f"{run} {arrivals}"
        if self.args.profile_again == "on" and self.args.profile_steps > 0 and name in self.args.profile_runs:
            self._phase(run, arrivals, trace, name, profiled=False)
            self._phase(f"{run}-profiled", arrivals, relabel(trace, "p-"), name, profiled=True)
        else:
            self._phase(run, arrivals, trace, name)

    def _phase(self, run: str, arrivals: str, trace: list[TraceItem], name: str,
               profiled: bool | None = None) -> None:
        if self.args.page_out == "on":
            self.page_out()
        if self.left() < 10:
            self.report["skipped"].append(f"{run} {arrivals}")
            log(f"skipped (deadline): {run} {arrivals}")
            return
        try:
            row = {"run": run, "arrivals": arrivals, **run_trace(
                self, trace, min(self.deadline, time.perf_counter() + self.args.phase_max_s), name, profiled)}
            if row.get("profile"):  # products as they run, every other part at its floor
                row["ceiling"] = ceiling(row["profile"], row["breakdown"]["kinds"])
            self.report["runs"].append(row)
            log(row_line(row) + "\n" + breakdown_table(row["breakdown"]))
        except Exception as exc:  # noqa: BLE001 - keep the other runs' numbers
            import traceback

            traceback.print_exc()
            self.report["errors"][f"{run} {arrivals}"] = f"{type(exc).__name__}: {exc}"
        finally:
            self.save()

    def main_traces(self) -> dict[str, list[TraceItem]]:
        args = self.args
        names = [a.name for a in self.tenants]
        return {mode: make_trace(num_requests=args.requests, adapters=names, zipf=args.zipf, arrivals=mode,
                                 prompt=(args.prompt_median, args.prompt_sigma, args.prompt_max),
                                 output=(args.output_median, args.output_sigma, args.output_max),
                                 rate=args.rate, vocab=self.vocab, seed=args.seed)
                for mode in args.arrivals}

    def slora_trace(self) -> list[TraceItem]:
        """The S-LoRA setting: fixed lengths, all at once, request i on adapter s(i % N)."""
        args = self.args
        rng = random.Random(args.seed + 1)
        sp = SamplingParams(max_new_tokens=args.slora_new, temperature=0.0, ignore_eos=True)
        return [TraceItem(0.0, GenerationRequest(
            prompt_token_ids=[rng.randrange(4, self.vocab) for _ in range(args.slora_prompt)], sampling=sp,
            adapter=self.slora[i % len(self.slora)].name, request_id=f"r{i}")) for i in range(args.slora_requests)]


def run_all(bench: TenantsBench) -> None:
    """Every phase in order of what matters most when the deadline cuts: the burst pair, S-LoRA,
    then the Poisson pair."""
    args = bench.args
    traces = bench.main_traces()
    order = ["burst", "poisson"]
    if args.prime == "on":  # the first run's one-time host costs land here, on no variant
        mode = sorted(traces, key=order.index)[0]
        bench.set_variant(args.variants[0])
        bench.phase("prime", mode, relabel(traces[mode], "prime-"))
        bench.report["primed"] = [r for r in bench.report["runs"] if r["run"] == "prime"]
        bench.report["runs"] = [r for r in bench.report["runs"] if r["run"] != "prime"]
    for mode in sorted(traces, key=order.index):
        for run in args.runs:
            trace = traces[mode] if run == "lora" else relabel(traces[mode], "", None)
            for variant in args.variants:  # side by side: the host paths now and as they were
                bench.set_variant(variant)
                label = run if len(args.variants) == 1 else f"{run}-{variant}"
                bench.phase(label, mode, relabel(trace, f"{label}-{mode}-"))
        if mode == "burst" and args.slora:
            slora = bench.slora_trace()
            for i in range(args.slora_repeat):  # repeats: "-2", "-3", ... (adapters resident unless --page-out)
                for variant in args.variants:
                    bench.set_variant(variant)
                    tag = ("" if len(args.variants) == 1 else f"-{variant}") + ("" if i == 0 else f"-{i + 1}")
                    bench.phase(f"slora_distinct{tag}", "burst", relabel(slora, f"sd{tag}-"))
                    bench.phase(f"slora_one{tag}", "burst", relabel(slora, f"s1{tag}-", bench.slora[0].name))
                    bench.phase(f"slora_base{tag}", "burst", relabel(slora, f"sb{tag}-", None))


# ---------------------------------------------------------------------------------------------
# output


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def row_line(r: dict) -> str:
    return (f"{r['run']} {r['arrivals']}: {r['complete']}/{r['requests']} requests, {r['tokens_per_s']:.0f} tok/s, "
            f"wall {r['wall_s']:.2f} s, floor {r['floor_s']:.2f} s ({_f(r['fraction_of_floor'], '.0%')} of it; "
            f"busy {_f(r['busy_fraction_of_floor'], '.0%')}), TTFT p50 {_f(r['ttft_s']['p50'], '.2f')} "
            f"p99 {_f(r['ttft_s']['p99'], '.2f')} s")


def table(report: dict) -> str:
    head = (f"{'run':<24} {'arrivals':<8} {'done':>9} {'adapters':>8} {'tok/s':>8} {'wall s':>7} {'floor s':>7} "
            f"{'floor/wall':>10} {'floor/busy':>10} {'TTFT p50/p99 s':>15} {'ad/step':>7} {'page-ins':>8} "
            f"{'prefetch hit/miss':>17}")
    lines = [head]
    for r in report["runs"]:
        t = r["ttft_s"]
        lines.append(f"{r['run']:<24} {r['arrivals']:<8} {r['complete']:>4}/{r['requests']:<4} "
                     f"{r['trace_adapters']:>8} {r['tokens_per_s']:>8.0f} {r['wall_s']:>7.2f} {r['floor_s']:>7.2f} "
                     f"{_f(r['fraction_of_floor'], '.1%'):>10} {_f(r['busy_fraction_of_floor'], '.1%'):>10} "
                     f"{_f(t['p50'], '.2f') + '/' + _f(t['p99'], '.2f'):>15} "
                     f"{r['ledger']['adapters_per_step_mean']:>7.1f} {r['paging']['page_ins']:>8} "
                     f"{str(r['paging']['prefetch_hits']) + '/' + str(r['paging']['prefetch_misses']):>17}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="8b")
    add_device_args(ap)
    ap.add_argument("--requests", type=int, default=384)
    ap.add_argument("--adapters", type=int, default=128)
    ap.add_argument("--ranks", type=comma_list(cast=int), default=[4, 8, 16, 32, 64])
    ap.add_argument("--distinct-weights", type=int, default=2, help="random weight sets per rank")
    ap.add_argument("--zipf", type=float, default=0.8, help="popularity of adapter i: 1 / (i + 1)^zipf")
    ap.add_argument("--prompt-median", type=float, default=256)
    ap.add_argument("--prompt-sigma", type=float, default=0.8)
    ap.add_argument("--prompt-max", type=int, default=2048)
    ap.add_argument("--output-median", type=float, default=128)
    ap.add_argument("--output-sigma", type=float, default=0.8)
    ap.add_argument("--output-max", type=int, default=1024)
    ap.add_argument("--arrivals", type=comma_list(("burst", "poisson")), default=["burst", "poisson"])
    ap.add_argument("--rate", type=float, default=16.0, help="Poisson arrivals, requests/s")
    ap.add_argument("--runs", type=comma_list(("lora", "base")), default=["lora", "base"])
    ap.add_argument("--slora", action="store_true", help="add the S-LoRA setting (distinct / one adapter / base)")
    ap.add_argument("--slora-requests", type=int, default=64)
    ap.add_argument("--slora-prompt", type=int, default=256)
    ap.add_argument("--slora-new", type=int, default=64)
    ap.add_argument("--slora-adapters", type=int, default=64)
    ap.add_argument("--slora-rank", type=int, default=16)
    ap.add_argument("--slora-repeat", type=int, default=1,
                    help="the three S-LoRA runs this many times in turn (repeats named slora_*-2, -3, ...)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=None, help="default: EngineConfig's")
    ap.add_argument("--chunked-prefill", choices=("on", "off"), default="off", help="default: the engine's (off)")
    ap.add_argument("--memory-fraction", type=float, default=0.85)
    ap.add_argument("--decode-gemm", choices=("auto", "cublas", "triton"), default="auto",
                    help="EngineTuning.decode_gemm of the engine (the new variant's; --old decode-gemm: cublas)")
    ap.add_argument("--decode-lora-beside", choices=("wide", "few"), default=EngineTuning().decode_lora_beside,
                    help="EngineTuning.decode_lora_beside of the engine (the new variant's; --old lora-beside: few)")
    ap.add_argument("--cpu-pool-mib", type=int, default=256)
    ap.add_argument("--warm-up", choices=("on", "off"), default="on", help="Engine.warm_up before the runs")
    ap.add_argument("--peak-tflops", type=float, default=None, help="default: data sheet (GPU) or measured")
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="default: measured device copy")
    ap.add_argument("--slo-ttft", type=float, default=6.0)
    ap.add_argument("--phase-max-s", type=float, default=120.0, help="a run is cut after this long")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds from the start: no phase runs past it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="CUDA: profile this many steps of each run in --profile-runs (kernels by step kind)")
    ap.add_argument("--profile-runs", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                    default=["lora burst", "base burst"], help="runs to profile, e.g. 'lora burst,base burst'")
    ap.add_argument("--profile-again", choices=("on", "off"), default="off",
                    help="on: each run in --profile-runs runs plain, then once more profiled as <run>-profiled "
                         "(the profiler slows what it records)")
    ap.add_argument("--variants", type=comma_list(("new", "old")), default=["new"],
                    help="each run with the engine's paths now (new) and as they were (old: those --old names); "
                         "runs named run-variant when both")
    ap.add_argument("--old", type=comma_list(("host", "prefill-lora", "page-in", "base-pieces", "table-grids",
                                              "decode-lora", "pdl", "rank-variant", "prefill-form", "beside",
                                              "small-steps", "decode-gemm", "token-buckets",
                                              "attention-splits", "attention-items", "mixed-ahead", "lora-beside",
                                              "grouped-shrink", "in-place", "padded-large", "quarter-buckets",
                                              "prefill-expand", "prefill-swiglu", "decode-hybrid")),
                    default=["host"],
                    help="what the old variant runs as it was: host (no prefetch ahead, tables one by one), "
                         "prefill-lora (LoRA added after the product), page-in (page-ins waited whole before "
                         "the step), base-pieces (base-only mixed steps through the LoRA pieces), table-grids "
                         "(the prefill LoRA's grids over the whole padded table), decode-lora (the decode "
                         "LoRA's blocks before the few-rows ones), pdl (the decode LoRA without programmatic "
                         "dependent launch), rank-variant (every decode step's LoRA in the rank-split variant, "
                         "whatever its ranks; the decode graphs' capture timed without and with it after "
                         "warm-up), prefill-form (the prefill LoRA's 'segments' kernels instead of the "
                         "default form), beside (the decode steps' LoRA shrinks after the frozen GEMMs, in stream "
                         "order, instead of beside them on a second stream), small-steps (small mixed steps' "
                         "prefill LoRA split as large ones'), decode-gemm (the frozen products of few rows by "
                         "cuBLAS instead of the Triton split-K product), token-buckets (mixed steps padded to "
                         "powers of two only), attention-splits (the decode attention split for 2 programs per "
                         "SM at every row count), attention-items (the decode attention's per-row splits at every "
                         "row count instead of work items from the step's total tokens where "
                         "paged_attention.BALANCED_ROWS takes them), mixed-ahead (steps admitting requests wait for "
                         "the running step's tokens: EngineTuning.mixed_ahead off), lora-beside (the decode rows' LoRA "
                         "shrinks beside the frozen GEMMs only in decode steps of at most 64 rows: "
                         "EngineTuning.decode_lora_beside few; the decode graphs captured again, the pieces "
                         "rebuilt), grouped-shrink (the grouped shrink's and the per-row expands' knobs as they "
                         "were: OLD_GROUPED_KNOBS; the decode graphs captured again, the pieces rebuilt), "
                         "prefill-expand (the prefill rows' expand re-reading S per column block: "
                         "lora_segments.SPLITK_EXPAND tile; the pieces rebuilt), prefill-swiglu (the prefill "
                         "rows' gate/up LoRA written into gate/up's outputs instead of expanded inside SwiGLU: "
                         "paged_forward.PREFILL_SWIGLU off; the pieces rebuilt), in-place (attention's "
                         "launches each write their own output, concatenated and copied into the pieces' "
                         "buffer: EngineTuning.attention_in_place off), padded-large (mixed steps of every size "
                         "padded to token buckets and run as pieces: EngineTuning.mixed_graph_max_tokens 'all'; "
                         "the engine's pool is then sized for them), quarter-buckets (mixed steps padded to "
                         "the 'fine' token buckets, 3 * 2^k between the powers of two, instead of the engine's default), "
                         "decode-hybrid (the decode rows' expands per row at every row count, the grouped shrink "
                         "from 256 rows: OLD_HYBRID_KNOBS; the decode graphs captured again, the pieces rebuilt); "
                         "default %(default)s")
    ap.add_argument("--decode-lora-knobs", type=parse_knobs, default={},
                    help="NAME=VALUE,... lora_gather knobs (Python literals) set before the engine is built: the "
                         "new variant's (e.g. the fastest mode of profile_decode_lora.py --best-knobs)")
    ap.add_argument("--splitk-expand", choices=lora_segments.EXPANDS, default=None,
                    help="the prefill rows' expand after the split-K shrink in the new variant "
                         "(lora_segments.SPLITK_EXPAND; default: the module's)")
    ap.add_argument("--prefill-swiglu", choices=("on", "off"), default=None,
                    help="the prefill rows' gate/up LoRA expanded inside SwiGLU in the new variant "
                         "(paged_forward.PREFILL_SWIGLU; default: the module's)")
    ap.add_argument("--prime", choices=("on", "off"), default="off",
                    help="run the first trace once before the measured runs, not reported among them (the "
                         "first run after warm-up carries one-time host costs: whichever variant runs first)")
    ap.add_argument("--page-out", choices=("on", "off"), default="off",
                    help="evict every idle adapter before each run (each pages its adapters in afresh)")
    add_output_args(ap)
    args = ap.parse_args(argv)
    if args.slora_repeat < 1:
        ap.error(f"--slora-repeat {args.slora_repeat} must be >= 1")
    if args.slora and args.slora_rank <= 0:
        ap.error(f"--slora-rank {args.slora_rank} must be >= 1")
    if min(args.ranks) < 1 or args.adapters < 1 or args.requests < 1:
        ap.error("--ranks, --adapters and --requests must be >= 1")
    return args


def parse_knobs(text: str) -> dict:
    """``--decode-lora-knobs``: "NAME=VALUE,..." -> {NAME: value}, each NAME a ``lora_gather`` knob."""
    knobs = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, value = item.partition("=")
        if not hasattr(lora_gather, name):
            raise argparse.ArgumentTypeError(f"{name} is not a lora_gather knob")
        knobs[name] = ast.literal_eval(value)
    return knobs


def main(argv=None) -> dict:
    args = parse_args(argv)
    before = {n: getattr(lora_gather, n) for n in args.decode_lora_knobs}
    for name, value in args.decode_lora_knobs.items():
        setattr(lora_gather, name, value)
    try:
        return _main(args)
    finally:
        for name, value in before.items():
            setattr(lora_gather, name, value)


def _main(args) -> dict:
    bench = TenantsBench(args)
    bench.report["decode_lora_knobs"] = args.decode_lora_knobs
    try:
        bench.warm_up()
        run_all(bench)
    finally:
        bench.engine.close()
        for name, value in getattr(bench, "decode_knobs", {}).items():  # (--old decode-lora changed them)
            setattr(lora_gather, name, value)
        if hasattr(bench, "small_step_rows"):  # (--old small-steps changed it)
            lora_segments.SMALL_STEP_ROWS = bench.small_step_rows
        if hasattr(bench, "programs_per_sm"):  # (--old attention-splits changed it)
            paged_attention.DECODE_PROGRAMS_PER_SM = bench.programs_per_sm
        if hasattr(bench, "split_mode"):  # (--old attention-items changed it)
            paged_attention.DECODE_SPLITS = bench.split_mode
    report = bench.report
    print("\n" + table(report))
    for r in report["runs"]:
        print(f"\n{r['run']} {r['arrivals']}: time by step kind\n" + breakdown_table(r["breakdown"]))
        if r.get("profile"):
            print(f"\n{r['run']} {r['arrivals']}: kernels of its first {args.profile_steps} steps\n"
                  + profile_table(r["profile"]))
            print(f"\n{r['run']} {r['arrivals']}: device ms per step by kernel category (floor and GPU ms: "
                  f"the same run's steps of that kind)\n" + category_table(r["profile"], r["breakdown"]["kinds"]))
            print(f"\n{r['run']} {r['arrivals']}: device ms per step by part, each against its own floor (floor.part_floors)\n"
                  + part_table(r["profile"], r["breakdown"]["kinds"]))
            if r.get("ceiling"):
                print(f"\n{r['run']} {r['arrivals']}: its ceiling with the frozen products as measured and every "
                      f"other part at its floor (profile_steps.ceiling)\n" + ceiling_table(r["ceiling"]))
    profiled = {r["run"]: r for r in report["runs"] if r.get("profile")}
    for name, r in profiled.items():  # the adapters' kernels: each LoRA run against its base-alone run
        base = profiled.get(name.replace("lora", "base", 1)) if name.startswith("lora") else None
        if base is not None:
            print(f"\n{name} against {base['run']} ({r['arrivals']}): the adapters' kernels by step kind\n"
                  + lora_kernel_table(r["profile"], base["profile"], r.get("lora_traffic"),
                                      report["limits"]["bandwidth"]))
    w = report.get("warm_up")
    if w:
        print(f"\nwarm-up {w['seconds']:.1f} s (mixed-step pieces {_f(w.get('mixed_pieces_s'), '.1f')} s), "
              f"captures {w['captures']}")
    for b in report.get("pieces_builds", []):
        print(f"pieces for {b['variant']} (prefill_lora_write={b['prefill_lora_write']}, base_pieces="
              f"{b['base_pieces']}, live_grids={b['live_grids']}, form={b.get('prefill_lora_form') or 'default'}, "
              f"decode_gemm={b.get('decode_gemm')}, token_buckets={b.get('token_buckets')}, "
              f"mixed_graph_max_tokens={b.get('mixed_graph_max_tokens')}) "
              f"built in {b['seconds']:.1f} s, "
              f"captures {b['captures']}")
    if report["skipped"]:
        print("skipped (deadline):", ", ".join(report["skipped"]))
    if report["errors"]:
        print("errors:", report["errors"])
    return report


if __name__ == "__main__":
    main()
