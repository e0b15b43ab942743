"""The prefill LoRA's split-K shrink (``lora_splitk``): K split by the step's size with the splits
summed in the shrink, before ``lora_segments``' expand (form "splitk") or its own (form "items",
``splitk_lora_add``), against the torch reference.

Interpreter runs on the CPU in fp32 / fp16 (bf16 on the GPU only); tolerances as in
test_lora_segments.py (fp32 1e-5: summation order only; fp16 2e-3: one rounding into fp16).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_lorafusion.kernels import lora_splitk
from lightning_lorafusion.kernels.lora_segments import (segment_kernel_variants, segment_lora_add,
                                                        segment_lora_reference, segment_tiles)
from lightning_lorafusion.kernels.lora_splitk import shrink_split, splitk_lora_add
from test_lora_segments import GPU_ONLY, TOL, make_lora, make_pool, rel_err

DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=GPU_ONLY)]


def group(dtype, device, seed=3, k=70):
    ns = (48, 16, 16)
    ranks = [(8, 8, 8), (20, 20, 20), (3, 0, 3), (16, 16, 16), (0, 0, 0), (37, 37, 37)]
    pool, a_off, b_off, rk, _ = make_pool(ranks, k, ns, dtype, device, seed=seed)
    return k, ns, (pool, a_off, b_off, rk, torch.tensor([2.0, 0.125, 1.0, 0.5, 1.0, 0.25]))


def with_live(lora, count: int):
    return dataclasses.replace(lora, live=torch.tensor([count], dtype=torch.int32, device=lora.pool.device))


def run_both(x, lora, ns, base, *, accumulate=True, form="items", **opts):
    got, want = base.clone(), base.clone()
    if form == "items":
        splitk_lora_add(x, lora, list(got.split(ns, dim=1)), accumulate=accumulate, **opts)
    else:
        segment_lora_add(x, lora, list(got.split(ns, dim=1)), backend="triton", form=form, accumulate=accumulate,
                         **opts)
    segment_lora_reference(x, lora, list(want.split(ns, dim=1)), accumulate=accumulate)
    return got, want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k,form", [(1, "items"), (3, "items"), (5, "items"), (3, "splitk"), (5, "splitk")])
def test_splitk_matches_the_reference_mixed_ranks_one_row_segments_and_padding(device, dtype, split_k, form):
    """Segments of 1 row and many tiles, ranks 3-37 (a rank above the 16-wide chunk, a rank-0
    projection, an adapter of rank 0 everywhere), padding tiles; rows outside every segment and
    the untargeted projection untouched; the counters left zero."""
    k, ns, tables = group(dtype, device, k=97)
    segments = [(0, 1, 5), (1, 37, 1), (37, 40, 0), (44, 45, 2), (45, 90, 3), (90, 92, 4), (92, 107, 5)]
    lora = make_lora(*tables[:4], tables[4], segments, 16, pad_tiles=3)
    x = torch.randn(110, k, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    base = torch.randn(110, sum(ns), generator=torch.Generator().manual_seed(5)).to(device, dtype)
    counters = torch.zeros(lora.tiles.shape[1] * 3, dtype=torch.int32, device=device)
    lora = dataclasses.replace(lora, counters=counters)
    got, want = run_both(x, lora, ns, base, split_k=split_k, form=form)
    assert rel_err(got - base, want - base) < TOL[dtype]
    assert torch.equal(got[40:44], base[40:44]) and torch.equal(got[107:], base[107:])
    assert torch.equal(got[44:45, 48:64], base[44:45, 48:64])  # adapter 2 has no k LoRA
    assert torch.equal(got[90:92], base[90:92])  # adapter 4: rank 0 everywhere
    assert not counters.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", ["items", "splitk"])
def test_splitk_write_first_over_a_covering_table(device, dtype, form):
    """Write-first into NaN over a covering table (base rows in tiles of no adapter): every row
    written, zeros where no LoRA, equal to the reference's write."""
    k, ns, tables = group(dtype, device, seed=7)
    rows = 120
    segments = [(3, 37, 1), (37, 40, 0), (44, 45, 2), (45, 90, 3), (90, 107, 5)]
    tiles = segment_tiles(segments, 16, rows=rows)
    lora = dataclasses.replace(make_lora(*tables[:4], tables[4], segments, 16),
                               tiles=torch.tensor(tiles, dtype=torch.int32).reshape(-1, 3).t().contiguous().to(device))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(8)).to(device, dtype)
    base = torch.full((rows, sum(ns)), float("nan"), dtype=dtype, device=device)
    got, want = run_both(x, lora, ns, base, accumulate=False, split_k=2, form=form)
    assert not got.isnan().any()
    assert rel_err(got, want) < TOL[dtype]
    assert not got[40:44].any() and not got[107:].any() and not got[:3].any()


@pytest.mark.parametrize("programs", [(1, 1), (2, 3), (0, 0), (-1, -1)])
def test_splitk_walks_the_live_tiles_only_with_any_program_count(device, monkeypatch, programs):
    """A table padded with 30 empty tiles, its live count on the device: 1-3 programs (per SM;
    the interpreter counts 2 SMs) walk every item, or a program per item of the rows' tiles
    (fewer than the live ones here: some walk two); tiles past the count are not run."""
    k, ns, tables = group(torch.float32, device, seed=9)
    segments = [(0, 1, 1), (1, 40, 0), (41, 42, 2), (42, 77, 3)]
    lora = make_lora(*tables[:4], tables[4], segments, 16, pad_tiles=30)
    n_live = len(segment_tiles(segments, 16))
    x = torch.randn(80, k, generator=torch.Generator().manual_seed(10)).to(device)
    base = torch.randn(80, sum(ns), generator=torch.Generator().manual_seed(11)).to(device)
    got, want = run_both(x, with_live(lora, n_live), ns, base, programs=programs, split_k=3, n_blocks=2)
    assert rel_err(got - base, want - base) < 1e-5
    first = base.clone()
    splitk_lora_add(x, with_live(lora, 1), list(first.split(ns, dim=1)), programs=programs, split_k=3)
    assert torch.equal(first[1:], base[1:]) and not torch.equal(first[:1], base[:1])


def test_splitk_is_deterministic_and_equal_for_any_program_count(device):
    """The splits are summed in split order by whichever program arrives last: the same output
    bit for bit whatever walks the items."""
    k, ns, tables = group(torch.float32, device, seed=12, k=130)
    lora = make_lora(*tables[:4], tables[4], [(0, 33, 1), (33, 60, 5)], 16)
    x = torch.randn(60, k, generator=torch.Generator().manual_seed(13)).to(device)
    base = torch.randn(60, sum(ns), generator=torch.Generator().manual_seed(14)).to(device)
    outs = []
    for programs in ((0, 0), (1, 1), (3, 2)):
        got = base.clone()
        splitk_lora_add(x, lora, list(got.split(ns, dim=1)), programs=programs, split_k=4)
        outs.append(got)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_empty_table_and_empty_adapters_do_nothing(device):
    k, ns, tables = group(torch.float32, device)
    x = torch.randn(20, k, device=device)
    base = torch.randn(20, sum(ns), device=device)
    for segments in ([], [(0, 20, 4)]):  # no tile; one adapter of rank 0 on every projection
        got = base.clone()
        splitk_lora_add(x, make_lora(*tables[:4], tables[4], segments, 16), list(got.split(ns, dim=1)))
        assert torch.equal(got, base)


def test_split_count_follows_the_step_size():
    """Few tiles: K split up to SPLIT_MIN_K per split; many: the target reached with few splits;
    the partials kept within the row budget."""
    assert shrink_split(4096, 3, 256, 64, 132) == 16  # one 256-row prompt: 4 tiles x 3 x 16
    assert shrink_split(14336, 1, 256, 64, 132) == 56
    assert shrink_split(4096, 3, 8192, 64, 132) == 2
    assert shrink_split(14336, 1, 8192, 64, 132) == 5
    assert shrink_split(64, 3, 16, 16, 132) == 1
    for rows in (1, 100, 3000, 8192, 32768):
        s = shrink_split(14336, 3, rows, 64, 132)
        assert s >= 1 and (s == 1 or s * 3 * rows <= lora_splitk.SPLIT_ROW_BUDGET)


@pytest.mark.parametrize("form", ["splitk", "items"])
def test_forms_via_segment_lora_add_and_one_compiled_variant_for_every_rank_mix(device, form):
    """``form="splitk"`` / ``"items"`` dispatch here; the compile keys are the same for ranks
    3-37 and one rank, any table length, split count and live count."""
    k, ns, tables = group(torch.float32, device)
    x = torch.randn(60, k, device=device)
    base = torch.randn(60, sum(ns), device=device)
    lora = make_lora(*tables[:4], tables[4], [(0, 33, 1), (33, 60, 5)], 16)
    got, want = base.clone(), base.clone()
    segment_lora_add(x, lora, list(got.split(ns, dim=1)), backend="triton", form=form)
    segment_lora_reference(x, lora, list(want.split(ns, dim=1)))
    assert rel_err(got - base, want - base) < 1e-5
    outs = list(base.split(ns, dim=1))
    keys = {segment_kernel_variants(x, make_lora(*tables[:4], tables[4], segs, 16, pad_tiles=pad, block_r=128),
                                    outs, form=form, split_k=split)
            for segs, pad, split in (([(0, 33, 1), (33, 60, 5)], 0, 1), ([(0, 5, 3)], 9, 4), ([(2, 60, 0)], 1, 2))}
    assert len(keys) == 1
    live = {segment_kernel_variants(x, with_live(make_lora(*tables[:4], tables[4], segs, 16, pad_tiles=pad), n),
                                    outs, form=form)
            for segs, pad, n in (([(0, 33, 1), (33, 60, 5)], 3, 4), ([(0, 5, 3)], 9, 1))}
    assert len(live) == 1


def test_factor_alignment_is_checked_and_an_aligned_pool_runs(device):
    """``factor_align`` promises the offsets' alignment (vector loads on a GPU): 1-16, powers of
    two; a pool laid out at multiples of 16 elements runs with 16 (the shrink's loads, and the
    expands' with ``expand_align``)."""
    k, ns = 64, (32, 16)
    lora = make_lora(*group(torch.float32, device)[2][:4], torch.ones(6), [(0, 5, 1)], 16)
    x = torch.zeros(5, 70, device=device)
    with pytest.raises(ValueError, match="factor_align"):
        dataclasses.replace(lora, factor_align=3).check(x, [torch.zeros(5, n, device=device) for n in (48, 16, 16)])
    pool = torch.randn(16 + 2 * 8 * (k + sum(ns)), generator=torch.Generator().manual_seed(20)).to(device)
    offs = torch.tensor([[16, 16 + 8 * (k + ns[0])], [16 + 8 * k, 16 + 8 * (2 * k + ns[0])]], dtype=torch.int64)
    aligned = dataclasses.replace(
        make_lora(pool, offs[0:1].T.reshape(2, 1).to(device), offs[1:2].T.reshape(2, 1).to(device),
                  torch.full((2, 1), 8, dtype=torch.int32, device=device), torch.ones(1), [(0, 30, 0)], 16),
        factor_align=16)
    x = torch.randn(30, k, generator=torch.Generator().manual_seed(21)).to(device)
    base = torch.randn(30, sum(ns), generator=torch.Generator().manual_seed(22)).to(device)
    got, want = run_both(x, aligned, ns, base, split_k=2)
    assert rel_err(got - base, want - base) < 1e-5
    got, want = run_both(x, aligned, ns, base, form="splitk", expand_align=True)  # the expands' vector loads
    assert rel_err(got - base, want - base) < 1e-5


@pytest.mark.parametrize("programs", [1, 3, 0])
def test_splitk_form_walks_the_live_tiles_and_equals_the_items_form(device, programs):
    """Form "splitk" (this shrink, ``lora_segments``' live expand over the summed S) over a padded
    table with its live count: 1 or 3 shrink programs per SM walking, or one per item; equal to
    the reference; tiles past the count not run."""
    k, ns, tables = group(torch.float32, device, seed=23)
    segments = [(0, 1, 1), (1, 40, 0), (41, 42, 2), (42, 77, 5)]
    lora = make_lora(*tables[:4], tables[4], segments, 16, pad_tiles=30)
    n_live = len(segment_tiles(segments, 16))
    x = torch.randn(80, k, generator=torch.Generator().manual_seed(24)).to(device)
    base = torch.randn(80, sum(ns), generator=torch.Generator().manual_seed(25)).to(device)
    got, want = run_both(x, with_live(dataclasses.replace(lora, factor_align=1), n_live), ns, base, form="splitk",
                         split_k=3, per_sm=(programs, None), expand_align=True, expand_stages=0)
    assert rel_err(got - base, want - base) < 1e-5
    first = base.clone()
    segment_lora_add(x, with_live(lora, 1), list(first.split(ns, dim=1)), backend="triton", form="splitk", split_k=3)
    assert torch.equal(first[1:], base[1:]) and not torch.equal(first[:1], base[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_small_steps_take_their_split_and_expand_blocks(device, dtype, monkeypatch):
    """Form "splitk" over at most ``SMALL_STEP_ROWS`` rows: the shrink's K in
    ``SMALL_STEP_SPLITS`` parts (capped where K is short), ``SMALL_STEP_EXPAND_BLOCKS`` column
    blocks per expand program; written first over a covering table, equal to the reference."""
    from lightning_lorafusion.kernels import lora_segments

    k, ns, tables = group(dtype, device, seed=9, k=257)  # (3 splits of K blocks of 16 and of 64: 96 / 128 wide)
    rows = 60
    segments = [(3, 37, 1), (37, 40, 0), (44, 45, 2), (45, 58, 5)]
    tiles = segment_tiles(segments, 16, rows=rows)
    lora = dataclasses.replace(make_lora(*tables[:4], tables[4], segments, 16),
                               tiles=torch.tensor(tiles, dtype=torch.int32).reshape(-1, 3).t().contiguous().to(device))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(8)).to(device, dtype)
    outs = [torch.empty(rows, n, dtype=dtype, device=device) for n in ns]
    monkeypatch.setattr(lora_segments, "SMALL_STEP_ROWS", None)
    plain = lora_segments._segment_launches(x, lora, outs, n_blocks=None, split_k=None, warps=(None, None),
                                            splitk=True)
    monkeypatch.setattr(lora_segments, "SMALL_STEP_ROWS", rows)
    monkeypatch.setattr(lora_segments, "SMALL_STEP_SPLITS", 3)
    small = lora_segments._segment_launches(x, lora, outs, n_blocks=None, split_k=None, warps=(None, None),
                                            splitk=True)
    assert small[0][2][10] == 3 != plain[0][2][10]  # the shrink's split count (its n_split argument)
    assert all(m["N_BLOCKS"] == lora_segments.SMALL_STEP_EXPAND_BLOCKS for _, _, _, m in small[1:])
    base = torch.full((rows, sum(ns)), float("nan"), dtype=dtype, device=device)
    got, want = run_both(x, lora, ns, base, accumulate=False, form="splitk")
    assert not got.isnan().any() and rel_err(got, want) < TOL[dtype]
    monkeypatch.setattr(lora_segments, "SMALL_STEP_ROWS", rows - 1)
    assert lora_segments._segment_launches(x, lora, outs, n_blocks=None, split_k=None, warps=(None, None),
                                           splitk=True)[0][2][10] == plain[0][2][10]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form,live", [("splitk", False), ("splitk", True), ("segments", False), ("segments", True)])
def test_shrink_launched_apart_gives_the_same_bits(device, dtype, form, live):
    """``segment_lora_shrink`` (the shrink alone; on a GPU on a second stream, a GEMM enqueued on the
    current one meanwhile) then ``segment_lora_add(shrunk=)`` (the expands alone): the same bits
    as the whole ``segment_lora_add``, additive, over a padded table (its live count or grids over
    the table); S of a wrong shape refused; other forms and an empty table launch nothing."""
    from lightning_lorafusion.kernels.lora_segments import segment_lora_shrink

    k, ns, tables = group(dtype, device, seed=31, k=97)
    segments = [(0, 1, 1), (1, 40, 0), (41, 42, 2), (42, 77, 5)]
    lora = make_lora(*tables[:4], tables[4], segments, 16, pad_tiles=5)
    lora = dataclasses.replace(lora, counters=torch.zeros(lora.tiles.shape[1] * 3, dtype=torch.int32, device=device))
    if live:
        lora = with_live(lora, len(segment_tiles(segments, 16)))
    x = torch.randn(80, k, generator=torch.Generator().manual_seed(32)).to(device, dtype)
    base = torch.randn(80, sum(ns), generator=torch.Generator().manual_seed(33)).to(device, dtype)
    want = base.clone()
    segment_lora_add(x, lora, list(want.split(ns, dim=1)), backend="triton", form=form)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    shrunk = segment_lora_shrink(x, lora, form=form, stream=side)
    if side is not None:
        x @ torch.randn(512, k, device=device, dtype=dtype).t()  # (the frozen GEMM's stand-in)
        torch.cuda.current_stream(device).wait_stream(side)
    got = base.clone()
    segment_lora_add(x, lora, list(got.split(ns, dim=1)), backend="triton", form=form, shrunk=shrunk)
    assert torch.equal(got, want)
    assert not lora.counters.any()
    with pytest.raises(ValueError, match="shrunk"):
        segment_lora_add(x, lora, list(got.split(ns, dim=1)), backend="triton", form=form,
                         shrunk=(shrunk[0][:, :, :10], shrunk[1]))
    with pytest.raises(ValueError, match="shrunk"):
        segment_lora_add(x, lora, list(got.split(ns, dim=1)), backend="triton", form="items", shrunk=shrunk)
    assert segment_lora_shrink(x, lora, form="items") is None
    with pytest.raises(ValueError, match="rows"):  # tables checked before the launch
        segment_lora_shrink(x[:1], dataclasses.replace(lora, segments=((0, 5, 0),)), form=form)
    empty = dataclasses.replace(lora, tiles=lora.tiles[:, :0])
    assert segment_lora_shrink(x, empty, form=form) is None
