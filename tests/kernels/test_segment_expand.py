"""The held expand (``segment_expand``, ``segment_lora_add(..., form="splitk", expand="held")``):
a tile's S loaded once per program, against the torch reference and the tile expand.

Interpreter runs on the CPU in fp32 / fp16 (bf16 on the GPU only); tolerances as in
test_lora_segments.py (fp32 1e-5: summation order only; fp16 2e-3: one rounding into fp16).
The dot in 16-bit (``lowp``) rounds S once more: 2e-3 in fp16 still holds (S's rounding is
below the output's), and its bf16 run on the GPU takes the bf16 tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_lorafusion.kernels import lora_segments
from lightning_lorafusion.kernels.lora_segments import (segment_kernel_variants, segment_lora_add, segment_lora_shrink,
                                                        segment_tiles)
from test_lora_segments import GPU_ONLY, TOL, make_lora, rel_err
from test_lora_splitk import group, run_both, with_live

SEGMENTS = [(0, 1, 5), (1, 37, 1), (37, 40, 0), (44, 45, 2), (45, 90, 3), (90, 92, 4), (92, 107, 5)]


def case(dtype, device, seed=3, rows=110, pad_tiles=3):
    k, ns, tables = group(dtype, device, seed=seed, k=40)  # (K: 2.5 interpreter blocks)
    lora = make_lora(*tables[:4], tables[4], SEGMENTS, 16, pad_tiles=pad_tiles)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    base = torch.randn(rows, sum(ns), generator=torch.Generator().manual_seed(seed + 2)).to(device, dtype)
    return ns, lora, x, base


@pytest.mark.parametrize("dtype,held", [(torch.float32, {}), (torch.float16, {}),
                                        pytest.param(torch.bfloat16, {}, marks=GPU_ONLY),
                                        (torch.float16, {"lowp": True}),
                                        pytest.param(torch.bfloat16, {"lowp": True}, marks=GPU_ONLY),
                                        (torch.float32, {"n_blocks": 1, "col_fastest": True}),
                                        (torch.float32, {"n_blocks": 3, "stages": 2, "align": False})])
def test_held_expand_matches_the_reference_mixed_ranks(device, dtype, held):
    """Ranks 3-37 (37: the held chunk and two more), an untargeted projection, an adapter of rank
    0 everywhere, 1-row segments, padding tiles, column blocks past the width: additive, against
    the reference; rows outside every segment untouched."""
    ns, lora, x, base = case(dtype, device)
    got, want = run_both(x, lora, ns, base, form="splitk", split_k=3, expand="held", held=held)
    assert rel_err(got - base, want - base) < TOL[dtype]
    assert torch.equal(got[40:44], base[40:44]) and torch.equal(got[107:], base[107:])
    assert torch.equal(got[44:45, 48:64], base[44:45, 48:64])  # adapter 2 has no k LoRA
    assert torch.equal(got[90:92], base[90:92])  # adapter 4: rank 0 everywhere


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_held_expand_equals_the_tile_expand_bit_for_bit(device, dtype):
    """Same sums in the same order (fp32 dot of the summed S, one rounding): the held expand's
    output equals the tile expand's, written first and additive."""
    ns, lora, x, base = case(dtype, device, seed=21)
    shrunk = segment_lora_shrink(x, lora, form="splitk", split_k=2)  # (one shrink: the expands compared)
    for accumulate in (True, False):
        outs = []
        for expand in ("tile", "held"):
            got = base.clone()
            segment_lora_add(x, lora, list(got.split(ns, dim=1)), backend="triton", form="splitk",
                             accumulate=accumulate, split_k=2, expand=expand, shrunk=shrunk)
            outs.append(got)
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_held_expand_writes_first_over_a_covering_table(device, dtype):
    """Write-first into NaN over a covering table: every row written, zeros where no LoRA."""
    k, ns, tables = group(dtype, device, seed=7)
    rows = 120
    segments = [(3, 37, 1), (37, 40, 0), (44, 45, 2), (45, 90, 3), (90, 107, 5)]
    tiles = segment_tiles(segments, 16, rows=rows)
    lora = dataclasses.replace(make_lora(*tables[:4], tables[4], segments, 16),
                               tiles=torch.tensor(tiles, dtype=torch.int32).reshape(-1, 3).t().contiguous().to(device))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(8)).to(device, dtype)
    base = torch.full((rows, sum(ns)), float("nan"), dtype=dtype, device=device)
    got, want = run_both(x, lora, ns, base, accumulate=False, split_k=2, form="splitk", expand="held")
    assert not got.isnan().any()
    assert rel_err(got, want) < TOL[dtype]
    assert not got[40:44].any() and not got[107:].any() and not got[:3].any()


@pytest.mark.parametrize("accumulate", [True, False])
def test_held_expand_walks_the_live_tiles_only(device, accumulate):
    """A table padded with 30 empty tiles and its live count: the live grid's programs walk the
    live tiles' items (equal to the table grid bit for bit); a count of 1 runs the first tile only."""
    ns, lora, x, base = case(torch.float32, device, seed=9, pad_tiles=30)
    n_live = len(segment_tiles(SEGMENTS, 16))
    shrunk = segment_lora_shrink(x, lora, form="splitk", split_k=3)  # (one shrink: the expands compared)
    outs = []
    for lo in (lora, with_live(lora, n_live)):
        got = base.clone()
        segment_lora_add(x, lo, list(got.split(ns, dim=1)), backend="triton", form="splitk", split_k=3,
                         accumulate=accumulate, expand="held", per_sm=(None, 2), shrunk=shrunk)
        outs.append(got)
    assert torch.equal(outs[0], outs[1])
    first = base.clone()
    segment_lora_add(x, with_live(lora, 1), list(first.split(ns, dim=1)), backend="triton", form="splitk",
                     accumulate=accumulate, expand="held", shrunk=shrunk)
    assert torch.equal(first[1:], base[1:]) and not torch.equal(first[:1], base[:1])


def test_held_expand_one_compiled_variant_for_every_rank_mix_and_bad_options(device):
    """The compile keys do not depend on ranks or the table's length; unknown options, another
    form or another expand name are refused."""
    ns, lora, x, base = case(torch.float32, device, seed=30)
    outs = list(base.split(ns, dim=1))
    keys = segment_kernel_variants(x, lora, outs, form="splitk", expand="held")
    one = dataclasses.replace(lora, ranks=torch.full_like(lora.ranks, 8),
                              tiles=torch.cat([lora.tiles, torch.zeros_like(lora.tiles[:, :5])], dim=1))
    assert segment_kernel_variants(x, one, outs, form="splitk", expand="held") == keys
    assert any(k[0] == "_held_expand_kernel" for k in keys)
    with pytest.raises(ValueError, match="unknown options"):
        segment_lora_add(x, lora, outs, backend="triton", form="splitk", expand="held", held={"bogus": 1})
    with pytest.raises(ValueError, match="form 'splitk' only"):
        segment_lora_add(x, lora, outs, backend="triton", form="segments", expand="held")
    with pytest.raises(ValueError, match="expand="):
        segment_lora_add(x, lora, outs, backend="triton", form="splitk", expand="wide")


def test_module_knob_picks_the_expand(device, monkeypatch):
    """``SPLITK_EXPAND`` is the default of the "splitk" form's expand."""
    ns, lora, x, base = case(torch.float32, device, seed=40)
    outs = list(base.split(ns, dim=1))
    monkeypatch.setattr(lora_segments, "SPLITK_EXPAND", "held")
    names = {k[0] for k in segment_kernel_variants(x, lora, outs, form="splitk")}
    assert "_held_expand_kernel" in names and "_segment_expand_kernel" not in names
