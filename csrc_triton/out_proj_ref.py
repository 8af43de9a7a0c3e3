"""Attention output projection ``wo_a`` with its inverse RoPE (docs/MODEL.md §5.6), FP8 weights.

The attention output ``o [T, H, d]`` is de-rotated (the rope tail rotated by ``-position``), its heads
split into G groups of H/G, and each group projected by its own rows of the block-FP8 ``wo_a``:

    x = apply_rope_tail(o, positions, inv_freq, inverse=True)      # rounded to o's dtype
    y[t, g] = fp8_linear(x[t, heads of g].flatten(), W[g*R:(g+1)*R], S[g*R/128:(g+1)*R/128])

with each 128-wide group of a token's activations quantised to e4m3 with scale ``amax / 448``
(fp8_linear_ref). This is the semantics of the model's unfused path (rope kernel, then one FP8 GEMM
per group) and the oracle of the fused kernel (out_proj.py). :func:`rope_quant_fp8` is its first
half, the de-rotated activations quantised per group (the input of a grouped FP8 GEMM).
"""

from __future__ import annotations

import torch
from torch import Tensor

from csrc_triton.fp8_linear_ref import fp8_linear, quant_act_fp8
from csrc_triton.rope_ref import apply_rope_tail


def rope_out_proj(o: Tensor, positions: Tensor, inv_freq: Tensor, weight: Tensor, weight_scale: Tensor,
                  groups: int) -> Tensor:
    """``o [T, H, d]`` -> ``[T, G * R]`` in o's dtype (module doc).

    Args:
        o: ``[T, H, d]`` attention output, heads in group order (H divisible by ``groups``).
        positions: ``[T]`` int64 positions of the queries.
        inv_freq: ``[r / 2]`` fp32 rope frequencies of the tail.
        weight: ``[G * R, H / G * d]`` float8_e4m3fn, group g's rows ``g*R .. (g+1)*R``.
        weight_scale: ``[G * R / 128, H / G * d / 128]`` float32 block scales.
        groups: G.
    """
    T, H, d = o.shape
    x = apply_rope_tail(o, positions, inv_freq, inverse=True).reshape(T, groups, H // groups * d)  # [T, G, H/G*d]
    rows = weight.shape[0] // groups
    block_rows = weight_scale.shape[0] // groups
    out = [fp8_linear(x[:, g], weight[g * rows:(g + 1) * rows], weight_scale[g * block_rows:(g + 1) * block_rows])
           for g in range(groups)]
    return torch.cat(out, dim=-1)  # [T, G*R]


def rope_quant_fp8(o: Tensor, positions: Tensor, inv_freq: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    """``o [T, H, d]`` de-rotated and quantised as :func:`rope_out_proj` feeds each group's GEMM:
    ``(q [T, G, K] float8_e4m3fn, scale [T, G, K / 128] float32)`` with ``K = H / G * d``."""
    T, H, d = o.shape
    return quant_act_fp8(apply_rope_tail(o, positions, inv_freq, inverse=True).reshape(T, groups, H // groups * d))
