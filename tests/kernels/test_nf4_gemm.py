"""The NF4 GEMM (dequantize inside the operand tiles) against its torch reference, dequantize
then matmul: forward ``x @ W^T`` and input gradient ``dy @ W``, odd shapes, both absmax layouts
(plain fp32 and double-quantized), fp32 and fp16 (bf16 is wrong in the Triton interpreter);
and the ``nf4_gemm`` option: the fused products train like the buffer ones."""

import pytest
import torch

from lightning_lorafusion.kernels.nf4 import (
    Nf4Weight, dequantize_nf4_reference, nf4_frozen_projections, quantize_nf4_reference, resolve_nf4_gemm,
)
from lightning_lorafusion.kernels.nf4_gemm import nf4_input_grad_fused, nf4_linear_fused, nf4_matmul_reference
from lightning_lorafusion.kernels.options import KernelOptions

# (M, N, K): M of decode (1, 5) and training tiles with tails; N, K off the block sizes (K even)
SHAPES = [(1, 47, 130), (5, 64, 96), (37, 130, 66), (70, 33, 258)]
# fp32: the same products summed in another order (ieee dots): sums of K = 258 unit-scale
# products reach ~16, so an output near zero can differ by a few 1e-5 (1.1e-5 seen on an H100);
# fp16: both round the fp32 sum once to fp16 (2^-11 = 4.9e-4 relative), so one ulp apart at most
TOL = {torch.float32: dict(rtol=1e-5, atol=5e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _weight(n: int, k: int, nested: bool, blocksize: int = 64, seed: int = 0) -> Nf4Weight:
    gen = torch.Generator().manual_seed(seed)
    return quantize_nf4_reference(torch.randn(n, k, generator=gen), blocksize=blocksize, double_quant=nested)


def _on(w: Nf4Weight, device) -> Nf4Weight:
    return Nf4Weight(*(t.to(device) if t is not None else None for t in
                       (w.data, w.absmax, w.code, w.nested_absmax, w.nested_code, w.offset)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_input_grad_equal_the_reference(shape, nested, dtype, device):
    m, n, k = shape
    w = _weight(n, k, nested)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen).to(dtype)
    dy = torch.randn(m, n, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    w_dev = _on(w, device)
    y = nf4_linear_fused(x.to(device), w_dev, bias.to(device)).cpu()
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y, nf4_matmul_reference(x, w, transpose=True, bias=bias), **TOL[dtype])
    dx = nf4_input_grad_fused(dy.to(device), w_dev).cpu()
    assert dx.dtype == dtype and dx.shape == (m, k)
    torch.testing.assert_close(dx, nf4_matmul_reference(dy, w, transpose=False), **TOL[dtype])


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("blocksize", [32, 64, 128])
def test_tiles_dequantize_bit_for_bit(blocksize, nested, device):
    """With an identity operand every output is one product: the weight the kernel read equals
    ``dequantize_nf4_reference`` exactly (codes, nibble order, blocks across rows, nested absmax)."""
    n, k = 47, 130  # blocks straddle rows: 130 values per row, blocks of 32..128
    w = _on(_weight(n, k, nested, blocksize), device)
    want = dequantize_nf4_reference(w).cpu()
    eye_k = torch.eye(k, device=device)
    assert torch.equal(nf4_linear_fused(eye_k, w).cpu(), want.t())
    eye_n = torch.eye(n, device=device)
    assert torch.equal(nf4_input_grad_fused(eye_n, w).cpu(), want)


def test_strided_operands_and_accumulation(device):
    """A column-sliced x (row stride > K) reads right; ``out`` accumulates ``dy @ W`` in place."""
    m, n, k = 9, 40, 64
    w = _on(_weight(n, k, True), device)
    wide = torch.randn(m, k + 6, device=device)
    x = wide[:, 3:3 + k]
    torch.testing.assert_close(nf4_linear_fused(x, w), nf4_matmul_reference(x.contiguous(), w, transpose=True),
                               rtol=1e-5, atol=1e-5)
    dy, prev = torch.randn(m, n, device=device), torch.randn(m, k, device=device)
    out = prev.clone()
    assert nf4_input_grad_fused(dy, w, out=out) is out
    torch.testing.assert_close(out, prev + nf4_matmul_reference(dy, w, transpose=False), rtol=1e-5, atol=1e-5)


def test_shape_errors_name_the_operand():
    w = _weight(16, 32, False)
    with pytest.raises(ValueError, match=r"x must be 2-D \[M, 32\]"):
        nf4_linear_fused(torch.randn(3, 30), w)
    with pytest.raises(ValueError, match=r"dy must be 2-D \[M, 16\]"):
        nf4_input_grad_fused(torch.randn(3, 32), w)
    with pytest.raises(ValueError, match="out must be"):
        nf4_input_grad_fused(torch.randn(3, 16), w, out=torch.zeros(3, 31))


def test_gemm_option_values():
    assert resolve_nf4_gemm("auto") == "buffer" and resolve_nf4_gemm("fused") == "fused"
    with pytest.raises(ValueError, match="nf4_gemm='tiles'"):
        KernelOptions(nf4_gemm="tiles")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_projections_equal_buffer_with_gradients(dtype, device):
    """``nf4_frozen_projections`` of a group (q, k, v-like) with gemm="fused" against "buffer":
    outputs and the input gradient summed over the group."""
    k = 66
    ws = [_on(_weight(n, k, nested, seed=s), device) for s, (n, nested) in enumerate([(48, True), (20, False), (20, True)])]
    biases = [None, torch.randn(20, device=device).to(dtype), None]
    x0 = torch.randn(23, k, device=device).to(dtype)
    grads, outs = [], []
    for gemm in ("buffer", "fused"):
        x = x0.clone().requires_grad_(True)
        ys = nf4_frozen_projections(x, ws, biases, gemm=gemm)
        sum((y.float() * (i + 1)).sum() for i, y in enumerate(ys)).backward()
        outs.append([y.detach() for y in ys])
        grads.append(x.grad)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, **TOL[dtype])
    torch.testing.assert_close(grads[0], grads[1], **TOL[dtype])


def test_fused_gemm_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="nf4_gemm='fused'.*use nf4_gemm: buffer"):
        nf4_linear_fused(torch.randn(2, 32), _weight(16, 32, False))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tiny_model_trains_alike_with_fused_and_buffer(backend, tmp_path, device):
    """Two adapters packed in one microbatch over a 2-layer NF4 Llama: the loss sums and every
    LoRA gradient with ``nf4_gemm="fused"`` equal those with "buffer" (fp32: the same weights,
    products summed in another order), through the torch and the fused-kernel LoRA paths."""
    from lightning_lorafusion.model.adapter_bank import AdapterBank
    from lightning_lorafusion.model.decoder import DecoderOptions, forward_loss_sums
    from lightning_lorafusion.model.hf_loading import load_base_model, params_to, quantize_base_nf4
    from lightning_lorafusion.model.random_model import write_random_llama
    from lightning_lorafusion.specs import AdapterSpec

    model_dir = write_random_llama(tmp_path / "llama", hidden_size=64, intermediate_size=128, num_layers=2)
    config, params, _ = load_base_model(str(model_dir))
    nf4 = params_to(quantize_base_nf4(params), device=device)
    specs = [AdapterSpec(name="a", rank=4, alpha=8, dropout=0.1, seed=1, dataset={"kind": "synthetic"}),
             AdapterSpec(name="b", rank=2, alpha=2, seed=2, target_modules=("q_proj", "v_proj", "down_proj"),
                         dataset={"kind": "synthetic"})]
    t = 48
    gen = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(4, config.vocab_size, (t,), generator=gen).to(device) for _ in range(2))
    cu = torch.tensor([0, 32, t], dtype=torch.int32, device=device)
    pos = torch.cat([torch.arange(32), torch.arange(t - 32)]).to(device)
    results = []
    for gemm in ("buffer", "fused"):
        bank = AdapterBank(specs, config, dtype=torch.float32, device=device)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in bank.parameters():
                p.normal_(0, 0.1)
        routing = bank.routing([(0, 32, 0), (32, t, 1)], 0, t)
        sums = forward_loss_sums(nf4, bank.view(), ids, labels, pos, cu, routing, config=config, backend=backend,
                                 options=DecoderOptions(kernels=KernelOptions(nf4_gemm=gemm)))
        sums.sum().backward()
        results.append((sums.detach(), [p.grad.clone() for p in bank.parameters()]))
    (loss_b, grads_b), (loss_f, grads_f) = results
    assert torch.isfinite(loss_b).all() and loss_b.abs().min() > 0
    torch.testing.assert_close(loss_f, loss_b, rtol=1e-5, atol=1e-5)
    assert len(grads_b) == len(grads_f) and all(g.abs().max() > 0 for g in grads_b)
    for gf, gb in zip(grads_f, grads_b):  # order-of-summation noise scales with the largest entries
        torch.testing.assert_close(gf, gb, rtol=1e-4, atol=1e-4 * gb.abs().max().item())
