"""Lightning-indexer scores + top-k, in Triton (docs/MODEL.md §5.5, HF semantics).

Matches :func:`indexer_ref.indexer_topk` in two stages:

1. ``_indexer_scores_kernel``, one program per (``TOKENS`` queries, block of ``BLOCK_N`` entries):
   ``score[t, w] = sum_h weights[t, h] * relu(q[t, h] . keys[w])`` as one ``[BLOCK_N, H]`` tensor-core
   dot per query, fp32 accumulation, keys as its rows so that the sum over heads runs along each row
   inside a warp (heads as rows would be summed across warps through shared memory, with many more
   barriers and shuffles); entries ``w >= num_visible[t]`` get -inf, and blocks wholly past
   the visible prefix are written without reading their keys (causal prefill reads half the keys).
   Prefill-sized calls put 8 neighbouring queries in a program, which load and FP8-decode the key tile
   once while they share keys (one query per program decoded every key tile once per query, which
   made this kernel a prefill's largest cost); decode batches keep one query each.
2. ``_select_kernel``, one program per query: the top-k of the visible prefix of its scores by radix
   select (four 8-bit histogram passes over the order-preserving integer keys of the fp32 scores find
   the k-th largest key, a fifth pass writes the indices above it and the lowest-indexed ones equal
   to it), then -1. It reads ``num_visible`` scores, not the row: a decode row's width is fixed at
   ``max_model_len / 4`` for CUDA graphs, which ``torch.topk`` would scan whole. A row with at
   most k visible entries picks them all without a pass. Deterministic: ties go to the lower index.

Bytes per query: ``H * di`` of q + ``num_visible * di`` of keys (from L2 after the first query of a
batch) + ``4 N`` of scores written (blocks past the visible prefix: -inf without reading keys) + at
most ``20 num_visible`` read by the selection + ``8 topk`` of indices.

:func:`indexer_topk_paged` runs the same kernel over a batch of decodes with ``PAGED`` (each query
finds its keys through its request's block-table row) and, for FP8 caches, ``FP8`` (the
``di + 4``-byte entries decoded in registers: e4m3 by the GPU's conversion on sm_89+, which halves the
kernel's sm_90 SASS, else by :mod:`kv_cache`'s integer codec; the same values): there is no gathered
``[B, N, di]`` copy, which moves each FP8 key in, its bf16 decode out and back in again. Its shapes
depend on ``max_entries`` only and nothing waits on the host, so it can be captured in a CUDA graph.
Bytes per query: ``H * di`` of q + ``num_visible * (di + 4)`` of FP8 keys (``2 di`` each raw bf16;
its own request's, not shared) + a block-table entry per ``E`` keys + ``8 N`` of scores + ``8 topk``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from csrc_triton.codec import e4m3_decode, entry_mode, hardware_e4m3, index_scale

# Elements of the fp32 [tokens, entries] score block materialised per chunk (128 MiB), as the reference.
_CHUNK_ELEMS = 1 << 25
# Calls of at least this many queries share key tiles between neighbouring queries (a prefill chunk; a
# decode batch of this size loads each row's keys anyway, once more for the tile it does not use).
PREFILL_QUERIES = 512


@triton.jit
def _key_tile(k_ptr, bt_ptr, r, t, n, vis, c, c_ok, di, E, s_k0, s_kn, s_kd, s_bt0, s_bt1,
              PAGED: tl.constexpr, FP8: tl.constexpr, HW_E4M3: tl.constexpr, DTYPE: tl.constexpr):
    """``[BN, BDI]`` keys ``n`` of query ``t`` (request ``r`` when PAGED) in DTYPE, 0 where not ``vis``."""
    if PAGED:  # entry n of request r is view[block_table[r, n // E], n % E]
        blk = tl.load(bt_ptr + r * s_bt0 + (n // E) * s_bt1, mask=vis, other=0).to(tl.int64)  # [BN]
        row = k_ptr + blk * s_k0 + (n % E).to(tl.int64) * s_kn  # [BN]
    else:  # keys [N, di] shared (s_k0 = 0) or [Tq, N, di] per query
        row = k_ptr + t * s_k0 + n.to(tl.int64) * s_kn  # [BN]
    k_mask = vis[:, None] & c_ok[None, :]
    if FP8:  # [di e4m3 | fp32 scale, little-endian] (kv_pack_ref.pack_index), decoded as kv_cache does
        code = tl.load(row[:, None] + c[None, :] * s_kd, mask=k_mask, other=0)  # [BN, BDI] uint8
        scale = index_scale(row[:, None], di, vis[:, None], s_kd)  # [BN]
        # e4m3 times a power of two: exact in q's dtype (bf16 has fp32's exponent range)
        return (e4m3_decode(code, HW_E4M3) * scale[:, None]).to(DTYPE)  # [BN, BDI]
    return tl.load(row[:, None] + c[None, :] * s_kd, mask=k_mask, other=0.0).to(DTYPE)  # [BN, BDI]


@triton.jit(do_not_specialize=["Tq"])
def _indexer_scores_kernel(
    q_ptr, w_ptr, k_ptr, nv_ptr, bt_ptr, req_ptr, score_ptr,
    Tq, H, N, di, E, w_scale,
    s_qt, s_qh, s_qd, s_wt, s_wh, s_k0, s_kn, s_kd, s_r, s_bt0, s_bt1, s_st, s_sn,
    PAGED: tl.constexpr, FP8: tl.constexpr, HW_E4M3: tl.constexpr, TOKENS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DI: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    # TOKENS consecutive queries per program share one loaded (and FP8-decoded) key tile while they
    # have the first one's keys (paged: the same request; else the launcher passes TOKENS > 1 only for
    # shared keys): a prefill chunk's queries do; a query of another request loads its own.
    t0 = tl.program_id(0).to(tl.int64) * TOKENS
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] entries
    h = tl.arange(0, BLOCK_H)
    h_ok = h < H
    c = tl.arange(0, BLOCK_DI)
    c_ok = c < di
    DTYPE: tl.constexpr = tl.float32 if DOT_F32 else q_ptr.dtype.element_ty
    nv_max = tl.load(nv_ptr + t0)  # the block's widest visible prefix
    for i in range(1, TOKENS):
        nv_max = tl.maximum(nv_max, tl.load(nv_ptr + tl.minimum(t0 + i, Tq - 1)))  # past Tq: the last again
    if tl.program_id(1) * BLOCK_N < nv_max:
        r0 = tl.maximum(tl.load(req_ptr + t0 * s_r).to(tl.int64), 0) if PAGED else 0  # a padding row: 0's
        k0 = _key_tile(k_ptr, bt_ptr, r0, t0, n, (n < nv_max) & (n < N), c, c_ok, di, E, s_k0, s_kn, s_kd,
                       s_bt0, s_bt1, PAGED, FP8, HW_E4M3, DTYPE)
        for i in range(0, TOKENS):
            t = t0 + i
            if t < Tq:
                nv = tl.load(nv_ptr + t)
                vis = (n < nv) & (n < N)  # [BN] (nv <= N is not assumed: clamp by N too)
                k = k0
                r = tl.load(req_ptr + t * s_r).to(tl.int64) if PAGED else 0
                if PAGED and r != r0:
                    k = _key_tile(k_ptr, bt_ptr, r, t, n, vis, c, c_ok, di, E, s_k0, s_kn, s_kd, s_bt0, s_bt1,
                                  PAGED, FP8, HW_E4M3, DTYPE)
                q = tl.load(q_ptr + t * s_qt + h[:, None] * s_qh + c[None, :] * s_qd,
                            mask=h_ok[:, None] & c_ok[None, :], other=0.0).to(DTYPE)  # [BH, BDI]
                logits = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # [BN, BH] fp32
                wh = tl.load(w_ptr + t * s_wt + h * s_wh, mask=h_ok, other=0.0).to(tl.float32) * w_scale  # [BH]
                score = tl.sum(tl.maximum(logits, 0.0) * wh[None, :], 1)  # [BN]
                tl.store(score_ptr + t * s_st + n * s_sn, tl.where(vis, score, float("-inf")), mask=n < N)
    else:
        for i in range(0, TOKENS):
            t = t0 + i
            if t < Tq:
                tl.store(score_ptr + t * s_st + n * s_sn, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=n < N)


# See sparse_attn.py: the interpreter needs fp32 dot operands (its bf16 matmul is wrong in triton 3.9).
_INTERPRETED = not isinstance(_indexer_scores_kernel, JITFunction)


def _scores(q: Tensor, weights: Tensor, num_visible: Tensor, keys: Tensor, key_strides: tuple, N: int,
            fp8_keys: bool = False, block_table: Tensor | None = None, req: Tensor | None = None,
            entries_per_block: int = 1, weight_scale: float = 1.0) -> Tensor:
    """``[Tq, N]`` fp32 scores, -inf at ``w >= num_visible[t]`` (``[Tq]`` on q's device); the head
    weights times ``weight_scale`` in fp32.

    Key ``w`` of query ``t`` is at ``keys + t * s0 + w * s1`` (``key_strides = (s0, s1, s_value)``), or,
    with a ``block_table``, at ``keys + block_table[req[t], w // E] * s0 + (w % E) * s1``.
    """
    Tq, H, di = q.shape
    assert weights.shape == (Tq, H) and num_visible.shape == (Tq,), (weights.shape, num_visible.shape)
    assert q.dtype in (torch.float32, torch.bfloat16, torch.float16), q.dtype
    scores = torch.empty(Tq, N, dtype=torch.float32, device=q.device)
    if Tq == 0 or N == 0:
        return scores
    paged = block_table is not None
    if not paged:  # placeholders, never dereferenced
        block_table, req = num_visible[None], num_visible
    block_h = max(16, triton.next_power_of_2(H))
    block_di = max(16, triton.next_power_of_2(di))
    # sm_90, bf16: no spills at 128 (64 past 64 heads); FP8 adds the fp32 decode of the key tile, so
    # it takes 64 (not measured)
    block_n = 32 if q.dtype == torch.float32 else (64 if block_h > 64 or fp8_keys else 128)
    # prefill-sized calls: 8 queries per key tile (consecutive queries of a chunk share their keys);
    # decode batches: one (each row its own request's keys)
    tokens = 8 if Tq >= PREFILL_QUERIES and (paged or key_strides[0] == 0) else 1
    _indexer_scores_kernel[(triton.cdiv(Tq, tokens), triton.cdiv(N, block_n))](
        q, weights, keys, num_visible, block_table, req, scores,
        Tq, H, N, di, entries_per_block, float(weight_scale),
        *q.stride(), *weights.stride(), *key_strides, req.stride(0), *block_table.stride(), *scores.stride(),
        PAGED=paged, FP8=fp8_keys, HW_E4M3=fp8_keys and hardware_e4m3(q.device), TOKENS=tokens,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_DI=block_di,
        DOT_F32=_INTERPRETED, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if block_h * block_n <= 8192 else 8,
    )
    return scores


def indexer_scores(q: Tensor, weights: Tensor, keys: Tensor, num_visible: Tensor) -> Tensor:
    """Stage 1: ``[Tq, N]`` fp32 scores, -inf at ``w >= num_visible[t]``.

    Args:
        q: ``[Tq, H, di]`` fp32 / bf16; weights ``[Tq, H]``; keys ``[N, di]`` shared or
        ``[Tq, N, di]`` per query (q's dtype); num_visible: ``[Tq]`` integer.
    """
    Tq, _, di = q.shape
    N = keys.shape[-2]
    assert keys.shape in ((N, di), (Tq, N, di)) and keys.dtype == q.dtype, (keys.shape, keys.dtype, q.dtype)
    key_query_stride = keys.stride(0) if keys.dim() == 3 else 0
    return _scores(q, weights, num_visible.to(q.device), keys, (key_query_stride, *keys.stride()[-2:]), N)


@triton.jit
def _order_key(x):
    """fp32 -> int64 in [0, 2^32) ordered as the floats (negative values bit-flipped, sign bit set on the rest)."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000).to(tl.int64)


@triton.jit
def _select_kernel(score_ptr, nv_ptr, out_ptr, N, K, s_st, s_sn, s_ot, s_ok, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    nv = tl.minimum(tl.load(nv_ptr + t).to(tl.int64), N)
    row, out = score_ptr + t * s_st, out_ptr + t * s_ot
    offs = tl.arange(0, BLOCK)
    if nv <= K:  # all of the visible prefix, then -1
        for k0 in range(0, K, BLOCK):
            j = k0 + offs
            tl.store(out + j * s_ok, tl.where(j < nv, j, -1).to(tl.int64), mask=j < K)
    else:
        bins = tl.arange(0, 512)  # digits 0..255; bin 256 collects the entries outside the prefix so far
        prefix = tl.zeros((), dtype=tl.int64)  # the k-th largest key's high digits found so far
        need = tl.zeros((), dtype=tl.int64) + K  # how many picks remain among the keys with that prefix
        for shift in tl.static_range(24, -1, -8):  # the key's bytes, high to low
            hist = tl.zeros((512,), dtype=tl.int32)
            for c0 in range(0, nv, BLOCK):
                j = c0 + offs
                key = _order_key(tl.load(row + j * s_sn, mask=j < nv, other=0.0))
                digits = ((key >> shift) & 255).to(tl.int32)
                hist += tl.histogram(tl.where((j < nv) & ((key >> (shift + 8)) == prefix), digits, 256), 512)
            hist = tl.where(bins < 256, hist, 0)
            at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # [512] keys with digit >= d
            digit = tl.max(tl.where((bins < 256) & (at_least >= need), bins, -1), 0)
            need -= tl.sum(tl.where(bins > digit, hist, 0), 0)
            prefix = prefix * 256 + digit
        # prefix is the k-th largest key; the K - need larger ones, then the first `need` equal ones
        above = K - need
        n_gt = tl.zeros((), dtype=tl.int64)
        n_eq = tl.zeros((), dtype=tl.int64)
        for c0 in range(0, nv, BLOCK):
            j = c0 + offs
            key = _order_key(tl.load(row + j * s_sn, mask=j < nv, other=0.0))
            gt = (j < nv) & (key > prefix)
            eq = (j < nv) & (key == prefix)
            slot_gt = n_gt + tl.cumsum(gt.to(tl.int64), 0) - 1
            slot_eq = n_eq + tl.cumsum(eq.to(tl.int64), 0) - 1
            tl.store(out + slot_gt * s_ok, j.to(tl.int64), mask=gt)
            tl.store(out + (above + slot_eq) * s_ok, j.to(tl.int64), mask=eq & (slot_eq < need))
            n_gt += tl.sum(gt.to(tl.int64), 0)
            n_eq += tl.sum(eq.to(tl.int64), 0)


def select_topk(scores: Tensor, num_visible: Tensor, k: int, out: Tensor | None = None) -> Tensor:
    """``[T, k]`` int64: per row the indices of the ``k`` largest of ``scores[t, :num_visible[t]]``
    (fp32 ``[T, N]``; ties to the lower index; in no particular order), then -1 in the spare slots;
    written into ``out`` when given (every slot)."""
    T, N = scores.shape
    out = torch.empty(T, k, dtype=torch.int64, device=scores.device) if out is None else out
    assert out.shape == (T, k) and out.dtype == torch.int64, (out.shape, out.dtype)
    if T and k:
        _select_kernel[(T,)](scores, num_visible, out, N, k, *scores.stride(), *out.stride(), BLOCK=1024,
                             num_warps=4)
    return out


def _topk(scores_of, num_visible: Tensor, Tq: int, N: int, topk: int, device: torch.device) -> Tensor:
    """Stage 2: ``[Tq, topk]`` int64, :func:`select_topk` of ``scores_of(rows)`` (the ``[t, N]`` scores
    of the query slice ``rows``, chunked over Tq as the reference) over ``num_visible`` (``[Tq]`` on
    ``device``): the picks first, then -1 (ops/flashmla.py relies on it). Shapes depend on the
    arguments' shapes only."""
    if N == 0:
        return torch.full((Tq, topk), -1, dtype=torch.int64, device=device)
    out = torch.empty(Tq, topk, dtype=torch.int64, device=device)  # [Tq, topk], every slot written
    chunk = max(16, _CHUNK_ELEMS // N // 16 * 16)  # slices start 16-aligned: compiled kernels specialise on it
    for s in range(0, Tq, chunk):
        rows = slice(s, s + chunk)
        select_topk(scores_of(rows), num_visible[rows], topk, out[rows])
    return out


def indexer_topk(q: Tensor, weights: Tensor, keys: Tensor, num_visible: Tensor, topk: int) -> Tensor:
    """Triton scores and selection: :func:`indexer_ref.indexer_topk` (same arguments and result).

    Args:
        q: ``[Tq, H, di]`` indexer queries (RoPE applied), fp32 / bf16.
        weights: ``[Tq, H]`` scaled head weights.
        keys: ``[N, di]`` indexer keys shared by all queries, or ``[Tq, N, di]`` per query; q's dtype.
        num_visible: ``[Tq]`` int64 visible prefix of the entries.
        topk: ``index_topk``.

    Returns:
        ``[Tq, topk]`` int64 entry indices, the picks in no particular order, then -1 in the
        ``topk - min(topk, num_visible[t])`` spare slots. Ties go to the lower index.
    """
    num_visible = num_visible.to(q.device)
    per_query = keys.dim() == 3

    def scores_of(rows: slice) -> Tensor:
        return indexer_scores(q[rows], weights[rows], keys[rows] if per_query else keys, num_visible[rows])

    return _topk(scores_of, num_visible, q.shape[0], keys.shape[-2], topk, q.device)


def indexer_topk_paged(q: Tensor, weights: Tensor, view: Tensor, block_table: Tensor, req: Tensor,
                       num_visible: Tensor, entries_per_block: int, fp8, topk: int, max_entries: int,
                       weight_scale: float = 1.0) -> Tensor:
    """:func:`indexer_ref.indexer_topk_paged` (same arguments and result), keys read in the kernel
    straight from the paged cache, FP8 entries decoded in registers, the head weights scaled there.

    CUDA-graph safe: no host synchronisation, every shape fixed by the arguments' shapes and
    ``max_entries``. Padding rows (``req < 0``) and entry blocks at or past ``num_visible`` read no key.

    Args:
        q: ``[B, H, di]`` indexer queries (RoPE applied), fp32 / bf16; one decode query per row.
        weights: ``[B, H]`` head weights, any float dtype (scaled by ``weight_scale`` in fp32).
        view: ``[num_blocks, E, C]`` the indexer cache component, any strides: raw keys (q's dtype,
            ``C = di``) or FP8 entries (uint8, ``C = di + 4``).
        block_table: ``[R, max_blocks]`` int32 / int64; entry n of request r is
            ``view[block_table[r, n // E], n % E]``.
        req: ``[B]`` int request of each row, < 0 for a padding row.
        num_visible: ``[B]`` int64 visible prefix of the request's entries, ``<= max_entries``.
        entries_per_block: ``E``.
        fp8: None (raw keys) or the FP8 entry spec (``rope_dim is None``, ``value_dim = di``).
        topk: ``index_topk``.
        max_entries: ``N``, static bound on ``num_visible`` (the scores are ``[B, N]``).
        weight_scale: the heads' common scale.

    Returns:
        ``[B, topk]`` int64 entry numbers, the picks in no particular order, then -1 in the spare
        slots; -1 in every slot of a padding row.
    """
    B, _, di = q.shape
    assert view.dim() == 3 and block_table.dim() == 2 and req.shape == (B,), (view.shape, block_table.shape, req.shape)
    mode, dim, _, _ = entry_mode(view, fp8)
    assert mode in ("raw", "index") and dim == di, (mode, dim, di)
    assert mode == "index" or view.dtype == q.dtype, (view.dtype, q.dtype)
    nv = torch.where(req >= 0, num_visible, 0)  # [B]; a padding row sees nothing: no read, all -1

    def scores_of(rows: slice) -> Tensor:
        return _scores(q[rows], weights[rows], nv[rows], view, view.stride(), max_entries, mode == "index",
                       block_table, req[rows], entries_per_block, weight_scale)

    return _topk(scores_of, nv, B, max_entries, topk, q.device)
