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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

# Elements of the fp32 [tokens, entries] score block materialised per chunk (128 MiB), as the reference.
_CHUNK_ELEMS = 1 << 25


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, k_ptr, nv_ptr, score_ptr,
    H, N, di,
    s_qt, s_qh, s_qd, s_wt, s_wh, s_kt, s_kn, s_kd, s_st, s_sn,
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
        k = tl.load(k_ptr + t * s_kt + n[:, None].to(tl.int64) * s_kn + c[None, :] * s_kd,
                    mask=vis[:, None] & c_ok[None, :], other=0.0)  # [BN, BDI]
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


def indexer_scores(q: Tensor, weights: Tensor, keys: Tensor, num_visible: Tensor) -> Tensor:
    """Stage 1: ``[Tq, N]`` fp32 scores, -inf at ``w >= num_visible[t]``.

    Args:
        q: ``[Tq, H, di]`` fp32 / bf16; weights ``[Tq, H]``; keys ``[N, di]`` shared or
        ``[Tq, N, di]`` per query (q's dtype); num_visible: ``[Tq]`` integer.
    """
    Tq, H, di = q.shape
    N = keys.shape[-2]
    assert keys.shape in ((N, di), (Tq, N, di)) and keys.dtype == q.dtype, (keys.shape, keys.dtype, q.dtype)
    key_query_stride = keys.stride(0) if keys.dim() == 3 else 0
    assert weights.shape == (Tq, H) and num_visible.shape == (Tq,), (weights.shape, num_visible.shape)
    assert q.dtype in (torch.float32, torch.bfloat16, torch.float16), q.dtype
    scores = torch.empty(Tq, N, dtype=torch.float32, device=q.device)
    if Tq == 0 or N == 0:
        return scores
    block_h = max(16, triton.next_power_of_2(H))
    block_di = max(16, triton.next_power_of_2(di))
    block_n = 32 if q.dtype == torch.float32 else (64 if block_h > 64 else 128)  # sm_90: no spills
    _indexer_scores_kernel[(Tq, triton.cdiv(N, block_n))](
        q, weights, keys, num_visible.to(q.device), scores,
        H, N, di,
        *q.stride(), *weights.stride(), key_query_stride, *keys.stride()[-2:], *scores.stride(),
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_DI=block_di,
        DOT_F32=_INTERPRETED, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if block_h * block_n <= 8192 else 8,
    )
    return scores


def indexer_topk(q: Tensor, weights: Tensor, keys: Tensor, num_visible: Tensor, topk: int) -> Tensor:
    """Triton scores + ``torch.topk``: :func:`indexer_ref.indexer_topk` (same arguments and result).

    Args:
        q: ``[Tq, H, di]`` indexer queries (RoPE applied), fp32 / bf16.
        weights: ``[Tq, H]`` scaled head weights.
        keys: ``[N, di]`` indexer keys shared by all queries, or ``[Tq, N, di]`` per query; q's dtype.
        num_visible: ``[Tq]`` int64 visible prefix of the entries.
        topk: ``index_topk``.

    Returns:
        ``[Tq, topk]`` int64 entry indices in no particular order, -1 in the
        ``topk - min(topk, num_visible[t])`` spare slots. Ties are broken by ``torch.topk``.
    """
    Tq = q.shape[0]
    N = keys.shape[-2]
    out = torch.full((Tq, topk), -1, dtype=torch.int64, device=q.device)  # [Tq, topk]
    k_eff = min(topk, N)
    if Tq == 0 or k_eff == 0:
        return out
    num_visible = num_visible.to(q.device)
    chunk = max(1, _CHUNK_ELEMS // N)
    for s in range(0, Tq, chunk):
        nv = num_visible[s : s + chunk]  # [t]
        chunk_keys = keys[s : s + chunk] if keys.dim() == 3 else keys
        score = indexer_scores(q[s : s + chunk], weights[s : s + chunk], chunk_keys, nv)  # [t, N]
        idx = score.topk(k_eff, dim=-1).indices  # [t, k_eff]
        out[s : s + chunk, :k_eff] = torch.where(idx < nv[:, None], idx, -1)
    return out
