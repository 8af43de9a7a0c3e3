"""Cache entries read and written through the block table, FP8 codec fused, Triton.

Matches :mod:`csrc_triton.kv_cache_ref` (same signatures and results, bit for bit): it fuses the
block-table gather / scatter with ``kv_pack_ref.unpack_main`` / ``unpack_index`` on read and
``pack_main`` / ``pack_index`` on write. One program per (row of the index tensors, block of
``BLOCK_K`` entries): it looks each entry's block up, then decodes (encodes) the entry in registers,
64 nope values (one scale) at a time for main KV, the whole key for an indexer entry.

The codec is integer arithmetic on the fp32 bits, so it is exact and the same on every device and
under the interpreter: e4m3 and bf16 rounding are round-to-nearest-even by hand, the scale exponent
is ``ceil(log2(amax / 448))`` read off the bits (kv_pack_ref), scaling multiplies by a power of two.
Reads decode e4m3 with the GPU's conversion instead where it has one (sm_89+, :func:`hardware_e4m3`):
the same exact values, two codes an instruction (the read kernels' sm_90 SASS: 21-30% shorter).
Decoded values (e4m3 times a power of two, or bf16) are exact in fp32 and bf16 outputs. The encode
helpers (``_store_e4m3`` ...) also serve kv_insert.py, which writes entries from registers; the decode
helpers (``_main_values`` ...) sparse_attn.py and indexer_topk.py, which read keys into registers; the
bf16 rounding (``_round_to_x``, ``_store_values``) also norm.py and rope.py.

Bytes (V4, FP8 main KV, bf16 out): a read moves 584 B in and 1024 B out per entry, plus its entry
number (8 B) and block-table entry (4 B); a write 1024 B in and 584 B out. The reference moves the
gathered bytes and fp32 temporaries several times over.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from csrc_triton.kv_pack_ref import NOPE_BLOCK, check_main_blocks, index_entry_bytes, main_entry_bytes


@triton.jit
def _entry_slots(view_ptr, bt_ptr, req_ptr, entry_ptr, a, b, ok, s_ra, s_rb, s_ea, s_eb, s_bt0, s_bt1, s_v0, E):
    """[BK] (block pointer, offset in the block) of the entries (a, b) of the index tensors: entry
    ``e`` of request ``r`` is at offset ``e % E`` of block ``bt[r, e // E]``."""
    r = tl.load(req_ptr + a * s_ra + b * s_rb, mask=ok, other=0).to(tl.int64)
    e = tl.load(entry_ptr + a * s_ea + b * s_eb, mask=ok, other=0).to(tl.int64)
    blk = tl.load(bt_ptr + r * s_bt0 + (e // E) * s_bt1, mask=ok, other=0).to(tl.int64)
    return view_ptr + blk * s_v0, e % E


@triton.jit
def _main_parts(block, o, E, D, C):
    """Byte pointers to the data part (``D`` bytes: nope e4m3, rope bf16) and the scale part of the
    main entries at offsets ``o`` of ``block`` (``C`` bytes per entry): a block holds its E data parts,
    then its E scale parts (kv_pack_ref.main_page_parts, FlashMLA's arrangement)."""
    return block + o * D, block + E * D + o * (C - D)


@triton.jit
def _e4m3_decode(code, HARDWARE: tl.constexpr):
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
def _ue8m0_decode(byte):
    """uint8 ue8m0 scale bytes -> fp32 2^(byte - 127) (exact; byte 0 is the subnormal 2^-127)."""
    k = byte.to(tl.uint32)
    return tl.where(k == 0, 0x400000, k << 23).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_decode(lo, hi):
    """Little-endian bf16 bytes (uint8 ``lo``, ``hi``) -> fp32 (exact)."""
    return ((lo.to(tl.uint32) | (hi.to(tl.uint32) << 8)) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _index_scale(row, value_dim, ok, s_v2):
    """fp32 scale [BK] of the indexer entries at ``row`` [BK, 1] (``ok`` [BK, 1]): the little-endian
    fp32 after the ``value_dim`` e4m3 codes (kv_pack_ref.pack_index); 0 where not ``ok``."""
    j = tl.arange(0, 4)[None, :]
    sb = tl.load(row + (value_dim + j) * s_v2, mask=ok, other=0).to(tl.uint32)  # [BK, 4]
    return tl.sum(sb << (8 * j).to(tl.uint32), axis=1).to(tl.float32, bitcast=True)


@triton.jit
def _main_values(data, scales, c, ok, nope, rope, NOPE_BLOCK: tl.constexpr, HW_E4M3: tl.constexpr):
    """fp32 values at columns ``c`` [1, BC] of the main entries with parts ``data``, ``scales`` [BK, 1]
    (``_main_parts``; ``ok`` [BK, 1]): e4m3 nope values times their block's ue8m0 scale, then the bf16
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
    return tl.where(c < nope, _e4m3_decode(code, HW_E4M3) * _ue8m0_decode(sb), _bf16_decode(lo, hi))


@triton.jit
def _e4m3_encode(x):
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
def _scale_exponent(amax):
    """int32 k = ceil(log2(max(amax, 1e-4) / 448)) from the bits: amax = m 2^e, 448 = 1.75 2^8."""
    bits = tl.maximum(amax, 1e-4).to(tl.uint32, bitcast=True)
    e = (bits >> 23).to(tl.int32) - 127
    return e - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def _bf16_bits(x):
    """fp32 -> uint32 holding the bf16 bits, round to nearest even (torch's cast)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded)  # NaN payloads would round into inf or wrap to -0


@triton.jit
def _round_to_x(y, X_BF16: tl.constexpr):
    """fp32 ``y`` rounded to bf16 (nearest even) when x is bf16: the unfused ops' ``.to(x.dtype)``."""
    if X_BF16:
        y = (_bf16_bits(y) << 16).to(tl.float32, bitcast=True)
    return y


@triton.jit
def _as_stored(v, ptr):
    """fp32 ``v`` as ``ptr``'s dtype holds it, in fp32 (bf16 rounded by hand: the interpreter's cast truncates)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        return _round_to_x(v, True)
    return v.to(ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _store_e4m3(ptr, x, k, mask):
    """Store the uint8 e4m3 codes of fp32 ``x * 2^-k`` (``k`` int32, broadcast against ``x``)."""
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)  # 2^-k
    tl.store(ptr, _e4m3_encode(x * inv).to(tl.uint8), mask=mask)


@triton.jit
def _store_bf16_bytes(ptr, value, mask, s_v2):
    """Store fp32 ``value`` as bf16 (round to nearest even), little-endian: bytes at ``ptr``, ``ptr + s_v2``."""
    bits = _bf16_bits(value)
    tl.store(ptr, (bits & 0xFF).to(tl.uint8), mask=mask)
    tl.store(ptr + s_v2, (bits >> 8).to(tl.uint8), mask=mask)


@triton.jit
def _store_scale_pad(scales, nope, scale_bytes, mask, NOPE_BLOCK: tl.constexpr):
    """Zero the pad after the ue8m0 bytes in the scale parts ``scales`` [BK, 1] of main entries
    (fewer than 8 bytes, up to ``scale_bytes``)."""
    p = (nope + NOPE_BLOCK - 1) // NOPE_BLOCK + tl.arange(0, 8)[None, :]
    tl.store(scales + p, tl.zeros_like(p).to(tl.uint8), mask=mask & (p < scale_bytes))


@triton.jit
def _store_index_scale(ptr, k, mask, s_v2):
    """Store the fp32 scale 2^k of indexer entries (``k`` [BK, 1] int32) as 4 little-endian bytes."""
    j = tl.arange(0, 4)[None, :]
    bits = ((k + 127) << 23).to(tl.uint32)
    tl.store(ptr + j * s_v2, ((bits >> (8 * j).to(tl.uint32)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _store_values(ptr, value, mask, OUT_BF16: tl.constexpr):
    """Store fp32 ``value``; bf16 rounded by hand (the interpreter's cast truncates)."""
    if OUT_BF16:
        value = _bf16_bits(value).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["B", "s_ra", "s_ea"])
def _read_kernel(
    view_ptr, bt_ptr, req_ptr, entry_ptr, out_ptr,
    B, E, C, D, nope, rope,
    s_ra, s_rb, s_ea, s_eb, s_bt0, s_bt1, s_v0, s_v1, s_v2,
    MAIN: tl.constexpr, INDEX: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    OUT_BF16: tl.constexpr, HW_E4M3: tl.constexpr,
):
    a = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    ok = b < B
    block, o = _entry_slots(view_ptr, bt_ptr, req_ptr, entry_ptr, a, b, ok, s_ra, s_rb, s_ea, s_eb, s_bt0, s_bt1,
                            s_v0, E)
    row = (block + o * s_v1)[:, None]  # [BK, 1] raw and indexer entries
    o_row = out_ptr + (a * B + b)[:, None] * D  # [BK, 1]; D values per entry
    if not (MAIN or INDEX):  # raw entries
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)[None, :]
            m = ok[:, None] & (c < C)
            tl.store(o_row + c, tl.load(row + c * s_v2, mask=m), mask=m)
    elif MAIN:  # bytes contiguous (s_v2 = 1); one ue8m0 scale byte per 64 nope values
        data, scales = _main_parts(block[:, None], o[:, None], E, nope + 2 * rope, C)
        for c0 in range(0, nope, BLOCK_C):  # BLOCK_C = 64: one scale per tile
            c = c0 + tl.arange(0, BLOCK_C)[None, :]
            m = ok[:, None] & (c < nope)
            q = _e4m3_decode(tl.load(data + c, mask=m, other=0), HW_E4M3)
            scale = _ue8m0_decode(tl.load(scales + c0 // BLOCK_C, mask=ok[:, None], other=127))
            _store_values(o_row + c, q * scale, m, OUT_BF16)
        i = tl.arange(0, BLOCK_R)[None, :]
        m = ok[:, None] & (i < rope)
        lo = tl.load(data + nope + 2 * i, mask=m, other=0)
        hi = tl.load(data + nope + 2 * i + 1, mask=m, other=0)
        _store_values(o_row + nope + i, _bf16_decode(lo, hi), m, OUT_BF16)
    else:  # indexer key
        c = tl.arange(0, BLOCK_C)[None, :]
        m = ok[:, None] & (c < nope)
        q = _e4m3_decode(tl.load(row + c * s_v2, mask=m, other=0), HW_E4M3)
        _store_values(o_row + c, q * _index_scale(row, nope, ok[:, None], s_v2)[:, None], m, OUT_BF16)


@triton.jit(do_not_specialize=["B", "s_ra", "s_ea"])
def _write_kernel(
    view_ptr, bt_ptr, req_ptr, entry_ptr, val_ptr,
    B, E, C, D, nope, rope,
    s_ra, s_rb, s_ea, s_eb, s_bt0, s_bt1, s_v0, s_v1, s_v2,
    MAIN: tl.constexpr, INDEX: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
):
    a = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    ok = b < B
    ok &= tl.load(req_ptr + a * s_ra + b * s_rb, mask=ok, other=-1) >= 0  # padding rows write nothing
    block, o = _entry_slots(view_ptr, bt_ptr, req_ptr, entry_ptr, a, b, ok, s_ra, s_rb, s_ea, s_eb, s_bt0, s_bt1,
                            s_v0, E)
    row = (block + o * s_v1)[:, None]  # [BK, 1] raw and indexer entries
    v_row = val_ptr + (a * B + b)[:, None] * D  # [BK, 1]
    if not (MAIN or INDEX):  # raw entries
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)[None, :]
            m = ok[:, None] & (c < C)
            tl.store(row + c * s_v2, tl.load(v_row + c, mask=m), mask=m)
    elif MAIN:  # bytes contiguous (s_v2 = 1)
        data, scales = _main_parts(block[:, None], o[:, None], E, nope + 2 * rope, C)
        for c0 in range(0, nope, BLOCK_C):  # BLOCK_C = 64: one scale per tile
            c = c0 + tl.arange(0, BLOCK_C)[None, :]
            m = ok[:, None] & (c < nope)
            x = tl.load(v_row + c, mask=m, other=0.0).to(tl.float32)  # [BK, 64]; the tail block padded with 0
            k = _scale_exponent(tl.max(tl.abs(x), axis=1))[:, None]  # [BK, 1]
            _store_e4m3(data + c, x, k, m)
            tl.store(scales + c0 // BLOCK_C, (k + 127).to(tl.uint8), mask=ok[:, None])
        _store_scale_pad(scales, nope, C - nope - 2 * rope, ok[:, None], BLOCK_C)
        i = tl.arange(0, BLOCK_R)[None, :]
        m = ok[:, None] & (i < rope)
        value = tl.load(v_row + nope + i, mask=m, other=0.0).to(tl.float32)
        _store_bf16_bytes(data + nope + 2 * i, value, m, 1)
    else:  # indexer key
        c = tl.arange(0, BLOCK_C)[None, :]
        m = ok[:, None] & (c < nope)
        x = tl.load(v_row + c, mask=m, other=0.0).to(tl.float32)  # [BK, BC]
        k = _scale_exponent(tl.max(tl.abs(x), axis=1))[:, None]  # [BK, 1]
        _store_e4m3(row + c * s_v2, x, k, m)
        _store_index_scale(row + nope * s_v2, k, ok[:, None], s_v2)


def _index_2d(req: Tensor, entry: Tensor, shape: torch.Size) -> tuple[Tensor, Tensor]:
    """``req`` and ``entry`` broadcast to ``shape`` and viewed as ``[A, B]`` (B the last axis); no
    copy for the usual ``[T, 1]`` x ``[T, K]``."""
    req, entry = (t.expand(shape) for t in (req, entry))
    cols = shape[-1] if len(shape) else 1
    return req.reshape(-1, cols), entry.reshape(-1, cols)


def _mode(view: Tensor, fp8) -> tuple[str, int, int, int]:
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
    if not isinstance(_read_kernel, JITFunction):  # the interpreter
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def _launch(kernel, view, block_table, req2, entry2, data, mode, dim, nope, rope, entries_per_block, **extra):
    A, B = req2.shape
    C = view.shape[-1]
    if mode == "main":
        block_c = NOPE_BLOCK
    elif mode == "index":
        block_c = triton.next_power_of_2(nope)
    else:
        block_c = min(triton.next_power_of_2(C), 256)
    block_k = max(1, min(4096 // block_c, 64))  # not by B: one compiled kernel for every step size
    kernel[(A, triton.cdiv(B, block_k))](
        view, block_table, req2, entry2, data,
        B, entries_per_block, C, dim, nope, rope,
        *req2.stride(), *entry2.stride(), *block_table.stride(), *view.stride(),
        MAIN=mode == "main", INDEX=mode == "index", BLOCK_K=block_k, BLOCK_C=block_c,
        BLOCK_R=max(2, triton.next_power_of_2(rope)), **extra,
    )


def read_entries(view: Tensor, block_table: Tensor, req: Tensor, entry: Tensor, entries_per_block: int,
                 fp8, out_dtype: torch.dtype) -> Tensor:
    """Triton :func:`kv_cache_ref.read_entries` (same arguments and result, exact).

    Args:
        view: ``[num_blocks, E, C]``, any strides (a view into vLLM's block-outermost pool); uint8
            when ``fp8`` is set.
        block_table: ``[R, max_blocks]`` int32 / int64.
        req, entry: int index tensors that broadcast together (``entry >= 0``).
        entries_per_block: ``E``.
        fp8: None or the FP8 entry spec (``value_dim``, ``rope_dim``).
        out_dtype: dtype of the result; FP8 decodes are exact in fp32 and bf16.

    Returns:
        ``[..., value_dim]`` in ``out_dtype``.
    """
    assert view.dim() == 3 and block_table.dim() == 2, (view.shape, block_table.shape)
    mode, dim, nope, rope = _mode(view, fp8)
    shape = torch.broadcast_shapes(req.shape, entry.shape)
    out = torch.empty(*shape, dim, dtype=view.dtype if mode == "raw" else out_dtype, device=view.device)
    if out.numel():
        req2, entry2 = _index_2d(req, entry, shape)
        _launch(_read_kernel, view, block_table, req2, entry2, out, mode, dim, nope, rope, entries_per_block,
                OUT_BF16=out.dtype == torch.bfloat16 and mode != "raw", HW_E4M3=hardware_e4m3(view.device))
    return out.to(out_dtype)  # raw entries: cast by torch (no-op when the dtype matches)


def write_entries(view: Tensor, block_table: Tensor, req: Tensor, entry: Tensor, entries_per_block: int,
                  values: Tensor, fp8) -> None:
    """Triton :func:`kv_cache_ref.write_entries` (same arguments, identical bytes written).

    Args:
        view: as for :func:`read_entries`; written in place.
        block_table, req, entry, entries_per_block: as for :func:`read_entries`; ``req`` and ``entry``
            broadcast to ``values.shape[:-1]``; each (request, entry) at most once; rows with
            ``req < 0`` (padding) are not written (nor their entry read).
        values: ``[..., value_dim]`` float.
        fp8: None (values cast to ``view.dtype``) or the FP8 entry spec (encoded).
    """
    assert view.dim() == 3 and block_table.dim() == 2, (view.shape, block_table.shape)
    mode, dim, nope, rope = _mode(view, fp8)
    assert values.shape[-1] == dim, (values.shape, dim)
    if values.numel() == 0:
        return
    if mode == "raw":
        values = values.to(view.dtype)
    values = values.contiguous()
    req2, entry2 = _index_2d(req, entry, values.shape[:-1])
    _launch(_write_kernel, view, block_table, req2, entry2, values, mode, dim, nope, rope, entries_per_block)
