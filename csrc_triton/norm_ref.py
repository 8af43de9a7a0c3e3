"""RMSNorm, weighted and unweighted (docs/MODEL.md §3.1)."""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``y = w * x * rsqrt(mean(x^2) + eps)`` over the last axis (§3.1).

    Args:
        x: ``[..., D]`` activations, any float dtype.
        weight: ``[D]`` (stored bf16 or fp32), or ``None`` for the unweighted per-head norm of the
            main query (§3.1 row 2) and the mHC input norm.
        eps: ``rms_norm_eps`` (1e-6 everywhere in V4).

    Returns:
        ``[..., D]`` in ``x.dtype``. Computed in fp32 (the weight is upcast, as HF and the reference
        keep it fp32); the result is rounded once, at the end.

    Bytes: reads ``x`` and ``w`` once, writes ``y`` once.
    """
    xf = x.float()  # [..., D]
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)  # [..., D]
    if weight is not None:
        y = y * weight.float()  # [..., D]
    return y.to(x.dtype)
