"""Triton indexer scores + top-k against indexer_ref (kernel link of the test chain).

Scores: kernel_cases.assert_close against the formula (fp32 1e-5; bf16 inputs, fp32 math: 1e-5
relative to the score scale as well). Selection: ties make "the same indices as the reference" the
wrong check, so each row must be *a* valid top-k of the float64 scores (tolerance 1e-4 of the score
scale), with -1 exactly in the spare slots; the reference passes the same check.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from csrc_triton.indexer_ref import indexer_topk as indexer_topk_ref  # noqa: E402
from csrc_triton.indexer_topk import indexer_scores, indexer_topk  # noqa: E402
from tests.csrc_triton.kernel_cases import (  # noqa: E402
    DTYPE_IDS, DTYPES, SKIP_REASON, assert_valid_topk, indexer_args, indexer_ref_scores,
)

pytestmark = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)
GPU = pytest.mark.gpu


def _ramp(Tq: int, N: int, step: int = 1) -> list[int]:
    return [min(N, (p + 1) // 4) for p in range(0, Tq * step, step)]


# (num_visible, N, H, di, topk): nothing to see, top-k larger than what is visible, ragged prefixes,
# an entry-block boundary (128 / 64), odd H / di, V4-Flash (H = 64, di = 128, top-512).
CASES = [
    pytest.param([0], 0, 16, 8, 4, id="no-keys"),
    pytest.param([0], 5, 16, 8, 4, id="nv0"),
    pytest.param([1], 5, 16, 8, 4, id="nv1"),
    pytest.param([0, 1, 2, 3, 4, 5], 5, 16, 8, 4, id="ramp-below-topk"),
    pytest.param([5, 9, 12, 12], 12, 17, 24, 4, id="mixed-odd"),
    pytest.param([130, 64, 129, 3], 130, 16, 16, 20, id="block-boundaries"),
    pytest.param(_ramp(40, 2048, 211), 2048, 64, 128, 512, id="flash-prefill", marks=GPU),
    pytest.param([4096] * 8 + [100, 513, 512], 4096, 64, 128, 512, id="flash-decode", marks=GPU),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_visible, N, H, di, topk", CASES)
def test_indexer_topk_matches_ref(num_visible, N, H, di, topk, dtype):
    q, weights, keys, nv, topk = indexer_args(num_visible, N, H, di, topk, dtype)
    ref_scores = indexer_ref_scores(q, weights, keys).cpu()  # [Tq, N] float64
    scale = ref_scores.abs().max().item() if ref_scores.numel() else 1.0
    scores = indexer_scores(q, weights, keys, nv).cpu()
    visible = torch.arange(N)[None, :] < nv.cpu()[:, None]
    assert torch.equal(torch.isinf(scores), ~visible) and (scores[~visible] < 0).all()
    torch.testing.assert_close(scores[visible].double(), ref_scores[visible], atol=1e-5 * max(1.0, scale), rtol=1e-5)

    sel = indexer_topk(q, weights, keys, nv, topk).cpu()
    assert_valid_topk(sel, ref_scores, nv.cpu(), topk, tol=1e-4 * max(1.0, scale))
    assert_valid_topk(indexer_topk_ref(q, weights, keys, nv, topk).cpu(), ref_scores, nv.cpu(), topk,
                      tol=1e-4 * max(1.0, scale))


def test_indexer_topk_chunked(monkeypatch):
    """Score chunks of 2 queries with a ragged end give the same selection as one chunk."""
    from csrc_triton import indexer_topk as module

    q, weights, keys, nv, topk = indexer_args([0, 1, 3, 5, 8, 10, 10], 10, 16, 8, 4, seed=2)
    whole = indexer_topk(q, weights, keys, nv, topk)
    monkeypatch.setattr(module, "_CHUNK_ELEMS", 2 * 10 + 1)
    assert torch.equal(indexer_topk(q, weights, keys, nv, topk), whole)


def test_indexer_topk_empty_queries():
    q, weights, keys, nv, _ = indexer_args([], 3, 4, 8, 2)
    assert indexer_topk(q, weights, keys, nv, 2).shape == (0, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_visible, N, H, di, topk", [
    pytest.param([0, 1, 5, 12, 3], 12, 16, 24, 4, id="decodes"),
    pytest.param([130, 64, 129, 3], 130, 16, 16, 20, id="block-boundaries"),
    pytest.param([4096, 2000, 513, 1] * 16, 4096, 64, 128, 512, id="flash-decode-batch", marks=GPU),
])
def test_indexer_topk_per_query_keys(num_visible, N, H, di, topk, dtype):
    """Keys [Tq, N, di] (a batch of decodes of different requests): each row scored against its own."""
    q, weights, _, nv, topk = indexer_args(num_visible, N, H, di, topk, dtype)
    keys = torch.stack([indexer_args([1], N, 1, di, 1, dtype, seed=100 + t)[2] for t in range(len(num_visible))])
    ref_scores = torch.stack([indexer_ref_scores(q[t : t + 1], weights[t : t + 1], keys[t])[0]
                              for t in range(len(num_visible))]).cpu()
    scale = ref_scores.abs().max().item()
    scores = indexer_scores(q, weights, keys, nv).cpu()
    visible = torch.arange(N)[None, :] < nv.cpu()[:, None]
    torch.testing.assert_close(scores[visible].double(), ref_scores[visible], atol=1e-5 * max(1.0, scale), rtol=1e-5)
    assert torch.isinf(scores[~visible]).all()
    for impl in (indexer_topk, indexer_topk_ref):
        assert_valid_topk(impl(q, weights, keys, nv, topk).cpu(), ref_scores, nv.cpu(), topk,
                          tol=1e-4 * max(1.0, scale))
