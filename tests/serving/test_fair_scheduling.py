"""``EngineConfig.scheduling="fair"``: which requests are admitted first when one adapter floods
the queue and others send light traffic (admission order, no timings), and the tokens stay
those of FIFO scheduling."""

from __future__ import annotations

import pytest

from lightning_lorafusion.serving import EngineConfig, GenerationRequest, SamplingParams
from lightning_lorafusion.serving.fair_share import OUTPUT_WEIGHT, PROMPT_WEIGHT, FairShare
from lightning_lorafusion.specs import ConfigError

FLOOD = "all4"
LIGHT = ["attn2", "mlp8", None]  # None: the base model is a tenant too
NEW = 3


def _request(rid: str, adapter: str | None, prompt=(5, 9, 17, 30)) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=prompt, adapter=adapter, request_id=rid,
                             sampling=SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))


def _admission_order(engine, submit_between_steps=None) -> list[str]:
    """Run to completion; request ids in the order the scheduler admitted them.
    ``submit_between_steps(step, engine)`` may submit more requests before a step."""
    order: list[str] = []
    step = 0
    while True:
        if submit_between_steps is not None:
            submit_between_steps(step, engine)
        if not (engine.scheduler.has_work() or engine._incoming):
            break
        engine.step()
        step += 1
        for state in engine.scheduler.running:
            if state.request_id not in order:
                order.append(state.request_id)
    return order


def _flood_then_light(make_engine, scheduling: str):
    engine = make_engine(backend="torch", max_num_seqs=2, max_num_batched_tokens=64, scheduling=scheduling,
                         prefix_caching=False, async_decode="off")
    for i in range(10):
        engine.submit(_request(f"flood{i}", FLOOD))
    for j, adapter in enumerate(LIGHT):
        engine.submit(_request(f"light{j}", adapter))
    return engine


def test_fifo_admits_the_flood_before_light_tenants(make_engine):
    order = _admission_order(_flood_then_light(make_engine, "fifo"))
    assert order == [f"flood{i}" for i in range(10)] + ["light0", "light1", "light2"]


def test_fair_admits_each_light_tenant_before_the_flood_backlog(make_engine):
    order = _admission_order(_flood_then_light(make_engine, "fair"))
    # all start at 0 service: the flood's first request (earliest), then each light tenant, whose
    # service stays below the flood's, then the backlog
    assert order == ["flood0", "light0", "light1", "light2"] + [f"flood{i}" for i in range(1, 10)]


@pytest.mark.parametrize("scheduling", ["fifo", "fair"])
def test_prefetch_follows_the_admission_order(make_engine, scheduling):
    engine = _flood_then_light(make_engine, scheduling)
    engine.step()  # admits two requests, then pages in the adapters of those next in line
    resident = {r.adapter.name for r in engine.pool.resident_adapters()}
    assert ("mlp8" in resident) == (scheduling == "fair")  # FIFO: ten flood requests come first


def test_fair_light_arrival_mid_flood_waits_for_at_most_one_flood_admission(make_engine):
    engine = make_engine(backend="torch", max_num_seqs=2, max_num_batched_tokens=64, scheduling="fair",
                         prefix_caching=False, async_decode="off")
    for i in range(12):
        engine.submit(_request(f"flood{i}", FLOOD))

    def arrivals(step, eng):
        if step == 6:  # the flood has been served for a while; this tenant was idle (service 0)
            eng.submit(_request("late", "attn2"))
        if step == 9:  # a returning tenant sends a burst: no credit for its idle time
            for k in range(4):
                eng.submit(_request(f"burst{k}", "mlp8"))

    order = _admission_order(engine, arrivals)
    # each request holds a slot for 3 steps (prefill + 2 decodes): flood0-3 were admitted by
    # step 6. "late" is lifted to the flood's service; the tie goes to the earlier arrival
    # (flood4), then "late" is next. The burst is lifted likewise and alternates with the flood
    # instead of taking every slot for its idle time.
    assert order == ["flood0", "flood1", "flood2", "flood3", "flood4", "late", "flood5", "burst0", "flood6",
                     "burst1", "flood7", "burst2", "flood8", "burst3", "flood9", "flood10", "flood11"]


@pytest.mark.parametrize("scheduling", ["fifo", "fair"])
def test_fair_scheduling_changes_the_order_not_the_tokens(make_engine, scheduling):
    reference = make_engine(backend="torch", prefix_caching=False, async_decode="off")
    engine = _flood_then_light(make_engine, scheduling)
    outputs = {}
    while engine.scheduler.has_work() or engine._incoming:
        for e in engine.step():
            outputs.setdefault(e.request_id, []).append(e.token_id)
    for rid in ("flood0", "flood9", "light0", "light1", "light2"):
        adapter = FLOOD if rid.startswith("flood") else LIGHT[int(rid[-1])]
        alone = reference.generate([_request(rid, adapter)])[0]
        assert [t for t in outputs[rid] if t is not None] == list(alone.token_ids), rid


def test_counters_lift_and_charge():
    from types import SimpleNamespace

    def state(adapter):
        return SimpleNamespace(request=SimpleNamespace(adapter=adapter))

    fair = FairShare()
    a1, a2, b1 = state("a"), state("a"), state("b")
    fair.queued(a1, [])
    fair.queued(a2, [])
    fair.charge_prefill(a1, 10)
    fair.charge_decode([a1, a1])
    assert fair.service["a"] == 10 * PROMPT_WEIGHT + 2 * OUTPUT_WEIGHT
    fair.queued(b1, [])  # b arrives while a waits: lifted to a's service, not 0
    assert fair.service["b"] == fair.service["a"]
    assert fair.next() is a1 and fair.heads() == [a1, b1]  # equal service: the earlier arrival
    fair.remove(a1)
    fair.charge_prefill(a1, 1)
    assert fair.next() is b1 and fair.heads() == [b1, a2]
    fair.remove(b1)
    fair.remove(a2)
    assert fair.next() is None


def test_scheduling_value_is_checked():
    with pytest.raises(ConfigError, match="scheduling='round_robin'; allowed: fifo, fair"):
        EngineConfig(scheduling="round_robin")
