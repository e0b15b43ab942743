"""Fused LoRA epilogues (RoPE + KV write, SwiGLU) and the grouped shrink: references vs float64
math, Triton (interpreter on CPU) vs references.

Tolerances on ||got - want|| / ||want||: fp32 1e-5 (same fp32 inputs; summation order and FMA
contraction differ); fp16 2e-3 (both add the LoRA term in fp32 and round once; the kernels then
round RoPE / SwiGLU once where the eager ops round after each op: a few ulps of 4.9e-4 at most).
"""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.kernels.lora_epilogues import (rope_group_dots, rope_write_kv, rope_write_kv_reference, swiglu,
                                                         swiglu_reference)
from lightning_lorafusion.kernels.lora_gather import MAX_RANK, GatheredLora
from lightning_lorafusion.model.decoder import rope_cos_sin, rope_inv_freq
from lightning_lorafusion.model.decoder import DecoderConfig

from _decode_groups import assert_per_row_bits, wrong_groups

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def rel_err(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def make_group(k, widths, ranks, rows, dtype, device, *, first_row=0, seed=0):
    """A pool of adapters for a group of projections sharing an input of width k (widths: their
    output widths) and a routing of ``rows`` decode rows over them. ``ranks[a][g]``: adapter a's
    rank on projection g (0 = not targeted). Returns (GatheredLora, factors) with
    factors[row][g] = (A [r, k], B [n, r], scale) in float64 (None: no LoRA)."""
    gen = torch.Generator().manual_seed(seed)
    parts, pos, offsets = [torch.randn(7, generator=gen)], 7, []
    factors_by_adapter = []
    for adapter_ranks in ranks:
        offs, facs = [], []
        for n, r in zip(widths, adapter_ranks):
            a = torch.randn(r, k, generator=gen) * k**-0.5
            b = torch.randn(n, r, generator=gen) * max(r, 1) ** -0.5
            offs.append((pos, pos + r * k))
            parts += [a.reshape(-1), b.T.reshape(-1), torch.randn(3, generator=gen)]
            pos += r * (k + n) + 3
            facs.append((a.to(dtype).double(), b.to(dtype).double()) if r else None)
        offsets.append(offs)
        factors_by_adapter.append(facs)
    pool = torch.cat(parts).to(device, dtype)
    row_adapter = [(i * 5 + 1) % len(ranks) for i in range(rows)]
    a_off = torch.tensor([[offsets[a][g][0] for a in row_adapter] for g in range(len(widths))], device=device)
    b_off = torch.tensor([[offsets[a][g][1] for a in row_adapter] for g in range(len(widths))], device=device)
    rk = torch.tensor([[ranks[a][g] for a in row_adapter] for g in range(len(widths))], dtype=torch.int32,
                      device=device)
    scales = (torch.rand(rows, generator=gen) + 0.5).to(device)
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    lora = GatheredLora(x, pool, a_off, b_off, rk, scales, first_row)
    factors = [[None if f is None else (*f, float(scales[i])) for f in factors_by_adapter[a]]
               for i, a in enumerate(row_adapter)]
    return lora, factors


def lora_delta64(lora, factors, g, width):
    """float64 [B, width]: scale * x A^T B^T per row (PEFT layout), 0 where no LoRA."""
    out = torch.zeros(lora.x.shape[0], width, dtype=torch.float64)
    for i, facs in enumerate(factors):
        if facs[g] is not None:
            a, b, s = facs[g]
            out[i] = s * (lora.x[i].double().cpu() @ a.T) @ b.T
    return out


SHAPES = {  # name: (tokens, Hq, Hkv, head_dim, hidden K, first_row, rows after the LoRA rows)
    "decode": (5, 4, 2, 8, 47, 0, 0),
    "mixed_rows_odd_half": (7, 6, 2, 6, 33, 3, 0),
    "mha": (3, 2, 2, 16, 20, 1, 0),
    # decode rows first, then rows without LoRA (a padded step's prefill rows): two launches
    "decode_rows_first": (7, 4, 2, 8, 24, 0, 4),
    "lora_rows_in_the_middle": (8, 4, 2, 8, 24, 2, 3),
}
# adapter -> ranks of (q, k, v): one targets only q and v, one has a rank of several blocks
QKV_RANKS = [(4, 4, 4), (3, 0, 5), (20, 20, 2)]


def make_rope_case(name, dtype, device, with_lora, fused, seed=0, partial=1.0):
    t, hq, hkv, d, k, first, after = SHAPES[name]
    gen = torch.Generator().manual_seed(seed + 11)
    widths = (hq * d, hkv * d, hkv * d)
    if fused:  # views of one q|k|v GEMM output, as the engine's fused projection gives them
        qkv = torch.randn(t, sum(widths), generator=gen).to(device, dtype)
        q, k_, v = (y.view(t, -1, d) for y in qkv.split(widths, dim=1))
    else:
        q, k_, v = (torch.randn(t, w // d, d, generator=gen).to(device, dtype) for w in widths)
    cfg = DecoderConfig(vocab_size=8, hidden_size=k, intermediate_size=8, num_layers=1, num_heads=hq,
                        num_kv_heads=hkv, head_dim=d, rope_theta=100.0, partial_rotary_factor=partial)
    positions = torch.randint(0, 40, (t,), generator=gen)
    cos, sin = rope_cos_sin(cfg, positions, dtype, rope_inv_freq(cfg))
    pages, page_size, layers = 6, 4, 3
    pool = torch.randn(pages, layers, 2, page_size, hkv, d, generator=gen).to(device, dtype)
    slots = torch.randperm(pages * page_size, generator=gen)[:t]  # distinct slots, pages shared
    slot_pages, slot_offsets = (slots // page_size).to(device), (slots % page_size).to(device)
    lora = factors = None
    if with_lora:
        lora, factors = make_group(k, widths, QKV_RANKS, t - first - after, dtype, device, first_row=first,
                                   seed=seed)
    return dict(q=q, k=k_, v=v, cos=cos.to(device), sin=sin.to(device), kv_pool=pool, layer=1, slot_pages=slot_pages,
                slot_offsets=slot_offsets, lora=lora), factors


def clone_case(case):
    out = dict(case)
    for key in ("q", "k", "v", "kv_pool"):
        out[key] = case[key].clone()
    return out


def test_rope_reference_matches_float64_math():
    """q, k, v += scale x A^T B^T for the decode rows; RoPE as HF's rotate_half; k and v land in
    their slots and no other slot changes."""
    case, factors = make_rope_case("mixed_rows_odd_half", torch.float32, "cpu", True, False)
    t, hq, d = case["q"].shape
    hkv = case["k"].shape[1]
    first = case["lora"].first_row
    want = {}
    for g, name in enumerate(("q", "k", "v")):
        y = case[name].double().reshape(t, -1).clone()
        y[first:] += lora_delta64(case["lora"], factors, g, y.shape[1])
        want[name] = y.view(t, -1, d)
    cos, sin = case["cos"].double().reshape(t, 1, d), case["sin"].double().reshape(t, 1, d)

    def rope(x):
        return x * cos + torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1) * sin

    want["q"], want["k"] = rope(want["q"]), rope(want["k"])
    ref = clone_case(case)
    rope_write_kv_reference(**ref)
    for name in ("q", "k", "v"):
        assert rel_err(ref[name], want[name]) < 1e-5, name
    pool_want = case["kv_pool"].clone()
    pool_want[case["slot_pages"], 1, 0, case["slot_offsets"]] = want["k"].float()
    pool_want[case["slot_pages"], 1, 1, case["slot_offsets"]] = want["v"].float()
    assert rel_err(ref["kv_pool"], pool_want) < 1e-6
    untouched = torch.ones(case["kv_pool"].shape[:4], dtype=torch.bool)
    untouched[case["slot_pages"], 1, :, case["slot_offsets"]] = False
    assert torch.equal(ref["kv_pool"][untouched], case["kv_pool"][untouched])
    assert hkv == 2 and hq == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("with_lora,fused", [(True, True), (True, False), (False, True)])
def test_rope_triton_matches_reference(device, dtype, shape, with_lora, fused):
    case, _ = make_rope_case(shape, dtype, device, with_lora, fused)
    ref, got = clone_case(case), clone_case(case)
    rope_write_kv_reference(**ref)
    rope_write_kv(**got, backend="triton")
    for name in ("q", "k", "v", "kv_pool"):
        assert rel_err(got[name], ref[name]) < TOL[dtype], (name, rel_err(got[name], ref[name]))
    if not with_lora:
        assert torch.equal(got["v"], case["v"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("with_lora", [True, False])
def test_rope_rows_kernel_gives_the_per_head_kernels_bits(device, dtype, shape, with_lora, monkeypatch):
    """The rows without LoRA through the program-per-row kernel (from 1 row) and through the
    program-per-(row, head) one (never): the same q, k, v and pool, bit for bit (odd head
    counts, half head dims that are not powers of two, LoRA rows before, between and after)."""
    import lightning_lorafusion.kernels.lora_epilogues as epi

    case, _ = make_rope_case(shape, dtype, device, with_lora, True)
    outs = []
    for threshold in (1, 10**9):
        monkeypatch.setattr(epi, "ROPE_ROWS_KERNEL_MIN_ROWS", threshold)
        got = clone_case(case)
        rope_write_kv(**got, backend="triton")
        outs.append(got)
    for name in ("q", "k", "v", "kv_pool"):
        assert torch.equal(outs[0][name], outs[1][name]), name


# partial rotary (Phi-4-mini rotates 3/4 of each head): shapes whose rotated width is a quarter,
# a half (head_dim 6 -> 2 dims) and three quarters of the head, the rest passing through
PARTIAL = [("mha", 0.25), ("mixed_rows_odd_half", 0.34), ("decode", 0.5), ("lora_rows_in_the_middle", 0.75)]


def test_partial_rotary_reference_rotates_only_the_leading_dims():
    """cos, sin as wide as the rotated dims: those dims get HF's rotate_half, the rest of each
    head passes through (after its LoRA), in q, k and the pool."""
    case, factors = make_rope_case("mha", torch.float32, "cpu", True, False, partial=0.75)
    t, _, d = case["q"].shape
    r = case["cos"].shape[-1]
    assert r == 12 < d
    first = case["lora"].first_row
    want = {}
    for g, name in enumerate(("q", "k", "v")):
        y = case[name].double().reshape(t, -1).clone()
        y[first:] += lora_delta64(case["lora"], factors, g, y.shape[1])
        want[name] = y.view(t, -1, d)
    cos, sin = case["cos"].double().reshape(t, 1, r), case["sin"].double().reshape(t, 1, r)

    def rope(x):
        x_rot, x_pass = x[..., :r], x[..., r:]
        rotated = x_rot * cos + torch.cat((-x_rot[..., r // 2:], x_rot[..., : r // 2]), dim=-1) * sin
        return torch.cat((rotated, x_pass), dim=-1)

    want["q"], want["k"] = rope(want["q"]), rope(want["k"])
    ref = clone_case(case)
    rope_write_kv_reference(**ref)
    for name in ("q", "k", "v"):
        assert rel_err(ref[name], want[name]) < 1e-5, name
    assert rel_err(ref["kv_pool"][case["slot_pages"], 1, 0, case["slot_offsets"]], want["k"]) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape,partial", PARTIAL)
@pytest.mark.parametrize("with_lora", [True, False])
def test_partial_rotary_triton_matches_reference(device, dtype, shape, partial, with_lora, monkeypatch):
    """Both kernels (per (row, head), and per row for rows without LoRA) rotate only the first
    rotary_dim dims and carry the rest (+ LoRA) into q, k and the pages."""
    import lightning_lorafusion.kernels.lora_epilogues as epi

    case, _ = make_rope_case(shape, dtype, device, with_lora, True, partial=partial)
    assert case["cos"].shape[-1] < case["q"].shape[-1]
    ref = clone_case(case)
    rope_write_kv_reference(**ref)
    for threshold in (1, 10**9):
        monkeypatch.setattr(epi, "ROPE_ROWS_KERNEL_MIN_ROWS", threshold)
        got = clone_case(case)
        rope_write_kv(**got, backend="triton")
        for name in ("q", "k", "v", "kv_pool"):
            assert rel_err(got[name], ref[name]) < TOL[dtype], (threshold, name, rel_err(got[name], ref[name]))


def test_rope_triton_shrink_blocks_and_rank_above_max(device):
    """Other shrink blocks give the same result; a row whose rank exceeds MAX_RANK comes out
    NaN (the kernels cannot check on the host) and leaves the other rows alone."""
    case, _ = make_rope_case("decode", torch.float32, device, True, True)
    ref = clone_case(case)
    rope_write_kv_reference(**ref)
    for blocks in ({"block_k": 16, "block_r": 16}, {"block_k": 64, "block_r": 32}):
        got = clone_case(case)
        rope_write_kv(**got, backend="triton", **blocks)
        assert rel_err(got["q"], ref["q"]) < TOL[torch.float32], blocks
    bad = clone_case(case)
    bad["lora"] = GatheredLora(*[getattr(case["lora"], f) for f in ("x", "pool", "a_offsets", "b_offsets")],
                               case["lora"].ranks.clone(), case["lora"].scales)
    bad["lora"].ranks[0, 2] = MAX_RANK + 1
    rope_write_kv(**bad, backend="triton")
    assert torch.isnan(bad["q"][2]).all() and not torch.isnan(bad["q"][[0, 1, 3, 4]]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_lora", [True, False])
@pytest.mark.parametrize("n,first_row,rows", [(47, 0, 6), (123, 2, 4), (47, 0, 3), (64, 1, 3)])
def test_swiglu_triton_matches_reference(device, dtype, with_lora, n, first_row, rows):
    """gate and up as column slices of one gate|up GEMM output; LoRA on ``rows`` rows from
    first_row: the last rows, the first ones (a padded mixed step's decode rows) or some in the
    middle (rows after them get none)."""
    t, k = 6, 29
    gen = torch.Generator().manual_seed(n)
    gu = torch.randn(t, 2 * n, generator=gen).to(device, dtype)
    gate, up = gu[:, :n], gu[:, n:]
    lora = None
    if with_lora:
        lora, _ = make_group(k, (n, n), [(4, 4), (0, 7), (17, 2)], rows, dtype, device, first_row=first_row)
    before = gu.clone()
    want = swiglu_reference(gate, up, lora)
    got = swiglu(gate, up, lora=lora, backend="triton")
    assert torch.equal(gu, before)  # neither path writes gate / up
    assert got.shape == (t, n) and got.dtype == dtype
    assert rel_err(got, want) < TOL[dtype]


def test_swiglu_reference_matches_float64_math():
    t, k, n = 5, 12, 9
    lora, factors = make_group(k, (n, n), [(3, 3), (2, 0)], t, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(1)
    gate, up = torch.randn(t, n, generator=gen), torch.randn(t, n, generator=gen)
    g64 = gate.double() + lora_delta64(lora, factors, 0, n)
    u64 = up.double() + lora_delta64(lora, factors, 1, n)
    assert rel_err(swiglu_reference(gate, up, lora), torch.nn.functional.silu(g64) * u64) < 1e-5


def test_bad_inputs_raise_clear_errors(device):
    case, _ = make_rope_case("decode", torch.float32, device, True, True)
    with pytest.raises(ValueError, match="k must be"):
        rope_write_kv(**{**case, "k": case["k"][:, :1]})
    with pytest.raises(ValueError, match="cos must be"):
        rope_write_kv(**{**case, "cos": case["cos"][:2]})
    lora = case["lora"]
    short = GatheredLora(lora.x, lora.pool, lora.a_offsets[:2], lora.b_offsets[:2], lora.ranks[:2], lora.scales)
    with pytest.raises(ValueError, match="a_offsets must be \\[3, rows\\]"):
        rope_write_kv(**{**case, "lora": short})
    late = GatheredLora(lora.x, lora.pool, lora.a_offsets, lora.b_offsets, lora.ranks, lora.scales, 2)
    with pytest.raises(ValueError, match="must lie within the outputs"):
        rope_write_kv(**{**case, "lora": late})
    g = torch.randn(4, 6, device=device)
    with pytest.raises(ValueError, match="up must have 4 rows"):
        swiglu(g, torch.randn(3, 6, device=device))
    with pytest.raises(ValueError, match="backend="):
        swiglu(g, g, backend="gpu")


# ---- rows grouped by adapter: the expand reads each group's B^T once -----------------------------

def with_groups(lora, ranks, group_rows, wrong=None):
    """``lora`` with its rows grouped by adapter (``make_group``'s routing; an adapter with no
    rank on any projection counts as no adapter, left out of the groups), in groups of at most
    ``group_rows``; ``wrong``: a grouping that does not match the rows (``wrong_groups`` of
    test_lora_gather.py)."""
    from dataclasses import replace

    from lightning_lorafusion.kernels.lora_gather import adapter_groups

    rows = lora.ranks.shape[1]
    keys = [a + 1 if any(ranks[a]) else 0 for a in ((i * 5 + 1) % len(ranks) for i in range(rows))]
    groups = adapter_groups(keys, rows, group_rows) if wrong is None else wrong_groups(keys, wrong)
    return replace(lora, groups=groups.to(lora.x.device))


@pytest.fixture(params=["row_loop", "dot", "dot_half", "dot_loop1"])
def grouped_expand(request, monkeypatch):
    """Every grouped expand taken (row bound 1), in each form (the dot with S in fp32 or
    rounded to the output's dtype; "loop1": groups of one row by the row loop, of two by the
    dot), the shrink per row; groups cut at 2 rows."""
    from lightning_lorafusion.kernels import lora_gather as module

    monkeypatch.setattr(module, "GROUPED_EXPAND_ROW_LOOP", request.param == "row_loop")
    if request.param == "dot_half":
        monkeypatch.setattr(module, "GROUPED_EXPAND_DOT", "half")
    if request.param == "dot_loop1":
        monkeypatch.setattr(module, "GROUPED_EXPAND_LOOP_ROWS", 1)
    monkeypatch.setattr(module, "GROUPED_EXPAND_MIN_ROWS", 1)
    monkeypatch.setattr(module, "GROUPED_MIN_ROWS", 10**9)
    monkeypatch.setattr(module, "GROUP_ROWS", 2)
    return module


GROUPED_QKV_RANKS = QKV_RANKS + [(0, 0, 0)]  # the last: rows without LoRA


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", ["decode", "decode_rows_first", "lora_rows_in_the_middle", "mixed_rows_odd_half"])
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_rope_grouped_expand_matches_per_row_and_reference(device, dtype, shape, partial, grouped_expand,
                                                           monkeypatch):
    """q/k/v's LoRA added a group at a time, then the plain RoPE kernels: the reference's q, k,
    v and pages, and the per-row fused kernel's (both kernels of rows without LoRA)."""
    import lightning_lorafusion.kernels.lora_epilogues as epi

    case, _ = make_rope_case(shape, dtype, device, False, True, partial=partial)
    t, first, after = case["q"].shape[0], SHAPES[shape][5], SHAPES[shape][6]
    lora, _ = make_group(SHAPES[shape][4], (case["q"][0].numel(), case["k"][0].numel(), case["v"][0].numel()),
                         GROUPED_QKV_RANKS, t - first - after, dtype, device, first_row=first)
    case["lora"] = with_groups(lora, GROUPED_QKV_RANKS, 2)
    assert int(case["lora"].groups[1].count_nonzero()) >= 2
    ref, per_row = clone_case(case), clone_case(case)
    rope_write_kv_reference(**ref)
    rope_write_kv(**{**per_row, "lora": lora}, backend="triton")
    for threshold in (1, 10**9):
        monkeypatch.setattr(epi, "ROPE_ROWS_KERNEL_MIN_ROWS", threshold)
        got = clone_case(case)
        rope_write_kv(**got, backend="triton")
        for name in ("q", "k", "v", "kv_pool"):
            assert rel_err(got[name], ref[name]) < TOL[dtype], (name, rel_err(got[name], ref[name]))
            assert rel_err(got[name], per_row[name]) < TOL[dtype], name
            if grouped_expand.GROUPED_EXPAND_ROW_LOOP:  # the per-row helpers, in the same order
                assert_per_row_bits(got[name], per_row[name])


@pytest.mark.parametrize("wrong", ["shifted", "dropped_group", "duplicated_row"])
def test_rope_grouped_expand_catches_a_wrong_grouping(device, wrong, grouped_expand):
    case, _ = make_rope_case("decode_rows_first", torch.float32, device, False, True)
    t = case["q"].shape[0]
    lora, _ = make_group(24, (32, 16, 16), GROUPED_QKV_RANKS, t - 4, torch.float32, device)
    ref = clone_case({**case, "lora": lora})
    rope_write_kv_reference(**ref)
    got = clone_case({**case, "lora": with_groups(lora, GROUPED_QKV_RANKS, 2, wrong=wrong)})
    rope_write_kv(**got, backend="triton")
    assert not rel_err(got["q"], ref["q"]) <= 1e-2  # (NaN, from partial sums never written, counts)


GROUPED_GATE_UP_RANKS = [(4, 4), (0, 7), (17, 2), (0, 0)]


def _grouped_swiglu_case(device, dtype, n, first_row, rows, group_rows):
    """SwiGLU of 7 rows with gate/up LoRA on ``rows`` of them, per row and grouped by up to
    ``group_rows`` rows: (per-row LoRA, grouped LoRA, reference, per-row kernel, grouped kernel);
    checks that gate and up are not written and that both kernels match the reference."""
    t, k = 7, 29
    gu = torch.randn(t, 2 * n, generator=torch.Generator().manual_seed(n)).to(device, dtype)
    gate, up = gu[:, :n], gu[:, n:]
    lora, _ = make_group(k, (n, n), GROUPED_GATE_UP_RANKS, rows, dtype, device, first_row=first_row)
    grouped = with_groups(lora, GROUPED_GATE_UP_RANKS, group_rows)
    before = gu.clone()
    want = swiglu_reference(gate, up, lora)
    per_row = swiglu(gate, up, lora=lora, backend="triton")
    got = swiglu(gate, up, lora=grouped, backend="triton")
    assert torch.equal(gu, before)
    assert rel_err(got, want) < TOL[dtype] and rel_err(got, per_row) < TOL[dtype]
    return (gate, up), lora, grouped, want, per_row, got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,first_row,rows", [(47, 0, 6), (123, 2, 4), (64, 1, 5)])
def test_swiglu_grouped_expand_matches_per_row_and_reference(device, dtype, n, first_row, rows, grouped_expand):
    """The grouped SwiGLU (every row plain, then the groups' rows with their LoRA): the
    reference and the per-row fused kernel; gate and up not written."""
    *_, per_row, got = _grouped_swiglu_case(device, dtype, n, first_row, rows, 2)
    if grouped_expand.GROUPED_EXPAND_ROW_LOOP:
        assert_per_row_bits(got, per_row)
    outside = [i for i in range(got.shape[0]) if not first_row <= i < first_row + rows]
    assert torch.equal(got[outside], per_row[outside])  # rows outside the gathered ones: the plain kernel's


@pytest.mark.parametrize("wrong", ["shifted", "dropped_group", "duplicated_row"])
def test_swiglu_grouped_expand_catches_a_wrong_grouping(device, wrong, grouped_expand):
    n, t = 40, 6
    gu = torch.randn(t, 2 * n, generator=torch.Generator().manual_seed(3)).to(device)
    lora, _ = make_group(29, (n, n), GROUPED_GATE_UP_RANKS, t, torch.float32, device)
    want = swiglu_reference(gu[:, :n], gu[:, n:], lora)
    got = swiglu(gu[:, :n], gu[:, n:], lora=with_groups(lora, GROUPED_GATE_UP_RANKS, 2, wrong=wrong),
                 backend="triton")
    assert not rel_err(got, want) <= 1e-2


def test_swiglu_grouped_rank_above_max_is_nan_for_its_rows_only(device, grouped_expand):
    n, t = 40, 6
    gu = torch.randn(t, 2 * n, generator=torch.Generator().manual_seed(3)).to(device)
    lora, _ = make_group(29, (n, n), GROUPED_GATE_UP_RANKS, t, torch.float32, device)
    bad_adapter = 2  # rows (i * 5 + 1) % 4 == 2: rows 1 and 5
    bad_rows = [i for i in range(t) if (i * 5 + 1) % 4 == bad_adapter]
    ranks = lora.ranks.clone()
    ranks[0, bad_rows] = MAX_RANK + 1
    from dataclasses import replace
    got = swiglu(gu[:, :n], gu[:, n:], lora=with_groups(replace(lora, ranks=ranks), GROUPED_GATE_UP_RANKS, 2),
                 backend="triton")
    good = [i for i in range(t) if i not in bad_rows]
    assert torch.isnan(got[bad_rows]).all() and not torch.isnan(got[good]).any()


# ---- the hybrid expands: groups of 2+ rows by one dot, rows alone per row, one table ------------

@pytest.fixture(params=["fused", "separate"])
def hybrid_expand(request, monkeypatch):
    """The hybrid expands taken (row bound 1), q/k/v's too: the groups' programs in the per-row
    launch ("fused") or a launch of their own after it (q/k/v per row then)."""
    from lightning_lorafusion.kernels import lora_gather as module

    monkeypatch.setattr(module, "HYBRID_MIN_ROWS", 1)
    monkeypatch.setattr(module, "HYBRID_FUSED", request.param == "fused")
    monkeypatch.setattr(module, "HYBRID_QKV", True)
    monkeypatch.setattr(module, "HYBRID_GROUP_N", 16)  # (the interpreter's column blocks of 32: two dots each)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,first_row,rows", [(47, 0, 6), (64, 1, 5)])
def test_swiglu_hybrid_expand_matches_per_row_and_reference(device, dtype, n, first_row, rows, hybrid_expand):
    """SwiGLU with groups of two rows by the dot and rows alone on their adapter by the per-row
    arithmetic (``with_groups``' routing has both, and rows without LoRA): the reference and the
    per-row kernel; the rows alone the per-row kernel's bits (a few ulp compiled); gate and up
    not written."""
    (gate, up), lora, grouped, want, per_row, got = _grouped_swiglu_case(device, dtype, n, first_row, rows, 16)
    sizes = grouped.groups[3].tolist()
    assert 1 in sizes and 2 in sizes  # both ways taken
    alone = [first_row + i for i, s in enumerate(sizes) if s < 2]
    assert_per_row_bits(got[alone], per_row[alone])
    # a wrong grouping (every row told it shares one adapter) is caught
    wrong = with_groups(lora, GROUPED_GATE_UP_RANKS, 16, wrong="one_adapter")
    assert not rel_err(swiglu(gate, up, lora=wrong, backend="triton"), want) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", ["decode", "lora_rows_in_the_middle", "mixed_rows_odd_half"])
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_rope_hybrid_expand_matches_per_row_and_reference(device, dtype, shape, partial, hybrid_expand):
    """q/k/v's LoRA in the RoPE + KV epilogue with its groups' programs ("decode": a group of two
    rows and rows alone; the others rows alone, before and after rows without LoRA): the
    reference's q, k, v and pages and the per-row kernel's, the rows alone its bits (a few ulp
    compiled). Separate
    launches (``HYBRID_FUSED`` off) leave q/k/v per row, and so do a GPU's launches whose head
    tiles are under 16 columns (``rope_group_dots``): the wrong grouping is caught only where the
    group programs run."""
    case, _ = make_rope_case(shape, dtype, device, False, True, partial=partial)
    t, first, after = case["q"].shape[0], SHAPES[shape][5], SHAPES[shape][6]
    lora, _ = make_group(SHAPES[shape][4], (case["q"][0].numel(), case["k"][0].numel(), case["v"][0].numel()),
                         GROUPED_QKV_RANKS, t - first - after, dtype, device, first_row=first)
    case["lora"] = with_groups(lora, GROUPED_QKV_RANKS, 16)
    sizes = case["lora"].groups[3].tolist()
    if shape == "decode":
        assert 1 in sizes and 2 in sizes
    ref, per_row, got = clone_case(case), clone_case(case), clone_case(case)
    rope_write_kv_reference(**ref)
    rope_write_kv(**{**per_row, "lora": lora}, backend="triton")
    rope_write_kv(**got, backend="triton")
    alone = [first + i for i, s in enumerate(sizes) if s < 2]
    for name in ("q", "k", "v", "kv_pool"):
        assert rel_err(got[name], ref[name]) < TOL[dtype], (name, rel_err(got[name], ref[name]))
        assert rel_err(got[name], per_row[name]) < TOL[dtype], name
    for name in ("q", "k", "v"):
        assert_per_row_bits(got[name][alone], per_row[name][alone])
    wrong = clone_case({**case, "lora": with_groups(lora, GROUPED_QKV_RANKS, 16, wrong="one_adapter")})
    rope_write_kv(**wrong, backend="triton")
    if shape == "decode" and hybrid_expand.HYBRID_FUSED and rope_group_dots(case["q"], case["cos"].shape[-1]):
        assert not rel_err(wrong["q"], ref["q"]) <= 1e-2
