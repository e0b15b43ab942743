"""SwiGLU with the prefill rows' gate/up LoRA in it (``segment_swiglu``) against its torch
reference (``segment_lora_reference`` into copies of gate and up, then the eager ops).

Interpreter runs on the CPU in fp32 / fp16 (bf16 on the GPU only). Tolerances: fp32 1e-5
(summation order only); fp16 2e-3 (the same roundings as the reference: each sum once, silu
once, the product once; a sum that lands on a rounding boundary may round the other way, and
SwiGLU carries that ulp); bf16 1.6e-2 as in test_lora_segments.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_lorafusion.kernels.lora_segments import segment_lora_shrink
from lightning_lorafusion.kernels.segment_swiglu import swiglu_segments, swiglu_segments_reference
from test_lora_segments import GPU_ONLY, TOL, make_covering_lora, make_pool, rel_err

DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=GPU_ONLY)]
# gate/up ranks per adapter: one above the 16-wide interpreter chunk (37: three chunks), an
# untargeted up, an adapter of rank 0 everywhere
RANKS = [(8, 8), (20, 20), (3, 0), (16, 16), (0, 0), (37, 37)]
ROWS, K, I = 120, 40, 72
# rows 0-6 and 107-119 in no segment (a mixed step's decode rows, padding); 1-row segments
SEGMENTS = [(7, 8, 5), (8, 37, 1), (37, 40, 0), (44, 45, 2), (45, 90, 3), (90, 92, 4), (92, 107, 5)]


def case(dtype, device, seed=0, pad_tiles=0, live=None):
    pool, a_off, b_off, rk, _ = make_pool(RANKS, K, (I, I), dtype, device, seed=seed)
    scales = torch.tensor([2.0, 0.125, 1.0, 0.5, 1.0, 0.25])
    lora = make_covering_lora(pool, a_off, b_off, rk, scales, SEGMENTS, 16, ROWS, pad_tiles=pad_tiles)
    if live is not None:
        lora = dataclasses.replace(lora, live=torch.tensor([live], dtype=torch.int32, device=device))
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(ROWS, K, generator=g).to(device, dtype)
    gate_up = (torch.randn(ROWS, 2 * I, generator=g) * 2).to(device, dtype)
    gate, up = gate_up.split([I, I], dim=1)
    return lora, x, gate, up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_blocks", [1, 3])
def test_swiglu_segments_matches_the_reference(device, dtype, n_blocks):
    """Column views of one gate|up output, mixed ranks, 1-row segments, gap rows (plain SwiGLU),
    1 or 3 column blocks a program (the last past the width); gate and up not written."""
    lora, x, gate, up = case(dtype, device)
    before = (gate.clone(), up.clone())
    s, _ = segment_lora_shrink(x, lora, form="splitk", split_k=3)
    got = swiglu_segments(gate, up, lora, s, n_blocks=n_blocks)
    want = swiglu_segments_reference(x, gate, up, lora)
    assert rel_err(got, want) < TOL[dtype]
    assert torch.equal(gate, before[0]) and torch.equal(up, before[1])
    plain = torch.nn.functional.silu(gate) * up
    assert rel_err(got[:7], plain[:7]) < TOL[dtype] and rel_err(got[107:], plain[107:]) < TOL[dtype]
    assert rel_err(got[90:92], plain[90:92]) < TOL[dtype]  # adapter 4: rank 0
    assert not torch.allclose(got[8:37].float(), plain[8:37].float(), rtol=1e-2, atol=1e-2)  # the LoRA is in


def test_swiglu_segments_live_grid_equals_the_table_grid(device):
    """A table padded with 25 empty tiles and its live count: a few programs walk the live
    tiles' items, the output bit for bit the table grid's; a count of 1 writes the first tile only."""
    lora, x, gate, up = case(torch.float32, device, seed=3, pad_tiles=25)
    s, _ = segment_lora_shrink(x, lora, form="splitk", split_k=2)
    table = swiglu_segments(gate, up, lora, s)
    n_live = int((lora.tiles[1] > lora.tiles[0]).sum())
    walked = swiglu_segments(gate, up, dataclasses.replace(lora, live=torch.tensor([n_live], dtype=torch.int32,
                                                                                     device=device)), s)
    assert torch.equal(table, walked)
    first = torch.full_like(table, float("nan"))
    swiglu_segments(gate, up, dataclasses.replace(lora, live=torch.tensor([1], dtype=torch.int32, device=device)), s,
                    out=first)
    rows = int(lora.tiles[1, 0])
    assert torch.equal(first[:rows], table[:rows]) and first[rows:].isnan().all()


def test_swiglu_segments_refuses_bad_arguments(device):
    lora, x, gate, up = case(torch.float32, device, seed=5)
    s, _ = segment_lora_shrink(x, lora, form="splitk", split_k=2)
    with pytest.raises(ValueError, match="s must be"):
        swiglu_segments(gate, up, lora, s[:, :1])
    with pytest.raises(ValueError, match="gate and up"):
        swiglu_segments(gate, up[:, :-1], lora, s)
    with pytest.raises(ValueError, match="out must be"):
        swiglu_segments(gate, up, lora, s, out=torch.empty(ROWS, I + 1, device=device))
