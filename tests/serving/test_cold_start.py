"""Cold start: what the engine compiles and captures does not multiply with the adapters' ranks.

Counted through the code's own registries: ``ModelRunner.capture_keys`` / ``capture_counts``
(decode graph keys, mixed-step pieces by token bucket; on the CPU the pieces run eagerly, built
where a GPU captures them) and ``segment_kernel_variants`` (the compile keys of the prefill LoRA
kernels). Outputs with ranks 4-128 through the Triton kernels (interpreter, fp32) equal the torch
references'. The on-disk compile caches go under the project's cache directory.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from lightning_lorafusion.kernels import lora_segments
from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.serving import paged_forward as paged_forward_module
from lightning_lorafusion.serving.warm_up import COMPILE_CACHE_DIRS, compiled_kernel_variants, use_compile_caches

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG = dict(num_pages=800, page_size=16, max_num_batched_tokens=64, max_num_seqs=8, prefix_caching=False)


def add_random_adapter(engine, name: str, rank: int, seed: int, modules=MODULES) -> None:
    cfg = engine.model_config
    g = torch.Generator().manual_seed(seed)
    factors = {}
    for layer in range(cfg.num_layers):
        for m in modules:
            k, n = cfg.module_dims(m)
            factors[(layer, m)] = (torch.randn(rank, k, generator=g) * k**-0.5,
                                   torch.randn(n, rank, generator=g) * 0.5 * rank**-0.5)
    engine.add_adapter_weights(name, factors, rank=rank, alpha=2.0 * rank)


def make_ranked_engine(make_engine, ranks, **config):
    engine = make_engine(with_adapters=False, **{**CONFIG, **config})
    for i, r in enumerate(ranks):
        add_random_adapter(engine, f"r{r}", r, seed=10 + i, modules=MODULES if i % 2 == 0 else MODULES[:4])
    return engine


def traffic(engine, adapters, *, new_tokens=3, logprobs=None):
    """Prompts of mixed lengths, one or two per adapter and one on the base, arriving over the
    first steps so prefills meet running decodes -> (request id, tokens, logprobs) in order."""
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    g = torch.Generator().manual_seed(1)
    names = [None, *adapters, *adapters[:2]]
    reqs = [GenerationRequest(prompt_token_ids=torch.randint(1, 60, (3 + 4 * i % 11,), generator=g).tolist(),
                              adapter=a, sampling=sp, request_id=f"t{i}") for i, a in enumerate(names)]
    results = engine.generate(reqs)
    return [(r.request_id, r.token_ids, r.logprobs) for r in results]


def test_capture_keys_do_not_depend_on_the_rank_mix(make_engine):
    """Adapters of ranks 4, 8, 24, 64 and 128 warm up to the same decode graph keys and mixed-step
    token buckets as one adapter of rank 8; an adapter of a rank seen nowhere before (40), loaded
    after warm-up and sent traffic beside the others, adds no key and builds no piece."""
    one = make_ranked_engine(make_engine, [8], mixed_graphs="eager")
    many = make_ranked_engine(make_engine, [4, 8, 24, 64, 128], mixed_graphs="eager")
    reports = [e.warm_up(prompt_len=6) for e in (one, many)]
    assert one.runner.capture_keys() == many.runner.capture_keys()
    assert many.runner.capture_keys()["mixed_pieces"] == list(many.runner.token_buckets)
    assert reports[0]["captures"] == reports[1]["captures"] == many.runner.capture_counts()
    assert reports[1]["ranks"] == [4, 8, 24, 64, 128]
    before = many.runner.capture_counts()
    pieces = dict(many.runner._mixed)
    add_random_adapter(many, "r40", 40, seed=99)
    assert many.runner.build_mixed_pieces() == 0
    traffic(many, ["r40", "r128", "r4"])
    assert many.runner.capture_counts() == before
    assert all(many.runner._mixed[b] is p for b, p in pieces.items())  # the same pieces served them
    stats = many.stats()
    assert stats["mixed_piece_keys"] == len(many.runner.token_buckets) and stats["warm_up_seconds"] > 0


def test_prefill_lora_kernel_variants_do_not_depend_on_the_rank_mix(make_engine, monkeypatch):
    """Every prefill LoRA call of a run through padded mixed pieces records the compile keys of
    the Triton launches it makes (``segment_kernel_variants``: the launcher's own plan, computed
    without running it, so the torch references run the math here): a run with ranks 4-128 and
    one with a single rank need the same set, so a GPU compiles the same kernels for both."""
    seen: list[frozenset] = []
    add = paged_forward_module.segment_lora_add

    def recording(x, lora, outs, **kwargs):
        seen.append(lora_segments.segment_kernel_variants(x, lora, outs))
        return add(x, lora, outs, **kwargs)

    monkeypatch.setattr(paged_forward_module, "segment_lora_add", recording)
    variants = []
    for ranks in ([8], [4, 8, 24, 64, 128]):
        seen.clear()
        engine = make_ranked_engine(make_engine, ranks, mixed_graphs="eager")
        traffic(engine, [f"r{r}" for r in ranks])
        assert seen
        variants.append(frozenset().union(*seen))
    assert variants[0] == variants[1]


def test_every_rank_through_the_triton_kernels_equals_the_torch_references(make_engine):
    """Ranks 4, 8, 24, 64 and 128 (one to eight chunks of the rank loops; 128 the widest) in one
    batch: the prefill LoRA's Triton kernels (interpreter, fp32; row tiles into the pieces' 128
    wide S) give each request the torch references' tokens and logprobs. (The decode gather
    kernels, unchanged, keep their own rank tests in tests/kernels; the torch one runs here.)"""
    ranks = [4, 8, 24, 64, 128]
    names = [f"r{r}" for r in ranks]
    got = {}
    for backend in ("torch", "triton"):
        engine = make_ranked_engine(make_engine, ranks, backend=backend, decode_backend="torch",
                                    **({"mixed_graphs": "eager"} if backend == "triton" else {}))
        got[backend] = traffic(engine, names, new_tokens=2, logprobs=1)
    for (rid, tokens, lps), (rid2, tokens2, lps2) in zip(got["torch"], got["triton"]):
        assert (rid, tokens) == (rid2, tokens2)
        assert lps == pytest.approx(lps2, abs=1e-4)


def test_compile_caches_go_under_the_project_cache_directory(tmp_path, monkeypatch):
    """Triton's and Inductor's caches default to <LORAFUSION_CACHE_DIR>/triton and /inductor (so a
    restart loads what the last run compiled); a directory the user set is kept."""
    monkeypatch.setenv("LORAFUSION_CACHE_DIR", str(tmp_path))
    for var in COMPILE_CACHE_DIRS:  # (set first: the fixture then restores the variable's absence)
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    dirs = use_compile_caches()
    assert dirs == {"TRITON_CACHE_DIR": str(tmp_path / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_caches()["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert isinstance(compiled_kernel_variants(), dict)  # (empty in the interpreter: nothing compiles)


def test_engine_sets_the_compile_cache_before_its_first_compile(make_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("LORAFUSION_CACHE_DIR", str(tmp_path))
    for var in COMPILE_CACHE_DIRS:
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    make_engine(with_adapters=False, num_pages=32, page_size=4)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")


def test_warm_up_report_reaches_serve_log_and_metrics(make_engine):
    """What warm-up compiled and captured, by kind, in the line ``serve`` logs and on /metrics."""
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from lightning_lorafusion.serving.serve_cli import warm_up_summary
    from lightning_lorafusion.serving.server import create_app

    engine = make_ranked_engine(make_engine, [4, 24], mixed_graphs="eager")
    report = engine.warm_up(prompt_len=4, max_new_tokens=1)
    buckets = len(engine.runner.token_buckets)
    line = warm_up_summary(report)
    assert line.startswith(f"warm-up: {report['requests']} requests (base and adapter ranks [4, 24]) in "
                           f"{report['seconds']:.2f} s") and f"{buckets} mixed-step token buckets" in line
    assert "Triton kernels: 0 variants" in line  # the interpreter compiles nothing
    assert "their list found by running the steps" in line  # (no record where nothing compiles ahead)
    restart = {**report, "compile_ahead": {**report["compile_ahead"], "source": "record"}}
    assert "their list read from its record" in warm_up_summary(restart)
    with TestClient(create_app(engine)) as client:
        samples = {s.name: s.value for f in text_string_to_metric_families(client.get("/metrics").text)
                   for s in f.samples}
    assert samples["lorafusion_warm_up_seconds"] == pytest.approx(report["seconds"])
    assert samples["lorafusion_mixed_piece_keys"] == buckets and samples["lorafusion_decode_graph_keys"] == 0


def test_compiled_kernel_variants_count_each_kernel_once(monkeypatch):
    """The registry of compiled Triton variants reads each kernel's per-device caches (as
    Triton's JIT keeps them: a tuple whose first item maps a specialisation to its binary); a
    kernel imported into a second module counts once, kernels outside the package not at all."""
    import types

    class FakeKernel:
        def __init__(self, variants):
            self.device_caches = {0: ({f"v{i}": object() for i in range(variants)}, {}, None, None, None)}

    shared, other = FakeKernel(2), FakeKernel(3)
    first = types.ModuleType("lightning_lorafusion.kernels._fake_a")
    first.shared, first.other, first.unused = shared, other, FakeKernel(0)
    second = types.ModuleType("lightning_lorafusion.kernels._fake_b")
    second.shared = shared
    outside = types.ModuleType("elsewhere_fake")
    outside.kernel = FakeKernel(5)
    for module in (first, second, outside):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    counts = compiled_kernel_variants()
    assert counts.get("_fake_a.shared") == 2 and counts.get("_fake_a.other") == 3
    assert "_fake_b.shared" not in counts and "_fake_a.unused" not in counts
    assert not any("elsewhere" in k for k in counts)


def test_pieces_no_step_can_run_are_not_built(make_engine):
    """With "auto" prefill LoRA, buckets of one and two rows get no added-after pieces: every
    count of adapted prefill rows such a step can hold writes first (``_step_writes``, the
    step's own decision); every larger bucket, where some count adds after, gets both."""
    engine = make_ranked_engine(make_engine, [8], mixed_graphs="eager", prefill_lora_write="auto")
    runner = engine.runner
    runner.build_mixed_pieces()
    for rows in runner.token_buckets:
        adds_after = any(not runner._step_writes(k, rows) for k in range(1, rows + 1))
        assert (rows in runner._pieces_by_mode[False][0]) == adds_after == (rows > 2)
        assert rows in runner._pieces_by_mode[True][0] and rows in runner._pieces_by_mode[None][0]
