"""The engine step's host fast paths equal the row-by-row rules they replace: one page allocation
for all decode rows, step inputs advanced from the last step's tokens, the per-row stop and
length rule (stop strings spanning tokens included), logprobs of only the rows that ask, the
detokenizer's single-token text cache."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.serving.detokenize import IncrementalDetokenizer
from lightning_lorafusion.serving.engine_step import _SampledRows
from lightning_lorafusion.serving.pool import UnifiedPool, prefix_page_keys

CASES = [([5, 9, 17], None), ([11, 4, 30, 22, 8, 19, 40], "all4"), ([7, 13, 21, 33, 45, 50, 6, 12, 28], "attn2"),
         ([60, 2, 35, 18, 26], "mlp8"), ([44, 41, 10, 20, 30, 40, 50, 15, 25], "all4"), ([8, 16], "mlp8")]


def _pool(num_pages: int = 64) -> UnifiedPool:
    return UnifiedPool(num_pages=num_pages, page_size=2, num_layers=1, num_kv_heads=1, head_dim=2,
                       dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("seed", range(4))
def test_allocate_kv_rows_takes_the_pages_of_one_by_one_calls(seed):
    """Same pages, owners and page lists as ``allocate_kv`` row by row; all or nothing, and
    never by dropping cached prefix pages (the caller then goes row by row)."""
    rng = random.Random(seed)
    pools = [_pool(), _pool()]
    lists = [[[] for _ in range(12)] for _ in pools]
    for pool, ls in zip(pools, lists):  # the same fragmented start, with a few cached prefix pages
        for pages in ls:
            assert pool.allocate_kv(pages, 2)
        keys = prefix_page_keys(None, [1, 2, 3, 4], 2, 2)
        for page, key in zip(ls[0], keys):
            pool.register(page, key)
        for pages in ls[::3]:
            pool.free_kv(pages)
    for _ in range(8):
        rows = rng.sample(range(12), rng.randint(1, 12))
        counts = [rng.randint(0, 2) for _ in rows]
        one_by_one, batched = pools
        free = one_by_one.num_free - one_by_one.kv_pages_cached  # pages free without dropping cached ones
        took = batched.allocate_kv_rows([lists[1][r] for r in rows], counts)
        assert took == (sum(counts) <= free)
        if took:
            for r, n in zip(rows, counts):
                assert one_by_one.allocate_kv(lists[0][r], n)
        assert lists[0] == lists[1]
        assert one_by_one._kv_owner.keys() == batched._kv_owner.keys()
        assert batched.kv_pages_cached == one_by_one.kv_pages_cached == 2
        for pool in pools:
            pool.check()


def _trace(engine, reqs, arrive_at, steps):
    """Step ``engine`` with ``reqs`` arriving at the given steps -> per step, the decode rows
    and their page lists, and every event."""
    plans, events = [], []
    schedule = engine.scheduler.schedule

    def recorded():
        plan = schedule()
        plans.append([(s.request_id, list(s.pages)) for s in plan.decode]
                     + [("prefill", s.request_id, list(s.pages)) for s in plan.prefill])
        return plan

    engine.scheduler.schedule = recorded
    for step in range(steps):
        for i in arrive_at.get(step, []):
            engine.submit(reqs[i])
        events += [(e.request_id, e.token_id, e.text, e.finish_reason) for e in engine.step()]
    return plans, events


def _requests(prefix: str, sampling: SamplingParams):
    return [GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sampling, request_id=f"{prefix}{i}")
            for i, (p, a) in enumerate(CASES)]


@pytest.mark.parametrize("num_pages", [96, 40])
def test_one_allocation_per_step_equals_row_by_row_growth(make_engine, num_pages):
    """The scheduler's one allocation for all decode rows gives the same plans, pages and
    events as growing row by row (``_grow_all`` off), also in a pool so small that rows are
    preempted (where the fast path must step aside)."""
    config = dict(num_pages=num_pages, page_size=4, kv_watermark=0.0, prefix_caching=False)
    sp = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    fast, slow = make_engine(**config), make_engine(**config)
    slow.scheduler._grow_all = lambda plan, prefilling: False
    arrive_at = {0: [0, 1, 2], 2: [3], 5: [4, 5]}
    got = [_trace(e, _requests("r", sp), arrive_at, 120) for e in (fast, slow)]
    assert got[0] == got[1]
    assert sum(r[3] is not None for r in got[0][1]) == len(CASES)  # every request finished
    if num_pages == 40:
        assert fast.stats()["preemptions_total"] > 0  # the row-by-row fallback ran


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("pad", [False, True])
def test_step_inputs_advanced_from_the_last_tokens_equal_a_full_load(make_engine, pad, overlap):
    """Every decode step's input buffer (token, position, KV page per row, padding rows) equals
    what loading each row from its state gives, with the fast path taken on most steps: page
    boundaries every 2 tokens, requests joining and finishing. With the overlapped decode the
    fast path's tokens come from the device, one token ahead of the host's state."""
    engine = make_engine(num_pages=96, page_size=2, async_decode=overlap)
    engine.runner.pad_decode = pad
    inputs = engine.runner.decode_inputs
    load = inputs.load_step
    fast_steps = []
    ahead_steps = []

    def checked(decode, rows, next_tokens=None, token_tensor=None):
        fast_steps.append((next_tokens is not None or token_tensor is not None) and inputs._step_rows == list(decode))
        ahead_steps.append(token_tensor is not None)
        load(decode, rows, next_tokens, token_tensor)
        s = inputs.page_size
        if token_tensor is None:
            expected = [[st.last_token for st in decode], [st.num_tokens - 1 for st in decode],
                        [st.pages[(st.num_tokens - 1) // s] for st in decode]]
        else:  # each row feeds the token the step before sampled, not yet in its state
            expected = [token_tensor.tolist(), [st.num_tokens for st in decode],
                        [st.pages[st.num_tokens // s] for st in decode]]
        pad_rows = rows - len(decode)
        expected = [expected[0] + [0] * pad_rows, expected[1] + [0] * pad_rows,
                    expected[2] + [inputs.scratch_page] * pad_rows]
        assert inputs.step[:, :rows].tolist() == expected

    inputs.load_step = checked
    sp = SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True)
    reqs = _requests("s", sp)
    _trace(engine, reqs, {0: [0, 1], 3: [2, 3], 4: [4], 11: [5]}, 40)
    assert sum(fast_steps) >= len(fast_steps) // 2 and not all(fast_steps)
    assert any(ahead_steps) == (overlap == "on")
    alone = [engine.generate([GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sp)])[0].token_ids
             for p, a in CASES]
    results = engine.generate(_requests("t", sp))
    assert [r.token_ids for r in results] == alone


def _reference_finish(state_like, token, detok) -> str | None:
    """The per-row rule: a stop token (EOS unless ignored, or a stop id) or a stop string
    ends with "stop"; max_new_tokens or the model's context with "length"."""
    sp, out, prompt = state_like["sampling"], state_like["out"], state_like["prompt"]
    if token in state_like["eos"] or token in sp.stop_token_ids:
        return "stop"
    detok.add_token(token)
    if detok.stopped:
        return "stop"
    if len(out) >= sp.max_new_tokens or len(prompt) + len(out) >= state_like["max_len"]:
        return "length"
    return None


@pytest.mark.parametrize("seed", range(3))
def test_emitted_events_follow_the_per_row_stop_rule(make_engine, seed):
    """Random requests (stop ids, stop strings that span two tokens' texts, EOS on or off,
    lengths, a short context) fed random tokens through the engine's emit step: each row ends
    at the step, with the reason, text and deltas that the per-row rule with its own
    detokenizer gives."""
    rng = random.Random(seed)
    max_len = 20
    engine = make_engine(num_pages=96, page_size=4, max_model_len=max_len)
    eos = engine.tokenizer.eos_token_id
    vocab = [engine.tokenizer.convert_ids_to_tokens(i) for i in range(engine.model_config.vocab_size)]
    states, refs = [], []
    for i in range(40):
        prompt = [rng.randrange(4, 64) for _ in range(rng.randint(1, 12))]
        stop = ()
        if rng.random() < 0.5:  # a stop string across a token boundary: "<tail of one word> <head of the next>"
            a, b = rng.choice(vocab[4:]), rng.choice(vocab[4:])
            stop = (f"{a[-1]} {b[:2]}",) if rng.random() < 0.7 else (a,)
        sp = SamplingParams(max_new_tokens=rng.randint(1, 12), temperature=0.0, ignore_eos=rng.random() < 0.5,
                            stop_token_ids=tuple(rng.sample(range(4, 64), rng.randint(0, 2))), stop=stop)
        req = GenerationRequest(prompt_token_ids=prompt, sampling=sp, request_id=f"q{i}")
        with engine._lock:
            state = engine._new_state(req, None)
            engine._states[req.request_id] = state
        states.append(state)
        refs.append({"sampling": sp, "out": [], "prompt": prompt, "max_len": max_len,
                     "eos": frozenset() if sp.ignore_eos else {eos},
                     "detok": IncrementalDetokenizer(engine.tokenizer, prompt, stop), "deltas": [], "end": None})
    live = list(range(len(states)))
    while live:
        tokens = [rng.choice([eos, rng.randrange(4, 64), rng.randrange(4, 12)]) for _ in live]
        events = []
        engine._emit([states[i] for i in live], tokens, _SampledRows([states[i] for i in live], engine.device,
                                                                     engine.model_config.vocab_size),
                     None, None, None, events)
        assert [e.request_id for e in events] == [states[i].request_id for i in live]
        for i, token, event in zip(live, tokens, events):
            ref = refs[i]
            ref["out"].append(token)
            reason = _reference_finish(ref, token, ref["detok"])
            text = ref["detok"].take_delta(final=reason is not None)
            assert (event.token_id, event.finish_reason, event.text) == (token, reason, text), (i, ref["sampling"])
            ref["end"] = reason
        live = [i for i in live if refs[i]["end"] is None]
    for state, ref in zip(states, refs):
        res = state.result()
        assert list(res.token_ids) == ref["out"] and res.text == ref["detok"].text
        assert res.finish_reason == ref["end"]
    assert {r["end"] for r in refs} == {"stop", "length"}
    assert any(r["detok"].stopped for r in refs)  # a stop string ended some request


def test_logprobs_of_some_rows_equal_every_row_asking(make_engine):
    """Logprobs are computed for the rows that ask only: the same values as when every row asks
    (prefix caching off: a cache hit prefills through another attention path)."""
    engine = make_engine(num_pages=96, page_size=4, prefix_caching=False)
    asks = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3)
    plain = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    every = engine.generate(_requests("a", asks))
    some = engine.generate([GenerationRequest(prompt_token_ids=p, adapter=a, sampling=asks if i % 2 else plain,
                                              request_id=f"b{i}") for i, (p, a) in enumerate(CASES)])
    for i, (x, y) in enumerate(zip(every, some)):
        assert x.token_ids == y.token_ids
        if i % 2:
            assert y.logprobs == x.logprobs and y.top_logprobs == x.top_logprobs
        else:
            assert y.logprobs is None


def test_single_token_text_cache_changes_no_text(make_engine):
    """Detokenizing a step's rows with the engine's single-token cache gives the texts and
    deltas of detokenizers fed one token at a time (also after the cache is warm)."""
    from lightning_lorafusion.serving.detokenize import add_tokens

    engine = make_engine(num_pages=96, page_size=4)
    rng = random.Random(0)
    cache: dict[int, str] = {}
    for _ in range(2):
        streams = [[rng.randrange(0, 64) for _ in range(15)] for _ in range(8)]
        stops = [(), ("w1",), ("3 w",), ()] * 2
        alone = [IncrementalDetokenizer(engine.tokenizer, [7, 8], s) for s in stops]
        cached = [IncrementalDetokenizer(engine.tokenizer, [7, 8], s) for s in stops]
        for k in range(15):
            add_tokens([(d, s[k]) for d, s in zip(cached, streams)], cache)
            for d, s, c in zip(alone, streams, cached):
                d.add_token(s[k])
                assert (d.text, d.stopped, d.take_delta()) == (c.text, c.stopped, c.take_delta())
    assert cache and all(cache[t] == engine.tokenizer.decode([t], skip_special_tokens=True) for t in cache)


def test_decode_tables_equal_each_row_looked_up(make_engine):
    """The decode rows' page table and LoRA tables (built in a few array operations when the
    rows change, patched where a row gained a page) equal each row's own pages and adapter:
    requests on three adapters and the base joining and finishing, pages of 2 tokens."""
    engine = make_engine(num_pages=128, page_size=2, async_decode="off")
    inputs = engine.runner.decode_inputs
    load = inputs.load_tables
    checked = []

    def checked_load(decode, pages_moved):
        rebuilt = load(decode, pages_moved)
        b = len(decode)
        for i, st in enumerate(decode):
            assert inputs.page_table[i, :len(st.pages)].tolist() == st.pages
            r = st.resident
            want = (torch.zeros_like(inputs.lora_offsets[..., 0]) if r is None
                    else r.adapter.relative_offsets + r.offset)
            assert torch.equal(inputs.lora_offsets[..., i], want)
            assert inputs.lora_ranks[:, i].tolist() == ([0] * 7 if r is None else r.adapter.module_ranks.tolist())
            assert inputs.lora_scales[i].item() == (0.0 if r is None else pytest.approx(r.adapter.scale))
        assert (inputs.page_table[b:, 0] == inputs.scratch_page).all() and (inputs.lora_ranks[:, b:] == 0).all()
        checked.append(rebuilt)
        return rebuilt

    inputs.load_tables = checked_load
    sp = SamplingParams(max_new_tokens=7, temperature=0.0, ignore_eos=True)
    _trace(engine, _requests("d", sp), {0: [0, 1, 2], 2: [3], 4: [4, 5]}, 30)
    assert any(checked) and not all(checked)  # rebuilt when the rows changed, patched otherwise


@pytest.mark.parametrize("mix", ["greedy", "mixed"])
def test_sampled_rows_gather_what_each_row_asks(make_engine, mix):
    """A step's sampling rows (gathered from the states' fixed flags) are those each row's
    settings name: rows that draw, rows with a bias or penalty, rows that want logprobs (0
    included)."""
    from lightning_lorafusion.serving.sampling import SamplingRows

    engine = make_engine(with_adapters=False)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    kinds = [greedy] if mix == "greedy" else [
        greedy, SamplingParams(max_new_tokens=4, temperature=0.7, seed=3),
        SamplingParams(max_new_tokens=4, temperature=0.0, logit_bias={5: 2.0}),
        SamplingParams(max_new_tokens=4, temperature=0.0, logprobs=0),
        SamplingParams(max_new_tokens=4, temperature=0.9, top_p=0.5, logprobs=2, presence_penalty=0.5)]
    rng = random.Random(0)
    states = [engine._new_state(GenerationRequest(prompt_token_ids=[3, 4, 5], sampling=rng.choice(kinds),
                                                  request_id=f"s{i}"), None) for i in range(40)]
    rows = _SampledRows(states, torch.device("cpu"), engine.model_config.vocab_size)
    sps = [s.sampling for s in states]
    want = SamplingRows.build(sps, [s.seed for s in states], [0] * len(states), torch.device("cpu"))
    assert rows.sampling.rows == want.rows
    for name in ("index", "temperature", "top_k", "top_p", "seeds", "draws", "min_p"):
        a, b = getattr(rows.sampling, name), getattr(want, name)
        assert (a is None and b is None) or torch.equal(a, b)
    adjusted = tuple(i for i, sp in enumerate(sps) if sp.adjusts_logits)
    assert (rows.adjust is None) == (not adjusted) and (rows.adjust is None or rows.adjust.rows == adjusted)
    asking = [i for i, sp in enumerate(sps) if sp.logprobs is not None]
    assert rows.logprob_row == {i: j for j, i in enumerate(asking)}
    assert rows.top_n == max((sps[i].logprobs for i in asking), default=None)
    if mix == "mixed":
        assert rows.sampling.rows and adjusted and asking and any(sps[i].logprobs == 0 for i in asking)
