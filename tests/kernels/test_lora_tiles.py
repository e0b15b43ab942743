"""Row-tile LoRA with S held across column blocks (``kernels/lora_tiles.py``) against the torch
reference of ``lora_segments``: the Triton kernels in the interpreter on CPU (fp32 / fp16),
tolerances as in test_lora_segments.py (fp32 1e-5: summation order only; fp16 2e-3: one ulp of
outputs of magnitude 1)."""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.kernels.lora_segments import segment_lora_reference
from lightning_lorafusion.kernels.lora_tiles import (
    held_ranks,
    tile_launches,
    tile_lora_add,
    tile_shrink_splits,
)

from test_lora_segments import GPU_ONLY, TOL, make_lora, make_pool, rel_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=GPU_ONLY)])
@pytest.mark.parametrize("block_m", [16, 32])
def test_matches_reference_on_column_views_of_one_output(device, dtype, block_m):
    """q/k/v-like group into column views of one output: ranks held in the small tile, in the
    wide one and above both (chunks per column block), a rank-0 projection, rows outside every
    segment, padding tiles."""
    k, ns = 70, (48, 16, 16)
    ranks = [(8, 8, 8), (20, 20, 20), (3, 0, 3), (40, 40, 40)]
    pool, a_off, b_off, rk, _ = make_pool(ranks, k, ns, dtype, device, seed=3)
    scales = torch.tensor([2.0, 0.125, 1.0, 0.5])
    segments = [(0, 37, 1), (37, 40, 0), (44, 45, 2), (45, 90, 3), (90, 107, 1)]
    x = torch.randn(110, k, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    base = torch.randn(110, sum(ns), generator=torch.Generator().manual_seed(5)).to(device, dtype)
    lora = make_lora(pool, a_off, b_off, rk, scales, segments, block_m, pad_tiles=3, block_r=64)
    got, want = base.clone(), base.clone()
    tile_lora_add(x, lora, list(got.split(ns, dim=1)), hold=True)
    segment_lora_reference(x, lora, list(want.split(ns, dim=1)))
    assert rel_err(got - base, want - base) < TOL[dtype]
    assert torch.equal(got[40:44], base[40:44]) and torch.equal(got[107:], base[107:])
    assert torch.equal(got[44:45, 48:64], base[44:45, 48:64])  # adapter 2 has no k LoRA


@pytest.mark.parametrize("n_blocks,split_k", [(1, 1), (3, 2), (8, 3), (2, 8)])
def test_column_blocks_and_k_splits(device, n_blocks, split_k):
    """An expand program over 1, 2, 3 or 8 column blocks (some past the width), the shrink's K in
    1, 2, 3 or 8 splits (the last ones empty): the same sums; every rank up to 128 beside each
    other (small tile, wide tile, chunks of the wide one)."""
    k, ns = 70, (100,)
    ranks = [(6,), (9,), (16,), (17,), (32,), (33,), (128,)]
    pool, a_off, b_off, rk, _ = make_pool(ranks, k, ns, torch.float32, device, seed=8)
    segments = [(0, 1, 1), (1, 40, 0), (41, 42, 1), (42, 50, 2), (50, 61, 3), (61, 70, 4), (70, 79, 5), (79, 97, 6)]
    scales = torch.tensor([0.5, 2.0, 1.0, 0.25, 0.75, 1.5, 0.125])
    lora = make_lora(pool, a_off, b_off, rk, scales, segments, 16, block_r=128)
    x = torch.randn(99, k, generator=torch.Generator().manual_seed(9)).to(device)
    base = torch.randn(99, 100, generator=torch.Generator().manual_seed(10)).to(device)
    got, want = base.clone(), base.clone()
    tile_lora_add(x, lora, [got], n_blocks=n_blocks, split_k=split_k)
    segment_lora_reference(x, lora, [want])
    for start, end, _ in segments:
        assert rel_err(got[start:end] - base[start:end], want[start:end] - base[start:end]) < 1e-5
    assert torch.equal(got[40:41], base[40:41]) and torch.equal(got[97:], base[97:])


def test_shrink_splits_k_by_its_length():
    """One split per 512 of K, at most 4 (the rule measured fastest); never more than the pool's
    sizing reserves S for."""
    from lightning_lorafusion.kernels.lora_segments import SHRINK_MAX_SPLITS

    assert [tile_shrink_splits(k, 8192, 64, 1) for k in (256, 512, 1024, 1536, 4096, 14336)] == [1, 1, 2, 3, 4, 4]
    assert max(tile_shrink_splits(k, 1, 64, 1) for k in (4096, 14336, 65536)) <= SHRINK_MAX_SPLITS


@pytest.mark.parametrize("hold,lowp", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_expand_options_match_the_reference(device, dtype, hold, lowp):
    """S held over the column blocks (small and wide tiles, chunks above both) and the 16-bit dot:
    the reference's sums within the dtype's tolerance (lowp in fp16 rounds S to fp16 too: the
    fp16 bound, 2e-3, covers one rounding of S of magnitude ~1 at 9.8e-4)."""
    k, ns = 70, (100,)
    ranks = [(6,), (9,), (16,), (17,), (32,), (33,), (128,)]
    pool, a_off, b_off, rk, _ = make_pool(ranks, k, ns, dtype, device, seed=8)
    segments = [(0, 1, 1), (1, 40, 0), (41, 42, 1), (42, 50, 2), (50, 61, 3), (61, 70, 4), (70, 79, 5), (79, 97, 6)]
    scales = torch.tensor([0.5, 2.0, 1.0, 0.25, 0.75, 1.5, 0.125])
    lora = make_lora(pool, a_off, b_off, rk, scales, segments, 16, block_r=128)
    x = torch.randn(99, k, generator=torch.Generator().manual_seed(9)).to(device, dtype)
    base = torch.randn(99, 100, generator=torch.Generator().manual_seed(10)).to(device, dtype)
    got, want = base.clone(), base.clone()
    tile_lora_add(x, lora, [got], hold=hold, lowp=lowp, n_blocks=2, split_k=2)
    segment_lora_reference(x, lora, [want])
    assert rel_err(got - base, want - base) < TOL[dtype]
    assert torch.equal(got[40:41], base[40:41]) and torch.equal(got[97:], base[97:])


def test_store_only_writes_the_delta_and_reads_nothing(device):
    """``store_only``: the tiles' rows of each output = the delta (what was there is not read);
    rows outside every tile keep what they held."""
    k, ns = 40, (24, 40)
    pool, a_off, b_off, rk, _ = make_pool([(4, 4), (40, 40)], k, ns, torch.float32, device, seed=11)
    segments = [(0, 9, 1), (9, 30, 0)]
    lora = make_lora(pool, a_off, b_off, rk, torch.tensor([1.0, 0.5]), segments, 16, block_r=64)
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(12)).to(device)
    got = torch.full((32, sum(ns)), 7.0, device=device)
    tile_lora_add(x, lora, list(got.split(ns, dim=1)), store_only=True)
    want = torch.zeros(32, sum(ns), device=device)
    segment_lora_reference(x, lora, list(want.split(ns, dim=1)))
    assert rel_err(got[:30], want[:30]) < 1e-5
    assert torch.equal(got[30:], torch.full((2, sum(ns)), 7.0, device=device))


def test_one_compiled_variant_for_every_rank_mix():
    """The launches' constexprs do not depend on the ranks present or on S's width: a rank never
    seen before runs kernels already compiled."""
    k, ns = 64, (32, 48)
    x = torch.randn(40, k)
    metas = []
    for ranks, block_r in (([(8, 8)], 16), ([(4, 4), (24, 0), (64, 64), (128, 128)], 128), ([(40, 40)], 64)):
        pool, a_off, b_off, rk, _ = make_pool(ranks, k, ns, torch.float32, "cpu")
        segments = [(i * 8, i * 8 + 8, i) for i in range(len(ranks))]
        lora = make_lora(pool, a_off, b_off, rk, torch.ones(len(ranks)), segments, 16, block_r=block_r)
        launches = tile_launches(x, lora, [torch.zeros(40, n) for n in ns])
        metas.append([(kernel.fn.__name__, tuple(sorted(meta.items()))) for kernel, _, _, meta in launches])
    assert all(m == metas[0] for m in metas)
    small, held = held_ranks(torch.device("cpu"))
    assert dict(metas[0][1][1])["SMALL_R"] == small and dict(metas[0][1][1])["HELD_R"] == held


def test_compile_keys_do_not_depend_on_ranks_or_the_s_width():
    """Every launch's compile key (constexprs, options, what the JIT specialises the other
    arguments on) is the same for one rank and for ranks 4-128 mixed at any S width."""
    from lightning_lorafusion.kernels.lora_segments import segment_kernel_variants

    k, ns = 64, (32, 48)
    x = torch.randn(40, k)
    keys = []
    for ranks, block_r in (([(8, 8)], 16), ([(4, 4), (8, 0), (24, 24), (64, 64), (128, 128)], 128),
                           ([(40, 40)], 64)):
        pool, a_off, b_off, rk, _ = make_pool(ranks, k, ns, torch.float32, "cpu")
        segments = [(i * 8, i * 8 + 8, i) for i in range(len(ranks))]
        lora = make_lora(pool, a_off, b_off, rk, torch.ones(len(ranks)), segments, 16, block_r=block_r)
        keys.append(segment_kernel_variants(x, lora, [torch.zeros(40, n) for n in ns], form="tiles"))
    assert all(key == keys[0] for key in keys)
    assert {name for name, _, _ in keys[0]} == {"_tile_shrink_kernel", "_tile_expand_kernel"}


def test_segment_lora_add_dispatches_by_form(device):
    """``form="tiles"``, ``"segments"``, ``"splitk"``, ``"items"`` and the default (the one measured
    fastest, "splitk") give the reference's sums; an unknown form is refused."""
    from lightning_lorafusion.kernels.lora_segments import DEFAULT_FORM

    assert DEFAULT_FORM == "splitk"
    from lightning_lorafusion.kernels.lora_segments import segment_lora_add

    k, ns = 40, (33,)
    pool, a_off, b_off, rk, _ = make_pool([(5,), (40,)], k, ns, torch.float32, device, seed=6)
    lora = make_lora(pool, a_off, b_off, rk, torch.tensor([1.0, 0.75]), [(2, 19, 1), (19, 23, 0)], 16, block_r=64)
    x = torch.randn(23, k, generator=torch.Generator().manual_seed(7)).to(device)
    want = torch.zeros(23, 33, device=device)
    segment_lora_reference(x, lora, [want])
    for form in (None, "tiles", "segments", "splitk", "items"):
        got = torch.zeros(23, 33, device=device)
        segment_lora_add(x, lora, [got], backend="triton", form=form)
        assert rel_err(got, want) < 1e-5
    with pytest.raises(ValueError, match="form="):
        segment_lora_add(x, lora, [want], backend="triton", form="fused")


def test_refuses_the_cpu_without_the_interpreter(monkeypatch):
    k, ns = 8, (8,)
    pool, a_off, b_off, rk, _ = make_pool([(4,)], k, ns, torch.float32, "cpu")
    lora = make_lora(pool, a_off, b_off, rk, torch.tensor([1.0]), [(0, 4, 0)], 16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        tile_lora_add(torch.randn(4, k), lora, [torch.zeros(4, 8)])
    with pytest.raises(ValueError, match="backend="):
        tile_lora_add(torch.randn(4, k), lora, [torch.zeros(4, 8)], backend="cuda")
