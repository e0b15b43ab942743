"""Fused Triton LoRA (single and multi adapter) against the float64 torch reference.

Runs in the Triton interpreter on CPU (fp32 / fp16; the interpreter's bf16 is wrong, bf16 is
checked on the GPU by scripts/bench_kernels.py). Tolerances on ||got - ref|| / ||ref||:
fp32 with IEEE dots: 1e-5 (float32 rounding over K <= 123 terms lands near 1e-7);
fp16: 3e-3 (inputs, S and outputs are rounded to fp16, unit roundoff 4.9e-4, plus the
fp16 rounding of the saved S and dS feeding later products).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_lorafusion.kernels.api import lora_projections
from lightning_lorafusion.kernels.dropout_triton import offset_hash
from lightning_lorafusion.kernels.block_sizes import INTERPRETER_BLOCK_SIZES, LoraBlockSizes
from lightning_lorafusion.kernels.fused_lora import fused_lora_projections
from lightning_lorafusion.kernels.reference import (
    LoraModuleWeights,
    LoraRouting,
    lora_projections_reference,
)

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
SMALL = INTERPRETER_BLOCK_SIZES  # block_m=32: several row blocks even at M=47


def make_problem(m, k, ns, ranks, dtype, device, bias=True, seed=0):
    """x [m, k]; per projection i: W [ns[i], k], bias, LoRA factors of ranks[i][a] (0: none)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    x = rnd(m, k).requires_grad_(True)
    ws = [rnd(n, k, scale=k**-0.5) for n in ns]
    bs = [rnd(n) if bias and i % 2 == 0 else None for i, n in enumerate(ns)]
    loras = []
    for n, rs in zip(ns, ranks):
        if all(r == 0 for r in rs):
            loras.append(None)
            continue
        a = tuple(rnd(r, k, scale=k**-0.5).requires_grad_(True) if r else None for r in rs)
        b = tuple(rnd(n, r, scale=r**-0.5).requires_grad_(True) if r else None for r in rs)
        loras.append(LoraModuleWeights(a, b))
    return x, ws, bs, loras


def leaves(x, loras):
    return [x] + [t for l in loras if l is not None for t in l.a + l.b if t is not None]


def rel_err(got, want):
    return float((got.detach().double() - want.detach()).norm() / want.norm().clamp_min(1e-30))


def check_against_reference(x, ws, bs, loras, routing, offset, dtype, sizes=SMALL):
    ys = fused_lora_projections(x, ws, bs, loras, routing, dropout_offset=offset, block_sizes=sizes)
    assert [tuple(y.shape) for y in ys] == [(x.shape[0], w.shape[0]) for w in ws]
    assert all(y.dtype == dtype for y in ys)
    # output gradients from their own generator: the draw does not depend on which tests ran
    # before (a 1-row rank-1 adapter's dA is dS x for one dS summed over N, whose cancellation
    # some draws of the shared generator pushed past the fp32 tolerance: 1.9e-5 in CI)
    gen = torch.Generator().manual_seed(1234)
    gys = [torch.randn(y.shape, generator=gen).to(y.device, y.dtype) for y in ys]
    params = leaves(x, loras)
    grads = torch.autograd.grad(ys, params, gys)

    def up(t):
        return None if t is None else t.detach().double().requires_grad_(True)

    x64 = up(x)
    l64 = [None if l is None else LoraModuleWeights(tuple(map(up, l.a)), tuple(map(up, l.b))) for l in loras]
    ys64 = lora_projections_reference(
        x64, [w.double() for w in ws], [None if b is None else b.double() for b in bs], l64, routing, offset
    )
    grads64 = torch.autograd.grad(ys64, leaves(x64, l64), [gy.double() for gy in gys])
    tol = TOL[dtype]
    for i, (y, y64) in enumerate(zip(ys, ys64)):
        assert rel_err(y, y64) < tol, f"output {i}: {rel_err(y, y64):.2e}"
    for j, (g, g64) in enumerate(zip(grads, grads64)):
        assert g.shape == g64.shape and g.dtype == params[j].dtype
        assert torch.isfinite(g).all()
        assert rel_err(g, g64) < tol, f"grad {j} {tuple(g.shape)}: {rel_err(g, g64):.2e}"


def single(m, p, seed=3, scale=2.0):
    return LoraRouting(num_rows=m, segments=((0, m, 0),), scales=(scale,), dropout_p=(p,), seeds=(seed,))


@pytest.mark.parametrize("gemm", ["triton", "cublas", "cublas_accumulate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_single_adapter_odd_shape(device, gemm, dtype):
    # M=47, K=123, N=4097, r=3: every dimension has a masked tail
    x, ws, bs, loras = make_problem(47, 123, (4097,), ((3,),), dtype, device)
    sizes = dataclasses.replace(SMALL, gemm=gemm)
    check_against_reference(x, ws, bs, loras, single(47, 0.25), 5, dtype, sizes)


@pytest.mark.parametrize("p,gemm", [(0.0, "triton"), (0.5, "triton"), (0.5, "cublas_accumulate")])
def test_multi_adapter_heterogeneous_ranks(device, p, gemm):
    # ranks 1, 16, 128 and 5 on q/k/v-like projections; adapter 2 has no LoRA on k;
    # rows 0..2 and 90..99 belong to no segment; segments are not block-aligned.
    m, k = 100, 70
    ranks = ((1, 16, 128, 5), (1, 16, 0, 5), (1, 16, 128, 5))
    x, ws, bs, loras = make_problem(m, k, (48, 20, 20), ranks, torch.float32, device)
    routing = LoraRouting(
        num_rows=m,
        segments=((3, 20, 1), (20, 21, 0), (21, 66, 2), (66, 90, 3)),
        scales=(0.5, 2.0, 0.125, 1.0),
        dropout_p=(p, p / 2, p, 0.0),
        seeds=(1, 2, 3, 4),
        microbatch_index=3,
    )
    check_against_reference(x, ws, bs, loras, routing, 2**31 + 9, torch.float32,
                            dataclasses.replace(SMALL, gemm=gemm))


def test_many_adapters_fp16_padded_segments(device):
    # 6 adapters on block-aligned (padded) segments, one adapter appearing twice, fp16
    m, k = 192, 64
    ranks = ((4, 8, 2, 16, 3, 1), (4, 8, 2, 16, 3, 1))
    x, ws, bs, loras = make_problem(m, k, (40, 33), ranks, torch.float16, device)
    segs = ((0, 32, 0), (32, 64, 1), (64, 96, 2), (96, 128, 3), (128, 160, 4), (160, 176, 5), (176, 192, 1))
    routing = LoraRouting(num_rows=m, segments=segs, scales=(1.0, 2.0, 0.5, 0.25, 4.0, 1.5),
                          dropout_p=(0.1,) * 6, seeds=(10, 11, 12, 13, 14, 15))
    check_against_reference(x, ws, bs, loras, routing, 17, torch.float16)


@pytest.mark.parametrize("gemm", ["triton", "cublas", "cublas_accumulate"])
def test_four_projections_chain_dx_gemm(device, gemm):
    # more projections than one dX launch sums (3): the Triton path chains launches
    x, ws, bs, loras = make_problem(40, 48, (16, 17, 18, 19), ((2, 3),) * 4, torch.float32, device)
    routing = LoraRouting(num_rows=40, segments=((0, 25, 0), (25, 40, 1)), scales=(1.0, 3.0),
                          dropout_p=(0.2, 0.3), seeds=(5, 6))
    check_against_reference(x, ws, bs, loras, routing, 1, torch.float32,
                            dataclasses.replace(SMALL, gemm=gemm))


def test_large_blocks_and_lora_free_projection(device):
    # GPU-sized tiles (block_m=128) on a small problem; one projection without any LoRA
    x, ws, bs, loras = make_problem(130, 100, (300, 40), ((16, 8), (0, 0)), torch.float32, device)
    routing = LoraRouting(num_rows=130, segments=((0, 100, 1), (100, 129, 0)), scales=(2.0, 0.5),
                          dropout_p=(0.1, 0.2), seeds=(1, 2))
    sizes = LoraBlockSizes(gemm="triton", fwd_block_n=256, skinny_block_m=32)
    check_against_reference(x, ws, bs, loras, routing, 7, torch.float32, sizes)


def test_s_and_ds_split_three_ways_with_empty_shares(device):
    """S summed over K and dS over N in 3 shares of fp32 partials (as a GPU plan splits a
    microbatch of few row tiles), the narrow projection's last dS shares empty: outputs and
    gradients still equal the reference."""
    from lightning_lorafusion.kernels.fused_lora_launch import _Plan

    x, ws, bs, loras = make_problem(70, 80, (100, 20), ((4, 8), (4, 8)), torch.float32, device)
    routing = LoraRouting(num_rows=70, segments=((0, 40, 0), (40, 70, 1)), scales=(2.0, 0.5),
                          dropout_p=(0.1, 0.0), seeds=(1, 2))
    with torch.no_grad():
        fused_lora_projections(x, ws, bs, loras, routing, dropout_offset=3, block_sizes=SMALL)
    plans = [p for p in routing.launch_cache.values() if isinstance(p, _Plan)]
    assert len(plans) == 1
    plans[0].s_split = plans[0].ds_split = 3
    plans[0].launches.clear()
    check_against_reference(x, ws, bs, loras, routing, 3, torch.float32)


@pytest.mark.parametrize("gemm", ["triton", "cublas"])
def test_fp32_factors_with_fp16_activations(device, gemm):
    """fp32 adapter factors (as the adapter bank keeps them) under fp16 activations: the kernels
    read them in fp32 and round on load; outputs and every gradient (fp32 for the factors)
    equal the reference."""
    x, ws, bs, loras = make_problem(70, 48, (40, 20), ((4, 8), (4, 0)), torch.float16, device)

    def fp32(t):
        return None if t is None else t.detach().float().requires_grad_(True)

    loras = [None if l is None else LoraModuleWeights(tuple(map(fp32, l.a)), tuple(map(fp32, l.b))) for l in loras]
    routing = LoraRouting(num_rows=70, segments=((0, 40, 0), (40, 70, 1)), scales=(2.0, 0.5),
                          dropout_p=(0.1, 0.0), seeds=(1, 2))
    check_against_reference(x, ws, bs, loras, routing, 3, torch.float16, dataclasses.replace(SMALL, gemm=gemm))


def test_ds_split_fills_the_gpu_with_enough_steps_per_share():
    from lightning_lorafusion.kernels.fused_lora_launch import _reduction_split_count

    # 2,816 rows in 22 tiles of 4 programs, N = 14336 in 112 steps, 132 SMs, 4 programs per SM
    assert _reduction_split_count(88, 112, 132, 4) == 6
    assert _reduction_split_count(216, 112, 132, 4) == 3  # 6,912 rows
    assert _reduction_split_count(88, 8, 132, 4) == 2  # N = 1024: shares of 4 steps at least
    assert _reduction_split_count(600, 112, 132, 4) == 1  # the grid fills the GPU already
    assert _reduction_split_count(88, 112, None, 4) == 2 and _reduction_split_count(88, 1, None, 4) == 1  # interpreter


def test_same_seed_same_mask_forward_and_backward(device):
    # With p=0.5 a backward that drew a different mask than the forward would miss dA by ~100%;
    # also: same (seed, offset) -> identical outputs, another offset -> different ones.
    x, ws, bs, loras = make_problem(64, 96, (32,), ((8,),), torch.float32, device)
    routing = single(64, 0.5)
    check_against_reference(x, ws, bs, loras, routing, 42, torch.float32)
    y1 = fused_lora_projections(x, ws, bs, loras, routing, dropout_offset=42, block_sizes=SMALL)[0]
    y2 = fused_lora_projections(x, ws, bs, loras, routing, dropout_offset=42, block_sizes=SMALL)[0]
    y3 = fused_lora_projections(x, ws, bs, loras, routing, dropout_offset=43, block_sizes=SMALL)[0]
    assert torch.equal(y1, y2)
    assert not torch.allclose(y1, y3)


def test_shared_input_projections_share_one_mask(device):
    # q and k with identical factors must give identical LoRA terms (one mask per input)
    x, ws, bs, loras = make_problem(48, 64, (24,), ((4,),), torch.float32, device, bias=False)
    lora = loras[0]
    ys = fused_lora_projections(x, ws * 2, [None, None], [lora, lora], single(48, 0.5), dropout_offset=9,
                                block_sizes=SMALL)
    assert torch.equal(ys[0], ys[1])


def test_frozen_weights_get_no_grad_and_uncovered_rows_are_frozen(device):
    x, ws, bs, loras = make_problem(64, 32, (24,), ((4, 4),), torch.float32, device)
    ws[0].requires_grad_(True)
    routing = LoraRouting(num_rows=64, segments=((10, 20, 1),), scales=(1.0, 1.0),
                          dropout_p=(0.0, 0.0), seeds=(0, 0))
    (y,) = fused_lora_projections(x, ws, bs, loras, routing, block_sizes=SMALL)
    frozen = torch.nn.functional.linear(x, ws[0], bs[0])
    outside = torch.ones(64, dtype=torch.bool)
    outside[10:20] = False
    torch.testing.assert_close(y[outside], frozen[outside], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(y[10:20], frozen[10:20])
    y.sum().backward()
    assert ws[0].grad is None
    assert loras[0].a[0].grad is None  # adapter 0 has no rows in this microbatch
    assert loras[0].a[1].grad is not None


def test_api_triton_backend_matches_torch_backend(device):
    x, ws, bs, loras = make_problem(33, 40, (20, 12), ((3,), (2,)), torch.float32, device)
    routing = single(33, 0.1)
    got = lora_projections(x, ws, bs, loras, routing, dropout_offset=4, backend="triton")
    want = lora_projections(x, ws, bs, loras, routing, dropout_offset=4, backend="torch")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_bad_inputs_raise_clear_errors(device):
    x, ws, bs, loras = make_problem(16, 32, (8,), ((2,),), torch.float32, device)
    routing = single(16, 0.0)
    with pytest.raises(ValueError, match=r"weights\[0\] must be \[N, 32\]"):
        fused_lora_projections(x, [ws[0][:, :31]], bs, loras, routing)
    with pytest.raises(TypeError, match="cast the frozen weights"):
        fused_lora_projections(x, [ws[0].half()], [None], loras, routing)
    with pytest.raises(TypeError, match="not supported"):
        fused_lora_projections(x.double(), ws, bs, loras, routing)
    with pytest.raises(ValueError, match="routing.num_rows=15"):
        fused_lora_projections(x, ws, bs, loras, single(15, 0.0))
    bad_b = LoraModuleWeights(loras[0].a, (loras[0].b[0][:, :1],))
    with pytest.raises(ValueError, match=r"loras\[0\].b\[0\] must be \[8, 2\]"):
        fused_lora_projections(x, ws, bs, [bad_b], routing)
    with pytest.raises(ValueError, match="one \\(possibly None\\) per adapter"):
        two = LoraRouting(num_rows=16, segments=((0, 16, 0),), scales=(1.0, 1.0), dropout_p=(0.0, 0.0), seeds=(0, 0))
        fused_lora_projections(x, ws, bs, loras, two)
    with pytest.raises(ValueError, match="2-D tensor"):
        fused_lora_projections(x[None], ws, bs, loras, routing)
    with pytest.raises(ValueError, match="one entry per projection"):
        fused_lora_projections(x, ws, [], loras, routing)
    with pytest.raises(ValueError, match="power of two"):
        LoraBlockSizes(fwd_block_n=100)
    with pytest.raises(ValueError, match="gemm="):
        LoraBlockSizes(gemm="cutlass")


def test_custom_ops_pass_opcheck_and_compile_fullgraph(device):
    # The torch.library ops behind torch.compile: schema / fake-tensor / autograd registration
    # checked by opcheck, and a fullgraph compile gives the reference's values and gradients.
    from lightning_lorafusion.kernels import fused_lora as fl
    from lightning_lorafusion.kernels import fused_lora_ops as ops
    from lightning_lorafusion.kernels.dropout_triton import offset_hash_arg
    from lightning_lorafusion.kernels.routing_table import build_launch_table

    x, ws, bs, loras = make_problem(40, 48, (16, 17), ((2, 3), (0, 0)), torch.float32, device)
    routing = LoraRouting(num_rows=40, segments=((0, 25, 0), (25, 40, 1)), scales=(1.0, 3.0),
                          dropout_p=(0.2, 0.3), seeds=(5, 6))
    table = build_launch_table(routing, fl.lora_ranks(loras, 2), SMALL.block_m, x.device)
    tensors, meta = ops._table_to_args(table)
    a_all = torch.cat(loras[0].a).detach().requires_grad_(True)
    b_cat = torch.cat(loras[0].b, dim=1).detach().requires_grad_(True)
    empty = x.new_empty(0)
    args = (x, a_all, ws, [bs[0], empty], [b_cat, empty], tensors, meta, ops._sizes_to_args(SMALL),
            offset_hash_arg(3))
    torch.library.opcheck(ops.fused_lora_fwd_op, args)

    def f(inp):
        return fl.fused_lora_projections(inp, ws, bs, loras, routing, dropout_offset=3, block_sizes=SMALL)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = compiled(x)
    want = lora_projections_reference(x, ws, bs, loras, routing, 3)
    params = leaves(x, loras)
    g_got = torch.autograd.grad(got, params, [torch.ones_like(y) for y in got])
    g_want = torch.autograd.grad(want, params, [torch.ones_like(y) for y in want])
    for a, b in zip(list(got) + list(g_got), list(want) + list(g_want)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cached launches call compiled kernels: CUDA only")
@pytest.mark.parametrize("gemm", ["cublas", "cublas_accumulate", "triton"])
def test_cached_launches_repeat_calls_and_misaligned_inputs_cuda(gemm):
    # The first call of a plan goes through Triton's dispatch, later ones call the compiled
    # kernels directly (triton_launch.CachedLaunch); a tensor at a new 16-byte alignment goes
    # through the dispatch again. Every call must match the float64 reference.
    from lightning_lorafusion.kernels.fused_lora_launch import _Plan

    sizes = dataclasses.replace(SMALL, gemm=gemm)  # small tiles: fp32 Triton GEMMs fit in shared memory
    x, ws, bs, loras = make_problem(300, 250, (192, 64), ((16, 8), (16, 8)), torch.float32, "cuda")
    routing = LoraRouting(num_rows=300, segments=((0, 130, 1), (130, 290, 0)), scales=(2.0, 0.5),
                          dropout_p=(0.1, 0.25), seeds=(7, 8))
    # offset 2's hash is below 2**31, offset 3's is not: both must reuse the launch compiled for
    # the first call's argument types (an OverflowError before offset_hash_arg)
    assert offset_hash(2) < 1 << 31 <= offset_hash(3)
    for offset in (2, 2, 3, 6):
        check_against_reference(x, ws, bs, loras, routing, offset, torch.float32, sizes)
    plans = [p for p in routing.launch_cache.values() if isinstance(p, _Plan)]
    launches = [launch for p in plans for hit in p.launches.values()
                for launch in (hit if isinstance(hit, tuple) else (hit,)) if hasattr(launch, "runners")]
    assert launches and all(launch.runners for launch in launches)  # the direct path was taken
    # rows of 250 fp32 = 1000 bytes: x[1:] starts 8 bytes off a 16-byte boundary
    big = torch.randn(301, 250, device="cuda").requires_grad_(True)
    check_against_reference(big[1:], ws, bs, loras, routing, 6, torch.float32, sizes)
