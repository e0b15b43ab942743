"""Decode LoRA gather (S-LoRA MBGMV): reference vs plain per-row math, Triton vs reference.

The Triton kernel runs in the interpreter on CPU (fp32 / fp16; bf16 is checked on the GPU by
scripts/bench_generation.py --step-batch). Tolerances on ||got - want|| / ||want||:
reference vs float64 per-row math: 1e-5 (fp32 matmuls over K <= 257 terms land near 1e-7);
Triton vs reference, fp32: 1e-5 (same fp32 inputs, only the summation order differs);
fp16: 1e-3 (both sum the same fp16 inputs in fp32 and round once to fp16, unit roundoff
4.9e-4: a one-ulp disagreement on an element is the most a different order can cause).
"""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.kernels.lora_gather import _lora_gather_triton, lora_gather, lora_gather_reference

from _decode_groups import assert_per_row_bits, wrong_groups

TOL = {torch.float32: 1e-5, torch.float16: 1e-3}


def rel_err(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def make_adapters(ranks, k, n, dtype, device, seed=0):
    """PEFT-layout factors (lora_A [r, K], lora_B [N, r]) packed into one flat pool as A then
    B^T, with a gap between adapters; returns (pool, [(a_offset, b_offset, A, B)])."""
    g = torch.Generator().manual_seed(seed)
    parts, adapters, pos = [], [], 3
    parts.append(torch.randn(pos, generator=g))
    for r in ranks:
        a = torch.randn(r, k, generator=g) * k**-0.5
        b = torch.randn(n, r, generator=g) * max(r, 1) ** -0.5
        adapters.append((pos, pos + r * k, a, b))
        parts += [a.reshape(-1), b.T.reshape(-1), torch.randn(5, generator=g)]
        pos += r * (k + n) + 5
    pool = torch.cat(parts).to(device=device, dtype=dtype)
    return pool, [(ao, bo, a.to(dtype).double(), b.to(dtype).double()) for ao, bo, a, b in adapters]


def make_routing(adapters, row_adapter, ranks, device, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    a_off = torch.tensor([adapters[i][0] for i in row_adapter], dtype=torch.int64, device=device)
    b_off = torch.tensor([adapters[i][1] for i in row_adapter], dtype=torch.int64, device=device)
    rk = torch.tensor([ranks[i] for i in row_adapter], dtype=torch.int32, device=device)
    scales = (torch.rand(len(row_adapter), generator=g) * 2 + 0.5).to(device)
    return a_off, b_off, rk, scales


def test_reference_matches_per_row_peft_math():
    """The spec, checked once against x A^T B^T with PEFT's (un-transposed) factors."""
    k, n, ranks = 47, 123, [1, 5, 16, 0]
    pool, adapters = make_adapters(ranks, k, n, torch.float32, "cpu")
    row_adapter = [2, 0, 3, 1, 2, 2, 1]
    a_off, b_off, rk, scales = make_routing(adapters, row_adapter, ranks, "cpu")
    x = torch.randn(len(row_adapter), k, generator=torch.Generator().manual_seed(3))
    got = lora_gather_reference(x, pool, a_off, b_off, rk, scales, n)
    want = torch.zeros(len(row_adapter), n, dtype=torch.float64)
    for i, ad in enumerate(row_adapter):
        _, _, a, b = adapters[ad]
        if ranks[ad]:
            want[i] = float(scales[i]) * (x[i].double() @ a.T) @ b.T
    assert got.dtype == torch.float32 and got.shape == (len(row_adapter), n)
    assert rel_err(got, want) < 1e-5
    assert torch.equal(got[2], torch.zeros(n))  # rank 0: no LoRA

    y = torch.randn(len(row_adapter), n)
    y0 = y.clone()
    assert lora_gather_reference(x, pool, a_off, b_off, rk, scales, n, out=y) is y
    assert rel_err(y, y0.double() + want) < 1e-5


CASES = {
    # name: (K, N, adapter ranks, row -> adapter)
    "mixed_ranks": (47, 123, [1, 5, 16, 64, 0], [3, 0, 4, 2, 1, 3, 2, 0]),
    "B1": (257, 47, [16], [0]),
    "B37_few_adapters": (123, 47, [8, 0, 5], [i * 7 % 3 for i in range(37)]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_matches_reference(device, dtype, case):
    k, n, ranks, row_adapter = CASES[case]
    pool, adapters = make_adapters(ranks, k, n, dtype, device)
    a_off, b_off, rk, scales = make_routing(adapters, row_adapter, ranks, device)
    x = torch.randn(len(row_adapter), k, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    want = lora_gather_reference(x, pool, a_off, b_off, rk, scales, n)
    got = lora_gather(x, pool, a_off, b_off, rk, scales, n, backend="triton")
    assert got.dtype == dtype and got.shape == want.shape
    assert rel_err(got, want) < TOL[dtype], f"{case}: {rel_err(got, want):.2e}"
    zero_rows = [i for i, ad in enumerate(row_adapter) if ranks[ad] == 0]
    assert torch.all(got[zero_rows] == 0)


def test_triton_adds_into_strided_out_and_reads_strided_x(device):
    """The engine's use: y = x W^T for a fused projection, LoRA added into a column slice of
    it; x a column slice of a wider activation. Rows with rank 0 keep y exactly."""
    k, n, ranks, row_adapter = 47, 123, [5, 0, 16], [0, 1, 2, 0, 2, 1]
    pool, adapters = make_adapters(ranks, k, n, torch.float32, device)
    a_off, b_off, rk, scales = make_routing(adapters, row_adapter, ranks, device)
    g = torch.Generator().manual_seed(7)
    x_wide = torch.randn(len(row_adapter), k + 9, generator=g).to(device)
    y_wide = torch.randn(len(row_adapter), n + 20, generator=g).to(device)
    x, out = x_wide[:, 4 : 4 + k], y_wide[:, 10 : 10 + n]
    want_wide = y_wide.clone()
    lora_gather_reference(x, pool, a_off, b_off, rk, scales, n, out=want_wide[:, 10 : 10 + n])
    before = y_wide.clone()
    assert lora_gather(x, pool, a_off, b_off, rk, scales, n, out=out, backend="triton") is out
    assert rel_err(y_wide, want_wide) < TOL[torch.float32]
    assert torch.equal(y_wide[:, :10], before[:, :10]) and torch.equal(y_wide[:, 10 + n :], before[:, 10 + n :])
    assert torch.equal(y_wide[[1, 5]], before[[1, 5]])


def test_triton_max_rank_and_rank_above_it(device):
    """Rank 128 (MAX_RANK, several rank blocks) is exact; a row above it comes out NaN from the
    kernel (it cannot check on the host) while the reference raises; other rows are unaffected."""
    k, n, ranks = 33, 47, [128, 3, 129]
    pool, adapters = make_adapters(ranks, k, n, torch.float32, device)
    a_off, b_off, rk, scales = make_routing(adapters, [0, 1, 0, 2], ranks, device)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(9)).to(device)
    want = lora_gather_reference(x[:3], pool, a_off[:3], b_off[:3], rk[:3], scales[:3], n)
    got = lora_gather(x, pool, a_off, b_off, rk, scales, n, backend="triton")
    assert rel_err(got[:3], want) < TOL[torch.float32]
    assert torch.isnan(got[3]).all()
    with pytest.raises(ValueError, match="ranks must be in \\[0, 128\\]"):
        lora_gather_reference(x, pool, a_off, b_off, rk, scales, n)


def test_triton_block_sizes_do_not_change_the_result(device):
    """Other K / N / rank blocks (the GPU's, 256 / 256 / 32) on odd shapes give the same sums."""
    k, n, ranks, row_adapter = 257, 123, [64, 5], [0, 1, 0]
    pool, adapters = make_adapters(ranks, k, n, torch.float32, device)
    a_off, b_off, rk, scales = make_routing(adapters, row_adapter, ranks, device)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4)).to(device)
    want = lora_gather_reference(x, pool, a_off, b_off, rk, scales, n)
    for blocks in ({"block_k": 256, "block_n": 256, "block_r": 32}, {"block_k": 64, "block_n": 16, "block_r": 64}):
        got = _lora_gather_triton(x, pool, a_off, b_off, rk, scales, n, None, **blocks)
        assert rel_err(got, want) < TOL[torch.float32], blocks


def test_bad_inputs_raise_clear_errors(device):
    k, n = 8, 6
    pool, adapters = make_adapters([2], k, n, torch.float32, device)
    a_off, b_off, rk, scales = make_routing(adapters, [0, 0], [2], device)
    x = torch.randn(2, k, device=device)
    with pytest.raises(ValueError, match="ranks must be a \\[2\\] torch.int32"):
        lora_gather(x, pool, a_off, b_off, rk.long(), scales, n, backend="triton")
    with pytest.raises(ValueError, match="a_offsets must be a \\[2\\]"):
        lora_gather(x, pool, a_off[:1], b_off, rk, scales, n)
    with pytest.raises(TypeError, match="pool is torch.float16"):
        lora_gather(x, pool.half(), a_off, b_off, rk, scales, n)
    with pytest.raises(ValueError, match="out must be \\[2, 6\\]"):
        lora_gather(x, pool, a_off, b_off, rk, scales, n, out=torch.zeros(2, 5, device=device))
    with pytest.raises(ValueError, match="backend="):
        lora_gather(x, pool, a_off, b_off, rk, scales, n, backend="cuda")
    with pytest.raises(ValueError, match="reaches past the pool"):
        lora_gather_reference(x, pool, a_off, b_off + 1000, rk, scales, n)


def test_adapter_groups_sort_rows_by_adapter_in_runs_of_at_most_group_rows():
    from lightning_lorafusion.kernels.lora_gather import adapter_groups

    keys = [2, 0, 1, 2, 2, 1, 3, 2, 0]
    g = adapter_groups(keys, 12, group_rows=2)
    starts, ends, perm, sizes = g.tolist()
    bounds = [(s, e) for s, e in zip(starts, ends) if e > s]
    rows = [perm[s:e] for s, e in bounds]
    assert rows == [[2, 5], [0, 3], [4, 7], [6]]  # adapter 1, then 2 (cut at 2 rows), then 3; rank-0 rows left out
    assert all(len({keys[i] for i in r}) == 1 for r in rows)
    assert sorted(i for r in rows for i in r) == [i for i, k in enumerate(keys) if k]
    assert starts[len(bounds):] == ends[len(bounds):] == [0] * (12 - len(bounds))
    assert sizes == [2, 0, 2, 2, 2, 2, 1, 2, 0, 0, 0, 0]  # each row's group's rows (0: in none)
    # the larger groups first (equal sizes in the adapters' order): adapter 2's 3 rows, then 1's 2, then 3's 1
    starts, ends, perm, sizes = adapter_groups([3, 1, 2, 2, 1, 2], 6).tolist()
    assert [perm[s:e] for s, e in zip(starts, ends) if e > s] == [[2, 3, 5], [1, 4], [0]]
    assert sizes == [1, 2, 3, 3, 2, 3]
    assert adapter_groups([0, 0], 4).count_nonzero() == 0
    with pytest.raises(ValueError, match="do not fit"):
        adapter_groups([1] * 5, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_shrink_gives_the_per_row_results(device, dtype, monkeypatch):
    """Rows grouped by adapter (one A read per group) add what the per-row kernel adds, for a
    batch that takes the grouped shrink (its row bound lowered to keep the interpreter quick),
    with rank-0 rows and groups cut at 16 rows."""
    from lightning_lorafusion.kernels import lora_gather as module
    from lightning_lorafusion.kernels.lora_gather import adapter_groups

    monkeypatch.setattr(module, "GROUPED_MIN_ROWS", 32)
    k, n, ranks = 70, 41, [8, 0, 5, 16, 33]
    rows = 32 + 7
    row_adapter = [(i * 5 + i // 7) % len(ranks) for i in range(rows)]
    row_adapter[:20] = [3] * 20  # one adapter over 20 rows: two groups
    pool, adapters = make_adapters(ranks, k, n, dtype, device)
    a_off, b_off, rk, scales = make_routing(adapters, row_adapter, ranks, device)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).to(device, dtype)
    keys = [ad + 1 if ranks[ad] else 0 for ad in row_adapter]
    groups = adapter_groups(keys, rows).to(device)
    y0 = torch.randn(rows, n, generator=torch.Generator().manual_seed(8)).to(device, dtype)
    want = lora_gather_reference(x, pool, a_off, b_off, rk, scales, n, out=y0.clone())
    got = lora_gather(x, pool, a_off, b_off, rk, scales, n, out=y0.clone(), backend="triton", groups=groups)
    per_row = lora_gather(x, pool, a_off, b_off, rk, scales, n, out=y0.clone(), backend="triton")
    assert rel_err(got - y0, want - y0) < TOL[dtype]
    assert rel_err(got - y0, per_row - y0) < TOL[dtype]
    # the groups as a view of a wider table (the engine's persistent one, sliced to the batch)
    wide = adapter_groups(keys, rows + 9).to(device)[:, :rows]
    viewed = lora_gather(x, pool, a_off, b_off, rk, scales, n, out=y0.clone(), backend="triton", groups=wide)
    assert torch.equal(viewed, got)
    # a wrong grouping is caught: all rows told they share adapter 3's rows
    wrong = adapter_groups([1] * rows, rows).to(device)
    bad = lora_gather(x, pool, a_off, b_off, rk, scales, n, out=y0.clone(), backend="triton", groups=wrong)
    # (a row whose own rank exceeds its group's reads partial sums nobody wrote: NaN counts too)
    assert not rel_err(bad - y0, want - y0) <= 0.1


def grouped_case(dtype, device, rows=37):
    """Rows over adapters of ranks 8, 0 (a row without LoRA), 5, 16, 33 (several rank blocks),
    one adapter over 20 rows (two groups of 16 and 4) -> (x, pool, routing, keys, y0)."""
    k, n, ranks = 70, 41, [8, 0, 5, 16, 33]
    row_adapter = [(i * 5 + i // 7) % len(ranks) for i in range(rows)]
    row_adapter[:20] = [3] * 20
    row_adapter[25] = row_adapter[31] = 1
    pool, adapters = make_adapters(ranks, k, n, dtype, device)
    routing = make_routing(adapters, row_adapter, ranks, device)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).to(device, dtype)
    keys = [ad + 1 if ranks[ad] else 0 for ad in row_adapter]
    y0 = torch.randn(rows, n, generator=torch.Generator().manual_seed(8)).to(device, dtype)
    return x, pool, routing, keys, y0


@pytest.fixture(params=["row_loop", "dot", "dot_half", "dot_loop3"])
def expand_form(request, monkeypatch):
    """The grouped expand's forms (``GROUPED_EXPAND_ROW_LOOP``; the dot with fp32 S or, "half",
    S rounded to the output's dtype: ``GROUPED_EXPAND_DOT``; "loop3": the dot for groups of
    more than 3 rows, the row loop for the others, ``GROUPED_EXPAND_LOOP_ROWS``) -> whether it
    is the row loop."""
    from lightning_lorafusion.kernels import lora_gather as module

    monkeypatch.setattr(module, "GROUPED_EXPAND_ROW_LOOP", request.param == "row_loop")
    if request.param == "dot_half":
        monkeypatch.setattr(module, "GROUPED_EXPAND_DOT", "half")
    if request.param == "dot_loop3":
        monkeypatch.setattr(module, "GROUPED_EXPAND_LOOP_ROWS", 3)
    return request.param == "row_loop"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shrink_bound", [1, 10**9])
def test_grouped_expand_gives_the_per_row_results(device, dtype, shrink_bound, expand_form, monkeypatch):
    """The expand reading each group's B^T once (its row bound lowered), after the grouped or
    the per-row shrink: what the per-row kernels and the reference add (the row loop: the
    per-row expand's bits), into ``out`` and as a fresh delta; rows without LoRA are not
    touched."""
    from lightning_lorafusion.kernels import lora_gather as module
    from lightning_lorafusion.kernels.lora_gather import adapter_groups

    monkeypatch.setattr(module, "GROUPED_EXPAND_MIN_ROWS", 8)
    monkeypatch.setattr(module, "GROUPED_MIN_ROWS", shrink_bound)
    x, pool, (a_off, b_off, rk, scales), keys, y0 = grouped_case(dtype, device)
    n = y0.shape[1]
    groups = adapter_groups(keys, len(keys)).to(device)
    want = lora_gather_reference(x, pool, a_off, b_off, rk, scales, n, out=y0.clone())
    got = lora_gather(x, pool, a_off, b_off, rk, scales, n, out=y0.clone(), backend="triton", groups=groups)
    monkeypatch.setattr(module, "GROUPED_EXPAND_MIN_ROWS", 10**9)
    per_row = lora_gather(x, pool, a_off, b_off, rk, scales, n, out=y0.clone(), backend="triton", groups=groups)
    assert rel_err(got - y0, want - y0) < TOL[dtype]
    assert rel_err(got - y0, per_row - y0) < TOL[dtype]
    if expand_form:
        assert_per_row_bits(got, per_row)
    no_lora = rk == 0
    assert bool(no_lora.any()) and torch.equal(got[no_lora], y0[no_lora])
    monkeypatch.setattr(module, "GROUPED_EXPAND_MIN_ROWS", 8)
    fresh = lora_gather(x, pool, a_off, b_off, rk, scales, n, backend="triton", groups=groups)
    assert rel_err(fresh, want - y0) < TOL[dtype] and not bool(fresh[no_lora].any())


@pytest.mark.parametrize("wrong", ["one_adapter", "shifted", "dropped_group", "duplicated_row"])
def test_grouped_expand_catches_a_wrong_grouping(device, wrong, expand_form, monkeypatch):
    """A grouping that does not match the rows fails the comparison. The row loop reads each
    row's own tables, so only which rows the groups hold matters to it: every row told it
    shares one adapter (each still in exactly one group) gives the right answer there."""
    from lightning_lorafusion.kernels import lora_gather as module

    monkeypatch.setattr(module, "GROUPED_EXPAND_MIN_ROWS", 8)
    monkeypatch.setattr(module, "GROUPED_MIN_ROWS", 10**9)  # the per-row shrink: only the expand is wrong
    x, pool, (a_off, b_off, rk, scales), keys, y0 = grouped_case(torch.float32, device)
    n = y0.shape[1]
    want = lora_gather_reference(x, pool, a_off, b_off, rk, scales, n, out=y0.clone())
    bad = lora_gather(x, pool, a_off, b_off, rk, scales, n, out=y0.clone(), backend="triton",
                      groups=wrong_groups(keys, wrong).to(device))
    if expand_form and wrong == "one_adapter":
        assert rel_err(bad - y0, want - y0) < TOL[torch.float32]
    else:
        assert not rel_err(bad - y0, want - y0) <= 0.05  # (NaN, from partial sums never written, counts)


def test_grouped_expand_rank_above_max_is_nan_for_its_group_only(device, expand_form, monkeypatch):
    from lightning_lorafusion.kernels import lora_gather as module
    from lightning_lorafusion.kernels.lora_gather import MAX_RANK, adapter_groups

    monkeypatch.setattr(module, "GROUPED_EXPAND_MIN_ROWS", 8)
    monkeypatch.setattr(module, "GROUPED_MIN_ROWS", 10**9)
    x, pool, (a_off, b_off, rk, scales), keys, y0 = grouped_case(torch.float32, device)
    bad_rows = torch.tensor([k == 4 for k in keys], device=device)  # the rank-16 adapter's rows
    rk = torch.where(bad_rows, MAX_RANK + 1, rk).to(torch.int32)
    groups = adapter_groups(keys, len(keys)).to(device)
    got = lora_gather(x, pool, a_off, b_off, rk, scales, y0.shape[1], out=y0.clone(), backend="triton",
                      groups=groups)
    assert torch.isnan(got[bad_rows]).all() and not torch.isnan(got[~bad_rows]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("shrink_bound", [1, 10**9])
def test_hybrid_expand_gives_the_per_row_results(device, dtype, fused, shrink_bound, monkeypatch):
    """The hybrid expand (``HYBRID_MIN_ROWS``): groups of at least 2 rows (16, 10, 6, 2 rows here)
    by one dot each, rows alone on their adapter by the per-row arithmetic, in the per-row
    launch (``HYBRID_FUSED``) or a grouped launch after it; after the grouped or the per-row
    shrink: the reference's and the per-row kernels' results, the rows alone the per-row
    kernel's bits (a few ulp compiled), into ``out`` and as a fresh delta; rows without LoRA not touched; a rank
    above MAX_RANK NaN on its rows only; a wrong grouping caught."""
    from lightning_lorafusion.kernels import lora_gather as module
    from lightning_lorafusion.kernels.lora_gather import MAX_RANK, adapter_groups

    monkeypatch.setattr(module, "HYBRID_MIN_ROWS", 8)
    monkeypatch.setattr(module, "HYBRID_FUSED", fused)
    monkeypatch.setattr(module, "HYBRID_GROUP_N", 16)  # (the interpreter's column blocks of 32: two dots each)
    monkeypatch.setattr(module, "GROUPED_MIN_ROWS", shrink_bound)
    x, pool, (a_off, b_off, rk, scales), keys, y0 = grouped_case(dtype, device)
    n = y0.shape[1]
    groups = adapter_groups(keys, len(keys)).to(device)
    sizes = groups[3].tolist()
    assert {1, 2, 16} <= set(sizes)
    want = lora_gather_reference(x, pool, a_off, b_off, rk, scales, n, out=y0.clone())
    got = lora_gather(x, pool, a_off, b_off, rk, scales, n, out=y0.clone(), backend="triton", groups=groups)
    per_row = lora_gather(x, pool, a_off, b_off, rk, scales, n, out=y0.clone(), backend="triton")
    assert rel_err(got - y0, want - y0) < TOL[dtype]
    assert rel_err(got - y0, per_row - y0) < TOL[dtype]
    alone = torch.tensor([s == 1 for s in sizes], device=device)
    assert_per_row_bits(got[alone], per_row[alone])
    no_lora = rk == 0
    assert bool(no_lora.any()) and torch.equal(got[no_lora], y0[no_lora])
    fresh = lora_gather(x, pool, a_off, b_off, rk, scales, n, backend="triton", groups=groups)
    assert rel_err(fresh, want - y0) < TOL[dtype] and not bool(fresh[no_lora].any())
    wrong = lora_gather(x, pool, a_off, b_off, rk, scales, n, out=y0.clone(), backend="triton",
                        groups=wrong_groups(keys, "one_adapter").to(device))
    assert not rel_err(wrong - y0, want - y0) <= 0.05
    if dtype == torch.float32:
        bad_rows = torch.tensor([k == 4 for k in keys], device=device)  # the rank-16 adapter's rows (one group)
        bad = lora_gather(x, pool, a_off, b_off, torch.where(bad_rows, MAX_RANK + 1, rk).to(torch.int32), scales, n,
                          out=y0.clone(), backend="triton", groups=groups)
        assert torch.isnan(bad[bad_rows]).all() and not torch.isnan(bad[~bad_rows]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split_k", [64, 40])
def test_grouped_shrink_split_k_gives_the_reference(device, dtype, split_k, monkeypatch):
    """The grouped shrink walking several K tiles per program (``GROUPED_SHRINK_SPLIT_K``; 40
    rounds up to two tiles of 32; K = 70: the last split is partial) writes fewer partial sums
    that the per-row and the grouped expand both read correctly."""
    from lightning_lorafusion.kernels import lora_gather as module
    from lightning_lorafusion.kernels.lora_gather import adapter_groups

    monkeypatch.setattr(module, "GROUPED_MIN_ROWS", 8)
    monkeypatch.setattr(module, "GROUPED_SHRINK_BLOCK_K", 32)  # (a GPU's default tile is wider than the split)
    monkeypatch.setattr(module, "GROUPED_SHRINK_SPLIT_K", split_k)
    x, pool, (a_off, b_off, rk, scales), keys, y0 = grouped_case(dtype, device)
    n = y0.shape[1]
    groups = adapter_groups(keys, len(keys)).to(device)
    want = lora_gather_reference(x, pool, a_off, b_off, rk, scales, n, out=y0.clone())
    for expand_bound in (10**9, 8):
        monkeypatch.setattr(module, "GROUPED_EXPAND_MIN_ROWS", expand_bound)
        got = lora_gather(x, pool, a_off, b_off, rk, scales, n, out=y0.clone(), backend="triton", groups=groups)
        assert rel_err(got - y0, want - y0) < TOL[dtype], expand_bound
    # the split is what the shrink ran with: partial sums over 64 columns, not 32
    part, k_blocks = module.lora_shrink(module.GatheredLora(x, pool, a_off[None], b_off[None], rk[None], scales,
                                                            groups=groups))
    assert k_blocks == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split_k", [None, 64])
def test_grouped_shrink_single_row_groups_give_the_reference(device, dtype, split_k, monkeypatch):
    """``GROUPED_SHRINK_SINGLE_ROWS``: groups of one row (adapters alone in the batch, heterogeneous
    ranks 5 / 16 / 33, a split of two K tiles) take the per-row arithmetic inside the grouped
    shrink, groups of several rows the dot, rank-0 rows nothing: the reference's result, and the
    per-row kernels' partial sums for the single rows; a wrong grouping (each row given its
    neighbour's adapter) is caught."""
    from lightning_lorafusion.kernels import lora_gather as module
    from lightning_lorafusion.kernels.lora_gather import GatheredLora, adapter_groups, lora_shrink

    monkeypatch.setattr(module, "GROUPED_MIN_ROWS", 8)
    monkeypatch.setattr(module, "GROUPED_SHRINK_SINGLE_ROWS", True)
    monkeypatch.setattr(module, "GROUPED_SHRINK_BLOCK_K", 32)
    monkeypatch.setattr(module, "GROUPED_SHRINK_SPLIT_K", split_k)
    k, n, ranks = 70, 41, [8, 0, 5, 16, 33, 8, 12]
    # adapters 2, 3, 4 and 6 one row each, adapter 0 five rows, 5 three, 1 (rank 0) two
    row_adapter = [0, 2, 0, 1, 3, 0, 5, 4, 0, 5, 1, 6, 5, 0]
    rows = len(row_adapter)
    pool, adapters = make_adapters(ranks, k, n, dtype, device)
    a_off, b_off, rk, scales = make_routing(adapters, row_adapter, ranks, device)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).to(device, dtype)
    keys = [ad + 1 if ranks[ad] else 0 for ad in row_adapter]
    groups = adapter_groups(keys, rows).to(device)
    sizes = [e - s for s, e in zip(*groups[:2].tolist()) if e > s]
    assert sorted(sizes) == [1, 1, 1, 1, 3, 5]
    y0 = torch.randn(rows, n, generator=torch.Generator().manual_seed(8)).to(device, dtype)
    want = lora_gather_reference(x, pool, a_off, b_off, rk, scales, n, out=y0.clone())
    got = lora_gather(x, pool, a_off, b_off, rk, scales, n, out=y0.clone(), backend="triton", groups=groups)
    assert rel_err(got - y0, want - y0) < TOL[dtype]
    assert torch.equal(got[rk == 0], y0[rk == 0])
    # the single rows' partial sums are the per-row shrink's over the same K split
    lora = GatheredLora(x, pool, a_off[None], b_off[None], rk[None], scales, groups=groups)
    part, k_blocks = lora_shrink(lora)
    monkeypatch.setattr(module, "GROUPED_MIN_ROWS", 10**9)
    # the grouped shrink's split: as set, else its GPU default on CUDA (one 512 block here) or the
    # interpreter's 32-wide tiles
    split = split_k or (module.GROUPED_SHRINK_GPU_TILES[1] if x.is_cuda else 32)
    ref_part, ref_blocks = lora_shrink(lora, block_k=split)
    assert k_blocks == ref_blocks == -(-k // split)
    part, ref_part = (p.view(rows, k_blocks, module.MAX_RANK) for p in (part, ref_part))
    for i in (1, 4, 7, 11):  # adapters 2, 3, 4, 6: alone
        r = ranks[row_adapter[i]]
        torch.testing.assert_close(part[i, :, :r], ref_part[i, :, :r], rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(module, "GROUPED_MIN_ROWS", 8)
    bad = lora_gather(x, pool, a_off, b_off, rk, scales, n, out=y0.clone(), backend="triton",
                      groups=wrong_groups(keys, "shifted").to(device))
    assert not rel_err(bad - y0, want - y0) <= 0.1


def grouped_knob_case(dtype, device, single_rows, monkeypatch, **knobs):
    """``grouped_case`` through the grouped shrink (from 8 rows) with ``knobs`` (lora_gather module
    constants) set first -> (module, (x, pool, a_off, b_off, rk, scales, n), y0, groups, the
    output with those knobs)."""
    from lightning_lorafusion.kernels import lora_gather as module
    from lightning_lorafusion.kernels.lora_gather import adapter_groups

    for name, value in {"GROUPED_MIN_ROWS": 8, "GROUPED_SHRINK_SINGLE_ROWS": single_rows, **knobs}.items():
        monkeypatch.setattr(module, name, value)
    x, pool, (a_off, b_off, rk, scales), keys, y0 = grouped_case(dtype, device)
    args = (x, pool, a_off, b_off, rk, scales, y0.shape[1])
    groups = adapter_groups(keys, len(keys)).to(device)
    return module, args, y0, groups, lora_gather(*args, out=y0.clone(), backend="triton", groups=groups)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("single_rows", [True, False])
def test_grouped_shrink_rank_split_gives_the_same_bits(device, dtype, single_rows, monkeypatch):
    """``GROUPED_RANK_SPLIT``: a group's rank chunks over 3 programs (ranks 5-33: one to three
    16-rank chunks; rank 0 rows; single-row groups by the per-row arithmetic or the dot) write
    the partial sums one program writes: the output bit for bit, and the reference's."""
    module, args, y0, groups, want = grouped_knob_case(dtype, device, single_rows, monkeypatch)
    monkeypatch.setattr(module, "GROUPED_RANK_SPLIT", 3)
    got = lora_gather(*args, out=y0.clone(), backend="triton", groups=groups)
    assert torch.equal(got, want)
    ref = lora_gather_reference(*args, out=y0.clone())
    assert rel_err(got - y0, ref - y0) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("single_rows", [True, False])
def test_grouped_shrink_rank_chunks_and_stages(device, dtype, single_rows, monkeypatch):
    """``GROUPED_SHRINK_BLOCK_R`` (a group's rank chunk: 32, 64 against the default 16, ranks
    5-33 so chunks past a group's rank are masked) and ``GROUPED_SHRINK_STAGES``, alone and with
    the rank split: each element's sum over K is the same (the chunk only picks which ranks a
    program loads at once): in fp16 the output is the default's bit for bit; in fp32 within a few
    ulp (the interpreter's fp32 dot and sums go through numpy, whose blocking follows the tile's
    shape); and the reference's."""
    module, args, y0, groups, want = grouped_knob_case(dtype, device, single_rows, monkeypatch)
    ref = lora_gather_reference(*args, out=y0.clone())
    for block_r, stages, split in ((32, None, 1), (64, 1, 1), (32, 2, 2)):
        monkeypatch.setattr(module, "GROUPED_SHRINK_BLOCK_R", block_r)
        monkeypatch.setattr(module, "GROUPED_SHRINK_STAGES", stages)
        monkeypatch.setattr(module, "GROUPED_RANK_SPLIT", split)
        got = lora_gather(*args, out=y0.clone(), backend="triton", groups=groups)
        if dtype == torch.float16:
            assert torch.equal(got, want), (block_r, stages, split)
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert rel_err(got - y0, ref - y0) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("single_rows", [True, False])
def test_grouped_shrink_unrolled_k_tiles_give_the_same_bits(device, dtype, single_rows, monkeypatch):
    """``GROUPED_SHRINK_UNROLL_K``: a split's K tiles unrolled (tiles of 16 in splits of 48, K = 70:
    the last split's third tile wholly past K, masked) sum the same tiles in the same order as the
    loop over them: the output bit for bit, and the reference's."""
    module, args, y0, groups, want = grouped_knob_case(dtype, device, single_rows, monkeypatch,
                                                       GROUPED_SHRINK_BLOCK_K=16, GROUPED_SHRINK_SPLIT_K=48)
    monkeypatch.setattr(module, "GROUPED_SHRINK_UNROLL_K", True)
    got = lora_gather(*args, out=y0.clone(), backend="triton", groups=groups)
    assert torch.equal(got, want)
    ref = lora_gather_reference(*args, out=y0.clone())
    assert rel_err(got - y0, ref - y0) < TOL[dtype]
