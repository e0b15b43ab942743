"""Triton kernels of NF4 dequantization (``nf4.dequantize_nf4_reference`` is their spec, bit for bit).

16-bit outputs of whole absmax blocks (every weight of the models here) take the block kernel:
one program expands ``BLOCKS`` absmax blocks, reading each block's absmax once and its codes as
32-bit words of 8, turned into values by byte permutes in per-block tables of the 16 final values
(``nf4_lookup``), so each thread writes 16 contiguous bytes per word. Other cases (fp32 output, a
short last block) take the byte kernel: one program expands ``BLOCK`` packed bytes into ``2 *
BLOCK`` values, high nibble first, each ``code[c] * absmax[i // blocksize]`` in fp32 and then
cast, the codebook and absmax gathered per byte. Either way a double-quantized absmax is undone in
the same kernel (``dyn[q] * nested_absmax[j // nested_blocksize] + offset``), with floating-point
contraction off so the multiply-add rounds like the reference's two ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .nf4_lookup import nf4_words_to_values

BLOCK = 1024  # packed bytes per program (byte kernel)
BLOCKS = 64  # absmax blocks per program (block kernel)
BLOCK_WARPS = 4
WORD_BLOCKSIZES = (32, 64, 128, 256)  # block sizes the block kernel serves (4 to 32 words a block)


@triton.jit
def nf4_byte_pair(data_ptr, absmax_ptr, code_ptr, nested_ptr, dyn_ptr, offset_ptr, byte, mask,
                  BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr):
    """fp32 ``(value 2 * byte, value 2 * byte + 1)`` of the packed NF4 bytes at ``byte`` (an
    index tensor; masked entries are 0): the byte's high and low nibble through the codebook,
    times the absmax of their block (decoded from its 8-bit code and the nested scale with
    double quantization). One byte load and one absmax per pair of values."""
    packed = tl.load(data_ptr + byte, mask=mask, other=0).to(tl.int32)
    block = (2 * byte) // BLOCKSIZE  # both values of a byte share a block (block sizes are even)
    if NESTED:
        q = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
        scale = tl.load(dyn_ptr + q) * tl.load(nested_ptr + block // NESTED_BLOCKSIZE, mask=mask, other=0.0)
        scale = scale + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax_ptr + block, mask=mask, other=0.0)
    hi = tl.load(code_ptr + (packed >> 4)) * scale
    lo = tl.load(code_ptr + (packed & 15)) * scale
    return tl.where(mask, hi, 0.0), tl.where(mask, lo, 0.0)


@triton.jit
def _nf4_dequant_kernel(data_ptr, absmax_ptr, code_ptr, nested_ptr, dyn_ptr, offset_ptr, out_ptr,
                        n_bytes, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr,
                        BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    byte = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = byte < n_bytes
    hi, lo = nf4_byte_pair(data_ptr, absmax_ptr, code_ptr, nested_ptr, dyn_ptr, offset_ptr, byte, mask,
                           BLOCKSIZE, NESTED, NESTED_BLOCKSIZE)
    values = tl.interleave(hi, lo)
    out = 2 * pid.to(tl.int64) * BLOCK + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + out, values.to(out_ptr.dtype.element_ty), mask=out < 2 * n_bytes)


@triton.jit
def _nf4_dequant_blocks_kernel(data_ptr, absmax_ptr, code_ptr, nested_ptr, dyn_ptr, offset_ptr, out_ptr, n_blocks,
                               BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr,
                               BLOCKS: tl.constexpr, ASM: tl.constexpr):
    """Absmax blocks ``[pid * BLOCKS, +BLOCKS)`` of the weight (16-bit ``out``): the absmax once
    per block, the codes as uint32 words of 8 (``BLOCKSIZE / 8`` a block)."""
    words_per_block: tl.constexpr = BLOCKSIZE // 8
    blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    mask = blk < n_blocks
    if NESTED:
        q = tl.load(absmax_ptr + blk, mask=mask, other=0).to(tl.int32)
        scale = tl.load(dyn_ptr + q) * tl.load(nested_ptr + blk // NESTED_BLOCKSIZE, mask=mask, other=0.0)
        scale = scale + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax_ptr + blk, mask=mask, other=0.0)
    w = tl.arange(0, words_per_block)
    words = tl.load(data_ptr.to(tl.pointer_type(tl.uint32)) + (blk[:, None, None] * words_per_block + w[None, None, :]),
                    mask=mask[:, None, None], other=0)
    values = nf4_words_to_values(words, scale[:, None], code_ptr, out_ptr.dtype.element_ty, True, ASM)
    out = blk[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
    tl.store(out_ptr + out, values, mask=mask[:, None])


def uses_block_kernel(data: torch.Tensor, blocksize: int, dtype: torch.dtype) -> bool:
    """Whether ``dequantize_nf4_triton`` takes the block kernel: a 16-bit output, whole absmax
    blocks of 32 to 256 values, the packed bytes contiguous and 4-byte aligned."""
    return (dtype in (torch.float16, torch.bfloat16) and blocksize in WORD_BLOCKSIZES
            and (2 * data.numel()) % blocksize == 0 and data.is_contiguous() and data.data_ptr() % 4 == 0)


def dequantize_nf4_triton(data: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int,
                          nested: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None, *,
                          dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
                          force_bytes: bool = False, blocks: int = BLOCKS, num_warps: int = BLOCK_WARPS
                          ) -> torch.Tensor:
    """An ``nf4.Nf4Weight``'s pieces -> ``[N, K]`` in ``dtype`` (``data`` uint8 ``[N, K/2]``;
    ``nested``: (nested_absmax, nested_code, offset [1], nested_blocksize) when ``absmax`` holds
    uint8 indices). ``out``: a contiguous buffer of at least ``N * K`` ``dtype`` elements to
    write into (its leading part is returned, viewed as ``[N, K]``). ``force_bytes``: the byte
    kernel even where the block kernel serves (benchmarks and tests compare the two);
    ``blocks``, ``num_warps``: the block kernel's tiling (powers of two)."""
    n, k = data.shape[0], 2 * data.shape[1]
    if out is None:
        out = torch.empty(n * k, dtype=dtype, device=data.device)
    if out.dtype != dtype or not out.is_contiguous() or out.numel() < n * k or out.device != data.device:
        raise ValueError(f"out must be a contiguous {dtype} buffer of >= {n * k} elements on {data.device}")
    view = out.view(-1)[: n * k]
    n_bytes = data.numel()
    nested_absmax, nested_code, offset, nested_blocksize = nested if nested is not None else (code, code, code, 1)
    if n_bytes and uses_block_kernel(data, blocksize, dtype) and not force_bytes:
        n_blocks = 2 * n_bytes // blocksize
        _nf4_dequant_blocks_kernel[(triton.cdiv(n_blocks, blocks),)](
            data, absmax, code, nested_absmax, nested_code, offset, view, n_blocks, BLOCKSIZE=blocksize,
            NESTED=nested is not None, NESTED_BLOCKSIZE=nested_blocksize, BLOCKS=blocks, ASM=data.is_cuda,
            num_warps=num_warps, enable_fp_fusion=False)
        return view.view(n, k)
    _nf4_dequant_kernel[(triton.cdiv(n_bytes, BLOCK),)](
        data, absmax, code, nested_absmax, nested_code, offset, view, n_bytes, BLOCKSIZE=blocksize,
        NESTED=nested is not None, NESTED_BLOCKSIZE=nested_blocksize, BLOCK=BLOCK, enable_fp_fusion=False)
    return view.view(n, k)
