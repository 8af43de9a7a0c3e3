"""mHC: manifold-constrained hyper-connections (docs/MODEL.md §4).

The residual is ``n = hc_mult`` streams ``X [T, n, D]``. Before each sub-layer, ``mhc_pre``
derives from X the collapse weights (pre), the expansion weights (post) and the Sinkhorn-projected
stream mixing matrix (comb) and collapses X to the sub-layer input; ``mhc_post`` expands the
sub-layer output back and mixes the residual. ``hc_head`` is the final collapse before the last norm.
Everything is fp32; the parameters are fp32 in the checkpoint.
"""

from __future__ import annotations

import torch
from torch import Tensor

from csrc_triton.norm_ref import rms_norm


def _mix_coefficients(x: Tensor, fn: Tensor, rms_eps: float) -> Tensor:
    """``mu = rsqrt(mean(v^2) + eps) * (fn v)`` with ``v = flatten(X)`` (§4 step 1).

    ``x [T, n, D]``, ``fn [M, n*D]`` -> ``[T, M]`` fp32. The norm is unweighted, so normalising
    before the matmul (done here, as HF does) equals scaling after it.
    """
    v = x.flatten(1).float()  # [T, n*D]
    v = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + rms_eps)  # [T, n*D]
    return v @ fn.float().t()  # [T, M]


def mhc_pre(
    x: Tensor,
    fn: Tensor,
    base: Tensor,
    scale: Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: Tensor | None = None,
    norm_eps: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """mHC_pre (§4 steps 1-6): collapse the streams and compute post/comb.

    ``pre_i = sigmoid(a0 mu_i + b_i) + hc_eps``, ``post_i = 2 sigmoid(a1 mu_{n+i} + b_{n+i})``,
    ``comb = Sinkhorn(a2 mu_{2n:} + b_{2n:})`` viewed row-major ``[n, n]``: row softmax + hc_eps,
    column normalise, then ``sinkhorn_iters - 1`` x (row, column) normalisations, each dividing
    by ``sum + hc_eps``. ``y = sum_i pre_i X[i]``.

    Args:
        x: ``[T, n, D]`` residual streams (bf16 in vLLM, fp32 in tests).
        fn: ``[(2+n)*n, n*D]`` fp32 (``hc_{attn,ffn}_fn``).
        base: ``[(2+n)*n]`` fp32.
        scale: ``[3]`` fp32 (pre, post, comb).
        rms_eps: ``rms_norm_eps`` of the input norm (not ``hc_eps``).
        hc_eps: ``hc_eps``.
        sinkhorn_iters: ``hc_sinkhorn_iters`` (20).
        norm_weight, norm_eps: the sub-layer's input RMSNorm (attn_norm / ffn_norm), applied to y as
            the separate op would (to y rounded to ``x.dtype``); None: y as it is.

    Returns:
        ``y [T, D]`` in ``x.dtype``: the sub-layer's input (normed when ``norm_weight`` is given),
        ``post [T, n]`` fp32 and ``comb [T, n, n]`` fp32, ``comb[j, k]`` = weight of input stream
        j in output stream k (consumed by :func:`mhc_post`).

    Bytes: reads X once for mu and once for y (fused kernels read it once), writes y.
    """
    n = x.shape[1]
    mu = _mix_coefficients(x, fn, rms_eps)  # [T, (2+n)*n]
    base = base.float()
    scale = scale.float()
    pre = torch.sigmoid(mu[:, :n] * scale[0] + base[:n]) + hc_eps  # [T, n]
    post = 2 * torch.sigmoid(mu[:, n : 2 * n] * scale[1] + base[n : 2 * n])  # [T, n]
    logits = (mu[:, 2 * n :] * scale[2] + base[2 * n :]).unflatten(-1, (n, n))  # [T, n(j), n(k)]
    comb = torch.softmax(logits, dim=-1) + hc_eps  # [T, n, n] row softmax
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)  # column normalisation
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)  # rows
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)  # columns
    y = (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)  # [T, D]
    if norm_weight is not None:
        y = rms_norm(y, norm_weight, norm_eps)
    return y, post, comb


def mhc_post(o: Tensor, x: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """mHC_post (§4): ``X'[k] = post_k * o + sum_j comb[j, k] * X[j]``.

    The sum runs over the *first* comb index (``comb^T X``); comb is not symmetric.

    Args:
        o: ``[T, D]`` sub-layer output.
        x: ``[T, n, D]`` residual streams that fed the matching :func:`mhc_pre`.
        post: ``[T, n]`` fp32.
        comb: ``[T, n, n]`` fp32.

    Returns:
        ``[T, n, D]`` in ``x.dtype``, computed in fp32 (the reference; HF casts post/comb to the
        activation dtype first, which only differs below fp32).
    """
    expanded = post.float().unsqueeze(-1) * o.float().unsqueeze(-2)  # [T, n, D]
    mixed = torch.matmul(comb.float().transpose(-1, -2), x.float())  # [T, n(k), D]
    return (expanded + mixed).to(x.dtype)


def hc_head(
    x: Tensor,
    fn: Tensor,
    base: Tensor,
    scale: Tensor,
    rms_eps: float,
    hc_eps: float,
    norm_weight: Tensor | None = None,
    norm_eps: float = 0.0,
) -> Tensor:
    """Final stream collapse (§4 "hc_head"): ``h = sum_i (sigmoid(a mu_i + b_i) + hc_eps) X[i]``.

    Args:
        x: ``[T, n, D]``.
        fn: ``[n, n*D]`` fp32 (``hc_head_fn``).
        base: ``[n]`` fp32.
        scale: ``[1]`` fp32.
        rms_eps: ``rms_norm_eps``.
        hc_eps: ``hc_eps``.
        norm_weight, norm_eps: the model's final RMSNorm, applied to h (rounded to ``x.dtype`` first, as
            the separate op would see it); None: h as it is.

    Returns:
        ``[T, D]`` in ``x.dtype``: h, normed when ``norm_weight`` is given.
    """
    mu = _mix_coefficients(x, fn, rms_eps)  # [T, n]
    pre = torch.sigmoid(mu * scale.float() + base.float()) + hc_eps  # [T, n]
    h = (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)  # [T, D]
    return h if norm_weight is None else rms_norm(h, norm_weight, norm_eps)
