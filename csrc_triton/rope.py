"""Partial interleaved RoPE on the tail channels, Triton (docs/MODEL.md §3.2, §5.6).

Matches :func:`rope_ref.apply_rope_tail`: the last ``r = 2 * len(inv_freq)`` channels rotate in
interleaved pairs ``(x[2i], x[2i+1])`` by ``p * f_i`` (``-p`` with ``inverse``), the leading ``d - r``
are copied. The angle is the same fp32 product as the reference's; cos / sin are computed in the
kernel (libdevice, with full range reduction: positions reach 10^6), for the tail's r / 2 pairs only
(once per program: at V4's 512-channel heads, computing them for all d / 2 pairs made the kernel
arithmetic-bound). One program per (token, outer middle axis, block of heads) loads its rows as their
nope channels and their tail (one read, one write of each value: the loads of a step are all in
flight at once), rotates the tail's pairs in fp32 and stores everything; bf16 results are rounded to
nearest even by hand (the interpreter's cast truncates). Input and output take their own strides on
two middle axes, so the result can land straight in another layout (``wo_a``'s group-major input,
model/attention.py). ``rotate_pairs`` is the rotation, shared with kv_insert.py.

:func:`norm_rope_tail` (the main query's per-head norm, then its RoPE) is the same kernel with
``norm_ref.rms_norm(x, None, eps)`` fused in front: the program norms each head row in registers
and rounds it to ``x.dtype``, as the unfused ops do in between. The squares are summed in another
order and rsqrt comes from another library, so a normed value may now and then round to the
neighbouring bf16 value (tests/csrc_triton/test_rope_kernel.py states the bounds).

Bytes: reads and writes ``T * M * d`` elements (M = product of the middle axes) + ``8 T`` positions;
unfused, the norm would read and write the whole query once more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from csrc_triton.codec import round_to_x, store_values

# Values one program holds: 4 query heads of V4 (512 channels), 16 indexer heads (128); a decode step's
# query is then spread over T * 16 programs (it was T * 4 of 16 heads, three dependent passes each).
ROW_TILE = 2048


def tail_block(r: int) -> int:
    """The tile width (``BLOCK_R``) of an ``r``-channel rope tail."""
    return max(16, triton.next_power_of_2(r))


@triton.jit
def rotate_pairs(xt, position, freq_ptr, r, INVERSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """``xt [BM, BR]`` (fp32, the ``r`` tail channels) with its interleaved pairs ``(2j, 2j + 1)`` rotated
    by ``position * freq[j]`` (``position`` fp32, a scalar or [BM, 1]; the reference's product), by its
    negative with INVERSE: the tail's only arithmetic, so cos / sin are worked out for its pairs alone."""
    j = tl.arange(0, BLOCK_R // 2)[None, :]  # [1, BR/2]
    angle = position * tl.load(freq_ptr + j, mask=2 * j < r, other=0.0)
    x0, x1 = tl.split(tl.reshape(xt, [BLOCK_M, BLOCK_R // 2, 2]))  # [BM, BR/2]
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    if INVERSE:
        sin = -sin
    return tl.reshape(tl.join(x0 * cos - x1 * sin, x1 * cos + x0 * sin), [BLOCK_M, BLOCK_R])


@triton.jit
def _rope_tail_kernel(
    x_ptr, pos_ptr, freq_ptr, out_ptr,
    M, d, nope, eps,
    s_xt, s_xa, s_xm, s_xd, s_ot, s_oa, s_om, s_od,
    INVERSE: tl.constexpr, NORM: tl.constexpr, X_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_NOPE: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    a = tl.program_id(1).to(tl.int64)  # outer middle axis (e.g. the head group of a group-major out)
    m = (tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]  # [BM, 1] heads
    c = tl.arange(0, BLOCK_NOPE)[None, :]  # [1, BN] nope channels 0 .. nope - 1
    k = nope + tl.arange(0, BLOCK_R)[None, :]  # [1, BR] tail channels nope .. d - 1
    nope_ok, tail_ok = (m < M) & (c < nope), (m < M) & (k < d)
    row = x_ptr + t * s_xt + a * s_xa + m * s_xm
    x = tl.load(row + c * s_xd, mask=nope_ok, other=0.0).to(tl.float32)  # [BM, BN]
    xt = tl.load(row + k * s_xd, mask=tail_ok, other=0.0).to(tl.float32)  # [BM, BR]
    if NORM:  # rms_norm(x, None, eps), rounded to x's dtype as the unfused op stores it
        inv_rms = tl.rsqrt((tl.sum(x * x, axis=1) + tl.sum(xt * xt, axis=1)) / d + eps)[:, None]
        x = round_to_x(x * inv_rms, X_BF16)
        xt = round_to_x(xt * inv_rms, X_BF16)

    y = rotate_pairs(xt, tl.load(pos_ptr + t).to(tl.float32), freq_ptr, d - nope, INVERSE, BLOCK_M, BLOCK_R)
    out = out_ptr + t * s_ot + a * s_oa + m * s_om
    store_values(out + c * s_od, x, nope_ok, X_BF16)  # nope channels exact in x's dtype: stored as loaded
    store_values(out + k * s_od, y, tail_ok, X_BF16)


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
    assert x.dtype in (torch.float32, torch.bfloat16), x.dtype  # the dtypes round_to_x rounds to
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
    assert d % 2 == 0 and 2 * half_r <= d and positions.shape == (T,), (x.shape, half_r, positions.shape)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == x.dtype, (out.shape, x.shape, out.dtype, x.dtype)
    if x.numel() == 0:
        return out
    assert out.dim() <= 4 or out.is_contiguous(), ("out needs at most two middle axes", out.shape, out.stride())
    x4, out4 = _two_middle_axes(x), _two_middle_axes(out)  # [T, A, B, d]
    A, B = x4.shape[1:3]
    inv_freq = inv_freq.to(device=x.device, dtype=torch.float32).contiguous()
    nope = d - 2 * half_r
    # rows per program by the row width, not the head count: one compiled kernel per width
    block_m = max(1, ROW_TILE // max(16, triton.next_power_of_2(d)))
    _rope_tail_kernel[(T, A, triton.cdiv(B, block_m))](
        x4, positions.to(x.device), inv_freq, out4,
        B, d, nope, 0.0 if norm_eps is None else float(norm_eps),
        *x4.stride(), *out4.stride(),
        INVERSE=bool(inverse), NORM=norm_eps is not None, X_BF16=x.dtype == torch.bfloat16, BLOCK_M=block_m,
        BLOCK_NOPE=max(16, triton.next_power_of_2(nope)), BLOCK_R=tail_block(2 * half_r),
    )
    return out
