"""Sparse shared-KV (MQA) attention with per-head sinks, Triton (docs/MODEL.md §5.3).

Matches :mod:`sparse_attn_ref`: keys = values, the sink enters the denominator only, invalid slots
are never read, a row with no valid key (and a finite or absent sink) returns 0.

One program per (query token, block of heads): the token's q block stays in registers, its keys
stream through in blocks of ``BLOCK_K`` with an online softmax (``_attend``); logits, weights and the
``[BLOCK_H, d]`` accumulator are fp32. ``d`` (512 in V4, any size here) is one padded tile.
:func:`sparse_attn` reads gathered keys ``[T, K, d]``; :func:`sparse_attn_cached` runs the same loop
over the window slots, then over the compressed slots, reading each key straight from its paged
cache through the block table (FP8 main entries decoded into the key tile by :mod:`kv_cache`'s
codec), so there is no gathered copy; the key blocks before a query's first valid slot and after
its last are skipped, and an empty slot is never loaded.

Bytes (bf16, V4-Flash: H = 64, d = 512, K = 128 + 512): per token ``K * d * 2`` of keys (655 KB,
read once: all 64 heads are one block) + ``2 * H * d * 2`` of q and out (128 KB) + ``K`` bytes of
mask. Cached: ``584 K`` of FP8 keys instead (374 KB; ``1024 K`` raw bf16), ``8 K`` of entry numbers
(int64, read twice: :func:`_slot_span`, then the loop, from L1/L2) and a block-table entry per valid
slot; the gathered path also writes the decoded keys, copies them once more to concatenate, and
reads them back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from csrc_triton.codec import entry_mode, hardware_e4m3, main_parts, main_values
from csrc_triton.formats import NOPE_BLOCK
from csrc_triton.paged import CacheSource

_NOPE_BLOCK = tl.constexpr(NOPE_BLOCK)
_SPAN_BLOCK = tl.constexpr(256)  # entry numbers scanned per step by _slot_span


@triton.jit
def _slot_span(idx_ptr, t, K, s_i0, s_i1, BLOCK_K: tl.constexpr):
    """``[k_lo, k_hi)``: from the key block holding query t's first slot with an entry >= 0 to just past
    its last one (empty when there is none); reads the ``K`` entry numbers once."""
    lo = tl.zeros([], tl.int32) + K
    hi = tl.zeros([], tl.int32)
    for s0 in range(0, K, _SPAN_BLOCK):
        j = s0 + tl.arange(0, _SPAN_BLOCK)  # [BS]
        ok = tl.load(idx_ptr + t * s_i0 + j * s_i1, mask=j < K, other=-1) >= 0
        lo = tl.minimum(lo, tl.min(tl.where(ok, j, K), 0))
        hi = tl.maximum(hi, tl.max(tl.where(ok, j + 1, 0), 0))
    return lo // BLOCK_K * BLOCK_K, hi


@triton.jit
def _attend(q, m_i, l_i, acc, t, r, kv_ptr, bt_ptr, idx_ptr, K, E, d, nope, rope, scale,
            s_kv0, s_kv1, s_kvd, s_bt0, s_bt1, s_i0, s_i1,
            KIND: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr,
            PRECISION: tl.constexpr, HW_E4M3: tl.constexpr):
    """Fold the first K key slots of one source into query t's running softmax (m_i, l_i [BH],
    acc [BH, BD]).

    ``KIND``: "gathered" (``kv_ptr`` [T, K, d] keys, ``idx_ptr`` [T, K] bool valid), or entries
    ``idx_ptr`` [T, K] (-1: empty) of request ``r`` in a paged cache ``kv_ptr`` [N, E, C] through its
    block table, "raw" (q's dtype) or "fp8" (main entries decoded in registers). Paged sources run
    only the key blocks of :func:`_slot_span`: the blocks outside it are neither loaded nor computed (a
    C128 decode's fixed-width slot list is mostly empty past the visible entries; window lists are
    empty before position 0, C4 top-k lists after the picks). A bound rather than a per-block branch
    keeps the loop software-pipelined. ``HW_E4M3``: FP8 codes decoded by the GPU's conversion
    (``kv_cache.hardware_e4m3``).
    """
    dd = tl.arange(0, BLOCK_D)  # [BD]
    d_ok = dd < d
    q_in = q
    if DOT_F32:
        q_in = q.to(tl.float32)
    if KIND == "gathered":
        k_lo = 0
        k_hi = K
    else:
        k_lo, k_hi = _slot_span(idx_ptr, t, K, s_i0, s_i1, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        j = k0 + tl.arange(0, BLOCK_K)  # [BK]
        if KIND == "gathered":
            ok = tl.load(idx_ptr + t * s_i0 + j * s_i1, mask=j < K, other=0) != 0  # [BK]
            row = kv_ptr + t * s_kv0 + j.to(tl.int64) * s_kv1  # [BK]
        else:
            e = tl.load(idx_ptr + t * s_i0 + j * s_i1, mask=j < k_hi, other=-1).to(tl.int64)  # [BK]
            ok = e >= 0
            block = kv_ptr + tl.load(bt_ptr + r * s_bt0 + (e // E) * s_bt1, mask=ok, other=0).to(tl.int64) * s_kv0
            row = block + (e % E) * s_kv1  # [BK]
        # Invalid slots are masked out of the loads: whatever they hold (NaN) never enters the math.
        if KIND == "fp8":  # e4m3 x 2^k and bf16: exact in q's dtype, so products equal the gathered path's
            data, scales = main_parts(block, e % E, E, nope + 2 * rope, s_kv1)  # entry bytes contiguous: C = s_kv1
            kv = main_values(data[:, None], scales[:, None], dd[None, :], ok[:, None], nope, rope,
                              _NOPE_BLOCK, HW_E4M3).to(q.dtype)
        else:
            kv = tl.load(row[:, None] + dd[None, :] * s_kvd, mask=ok[:, None] & d_ok[None, :], other=0.0)
        kv_in = kv  # [BK, BD]
        if DOT_F32:
            kv_in = kv.to(tl.float32)
        logits = tl.dot(q_in, tl.trans(kv_in), input_precision=PRECISION) * scale  # [BH, BK] fp32
        logits = tl.where(ok[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))  # [BH]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: keep exp() finite
        alpha = tl.exp(m_i - m_safe)  # [BH]
        p = tl.exp(logits - m_safe[:, None])  # [BH, BK]
        l_i = l_i * alpha + tl.sum(p, 1)
        p_in = p.to(kv.dtype)  # bf16 weights into the MMA, as flash attention does
        if DOT_F32:
            p_in = p_in.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_in, kv_in, input_precision=PRECISION)  # [BH, BD]
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _sparse_attn_kernel(
    q_ptr, sink_ptr, out_ptr, req_ptr,
    w_ptr, w_bt_ptr, w_idx_ptr, Kw, Ew, w_nope, w_rope, s_w0, s_w1, s_w2, s_wbt0, s_wbt1, s_wi0, s_wi1,
    m_ptr, m_bt_ptr, m_idx_ptr, Km, Em, m_nope, m_rope, s_m0, s_m1, s_m2, s_mbt0, s_mbt1, s_mi0, s_mi1,
    H, d, scale,
    s_qt, s_qh, s_qd, s_ot, s_oh, s_od, s_r,
    WINDOW: tl.constexpr, MAIN: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, HW_E4M3: tl.constexpr,
):
    """Query t, heads block: the window source's slots then the main source's (``MAIN`` "none": absent)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    h_ok = h < H
    dd = tl.arange(0, BLOCK_D)  # [BD]
    d_ok = dd < d
    q = tl.load(q_ptr + t * s_qt + h[:, None] * s_qh + dd[None, :] * s_qd,
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # [BH, BD]
    if WINDOW == "gathered":  # no request: validity is the mask
        r = t
    else:  # a padding row (r < 0) runs no slot: it reads no entry
        r = tl.load(req_ptr + t * s_r).to(tl.int64)
        Kw = tl.where(r >= 0, Kw, 0)
        Km = tl.where(r >= 0, Km, 0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the logits
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp(l - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)  # running sum of exp(l - m_i) k
    m_i, l_i, acc = _attend(q, m_i, l_i, acc, t, r, w_ptr, w_bt_ptr, w_idx_ptr, Kw, Ew, d, w_nope, w_rope,
                            scale, s_w0, s_w1, s_w2, s_wbt0, s_wbt1, s_wi0, s_wi1,
                            WINDOW, BLOCK_K, BLOCK_D, DOT_F32, PRECISION, HW_E4M3)
    if MAIN != "none":
        m_i, l_i, acc = _attend(q, m_i, l_i, acc, t, r, m_ptr, m_bt_ptr, m_idx_ptr, Km, Em, d, m_nope, m_rope,
                                scale, s_m0, s_m1, s_m2, s_mbt0, s_mbt1, s_mi0, s_mi1,
                                MAIN, BLOCK_K, BLOCK_D, DOT_F32, PRECISION, HW_E4M3)

    sink = tl.load(sink_ptr + h, mask=h_ok, other=float("-inf"))  # [BH]
    m = tl.maximum(m_i, sink)
    m = tl.where(m == float("-inf"), 0.0, m)  # no key and no sink: everything below is 0
    c = tl.exp(m_i - m)  # [BH]
    denom = l_i * c + tl.exp(sink - m)  # [BH]
    w = c / tl.where(denom > 0, denom, 1.0)  # denom = 0 only when c = 0 (no key, no sink)
    out = acc * w[:, None]  # [BH, BD]
    tl.store(out_ptr + t * s_ot + h[:, None] * s_oh + dd[None, :] * s_od,
             out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])


# The interpreter (TRITON_INTERPRET=1, CPU tests) multiplies bf16 dot operands as raw uint16 (triton
# 3.9); it gets them upcast to fp32, which gives the same products. Compiled kernels keep bf16 MMAs.
_INTERPRETED = not isinstance(_sparse_attn_kernel, JITFunction)


def _config(H: int, d: int, dtype: torch.dtype, fp8: bool) -> dict:
    """Tile sizes (``tl.dot`` needs every dim >= 16). One head block of up to 64 heads per token, so
    that each key is read once per token: 64 x 64 tiles, 8 warps, 2 stages (16-head blocks read every
    key once per head block, several times slower; docs/bench has the measurements). fp32 (a test
    path) keeps 16 x 16 tiles: 64 x 64 fp32 key tiles would not fit shared memory. FP8 sources decode
    the key tile through fp32 registers next to the fp32 accumulator: 16-key blocks, as wider ones
    spill several times more registers to local memory (scripts/sass_loops.py shows a build's)."""
    block_d = max(16, triton.next_power_of_2(d))
    if dtype == torch.float32 and block_d >= 256:
        return dict(BLOCK_H=16, BLOCK_K=16, BLOCK_D=block_d, num_warps=8, num_stages=2)
    block_h = max(16, min(64, triton.next_power_of_2(H)))
    return dict(BLOCK_H=block_h, BLOCK_K=16 if fp8 else 64, BLOCK_D=block_d, num_warps=8 if block_d >= 256 else 4,
                num_stages=2)


def _source_args(src: CacheSource | None, entries: Tensor | None, q: Tensor) -> tuple[str, tuple]:
    """(kind, the kernel's per-source arguments) of one paged source; kind "none" for an absent one
    (placeholders, never dereferenced)."""
    T, _, d = q.shape
    if src is None:
        assert entries is None
        return "none", (q, q, q, 0, 1, 0, 0) + (0,) * 7
    view, bt = src.view, src.block_table
    assert view.dim() == 3 and bt.dim() == 2, (view.shape, bt.shape)
    assert entries.dim() == 2 and entries.shape[0] == T and not entries.dtype.is_floating_point, entries.shape
    mode, dim, nope, rope = entry_mode(view, src.fp8)
    assert mode != "index" and dim == d, (mode, dim, d)
    assert mode == "main" or view.dtype == q.dtype, (view.dtype, q.dtype)
    kind = "fp8" if mode == "main" else "raw"
    return kind, (view, bt, entries, entries.shape[1], src.entries_per_block, nope, rope,
                  *view.stride(), *bt.stride(), *entries.stride())


def _launch(q: Tensor, sink: Tensor, scale: float, req: Tensor, window: tuple[str, tuple],
            main: tuple[str, tuple], out: Tensor | None = None) -> Tensor:
    T, H, d = q.shape
    assert q.dtype in (torch.float32, torch.bfloat16, torch.float16), q.dtype
    assert sink.shape == (H,), sink.shape
    if out is None:
        out = torch.empty(T, H, d, dtype=q.dtype, device=q.device)  # [T, H, d]
    assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype, q.shape, q.dtype)
    if T == 0 or H == 0:
        return out
    sink = sink.to(device=q.device, dtype=torch.float32).contiguous()
    cfg = _config(H, d, q.dtype, "fp8" in (window[0], main[0]))
    grid = (T, triton.cdiv(H, cfg["BLOCK_H"]))
    _sparse_attn_kernel[grid](
        q, sink, out, req, *window[1], *main[1], H, d, float(scale),
        *q.stride(), *out.stride(), req.stride(0),
        WINDOW=window[0], MAIN=main[0], DOT_F32=_INTERPRETED, HW_E4M3=hardware_e4m3(q.device),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **cfg,
    )
    return out


def sparse_attn(q: Tensor, kv: Tensor, valid: Tensor, sink: Tensor, scale: float) -> Tensor:
    """Triton :func:`sparse_attn_ref.sparse_attn` (same arguments and result).

    Args:
        q: ``[T, H, d]`` fp32 / bf16, any strides.
        kv: ``[T, K, d]`` gathered keys = values, same dtype as q, any strides.
        valid: ``[T, K]`` bool.
        sink: ``[H]`` (upcast to fp32).
        scale: softmax scale.

    Returns:
        ``[T, H, d]`` in ``q.dtype``; fp32 inside.
    """
    T, K = kv.shape[0], kv.shape[1]
    assert kv.dim() == 3 and T == q.shape[0] and kv.shape[2] == q.shape[2], (q.shape, kv.shape)
    assert kv.dtype == q.dtype, (kv.dtype, q.dtype)
    assert valid.shape == (T, K) and valid.dtype == torch.bool, (valid.shape, valid.dtype)
    gathered = (kv, kv, valid, K, 1, 0, 0, *kv.stride(), 0, 0, *valid.stride())  # no block table
    # no request either: ``valid`` stands in for ``req`` (never read)
    return _launch(q, sink, scale, valid, ("gathered", gathered), _source_args(None, None, q))


def sparse_attn_cached(q: Tensor, sink: Tensor, scale: float, req: Tensor, window: CacheSource,
                       window_entries: Tensor, main: CacheSource | None, main_entries: Tensor | None,
                       out: Tensor | None = None) -> Tensor:
    """Triton :func:`sparse_attn_ref.sparse_attn_cached` (same arguments and result): keys read in the
    kernel straight from the paged caches, FP8 main entries decoded in registers.

    CUDA-graph safe: no host synchronisation, shapes fixed by the arguments'. Padding rows
    (``req < 0``) read nothing, empty slots (entry -1) no key; key blocks before a row's first valid
    slot and after its last are skipped (a C128 decode's fixed-width list past the visible entries).

    Args:
        q: ``[T, H, d]`` fp32 / bf16, any strides.
        sink: ``[H]`` (upcast to fp32).
        scale: softmax scale.
        req: ``[T]`` int request of each query, < 0 for a padding row.
        window, main: ``CacheSource`` (view ``[N, E, C]`` any strides: raw entries in q's dtype with
            ``C = d``, or uint8 FP8 main entries of ``d`` values); ``main`` None for window-only layers.
        window_entries, main_entries: ``[T, W]`` / ``[T, K]`` int (int32 / int64, any strides), -1 for
            an empty slot; ``main_entries`` None with ``main``.
        out: ``[T, H, d]`` in ``q.dtype``, any strides, to write the result into.

    Returns:
        ``out``, or a new ``[T, H, d]`` in ``q.dtype``; fp32 inside.
    """
    assert req.shape == (q.shape[0],) and not req.dtype.is_floating_point, req.shape
    return _launch(q, sink, scale, req, _source_args(window, window_entries, q), _source_args(main, main_entries, q),
                   out)
