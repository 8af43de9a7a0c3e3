"""Triton sparse_attn / sparse_attn_paged against sparse_attn_ref (kernel link of the test chain).

Tolerances: kernel_cases.assert_close (fp32 1e-5; bf16 1e-2 + cosine > 0.9999). CPU cases are tiny
(interpreter); the V4-Flash cases (H = 64, d = 512, K = 128 + 512) are `gpu`-marked.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from csrc_triton.sparse_attn import sparse_attn, sparse_attn_paged  # noqa: E402
from csrc_triton.sparse_attn_ref import sparse_attn as sparse_attn_ref  # noqa: E402
from tests.csrc_triton.kernel_cases import (  # noqa: E402
    DEVICE, DTYPE_IDS, DTYPES, SKIP_REASON, assert_close, gather_paged, sparse_attn_args, sparse_attn_paged_args,
)

pytestmark = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)
GPU = pytest.mark.gpu

# (T, H, K, d): length 0 and 1, K = 0, odd H / d, H across a head block (64), K across key blocks
# (64), V4-Flash and V4-Pro (H = 128: two head blocks).
SHAPES = [
    (0, 3, 4, 8),
    (1, 1, 1, 8),
    (1, 3, 6, 8),
    (3, 2, 0, 8),
    (5, 3, 7, 20),
    (3, 17, 33, 16),
    (2, 3, 130, 24),
    (2, 65, 5, 8),
    pytest.param(37, 64, 640, 512, marks=GPU),
    pytest.param(5, 128, 129, 512, marks=GPU),
    pytest.param(300, 7, 200, 96, marks=GPU),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T, H, K, d", SHAPES)
def test_sparse_attn_matches_ref(T, H, K, d, dtype):
    args = sparse_attn_args(T, H, K, d, dtype)
    out = sparse_attn(*args)
    assert_close(out, sparse_attn_ref(*args), dtype)
    if T > 1:  # row 0 has no valid key: exactly 0 whatever its slots hold
        assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T, H, K, d", [(4, 3, 11, 16), pytest.param(16, 64, 640, 512, marks=GPU)])
def test_sparse_attn_paged_matches_ref(T, H, K, d, dtype):
    q, cache, block_ids, offsets, valid, sink, scale = sparse_attn_paged_args(T, H, K, d, dtype)
    assert not cache.is_contiguous()
    out = sparse_attn_paged(q, cache, block_ids, offsets, valid, sink, scale)
    ref = sparse_attn_ref(q, gather_paged(cache, block_ids, offsets), valid, sink, scale)
    assert_close(out, ref, dtype)


def test_sparse_attn_strided_inputs():
    """Non-contiguous q / kv views: head-major q, kv sliced out of a wider buffer."""
    T, H, K, d = 3, 5, 9, 12
    q = sparse_attn_args(H, T, 0, d)[0].transpose(0, 1)  # [T, H, d] with strides (d, T*d, 1)
    _, kv, valid, sink, scale = sparse_attn_args(T, H, K, d + 4, seed=1)
    kv = kv[..., 2 : 2 + d]  # [T, K, d] non-contiguous
    assert_close(sparse_attn(q, kv, valid, sink, scale), sparse_attn_ref(q, kv, valid, sink, scale), torch.float32)


def test_sparse_attn_extreme_sinks():
    """A huge sink drives the output to 0; a -inf sink is no sink (an all-invalid row then gives 0)."""
    T, H, K, d = 3, 2, 5, 8
    q, kv, valid, _, scale = sparse_attn_args(T, H, K, d, p_valid=1.0)
    valid[0] = False  # sparse_attn_args keeps row 0 all-invalid
    big = sparse_attn(q, kv, valid, torch.full((H,), 1e4, device=DEVICE), scale)
    assert big.abs().max() < 1e-30
    no_sink = sparse_attn(q, kv, valid, torch.full((H,), float("-inf"), device=DEVICE), scale)
    assert torch.equal(no_sink[0], torch.zeros_like(no_sink[0]))  # the reference gives NaN here
    p = torch.softmax(scale * torch.einsum("thd,tkd->thk", q[1:], kv[1:]), -1)
    assert_close(no_sink[1:], torch.einsum("thk,tkd->thd", p, kv[1:]), torch.float32)


def test_sparse_attn_large_logits():
    """Logits in the thousands: the online max keeps exp() finite."""
    T, H, K, d = 2, 2, 70, 4
    q, kv, valid, sink, _ = sparse_attn_args(T + 1, H, K, d, p_valid=1.0)
    q, kv, valid = 30 * q[1:], 30 * kv[1:], valid[1:]
    out = sparse_attn(q, kv, valid, sink, 1.0)
    ref = sparse_attn_ref(q, kv, valid, sink, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
