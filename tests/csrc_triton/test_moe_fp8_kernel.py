"""Triton moe_experts_fp8 (V4-Flash-Base's FP8 routed experts) against moe_mxfp4_ref.moe_experts_fp8.

Tolerances as test_moe_mxfp4_kernel.py (kernel_cases.assert_close): the kernel's weights are the
reference's values (e4m3 times a power-of-two scale, exact in bf16), so the fp32 summation order and h
rounded to x's dtype are all that differ.

Shapes: those of the MXFP4 test, with dims that are not multiples of 128 (a ragged last scale block, W3's
scale rows not starting on a 128-row block of w13), several 128-blocks along each dim with their own
scales, experts over several row blocks; V4-Flash's sizes are `gpu`-marked.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from csrc_triton.moe_mxfp4 import moe_experts_fp8  # noqa: E402
from csrc_triton.moe_mxfp4_ref import moe_experts_fp8 as moe_experts_fp8_ref  # noqa: E402
from tests.csrc_triton.kernel_cases import DTYPE_IDS, DTYPES, SKIP_REASON, assert_close, moe_fp8_args  # noqa: E402

pytestmark = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)
GPU = pytest.mark.gpu

# (T, D, I, E_local, k, p_hot): swiglu_limit 3 (many gate / up values clamped)
SHAPES = [
    (0, 64, 32, 4, 2, 0.0),
    (1, 64, 32, 3, 6, 0.0),
    (5, 160, 96, 3, 4, 0.0),  # ragged blocks: I = 96 < 128, D = 160 = 128 + 32
    (17, 288, 160, 5, 3, 0.0),  # three blocks of D, two of I (the second ragged)
    (40, 256, 256, 4, 2, 0.6),  # expert 0: ~50 rows in 16-row blocks; 2 x 2 blocks per weight
    (70, 96, 160, 2, 3, 0.0),  # ~100 rows per expert: 64-row blocks
]
V4_FLASH = [
    pytest.param(1, 4096, 2048, 16, 6, 0.0, marks=GPU),
    pytest.param(16, 4096, 2048, 16, 6, 0.0, marks=GPU),
    pytest.param(300, 4096, 2048, 16, 6, 0.0, marks=GPU),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T, D, I, E, k, p_hot", SHAPES)
def test_moe_experts_fp8_matches_ref(T, D, I, E, k, p_hot, dtype):
    args = moe_fp8_args(T, D, I, E, k, dtype, p_hot=p_hot, limit=3.0)
    out = moe_experts_fp8(*args)
    assert out.shape == (T, D)
    assert_close(out, moe_experts_fp8_ref(*args), dtype)
    if T > 1:  # token 0 has every slot skipped: exactly 0
        assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("T, D, I, E, k, p_hot", V4_FLASH)
def test_moe_experts_fp8_v4_flash_dims(T, D, I, E, k, p_hot):
    args = moe_fp8_args(T, D, I, E, k, torch.bfloat16, p_hot=p_hot, limit=10.0)
    assert_close(moe_experts_fp8(*args), moe_experts_fp8_ref(*args), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_moe_experts_fp8_adds_the_shared_output(dtype):
    args = moe_fp8_args(9, 160, 96, 4, 3, dtype, limit=3.0)
    shared = torch.randn(9, 160, generator=torch.Generator().manual_seed(3)).to(dtype).to(args[0].device)
    out = moe_experts_fp8(*args, shared=shared)
    assert torch.equal(out, (moe_experts_fp8(*args) + shared).to(dtype))
    assert_close(out, moe_experts_fp8_ref(*args, shared=shared), dtype)


def test_moe_experts_fp8_reads_each_block_scale():
    """Every 128-block's scale, W3's included, reaches its weights: doubling one block's scale doubles that
    block's weights only, in kernel and reference alike (a kernel reading a neighbour's scale differs)."""
    x, weights, ids, w13, s13, w2, s2, limit = moe_fp8_args(12, 288, 160, 2, 2, torch.float32, p_skip=0.0,
                                                            limit=30.0)
    base = moe_experts_fp8(x, weights, ids, w13, s13, w2, s2, limit)
    for which, block in (("w13", (0, 1, 2)), ("w13", (1, 3, 0)), ("w2", (0, 2, 1)), ("w2", (1, 0, 0))):
        s13_b, s2_b = s13.clone(), s2.clone()
        (s13_b if which == "w13" else s2_b)[block] *= 2
        out = moe_experts_fp8(x, weights, ids, w13, s13_b, w2, s2_b, limit)
        ref = moe_experts_fp8_ref(x, weights, ids, w13, s13_b, w2, s2_b, limit)
        assert not torch.allclose(ref, base)
        assert_close(out, ref, torch.float32, f"{which} block {block}")
