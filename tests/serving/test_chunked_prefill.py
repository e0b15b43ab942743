"""Chunked prefill: every step within the token budget, outputs unchanged (vs unchunked and HF + PEFT)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_lorafusion.model.hf_loading import load_base_model
from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams

from test_generation import CASES, GREEDY, _requests
from test_prefix_cache import SYSTEM, _run_arriving

# prompts longer than the budgets below (6 and 7 tokens a step), of the base and three adapters
LONG = [
    ([(5 * i + 3) % 64 for i in range(23)], "all4"),
    ([(7 * i + 1) % 64 for i in range(17)], None),
    ([(11 * i + 2) % 64 for i in range(30)], "mlp8"),
    ([(3 * i + 9) % 64 for i in range(9)], "attn2"),
    ([(13 * i + 4) % 64 for i in range(14)], "all4"),
]
MIXED = LONG + CASES[:4]
ARRIVE = {0: [0, 1], 1: [2], 3: [3, 4], 4: [5], 9: [6, 7], 15: [8]}  # step -> requests submitted before it


def _record_plans(engine: Engine) -> list[tuple[int, list[tuple[int, int, int]], int]]:
    """Per step: (tokens scheduled, [(first uncached token, tokens fed, request's tokens)] per
    prefill, decode rows)."""
    plans = []
    schedule = engine.scheduler.schedule

    def recorded():
        plan = schedule()
        plans.append((plan.num_tokens, [(s.num_cached, n, s.num_tokens)
                                        for s, n in zip(plan.prefill, plan.prefill_lens)], len(plan.decode)))
        return plan

    engine.scheduler.schedule = recorded
    return plans


def _check_chunking(plans, budget: int, page_size: int) -> None:
    """Every step within ``budget``; some request prefilled in pieces, some piece ending inside a page."""
    assert max(p[0] for p in plans) <= budget
    pieces = [p for _, prefill, _ in plans for p in prefill if p[0] + p[1] < p[2]]
    assert pieces, "no prefill was chunked"
    assert any((first + n) % page_size for first, n, _ in pieces), "every chunk ended on a page boundary"


def test_chunked_equals_unchunked_and_hf_peft(make_engine, hf_reference):
    """Prompts up to 5x the budget, the base and three adapters, requests arriving at different
    steps (so prefill chunks share steps with decode rows)."""
    reqs = _requests(MIXED)
    whole = _run_arriving(make_engine(num_pages=96, page_size=4, enable_chunked_prefill=False,
                                      prefix_caching=False), reqs, ARRIVE)
    engine = make_engine(num_pages=96, page_size=4, max_num_seqs=4, max_num_batched_tokens=6,
                         prefix_caching=False, enable_chunked_prefill=True)
    plans = _record_plans(engine)
    chunked = _run_arriving(engine, _requests(MIXED), ARRIVE)
    assert chunked == whole
    for (prompt, adapter), out in zip(MIXED, chunked):
        assert list(out) == hf_reference.generate(prompt, adapter, GREEDY.max_new_tokens), (adapter, len(prompt))
    _check_chunking(plans, 6, 4)
    assert any(prefill and decode for _, prefill, decode in plans), "no step mixed decode rows and prefill"
    stats = engine.stats()
    assert stats["prefill_chunks_total"] > 0 and stats["kv_pages_used"] == 0 and stats["running"] == 0
    engine.pool.check()


def test_unchunked_prompt_longer_than_budget_runs_alone(make_engine):
    engine = make_engine(num_pages=96, page_size=4, max_num_seqs=4, max_num_batched_tokens=6,
                         enable_chunked_prefill=False)
    plans = _record_plans(engine)
    engine.generate(_requests(LONG[:3]))
    assert engine.stats()["prefill_chunks_total"] == 0
    over = [prefill for n, prefill, _ in plans if n > 6]
    assert over and all(len(p) == 1 and p[0][0] == 0 and p[0][1] == p[0][2] for p in over)


def test_chunked_prefill_with_tiny_pool_evicting_adapters(make_engine):
    reference = make_engine(num_pages=200, page_size=4, enable_chunked_prefill=False).generate(_requests(MIXED))
    # 40 pages: all4 (16) + mlp8 (22) + attn2 (2) = 40 pages of adapters alone leave no KV room
    engine = make_engine(num_pages=40, page_size=4, max_num_seqs=4, max_num_batched_tokens=7,
                         enable_chunked_prefill=True)
    plans = _record_plans(engine)
    results = engine.generate(_requests(MIXED + MIXED[::-1]))
    assert [r.token_ids for r in results] == [r.token_ids for r in reference + reference[::-1]]
    _check_chunking(plans, 7, 4)
    stats = engine.stats()
    assert stats["adapter_evictions_total"] > 0 and stats["adapter_page_ins_total"] > 3
    assert stats["kv_pages_used"] == 0 and stats["running"] == 0
    engine.pool.check()


def test_chunked_prefill_with_preemption(make_engine):
    """KV pages run out while requests decode: the latest admitted (possibly mid-prefill) is
    preempted, re-prefilled in chunks, and every output is unchanged."""
    sp = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True)
    cases = [(p, None) for p, _ in LONG]
    reference = make_engine(False, num_pages=200, page_size=4, enable_chunked_prefill=False).generate(
        _requests(cases, sp))
    engine = make_engine(False, num_pages=24, page_size=4, max_num_seqs=4, max_num_batched_tokens=7,
                         kv_watermark=0.0, enable_chunked_prefill=True)
    plans = _record_plans(engine)
    results = engine.generate(_requests(cases, sp))
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    _check_chunking(plans, 7, 4)
    stats = engine.stats()
    assert stats["preemptions_total"] > 0 and stats["kv_pages_used"] == 0
    engine.pool.check()


def test_chunked_prefill_shares_only_computed_prefix_pages(make_engine, hf_reference):
    """A request sharing a prefix is admitted in the step where the first finishes its chunked
    prefill: it reuses the pages computed by the earlier chunks (registered chunk by chunk),
    not the page that step fills."""
    first = (SYSTEM + [1, 2, 3, 4, 5, 6, 7], "all4")  # 20 tokens: chunks 0-8, 8-16, 16-20
    second = (SYSTEM + [1, 2, 3, 4, 5, 6, 7, 40, 41], "all4")  # shares 5 full pages with first
    other = (SYSTEM + [1, 2], "attn2")
    cases = [first, second, other]
    engine = make_engine(num_pages=96, page_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                         enable_chunked_prefill=True)
    out = _run_arriving(engine, _requests(cases), {0: [0], 2: [1, 2]})
    stats = engine.stats()
    assert stats["prefix_cache_hits_total"] == 1 and stats["prefix_tokens_reused_total"] == 16
    results = engine.generate(_requests([first, second]))  # both hit the cached pages now
    assert engine.stats()["prefix_cache_hits_total"] == 3
    assert engine.stats()["prefix_tokens_reused_total"] == 16 + 16 + 20
    for (prompt, adapter), tokens in zip(cases, out):
        assert list(tokens) == hf_reference.generate(prompt, adapter, GREEDY.max_new_tokens)
    for (prompt, adapter), res in zip([first, second], results):
        assert list(res.token_ids) == hf_reference.generate(prompt, adapter, GREEDY.max_new_tokens)
    engine.pool.check()


def test_chunked_prompt_logprobs_and_seeded_sampling(make_engine):
    """Prompt logprobs gathered chunk by chunk (also scoring only) and seeded sampling (chunks
    draw nothing) equal the unchunked engine's."""
    score = SamplingParams(max_new_tokens=0, prompt_logprobs=2)
    both = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=True, logprobs=1)
    sampled = SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    reqs = lambda: (_requests(LONG[:2], score) + _requests(LONG[2:4], both)  # noqa: E731
                    + _requests(LONG[3:], sampled))
    whole = make_engine(num_pages=96, page_size=4, enable_chunked_prefill=False).generate(reqs())
    engine = make_engine(num_pages=96, page_size=4, max_num_seqs=4, max_num_batched_tokens=5,
                         enable_chunked_prefill=True)
    plans = _record_plans(engine)
    chunked = engine.generate(reqs())
    _check_chunking(plans, 5, 4)
    for a, b in zip(whole, chunked):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        if a.prompt_logprobs is not None:
            assert len(b.prompt_logprobs) == len(a.prompt_token_ids)
            assert b.prompt_logprobs[0] is None
            assert b.prompt_logprobs[1:] == pytest.approx(a.prompt_logprobs[1:], abs=1e-5)
            assert [list(t) for t in b.prompt_top_logprobs[1:]] == [list(t) for t in a.prompt_top_logprobs[1:]]
        if a.logprobs is not None:
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)


@pytest.fixture(scope="module")
def loaded(model_dir, adapter_dirs):
    """The tiny base loaded once (engines of the property test share its weights)."""
    config, params, tokenizer = load_base_model(str(model_dir), dtype=torch.float32)
    return config, params, tokenizer, adapter_dirs


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_random_arrivals_and_aborts_never_leak_pages(loaded, seed):
    """Random prompts (several times the budget, half with a shared header), adapters, arrival steps
    and aborts under a tiny
    pool and a random budget: every step within the budget, the pool consistent after every
    step, everything back at the end, and the unaborted requests' tokens equal an unchunked
    engine's with a large pool."""
    config, params, tokenizer, adapter_dirs = loaded
    rng = random.Random(seed)
    page_size, max_seqs = rng.choice([2, 3, 4]), rng.randint(1, 4)
    budget = rng.randint(max_seqs, 8)
    names = [None, *adapter_dirs]
    header = [rng.randrange(4, 64) for _ in range(rng.randint(page_size, 3 * page_size))]  # shared by some
    tail = lambda: [rng.randrange(4, 64) for _ in range(rng.randint(1, 4 * budget))]  # noqa: E731
    cases = [((header if rng.random() < 0.5 else []) + tail(), rng.choice(names)) for _ in range(rng.randint(3, 8))]
    sp = SamplingParams(max_new_tokens=rng.randint(1, 10), temperature=0.0, ignore_eos=True)

    def engine(**cfg):
        e = Engine(config, params, tokenizer, EngineConfig(**cfg), device="cpu")
        for name, path in adapter_dirs.items():
            e.add_adapter(name, path)
        return e

    big = engine(num_pages=400, page_size=page_size, enable_chunked_prefill=False)
    reference = big.generate(_requests(cases, sp))
    # room for the largest request with its adapter, and a few pages more: adapters get evicted
    need = max(big.pool.pages_for_tokens(len(p) + sp.max_new_tokens)
               + (big.pool.pages_for_adapter(big._adapters[a]) if a else 0) for p, a in cases)
    need = max([need] + [big.pool.pages_for_adapter(a) for a in big._adapters.values()])
    pages = need + rng.randint(0, 6)
    eng = engine(num_pages=pages, page_size=page_size, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                 kv_watermark=rng.choice([0.0, 0.05]), prefix_caching=rng.random() < 0.5,
                 enable_chunked_prefill=True)
    plans = _record_plans(eng)
    reqs = _requests(cases, sp)
    arrive = sorted(rng.randrange(0, 12) for _ in reqs)
    aborts = {i: rng.randrange(0, 20) for i in range(len(reqs)) if rng.random() < 0.2}
    tokens = {r.request_id: [] for r in reqs}
    reasons: dict[str, str] = {}
    for step in range(2000):
        for i, r in enumerate(reqs):
            if arrive[i] == step:
                eng.submit(r)
            if aborts.get(i) == step:
                eng.abort(r.request_id)
        for ev in eng.step():
            if ev.token_id is not None:
                tokens[ev.request_id].append(ev.token_id)
            if ev.finish_reason is not None:
                reasons[ev.request_id] = ev.finish_reason
        eng.pool.check()
        if len(reasons) == len(reqs):
            break
    assert len(reasons) == len(reqs)
    assert max(p[0] for p in plans) <= budget
    for r, ref in zip(reqs, reference):
        if reasons[r.request_id] != "abort":
            assert tuple(tokens[r.request_id]) == ref.token_ids
    pool = eng.pool
    assert eng.stats()["running"] == eng.stats()["waiting"] == 0 and pool.kv_pages_used == 0
    assert all(r.users == 0 for r in pool.resident_adapters())
    assert pool.num_free + pool.adapter_pages_used == pool.num_pages


def test_chunked_prefill_with_triton_kernels_equals_hf_peft(make_engine, hf_reference):
    """Later chunks (starting inside a page) attend over their earlier chunks' pages through the
    Triton paged prefill kernel (interpreter, fp32; on a GPU the test above), in steps shared
    with first chunks and decode rows."""
    cases = LONG[:3] + CASES[:1]
    sp = SamplingParams(max_new_tokens=3, temperature=0.0)
    engine = make_engine(num_pages=96, page_size=4, max_num_seqs=4, max_num_batched_tokens=7,
                         prefix_caching=False, enable_chunked_prefill=True, backend="triton")
    plans = _record_plans(engine)
    got = _run_arriving(engine, _requests(cases, sp), {0: [0, 1], 2: [2], 5: [3]})
    for (prompt, adapter), out in zip(cases, got):
        assert list(out) == hf_reference.generate(prompt, adapter, 3), (adapter, len(prompt))
    _check_chunking(plans, 7, 4)
    engine.pool.check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_chunked_prefill_on_gpu_equals_hf_peft(model_dir, adapter_dirs, hf_reference):
    """On a GPU (fp32, Triton kernels, decode CUDA graphs): chunked prefill sharing steps with
    graphed decode steps gives the unchunked engine's and HF + PEFT's greedy tokens."""

    def engine(**cfg):
        return Engine.from_pretrained(str(model_dir), adapter_dirs, EngineConfig(num_pages=96, page_size=4,
                                                                                 max_num_seqs=4, **cfg),
                                      device="cuda", dtype=torch.float32)

    whole = engine(enable_chunked_prefill=False, max_num_batched_tokens=64)
    chunked = engine(max_num_batched_tokens=6, enable_chunked_prefill=True)
    plans = _record_plans(chunked)
    got = _run_arriving(chunked, _requests(MIXED), ARRIVE)
    assert got == _run_arriving(whole, _requests(MIXED), ARRIVE)
    for (prompt, adapter), out in zip(MIXED, got):
        assert list(out) == hf_reference.generate(prompt, adapter, GREEDY.max_new_tokens), (adapter, len(prompt))
    _check_chunking(plans, 6, 4)
    assert chunked.runner.graphs is not None
    whole.close()
    chunked.close()
