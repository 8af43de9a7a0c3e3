"""Partial interleaved RoPE on the tail channels, Triton (dsv4_architecture.md §3.2, §5.6).

Matches :func:`rope_ref.apply_rope_tail`: the last ``r = 2 * len(inv_freq)`` channels rotate in
interleaved pairs ``(x[2i], x[2i+1])`` by ``p * f_i`` (``-p`` with ``inverse``), the leading ``d - r``
are copied. The angle is the same fp32 product as the reference's; cos / sin are computed in the
kernel (libdevice, with full range reduction: positions reach 10^6). One program per (token, outer
middle axis, block of heads) copies the nope channels and rotates the tail in fp32; bf16 results are
rounded to nearest even by hand (the interpreter's cast truncates). Input and output take their own
strides on two middle axes, so the result can land straight in another layout (``wo_a``'s
group-major input, model/attention.py).

:func:`norm_rope_tail` (the main query's per-head norm, then its RoPE) is the same kernel with
``norm_ref.rms_norm(x, None, eps)`` fused in front: the program first sums each head row's squares,
then norms every value it copies or rotates in fp32 and rounds it to ``x.dtype``, as the unfused ops
do in between. The squares are summed in another order and rsqrt comes from another library, so a
normed value may now and then round to the neighbouring bf16 value (tests/csrc_triton/test_rope_kernel.py
states the bounds).

Bytes: reads and writes ``T * M * d`` elements (M = product of the middle axes) + ``8 T`` positions.
The fused norm reads each row a second time, from cache (a program's rows are 16 KiB for V4's query);
unfused, the norm would read and write the whole query once more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from csrc_triton.kv_cache import _round_to_x, _store_values


@triton.jit
def _rope_tail_kernel(
    x_ptr, pos_ptr, freq_ptr, out_ptr,
    M, d, nope, half_r, eps,
    s_xt, s_xa, s_xm, s_xd, s_ot, s_oa, s_om, s_od,
    INVERSE: tl.constexpr, NORM: tl.constexpr, X_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    a = tl.program_id(1).to(tl.int64)  # outer middle axis (e.g. the head group of a group-major out)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] heads
    m_ok = m < M
    x_row = x_ptr + t * s_xt + a * s_xa + m[:, None] * s_xm  # [BM, 1]
    o_row = out_ptr + t * s_ot + a * s_oa + m[:, None] * s_om
    if NORM:  # rms_norm(x, None, eps): each row's mean square before anything is written
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c0 in range(0, d, BLOCK_NOPE):
            c = c0 + tl.arange(0, BLOCK_NOPE)
            mask = m_ok[:, None] & (c < d)[None, :]
            v = tl.load(x_row + c[None, :] * s_xd, mask=mask, other=0.0).to(tl.float32)
            sum_sq += tl.sum(v * v, axis=1)
        rms = tl.rsqrt(sum_sq / d + eps)[:, None]  # [BM, 1]
    for c0 in range(0, nope, BLOCK_NOPE):
        c = c0 + tl.arange(0, BLOCK_NOPE)
        mask = m_ok[:, None] & (c < nope)[None, :]
        v = tl.load(x_row + c[None, :] * s_xd, mask=mask)
        if NORM:
            v = _round_to_x(v.to(tl.float32) * rms, X_BF16)
        tl.store(o_row + c[None, :] * s_od, v.to(out_ptr.dtype.element_ty), mask=mask)

    i = tl.arange(0, BLOCK_R)  # [BR] pair index
    i_ok = i < half_r
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(freq_ptr + i, mask=i_ok, other=0.0)  # [BR]
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    if INVERSE:
        sin = -sin
    mask = m_ok[:, None] & i_ok[None, :]  # [BM, BR]
    even = nope + 2 * i[None, :]  # [1, BR] channel of x[2i]
    x0 = tl.load(x_row + even * s_xd, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(x_row + (even + 1) * s_xd, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        x0 = _round_to_x(x0 * rms, X_BF16)
        x1 = _round_to_x(x1 * rms, X_BF16)
    y0 = x0 * cos[None, :] - x1 * sin[None, :]
    y1 = x1 * cos[None, :] + x0 * sin[None, :]
    _store_values(o_row + even * s_od, y0, mask, X_BF16)
    _store_values(o_row + (even + 1) * s_od, y1, mask, X_BF16)


def apply_rope_tail(x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False,
                    out: Tensor | None = None) -> Tensor:
    """Triton :func:`rope_ref.apply_rope_tail` (same arguments and result).

    Args:
        x: ``[T, ..., d]`` any float dtype, at most two middle axes that do not merge into one
            strided axis (more cost a copy).
        positions: ``[T]`` int64.
        inv_freq: ``[r / 2]`` fp32.
        inverse: rotate by ``-positions``.
        out: where to write the result instead (``x``'s shape and dtype; the same rule for its axes).

    Returns:
        ``out``, or a new contiguous ``[T, ..., d]`` tensor in ``x.dtype``.
    """
    return _rope_tail(x, positions, inv_freq, inverse, None, out)


def norm_rope_tail(x: Tensor, positions: Tensor, inv_freq: Tensor, eps: float) -> Tensor:
    """Triton :func:`rope_ref.norm_rope_tail` (same arguments and result; see the module for the numerics).

    Args:
        x: ``[T, ..., d]`` bf16 or fp32, as for :func:`apply_rope_tail`; normed over ``d``.
        positions, inv_freq: as for :func:`apply_rope_tail`.
        eps: the RMSNorm epsilon.

    Returns:
        A new contiguous ``[T, ..., d]`` tensor in ``x.dtype``.
    """
    assert x.dtype in (torch.float32, torch.bfloat16), x.dtype  # the dtypes _round_to_x rounds to
    return _rope_tail(x, positions, inv_freq, False, eps, None)


def _two_middle_axes(x: Tensor) -> Tensor:
    """``x`` ``[T, ..., d]`` as ``[T, A, B, d]``: a view for up to two middle axes, else a reshape."""
    T, d = x.shape[0], x.shape[-1]
    if x.dim() == 4:
        return x
    if x.dim() == 3:
        return x.unsqueeze(1)
    return x.reshape(T, 1, -1, d)


def _rope_tail(x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool, norm_eps: float | None,
               out: Tensor | None) -> Tensor:
    """Launch :func:`_rope_tail_kernel` into ``out`` (or a new tensor), norming each row first when
    ``norm_eps`` is given."""
    T, d = x.shape[0], x.shape[-1]
    half_r = inv_freq.numel()
    assert 2 * half_r <= d and positions.shape == (T,), (x.shape, half_r, positions.shape)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == x.dtype, (out.shape, x.shape, out.dtype, x.dtype)
    if x.numel() == 0:
        return out
    assert out.dim() <= 4 or out.is_contiguous(), ("out needs at most two middle axes", out.shape, out.stride())
    x4, out4 = _two_middle_axes(x), _two_middle_axes(out)  # [T, A, B, d]
    A, B = x4.shape[1:3]
    inv_freq = inv_freq.to(device=x.device, dtype=torch.float32).contiguous()
    block_m = max(1, min(triton.next_power_of_2(B), 8192 // max(16, triton.next_power_of_2(d))))
    _rope_tail_kernel[(T, A, triton.cdiv(B, block_m))](
        x4, positions.to(x.device), inv_freq, out4,
        B, d, d - 2 * half_r, half_r, 0.0 if norm_eps is None else float(norm_eps),
        *x4.stride(), *out4.stride(),
        INVERSE=bool(inverse), NORM=norm_eps is not None, X_BF16=x.dtype == torch.bfloat16, BLOCK_M=block_m,
        BLOCK_NOPE=min(256, max(16, triton.next_power_of_2(d - 2 * half_r))),
        BLOCK_R=max(16, triton.next_power_of_2(half_r)),
    )
    return out
