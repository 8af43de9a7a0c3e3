"""Lightning-indexer scores + top-k, Triton + torch.topk (dsv4_architecture.md §5.5, HF semantics).

Matches :func:`indexer_ref.indexer_topk` in two stages:

1. ``_indexer_scores_kernel``, one program per (query token, block of ``BLOCK_N`` entries):
   ``score[t, w] = sum_h weights[t, h] * relu(q[t, h] . keys[w])`` as one ``[H, BLOCK_N]`` tensor-core
   dot, fp32 accumulation; entries ``w >= num_visible[t]`` get -inf, and blocks wholly past the
   visible prefix are written without reading their keys (causal prefill reads half the keys).
2. ``torch.topk`` over the ``[Tq, N]`` fp32 scores (chunked over Tq like the reference), then -1 in
   the slots past the visible count. A fused top-k (radix select in the kernel) would save writing
   and re-reading the scores (``8 N`` bytes per query); it is left for when this shows up in a profile.

Bytes per query: ``H * di`` of q + ``num_visible * di`` of keys (from L2 after the first query of a
batch) + ``8 N`` of scores (write + topk read) + ``8 topk`` of indices.

:func:`indexer_topk_paged` runs the same kernel over a batch of decodes with ``PAGED`` (each query
finds its keys through its request's block-table row) and, for FP8 caches, ``FP8`` (the
``di + 4``-byte entries decoded in registers with :mod:`kv_cache`'s codec): there is no gathered
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

from csrc_triton.kv_cache import _e4m3_decode, _index_scale, _mode

# Elements of the fp32 [tokens, entries] score block materialised per chunk (128 MiB), as the reference.
_CHUNK_ELEMS = 1 << 25


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, k_ptr, nv_ptr, bt_ptr, req_ptr, score_ptr,
    H, N, di, E,
    s_qt, s_qh, s_qd, s_wt, s_wh, s_k0, s_kn, s_kd, s_r, s_bt0, s_bt1, s_st, s_sn,
    PAGED: tl.constexpr, FP8: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DI: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] entries
    nv = tl.load(nv_ptr + t)
    if tl.program_id(1) * BLOCK_N < nv:
        h = tl.arange(0, BLOCK_H)
        h_ok = h < H
        c = tl.arange(0, BLOCK_DI)
        c_ok = c < di
        vis = n < nv  # [BN] (nv <= N is not assumed: clamp by N too)
        vis = vis & (n < N)
        q = tl.load(q_ptr + t * s_qt + h[:, None] * s_qh + c[None, :] * s_qd,
                    mask=h_ok[:, None] & c_ok[None, :], other=0.0)  # [BH, BDI]
        if PAGED:  # entry n of request req[t] is view[block_table[req[t], n // E], n % E]
            r = tl.load(req_ptr + t * s_r).to(tl.int64)
            blk = tl.load(bt_ptr + r * s_bt0 + (n // E) * s_bt1, mask=vis, other=0).to(tl.int64)  # [BN]
            row = k_ptr + blk * s_k0 + (n % E).to(tl.int64) * s_kn  # [BN]
        else:  # keys [N, di] shared (s_k0 = 0) or [Tq, N, di] per query
            row = k_ptr + t * s_k0 + n.to(tl.int64) * s_kn  # [BN]
        k_mask = vis[:, None] & c_ok[None, :]
        if FP8:  # [di e4m3 | fp32 scale, little-endian] (kv_pack_ref.pack_index), decoded as kv_cache does
            code = tl.load(row[:, None] + c[None, :] * s_kd, mask=k_mask, other=0)  # [BN, BDI] uint8
            scale = _index_scale(row[:, None], di, vis[:, None], s_kd)  # [BN]
            # e4m3 times a power of two: exact in q's dtype (bf16 has fp32's exponent range)
            k = (_e4m3_decode(code) * scale[:, None]).to(q_ptr.dtype.element_ty)  # [BN, BDI]
        else:
            k = tl.load(row[:, None] + c[None, :] * s_kd, mask=k_mask, other=0.0)  # [BN, BDI]
        if DOT_F32:
            q = q.to(tl.float32)
            k = k.to(tl.float32)
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BH, BN] fp32
        wh = tl.load(w_ptr + t * s_wt + h * s_wh, mask=h_ok, other=0.0).to(tl.float32)  # [BH]
        score = tl.sum(tl.maximum(logits, 0.0) * wh[:, None], 0)  # [BN]
        score = tl.where(vis, score, float("-inf"))
    else:
        score = tl.full([BLOCK_N], float("-inf"), tl.float32)
    tl.store(score_ptr + t * s_st + n * s_sn, score, mask=n < N)


# See sparse_attn.py: the interpreter needs fp32 dot operands (its bf16 matmul is wrong in triton 3.9).
_INTERPRETED = not isinstance(_indexer_scores_kernel, JITFunction)


def _scores(q: Tensor, weights: Tensor, num_visible: Tensor, keys: Tensor, key_strides: tuple, N: int,
            fp8_keys: bool = False, block_table: Tensor | None = None, req: Tensor | None = None,
            entries_per_block: int = 1) -> Tensor:
    """``[Tq, N]`` fp32 scores, -inf at ``w >= num_visible[t]`` (``[Tq]`` on q's device).

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
    _indexer_scores_kernel[(Tq, triton.cdiv(N, block_n))](
        q, weights, keys, num_visible, block_table, req, scores,
        H, N, di, entries_per_block,
        *q.stride(), *weights.stride(), *key_strides, req.stride(0), *block_table.stride(), *scores.stride(),
        PAGED=paged, FP8=fp8_keys, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_DI=block_di,
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


def _topk(scores_of, num_visible: Tensor, Tq: int, N: int, topk: int, device: torch.device) -> Tensor:
    """Stage 2: ``[Tq, topk]`` int64, ``torch.topk`` of ``scores_of(rows)`` (the ``[t, N]`` scores of
    the query slice ``rows``, chunked over Tq as the reference), -1 where a pick is past
    ``num_visible`` (``[Tq]`` on ``device``): sorted, so those come last (attention/flashmla.py relies
    on it). Shapes depend on the arguments' shapes only."""
    out = torch.full((Tq, topk), -1, dtype=torch.int64, device=device)  # [Tq, topk]
    k_eff = min(topk, N)
    if Tq == 0 or k_eff == 0:
        return out
    chunk = max(1, _CHUNK_ELEMS // N)
    for s in range(0, Tq, chunk):
        rows = slice(s, s + chunk)
        idx = scores_of(rows).topk(k_eff, dim=-1).indices  # [t, k_eff]
        out[rows, :k_eff] = torch.where(idx < num_visible[rows, None], idx, -1)
    return out


def indexer_topk(q: Tensor, weights: Tensor, keys: Tensor, num_visible: Tensor, topk: int) -> Tensor:
    """Triton scores + ``torch.topk``: :func:`indexer_ref.indexer_topk` (same arguments and result).

    Args:
        q: ``[Tq, H, di]`` indexer queries (RoPE applied), fp32 / bf16.
        weights: ``[Tq, H]`` scaled head weights.
        keys: ``[N, di]`` indexer keys shared by all queries, or ``[Tq, N, di]`` per query; q's dtype.
        num_visible: ``[Tq]`` int64 visible prefix of the entries.
        topk: ``index_topk``.

    Returns:
        ``[Tq, topk]`` int64 entry indices, the picks in no particular order, then -1 in the
        ``topk - min(topk, num_visible[t])`` spare slots. Ties are broken by ``torch.topk``.
    """
    num_visible = num_visible.to(q.device)
    per_query = keys.dim() == 3

    def scores_of(rows: slice) -> Tensor:
        return indexer_scores(q[rows], weights[rows], keys[rows] if per_query else keys, num_visible[rows])

    return _topk(scores_of, num_visible, q.shape[0], keys.shape[-2], topk, q.device)


def indexer_topk_paged(q: Tensor, weights: Tensor, view: Tensor, block_table: Tensor, req: Tensor,
                       num_visible: Tensor, entries_per_block: int, fp8, topk: int, max_entries: int) -> Tensor:
    """:func:`indexer_ref.indexer_topk_paged` (same arguments and result), keys read in the kernel
    straight from the paged cache, FP8 entries decoded in registers.

    CUDA-graph safe: no host synchronisation, every shape fixed by the arguments' shapes and
    ``max_entries``. Padding rows (``req < 0``) and entry blocks at or past ``num_visible`` read no key.

    Args:
        q: ``[B, H, di]`` indexer queries (RoPE applied), fp32 / bf16; one decode query per row.
        weights: ``[B, H]`` scaled head weights.
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

    Returns:
        ``[B, topk]`` int64 entry numbers, the picks in no particular order, then -1 in the spare
        slots; -1 in every slot of a padding row.
    """
    B, _, di = q.shape
    assert view.dim() == 3 and block_table.dim() == 2 and req.shape == (B,), (view.shape, block_table.shape, req.shape)
    mode, dim, _, _ = _mode(view, fp8)
    assert mode in ("raw", "index") and dim == di, (mode, dim, di)
    assert mode == "index" or view.dtype == q.dtype, (view.dtype, q.dtype)
    nv = torch.where(req >= 0, num_visible, 0)  # [B]; a padding row sees nothing: no read, all -1

    def scores_of(rows: slice) -> Tensor:
        return _scores(q[rows], weights[rows], nv[rows], view, view.stride(), max_entries, mode == "index",
                       block_table, req[rows], entries_per_block)

    return _topk(scores_of, nv, B, max_entries, topk, q.device)
