"""How the training graphs' captures use the CUDA allocator (training/cuda_graphs.CaptureMemory,
a pipeline stage's split graphs in training/stage_graphs.py, capture.pool_usage), on the CPU:
torch.cuda's stream, graph, pool and cache calls are replaced by recorders, the step itself by a
stub, so what is checked is the order of warm-ups, cache releases and captures, which memory pool
each one allocates from, and the order keys are captured in."""

from __future__ import annotations

import contextlib
import os

import torch

from lightning_lorafusion.capture import expandable_segments_by_default, pool_usage
from lightning_lorafusion.model.adapter_bank import AdapterBank
from lightning_lorafusion.model.decoder import DecoderConfig
from lightning_lorafusion.model.random_model import random_base_params
from lightning_lorafusion.specs import AdapterSpec
from lightning_lorafusion.training import cuda_graphs as cg
from lightning_lorafusion.training.cuda_graphs import (
    DEFAULT_CAPTURE_MEMORY,
    CaptureMemory,
    GraphKey,
    TrainingGraphs,
    capture_size,
)

# two keys neither covers: the plan takes SMALL first (more microbatches), BIG needs more memory
SMALL, BIG = GraphKey(64, 64, 8, 32), GraphKey(64, 32, 8, 64)
PLANNED = {SMALL: 5, BIG: 1}


class _Recorder:
    """Stand-ins for the CUDA calls a capture makes, writing what happens into ``events``."""

    def __init__(self, monkeypatch):
        self.events: list[tuple] = []
        self.routed: list = []  # the pools this thread allocates from (a stack, as torch keeps it)
        self.capturing = None
        self.graphs = 0
        self.handles = 0
        self.refs: dict = {}  # references to each pool (torch drops a pool whose count reaches 0)
        ev = self.events

        class Stream:
            device = torch.device("cuda", 0)

            def __init__(self, *a, **k):
                pass

            def wait_stream(self, other):
                pass

        class Graph:
            def __init__(graph):
                self.graphs += 1
                graph.id = ("graph", self.graphs)
                graph.captured_pool = None

            def pool(graph):
                return graph.captured_pool or graph.id

            def replay(graph):
                ev.append(("replay", graph.id))

        @contextlib.contextmanager
        def graph_capture(graph, *, pool=None, stream=None, device=None):
            graph.captured_pool = pool
            ev.append(("capture", pool))
            self.incref(pool if pool is not None else graph.id)  # the graph holds its pool
            self.capturing = pool if pool is not None else graph.id
            try:
                yield
            finally:
                self.capturing = None

        class MemPool:
            def __init__(pool):
                self.handles += 1
                ev.append(("mempool",))
                pool.id = ("handle", self.handles)
                self.incref(pool.id)

        def begin(index, pool):
            self.routed.append(pool)
            self.incref(pool)

        def release(index, pool):
            self.refs[pool] -= 1
            if self.refs[pool] == 0:
                ev.append(("pool_dropped", pool))

        def end(index, pool):
            assert self.routed and self.routed[-1] == pool
            self.routed.pop()

        def run_static(graphs, key, inputs, tables):
            where = "capture" if self.capturing is not None else "eager"
            ev.append(("step", where, key, self.capturing or (self.routed[-1] if self.routed else None)))
            return torch.zeros(graphs.bank.num_adapters)

        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: Stream())
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: ev.append(("sync",)))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: ev.append(("empty_cache",)))
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "MemPool", MemPool)
        monkeypatch.setattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", begin, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_releasePool", release, raising=False)
        monkeypatch.setattr(cg, "graph_capture", graph_capture)
        monkeypatch.setattr(cg, "capture_batch", lambda device: _batch(ev))
        monkeypatch.setattr(TrainingGraphs, "_run_static", run_static)
        monkeypatch.setattr(TrainingGraphs, "_buffers", lambda graphs, capacity, device: (_Tables(), _Inputs()))

    def incref(self, pool) -> None:
        self.refs[pool] = self.refs.get(pool, 0) + 1

    def flow(self) -> list[tuple]:
        """The events without the synchronisations (each cache release follows one)."""
        return [e for e in self.events if e != ("sync",)]


@contextlib.contextmanager
def _batch(events):
    events.append(("batch",))
    yield
    events.append(("batch_end",))


class _Tables:
    num_tables = 1
    allocation_context = contextlib.nullcontext

    def fill(self, segments, index):
        pass

    def freeze(self, frozen=True):
        pass


class _Inputs:
    def load(self, mb, denominators):
        pass


def _graphs(memory: CaptureMemory = DEFAULT_CAPTURE_MEMORY) -> TrainingGraphs:
    config = DecoderConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                           num_kv_heads=2, head_dim=8)
    specs = [AdapterSpec(name="a", rank=4, alpha=8, dropout=0.0, seed=1, dataset={"kind": "synthetic"})]
    return TrainingGraphs(params=random_base_params(config, seed=0), bank=AdapterBank(specs, config),
                          config=config, capture=True, memory=memory)


def _precapture(monkeypatch, memory: CaptureMemory) -> tuple[TrainingGraphs, _Recorder]:
    rec = _Recorder(monkeypatch)
    graphs = _graphs(memory)
    done = graphs.precapture(PLANNED, torch.device("cpu"))  # the buffers stay on the host
    assert graphs.disabled is None and sorted(done, key=capture_size) == [SMALL, BIG]
    return graphs, rec


def test_capture_size_orders_by_tokens_then_head_rows():
    keys = [GraphKey(64, 64, 8, 32), GraphKey(128, 16, 8, 16), GraphKey(64, 32, 8, 64), GraphKey(64, 32, 16, 64)]
    assert sorted(keys, key=capture_size, reverse=True) == [keys[1], keys[3], keys[2], keys[0]]


def test_plan_order_first_warm_up_released_before_its_capture_later_ones_in_the_pool(monkeypatch):
    """``CaptureMemory()`` off: keys in the plan's order; the first key's eager warm-up uses the
    eager allocator and its cached blocks are handed back before its capture (which makes the
    pool); the next key warms up inside that pool and is captured into it with no release; the
    cache is handed back once after the batch (the warm-ups' backward allocated outside the
    pool, on autograd's thread)."""
    graphs, rec = _precapture(monkeypatch, CaptureMemory())
    first_pool = ("graph", 1)
    assert rec.flow() == [
        ("batch",),
        ("step", "eager", SMALL, None), ("empty_cache",), ("capture", None), ("step", "capture", SMALL, first_pool),
        ("step", "eager", BIG, first_pool), ("capture", first_pool), ("step", "capture", BIG, first_pool),
        ("empty_cache",), ("batch_end",)]
    assert graphs._pool == first_pool and set(graphs._graphs) == {SMALL, BIG}


def test_largest_first_captures_the_biggest_key_before_the_others(monkeypatch):
    graphs, rec = _precapture(monkeypatch, CaptureMemory(largest_first=True))
    assert [e[2] for e in rec.flow() if e[0] == "step" and e[1] == "eager"] == [BIG, SMALL]
    assert [e[2] for e in rec.flow() if e[0] == "step" and e[1] == "capture"] == [BIG, SMALL]


def test_release_hands_cached_blocks_back_before_every_capture_and_after_the_batch(monkeypatch):
    graphs, rec = _precapture(monkeypatch, CaptureMemory(release=True))
    flow = rec.flow()
    captures = [i for i, e in enumerate(flow) if e[0] == "capture"]
    assert len(captures) == 2
    for i in captures:  # the warm-up, then a release, then the capture
        assert flow[i - 2][:2] == ("step", "eager") and flow[i - 1] == ("empty_cache",)
    assert flow[-3:] == [("step", "capture", BIG, ("graph", 1)), ("empty_cache",), ("batch_end",)]
    assert rec.events[rec.events.index(("empty_cache",)) - 1] == ("sync",)  # queued work ended first


def test_warm_in_pool_makes_the_pool_before_the_first_warm_up(monkeypatch):
    """The first warm-up allocates from a pool made for it (a MemPool: it holds the pool, which
    the warm-up's own routing would otherwise drop when it ends), the capture then records into
    that same pool: no cache release before the captures, one after them (the warm-ups' backward
    allocates on autograd's thread, outside the thread's routing)."""
    graphs, rec = _precapture(monkeypatch, CaptureMemory(warm_in_pool=True))
    handle = ("handle", 1)
    assert rec.flow() == [
        ("batch",), ("mempool",),
        ("step", "eager", SMALL, handle), ("capture", handle), ("step", "capture", SMALL, handle),
        ("step", "eager", BIG, handle), ("capture", handle), ("step", "capture", BIG, handle),
        ("empty_cache",), ("batch_end",)]
    assert graphs._pool == handle and rec.routed == [] and graphs._mempool.id == handle
    assert rec.refs[handle] == 3  # the MemPool and the two graphs


def test_a_first_use_capture_follows_the_same_rules(monkeypatch):
    """Outside a precapture (a key's first microbatch): the same warm-up, release and pool
    choice; the warm-up is the microbatch's real step."""
    from lightning_lorafusion.training.cuda_graphs import graph_key, idle_microbatch

    rec = _Recorder(monkeypatch)
    graphs = _graphs(CaptureMemory(release=True, warm_in_pool=True))
    mb = idle_microbatch(SMALL, 1)
    key = graph_key(mb)
    sums = graphs.step(mb, mb.loss_denominators)
    assert sums is not None and graphs.captures == 1 and set(graphs._graphs) == {key}
    handle = ("handle", 1)
    assert rec.flow() == [("mempool",), ("step", "eager", key, handle), ("empty_cache",), ("capture", handle),
                          ("step", "capture", key, handle), ("empty_cache",)]


def test_pool_usage_sums_segments_per_pool():
    mib = 2**20
    segments = [
        {"device": 0, "segment_pool_id": (0, 0), "total_size": 512 * mib, "allocated_size": 256 * mib,
         "blocks": [{"size": 256 * mib, "state": "active_allocated"}, {"size": 256 * mib, "state": "inactive"}]},
        {"device": 0, "segment_pool_id": (0, 0), "total_size": 2 * mib, "allocated_size": 0, "is_expandable": True,
         "blocks": [{"size": 2 * mib, "state": "inactive"}]},
        {"device": 0, "segment_pool_id": (3, 0), "total_size": 1024 * mib, "allocated_size": 8 * mib,
         "blocks": [{"size": 8 * mib, "state": "active_allocated"}, {"size": 1016 * mib, "state": "inactive"}]},
        {"device": 0, "segment_pool_id": [0, 7], "total_size": 1024 * mib, "allocated_size": 1024 * mib,
         "blocks": [{"size": 1024 * mib, "state": "active_allocated"}]},
        {"device": 1, "segment_pool_id": (0, 0), "total_size": 4096 * mib, "allocated_size": 0, "blocks": []},
    ]
    usage = pool_usage(segments, torch.device("cuda", 0))
    assert usage["eager"] == {"reserved": 0.502, "allocated": 0.25, "largest_free": 0.25, "segments": 2,
                              "expandable": 1}
    assert usage["graphs"] == {"reserved": 2.0, "allocated": 1.008, "largest_free": 0.992, "segments": 2,
                               "expandable": 0}
    assert pool_usage([], torch.device("cuda", 0)) == {}


def test_expandable_segments_are_asked_for_unless_allocator_options_are_set():
    env = {"HOME": "/x"}
    assert expandable_segments_by_default(env) is True
    assert env == {"HOME": "/x", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for user in ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"},
                 {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}):
        env = dict(user)
        assert expandable_segments_by_default(env) is False and env == user
    env = {"PYTORCH_CUDA_ALLOC_CONF": ""}  # set but empty: nothing asked for
    assert expandable_segments_by_default(env) is True and env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_fit_asks_for_expandable_segments_before_anything_runs(monkeypatch):
    """The console script's fit / validate path sets the allocator option (the user's own stays);
    serve and generate do not touch it."""
    from lightning_lorafusion import cli

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # restored after the test
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    seen = []
    monkeypatch.setattr(cli, "LoRAFusionCLI", lambda *a, **k: seen.append(os.environ["PYTORCH_CUDA_ALLOC_CONF"]))
    monkeypatch.setattr(cli, "_keep_wandb_local", lambda: None)
    assert cli.main(["fit", "--config", "x.yaml"]) == 0
    assert seen == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    assert cli.main(["fit", "--config", "x.yaml"]) == 0
    assert seen[-1] == "max_split_size_mb:64"
    import lightning_lorafusion.serving.generate_cli as generate_cli

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    monkeypatch.setattr(generate_cli, "run", lambda args: 0)
    assert cli.main(["generate"]) == 0 and os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ""


def test_an_epoch_whose_keys_are_held_starts_with_no_collection_sync_or_release(monkeypatch):
    """A precapture with nothing left to capture (the usual epoch after the first) touches
    neither the collector nor the device: no capture batch, no synchronisation, no cache release
    (releasing the cache would make the epoch's first steps allocate from the driver again)."""
    graphs, rec = _precapture(monkeypatch, CaptureMemory(release=True))
    rec.events.clear()
    assert graphs.precapture(PLANNED, torch.device("cpu")) == []
    assert rec.events == [] and graphs.planned == frozenset(PLANNED)


def _stage_recorder(monkeypatch) -> _Recorder:
    """``_Recorder`` for a pipeline stage's split graphs: the stage's forward is a stub whose
    forward and backward write where they run (eager or captured, and the pool this thread is
    routed to) and the launch tables count as taken."""
    from lightning_lorafusion.kernels.static_routing import StaticLaunchTables
    from lightning_lorafusion.training import stage_graphs as sg

    rec = _Recorder(monkeypatch)
    ev = rec.events

    def where(kind, key):
        place = "capture" if rec.capturing is not None else "eager"
        return (kind, place, key, rec.capturing or (rec.routed[-1] if rec.routed else None))

    def forward_static(graphs, s, key):
        ev.append(where("forward", key))
        out = torch.ones(key.capacity, graphs.config.hidden_size, requires_grad=True) * 1.0
        out.register_hook(lambda grad: ev.append(where("backward", key)))
        return out

    monkeypatch.setattr(sg, "graph_capture", cg.graph_capture)  # the recorder's
    monkeypatch.setattr(sg, "capture_batch", lambda device: _batch(ev))
    monkeypatch.setattr(sg.SplitStageGraphs, "_forward_static", forward_static)
    monkeypatch.setattr(StaticLaunchTables, "num_tables", property(lambda tables: 1))
    return rec


def test_stage_graphs_hand_each_warm_up_back_before_capturing_into_the_slot_pool(monkeypatch):
    """A stage's split graphs (``stage_graphs.SplitStageGraphs``): each slot's warm-up (forward
    and backward) runs in the eager allocator, routed to no pool; its cached blocks are handed
    back before the slot's forward is captured into a new pool and its backward into the same
    one; the next slot gets its own pool. A microbatch its slot's key does not cover drops the
    slot's graphs (cache handed back) and repeats the same flow for the join. No warm-up is
    routed to a pool by thread, so nothing of the backward stays in the eager cache afterwards
    (what ``TrainingGraphs`` releases after its captures)."""
    from lightning_lorafusion.training.cuda_graphs import idle_microbatch
    from lightning_lorafusion.training.graph_cover import join
    from lightning_lorafusion.training.stage_graphs import SplitStageGraphs, stage_key, stage_key_of

    rec = _stage_recorder(monkeypatch)
    base = _graphs()
    graphs = SplitStageGraphs(params=base.params, bank=base.bank, config=base.config, capture=True,
                              layers=range(0, 1), is_first=True, slots=2)
    cpu = torch.device("cpu")  # the buffers stay on the host
    want = join([stage_key_of(SMALL), stage_key_of(BIG)])
    assert graphs.precapture(PLANNED, cpu) == [want, want] and graphs.disabled is None

    def slot_flow(key, pool):
        return [("forward", "eager", key, None), ("backward", "eager", key, None), ("empty_cache",),
                ("capture", None), ("forward", "capture", key, pool),
                ("capture", pool), ("backward", "capture", key, pool)]

    assert rec.flow() == [("batch",), *slot_flow(want, ("graph", 1)), *slot_flow(want, ("graph", 3)),
                          ("batch_end",)]
    assert [s.pool for s in graphs._slots] == [("graph", 1), ("graph", 3)] and rec.routed == []
    assert rec.events[rec.events.index(("empty_cache",)) - 1] == ("sync",)  # queued work ended first

    rec.events.clear()  # more attention blocks on slot 0: its graphs go, the join is captured
    mb = idle_microbatch(GraphKey(64, 4, 16, 0), 1)
    bigger = join([want, stage_key(mb)])
    assert bigger.num_blocks == 16 and bigger.max_seqlen == want.max_seqlen
    assert graphs.forward(mb, None, 0) is not None
    assert rec.flow() == [("empty_cache",), *slot_flow(bigger, ("graph", 5)), ("replay", ("graph", 5))]
    assert graphs._slots[0].key == bigger and graphs.captures == 3 and rec.routed == []
