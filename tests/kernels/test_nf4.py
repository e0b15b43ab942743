"""NF4 format: our quantizer/dequantizer against bitsandbytes (on CPU), the Triton dequantize
kernel against the torch reference (interpreter on CPU), and the frozen product's gradients."""

import pytest
import torch

from lightning_lorafusion.kernels.nf4 import (
    NF4_CODE, Nf4Weight, dequantize_nf4_reference, dynamic_code, nf4_code, nf4_frozen_projections,
    quantize_nf4_reference,
)

SHAPES = [(64, 96), (47, 130), (3, 10), (128, 4096 + 2)]  # tails: n not a multiple of the block


def _bnb():
    return pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is not installed")


def _from_bnb(q, state) -> Nf4Weight:
    n, k = state.shape
    nested = state.nested
    return Nf4Weight(q.view(n, k // 2), state.absmax, state.code,
                     state.state2.absmax if nested else None, state.state2.code if nested else None,
                     state.offset.reshape(1) if nested else None)


def test_codebooks_equal_bitsandbytes():
    F = _bnb()
    assert torch.equal(nf4_code(), F.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(dynamic_code(), F.create_dynamic_map())


def test_published_codebook_and_layout():
    """Without bitsandbytes too: the 16 published values, sorted, exact 0 and +-1; the first
    value of a pair in the high nibble."""
    code = nf4_code()
    assert code.shape == (16,) and torch.all(code[1:] > code[:-1])
    assert code[0] == -1.0 and code[7] == 0.0 and code[15] == 1.0
    assert NF4_CODE[8] == pytest.approx(0.07958029955625534, abs=0)
    w = torch.tensor([[1.0, -1.0, 0.0, 0.6]])  # one block, absmax 1
    q = quantize_nf4_reference(w)
    assert q.data.tolist() == [[(15 << 4) | 0, (7 << 4) | 13]]  # 0.6 -> 0.5626 (index 13)
    assert q.absmax.tolist() == [1.0]
    torch.testing.assert_close(dequantize_nf4_reference(q), torch.tensor([[1.0, -1.0, 0.0, NF4_CODE[13]]]))


def _assert_dequantized_equal(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Bit for bit where bitsandbytes' CPU library multiplies in fp32 (as we do); its vectorised
    half-precision path on some CPUs rounds the product differently, by at most one unit in the
    last place of the 16-bit result, which is all this allows there."""
    if torch.equal(ours, theirs):
        return
    assert ours.dtype in (torch.float16, torch.bfloat16), "fp32 results must be equal bit for bit"
    ulp = torch.finfo(ours.dtype).eps
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=ulp, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("blocksize", [64, 32, 128])
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_equals_bitsandbytes_bit_for_bit(shape, blocksize, dtype):
    F = _bnb()
    torch.manual_seed(0)
    w = (torch.randn(shape) * 0.02).to(dtype)
    q, state = F.quantize_4bit(w, blocksize=blocksize, quant_type="nf4", compress_statistics=False)
    ours = quantize_nf4_reference(w, blocksize=blocksize)
    assert torch.equal(ours.data.view(-1), q.view(-1))
    assert torch.equal(ours.absmax, state.absmax)
    _assert_dequantized_equal(dequantize_nf4_reference(ours, dtype), F.dequantize_4bit(q, state))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_double_quantization_against_bitsandbytes(shape, dtype):
    """4-bit codes, offset and nested absmax are bit for bit bitsandbytes'; the uint8 absmax
    indices are the nearest entries of the dynamic code (bitsandbytes' CPU library searches
    approximately and sometimes takes the neighbour of a near-tie: we never do worse); and our
    dequantizer reproduces bitsandbytes' dequantization of bitsandbytes' own state bit for bit."""
    F = _bnb()
    torch.manual_seed(1)
    w = (torch.randn(shape) * 0.02).to(dtype)
    q, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    ours = quantize_nf4_reference(w, blocksize=64, double_quant=True)
    assert torch.equal(ours.data.view(-1), q.view(-1))
    assert torch.equal(ours.offset, state.offset.reshape(1))
    assert torch.equal(ours.nested_absmax, state.state2.absmax)
    dyn = dynamic_code()
    centred = quantize_nf4_reference(w, blocksize=64).absmax - ours.offset  # before its 8-bit quantization
    block = torch.arange(centred.numel()) // 256
    scaled = (centred * (1.0 / ours.nested_absmax[block].clamp_min(1e-38))).clamp(-1, 1)
    d_ours = (scaled - dyn[ours.absmax.long()]).abs()
    d_bnb = (scaled - dyn[state.absmax.long()]).abs()
    assert torch.all(d_ours <= d_bnb)
    live = ours.nested_absmax[block] > 0  # (an all-equal absmax centres to 0: any index decodes to 0)
    assert torch.all((d_bnb - d_ours)[live] < 1e-4)  # where the two differ, it was a near-tie
    theirs = _from_bnb(q, state)
    _assert_dequantized_equal(dequantize_nf4_reference(theirs, dtype), F.dequantize_4bit(q, state))


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("blocksize", [64, 256])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_dequantize_equals_reference(shape, blocksize, dtype, double_quant, device):
    if dtype == torch.float16 and shape == SHAPES[3] and device.type == "cpu":
        # whole blocks in fp16 take the block kernel, minutes in the interpreter at 128 x 4098: the same
        # path (whole 64- and 256-value blocks, rows that straddle blocks) at an eighth of the size
        shape = (16, 4112)
    torch.manual_seed(2)
    w = quantize_nf4_reference(torch.randn(shape, device=device), blocksize=blocksize, double_quant=double_quant)
    expected = dequantize_nf4_reference(w, dtype)
    assert torch.equal(w.dequantize(dtype, backend="triton"), expected)
    buf = torch.full((shape[0] * shape[1] + 5,), float("nan"), dtype=dtype, device=device)
    got = w.dequantize(dtype, out=buf, backend="triton")
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, expected)


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("blocksize,shape,blocks", [(32, (40, 96), 16), (64, (64, 96), 32), (128, (3, 128), 2),
                                                    (256, (16, 256), 4)])
def test_block_kernel_equals_byte_kernel_and_reference(blocksize, shape, blocks, double_quant, device):
    """Whole absmax blocks in fp16 take the block kernel (codes by byte permutes; emulated in
    the interpreter); it writes the reference's bits, as the byte kernel does, also when the
    last program has blocks past the end (``blocks`` per program does not divide the count)."""
    from lightning_lorafusion.kernels.nf4_triton import dequantize_nf4_triton, uses_block_kernel

    torch.manual_seed(4)
    w = quantize_nf4_reference(torch.randn(shape, device=device), blocksize=blocksize, double_quant=double_quant)
    assert uses_block_kernel(w.data, blocksize, torch.float16)
    assert not uses_block_kernel(w.data, blocksize, torch.float32)
    nested = (w.nested_absmax, w.nested_code, w.offset, w.nested_blocksize) if double_quant else None
    expected = dequantize_nf4_reference(w, torch.float16)
    block = dequantize_nf4_triton(w.data, w.absmax, w.code, blocksize, nested, dtype=torch.float16, blocks=blocks)
    byte = dequantize_nf4_triton(w.data, w.absmax, w.code, blocksize, nested, dtype=torch.float16, force_bytes=True)
    assert torch.equal(block, expected) and torch.equal(byte, expected)


def test_block_kernel_only_for_whole_blocks():
    w = quantize_nf4_reference(torch.randn(47, 130))  # 6110 values: the last block of 64 is short
    from lightning_lorafusion.kernels.nf4_triton import uses_block_kernel

    assert not uses_block_kernel(w.data, w.blocksize, torch.float16)
    assert not uses_block_kernel(w.data[:, 1:], 64, torch.float16)  # not contiguous


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 arithmetic is checked on the GPU only")
def test_triton_dequantize_bf16_on_gpu():
    from lightning_lorafusion.kernels.nf4_triton import dequantize_nf4_triton

    for blocksize in (64, 256):
        w = quantize_nf4_reference(torch.randn(256, 1024 + 256, device="cuda"), blocksize=blocksize, double_quant=True)
        expected = dequantize_nf4_reference(w, torch.bfloat16)
        assert torch.equal(w.dequantize(torch.bfloat16, backend="triton"), expected)  # the block kernel
        nested = (w.nested_absmax, w.nested_code, w.offset, w.nested_blocksize)
        assert torch.equal(dequantize_nf4_triton(w.data, w.absmax, w.code, blocksize, nested, dtype=torch.bfloat16,
                                                 force_bytes=True), expected)


def test_params_round_trip_survives_dtype_casts():
    w = quantize_nf4_reference(torch.randn(16, 64), double_quant=True)
    p = w.to_params()
    assert all(not t.is_floating_point() for t in p.values())  # bf16-true casts leave them alone
    back = Nf4Weight.from_params({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in p.items()})
    assert torch.equal(dequantize_nf4_reference(back), dequantize_nf4_reference(w))


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="in_features must be even"):
        quantize_nf4_reference(torch.randn(4, 7))
    with pytest.raises(ValueError, match="blocksize=48"):
        quantize_nf4_reference(torch.randn(4, 8), blocksize=48)


@pytest.mark.parametrize("with_bias", [False, True])
def test_frozen_product_forward_and_input_grad(with_bias):
    """y = x dequant(W)^T (+ b) and dx = dy dequant(W), equal to autograd through the
    dequantized weights; no gradient reaches the weight."""
    torch.manual_seed(3)
    ws = [quantize_nf4_reference(torch.randn(n, 64) * 0.1, double_quant=True) for n in (48, 16)]
    bs = [torch.randn(48) if with_bias else None, None]
    x = torch.randn(23, 64, requires_grad=True)
    ys = nf4_frozen_projections(x, ws, bs)
    dys = [torch.randn_like(y) for y in ys]
    (dx,) = torch.autograd.grad(ys, [x], dys)
    x_ref = x.detach().clone().requires_grad_(True)
    dense = [dequantize_nf4_reference(w) for w in ws]
    ys_ref = [torch.nn.functional.linear(x_ref, d, b) for d, b in zip(dense, bs)]
    (dx_ref,) = torch.autograd.grad(ys_ref, [x_ref], dys)
    for y, yr in zip(ys, ys_ref):
        torch.testing.assert_close(y, yr, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-6, atol=1e-6)  # summation order of dx may differ
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(nf4_frozen_projections(x, ws, bs), ys_ref))


def test_fused_lora_projections_with_nf4_weights(device):
    """The Triton LoRA path over NF4 frozen weights (two adapters of different ranks, dropout)
    equals the same fused path over the dequantized weights: outputs and the gradients of x, A
    and B (the input gradient dequantizes the 4-bit weights again)."""
    from lightning_lorafusion.kernels.fused_lora import fused_lora_projections
    from lightning_lorafusion.kernels.reference import LoraModuleWeights, LoraRouting

    torch.manual_seed(4)
    k, m = 64, 48
    ws = [quantize_nf4_reference(torch.randn(n, k, device=device) * 0.1, double_quant=True) for n in (32, 16)]
    dense = [dequantize_nf4_reference(w) for w in ws]
    routing = LoraRouting(num_rows=m, segments=((0, 16, 0), (16, 48, 1)), scales=(2.0, 0.5),
                          dropout_p=(0.0, 0.1), seeds=(1, 2))
    factors = [[(torch.randn(r, k, device=device) * 0.1, torch.randn(n, r, device=device) * 0.1)
                for r in (4, 2)] for n in (32, 16)]
    x0 = torch.randn(m, k, device=device)

    def run(weights):
        x = x0.clone().requires_grad_(True)
        leaves = [[(a.clone().requires_grad_(True), b.clone().requires_grad_(True)) for a, b in f] for f in factors]
        loras = [LoraModuleWeights(a=tuple(a for a, _ in f), b=tuple(b for _, b in f)) for f in leaves]
        ys = fused_lora_projections(x, weights, [None, None], loras, routing, dropout_offset=3)
        sum((y * (i + 1)).sum() for i, y in enumerate(ys)).backward()
        return [y.detach() for y in ys] + [x.grad] + [t.grad for f in leaves for pair in f for t in pair]

    for got, want in zip(run(ws), run(dense)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
