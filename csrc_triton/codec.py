"""Triton device functions shared by the kernels, and the checks their launchers share.

The FP8 cache-entry codec is integer arithmetic on the fp32 bits, so it is exact and the same on
every device and under the interpreter: e4m3 and bf16 rounding are round-to-nearest-even by hand,
the scale exponent is ``ceil(log2(amax / 448))`` read off the bits (kv_pack_ref), scaling multiplies
by a power of two. Reads decode e4m3 with the GPU's conversion instead where it has one (sm_89+,
:func:`hardware_e4m3`): the same exact values, two codes an instruction. Decoded values (e4m3 times
a power of two, or bf16) are exact in fp32 and bf16 outputs.

Users: the entry addressing and the decoders (``entry_slots``, ``main_values`` ...) serve
kv_cache.py, sparse_attn.py and indexer_topk.py, which read entries into registers; the encoders
(``store_e4m3`` ...) kv_cache.py and kv_insert.py, which write them; the bf16 rounding
(``round_to_x``, ``store_values``, ``as_stored``) also norm.py, rope.py, mhc.py and moe_mxfp4.py.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from csrc_triton.formats import check_main_blocks, index_entry_bytes, main_entry_bytes


@triton.jit
def entry_slots(view_ptr, bt_ptr, req_ptr, entry_ptr, a, b, ok, s_ra, s_rb, s_ea, s_eb, s_bt0, s_bt1, s_v0, E):
    """[BK] (block pointer, offset in the block) of the entries (a, b) of the index tensors: entry
    ``e`` of request ``r`` is at offset ``e % E`` of block ``bt[r, e // E]``."""
    r = tl.load(req_ptr + a * s_ra + b * s_rb, mask=ok, other=0).to(tl.int64)
    e = tl.load(entry_ptr + a * s_ea + b * s_eb, mask=ok, other=0).to(tl.int64)
    blk = tl.load(bt_ptr + r * s_bt0 + (e // E) * s_bt1, mask=ok, other=0).to(tl.int64)
    return view_ptr + blk * s_v0, e % E


@triton.jit
def main_parts(block, o, E, D, C):
    """Byte pointers to the data part (``D`` bytes: nope e4m3, rope bf16) and the scale part of the
    main entries at offsets ``o`` of ``block`` (``C`` bytes per entry): a block holds its E data parts,
    then its E scale parts (kv_pack_ref.main_page_parts, FlashMLA's arrangement)."""
    return block + o * D, block + E * D + o * (C - D)


@triton.jit
def e4m3_decode(code, HARDWARE: tl.constexpr):
    """uint8 e4m3fn codes -> fp32 (exact; 0x7F / 0xFF are NaN): the GPU's conversion where it has one
    (``HARDWARE``, see :func:`hardware_e4m3`: two codes an instruction), else integer arithmetic."""
    if HARDWARE:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    c = code.to(tl.uint32)
    sign = (c & 0x80) << 24
    exp = (c >> 3) & 0xF
    man = c & 0x7
    normal = ((exp + 120) << 23) | (man << 20)  # 2^(exp - 7) * (1 + man / 8)
    subnormal = (man.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)  # man * 2^-9
    bits = tl.where(exp == 0, subnormal, normal) | sign
    value = bits.to(tl.float32, bitcast=True)
    return tl.where((c & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def ue8m0_decode(byte):
    """uint8 ue8m0 scale bytes -> fp32 2^(byte - 127) (exact; byte 0 is the subnormal 2^-127)."""
    k = byte.to(tl.uint32)
    return tl.where(k == 0, 0x400000, k << 23).to(tl.float32, bitcast=True)


@triton.jit
def bf16_decode(lo, hi):
    """Little-endian bf16 bytes (uint8 ``lo``, ``hi``) -> fp32 (exact)."""
    return ((lo.to(tl.uint32) | (hi.to(tl.uint32) << 8)) << 16).to(tl.float32, bitcast=True)


@triton.jit
def index_scale(row, value_dim, ok, s_v2):
    """fp32 scale [BK] of the indexer entries at ``row`` [BK, 1] (``ok`` [BK, 1]): the little-endian
    fp32 after the ``value_dim`` e4m3 codes (kv_pack_ref.pack_index); 0 where not ``ok``."""
    j = tl.arange(0, 4)[None, :]
    sb = tl.load(row + (value_dim + j) * s_v2, mask=ok, other=0).to(tl.uint32)  # [BK, 4]
    return tl.sum(sb << (8 * j).to(tl.uint32), axis=1).to(tl.float32, bitcast=True)


@triton.jit
def main_values(data, scales, c, ok, nope, rope, NOPE_BLOCK: tl.constexpr, HW_E4M3: tl.constexpr):
    """fp32 values at columns ``c`` [1, BC] of the main entries with parts ``data``, ``scales`` [BK, 1]
    (``main_parts``; ``ok`` [BK, 1]): e4m3 nope values times their block's ue8m0 scale, then the bf16
    rope tail; 0 past ``nope + rope`` and where not ``ok``. Any columns in one tile (sparse_attn.py
    decodes whole keys): each value loads its own scale byte (``NOPE_BLOCK`` values share one, so
    that load hits the cache)."""
    is_nope = ok & (c < nope)
    code = tl.load(data + c, mask=is_nope, other=0)
    sb = tl.load(scales + c // NOPE_BLOCK, mask=is_nope, other=127)
    i = c - nope
    is_rope = ok & (c >= nope) & (i < rope)
    lo = tl.load(data + nope + 2 * i, mask=is_rope, other=0)
    hi = tl.load(data + nope + 2 * i + 1, mask=is_rope, other=0)
    return tl.where(c < nope, e4m3_decode(code, HW_E4M3) * ue8m0_decode(sb), bf16_decode(lo, hi))


@triton.jit
def e4m3_encode(x):
    """fp32 -> uint32 e4m3fn code, clamped to +-448, round to nearest even (torch's cast)."""
    bits = tl.minimum(tl.maximum(x, -448.0), 448.0).to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal (>= 2^-6): drop 20 of fp32's 23 mantissa bits, rounding to even; a carry bumps the exponent
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal: adding 2^14 leaves an ulp of 2^-9, the e4m3 subnormal step (the hardware rounds to even)
    subnormal = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - 0x46800000
    return tl.where(mag < 0x3C800000, subnormal, normal) | sign


@triton.jit
def scale_exponent(amax):
    """int32 k = ceil(log2(max(amax, 1e-4) / 448)) from the bits: amax = m 2^e, 448 = 1.75 2^8."""
    bits = tl.maximum(amax, 1e-4).to(tl.uint32, bitcast=True)
    e = (bits >> 23).to(tl.int32) - 127
    return e - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def bf16_bits(x):
    """fp32 -> uint32 holding the bf16 bits, round to nearest even (torch's cast)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded)  # NaN payloads would round into inf or wrap to -0


@triton.jit
def round_to_x(y, X_BF16: tl.constexpr):
    """fp32 ``y`` rounded to bf16 (nearest even) when x is bf16: the unfused ops' ``.to(x.dtype)``."""
    if X_BF16:
        y = (bf16_bits(y) << 16).to(tl.float32, bitcast=True)
    return y


@triton.jit
def as_stored(v, ptr):
    """fp32 ``v`` as ``ptr``'s dtype holds it, in fp32 (bf16 rounded by hand: the interpreter's cast truncates)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        return round_to_x(v, True)
    return v.to(ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def store_e4m3(ptr, x, k, mask):
    """Store the uint8 e4m3 codes of fp32 ``x * 2^-k`` (``k`` int32, broadcast against ``x``)."""
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)  # 2^-k
    tl.store(ptr, e4m3_encode(x * inv).to(tl.uint8), mask=mask)


@triton.jit
def store_bf16_bytes(ptr, value, mask, s_v2):
    """Store fp32 ``value`` as bf16 (round to nearest even), little-endian: bytes at ``ptr``, ``ptr + s_v2``."""
    bits = bf16_bits(value)
    tl.store(ptr, (bits & 0xFF).to(tl.uint8), mask=mask)
    tl.store(ptr + s_v2, (bits >> 8).to(tl.uint8), mask=mask)


@triton.jit
def store_scale_pad(scales, nope, scale_bytes, mask, NOPE_BLOCK: tl.constexpr):
    """Zero the pad after the ue8m0 bytes in the scale parts ``scales`` [BK, 1] of main entries
    (fewer than 8 bytes, up to ``scale_bytes``)."""
    p = (nope + NOPE_BLOCK - 1) // NOPE_BLOCK + tl.arange(0, 8)[None, :]
    tl.store(scales + p, tl.zeros_like(p).to(tl.uint8), mask=mask & (p < scale_bytes))


@triton.jit
def store_index_scale(ptr, k, mask, s_v2):
    """Store the fp32 scale 2^k of indexer entries (``k`` [BK, 1] int32) as 4 little-endian bytes."""
    j = tl.arange(0, 4)[None, :]
    bits = ((k + 127) << 23).to(tl.uint32)
    tl.store(ptr + j * s_v2, ((bits >> (8 * j).to(tl.uint32)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def store_values(ptr, value, mask, OUT_BF16: tl.constexpr):
    """Store fp32 ``value``; bf16 rounded by hand (the interpreter's cast truncates)."""
    if OUT_BF16:
        value = bf16_bits(value).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)


def entry_mode(view: Tensor, fp8) -> tuple[str, int, int, int]:
    """(kind: raw / main / index, value_dim, nope (FP8 values), rope) of the component, checking
    the entry width."""
    C = view.shape[-1]
    if fp8 is None:
        return "raw", C, 0, 0
    assert view.dtype == torch.uint8, view.dtype
    if fp8.rope_dim is None:
        assert C == index_entry_bytes(fp8.value_dim), (C, fp8)
        return "index", fp8.value_dim, fp8.value_dim, 0
    assert C == main_entry_bytes(fp8.value_dim, fp8.rope_dim), (C, fp8)
    check_main_blocks(view)
    return "main", fp8.value_dim, fp8.value_dim - fp8.rope_dim, fp8.rope_dim


@functools.cache
def hardware_e4m3(device: torch.device) -> bool:
    """Whether kernels on ``device`` convert e4m3 with the GPU's instructions (sm_89+) rather than by
    integer arithmetic (the interpreter, whose casts round wrongly; older GPUs, which have no FP8 type):
    decoding gives the same exact values either way, encoding the same round-to-nearest-even codes
    (out_proj.rope_quant_fp8). Asked at launch, so importing this module touches no GPU; a launch
    captured off the GPU (the Hopper compile test) takes the hardware path."""
    if not isinstance(entry_slots, JITFunction):  # the interpreter
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
