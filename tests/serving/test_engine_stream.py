"""Async streaming: concurrent consumers share the background loop's batches; early close aborts."""

from __future__ import annotations

import asyncio

from lightning_lorafusion.serving import SamplingParams

from test_generation import CASES, _requests

SP = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


def test_concurrent_streams_get_their_own_tokens_incrementally(make_engine):
    engine = make_engine(num_pages=96, page_size=4)
    expected = [r.token_ids for r in engine.generate(_requests(CASES[:4], SP))]
    order: list[str] = []

    async def consume(req):
        events = []
        async for ev in engine.stream(req):
            order.append(req.request_id)
            events.append(ev)
        return events

    async def main():
        reqs = _requests(CASES[:4], SP)
        return reqs, await asyncio.gather(*(consume(r) for r in reqs))

    reqs, all_events = asyncio.run(main())
    for req, events, tokens in zip(reqs, all_events, expected):
        assert tuple(e.token_id for e in events) == tokens
        assert [e.finish_reason for e in events] == [None] * 5 + ["length"]
        assert "".join(e.text for e in events) == "".join(
            " " + w for w in engine.tokenizer.convert_ids_to_tokens(list(tokens)))
    # consumers were served as the tokens came, interleaved, not one request after another
    first_done = min(max(i for i, rid in enumerate(order) if rid == r.request_id) for r in reqs)
    assert len(set(order[:first_done + 1])) == len(reqs)
    # generate() while the loop thread runs waits for it instead of stepping itself
    assert [r.token_ids for r in engine.generate(_requests(CASES[:2], SP))] == expected[:2]
    engine.close()


def test_closing_a_stream_aborts_its_request(make_engine):
    engine = make_engine(num_pages=96, page_size=4)

    async def main():
        req = _requests([CASES[1]], SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True))[0]
        got = []
        stream = engine.stream(req)
        async for ev in stream:
            got.append(ev)
            if len(got) == 2:
                break
        await stream.aclose()
        for _ in range(200):
            if engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0:
                break
            await asyncio.sleep(0.01)
        return got

    got = asyncio.run(main())
    assert len(got) == 2
    stats = engine.stats()
    assert stats["running"] == 0 and stats["kv_pages_used"] == 0
    assert stats["generated_tokens_total"] < 50
    engine.close()
