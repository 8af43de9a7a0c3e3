"""Lightning-indexer top-k selection (docs/MODEL.md §5.5, transformers semantics).

HF semantics: no Hadamard rotation, no FP8/FP4 quantisation, fp32 scores. The indexer keys are
the ratio-4 overlapping compressor at width ``index_head_dim`` (:mod:`compressor_ref`) followed by
``indexer.compressor.norm`` and RoPE at ``4w``; the queries are ``indexer.wq_b @ c_q`` (the normalised
q latent of the main attention) with RoPE at the token position and no per-head norm.
"""

from __future__ import annotations

import torch
from torch import Tensor

from csrc_triton.kv_cache_ref import read_entries

# Elements of the fp32 [tokens, heads, entries] score block materialised per chunk (128 MiB).
_CHUNK_ELEMS = 1 << 25


def indexer_topk(q: Tensor, weights: Tensor, keys: Tensor, num_visible: Tensor, topk: int) -> Tensor:
    """Per query, the ``topk`` visible compressed entries with the highest indexer score (§5.5).

    ``score[t, w] = sum_h weights[t, h] * relu(q[t, h] . keys[w])`` in fp32; entries
    ``w >= num_visible[t]`` (``= (p + 1) // 4`` for a query at position p) are invisible.

    ``weights`` must already carry both scales: the caller passes
    ``weights_proj(x) * index_head_dim**-0.5 * index_n_heads**-0.5``, where x is the post-attn_norm
    hidden state (the same x that feeds the compressors). HF applies ``index_head_dim**-0.5`` to
    ``relu(q.k)`` and ``index_n_heads**-0.5`` to the projected weights; the product is the same
    (up to fp32 rounding).

    Args:
        q: ``[Tq, H, di]`` indexer queries, RoPE applied.
        weights: ``[Tq, H]`` scaled head weights.
        keys: ``[N, di]`` indexer keys (normed, RoPE applied), entry w at row w, shared by all
            queries; or ``[Tq, N, di]``, each query's own keys (a batch of decodes of different
            requests, padded to the longest: rows past ``num_visible[t]`` are never selected).
        num_visible: ``[Tq]`` int64 number of visible entries (a prefix of the rows).
        topk: ``index_topk``.

    Returns:
        ``[Tq, topk]`` int64: indices of the selected entries in no particular order, -1 in the
        ``topk - min(topk, num_visible[t])`` slots that have nothing to select. Ties are broken by
        ``torch.topk`` (unspecified).

    Bytes: reads q, weights and all N keys per query chunk; the score block is chunked over Tq so
    at most ``_CHUNK_ELEMS`` fp32 scores are live.
    """
    Tq, H, _ = q.shape
    N = keys.shape[-2]
    out = torch.full((Tq, topk), -1, dtype=torch.int64, device=q.device)  # [Tq, topk]
    k_eff = min(topk, N)
    if Tq == 0 or k_eff == 0:
        return out
    per_query = keys.dim() == 3
    keys_t = keys.float().transpose(-1, -2)  # [(Tq,) di, N]
    entry = torch.arange(N, device=q.device)  # [N]
    chunk = max(1, _CHUNK_ELEMS // max(1, H * N))
    for s in range(0, Tq, chunk):
        qc = q[s : s + chunk].float()  # [t, H, di]
        logits = torch.relu(qc @ (keys_t[s : s + chunk] if per_query else keys_t))  # [t, H, N]
        score = torch.einsum("thn,th->tn", logits, weights[s : s + chunk].float())  # [t, N]
        nv = num_visible[s : s + chunk].to(q.device)  # [t]
        score = score.masked_fill(entry[None, :] >= nv[:, None], float("-inf"))  # [t, N]
        idx = score.topk(k_eff, dim=-1).indices  # [t, k_eff]
        out[s : s + chunk, :k_eff] = torch.where(idx < nv[:, None], idx, -1)
    return out


def indexer_topk_paged(q: Tensor, weights: Tensor, view: Tensor, block_table: Tensor, req: Tensor,
                       num_visible: Tensor, entries_per_block: int, fp8, topk: int, max_entries: int,
                       weight_scale: float = 1.0) -> Tensor:
    """:func:`indexer_topk` of a batch of queries, each against its own request's keys in a paged cache
    component (the Triton kernel reads them in place; here each request's are gathered once, for all
    its rows: a prefill chunk's queries share them, and a gather per row would hold [B, N, di] keys,
    gigabytes for one long prompt).

    Args:
        q: ``[B, H, di]`` indexer queries (RoPE applied); weights ``[B, H]`` head weights (the
            projection's output, any float dtype), scaled by ``weight_scale`` in fp32 here.
        view: ``[num_blocks, E, C]`` the indexer cache component (raw keys, or uint8 FP8 entries), any strides.
        block_table: ``[R, max_blocks]`` int32 / int64, covering ``max_entries`` entries (vLLM's covers
            ``max_model_len``): entry n of request r is ``view[block_table[r, n // E], n % E]``.
        req: ``[B]`` int request of each row, < 0 for a padding row.
        num_visible: ``[B]`` int64 visible prefix of the request's entries, ``<= max_entries``.
        entries_per_block: ``E``.
        fp8: None (raw keys) or the FP8 indexer entry spec (``rope_dim is None``).
        topk: ``index_topk``.
        max_entries: ``N``, static bound on ``num_visible``.
        weight_scale: the heads' common scale (``index_head_dim^-0.5 * index_n_heads^-0.5``).

    Returns:
        ``[B, topk]`` int64 as :func:`indexer_topk`, every slot of a padding row -1.
    """
    weights = weights.float() * weight_scale
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)  # padding rows stay -1
    entry = torch.arange(max_entries, device=q.device)  # [N]
    for r in req[req >= 0].unique():
        rows = (req == r).nonzero().squeeze(1)
        keys = read_entries(view, block_table, r, entry, entries_per_block, fp8, q.dtype)  # [N, di]
        out[rows] = indexer_topk(q[rows], weights[rows], keys, num_visible[rows], topk)
    return out
