"""The few-rows frozen product (``skinny_gemm``) against ``F.linear`` in fp32 and fp16 (bf16 is
wrong in the Triton interpreter): odd N and K, K not a multiple of the loop step, split-K with
the sum in the launch (counters left zeroed for the next call), both dot orders, rows past one
tile, writing into a strided output; and which products the engine's plan sends to it."""

import pytest
import torch

from lightning_lorafusion.kernels.skinny_gemm import (
    MAX_ROWS, SkinnyConfig, SkinnyPlan, SkinnyWorkspace, default_config, plain_linear, skinny_linear,
    skinny_linear_reference,
)

SHAPES = [(1, 47, 96), (5, 64, 123), (17, 33, 64), (40, 20, 200)]
CONFIGS = [
    SkinnyConfig(block_n=16, block_k=16),  # split-K by fill: several splits
    SkinnyConfig(block_n=32, block_k=32, split_k=1),  # no split: the tile stored directly
    SkinnyConfig(block_n=16, block_k=32, split_k=3),
    SkinnyConfig(block_n=16, block_k=16, split_k=2, x_first=True),
    SkinnyConfig(block_n=32, block_k=16, block_m=16, x_first=True, fill=2),  # rows over several tiles
    SkinnyConfig(block_n=16, block_k=64, block_m=16, split_k=2),
]
# fp32: the same products summed in another order (ieee dots), sums of up to 200 unit-scale
# products; fp16: both round an fp32 sum once to fp16
TOL = {torch.float32: dict(rtol=1e-5, atol=5e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"n{c.block_n}k{c.block_k}s{c.split_k}m{c.block_m}"
                         + ("xw" if c.x_first else ""))
def test_skinny_linear_matches_reference(device, dtype, cfg):
    gen = torch.Generator().manual_seed(0)
    ws = SkinnyWorkspace.create(device, 256)
    for m, n, k in SHAPES:
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        w = torch.randn(n, k, generator=gen).to(device, dtype)
        want = skinny_linear_reference(x.float(), w.float())
        for _ in range(2):  # a second call reuses the counters the first left
            got = skinny_linear(x, w, config=cfg, workspace=ws)
            assert got.dtype == dtype and got.shape == (m, n)
            torch.testing.assert_close(got.float(), want, **TOL[dtype])
        assert int(ws.counters.abs().sum()) == 0  # every tile's counter set back to 0


def test_skinny_linear_writes_into_a_strided_output(device):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 80, generator=gen).to(device)
    w = torch.randn(24, 80, generator=gen).to(device)
    out = torch.full((3, 40), 7.0, device=device)
    skinny_linear(x, w, config=SkinnyConfig(block_n=16, block_k=16, split_k=2), out=out[:, 8:32])
    torch.testing.assert_close(out[:, 8:32], x @ w.t(), **TOL[torch.float32])
    assert bool((out[:, :8] == 7).all()) and bool((out[:, 32:] == 7).all())


def test_skinny_linear_rejects_what_it_does_not_serve(device):
    w = torch.randn(8, 16, device=device)
    with pytest.raises(ValueError, match="at most"):
        skinny_linear(torch.randn(MAX_ROWS + 1, 16, device=device), w)
    with pytest.raises(ValueError, match="share K"):
        skinny_linear(torch.randn(2, 8, device=device), w)
    with pytest.raises(ValueError, match="power of two"):
        SkinnyConfig(block_n=24)


def test_plan_sends_few_rows_without_bias_and_the_rest_to_f_linear(device, monkeypatch):
    from lightning_lorafusion.kernels import skinny_gemm

    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda x, w, **kw: calls.append(x.shape[0]) or real(x, w, **kw))
    small = SkinnyConfig(block_n=16, block_k=16)
    plan = SkinnyPlan(SkinnyWorkspace.create(device, 64), choose=lambda m, n, k: small if m <= 16 else None)
    w, b = torch.randn(20, 32, device=device), torch.randn(20, device=device)
    for m in (1, 16, 64, 65, MAX_ROWS + 1):
        x = torch.randn(m, 32, device=device)
        torch.testing.assert_close(plain_linear(plan, x, w), x @ w.t(), **TOL[torch.float32])
    torch.testing.assert_close(plain_linear(plan, torch.ones(2, 32, device=device), w, b),
                               torch.ones(2, 32, device=device) @ w.t() + b)
    assert calls == [1, 16]  # 64 rows: none chosen; past MAX_ROWS and with a bias: F.linear
    assert plain_linear(None, torch.ones(1, 32, device=device), w).shape == (1, 20)


def test_default_config_takes_the_wide_products_of_few_rows():
    """The LM head up to 64 rows, gate/up up to 8; o, q/k/v, down and wider steps stay cuBLAS's."""
    assert default_config(64, 128256, 4096) is not None and default_config(65, 128256, 4096) is None
    assert default_config(8, 28672, 4096) is not None and default_config(16, 28672, 4096) is None
    for n, k in ((4096, 4096), (6144, 4096), (4096, 14336)):
        assert all(default_config(m, n, k) is None for m in (1, 4, 16, 64))


def test_plan_for_mode():
    cpu = torch.device("cpu")
    assert SkinnyPlan.for_mode("auto", cpu, torch.bfloat16) is None  # CUDA only
    assert SkinnyPlan.for_mode("cublas", cpu, torch.bfloat16) is None
    with pytest.raises(ValueError, match="decode_gemm"):
        SkinnyPlan.for_mode("fast", cpu, torch.bfloat16)
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert SkinnyPlan.for_mode("triton", cuda, torch.bfloat16) is not None
        assert SkinnyPlan.for_mode("triton", cuda, torch.float32) is None
