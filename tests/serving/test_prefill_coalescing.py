"""Prefill coalescing (``EngineConfig.prefill_wait_steps``): arrivals a few steps apart are
prefilled in one step while others decode; outputs are unchanged and nobody waits longer than
the limit."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_lorafusion.serving import EngineConfig
from lightning_lorafusion.specs import ConfigError

from test_generation import CASES, GREEDY, _requests
from test_prefix_cache import _run_arriving


def _run(engine, reqs, arrive_at: dict[int, list[int]]):
    """``_run_arriving`` with the plans recorded: -> (tokens per request, {request index: step its
    prefill ran}, plans as (prefill, decode) counts)."""
    index = {r.request_id: i for i, r in enumerate(reqs)}
    admitted: dict[int, int] = {}
    plans: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def recorded():
        plan = schedule()
        for state in plan.prefill:
            admitted.setdefault(index[state.request.request_id], len(plans))
        plans.append((len(plan.prefill), len(plan.decode)))
        return plan

    engine.scheduler.schedule = recorded
    try:
        tokens = _run_arriving(engine, reqs, arrive_at)
    finally:
        engine.scheduler.schedule = schedule
    return tokens, admitted, plans


# four requests decode from step 0; three more arrive one step apart
ARRIVE = {0: [0, 1, 2, 3], 2: [4], 3: [5], 4: [6]}
SEVEN = CASES + [([9, 3, 27, 41], "attn2")]


def test_arrivals_are_prefilled_together_and_outputs_unchanged(make_engine, hf_reference):
    plain, admitted0, _ = _run(make_engine(num_pages=96, page_size=4), _requests(SEVEN), ARRIVE)
    engine = make_engine(num_pages=96, page_size=4, prefill_wait_steps=3)
    held, admitted, plans = _run(engine, _requests(SEVEN), ARRIVE)
    assert held == plain
    for (prompt, adapter), out in zip(SEVEN, held):
        assert list(out) == hf_reference.generate(prompt, adapter, GREEDY.max_new_tokens)
    assert [admitted0[i] for i in (4, 5, 6)] == [2, 3, 4]  # without coalescing: one eager step each
    # the first arrival (step 2) waits 3 steps; the two behind it join the same prefill
    assert [admitted[i] for i in (4, 5, 6)] == [5, 5, 5]
    assert sum(1 for p, _ in plans if p) == 2
    stats = engine.stats()
    assert stats["prefill_steps_total"] == 2 and stats["prefill_held_steps_total"] == 3
    assert stats["kv_pages_used"] == 0 and stats["running"] == 0
    # the step counters: rows and steps as planned, time split between prefill and decode steps
    ran = [p + d for p, d in plans if p + d]
    assert stats["steps_total"] == len(ran) and stats["step_rows_total"] == sum(ran)
    # prefill steps' seconds are part of all steps' (no wall-clock outcome: only non-negative)
    assert 0 <= stats["prefill_step_seconds_total"] <= stats["step_seconds_total"]
    assert stats["first_tokens_total"] == len(SEVEN) and stats["ttft_seconds_total"] >= 0
    engine.pool.check()


def test_an_idle_engine_admits_at_once(make_engine):
    engine = make_engine(num_pages=96, page_size=4, prefill_wait_steps=5)
    _, admitted, _ = _run(engine, _requests(CASES[:2]), {0: [0], 1: [1]})
    # nothing decodes before step 0: admitted there; at step 1 one row decodes and one arrives
    # (as many arrivals as decoding rows): no point in holding it back
    assert admitted == {0: 0, 1: 1}
    assert engine.stats()["prefill_held_steps_total"] == 0


def test_arrivals_as_many_as_the_decoding_rows_go_in_at_once(make_engine):
    engine = make_engine(num_pages=96, page_size=4, prefill_wait_steps=8)
    _, admitted, _ = _run(engine, _requests(SEVEN[:4]), {0: [0, 1], 2: [2], 3: [3]})
    assert admitted[2] == 3  # one arrival, two rows decoding: held one step, then the second came
    assert admitted[3] == 3


@pytest.mark.parametrize("prompt_len, admitted_at", [(8, 2), (7, 5)])
def test_a_full_budget_of_prompts_goes_in_at_once(make_engine, prompt_len, admitted_at):
    """Four rows decode in a budget of 12 tokens: 8 are left, which an 8-token prompt fills (no
    point in waiting for company); a 7-token prompt is held its 3 steps."""
    engine = make_engine(num_pages=96, page_size=4, max_num_seqs=8, max_num_batched_tokens=12,
                         prefill_wait_steps=3)
    first = [CASES[0], CASES[5], CASES[3], CASES[5]]  # 3 + 2 + 5 + 2 = 12 tokens: one step
    reqs = _requests(first + [(list(range(1, prompt_len + 1)), None)])
    _, admitted, _ = _run(engine, reqs, {0: [0, 1, 2, 3], 2: [4]})
    assert set(admitted.values()) == {0, admitted_at}


@pytest.mark.parametrize("bad", [-1, -5])
def test_negative_wait_is_refused(bad):
    with pytest.raises(ConfigError, match="prefill_wait_steps"):
        EngineConfig(prefill_wait_steps=bad)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(1, 6), steps=st.lists(st.integers(0, 14), min_size=len(SEVEN), max_size=len(SEVEN)))
def test_random_arrivals_same_outputs_and_bounded_wait(make_engine_session, k, steps):
    arrive: dict[int, list[int]] = {}
    for i, s in enumerate(steps):
        arrive.setdefault(s, []).append(i)
    plain, _, _ = _run(make_engine_session(0), _requests(SEVEN), arrive)
    engine = make_engine_session(k)
    held, admitted, plans = _run(engine, _requests(SEVEN), arrive)
    assert held == plain
    for i, s in enumerate(steps):
        assert s <= admitted[i] <= s + k, (i, s, admitted[i])
    assert engine.stats()["kv_pages_used"] == 0
    engine.pool.check()


@pytest.fixture
def make_engine_session(make_engine):
    """Engines of the property test: one per wait setting, reused across examples (the pool
    returns to empty after every run)."""
    cache = {}

    def get(k: int):
        if k not in cache:
            cache[k] = make_engine(num_pages=96, page_size=4, prefix_caching=False, prefill_wait_steps=k)
        return cache[k]

    return get
