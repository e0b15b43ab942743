"""The overlapped decode (``EngineTuning.async_decode``): a decode-only step launched before the
previous step's tokens are read gives every request the tokens, texts, finish reasons and
logprobs of the engine that reads each step before planning the next, while requests arrive,
stop on stop tokens and strings mid-batch (their row in the step ahead is discarded), hit
their length, are aborted with a step in flight, or are preempted in a tiny pool; the pool
ends with no page leaked."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_lorafusion.serving import GenerationRequest, SamplingParams

ADAPTER_CHOICES = [None, "all4", "attn2", "mlp8"]


def _requests(engine, seed: int, n: int) -> list[GenerationRequest]:
    """Random prompts and adapters; greedy, seeded sampling, penalties and logprobs mixed; stop
    ids and stop strings that end some requests early; lengths 1..14."""
    rng = random.Random(seed)
    vocab = [engine.tokenizer.convert_ids_to_tokens(i) for i in range(engine.model_config.vocab_size)]
    out = []
    for i in range(n):
        kind = i % 4
        extra = {}
        if kind == 1:
            extra = dict(temperature=0.9, top_p=0.9, seed=1000 + i)
        elif kind == 2:
            extra = dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4)
        elif kind == 3:
            extra = dict(temperature=0.0, logprobs=2)
        else:
            extra = dict(temperature=0.0)
        stop = (rng.choice(vocab[4:]),) if rng.random() < 0.3 else ()
        sp = SamplingParams(max_new_tokens=rng.randint(1, 14), ignore_eos=rng.random() < 0.5, stop=stop,
                            stop_token_ids=tuple(rng.sample(range(4, 64), rng.randint(0, 3))), **extra)
        prompt = [rng.randrange(4, 64) for _ in range(rng.randint(1, 12))]
        out.append(GenerationRequest(prompt_token_ids=prompt, adapter=rng.choice(ADAPTER_CHOICES), sampling=sp,
                                     request_id=f"r{i}"))
    return out


def _drive(engine, requests, arrive_every: int, abort: dict[int, str] | None = None, max_calls: int = 400,
           per_batch: int = 3):
    """Submit ``requests`` ``per_batch`` at a time (one batch every ``arrive_every`` step calls), abort
    the named request at the given call, step until all ended -> request id -> (token ids,
    text, finish reason, logprobs, top logprobs) and the request ids in finishing order."""
    abort = abort or {}
    results, pending = {}, list(requests)
    ended = []
    streams: dict[str, list] = {r.request_id: [] for r in requests}

    def on_event(event):
        assert event.request_id not in ended, "an event after the request's last one"
        streams[event.request_id].append((event.token_id, event.text))
        if event.finish_reason is not None:
            ended.append(event.request_id)

    keep = engine._keep_results
    for r in requests:
        keep[r.request_id] = None
    for call in range(max_calls):
        if call % arrive_every == 0 and pending:
            for r in pending[:per_batch]:
                engine.submit(r, on_event)
            pending = pending[per_batch:]
        if call in abort:
            engine.abort(abort[call])
        engine.step()
        if not pending and len(ended) == len(requests):
            break
    assert len(ended) == len(requests), "not every request ended"
    while engine._has_work():  # a step ahead whose rows all stopped: read, every row discarded
        engine.step()
    for r in requests:
        res = keep.pop(r.request_id)
        results[r.request_id] = (res.token_ids, res.text, res.finish_reason, res.logprobs, res.top_logprobs,
                                 res.prompt_logprobs)
        # the stream carries the result: every token (the stop token too) and the text in pieces
        tokens = [t for t, _ in streams[r.request_id] if t is not None]
        assert tokens == list(res.token_ids) and "".join(x for _, x in streams[r.request_id]) == res.text
    return results


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        ids, text, reason, lps, tops, prompt_lps = a[rid]
        ids2, text2, reason2, lps2, tops2, prompt_lps2 = b[rid]
        assert (ids, text, reason) == (ids2, text2, reason2), rid
        if prompt_lps is None:
            assert prompt_lps2 is None
        else:
            assert prompt_lps2[0] is prompt_lps[0] is None
            assert prompt_lps2[1:] == pytest.approx(prompt_lps[1:], rel=1e-5, abs=1e-6), rid
        if lps is None:
            assert lps2 is None
        else:
            assert lps2 == pytest.approx(lps, rel=1e-5, abs=1e-6), rid
            assert [sorted(t) for t in tops] == [sorted(t) for t in tops2], rid


def _assert_pool_empty(engine) -> None:
    engine.pool.check()
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["kv_pages_used"] == 0
    assert engine._inflight is None


@pytest.mark.parametrize("seed,arrive_every", [(0, 2), (1, 5), (2, 1)])
def test_overlapped_decode_equals_the_step_by_step_engine(make_engine, seed, arrive_every):
    config = dict(num_pages=160, page_size=4, max_num_seqs=8, prefix_caching=False)
    sync, overlap = make_engine(async_decode="off", **config), make_engine(async_decode="on", **config)
    assert not sync._overlap and overlap._overlap
    reqs = _requests(sync, seed, 18)
    want = _drive(sync, reqs, arrive_every)
    got = _drive(overlap, reqs, arrive_every)
    _assert_same(want, got)
    stats = overlap.stats()
    assert stats["decode_steps_ahead_total"] > 0  # the overlap ran
    assert sync.stats()["decode_steps_ahead_total"] == 0
    reasons = {v[2] for v in want.values()}
    assert reasons == {"stop", "length"}  # both kinds of ending happened mid-batch
    for engine in (sync, overlap):
        _assert_pool_empty(engine)


def test_a_stop_token_mid_batch_discards_one_row(make_engine):
    """Six greedy requests decoding together; one stops on a stop token after its 3rd token, one
    on a stop string after its 4th: each has a row in the step launched ahead that is discarded, and
    every output equals the step-by-step engine's."""
    config = dict(num_pages=160, page_size=4, max_num_seqs=8, prefix_caching=False)
    sync, overlap = make_engine(async_decode="off", **config), make_engine(async_decode="on", **config)
    free = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [([5 + i, 9, 17 + i], ADAPTER_CHOICES[i % 4]) for i in range(6)]
    plain = sync.generate([GenerationRequest(prompt_token_ids=p, adapter=a, sampling=free) for p, a in prompts])
    ids1, ids4 = list(plain[1].token_ids), list(plain[4].token_ids)
    def first_new(ids, start):  # the first token at index >= start not seen before it
        return next(i for i in range(start, len(ids)) if ids[i] not in ids[:i])

    stop_id = ids1[first_new(ids1, 3)]
    words4 = sync.tokenizer.convert_ids_to_tokens(ids4)
    stop_word = words4[first_new(ids4, 4)]
    samplings = [free] * 6
    samplings[1] = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_id,))
    samplings[4] = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop_word,))
    reqs = [GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sp, request_id=f"s{i}")
            for i, ((p, a), sp) in enumerate(zip(prompts, samplings))]
    want, got = _drive(sync, reqs, 100), _drive(overlap, reqs, 100)
    _assert_same(want, got)
    assert want["s1"][2] == want["s4"][2] == "stop"
    assert len(want["s1"][0]) == ids1.index(stop_id) + 1 < 12
    stats = overlap.stats()
    assert stats["decode_rows_discarded_total"] == 2
    # every decode step but the first and the one whose rows reach their length ran ahead
    assert stats["decode_steps_ahead_total"] >= 9
    _assert_pool_empty(overlap)


def test_rows_reaching_their_length_leave_the_step_planned_ahead(make_engine):
    """Requests of six lengths decoding together: each step planned ahead leaves out the rows
    whose last token the running step samples, so no decode step waits for the host (the
    first is planned while the prefill step runs) until the last row ends; the rows that go on (greedy, seeded sampling,
    penalties with min_tokens) are rebuilt for the smaller batch one token ahead of their
    states (draw counters, generated counts) and give the step-by-step engine's outputs."""
    config = dict(num_pages=160, page_size=4, max_num_seqs=8, prefix_caching=False)
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_k=20, seed=5),
             dict(temperature=0.7, seed=9, repetition_penalty=1.2, min_tokens=4),
             dict(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3), dict(temperature=1.0, seed=2),
             dict(temperature=0.9, top_p=0.8, seed=3, min_tokens=2)]
    reqs = [GenerationRequest(prompt_token_ids=[6 + i, 20, 33 - i], adapter=ADAPTER_CHOICES[i % 4],
                              sampling=SamplingParams(max_new_tokens=3 + 2 * i, **kinds[i]), request_id=f"n{i}")
            for i in range(6)]
    sync, overlap = make_engine(async_decode="off", **config), make_engine(async_decode="on", **config)
    want, got = _drive(sync, reqs, 100, per_batch=6), _drive(overlap, reqs, 100, per_batch=6)
    _assert_same(want, got)
    stats = overlap.stats()
    if all(v[2] == "length" for v in want.values()):  # (an EOS draw would end a row early)
        decode_steps = stats["steps_total"] - stats["prefill_steps_total"]
        assert stats["decode_steps_ahead_total"] == decode_steps  # the first one after the prefill too
    # every token but 0-3 stops this one once 4 are out: it must stop at its 5th exactly, also
    # when the batch is rebuilt (n0 leaving) while its 4th token is in flight
    edge = GenerationRequest(prompt_token_ids=[9, 14, 27], adapter="mlp8", request_id="n6", sampling=SamplingParams(
        max_new_tokens=10, temperature=0.0, min_tokens=4, stop_token_ids=tuple(range(4, 64))))
    reqs = [GenerationRequest(prompt_token_ids=r.prompt_token_ids, adapter=r.adapter, sampling=r.sampling,
                              request_id=r.request_id + "b") for r in reqs] + [edge]
    want, got = _drive(sync, reqs, 100, per_batch=7), _drive(overlap, reqs, 100, per_batch=7)
    _assert_same(want, got)
    assert want["n6"][2] == "stop" and len(want["n6"][0]) == 5
    assert stats["decode_steps_ahead_total"] >= 8
    _assert_pool_empty(overlap)


@pytest.mark.parametrize("seed", [3, 4])
def test_overlapped_decode_with_chunked_prefill_and_prompt_logprobs(make_engine, seed):
    """Chunked prefill under a small token budget (a step whose prefill chunk leaves tokens for
    later is read before the next is planned), prompt logprobs on some requests, and steps
    with prefill rows left running (the next decode step planned ahead over their rows, in
    their order): the step-by-step engine's outputs."""
    config = dict(num_pages=200, page_size=4, max_num_seqs=8, prefix_caching=False, enable_chunked_prefill=True,
                  max_num_batched_tokens=12)
    sync, overlap = make_engine(async_decode="off", **config), make_engine(async_decode="on", **config)
    reqs = _requests(sync, seed, 14)
    reqs = [GenerationRequest(prompt_token_ids=list(r.prompt_token_ids) * 2, adapter=r.adapter, request_id=r.request_id,
                              sampling=SamplingParams(**{**_fields(r.sampling), "prompt_logprobs": 2 if i % 5 == 0
                                                         else None}))
            for i, r in enumerate(reqs)]
    want, got = _drive(sync, reqs, 3), _drive(overlap, reqs, 3)
    _assert_same(want, got)
    stats = overlap.stats()
    assert stats["prefill_chunks_total"] > 0 and stats["decode_steps_ahead_total"] > 0
    assert any(v[5] is not None for v in want.values())
    _assert_pool_empty(overlap)


def test_the_step_after_a_mixed_step_is_planned_ahead(make_engine):
    """Three requests decode; a fourth arrives and is prefilled beside them (its row sampled
    first, theirs after): the decode step after that mixed step is planned while it runs, over
    its rows in its order (not the scheduler's), and so is every other decode step; outputs
    equal the step-by-step engine's."""
    config = dict(num_pages=200, page_size=4, max_num_seqs=8, prefix_caching=False)
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    reqs = [GenerationRequest(prompt_token_ids=[4 + 7 * i, 11, 25 + i], adapter=ADAPTER_CHOICES[i], sampling=sp,
                              request_id=f"m{i}") for i in range(4)]
    sync, overlap = make_engine(async_decode="off", **config), make_engine(async_decode="on", **config)
    want, got = _drive(sync, reqs, 5), _drive(overlap, reqs, 5)  # three at step 0, the fourth at step 5
    _assert_same(want, got)
    stats = overlap.stats()
    assert stats["prefill_steps_total"] == 2
    assert stats["decode_steps_ahead_total"] == stats["steps_total"] - stats["prefill_steps_total"]
    _assert_pool_empty(overlap)


def _fields(sp: SamplingParams) -> dict:
    import dataclasses

    return {f.name: getattr(sp, f.name) for f in dataclasses.fields(sp)}


def test_a_request_aborted_with_its_step_in_flight(make_engine):
    """An abort that lands while a step ahead holds the request's row: it ends "abort", its row's
    token is discarded, the others are unchanged."""
    config = dict(num_pages=160, page_size=4, max_num_seqs=8, prefix_caching=False)
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    reqs = [GenerationRequest(prompt_token_ids=[5 + i, 9, 17 + i], adapter=ADAPTER_CHOICES[i % 4], sampling=sp,
                              request_id=f"a{i}") for i in range(6)]
    sync, overlap = make_engine(async_decode="off", **config), make_engine(async_decode="on", **config)
    want = _drive(sync, reqs, 100)
    got = _drive(overlap, reqs, 100, abort={5: "a2"})
    assert got["a2"][2] == "abort" and 0 < len(got["a2"][0]) < 12
    assert list(got["a2"][0]) == list(want["a2"][0][:len(got["a2"][0])])
    del want["a2"], got["a2"]
    _assert_same(want, got)
    _assert_pool_empty(overlap)


def test_overlapped_decode_in_a_pool_that_preempts(make_engine):
    """A pool too small for every running request's growth: the step ahead is refused when the
    next pages are not free, the engine reads the running step and preempts as before."""
    config = dict(num_pages=24, page_size=2, max_num_seqs=8, kv_watermark=0.0, prefix_caching=False)
    sp = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True)
    reqs = [GenerationRequest(prompt_token_ids=[4 + 3 * i, 9, 17, 30 - i], adapter=None, sampling=sp,
                              request_id=f"p{i}") for i in range(6)]
    sync = make_engine(with_adapters=False, async_decode="off", **config)
    overlap = make_engine(with_adapters=False, async_decode="on", **config)
    want = _drive(sync, reqs, 100)
    got = _drive(overlap, reqs, 100)
    _assert_same(want, got)
    assert overlap.stats()["preemptions_total"] > 0 and overlap.stats()["decode_steps_ahead_total"] > 0
    _assert_pool_empty(overlap)


def test_overlapped_decode_with_prefix_caching(make_engine):
    """Prefix caching on: requests finishing with a step in flight register their pages (the
    token fed by the discarded row included); a second batch with the same prompts reuses
    them and gives the same outputs as the step-by-step engine."""
    config = dict(num_pages=200, page_size=2, max_num_seqs=8, prefix_caching=True)
    sync, overlap = make_engine(async_decode="off", **config), make_engine(async_decode="on", **config)
    reqs = _requests(sync, 7, 12)
    for engine in (sync, overlap):
        engine._round = [_drive(engine, reqs, 3)]
    again = [GenerationRequest(prompt_token_ids=list(r.prompt_token_ids), adapter=r.adapter, sampling=r.sampling,
                               request_id=r.request_id + "x") for r in reqs]
    for engine in (sync, overlap):
        engine._round.append(_drive(engine, again, 100))
    for a, b in zip(sync._round, overlap._round):
        _assert_same(a, b)
    assert overlap.stats()["prefix_cache_hits_total"] > 0
    for engine in (sync, overlap):
        engine.pool.check()
        assert engine.stats()["kv_pages_used"] == 0


def test_async_decode_setting_is_checked():
    from lightning_lorafusion.serving.config import EngineTuning
    from lightning_lorafusion.specs import ConfigError

    with pytest.raises(ConfigError, match="async_decode"):
        EngineTuning(async_decode="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: pinned copies, events, CUDA graphs")
@pytest.mark.parametrize("seed", [0, 1])
def test_overlapped_decode_on_a_gpu_with_graphs(make_engine, seed):
    """On a GPU (fp32, Triton kernels, decode CUDA graphs): the step ahead replays the graph fed
    by a device-to-device token copy, its inputs come from the pinned mirrors in turn, the
    running step's tokens reach the host by a pinned copy and an event; outputs equal the
    step-by-step engine's, with stops mid-batch."""
    config = dict(num_pages=160, page_size=4, max_num_seqs=8, prefix_caching=False, backend="triton",
                  cuda_graphs="on")
    sync, overlap = make_engine(async_decode="off", **config), make_engine(async_decode="on", **config)
    assert overlap.runner.graphs is not None and overlap.device.type == "cuda"
    reqs = _requests(sync, seed, 18)
    _assert_same(_drive(sync, reqs, 4), _drive(overlap, reqs, 4))
    assert overlap.stats()["decode_steps_ahead_total"] > 0
    _assert_pool_empty(overlap)
