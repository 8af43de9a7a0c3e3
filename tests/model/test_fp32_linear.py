"""layers.fp32_linear (router and output logits): the reference's fp32 linear, on CUDA as one
half-precision GEMM with fp32 output.

bf16 x bf16 products are exact in fp32, so the CUDA GEMM differs from ``F.linear(x.float(),
W.float())`` by summation order alone: within ``K * 2^-24 * sum |x_i w_i|`` per output (fp32
accumulation in any order); and its relative RMS error stays near fp32's 1e-7, far below the ~1e-3
that a bf16 output or bf16 partial sums would leave.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_dsv4.model.layers import fp32_linear


@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 64)])
def test_fp32_linear_is_the_fp32_reference_on_cpu(shape):
    x = torch.randn(*shape).bfloat16()
    w = torch.randn(48, shape[-1]).bfloat16()
    assert torch.equal(fp32_linear(x, w), F.linear(x.float(), w.float()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the half-precision GEMM path is CUDA's")
@pytest.mark.parametrize("tokens, out_features, in_features", [(1, 256, 4096), (64, 256, 4096), (16, 129280, 4096)])
def test_fp32_linear_on_cuda_accumulates_in_fp32(tokens, out_features, in_features):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, in_features, generator=g).bfloat16().cuda()
    w = (torch.randn(out_features, in_features, generator=g) * 0.02).bfloat16().cuda()
    y = fp32_linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (tokens, out_features)
    exact = x.double() @ w.double().T
    bound = in_features * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    assert ((y.double() - exact).abs() <= bound).all()
    # fp32 accumulation leaves ~1e-7 relative RMS; a bf16 output or bf16 partial sums would leave ~1e-3
    assert (y.double() - exact).norm() <= 1e-5 * exact.norm()
