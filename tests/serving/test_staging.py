"""A step's host tables packed into one buffer and copied once (``staging.StagedTables``,
``EngineTuning.host_tables="packed"``): the same tensors as one copy per table, one upload per
step, and the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_lorafusion.serving import GenerationRequest, SamplingParams
from lightning_lorafusion.serving.staging import ALIGN, SeparateTables, StagedTables, make_tables

CASES = [([5, 9, 17], None), ([11, 4, 30, 22, 8, 19, 40], "all4"), ([7, 13, 21, 33, 45, 50, 6, 12, 28], "attn2"),
         ([60, 2, 35, 18, 26], "mlp8"), ([44, 41, 10, 20, 30, 40, 50, 15, 25], "all4"), ([8, 16], "mlp8")]


def _tables():
    """(values, dtype, shape) of every kind a step queues: lists, a transposed array, a
    non-contiguous tensor, bools, an empty table, odd byte lengths."""
    offsets = torch.arange(2 * 7 * 2 * 3, dtype=torch.int64).view(3, 2, 7, 2).permute(1, 2, 3, 0)
    return [([3, 1, 4, 1, 5], torch.int64, None), ([0, 2, 9], torch.int32, None),
            (np.arange(12, dtype=np.int64).reshape(-1, 3).T, torch.int32, None), (offsets, torch.int64, None),
            ([0.5, -1.25, 3.0], torch.float32, None), ([True, False, True], torch.bool, None),
            ([], torch.int64, None), ([[1, 2], [3, 4], [5, 6]], torch.int32, None), ([7] * 6, torch.int32, (2, 3))]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_packed_tables_equal_one_copy_each(device):
    packed, separate = StagedTables(device), SeparateTables(device)
    for _ in range(4):  # the slots are reused in turn
        for tables in (packed, separate):
            for values, dtype, shape in _tables():
                tables.add(values, dtype, shape)
        got, want = packed.upload(), separate.upload()
        assert len(got) == len(want) == len(_tables())
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape and g.device == w.device
            assert torch.equal(g.cpu(), w.cpu())
            assert (g.storage_offset() * g.element_size()) % ALIGN == 0
    assert packed.uploads == 4 and separate.uploads == 4 * len(_tables())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs a GPU")
def test_packed_tables_come_from_pinned_memory_gpu():
    tables = StagedTables("cuda")
    tables.add(list(range(100)), torch.int64)
    first = tables.upload()[0]
    tables.add(list(range(100, 200)), torch.int64)
    second = tables.upload()[0]
    assert all(h is None or h.is_pinned() for h in tables._host)
    torch.cuda.synchronize()
    assert first.tolist() == list(range(100)) and second.tolist() == list(range(100, 200))


def test_make_tables_names_the_modes():
    assert isinstance(make_tables("packed", "cpu"), StagedTables)
    assert isinstance(make_tables("separate", "cpu"), SeparateTables)
    with pytest.raises(ValueError, match="host_tables"):
        make_tables("pinned", "cpu")


def _run(engine, arrive_at) -> dict[str, list[int]]:
    reqs = [GenerationRequest(prompt_token_ids=p, adapter=a, request_id=f"r{i}",
                              sampling=SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
            for i, (p, a) in enumerate(CASES)]
    tokens: dict[str, list[int]] = {}
    for step in range(60):
        for i in arrive_at.get(step, []):
            engine.submit(reqs[i])
        for ev in engine.step():
            if ev.token_id is not None:
                tokens.setdefault(ev.request_id, []).append(ev.token_id)
    return tokens


@pytest.mark.parametrize("pieces", ["off", "eager"])
def test_packed_steps_upload_once_and_change_no_token(make_engine, pieces):
    arrive_at = {0: [0, 1], 2: [2], 3: [3, 4], 6: [5]}  # mixed steps with decode rows and prefix hits
    runs = {}
    for mode in ("packed", "separate"):
        engine = make_engine(num_pages=96, page_size=4, host_tables=mode, mixed_graphs=pieces, async_decode="off")
        runs[mode] = _run(engine, arrive_at)
        mixed = engine.stats()["prefill_steps_total"]
        uploads = engine.runner._tables.uploads
        if mode == "packed":
            assert uploads == mixed  # one copy of the step's tables per step with prefill rows
        else:
            assert uploads > 3 * mixed
    assert runs["packed"] == runs["separate"] and len(runs["packed"]) == len(CASES)
