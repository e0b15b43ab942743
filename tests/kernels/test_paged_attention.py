"""Paged decode attention: reference vs plain per-row math, Triton vs reference, write_kv.

The Triton kernel runs in the interpreter on CPU (fp32 / fp16; bf16 is checked on the GPU by
scripts/bench_generation.py --step-batch). Tolerances on ||got - want|| / ||want||:
reference vs float64 per-row math: 1e-5 (fp32 softmax over <= 70 tokens, errors near 1e-7);
Triton vs reference, fp32 (IEEE dots): 1e-5 (only the order of the online softmax differs);
fp16: 1e-3 (probabilities are rounded to fp16 before the P V product, unit roundoff 4.9e-4,
and the output once more; the reference keeps them in fp32; seen: ~2e-4).
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_lorafusion.kernels.paged_attention import (
    MAX_SPLITS,
    _paged_decode_attention_triton,
    balanced_items,
    paged_decode_attention,
    paged_decode_attention_reference,
    write_kv,
)

TOL = {torch.float32: 1e-5, torch.float16: 1e-3}


def rel_err(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def make_problem(lens, page, hq, hkv, d, dtype, device, layers=2, seed=0):
    """A pool with every row's pages scattered in random order, unused page-table entries -1."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in lens]
    max_pages = max(need) + 1
    num_pages = sum(need) + 3
    pool = torch.randn(num_pages, layers, 2, page, hkv, d, generator=g).to(device, dtype)
    perm = torch.randperm(num_pages, generator=g).tolist()
    table = torch.full((len(lens), max_pages), -1, dtype=torch.int32)
    pos = 0
    for b, p in enumerate(need):
        table[b, :p] = torch.tensor(perm[pos : pos + p], dtype=torch.int32)
        pos += p
    q = torch.randn(len(lens), hq, d, generator=g).to(device, dtype)
    return q, pool, table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def naive_attention(q, pool, layer, table, lens, scale, window):
    """Token by token through the page table, one head at a time, float64."""
    b, hq, d = q.shape
    page, hkv = pool.shape[3], pool.shape[4]
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        first = 0 if window is None else max(0, n - window)
        toks = [(int(table[i, t // page]), t % page) for t in range(first, n)]
        for h in range(hq):
            kvh = h // (hq // hkv)
            k = torch.stack([pool[p, layer, 0, s, kvh] for p, s in toks]).double()
            v = torch.stack([pool[p, layer, 1, s, kvh] for p, s in toks]).double()
            w = torch.softmax(k @ q[i, h].double() * scale, dim=0)
            out[i, h] = w @ v
    return out


@pytest.mark.parametrize("window", [None, 7])
def test_reference_matches_naive_per_row_math(window):
    lens = [1, 5, 6, 10, 37]  # one token, exactly one page, one past it, two pages, long
    q, pool, table, seq_lens = make_problem(lens, 5, 8, 2, 16, torch.float32, "cpu")
    got = paged_decode_attention_reference(q, pool, 1, table, seq_lens, scale=0.3, sliding_window=window)
    want = naive_attention(q, pool, 1, table, seq_lens, 0.3, window)
    assert got.dtype == torch.float32 and got.shape == q.shape
    assert rel_err(got, want) < 1e-5


def test_write_kv_scatters_into_the_named_slots_only():
    pool = torch.zeros(6, 3, 2, 4, 2, 8)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    pages = torch.tensor([4, 4, 1, 1, 1], dtype=torch.int32)
    offsets = torch.tensor([2, 3, 0, 1, 2])
    write_kv(pool, 1, k, v, pages, offsets)
    for t in range(5):
        assert torch.equal(pool[pages[t], 1, 0, offsets[t]], k[t])
        assert torch.equal(pool[pages[t], 1, 1, offsets[t]], v[t])
    assert int((pool != 0).sum()) == 2 * k.numel()  # nothing else touched (other layers included)
    with pytest.raises(ValueError, match="k must be \\[tokens, 2, 8\\]"):
        write_kv(pool, 1, k[:, :1], v, pages, offsets)
    with pytest.raises(ValueError, match="layer=3"):
        write_kv(pool, 3, k, v, pages, offsets)


def test_written_tokens_attend_like_sdpa():
    """write_kv then the reference equals SDPA over the same tokens (decode of the last one)."""
    hq, hkv, d, page, n = 4, 2, 8, 4, 10
    pool = torch.zeros(5, 1, 2, page, hkv, d)
    k, v, q = torch.randn(n, hkv, d), torch.randn(n, hkv, d), torch.randn(1, hq, d)
    table = torch.tensor([[3, 0, 4]], dtype=torch.int32)
    write_kv(pool, 0, k, v, table[0, torch.arange(n) // page], torch.arange(n) % page)
    got = paged_decode_attention(q, pool, 0, table, torch.tensor([n], dtype=torch.int32), scale=d**-0.5)
    kk = k.transpose(0, 1).repeat_interleave(hq // hkv, 0)
    vv = v.transpose(0, 1).repeat_interleave(hq // hkv, 0)
    want = torch.nn.functional.scaled_dot_product_attention(q.view(hq, 1, d), kk, vv).view(1, hq, d)
    assert rel_err(got, want) < 1e-5


CASES = {
    # name: (seq_lens, page size, Hq, Hkv, head dim, sliding window, splits (None = launcher's))
    "gqa4_page5": ([1, 5, 6, 37], 5, 8, 2, 24, None, None),
    "gqa4_page5_window": ([1, 5, 6, 37], 5, 8, 2, 24, 7, 3),
    "mha_page16_one_split": ([16, 17, 3, 70], 16, 3, 3, 16, None, 1),
    "B37_window_past_len": ([1 + (i * 11) % 40 for i in range(37)], 16, 4, 1, 16, 20, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_matches_reference(device, dtype, case):
    """The per-row splits (``splits`` given, or the "per-row" mode)."""
    lens, page, hq, hkv, d, window, splits = CASES[case]
    q, pool, table, seq_lens = make_problem(lens, page, hq, hkv, d, dtype, device)
    scale = 1 / math.sqrt(d)
    want = paged_decode_attention_reference(q, pool, 1, table, seq_lens, scale=scale, sliding_window=window)
    got = _paged_decode_attention_triton(q, pool, 1, table, seq_lens, scale, window, splits=splits, mode="per-row")
    assert got.dtype == dtype and got.shape == q.shape
    assert rel_err(got, want) < TOL[dtype], f"{case}: {rel_err(got, want):.2e}"


BALANCED_CASES = {
    # name: (seq_lens, page size, Hq, Hkv, head dim, sliding window, target, shortest item)
    # ragged rows, one-token rows, lengths off the page; long rows cut into several items
    "gqa4_ragged": ([1, 5, 6, 37, 70, 2], 5, 8, 2, 24, None, 4, 16),
    "gqa8_one_token_rows": ([1, 1, 90, 17, 1], 16, 8, 1, 16, None, 3, 16),
    "mha_window": ([16, 17, 3, 70, 41], 16, 3, 3, 16, 30, 8, 16),
    "gqa4_one_item_each": ([9, 33, 20], 4, 4, 1, 16, None, 64, 64),  # every row one item: no combine
}


@pytest.mark.parametrize("mode", ["balanced", "stream"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", sorted(BALANCED_CASES))
def test_balanced_items_match_reference(device, dtype, case, mode):
    """Work items of a token count from the step's total: rows of one item write their output,
    rows of several are merged by the combine; GQA 1 / 4 / 8, windows, 1-token rows. The
    streamed mode over the same rows: ``target`` programs, each a range of the rows' tokens
    laid end to end (several rows, or a piece of one)."""
    lens, page, hq, hkv, d, window, target, min_chunk = BALANCED_CASES[case]
    chunk, items = balanced_items(lens, target=target, min_chunk=min_chunk, block_t=16, sliding_window=window)
    assert (max(items) > 1) == (case != "gqa4_one_item_each"), (chunk, items)  # the case covers what it names
    q, pool, table, seq_lens = make_problem(lens, page, hq, hkv, d, dtype, device)
    scale = 1 / math.sqrt(d)
    want = paged_decode_attention_reference(q, pool, 1, table, seq_lens, scale=scale, sliding_window=window)
    got = _paged_decode_attention_triton(q, pool, 1, table, seq_lens, scale, window, mode=mode,
                                         target=target, min_chunk=min_chunk, block_t=16)
    assert got.dtype == dtype and got.shape == q.shape
    assert rel_err(got, want) < TOL[dtype], f"{case}: {rel_err(got, want):.2e}"


def test_balanced_items_soft_cap(device):
    """Gemma 2's score cap through the balanced kernel, rows of several items (fp32)."""
    lens = [3, 50, 21]
    q, pool, table, seq_lens = make_problem(lens, 4, 8, 2, 16, torch.float32, device)
    q = q * 3  # scores well past the cap
    want = paged_decode_attention_reference(q, pool, 1, table, seq_lens, scale=0.25, softcap=1.5)
    got = _paged_decode_attention_triton(q, pool, 1, table, seq_lens, 0.25, None, softcap=1.5, mode="balanced",
                                         target=3, min_chunk=16, block_t=16)
    assert max(balanced_items(lens, target=3, min_chunk=16, block_t=16)[1]) > 1
    assert rel_err(got, want) < TOL[torch.float32]


def test_auto_mode_takes_balanced_items_within_its_rows(device):
    """"auto": the balanced items for launches of BALANCED_ROWS rows, the per-row splits
    otherwise (both equal the reference); an unknown mode is refused."""
    from lightning_lorafusion.kernels import paged_attention as pa

    lo, hi = pa.BALANCED_ROWS
    assert [pa.decode_split_mode(r, "auto") for r in (lo - 1, lo, hi, hi + 1)] == [
        "per-row", "balanced", "balanced", "per-row"]
    assert pa.decode_split_mode(1, "stream") == "stream"
    with pytest.raises(ValueError, match="mode='fast'"):
        pa.decode_split_mode(4, "fast")
    lens = [1 + (i * 7) % 23 for i in range(lo)]
    q, pool, table, seq_lens = make_problem(lens, 4, 4, 2, 16, torch.float32, device)
    want = paged_decode_attention_reference(q, pool, 1, table, seq_lens, scale=0.25)
    got = _paged_decode_attention_triton(q, pool, 1, table, seq_lens, 0.25, None, mode="auto")
    assert rel_err(got, want) < TOL[torch.float32]


def test_balanced_items_fit_the_grid():
    """The grid holds target + rows items whatever the lengths, and no row exceeds MAX_SPLITS."""
    g = torch.Generator().manual_seed(1)
    for trial in range(200):
        rows = int(torch.randint(1, 300, (1,), generator=g))
        lens = torch.randint(1, 40000 if trial % 2 else 300, (rows,), generator=g).tolist()
        target = int(torch.randint(1, 600, (1,), generator=g))
        window = None if trial % 3 else 4096
        chunk, items = balanced_items(lens, target=target, min_chunk=128, block_t=64, sliding_window=window)
        assert chunk % 64 == 0 and chunk >= 128
        assert sum(items) <= target + rows and max(items) <= MAX_SPLITS and min(items) >= 1


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_stale_slots_past_the_end_never_reach_the_output(device, backend):
    """Slots of a row's last page past its length hold a freed page's old values: NaN and inf
    there change nothing (both paths)."""
    lens, page, hq, hkv, d = [9, 2, 5], 4, 4, 2, 16
    q, pool, table, seq_lens = make_problem(lens, page, hq, hkv, d, torch.float32, device)
    want = paged_decode_attention_reference(q, pool, 1, table, seq_lens, scale=0.25)
    dirty = pool.clone()
    for b, n in enumerate(lens):  # 9, 2 and 5 all leave free slots in their last page
        last, used = int(table[b, (n - 1) // page]), n % page
        dirty[last, :, :, used:] = float("nan")  # K and V past the end
        dirty[last, :, 0, page - 1] = float("inf")  # a K past the end (used < page - 1 for all three)
    got = paged_decode_attention(q, dirty, 1, table, seq_lens, scale=0.25, backend=backend)
    assert torch.isfinite(got).all() and rel_err(got, want) < TOL[torch.float32]


def test_public_triton_backend_and_strided_q(device):
    """q as a head slice of a fused qkv activation (row stride != Hq * D)."""
    lens, page, hq, hkv, d = [9, 2], 4, 4, 2, 16
    _, pool, table, seq_lens = make_problem(lens, page, hq, hkv, d, torch.float32, device)
    qkv = torch.randn(2, hq + 2 * hkv, d, device=device)
    q = qkv[:, :hq]
    want = paged_decode_attention_reference(q.contiguous(), pool, 0, table, seq_lens, scale=0.25)
    got = paged_decode_attention(q, pool, 0, table, seq_lens, scale=0.25, backend="triton")
    assert rel_err(got, want) < TOL[torch.float32]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_output_written_into_the_rows_of_a_buffer(device, backend):
    """``out``: the rows of a larger buffer (a mixed step's attention output) get what the
    launch would have returned, bit for bit, and nothing else is written; a buffer of another
    shape or not contiguous is refused."""
    lens, page, hq, hkv, d = [9, 2, 5], 4, 4, 2, 16
    q, pool, table, seq_lens = make_problem(lens, page, hq, hkv, d, torch.float32, device)
    want = paged_decode_attention(q, pool, 1, table, seq_lens, scale=0.25, backend=backend)
    buf = torch.full((7, hq, d), 3.0, device=device)
    got = paged_decode_attention(q, pool, 1, table, seq_lens, scale=0.25, backend=backend, out=buf[2:5])
    assert got.data_ptr() == buf[2].data_ptr() and torch.equal(buf[2:5], want)
    assert (buf[:2] == 3.0).all() and (buf[5:] == 3.0).all()
    with pytest.raises(ValueError, match="out must be a contiguous"):
        paged_decode_attention(q, pool, 1, table, seq_lens, scale=0.25, backend=backend,
                               out=torch.empty(3, d, hq, device=device).transpose(1, 2))


def test_bad_inputs_raise_clear_errors(device):
    q, pool, table, seq_lens = make_problem([3, 4], 4, 4, 2, 8, torch.float32, device)
    with pytest.raises(ValueError, match="not a multiple of the pool's 2 kv heads"):
        paged_decode_attention(q[:, :3], pool, 0, table, seq_lens, scale=1.0, backend="triton")
    with pytest.raises(ValueError, match="page_table must be a \\[2, max_pages >= 1\\] int32"):
        paged_decode_attention(q, pool, 0, table.long(), seq_lens, scale=1.0)
    with pytest.raises(ValueError, match="sliding_window must be None or a positive int"):
        paged_decode_attention(q, pool, 0, table, seq_lens, scale=1.0, sliding_window=0)
    with pytest.raises(TypeError, match="q is torch.float16"):
        paged_decode_attention(q.half(), pool, 0, table, seq_lens, scale=1.0)
    with pytest.raises(ValueError, match="seq_lens need 3 pages but page_table has 2 columns"):
        paged_decode_attention_reference(q, pool, 0, table, seq_lens + 5, scale=1.0)


def test_per_step_integers_are_not_compile_keys():
    from lightning_lorafusion.kernels import paged_attention as pa

    assert "pt_stride" in pa.DECODE_UNSPECIALISED and "splits" in pa.COMBINE_UNSPECIALISED
    assert {"pt_stride", "rows", "target"} <= set(pa.BALANCED_UNSPECIALISED)
    assert set(pa.DECODE_UNSPECIALISED) <= set(pa._paged_decode_kernel.arg_names)
    assert set(pa.BALANCED_UNSPECIALISED) <= set(pa._paged_decode_balanced_kernel.arg_names)
    assert set(pa.BALANCED_UNSPECIALISED) <= set(pa._paged_decode_stream_kernel.arg_names)
    assert set(pa.COMBINE_UNSPECIALISED) <= set(pa._combine_splits_kernel.arg_names)
    with pytest.raises(ValueError, match="splits"):
        dev = "cuda" if torch.cuda.is_available() else "cpu"  # (CPU tensors need the interpreter)
        q, pool, table, lens = make_problem([5, 12], 4, 4, 2, 16, torch.float32, dev)
        pa._paged_decode_attention_triton(q, pool, 1, table, lens, 0.25, None, splits=pa.MAX_SPLITS + 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's compile records need a GPU")
def test_no_page_table_width_compiles_a_decode_variant_of_its_own():
    from lightning_lorafusion.serving.compile_ahead import distinct, record_launches

    q, pool, table, lens = make_problem([5, 12, 3], 16, 8, 2, 64, torch.bfloat16, "cuda")
    found = []
    for width in (2, 1, 16, 17, 32):
        wide = torch.full((table.shape[0], width), -1, dtype=table.dtype, device="cuda")
        wide[:, :min(width, table.shape[1])] = table[:, :width]
        with record_launches() as launched:
            _paged_decode_attention_triton(q, pool, 1, wide, lens, 0.125, None, mode="balanced")
        found += launched
    names = [v.name.rsplit(":", 1)[1] for v in distinct(found)]
    # balanced items: the width selects nothing
    assert names.count("_paged_decode_balanced_kernel") == 1, [v.data[:300] for v in distinct(found)]
    assert names.count("_combine_items_kernel") == 1, [v.data[:300] for v in distinct(found)]
    found = []
    for width in (2, 1, 16, 17, 32):
        wide = torch.full((table.shape[0], width), -1, dtype=table.dtype, device="cuda")
        wide[:, :min(width, table.shape[1])] = table[:, :width]
        with record_launches() as launched:
            _paged_decode_attention_triton(q, pool, 1, wide, lens, 0.125, None, mode="per-row")
        found += launched
    names = [v.name.rsplit(":", 1)[1] for v in distinct(found)]
    # per-row splits: the split count follows the width; only whether there are splits selects a variant
    assert names.count("_combine_splits_kernel") <= 1, [v.data[:300] for v in distinct(found)]
    assert names.count("_paged_decode_kernel") <= 2, [v.data[:300] for v in distinct(found)]
