"""The Triton dropout hash draws exactly the torch reference's masks, with the right keep rate."""

import math

import pytest
import torch

from lightning_lorafusion.kernels.dropout import dropout_keep_mask, dropout_keep_threshold
from lightning_lorafusion.kernels.dropout_triton import offset_hash, offset_hash_arg, triton_dropout_keep_mask


@pytest.mark.parametrize(
    "seed,offset,row_start,rows,cols,p",
    [
        (0, 0, 0, 47, 123, 0.1),
        (123456789, 2**31 + 5, 77, 33, 257, 0.5),
        (2**40 + 3, 4095, 5, 64, 64, 0.9),
        (7, 2**32 - 1, 2**20, 17, 129, 0.3),
    ],
)
def test_triton_mask_bit_identical_to_torch(device, seed, offset, row_start, rows, cols, p):
    got = triton_dropout_keep_mask(seed, offset, row_start, rows, cols, p, device)
    want = dropout_keep_mask(seed, offset, row_start, rows, cols, p, device)
    assert got.shape == want.shape == (rows, cols)
    assert torch.equal(got, want)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_fraction_within_binomial_bounds(device, p):
    rows, cols = 96, 1000
    mask = triton_dropout_keep_mask(11, 3, 0, rows, cols, p, device)
    n = rows * cols
    sd = math.sqrt(n * p * (1 - p))
    kept = int(mask.sum())
    assert abs(kept - n * (1 - p)) < 5 * sd, (kept, n * (1 - p), sd)
    # rows and columns are each near the rate too (catches a hash ignoring row or col)
    per_col = mask.float().mean(0)
    assert (per_col - (1 - p)).abs().max() < 6 * math.sqrt(p * (1 - p) / rows)


def test_masks_differ_across_seed_offset_and_rows(device):
    base = triton_dropout_keep_mask(1, 1, 0, 32, 128, 0.5, device)
    for other in (
        triton_dropout_keep_mask(2, 1, 0, 32, 128, 0.5, device),
        triton_dropout_keep_mask(1, 2, 0, 32, 128, 0.5, device),
        triton_dropout_keep_mask(1, 1, 32, 32, 128, 0.5, device),
    ):
        agree = (base == other).float().mean().item()
        assert 0.4 < agree < 0.6  # independent masks agree on about half the elements


def test_threshold_rounds_p():
    assert dropout_keep_threshold(0.0) == 0
    assert dropout_keep_threshold(0.5) == 1 << 15


def test_offset_hash_arg_is_the_same_bits_in_int32_range():
    """The kernels take the offset hash as int32 whatever the offset, so a launch compiled for
    one offset accepts every other (Triton types 2**31..2**32-1 as uint32)."""
    hashes = [offset_hash(o) for o in range(64)] + [offset_hash(2**31 + 5), offset_hash(2**32 - 1)]
    assert any(h >= 2**31 for h in hashes) and any(h < 2**31 for h in hashes)
    for o in list(range(64)) + [2**31 + 5, 2**32 - 1]:
        arg = offset_hash_arg(o)
        assert -(2**31) <= arg < 2**31
        assert arg & 0xFFFFFFFF == offset_hash(o)
