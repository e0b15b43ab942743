"""Adapters paged in ahead of admission (``EngineTuning.prefetch_ahead``): which adapters are
paged in while the step before their admission runs, that nothing is evicted for it and the
next admissions' KV room is kept, the hit / miss / wasted counters, and unchanged tokens."""

from __future__ import annotations

import pytest

from lightning_lorafusion.serving import EngineConfig, GenerationRequest, SamplingParams
from lightning_lorafusion.serving.config import EngineTuning
from lightning_lorafusion.specs import ConfigError

NEW = 3


def _request(rid: str, adapter: str | None, prompt=(5, 9, 17, 30), new: int = NEW) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=list(prompt), adapter=adapter, request_id=rid,
                             sampling=SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))


def _resident(engine) -> set[str]:
    return {r.adapter.name for r in engine.pool.resident_adapters()}


def _run(engine, events=()) -> dict[str, list[int]]:
    """Step to the end -> each request's tokens (``events``: of steps already run)."""
    tokens: dict[str, list[int]] = {}
    for _ in range(200):
        for ev in events:
            if ev.token_id is not None:
                tokens.setdefault(ev.request_id, []).append(ev.token_id)
        if not engine.has_work():
            break
        events = engine.step()
    assert not engine.has_work()
    return tokens


ADAPTERS = ["all4", "all4", "attn2", "mlp8", "attn2"]


def _two_slots(make_engine, ahead: str, **config):
    """Two running requests at a time, no queued request within ``prefetch_depth`` (0): what is
    paged in early is what the next step could admit."""
    engine = make_engine(backend="torch", max_num_seqs=2, max_num_batched_tokens=64, prefetch_depth=0,
                         prefix_caching=False, num_pages=96, page_size=4, prefetch_ahead=ahead, **config)
    for i, adapter in enumerate(ADAPTERS):
        engine.submit(_request(f"r{i}", adapter))
    return engine


@pytest.mark.parametrize("async_decode", ["off", "on"])
def test_the_next_admissions_adapters_are_paged_in_while_the_step_before_runs(make_engine, async_decode):
    engine = _two_slots(make_engine, "on", async_decode=async_decode)
    first = engine.step()  # admits r0 and r1; r2 and r3 are the most the next step could admit
    assert _resident(engine) == {"all4", "attn2", "mlp8"}
    assert engine.stats()["adapter_prefetches_total"] == 2
    tokens = _run(engine, first)
    stats = engine.stats()
    # r2 and r3 found theirs paged in; r0 paged all4 in itself (r1 and r4: resident, in use)
    assert (stats["adapter_prefetch_hits_total"], stats["adapter_prefetch_misses_total"]) == (2, 1)
    assert stats["adapter_prefetch_wasted_total"] == 0 and stats["adapter_page_ins_total"] == 3
    # the same tokens as without prefetching ahead, and as each request alone
    off = _two_slots(make_engine, "off", async_decode=async_decode)
    first = off.step()
    assert _resident(off) == {"all4"}  # prefetch_depth 0: nothing paged in early
    assert _run(off, first) == tokens
    assert off.stats()["adapter_prefetch_misses_total"] == 3 and off.stats()["adapter_prefetch_hits_total"] == 0
    alone = make_engine(backend="torch", prefix_caching=False, num_pages=96, page_size=4)
    for i, adapter in enumerate(ADAPTERS):
        assert list(alone.generate([_request(f"a{i}", adapter)])[0].token_ids) == tokens[f"r{i}"]
    engine.pool.check()


@pytest.mark.parametrize("ahead", ["on", "off"])
def test_prefetch_copies_are_issued_after_the_step_is_launched(make_engine, ahead):
    """Ahead: the next admissions' page-ins come after the step's forward is queued (a copy
    queued before it would hold its own host-to-device copies back); before: in ``schedule``."""
    engine = make_engine(backend="torch", max_num_seqs=2, max_num_batched_tokens=64, prefetch_depth=8,
                         prefix_caching=False, num_pages=96, page_size=4, prefetch_ahead=ahead, async_decode="off")
    for i, adapter in enumerate(ADAPTERS):
        engine.submit(_request(f"r{i}", adapter))
    seen = []
    forward = engine.runner.forward

    def recording(batch):
        seen.append(_resident(engine))
        return forward(batch)

    engine.runner.forward = recording
    engine.step()
    assert seen == [{"all4"} if ahead == "on" else {"all4", "attn2", "mlp8"}]
    assert _resident(engine) == {"all4", "attn2", "mlp8"}


def test_the_window_ends_at_the_next_steps_slots(make_engine):
    engine = make_engine(backend="torch", max_num_seqs=1, max_num_batched_tokens=64, prefetch_depth=0,
                         prefix_caching=False, num_pages=96, page_size=4, async_decode="off")
    for i, adapter in enumerate(["all4", "attn2", "mlp8"]):
        engine.submit(_request(f"r{i}", adapter))
    engine.step()  # r0 runs: the next step admits r1 at most
    assert _resident(engine) == {"all4", "attn2"}


def test_the_window_ends_at_the_next_steps_token_budget(make_engine):
    engine = make_engine(backend="torch", max_num_seqs=4, max_num_batched_tokens=8, prefetch_depth=0,
                         prefix_caching=False, num_pages=96, page_size=4, async_decode="off")
    engine.submit(_request("r0", "all4"))
    engine.submit(_request("r1", "attn2", prompt=(3, 4, 5, 6, 7, 8, 9, 10)))  # the whole budget
    engine.submit(_request("r2", "mlp8"))  # a step after r1's at the earliest
    engine.step()
    assert _resident(engine) == {"all4", "attn2"}


def test_prefetch_evicts_nothing(make_engine):
    # 40 pages: mlp8 (22) runs with its KV; all4 (16) would need the idle attn2 (2) evicted
    engine = make_engine(backend="torch", max_num_seqs=1, max_num_batched_tokens=64, prefix_caching=False,
                         num_pages=40, page_size=4, kv_watermark=0.0, async_decode="off")
    _run_one(engine, "attn2")
    engine.submit(_request("used", "mlp8", new=6))
    engine.submit(_request("next", "all4"))
    engine.step()
    assert _resident(engine) == {"attn2", "mlp8"}  # all4 waits for its admission
    assert engine.stats()["adapter_evictions_total"] == 0
    assert engine.stats()["adapter_prefetches_total"] == 0
    _run(engine)
    engine.pool.check()


def _run_one(engine, adapter: str) -> None:
    engine.generate([_request("first", adapter, new=1)])


@pytest.mark.parametrize("ahead", ["on", "off"])
def test_prefetch_ahead_leaves_the_next_admissions_kv_room(make_engine, ahead):
    # 28 pages: attn2 (2) and its 2 KV pages run; all4 (16) fits the 24 free pages, but its
    # request's 40-token prompt then needs 10 of the 8 left
    engine = make_engine(backend="torch", max_num_seqs=1, max_num_batched_tokens=64, prefix_caching=False,
                         num_pages=28, page_size=4, kv_watermark=0.0, async_decode="off", prefetch_ahead=ahead)
    engine.submit(_request("now", "attn2", new=3))
    engine.submit(_request("next", "all4", prompt=[(7 * i) % 60 + 2 for i in range(40)]))
    engine.step()
    # before prefetching ahead, the first queued requests' adapters went in regardless of their KV
    assert ("all4" in _resident(engine)) == (ahead == "off")
    _run(engine)
    engine.pool.check()


def test_prefetch_ahead_and_host_tables_are_checked():
    with pytest.raises(ConfigError, match="prefetch_ahead"):
        EngineTuning(prefetch_ahead="yes")
    with pytest.raises(ConfigError, match="host_tables"):
        EngineTuning(host_tables="pinned")
    with pytest.raises(ConfigError, match=r"EngineConfig\.tuning\.prefetch_ahead"):  # passed flat
        EngineConfig(prefetch_ahead="off")
    assert EngineConfig(tuning={"host_tables": "separate"}).tuning.host_tables == "separate"
