"""The byte-permute lookup of NF4 codes (``kernels/nf4_lookup.py``): its PTX (the text the GPU runs)
executed here instruction by instruction by a small interpreter of the handful of instructions it
uses, and its Triton emulation under the Triton interpreter, both bit for bit against the torch
reference values ``code[c] * absmax`` rounded once to fp16/bf16, for every code and all 8
positions of a word, both output orders."""

import re

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from lightning_lorafusion.kernels import nf4_lookup
from lightning_lorafusion.kernels.nf4 import nf4_code

M32 = 0xFFFFFFFF


def _prmt(a: int, b: int, s: int) -> int:
    """PTX ``prmt.b32`` default mode (the ISA's definition, written independently of the kernel's)."""
    src = (b << 32) | a
    out = 0
    for i in range(4):
        n = (s >> (4 * i)) & 15
        byte = (src >> (8 * (n & 7))) & 0xFF
        if n & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def _cvt16(value: float, dtype: torch.dtype) -> int:
    return int(torch.tensor([value], dtype=torch.float32).to(dtype).view(torch.int16).item()) & 0xFFFF


def run_ptx(text: str, operands: dict[int, object], dtype: torch.dtype) -> dict[int, int]:
    """Execute the inline PTX ``text`` with ``$i`` inputs from ``operands`` (ints: 32-bit
    registers, floats: f32); returns every ``$i`` it wrote (16- or 32-bit ints)."""
    regs = {f"${k}": v for k, v in operands.items()}

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    for line in text.splitlines():
        line = line.split("//")[0].strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32":
            m = re.match(r"\{(\S+),\s*(\S+)\},\s*(\S+)", rest)
            q = val(m.group(3))
            regs[m.group(1)], regs[m.group(2)] = q & 0xFFFF, q >> 16
            continue
        d, *args = [t.strip() for t in rest.split(",")]
        if op.startswith("cvt.rn."):
            hi, lo = (_cvt16(regs[t], dtype) for t in args)
            regs[d] = (hi << 16) | lo
            continue
        v = [val(t) for t in args]
        regs[d] = {"xor.b32": lambda: v[0] ^ v[1], "and.b32": lambda: v[0] & v[1], "or.b32": lambda: v[0] | v[1],
                   "shl.b32": lambda: (v[0] << v[1]) & M32, "shr.u32": lambda: v[0] >> v[1],
                   "prmt.b32": lambda: _prmt(v[0], v[1], v[2]),
                   "lop3.b32": lambda: _lop3(v[0], v[1], v[2], v[3])}[op]()
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$") and int(k[1:]) not in operands}


def _case(dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    scale = float(np.float32(torch.rand(1, generator=gen).item() * 4 + 0.01))
    codes = torch.randint(0, 16, (8,), generator=gen)
    # byte j holds k = 2j (high nibble) and 2j + 1 (low nibble); the word is little-endian
    word = sum(((int(codes[2 * j]) << 4) | int(codes[2 * j + 1])) << (8 * j) for j in range(4))
    want = (nf4_code() * scale).to(dtype).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    return scale, codes, word, want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split", [False, True])
def test_ptx_looks_up_every_code_bit_for_bit(split, dtype):
    """Tables from the table PTX, then words through the lookup PTX: each output is the
    reference value of its code (both orders: ``k0..k7``, or even then odd ``k`` per pair)."""
    table_asm = (nf4_lookup.TABLE_ASM_BF16 if dtype == torch.bfloat16 else nf4_lookup.TABLE_ASM_F16).value
    lookup_asm = (nf4_lookup.LOOKUP_ASM_SPLIT if split else nf4_lookup.LOOKUP_ASM_CONTIG).value
    order = [0, 2, 1, 3, 4, 6, 5, 7] if split else list(range(8))
    seen = set()
    for seed in range(40):
        scale, codes, word, want = _case(dtype, seed)
        products = {8 + c: float(np.float32(nf4_code()[c].item()) * np.float32(scale)) for c in range(16)}
        tables = run_ptx(table_asm, products, dtype)
        outs = run_ptx(lookup_asm, {8: word, **{9 + i: tables[i] for i in range(8)}}, dtype)
        got = [outs[i] for i in range(8)]
        assert got == [int(want[codes[k]]) for k in order], (seed, codes.tolist())
        seen.update(codes.tolist())
    assert seen == set(range(16))


@triton.jit
def _lookup_kernel(w_ptr, s_ptr, code_ptr, out_ptr, dtype: tl.constexpr, CONTIG: tl.constexpr):
    r = tl.arange(0, 4)
    g = tl.arange(0, 2)
    nw = tl.arange(0, 8)
    words = tl.load(w_ptr + r[:, None, None] * 16 + g[None, :, None] * 8 + nw[None, None, :])
    scale = tl.load(s_ptr + r[:, None] * 2 + g[None, :])
    if CONTIG:
        v = nf4_lookup.nf4_words_to_values(words, scale, code_ptr, dtype, True, False)
        tl.store(out_ptr + r[:, None] * 128 + tl.arange(0, 128)[None, :], v)
    else:
        even, odd = nf4_lookup.nf4_words_to_values(words, scale, code_ptr, dtype, False, False)
        k = tl.arange(0, 32)
        base = out_ptr + r[:, None, None] * 128 + g[None, :, None] * 64 + 2 * k[None, None, :]
        tl.store(base, even)
        tl.store(base + 1, odd)


@pytest.mark.parametrize("contig", [True, False])
def test_emulated_lookup_is_bit_exact(contig):
    """The same steps in Triton integer operations (what runs off CUDA; on a GPU the test runs
    them compiled): 4 rows x 2 absmax blocks of 64 codes, fp16 (bf16 is wrong in the Triton
    interpreter)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (4, 64), dtype=torch.uint8, generator=gen)
    scale = torch.rand(4, 2, generator=gen) * 3
    code = nf4_code()
    codes = torch.stack([data >> 4, data & 15], -1).reshape(4, 128).long()
    want = (code[codes] * scale.repeat_interleave(64, 1)).half()
    out = torch.empty(4, 128, dtype=torch.float16, device=device)
    _lookup_kernel[(1,)](data.view(torch.int32).to(device), scale.to(device), code.to(device), out, tl.float16,
                         contig)
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))
