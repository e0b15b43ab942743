"""The prefill LoRA as two grouped GEMMs over staged factors (``lora_grouped_gemm``): the row
groups, the staging kernels against their torch form, and the delta against the row-tile
reference (``segment_lora_reference``, write-first: every row, zeros where no LoRA).

The staging kernels copy (and scale Bᵀ by an fp32 multiply, one rounding): against their
reference exact in fp32. The delta rounds S to the input's dtype between its two GEMMs (the
reference keeps fp32 sums): fp32 1e-5 relative; bf16 (GPU) 1.6e-2, one bf16 ulp of the deltas.
"""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.kernels.lora_grouped_gemm import (
    BAND_ALIGN, band_widths, grouped_available, grouped_lora_delta, row_groups, stage_factors,
    stage_factors_reference)
from lightning_lorafusion.kernels.segment_tables import NO_ADAPTER, segment_lora_reference

from test_lora_segments import make_lora, make_pool, rel_err

# the grouped GEMM's CUDA kernels (CUTLASS) need Hopper; bf16 arithmetic is wrong in the Triton interpreter
HOPPER = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                            reason="torch._grouped_mm runs bf16 on GPUs of compute capability >= 9.0")


def test_row_groups_merge_neighbours_and_cover_every_row():
    g = row_groups([(2, 5, 1), (5, 9, 1), (9, 10, 0), (12, 14, 0)], 16, torch.device("cpu"))
    assert g.bounds == ((0, 2, NO_ADAPTER), (2, 9, 1), (9, 10, 0), (10, 12, NO_ADAPTER), (12, 14, 0),
                        (14, 16, NO_ADAPTER))
    assert g.ends.tolist() == [2, 9, 10, 12, 14, 16] and g.adapters.tolist() == [-1, 1, 0, -1, 0, -1]
    # covering segments (rows without LoRA as adapter -1, one per decode row) merge into one group
    cov = row_groups([(0, 1, NO_ADAPTER), (1, 2, NO_ADAPTER), (2, 6, 3)], 6, torch.device("cpu"))
    assert cov.bounds == ((0, 2, NO_ADAPTER), (2, 6, 3))
    assert row_groups([], 4, torch.device("cpu")).bounds == ((0, 4, NO_ADAPTER),)
    with pytest.raises(ValueError, match="overlaps"):
        row_groups([(0, 5, 1), (4, 6, 0)], 8, torch.device("cpu"))


def test_bands_hold_the_largest_rank_aligned():
    assert band_widths([8, 0, 17, 64]) == (BAND_ALIGN, BAND_ALIGN, 32, 64)


def _case(device, dtype, ns, ranks, segments, rows, k=48, seed=0):
    pool, a_off, b_off, rk, _ = make_pool(ranks, k, ns, dtype, device, seed=seed)
    scales = torch.tensor([0.5 + 0.25 * i for i in range(len(ranks))])
    lora = make_lora(pool, a_off, b_off, rk, scales, segments, 16)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    max_ranks = [max(r[p] for r in ranks) for p in range(len(ns))]
    return lora, x, max_ranks


# (the engine's segments list adapted rows only; the rows between them are the groups without adapter)
CASES = {
    "qkv": ((32, 16, 16), [(8, 8, 8), (20, 20, 20), (3, 0, 3), (16, 16, 16)],
            [(2, 30, 1), (30, 33, 0), (37, 38, 2), (38, 60, 3), (60, 64, 1)]),
    "gate_up": ((40, 40), [(4, 4), (0, 12)], [(0, 10, 0), (10, 25, 1), (25, 30, 0)]),
    "down": ((24,), [(16,), (2,)], [(3, 9, 1), (9, 20, 0)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_staging_kernels_match_their_reference(device, name):
    """Bands in order, ranks under their band zero-padded, a projection an adapter does not
    target zero, groups without adapter zero, Bᵀ transposed into its column block and scaled."""
    ns, ranks, segments = CASES[name]
    rows = max(e for _, e, _ in segments) + 2
    lora, x, max_ranks = _case(device, torch.float32, ns, ranks, segments, rows)
    groups = row_groups(lora.segments, rows, x.device)
    bands = band_widths(max_ranks)
    got_a, got_bt = stage_factors(lora, groups, x.shape[1], ns, bands)
    want_a, want_bt = stage_factors_reference(lora, groups, x.shape[1], ns, bands)
    assert got_a.shape == (groups.count, sum(bands), x.shape[1]) and got_bt.shape == (groups.count, sum(ns), sum(bands))
    assert torch.equal(got_a, want_a) and torch.equal(got_bt, want_bt)
    assert want_bt.abs().sum() > 0 and float(want_a[[i for i, b in enumerate(groups.bounds) if b[2] < 0]].abs().sum()) == 0


@pytest.mark.skipif(not grouped_available(torch.zeros(1)), reason="no torch._grouped_mm in this torch")
@pytest.mark.parametrize("name", list(CASES))
def test_grouped_delta_matches_the_row_tile_reference_on_every_row(name):
    """The delta of every projection side by side, written for every row as write-first does:
    the reference's LoRA on the segments' rows, exact zeros on every other row."""
    ns, ranks, segments = CASES[name]
    rows = max(e for _, e, _ in segments) + 2
    lora, x, max_ranks = _case(torch.device("cpu"), torch.float32, ns, ranks, segments, rows, seed=7)
    got = grouped_lora_delta(x, lora, ns, max_ranks)
    want = torch.full((rows, sum(ns)), float("nan"))
    segment_lora_reference(x, lora, list(want.split(list(ns), dim=1)), accumulate=False)
    assert got.shape == want.shape and got.dtype == x.dtype
    assert rel_err(got, want) < 1e-5
    covered = torch.zeros(rows, dtype=torch.bool)
    for s, e, ad in segments:
        covered[s:e] |= ad >= 0
    assert torch.equal(got[~covered], torch.zeros_like(got[~covered]))


@HOPPER
@pytest.mark.parametrize("name", list(CASES))
def test_grouped_delta_in_bf16_on_the_gpu(name):
    ns, ranks, segments = CASES[name]
    rows = max(e for _, e, _ in segments) + 2
    x_dev = torch.device("cuda")
    lora, x, max_ranks = _case(x_dev, torch.bfloat16, ns, ranks, segments, rows, k=64, seed=11)
    assert grouped_available(x)
    got = grouped_lora_delta(x, lora, ns, max_ranks)
    want = torch.zeros(rows, sum(ns), dtype=torch.bfloat16, device=x_dev)
    segment_lora_reference(x, lora, list(want.split(list(ns), dim=1)), accumulate=False)
    assert rel_err(got, want) < 1.6e-2
