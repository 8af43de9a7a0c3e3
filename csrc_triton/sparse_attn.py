"""Sparse shared-KV (MQA) attention with per-head sinks, Triton (dsv4_architecture.md §5.3).

Matches :func:`sparse_attn_ref.sparse_attn`: keys = values, the sink enters the denominator only,
invalid slots are never read, a row with no valid key (and a finite or absent sink) returns 0.

One program per (query token, block of heads): the token's q block stays in registers, its K keys
stream through in blocks of ``BLOCK_K`` with an online softmax; logits, weights and the ``[BLOCK_H, d]``
accumulator are fp32. ``d`` (512 in V4, any size here) is one padded tile. :func:`sparse_attn_paged`
is the same kernel reading each key straight from a paged cache by (block, offset) instead of from a
gathered copy.

Bytes (bf16, V4-Flash: H = 64, d = 512, K = 128 + 512): per token ``K * d * 2`` of keys (655 KB,
read once: all 64 heads are one block) + ``2 * H * d * 2`` of q and out (128 KB) + ``K`` bytes of
mask (+ ``16 K`` of indices when paged).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction


@triton.jit
def _sparse_attn_kernel(
    q_ptr, kv_ptr, blk_ptr, off_ptr, valid_ptr, sink_ptr, out_ptr,
    H, K, d, scale,
    s_qt, s_qh, s_qd,
    s_kv0, s_kv1, s_kvd,
    s_bt, s_bk, s_ft, s_fk,
    s_vt, s_vk,
    s_ot, s_oh, s_od,
    PAGED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    h_ok = h < H
    dd = tl.arange(0, BLOCK_D)  # [BD]
    d_ok = dd < d
    q = tl.load(q_ptr + t * s_qt + h[:, None] * s_qh + dd[None, :] * s_qd,
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # [BH, BD]
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the logits
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp(l - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)  # running sum of exp(l - m_i) k
    for k0 in range(0, K, BLOCK_K):
        j = k0 + tl.arange(0, BLOCK_K)  # [BK]
        ok = tl.load(valid_ptr + t * s_vt + j * s_vk, mask=j < K, other=0) != 0  # [BK]
        if PAGED:
            blk = tl.load(blk_ptr + t * s_bt + j * s_bk, mask=ok, other=0).to(tl.int64)
            off = tl.load(off_ptr + t * s_ft + j * s_fk, mask=ok, other=0).to(tl.int64)
            row = blk * s_kv0 + off * s_kv1  # [BK]
        else:
            row = t * s_kv0 + j.to(tl.int64) * s_kv1  # [BK]
        # Invalid slots are masked out of the load: whatever they hold (NaN) never enters the math.
        kv = tl.load(kv_ptr + row[:, None] + dd[None, :] * s_kvd,
                     mask=ok[:, None] & d_ok[None, :], other=0.0)  # [BK, BD]
        if DOT_F32:
            kv = kv.to(tl.float32)
        logits = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * scale  # [BH, BK] fp32
        logits = tl.where(ok[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))  # [BH]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: keep exp() finite
        alpha = tl.exp(m_i - m_safe)  # [BH]
        p = tl.exp(logits - m_safe[:, None])  # [BH, BK]
        l_i = l_i * alpha + tl.sum(p, 1)
        p_in = p.to(kv_ptr.dtype.element_ty)  # bf16 weights into the MMA, as flash attention does
        if DOT_F32:
            p_in = p_in.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_in, kv, input_precision=PRECISION)  # [BH, BD]
        m_i = m_new

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


def _config(H: int, d: int, dtype: torch.dtype) -> dict:
    """Tile sizes (``tl.dot`` needs every dim >= 16). One head block of up to 64 heads per token, so
    that each key is read once per token; measured on H200 (triton 3.6, bf16, H = 64, d = 512,
    K = 640): 64 x 64 tiles, 8 warps, 2 stages beat 16-head blocks by 2.4x (T = 64) to 5x (T = 1024).
    fp32 (a test path) keeps 16 x 16 tiles: 64 x 64 fp32 key tiles would not fit shared memory."""
    block_d = max(16, triton.next_power_of_2(d))
    if dtype == torch.float32 and block_d >= 256:
        return dict(BLOCK_H=16, BLOCK_K=16, BLOCK_D=block_d, num_warps=8, num_stages=2)
    block_h = max(16, min(64, triton.next_power_of_2(H)))
    return dict(BLOCK_H=block_h, BLOCK_K=64, BLOCK_D=block_d, num_warps=8 if block_d >= 256 else 4, num_stages=2)


def _launch(q, kv, strides_kv, blk, off, valid, sink, scale, paged: bool) -> Tensor:
    T, H, d = q.shape
    K = valid.shape[1]
    assert q.dtype in (torch.float32, torch.bfloat16, torch.float16), q.dtype
    assert kv.dtype == q.dtype, (kv.dtype, q.dtype)
    assert valid.shape == (T, K) and valid.dtype == torch.bool, (valid.shape, valid.dtype)
    assert sink.shape == (H,), sink.shape
    out = torch.empty(T, H, d, dtype=q.dtype, device=q.device)  # [T, H, d]
    if T == 0 or H == 0:
        return out
    sink = sink.to(device=q.device, dtype=torch.float32).contiguous()
    cfg = _config(H, d, q.dtype)
    grid = (T, triton.cdiv(H, cfg["BLOCK_H"]))
    _sparse_attn_kernel[grid](
        q, kv, blk, off, valid, sink, out,
        H, K, d, float(scale),
        *q.stride(), *strides_kv, blk.stride(0), blk.stride(1), off.stride(0), off.stride(1),
        *valid.stride(), *out.stride(),
        PAGED=paged, DOT_F32=_INTERPRETED, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **cfg,
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
    no_index = valid.new_empty((1, 1), dtype=torch.int32)  # unused when not paged
    return _launch(q, kv, kv.stride(), no_index, no_index, valid, sink, scale, paged=False)


def sparse_attn_paged(q: Tensor, cache: Tensor, block_ids: Tensor, offsets: Tensor, valid: Tensor,
                      sink: Tensor, scale: float) -> Tensor:
    """:func:`sparse_attn` reading key j of token t from ``cache[block_ids[t, j], offsets[t, j]]``.

    Equals ``sparse_attn_ref.sparse_attn(q, cache[block_ids, offsets], valid, sink, scale)`` without
    materialising the ``[T, K, d]`` gather; slots with ``valid = False`` are never dereferenced, so
    their ids may be anything (-1).

    Args:
        q: ``[T, H, d]``.
        cache: ``[N_blocks, E, d]`` entries of one cache component, same dtype as q; any strides (a
            view into vLLM's block-outermost page, where the page stride exceeds ``E * d``).
        block_ids: ``[T, K]`` int32 / int64 physical block of each key.
        offsets: ``[T, K]`` int32 / int64 entry inside the block.
        valid: ``[T, K]`` bool.
        sink: ``[H]``.
        scale: softmax scale.

    Returns:
        ``[T, H, d]`` in ``q.dtype``.
    """
    T, K = valid.shape
    assert cache.dim() == 3 and cache.shape[2] == q.shape[2], (q.shape, cache.shape)
    assert block_ids.shape == offsets.shape == (T, K), (block_ids.shape, offsets.shape, valid.shape)
    assert not block_ids.dtype.is_floating_point and not offsets.dtype.is_floating_point
    return _launch(q, cache, cache.stride(), block_ids, offsets, valid, sink, scale, paged=True)
