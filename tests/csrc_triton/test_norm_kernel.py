"""Triton rms_norm against norm_ref (kernel link of the test chain).

Tolerance: kernel_cases.assert_close (fp32 1e-5; bf16 1e-2 + cosine). The kernel does the reference's
fp32 operations and its one rounding, but sums the squares in another order and takes rsqrt from
another library, so a bf16 output may land on the neighbouring value (one ulp, within the bf16
tolerance); roundings rarely move, so at least 99% of bf16 outputs must be identical (this catches a
rounding that truncates). Rows span 10^-3 .. 10^3 and one is zero, so eps is visible.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from csrc_triton.norm import rms_norm  # noqa: E402
from csrc_triton.norm_ref import rms_norm as rms_norm_ref  # noqa: E402
from tests.csrc_triton.kernel_cases import DTYPE_IDS, DTYPES, SKIP_REASON, assert_close, rms_norm_args  # noqa: E402

pytestmark = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)
GPU = pytest.mark.gpu

# (leading axes, D): length 0 and 1, odd row counts and D (a partial row block, masked channels), two
# and three leading axes, one row per program (4096) and a masked 8192 tile (7168); V4-Flash / V4-Pro
# hidden (4096 / 7168), q latent (1024 / 1536) and the per-head query norm ([T, 64, 512]).
SHAPES = [
    ((0,), 16),
    ((1,), 16),
    ((37,), 20),
    ((3, 4), 300),
    ((2, 3, 5), 64),
    ((3,), 4096),
    ((2,), 7168),
    ((9,), 1536),
    ((2, 4), 512),
    pytest.param((4096,), 4096, marks=GPU),
    pytest.param((4096,), 7168, marks=GPU),
    pytest.param((4096,), 1024, marks=GPU),
    pytest.param((4096,), 1536, marks=GPU),
    pytest.param((1024, 64), 512, marks=GPU),
]
WEIGHTS = [torch.float32, torch.bfloat16, None]
WEIGHT_IDS = ["w_fp32", "w_bf16", "unweighted"]


def assert_norm_matches_ref(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """The module's tolerances."""
    assert_close(out, ref, dtype)
    if dtype == torch.bfloat16 and ref.numel():
        same = (out.cpu() == ref.cpu()).double().mean().item()
        assert same >= 0.99, same


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("weight_dtype", WEIGHTS, ids=WEIGHT_IDS)
@pytest.mark.parametrize("lead, D", SHAPES)
def test_rms_norm_matches_ref(lead, D, weight_dtype, dtype):
    x, weight, eps = rms_norm_args(lead, D, weight_dtype, dtype)
    out = rms_norm(x, weight, eps)
    assert_norm_matches_ref(out, rms_norm_ref(x, weight, eps), dtype)
    assert out.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("weight_dtype", [torch.float32, None], ids=["weighted", "unweighted"])
def test_rms_norm_strided_rows(weight_dtype, dtype):
    """A [T, H, d] column window of a wider tensor whose other columns are NaN (rows strided; the
    leading axes merge into one strided axis), its heads-first transpose (they do not: a copy), and a
    column-major [N, d] (strided channels)."""
    x, weight, eps = rms_norm_args((5, 3), 40, weight_dtype, dtype)
    nan = torch.full_like(x, float("nan"))
    window = torch.cat([nan, x, nan], -1)[..., 40:80]  # [5, 3, 40], row stride 120
    column_major = x.reshape(15, 40).t().contiguous().t()  # [15, 40], strides (1, 15)
    for view in (window, window.transpose(0, 1), column_major):
        assert not view.is_contiguous()
        assert_norm_matches_ref(rms_norm(view, weight, eps), rms_norm_ref(view, weight, eps), dtype)
