"""Partial interleaved RoPE with optional YaRN frequencies (docs/MODEL.md §3.2, §5.6).

Only the last ``r`` channels of a head are rotated (layout ``[nope | rope]``), in GPT-J-style
interleaved pairs ``(x[2i], x[2i+1])``. SWA-only layers use ``rope_theta`` without YaRN; CSA/HCA
layers (everything rotated in them: q, window k, compressed k, indexer q/k) use
``compress_rope_theta`` with YaRN. YaRN's mscale is never applied (cos/sin are unscaled).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from csrc_triton.norm_ref import rms_norm


def rope_inv_freq(
    rope_dim: int,
    theta: float,
    yarn_factor: float | None = None,
    yarn_original_max_pos: int = 0,
    beta_fast: float = 32,
    beta_slow: float = 1,
) -> Tensor:
    """Per-pair inverse frequencies ``f_i``, i = 0 .. rope_dim/2 - 1 (§3.2).

    Plain RoPE: ``f_i = theta^(-2i/r)``. With ``yarn_factor`` (the reference's YaRN):
    ``low = max(floor(r ln(L0 / (beta_fast 2 pi)) / (2 ln theta)), 0)``,
    ``high = min(ceil(r ln(L0 / (beta_slow 2 pi)) / (2 ln theta)), r - 1)``,
    ``ramp_i = clamp((i - low) / (high - low), 0, 1)``, ``smooth_i = 1 - ramp_i`` and
    ``f_i <- f_i / factor * (1 - smooth_i) + f_i * smooth_i``. ``high`` is nudged by 1e-3 when it
    equals ``low`` (as HF and the reference do). No mscale is returned or applied.

    The operation order matches transformers' ``_compute_yarn_parameters`` so the fp32 values are
    bit-identical to HF's ``compress_inv_freq`` buffer.

    Args:
        rope_dim: r, the number of rotated channels (even).
        theta: RoPE base (``rope_theta`` or ``compress_rope_theta``).
        yarn_factor: YaRN ``factor``, or ``None`` for plain RoPE.
        yarn_original_max_pos: YaRN ``original_max_position_embeddings`` (L0).
        beta_fast, beta_slow: YaRN correction-range parameters.

    Returns:
        ``[rope_dim // 2]`` fp32.
    """
    assert rope_dim % 2 == 0, rope_dim
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)  # [r/2]
    inv_freq = 1.0 / pos_freqs  # [r/2]
    if yarn_factor is None:
        return inv_freq

    def correction_dim(num_rotations: float) -> float:
        return rope_dim * math.log(yarn_original_max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid 0/0 in the ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [r/2]
    smooth = 1 - ramp  # [r/2] 1 = keep the base frequency (extrapolate)
    inv_freq_interp = 1.0 / (yarn_factor * pos_freqs)  # [r/2]
    return inv_freq_interp * (1 - smooth) + inv_freq * smooth  # [r/2]


def apply_rope_tail(x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False,
                    out: Tensor | None = None) -> Tensor:
    """Rotate the last ``r = 2 * len(inv_freq)`` channels of ``x`` by ``positions * f`` (§3.2).

    Pairs are interleaved: ``x'[2i] = x[2i] cos - x[2i+1] sin``, ``x'[2i+1] = x[2i] sin +
    x[2i+1] cos`` with angle ``p * f_i``. ``inverse=True`` rotates by ``-p`` (the conjugate
    rotation that de-rotates the attention output, §5.6). The leading ``d - r`` "nope" channels are
    copied unchanged.

    Args:
        x: ``[T, ..., d]``; any number of middle axes (heads), which share the token's position.
        positions: ``[T]`` int64 absolute positions (compressed entry ``w`` of ratio m: ``w * m``).
        inv_freq: ``[r / 2]`` from :func:`rope_inv_freq`.
        inverse: rotate by ``-positions``.
        out: where to write the result instead (``x``'s shape and dtype, any strides: e.g. a
            transposed view of a group-major buffer that the grouped ``wo_a`` GEMMs read).

    Returns:
        ``out``, or a new ``[T, ..., d]`` tensor in ``x.dtype``; cos/sin and the rotation are
        computed in fp32.
    """
    r = 2 * inv_freq.numel()
    freqs = positions.float()[:, None] * inv_freq.to(device=x.device, dtype=torch.float32)  # [T, r/2]
    bshape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
    cos = freqs.cos().view(bshape)  # [T, 1.., r/2]
    sin = freqs.sin().view(bshape)  # [T, 1.., r/2]
    if inverse:
        sin = -sin
    pairs = x[..., x.shape[-1] - r :].float().unflatten(-1, (r // 2, 2))  # [T, .., r/2, 2]
    x0, x1 = pairs[..., 0], pairs[..., 1]  # [T, .., r/2] each
    rotated = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)  # [T, .., r]
    result = torch.cat([x[..., : x.shape[-1] - r], rotated.to(x.dtype)], dim=-1)  # [T, .., d]
    return result if out is None else out.copy_(result)


def norm_rope_tail(x: Tensor, positions: Tensor, inv_freq: Tensor, eps: float) -> Tensor:
    """The main query's unweighted per-head RMSNorm, then its RoPE tail (§3.1 row 2, §3.2):
    ``apply_rope_tail(rms_norm(x, None, eps), positions, inv_freq)``, the norm rounded to ``x.dtype``
    in between.

    Args:
        x: ``[T, ..., d]``, normed over ``d``.
        positions, inv_freq: as for :func:`apply_rope_tail`.
        eps: ``rms_norm_eps``.

    Returns:
        A new ``[T, ..., d]`` tensor in ``x.dtype``.
    """
    return apply_rope_tail(rms_norm(x, None, eps), positions, inv_freq)
