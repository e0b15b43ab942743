"""Triton kernel of NF4 dequantization (``nf4.dequantize_nf4_reference`` is its spec, bit for bit).

One program expands ``BLOCK`` packed bytes into ``2 * BLOCK`` values: high nibble first, each
``code[c] * absmax[i // blocksize]`` in fp32 and then cast. A double-quantized absmax is
undone in the same kernel (``dyn[q] * nested_absmax[j // nested_blocksize] + offset``), with
floating-point contraction off so the multiply-add rounds like the reference's two ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # packed bytes per program


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


def dequantize_nf4_triton(data: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int,
                          nested: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None, *,
                          dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """An ``nf4.Nf4Weight``'s pieces -> ``[N, K]`` in ``dtype`` (``data`` uint8 ``[N, K/2]``;
    ``nested``: (nested_absmax, nested_code, offset [1], nested_blocksize) when ``absmax`` holds
    uint8 indices). ``out``: a contiguous buffer of at least ``N * K`` ``dtype`` elements to
    write into (its leading part is returned, viewed as ``[N, K]``)."""
    n, k = data.shape[0], 2 * data.shape[1]
    if out is None:
        out = torch.empty(n * k, dtype=dtype, device=data.device)
    if out.dtype != dtype or not out.is_contiguous() or out.numel() < n * k or out.device != data.device:
        raise ValueError(f"out must be a contiguous {dtype} buffer of >= {n * k} elements on {data.device}")
    view = out.view(-1)[: n * k]
    n_bytes = data.numel()
    nested_absmax, nested_code, offset, nested_blocksize = nested if nested is not None else (code, code, code, 1)
    _nf4_dequant_kernel[(triton.cdiv(n_bytes, BLOCK),)](
        data, absmax, code, nested_absmax, nested_code, offset, view, n_bytes, BLOCKSIZE=blocksize,
        NESTED=nested is not None, NESTED_BLOCKSIZE=nested_blocksize, BLOCK=BLOCK, enable_fp_fusion=False)
    return view.view(n, k)
