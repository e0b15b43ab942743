"""NF4 codes to 16-bit values by byte permutes: each absmax block's 16 final values
(``code[c] * absmax`` in fp32, rounded once to fp16/bf16, as ``nf4.dequantize_nf4_reference``)
are built once and held as 8 32-bit registers (the 16 low bytes in ``L0..L3``, the 16 high bytes
in ``H0..H3``); then every 32-bit word of packed codes (8 values) is looked up with ``prmt``
(PTX byte permute: any 4 bytes of 2 registers, picked by 4 nibbles, which are our codes).

Per word: 8 permutes pick the low and high bytes of codes 0-7 and 8-15 for 4 codes at a time,
4 bitwise selects choose between them by each code's bit 3 (masks built by 2 more permutes in
their sign-copying mode), 4 pair the bytes into 16-bit values: 22 instructions per 8 values
against ~7.5 per value for the codebook gathered in registers. On CUDA it is
inline PTX; under the Triton interpreter (no PTX) the same steps run as integer operations
(``_prmt``), so the interpreter tests check the selector arithmetic the PTX uses.

Word layout (bitsandbytes: byte ``j`` of a row holds ``k = 2j`` in its high nibble and ``2j + 1``
in its low one, little-endian words): nibbles 0..7 of a word are ``k1 k0 k3 k2 k5 k4 k7 k6``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# prmt selectors pairing looked-up low bytes ``lo = [L(k1), L(k0), L(k3), L(k2)]`` (bytes 0-3)
# with high bytes ``hi`` (4-7) into two 16-bit values, lower half first:
# k order: (k0, k1), (k2, k3); even/odd split: (k0, k2), (k1, k3)
PAIR_CONTIG = (0x4051, 0x6273)
PAIR_SPLIT = (0x7351, 0x6240)


def _table_asm(cvt: str) -> str:
    pack = "".join(f"cvt.rn.{cvt}.f32 p{i}, ${9 + 2 * i}, ${8 + 2 * i};\n" for i in range(8))
    split = "".join(f"prmt.b32 ${i}, p{2 * i}, p{2 * i + 1}, 0x6420;\n" for i in range(4))
    split += "".join(f"prmt.b32 ${4 + i}, p{2 * i}, p{2 * i + 1}, 0x7531;\n" for i in range(4))
    return "{\n.reg .b32 p<8>;\n" + pack + split + "}"


def _half_asm(a: str, b: str, mask: str, outs: tuple[int, int, int, int], pair: tuple[int, int]) -> str:
    """4 codes -> 4 16-bit outputs (operands ``outs``): ``a`` selects them among values 0-7
    (codes 8-15 select garbage there), ``b`` (bit 3 flipped) among 8-15, ``mask`` has 0xFF in the
    bytes whose code is 8-15."""
    o = outs
    return (f"prmt.b32 x, $9, $10, {a};\n"
            f"prmt.b32 y, $11, $12, {b};\n"
            f"lop3.b32 lo, x, y, {mask}, 0xD8;\n"  # (x & ~mask) | (y & mask): 0xF0 & ~0xAA | 0xCC & 0xAA
            f"prmt.b32 x, $13, $14, {a};\n"
            f"prmt.b32 y, $15, $16, {b};\n"
            f"lop3.b32 hi, x, y, {mask}, 0xD8;\n"
            f"prmt.b32 q, lo, hi, {pair[0]:#06x};\n"
            f"mov.b32 {{${o[0]}, ${o[1]}}}, q;\n"
            f"prmt.b32 q, lo, hi, {pair[1]:#06x};\n"
            f"mov.b32 {{${o[2]}, ${o[3]}}}, q;\n")


def _lookup_asm(pair: tuple[int, int]) -> str:
    """``$8``: the word; nibbles 0-3 then 4-7 (``prmt`` reads a selector's low 16 bits). A
    selector nibble with bit 3 set replicates a byte's sign bit, which builds the masks: bit 3
    of nibble 2i+1 is bit 7 of byte i of the word, of nibble 2i bit 7 of byte i of ``word << 4``."""
    return ("{\n.reg .b32 wb, sh, ma, mb, a, b, x, y, lo, hi, q;\n"
            "xor.b32 wb, $8, 0x88888888;\n"
            "shl.b32 sh, $8, 4;\n"
            "prmt.b32 ma, sh, $8, 0xD9C8;\n"
            "prmt.b32 mb, sh, $8, 0xFBEA;\n"
            + _half_asm("$8", "wb", "ma", (0, 1, 2, 3), pair)
            + "shr.u32 a, $8, 16;\n"
            + "shr.u32 b, wb, 16;\n"
            + _half_asm("a", "b", "mb", (4, 5, 6, 7), pair) + "}")


TABLE_ASM_BF16 = tl.constexpr(_table_asm("bf16x2"))
TABLE_ASM_F16 = tl.constexpr(_table_asm("f16x2"))
LOOKUP_ASM_CONTIG = tl.constexpr(_lookup_asm(PAIR_CONTIG))
LOOKUP_ASM_SPLIT = tl.constexpr(_lookup_asm(PAIR_SPLIT))
_TABLE_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["f"] * 16))
_LOOKUP_CONSTRAINTS = tl.constexpr(",".join(["=h"] * 8 + ["r"] * 9))


@triton.jit
def _prmt(a, b, s):
    """PTX ``prmt.b32`` (default mode) on uint32 tensors, in integer steps: result byte ``i`` is
    byte ``n & 7`` of ``b:a`` for selector nibble ``n = s >> 4i``, or with ``n & 8`` that byte's
    sign bit copied to all 8 bits."""
    out = tl.zeros_like(a)
    for i in tl.static_range(4):
        sel = (s >> (4 * i)) & 15
        src = tl.where((sel & 7) < 4, a, b)
        byte = (src >> ((sel & 3) * 8)) & 0xFF
        byte = tl.where((sel & 8) != 0, tl.where((byte & 0x80) != 0, 0xFF, 0), byte)
        out |= byte.to(tl.uint32) << (8 * i)
    return out


@triton.jit
def _bits16(p, dtype: tl.constexpr):
    return p.to(dtype).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _bytes4(t0, t1, t2, t3, SHIFT: tl.constexpr):
    return (((t0 >> SHIFT) & 0xFF) | (((t1 >> SHIFT) & 0xFF) << 8) | (((t2 >> SHIFT) & 0xFF) << 16)
            | (((t3 >> SHIFT) & 0xFF) << 24))


@triton.jit
def _table_emulated(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15, dtype: tl.constexpr):
    t0, t1, t2, t3 = _bits16(p0, dtype), _bits16(p1, dtype), _bits16(p2, dtype), _bits16(p3, dtype)
    t4, t5, t6, t7 = _bits16(p4, dtype), _bits16(p5, dtype), _bits16(p6, dtype), _bits16(p7, dtype)
    t8, t9, t10, t11 = _bits16(p8, dtype), _bits16(p9, dtype), _bits16(p10, dtype), _bits16(p11, dtype)
    t12, t13, t14, t15 = _bits16(p12, dtype), _bits16(p13, dtype), _bits16(p14, dtype), _bits16(p15, dtype)
    return (_bytes4(t0, t1, t2, t3, 0), _bytes4(t4, t5, t6, t7, 0), _bytes4(t8, t9, t10, t11, 0),
            _bytes4(t12, t13, t14, t15, 0), _bytes4(t0, t1, t2, t3, 8), _bytes4(t4, t5, t6, t7, 8),
            _bytes4(t8, t9, t10, t11, 8), _bytes4(t12, t13, t14, t15, 8))


@triton.jit
def block_tables(code_ptr, scale, dtype: tl.constexpr, ASM: tl.constexpr):
    """The lookup registers of blocks with fp32 absmax ``scale`` (any shape): 8 uint32 tensors
    of its shape, ``L0..L3`` (low bytes of values 0-3, 4-7, 8-11, 12-15) then ``H0..H3``."""
    p0, p1, p2, p3 = (tl.load(code_ptr + 0) * scale, tl.load(code_ptr + 1) * scale, tl.load(code_ptr + 2) * scale,
                      tl.load(code_ptr + 3) * scale)
    p4, p5, p6, p7 = (tl.load(code_ptr + 4) * scale, tl.load(code_ptr + 5) * scale, tl.load(code_ptr + 6) * scale,
                      tl.load(code_ptr + 7) * scale)
    p8, p9, p10, p11 = (tl.load(code_ptr + 8) * scale, tl.load(code_ptr + 9) * scale,
                        tl.load(code_ptr + 10) * scale, tl.load(code_ptr + 11) * scale)
    p12, p13, p14, p15 = (tl.load(code_ptr + 12) * scale, tl.load(code_ptr + 13) * scale,
                          tl.load(code_ptr + 14) * scale, tl.load(code_ptr + 15) * scale)
    if ASM:
        return tl.inline_asm_elementwise(TABLE_ASM_BF16 if dtype == tl.bfloat16 else TABLE_ASM_F16,
                                         _TABLE_CONSTRAINTS,
                                         [p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15],
                                         dtype=(tl.uint32,) * 8, is_pure=True, pack=1)
    else:
        return _table_emulated(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15, dtype)


@triton.jit
def _half_emulated(a, b, mask, l0, l1, l2, l3, h0, h1, h2, h3, PAIR0: tl.constexpr, PAIR1: tl.constexpr):
    keep = mask ^ 0xFFFFFFFF
    lo = (_prmt(l0, l1, a) & keep) | (_prmt(l2, l3, b) & mask)
    hi = (_prmt(h0, h1, a) & keep) | (_prmt(h2, h3, b) & mask)
    q0 = _prmt(lo, hi, tl.full(a.shape, PAIR0, tl.uint32))
    q1 = _prmt(lo, hi, tl.full(a.shape, PAIR1, tl.uint32))
    return (q0 & 0xFFFF).to(tl.uint16), (q0 >> 16).to(tl.uint16), (q1 & 0xFFFF).to(tl.uint16), \
        (q1 >> 16).to(tl.uint16)


@triton.jit
def lookup_words(words, l0, l1, l2, l3, h0, h1, h2, h3, dtype: tl.constexpr, SPLIT: tl.constexpr,
                 ASM: tl.constexpr):
    """uint32 ``words`` (8 packed codes each) through the tables (broadcast to ``words``' shape)
    -> 8 ``dtype`` tensors of its shape: ``k0 .. k7`` of each word, or with ``SPLIT`` ``k0 k2 k1
    k3 k4 k6 k5 k7`` (each pair of outputs is one 32-bit register)."""
    if ASM:
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            LOOKUP_ASM_SPLIT if SPLIT else LOOKUP_ASM_CONTIG, _LOOKUP_CONSTRAINTS,
            [words, l0, l1, l2, l3, h0, h1, h2, h3], dtype=(tl.uint16,) * 8, is_pure=True, pack=1)
    else:
        l0, l1, l2, l3 = (tl.broadcast_to(l0, words.shape), tl.broadcast_to(l1, words.shape),
                          tl.broadcast_to(l2, words.shape), tl.broadcast_to(l3, words.shape))
        h0, h1, h2, h3 = (tl.broadcast_to(h0, words.shape), tl.broadcast_to(h1, words.shape),
                          tl.broadcast_to(h2, words.shape), tl.broadcast_to(h3, words.shape))
        p0: tl.constexpr = 0x7351 if SPLIT else 0x4051
        p1: tl.constexpr = 0x6240 if SPLIT else 0x6273
        words = words.to(tl.uint32, bitcast=True)
        flipped = words ^ 0x88888888
        shifted = words << 4
        mask_lo = _prmt(shifted, words, tl.full(words.shape, 0xD9C8, tl.uint32))
        mask_hi = _prmt(shifted, words, tl.full(words.shape, 0xFBEA, tl.uint32))
        o0, o1, o2, o3 = _half_emulated(words, flipped, mask_lo, l0, l1, l2, l3, h0, h1, h2, h3, p0, p1)
        o4, o5, o6, o7 = _half_emulated(words >> 16, flipped >> 16, mask_hi, l0, l1, l2, l3, h0, h1, h2, h3, p0, p1)
    return (o0.to(dtype, bitcast=True), o1.to(dtype, bitcast=True), o2.to(dtype, bitcast=True),
            o3.to(dtype, bitcast=True), o4.to(dtype, bitcast=True), o5.to(dtype, bitcast=True),
            o6.to(dtype, bitcast=True), o7.to(dtype, bitcast=True))


@triton.jit
def nf4_words_to_values(words, scale, code_ptr, dtype: tl.constexpr, CONTIG: tl.constexpr, ASM: tl.constexpr):
    """``words`` uint32 ``[R, G, W]`` (``W`` words of each of ``R x G`` absmax blocks, ``scale``
    fp32 ``[R, G]``) -> the values in ``dtype``: ``[R, G * 8 W]`` in ``k`` order (``CONTIG``), or
    ``(even k, odd k)``, two ``[R, G, 4 W]``."""
    # the scale taken to the words' layout (an identity tied to them on CUDA) and reduced back
    # over the words: the tables are then built where their words are, not moved there (a
    # shared-memory round trip and two barriers for each of the 8 registers)
    if ASM:
        tied = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [scale[:, :, None], words], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        tied = tl.broadcast_to(scale[:, :, None], words.shape)
    l0, l1, l2, l3, h0, h1, h2, h3 = block_tables(code_ptr, tl.max(tied, axis=2), dtype, ASM)
    l0, l1, l2, l3 = l0[:, :, None], l1[:, :, None], l2[:, :, None], l3[:, :, None]
    h0, h1, h2, h3 = h0[:, :, None], h1[:, :, None], h2[:, :, None], h3[:, :, None]
    o0, o1, o2, o3, o4, o5, o6, o7 = lookup_words(words, l0, l1, l2, l3, h0, h1, h2, h3, dtype, not CONTIG, ASM)
    r: tl.constexpr = words.shape[0]
    g: tl.constexpr = words.shape[1]
    nw: tl.constexpr = words.shape[2]
    # join(join(join(a, b), join(c, d)), join(join(e, f), join(g, h))) flattens as a e c g b f d h
    if CONTIG:
        v = tl.join(tl.join(tl.join(o0, o4), tl.join(o2, o6)), tl.join(tl.join(o1, o5), tl.join(o3, o7)))
        return tl.reshape(v, (r, g * nw * 8))
    else:  # outputs k0 k2 k1 k3 k4 k6 k5 k7: even k0 k2 k4 k6 = o0 o1 o4 o5, odd = o2 o3 o6 o7
        even = tl.join(tl.join(o0, o4), tl.join(o1, o5))
        odd = tl.join(tl.join(o2, o6), tl.join(o3, o7))
        return tl.reshape(even, (r, g, nw * 4)), tl.reshape(odd, (r, g, nw * 4))
