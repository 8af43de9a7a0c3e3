"""FP8 block-scaled linear (docs/MODEL.md §3.3): the checkpoint's FP8 weights used as stored.

The weight is float8_e4m3fn [N, K] with one float32 scale per 128x128 block [ceil(N/128), ceil(K/128)];
the activation is quantised per token in 128-wide groups of K, each with its own scale:

    y[t, n] = sum_k (q_x[t, k] * s_x[t, k // 128]) * (q_w[n, k] * s_w[n // 128, k // 128])

which vLLM's block-FP8 kernels compute per 128-wide K block, scales applied to the fp32 partial sums.
Bytes per call (T tokens, bf16 activations): N*K weight + 4*N*K/128^2 scales + 2*T*K in, 2*T*N out;
at decode the weight read dominates, half of what the dequantised bf16 weight costs.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from csrc_triton.formats import FP8_BLOCK, FP8_MAX

GROUP = FP8_BLOCK  # activation group = weight block width
MIN_AMAX = 1e-10  # an all-zero group gets a tiny scale instead of 0/0 (vLLM's eps)
INV_FP8_MAX = 1.0 / FP8_MAX  # rounded to fp32 where it multiplies an fp32 tensor


def quant_act_fp8(x: torch.Tensor, pow2_scales: bool = False, group: int = GROUP):
    """x [..., K] -> (q float8_e4m3fn [..., K], scale float32 [..., ceil(K/group)]), x ~ q * scale.

    Per group: scale = amax * fp32(1/448), or its power-of-two ceiling (UE8M0, what DeepGEMM asks
    for); q = x / scale rounded to the nearest e4m3 value (ties to even), clamped to +-448. The scale
    is a product with the fp32 reciprocal, written out: torch divides by a Python scalar that way on
    CUDA but not everywhere, and a scale one ulp off flips the e4m3 rounding of bf16 activations that
    sit on a tie (common: 448 * x / amax of bf16 values often has 4 significant bits).
    """
    k = x.shape[-1]
    num_groups = math.ceil(k / group)
    xg = F.pad(x.float(), (0, num_groups * group - k)).unflatten(-1, (num_groups, group))  # [..., G, group]
    scale = xg.abs().amax(-1).clamp(min=MIN_AMAX) * INV_FP8_MAX  # [..., G]
    if pow2_scales:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [..., G, group]
    return q.flatten(-2)[..., :k], scale


def _expand(scale: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """Repeat each block scale over its 128 rows / columns along ``dim``, cropped to ``size``."""
    return scale.repeat_interleave(GROUP, dim=dim).narrow(dim, 0, size)


def dequant_act(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q [..., K], scale [..., ceil(K/128)]) -> float32 [..., K]."""
    return q.float() * _expand(scale, q.shape[-1], -1)


def dequant_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 weight [N, K] with float32 block scales [ceil(N/128), ceil(K/128)] -> float32 [N, K]."""
    n, k = weight.shape
    return weight.float() * _expand(_expand(scale.float(), n, 0), k, 1)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               pow2_act_scales: bool = False) -> torch.Tensor:
    """x [..., K] through the block-FP8 weight [N, K] -> [..., N] in x's dtype (fp32 inside)."""
    q, s = quant_act_fp8(x, pow2_act_scales)
    return F.linear(dequant_act(q, s), dequant_weight(weight, weight_scale)).to(x.dtype)


def block_fp8_gemm(weight: torch.Tensor, weight_scale: torch.Tensor):
    """The reference bound to one loaded weight: ``x [M, K] -> [M, N]`` (``ops.block_fp8_gemm``'s signature)."""
    return functools.partial(fp8_linear, weight=weight, weight_scale=weight_scale)


def grouped_fp8_gemm(weight: torch.Tensor, weight_scale: torch.Tensor, groups: int):
    """A block-diagonal block-FP8 weight (group g: rows ``g*R .. (g+1)*R``) bound to its grouped GEMM
    over activations already quantised per group: ``(q [T, G, K] e4m3, scale [T, G, K/128]) -> [T, G*R]``
    bf16 (``ops.grouped_fp8_gemm``'s signature; each group is :func:`fp8_linear` past its quantiser)."""
    w = dequant_weight(weight, weight_scale).view(groups, -1, weight.shape[1])  # [G, R, K]

    def run(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.einsum("tgk,grk->tgr", dequant_act(q, scale), w).flatten(1).to(torch.bfloat16)

    return run
