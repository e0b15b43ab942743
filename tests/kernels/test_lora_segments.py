"""Prefill segment LoRA over the pool (MBGMM): reference vs float64 PEFT math, Triton vs reference.

The Triton kernels run in the interpreter on CPU (fp32 / fp16; bf16 runs on the GPU through the
engine, scripts/bench_generation.py --step-batch). Tolerances on ||got - want|| / ||want|| of the added
delta: reference vs float64 math 1e-5 (fp32 sums over K <= 70 terms); Triton vs reference fp32
1e-5 (summation order only); fp16 2e-3 (both round the sum into an fp16 output once, and the
outputs' own magnitude is 1: one ulp of it, 9.8e-4, is the most an order difference moves an
element, against deltas of norm about 1 per element); bf16 (GPU only) 1.6e-2, the same one-ulp
argument at bf16's 7.8e-3.
"""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.kernels.lora_segments import (
    NO_ADAPTER,
    SegmentLora,
    covering_segments,
    rank_chunk,
    block_r_for,
    segment_kernel_variants,
    segment_lora_add,
    segment_lora_reference,
    segment_tiles,
)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 arithmetic is wrong in the Triton interpreter")


def rel_err(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def make_pool(ranks, k, ns, dtype, device, seed=0):
    """Adapters (one rank each, one (A [r, K], B [N_g, r]) pair per projection, rank 0 where a
    projection is untargeted) in one flat pool as A then B^T with gaps; returns the pool, the
    [G, A] offset / rank tables and the factors in float64."""
    g = torch.Generator().manual_seed(seed)
    parts, pos = [torch.randn(7, generator=g)], 7
    a_off = torch.zeros(len(ns), len(ranks), dtype=torch.int64)
    b_off = torch.zeros_like(a_off)
    rk = torch.zeros(len(ns), len(ranks), dtype=torch.int32)
    factors = {}
    for ad, rs in enumerate(ranks):
        for p, n in enumerate(ns):
            r = rs[p]
            if r == 0:
                continue
            a = torch.randn(r, k, generator=g) * k**-0.5
            b = torch.randn(n, r, generator=g) * r**-0.5
            a_off[p, ad], b_off[p, ad], rk[p, ad] = pos, pos + r * k, r
            parts += [a.reshape(-1), b.T.reshape(-1), torch.randn(3, generator=g)]
            pos += r * (k + n) + 3
            factors[(ad, p)] = (a, b)
    pool = torch.cat(parts).to(device=device, dtype=dtype)
    factors = {key: (a.to(dtype).double(), b.to(dtype).double()) for key, (a, b) in factors.items()}
    return pool, a_off.to(device), b_off.to(device), rk.to(device), factors


def make_lora(pool, a_off, b_off, rk, scales, segments, block_m, *, pad_tiles=0, block_r=None):
    tiles = segment_tiles(segments, block_m) + [(0, 0, 0)] * pad_tiles
    tiles_t = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 3).t().contiguous().to(pool.device)
    return SegmentLora(pool=pool, tiles=tiles_t, a_offsets=a_off, b_offsets=b_off, ranks=rk,
                       scales=scales.to(pool.device), segments=tuple(segments), block_m=block_m,
                       block_r=block_r or block_r_for(int(rk.max()) if rk.numel() else 0))


def test_segment_tiles_cover_each_segment_in_order():
    tiles = segment_tiles([(0, 5, 2), (5, 6, 0), (9, 41, 1)], 16)
    assert tiles == [(0, 5, 2), (5, 6, 0), (9, 25, 1), (25, 41, 1)]
    assert segment_tiles([], 16) == []


def test_block_r_is_a_power_of_two_holding_the_rank():
    assert [block_r_for(r) for r in (0, 1, 16, 17, 64, 65, 128)] == [16, 16, 16, 32, 64, 128, 128]
    with pytest.raises(ValueError, match="ranks must be in"):
        block_r_for(129)


def test_reference_matches_peft_math_per_segment():
    """The spec, once, against x A^T B^T with PEFT's factors in float64: rows outside every
    segment untouched, a projection an adapter does not target untouched."""
    k, ns = 37, (24, 8, 8)
    ranks = [(4, 4, 4), (8, 0, 8), (2, 2, 0)]
    pool, a_off, b_off, rk, factors = make_pool(ranks, k, ns, torch.float32, "cpu")
    scales = torch.tensor([0.5, 2.0, 1.5])
    segments = [(0, 5, 1), (5, 6, 0), (9, 20, 2), (20, 23, 1)]  # rows 6..8 have no adapter
    x = torch.randn(23, k, generator=torch.Generator().manual_seed(1))
    base = [torch.randn(23, n, generator=torch.Generator().manual_seed(2 + p)) for p, n in enumerate(ns)]
    outs = [y.clone() for y in base]
    segment_lora_reference(x, make_lora(pool, a_off, b_off, rk, scales, segments, 4), outs)
    for p in range(len(ns)):
        want = base[p].double().clone()
        for start, end, ad in segments:
            if (ad, p) in factors:
                a, b = factors[(ad, p)]
                want[start:end] += scales[ad].item() * (x[start:end].double() @ a.T @ b.T)
        assert rel_err(outs[p] - base[p], want - base[p].double()) < 1e-5
        assert torch.equal(outs[p][6:9], base[p][6:9])
    assert torch.equal(outs[1][0:5], base[1][0:5]) and torch.equal(outs[2][9:20], base[2][9:20])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=GPU_ONLY)])
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_triton_matches_reference_on_column_views_of_one_output(device, dtype, block_m):
    """q/k/v-like group: the outputs are column views of one fused GEMM output; segments that
    span several tiles and end mid-tile, mixed ranks (one above 16: a 32-wide rank block), a
    rank-0 projection, padding tiles at the end of the table."""
    k, ns = 70, (48, 16, 16)
    ranks = [(8, 8, 8), (20, 20, 20), (3, 0, 3), (16, 16, 16)]
    pool, a_off, b_off, rk, _ = make_pool(ranks, k, ns, dtype, device, seed=3)
    scales = torch.tensor([2.0, 0.125, 1.0, 0.5])
    segments = [(0, 37, 1), (37, 40, 0), (44, 45, 2), (45, 90, 3), (90, 107, 1)]
    x = torch.randn(110, k, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    base = torch.randn(110, sum(ns), generator=torch.Generator().manual_seed(5)).to(device, dtype)
    lora = make_lora(pool, a_off, b_off, rk, scales, segments, block_m, pad_tiles=3)
    got, want = base.clone(), base.clone()
    segment_lora_add(x, lora, list(got.split(ns, dim=1)), backend="triton", form="segments")
    segment_lora_reference(x, lora, list(want.split(ns, dim=1)))
    assert rel_err(got - base, want - base) < TOL[dtype]
    assert torch.equal(got[40:44], base[40:44]) and torch.equal(got[107:], base[107:])  # no segment there
    assert torch.equal(got[44:45, 48:64], base[44:45, 48:64])  # adapter 2 has no k LoRA


def test_triton_separate_outputs_and_block_r_wider_than_ranks(device):
    """o / down-like single projections into their own tensors; block_r larger than needed."""
    k, ns = 40, (33,)
    ranks = [(5,), (12,)]
    pool, a_off, b_off, rk, _ = make_pool(ranks, k, ns, torch.float32, device, seed=6)
    segments = [(2, 19, 1), (19, 23, 0)]
    lora = make_lora(pool, a_off, b_off, rk, torch.tensor([1.0, 0.75]), segments, 16, block_r=64)
    x = torch.randn(23, k, generator=torch.Generator().manual_seed(7)).to(device)
    got = torch.zeros(23, 33, device=device)
    want = got.clone()
    segment_lora_add(x, lora, [got], backend="triton", form="segments")
    segment_lora_reference(x, lora, [want])
    assert rel_err(got, want) < 1e-5
    assert torch.equal(got[:2], torch.zeros(2, 33, device=device))


@pytest.mark.parametrize("n_blocks,split_k", [(1, 1), (3, 2), (4, 3), (2, 8)])
def test_expand_programs_over_several_column_blocks(device, n_blocks, split_k):
    """An expand program covering 1, 3 or 4 column blocks (the last program's blocks partly or
    wholly past the output's width), the shrink's K in 1, 2, 3 or 8 splits (8: more splits than
    K blocks, the last ones empty): the same sums; a 1-row tile beside a multi-tile segment."""
    k, ns = 70, (100,)
    pool, a_off, b_off, rk, _ = make_pool([(6,), (9,)], k, ns, torch.float32, device, seed=8)
    segments = [(0, 1, 1), (1, 40, 0), (41, 42, 1)]
    lora = make_lora(pool, a_off, b_off, rk, torch.tensor([0.5, 2.0]), segments, 16)
    x = torch.randn(44, k, generator=torch.Generator().manual_seed(9)).to(device)
    base = torch.randn(44, 100, generator=torch.Generator().manual_seed(10)).to(device)
    got, want = base.clone(), base.clone()
    segment_lora_add(x, lora, [got], backend="triton", n_blocks=n_blocks, split_k=split_k, form="segments")
    segment_lora_reference(x, lora, [want])
    assert rel_err(got - base, want - base) < 1e-5
    assert torch.equal(got[40:41], base[40:41]) and torch.equal(got[42:], base[42:])


def test_bad_tables_are_refused_before_any_launch():
    k, ns = 8, (8,)
    pool, a_off, b_off, rk, _ = make_pool([(4,)], k, ns, torch.float32, "cpu")
    x = torch.randn(4, k)
    lora = make_lora(pool, a_off, b_off, rk, torch.tensor([1.0]), [(0, 4, 0)], 16)
    with pytest.raises(ValueError, match="2 outputs"):
        segment_lora_add(x, lora, [torch.zeros(4, 8), torch.zeros(4, 8)], backend="torch")
    with pytest.raises(ValueError, match="ends past"):
        segment_lora_add(x[:3], lora, [torch.zeros(3, 8)], backend="torch")
    with pytest.raises(TypeError, match="pool must be"):
        segment_lora_add(x.half(), lora, [torch.zeros(4, 8, dtype=torch.float16)], backend="torch")
    with pytest.raises(ValueError, match="backend="):
        segment_lora_add(x, lora, [torch.zeros(4, 8)], backend="cuda")
    big = SegmentLora(**{**lora.__dict__, "block_r": 16, "ranks": torch.tensor([[20]], dtype=torch.int32)})
    with pytest.raises(ValueError, match="above block_r"):
        segment_lora_reference(x, big, [torch.zeros(4, 8)])


def test_expand_warps_follow_the_s_tile_size():
    """2 warps for S tiles of at least 64 x 64 (block_m x block_r), the default below: what the
    H100 measured fastest at 64 x 64 and slowest at 64 x 16, 64 x 32 and 32 x 64 (docs/kernels.md)."""
    from lightning_lorafusion.kernels.lora_segments import expand_warps

    assert expand_warps(64, 64) == 2 and expand_warps(64, 128) == 2
    assert expand_warps(64, 16) is None and expand_warps(64, 32) is None and expand_warps(32, 64) is None


def test_every_rank_up_to_128_matches_the_reference_in_one_table(device):
    """Ranks 4, 8, 24, 64 and 128 side by side (one, two, four and eight chunks of the rank loop;
    128 = the widest S): each segment's rows match the reference (fp32, summation order only),
    and a tile of rank 4 beside rank 128 adds only its own rank's terms."""
    k, ns = 40, (24, 40)
    ranks = [(4, 4), (8, 8), (24, 0), (64, 64), (128, 128)]
    pool, a_off, b_off, rk, _ = make_pool(ranks, k, ns, torch.float32, device, seed=11)
    scales = torch.tensor([1.0, 0.5, 2.0, 0.25, 0.125])
    segments = [(0, 5, 4), (5, 9, 0), (9, 30, 3), (30, 31, 1), (31, 50, 2)]
    x = torch.randn(52, k, generator=torch.Generator().manual_seed(12)).to(device)
    base = torch.randn(52, sum(ns), generator=torch.Generator().manual_seed(13)).to(device)
    lora = make_lora(pool, a_off, b_off, rk, scales, segments, 16, pad_tiles=2, block_r=128)
    got, want = base.clone(), base.clone()
    segment_lora_add(x, lora, list(got.split(ns, dim=1)), backend="triton", form="segments")
    segment_lora_reference(x, lora, list(want.split(ns, dim=1)))
    for start, end, _ in segments:
        assert rel_err(got[start:end] - base[start:end], want[start:end] - base[start:end]) < 1e-5
    assert torch.equal(got[50:], base[50:])
    assert torch.equal(got[31:50, 24:], base[31:50, 24:])  # rank 0 on the second projection


def test_compiled_variants_do_not_depend_on_ranks_or_the_s_width():
    """The kernels' compile keys (constexprs, options, JIT specialisations) are the same for
    one rank, for ranks 4-128 mixed, and for any S width: a rank never seen before runs kernels
    already compiled. (The rank is a runtime loop bound.)"""
    k, ns = 64, (32, 48)
    x = torch.randn(40, k)
    keys = []
    for ranks, block_r in (([(8, 8)], 16), ([(8, 8)], 128), ([(4, 4), (8, 0), (24, 24), (64, 64), (128, 128)], 128),
                           ([(128, 128)], 128), ([(24, 24), (40, 40)], 64)):
        pool, a_off, b_off, rk, _ = make_pool(ranks, k, ns, torch.float32, "cpu")
        segments = [(i * 8, i * 8 + 8, i) for i in range(len(ranks))]
        lora = make_lora(pool, a_off, b_off, rk, torch.ones(len(ranks)), segments, 16, block_r=block_r)
        outs = [torch.zeros(40, n) for n in ns]
        keys.append(segment_kernel_variants(x, lora, outs, form="segments"))
    assert all(k_ == keys[0] for k_ in keys)
    assert len(keys[0]) == 3  # one shrink, two expands (one per output width's column-block count)
    assert all(dict(meta)["BLOCK_R"] == rank_chunk(torch.device("cpu")) for _, meta, _ in keys[0])


def make_covering_lora(pool, a_off, b_off, rk, scales, segments, block_m, rows, *, pad_tiles=0):
    """A covering table: the segments' tiles plus ``NO_ADAPTER`` tiles over every other row."""
    lora = make_lora(pool, a_off, b_off, rk, scales, segments, block_m)
    tiles = segment_tiles(segments, block_m, rows=rows) + [(0, 0, 0)] * pad_tiles
    tiles_t = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 3).t().contiguous().to(pool.device)
    return SegmentLora(pool=pool, tiles=tiles_t, a_offsets=lora.a_offsets, b_offsets=lora.b_offsets,
                       ranks=lora.ranks, scales=lora.scales, segments=lora.segments, block_m=block_m,
                       block_r=lora.block_r)


def test_covering_tiles_fill_the_gaps_with_no_adapter_tiles():
    assert covering_segments([(2, 5, 1), (5, 6, 0), (9, 30, 1)], 40) == [
        (0, 2, NO_ADAPTER), (2, 5, 1), (5, 6, 0), (6, 9, NO_ADAPTER), (9, 30, 1), (30, 40, NO_ADAPTER)]
    assert segment_tiles([(3, 4, 0)], 16, rows=40) == [(0, 3, -1), (3, 4, 0), (4, 20, -1), (20, 36, -1),
                                                        (36, 40, -1)]
    assert segment_tiles([], 16, rows=20) == [(0, 16, -1), (16, 20, -1)]
    with pytest.raises(ValueError, match="row order"):
        covering_segments([(5, 9, 0), (2, 4, 1)], 10)
    with pytest.raises(ValueError, match="end by row 8"):
        covering_segments([(5, 9, 0)], 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=GPU_ONLY)])
@pytest.mark.parametrize("block_m", [16, 32])
def test_write_first_writes_every_row_and_a_gemm_adds_the_frozen_product(device, dtype, block_m):
    """Write-first (accumulate=False) over a covering table, into an output full of NaN: every row
    written (the LoRA on the segments' rows, zeros on rows without an adapter and on a
    projection an adapter does not target), equal to the reference's write; then ``addmm_`` of the
    frozen product gives what the product + the additive path gives."""
    k, ns, rows = 70, (48, 16, 16), 120
    ranks = [(8, 8, 8), (20, 20, 20), (3, 0, 3), (16, 16, 16)]
    pool, a_off, b_off, rk, _ = make_pool(ranks, k, ns, dtype, device, seed=3)
    scales = torch.tensor([2.0, 0.125, 1.0, 0.5])
    segments = [(3, 37, 1), (37, 40, 0), (44, 45, 2), (45, 90, 3), (90, 107, 1)]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    w = (torch.randn(sum(ns), k, generator=torch.Generator().manual_seed(5)) * k**-0.5).to(device, dtype)
    lora = make_covering_lora(pool, a_off, b_off, rk, scales, segments, block_m, rows, pad_tiles=2)
    got = torch.full((rows, sum(ns)), float("nan"), dtype=dtype, device=device)
    want = got.clone()
    segment_lora_add(x, lora, list(got.split(ns, dim=1)), backend="triton", accumulate=False, form="segments")
    segment_lora_reference(x, lora, list(want.split(ns, dim=1)), accumulate=False)
    assert not got.isnan().any()
    assert rel_err(got, want) < TOL[dtype]
    zeros = torch.zeros(rows, sum(ns), dtype=dtype, device=device)
    for a, b in ((0, 3), (40, 44), (107, rows)):
        assert torch.equal(got[a:b], zeros[a:b])
    assert torch.equal(got[44:45, 48:64], zeros[44:45, 48:64])  # adapter 2 has no k LoRA
    got.addmm_(x, w.t())
    added = x @ w.t()
    segment_lora_add(x, lora, list(added.split(ns, dim=1)), backend="triton", form="segments")  # additive
    assert rel_err(got - x @ w.t(), added - x @ w.t()) < 2 * TOL[dtype]


def test_additive_paths_skip_no_adapter_tiles(device):
    """A covering table through the additive kernels of both forms: the ``NO_ADAPTER`` tiles
    read no table entry (-1 would be out of bounds) and leave their rows as they are."""
    from lightning_lorafusion.kernels.lora_tiles import tile_lora_add

    k, ns, rows = 40, (33, 20), 70
    pool, a_off, b_off, rk, _ = make_pool([(5, 5), (12, 0)], k, ns, torch.float32, device, seed=6)
    segments = [(2, 19, 1), (19, 23, 0), (40, 61, 1)]
    lora = make_covering_lora(pool, a_off, b_off, rk, torch.tensor([1.0, 0.75]), segments, 16, rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).to(device)
    base = torch.randn(rows, sum(ns), generator=torch.Generator().manual_seed(8)).to(device)
    want = base.clone()
    segment_lora_reference(x, lora, list(want.split(ns, dim=1)))
    for run in (lambda o: segment_lora_add(x, lora, o, backend="triton", form="segments"),
                lambda o: tile_lora_add(x, lora, o)):
        got = base.clone()
        run(list(got.split(ns, dim=1)))
        assert rel_err(got - base, want - base) < 1e-5
        assert torch.equal(got[:2], base[:2]) and torch.equal(got[23:40], base[23:40])


def test_write_first_refuses_the_tiles_form():
    pool, a_off, b_off, rk, _ = make_pool([(4,)], 8, (8,), torch.float32, "cpu")
    lora = make_lora(pool, a_off, b_off, rk, torch.tensor([1.0]), [(0, 4, 0)], 16)
    with pytest.raises(ValueError, match="write-first"):
        segment_lora_add(torch.zeros(4, 8), lora, [torch.zeros(4, 8)], backend="triton", form="tiles",
                         accumulate=False)
