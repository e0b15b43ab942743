"""Which graphs an epoch captures up front (training/graph_cover.py), the idle microbatch their
warm-up runs (training/cuda_graphs.py) and the data module's view of a whole epoch."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import Counter

import pytest
import torch

from lightning_lorafusion.data.microbatch import IGNORE_INDEX
from lightning_lorafusion.training.cuda_graphs import graph_key, idle_microbatch
from lightning_lorafusion.training.epoch_graphs import union_over_replicas
from lightning_lorafusion.training.graph_cover import (
    GraphKey,
    cheapest_cover,
    covers,
    join,
    padded_rows_saved,
    plan_captures,
    replay_cost,
)

K = GraphKey
C = 8192


def _covered(planned, held) -> bool:
    return all(cheapest_cover(k, held) is not None for k in planned)


def test_covers_and_the_cheapest_cover():
    small = K(C, 2048, 16, 512)
    assert covers(small, small) and covers(K(C, 4096, 16, 512), small)
    assert not covers(K(C, 1024, 64, 4096), small) and not covers(K(4096, 2048, 16, 512), small)
    held = [K(C, 8192, 32, 512), K(C, 2048, 32, 1024), K(C, 4096, 16, 512)]
    assert cheapest_cover(small, held) == K(C, 4096, 16, 512)  # LM-head rows first, then width
    assert cheapest_cover(K(C, 2048, 64, 512), held) is None
    assert join([small, K(C, 4096, 8, 1536)]) == K(C, 4096, 16, 1536)
    with pytest.raises(ValueError, match="one capacity"):
        join([small, K(4096, 2048, 16, 512)])


def test_plan_captures_covers_every_planned_key_with_few_graphs():
    """The case of a data-parallel epoch: keys with 32 attention blocks no earlier graph covers."""
    held = [K(C, 4096, 16, 512), K(C, 2048, 16, 1024), K(C, 8192, 16, 512), K(C, 4096, 16, 1024)]
    planned = {K(C, 2048, 16, 512): 5, K(C, 2048, 32, 512): 3, K(C, 2048, 32, 1024): 2,
               K(C, 2048, 16, 1536): 1, K(C, 4096, 16, 1024): 4}
    chosen = plan_captures(planned, held, limit=4)
    assert _covered(planned, held + chosen)
    # (2048, 32, 1024) covers both 32-block keys; (2048, 16, 1536) only itself; the budget left
    # then gives (2048, 32, 512)'s 3 microbatches their own graph (512 LM-head rows fewer each)
    assert chosen == [K(C, 2048, 32, 1024), K(C, 2048, 16, 1536), K(C, 2048, 32, 512)]
    assert plan_captures(planned, held + chosen) == []  # nothing left: nothing to capture
    # a key held already is never chosen again, and nothing is chosen past the limit
    assert plan_captures(planned, held, limit=0) == []
    one = plan_captures(planned, held, limit=1)
    assert one == [K(C, 2048, 32, 1536)] and _covered(planned, held + one)  # the join of what is left


def test_plan_captures_spends_the_budget_left_on_padded_lm_head_rows():
    """After the cover, keys left in the budget go where they save the most padded LM-head rows
    (microbatches x rows undercut), and none is taken that saves nothing."""
    small, big, wide = K(C, 2048, 16, 256), K(C, 2048, 16, 1024), K(C, 4096, 16, 384)
    planned = {small: 10, big: 1, wide: 2}
    assert padded_rows_saved(small, planned, [K(C, 4096, 16, 1024)]) == 10 * 768
    assert padded_rows_saved(wide, planned, [K(C, 4096, 16, 1024)]) == 10 * 640 + 2 * 640
    assert padded_rows_saved(big, planned, []) == 0  # covers nothing held: no rows to save
    assert plan_captures(planned, [], limit=1) == [K(C, 4096, 16, 1024)]  # the join
    chosen = plan_captures(planned, [], limit=4)
    # the cover first (wide covers small too: 12 microbatches; big needs its own), then
    # small's own graph (128 rows fewer for 10 microbatches)
    assert chosen == [wide, big, small]
    assert plan_captures(planned, chosen, limit=4) == []  # nothing saves a row any more


def test_plan_captures_prefers_more_microbatches_then_the_cheaper_key():
    a, b = K(C, 4096, 8, 512), K(C, 2048, 16, 512)  # neither covers the other
    assert plan_captures({a: 1, b: 3}, [], limit=4) == [b, a]
    assert plan_captures({a: 3, b: 1}, [], limit=4) == [a, b]
    assert plan_captures({a: 2, b: 2}, [], limit=4) == [b, a]  # tie: cheaper width first
    with pytest.raises(ValueError, match="limit"):
        plan_captures({a: 1}, [], limit=-1)


def test_plan_captures_is_a_bounded_cover_for_any_keys():
    rng = random.Random(0)
    values = dict(capacity=(4096, 8192), max_seqlen=(128, 256, 1024, 4096, 8192), num_blocks=(8, 16, 32, 64),
                  label_rows=(256, 512, 1024, 1536, 2048))
    for trial in range(200):
        def key():
            return K(*(rng.choice(v) for v in values.values()))
        planned = {key(): rng.randint(1, 5) for _ in range(rng.randint(1, 12))}
        held = [key() for _ in range(rng.randint(0, 4))]
        limit = rng.randint(1, 6)
        chosen = plan_captures(planned, held, limit=limit)
        assert len(chosen) <= limit and len(set(chosen)) == len(chosen)
        assert not any(k in held for k in chosen)
        if limit >= len({k.capacity for k in planned}):
            assert _covered(planned, held + chosen), (trial, planned, held, chosen)
        # every replica passing the same keys in another order picks the same graphs
        shuffled = dict(sorted(planned.items(), key=lambda kv: rng.random()))
        assert plan_captures(shuffled, list(reversed(held)), limit=limit) == chosen


@pytest.mark.parametrize("key", [K(256, 128, 8, 128), K(1024, 128, 8, 128), K(640, 256, 8, 128),
                                 K(C, 8192, 8, 512)])
def test_the_idle_microbatch_fits_its_key_and_trains_nothing(key):
    mb = idle_microbatch(key, num_adapters=3)
    assert covers(key, graph_key(mb))
    assert mb.capacity == key.capacity and int(mb.cu_seqlens[-1]) == key.capacity
    blocks = mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]
    assert int(blocks.max()) <= key.max_seqlen and len(blocks) <= key.num_blocks
    starts = torch.repeat_interleave(mb.cu_seqlens[:-1].long(), blocks.long())
    assert torch.equal(mb.position_ids, torch.arange(key.capacity) - starts)
    assert (mb.labels == IGNORE_INDEX).all() and mb.num_label_rows == 0
    assert (mb.loss_denominators == 0).all() and mb.step_adapters == () and mb.samples == ()
    # too few blocks to cover the capacity at this width: no packed microbatch has that key
    assert idle_microbatch(K(2048, 128, 8, 128), 3) is None


def test_keys_of_all_replicas_without_a_group_are_this_replicas():
    keys = {K(C, 2048, 16, 512): 2}
    assert union_over_replicas(keys, None) == keys


def test_replay_cost_orders_lm_head_rows_first():
    keys = [K(C, s, b, r) for s, b, r in itertools.product((2048, 8192), (8, 64), (512, 1024))]
    ordered = sorted(keys, key=replay_cost)
    assert [k.label_rows for k in ordered] == [512] * 4 + [1024] * 4


def _synthetic(n, seed, distribution="xsum"):
    return {"kind": "synthetic", "distribution": distribution, "num_samples": n, "seed": seed, "vocab_size": 97}


def _datamodule():
    from lightning_lorafusion.specs import AdapterSpec
    from lightning_lorafusion.training.datamodule import MultiAdapterDataModule

    specs = [AdapterSpec(name=f"x{i}", rank=4, global_batch_size=2, seed=i, dataset=_synthetic(6, i))
             for i in range(3)]
    dm = MultiAdapterDataModule(capacity=128, pad_multiple=8, max_length=48, prefetch=2, planner={"window": 1})
    dm.configure(specs, None)
    dm.load_datasets()
    return dm, specs


def test_the_data_module_lists_the_epoch_the_stream_continues_with():
    from lightning_lorafusion.training.epoch_graphs import epoch_keys

    dm, _ = _datamodule()
    plan = dm.epoch_plan(0).plan
    real = [pos for pos, mb in enumerate(plan.microbatches) if not mb.is_noop]
    assert dm.stream_start() == (0, 0)
    packed = list(dm.packed_epoch(0))
    assert [mb.index for mb in packed] == [dm.pack_position(0, pos).index for pos in real]
    epoch, keys = epoch_keys(dm)
    assert epoch == 0 and keys == Counter(graph_key(mb) for mb in packed) and sum(keys.values()) == len(real)
    # the resume point at the end of epoch 0: the stream, and the keys, are epoch 1's
    dm.epoch, dm.position = 0, len(plan.microbatches)
    assert dm.stream_start() == (1, 0) and epoch_keys(dm)[0] == 1
    dm.epoch, dm.position = 0, real[-1]
    assert dm.stream_start() == (0, real[-1]) and sum(epoch_keys(dm)[1].values()) == 1


def test_precapture_epoch_captures_before_the_first_step_what_the_epoch_needs():
    """The training module's epoch-start hook: the coming epoch's keys from the data module, a
    covering set held before any step (graphs without capture: CPU), each planned key covered."""
    from types import SimpleNamespace

    from lightning_lorafusion.model.adapter_bank import AdapterBank
    from lightning_lorafusion.model.decoder import DecoderConfig
    from lightning_lorafusion.model.random_model import random_base_params
    from lightning_lorafusion.training.cuda_graphs import TrainingGraphs
    from lightning_lorafusion.training.epoch_graphs import epoch_keys, precapture_epoch

    dm, specs = _datamodule()
    config = DecoderConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                           num_kv_heads=2, head_dim=8)
    graphs = TrainingGraphs(params=random_base_params(config, seed=0, std=0.2), config=config, capture=False,
                            bank=AdapterBank(specs, config, dtype=torch.float32), chunk_size=32, max_precapture=2)
    trainer = SimpleNamespace(datamodule=dm, strategy=SimpleNamespace())
    module = SimpleNamespace(_graphs=graphs, _trainer=trainer, trainer=trainer, device=torch.device("cpu"))
    done = precapture_epoch(module)
    _, keys = epoch_keys(dm, lookahead=1)  # this epoch's keys and the next one's (no epoch limit)
    assert 1 <= len(done) <= 2 and graphs._static_keys == set(done) and graphs.planned == frozenset(keys)
    assert all(cheapest_cover(k, done) is not None for k in keys)
    assert all(p.grad is None or not p.grad.any() for p in graphs.bank.parameters())  # nothing trained
    assert precapture_epoch(module) == []  # held already
    graphs.max_precapture, graphs.planned = 0, frozenset()  # cuda_graph_precapture: 0 turns it off
    assert precapture_epoch(module) == [] and graphs.planned == frozenset()
    assert precapture_epoch(SimpleNamespace(_graphs=None, _trainer=trainer, trainer=trainer)) == []


def _union_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mine = Counter({K(C, 2048, 16, 512): 3, K(C, 2048, 32, 512): 1} if rank == 0 else
                       {K(C, 2048, 16, 512): 2, K(C, 4096, 16, 1536): 1})
        union = union_over_replicas(mine, dist.group.WORLD)
        torch.save({"union": dict(union), "chosen": plan_captures(union, [], limit=4)}, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_replicas_agree_on_the_keys_and_so_on_the_graphs(tmp_path):
    """Two gloo ranks with different shares of an epoch: both see the union of their keys and
    choose the same graphs, which cover every microbatch of either."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_union_rank, args=(2, port, str(tmp_path)), nprocs=2, start_method="spawn")
    got = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2)]
    assert got[0] == got[1]
    assert got[0]["union"] == {K(C, 2048, 16, 512): 5, K(C, 2048, 32, 512): 1, K(C, 4096, 16, 1536): 1}
    assert all(cheapest_cover(k, got[0]["chosen"]) is not None for k in got[0]["union"])


def test_epoch_start_also_covers_the_next_epoch_so_it_captures_nothing():
    """The keys of the epoch after the coming one are covered at the coming one's start (not past
    the trainer's last epoch): the next epoch's start then captures nothing."""
    from types import SimpleNamespace

    from lightning_lorafusion.model.adapter_bank import AdapterBank
    from lightning_lorafusion.model.decoder import DecoderConfig
    from lightning_lorafusion.model.random_model import random_base_params
    from lightning_lorafusion.training.cuda_graphs import TrainingGraphs
    from lightning_lorafusion.training.epoch_graphs import epoch_keys, precapture_epoch

    dm, specs = _datamodule()
    _, first = epoch_keys(dm)
    _, both = epoch_keys(dm, lookahead=1)
    second = Counter(graph_key(mb) for mb in dm.packed_epoch(1))
    assert both == first + second
    assert epoch_keys(dm, lookahead=1, last_epoch=0)[1] == first  # no epoch past the last
    config = DecoderConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                           num_kv_heads=2, head_dim=8)
    graphs = TrainingGraphs(params=random_base_params(config, seed=0, std=0.2), config=config, capture=False,
                            bank=AdapterBank(specs, config, dtype=torch.float32), chunk_size=32, max_precapture=4)
    trainer = SimpleNamespace(datamodule=dm, strategy=SimpleNamespace(), max_epochs=2)
    module = SimpleNamespace(_graphs=graphs, _trainer=trainer, trainer=trainer, device=torch.device("cpu"))
    done = precapture_epoch(module)
    assert done and all(cheapest_cover(k, done) is not None for k in second)
    dm.epoch, dm.position = 1, 0
    assert precapture_epoch(module) == []  # epoch 1's keys were covered at epoch 0's start


def test_a_key_first_planned_for_the_next_epoch_is_captured_one_epoch_early(monkeypatch):
    """Epoch 1 plans a shape no graph of epoch 0 covers (longer samples): it is captured at epoch
    0's start, so epoch 1 starts capturing nothing; with the trainer ending after epoch 0 it is
    not captured at all."""
    from types import SimpleNamespace

    from lightning_lorafusion.model.adapter_bank import AdapterBank
    from lightning_lorafusion.model.decoder import DecoderConfig
    from lightning_lorafusion.model.random_model import random_base_params
    from lightning_lorafusion.training import epoch_graphs
    from lightning_lorafusion.training.cuda_graphs import TrainingGraphs

    real_dm, specs = _datamodule()
    short, long = GraphKey(128, 32, 4, 8), GraphKey(128, 64, 4, 16)  # long is not covered by short
    plans = {0: [short] * 3, 1: [short, long]}

    class Stream:
        epoch = position = 0

        def stream_start(self):
            return self.epoch, self.position

        def packed_epoch(self, epoch, start=0):
            return iter(plans.get(epoch, [])[start:])

    monkeypatch.setattr(epoch_graphs, "graph_key", lambda key: key)  # the stand-in yields keys
    config = DecoderConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                           num_kv_heads=2, head_dim=8)

    def module(max_epochs):
        graphs = TrainingGraphs(params=random_base_params(config, seed=0, std=0.2), config=config, capture=False,
                                bank=AdapterBank(specs, config, dtype=torch.float32), chunk_size=32,
                                max_precapture=4)
        dm = Stream()
        trainer = SimpleNamespace(datamodule=dm, strategy=SimpleNamespace(), max_epochs=max_epochs)
        return SimpleNamespace(_graphs=graphs, _trainer=trainer, trainer=trainer, device=torch.device("cpu")), dm

    m, dm = module(max_epochs=2)
    done = epoch_graphs.precapture_epoch(m)
    assert cheapest_cover(long, done) is not None and cheapest_cover(short, done) is not None
    dm.epoch = 1
    assert epoch_graphs.precapture_epoch(m) == []
    m, dm = module(max_epochs=1)
    assert cheapest_cover(long, epoch_graphs.precapture_epoch(m)) is None  # no epoch 1 to prepare for


def test_the_next_epoch_start_reuses_the_keys_its_lookahead_packed():
    """With a cache, an epoch's keys are packed on the host once: the epoch before it (its
    lookahead) packs them, its own start reads them back; a re-planned epoch is packed again."""
    from lightning_lorafusion.training.epoch_graphs import epoch_keys

    dm, _ = _datamodule()
    packed: list[tuple[int, int]] = []
    original = dm.packed_epoch

    def counting(epoch, start=0):
        packed.append((epoch, start))
        return original(epoch, start)

    dm.packed_epoch = counting
    cache: dict = {}
    _, both = epoch_keys(dm, lookahead=1, cache=cache)
    assert packed == [(0, 0), (1, 0)] and both == epoch_keys(dm, lookahead=1)[1]
    packed.clear()
    dm.epoch, dm.position = 1, 0
    _, second = epoch_keys(dm, lookahead=1, last_epoch=1, cache=cache)
    assert packed == [] and second == Counter(graph_key(mb) for mb in original(1))
    dm._plans[1] = dataclasses.replace(dm._plans[1], plan=dataclasses.replace(dm._plans[1].plan))
    assert epoch_keys(dm, lookahead=1, last_epoch=1, cache=cache)[1] == second and packed == [(1, 0)]
