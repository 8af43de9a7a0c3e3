"""Sparse shared-KV (MQA) attention with per-head sinks (dsv4_architecture.md §5.3).

Each query token t attends over its own gathered key set ``kv[t]`` (window slots followed by the
selected / visible compressed entries, §5.2); keys and values are the same vectors. The caller
gathers ``kv`` and the validity mask (this is where the reference's ``-1`` index slots go).
"""

from __future__ import annotations

import torch
from torch import Tensor

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
