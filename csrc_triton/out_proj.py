"""Attention output projection ``wo_a`` with its inverse RoPE and FP8 activation quantisation in one
Triton kernel (docs/MODEL.md §5.6; semantics and oracle: out_proj_ref.rope_out_proj).

The unfused path runs the rope kernel, a transpose, then per group vLLM's activation quantiser and
block-FP8 GEMM: about 20 launches per layer, which dominate small steps. This kernel is one launch,
but its large prefill tiles are far from the GEMMs' speed, so the model runs it for steps of up to
``ops.OUT_PROJ_FUSED_MAX_TOKENS`` tokens (``ops.OUT_PROJ``; docs/bench has the measurements).

One program computes a [BLOCK_M tokens, BLOCK_N outputs] tile of one group. Per 128-wide K block it
loads the attention output, splits it into its interleaved rope pairs in registers and de-rotates
them with the per-token cos / sin of the reference's angles (worked out once per program with the
functions torch's CUDA ops call, so no launch of its own; cos 1, sin 0 outside the tail, which
leaves those values unchanged), rounds to o's dtype as
the unfused path stores it, quantises each token's 128 values to e4m3 with scale ``amax * fp32(1/448)`` (an
IEEE division by it and no FMA contraction, so each e4m3 value is the reference's), and
accumulates the FP8 tensor-core product scaled by the activation and weight block scales. A 128-block
never straddles two heads (``d % 128 == 0``) and the rope tail lies in a head's last block
(``rope_dim <= 128``), so the group's K blocks walk its heads in order.

:func:`rope_quant_fp8` stores the same de-rotated e4m3 activations and their scales instead of
multiplying them, laid out for DeepGEMM's grouped FP8 GEMM (``ops.OUT_PROJ=einsum``,
vllm_dsv4/ops/vllm_kernels.py binding 4), the route vLLM's in-tree model takes, faster than this
kernel on large steps.

Bytes per call: ``G*R*K`` FP8 weight (the decode cost) + ``4 G*R*K / 128^2`` scales + ``2 T H d`` in
+ ``2 T G R`` out (:func:`rope_quant_fp8` also ``8 T r/2`` of cos / sin tables from torch, whose CPU
functions the interpreter's do not match bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from csrc_triton.codec import bf16_bits, e4m3_decode, e4m3_encode, hardware_e4m3

FP8_MAX = tl.constexpr(448.0)
INV_FP8_MAX = tl.constexpr(1.0 / 448.0)  # fp8_linear_ref's scale factor
BLOCK_K = 128  # activation group = weight block


@triton.jit
def _tail_pairs(m_ok, d, nope, BLOCK_K: tl.constexpr):
    """The pairs of a head's last K block, where the rope tail lies: ``(frequency index [BK/2], < 0
    before the tail; [BM, BK/2] mask of the tail pairs of the tokens in range)``."""
    pair = (d - BLOCK_K) // 2 + tl.arange(0, BLOCK_K // 2) - nope // 2
    return pair, m_ok[:, None] & (pair >= 0)[None, :]


@triton.jit
def _tail_trig(cos_ptr, sin_ptr, m, m_ok, d, nope, half_r, BLOCK_K: tl.constexpr):
    """cos / sin [BM, BK/2] of the last K block's pairs from the launcher's [T, r/2] tables, loaded once
    per program; pairs before the tail get cos 1, sin 0, which leave them unchanged, exactly."""
    pair, tail = _tail_pairs(m_ok, d, nope, BLOCK_K)
    trig = m[:, None] * half_r + tl.maximum(pair, 0)[None, :]
    return tl.load(cos_ptr + trig, mask=tail, other=1.0), tl.load(sin_ptr + trig, mask=tail, other=0.0)


@triton.jit
def _tail_trig_of_positions(pos_ptr, freq_ptr, m, m_ok, d, nope, BLOCK_K: tl.constexpr):
    """:func:`_tail_trig` worked out in the program: the reference's fp32 angle (position times
    frequency, one rounding), then libdevice's cos / sin, the functions torch's CUDA ops call, with
    their full range reduction (positions reach 10^6)."""
    pair, tail = _tail_pairs(m_ok, d, nope, BLOCK_K)
    position = tl.load(pos_ptr + m, mask=m_ok, other=0).to(tl.float32)
    angle = position[:, None] * tl.load(freq_ptr + tl.maximum(pair, 0))[None, :]
    return tl.where(tail, tl.cos(angle), 1.0), tl.where(tail, tl.sin(angle), 0.0)


@triton.jit
def _derotated_fp8_block(o_ptr, m, m_ok, head, ch0, d, s_ot, s_oh, s_od, cos_tail, sin_tail,
                         ROUND_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         ROTATE: tl.constexpr = True):
    """Channels ``ch0 .. ch0 + BK`` of ``head`` for tokens ``m``, de-rotated, rounded as the unfused
    path stores them and quantised as the reference does: (values [BM, BK] on the e4m3 grid's scale,
    not yet cast; per-token scales [BM]). ``ROTATE=False``: a block known to lie before the rope tail,
    loaded as it is (the rotation by 1 / 0 and the bf16 rounding would leave it unchanged)."""
    ch = ch0 + tl.arange(0, BLOCK_K)
    x = tl.load(o_ptr + m[:, None].to(tl.int64) * s_ot + head * s_oh + ch[None, :] * s_od,
                mask=m_ok[:, None], other=0.0).to(tl.float32)  # [BM, BK]
    if ROTATE:
        in_tail = ch0 == d - BLOCK_K
        cos = tl.where(in_tail, cos_tail, 1.0)
        sin = tl.where(in_tail, sin_tail, 0.0)
        x0, x1 = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))  # interleaved pairs (2i, 2i+1)
        x = tl.reshape(tl.join(x0 * cos + x1 * sin, x1 * cos - x0 * sin), (BLOCK_M, BLOCK_K))  # rotate by -p
        if ROUND_BF16:  # as the unfused path stores the de-rotated output (identity on the bf16 nope values)
            x = (bf16_bits(x) << 16).to(tl.float32, bitcast=True)
    # the reference's scale exactly, and an IEEE division: the default fp32 '/' is approximate and
    # would move values across e4m3 rounding boundaries the reference does not cross
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) * INV_FP8_MAX  # [BM] per-token group scale
    return tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX), scale


@triton.jit(do_not_specialize=["T"])
def _rope_out_proj_kernel(
    o_ptr, pos_ptr, freq_ptr, w_ptr, ws_ptr, out_ptr,
    T, heads_per_group, d, nope, R, k_split,
    s_ot, s_oh, s_od, s_wn, s_wk, s_sn, s_sk, s_ys, s_yt, s_yn,
    ROUND_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] tokens
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output rows of wo_a (all of one group)
    g = tl.program_id(1) * BLOCK_N // R  # the group these rows belong to
    m_ok = m < T
    c = tl.arange(0, BLOCK_K)  # [BK] channel within the K block
    cos_tail, sin_tail = _tail_trig_of_positions(pos_ptr, freq_ptr, m, m_ok, d, nope, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # split-K programs (axis 2) take k_split channels each and store fp32 partial sums (the launcher adds them)
    k_begin = tl.program_id(2) * k_split
    k_end = tl.minimum(k_begin + k_split, heads_per_group * d)
    for k0 in range(k_begin, k_end, BLOCK_K):  # no branch in the body: Triton pipelines its loads
        v, scale = _derotated_fp8_block(o_ptr, m, m_ok, g * heads_per_group + k0 // d, k0 % d, d, s_ot, s_oh, s_od,
                                        cos_tail, sin_tail, ROUND_BF16, BLOCK_M, BLOCK_K)
        kw = (k0 + c).to(tl.int64)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * s_wn + kw[None, :] * s_wk)  # [BN, BK] e4m3, K contiguous
        w_scale = tl.load(ws_ptr + (n // BLOCK_K) * s_sn + (k0 // BLOCK_K) * s_sk)  # [BN]
        if DOT_F32:  # the interpreter, whose fp8 casts round wrongly: e4m3 by hand, exact fp32 products
            part = tl.dot(e4m3_decode(e4m3_encode(v), False), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:  # round to nearest even, as torch's cast
            part = tl.dot(v.to(tl.float8e4nv), tl.trans(w))
        acc += part * scale[:, None] * w_scale[None, :]
    out = out_ptr + tl.program_id(2) * s_ys + m[:, None].to(tl.int64) * s_yt + n[None, :] * s_yn
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _store_fp8_block(q_ptr, qs_ptr, v, scale, g, m, m_ok, k, T_scales, s_qg, s_qt, s_sg, s_st, s_sk,
                     HW_CAST: tl.constexpr, BLOCK_K: tl.constexpr):
    """One quantised [BM, BK] block at channel ``k`` of group ``g``'s row: e4m3 codes and the per-token
    scales (the scales' padding rows get 0: what the GEMM reads there multiplies nothing it stores)."""
    if HW_CAST:  # round to nearest even with saturation: torch's cast of the clamped values
        codes = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:  # e4m3 by hand: the interpreter's cast rounds wrongly, pre-sm_89 GPUs have none
        codes = e4m3_encode(v).to(tl.uint8)
    tl.store(q_ptr + g * s_qg + m[:, None].to(tl.int64) * s_qt + (k + tl.arange(0, BLOCK_K))[None, :], codes,
             mask=m_ok[:, None])
    tl.store(qs_ptr + g * s_sg + m * s_st + (k // BLOCK_K) * s_sk, tl.where(m_ok, scale, 0.0), mask=m < T_scales)


@triton.jit(do_not_specialize=["T", "T_scales", "s_sk"])
def _rope_quant_kernel(
    o_ptr, cos_ptr, sin_ptr, q_ptr, qs_ptr,
    T, T_scales, heads_per_group, d, nope, half_r,
    s_ot, s_oh, s_od, s_qg, s_qt, s_sg, s_st, s_sk,
    ROUND_BF16: tl.constexpr, HW_CAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] tokens (up to the scales' padded rows)
    head = tl.program_id(1)
    g = head // heads_per_group
    m_ok = m < T
    cos_tail, sin_tail = _tail_trig(cos_ptr, sin_ptr, m, m_ok, d, nope, half_r, BLOCK_K)
    k_head = (head % heads_per_group) * d  # the head's first channel within the group's row
    for ch0 in range(0, d - BLOCK_K, BLOCK_K):  # the blocks before the rope tail, as they are
        v, scale = _derotated_fp8_block(o_ptr, m, m_ok, head, ch0, d, s_ot, s_oh, s_od, cos_tail, sin_tail,
                                        ROUND_BF16, BLOCK_M, BLOCK_K, ROTATE=False)
        _store_fp8_block(q_ptr, qs_ptr, v, scale, g, m, m_ok, k_head + ch0, T_scales, s_qg, s_qt, s_sg, s_st, s_sk,
                         HW_CAST, BLOCK_K)
    v, scale = _derotated_fp8_block(o_ptr, m, m_ok, head, d - BLOCK_K, d, s_ot, s_oh, s_od, cos_tail, sin_tail,
                                    ROUND_BF16, BLOCK_M, BLOCK_K)
    _store_fp8_block(q_ptr, qs_ptr, v, scale, g, m, m_ok, k_head + d - BLOCK_K, T_scales, s_qg, s_qt, s_sg, s_st,
                     s_sk, HW_CAST, BLOCK_K)


def _tail_cos_sin(positions: Tensor, inv_freq: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin [T, r/2] of the reference's fp32 angles, once per token (not per program)."""
    angles = positions.to(device).float()[:, None] * inv_freq.to(device=device, dtype=torch.float32)
    return angles.cos(), angles.sin()


def fits(o: Tensor, weight: Tensor, groups: int, rope_dim: int) -> bool:
    """Whether the kernel covers these shapes: 128-blocks within heads, whole 128-row output blocks
    per group, the rope tail within a head's last 128-block."""
    T, H, d = o.shape
    return (d % BLOCK_K == 0 and H % groups == 0 and weight.shape[0] % (groups * BLOCK_K) == 0
            and weight.shape[1] == H // groups * d and 0 < rope_dim <= BLOCK_K and rope_dim % 2 == 0)


def default_tiles(T: int) -> dict:
    """The launch's tile sizes for ``T`` tokens (scripts/bench_kernels.py times others against them)."""
    if T <= 64:  # decode: split K into four shares so more programs stream the weight (V4-Flash's output
        # tiles alone give each of an H200's 132 SMs one program, 32 dependent K blocks long). Up to 16 tokens
        # (one row block) 128-wide 8-warp tiles, the faster where timed (scripts/bench_kernels.py); wider row
        # blocks keep the 64-wide tile until timed
        wide = T <= 16
        return dict(BLOCK_M=max(16, triton.next_power_of_2(T)), BLOCK_N=128 if wide else 64,
                    num_warps=8 if wide else 4, num_stages=4, SPLIT_K=4)
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


def rope_out_proj(o: Tensor, positions: Tensor, inv_freq: Tensor, weight: Tensor, weight_scale: Tensor,
                  groups: int, tiles: dict | None = None) -> Tensor:
    """Triton :func:`out_proj_ref.rope_out_proj` (same arguments and result; shapes as ``fits``);
    ``tiles`` overrides :func:`default_tiles` (``BLOCK_M``, ``BLOCK_N`` dividing a group's rows,
    ``num_warps``, ``num_stages``, and ``SPLIT_K``: that many programs per output tile, each over a
    share of the K blocks, their fp32 partial sums added in a fixed order)."""
    T, H, d = o.shape
    assert fits(o, weight, groups, 2 * inv_freq.numel()), (o.shape, weight.shape, groups, inv_freq.shape)
    assert o.dtype in (torch.bfloat16, torch.float32), o.dtype
    N, K = weight.shape
    out = torch.empty(T, N, dtype=o.dtype, device=o.device)
    if T == 0:
        return out
    tiles = dict(tiles or default_tiles(T))
    split = tiles.pop("SPLIT_K", 1)
    assert (N // groups) % tiles["BLOCK_N"] == 0, (N, groups, tiles)
    k_split = triton.cdiv(K // BLOCK_K, split) * BLOCK_K
    partial = out[None] if split == 1 else torch.empty(split, T, N, dtype=torch.float32, device=o.device)
    _rope_out_proj_kernel[(triton.cdiv(T, tiles["BLOCK_M"]), N // tiles["BLOCK_N"], split)](
        o, positions.to(o.device).contiguous(), inv_freq.to(device=o.device, dtype=torch.float32), weight,
        weight_scale, partial, T, H // groups, d, d - 2 * inv_freq.numel(), N // groups, k_split,
        *o.stride(), *weight.stride(), *weight_scale.stride(), *partial.stride(),
        ROUND_BF16=o.dtype == torch.bfloat16, BLOCK_K=BLOCK_K, DOT_F32=_INTERPRETED, **tiles,
        enable_fp_fusion=False,  # the rotation rounds each product as the reference does (no FMA contraction)
    )
    return out if split == 1 else partial.sum(0).to(o.dtype)


_INTERPRETED = not isinstance(_rope_out_proj_kernel, JITFunction)  # its fp8 casts round wrongly


def rope_quant_fp8(o: Tensor, positions: Tensor, inv_freq: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    """Triton :func:`out_proj_ref.rope_quant_fp8` (same arguments and values), laid out for DeepGEMM's
    grouped FP8 GEMM: ``q`` [T, G, K] stored group-major ([G, T, K] contiguous) and ``scale`` [T, G, K/128]
    stored token-fastest per group with the token count padded to a multiple of 4 (16-byte rows for
    its TMA loads; the padding holds 0). One program per (block of tokens, head)."""
    T, H, d = o.shape
    half_r = inv_freq.numel()
    assert d % BLOCK_K == 0 and H % groups == 0 and 0 < 2 * half_r <= BLOCK_K, (o.shape, groups, half_r)
    K = H // groups * d
    T_scales = -(-T // 4) * 4
    q = torch.empty(groups, T, K, dtype=torch.uint8, device=o.device)
    scale = torch.empty(groups, K // BLOCK_K, T_scales, dtype=torch.float32, device=o.device).transpose(1, 2)
    if T_scales:
        block_m = min(32, max(16, triton.next_power_of_2(T_scales)))
        _rope_quant_kernel[(triton.cdiv(T_scales, block_m), H)](
            o, *_tail_cos_sin(positions, inv_freq, o.device), q, scale,
            T, T_scales, H // groups, d, d - 2 * half_r, half_r,
            *o.stride(), *q.stride()[:2], *scale.stride(),
            ROUND_BF16=o.dtype == torch.bfloat16, HW_CAST=hardware_e4m3(o.device), BLOCK_M=block_m, BLOCK_K=BLOCK_K,
            enable_fp_fusion=False,  # the rotation rounds each product as the reference does
        )
    return q.view(torch.float8_e4m3fn).transpose(0, 1), scale[:, :T].transpose(0, 1)
