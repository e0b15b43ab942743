"""Unified pool: adapters and KV share pages; eviction, page-in, waiting admission, no leaks."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_lorafusion.serving import GenerationRequest, SamplingParams, UnknownAdapterError
from lightning_lorafusion.serving.adapters import HostAdapter
from lightning_lorafusion.serving.pool import UnifiedPool, prefix_page_keys

from test_generation import CASES, _requests


def test_small_pool_evicts_and_pages_back_in_without_changing_outputs(make_engine):
    reference = make_engine(num_pages=200, page_size=4).generate(_requests(CASES))
    # 34 pages: all4 (16) + mlp8 (22) + attn2 (2) = 40 pages of adapters alone do not fit
    engine = make_engine(num_pages=34, page_size=4)
    results = engine.generate(_requests(CASES + CASES[::-1]))
    assert [r.token_ids for r in results] == [r.token_ids for r in reference + reference[::-1]]
    stats = engine.stats()
    assert stats["adapter_evictions_total"] > 0
    assert stats["adapter_page_ins_total"] > len({a for _, a in CASES if a})
    assert stats["kv_pages_used"] == 0 and stats["running"] == 0
    engine.pool.check()


def test_admission_waits_for_kv_and_proceeds(make_engine):
    cases = [(list(range(3 + i, 12 + i)), None) for i in range(8)]  # 9 + 10 tokens: 5 pages each
    reference = make_engine(num_pages=200, page_size=4).generate(_requests(cases))
    engine = make_engine(False, num_pages=16, page_size=4, kv_watermark=0.0)
    for r in _requests(cases):
        engine.submit(r)
    saw_waiting, done = False, {}
    for _ in range(200):
        for ev in engine.step():
            if ev.finish_reason:
                done[ev.request_id] = ev.finish_reason
        s = engine.stats()
        saw_waiting |= s["running"] > 0 and s["waiting"] > 0
        assert s["kv_pages_used"] <= 16
        if len(done) == len(cases):
            break
    assert saw_waiting and len(done) == len(cases)
    assert engine.stats()["kv_pages_used"] == 0
    again = make_engine(False, num_pages=16, page_size=4, kv_watermark=0.0).generate(_requests(cases))
    assert [r.token_ids for r in again] == [r.token_ids for r in reference]


def test_remove_adapter_frees_pages_once_idle(make_engine):
    engine = make_engine(num_pages=96, page_size=4)
    req = _requests([CASES[3]], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))[0]
    engine.submit(req)
    engine.step()
    assert {a.name: a.resident for a in engine.adapters()}["mlp8"]
    engine.remove_adapter("mlp8")
    assert "mlp8" not in {a.name for a in engine.adapters()}
    with pytest.raises(UnknownAdapterError):
        engine.submit(GenerationRequest(prompt_token_ids=[1, 2], adapter="mlp8"))
    with pytest.raises(UnknownAdapterError):
        engine.remove_adapter("mlp8")
    assert engine.stats()["adapter_pages_used"] == 22  # still in use by the running request
    tokens = []
    while engine.stats()["running"]:
        tokens += [e.token_id for e in engine.step() if e.token_id is not None]
    assert len(tokens) == 5
    engine.step()
    assert engine.stats()["adapter_pages_used"] == 0 and engine.stats()["adapters_resident"] == 0


def _fake_adapter(numel: int) -> HostAdapter:
    return HostAdapter(name=f"a{numel}", rank=1, alpha=1.0, target_modules=(), slots={},
                       flat=torch.arange(numel, dtype=torch.float32), num_layers=1)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_pool_accounting_never_leaks(seed):
    """Random arrivals / growth / finishes / adapter page-ins / shared prefix pages, and lists
    that grow page by page registering each page once filled (decoding): pages are always
    exactly one of free, KV (in use or cached) or adapter; moved KV pages keep their contents;
    everything returns at the end."""
    rng = random.Random(seed)
    pool = UnifiedPool(num_pages=40, page_size=2, num_layers=1, num_kv_heads=1, head_dim=2,
                       dtype=torch.float32, device="cpu")
    adapters = [_fake_adapter(rng.randint(1, 8 * pool.page_elems)) for _ in range(5)]
    owners: list[tuple[list[int], list[float]]] = []  # page list, marker value written into each page
    users: list[HostAdapter] = []
    # prefix caching: three chains of page keys; a page registered under key i of a chain holds
    # that key's marker, and lists taking a chain's prefix share those pages
    chains = [prefix_page_keys(c, [c] * 16, 2, 8) for c in range(3)]
    # decoding lists: chain c's list starts with its first page and grows a page at a time, registering
    # each grown page under the key extended from the last (``known=``) once it is full
    decoding: list[tuple[int, list[int], list[float], list[bytes]]] = []
    for step in range(80):
        op = rng.random()
        if op < 0.1 and decoding:
            c, pages, markers, keys = decoding[rng.randrange(len(decoding))]
            n = len(pages)
            if n < len(chains[c]) and pool.allocate_kv(pages, 1):
                keys[:] = prefix_page_keys(c, [c] * 2 * (n + 1), 2, n + 1, known=keys)
                assert keys == chains[c][:n + 1]  # extending the chain = hashing it from the start
                markers.append(100.0 * (c + 1) + n)
                pool.kv[pages[-1]] = markers[-1]
                pool.register(pages[-1], keys[-1])  # a no-op if another list registered that key first
        elif op < 0.15:
            c, pages = rng.randrange(3), []
            shared = pool.match_prefix(chains[c][:1])
            pool.share(pages, shared)
            if shared or pool.allocate_kv(pages, 1):
                if not shared:
                    pool.kv[pages[0]] = 100.0 * (c + 1)
                    pool.register(pages[0], chains[c][0])
                entry = (c, pages, [100.0 * (c + 1)], [chains[c][0]])
                decoding.append(entry)
                owners.append(entry[1:3])
        elif op < 0.22:
            pages: list[int] = []
            if pool.allocate_kv(pages, rng.randint(1, 4)):
                markers = [float(step + 1)] * len(pages)
                pool.kv[pages] = markers[0]
                owners.append((pages, markers))
        elif op < 0.35:
            c, n = rng.randrange(3), rng.randint(1, 6)
            keys = chains[c][:n]
            pages = []
            pool.share(pages, pool.match_prefix(keys))
            reused = len(pages)
            if pool.allocate_kv(pages, n - reused):
                for i in range(reused, n):
                    pool.kv[pages[i]] = 100.0 * (c + 1) + i
                    pool.register(pages[i], keys[i])
                owners.append((pages, [100.0 * (c + 1) + i for i in range(n)]))
            else:
                pool.free_kv(pages)
        elif op < 0.5 and owners:
            pages, _ = owners.pop(rng.randrange(len(owners)))
            decoding = [d for d in decoding if d[1] is not pages]
            pool.free_kv(pages)
        elif op < 0.75:
            a = rng.choice(adapters)
            r = pool.page_in(a)
            if r is not None:
                assert torch.equal(pool.storage[r.offset:r.offset + a.numel], a.flat)
                if rng.random() < 0.5:
                    pool.acquire(a)
                    users.append(a)
        elif op < 0.85 and users:
            pool.release(users.pop(rng.randrange(len(users))))
        else:
            pool.evict_lru_idle()
        pool.check()
        for pages, markers in owners:  # relocation moved the contents too; shared pages are the right ones
            for page, marker in zip(pages, markers):
                assert bool((pool.kv[page] == marker).all())
        for a in set(users):
            r = pool.resident(a)
            assert r is not None and torch.equal(pool.storage[r.offset:r.offset + a.numel], a.flat)
    for pages, _ in owners:
        pool.free_kv(pages)
    for a in users:
        pool.release(a)
    while pool.evict_lru_idle():
        pass
    pool.check()
    assert pool.num_free == pool.num_pages and pool.kv_pages_used == 0
    everything: list[int] = []
    assert pool.allocate_kv(everything, pool.num_pages)  # drops every cached prefix page
    assert pool.kv_pages_cached == 0 and pool.match_prefix([k[0] for k in chains]) == []
    pool.free_kv(everything)
    pool.check()


def _registered_sequence(pages: int):
    """A 6-page pool (2 tokens a page) holding one sequence of ``pages`` full, registered pages:
    -> (pool, its page list, their prefix keys)."""
    pool = UnifiedPool(num_pages=6, page_size=2, num_layers=1, num_kv_heads=1, head_dim=2,
                       dtype=torch.float32, device="cpu")
    keys = prefix_page_keys(None, list(range(2 * pages)), 2, pages)
    seq: list[int] = []
    assert pool.allocate_kv(seq, pages)
    for page, key in zip(seq, keys):
        pool.register(page, key)
    return pool, seq, keys


def test_a_freed_sequence_is_dropped_tail_first():
    """Cached pages of a finished sequence go least-recently-used first from its last page, so
    under pressure the cache keeps its leading pages (still reachable from the first key)."""
    pool, seq, keys = _registered_sequence(4)
    head = seq[:2]
    pool.free_kv(seq)
    other: list[int] = []
    assert pool.allocate_kv(other, 4)  # 2 free pages and the 2 least recently used cached ones
    assert pool.match_prefix(keys) == head and pool.prefix_evictions == 2
    pool.check()


def test_forgotten_prefix_pages_are_freed_not_cached():
    """``forget_prefixes``: no key matches the pages any more; a holder keeps them, and letting
    go frees them (a sharer's copy of the list keeps them until it lets go too)."""
    pool, seq, keys = _registered_sequence(3)
    sharer: list[int] = []
    pool.share(sharer, pool.match_prefix(keys[:1]))
    pool.forget_prefixes(seq)
    assert pool.match_prefix(keys) == [] and pool.kv_pages_cached == 0
    pool.free_kv(seq)
    assert pool.num_free == 5 and pool.kv_pages_cached == 0  # the shared first page is still held
    pool.free_kv(sharer)
    assert pool.num_free == 6
    pool.check()


def test_fragmented_pool_moves_kv_pages_to_fit_an_adapter():
    pool = UnifiedPool(num_pages=12, page_size=2, num_layers=1, num_kv_heads=1, head_dim=2,
                       dtype=torch.float32, device="cpu")
    lists = [[] for _ in range(12)]
    for i, pages in enumerate(lists):
        assert pool.allocate_kv(pages, 1)
        pool.kv[pages] = float(i)
    for pages in lists[::2]:  # every other page free: no run of 2
        pool.free_kv(pages)
    adapter = _fake_adapter(5 * pool.page_elems)  # needs 5 contiguous pages; 6 are free
    r = pool.page_in(adapter)
    assert r is not None and pool.pages_moved > 0
    pool.check()
    for i, pages in enumerate(lists):
        if i % 2:
            assert bool((pool.kv[pages] == float(i)).all())


def test_page_in_without_moving_kv_pages_waits_for_a_free_run():
    pool = UnifiedPool(num_pages=12, page_size=2, num_layers=1, num_kv_heads=1, head_dim=2,
                       dtype=torch.float32, device="cpu")
    lists = [[] for _ in range(12)]
    for pages in lists:
        assert pool.allocate_kv(pages, 1)
    for pages in lists[::2]:  # every other page free: no run of 2
        pool.free_kv(pages)
    adapter = _fake_adapter(5 * pool.page_elems)
    assert pool.page_in(adapter, may_evict=False, may_move=False) is None  # (a prefetch behind a launched step)
    assert pool.pages_moved == 0 and pool.resident(adapter) is None
    assert pool.page_in(adapter, may_evict=False) is not None and pool.pages_moved > 0
    pool.check()
