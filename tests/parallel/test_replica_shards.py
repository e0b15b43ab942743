"""Global batches dealt to data-parallel replicas: one plan shape fits every replica's shard."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from lightning_lorafusion.data.microbatch import IGNORE_INDEX
from lightning_lorafusion.data.packing import PackingConfig, SampleLookup, pack_microbatch
from lightning_lorafusion.parallel.executor import run_stage
from lightning_lorafusion.parallel.replica_shards import (
    REPLICA_CAPACITY_LEVELS,
    ReplicaLookup,
    bundle_global_batch,
    capacity_levels,
    level_of,
    level_step,
    rounded_needs,
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
    from lightning_lorafusion.training.epoch_planning import replica_shards

    datasets, lookup, lengths = _mixed_datasets()
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


def test_capacity_levels_are_the_fewest_tokens_of_any_choice_of_levels():
    """Exact against brute force over every choice of at most ``levels`` needs as levels."""
    import itertools

    rng = random.Random(3)
    for _ in range(200):
        needs = [rng.choice((0, 8, 16, 24, 40, 48, 64)) for _ in range(rng.randint(1, 9))]
        levels = rng.randint(1, 4)
        got = capacity_levels(needs, levels)
        real = sorted({n for n in needs if n})
        if not real:
            assert got == []
            continue
        assert got == sorted(set(got)) and len(got) <= levels and got[-1] == real[-1]
        cost = lambda lv: sum(level_of(n, lv) for n in needs if n)  # noqa: E731
        best = min(cost(list(c) + [real[-1]]) for m in range(levels)
                   for c in itertools.combinations(real[:-1], m))
        assert cost(got) == best
    assert level_of(17, [16, 24, 64]) == 24
    assert level_step(8192, 128) == 512 and level_step(128, 8) == 8 and level_step(64, 128) == 128
    assert rounded_needs([0, 7000, 7680, 8100], 8192, 128) == [0, 7168, 7680, 8192]
    assert rounded_needs([8000], 8000, 64) == [8000]  # never past the capacity
    with pytest.raises(ValueError, match="holds 65 tokens"):
        level_of(65, [16, 64])


def _mixed_datasets():
    """The 8B benchmark's workload: 4 adapters x 64 mixed samples in global batches of 16."""
    from lightning_lorafusion.data.synthetic import synthetic_token_samples

    datasets = []
    for a in range(4):
        pairs = synthetic_token_samples("mixed", 64, vocab_size=1000, seed=a + 1, max_length=8192)
        datasets.append([Sample(list(x), list(y)) for x, y in pairs])
    lookup = SampleLookup(datasets, [[list(range(j, j + 16)) for j in range(0, 64, 16)] for _ in range(4)])
    return datasets, lookup, lookup.lengths()


def _mixed_workload(replicas: int):
    from lightning_lorafusion.training.epoch_planning import (
        deal_replica_shards,
        replica_needs,
        replica_shards,
        run_capacity_levels,
    )

    datasets, lookup, lengths = _mixed_datasets()
    shares = []
    for replica in range(replicas):
        _, slots = replica_shards(datasets, lookup, lengths, data_parallel_size=replicas, replica=replica)
        plan = plan_microbatches(slots, capacity=8192, pad_multiple=128, num_stages=1, method="greedy")
        needs = replica_needs(lookup, lengths, plan, data_parallel_size=replicas, pad_multiple=128)
        levels = run_capacity_levels([needs], 8192, REPLICA_CAPACITY_LEVELS)
        assert 8192 in levels and len(levels) <= REPLICA_CAPACITY_LEVELS
        shares.append((plan, *deal_replica_shards(datasets, lookup, lengths, plan, data_parallel_size=replicas,
                                                  replica=replica, pad_multiple=128, levels=levels)))
    return lengths, shares


def test_data_parallel_microbatches_without_a_pipeline_are_packed_below_the_capacity():
    """The 8B benchmark's workload at two replicas, no pipeline: the shape plan has 20
    microbatches where a replica's tokens fill 19; packed at the epoch's capacity levels
    (multiples of capacity / 16) they take fewer tokens than 20 full ones, every replica packs
    position i at the same capacity, and every one of its shares fits there."""
    lengths, shares = _mixed_workload(2)
    total = sum(n for per_adapter in lengths for batch in per_adapter for n in batch)
    fewest = -(-total // (2 * 8192))
    (plan, mine0, caps), (_, mine1, caps1) = shares
    assert len(plan.microbatches) <= fewest + 1 and caps == caps1
    assert len(set(caps)) <= REPLICA_CAPACITY_LEVELS and max(caps) <= 8192
    assert all(c % 512 == 0 for c in caps) and sum(caps) <= (len(caps) - 2) * 8192 + 2 * 7680
    for mine in (mine0, mine1):
        for pos, mb in enumerate(plan.microbatches):
            packed = pack_microbatch(replica_microbatch(mb, mine), mine,
                                     config=PackingConfig(capacity=caps[pos], pad_multiple=128),
                                     num_adapters=4, denominators=mine.denominators(), step_adapters=(), index=pos)
            assert packed.capacity == caps[pos]


def test_dealing_slots_evens_out_the_replicas_of_each_microbatch():
    """Every slot's bundles are dealt one to each replica; the needs (each microbatch's longest
    replica share, segments padded) are what the deal gives, and over many plans fewer tokens
    than the bundles in the order they were made."""
    from lightning_lorafusion.parallel.replica_shards import deal_slots

    rng = random.Random(5)
    plans = []
    for _ in range(20):
        replicas = rng.randint(2, 4)
        lengths = [[[rng.randint(1, 40) for _ in range(rng.randint(1, 9))] for _ in range(2)] for _ in range(3)]
        tokens, slots = {}, []
        for a, per_adapter in enumerate(lengths):
            slots.append([])
            for j, lens in enumerate(per_adapter):
                bundles = bundle_global_batch(list(range(len(lens))), lens, replicas)
                for k in range(len(bundles[0])):
                    tokens[(a, j, k)] = [sum(lens[i] for i in b[k]) for b in bundles]
                slots[a].append(slot_lengths(bundles, dict(enumerate(lens))))
        plan = plan_microbatches(slots, capacity=64, pad_multiple=4, num_stages=1, method="greedy")
        deal, needs = deal_slots(plan, tokens, pad_multiple=4)
        before = _needs(plan, tokens, {s: tuple(range(replicas)) for s in tokens}, 4)
        assert sorted(deal) == sorted(tokens)
        assert all(sorted(d) == list(range(replicas)) for d in deal.values())
        assert needs == _needs(plan, tokens, deal, 4) and all(n <= 64 for n in needs)
        plans.append((sum(needs), sum(before)))
    assert sum(n for n, _ in plans) < sum(b for _, b in plans)


def _needs(plan, tokens, deal, pad):
    from lightning_lorafusion.planner.plan import padded_length

    out = []
    for mb in plan.microbatches:
        replicas = len(next(iter(deal.values())))
        per = [{} for _ in range(replicas)]
        for ref in mb.samples:
            slot = (ref.adapter, ref.batch, ref.index)
            for r in range(replicas):
                per[r][ref.adapter] = per[r].get(ref.adapter, 0) + tokens[slot][deal[slot][r]]
        out.append(max((sum(padded_length(n, pad) for n in p.values()) for p in per), default=0))
    return out


def _gradients_at_steps(plan, packed, bank, config):
    """Each adapter's gradient at each of its steps (one stage, the executor), weights unchanged."""
    stage = DecoderStage(params=case.base_params(config), bank=bank, config=config, layers=range(config.num_layers),
                         is_first=True, is_last=True, microbatches=packed.__getitem__)
    grads = {}

    def step(adapter, batch):
        grads[(adapter, batch)] = [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                   for p in bank.parameters_of(adapter)]
        for p in bank.parameters_of(adapter):
            p.grad = None

    run_stage(build_pipeline_schedule(plan, 1)[0], stage, stage_index=0, num_stages=1,
              activation_shape=(plan.capacity, config.hidden_size), dtype=torch.float32, device="cpu",
              optimizer_step=step)
    return grads


def _dropout_free_bank_factory(seed: int):
    """The pipeline case's adapters without dropout (masks follow positions) and a maker of their
    bank with non-zero B (``pipeline_case.make_bank``'s init with ``seed``)."""
    import dataclasses

    from lightning_lorafusion.model.adapter_bank import AdapterBank

    specs = [dataclasses.replace(s, dropout=0.0) for s in case.adapter_specs()]

    def bank(config):
        b = AdapterBank(specs, config)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(b.named_parameters()):
                if name.endswith("lora_B"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        return b

    return specs, bank


def _prompt_samples(num_adapters: int, per_adapter: int, seed: int) -> list[list[Sample]]:
    """Random samples of 4-26 tokens, each with a prompt of no label."""
    rng = random.Random(seed)
    datasets = []
    for _ in range(num_adapters):
        ds = []
        for _ in range(per_adapter):
            n = rng.randint(4, 26)
            ids = [rng.randrange(61) for _ in range(n)]
            prompt = rng.randint(1, n - 2)
            ds.append(Sample(ids, [IGNORE_INDEX] * prompt + ids[prompt + 1:] + [IGNORE_INDEX]))
        datasets.append(ds)
    return datasets


def _levels_case(bank_seed: int, per_adapter: int, data_seed: int):
    """A tiny model, its dropout-free bank factory and prompt samples of each adapter in two
    global batches (the first five samples, then the rest): (config, specs, bank, datasets,
    lookup, lengths, denominators)."""
    config = case.tiny_config()
    specs, make = _dropout_free_bank_factory(bank_seed)
    datasets = _prompt_samples(len(specs), per_adapter, data_seed)
    lookup = SampleLookup(datasets, [[list(range(0, 5)), list(range(5, per_adapter))] for _ in specs])
    return config, specs, lambda: make(config), datasets, lookup, lookup.lengths(), lookup.denominators()


def _assert_same_gradients(got: dict, want: dict) -> None:
    """Each adapter's gradient at each step equal (fp32 rounding of the sums' order)."""
    assert sorted(got) == sorted(want)
    for key in want:
        for g, w in zip(got[key], want[key]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def test_replicas_packed_at_capacity_levels_sum_to_the_one_process_gradients():
    """Two replicas without a pipeline, their slots dealt and their microbatches packed at the
    epoch's capacity levels (shorter than the plan's capacity): each adapter's gradient at each
    step, summed over the replicas, equals the one-process gradient of the same global batch."""
    import dataclasses

    from lightning_lorafusion.training.epoch_planning import (
        deal_replica_shards,
        replica_needs,
        replica_shards,
        run_capacity_levels,
    )

    config, specs, bank, datasets, lookup, lengths, denominators = _levels_case(7, 10, 11)
    packing = PackingConfig(capacity=case.CAPACITY, pad_multiple=case.PAD_MULTIPLE)

    def pack(plan, mine, capacity_of):
        step_at = plan.step_adapters()
        return {i: pack_microbatch(replica_microbatch(mb, mine) if isinstance(mine, ReplicaLookup) else mb, mine,
                                   config=dataclasses.replace(packing, capacity=capacity_of(i)),
                                   num_adapters=len(specs), denominators=denominators,
                                   step_adapters=step_at.get(i, ()), index=i)
                for i, mb in enumerate(plan.microbatches) if not mb.is_noop}

    one = plan_microbatches(lengths, capacity=case.CAPACITY, pad_multiple=case.PAD_MULTIPLE, num_stages=1,
                            method="greedy")
    want = _gradients_at_steps(one, pack(one, lookup, lambda i: case.CAPACITY), bank(), config)
    got, capacities = {}, []
    for replica in (0, 1):
        _, slots = replica_shards(datasets, lookup, lengths, data_parallel_size=2, replica=replica)
        plan = plan_microbatches(slots, capacity=case.CAPACITY, pad_multiple=case.PAD_MULTIPLE, num_stages=1,
                                 method="greedy")
        needs = replica_needs(lookup, lengths, plan, data_parallel_size=2, pad_multiple=case.PAD_MULTIPLE)
        mine, caps = deal_replica_shards(datasets, lookup, lengths, plan, data_parallel_size=2, replica=replica,
                                         pad_multiple=case.PAD_MULTIPLE,
                                         levels=run_capacity_levels([needs], case.CAPACITY, 3))
        capacities.append(caps)
        for key, grads in _gradients_at_steps(plan, pack(plan, mine, caps.__getitem__), bank(), config).items():
            got[key] = grads if key not in got else [g + h for g, h in zip(got[key], grads)]
    assert capacities[0] == capacities[1] and min(capacities[0]) < case.CAPACITY
    _assert_same_gradients(got, want)


def test_one_process_packed_at_capacity_levels_gives_the_full_capacity_gradients():
    """One process without a pipeline: the plan's microbatches packed at the levels of their
    tokens (``plan_needs``, some shorter than the plan's capacity) train exactly as packed at the
    capacity: the same tokens first, and each adapter's gradient at each step equal."""
    from lightning_lorafusion.training.epoch_planning import level_capacities, plan_needs, run_capacity_levels

    config, specs, bank, _, lookup, lengths, denominators = _levels_case(5, 9, 3)
    plan = plan_microbatches(lengths, capacity=case.CAPACITY, pad_multiple=case.PAD_MULTIPLE, num_stages=1,
                             method="greedy")
    needs = plan_needs(plan, case.PAD_MULTIPLE)
    capacities = level_capacities(needs, run_capacity_levels([needs], case.CAPACITY, 3), case.CAPACITY)
    assert min(capacities) < case.CAPACITY
    assert all(c >= mb.padded_tokens(case.PAD_MULTIPLE) for c, mb in zip(capacities, plan.microbatches))
    step_at = plan.step_adapters()

    def pack(capacity_of):
        return {i: pack_microbatch(mb, lookup, config=PackingConfig(capacity=capacity_of(i),
                                                                    pad_multiple=case.PAD_MULTIPLE),
                                   num_adapters=len(specs), denominators=denominators,
                                   step_adapters=step_at.get(i, ()), index=i)
                for i, mb in enumerate(plan.microbatches) if not mb.is_noop}

    full, short = pack(lambda i: case.CAPACITY), pack(capacities.__getitem__)
    for i, mb in short.items():
        assert mb.capacity == capacities[i]
        assert torch.equal(mb.input_ids, full[i].input_ids[: mb.capacity])
        assert torch.equal(mb.labels, full[i].labels[: mb.capacity])
        assert (full[i].labels[mb.capacity:] == IGNORE_INDEX).all()
    want = _gradients_at_steps(plan, full, bank(), config)
    got = _gradients_at_steps(plan, short, bank(), config)
    _assert_same_gradients(got, want)


def test_the_data_module_packs_at_capacity_levels_only_without_a_pipeline():
    """``fit``'s data module at two replicas: without a pipeline each position is packed at the
    epoch's level for it (the same on both replicas, some below ``data.capacity``); with two
    stages (activations cross a stage boundary at a fixed shape) every microbatch has the full
    capacity. Either way both replicas together run every sample of the epoch once."""
    from lightning_lorafusion.specs import AdapterSpec, ConfigError
    from lightning_lorafusion.training.datamodule import MultiAdapterDataModule

    specs = [AdapterSpec(name=f"m{i}", rank=4, global_batch_size=6, seed=i + 1,
                         dataset={"kind": "synthetic", "distribution": "xsum", "num_samples": 12, "seed": i + 1,
                                  "vocab_size": 97}) for i in range(3)]
    def data_module(**kwargs):
        dm = MultiAdapterDataModule(capacity=256, pad_multiple=8, max_length=120, planner={"window": 2}, **kwargs)
        dm.configure(specs, None)
        dm.load_datasets()
        return dm

    for stages in (1, 2):
        capacities, samples = [], []
        for replica in (0, 1):
            dm = data_module()
            dm.num_stages, dm.data_parallel_size, dm.replica, dm.pipeline = stages, 2, replica, True
            capacities.append([])
            for epoch in range(3):
                mbs = list(dm.packed_epoch(epoch))
                capacities[-1] += [mb.capacity for mb in mbs]
                lookup = dm.epoch_plan(epoch).lookup
                samples += [(epoch, s.adapter, lookup.batches[s.adapter][s.batch][s.index])
                            for mb in mbs for s in mb.samples]
        assert capacities[0] == capacities[1]
        if stages == 1:  # three epochs, at most three capacities in all, the plan's among them
            assert min(capacities[0]) < 256 and 256 in dm._capacity_levels
            assert set(capacities[0]) <= set(dm._capacity_levels) and len(dm._capacity_levels) <= 3
            assert dm.state_dict()["capacity_levels"] == list(dm._capacity_levels)
        else:
            assert set(capacities[0]) == {256} and dm.epoch_plan(2).capacities is None
        assert sorted(samples) == sorted((e, a, i) for e in range(3) for a in range(3) for i in range(12))
    # one process without a pipeline packs at levels too, every sample once
    dm = data_module()
    dm.num_stages, dm.data_parallel_size, dm.replica, dm.pipeline = 1, 1, 0, False
    capacities, samples = [], []
    for epoch in range(3):
        mbs = list(dm.packed_epoch(epoch))
        capacities += [mb.capacity for mb in mbs]
        lookup = dm.epoch_plan(epoch).lookup
        samples += [(epoch, s.adapter, lookup.batches[s.adapter][s.batch][s.index]) for mb in mbs for s in mb.samples]
        for mb in mbs:  # the smallest level holding its padded segments
            end = max(e for _, e, _ in mb.segments)
            assert end <= mb.capacity and not [c for c in dm._capacity_levels if end <= c < mb.capacity]
    assert min(capacities) < 256 and set(capacities) <= set(dm._capacity_levels) and 256 in dm._capacity_levels
    assert sorted(samples) == sorted((e, a, i) for e in range(3) for a in range(3) for i in range(12))
    # a resumed run packs at the checkpoint's levels, not at ones chosen again
    dm = data_module()
    dm.num_stages, dm.data_parallel_size, dm.replica, dm.pipeline = 1, 2, 0, True
    dm.load_state_dict({"epoch": 1, "position": 0, "capacity": 256, "capacity_levels": [128, 256]})
    assert {mb.capacity for mb in dm.packed_epoch(1)} <= {128, 256} and dm._capacity_levels == (128, 256)
    # data.replica_capacity_levels: 0 packs every microbatch at the capacity; not an int >= 0 is refused
    dm = MultiAdapterDataModule(capacity=256, pad_multiple=8, max_length=120, planner={"window": 2},
                                replica_capacity_levels=0)
    dm.configure(specs, None)
    dm.load_datasets()
    dm.num_stages, dm.data_parallel_size, dm.replica, dm.pipeline = 1, 2, 0, True
    assert {mb.capacity for mb in dm.packed_epoch(0)} == {256} and dm.epoch_plan(0).capacities is None
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="data.replica_capacity_levels"):
            MultiAdapterDataModule(capacity=256, replica_capacity_levels=bad)
