"""Prefix caching: full KV pages shared per adapter; same outputs, fewer pages, LRU eviction."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.serving import Engine, EngineConfig, GenerationRequest, SamplingParams
from lightning_lorafusion.serving.config import EngineTuning
from lightning_lorafusion.serving.pool import prefix_page_keys

from test_generation import GREEDY, _requests

SYSTEM = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 32, 38, 46]  # 13 tokens: 3 full pages of 4
SUFFIXES = [[2, 7], [18, 28, 18, 28, 45], [1], [59, 4, 23], [60, 61, 62, 63, 1, 2, 3, 4]]


def _shared_cases():
    adapters = [None, "all4", "attn2"]
    return [(SYSTEM + sfx, adapters[i % 3]) for i, sfx in enumerate(SUFFIXES + SUFFIXES[::-1])]


def _run_arriving(engine, reqs, arrive_at):
    tokens = {r.request_id: [] for r in reqs}
    finished = set()
    for step in range(200):
        for i in arrive_at.get(step, []):
            engine.submit(reqs[i])
        for ev in engine.step():
            if ev.token_id is not None:
                tokens[ev.request_id].append(ev.token_id)
            if ev.finish_reason is not None:
                finished.add(ev.request_id)
        if len(finished) == len(reqs):
            break
    assert len(finished) == len(reqs)
    return [tuple(tokens[r.request_id]) for r in reqs]


def test_shared_system_prompt_same_outputs_with_and_without_prefix_caching(make_engine, hf_reference):
    cases = _shared_cases()
    arrive_at = {0: [0, 1], 3: [2, 3], 6: [4], 12: [5, 6, 7], 20: [8, 9]}
    off = _run_arriving(make_engine(num_pages=96, page_size=4, prefix_caching=False), _requests(cases), arrive_at)
    engine = make_engine(num_pages=96, page_size=4)
    on = _run_arriving(engine, _requests(cases), arrive_at)
    assert on == off
    for (prompt, adapter), out in list(zip(cases, on))[4:7]:  # hits, against HF + PEFT too
        assert list(out) == hf_reference.generate(prompt, adapter, GREEDY.max_new_tokens)
    stats = engine.stats()
    assert stats["prefix_cache_hits_total"] >= 5 and stats["prefix_tokens_reused_total"] >= 5 * 12
    assert stats["kv_pages_used"] == 0 and stats["prefix_pages_cached"] > 0
    engine.pool.check()


def _admit(engine, prompt, adapter):
    """Submit and run one step (the prefill); -> the request's state."""
    req = GenerationRequest(prompt_token_ids=prompt, adapter=adapter,
                            sampling=SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
    engine.submit(req)
    engine.step()
    return next(s for s in engine.scheduler.running if s.request_id == req.request_id)


def test_page_counts_show_sharing_per_adapter(make_engine):
    engine = make_engine(num_pages=200, page_size=4, kv_watermark=0.0)
    pool = engine.pool
    a = _admit(engine, SYSTEM + [1, 2, 3], "all4")  # 16 tokens -> 4 pages, 4 registered
    assert len(a.pages) == 4 and engine.stats()["prefix_cache_hits_total"] == 0
    used = pool.kv_pages_used
    b = _admit(engine, SYSTEM + [4, 5], "all4")  # same adapter: shares the 3 system pages
    assert b.pages[:3] == a.pages[:3] and b.pages[3] != a.pages[3]
    assert pool.kv_pages_used - used == 2  # b's one new page + a's page for its 17th token (a decoded)
    assert engine.stats()["prefix_tokens_reused_total"] == 12
    used = pool.kv_pages_used
    c = _admit(engine, SYSTEM + [4, 5], "attn2")  # another adapter: shares nothing
    assert not set(c.pages) & set(a.pages + b.pages) and pool.kv_pages_used - used == len(c.pages)
    base = _admit(engine, SYSTEM + [4, 5], None)  # nor does the base
    assert not set(base.pages) & set(a.pages + b.pages + c.pages)
    assert engine.stats()["prefix_cache_hits_total"] == 1
    shared = list(a.pages[:3])
    while engine.stats()["running"]:
        engine.step()
    assert pool.kv_pages_used == 0 and set(shared) <= set(pool._cached)  # kept after the requests finished
    d = _admit(engine, SYSTEM + [9], "all4")  # reuses the cached pages of finished requests
    assert d.pages[:3] == shared and engine.stats()["prefix_cache_hits_total"] == 2
    pool.check()


def test_prompt_logprobs_requests_do_not_reuse(make_engine):
    engine = make_engine(num_pages=96, page_size=4)
    engine.generate(_requests([(SYSTEM + [1], "mlp8")]))
    sp = SamplingParams(max_new_tokens=2, temperature=0.0, prompt_logprobs=True)
    scored = engine.generate(_requests([(SYSTEM + [2], "mlp8")], sp))[0]
    assert engine.stats()["prefix_cache_hits_total"] == 0
    ref = make_engine(num_pages=96, page_size=4, prefix_caching=False).generate(
        _requests([(SYSTEM + [2], "mlp8")], sp))[0]
    assert scored.prompt_logprobs == ref.prompt_logprobs and scored.token_ids == ref.token_ids


def test_cached_pages_evicted_under_pool_pressure(make_engine):
    # distinct 12-token prefixes per request fill the cache; 40 pages (adapters take 2 + 16)
    cases = [([(7 * i + j) % 64 for j in range(12)] + [i % 5 + 1], a)
             for i in range(10) for a in ("attn2", "all4", None)]
    cases += cases[:6]  # repeats that hit if their pages survived
    ref = make_engine(num_pages=200, page_size=4, prefix_caching=False).generate(_requests(cases))
    engine = make_engine(num_pages=40, page_size=4)
    out = engine.generate(_requests(cases))
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    stats = engine.stats()
    assert stats["prefix_pages_evicted_total"] > 0 and stats["kv_pages_used"] == 0
    assert stats["prefix_pages_cached"] + stats["adapter_pages_used"] <= 40
    engine.pool.check()


def test_readded_adapter_never_hits_the_old_prefix(make_engine, adapter_dirs):
    engine = make_engine(num_pages=96, page_size=4)
    prompt = SYSTEM + [5, 6]
    first = engine.generate(_requests([(prompt, "attn2")]))[0]
    engine.remove_adapter("attn2")
    engine.step()  # retires it
    engine.add_adapter("attn2", adapter_dirs["attn2"])
    again = engine.generate(_requests([(prompt, "attn2")]))[0]
    assert engine.stats()["prefix_cache_hits_total"] == 0
    assert again.token_ids == first.token_ids  # same weights, so the same tokens, computed afresh
    engine.generate(_requests([(prompt, "attn2")]))
    assert engine.stats()["prefix_cache_hits_total"] == 1  # the re-added one caches its own prefix


def test_prefix_attention_equals_full_causal_attention():
    """New queries over [cached prefix + new] K/V in scattered pages equal the rows of causal
    attention over the whole sequence, with and without a sliding window (GQA)."""
    from lightning_lorafusion.kernels.paged_attention import paged_prefix_attention_reference
    from lightning_lorafusion.model.attention import sdpa_varlen_loop

    g = torch.Generator().manual_seed(0)
    n_total, start, s, hq, hkv, d = 11, 8, 4, 4, 2, 8
    q, k, v = (torch.randn(n_total, h, d, generator=g) for h in (hq, hkv, hkv))
    pool = torch.zeros(6, 2, 2, s, hkv, d)  # [P, L, 2, S, Hkv, D]
    pages = torch.tensor([4, 1, 3])
    for pos in range(n_total):
        pool[pages[pos // s], 1, 0, pos % s] = k[pos]
        pool[pages[pos // s], 1, 1, pos % s] = v[pos]
    for window in (None, 5):
        full = sdpa_varlen_loop(q, k, v, torch.tensor([0, n_total]), scale=0.3, sliding_window=window)
        got = paged_prefix_attention_reference(q[start:], pool, 1, pages, start, scale=0.3, sliding_window=window)
        torch.testing.assert_close(got, full[start:], rtol=1e-5, atol=1e-6)


def test_reset_prefix_cache_frees_cached_pages_and_stops_hits(make_engine):
    engine = make_engine(num_pages=96, page_size=4)
    prompt = SYSTEM + [5, 6]
    first = engine.generate(_requests([(prompt, "all4")]))[0]
    cached = engine.stats()["prefix_pages_cached"]
    # the prompt's pages and those filled while decoding (the last token's KV is never written)
    assert cached == (len(prompt) + len(first.token_ids) - 1) // 4
    free_before = engine.pool.num_free
    assert engine.reset_prefix_cache() == cached
    assert engine.stats()["prefix_pages_cached"] == 0 and engine.pool.num_free == free_before  # cached counted free
    again = engine.generate(_requests([(prompt, "all4")]))[0]
    assert engine.stats()["prefix_cache_hits_total"] == 0 and again.token_ids == first.token_ids
    engine.pool.check()


# step 1's prefill layout: (varlen rows, prefill rows, decode rows, the paged launch's
# (cu_seqlens, starts)): varlen: the fresh prompts' rows (6 + 14) first, then the hits' new
# tokens (4 and 6) after 12 cached each; paged: all four in one launch, in scheduling order
MIXED_STEP = {"varlen": (20, 30, 2, ([0, 4, 10], [12, 12])),
              "paged": (0, 30, 2, ([0, 4, 10, 16, 30], [12, 0, 12, 0]))}


@pytest.mark.parametrize("prefill_attention", ["varlen", "paged"])
def test_prefix_hits_fresh_prompts_and_decodes_in_one_triton_step(model_dir, adapter_dirs, hf_reference,
                                                                  prefill_attention):
    """Triton kernels in fp32 (the interpreter on CPU; the GPU where there is one): one step
    prefills two prefix hits (the paged prefill kernel, both in one launch per layer) next to
    two fresh prompts (varlen, or with ``prefill_attention="paged"`` in that same launch) and
    two decoding requests; every request's tokens equal HF + PEFT's."""
    engine = Engine.from_pretrained(str(model_dir), adapter_dirs,
                                    EngineConfig(num_pages=96, page_size=4, backend="triton",
                                                 tuning=EngineTuning(prefill_attention=prefill_attention)),
                                    device="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.float32)
    try:
        _check_mixed_triton_step(engine, hf_reference, MIXED_STEP[prefill_attention])
    finally:
        engine.close()


def _check_mixed_triton_step(engine, hf_reference, layout):
    sp = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    cases = [(SYSTEM + [1], "all4"), (SYSTEM + [2, 3], None),  # step 0: fill the cache, then decode
             (SYSTEM + [18, 28, 45], "all4"), ([7, 13, 21, 33, 45, 50], "attn2"),  # step 1: hit, fresh
             (SYSTEM + [59, 4, 23, 60, 61], None), (SYSTEM + [9], "mlp8")]  # hit (6 new rows), fresh
    steps = []
    prepare = engine.runner.prepare

    def recording_prepare(prefill, decode, *args, **kwargs):
        batch = prepare(prefill, decode, *args, **kwargs)
        pre = batch.prefill_prefixes
        steps.append((batch.num_fresh_rows, batch.num_prefill_rows, len(decode),
                      None if pre is None else (pre.cu_seqlens.tolist(), pre.starts.tolist())))
        return batch

    engine.runner.prepare = recording_prepare
    reqs = [GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sp) for p, a in cases]
    out = _run_arriving(engine, reqs, {0: [0, 1], 1: [2, 3, 4, 5]})
    assert steps[1] == layout
    for (prompt, adapter), tokens in zip(cases, out):
        assert list(tokens) == hf_reference.generate(prompt, adapter, 3), adapter
    assert engine.stats()["prefix_cache_hits_total"] == 2
    engine.pool.check()


# Pages filled while decoding: a next chat turn (prompt = previous prompt + answer + new text),
# a resent completion or a preempted request's re-admission reuses them like prompt pages.

TURN1 = SYSTEM + [2, 7]  # 15 tokens: 3 full prompt pages of 4
USER2 = [18, 28, 45]


def _pages_at_finish(engine) -> dict[str, list[int]]:
    """request id -> its page list just before it finished (``Scheduler.finish`` wrapped)."""
    seen: dict[str, list[int]] = {}
    finish = engine.scheduler.finish

    def recording(state):
        seen[state.request_id] = list(state.pages)
        finish(state)

    engine.scheduler.finish = recording
    return seen


def _two_turns(engine, adapter, later_adapter=None):
    """Turn 1, then (under ``later_adapter``, default the same) turn 2 = turn 1's prompt +
    answer + new text and turn 1's prompt + answer resent alone; -> the three results."""
    turn1 = engine.generate(_requests([(TURN1, adapter)]))[0]
    history = TURN1 + list(turn1.token_ids)
    later = adapter if later_adapter is None else later_adapter
    return [turn1, *engine.generate(_requests([(history + USER2, later), (history, later)]))]


def test_next_turn_reuses_the_pages_filled_while_decoding(make_engine, hf_reference):
    """With prefix caching, turn 2 (and the resent completion) take turn 1's 3 prompt pages and
    the 3 filled while decoding its 10-token answer (every page but the one holding the answer's
    last token, whose KV was never written); tokens equal those without prefix caching and
    HF + PEFT's."""
    off = _two_turns(make_engine(num_pages=96, page_size=4, prefix_caching=False), "all4")
    engine = make_engine(num_pages=96, page_size=4)
    pages = _pages_at_finish(engine)
    on = _two_turns(engine, "all4")
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    history = TURN1 + list(on[0].token_ids)
    for prompt, res in zip([TURN1, history + USER2, history], on):
        assert list(res.token_ids) == hf_reference.generate(prompt, "all4", GREEDY.max_new_tokens)
    written = (len(history) - 1) // 4  # 6 pages: 3 of the prompt, 3 filled while decoding
    assert written == 6 and len(TURN1) // 4 == 3
    first, second, resent = (pages[r.request_id] for r in on)
    assert second[:written] == first[:written] and resent[:written] == first[:written]
    assert not set(second[written:]) & set(first) and not set(resent[written:]) & set(first)
    stats = engine.stats()
    assert stats["prefix_cache_hits_total"] == 2 and stats["prefix_tokens_reused_total"] == 2 * 4 * written
    engine.pool.check()


def test_next_turn_under_another_adapter_reuses_nothing(make_engine):
    """Turn 2 under another adapter (attn2's LoRA touches v; mlp8's leaves k and v alone: not
    shared either) or the base takes none of turn 1's pages, prompt or decoded; under turn 1's
    adapter it takes them all."""
    engine = make_engine(num_pages=96, page_size=4)
    pages = _pages_at_finish(engine)
    turn1 = engine.generate(_requests([(TURN1, "all4")]))[0]
    history = TURN1 + list(turn1.token_ids)
    cached = set(engine.pool._cached)
    assert len(cached) == (len(history) - 1) // 4 and cached == set(pages[turn1.request_id][:len(cached)])
    for other in ("attn2", "mlp8", None):
        for res in engine.generate(_requests([(history + USER2, other), (history, other)])):
            assert not set(pages[res.request_id]) & cached
    assert engine.stats()["prefix_cache_hits_total"] == 0
    same = engine.generate(_requests([(history + USER2, "all4")]))[0]
    assert set(pages[same.request_id][:len(cached)]) == cached
    assert engine.stats()["prefix_cache_hits_total"] == 1
    engine.pool.check()


def test_pages_registered_while_decoding_hold_their_tokens_kv(make_engine):
    """A request that ends on a stop string: exactly its pages whose every token's KV was
    written are registered (keyed by the token ids they hold), and each holds the keys and
    values a fresh prefill of the same tokens computes (fp32)."""
    ref = make_engine(num_pages=96, page_size=4, prefix_caching=False)
    free = ref.generate(_requests([(TURN1, "all4")]))[0]
    words = ref.tokenizer.convert_ids_to_tokens(list(free.token_ids))
    stop = f"{words[6]} {words[7]}"
    engine = make_engine(num_pages=96, page_size=4)
    sp = SamplingParams(max_new_tokens=10, temperature=0.0, stop=(stop,))
    stopped = engine.generate(_requests([(TURN1, "all4")], sp))[0]
    cut = free.text.find(stop)
    assert stopped.finish_reason == "stop" and stopped.text == free.text[:cut]
    ids = TURN1 + list(stopped.token_ids)
    assert len(stopped.token_ids) == free.text[:cut + len(stop)].count(" ") < 10
    written = (len(ids) - 1) // 4  # the last token's KV is never written
    keys = prefix_page_keys(engine._adapters["all4"].key, ids, 4, len(ids) // 4)
    cached = engine.pool.match_prefix(keys)
    assert len(cached) == written > len(TURN1) // 4 and engine.stats()["prefix_pages_cached"] == written
    pages = _pages_at_finish(ref)
    prefill = ref.generate(_requests([(ids, "all4")], SamplingParams(max_new_tokens=1, temperature=0.0)))[0]
    fresh = pages[prefill.request_id][:written]
    torch.testing.assert_close(engine.pool.kv[cached], ref.pool.kv[fresh], rtol=1e-5, atol=1e-5)


def test_a_request_arriving_mid_decode_reuses_pages_just_filled(make_engine):
    """A page is registered as soon as the request that filled it by decoding needs its next
    page: a request sent while the first still runs, with its prompt and tokens so far, reuses
    the prompt pages and the pages filled since."""
    engine = make_engine(num_pages=96, page_size=4)
    pages = _pages_at_finish(engine)
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    first = _requests([(TURN1, "all4")], sp)[0]
    engine.submit(first)
    tokens = []
    while len(tokens) < 6:  # 21 tokens, KV written for 20: 5 full pages (the 5th registered next step)
        tokens += [e.token_id for e in engine.step() if e.request_id == first.request_id]
    second = _requests([(TURN1 + tokens + USER2, "all4")], sp)[0]
    engine.submit(second)
    engine.step()
    assert engine.stats()["running"] == 2 and engine.stats()["prefix_tokens_reused_total"] == 5 * 4
    while engine.stats()["running"]:
        engine.step()
    assert pages[second.request_id][:5] == pages[first.request_id][:5]
    engine.pool.check()


def test_a_preempted_request_reuses_the_pages_it_decoded(make_engine):
    """KV pages run out while requests decode: a preempted request's pages stay cached, and its
    re-admission (prompt + generated tokens) reuses pages it filled while decoding rather
    than recomputing them; every output equals the engine's without prefix caching."""
    from test_chunked_prefill import LONG

    sp = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True)
    cases = [(p, None) for p, _ in LONG]
    off = make_engine(False, num_pages=16, page_size=4, kv_watermark=0.0, prefix_caching=False)
    reference = off.generate(_requests(cases, sp))
    engine = make_engine(False, num_pages=16, page_size=4, kv_watermark=0.0)
    readmitted = []
    admit = engine.scheduler._admit

    def recording(state):
        admitted = admit(state)
        if admitted and state.output_ids:  # a re-admission after a preemption
            readmitted.append((len(state.request.prompt_token_ids), state.num_cached))
        return admitted

    engine.scheduler._admit = recording
    results = engine.generate(_requests(cases, sp))
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    assert off.stats()["preemptions_total"] > 0 and engine.stats()["preemptions_total"] > 0
    assert any(cached > prompt // 4 * 4 for prompt, cached in readmitted), readmitted
    engine.pool.check()


def test_next_turn_with_triton_kernels_equals_hf_peft(make_engine, hf_reference):
    """Triton kernels in fp32 (the interpreter on CPU, the GPU where there is one): pages whose
    KV the decode kernels wrote are attended by the next turn's paged prefill; every turn's
    tokens equal HF + PEFT's."""
    engine = make_engine(num_pages=96, page_size=4, backend="triton")
    turn1, second, resent = _two_turns(engine, "all4")  # LoRA on k and v too
    history = TURN1 + list(turn1.token_ids)
    for prompt, res in zip([TURN1, history + USER2, history], [turn1, second, resent]):
        assert list(res.token_ids) == hf_reference.generate(prompt, "all4", GREEDY.max_new_tokens)
    assert engine.stats()["prefix_tokens_reused_total"] == 2 * 4 * ((len(history) - 1) // 4)
    engine.pool.check()
