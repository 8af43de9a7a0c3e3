"""MoE routing and experts (docs/MODEL.md §6).

sqrt-softplus scores, bias-corrected top-k (or a frozen token-id -> expert hash table in the first
``num_hash_layers`` layers), renormalised weights times ``routed_scaling_factor``, and clamped
SwiGLU experts. The shared expert uses :func:`swiglu_clamped` with the same limit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# transformers 5.19 adds this to the renormalisation denominator; the reference adds nothing.
# Keeping it makes the oracle comparison exact and is harmless (scores are > 0).
RENORM_EPS = 1e-20


def route(
    router_logits: Tensor,
    top_k: int,
    routed_scaling_factor: float,
    renormalize: bool,
    bias: Tensor | None = None,
    hash_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Select experts and their weights (§6 steps 1-3).

    ``s = sqrt(softplus(logits))``; ``ids = hash_ids`` if given, else ``topk(s + bias)`` (the bias
    affects selection only); ``w = s[ids] / (sum s[ids] + 1e-20)`` if ``renormalize`` (HF's
    epsilon), then ``w *= routed_scaling_factor``.

    Args:
        router_logits: ``[T, E]`` fp32 (``gate.weight @ x`` computed in fp32, as the reference does).
        top_k: experts per token (``num_experts_per_tok``).
        routed_scaling_factor: 1.5 (Flash) / 2.5 (Pro).
        renormalize: ``norm_topk_prob``.
        bias: ``[E]`` fp32 ``gate.bias`` (HF ``e_score_correction_bias``), or ``None``.
        hash_ids: ``[T, top_k]`` int, ``tid2eid[token_ids]`` for hash layers, or ``None``.

    Returns:
        ``weights [T, top_k]`` fp32 and ``ids [T, top_k]`` int64. For top-k routing the order of
        the k slots is unspecified (not sorted); for hash routing it is the table's order.
    """
    scores = F.softplus(router_logits.float()).sqrt()  # [T, E]
    if hash_ids is not None:
        ids = hash_ids.long()  # [T, k]
    else:
        sel = scores if bias is None else scores + bias.float()  # [T, E]
        ids = torch.topk(sel, top_k, dim=-1, sorted=False).indices  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)  # [T, k]
    return weights * routed_scaling_factor, ids


def swiglu_clamped(gate_up: Tensor, limit: float) -> Tensor:
    """Clamped SwiGLU (§6 step 4): ``silu(min(g, L)) * clamp(u, -L, L)``.

    Args:
        gate_up: ``[..., 2I]``: first half ``g = W1 x`` (gate), second half ``u = W3 x`` (up).
        limit: ``swiglu_limit`` L (10). The gate is clamped from above only.

    Returns:
        ``[..., I]`` in ``gate_up.dtype``, computed in fp32.
    """
    gate, up = gate_up.float().chunk(2, dim=-1)  # [..., I] each
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (F.silu(gate) * up).to(gate_up.dtype)  # [..., I]


def moe_experts(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    swiglu_limit: float,
) -> Tensor:
    """Routed experts (§6 steps 4-5, without the shared expert): ``y = sum_k w_k FFN_{ids_k}(x)``.

    ``FFN_e(x) = W2_e swiglu_clamped(W13_e x)``; the routing weight multiplies the expert output
    after W2 (HF / vLLM; the reference multiplies before W2, which is equal). Tokens are grouped by
    expert with one sort; the Python loop runs over experts that received tokens.

    Args:
        x: ``[T, D]`` post-``ffn_norm`` activations.
        weights: ``[T, k]`` routing weights (fp32) from :func:`route`.
        ids: ``[T, k]`` expert ids in ``[0, E]``; id ``E`` means "not on this rank" and is skipped
            (tensor parallelism shards whole experts, model/moe.py).
        w13: ``[E, 2I, D]`` rows ``[:I]`` = W1 (gate), ``[I:]`` = W3 (up).
        w2: ``[E, D, I]``.
        swiglu_limit: L.

    Returns:
        ``[T, D]`` in ``x.dtype``; matmuls and the weighted sum accumulate in fp32.

    Bytes: each hit expert's W13 and W2 once, plus x gathered k times.
    """
    T, k = ids.shape
    out = torch.zeros(T, x.shape[-1], dtype=torch.float32, device=x.device)  # [T, D]
    if T == 0:
        return out.to(x.dtype)
    flat_ids = ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat_ids, stable=True)  # [T*k] assignments grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0] + 1).tolist()[: w13.shape[0]]  # [E] one sync
    tok = order // k  # [T*k] token of each assignment
    wgt = weights.reshape(-1)[order].float()  # [T*k]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        t_e = tok[start : start + n]  # [n]
        h = x[t_e].float() @ w13[e].float().t()  # [n, 2I]
        y = swiglu_clamped(h, swiglu_limit) @ w2[e].float().t()  # [n, D]
        out.index_add_(0, t_e, y * wgt[start : start + n, None])
        start += n
    return out.to(x.dtype)


def moe_experts_every_expert(x: Tensor, weights: Tensor, ids: Tensor, w13: Tensor, w2: Tensor,
                             swiglu_limit: float) -> Tensor:
    """:func:`moe_experts` without reading anything on the host, so a CUDA graph can capture it: every
    expert runs on every token, and a token's output takes each expert's with the sum of the routing
    weights that picked it (0 for the others). E times the matmul work of :func:`moe_experts`: for
    decode-sized steps of checkpoints with unquantised experts (official ones carry MXFP4 experts).
    Same arguments and result; ids outside ``[0, E)`` are skipped."""
    T, E = ids.shape[0], w13.shape[0]
    local = torch.where((ids >= 0) & (ids < E), ids, E).long()  # [T, k]; E collects the skipped picks
    per_expert = torch.zeros(T, E + 1, dtype=torch.float32, device=x.device)
    per_expert.scatter_add_(1, local, weights.float())  # [T, E + 1]
    xf = x.float()
    out = torch.zeros(T, x.shape[-1], dtype=torch.float32, device=x.device)  # [T, D]
    for e in range(E):
        h = swiglu_clamped(xf @ w13[e].float().t(), swiglu_limit)  # [T, I]
        out.addcmul_(h @ w2[e].float().t(), per_expert[:, e, None])
    return out.to(x.dtype)
