"""The decode LoRA under programmatic dependent launch (``lora_gather.PDL``, where the shrink does
not split ranks over programs): the expands and the RoPE + KV / SwiGLU epilogues load their
rows' first rank chunk of B^T before the partial sums (and on a Hopper GPU wait for the
shrink's grid in between). The sums are the same in the same
order, so the outputs must equal those with ``PDL`` off bit for bit: checked in the interpreter
(fp32, fp16) over ranks of one chunk, several chunks, rank 0 and ranks above a chunk on the same
row's projections, the few-rows blocks and the blocks of before, paired and unpaired epilogues.
"""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.kernels import lora_gather as lg
from lightning_lorafusion.kernels.lora_epilogues import rope_write_kv, swiglu
from lightning_lorafusion.kernels.lora_gather import lora_gather

from test_lora_few_rows import ROWS, _group
from test_lora_gather import make_adapters, make_routing

RANKS = [3, 0, 40, 64, 100, 128, 16]


def test_pdl_options(monkeypatch):
    """Off, or over rows whose shrink splits ranks over programs: no constexpr on, no launch
    option. On, off CUDA: the preloaded first chunk only (the interpreter checks its arithmetic);
    grid dependency control needs a CUDA device."""
    cpu = torch.device("cpu")
    off = ({"PRELOAD": False, "GDC": False}, {}, {"GDC": False})
    monkeypatch.setattr(lg, "FEW_ROWS", 8)
    monkeypatch.setattr(lg, "RANK_SPLIT_MAX_ROWS", 64)
    monkeypatch.setattr(lg, "PDL", False)
    assert all(lg.pdl_options(cpu, rows) == off for rows in (1, 16, 256))
    monkeypatch.setattr(lg, "PDL", True)
    for rows in (1, 8, 65, 256):  # the few-rows blocks, or past the rank split's bound
        assert lg.rank_split(cpu, rows) == 1 and lg.pdl_applies(cpu, rows)
        assert lg.pdl_options(cpu, rows) == ({"PRELOAD": True, "GDC": False}, {}, {"GDC": False})
    for rows in (9, 64):
        assert lg.rank_split(cpu, rows) > 1 and not lg.pdl_applies(cpu, rows) and lg.pdl_options(cpu, rows) == off


def _both(monkeypatch, fn):
    """``fn()`` with PDL off, then on -> (off, on)."""
    monkeypatch.setattr(lg, "PDL", False)
    off = fn()
    monkeypatch.setattr(lg, "PDL", True)
    return off, fn()


@pytest.fixture(params=[(16, True), (None, False)], ids=["few_paired", "before_unpaired"])
def blocks(request, monkeypatch):
    few, pair = request.param
    monkeypatch.setattr(lg, "FEW_ROWS", few)
    monkeypatch.setattr(lg, "PAIR_EPILOGUES", pair)
    monkeypatch.setattr(lg, "RANK_SPLIT_MAX_ROWS", None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gather_with_pdl_gives_the_same_bits(device, dtype, blocks, monkeypatch):
    k, n, row_adapter = 70, 90, ROWS["mixed_with_base_rows"]
    pool, adapters = make_adapters(RANKS, k, n, dtype, device)
    a_off, b_off, rk, scales = make_routing(adapters, row_adapter, RANKS, device)
    x = torch.randn(len(row_adapter), k, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    y = torch.randn(len(row_adapter), n, generator=torch.Generator().manual_seed(6)).to(device, dtype)

    def run():
        out = y.clone()
        lora_gather(x, pool, a_off, b_off, rk, scales, n, out=out, backend="triton")
        return out, lora_gather(x, pool, a_off, b_off, rk, scales, n, backend="triton")

    (acc_off, new_off), (acc_on, new_on) = _both(monkeypatch, run)
    assert torch.equal(acc_on, acc_off) and torch.equal(new_on, new_off)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swiglu_with_pdl_gives_the_same_bits(device, dtype, blocks, monkeypatch):
    row_adapter = ROWS["mixed_with_base_rows"]
    t, n = len(row_adapter) + 2, 72
    lora = _group(40, (n, n), row_adapter, dtype, device, first_row=1)
    gu = torch.randn(t, 2 * n, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    off, on = _both(monkeypatch, lambda: swiglu(gu[:, :n], gu[:, n:], lora=lora, backend="triton"))
    assert torch.equal(on, off)


def test_rope_write_kv_with_pdl_gives_the_same_bits(device, blocks, monkeypatch):
    from test_lora_epilogues import SHAPES, make_rope_case

    t, hq, hkv, d, k, first, _ = SHAPES["decode"]
    case, _ = make_rope_case("decode", torch.float32, device, False, True)
    case["lora"] = _group(k, (hq * d, hkv * d, hkv * d), ROWS["mixed_with_base_rows"][:t], torch.float32, device,
                          first_row=first)
    common = {key: case[key] for key in ("cos", "sin", "layer", "slot_pages", "slot_offsets", "lora")}

    def run():
        got = {key: case[key].clone() for key in ("q", "k", "v", "kv_pool")}
        rope_write_kv(got["q"], got["k"], got["v"], kv_pool=got["kv_pool"], backend="triton", **common)
        return got

    off, on = _both(monkeypatch, run)
    for key in off:
        assert torch.equal(on[key], off[key]), key
