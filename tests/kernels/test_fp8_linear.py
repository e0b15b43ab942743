"""FP8 frozen base (kernels/fp8_linear.py): scales, layouts, emulated products, LoRA integration.

CPU tests run the emulated path (quantize, dequantize in fp32, matmul), which is the spec; the
fused LoRA kernels run in the Triton interpreter (fp32) around it. The GPU test (skipped
without CUDA compute capability >= 8.9) checks the real path against the emulated one.

Tolerances. e4m3 keeps 3 mantissa bits: round-to-nearest moves a value by at most 2^-4
(6.25%) of itself, about 2^-4 / sqrt(3) = 3.6% rms for values spread over a binade. A product
of two quantized operands of random sign sums independent errors, so its relative Frobenius
error is about sqrt(2) x 3.6% = 5%: we allow 8% against the unquantized fp64 product (measured
3.7-3.9%). Against the fp64 product of the *quantized* operands (the same scales), only fp32
accumulation remains: 1e-5. The real path may differ from the emulated one only by the
GEMM's accumulation order and the final bf16 rounding (2^-9): 1e-2.
"""

from __future__ import annotations

import pytest
import torch

from lightning_lorafusion.kernels import fp8_linear as F8
from lightning_lorafusion.kernels.api import lora_projections
from lightning_lorafusion.kernels.block_sizes import INTERPRETER_BLOCK_SIZES
from lightning_lorafusion.kernels.fused_lora import fused_lora_projections
from lightning_lorafusion.kernels.reference import LoraModuleWeights, LoraRouting

FP8_TOL = 8e-2  # quantized vs unquantized product (see module docstring)
SAME_SCALES_TOL = 1e-5  # emulated vs fp64 over the same quantized operands
REAL_TOL = 1e-2  # real FP8 GEMM (bf16 out) vs emulated


def rel(got, want):
    return float((got.detach().double() - want.detach().double()).norm() / want.detach().double().norm())


def problem(m=47, k=64, ns=(32, 16, 48), seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype).requires_grad_(True)
    ws = [(torch.randn(n, k, generator=g) * k**-0.5 * (1 + torch.rand(n, 1, generator=g) * 8)).to(device, dtype)
          for n in ns]
    return x, ws


def test_pow2_scales_cover_the_e4m3_range_exactly():
    amax = torch.tensor([448.0, 449.0, 224.0, 224.5, 1.0, 0.0, 3e-39, 1e30, 0.875 * 2**-3])
    s = F8.pow2_scales(amax)
    assert torch.equal(torch.log2(s), torch.log2(s).round()), "scales are powers of two"
    live = amax > 0
    assert (amax[live] / s[live] <= F8.FP8_MAX).all()
    # the smallest such power of two: half of it would overflow (the subnormal row is clamped)
    normal = live & (amax > 2**-100)
    assert (amax[normal] / (s[normal] / 2) > F8.FP8_MAX).all()
    assert s[5] == 1.0 and s[6] == 2.0**-126
    assert s.tolist()[:5] == [1.0, 2.0, 0.5, 1.0, 2.0**-8]


def test_weight_quantization_layout_and_storage():
    _, (w,) = problem(ns=(40,))
    w[3] = 0.0
    fw = F8.quantize_weight(w)
    assert fw.data.dtype == F8.FP8_DTYPE and fw.data.shape == (40, 64) and fw.scale.shape == (40,)
    amax = w.abs().amax(dim=1)
    assert torch.equal(fw.scale, F8.pow2_scales(amax)), "one scale per output channel (row)"
    # each element moves by at most half an e4m3 ulp (2^-4 relative) in the normal range
    deq = fw.dequantize()
    big = w.abs() >= fw.scale[:, None] * 2**-6
    assert ((deq - w).abs()[big] <= w.abs()[big] * 2**-4).all()
    assert (deq[3] == 0).all()
    # pytree storage: uint8 bits + scales survive Module.to(bfloat16) (Lightning's bf16-true)
    p = F8.quantize_projection({"weight": w, "bias": torch.ones(40)})
    assert set(p) == {F8.WEIGHT_KEY, F8.SCALE_KEY, "bias"} and p[F8.WEIGHT_KEY].dtype == torch.uint8
    mod = torch.nn.Module()
    for name, t in p.items():
        mod.register_buffer(name, t)
    mod.to(torch.bfloat16)
    back = F8.Fp8Weight.from_params({n: getattr(mod, n) for n in p})
    assert torch.equal(back.data.view(torch.uint8), fw.data.view(torch.uint8))
    assert back.scale.dtype == torch.float32 and torch.equal(back.scale, fw.scale)


def test_emulated_forward_and_input_gradient():
    x, ws = problem()
    fws = [F8.quantize_weight(w) for w in ws]
    biases = [torch.randn(32), None, None]
    ys = F8.frozen_projections(x, fws, biases)
    gys = [torch.randn_like(y) for y in ys]
    (dx,) = torch.autograd.grad(ys, [x], gys)
    for y, w, b in zip(ys, ws, biases):
        exact = x.double() @ w.double().t() + (0 if b is None else b.double())
        assert rel(y, exact) < FP8_TOL
        # the spec over the same quantized operands: rows of x, channels of W
        xq, sx = F8.quantize_rows_reference(x)
        fw = F8.quantize_weight(w)
        same = (xq.double() * sx.double()) @ (fw.data.double() * fw.scale.double()[:, None]).t()
        assert rel(y, same + (0 if b is None else b.double())) < SAME_SCALES_TOL
    exact_dx = sum(g.double() @ w.double() for g, w in zip(gys, ws))
    assert rel(dx, exact_dx) < FP8_TOL
    # backward = dY (quantized per row after folding in the channel scales, jointly over the
    # group) times the *same* e4m3 weights: the exact gradient of the forward's dequantized W
    g = torch.cat([gy * fw.scale for gy, fw in zip(gys, fws)], dim=1)
    gq, sg = F8.quantize_rows_reference(g)
    wq = torch.cat([fw.data.double() for fw in fws])
    assert rel(dx, (gq.double() * sg.double()) @ wq) < SAME_SCALES_TOL
    assert F8.quantize_rows_reference(x)[1].shape == (47, 1)


def test_fp8_linear_single_projection_and_no_weight_grad():
    x, (w,) = problem(ns=(24,))
    fw = F8.quantize_weight(w)
    y = F8.fp8_linear(x, fw)
    assert y.shape == (47, 24) and y.dtype == torch.float32
    y.sum().backward()
    assert x.grad is not None and rel(x.grad, torch.ones(47, 24, dtype=torch.float64) @ w.double()) < FP8_TOL
    with pytest.raises(TypeError, match="mixes FP8 and plain"):
        F8.frozen_projections(x, [fw, w], [None, None])


def _loras(ws, ranks, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for w, rs in zip(ws, ranks):
        a = tuple(torch.randn(r, k, generator=g).requires_grad_(True) if r else None for r in rs)
        b = tuple(torch.randn(w.shape[0], r, generator=g).requires_grad_(True) if r else None for r in rs)
        out.append(LoraModuleWeights(a, b))
    return out


ROUTING = LoraRouting(num_rows=47, segments=((0, 20, 0), (24, 47, 1)), scales=(2.0, 0.5),
                      dropout_p=(0.25, 0.0), seeds=(7, 8))
RANKS = [(4, 0), (2, 3), (0, 5)]


def test_lora_gradients_do_not_depend_on_fp8_except_through_dy():
    """Same upstream dY: dA and dB of the FP8 path equal those of the plain path (whatever the
    base weight), and dX differs from it by exactly the frozen term's FP8 error."""
    x, ws = problem()
    fws = [F8.quantize_weight(w) for w in ws]
    deq = [fw.dequantize() for fw in fws]
    loras = _loras(ws, RANKS, 64)
    leaves = [x] + [t for l in loras for t in l.a + l.b if t is not None]
    y8 = lora_projections(x, fws, [None] * 3, loras, ROUTING, dropout_offset=3, backend="torch")
    gys = [torch.randn_like(y) for y in y8]
    g8 = torch.autograd.grad(y8, leaves, gys)
    yp = lora_projections(x, deq, [None] * 3, loras, ROUTING, dropout_offset=3, backend="torch")
    gp = torch.autograd.grad(yp, leaves, gys)
    for a, b in zip(g8[1:], gp[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # LoRA terms identical too: outputs differ by the frozen products only
    for y_8, y_p, fw, w in zip(y8, yp, fws, deq):
        torch.testing.assert_close(y_8 - F8.frozen_projections(x, [fw], [None])[0], y_p - x @ w.t(),
                                   rtol=1e-5, atol=1e-5)
    base8 = F8.fp8_input_grad(gys, fws, m=47, k=64, dtype=torch.float32, device=x.device, emulate=True)
    basep = sum(g @ w for g, w in zip(gys, deq))
    torch.testing.assert_close(g8[0] - base8, gp[0] - basep, rtol=1e-5, atol=1e-5)
    assert rel(g8[0], gp[0]) < FP8_TOL


def test_fp8_embedding_table_and_lookup():
    """The input embedding stored in e4m3 with one power-of-two scale per token row: a lookup
    returns exactly the dequantized rows, in the table's dtype; a tied table (the LM head) is
    left alone by quantize_base_fp8."""
    from lightning_lorafusion.model.decoder import embed, embedding_device_dtype
    from lightning_lorafusion.model.hf_loading import quantize_base_fp8

    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        table = (torch.randn(37, 64, generator=g) * torch.rand(37, 1, generator=g) * 4).to(dtype)
        table[5] = 0
        q = F8.quantize_embedding(table)
        assert q[F8.WEIGHT_KEY].dtype == torch.uint8 and q[F8.WEIGHT_KEY].shape == (37, 64)
        assert q[F8.SCALE_KEY].dtype == dtype and q[F8.SCALE_KEY].shape == (37,)
        deq = F8.quantize_weight(table).dequantize()  # the same per-row scales and bits
        ids = torch.tensor([3, 5, 36, 3, 0])
        got = embed({"embed": q}, ids)
        assert got.dtype == dtype and torch.equal(got, deq[ids].to(dtype))
        assert (got[1] == 0).all()
        big = table.float().abs() >= q[F8.SCALE_KEY].float()[:, None] * 2**-6
        err = (deq - table.float()).abs()
        assert (err[big] <= table.float().abs()[big] * 2**-4).all(), "half an e4m3 ulp"
        assert embedding_device_dtype({"embed": q}) == (table.device, dtype)
    untied = {"embed": table, "lm_head": table.clone(), "layers": []}
    tied = {"embed": table, "lm_head": table, "layers": []}
    assert F8.is_quantized(quantize_base_fp8(untied, embedding=True)["embed"])
    assert quantize_base_fp8(untied)["embed"] is table, "off unless asked"
    assert quantize_base_fp8(tied, embedding=True)["embed"] is table


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU); the GPU test covers the real fused path")
def test_fused_kernels_with_fp8_base_match_the_reference():
    """Triton interpreter (fp32): the fused path's FP8 branch (X quantized once per group,
    LoRA terms added in place, one dX product) against the torch reference with the same
    Fp8Weights, outputs and every gradient."""
    x, ws = problem()
    fws = [F8.quantize_weight(w) for w in ws]
    biases = [None, torch.randn(16), None]
    loras = _loras(ws, RANKS, 64)
    leaves = [x] + [t for l in loras for t in l.a + l.b if t is not None]
    yr = lora_projections(x, fws, biases, loras, ROUTING, dropout_offset=5, backend="torch")
    gys = [torch.randn_like(y) for y in yr]
    gr = torch.autograd.grad(yr, leaves, gys)
    yf = fused_lora_projections(x, fws, biases, loras, ROUTING, dropout_offset=5,
                                block_sizes=INTERPRETER_BLOCK_SIZES)
    gf = torch.autograd.grad(yf, leaves, gys)
    for a, b in zip(yf, yr):
        assert rel(a, b) < SAME_SCALES_TOL
    for a, b in zip(gf, gr):
        assert rel(a, b) < SAME_SCALES_TOL
    # a group without any routed LoRA rows goes straight to the frozen FP8 products
    ys0 = fused_lora_projections(x, fws, biases, [None] * 3, ROUTING, block_sizes=INTERPRETER_BLOCK_SIZES)
    for a, b in zip(ys0, F8.frozen_projections(x, fws, biases)):
        torch.testing.assert_close(a, b)


def test_real_path_refuses_without_fp8_tensor_cores():
    x, (w,) = problem(ns=(16,))
    fw = F8.quantize_weight(w)
    if F8.fp8_supported(x.device):
        pytest.skip("this device has FP8 tensor cores")
    with pytest.raises(RuntimeError, match="compute capability"):
        F8.fp8_linear(x, fw, emulate=False)


@pytest.mark.skipif(not torch.cuda.is_available() or not F8.fp8_supported("cuda"),
                    reason="needs a CUDA GPU with compute capability >= 8.9")
def test_real_fp8_path_matches_emulated_on_gpu():
    from lightning_lorafusion.kernels.fp8_triton import quantize_rows, transpose_concat

    # Triton quantization is bit-identical to the torch spec (odd widths, two inputs, col scales)
    x, ws = problem(m=100, k=256, ns=(192, 64, 64), dtype=torch.bfloat16, device="cuda")
    x = x.detach().requires_grad_(True)
    xd = x.detach().clone()
    xd[7] = 0
    q, s = quantize_rows([xd], None)
    qr, sr = F8.quantize_rows_reference(xd)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
    c = F8.pow2_scales(torch.rand(300, device="cuda") * 8)
    parts = [torch.randn(100, 123, device="cuda", dtype=torch.bfloat16), torch.randn(100, 177, device="cuda",
                                                                                     dtype=torch.bfloat16)]
    q, s = quantize_rows(parts, [c[:123], c[123:]])
    qr, sr = F8.quantize_rows_reference(torch.cat(parts, 1).float() * c)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
    # wide rows (more warps per row, row_launch): the 8B shape's down input and gate/up dY
    for widths in ((14336,), (14336, 14336)):
        parts = [torch.randn(64, n, device="cuda", dtype=torch.bfloat16) for n in widths]
        cols = [F8.pow2_scales(torch.rand(n, device="cuda") * 8) for n in widths]
        q, s = quantize_rows(parts, cols if len(widths) > 1 else None)
        ref_in = torch.cat([p.float() * c for p, c in zip(parts, cols)], 1) if len(widths) > 1 else parts[0]
        qr, sr = F8.quantize_rows_reference(ref_in)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
    fws = [F8.quantize_weight(w) for w in ws]
    wt = transpose_concat([fw.data for fw in fws])
    assert torch.equal(wt.view(torch.uint8), torch.cat([fw.data for fw in fws]).view(torch.uint8).t())
    # frozen group: real vs emulated, forward and dX (M=100 exercises the row padding)
    ys = F8.frozen_projections(x, fws, [None] * 3, emulate=False)
    gys = [torch.randn_like(y) for y in ys]
    (dx,) = torch.autograd.grad(ys, [x], gys)
    ye = F8.frozen_projections(x, fws, [None] * 3, emulate=True)
    (dxe,) = torch.autograd.grad(ye, [x], gys)
    for a, b in zip(ys, ye):
        assert a.dtype == torch.bfloat16 and rel(a, b) < REAL_TOL
    assert rel(dx, dxe) < REAL_TOL
    # fused LoRA projections on the GPU (real FP8) vs the torch reference on CPU copies (emulated)
    m = 256
    x, ws = problem(m=m, k=256, ns=(256, 64, 64), dtype=torch.bfloat16, device="cuda", seed=3)
    fws = [F8.quantize_weight(w) for w in ws]
    routing = LoraRouting(num_rows=m, segments=((0, 128, 0), (128, 256, 1)), scales=(2.0, 1.0),
                          dropout_p=(0.1, 0.0), seeds=(1, 2))
    loras = [LoraModuleWeights(tuple(a.to("cuda", torch.bfloat16).detach().requires_grad_(True) if a is not None
                                     else None for a in l.a),
                               tuple(b.to("cuda", torch.bfloat16).detach().requires_grad_(True) if b is not None
                                     else None for b in l.b))
             for l in _loras(ws, [(8, 8), (8, 0), (0, 16)], 256)]
    leaves = [x] + [t for l in loras for t in l.a + l.b if t is not None]
    yg = lora_projections(x, fws, [None] * 3, loras, routing, dropout_offset=9, backend="triton")
    gys = [torch.randn_like(y) for y in yg]
    gg = torch.autograd.grad(yg, leaves, gys)

    def cpu(t):
        return None if t is None else t.detach().cpu().float().requires_grad_(True)

    xc = cpu(x)
    lc = [LoraModuleWeights(tuple(map(cpu, l.a)), tuple(map(cpu, l.b))) for l in loras]
    fc = [F8.Fp8Weight(fw.data.cpu(), fw.scale.cpu()) for fw in fws]
    yc = lora_projections(xc, fc, [None] * 3, lc, routing, dropout_offset=9, backend="torch")
    gc = torch.autograd.grad(yc, [xc] + [t for l in lc for t in l.a + l.b if t is not None],
                             [g.cpu().float() for g in gys])
    for a, b in zip(yg, yc):
        assert rel(a.cpu(), b) < 2 * REAL_TOL
    for a, b in zip(gg, gc):
        assert rel(a.cpu(), b) < 2 * REAL_TOL


@pytest.mark.parametrize("m,n,k,bn,bk,split", [(1, 48, 64, None, None, None), (5, 128, 512, None, None, None),
                                               (64, 64, 256, 32, 64, 1), (70, 32, 48, 16, 16, 1),
                                               (3, 64, 256, None, None, 4), (64, 32, 96, 16, 16, 2)])
def test_weight_only_linear_kernel(device, m, n, k, bn, bk, split):
    """``fp8_triton.weight_only_linear`` (the decode product: e4m3 weights, unquantized x) equals
    x @ dequantized(W)^T; fp32 under the interpreter (only accumulation order differs), bf16 on a
    GPU (the output's rounding)."""
    from lightning_lorafusion.kernels.fp8_triton import weight_only_linear

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x, (w,) = problem(m=m, k=k, ns=(n,), dtype=torch.float32, seed=m)
    fw = F8.quantize_weight(w)
    want = x.detach().double() @ fw.dequantize(torch.float64).t()
    got = weight_only_linear(x.detach().to(device, dtype), fw.data.to(device), fw.scale.to(device),
                             block_n=bn, block_k=bk, split_k=split)
    assert got.shape == (m, n) and got.dtype == dtype
    assert rel(got.cpu(), want) < (SAME_SCALES_TOL if dtype == torch.float32 else REAL_TOL)
    # a strided x (a column slice of a wider tensor) reads the same values
    wide = torch.cat([x.detach(), x.detach()], dim=1).to(device, dtype)
    again = weight_only_linear(wide[:, :k], fw.data.to(device), fw.scale.to(device), block_n=bn, block_k=bk,
                               split_k=split)
    assert torch.equal(again, got)


def test_weight_only_config_is_the_sweeps_winner_and_always_valid():
    """The default tiles are the H100 sweep's winners at its shapes (block_n, block_k, split_k;
    docs/BENCHMARKS.md) and divide any other shape the kernel accepts."""
    from lightning_lorafusion.kernels.fp8_triton import weight_only_config

    winners = {(16, 4096, 4096): (32, 128, 4), (16, 1024, 4096): (32, 128, 4), (16, 14336, 4096): (32, 128, 1),
               (16, 4096, 14336): (32, 128, 4), (64, 4096, 4096): (64, 128, 4), (64, 1024, 4096): (32, 128, 4),
               (64, 14336, 4096): (64, 128, 1), (64, 4096, 14336): (64, 128, 4)}
    for (m, n, k), want in winners.items():
        assert weight_only_config(m, n, k) == want
    for m in (1, 16, 17, 64):
        for n in (16, 48, 96, 1040, 14336):
            for k in (16, 48, 96, 272, 4096, 4112):
                bn, bk, split = weight_only_config(m, n, k)
                assert n % bn == 0 and k % split == 0 and (k // split) % bk == 0 and bk % 16 == 0, (m, n, k)


def test_weight_only_products_are_chosen_per_weight(monkeypatch):
    """The real forward's routing, with CPU stand-ins for its GPU products: with weight-only on,
    at most WEIGHT_ONLY_MAX_ROWS rows take it for weights no wider than deep (and every weight
    for one row); the rest share one row quantization of x; all equal x @ W^T."""
    from lightning_lorafusion.kernels import fp8_triton

    calls = []

    def weight_only(x, data, scale):
        calls.append(("wo", data.shape[0]))
        return x @ F8.Fp8Weight(data, scale).dequantize(x.dtype).t()

    def quantize_rows(xs, _):
        calls.append(("quantize", None))
        return xs[0], torch.ones(xs[0].shape[0], 1)

    def scaled_mm(xq, sx, data, scale, dtype, fast):
        calls.append(("rowwise", data.shape[0]))
        return (xq * sx) @ F8.Fp8Weight(data, scale.view(-1)).dequantize(dtype).t()

    monkeypatch.setattr(F8, "_check_real", lambda x, w: None)
    monkeypatch.setattr(fp8_triton, "weight_only_linear", weight_only)
    monkeypatch.setattr(fp8_triton, "quantize_rows", quantize_rows)
    monkeypatch.setattr(F8, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(F8, "WEIGHT_ONLY_MAX_ROWS", 16)
    ws = [torch.randn(n, 64) for n in (128, 64, 32)]  # wider than deep, square, narrow
    fws = [F8.quantize_weight(w) for w in ws]
    for m, weight_only_on, want in [(16, True, ["quantize", ("rowwise", 128), ("wo", 64), ("wo", 32)]),
                                    (1, True, [("wo", 128), ("wo", 64), ("wo", 32)]),
                                    (17, True, ["quantize", ("rowwise", 128), ("rowwise", 64), ("rowwise", 32)]),
                                    (4, False, ["quantize", ("rowwise", 128), ("rowwise", 64), ("rowwise", 32)])]:
        calls.clear()
        x = torch.randn(m, 64)
        ys = F8._real_outputs(x, fws, [None, None, torch.ones(32)], weight_only=weight_only_on)
        assert [c if c[0] != "quantize" else "quantize" for c in calls] == want, (m, weight_only_on)
        for y, fw, b in zip(ys, fws, [0, 0, 1]):
            torch.testing.assert_close(y, x @ fw.dequantize(torch.float32).t() + b)
    monkeypatch.setattr(F8, "WEIGHT_ONLY_MAX_ROWS", 0)  # off: never
    assert not any(F8.weight_only_wins(m, 32, 64) for m in (1, 16, 64))
    monkeypatch.undo()
    assert F8.WEIGHT_ONLY_MAX_ROWS == 16  # the default, from the engine's decode measurement (docs/kernels.md)


def test_inference_only_asks_for_the_weight_only_product(monkeypatch):
    """``frozen_projections`` without autograd passes ``weight_only=True`` down (the real path
    then serves few rows weight-only); with a gradient it keeps the row-quantized product."""
    x, ws = problem(m=8, k=64, ns=(32, 16))
    fws = [F8.quantize_weight(w) for w in ws]
    seen = []
    real = F8.fp8_outputs

    def spy(*args, **kwargs):
        seen.append(kwargs.get("weight_only", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(F8, "fp8_outputs", spy)
    with torch.no_grad():
        F8.frozen_projections(x, fws, [None, None], emulate=True)
    F8.frozen_projections(x.detach(), fws, [None, None], emulate=True)
    ys = F8.frozen_projections(x, fws, [None, None], emulate=True)
    assert seen == [True, True, False] and ys[0].requires_grad
