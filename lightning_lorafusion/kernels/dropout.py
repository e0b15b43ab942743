"""Counter-based dropout masks: a pure hash of (seed, offset, row, col), reproducible anywhere.

The same function is evaluated inside the Triton kernels (uint32 arithmetic) and here in
torch (int64 arithmetic masked to 32 bits), so the torch reference and the fused kernels
drop exactly the same elements, and backward regenerates the forward's mask instead of
storing it.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# Odd multipliers (golden ratio and murmur3 constants) that spread each coordinate.
_C_SEED = 0x9E3779B1
_C_OFFSET = 0x85EBCA77
_C_ROW = 0xC2B2AE3D
_C_COL = 0x27D4EB2F
_FMIX1 = 0x85EBCA6B
_FMIX2 = 0xC2B2AE35
_INV_C_OFFSET = pow(_C_OFFSET, -1, 1 << 32)  # _C_OFFSET is odd: invertible mod 2^32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _FMIX1) & _MASK32
    x = x ^ (x >> 13)
    x = (x * _FMIX2) & _MASK32
    return x ^ (x >> 16)


def hash_uniform16(seed: int, offset: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """16 random bits in [0, 2^16) per (row, col); rows [R, 1] and cols [1, C] broadcast.

    One 32-bit hash serves a pair of rows (2i, 2i+1) at a column: row 2i takes its low 16 bits,
    row 2i+1 its high 16 bits. The kernels thus hash half of the elements they mask.
    """
    base = ((seed * _C_SEED) ^ (offset * _C_OFFSET)) & _MASK32
    rows = rows.to(torch.int64)
    x = (base ^ (((rows >> 1) * _C_ROW) & _MASK32)) & _MASK32
    x = _fmix32(x)
    x = (x ^ ((cols.to(torch.int64) * _C_COL) & _MASK32)) & _MASK32
    x = _fmix32(x)
    return torch.where((rows & 1).bool(), x >> 16, x & 0xFFFF)


def dropout_keep_threshold(p: float) -> int:
    """Elements whose 16-bit hash is >= this are kept; keep probability is 1 - p (to 2^-16)."""
    return int(round(p * (1 << 16)))


def dropout_keep_mask(
    seed: int, offset: int, row_start: int, rows: int, cols: int, p: float, device=None
) -> torch.Tensor:
    """Boolean keep-mask ``[rows, cols]`` for token rows ``row_start .. row_start+rows``.

    ``row`` is the token's index in the microbatch, ``col`` the input feature; ``seed`` is the
    adapter's seed and ``offset`` distinguishes microbatches and layers (see ``dropout_offset``).
    """
    if p <= 0.0:
        return torch.ones(rows, cols, dtype=torch.bool, device=device)
    r = torch.arange(row_start, row_start + rows, device=device, dtype=torch.int64)[:, None]
    c = torch.arange(cols, device=device, dtype=torch.int64)[None, :]
    return hash_uniform16(seed, offset, r, c) >= dropout_keep_threshold(p)


def _fmix32_int(x: int) -> int:
    """``_fmix32`` on one Python int (a bijection of 32-bit values; 0 maps to 0)."""
    x ^= x >> 16
    x = (x * _FMIX1) & _MASK32
    x ^= x >> 13
    x = (x * _FMIX2) & _MASK32
    return x ^ (x >> 16)


def microbatch_hash(microbatch_index: int) -> int:
    """The microbatch's share of the hash base (0 for microbatch 0)."""
    return _fmix32_int(microbatch_index & _MASK32)


def dropout_offset(microbatch_index: int, layer: int, input_slot: int) -> int:
    """Offset for one (microbatch, layer, input) triple; input_slot 0: attn input, 1: o_proj
    input, 2: MLP input, 3: down_proj input. Shared-input projections share one mask.

    Chosen so that the microbatch enters the hash base by xor: ``offset * _C_OFFSET`` (what
    the base takes, mod 2^32) is ``microbatch_hash(microbatch_index) ^ ((layer * 4 + slot) *
    _C_OFFSET)``. A CUDA graph captured at microbatch 0 (its offsets are launch constants)
    replays microbatch ``i`` with each adapter's seed hash xored with ``microbatch_hash(i)``,
    a device table entry, and draws exactly the masks an eager step draws
    (``kernels/static_routing.py``).
    """
    layer_part = ((layer * 4 + input_slot) * _C_OFFSET) & _MASK32
    return ((microbatch_hash(microbatch_index) ^ layer_part) * _INV_C_OFFSET) & _MASK32
