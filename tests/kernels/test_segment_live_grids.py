"""The prefill LoRA's live grids (``SegmentLora.live``) of the "segments" kernels: a fixed number of programs walking the
live tiles of a padded table, against the torch reference and against the grids over the whole
table (which run the same per-element sums in the same order, so their outputs are bitwise equal).

Interpreter runs on the CPU in fp32 / fp16 (bf16 on the GPU only); tolerances as in
test_lora_segments.py (fp32 1e-5: summation order only; fp16 2e-3: one rounding into fp16).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_lorafusion.kernels import lora_segments
from lightning_lorafusion.kernels.lora_segments import (
    live_programs,
    segment_kernel_variants,
    segment_lora_add,
    segment_lora_reference,
    segment_tiles,
)
from test_lora_segments import GPU_ONLY, TOL, make_covering_lora, make_lora, make_pool, rel_err

DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=GPU_ONLY)]


def with_live(lora, count: int):
    return dataclasses.replace(lora, live=torch.tensor([count], dtype=torch.int32, device=lora.pool.device))


def live_count(lora) -> int:
    """The tiles a table's builder counts as live: every tile before the padding."""
    return len(segment_tiles(lora.segments, lora.block_m))


def group(dtype, device, seed=3):
    k, ns = 70, (48, 16, 16)
    ranks = [(8, 8, 8), (20, 20, 20), (3, 0, 3), (16, 16, 16)]
    pool, a_off, b_off, rk, _ = make_pool(ranks, k, ns, dtype, device, seed=seed)
    return k, ns, (pool, a_off, b_off, rk, torch.tensor([2.0, 0.125, 1.0, 0.5]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("accumulate", [True, False])
def test_live_grid_equals_the_table_grid_and_the_reference_with_padding_and_base_rows(device, dtype, accumulate):
    """A covering table (base rows in ``NO_ADAPTER`` tiles) padded with 40 empty tiles; live
    count = its real tiles. Additive and write-first (into NaN: every row written, zeros on the
    base rows): equal to the reference within the dtype's tolerance, bitwise equal to the grid
    over the whole table."""
    k, ns, tables = group(dtype, device)
    rows = 120
    segments = [(3, 37, 1), (37, 40, 0), (44, 45, 2), (45, 90, 3), (90, 107, 1)]
    lora = make_covering_lora(*tables, segments, 16, rows, pad_tiles=40)
    n_live = len(segment_tiles(segments, 16, rows=rows))
    assert lora.tiles.shape[1] == n_live + 40
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    base = (torch.randn(rows, sum(ns), generator=torch.Generator().manual_seed(5)).to(device, dtype) if accumulate
            else torch.full((rows, sum(ns)), float("nan"), dtype=dtype, device=device))
    got, old, want = base.clone(), base.clone(), base.clone()
    segment_lora_add(x, with_live(lora, n_live), list(got.split(ns, dim=1)), backend="triton", form="segments", accumulate=accumulate)
    segment_lora_add(x, lora, list(old.split(ns, dim=1)), backend="triton", form="segments", accumulate=accumulate)
    segment_lora_reference(x, lora, list(want.split(ns, dim=1)), accumulate=accumulate)
    assert torch.equal(got, old)
    if accumulate:
        assert rel_err(got - base, want - base) < TOL[dtype]
        assert torch.equal(got[:3], base[:3]) and torch.equal(got[107:], base[107:])  # base rows untouched
    else:
        assert not got.isnan().any()
        assert rel_err(got, want) < TOL[dtype]
        zeros = torch.zeros(rows, sum(ns), dtype=dtype, device=device)
        assert torch.equal(got[40:44], zeros[40:44]) and torch.equal(got[107:], zeros[107:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_live_tile_among_many_empty_ones(device, dtype):
    """One request of 5 rows in a table of 1 + 60 padding tiles (a short prompt in a large
    bucket): the live grid's few programs do its work alone, as the reference does."""
    k, ns, tables = group(dtype, device, seed=11)
    lora = make_lora(*tables[:4], tables[4], [(6, 11, 3)], 16, pad_tiles=60)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(12)).to(device, dtype)
    base = torch.randn(64, sum(ns), generator=torch.Generator().manual_seed(13)).to(device, dtype)
    got, want = base.clone(), base.clone()
    segment_lora_add(x, with_live(lora, live_count(lora)), list(got.split(ns, dim=1)), backend="triton", form="segments")
    segment_lora_reference(x, lora, list(want.split(ns, dim=1)))
    assert rel_err(got - base, want - base) < TOL[dtype]
    assert torch.equal(got[:6], base[:6]) and torch.equal(got[11:], base[11:])


@pytest.mark.parametrize("n_blocks,split_k,programs", [(1, 1, 1), (3, 2, 2), (4, 3, 5), (2, 4, 0)])
def test_live_grid_walks_every_item_whatever_the_program_count(device, monkeypatch, n_blocks, split_k, programs):
    """Items = live tiles x projections x K splits (shrink), x column groups (expand): with 1, 2
    or 5 programs (per SM on CUDA) each walks many of them, tiles of different ranks interleaved;
    0: a program per item of the whole table."""
    k, ns, tables = group(torch.float32, device, seed=14)
    segments = [(0, 1, 1), (1, 40, 0), (41, 42, 2), (42, 77, 3)]
    lora = make_lora(*tables[:4], tables[4], segments, 16, pad_tiles=7)
    x = torch.randn(80, k, generator=torch.Generator().manual_seed(15)).to(device)
    base = torch.randn(80, sum(ns), generator=torch.Generator().manual_seed(16)).to(device)
    got, old = base.clone(), base.clone()
    opts = dict(backend="triton", form="segments", n_blocks=n_blocks, split_k=split_k)
    monkeypatch.setattr(lora_segments, "LIVE_PROGRAMS_INTERPRETER", programs)
    segment_lora_add(x, with_live(lora, live_count(lora)), list(got.split(ns, dim=1)), per_sm=(programs, programs),
                     **opts)
    segment_lora_add(x, lora, list(old.split(ns, dim=1)), **opts)
    assert torch.equal(got, old)
    want = base.clone()
    segment_lora_reference(x, lora, list(want.split(ns, dim=1)))
    assert rel_err(got - base, want - base) < 1e-5


@pytest.mark.parametrize("accumulate", [True, False])
def test_tiles_past_the_live_count_are_not_run(device, accumulate):
    """The live count is the contract: a table's tiles past it are padding and nothing runs
    them (a count of 0: nothing is read or written)."""
    k, ns, tables = group(torch.float32, device, seed=17)
    lora = make_lora(*tables[:4], tables[4], [(0, 16, 1), (16, 30, 3)], 16, pad_tiles=4)
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(18)).to(device)
    base = torch.randn(32, sum(ns), generator=torch.Generator().manual_seed(19)).to(device)
    got = base.clone()
    segment_lora_add(x, with_live(lora, 0), list(got.split(ns, dim=1)), backend="triton", form="segments", accumulate=accumulate)
    assert torch.equal(got, base)
    segment_lora_add(x, with_live(lora, 1), list(got.split(ns, dim=1)), backend="triton", form="segments", accumulate=accumulate)
    first = dataclasses.replace(lora, segments=((0, 16, 1),))
    want = base.clone()
    segment_lora_reference(x, first, list(want.split(ns, dim=1)), accumulate=accumulate)
    added = base[:16] if accumulate else torch.zeros_like(base[:16])  # write-first: the delta alone
    assert rel_err(got[:16] - added, want[:16] - added) < 1e-5
    assert torch.equal(got[16:], base[16:])  # (the reference's write-first zeros every other row)


def test_live_programs_are_capped_by_the_table_items():
    cpu = torch.device("cpu")
    assert live_programs(cpu, 1000, 8) == lora_segments.LIVE_PROGRAMS_INTERPRETER
    assert live_programs(cpu, 2, 8) == 2
    assert live_programs(cpu, 0, 8) == 1
    assert live_programs(cpu, 1000, 0) == 1000  # 0: a program per item


def test_a_bad_live_count_tensor_is_refused(device):
    k, ns, tables = group(torch.float32, device)
    lora = make_lora(*tables[:4], tables[4], [(0, 4, 0)], 16)
    x, outs = torch.zeros(4, k, device=device), [torch.zeros(4, n, device=device) for n in ns]
    for bad in (torch.tensor([1, 2], dtype=torch.int32), torch.tensor([1], dtype=torch.int64)):
        with pytest.raises(ValueError, match="SegmentLora.live must be"):
            segment_lora_add(x, dataclasses.replace(lora, live=bad.to(device)), outs, backend="triton", form="segments")


def test_live_grid_variants_do_not_depend_on_the_table_length_or_the_live_count(device):
    """One compiled shrink and one expand serve every table length and live count (both are
    runtime values), as the table grids do; the live kernels are the ones launched."""
    k, ns, tables = group(torch.float32, device)
    x = torch.zeros(100, k, device=device)
    outs = [torch.zeros(100, n, device=device) for n in ns]
    keys = set()
    for pad, live in ((0, 3), (5, 1), (40, 0), (17, 7)):
        lora = make_lora(*tables[:4], tables[4], [(0, 40, 1), (40, 41, 2)], 16, pad_tiles=pad)
        keys.add(segment_kernel_variants(x, with_live(lora, live), outs, form="segments"))
    assert len(keys) == 1
    names = {key[0] for key in next(iter(keys))}
    assert names == {"_live_shrink_kernel", "_live_expand_kernel"}
