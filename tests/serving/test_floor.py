"""The step ledger and the floor model (serving/floor.py): hand-computed steps, the engine's
ledger against what its requests must have done, and the page-in fences of the pool."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.serving.floor import (FloorShape, StepLedger, base_weight_bytes, part_floors, run_floor,
                                                step_cost)
from lightning_lorafusion.serving.pool import FreedPageFences, UnifiedPool
from lightning_lorafusion.specs import ALL_TARGET_MODULES

# 2 layers, 2 heads of 4, hidden 8, MLP 16, vocab 10: projection weights per layer
# 64 (q) + 32 (k) + 32 (v) + 64 (o) + 128 (gate) + 128 (up) + 128 (down) = 576, so 1152 in all
SHAPE = FloorShape(num_layers=2, num_heads=2, head_dim=4, hidden_size=8, vocab_size=10,
                   module_dims={"q_proj": (8, 8), "k_proj": (8, 4), "v_proj": (8, 4), "o_proj": (8, 8),
                                "gate_proj": (8, 16), "up_proj": (8, 16), "down_proj": (16, 8)})


def _adapter(key: int, name: str, ranks: dict[str, int]):
    return SimpleNamespace(key=key, name=name, module_ranks=torch.tensor(
        [ranks.get(m, 0) for m in ALL_TARGET_MODULES], dtype=torch.int32))


# a: q and v at rank 2 -> 2 layers * (2 * (8 + 8) + 2 * (8 + 4)) = 112 elements
# b: down at rank 4 -> 2 layers * 4 * (16 + 8) = 192 elements
A = _adapter(1, "a", {"q_proj": 2, "v_proj": 2})
B = _adapter(2, "b", {"down_proj": 4})


def _state(num_cached: int, num_tokens: int, adapter=None):
    return SimpleNamespace(num_cached=num_cached, num_tokens=num_tokens, adapter=adapter)


def _ledger() -> StepLedger:
    return StepLedger(base_weight_bytes=1000, kv_bytes_per_token=32, adapter_elem_bytes=2)


def test_shape_sizes():
    assert SHAPE.projection_params == 1152
    assert SHAPE.adapter_elems((("q_proj", 2), ("v_proj", 2))) == 112
    assert SHAPE.adapter_elems((("down_proj", 4),)) == 192


def test_decode_step_of_two_rows_by_hand():
    ledger = _ledger()
    # two rows of adapter a with 5 and 9 tokens in the cache: each reads its context and its own token
    ledger.record([], [], [_state(5, 6, A), _state(9, 10, A)])
    (step,) = ledger.steps
    assert (step.decode_rows, step.decode_kv_tokens, step.sampled_rows, step.adapters) == (2, 16, 2, ((1, 2),))
    cost = step_cost(step, ledger, SHAPE)
    # bytes: base once + 16 KV tokens * 32 + adapter a once (112 elements * 2 bytes), not once per row
    assert (cost.base_bytes, cost.kv_bytes, cost.adapter_bytes) == (1000, 512, 224)
    # FLOPs: 2 * 1152 * 2 tokens + LM head 2 * 8 * 10 * 2 rows + attention 4 * 2 layers * 2 heads
    # * 4 dims * 16 pairs + adapter 2 * 112 * 2 tokens
    assert cost.flops == 4608 + 320 + 1024 + 448
    floor = run_floor(ledger, SHAPE, peak_flops=1e4, bandwidth=1e3)  # memory bound: 1736 B / 1e3 B/s
    assert floor["floor_s"] == pytest.approx(1.736) and floor["compute_bound_steps"] == 0
    # each distinct adapter of the step is read once
    ledger.record([], [], [_state(5, 6, A), _state(9, 10, B)])
    assert step_cost(ledger.steps[1], ledger, SHAPE).adapter_bytes == (112 + 192) * 2


def test_part_floors_by_hand():
    """Each part of a step on its own: the products' weights or FLOPs, the LM head's, decode and
    prefill attention's KV or pairs, the activations of norms, RoPE and SwiGLU, the adapters'."""
    ledger = _ledger()
    ledger.record([_state(3, 10, B)], [4], [_state(5, 6, A), _state(9, 10)])
    (step,) = ledger.steps
    parts = part_floors(step, ledger, SHAPE, peak_flops=1e4, bandwidth=1e3)
    # 6 tokens: products 2 * 1152 * 6 FLOPs against 1152 * 2 bytes
    assert parts["products"] == pytest.approx(max(2 * 1152 * 6 / 1e4, 2304 / 1e3))
    # two decode rows sample (the chunk does not end its prompt): the head's 80 weights once
    assert parts["lm_head"] == pytest.approx(max(2 * 8 * 10 * 2 / 1e4, 160 / 1e3))
    # decode rows read 6 + 10 KV tokens; the chunk 7, over 22 pairs
    assert parts["attention_decode"] == pytest.approx(max(4 * 2 * 2 * 4 * 16 / 1e4, 16 * 32 / 1e3))
    assert parts["attention_prefill"] == pytest.approx(max(4 * 2 * 2 * 4 * 22 / 1e4, 7 * 32 / 1e3))
    # per token and layer (8 * 8 + 2 * 8 + 5 * 4 + 3 * 16) elements of 2 bytes, 2 layers
    assert parts["elementwise"] == pytest.approx(6 * 2 * 148 * 2 / 1e3)
    # adapters a (1 decode token) and b (4 prefill tokens), each read once
    assert parts["lora"] == pytest.approx(max((2 * 112 + 2 * 192 * 4) / 1e4, (112 + 192) * 2 / 1e3))
    assert sum(parts.values()) >= run_floor(ledger, SHAPE, peak_flops=1e4, bandwidth=1e3)["floor_s"]


def test_prefill_chunk_by_hand():
    ledger = _ledger()
    # a chunk of 4 tokens after 3 cached of a 10-token prompt: not its last piece, so no logits
    ledger.record([_state(3, 10, B)], [4], [])
    (step,) = ledger.steps
    assert (step.prefill, step.sampled_rows, step.adapters) == (((4, 3),), 0, ((2, 4),))
    cost = step_cost(step, ledger, SHAPE)
    # attention pairs: 4 * 3 (the context) + 1 + 2 + 3 + 4 (causal inside the chunk) = 22
    assert cost.flops == 2 * 1152 * 4 + 4 * 2 * 2 * 4 * 22 + 2 * 192 * 4
    assert (cost.base_bytes, cost.kv_bytes, cost.adapter_bytes) == (1000, 7 * 32, 384)
    floor = run_floor(ledger, SHAPE, peak_flops=1e3, bandwidth=1e4)  # compute bound
    assert floor["floor_s"] == pytest.approx(cost.flops / 1e3) and floor["compute_bound_steps"] == 1
    # its last piece samples a token: the LM head runs on that row
    ledger.record([_state(7, 10)], [3], [])
    last = ledger.steps[1]
    assert last.sampled_rows == 1 and last.adapters == ()
    assert step_cost(last, ledger, SHAPE).flops == 2 * 1152 * 3 + 2 * 8 * 10 + 4 * 2 * 2 * 4 * (3 * 7 + 6)


def test_run_floor_sums_the_max_of_each_step():
    ledger = _ledger()
    ledger.record([_state(3, 10, B)], [4], [])
    ledger.record([], [], [_state(5, 6, A), _state(9, 10, A)])
    costs = [step_cost(s, ledger, SHAPE) for s in ledger.steps]
    floor = run_floor(ledger, SHAPE, peak_flops=2e3, bandwidth=1e3)
    assert floor["floor_s"] == pytest.approx(sum(max(c.flops / 2e3, c.bytes / 1e3) for c in costs))
    assert floor["adapter_bytes"] == 384 + 224 and floor["kv_bytes"] == 224 + 512 and floor["base_bytes"] == 2000
    assert floor["steps"] == 2
    with pytest.raises(ValueError, match="bandwidth"):
        run_floor(ledger, SHAPE, peak_flops=1.0, bandwidth=0.0)


def test_base_weight_bytes_counts_what_a_step_reads():
    embed = torch.zeros(10, 8)  # 320 bytes
    head = torch.zeros(10, 8)
    fused = torch.zeros(16, 8)  # a fused projection: its members are views of it
    layer = {"qkv_proj": {"weight": fused}, "q_proj": {"weight": fused[:8]}, "k_proj": {"weight": fused[8:]},
             "norm": torch.zeros(8)}
    untied = {"embed": embed, "layers": [layer], "norm": torch.zeros(8), "lm_head": head}
    assert base_weight_bytes(untied) == 512 + 32 + 32 + 320  # the embedding table is not read whole
    tied = {**untied, "lm_head": embed}
    assert base_weight_bytes(tied) == 512 + 32 + 32 + 320  # the table is the head: read once


def _run(engine, requests):
    return {r.request_id: list(r.token_ids) for r in engine.generate(requests)}


@pytest.mark.parametrize("tuning", [dict(async_decode="off"),
                                    dict(async_decode="on", enable_chunked_prefill=True, max_num_batched_tokens=6,
                                         max_num_seqs=4)])
def test_engine_ledger_matches_its_requests(make_engine, tuning):
    prompts = {"x": ([5, 6, 7, 8, 9], "all4"), "y": ([9, 8, 7, 6, 5, 4, 3], "attn2"), "z": ([11, 12, 13], None)}
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)

    def requests():
        return [GenerationRequest(prompt_token_ids=p, adapter=a, sampling=sp, request_id=rid)
                for rid, (p, a) in prompts.items()]

    plain = _run(make_engine(prefix_caching=False, **tuning), requests())
    engine = make_engine(prefix_caching=False, **tuning)
    assert engine.step_ledger() is None
    ledger = engine.enable_step_ledger()
    assert _run(engine, requests()) == plain  # the ledger changes nothing
    assert engine.disable_step_ledger() is ledger and engine.step_ledger() is None
    summary = ledger.summary()
    # every token fed (prompt, then 3 generated ones) attends to itself and all before it,
    # however the prompts were cut into pieces: (p + 3)(p + 4) / 2 (query, key) pairs a request
    pairs = sum(n * ctx + n * (n + 1) // 2 for s in ledger.steps for n, ctx in s.prefill)
    assert pairs + summary["decode_kv_tokens"] == sum((len(p) + 3) * (len(p) + 4) // 2 for p, _ in prompts.values())
    assert summary["prefill_tokens"] + summary["decode_rows"] == 15 + 3 * 3
    if not tuning.get("enable_chunked_prefill"):  # (a chunked prompt's last token may go as a decode row)
        assert summary["prefill_tokens"] == 15 and summary["decode_rows"] == 3 * 3
        # the decode steps of a prompt of p feed positions p, p + 1, p + 2 and read p + 1 .. p + 3 tokens
        assert summary["decode_kv_tokens"] == sum(3 * len(p) + 6 for p, _ in prompts.values())
    assert sum(s.sampled_rows for s in ledger.steps) == 3 * 4  # every generated token's logits
    by_name = {a.name: a for a in ledger.adapters.values()}
    assert set(by_name) == {"all4", "attn2"} and summary["distinct_adapters"] == 2
    assert dict(by_name["attn2"].module_ranks) == {"q_proj": 2, "v_proj": 2}
    assert dict(by_name["all4"].module_ranks) == {m: 4 for m in ALL_TARGET_MODULES}
    key = {a.name: k for k, a in ledger.adapters.items()}
    tokens = sum(n for s in ledger.steps for k, n in s.adapters if k == key["attn2"])
    assert tokens == 7 + 3  # its prompt and its three generated tokens fed back
    # the decode rows per adapter: each step's decode rows of an adapter, within its tokens there
    for s in ledger.steps:
        assert sum(n for _, n in s.decode_adapters) <= s.decode_rows
        assert all(n <= dict(s.adapters)[k] for k, n in s.decode_adapters)
    if not tuning.get("enable_chunked_prefill"):
        assert sum(n for s in ledger.steps for k, n in s.decode_adapters if k == key["attn2"]) == 3
    pieces = [piece for s in ledger.steps for piece in s.prefill]
    if tuning.get("enable_chunked_prefill"):
        assert any(ctx > 0 for _, ctx in pieces)  # a chunk after an earlier one
    if tuning["async_decode"] == "on":  # rows of steps planned ahead were counted too
        assert engine.stats()["decode_steps_ahead_total"] > 0
    assert ledger.base_weight_bytes == base_weight_bytes(engine.params) > 0
    cfg = engine.model_config
    assert ledger.kv_bytes_per_token == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32


class _Fence:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def test_page_in_waits_only_for_the_readers_of_its_pages():
    made: list[_Fence] = []
    fences = FreedPageFences(8, lambda: made.append(_Fence()) or made[-1])
    assert fences.pending(0, 8) is None  # nothing ever touched the pages
    fences.freed([0, 1])  # a finished request's pages, let go after the steps that read them
    fences.freed([4])  # let go later: after a step launched since
    first, later = made
    assert fences.pending(0, 2) is first  # not the later fence: the copy may run beside that step
    assert fences.pending(2, 2) is None
    assert fences.pending(0, 5) is later  # pages of both: the later covers the earlier
    first.done = True
    assert fences.pending(0, 2) is None and fences.pending(4, 1) is later
    later.done = True
    assert fences.pending(0, 8) is None


def test_pool_marks_pages_where_they_are_let_go():
    made: list[_Fence] = []
    pool = UnifiedPool(num_pages=8, page_size=2, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                       device="cpu")
    pool._fences = FreedPageFences(pool.num_pages, lambda: made.append(_Fence()) or made[-1])
    pages: list[int] = []
    assert pool.allocate_kv(pages, 3) and pages == [0, 1, 2]
    pool.free_kv(pages)
    assert len(made) == 1 and pool._fences.pending(0, 3) is made[0]
    # a KV page moved out of the way of an adapter's run is let go after the move that reads it
    lists = [[] for _ in range(8)]
    for owner in lists:
        assert pool.allocate_kv(owner, 1)
    for p in (0, 3, 5, 7):  # no two free pages side by side: a run of 2 needs a move
        pool.free_kv(lists[p])
    before = len(made)
    assert pool._find_run(2) is None
    start = pool._open_run(2)
    assert start is not None and pool.pages_moved == 1 and len(made) == before + 1
    assert pool._fences.pending(start, 2) is made[-1]
    pool.check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: a page-in on its own stream")
def test_page_in_lands_after_the_last_reader_of_its_pages_gpu():
    from lightning_lorafusion.serving.adapters import HostAdapter

    pool = UnifiedPool(num_pages=4, page_size=2, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                       device="cuda")
    pages: list[int] = []
    assert pool.allocate_kv(pages, 4)
    kv = pool.storage[:4 * pool.page_elems]
    kv.fill_(7.0)
    torch.cuda._sleep(100_000_000)  # keep the compute stream busy, so the read below is still queued
    seen = kv.clone()  # a step's read of the KV pages, queued before they are let go
    pool.free_kv(pages)
    flat = torch.ones(2 * pool.page_elems, dtype=torch.float32).pin_memory()
    adapter = HostAdapter(name="a", rank=1, alpha=1.0, target_modules=(), slots={}, flat=flat, num_layers=1)
    resident = pool.page_in(adapter)  # into pages the queued read still holds
    pool.wait_ready([resident])
    torch.cuda.synchronize()
    assert bool((seen == 7.0).all())  # the copy waited for the read
    assert bool((pool.storage[resident.offset:resident.offset + flat.numel()] == 1.0).all())
