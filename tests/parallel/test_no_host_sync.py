"""The training step needs no device->host sync for the label rows or the longest sample:
packing builds both on the host (``Microbatch.label_rows`` / ``max_seqlen``) and the pipeline
stage passes them to the decoder. (The module's training step: tests/training/test_no_host_sync_fit.py.)"""

from dataclasses import dataclass

import pytest
import torch

from lightning_lorafusion.data.microbatch import IGNORE_INDEX
from lightning_lorafusion.data.packing import PackingConfig, SampleLookup, pack_microbatch
from lightning_lorafusion.model import decoder as dec
from lightning_lorafusion.parallel.stage import DecoderStage, adapter_loss
from lightning_lorafusion.planner.plan import PlannedMicrobatch, SampleRef

from . import pipeline_case as case


@dataclass(frozen=True)
class _Sample:
    input_ids: list
    labels: list


def _edge_microbatches():
    """A prompt-only sample next to a normal one, an all-prompt microbatch, an empty (no-op)
    one, and padding blocks (segment padding and the tail)."""
    normal = _Sample(list(range(1, 10)), [IGNORE_INDEX] * 4 + list(range(6, 10)) + [IGNORE_INDEX])
    prompt_only = _Sample(list(range(20, 27)), [IGNORE_INDEX] * 7)
    lookup = SampleLookup([[normal, prompt_only], [prompt_only]], [[[0, 1]], [[0]]])
    dens = lookup.denominators()
    config = PackingConfig(capacity=32, pad_multiple=4)
    plans = [
        PlannedMicrobatch((SampleRef(0, 0, 0, 9), SampleRef(0, 0, 1, 7), SampleRef(1, 0, 0, 7))),
        PlannedMicrobatch((SampleRef(1, 0, 0, 7),)),
        PlannedMicrobatch(),
    ]
    return [pack_microbatch(p, lookup, config=config, num_adapters=3, denominators=dens, step_adapters=(),
                            index=i) for i, p in enumerate(plans)]


def _all_microbatches():
    _, per_replica = case.samples_and_plan(2, replicas=2)
    return [mb for mbs in per_replica for mb in mbs.values()] + _edge_microbatches()


def _check_metadata(mb):
    cu = mb.cu_seqlens
    assert mb.max_seqlen == int((cu[1:] - cu[:-1]).max())
    expected_rows = (mb.labels != IGNORE_INDEX).nonzero().squeeze(1)
    assert mb.label_rows.dtype == torch.int64
    assert torch.equal(mb.label_rows, expected_rows)
    assert mb.num_label_rows == expected_rows.numel()


def test_packed_metadata_equals_the_device_computation():
    mbs = _all_microbatches()
    for mb in mbs:
        _check_metadata(mb)
        moved = mb.to("cpu")  # what transfer_batch_to_device does; the metadata travels along
        assert moved.max_seqlen == mb.max_seqlen
        _check_metadata(moved)
        meta = mb.to("meta")
        assert meta.label_rows.device.type == "meta" and meta.num_label_rows == mb.num_label_rows
    edge = _edge_microbatches()
    assert edge[0].num_label_rows == 4  # only the normal sample's labels; prompt-only adds none
    assert edge[1].num_label_rows == 0 and edge[2].num_label_rows == 0
    assert edge[2].max_seqlen == 32  # an empty microbatch is one padding block
    assert any(int(b - a) == mb.max_seqlen and not any(s <= a < e for s, e, _ in mb.segments)
               for mb in edge for a, b in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:])), \
        "some microbatch's longest block is tail padding"


def test_loss_sums_and_gradients_identical_with_and_without_metadata():
    config = case.tiny_config()
    params = case.base_params(config)
    bank = case.make_bank(config)
    for mb in _all_microbatches():
        if mb.num_label_rows == 0:
            continue  # no loss: nothing to backward
        routing = bank.routing(mb.segments, mb.index, mb.capacity)
        results = []
        for meta in ({}, {"max_seqlen": mb.max_seqlen, "label_rows": mb.label_rows}):
            bank.zero_grad(set_to_none=True)
            sums = dec.forward_loss_sums(params, bank.view(), mb.input_ids, mb.labels, mb.position_ids,
                                         mb.cu_seqlens, routing, config=config, chunk_size=5, **meta)
            adapter_loss(sums, mb.loss_denominators).backward()
            results.append((sums.detach(), {n: p.grad.clone() for n, p in bank.named_parameters()
                                            if p.grad is not None}))
        (plain, plain_grads), (fast, fast_grads) = results
        assert torch.equal(plain, fast)
        assert plain_grads.keys() == fast_grads.keys() and plain_grads
        for name in plain_grads:
            assert torch.equal(plain_grads[name], fast_grads[name]), name


def test_head_loss_sums_rejects_malformed_label_rows():
    config = case.tiny_config()
    params = case.base_params(config)
    h = torch.randn(8, config.hidden_size)
    labels = torch.full((8,), 3)
    with pytest.raises(ValueError, match="label_rows"):
        dec.head_loss_sums(params, h, labels, ((0, 8, 0),), 1, config=config,
                           label_rows=torch.arange(9))


def test_pipeline_last_stage_has_no_nonzero_sync(sync_guard):
    config = case.tiny_config()
    params = case.base_params(config)
    bank = case.make_bank(config)
    _, per_replica = case.samples_and_plan(1)
    mbs = per_replica[0]
    stage = DecoderStage(params=params, bank=bank, config=config, layers=range(config.num_layers),
                         is_first=True, is_last=True, microbatches=mbs.__getitem__, train=False)
    expected = {}
    for i, mb in mbs.items():  # the old path, with nonzero()
        routing = bank.routing(mb.segments, mb.index, mb.capacity, train=False)
        sums = dec.forward_loss_sums(params, bank.view(), mb.input_ids, mb.labels, mb.position_ids,
                                     mb.cu_seqlens, routing, config=config)
        expected[i] = adapter_loss(sums, mb.loss_denominators)
    guard = sync_guard
    for i in mbs:
        assert torch.equal(guard.run(stage.forward, None, i), expected[i])
    assert len(guard.max_seqlens) == len(mbs) * config.num_layers
    assert all(m is not None for m in guard.max_seqlens)
