"""Cache entries read and written through the block table, FP8 codec fused, Triton.

Matches :mod:`csrc_triton.kv_cache_ref` (same signatures and results, bit for bit): it fuses the
block-table gather / scatter with ``kv_pack_ref.unpack_main`` / ``unpack_index`` on read and
``pack_main`` / ``pack_index`` on write. One program per (row of the index tensors, block of
``BLOCK_K`` entries): it looks each entry's block up, then decodes (encodes) the entry in registers,
64 nope values (one scale) at a time for main KV, the whole key for an indexer entry.

The codec (encode, decode, entry addressing) is codec.py's, shared with the other kernels that read
or write entries in registers; it is exact, so reads and writes match the reference bit for bit.

Bytes (V4, FP8 main KV, bf16 out): a read moves 584 B in and 1024 B out per entry, plus its entry
number (8 B) and block-table entry (4 B); a write 1024 B in and 584 B out. The reference moves the
gathered bytes and fp32 temporaries several times over.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from csrc_triton.codec import (
    bf16_decode, e4m3_decode, entry_mode, entry_slots, hardware_e4m3, index_scale, main_parts, scale_exponent,
    store_bf16_bytes, store_e4m3, store_index_scale, store_scale_pad, store_values, ue8m0_decode,
)
from csrc_triton.formats import NOPE_BLOCK


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
    block, o = entry_slots(view_ptr, bt_ptr, req_ptr, entry_ptr, a, b, ok, s_ra, s_rb, s_ea, s_eb, s_bt0, s_bt1,
                            s_v0, E)
    row = (block + o * s_v1)[:, None]  # [BK, 1] raw and indexer entries
    o_row = out_ptr + (a * B + b)[:, None] * D  # [BK, 1]; D values per entry
    if not (MAIN or INDEX):  # raw entries
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)[None, :]
            m = ok[:, None] & (c < C)
            tl.store(o_row + c, tl.load(row + c * s_v2, mask=m), mask=m)
    elif MAIN:  # bytes contiguous (s_v2 = 1); one ue8m0 scale byte per 64 nope values
        data, scales = main_parts(block[:, None], o[:, None], E, nope + 2 * rope, C)
        for c0 in range(0, nope, BLOCK_C):  # BLOCK_C = 64: one scale per tile
            c = c0 + tl.arange(0, BLOCK_C)[None, :]
            m = ok[:, None] & (c < nope)
            q = e4m3_decode(tl.load(data + c, mask=m, other=0), HW_E4M3)
            scale = ue8m0_decode(tl.load(scales + c0 // BLOCK_C, mask=ok[:, None], other=127))
            store_values(o_row + c, q * scale, m, OUT_BF16)
        i = tl.arange(0, BLOCK_R)[None, :]
        m = ok[:, None] & (i < rope)
        lo = tl.load(data + nope + 2 * i, mask=m, other=0)
        hi = tl.load(data + nope + 2 * i + 1, mask=m, other=0)
        store_values(o_row + nope + i, bf16_decode(lo, hi), m, OUT_BF16)
    else:  # indexer key
        c = tl.arange(0, BLOCK_C)[None, :]
        m = ok[:, None] & (c < nope)
        q = e4m3_decode(tl.load(row + c * s_v2, mask=m, other=0), HW_E4M3)
        store_values(o_row + c, q * index_scale(row, nope, ok[:, None], s_v2)[:, None], m, OUT_BF16)


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
    block, o = entry_slots(view_ptr, bt_ptr, req_ptr, entry_ptr, a, b, ok, s_ra, s_rb, s_ea, s_eb, s_bt0, s_bt1,
                            s_v0, E)
    row = (block + o * s_v1)[:, None]  # [BK, 1] raw and indexer entries
    v_row = val_ptr + (a * B + b)[:, None] * D  # [BK, 1]
    if not (MAIN or INDEX):  # raw entries
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)[None, :]
            m = ok[:, None] & (c < C)
            tl.store(row + c * s_v2, tl.load(v_row + c, mask=m), mask=m)
    elif MAIN:  # bytes contiguous (s_v2 = 1)
        data, scales = main_parts(block[:, None], o[:, None], E, nope + 2 * rope, C)
        for c0 in range(0, nope, BLOCK_C):  # BLOCK_C = 64: one scale per tile
            c = c0 + tl.arange(0, BLOCK_C)[None, :]
            m = ok[:, None] & (c < nope)
            x = tl.load(v_row + c, mask=m, other=0.0).to(tl.float32)  # [BK, 64]; the tail block padded with 0
            k = scale_exponent(tl.max(tl.abs(x), axis=1))[:, None]  # [BK, 1]
            store_e4m3(data + c, x, k, m)
            tl.store(scales + c0 // BLOCK_C, (k + 127).to(tl.uint8), mask=ok[:, None])
        store_scale_pad(scales, nope, C - nope - 2 * rope, ok[:, None], BLOCK_C)
        i = tl.arange(0, BLOCK_R)[None, :]
        m = ok[:, None] & (i < rope)
        value = tl.load(v_row + nope + i, mask=m, other=0.0).to(tl.float32)
        store_bf16_bytes(data + nope + 2 * i, value, m, 1)
    else:  # indexer key
        c = tl.arange(0, BLOCK_C)[None, :]
        m = ok[:, None] & (c < nope)
        x = tl.load(v_row + c, mask=m, other=0.0).to(tl.float32)  # [BK, BC]
        k = scale_exponent(tl.max(tl.abs(x), axis=1))[:, None]  # [BK, 1]
        store_e4m3(row + c * s_v2, x, k, m)
        store_index_scale(row + nope * s_v2, k, ok[:, None], s_v2)


def _index_2d(req: Tensor, entry: Tensor, shape: torch.Size) -> tuple[Tensor, Tensor]:
    """``req`` and ``entry`` broadcast to ``shape`` and viewed as ``[A, B]`` (B the last axis); no
    copy for the usual ``[T, 1]`` x ``[T, K]``."""
    req, entry = (t.expand(shape) for t in (req, entry))
    cols = shape[-1] if len(shape) else 1
    return req.reshape(-1, cols), entry.reshape(-1, cols)



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
    mode, dim, nope, rope = entry_mode(view, fp8)
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
    mode, dim, nope, rope = entry_mode(view, fp8)
    assert values.shape[-1] == dim, (values.shape, dim)
    if values.numel() == 0:
        return
    if mode == "raw":
        values = values.to(view.dtype)
    values = values.contiguous()
    req2, entry2 = _index_2d(req, entry, values.shape[:-1])
    _launch(_write_kernel, view, block_table, req2, entry2, values, mode, dim, nope, rope, entries_per_block)
