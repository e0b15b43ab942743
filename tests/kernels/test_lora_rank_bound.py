"""The decode LoRA's rank variant (``GatheredLora.rank_bound``, ``lora_gather.decode_rank_bound``):
launches whose rows' ranks are known to be at most ``UNSPLIT_MAX_RANK`` take no rank split over
programs, and so programmatic dependent launch, where the rows would otherwise split. The
choice is by row count and the step's largest rank only, at most two variants per row count;
the variants compute the same sums in the same order, so the outputs must be equal bit for bit,
for any rank (a stale bound may cost time, never correctness): checked in the interpreter (fp32,
fp16) with ranks 0-128 on one row's projections, gather, SwiGLU and RoPE + KV epilogues, and
against the references at the tolerances of test_lora_few_rows.py.
"""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.kernels import lora_gather as lg
from lightning_lorafusion.kernels.lora_epilogues import rope_write_kv, swiglu, swiglu_reference
from lightning_lorafusion.kernels.lora_gather import lora_gather, lora_gather_reference

from test_lora_few_rows import RANKS, ROWS, TOL, _group
from test_lora_gather import make_adapters, make_routing, rel_err


def test_decode_rank_bound_by_rows_and_largest_rank(monkeypatch):
    """Few rows up to 8, the rank split up to 64 rows (the engine's), unsplit up to rank 16:
    rows that never split keep one variant; 9-64 rows take the bound where the largest rank is
    at most 16 (rank 0: no LoRA row at all), and with it no split and PDL."""
    cpu = torch.device("cpu")
    for name, value in (("FEW_ROWS", 8), ("RANK_SPLIT_MAX_ROWS", 64), ("UNSPLIT_MAX_RANK", 16), ("PDL", True)):
        monkeypatch.setattr(lg, name, value)
    for rows in (1, 8, 65, 128, 256):
        assert lg.decode_rank_bounds(rows) == (None,)
        assert all(lg.decode_rank_bound(rows, r) is None for r in (0, 4, 16, 64, 128))
    for rows in (9, 16, 32, 64):
        assert lg.decode_rank_bounds(rows) == (None, 16)
        assert [lg.decode_rank_bound(rows, r) for r in (0, 1, 8, 16, 17, 32, 64, 128)] == [16] * 4 + [None] * 4
        assert lg.rank_split(cpu, rows) == lg.RANK_SPLIT and not lg.pdl_applies(cpu, rows)
        assert lg.rank_split(cpu, rows, 16) == 1 and lg.pdl_applies(cpu, rows, 16)
        assert lg.pdl_options(cpu, rows, 16) == ({"PRELOAD": True, "GDC": False}, {}, {"GDC": False})
        assert lg.rank_split(cpu, rows, 32) == lg.RANK_SPLIT  # a bound past UNSPLIT_MAX_RANK changes nothing
    monkeypatch.setattr(lg, "UNSPLIT_MAX_RANK", None)
    assert all(lg.decode_rank_bounds(rows) == (None,) for rows in (1, 16, 64, 256))
    assert lg.rank_split(cpu, 16, 16) == lg.RANK_SPLIT


@pytest.fixture
def split_rows(monkeypatch):
    """The shrink over 8 rows splits ranks (the interpreter's small shapes: ``RANK_SPLIT_MAX_ROWS``
    16, no few-rows blocks), PDL on."""
    monkeypatch.setattr(lg, "FEW_ROWS", None)
    monkeypatch.setattr(lg, "RANK_SPLIT_MAX_ROWS", 16)
    monkeypatch.setattr(lg, "UNSPLIT_MAX_RANK", 16)
    monkeypatch.setattr(lg, "PDL", True)
    rows = len(ROWS["mixed_with_base_rows"])
    assert lg.decode_rank_bounds(rows) == (None, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gather_unsplit_variant_gives_the_same_bits(device, dtype, split_rows):
    k, n, row_adapter = 70, 90, ROWS["mixed_with_base_rows"]
    pool, adapters = make_adapters(RANKS, k, n, dtype, device)
    a_off, b_off, rk, scales = make_routing(adapters, row_adapter, RANKS, device)
    x = torch.randn(len(row_adapter), k, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    y = torch.randn(len(row_adapter), n, generator=torch.Generator().manual_seed(6)).to(device, dtype)
    got = {}
    for bound in (None, 16):
        out = y.clone()
        lora_gather(x, pool, a_off, b_off, rk, scales, n, out=out, backend="triton", rank_bound=bound)
        got[bound] = out, lora_gather(x, pool, a_off, b_off, rk, scales, n, backend="triton", rank_bound=bound)
    assert torch.equal(got[16][0], got[None][0]) and torch.equal(got[16][1], got[None][1])
    want = lora_gather_reference(x, pool, a_off, b_off, rk, scales, n, out=y.clone())
    assert rel_err(got[16][0], want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swiglu_unsplit_variant_gives_the_same_bits(device, dtype, split_rows):
    row_adapter = ROWS["mixed_with_base_rows"]
    t, n = len(row_adapter) + 2, 72
    lora = _group(40, (n, n), row_adapter, dtype, device, first_row=1)
    gu = torch.randn(t, 2 * n, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    split = swiglu(gu[:, :n], gu[:, n:], lora=lora, backend="triton")
    bounded = lg.GatheredLora(*(getattr(lora, f) for f in ("x", "pool", "a_offsets", "b_offsets", "ranks", "scales")),
                              lora.first_row, rank_bound=16)
    unsplit = swiglu(gu[:, :n], gu[:, n:], lora=bounded, backend="triton")
    assert torch.equal(unsplit, split)
    assert rel_err(unsplit, swiglu_reference(gu[:, :n], gu[:, n:], lora)) < TOL[dtype]


def test_rope_write_kv_unsplit_variant_gives_the_same_bits(device, split_rows):
    from test_lora_epilogues import SHAPES, make_rope_case

    t, hq, hkv, d, k, first, _ = SHAPES["decode"]
    case, _ = make_rope_case("decode", torch.float32, device, False, True)
    lora = _group(k, (hq * d, hkv * d, hkv * d), ROWS["mixed_with_base_rows"][:t], torch.float32, device,
                  first_row=first)
    got = {}
    for bound in (None, 16):
        case["lora"] = lg.GatheredLora(*(getattr(lora, f) for f in ("x", "pool", "a_offsets", "b_offsets", "ranks",
                                                                     "scales")), lora.first_row, rank_bound=bound)
        common = {key: case[key] for key in ("cos", "sin", "layer", "slot_pages", "slot_offsets", "lora")}
        got[bound] = {key: case[key].clone() for key in ("q", "k", "v", "kv_pool")}
        rope_write_kv(got[bound]["q"], got[bound]["k"], got[bound]["v"], kv_pool=got[bound]["kv_pool"],
                      backend="triton", **common)
    for key in got[None]:
        assert torch.equal(got[16][key], got[None][key]), key
