"""RMSNorm, weighted or unweighted, Triton (docs/MODEL.md §3.1).

Matches :func:`norm_ref.rms_norm` (same signature): the mean of squares, rsqrt and the products in fp32
(the weight upcast), one rounding to ``x.dtype`` at the end (bf16 rounded to nearest even by hand, as
the interpreter's cast truncates). One program per block of rows holds whole rows in registers
(``BLOCK_D = next_pow2(D)``, 8192 for V4-Pro's 7168 hidden), so each row is read once. Rows may be
strided (a column window of a wider tensor, a ``[T, H, d]`` view): the leading axes are flattened to
one strided axis, a view whenever they merge.

Numerics: the squares are summed in another order and rsqrt comes from another library, so the fp32
value before the rounding may differ by a few ulps, which now and then moves a bf16 rounding to the
neighbouring value (tests/csrc_triton/test_norm_kernel.py states the bounds).

Bytes: reads ``x`` and writes ``y`` once (``2 N D`` elements) plus the weight (``D``, shared by all
rows); the reference also writes and reads back fp32 temporaries of ``[N, D]`` (the cast, the
square, each product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from csrc_triton.codec import store_values

# Values one program holds: a V4 hidden row (4096) or several shorter rows (q latent, per head).
ROW_TILE = 4096


@triton.jit(do_not_specialize=["N"])
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr,
    N, D, eps,
    s_xn, s_xd, s_w, s_on,
    HAS_WEIGHT: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] rows
    c = tl.arange(0, BLOCK_D)[None, :]  # [1, BD] channels
    mask = (n < N)[:, None] & (c < D)
    x = tl.load(x_ptr + n[:, None] * s_xn + c * s_xd, mask=mask, other=0.0).to(tl.float32)  # [BN, BD]
    y = x * tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + c * s_w, mask=c < D, other=0.0).to(tl.float32)
    store_values(out_ptr + n[:, None] * s_on + c, y, mask, OUT_BF16)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """Triton :func:`norm_ref.rms_norm` (same arguments and result; see the module for the numerics).

    Args:
        x: ``[..., D]`` any float dtype, any strides (leading axes that do not merge into one strided
            axis, e.g. a transposed view, cost a copy).
        weight: ``[D]`` bf16 or fp32, or ``None`` (unweighted).
        eps: the RMSNorm epsilon.

    Returns:
        A new contiguous ``[..., D]`` tensor in ``x.dtype``.
    """
    D = x.shape[-1]
    assert weight is None or weight.shape == (D,), (x.shape, weight.shape)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    rows = x.reshape(-1, D)  # [N, D]
    N = rows.shape[0]
    block_d = triton.next_power_of_2(D)
    block_n = max(1, ROW_TILE // block_d)  # not by N: one compiled kernel for every step size
    _rms_norm_kernel[(triton.cdiv(N, block_n),)](
        rows, weight if weight is not None else rows, out,
        N, D, float(eps),
        *rows.stride(), weight.stride(0) if weight is not None else 0, D,
        HAS_WEIGHT=weight is not None, OUT_BF16=x.dtype == torch.bfloat16, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=8 if block_n * block_d >= ROW_TILE else 4,  # full tiles: 16 values a thread (32 for D = 7168)
    )
    return out
