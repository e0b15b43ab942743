"""Paged prefill attention: reference and Triton kernel vs causal SDPA over the unpaged K/V.

The Triton kernel runs in the interpreter on CPU (fp32 / fp16; bf16 is checked on the GPU by
``test_bf16_on_gpu`` and scripts/bench_generation.py --prefill-attention). Tolerances on ||got - want|| /
||want||: fp32 1e-5 (IEEE dots; only the order of the online softmax's sums differs from
SDPA's, errors near 1e-7); fp16 1e-3 (the kernel rounds the probabilities to fp16 before the
P V product, unit roundoff 4.9e-4, and the output once more; the reference here runs in fp32
on the same fp16 inputs; seen ~3e-4); bf16 on the GPU 2e-2 (unit roundoff 3.9e-3, the same two
roundings).
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_lorafusion.kernels.paged_prefill import (
    _paged_prefill_attention_triton,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)
from lightning_lorafusion.model.attention import sdpa_varlen_loop

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2}


def rel_err(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def make_problem(requests, page, hq, hkv, d, dtype, device, layers=2, layer=1, seed=0):
    """requests: (cached prefix length, new tokens) per request. Whole sequences' q/k/v are
    drawn; k/v of every position go into the pool (pages in random order, unused table entries
    -1, other layers noise). -> (q of the new tokens [T, Hq, D], pool, cu_seqlens, starts,
    page_table, the full sequences' (q, k, v) list)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(s + n) // page) for s, n in requests]
    num_pages = sum(need) + 3
    pool = torch.randn(num_pages, layers, 2, page, hkv, d, generator=g)
    perm = torch.randperm(num_pages, generator=g).tolist()
    table = torch.full((len(requests), max(need) + 1), -1, dtype=torch.int32)
    seqs, new_q, cu = [], [], [0]
    for i, (start, n) in enumerate(requests):
        pages = perm[sum(need[:i]):sum(need[:i + 1])]
        table[i, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        total = start + n
        q, k, v = (torch.randn(total, h, d, generator=g) for h in (hq, hkv, hkv))
        for pos in range(total):
            pool[pages[pos // page], layer, 0, pos % page] = k[pos]
            pool[pages[pos // page], layer, 1, pos % page] = v[pos]
        seqs.append((q, k, v))
        new_q.append(q[start:])
        cu.append(cu[-1] + n)
    q = torch.cat(new_q).to(device, dtype)
    return (q, pool.to(device, dtype), torch.tensor(cu, dtype=torch.int32, device=device),
            torch.tensor([s for s, _ in requests], dtype=torch.int32, device=device), table.to(device), seqs)


def sdpa_on_unpaged(requests, seqs, scale, window, dtype):
    """Causal SDPA over each whole sequence (in ``dtype``-rounded fp32), the new tokens' rows."""
    outs = []
    for (start, n), (q, k, v) in zip(requests, seqs):
        q, k, v = (t.to(dtype).float() for t in (q, k, v))
        full = sdpa_varlen_loop(q, k, v, torch.tensor([0, start + n]), scale=scale, sliding_window=window)
        outs.append(full[start:])
    return torch.cat(outs)


# name: (requests [(prefix, new)], page, Hq, Hkv, head dim, sliding window, launcher knobs)
CASES = {
    # Llama-like GQA 4: no prefix, a prefix not page-aligned, several pages, a 1-token prefill
    "llama_gqa4": ([(0, 13), (5, 9), (23, 30), (16, 1)], 4, 8, 2, 32, None, {}),
    # Qwen2-like GQA 7 (tiles hold 4 tokens of 7 heads, 4 rows unused), odd head dim
    "qwen2_gqa7": ([(7, 11), (0, 5), (12, 20)], 4, 14, 2, 24, None, {}),
    # Mistral-like sliding window shorter than the sequences, longer than some
    "mistral_window": ([(0, 13), (5, 9), (23, 30), (3, 2)], 4, 8, 2, 32, 11, {}),
    # MHA, page 16, key blocks of 32 spanning two pages, one-token-per-head tiles
    "mha_page16": ([(17, 40), (0, 33), (48, 3)], 16, 3, 3, 16, None, {"block_m": 16, "block_n": 32}),
    # a grid bound larger than any request (empty tiles exit), window wider than every sequence
    "gqa2_loose_grid_wide_window": ([(9, 6), (2, 12)], 5, 4, 2, 16, 100, {"max_seqlen": 40}),
}


@pytest.mark.parametrize("window", [None, 6])
def test_reference_matches_causal_sdpa_on_unpaged_kv(window):
    requests = [(0, 7), (5, 4), (9, 1), (12, 9)]
    q, pool, cu, starts, table, seqs = make_problem(requests, 4, 8, 2, 16, torch.float32, "cpu")
    got = paged_prefill_attention_reference(q, pool, 1, cu, starts, table, scale=0.3, sliding_window=window)
    want = sdpa_on_unpaged(requests, seqs, 0.3, window, torch.float32)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_matches_reference_and_sdpa(device, dtype, case):
    requests, page, hq, hkv, d, window, knobs = CASES[case]
    q, pool, cu, starts, table, seqs = make_problem(requests, page, hq, hkv, d, dtype, device)
    scale = 1 / math.sqrt(d)
    got = _paged_prefill_attention_triton(q, pool, 1, cu, starts, table, scale, window, **knobs)
    assert got.dtype == dtype and got.shape == q.shape
    want = paged_prefill_attention_reference(q.float(), pool.float(), 1, cu, starts, table, scale=scale,
                                             sliding_window=window)
    assert rel_err(got, want) < TOL[dtype], f"{case}: vs reference {rel_err(got, want):.2e}"
    sdpa = sdpa_on_unpaged(requests, seqs, scale, window, dtype)
    assert rel_err(got.cpu(), sdpa) < TOL[dtype], f"{case}: vs SDPA {rel_err(got.cpu(), sdpa):.2e}"


def test_public_triton_backend_strided_q_and_empty_request(device):
    """q as a head slice of a fused qkv activation (row stride != Hq * D); a request with no
    new tokens in the middle of the batch."""
    requests = [(6, 5), (4, 0), (0, 7)]
    q, pool, cu, starts, table, _ = make_problem(requests, 4, 4, 2, 16, torch.float32, device)
    qkv = torch.randn(q.shape[0], 4 + 2 * 2, 16, device=device)
    qkv[:, :4] = q
    strided = qkv[:, :4]
    want = paged_prefill_attention_reference(q, pool, 1, cu, starts, table, scale=0.25)
    got = paged_prefill_attention(strided, pool, 1, cu, starts, table, scale=0.25, backend="triton")
    assert rel_err(got, want) < TOL[torch.float32]
    empty = paged_prefill_attention(q[:0], pool, 1, cu[:1] * 0, starts[:0], table[:0], scale=0.25, backend="triton")
    assert empty.shape == (0, 4, 16)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_output_written_into_the_rows_of_a_buffer(device, backend):
    """``out``: rows of a larger buffer get what the launch would have returned, bit for bit,
    and nothing else is written."""
    requests = [(6, 5), (4, 0)]
    q, pool, cu, starts, table, _ = make_problem(requests, 4, 4, 2, 16, torch.float32, device)
    want = paged_prefill_attention(q, pool, 1, cu, starts, table, scale=0.25, backend=backend)
    buf = torch.full((q.shape[0] + 3, 4, 16), 3.0, device=device)
    got = paged_prefill_attention(q, pool, 1, cu, starts, table, scale=0.25, backend=backend, out=buf[1:-2])
    assert got.data_ptr() == buf[1].data_ptr() and torch.equal(buf[1:-2], want)
    assert (buf[0] == 3.0).all() and (buf[-2:] == 3.0).all()


def test_bad_inputs_raise_clear_errors(device):
    q, pool, cu, starts, table, _ = make_problem([(3, 4), (0, 2)], 4, 4, 2, 8, torch.float32, device)
    with pytest.raises(ValueError, match="not a multiple of the pool's 2 kv heads"):
        paged_prefill_attention(q[:, :3], pool, 0, cu, starts, table, scale=1.0, backend="triton")
    with pytest.raises(ValueError, match="starts must be a \\[2\\] int32 tensor"):
        paged_prefill_attention(q, pool, 0, cu, starts.long(), table, scale=1.0)
    with pytest.raises(ValueError, match="cu_seqlens must be a \\[requests \\+ 1\\] int32"):
        paged_prefill_attention(q, pool, 0, cu.float(), starts, table, scale=1.0)
    with pytest.raises(ValueError, match="page_table must be a \\[2, max_pages >= 1\\] int32"):
        paged_prefill_attention(q, pool, 0, cu, starts, table[:1], scale=1.0)
    with pytest.raises(TypeError, match="q is torch.float16"):
        paged_prefill_attention(q.half(), pool, 0, cu, starts, table, scale=1.0)
    with pytest.raises(ValueError, match="sliding_window must be None or a positive int"):
        paged_prefill_attention(q, pool, 0, cu, starts, table, scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="request 0 needs 4 pages but page_table has 3 columns"):
        paged_prefill_attention_reference(q, pool, 0, cu, starts + 6, table, scale=1.0)
    with pytest.raises(ValueError, match="backend='cuda'"):
        paged_prefill_attention(q, pool, 0, cu, starts, table, scale=1.0, backend="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernel check needs a GPU")
def test_bf16_on_gpu():
    """bf16 at Llama-8B heads (Hq 32, Hkv 8, D 128, page 16) and Qwen2 (GQA 7), with and
    without a window: the kernel against the reference computed in fp32 on the same inputs."""
    requests = [(0, 200), (300, 64), (17, 129), (448, 1), (96, 256)]
    for hq, hkv, d, window in ((32, 8, 128, None), (32, 8, 128, 100), (28, 4, 128, None), (32, 8, 64, None)):
        q, pool, cu, starts, table, _ = make_problem(requests, 16, hq, hkv, d, torch.bfloat16, "cuda")
        got = paged_prefill_attention(q, pool, 1, cu, starts, table, scale=d**-0.5, sliding_window=window)
        want = paged_prefill_attention_reference(q.float(), pool.float(), 1, cu, starts, table, scale=d**-0.5,
                                                 sliding_window=window)
        assert rel_err(got, want) < TOL[torch.bfloat16], (hq, hkv, d, window, rel_err(got, want))


def widened(table: torch.Tensor, width: int) -> torch.Tensor:
    """The page table with ``width`` columns (extra entries -1, never read)."""
    out = torch.full((table.shape[0], width), -1, dtype=table.dtype, device=table.device)
    out[:, :min(width, table.shape[1])] = table[:, :width]
    return out


def test_page_table_width_is_not_a_compile_key():
    """The table's row stride (its width: the step's longest request in pages) only indexes the
    table, so it is left unspecialised; the names must be the kernel's own arguments."""
    from lightning_lorafusion.kernels import paged_prefill

    assert "pt_stride" in paged_prefill.PREFILL_UNSPECIALISED
    assert set(paged_prefill.PREFILL_UNSPECIALISED) <= set(paged_prefill._paged_prefill_kernel.arg_names)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's compile records need a GPU")
def test_no_page_table_width_compiles_a_variant_of_its_own():
    from lightning_lorafusion.serving.compile_ahead import distinct, record_launches

    q, pool, cu, starts, table, _ = make_problem([(3, 5), (0, 9)], 16, 8, 2, 64, torch.bfloat16, "cuda")
    found = []
    for width in (2, 1, 16, 17, 32):  # 1 and multiples of 16 are what Triton would specialise on
        with record_launches() as launched:
            paged_prefill_attention(q, pool, 1, cu, starts, widened(table, max(width, 1)), scale=0.125,
                                    max_seqlen=9)
        found += launched
    assert len(distinct(found)) <= 1, [v.data[:200] for v in distinct(found)]
