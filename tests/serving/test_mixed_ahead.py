"""Mixed steps planned ahead (``EngineTuning.mixed_ahead``): with the overlapped decode, a step
that admits queued requests is planned and launched before the running step's tokens are read,
its decode rows fed those tokens on the device. Every request gets the tokens, texts, finish
reasons and logprobs of the engine that reads each step before planning the next (and of the
overlapped engine without it), while requests finish, arrive, stop mid-batch, are preempted or
prefilled in chunks; where the scheduler cannot tell what it would admit (an adapter to page
in, fair picks) the step waits for the tokens as before."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.serving.config import EngineTuning
from lightning_lorafusion.specs import ConfigError

from test_overlapped_decode import _assert_pool_empty, _assert_same, _drive, _requests


def _three(make_engine, **config):
    """The step-by-step engine, the overlapped one without mixed steps ahead, and with them."""
    return (make_engine(async_decode="off", **config), make_engine(async_decode="on", mixed_ahead="off", **config),
            make_engine(async_decode="on", **config))


@pytest.mark.parametrize("seed,arrive_every,mixed", [(0, 2, "off"), (1, 3, "eager")])
def test_mixed_steps_ahead_equal_the_step_by_step_engine(make_engine, seed, arrive_every, mixed):
    """Arrivals every few steps while others decode and finish (lengths, stop ids and strings),
    sampling, penalties and logprobs mixed; one eager forward and the padded pieces (decode rows
    first, their tokens copied into rows [0, B) on the device)."""
    config = dict(num_pages=200, page_size=4, max_num_seqs=6, prefix_caching=False, mixed_graphs=mixed)
    sync, off, on = _three(make_engine, **config)
    assert on.mixed_ahead and not off.mixed_ahead and not sync.mixed_ahead
    reqs = _requests(sync, seed, 12)
    want = _drive(sync, reqs, arrive_every)
    _assert_same(want, _drive(off, reqs, arrive_every))
    _assert_same(want, _drive(on, reqs, arrive_every))
    assert on.stats()["mixed_steps_ahead_total"] > 0
    assert off.stats()["mixed_steps_ahead_total"] == sync.stats()["mixed_steps_ahead_total"] == 0
    for engine in (sync, off, on):
        _assert_pool_empty(engine)


def test_a_full_batch_admits_ahead_as_rows_reach_their_length(make_engine):
    """More requests than running slots, every one greedy to its length: each row that ends
    frees its slot for the next queued request in the step planned ahead (the scheduler counts
    the rows ending with the running step as gone), so every step after the first is launched
    before the one before it is read; outputs equal the step-by-step engine's."""
    config = dict(num_pages=200, page_size=4, max_num_seqs=4, prefix_caching=False)
    sync, off, on = _three(make_engine, **config)
    reqs = [GenerationRequest(prompt_token_ids=[5 + i, 9, 17 + 2 * i], adapter=[None, "all4", "attn2", "mlp8"][i % 4],
                              sampling=SamplingParams(max_new_tokens=2 + (3 * i) % 5, temperature=0.0,
                                                      ignore_eos=True), request_id=f"f{i}")
            for i in range(8)]
    want = _drive(sync, reqs, 100, per_batch=8)
    _assert_same(want, _drive(off, reqs, 100, per_batch=8))
    _assert_same(want, _drive(on, reqs, 100, per_batch=8))
    stats = on.stats()
    assert stats["mixed_steps_ahead_total"] == stats["prefill_steps_total"] - 1 > 0
    assert stats["mixed_steps_ahead_total"] + stats["decode_steps_ahead_total"] == stats["steps_total"] - 1
    _assert_pool_empty(on)


def test_mixed_steps_ahead_in_a_pool_that_preempts(make_engine):
    """A pool too small for every running request: an admission whose pages are not free now
    (before the rows ending give theirs back) is not planned ahead, growth that needs a
    preemption is not either; outputs equal the step-by-step engine's."""
    config = dict(num_pages=24, page_size=2, max_num_seqs=8, kv_watermark=0.0, prefix_caching=False)
    sp = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True)
    reqs = [GenerationRequest(prompt_token_ids=[4 + 3 * i, 9, 17, 30 - i], adapter=None, sampling=sp,
                              request_id=f"p{i}") for i in range(8)]
    sync, off, on = _three(make_engine, with_adapters=False, **config)
    want = _drive(sync, reqs, 3, per_batch=2)
    _assert_same(want, _drive(off, reqs, 3, per_batch=2))
    _assert_same(want, _drive(on, reqs, 3, per_batch=2))
    assert on.stats()["preemptions_total"] > 0
    _assert_pool_empty(on)


def test_mixed_steps_ahead_with_chunked_prefill_and_prefix_caching(make_engine):
    """Chunked prefill under a small budget (admissions ahead take the budget's chunk; a request
    whose prefill is under way stops the planning ahead) and prefix caching (the second batch of
    requests reuses the first's pages): outputs equal the step-by-step engine's."""
    config = dict(num_pages=240, page_size=2, max_num_seqs=6, prefix_caching=True, enable_chunked_prefill=True,
                  max_num_batched_tokens=24)
    sync, off, on = _three(make_engine, **config)
    reqs = _requests(sync, 11, 12)
    again = [GenerationRequest(prompt_token_ids=list(r.prompt_token_ids), adapter=r.adapter, sampling=r.sampling,
                               request_id=r.request_id + "x") for r in reqs]
    rounds = {e: [_drive(e, reqs, 2), _drive(e, again, 2)] for e in (sync, off, on)}
    for engine in (off, on):
        for a, b in zip(rounds[sync], rounds[engine]):
            _assert_same(a, b)
    assert on.stats()["mixed_steps_ahead_total"] > 0 and on.stats()["prefix_cache_hits_total"] > 0
    for engine in (sync, off, on):
        engine.pool.check()
        assert engine.stats()["kv_pages_used"] == 0


def test_admissions_paging_in_their_adapter_and_fair_picks(make_engine):
    """Three base requests decode; one on an adapter not yet resident arrives (nothing pages it
    in ahead: ``prefetch_depth`` 0, no prefetch ahead), then a second on the same adapter.
    Without prefix caching both steps are planned ahead, the first paging its adapter into the
    free run ``page_in`` would take anyway (counted as a prefetch miss, as reading first
    would); with prefix caching the first waits for the running step's tokens (where pages go
    depends on the cache), the second's adapter is resident by then. Fair scheduling never
    plans an admission ahead (its picks depend on the charges made as it admits)."""
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    base = [GenerationRequest(prompt_token_ids=[4 + i, 13, 21], adapter=None, sampling=sp, request_id=f"b{i}")
            for i in range(3)]
    late = [GenerationRequest(prompt_token_ids=[7, 30 + i], adapter="mlp8", sampling=sp, request_id=f"l{i}")
            for i in range(2)]
    calls = {0: base, 3: late[:1], 6: late[1:]}
    for caching, ahead in ((False, 2), (True, 1)):
        config = dict(num_pages=200, page_size=4, max_num_seqs=8, prefix_caching=caching, prefetch_depth=0,
                      prefetch_ahead="off")
        sync, off, on = _three(make_engine, **config)
        want = _drive_at(sync, calls)
        _assert_same(want, _drive_at(off, calls))
        _assert_same(want, _drive_at(on, calls))
        stats = on.stats()
        assert stats["prefill_steps_total"] == 3 and stats["mixed_steps_ahead_total"] == ahead
        assert stats["adapter_prefetch_misses_total"] == sync.stats()["adapter_prefetch_misses_total"] == 1
        on.pool.check()
    fair = make_engine(async_decode="on", scheduling="fair", **config)
    _assert_same(want, _drive_at(fair, calls))
    assert fair.stats()["mixed_steps_ahead_total"] == 0 and fair.stats()["decode_steps_ahead_total"] > 0


def test_arrivals_held_back_ahead_as_reading_first_would(make_engine):
    """Prefill coalescing (``prefill_wait_steps`` 2): arrivals one call apart while six rows
    decode are held back and admitted together; planned ahead, the scheduler holds and admits
    them at the same steps as reading first would (greedy to their lengths: the same plans),
    so the held steps, the prefill steps and every output are the same."""
    sp = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    first = [GenerationRequest(prompt_token_ids=[5 + i, 11, 19 + i], adapter=[None, "all4"][i % 2], sampling=sp,
                               request_id=f"c{i}") for i in range(6)]
    late = [GenerationRequest(prompt_token_ids=[8, 40 + i], adapter=[None, "attn2"][i % 2], sampling=sp,
                              request_id=f"d{i}") for i in range(3)]
    calls = {0: first, 3: late[:1], 4: late[1:2], 5: late[2:]}
    config = dict(num_pages=200, page_size=4, max_num_seqs=12, prefix_caching=False, prefill_wait_steps=2)
    sync, off, on = _three(make_engine, **config)
    want = _drive_at(sync, calls)
    _assert_same(want, _drive_at(off, calls))
    _assert_same(want, _drive_at(on, calls))
    assert on.scheduler.held_steps == sync.scheduler.held_steps > 0
    assert on.stats()["prefill_steps_total"] == sync.stats()["prefill_steps_total"]
    assert on.stats()["mixed_steps_ahead_total"] > 0


def _drive_at(engine, calls: dict[int, list[GenerationRequest]]) -> dict:
    """Submit ``calls[i]`` before step call i; step until every request ended -> ``_drive``'s results."""
    order = [r for i in sorted(calls) for r in calls[i]]
    keep = engine._keep_results
    for r in order:
        keep[r.request_id] = None
    for call in range(400):
        for r in calls.get(call, []):
            engine.submit(r)
        engine.step()
        if call > max(calls) and not engine._has_work():
            break
    out = {}
    for r in order:
        res = keep.pop(r.request_id)
        out[r.request_id] = (res.token_ids, res.text, res.finish_reason, res.logprobs, res.top_logprobs,
                             res.prompt_logprobs)
    return out


def test_mixed_ahead_setting_is_checked_and_needs_the_overlapped_decode(make_engine):
    with pytest.raises(ConfigError, match="mixed_ahead"):
        EngineTuning(mixed_ahead="yes")
    engine = make_engine(async_decode="off", num_pages=64, page_size=4)
    assert not engine.mixed_ahead
    engine.mixed_ahead = True  # (no overlapped decode: stays off)
    assert not engine.mixed_ahead
    engine = make_engine(async_decode="on", num_pages=64, page_size=4)
    assert engine.mixed_ahead
    engine.mixed_ahead = False
    assert not engine.mixed_ahead


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: pinned copies, events, CUDA graphs")
def test_mixed_steps_ahead_on_a_gpu_with_graphs(make_engine):
    """On a GPU (fp32, Triton kernels, decode graphs and captured mixed-step pieces): the step
    admitting requests ahead copies the running step's tokens into its padded rows on the
    device; outputs equal the step-by-step engine's, with stops mid-batch."""
    config = dict(num_pages=160, page_size=4, max_num_seqs=6, prefix_caching=False, backend="triton",
                  cuda_graphs="on", max_num_batched_tokens=64)
    sync, on = make_engine(async_decode="off", **config), make_engine(async_decode="on", **config)
    assert on.runner.graphs is not None
    reqs = _requests(sync, 2, 14)
    _assert_same(_drive(sync, reqs, 2), _drive(on, reqs, 2))
    assert on.stats()["mixed_steps_ahead_total"] > 0
    _assert_pool_empty(on)
