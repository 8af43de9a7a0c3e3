"""Triton apply_rope_tail and norm_rope_tail against rope_ref (kernel link of the test chain).

apply_rope_tail: kernel_cases.assert_close (fp32 1e-5; bf16 1e-2 + cosine). Positions reach 2^20, so
the kernel's cos / sin must range-reduce like torch's; the nope channels must be copied bit for bit.

norm_rope_tail: fp32 as above. bf16 is rounded twice, after the norm and after the rotation, and the
kernel's fp32 values before each rounding may differ from the reference's by a few ulps (summation
order, rsqrt / cos / sin from another library), so a rounding may land on the neighbouring value: an
output may differ by one ulp of itself plus one ulp of each normed value ``(n0, n1)`` of its pair (rope
channels), ``|out - ref| <= u (max(|out|, |ref|) + |n0| + |n1|)`` with ``u = 2^-7 + 2^-18`` (one bf16
ulp is at most 2^-7 of the value). Roundings rarely move, so at least 99% of the outputs must be
identical besides. Rows span 10^-3 .. 10^3 and one is zero, so eps is visible.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from csrc_triton.norm_ref import rms_norm  # noqa: E402
from csrc_triton.rope import apply_rope_tail, norm_rope_tail  # noqa: E402
from csrc_triton.rope_ref import apply_rope_tail as apply_rope_tail_ref  # noqa: E402
from csrc_triton.rope_ref import norm_rope_tail as norm_rope_tail_ref  # noqa: E402
from tests.csrc_triton.kernel_cases import (  # noqa: E402
    DTYPE_IDS, DTYPES, SKIP_REASON, assert_close, norm_rope_args, rope_args, rope_pair_magnitude,
)

pytestmark = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)
GPU = pytest.mark.gpu

# (T, mid, d, r): length 0 and 1, no middle axis (kv), two middle axes, all channels rotated (r = d),
# odd d, a head-block boundary; V4 q (64 heads x 512, r = 64), kv, indexer q (64 x 128).
SHAPES = [
    (0, (2,), 16, 8),
    (1, (1,), 8, 8),
    (5, (), 20, 8),
    (3, (2, 3), 24, 8),
    (2, (2, 2, 3), 16, 8),
    (4, (33,), 300, 16),
    pytest.param(64, (64,), 512, 64, marks=GPU),
    pytest.param(1000, (), 512, 64, marks=GPU),
    pytest.param(64, (64,), 128, 64, marks=GPU),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("inverse", [False, True], ids=["fwd", "inv"])
@pytest.mark.parametrize("T, mid, d, r", SHAPES)
def test_apply_rope_tail_matches_ref(T, mid, d, r, inverse, dtype):
    args = rope_args(T, mid, d, r, dtype, inverse)
    out = apply_rope_tail(*args)
    ref = apply_rope_tail_ref(*args)
    assert_close(out, ref, dtype)
    assert torch.equal(out[..., : d - r], args[0][..., : d - r])
    assert T == 0 or out.data_ptr() != args[0].data_ptr()


def test_apply_rope_tail_strided_and_roundtrip():
    """A non-contiguous x (the tail of a wider tensor); forward then inverse gives x back."""
    x, pos, inv_freq, _ = rope_args(3, (4,), 40, 8)
    view = x[..., 8:]  # [T, 4, 32]
    assert_close(apply_rope_tail(view, pos, inv_freq), apply_rope_tail_ref(view, pos, inv_freq), torch.float32)
    back = apply_rope_tail(apply_rope_tail(view, pos, inv_freq), pos, inv_freq, inverse=True)
    torch.testing.assert_close(back, view, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T, groups, heads, d, r", [(0, 2, 2, 16, 8), (5, 2, 3, 24, 8),
                                                    pytest.param(64, 8, 8, 512, 64, marks=GPU)])
def test_apply_rope_tail_into_a_group_major_buffer(T, groups, heads, d, r, dtype):
    """``out=`` a transposed view (the grouped ``wo_a``'s [G, T, H/G, d] input): every element of the
    buffer written, with the values the reference returns for the [T, H, d] layout."""
    x, pos, inv_freq, _ = rope_args(T, (groups * heads,), d, r, dtype, True)
    buffer = torch.full((groups, T, heads, d), float("nan"), dtype=dtype, device=x.device)
    out = apply_rope_tail(x.view(T, groups, heads, d), pos, inv_freq, inverse=True, out=buffer.transpose(0, 1))
    assert out.data_ptr() == buffer.data_ptr()
    ref = apply_rope_tail_ref(x, pos, inv_freq, inverse=True)
    assert_close(buffer.transpose(0, 1).reshape(T, groups * heads, d), ref, dtype)


# (T, mid, d, r): as SHAPES, with V4's query rows (64 heads x 512, r = 64) at a few tokens for the interpreter.
NORM_SHAPES = SHAPES[:5] + [
    (2, (4,), 512, 64),
    pytest.param(64, (64,), 512, 64, marks=GPU),
    pytest.param(1024, (64,), 512, 64, marks=GPU),
]


def assert_norm_rope_matches_ref(out: torch.Tensor, x: torch.Tensor, positions, inv_freq, eps) -> None:
    """``out`` against the reference within the module's bounds."""
    ref = norm_rope_tail_ref(x, positions, inv_freq, eps)
    if x.dtype == torch.float32:
        assert_close(out, ref, x.dtype)
        return
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype)
    o, f = out.double().cpu(), ref.double().cpu()
    normed = rms_norm(x, None, eps).double().cpu()  # the reference's values before the rotation
    bound = (2**-7 + 2**-18) * (torch.maximum(o.abs(), f.abs()) + rope_pair_magnitude(normed, 2 * inv_freq.numel()))
    excess = (o - f).abs() - bound
    assert excess.numel() == 0 or excess.max() <= 0, ((o - f).abs().max().item(), excess.argmax().item())
    if o.numel():
        same = (o == f).double().mean().item()
        assert same >= 0.99, same


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T, mid, d, r", NORM_SHAPES)
def test_norm_rope_tail_matches_ref(T, mid, d, r, dtype):
    args = norm_rope_args(T, mid, d, r, dtype)
    out = norm_rope_tail(*args)
    assert_norm_rope_matches_ref(out, *args)
    assert out.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_norm_rope_tail_strided(dtype):
    """x a column window of a wider tensor whose other columns are NaN (the norm must read only the row)."""
    x, positions, inv_freq, eps = norm_rope_args(3, (4,), 40, 8, dtype)
    nan = torch.full_like(x, float("nan"))
    window = torch.cat([nan, x, nan], -1)[..., 40:80]  # [T, 4, 40], head stride 120
    assert not window.is_contiguous()
    assert_norm_rope_matches_ref(norm_rope_tail(window, positions, inv_freq, eps), window, positions, inv_freq, eps)
