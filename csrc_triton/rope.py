"""Partial interleaved RoPE on the tail channels, Triton (dsv4_architecture.md §3.2, §5.6).

Matches :func:`rope_ref.apply_rope_tail`: the last ``r = 2 * len(inv_freq)`` channels rotate in
interleaved pairs ``(x[2i], x[2i+1])`` by ``p * f_i`` (``-p`` with ``inverse``), the leading ``d - r``
are copied. The angle is the same fp32 product as the reference's; cos / sin are computed in the
kernel (libdevice, with full range reduction: positions reach 10^6). One program per (token, block of
heads) copies the nope channels and rotates the tail in fp32.

Bytes: reads and writes ``T * M * d`` elements (M = product of the middle axes) + ``8 T`` positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rope_tail_kernel(
    x_ptr, pos_ptr, freq_ptr, out_ptr,
    M, d, nope, half_r,
    s_xt, s_xm, s_xd, s_ot, s_om, s_od,
    INVERSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] heads
    m_ok = m < M
    x_row = x_ptr + t * s_xt + m[:, None] * s_xm  # [BM, 1]
    o_row = out_ptr + t * s_ot + m[:, None] * s_om
    for c0 in range(0, nope, BLOCK_NOPE):
        c = c0 + tl.arange(0, BLOCK_NOPE)
        mask = m_ok[:, None] & (c < nope)[None, :]
        tl.store(o_row + c[None, :] * s_od, tl.load(x_row + c[None, :] * s_xd, mask=mask), mask=mask)

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
    y0 = x0 * cos[None, :] - x1 * sin[None, :]
    y1 = x1 * cos[None, :] + x0 * sin[None, :]
    tl.store(o_row + even * s_od, y0.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + (even + 1) * s_od, y1.to(out_ptr.dtype.element_ty), mask=mask)


def apply_rope_tail(x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False) -> Tensor:
    """Triton :func:`rope_ref.apply_rope_tail` (same arguments and result).

    Args:
        x: ``[T, ..., d]`` any float dtype; the middle axes must flatten to one strided axis (they do
            for any slice of the last axis, e.g. the rope tail of a wider tensor).
        positions: ``[T]`` int64.
        inv_freq: ``[r / 2]`` fp32.
        inverse: rotate by ``-positions``.

    Returns:
        A new contiguous ``[T, ..., d]`` tensor in ``x.dtype``.
    """
    T, d = x.shape[0], x.shape[-1]
    half_r = inv_freq.numel()
    assert 2 * half_r <= d and positions.shape == (T,), (x.shape, half_r, positions.shape)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x3 = x.reshape(T, -1, d)  # [T, M, d]; a view whenever the middle axes merge
    M = x3.shape[1]
    out3 = out.view(T, M, d)
    inv_freq = inv_freq.to(device=x.device, dtype=torch.float32).contiguous()
    block_m = max(1, min(triton.next_power_of_2(M), 8192 // max(16, triton.next_power_of_2(d))))
    _rope_tail_kernel[(T, triton.cdiv(M, block_m))](
        x3, positions.to(x.device), inv_freq, out3,
        M, d, d - 2 * half_r, half_r,
        *x3.stride(), *out3.stride(),
        INVERSE=bool(inverse), BLOCK_M=block_m,
        BLOCK_NOPE=min(256, max(16, triton.next_power_of_2(d - 2 * half_r))),
        BLOCK_R=max(16, triton.next_power_of_2(half_r)),
    )
    return out
