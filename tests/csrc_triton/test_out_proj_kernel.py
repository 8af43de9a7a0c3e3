"""Triton rope_out_proj (inverse RoPE + FP8 quantisation + grouped block-FP8 wo_a) against out_proj_ref.

Tolerance: kernel_cases.assert_close at the bf16 level for both dtypes (the FP8 tensor-core sums
differ from the reference's fp32 ones by accumulation order). Both sides de-rotate with the same
cos / sin (the launcher computes them as the reference does), without FMA contraction, take the
scale as amax times the fp32 reciprocal of 448 and divide by it in IEEE arithmetic
(test_compile_hopper.py checks the PTX), so the e4m3 activations are the reference's: one activation
rounded to the neighbouring e4m3 value moves an output by up to ~0.01 at these magnitudes. On an
H200 an approximate '/' failed fp32 at 64 and 1,000 tokens (largest difference 0.0137),
and an IEEE amax / 448 against torch's CUDA scalar division (a reciprocal product) failed bf16 from 3
tokens on, where 448 x / amax often lands on an e4m3 tie. A wrong rotation sign, a missed scale or a
wrong group moves outputs by their own size.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from csrc_triton.out_proj import rope_out_proj, rope_quant_fp8  # noqa: E402
from csrc_triton.out_proj_ref import rope_out_proj as rope_out_proj_ref  # noqa: E402
from csrc_triton.out_proj_ref import rope_quant_fp8 as rope_quant_fp8_ref  # noqa: E402
from tests.csrc_triton.kernel_cases import DTYPE_IDS, DTYPES, SKIP_REASON, assert_close, out_proj_args  # noqa: E402

pytestmark = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)
GPU = pytest.mark.gpu

# (T, H, d, r, G, R): no tokens; one token; the tail inside the last 128-block and all channels rotated
# (r = d); several heads per group, tokens over one M block; V4-Flash at decode and prefill sizes;
# the kernel-shaped preset.
SHAPES = [
    (0, 2, 128, 16, 1, 128),
    (1, 2, 128, 16, 2, 128),
    (3, 4, 256, 64, 2, 128),
    (5, 2, 128, 128, 1, 256),
    (70, 4, 128, 32, 2, 128),
    pytest.param(1, 64, 512, 64, 8, 1024, marks=GPU),
    pytest.param(64, 64, 512, 64, 8, 1024, marks=GPU),
    pytest.param(1000, 64, 512, 64, 8, 1024, marks=GPU),
    pytest.param(37, 8, 512, 64, 2, 128, marks=GPU),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T, H, d, r, G, R", SHAPES)
def test_rope_out_proj_matches_ref(T, H, d, r, G, R, dtype):
    args = out_proj_args(T, H, d, r, G, R, dtype)
    assert_close(rope_out_proj(*args), rope_out_proj_ref(*args), torch.bfloat16)


def test_rope_out_proj_reads_strided_heads():
    """The attention output as a slice of a wider buffer (heads not contiguous)."""
    o, *rest = out_proj_args(4, 2, 128, 16, 2, 128, torch.bfloat16)
    wide = torch.zeros(4, 3, 128, dtype=o.dtype, device=o.device)
    wide[:, 1:] = o
    assert_close(rope_out_proj(wide[:, 1:], *rest), rope_out_proj_ref(o, *rest), torch.bfloat16)


@pytest.mark.parametrize("tiles", [dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=6),
                                   dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4),
                                   dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4, SPLIT_K=2),
                                   dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4, SPLIT_K=3)],
                         ids=["n32", "m64n128", "split2", "split3-uneven"])
def test_rope_out_proj_other_tiles_match_ref(tiles):
    """The tile shapes scripts/bench_kernels.py times against the default ones compute the same."""
    args = out_proj_args(70, 4, 128, 32, 2, 128, torch.bfloat16)
    assert_close(rope_out_proj(*args, tiles=tiles), rope_out_proj_ref(*args), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T, H, d, r, G, R", SHAPES)
def test_rope_quant_fp8_matches_ref_bit_for_bit(T, H, d, r, G, R, dtype):
    """The de-rotated, quantised activations of the grouped-GEMM path: the same e4m3 codes and scales
    as the reference (same rounding rules, module doc), laid out as DeepGEMM's grouped GEMM reads
    them, with the scales' padding rows (tokens up to a multiple of 4) at 0."""
    o, positions, inv_freq, *_ = out_proj_args(T, H, d, r, G, R, dtype)
    q, scale = rope_quant_fp8(o, positions, inv_freq, G)
    q_ref, scale_ref = rope_quant_fp8_ref(o, positions, inv_freq, G)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)
    if T:  # (an empty tensor's strides say nothing)
        K, padded = H // G * d, -(-T // 4) * 4
        assert q.stride() == (K, T * K, 1)  # group-major
        assert scale.stride() == (1, K // 128 * padded, padded)  # per group, tokens fastest
        storage = torch.as_strided(scale, (G, K // 128, padded), (K // 128 * padded, padded, 1))
        assert not storage[:, :, T:].any()
