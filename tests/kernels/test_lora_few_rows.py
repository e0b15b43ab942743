"""The decode LoRA's few-rows blocks (``lora_gather.FEW_ROWS``): a launch over at most that many
rows takes a row's whole rank as one tile (``FEW_BLOCK_R``), narrower K blocks in the shrink
and narrower column blocks in the expands. Checked against the references and against the
blocks used before (``FEW_ROWS`` None), with heterogeneous ranks (1 to 128: one tile, two tiles
above ``FEW_BLOCK_R``), rows without an adapter mixed in and a row alone; interpreter fp32 /
fp16 on the CPU. Tolerances as in test_lora_gather.py / test_lora_epilogues.py.
"""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.kernels import lora_gather as lg
from lightning_lorafusion.kernels.lora_epilogues import rope_write_kv, rope_write_kv_reference, swiglu, swiglu_reference
from lightning_lorafusion.kernels.lora_gather import GatheredLora, lora_gather, lora_gather_reference

from test_lora_gather import make_adapters, make_routing, rel_err

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
# adapter ranks: one below a 16-rank block, several blocks, the whole few-rows tile, above it, the most
RANKS = [3, 0, 40, 64, 100, 128, 16]
ROWS = {  # rows -> adapter of each row (rank 0: a base row)
    "one_row_rank_100": [4],
    "one_base_row": [1],
    "mixed_with_base_rows": [0, 1, 2, 3, 1, 4, 5, 6],
    "sixteen_shared": [i % 3 + 2 for i in range(16)],
}


@pytest.fixture(params=["few", "before", "few_unpaired", "rank_split"])
def few(request, monkeypatch):
    """The few-rows blocks on (for up to 16 rows) or off (the blocks used before them); the
    epilogues' column sets in one rank loop (the default) or one after the other; the shrink's
    rank blocks over several programs (``RANK_SPLIT``) with the blocks of before."""
    monkeypatch.setattr(lg, "FEW_ROWS", None if request.param in ("before", "rank_split") else 16)
    monkeypatch.setattr(lg, "PAIR_EPILOGUES", request.param != "few_unpaired")
    monkeypatch.setattr(lg, "RANK_SPLIT_MAX_ROWS", 16 if request.param == "rank_split" else None)
    return request.param


def test_few_rows_choose_their_blocks_by_row_count(monkeypatch):
    """At most FEW_ROWS rows: the few-rows blocks (a caller's blocks still win); more rows or
    FEW_ROWS None: the blocks of before."""
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert lg.FEW_ROWS is not None and lg.FEW_ROWS >= 1
    monkeypatch.setattr(lg, "FEW_ROWS", 16)
    assert lg.row_blocks(gpu, 1) == (lg.FEW_SHRINK_BLOCK_K, lg.FEW_BLOCK_R) != lg.shrink_blocks(gpu)
    assert lg.row_blocks(gpu, 16) == (lg.FEW_SHRINK_BLOCK_K, 64) and lg.expand_block_n(gpu, 16) == 64
    assert lg.row_blocks(gpu, 17) == lg.shrink_blocks(gpu) == (lg.ROW_SHRINK_BLOCK_K, 16)
    assert lg.expand_block_n(gpu, 17) == lg.ROW_EXPAND_BLOCK_N and lg.expand_block_n(gpu, 0) == lg.ROW_EXPAND_BLOCK_N
    assert lg.row_blocks(gpu, 4, block_k=256, block_r=32) == (256, 32) and lg.expand_block_n(gpu, 4, 512) == 512
    assert lg.row_blocks(cpu, 4) == (16, 64) and lg.expand_block_n(cpu, 4) == 32
    monkeypatch.setattr(lg, "FEW_ROWS", None)
    assert lg.row_blocks(gpu, 1) == (lg.ROW_SHRINK_BLOCK_K, 16) and lg.expand_block_n(gpu, 1) == lg.ROW_EXPAND_BLOCK_N


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", sorted(ROWS))
def test_gather_few_rows_matches_reference(device, dtype, rows, few):
    k, n = 70, 90
    row_adapter = ROWS[rows]
    pool, adapters = make_adapters(RANKS, k, n, dtype, device)
    a_off, b_off, rk, scales = make_routing(adapters, row_adapter, RANKS, device)
    x = torch.randn(len(row_adapter), k, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    y = torch.randn(len(row_adapter), n, generator=torch.Generator().manual_seed(6)).to(device, dtype)
    want = y.clone()
    lora_gather_reference(x, pool, a_off, b_off, rk, scales, n, out=want)
    got = y.clone()
    lora_gather(x, pool, a_off, b_off, rk, scales, n, out=got, backend="triton")
    assert rel_err(got, want) < TOL[dtype]
    base = [i for i, a in enumerate(row_adapter) if RANKS[a] == 0]
    assert torch.equal(got[base], y[base])  # rows without an adapter are not touched


def test_gather_few_rows_equals_the_blocks_of_before(device, monkeypatch):
    """Both block choices over the same rows agree to fp32 rounding (only the summation order
    differs), and the few-rows launch is not the one of before (its shrink has more K blocks)."""
    # K spans more few-rows K blocks than blocks of before on a GPU (256 vs 512) and in the
    # interpreter (16 vs 32)
    k, n, row_adapter = 700, 90, ROWS["mixed_with_base_rows"]
    pool, adapters = make_adapters(RANKS, k, n, torch.float32, device)
    a_off, b_off, rk, scales = make_routing(adapters, row_adapter, RANKS, device)
    x = torch.randn(len(row_adapter), k, generator=torch.Generator().manual_seed(5)).to(device)
    lora = GatheredLora(x, pool, a_off[None], b_off[None], rk[None], scales)
    monkeypatch.setattr(lg, "FEW_ROWS", 16)
    few = lora_gather(x, pool, a_off, b_off, rk, scales, n, backend="triton")
    few_kb = lg.lora_shrink(lora)[1]
    monkeypatch.setattr(lg, "FEW_ROWS", None)
    before = lora_gather(x, pool, a_off, b_off, rk, scales, n, backend="triton")
    assert lg.lora_shrink(lora)[1] < few_kb
    assert rel_err(few, before) < 1e-6


def test_rank_above_max_is_nan_for_its_row_only_with_few_rows(device):
    k, n, ranks = 33, 47, [128, 3, 129]
    pool, adapters = make_adapters(ranks, k, n, torch.float32, device)
    a_off, b_off, rk, scales = make_routing(adapters, [0, 1, 2], ranks, device)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(9)).to(device)
    got = lora_gather(x, pool, a_off, b_off, rk, scales, n, backend="triton")
    want = lora_gather_reference(x[:2], pool, a_off[:2], b_off[:2], rk[:2], scales[:2], n)
    assert rel_err(got[:2], want) < TOL[torch.float32] and torch.isnan(got[2]).all()


def _group(k, widths, row_adapter, dtype, device, first_row=0, seed=0):
    """A GatheredLora over ``row_adapter`` for projections of ``widths`` (adapter a's rank on
    projection g: RANKS[(a + g) % len(RANKS)], so one row's projections differ in rank)."""
    g = torch.Generator().manual_seed(seed)
    pool, adapters = make_adapters(RANKS * len(widths), k, max(widths), dtype, device, seed=seed)
    rows = len(row_adapter)
    a_off = torch.zeros(len(widths), rows, dtype=torch.int64)
    b_off = torch.zeros(len(widths), rows, dtype=torch.int64)
    rk = torch.zeros(len(widths), rows, dtype=torch.int32)
    for p in range(len(widths)):
        for i, a in enumerate(row_adapter):
            j = p * len(RANKS) + (a + p) % len(RANKS)
            a_off[p, i], b_off[p, i], rk[p, i] = adapters[j][0], adapters[j][1], RANKS[(a + p) % len(RANKS)]
    scales = (torch.rand(rows, generator=g) + 0.5).to(device)
    x = torch.randn(rows, k, generator=g).to(device, dtype)
    return GatheredLora(x, pool, a_off.to(device), b_off.to(device), rk.to(device), scales, first_row)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", ["one_row_rank_100", "mixed_with_base_rows"])
def test_swiglu_few_rows_matches_reference(device, dtype, rows, few):
    t, n = len(ROWS[rows]) + 2, 72
    lora = _group(40, (n, n), ROWS[rows], dtype, device, first_row=1)
    g = torch.Generator().manual_seed(3)
    gu = torch.randn(t, 2 * n, generator=g).to(device, dtype)
    want = swiglu_reference(gu[:, :n], gu[:, n:], lora)
    got = swiglu(gu[:, :n], gu[:, n:], lora=lora, backend="triton")
    assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", ["one_row_rank_100", "mixed_with_base_rows"])
def test_rope_write_kv_few_rows_matches_reference(device, dtype, rows, few):
    from test_lora_epilogues import SHAPES, make_rope_case

    t, hq, hkv, d, k, first, _ = SHAPES["decode"]
    case, _ = make_rope_case("decode", dtype, device, False, True)
    row_adapter = ROWS[rows][:t]
    case["lora"] = _group(k, (hq * d, hkv * d, hkv * d), row_adapter, dtype, device, first_row=first)
    want = {key: case[key].clone() for key in ("q", "k", "v", "kv_pool")}
    got = {key: case[key].clone() for key in ("q", "k", "v", "kv_pool")}
    common = {key: case[key] for key in ("cos", "sin", "layer", "slot_pages", "slot_offsets", "lora")}
    rope_write_kv_reference(want["q"], want["k"], want["v"], kv_pool=want["kv_pool"], **common)
    rope_write_kv(got["q"], got["k"], got["v"], kv_pool=got["kv_pool"], backend="triton", **common)
    for key in want:
        assert rel_err(got[key], want[key]) < TOL[dtype], key


def _ahead_case(row_adapter, dtype, device, first_row=1, after=2):
    """SwiGLU's gate/up LoRA over ``row_adapter`` (rows from ``first_row``, ``after`` plain rows
    after them) and down's tables for the same rows (down's rank of adapter a: RANKS[(a + 3) % len])."""
    n, h = 72, 24
    rows = len(row_adapter)
    t = first_row + rows + after
    lora = _group(40, (n, n), row_adapter, dtype, device, first_row=first_row)
    down_ranks = [RANKS[(a + 3) % len(RANKS)] for a in range(len(RANKS))]
    pool, adapters = make_adapters(down_ranks, n, h, dtype, device, seed=4)
    a_off, b_off, rk, scales = make_routing(adapters, row_adapter, down_ranks, device)
    gu = torch.randn(t, 2 * n, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    return lora, gu, n, (pool, a_off, b_off, rk, lora.scales, h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", ["one_row_rank_100", "mixed_with_base_rows", "sixteen_shared"])
def test_swiglu_ahead_gives_down_its_shrink(device, dtype, rows, monkeypatch):
    """SwiGLU's LoRA rows computing down's shrink (``AHEAD_MAX_ROWS``): its output is SwiGLU's,
    and down's gather from those partials (its expand alone) equals the reference on the
    activation; ranks up to 128 (two rank tiles), rows without an adapter, a row alone."""
    from lightning_lorafusion.kernels.lora_ahead import ShrinkAhead
    from lightning_lorafusion.kernels.lora_epilogues import swiglu_ahead

    monkeypatch.setattr(lg, "AHEAD_MAX_ROWS", 16)
    monkeypatch.setattr(lg, "FEW_ROWS", 16)
    lora, gu, n, (pool, a_off, b_off, rk, scales, h) = _ahead_case(ROWS[rows], dtype, device)
    act, partials = swiglu_ahead(gu[:, :n], gu[:, n:], lora=lora, ahead=ShrinkAhead(pool, a_off, rk), backend="triton")
    block_n = lg.AHEAD_BLOCK_N if device.type == "cuda" else 32  # the column block the launch takes there
    assert partials is not None and partials[1] == -(-n // block_n)
    assert rel_err(act, swiglu_reference(gu[:, :n], gu[:, n:], lora)) < TOL[dtype]
    rows_act = act[lora.first_row:lora.first_row + len(ROWS[rows])]
    y = torch.randn(rows_act.shape[0], h, generator=torch.Generator().manual_seed(8)).to(device, dtype)
    want, got = y.clone(), y.clone()
    lora_gather_reference(rows_act, pool, a_off, b_off, rk, scales, h, out=want)
    lora_gather(rows_act, pool, a_off, b_off, rk, scales, h, out=got, backend="triton", partials=partials)
    assert rel_err(got, want) < TOL[dtype]


def test_swiglu_ahead_only_where_it_applies(device, monkeypatch):
    """No partials without ``AHEAD_MAX_ROWS``, above it, or on the torch path; wrong tables and
    wrong partials are refused."""
    from lightning_lorafusion.kernels.lora_ahead import ShrinkAhead
    from lightning_lorafusion.kernels.lora_epilogues import swiglu_ahead

    lora, gu, n, (pool, a_off, b_off, rk, scales, h) = _ahead_case(ROWS["mixed_with_base_rows"], torch.float32,
                                                                   device)
    ahead = ShrinkAhead(pool, a_off, rk)
    assert swiglu_ahead(gu[:, :n], gu[:, n:], lora=lora, ahead=ahead, backend="triton")[1] is None
    monkeypatch.setattr(lg, "AHEAD_MAX_ROWS", 4)  # 8 rows: more than the bound
    assert swiglu_ahead(gu[:, :n], gu[:, n:], lora=lora, ahead=ahead, backend="triton")[1] is None
    monkeypatch.setattr(lg, "AHEAD_MAX_ROWS", 16)
    assert swiglu_ahead(gu[:, :n], gu[:, n:], lora=lora, ahead=ahead, backend="torch")[1] is None
    with pytest.raises(ValueError, match="ShrinkAhead.ranks"):
        swiglu_ahead(gu[:, :n], gu[:, n:], lora=lora, ahead=ShrinkAhead(pool, a_off, rk[:-1]), backend="triton")
    _, partials = swiglu_ahead(gu[:, :n], gu[:, n:], lora=lora, ahead=ahead, backend="triton")
    x = torch.zeros(rk.shape[0] + 1, n, device=device)
    with pytest.raises(ValueError, match="partials must be"):
        lora_gather(x, pool, *(torch.cat([t, t[:1]]) for t in (a_off, b_off, rk, scales)), h, backend="triton",
                    partials=partials)


@pytest.mark.parametrize("split", [2, 4, 8])
def test_rank_split_shrink_gives_the_same_bits(device, split, monkeypatch):
    """The shrink's rank blocks spread over ``split`` programs compute each block as before:
    the same partial sums, bit for bit (ranks 1-128 with 16-rank blocks: up to 8 blocks, some
    programs with none, one with two), and a split above the bound is not taken."""
    k, n, row_adapter = 70, 90, ROWS["mixed_with_base_rows"]
    pool, adapters = make_adapters(RANKS, k, n, torch.float32, device)
    a_off, b_off, rk, scales = make_routing(adapters, row_adapter, RANKS, device)
    x = torch.randn(len(row_adapter), k, generator=torch.Generator().manual_seed(5)).to(device)
    lora = GatheredLora(x, pool, a_off[None], b_off[None], rk[None], scales)
    monkeypatch.setattr(lg, "FEW_ROWS", None)
    monkeypatch.setattr(lg, "RANK_SPLIT_MAX_ROWS", None)
    part, kb = lg.lora_shrink(lora, block_r=16)
    monkeypatch.setattr(lg, "RANK_SPLIT", split)
    monkeypatch.setattr(lg, "RANK_SPLIT_MAX_ROWS", len(row_adapter))
    assert lg.rank_split(device, len(row_adapter)) == split and lg.rank_split(device, len(row_adapter) + 1) == 1
    part_split, kb_split = lg.lora_shrink(lora, block_r=16)
    view = (len(row_adapter), kb, lg.MAX_RANK)
    for i, a in enumerate(row_adapter):  # entries past a row's rank are never written: compare the rest
        r = min(RANKS[a], lg.MAX_RANK)
        assert torch.equal(part.view(view)[i, :, :r], part_split.view(view)[i, :, :r])
    assert kb_split == kb
