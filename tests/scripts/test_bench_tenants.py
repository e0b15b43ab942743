"""scripts/bench_tenants.py on CPU (tiny shape, fp32): the trace's lengths, popularity and arrivals,
and a full run whose floors come from the engine's step ledger."""

import json
import math

import pytest

from _script_loader import load_script


def test_trace_shapes():
    bench = load_script("bench_tenants")
    names = [f"t{i}" for i in range(6)]
    burst = bench.make_trace(num_requests=600, adapters=names, zipf=1.0, prompt=(20, 0.8, 60), output=(8, 0.5, 30),
                             arrivals="burst", rate=10.0, vocab=64, seed=0)
    assert all(it.arrival_s == 0.0 for it in burst)
    prompts = sorted(len(it.request.prompt_token_ids) for it in burst)
    outputs = [it.request.sampling.max_new_tokens for it in burst]
    assert 1 <= prompts[0] and prompts[-1] == 60  # capped (a lognormal of sigma 0.8 passes 3x its median)
    assert 15 <= prompts[len(prompts) // 2] <= 25 and max(outputs) <= 30  # median about 20
    counts = [sum(it.request.adapter == n for it in burst) for n in names]
    assert counts[0] > counts[2] > counts[5] > 0  # Zipf: adapter 0 the most popular
    poisson = bench.make_trace(num_requests=600, adapters=names, zipf=1.0, prompt=(20, 0.8, 60),
                               output=(8, 0.5, 30), arrivals="poisson", rate=10.0, vocab=64, seed=0)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(poisson, poisson[1:])]
    assert 0.08 < sum(gaps) / len(gaps) < 0.12  # mean gap 1 / rate
    assert [it.request.prompt_token_ids for it in poisson] == [it.request.prompt_token_ids for it in burst]
    base = bench.relabel(burst, "b-", None)
    assert all(b.request.adapter is None and b.request.request_id == "b-" + it.request.request_id
               and b.request.prompt_token_ids == it.request.prompt_token_ids for b, it in zip(base, burst))


def test_bench_tenants_tiny_cpu(tmp_path):
    bench = load_script("bench_tenants")
    # peak and bandwidth given, above what two CPU cores reach: the floor is then a true lower bound
    report = bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "10",
                         "--adapters", "6", "--ranks", "4,8", "--prompt-median", "10", "--prompt-max", "30",
                         "--output-median", "4", "--output-max", "8", "--rate", "60", "--warm-up", "off",
                         "--slora", "--slora-requests", "4", "--slora-prompt", "12", "--slora-new", "3",
                         "--slora-adapters", "4", "--slora-rank", "4", "--slora-repeat", "2",
                         "--profile-steps", "2", "--profile-runs", "slora_one burst", "--profile-again", "on",
                         "--peak-tflops", "5", "--bandwidth-gbs", "500",
                         "--phase-max-s", "3600", "--out", str(tmp_path)])
    assert report["errors"] == {} and report["skipped"] == []
    saved = json.loads((tmp_path / "bench_tenants_tiny.json").read_text())
    runs = {(r["run"], r["arrivals"]): r for r in saved["runs"]}
    # the S-LoRA runs twice in turn; the run named in --profile-runs again after itself (profiled on CUDA)
    assert [r["run"] for r in saved["runs"] if r["run"].startswith("slora")] == [
        "slora_distinct", "slora_one", "slora_one-profiled", "slora_base",
        "slora_distinct-2", "slora_one-2", "slora_base-2"]
    assert set(runs) == {("lora", "burst"), ("base", "burst"), ("lora", "poisson"), ("base", "poisson"),
                         ("slora_distinct", "burst"), ("slora_one", "burst"), ("slora_base", "burst"),
                         ("slora_one-profiled", "burst"), ("slora_distinct-2", "burst"), ("slora_one-2", "burst"),
                         ("slora_base-2", "burst")}
    assert saved["limits"]["peak_flops"] == 5e12 and saved["limits"]["bandwidth"] == 500e9
    for r in runs.values():
        assert r["complete"] == r["requests"] and r["generated_tokens"] > 0 and r["wall_s"] > 0
        assert r["floor_s"] > 0 and r["floor"]["base_bytes"] > 0 and r["floor"]["flops"] > 0
        assert 0 < r["fraction_of_floor"] <= 1 and math.isclose(r["fraction_of_floor"], r["floor_s"] / r["wall_s"])
        assert r["floor"]["steps"] == r["ledger"]["steps"] > 0
        # every prompt token and every generated token but each request's last is fed once
        assert r["ledger"]["prefill_tokens"] + r["ledger"]["decode_rows"] == \
            r["prompt_tokens"] + r["generated_tokens"] - r["requests"]
        # where the time went: the steps by kind add up to the run's steps, busy time and floor
        total, kinds = r["breakdown"]["total"], r["breakdown"]["kinds"]
        assert total["steps"] == r["ledger"]["steps"] == sum(k["steps"] for k in kinds)
        assert math.isclose(total["wall_s"], r["busy_s"], rel_tol=1e-9)
        assert math.isclose(total["floor_s"], r["floor_s"], rel_tol=1e-9)
        assert r["breakdown"]["gpu_times"] is False and total["gpu_s"] is None  # a CPU: wall times
        assert {k["kind"].split()[0] for k in kinds} == {"mixed", "decode"}
        assert all(k["kind"].split()[2] == ("base" if "base" in r["run"] else "lora") for k in kinds)
    for run in ("lora", "slora_distinct", "slora_one", "slora_one-profiled", "slora_distinct-2"):
        assert runs[(run, "burst")]["floor"]["adapter_bytes"] > 0
    for run in (("base", "burst"), ("base", "poisson"), ("slora_base", "burst")):
        assert runs[run]["floor"]["adapter_bytes"] == 0 and runs[run]["ledger"]["distinct_adapters"] == 0
    assert runs[("slora_distinct", "burst")]["ledger"]["distinct_adapters"] == 4
    assert runs[("slora_one", "burst")]["ledger"]["distinct_adapters"] == 1
    # the same requests: the LoRA run reads its adapters besides what the base run reads
    assert runs[("lora", "burst")]["floor"]["flops"] > runs[("base", "burst")]["floor"]["flops"]


def test_measured_limits_are_positive():
    import torch

    bench = load_script("bench_tenants")
    cpu = torch.device("cpu")
    assert bench.copy_bandwidth(cpu, 4) > 0 and bench.matmul_flops(cpu, torch.float32, 64) > 0
    assert load_script("harness").dense_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert load_script("harness").dense_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert load_script("harness").dense_bf16_tflops("cpu") is None


def test_bench_tenants_variants_side_by_side(tmp_path):
    bench = load_script("bench_tenants")
    report = bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "10",
                         "--adapters", "6", "--ranks", "4,8", "--prompt-median", "10", "--prompt-max", "30",
                         "--output-median", "4", "--output-max", "8", "--arrivals", "burst", "--warm-up", "off",
                         "--max-num-seqs", "3", "--variants", "new,old", "--page-out", "on",
                         "--phase-max-s", "3600", "--out", str(tmp_path)])
    assert report["errors"] == {} and report["skipped"] == []
    runs = {r["run"]: r for r in report["runs"]}
    assert set(runs) == {"lora-new", "lora-old", "base-new", "base-old"}
    new, old = runs["lora-new"], runs["lora-old"]
    assert new["generated_tokens"] == old["generated_tokens"] and new["complete"] == new["requests"]
    # paged out before each run: both page every adapter of the trace in again
    assert new["paging"]["page_ins"] >= new["trace_adapters"] and old["paging"]["page_ins"] >= old["trace_adapters"]
    # admissions that found their adapter paged in ahead or paged it in themselves: the window
    # ahead holds at least the first prefetch_depth queued requests, so it misses no more
    assert new["paging"]["prefetch_misses"] <= old["paging"]["prefetch_misses"]
    assert new["paging"]["prefetch_hits"] + new["paging"]["prefetch_misses"] > 0
    assert runs["base-new"]["paging"]["page_ins"] == 0


def test_bench_tenants_old_variant_switches_the_named_paths(tmp_path, monkeypatch):
    """``--old prefill-lora,page-in``: the old runs add the prefill LoRA after the product and
    wait for page-ins whole (host paths as new); the new runs write it first and wait by layer.
    ``--prime on``: the trace runs once first, outside the reported runs."""
    bench = load_script("bench_tenants")
    seen = []
    real = bench.TenantsBench.phase

    def phase(self, run, arrivals, trace):
        engine = self.engine
        seen.append((run, engine.runner.prefill_lora_write, engine.pool.page_in_groups,
                     engine.scheduler.prefetch_ahead, engine.runner.host_tables))
        return real(self, run, arrivals, trace)

    monkeypatch.setattr(bench.TenantsBench, "phase", phase)
    report = bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "8",
                         "--adapters", "4", "--ranks", "4,8", "--prompt-median", "10", "--prompt-max", "30",
                         "--output-median", "3", "--output-max", "6", "--arrivals", "burst", "--warm-up", "off",
                         "--runs", "lora", "--variants", "new,old", "--old", "prefill-lora,page-in",
                         "--page-out", "on", "--prime", "on", "--phase-max-s", "3600", "--out", str(tmp_path)])
    assert report["errors"] == {}
    assert seen[0][0] == "prime" and [r["run"] for r in report["primed"]] == ["prime"]  # run first, not reported
    seen = seen[1:]
    slices = min(8, bench.SHAPES["tiny"]["num_hidden_layers"])
    assert seen == [("lora-new", "auto", slices, True, "packed"), ("lora-old", "off", 1, True, "packed")]
    runs = {r["run"]: r for r in report["runs"]}
    assert runs["lora-new"]["generated_tokens"] == runs["lora-old"]["generated_tokens"]


def test_bench_tenants_old_variant_switches_the_mixed_pieces_lora(tmp_path, monkeypatch):
    """``--old base-pieces,table-grids``: the old runs send base-only mixed steps through the
    LoRA pieces and run the prefill LoRA on grids over the whole padded table; the new runs
    neither; the tokens agree."""
    bench = load_script("bench_tenants")
    seen = []
    real = bench.TenantsBench.phase

    def phase(self, run, arrivals, trace):
        seen.append((run, self.engine.runner.base_pieces, self.engine.runner.live_grids))
        return real(self, run, arrivals, trace)

    monkeypatch.setattr(bench.TenantsBench, "phase", phase)
    report = bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "6",
                         "--adapters", "3", "--ranks", "4,8", "--prompt-median", "8", "--prompt-max", "20",
                         "--output-median", "3", "--output-max", "5", "--arrivals", "burst", "--warm-up", "off",
                         "--runs", "lora,base", "--variants", "new,old", "--old", "base-pieces,table-grids",
                         "--phase-max-s", "3600", "--out", str(tmp_path)])
    assert report["errors"] == {}
    assert seen == [("lora-new", True, True), ("lora-old", False, False), ("base-new", True, True),
                    ("base-old", False, False)]
    runs = {r["run"]: r for r in report["runs"]}
    assert runs["lora-new"]["generated_tokens"] == runs["lora-old"]["generated_tokens"]


def test_bench_tenants_old_decode_lora_sets_the_blocks_of_before(tmp_path, monkeypatch):
    """``--old decode-lora,pdl,rank-variant,beside``: the old runs take the decode LoRA's blocks
    before the few-rows ones (``FEW_ROWS`` and ``AHEAD_MAX_ROWS`` None, the epilogues unpaired),
    no programmatic dependent launch, no rank variant (``UNSPLIT_MAX_RANK`` None) and no shrink
    beside the GEMMs (``BESIDE_MAX_ROWS`` None), the new runs the engine's; put back after."""
    from lightning_lorafusion.kernels import lora_gather

    bench = load_script("bench_tenants")
    seen = []
    real = bench.TenantsBench.phase

    def phase(self, run, arrivals, trace):
        seen.append((run, lora_gather.FEW_ROWS, lora_gather.AHEAD_MAX_ROWS, lora_gather.PAIR_EPILOGUES,
                     lora_gather.PDL, lora_gather.UNSPLIT_MAX_RANK, lora_gather.BESIDE_MAX_ROWS))
        return real(self, run, arrivals, trace)

    monkeypatch.setattr(bench.TenantsBench, "phase", phase)
    monkeypatch.setattr(lora_gather, "AHEAD_MAX_ROWS", 16)
    monkeypatch.setattr(lora_gather, "FEW_ROWS", 16)
    monkeypatch.setattr(lora_gather, "PDL", True)
    monkeypatch.setattr(lora_gather, "UNSPLIT_MAX_RANK", 16)
    monkeypatch.setattr(lora_gather, "BESIDE_MAX_ROWS", 64)
    report = bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "6",
                         "--adapters", "3", "--ranks", "4,8", "--prompt-median", "10", "--prompt-max", "30",
                         "--output-median", "3", "--output-max", "5", "--arrivals", "burst", "--warm-up", "off",
                         "--runs", "lora", "--variants", "new,old", "--old", "decode-lora,pdl,rank-variant,beside",
                         "--slora", "--slora-requests", "2", "--slora-prompt", "6", "--slora-new", "2",
                         "--slora-adapters", "2", "--slora-rank", "4",
                         "--phase-max-s", "3600", "--out", str(tmp_path)])
    assert report["errors"] == {}
    new, old = (16, 16, True, True, 16, 64), (None, None, False, False, None, None)
    # the S-LoRA runs side by side too, each variant's three in turn
    assert seen == [("lora-new", *new), ("lora-old", *old), ("slora_distinct-new", *new), ("slora_one-new", *new),
                    ("slora_base-new", *new), ("slora_distinct-old", *old), ("slora_one-old", *old),
                    ("slora_base-old", *old)]
    assert (lora_gather.FEW_ROWS, lora_gather.AHEAD_MAX_ROWS, lora_gather.PAIR_EPILOGUES, lora_gather.PDL,
            lora_gather.UNSPLIT_MAX_RANK, lora_gather.BESIDE_MAX_ROWS) == (16, 16, True, True, 16, 64)


def test_bench_tenants_decode_lora_knobs_and_old_grouped_shrink(tmp_path, monkeypatch):
    """``--decode-lora-knobs``: the new runs take those ``lora_gather`` knobs; ``--old
    grouped-shrink,decode-hybrid``: the old runs the grouped shrink's and per-row expands' knobs of
    before (``OLD_GROUPED_KNOBS``) and no hybrid expands (``OLD_HYBRID_KNOBS``), the mixed-step
    pieces rebuilt for each; all put back after."""
    from lightning_lorafusion.kernels import lora_gather

    bench = load_script("bench_tenants")
    names = ("GROUPED_SHRINK_BLOCK_R", "GROUPED_SHRINK_WARPS", "GROUPED_MIN_ROWS", "ROW_EXPAND_WARPS",
             "HYBRID_MIN_ROWS")
    before = {n: getattr(lora_gather, n) for n in names}
    seen = []
    real = bench.TenantsBench.phase

    def phase(self, run, arrivals, trace):
        seen.append((run, *(getattr(lora_gather, n) for n in names)))
        return real(self, run, arrivals, trace)

    monkeypatch.setattr(bench.TenantsBench, "phase", phase)
    with pytest.raises(SystemExit):
        bench.parse_args(["--decode-lora-knobs", "NOT_A_KNOB=1"])
    report = bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "6",
                         "--adapters", "3", "--ranks", "4,8", "--prompt-median", "10", "--prompt-max", "30",
                         "--output-median", "3", "--output-max", "5", "--arrivals", "burst", "--warm-up", "off",
                         "--runs", "lora", "--variants", "new,old", "--old", "grouped-shrink,decode-hybrid",
                         "--decode-lora-knobs",
                         "GROUPED_SHRINK_BLOCK_R=64,GROUPED_SHRINK_WARPS=8,GROUPED_MIN_ROWS=2,HYBRID_MIN_ROWS=2",
                         "--phase-max-s", "3600", "--out", str(tmp_path)])
    assert report["errors"] == {}
    old_knobs = {**bench.OLD_GROUPED_KNOBS, **bench.OLD_HYBRID_KNOBS}
    old = tuple(old_knobs[n] if n in old_knobs else before[n] for n in names)
    assert old[2:] == (256, before["ROW_EXPAND_WARPS"], None)
    assert seen == [("lora-new", 64, 8, 2, before["ROW_EXPAND_WARPS"], 2), ("lora-old", *old)]
    assert report["decode_lora_knobs"] == {"GROUPED_SHRINK_BLOCK_R": 64, "GROUPED_SHRINK_WARPS": 8,
                                           "GROUPED_MIN_ROWS": 2, "HYBRID_MIN_ROWS": 2}
    runs = {r["run"]: r for r in report["runs"]}
    assert runs["lora-new"]["generated_tokens"] == runs["lora-old"]["generated_tokens"]
    assert {n: getattr(lora_gather, n) for n in names} == before


def test_bench_tenants_old_small_steps_splits_small_steps_as_large_ones(tmp_path, monkeypatch):
    """``--old small-steps``: the old runs take ``lora_segments.SMALL_STEP_ROWS`` None (the
    mixed-step pieces dropped and rebuilt), the new ones the engine's; put back after."""
    from lightning_lorafusion.kernels import lora_segments

    bench = load_script("bench_tenants")
    seen = []
    real = bench.TenantsBench.phase

    def phase(self, run, arrivals, trace):
        seen.append((run, lora_segments.SMALL_STEP_ROWS))
        return real(self, run, arrivals, trace)

    monkeypatch.setattr(bench.TenantsBench, "phase", phase)
    monkeypatch.setattr(lora_segments, "SMALL_STEP_ROWS", 512)
    report = bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "4",
                         "--adapters", "2", "--ranks", "4", "--prompt-median", "10", "--prompt-max", "20",
                         "--output-median", "2", "--output-max", "3", "--arrivals", "burst", "--warm-up", "off",
                         "--runs", "lora", "--variants", "new,old", "--old", "small-steps",
                         "--phase-max-s", "3600", "--out", str(tmp_path)])
    assert report["errors"] == {}
    assert seen == [("lora-new", 512), ("lora-old", None)]
    assert lora_segments.SMALL_STEP_ROWS == 512


def test_bench_tenants_old_decode_gemm_switches_the_products(tmp_path, monkeypatch):
    """``--old decode-gemm,token-buckets,attention-splits``: the old runs take the frozen products
    of few rows by cuBLAS, pad mixed steps to powers of two and split decode attention for 2
    programs per SM, the new ones the engine's defaults; the tokens agree."""
    from lightning_lorafusion.kernels import paged_attention

    bench = load_script("bench_tenants")
    seen = []
    real = bench.TenantsBench.phase

    def phase(self, run, arrivals, trace):
        seen.append((run, self.engine.runner.decode_gemm, self.engine.runner.token_bucket_mode,
                     paged_attention.DECODE_PROGRAMS_PER_SM))
        return real(self, run, arrivals, trace)

    monkeypatch.setattr(bench.TenantsBench, "phase", phase)
    report = bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "6",
                         "--adapters", "3", "--ranks", "4", "--prompt-median", "8", "--prompt-max", "20",
                         "--output-median", "3", "--output-max", "4", "--arrivals", "burst", "--warm-up", "off",
                         "--runs", "base", "--variants", "new,old", "--old",
                         "decode-gemm,token-buckets,attention-splits",
                         "--phase-max-s", "3600", "--out", str(tmp_path)])
    assert report["errors"] == {}
    per_sm = paged_attention.DECODE_PROGRAMS_PER_SM
    assert seen == [("base-new", "auto", "fine", per_sm),
                    ("base-old", "cublas", "pow2", bench.OLD_PROGRAMS_PER_SM)]
    assert paged_attention.DECODE_PROGRAMS_PER_SM == per_sm  # set back after the runs
    runs = {r["run"]: r for r in report["runs"]}
    assert runs["base-new"]["generated_tokens"] == runs["base-old"]["generated_tokens"]


def test_bench_tenants_old_lora_beside_switches_where_the_shrinks_run(tmp_path, monkeypatch):
    """``--decode-lora-beside wide --old lora-beside``: the new runs' engine takes the decode rows'
    shrinks beside the GEMMs in every step, the old ones only in decode steps of few rows
    (``ModelRunner.decode_lora_beside`` "few"); the tokens agree."""
    bench = load_script("bench_tenants")
    seen = []
    real = bench.TenantsBench.phase

    def phase(self, run, arrivals, trace):
        seen.append((run, self.engine.runner.decode_lora_beside, self.engine.runner.model.wide_beside))
        return real(self, run, arrivals, trace)

    monkeypatch.setattr(bench.TenantsBench, "phase", phase)
    report = bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "6",
                         "--adapters", "3", "--ranks", "4", "--prompt-median", "8", "--prompt-max", "20",
                         "--output-median", "3", "--output-max", "4", "--arrivals", "burst", "--warm-up", "off",
                         "--runs", "lora", "--variants", "new,old", "--old", "lora-beside",
                         "--decode-lora-beside", "wide", "--phase-max-s", "3600", "--out", str(tmp_path)])
    assert report["errors"] == {}
    assert seen == [("lora-new", "wide", True), ("lora-old", "few", False)]
    runs = {r["run"]: r for r in report["runs"]}
    assert runs["lora-new"]["generated_tokens"] == runs["lora-old"]["generated_tokens"]


def test_bench_tenants_old_mixed_buffers(tmp_path, monkeypatch):
    """``--old in-place,padded-large,quarter-buckets``: the old runs concatenate attention's
    outputs and pad base-only mixed steps of every size to the "fine" buckets; the new ones write
    attention in place and pad base-only steps up to the engine's graph limit (to the engine's
    buckets, "fine" by default); the tokens agree."""
    bench = load_script("bench_tenants")
    seen = []
    real = bench.TenantsBench.phase

    def phase(self, run, arrivals, trace):
        r = self.engine.runner
        seen.append((run, r.attention_in_place, r.mixed_graph_max_tokens is None, r.token_bucket_mode))
        return real(self, run, arrivals, trace)

    monkeypatch.setattr(bench.TenantsBench, "phase", phase)
    report = bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "6",
                         "--adapters", "3", "--ranks", "4", "--prompt-median", "8", "--prompt-max", "20",
                         "--output-median", "3", "--output-max", "4", "--arrivals", "burst", "--warm-up", "off",
                         "--runs", "base", "--variants", "new,old", "--old", "in-place,padded-large,quarter-buckets",
                         "--phase-max-s", "3600", "--out", str(tmp_path)])
    assert report["errors"] == {}
    assert seen == [("base-new", True, False, "fine"), ("base-old", False, True, "fine")]
    runs = {r["run"]: r for r in report["runs"]}
    assert runs["base-new"]["generated_tokens"] == runs["base-old"]["generated_tokens"]


def test_bench_tenants_prefill_expand_and_swiglu_knobs(tmp_path, monkeypatch):
    """``--splitk-expand held --prefill-swiglu on`` with ``--old prefill-expand,prefill-swiglu``: the
    new runs take the held expand and gate/up's LoRA inside SwiGLU, the old ones neither; the
    tokens agree."""
    from lightning_lorafusion.kernels import lora_segments
    from lightning_lorafusion.serving import paged_forward

    bench = load_script("bench_tenants")
    monkeypatch.setattr(lora_segments, "SPLITK_EXPAND", lora_segments.SPLITK_EXPAND)
    monkeypatch.setattr(paged_forward, "PREFILL_SWIGLU", paged_forward.PREFILL_SWIGLU)
    seen = []
    real = bench.TenantsBench.phase

    def phase(self, run, arrivals, trace):
        seen.append((run, lora_segments.SPLITK_EXPAND, paged_forward.PREFILL_SWIGLU))
        return real(self, run, arrivals, trace)

    monkeypatch.setattr(bench.TenantsBench, "phase", phase)
    report = bench.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "6",
                         "--adapters", "3", "--ranks", "4,8", "--prompt-median", "8", "--prompt-max", "20",
                         "--output-median", "3", "--output-max", "5", "--arrivals", "burst", "--warm-up", "off",
                         "--runs", "lora", "--variants", "new,old", "--old", "prefill-expand,prefill-swiglu",
                         "--splitk-expand", "held", "--prefill-swiglu", "on", "--phase-max-s", "3600",
                         "--out", str(tmp_path)])
    assert report["errors"] == {}
    assert seen == [("lora-new", "held", True), ("lora-old", "tile", False)]
    runs = {r["run"]: r for r in report["runs"]}
    assert runs["lora-new"]["generated_tokens"] == runs["lora-old"]["generated_tokens"]
