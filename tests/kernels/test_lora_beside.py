"""The decode LoRA's shrink launched beside the frozen GEMM (``lora_gather.shrink_beside``): the
consumers (``lora_gather``'s expand, the RoPE + KV and SwiGLU epilogues) read partial sums
launched earlier, on another stream on a GPU, and take no PDL edge then. The same kernels and
sums, so the outputs must equal those of the consumer launching its own shrink bit for bit:
checked in the interpreter (fp32, fp16; the partials given as ``GatheredLora.partials``) and on
CUDA (a real second stream, a GEMM enqueued between fork and join) over one row of rank 100,
eight rows with base rows and mixed ranks, and sixteen rows (the rank split's launches).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from lightning_lorafusion.kernels import lora_gather as lg
from lightning_lorafusion.kernels.lora_epilogues import rope_write_kv, swiglu
from lightning_lorafusion.kernels.lora_gather import GatheredLora, lora_gather, lora_shrink, shrink_beside

from _decode_groups import assert_per_row_bits
from test_lora_few_rows import ROWS, _group

CASES = ["one_row_rank_100", "mixed_with_base_rows", "sixteen_shared"]


@pytest.fixture(autouse=True)
def knobs(monkeypatch):
    monkeypatch.setattr(lg, "FEW_ROWS", 8)
    monkeypatch.setattr(lg, "RANK_SPLIT_MAX_ROWS", 16)
    monkeypatch.setattr(lg, "PDL", True)
    monkeypatch.setattr(lg, "BESIDE_MAX_ROWS", 64)


@contextlib.contextmanager
def launched(lora: GatheredLora, wide: bool = False):
    """``lora`` with its shrink launched beside: on CUDA ``shrink_beside`` on a second stream, a
    GEMM enqueued on the current one meanwhile; elsewhere the partials launched first."""
    if not lora.x.is_cuda:
        yield dataclasses.replace(lora, partials=lora_shrink(lora))
        return
    side = torch.cuda.Stream(lora.x.device)
    with shrink_beside(lora, side, wide) as got:
        assert got.partials is not None
        w = torch.randn(2048, lora.x.shape[1], device=lora.x.device, dtype=lora.x.dtype)
        lora.x @ w.t()  # (the frozen GEMM's stand-in)
        yield got


def test_beside_applies_only_with_a_stream_on_cuda_within_its_rows(monkeypatch):
    lora = _group(40, (24,), ROWS["mixed_with_base_rows"], torch.float32, torch.device("cpu"))
    assert not lg.beside_applies(lora, None) and not lg.beside_applies(None, object())
    assert not lg.beside_applies(lora, object())  # CPU tensors
    with shrink_beside(lora, None) as same:
        assert same is lora
    off = {"PRELOAD": False, "GDC": False}
    cpu = torch.device("cpu")
    assert lg.pdl_options(cpu, 1, beside=True) == (off, {}, lg.pdl_options(cpu, 1)[2])
    if torch.cuda.is_available():
        cuda = _group(40, (24,), ROWS["mixed_with_base_rows"], torch.float32, torch.device("cuda"))
        stream = torch.cuda.Stream()
        assert lg.beside_applies(cuda, stream)
        monkeypatch.setattr(lg, "BESIDE_MAX_ROWS", 4)
        assert not lg.beside_applies(cuda, stream)
        monkeypatch.setattr(lg, "BESIDE_MAX_ROWS", None)
        assert not lg.beside_applies(cuda, stream)


def test_lora_shrink_returns_partials_launched_already(device):
    lora = _group(40, (24, 24), ROWS["mixed_with_base_rows"], torch.float32, device)
    given = (torch.zeros(1, device=device), 3)
    assert lora_shrink(dataclasses.replace(lora, partials=given)) is given


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", CASES)
def test_gather_beside_gives_the_same_bits(device, dtype, rows):
    n = 90
    lora = _group(70, (n,), ROWS[rows], dtype, device)
    y = torch.randn(len(ROWS[rows]), n, generator=torch.Generator().manual_seed(6)).to(device, dtype)
    args = (lora.x, lora.pool, lora.a_offsets[0], lora.b_offsets[0], lora.ranks[0], lora.scales, n)
    want = y.clone()
    lora_gather(*args, out=want, backend="triton")
    got = y.clone()
    with launched(lora) as beside:
        pass
    lora_gather(*args, out=got, backend="triton", partials=beside.partials)
    assert torch.equal(got, want)
    ref = y.clone()
    lora_gather(*args, out=ref, backend="torch")
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", CASES)
def test_swiglu_beside_gives_the_same_bits(device, dtype, rows):
    t, n = len(ROWS[rows]) + 2, 72
    lora = _group(40, (n, n), ROWS[rows], dtype, device, first_row=1)
    gu = torch.randn(t, 2 * n, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    want = swiglu(gu[:, :n], gu[:, n:], lora=lora, backend="triton")
    with launched(lora) as beside:
        pass
    got = swiglu(gu[:, :n], gu[:, n:], lora=beside, backend="triton")
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows", CASES[:2])
def test_rope_write_kv_beside_gives_the_same_bits(device, rows):
    from test_lora_epilogues import SHAPES, make_rope_case

    t, hq, hkv, d, k, first, _ = SHAPES["decode"]
    case, _ = make_rope_case("decode", torch.float32, device, False, True)
    row_adapter = ROWS[rows][:t - first]
    lora = _group(k, (hq * d, hkv * d, hkv * d), row_adapter, torch.float32, device, first_row=first)
    common = {key: case[key] for key in ("cos", "sin", "layer", "slot_pages", "slot_offsets")}

    def run(group):
        got = {key: case[key].clone() for key in ("q", "k", "v", "kv_pool")}
        rope_write_kv(got["q"], got["k"], got["v"], kv_pool=got["kv_pool"], backend="triton", lora=group, **common)
        return got

    want = run(lora)
    with launched(lora) as beside:
        pass
    got = run(beside)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", CASES)
def test_expand_beside_added_by_the_norm_gives_the_same_bits(device, dtype, rows):
    """o's expand beside its GEMM (``expand_beside``: the rows' fp32 delta) added by the residual
    add + RMSNorm (``add_rms_norm(lora=)``) = the additive expand into o, then the norm: the same
    residual stream and normed rows, bit for bit; rows before the LoRA rows untouched."""
    from lightning_lorafusion.kernels.rms_norm import add_rms_norm

    n, first = 40, 2
    lora = _group(24, (n,), ROWS[rows], dtype, device)
    b = len(ROWS[rows])
    g = torch.Generator().manual_seed(9)
    o = torch.randn(first + b, n, generator=g).to(device, dtype)
    h = torch.randn(first + b, n, generator=g).to(device, dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(device, dtype)

    want_o, want_h = o.clone(), h.clone()
    lora_gather(lora.x, lora.pool, lora.a_offsets[0], lora.b_offsets[0], lora.ranks[0], lora.scales, n,
                out=want_o[first:], backend="triton")
    want_x = add_rms_norm(want_h, want_o, w, 1e-5, backend="triton")

    if device.type == "cuda":  # the expand after the shrink on the second stream, a GEMM meanwhile
        side = torch.cuda.Stream(device)
        with shrink_beside(lora, side) as beside:
            delta = lg.expand_beside(beside, n, side)
            lora.x @ torch.randn(2048, lora.x.shape[1], device=device, dtype=dtype).t()
    else:
        delta = lg.expand_beside(dataclasses.replace(lora, partials=lora_shrink(lora)), n, None)
    got_h = h.clone()
    got_x = add_rms_norm(got_h, o, w, 1e-5, backend="triton", lora=(delta, first))
    assert torch.equal(got_h, want_h) and torch.equal(got_x, want_x)
    ref_h = h.clone()
    ref_x = add_rms_norm(ref_h, o, w, 1e-5, backend="torch", lora=(delta, first))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(ref_h.float(), got_h.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(ref_x.float(), got_x.float(), rtol=tol, atol=tol)


def _grouped(k, widths, dtype, device, first_row=0):
    """Sixteen rows over three adapters with their groups (``adapter_groups``), for a launch that
    takes the grouped shrink once ``GROUPED_MIN_ROWS`` is 16."""
    rows = ROWS["sixteen_shared"]
    lora = _group(k, widths, rows, dtype, device, first_row=first_row)
    groups = lg.adapter_groups([a + 1 for a in rows], len(rows), group_rows=4).to(device)
    return dataclasses.replace(lora, groups=groups)


def test_wide_beside_takes_any_rows_and_the_grouped_shrink(monkeypatch):
    """``wide`` (``EngineTuning.decode_lora_beside`` "wide"): beside whatever the rows and with
    the grouped shrink; without it, only up to ``BESIDE_MAX_ROWS`` rows of per-row shrink."""
    monkeypatch.setattr(lg, "GROUPED_MIN_ROWS", 16)
    cpu = _grouped(40, (24,), torch.float32, torch.device("cpu"))
    assert not lg.beside_applies(cpu, object(), wide=True)  # CPU tensors
    assert not lg.beside_applies(cpu, None, wide=True)
    if torch.cuda.is_available():
        cuda = _grouped(40, (24,), torch.float32, torch.device("cuda"))
        stream = torch.cuda.Stream()
        assert not lg.beside_applies(cuda, stream)  # the grouped shrink: not beside unless wide
        assert lg.beside_applies(cuda, stream, wide=True)
        monkeypatch.setattr(lg, "BESIDE_GROUPED", True)
        assert lg.beside_applies(cuda, stream)
        monkeypatch.setattr(lg, "BESIDE_MAX_ROWS", 8)
        assert not lg.beside_applies(cuda, stream) and lg.beside_applies(cuda, stream, wide=True)
        monkeypatch.setattr(lg, "BESIDE_MAX_ROWS", None)
        assert lg.beside_applies(cuda, stream, wide=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_wide_beside_grouped_shrink_gives_the_same_bits(device, dtype, monkeypatch):
    """The grouped shrink launched beside (wide) and read by the gather's expand and by SwiGLU's
    LoRA rows: the same bits as each launching its own grouped shrink."""
    monkeypatch.setattr(lg, "GROUPED_MIN_ROWS", 16)
    monkeypatch.setattr(lg, "BESIDE_MAX_ROWS", 8)  # (16 rows: beside only because wide)
    n = 72
    lora = _grouped(40, (n,), dtype, device)
    y = torch.randn(16, n, generator=torch.Generator().manual_seed(6)).to(device, dtype)
    args = (lora.x, lora.pool, lora.a_offsets[0], lora.b_offsets[0], lora.ranks[0], lora.scales, n)
    want = y.clone()
    lora_gather(*args, out=want, backend="triton", groups=lora.groups)
    with launched(lora, wide=True) as beside:
        pass
    got = y.clone()
    lora_gather(*args, out=got, backend="triton", groups=lora.groups, partials=beside.partials)
    assert torch.equal(got, want)
    ref = y.clone()
    lora_gather(*args, out=ref, backend="torch")
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    pair = _grouped(40, (n, n), dtype, device, first_row=1)
    gu = torch.randn(18, 2 * n, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    want = swiglu(gu[:, :n], gu[:, n:], lora=pair, backend="triton")
    with launched(pair, wide=True) as beside:
        pass
    assert torch.equal(swiglu(gu[:, :n], gu[:, n:], lora=beside, backend="triton"), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused", [True, False])
def test_hybrid_expand_beside_gives_the_per_row_delta(device, dtype, fused, monkeypatch):
    """o's expand beside with the hybrid expands (``HYBRID_MIN_ROWS``: groups of four and two rows
    by one dot each, in the per-row launch or a grouped launch after it on the same stream; rows
    alone in their group: per row): the per-row delta within rounding, a lone row's bits (a few
    ulp compiled: ``assert_per_row_bits``)."""
    n = 72
    lora = _grouped(40, (n,), dtype, device)
    keys = [a + 1 for a in ROWS["sixteen_shared"]]
    keys[5] = 9  # a row alone on its adapter (its tables unchanged: only the grouping moves)
    lora = dataclasses.replace(lora, groups=lg.adapter_groups(keys, 16, group_rows=4).to(device))
    assert set(lora.groups[3].tolist()) == {1, 2, 4}

    def delta():
        if device.type == "cuda":
            side = torch.cuda.Stream(device)
            with shrink_beside(lora, side, wide=True) as beside:
                d = lg.expand_beside(beside, n, side)
                lora.x @ torch.randn(2048, lora.x.shape[1], device=device, dtype=dtype).t()
            return d
        return lg.expand_beside(dataclasses.replace(lora, partials=lora_shrink(lora)), n, None)

    per_row = delta()
    monkeypatch.setattr(lg, "HYBRID_MIN_ROWS", 16)
    monkeypatch.setattr(lg, "HYBRID_FUSED", fused)
    got = delta()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, per_row, rtol=tol, atol=tol * float(per_row.abs().max()))
    assert_per_row_bits(got[5], per_row[5])
