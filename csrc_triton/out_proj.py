"""Attention output projection ``wo_a`` with its inverse RoPE and FP8 activation quantisation in one
Triton kernel (dsv4_architecture.md §5.6; semantics and oracle: out_proj_ref.rope_out_proj).

The unfused path runs the rope kernel, a transpose, then per group vLLM's activation quantiser and
block-FP8 GEMM: about 20 launches per layer. Opt-in (``VLLM_DSV4_OUT_PROJ=fused``): its first
version, which computed cos / sin in every output block, took 109 us at 1 token and 21.7 ms at 8,192
on the H200 for V4-Flash's wo_a (33.5 MB of FP8 weight: 7 us of HBM time), far from the GEMMs it
replaces; this one is not yet measured. Here one
program computes a [BLOCK_M tokens, BLOCK_N outputs] tile of one group: per 128-wide K block it loads
the attention output (and each channel's rope partner ``c ^ 1``), de-rotates the tail channels in
fp32 with the per-token cos / sin the launcher computes as the reference does, rounds to o's dtype as
the unfused path stores it, quantises each token's 128 values to e4m3
with scale ``amax / 448``, and accumulates the FP8 tensor-core product scaled by the activation and
weight block scales. A 128-block never straddles two heads (``d % 128 == 0``), so the group's K
blocks walk its heads in order.

Bytes per call: ``G*R*K`` FP8 weight (the decode cost) + ``4 G*R*K / 128^2`` scales + ``2 T H d`` in
(read twice: the partner load hits the cache) + ``2 T G R`` out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from csrc_triton.kv_cache import _bf16_bits, _e4m3_decode, _e4m3_encode

FP8_MAX = tl.constexpr(448.0)
BLOCK_K = 128  # activation group = weight block


@triton.jit
def _rope_out_proj_kernel(
    o_ptr, cos_ptr, sin_ptr, w_ptr, ws_ptr, out_ptr,
    T, heads_per_group, d, nope, half_r, R,
    s_ot, s_oh, s_od, s_wn, s_wk, s_sn, s_sk, s_yt, s_yn,
    ROUND_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] tokens
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output rows of wo_a (all of one group)
    g = tl.program_id(1) * BLOCK_N // R  # the group these rows belong to
    m_ok = m < T
    c = tl.arange(0, BLOCK_K)  # [BK] channel within the K block
    partner = c ^ 1  # rope pairs are interleaved: (2i, 2i+1)
    sign = tl.where(c % 2 == 0, 1.0, -1.0)  # inverse rotation: y0 = x0 cos + x1 sin, y1 = x1 cos - x0 sin
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, heads_per_group * d, BLOCK_K):
        head = g * heads_per_group + k0 // d
        ch = k0 % d + c  # [BK] channel within the head
        row = o_ptr + m[:, None].to(tl.int64) * s_ot + head * s_oh  # [BM, 1]
        x = tl.load(row + ch[None, :] * s_od, mask=m_ok[:, None], other=0.0).to(tl.float32)  # [BM, BK]
        if k0 % d + BLOCK_K > nope:  # this block holds rope tail channels
            xp = tl.load(row + (k0 % d + partner)[None, :] * s_od, mask=m_ok[:, None], other=0.0).to(tl.float32)
            rot = ch >= nope
            pair = m[:, None] * half_r + tl.where(rot, (ch - nope) // 2, 0)[None, :]  # [BM, BK] (token, frequency)
            ok = m_ok[:, None] & rot[None, :]
            cos = tl.load(cos_ptr + pair, mask=ok, other=1.0)
            sin = tl.load(sin_ptr + pair, mask=ok, other=0.0)
            y = x * cos + sign[None, :] * xp * sin
            if ROUND_BF16:  # as the unfused path stores the de-rotated output
                y = (_bf16_bits(y) << 16).to(tl.float32, bitcast=True)
            x = tl.where(rot[None, :], y, x)
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / FP8_MAX  # [BM] per-token group scale
        code = _e4m3_encode(x / scale[:, None])  # [BM, BK] round to nearest even, as torch's cast
        kw = (k0 + c).to(tl.int64)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * s_wn + kw[None, :] * s_wk)  # [BN, BK] e4m3, K contiguous
        w_scale = tl.load(ws_ptr + (n // BLOCK_K) * s_sn + (k0 // BLOCK_K) * s_sk)  # [BN]
        if DOT_F32:  # the interpreter: exact products of e4m3 values in fp32
            part = tl.dot(_e4m3_decode(code), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(code.to(tl.uint8).to(tl.float8e4nv, bitcast=True), tl.trans(w))
        acc += part * scale[:, None] * w_scale[None, :]
    out = out_ptr + m[:, None].to(tl.int64) * s_yt + n[None, :] * s_yn
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])


def fits(o: Tensor, weight: Tensor, groups: int, rope_dim: int) -> bool:
    """Whether the kernel covers these shapes: 128-blocks within heads, whole 128-row output blocks
    per group, the rope tail within a head."""
    T, H, d = o.shape
    return (d % BLOCK_K == 0 and H % groups == 0 and weight.shape[0] % (groups * BLOCK_K) == 0
            and weight.shape[1] == H // groups * d and 0 < rope_dim <= d and rope_dim % 2 == 0)


def rope_out_proj(o: Tensor, positions: Tensor, inv_freq: Tensor, weight: Tensor, weight_scale: Tensor,
                  groups: int) -> Tensor:
    """Triton :func:`out_proj_ref.rope_out_proj` (same arguments and result; shapes as ``fits``)."""
    T, H, d = o.shape
    assert fits(o, weight, groups, 2 * inv_freq.numel()), (o.shape, weight.shape, groups, inv_freq.shape)
    assert o.dtype in (torch.bfloat16, torch.float32), o.dtype
    N = weight.shape[0]
    out = torch.empty(T, N, dtype=o.dtype, device=o.device)
    if T == 0:
        return out
    block_m = min(64, max(16, triton.next_power_of_2(T)))
    block_n = 64 if T <= 64 else 128  # decode: more programs to stream the weight
    # the reference's angles and cos / sin, once per token (not per output block)
    freqs = positions.to(o.device).float()[:, None] * inv_freq.to(device=o.device, dtype=torch.float32)  # [T, r/2]
    _rope_out_proj_kernel[(triton.cdiv(T, block_m), N // block_n)](
        o, freqs.cos(), freqs.sin(), weight, weight_scale, out,
        T, H // groups, d, d - 2 * inv_freq.numel(), inv_freq.numel(), N // groups,
        *o.stride(), *weight.stride(), *weight_scale.stride(), *out.stride(),
        ROUND_BF16=o.dtype == torch.bfloat16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        DOT_F32=_INTERPRETED,
    )
    return out


_INTERPRETED = not isinstance(_rope_out_proj_kernel, JITFunction)  # its fp8 casts round wrongly
