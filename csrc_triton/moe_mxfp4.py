"""Routed experts on packed MXFP4 weights, and on FP8 128x128 blocks (V4-Flash-Base), Triton
(docs/MODEL.md §3.3, §6 steps 4-5).

Matches :func:`moe_mxfp4_ref.moe_experts_mxfp4` / :func:`moe_mxfp4_ref.moe_experts_fp8` (=
:func:`routing_ref.moe_experts` on the decoded weights) without ever materialising a decoded weight:
the weights are decoded in registers. The two formats share every kernel; ``FP8`` picks the decode.

1. ``align_pairs`` (two small kernels, no host sync; semantics: ``moe_mxfp4_ref.align_pairs``): the
   ``T*k`` (token, slot) pairs are grouped by expert, skipped ids (``E_local``, or anything outside
   ``[0, E_local)``) dropped, and each expert's rows padded to ``BLOCK_M``; ``block_expert[b]`` is
   the expert of row block b (-1 past the last one). The grid is sized by a bound
   (``cdiv(T*k, BLOCK_M) + min(E_local, T*k)`` blocks), not by the routing. It replaces a dozen
   PyTorch launches (count, cumsum, searchsorted, sort, scatter) per MoE call of a decode step.
2. ``_w13_swiglu_kernel``: per (row block, block of I columns) ``[x W1_e^T | x W3_e^T]`` over the
   gathered token rows, fused with :func:`routing_ref.swiglu_clamped`; h is stored in ``x.dtype``.
3. ``_w2_kernel``: ``h W2_e^T`` times the routing weight, in fp32, written to the pair's row.
4. ``_sum_k_kernel``: the k rows of each token summed in fp32 (skipped slots masked), cast to
   ``x.dtype``: deterministic, no atomics; the shared expert's output added there when given.

MXFP4 decode of a ``[BLOCK_N, BLOCK_K]`` tile, two codes per bit operation: weights are read as
32-bit words of 8 codes (nibble j = code j), and a word shifted left by ``4 * (3 - i)`` has codes i
and i + 4 at bits 12..15 and 28..31, from where ``(q & 0x80008000) | ((q >> 6) & 0x01C001C0)``
places each code ``s e1 e0 m`` at bf16 bits 15 / 8..6 of its half: the bf16 number
``e2m1 * 2^-126`` (code ``s 00 m`` is the bf16 subnormal ``m * 2^-127``). An exact bf16 product,
both halves of a register at once, gives the weight: ``* 2^(s - 1)``, which bf16 holds for scale
bytes up to 128 (``narrow_scales``), else two: ``* 2^(min(s, 128) - 1) * 2^(max(s, 128) - 128)``.
The halves of such a register feed a tensor-core instruction as one pair of K, so the kernel's K order within each 8 is
0 4 1 5 2 6 3 7: the W13 pass permutes its x tile in registers and stores h in that order, which
the W2 pass reads as it is. Weights are thus the reference's values, x is exact in its dtype, and
only the fp32 summation order differs, plus h rounded to ``x.dtype`` (the reference keeps it fp32).
Tiles divide the dims (the launcher narrows them), so the K loops load without masks and Triton
pipelines them. About 5-6 SASS instructions per weight element at decode (sm_90, triton 3.9; the
even/odd split with fp32 scaling it replaced took 9-11).

FP8 decode of a ``[BLOCK_N, BLOCK_K]`` tile: the e4m3 bytes converted by the hardware, times each
row's float32 block scale (a K step never straddles a 128-column block: BLOCK_K divides 128), in
fp32, then in x's dtype for the dot: exact for power-of-two scales (loader/checkpoint.py checks them).
K keeps its natural order. Bytes per hit expert at V4-Flash's sizes: 24 MiB of weights (twice
MXFP4's) + 6 KiB of scales.

Limits: D and I multiples of 32; x fp32 / bf16 / fp16 (decoded weights cast to x's dtype: exact in
fp16 for scales in its range); scale byte 255 (e8m0 NaN) gives inf where the reference gives NaN.
Transient buffers: h ``[rows, I]`` in x.dtype (rows <= ``T*k + E_local * BLOCK_M``) and the fp32
partial outputs ``[T*k, D]``: at V4-Flash, T = 8192, about 270 MB + 800 MB.

Bytes (V4-Flash, D = 4096, I = 2048): per hit expert 8 MiB of W13 codes + 4 MiB of W2 codes +
0.75 MiB of scales, read once per row block (one block per expert at decode: T = 1 reads 6
experts, 76.5 MiB); x, h and the partial outputs are small beside them at decode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from csrc_triton.codec import as_stored, store_values
from csrc_triton.formats import FP8_BLOCK, MXFP4_BLOCK
from csrc_triton.routing import swiglu_clamped_values


@triton.jit
def _mul_bf16x2(a, b):
    """``a * b`` in bf16, both halves of a register at once (Triton's own bf16 product makes ptxas
    swap each pair's halves before and after it). An FMA adding -0, exact: mul.bf16x2 needs sm_90."""
    return tl.inline_asm_elementwise("{ .reg .b32 nz; mov.b32 nz, 0x80008000; fma.rn.bf16x2 $0, $1, $2, nz; }",
                                     "=r,r,r", [a, b], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _code_pair(words, i: tl.constexpr):
    """Codes ``i`` and ``i + 4`` of each word (nibble j is code j) as the bits of bf16 ``e2m1 * 2^-126``:
    the word shifted so that they sit at bits 12..15 and 28..31, three bit operations place both."""
    q = words << (4 * (3 - i))
    pair = (q & 0x80008000) | ((q >> 6) & 0x01C001C0)
    return (pair & 0xFFFF).to(tl.uint16), (pair >> 16).to(tl.uint16)


@triton.jit
def _decode_tile(w_ptrs, s_ptrs, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NARROW_SCALES: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    """``[BLOCK_N, BLOCK_K]`` of MXFP4 weight (its words at ``w_ptrs``, scale bytes at ``s_ptrs``)
    in the kernel's K order, fp32 when ``INTERPRETED`` (its dots need fp32), else bf16."""
    words = tl.load(w_ptrs).to(tl.uint32, bitcast=True)  # [BN, BK/8]: 8 codes each
    s = tl.load(s_ptrs).to(tl.int32)  # [BN, BK/32] e8m0 bytes
    lo0, hi0 = _code_pair(words, 0)
    lo1, hi1 = _code_pair(words, 1)
    lo2, hi2 = _code_pair(words, 2)
    lo3, hi3 = _code_pair(words, 3)
    lo = tl.reshape(tl.join(tl.join(lo0, lo2), tl.join(lo1, lo3)), [BLOCK_N, BLOCK_K // 8, 4])  # codes 0..3
    hi = tl.reshape(tl.join(tl.join(hi0, hi2), tl.join(hi1, hi3)), [BLOCK_N, BLOCK_K // 8, 4])  # codes 4..7
    codes = tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K])  # position 2i + h: code i + 4h
    if INTERPRETED:  # fp32 through the bits: the interpreter's bf16 -> fp32 cast flushes the subnormal codes
        w = (codes.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        w = codes.to(tl.bfloat16, bitcast=True)
    # times 2^(s - 1), exactly: one product where every s <= 128 (bf16's range holds 2^(s - 1)), else two
    w = _times_pow2(w, (s if NARROW_SCALES else tl.minimum(s, 128)) + 126, BLOCK_N, BLOCK_K, INTERPRETED)
    if not NARROW_SCALES:
        w = _times_pow2(w, tl.maximum(s, 128) - 1, BLOCK_N, BLOCK_K, INTERPRETED)
    return w


SCALE_BLOCK = tl.constexpr(FP8_BLOCK)  # FP8 weights: one scale per SCALE_BLOCK x SCALE_BLOCK


@triton.jit
def _fp8_tile(w_ptrs, s_ptrs):
    """FP8 weight ``[BLOCK_N, BLOCK_K]`` (e4m3 bytes at ``w_ptrs``) times each row's block scale (float32 at
    ``s_ptrs`` ``[BLOCK_N]``), in fp32: exact for power-of-two scales."""
    w = tl.load(w_ptrs).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return w * tl.load(s_ptrs)[:, None]


@triton.jit
def _times_pow2(w, biased_exponent, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """``w [BN, BK]`` times ``2^(biased_exponent - 127)``, one exponent ``[BN, BK/32]`` per 32 of K
    (the K order permutes within 8s): exact, in fp32 under the interpreter, else in bf16 pairs."""
    e = tl.reshape(tl.broadcast_to(biased_exponent[:, :, None], [BLOCK_N, BLOCK_K // 32, 32]), [BLOCK_N, BLOCK_K])
    if INTERPRETED:
        return w * (e << 23).to(tl.float32, bitcast=True)
    return _mul_bf16x2(w, (e << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True))


@triton.jit
def _dot(acc, a, w, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a w^T``: fp32 operands under the interpreter (see ``_INTERPRETED``), else w in a's dtype (exact:
    two significant bits)."""
    if INTERPRETED:
        a = a.to(tl.float32)
    else:
        w = w.to(a.dtype)
    return tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)


@triton.jit
def _to_k_order(a, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns of ``a [BM, BK]`` in the kernel's K order (within each 8: 0 4 1 5 2 6 3 7), in registers."""
    return tl.reshape(tl.permute(tl.reshape(a, [BLOCK_M, BLOCK_K // 8, 2, 4]), (0, 1, 3, 2)), [BLOCK_M, BLOCK_K])


@triton.jit
def _w13_swiglu_kernel(
    x_ptr, w_ptr, s_ptr, h_ptr, pair_ptr, block_expert_ptr,
    I, D, top_k, limit,
    s_xt, s_we, s_wn, s_se, s_sn, s_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NARROW_SCALES: tl.constexpr, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr, X_IN_K_ORDER: tl.constexpr,
    FP8: tl.constexpr,
):
    e = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if e < 0:
        return
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] padded rows of this block
    pair = tl.load(pair_ptr + rows)  # [BM] (token, slot) pair, -1 on padding
    m_ok = pair >= 0
    tok = tl.where(m_ok, pair // top_k, 0).to(tl.int64)  # [BM] padding rows read token 0, never kept
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] rows of W1 (gate); of W3 (up) at I + n
    k = tl.arange(0, BLOCK_K)  # [BK] x columns of a K step
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    x_ptrs = x_ptr + tok[:, None] * s_xt + k[None, :]  # [BM, BK]
    if FP8:
        w_ptrs = w_ptr + e * s_we + n[:, None] * s_wn + k[None, :]  # [BN, BK] e4m3 bytes
        s_ptrs = s_ptr + e * s_se + (n // SCALE_BLOCK) * s_sn  # [BN] the rows' scales of K block 0
        s_up = tl.cdiv(I, SCALE_BLOCK) * s_sn  # W3's scale rows follow W1's
    else:
        kw = tl.arange(0, BLOCK_K // 8)  # [BK/8] weight words
        ks = tl.arange(0, BLOCK_K // 32)  # [BK/32] scales
        w_ptrs = w_ptr + e * s_we + n[:, None] * s_wn + kw[None, :]  # [BN, BK/8]
        s_ptrs = s_ptr + e * s_se + n[:, None] * s_sn + ks[None, :]  # [BN, BK/32]
    for kk in range(0, D, BLOCK_K):
        xk = tl.load(x_ptrs)  # [BM, BK]
        if FP8:
            w1 = _fp8_tile(w_ptrs, s_ptrs + kk // SCALE_BLOCK)
            w3 = _fp8_tile(w_ptrs + I * s_wn, s_ptrs + s_up + kk // SCALE_BLOCK)
        else:
            if not X_IN_K_ORDER:  # else the launcher permuted x's columns
                xk = _to_k_order(xk, BLOCK_M, BLOCK_K)
            w1 = _decode_tile(w_ptrs, s_ptrs, BLOCK_N, BLOCK_K, NARROW_SCALES, INTERPRETED)
            w3 = _decode_tile(w_ptrs + I * s_wn, s_ptrs + I * s_sn, BLOCK_N, BLOCK_K, NARROW_SCALES, INTERPRETED)
        gate = _dot(gate, xk, w1, INTERPRETED, PRECISION)
        up = _dot(up, xk, w3, INTERPRETED, PRECISION)
        x_ptrs += BLOCK_K
        if FP8:
            w_ptrs += BLOCK_K
        else:
            w_ptrs += BLOCK_K // 8
            s_ptrs += BLOCK_K // 32
    h = swiglu_clamped_values(gate, up, limit)  # [BM, BN]
    if FP8:
        col = n
    else:  # h's columns in the K order the W2 pass reads: column n at 8 * (n // 8) + 2 * (n % 4) + n % 8 // 4
        col = n - n % 8 + 2 * (n % 4) + n % 8 // 4
    tl.store(h_ptr + rows[:, None].to(tl.int64) * s_hm + col[None, :], h.to(h_ptr.dtype.element_ty))


@triton.jit
def _w2_kernel(
    h_ptr, w_ptr, s_ptr, y_ptr, pair_ptr, block_expert_ptr, rw_ptr,
    D, I,
    s_hm, s_we, s_wn, s_se, s_sn, s_yp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NARROW_SCALES: tl.constexpr, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    e = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if e < 0:
        return
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    pair = tl.load(pair_ptr + rows)  # [BM]
    m_ok = pair >= 0
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns (of D)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * s_hm + k[None, :]  # [BM, BK], already in the K order
    if FP8:
        w_ptrs = w_ptr + e * s_we + n[:, None] * s_wn + k[None, :]  # [BN, BK] e4m3 bytes
        s_ptrs = s_ptr + e * s_se + (n // SCALE_BLOCK) * s_sn  # [BN] the rows' scales of K block 0
    else:
        kw = tl.arange(0, BLOCK_K // 8)
        ks = tl.arange(0, BLOCK_K // 32)
        w_ptrs = w_ptr + e * s_we + n[:, None] * s_wn + kw[None, :]  # [BN, BK/8]
        s_ptrs = s_ptr + e * s_se + n[:, None] * s_sn + ks[None, :]  # [BN, BK/32]
    for kk in range(0, I, BLOCK_K):
        if FP8:
            w = _fp8_tile(w_ptrs, s_ptrs + kk // SCALE_BLOCK)
        else:
            w = _decode_tile(w_ptrs, s_ptrs, BLOCK_N, BLOCK_K, NARROW_SCALES, INTERPRETED)
        acc = _dot(acc, tl.load(h_ptrs), w, INTERPRETED, PRECISION)
        h_ptrs += BLOCK_K
        if FP8:
            w_ptrs += BLOCK_K
        else:
            w_ptrs += BLOCK_K // 8
            s_ptrs += BLOCK_K // 32
    rw = tl.load(rw_ptr + pair, mask=m_ok, other=0.0)  # [BM] fp32 routing weight
    tl.store(y_ptr + pair[:, None].to(tl.int64) * s_yp + n[None, :], acc * rw[:, None], mask=m_ok[:, None])


@triton.jit
def _sum_k_kernel(y_ptr, ids_ptr, shared_ptr, out_ptr, D, top_k, E, s_st,
                  SHARED: tl.constexpr, BLOCK_SLOTS: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    j = tl.arange(0, BLOCK_SLOTS)  # [BS] slots
    ids = tl.load(ids_ptr + t * top_k + j, mask=j < top_k, other=-1)
    ok = (ids >= 0) & (ids < E)  # skipped slots were never written
    y = tl.load(y_ptr + (t * top_k + j)[:, None] * D + d[None, :], mask=ok[:, None] & (d < D)[None, :], other=0.0)
    out = tl.sum(y, 0)  # [BD] fp32
    if SHARED:  # the routed sum as stored, plus the shared expert's output: the unfused add's two roundings
        out = as_stored(out, out_ptr) + tl.load(shared_ptr + t * s_st + d, mask=d < D, other=0.0).to(tl.float32)
    store_values(out_ptr + t * D + d, out, d < D, out_ptr.dtype.element_ty == tl.bfloat16)


# See sparse_attn.py: the interpreter needs fp32 dot operands (its bf16 matmul is wrong in triton 3.9);
# it cannot run inline PTX either.
_INTERPRETED = not isinstance(_w2_kernel, JITFunction)


def _tile(n: int, cap: int) -> int:
    """The largest power of two <= ``cap`` dividing ``n`` (a multiple of 32): tiles never straddle a dim."""
    t = cap
    while n % t:
        t //= 2
    return t


def _config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> dict:
    """Tile caps. Decode and small batches (at most 16 rows per expert on average): 16-row blocks,
    one per hit expert, so each weight byte is read once; 64-column tiles on 2 warps (each thread
    decodes twice the weight of the 4-warp 32-column tile for the same x loads), the best of the
    decode tiles timed at V4-Flash's shapes (docs/bench). Larger batches: 64 x 64 tiles reuse a
    decoded tile over 64 rows, the best of the batch tiles timed. fp32 (a test path) halves the K
    step. ``X_IN_K_ORDER``: W13 reads x with its columns already in the kernel's K order (one permuted
    copy per call): for batch tiles x then reaches the tensor cores as loaded, not gathered element by
    element (fewer instructions and registers per K step); decode tiles compile worse that way."""
    if num_pairs <= 16 * num_experts:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=2, num_stages=4)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, X_IN_K_ORDER=True)
    if dtype == torch.float32:
        cfg["BLOCK_K"] //= 2
    return cfg


@triton.jit(do_not_specialize=["P"])
def _expert_counts_kernel(ids_ptr, counts_ptr, cursor_ptr, P, E, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """counts[e] = the pairs routed to local expert e (E: skipped ids, anything outside [0, E)), and
    the placement's cursors zeroed, by one program: no buffer to clear before it, no atomics (a decode
    step's pairs are one load; an 8k prefill's 49k, 48 loads)."""
    counts = tl.zeros([BLOCK_E], tl.int32)
    for start in range(0, P, BLOCK):
        j = start + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + j, mask=j < P, other=0).to(tl.int32)
        counts += tl.histogram(tl.where((e >= 0) & (e < E), e, E), BLOCK_E, mask=j < P)
    ex = tl.arange(0, BLOCK_E)
    tl.store(counts_ptr + ex, counts, mask=ex <= E)
    tl.store(cursor_ptr + ex, tl.zeros([BLOCK_E], tl.int32), mask=ex <= E)


@triton.jit(do_not_specialize=["P", "num_blocks"])
def _place_pairs_kernel(ids_ptr, counts_ptr, cursor_ptr, bounds_ptr, pair_of_row_ptr, block_expert_ptr, P, E,
                        num_blocks, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, LOG2_BLOCK_E: tl.constexpr):
    """Each pair to a row of its expert's BLOCK_M-row blocks (a slot taken by atomic increment: the
    order within an expert varies, each row's result does not); the first programs also write
    block_expert and -1 to their blocks' padding rows (the rows past their expert's pairs: other
    rows than the pairs', so no order between programs is needed). Every program works out each
    expert's first and end block (a cumsum over the counts) and stores them to ``bounds`` [2, BLOCK_E]:
    the same values from every program, so their stores race harmlessly; a pair then reads its
    expert's, a block finds its expert by binary search."""
    ex = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + ex, mask=ex < E, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M  # [BE]
    block_end = tl.cumsum(blocks, 0)  # [BE]; past E: the total
    tl.store(bounds_ptr + ex, block_end - blocks)
    tl.store(bounds_ptr + BLOCK_E + ex, block_end)
    tl.debug_barrier()  # this program's stores, read back below by its other threads
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + j, mask=j < P, other=0).to(tl.int32)
    live = (j < P) & (e >= 0) & (e < E)
    e = tl.where(live, e, 0)
    start = tl.load(bounds_ptr + e, mask=live, other=0) * BLOCK_M  # [BLOCK] first row of e's blocks
    slot = tl.atomic_add(cursor_ptr + e, 1, mask=live)
    tl.store(pair_of_row_ptr + start + slot, j.to(tl.int32), mask=live)
    # expert of block b: how many experts end by b (block_end rises with e), found in LOG2_BLOCK_E halvings
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # this program's share of the blocks
    expert = tl.zeros([BLOCK], tl.int32)
    for level in tl.static_range(LOG2_BLOCK_E):
        step = BLOCK_E >> (level + 1)
        ends_by_b = tl.load(bounds_ptr + BLOCK_E + expert + step - 1) <= b
        expert = tl.where(ends_by_b, expert + step, expert)
    tl.store(block_expert_ptr + b, tl.where(expert < E, expert, -1), mask=b < num_blocks)
    e_ok = expert < E
    first = tl.load(bounds_ptr + expert, mask=e_ok, other=0)  # [BLOCK] the expert's first block
    held = tl.where(e_ok, tl.load(counts_ptr + expert, mask=e_ok, other=0) - (b - first) * BLOCK_M, 0)  # pairs in b
    row = tl.arange(0, BLOCK_M)
    tl.store(pair_of_row_ptr + b[:, None] * BLOCK_M + row[None, :], tl.full([BLOCK, BLOCK_M], -1, tl.int32),
             mask=(b < num_blocks)[:, None] & (row[None, :] >= held[:, None]))


def align_pairs(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """Triton :func:`moe_mxfp4_ref.align_pairs` (same arguments and result, up to the order of the
    pairs within each expert's rows); no host sync."""
    E, P, dev = num_experts, ids.numel(), ids.device
    num_blocks = triton.cdiv(P, block_m) + min(E, P)
    block_e = triton.next_power_of_2(E + 1)
    scratch = torch.empty(2, E + 1, dtype=torch.int32, device=dev)  # counts, cursors: the counts kernel writes both
    bounds = torch.empty(2, block_e, dtype=torch.int32, device=dev)  # experts' first and end blocks
    pair_of_row = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)  # every row written
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    flat = ids.reshape(-1)
    block = 128
    grid = (triton.cdiv(max(P, num_blocks), block),)
    _expert_counts_kernel[(1,)](flat, scratch[0], scratch[1], P, E, BLOCK=1024, BLOCK_E=block_e)
    _place_pairs_kernel[grid](flat, scratch[0], scratch[1], bounds, pair_of_row, block_expert, P, E, num_blocks,
                              BLOCK_M=block_m, BLOCK=block, BLOCK_E=block_e, LOG2_BLOCK_E=block_e.bit_length() - 1)
    return pair_of_row, block_expert


def moe_experts_mxfp4(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    swiglu_limit: float,
    narrow_scales: bool = False,
    shared: Tensor | None = None,
    config: dict | None = None,
) -> Tensor:
    """Triton :func:`moe_mxfp4_ref.moe_experts_mxfp4` (same arguments and result; ``shared`` added in
    the k-sum's launch); ``config`` overrides ``_config``'s tiles (scripts/bench_kernels.py times
    others against them).

    Args:
        x: ``[T, D]`` fp32 / bf16 / fp16.
        weights: ``[T, k]`` routing weights (upcast to fp32).
        ids: ``[T, k]`` int local expert ids; ``E_local`` (and anything outside ``[0, E_local)``) is skipped.
        w13: ``[E_local, 2I, D/2]`` uint8 / int8 packed e2m1, rows ``[:I]`` = W1 (gate), ``[I:]`` = W3.
        w13_scale: ``[E_local, 2I, D/32]`` uint8 / float8_e8m0fnu.
        w2: ``[E_local, D, I/2]`` uint8 / int8 packed e2m1.
        w2_scale: ``[E_local, D, I/32]`` uint8 / float8_e8m0fnu.
        swiglu_limit: L.
        narrow_scales: the caller's promise that no scale byte passes 128 (weights below 16, as in
            trained checkpoints: model/moe.py checks once at load); the decode then takes one product.
        shared: ``[T, D]`` in ``x.dtype`` (the shared expert's output), added to the result, or None.

    Returns:
        ``[T, D]`` in ``x.dtype``; matmuls and the weighted sum accumulate in fp32.
    """
    T, D = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    assert D % MXFP4_BLOCK == 0 and I % MXFP4_BLOCK == 0, (D, I)
    assert w13.shape == (E, 2 * I, D // 2) and w13_scale.shape == (E, 2 * I, D // MXFP4_BLOCK), w13_scale.shape
    assert w2.shape == (E, D, I // 2) and w2_scale.shape == (E, D, I // MXFP4_BLOCK), (w2.shape, w2_scale.shape)
    w13, w2 = w13.view(torch.int32), w2.view(torch.int32)  # words of 8 codes
    w13_scale, w2_scale = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    return _moe(x, weights, ids, (w13, w13_scale, w2, w2_scale), I, swiglu_limit, shared, config,
                dict(NARROW_SCALES=narrow_scales, FP8=False))


def moe_experts_fp8(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    swiglu_limit: float,
    shared: Tensor | None = None,
    config: dict | None = None,
) -> Tensor:
    """Triton :func:`moe_mxfp4_ref.moe_experts_fp8` (same arguments and result; ``shared`` added in the
    k-sum's launch): V4-Flash-Base's FP8 experts, on the MXFP4 kernels' rows and tiles.

    Args:
        x, weights, ids, swiglu_limit, shared, config: as :func:`moe_experts_mxfp4`.
        w13: ``[E_local, 2I, D]`` float8_e4m3fn (or its bytes), rows ``[:I]`` = W1 (gate), ``[I:]`` = W3.
        w13_scale: ``[E_local, 2 * ceil(I/128), ceil(D/128)]`` float32: W1's blocks, then W3's.
        w2: ``[E_local, D, I]`` float8_e4m3fn (or its bytes).
        w2_scale: ``[E_local, ceil(D/128), ceil(I/128)]`` float32.

    Returns:
        ``[T, D]`` in ``x.dtype``; matmuls and the weighted sum accumulate in fp32.
    """
    T, D = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    bi, bd = triton.cdiv(I, FP8_BLOCK), triton.cdiv(D, FP8_BLOCK)  # scale blocks along I and D
    assert D % MXFP4_BLOCK == 0 and I % MXFP4_BLOCK == 0, (D, I)  # the tiles divide them
    assert w13.shape == (E, 2 * I, D) and w13_scale.shape == (E, 2 * bi, bd), w13_scale.shape
    assert w2.shape == (E, D, I) and w2_scale.shape == (E, bd, bi), (w2.shape, w2_scale.shape)
    assert w13_scale.dtype == w2_scale.dtype == torch.float32, (w13_scale.dtype, w2_scale.dtype)
    w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)  # e4m3 bytes
    return _moe(x, weights, ids, (w13, w13_scale, w2, w2_scale), I, swiglu_limit, shared, config,
                dict(NARROW_SCALES=False, FP8=True))


def _moe(x: Tensor, weights: Tensor, ids: Tensor, experts: tuple[Tensor, ...], I: int, swiglu_limit: float,
         shared: Tensor | None, config: dict | None, decode: dict) -> Tensor:
    """The launches of both formats: ``experts`` (w13, w13_scale, w2, w2_scale) as the kernels read them,
    ``decode`` their constexprs ``NARROW_SCALES`` and ``FP8``."""
    T, D = x.shape
    k, (w13, w13_scale, w2, w2_scale) = ids.shape[1], experts
    E = w13.shape[0]
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16), x.dtype
    assert ids.shape == weights.shape == (T, k) and not ids.dtype.is_floating_point, (ids.shape, weights.shape)
    assert all(w.is_contiguous() for w in experts)
    assert shared is None or (shared.shape == (T, D) and shared.dtype == x.dtype and shared.stride(1) == 1), shared
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T * k == 0 or E == 0:
        return out.zero_() if shared is None else out.copy_(shared)
    x = x.contiguous()
    ids = ids.contiguous()
    rw = weights.to(torch.float32).contiguous()  # [T, k]
    cfg = dict(config or _config(T * k, E, x.dtype))
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    x_in_k_order = cfg.pop("X_IN_K_ORDER", False) and not decode["FP8"]  # FP8 keeps K's natural order
    pair_of_row, block_expert = align_pairs(ids, E, bm)
    num_blocks = block_expert.numel()
    # The interpreter truncates fp32 -> bf16 (triton 3.9): a biased h would test nothing, so there it stays fp32.
    h_dtype = torch.float32 if _INTERPRETED else x.dtype
    h = torch.empty(num_blocks * bm, I, dtype=h_dtype, device=x.device)  # [rows, I]
    y = torch.empty(T * k, D, dtype=torch.float32, device=x.device)  # [T*k, D]; skipped rows unwritten
    common = dict(BLOCK_M=bm, INTERPRETED=_INTERPRETED, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                  **decode, **cfg)
    bn1, bk1 = _tile(I, bn), _tile(D, bk)
    # x's columns within each 8 as 0 4 1 5 2 6 3 7 (the kernel's K order), copied once for all row blocks
    x13 = x.view(T, D // 8, 2, 4).transpose(2, 3).reshape(T, D) if x_in_k_order else x
    _w13_swiglu_kernel[(num_blocks, I // bn1)](
        x13, w13, w13_scale, h, pair_of_row, block_expert,
        I, D, k, float(swiglu_limit),
        x13.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), h.stride(0),
        BLOCK_N=bn1, BLOCK_K=bk1, X_IN_K_ORDER=x_in_k_order, **common,
    )
    bn2, bk2 = _tile(D, bn), _tile(I, bk)
    _w2_kernel[(num_blocks, D // bn2)](
        h, w2, w2_scale, y, pair_of_row, block_expert, rw,
        D, I,
        h.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), y.stride(0),
        BLOCK_N=bn2, BLOCK_K=bk2, **common,
    )
    block_d = min(1024, triton.next_power_of_2(D))
    _sum_k_kernel[(T, triton.cdiv(D, block_d))](y, ids, shared if shared is not None else out, out, D, k, E,
                                               shared.stride(0) if shared is not None else 0, SHARED=shared is not None,
                                               BLOCK_SLOTS=triton.next_power_of_2(k), BLOCK_D=block_d)
    return out
