"""Triton mhc_pre / mhc_post against mhc_ref (kernel link of the test chain).

Tolerances: kernel_cases.assert_close (fp32 1e-5; bf16 1e-2 + cosine > 0.9999) on y (with and
without the fused input norm), post, comb and the mixed streams. CPU cases are tiny (interpreter);
V4-Flash (n = 4, D = 4096) is `gpu`-marked, at decode (T = 1: the n*D axis split over many
programs) and prefill (T = 1000: 64-token blocks) sizes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from csrc_triton import mhc_ref  # noqa: E402
from csrc_triton.mhc import hc_head, mhc_post, mhc_pre  # noqa: E402
from tests.csrc_triton.kernel_cases import (  # noqa: E402
    DTYPE_IDS, DTYPES, SKIP_REASON, assert_close, hc_head_args, mhc_post_args, mhc_pre_args,
)

pytestmark = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)
GPU = pytest.mark.gpu

# (T, n, D): length 0 and 1, a token block boundary (16), odd D, n = 3 (padded to 4), n*D = 4096
# (two splits of the projection even on CPU), V4-Flash.
SHAPES = [
    (0, 4, 8),
    (1, 4, 8),
    (17, 4, 20),
    (3, 3, 24),
    (2, 4, 1024),
    pytest.param(1, 4, 4096, marks=GPU),
    pytest.param(64, 4, 4096, marks=GPU),
    pytest.param(1000, 4, 4096, marks=GPU),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T, n, D", SHAPES)
@pytest.mark.parametrize("norm", [False, True], ids=["collapse", "collapse-norm"])
def test_mhc_pre_matches_ref(T, n, D, dtype, norm):
    """y alone, and with the sub-layer's input RMSNorm fused (as the model calls it)."""
    args = mhc_pre_args(T, n, D, dtype)
    if norm:
        weight = 0.5 + torch.rand(D, generator=torch.Generator().manual_seed(4))
        args = (*args, weight.to(args[0].device), 1e-6)
    y, post, comb = mhc_pre(*args)
    y_ref, post_ref, comb_ref = mhc_ref.mhc_pre(*args)
    assert_close(y, y_ref, dtype, "y")
    assert_close(post, post_ref, dtype, "post")
    assert_close(comb, comb_ref, dtype, "comb")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T, n, D", SHAPES)
@pytest.mark.parametrize("norm", [False, True], ids=["collapse", "collapse-norm"])
def test_hc_head_matches_ref(T, n, D, dtype, norm):
    """The hyper-head (n rows of fn, no post / comb), alone and with the model's final norm fused."""
    args = hc_head_args(T, n, D, dtype, norm)
    assert_close(hc_head(*args), mhc_ref.hc_head(*args), dtype)


@pytest.mark.parametrize("iters", [1, 2])
def test_mhc_pre_sinkhorn_iters(iters):
    args = mhc_pre_args(5, 4, 16, sinkhorn_iters=iters, seed=3)
    for ours, ref, what in zip(mhc_pre(*args), mhc_ref.mhc_pre(*args), ("y", "post", "comb")):
        assert_close(ours, ref, args[0].dtype, what)


def test_mhc_pre_strided_x():
    """x as a non-contiguous view (streams sliced out of a wider residual buffer)."""
    x, *rest = mhc_pre_args(3, 6, 16, seed=1)
    x = x[:, 1:5]  # [T, 4, D], stride(0) = 6 D
    fn, base, scale = mhc_pre_args(3, 4, 16, seed=2)[1:4]
    args = (x, fn, base, scale, *rest[3:])
    for ours, ref, what in zip(mhc_pre(*args), mhc_ref.mhc_pre(*args), ("y", "post", "comb")):
        assert_close(ours, ref, x.dtype, what)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T, n, D", SHAPES)
def test_mhc_post_matches_ref(T, n, D, dtype):
    args = mhc_post_args(T, n, D, dtype)
    assert_close(mhc_post(*args), mhc_ref.mhc_post(*args), dtype)
