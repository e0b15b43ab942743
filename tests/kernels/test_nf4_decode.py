"""The NF4 decode kernel (few rows, the 4-bit weight read once) against its torch reference,
dequantize then matmul: odd N, K of several absmax blocks, plain and double-quantized absmax,
the four codebook lookups, GEMV and dots, split-K, bias; bit-exact weights through an identity
operand; fp32 and fp16 (bf16 is wrong in the Triton interpreter); and where ``nf4_gemm="auto"``
sends a forward."""

import pytest
import torch

from lightning_lorafusion.kernels.nf4 import (
    DECODE_MAX_BLOCKSIZE, DECODE_ROWS, Nf4Weight, dequantize_nf4_reference, nf4_forward_kind, quantize_nf4_reference,
)
from lightning_lorafusion.kernels.nf4_decode import (
    MAX_BLOCKSIZE, MAX_GROUP, MAX_ROWS, DecodeConfig, DecodeWorkspace, default_config, groupable, nf4_decode_group,
    nf4_linear_decode,
)
from lightning_lorafusion.kernels.nf4_gemm import nf4_matmul_reference

# (M, N, K): decode row counts (1, a few, a tile's worth and past it); N off every block_n; K
# several absmax blocks, not a multiple of the loop step (groups * blocksize)
SHAPES = [(1, 47, 192), (5, 33, 320), (17, 70, 128), (40, 20, 384)]
CONFIGS = [
    None,  # default_config(M)
    DecodeConfig(block_n=16, groups=1, split_k=3, use_dot=True, lookup=1),
    DecodeConfig(block_n=32, groups=2, split_k=1, use_dot=False, lookup=1),
    DecodeConfig(block_n=16, groups=4, split_k=2, use_dot=False, lookup=0),
    DecodeConfig(block_n=32, groups=2, split_k=0, use_dot=True, block_m=16),
    DecodeConfig(block_n=16, groups=2, split_k=2, use_dot=False, block_m=4),
    DecodeConfig(block_n=16, groups=1, split_k=2, use_dot=False, lookup=2, num_warps=4),
    DecodeConfig(block_n=16, groups=2, split_k=2, use_dot=True, lookup=3),
    # byte permutes (fp16; fp32 activations take lookup 2), the weight tile in k order or split
    DecodeConfig(block_n=16, groups=2, split_k=2, use_dot=True, lookup=4, contiguous=True),
    DecodeConfig(block_n=32, groups=1, split_k=0, use_dot=False, lookup=4, contiguous=True),
    DecodeConfig(block_n=16, groups=2, split_k=1, use_dot=False, lookup=4, block_m=4, contiguous=True),
    DecodeConfig(block_n=16, groups=1, split_k=3, use_dot=True, lookup=4),
    DecodeConfig(block_n=16, groups=2, split_k=2, use_dot=False, lookup=2, contiguous=True),
    # Y = X W^T (the weight the dot's second operand), rows padded to 64 or a tile of 16
    DecodeConfig(block_n=32, groups=2, split_k=2, use_dot=True, lookup=4, contiguous=True, x_first=True, block_m=64),
    DecodeConfig(block_n=16, groups=1, split_k=0, use_dot=True, lookup=2, contiguous=True, x_first=True),
    # split-K partials summed by each tile's last program (one launch)
    DecodeConfig(block_n=16, groups=1, split_k=3, use_dot=False, lookup=4, fused_sum=True),
    DecodeConfig(block_n=32, groups=1, split_k=2, use_dot=True, lookup=4, contiguous=True, fused_sum=True),
]
# fp32: the same products summed in another order (ieee dots / fp32 multiply-adds): sums of up
# to 384 unit-scale products, so a few 1e-5 apart near zero; fp16: both round the fp32 sum once
# to fp16 (2^-11 relative), so one ulp apart at most
TOL = {torch.float32: dict(rtol=1e-5, atol=6e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _weight(n: int, k: int, nested: bool, blocksize: int = 64, seed: int = 0) -> Nf4Weight:
    gen = torch.Generator().manual_seed(seed)
    return quantize_nf4_reference(torch.randn(n, k, generator=gen), blocksize=blocksize, double_quant=nested)


def _on(w: Nf4Weight, device) -> Nf4Weight:
    return Nf4Weight(*(t.to(device) if t is not None else None for t in
                       (w.data, w.absmax, w.code, w.nested_absmax, w.nested_code, w.offset)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "default" if c is None else
                         f"n{c.block_n}g{c.groups}s{c.split_k}{'dot' if c.use_dot else 'gemv'}l{c.lookup}m{c.block_m}"
                         f"{'c' if c.contiguous else ''}{'x' if c.x_first else ''}{'f' if c.fused_sum else ''}")
def test_forward_equals_the_reference(config, shape, nested, dtype, device):
    m, n, k = shape
    if (device.type == "cpu" and config is not None and not config.use_dot and config.lookup == 4 and config.block_m == 0
            and m > 5):
        # the interpreter runs these per-row GEMV programs for minutes at the wide shapes: past a
        # few rows it takes 9 or 12 rows, N off every block_n, K of three or five absmax blocks
        m, n, k = (9, 20, 192) if m < 40 else (12, 33, 320)
    w = _weight(n, k, nested)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    y = nf4_linear_decode(x.to(device), _on(w, device), bias.to(device), config=config).cpu()
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y, nf4_matmul_reference(x, w, transpose=True, bias=bias), **TOL[dtype])


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("blocksize", [32, 64, 128])
@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("lookup,contiguous,dtype", [(0, False, torch.float32), (1, False, torch.float32),
                                                     (2, False, torch.float32), (3, False, torch.float32),
                                                     (2, True, torch.float32), (4, False, torch.float16),
                                                     (4, True, torch.float16)])
def test_weight_is_dequantized_bit_for_bit(lookup, contiguous, dtype, use_dot, blocksize, nested, device):
    """Rows of the identity as ``x``: every output is one weight value times 1 (plus exact
    zeros), so the values the kernel built equal ``dequantize_nf4_reference`` bit for bit (all
    16 codes occur among the 37 x 10 values read back). Byte permutes build 16-bit values: fp16
    (exact through the product: one value times 1, summed with zeros in fp32)."""
    n, k = 37, 2 * blocksize
    w = _on(_weight(n, k, nested, blocksize, seed=3), device)
    want = dequantize_nf4_reference(w, dtype).cpu()
    eye = torch.eye(k, device=device, dtype=dtype)
    # both nibbles, each block's first and last values, across row ends (the interpreter is slow:
    # a sample of columns, every absmax block of W is still read by each product)
    cols = sorted({0, 1, blocksize - 2, blocksize - 1, blocksize, blocksize + 3, k - 2, k - 1, 7, k // 2 + 5})
    config = DecodeConfig(block_n=16, groups=1, split_k=2, use_dot=use_dot, lookup=lookup, contiguous=contiguous)
    y = nf4_linear_decode(eye[cols], w, config=config).cpu()
    assert y.dtype == dtype and torch.equal(y, want[:, cols].t())


def test_strided_x_reads_right(device):
    """A column slice of a wider tensor (row stride > K) is read through its strides."""
    w = _on(_weight(24, 128, True), device)
    wide = torch.randn(3, 140, device=device)
    x = wide[:, 5:133]
    for config in (default_config(1), default_config(3)):
        torch.testing.assert_close(nf4_linear_decode(x, w, config=config),
                                   nf4_matmul_reference(x.contiguous(), w, transpose=True), rtol=1e-5, atol=5e-5)


def test_inputs_are_checked():
    w = _weight(16, 128, False)
    with pytest.raises(ValueError, match=r"x must be 2-D \[M, 128\]"):
        nf4_linear_decode(torch.randn(2, 126), w)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS}"):
        nf4_linear_decode(torch.randn(MAX_ROWS + 1, 128), w)
    with pytest.raises(ValueError, match="multiple of the weight's blocksize 64"):
        nf4_linear_decode(torch.randn(2, 96), _weight(16, 96, False))


def test_auto_takes_the_decode_kernel_for_few_rows_on_cuda():
    """``nf4_gemm="auto"``: the decode kernel for 1..DECODE_ROWS rows on CUDA; the buffer for more
    rows, off CUDA, or when a weight's rows are not whole absmax blocks; explicit choices kept."""
    ws = [_weight(16, 128, True), _weight(8, 128, False)]
    assert nf4_forward_kind(1, True, ws) == "decode"
    assert nf4_forward_kind(DECODE_ROWS, True, ws) == "decode"
    assert nf4_forward_kind(DECODE_ROWS + 1, True, ws) == "buffer"
    assert nf4_forward_kind(0, True, ws) == "buffer"
    assert nf4_forward_kind(1, False, ws) == "buffer"
    assert nf4_forward_kind(1, True, ws + [_weight(4, 96, False)]) == "buffer"  # 96 = 1.5 blocks per row
    assert nf4_forward_kind(1, True, ws, "buffer") == "buffer"
    assert nf4_forward_kind(1, True, ws, "fused") == "fused"
    assert nf4_forward_kind(1, True, [_weight(4, 1024, False, blocksize=512)]) == "buffer"  # over the kernel's blocks
    assert DECODE_ROWS <= MAX_ROWS and DECODE_MAX_BLOCKSIZE == MAX_BLOCKSIZE


GROUP_CONFIGS = [
    None,
    DecodeConfig(block_n=16, groups=1, split_k=3, use_dot=False, lookup=4),
    DecodeConfig(block_n=32, groups=2, split_k=2, use_dot=True, lookup=4, contiguous=True, x_first=True, block_m=64),
    DecodeConfig(block_n=16, groups=1, split_k=2, use_dot=True, lookup=4, contiguous=True, fused_sum=True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,bias", [((40, 16, 16), False), ((33, 47), True), ((20,), True)])
@pytest.mark.parametrize("config", GROUP_CONFIGS, ids=lambda c: "default" if c is None else
                         f"n{c.block_n}s{c.split_k}{'dot' if c.use_dot else 'gemv'}{'f' if c.fused_sum else ''}")
def test_group_in_one_launch_equals_each_reference(config, rows, bias, dtype, device):
    """q/k/v- and gate/up-like groups (row counts off every tile, one weight alone too), one
    launch: each output is its weight's reference product, a column view of one tensor."""
    k = 192
    ws = [_weight(n, k, True, seed=i) for i, n in enumerate(rows)]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, k, generator=gen).to(dtype)
    bs = [torch.randn(n, generator=gen).to(dtype) if bias else None for n in rows]
    ys = nf4_decode_group(x.to(device), [_on(w, device) for w in ws], [b.to(device) if bias else None for b in bs],
                          config=config)
    assert len(ys) == len(rows)
    for y, w, b in zip(ys, ws, bs):
        assert y.shape == (5, w.shape[0]) and y.stride(0) == sum(rows)
        torch.testing.assert_close(y.cpu(), nf4_matmul_reference(x, w, transpose=True, bias=b), **TOL[dtype])


def test_workspace_counters_are_left_zeroed(device):
    """Split-K summed in the launch with a kept workspace: each launch sets its counters back to
    0, so repeated calls (as graph replays) stay right without a fill; another shape reuses it."""
    ws = DecodeWorkspace.create(device, counters=64)
    cfg = DecodeConfig(block_n=16, groups=1, split_k=3, use_dot=False, lookup=4, fused_sum=True)
    for n, seed in ((47, 0), (47, 1), (20, 2)):
        w = _weight(n, 192, False, seed=seed)
        x = torch.randn(3, 192, generator=torch.Generator().manual_seed(seed)).to(torch.float16)
        y = nf4_linear_decode(x.to(device), _on(w, device), config=cfg, workspace=ws)
        torch.testing.assert_close(y.cpu(), nf4_matmul_reference(x, w, transpose=True), **TOL[torch.float16])
        assert int(ws.counters.count_nonzero()) == 0


def test_what_groups():
    ws = [_weight(16, 128, True), _weight(8, 128, True)]
    assert groupable(ws, [None, None])
    assert not groupable(ws, [torch.zeros(16), None])  # biases on some only
    assert not groupable(ws + [_weight(8, 128, False)], [None] * 3)  # another absmax layout
    assert groupable([_weight(2048, 128, True), ws[1]], [None] * 2)  # 256 absmax a nested block, and one block
    assert not groupable([ws[0], _weight(8, 192, True)], [None] * 2)  # another K
    assert not groupable(ws * 2, [None] * 4) and MAX_GROUP == 3
    with pytest.raises(ValueError, match="at most 3 sharing K"):
        nf4_decode_group(torch.randn(2, 128), ws * 2, [None] * 4)


def test_inference_group_is_one_launch_with_the_callers_workspace(monkeypatch, device):
    """The engine's path (``nf4_frozen_projections`` without grad, a workspace kept by the
    caller): a q/k/v-like group as the decode kernel's one launch, outputs column views of one
    tensor, each its weight's reference product; with autograd each output stays its own."""
    from lightning_lorafusion.kernels import nf4, nf4_decode

    monkeypatch.setattr(nf4, "nf4_forward_kind", lambda *a, **k: "decode")  # the CPU takes the buffer path
    monkeypatch.setattr(nf4_decode, "default_config", lambda m, shape=None: DecodeConfig(
        block_n=16, groups=1, split_k=2, use_dot=True, lookup=4, contiguous=True, fused_sum=True))
    ws = [_weight(n, 128, True, seed=i) for i, n in enumerate((32, 16, 16))]
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    workspace = nf4_decode.DecodeWorkspace.create(device, counters=16)
    with torch.no_grad():
        ys = nf4.nf4_frozen_projections(x.to(device), [_on(w, device) for w in ws], [None] * 3, workspace=workspace)
    assert len({y.untyped_storage().data_ptr() for y in ys}) == 1 and ys[1].stride(0) == 64
    for y, w in zip(ys, ws):
        torch.testing.assert_close(y.cpu(), nf4_matmul_reference(x, w, transpose=True), **TOL[torch.float16])
    assert int(workspace.counters.count_nonzero()) == 0
    xg = x.to(device).float().requires_grad_()
    ys = nf4.nf4_frozen_projections(xg, [_on(w, device) for w in ws], [None] * 3)
    assert len({y.untyped_storage().data_ptr() for y in ys}) == 3


def test_decode_workspace_only_for_an_nf4_base_on_cuda():
    from lightning_lorafusion.kernels.nf4 import nf4_decode_workspace

    nf4_params = {"layers": [{"q_proj": _weight(16, 128, True).to_params()}]}
    assert nf4_decode_workspace(nf4_params, "cpu") is None
    assert nf4_decode_workspace({"layers": [{"q_proj": {"weight": torch.zeros(2, 2)}}]}, "cpu") is None
