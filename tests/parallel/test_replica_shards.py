"""Global batches dealt to data-parallel replicas: one plan shape fits every replica's shard."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from lightning_lorafusion.data.microbatch import IGNORE_INDEX
from lightning_lorafusion.data.packing import PackingConfig, SampleLookup, pack_microbatch
from lightning_lorafusion.parallel.executor import run_stage
from lightning_lorafusion.parallel.replica_shards import (
    ReplicaLookup,
    bundle_global_batch,
    replica_microbatch,
    slot_lengths,
    split_global_batch,
)
from lightning_lorafusion.parallel.schedule import build_pipeline_schedule
from lightning_lorafusion.parallel.stage import DecoderStage
from lightning_lorafusion.planner import plan_microbatches

from . import pipeline_case as case


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]


def test_split_deals_longest_first_and_replica_zero_bounds_every_slot():
    rng = random.Random(0)
    for n in range(0, 12):
        for replicas in (1, 2, 3, 4):
            indices = rng.sample(range(100), n)
            lengths = [rng.randint(1, 50) for _ in range(n)]
            length_of = dict(zip(indices, lengths))
            shards = split_global_batch(indices, lengths, replicas)
            assert sorted(i for s in shards for i in s) == sorted(indices)
            assert len(shards[0]) == -(-n // replicas)
            assert all(len(shards[0]) - 1 <= len(s) <= len(shards[0]) for s in shards)
            for s in shards:
                for k, i in enumerate(s):
                    assert length_of[i] <= length_of[shards[0][k]]
            assert split_global_batch(indices, lengths, replicas) == shards  # deterministic
    assert split_global_batch([7, 8, 9], [5, 9, 5], 1) == [[8, 7, 9]]


def test_replica_microbatch_fills_the_same_slots_with_its_own_samples():
    # adapter 0, one global batch of 5 samples over 2 replicas: replica 1 lacks slot 2
    data = [Sample(list(range(n)), [IGNORE_INDEX] + list(range(1, n))) for n in (9, 4, 12, 7, 3)]
    shards = split_global_batch(list(range(5)), [len(s.input_ids) for s in data], 2)
    assert shards == [[2, 3, 4], [0, 1]]
    lookups = [SampleLookup([data], [[shard]]) for shard in shards]
    shape = plan_microbatches([[[len(data[i].input_ids) for i in shards[0]]]], capacity=16,
                              pad_multiple=4, num_stages=1, method="greedy")
    packing = PackingConfig(capacity=16, pad_multiple=4)
    seen = [[], []]
    for planned in shape.microbatches:
        for r, lookup in enumerate(lookups):
            mine = replica_microbatch(planned, lookup)
            assert [(s.adapter, s.batch, s.index) for s in mine.samples] == [
                (s.adapter, s.batch, s.index) for s in planned.samples if s.index < len(shards[r])]
            pack_microbatch(mine, lookup, config=packing, num_adapters=1, denominators={(0, 0): 30},
                            step_adapters=(), index=0)  # fits the planned capacity
            seen[r] += [lookup.batches[0][0][s.index] for s in mine.samples]
    assert sorted(seen[0]) == sorted(shards[0]) and sorted(seen[1]) == sorted(shards[1])


def test_an_empty_replica_microbatch_runs_and_contributes_nothing():
    """A replica whose share of a microbatch is empty still runs it (all padding) and steps."""
    config = case.tiny_config()
    bank = case.make_bank(config)
    opts = case.optimizers(bank)
    plan, per_replica = case.samples_and_plan(1)
    empty = next(iter(per_replica[0].values()))
    empty = pack_microbatch(type(plan.microbatches[0])(), SampleLookup([], []),
                            config=PackingConfig(capacity=case.CAPACITY, pad_multiple=case.PAD_MULTIPLE),
                            num_adapters=3, denominators={}, step_adapters=(), index=empty.index)
    assert empty.segments == () and bool((empty.labels == IGNORE_INDEX).all())
    stage = DecoderStage(params=case.base_params(config), bank=bank, config=config,
                         layers=range(config.num_layers), is_first=True, is_last=True,
                         microbatches=lambda i: empty)
    steps = []

    def step(adapter, batch):
        steps.append((adapter, batch))
        assert all(p.grad is None for p in bank.parameters_of(adapter))
        opts[adapter].step()

    before = {k: v.clone() for k, v in bank.state_dict().items()}
    run_stage(build_pipeline_schedule(plan, 1)[0], stage, stage_index=0, num_stages=1,
              activation_shape=(case.CAPACITY, config.hidden_size), dtype=torch.float32,
              device="cpu", optimizer_step=step)
    assert sorted(steps) == sorted(plan.step_points)
    for key, value in bank.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_bundles_hold_every_sample_once_and_fit_their_slot():
    rng = random.Random(1)
    for n in range(0, 20):
        for replicas in (1, 2, 3, 4):
            indices = rng.sample(range(100), n)
            lengths = [rng.choice((rng.randint(1, 40), rng.randint(40, 400))) for _ in range(n)]
            length_of = dict(zip(indices, lengths))
            bundles = bundle_global_batch(indices, lengths, replicas)
            assert len(bundles) == replicas and len({len(b) for b in bundles}) == 1
            assert sorted(i for b in bundles for bundle in b for i in bundle) == sorted(indices)
            widths = slot_lengths(bundles, length_of)
            for b in bundles:
                assert all(sum(length_of[i] for i in bundle) <= w for bundle, w in zip(b, widths))
            # never more planned tokens than one sample per slot (split_global_batch's replica 0)
            dealt = split_global_batch(indices, lengths, replicas)[0]
            assert sum(widths) <= sum(length_of[i] for i in dealt)
            assert bundle_global_batch(indices, lengths, replicas) == bundles  # deterministic
    assert bundle_global_batch([7, 8, 9], [5, 9, 5], 1) == [[[8], [7], [9]]]
    # the longest opens a slot, the other replica fills it with what fits: 9 | 5 + 4
    assert bundle_global_batch([0, 1, 2, 3], [9, 5, 4, 2], 2) == [[[0], [3]], [[1, 2], []]]


def test_replica_bundles_pack_into_the_shape_plan():
    data = [Sample(list(range(n)), [IGNORE_INDEX] + list(range(1, n))) for n in (9, 4, 12, 7, 3, 5)]
    lengths = [len(s.input_ids) for s in data]
    bundles = bundle_global_batch(list(range(6)), lengths, 2)
    widths = slot_lengths(bundles, dict(enumerate(lengths)))
    lookups = []
    for mine in bundles:
        flat = [i for b in mine for i in b]
        starts = [sum(len(x) for x in mine[:k]) for k in range(len(mine))]
        lookups.append(ReplicaLookup([data], [[flat]], [[[tuple(range(s, s + len(b))) for s, b in zip(starts, mine)]]]))
    shape = plan_microbatches([[widths]], capacity=16, pad_multiple=4, num_stages=1, method="greedy")
    packing = PackingConfig(capacity=16, pad_multiple=4)
    seen = [[], []]
    for planned in shape.microbatches:
        for r, lookup in enumerate(lookups):
            mine = replica_microbatch(planned, lookup)
            pack_microbatch(mine, lookup, config=packing, num_adapters=1, denominators={(0, 0): 40},
                            step_adapters=(), index=0)  # fits the planned capacity
            seen[r] += [lookup.batches[0][0][s.index] for s in mine.samples]
    assert sorted(seen[0] + seen[1]) == list(range(6))
    assert [sorted(s) for s in seen] == [sorted(i for b in mine for i in b) for mine in bundles]


def test_data_parallel_shards_of_the_mixed_workload_need_about_half_the_microbatches():
    """The 8B benchmark's workload (4 adapters x 64 mixed samples, global batches of 16, capacity
    8192) at two replicas: the shape plan needs at most one microbatch more than half the
    tokens take (dealing one sample per slot needed two more)."""
    from lightning_lorafusion.data.synthetic import synthetic_token_samples
    from lightning_lorafusion.training.epoch_planning import replica_shards

    datasets = []
    for a in range(4):
        pairs = synthetic_token_samples("mixed", 64, vocab_size=1000, seed=a + 1, max_length=8192)
        datasets.append([Sample(list(x), list(y)) for x, y in pairs])
    lookup = SampleLookup(datasets, [[list(range(j, j + 16)) for j in range(0, 64, 16)] for _ in range(4)])
    lengths = lookup.lengths()
    total = sum(n for per_adapter in lengths for batch in per_adapter for n in batch)
    need = -(-total // (2 * 8192))
    counts = []
    for replica in (0, 1):
        mine, slots = replica_shards(datasets, lookup, lengths, data_parallel_size=2, replica=replica)
        plan = plan_microbatches(slots, capacity=8192, pad_multiple=128, num_stages=1, method="greedy")
        counts.append(len(plan.microbatches))
        assert sorted(i for per_adapter in mine.batches for batch in per_adapter for i in batch) != []
    assert counts[0] == counts[1] <= need + 1
    dealt = [[[lengths[a][j][i] for i in sorted(range(16), key=lambda i: -lengths[a][j][i])[::2]]
              for j in range(4)] for a in range(4)]
    assert len(plan_microbatches(dealt, capacity=8192, pad_multiple=128, num_stages=1,
                                 method="greedy").microbatches) > counts[0]
