"""Sparse shared-KV (MQA) attention with per-head sinks (docs/MODEL.md §5.3).

Each query token t attends over its own key set (window slots followed by the selected / visible
compressed entries, §5.2); keys and values are the same vectors. :func:`sparse_attn` takes the keys
gathered (``kv [T, K, d]`` and a validity mask); :func:`sparse_attn_cached` names them by entry
number in the two paged caches (``-1`` for an empty slot) and is that gather followed by
:func:`sparse_attn`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from csrc_triton.kv_cache_ref import read_entries
from csrc_triton.paged import CacheSource

# Elements of fp32 temporaries ([t, K, d] keys + [t, H, K] logits) live per chunk (128 MiB).
_CHUNK_ELEMS = 1 << 25


def sparse_attn(q: Tensor, kv: Tensor, valid: Tensor, sink: Tensor, scale: float) -> Tensor:
    """``o_h = sum_j softmax_j(l_j; sink_h) k_j`` over each token's own key list (§5.3).

    ``l_j = scale * (q_h . k_j)`` in fp32; with ``M = max(max_j l_j, s_h)``,
    ``alpha_j = exp(l_j - M) / (sum_j' exp(l_j' - M) + exp(s_h - M))``: the sink enters the
    denominator only, like a zero-valued key. Invalid slots are dropped (their contents may be
    anything, including NaN). A row with no valid key returns 0.

    Args:
        q: ``[T, H, d]`` queries (RoPE applied).
        kv: ``[T, K, d]`` gathered keys = values per query token.
        valid: ``[T, K]`` bool.
        sink: ``[H]`` fp32 ``attn_sink``.
        scale: softmax scale, ``head_dim**-0.5`` (no YaRN mscale).

    Returns:
        ``[T, H, d]`` in ``q.dtype``. The rotated tail is still at the key positions; the caller
        de-rotates it (§5.6).

    Bytes: reads ``T * K * d`` of kv (the kernels read the cache by index instead of a gathered
    copy). Chunked over T so that at most ``_CHUNK_ELEMS`` fp32 temporaries are live.
    """
    T, H, d = q.shape
    K = kv.shape[1]
    out = torch.empty(T, H, d, dtype=q.dtype, device=q.device)  # [T, H, d]
    if K == 0:
        return out.zero_()
    sink = sink.float()[None, :]  # [1, H]
    chunk = max(1, _CHUNK_ELEMS // max(1, K * (d + H)))
    for s in range(0, T, chunk):
        vc = valid[s : s + chunk]  # [t, K]
        kc = torch.where(vc[..., None], kv[s : s + chunk].float(), 0.0)  # [t, K, d]
        logits = torch.matmul(q[s : s + chunk].float(), kc.transpose(1, 2)) * scale  # [t, H, K]
        logits = logits.masked_fill(~vc[:, None, :], float("-inf"))  # [t, H, K]
        m = torch.maximum(logits.amax(dim=-1), sink)  # [t, H] finite: the sink is
        p = torch.exp(logits - m[..., None])  # [t, H, K]
        denom = p.sum(dim=-1) + torch.exp(sink - m)  # [t, H]
        out[s : s + chunk] = (torch.matmul(p, kc) / denom[..., None]).to(q.dtype)  # [t, H, d]
    return out


def sparse_attn_cached(q: Tensor, sink: Tensor, scale: float, req: Tensor, window: CacheSource,
                       window_entries: Tensor, main: CacheSource | None, main_entries: Tensor | None,
                       out: Tensor | None = None) -> Tensor:
    """:func:`sparse_attn` over keys named by entry number in two paged caches.

    Query t attends the window entries ``window_entries[t]`` then the main entries ``main_entries[t]``
    of its request ``req[t]``, each decoded to q's dtype as ``kv_cache_ref.read_entries`` does; a slot is
    valid iff its entry is >= 0 and ``req[t] >= 0``. This is literally the gathered composition
    (invalid slots read entry 0 of request 0, then are masked).

    Args:
        q: ``[T, H, d]`` fp32 / bf16 queries (RoPE applied).
        sink: ``[H]`` fp32 ``attn_sink``.
        scale: softmax scale.
        req: ``[T]`` int request of each query; < 0 for a padding row (returns 0).
        window: the window's component (``swa``: entries are token positions).
        window_entries: ``[T, W]`` int, -1 for an empty slot.
        main: the compressed component (``c4`` / ``c128``: entries are entry numbers), or None
            (window-only layers).
        main_entries: ``[T, K]`` int, -1 for an empty slot; None with ``main``.
        out: ``[T, H, d]`` in ``q.dtype`` to write the result into (the caller's buffer, e.g. its rows of
            a layer's output).

    Returns:
        ``out``, or a new ``[T, H, d]`` in ``q.dtype``.
    """
    live = req[:, None] >= 0  # [T, 1]
    req0 = req.clamp(min=0)[:, None]  # [T, 1]
    keys, valid = [], []
    for src, entries in ((window, window_entries), (main, main_entries)):
        if src is not None:
            keys.append(read_entries(src.view, src.block_table, req0, entries.clamp(min=0), src.entries_per_block,
                                     src.fp8, q.dtype))  # [T, n, d]
            valid.append((entries >= 0) & live)  # [T, n]
    result = sparse_attn(q, torch.cat(keys, 1), torch.cat(valid, 1), sink, scale)
    return result if out is None else out.copy_(result)
