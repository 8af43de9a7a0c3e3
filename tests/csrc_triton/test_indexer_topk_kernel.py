"""Triton indexer scores + top-k against indexer_ref (kernel link of the test chain).

Scores: kernel_cases.assert_close against the formula (fp32 1e-5; bf16 inputs, fp32 math: 1e-5
relative to the score scale as well). Selection: ties make "the same indices as the reference" the
wrong check, so each row must be *a* valid top-k of the float64 scores (tolerance 1e-4 of the score
scale), with -1 exactly in the spare slots; the reference passes the same check.

The selection alone (radix select over the visible prefix) against ``torch.topk`` of that prefix: the
same multiset of values, distinct in-prefix indices, -1 exactly in the spare slots, and among the
entries equal to the k-th largest value the lowest-indexed ones.

Paged decode top-k (keys read through the block table, raw or FP8 entries): the kernel picks the same
entry set per row as ``indexer_ref.indexer_topk_paged`` (swaps only at float64 ties), and that
reference picks what the gather path does (each row alone against its request's visible keys).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from csrc_triton import kv_cache_ref  # noqa: E402
from csrc_triton.indexer_ref import indexer_topk as indexer_topk_ref  # noqa: E402
from csrc_triton.indexer_ref import indexer_topk_paged as indexer_topk_paged_ref  # noqa: E402
from csrc_triton.indexer_topk import indexer_scores, indexer_topk, indexer_topk_paged, select_topk  # noqa: E402
from tests.csrc_triton.kernel_cases import (  # noqa: E402
    DTYPE_IDS, DTYPES, SKIP_REASON, assert_same_topk, assert_valid_topk, indexer_args, indexer_paged_args,
    indexer_ref_scores,
)
from vllm_dsv4.kv.layout import Fp8Entry  # noqa: E402

pytestmark = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)
GPU = pytest.mark.gpu


@pytest.fixture(params=[False, True], ids=["query-tiles", "shared-tiles"])
def key_tiles(request, monkeypatch):
    """Run the score kernel with one query per key tile, or (as prefill-sized calls do) eight
    neighbouring queries sharing one where their keys are the same."""
    if request.param:
        from csrc_triton import indexer_topk as module

        monkeypatch.setattr(module, "PREFILL_QUERIES", 1)


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
def test_indexer_topk_matches_ref(num_visible, N, H, di, topk, dtype, key_tiles):
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
    """Score chunks of 16 queries (the fewest: slices stay 16-aligned) with a ragged end give the same
    selection as one chunk."""
    from csrc_triton import indexer_topk as module

    q, weights, keys, nv, topk = indexer_args([0, 1, 3, 5, 8, 10, 10, 7] * 5, 10, 16, 8, 4, seed=2)
    whole = indexer_topk(q, weights, keys, nv, topk)
    monkeypatch.setattr(module, "_CHUNK_ELEMS", 16 * 10 + 1)  # chunks of 16, 16 and 8 queries
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


# (FP8 entries, q dtype): raw keys in q's dtype, or FP8 entries (di + 4 bytes) under either q dtype.
PAGED_KINDS = {"raw_fp32": (False, torch.float32), "raw_bf16": (False, torch.bfloat16),
               "fp8_fp32": (True, torch.float32), "fp8_bf16": (True, torch.bfloat16)}

# (num_visible, req, R, N, H, di, topk, E): req -1 is a padding row (given num_visible N, which it
# must ignore); num_visible 0, < topk, == topk, > topk and == N; topk > N; kernel blocks (32 / 64 /
# 128 entries) and cache blocks (E) crossed; V4-Flash (H = 64, di = 128, top-512, E = 64).
PAGED_CASES = [
    pytest.param([0, 5, 8], [0, 1, -1], 2, 8, 16, 24, 4, 4, id="nv0-padding"),
    pytest.param([1, 3, 4, 9, 20, 20], [2, 0, 1, 2, 1, -1], 3, 20, 17, 24, 4, 4, id="ragged-odd"),
    pytest.param([6, 2], [0, 0], 1, 6, 16, 16, 8, 4, id="topk-above-N"),
    pytest.param([130, 64, 129, 3, 65], [1, 0, 1, 2, 0], 3, 130, 16, 32, 20, 16, id="block-boundaries"),
    pytest.param([200, 150, 17, 0, 200], [3, 1, 0, -1, 2], 4, 200, 64, 128, 16, 64, id="flash-dims"),
    # a padding row, then 20 causal queries of request 1 and 3 of request 0: key tiles shared within a
    # request, a request change inside an 8-query block, a block led by the padding row
    pytest.param([0] + _ramp(20, 40, 7) + [40, 33, 12], [-1] + [1] * 20 + [0] * 3, 2, 40, 16, 32, 6, 8,
                 id="prefill-chunks"),
    pytest.param([], [], 2, 8, 16, 16, 4, 4, id="no-queries"),
    pytest.param([0, 0], [0, -1], 1, 0, 16, 16, 4, 4, id="no-entries"),
    pytest.param([8192, 8000, 4096, 513, 512, 511, 100, 0, 8192, 3000, 1, 7000, 8192, 64, 65, 8192],
                 [0, 1, 2, 3, 4, 5, 0, 1, -1, 2, 3, 4, 5, 0, 1, -1], 6, 8192, 64, 128, 512, 64,
                 id="flash-decode", marks=GPU),
]


def _paged_scores(q, weights, view, bt, req, E, fp8, N) -> torch.Tensor:
    """``[B, N]`` float64 scores of each row against its request's decoded keys (padding rows: request 0)."""
    keys = kv_cache_ref.read_entries(view, bt, req.clamp(min=0)[:, None], torch.arange(N, device=q.device), E, fp8,
                                     torch.float32)  # [B, N, di]
    logits = torch.einsum("bhc,bnc->bhn", q.double(), keys.double()).clamp(min=0)
    return torch.einsum("bhn,bh->bn", logits, weights.double()).cpu()


@pytest.mark.parametrize("kind", PAGED_KINDS)
@pytest.mark.parametrize("num_visible, req, R, N, H, di, topk, E", PAGED_CASES)
def test_indexer_topk_paged_matches_ref(num_visible, req, R, N, H, di, topk, E, kind, key_tiles):
    use_fp8, dtype = PAGED_KINDS[kind]
    args = indexer_paged_args(num_visible, req, R, N, H, di, topk, E, Fp8Entry(di, None) if use_fp8 else None, dtype)
    q, weights, view, bt, req_t, nv, E, fp8, topk, N = args
    scores = _paged_scores(q, weights, view, bt, req_t, E, fp8, N)  # [B, N]
    tol = 1e-5 * max(1.0, scores.abs().max().item() if scores.numel() else 1.0)
    ref = indexer_topk_paged_ref(*args).cpu()
    assert_same_topk(indexer_topk_paged(*args).cpu(), ref, scores, tol)
    # the gather path: each row alone, against its request's visible keys only
    for b, (r, n) in enumerate(zip(req, num_visible)):
        if r < 0:
            assert (ref[b] == -1).all()
            continue
        keys = kv_cache_ref.read_entries(view, bt, req_t[b], torch.arange(n, device=q.device), E, fp8, dtype)
        alone = indexer_topk_ref(q[b : b + 1], weights[b : b + 1], keys, nv[b : b + 1], topk).cpu()
        assert_same_topk(alone, ref[b : b + 1], scores[b : b + 1], tol)


@pytest.mark.parametrize("kind", ["raw_fp32", "fp8_bf16"])
@pytest.mark.parametrize("case", ["ragged-odd", "prefill-chunks"])
def test_indexer_topk_paged_scales_raw_head_weights(case, kind):
    """The model hands the projection's bf16 head weights and their scale (index_head_dim^-0.5 *
    index_n_heads^-0.5), scaled in fp32 inside the op: the same picks as weights scaled beforehand."""
    use_fp8, dtype = PAGED_KINDS[kind]
    values = next(c.values for c in PAGED_CASES if c.id == case)
    q, weights, *rest = indexer_paged_args(*values, Fp8Entry(values[5], None) if use_fp8 else None, dtype)
    raw, scale = (weights * 90).bfloat16(), 90**-1.0
    scaled = raw.float() * scale
    ref = indexer_topk_paged_ref(q, scaled, *rest).cpu()
    assert torch.equal(indexer_topk_paged_ref(q, raw, *rest, weight_scale=scale).cpu(), ref)
    view, bt, req_t, nv, E, fp8, topk, N = rest
    scores = _paged_scores(q, scaled, view, bt, req_t, E, fp8, N)
    tol = 1e-5 * max(1.0, scores.abs().max().item())
    assert_same_topk(indexer_topk_paged(q, raw, *rest, weight_scale=scale).cpu(), ref, scores, tol)


@GPU
@pytest.mark.parametrize("kind", ["raw_bf16", "fp8_bf16"])
def test_indexer_topk_paged_cuda_graph(kind):
    """Captured in a CUDA graph (a host sync would fail the capture), then replayed with other requests,
    padding and visible counts written into the same buffers: the reference's picks for those."""
    use_fp8, dtype = PAGED_KINDS[kind]
    args = indexer_paged_args([300, 0, 77, 512], [0, 1, -1, 2], 3, 1024, 64, 128, 64, 64,
                              Fp8Entry(128, None) if use_fp8 else None, dtype)
    q, weights, view, bt, req, nv, E, fp8, topk, N = args
    indexer_topk_paged(*args)  # compiles the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = indexer_topk_paged(*args)
    req.copy_(torch.tensor([2, -1, 0, 1]))
    nv.copy_(torch.tensor([1024, 900, 5, 64]))
    graph.replay()
    scores = _paged_scores(q, weights, view, bt, req, E, fp8, N)
    assert_same_topk(out.cpu(), indexer_topk_paged_ref(*args).cpu(), scores, 1e-5 * max(1.0, scores.abs().max().item()))


# (num_visible per row, N, k, values): at most k visible (no pass), one pick, many ties across every
# radix digit, negative and mixed-sign scores, picks straddling the 1,024-entry chunks, V4-Flash decode
# rows at max_model_len 64k (16,384 wide) with short and long prefixes.
SELECT_CASES = [
    pytest.param([0, 3, 8], 8, 8, "normal", id="at-most-k"),
    pytest.param([1, 7, 50], 50, 1, "normal", id="k1"),
    pytest.param([5000, 4000, 2500, 9], 5000, 100, "ties", id="ties"),
    pytest.param([3000, 1500], 3000, 512, "negative", id="negative"),
    pytest.param([2049, 2048, 1025], 2049, 1024, "normal", id="chunk-edges"),
    pytest.param([16384, 700, 513, 512, 0], 16384, 512, "normal", id="flash-decode", marks=GPU),
]


@pytest.mark.parametrize("num_visible, N, k, values", SELECT_CASES)
def test_select_topk_matches_torch_topk(num_visible, N, k, values):
    g = torch.Generator().manual_seed(N + k)
    T = len(num_visible)
    scores = {"normal": lambda: torch.randn(T, N, generator=g),
              "ties": lambda: torch.randint(-3, 4, (T, N), generator=g).float(),
              "negative": lambda: -torch.rand(T, N, generator=g) - 1}[values]()
    nv = torch.tensor(num_visible)
    scores[torch.arange(N)[None, :] >= nv[:, None]] = float("-inf")  # as the score kernel writes them
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = select_topk(scores.to(device), nv.to(device), k).cpu()
    assert out.shape == (T, k) and out.dtype == torch.int64
    for t in range(T):
        n = int(nv[t])
        m = min(k, n)
        picks = out[t, :m]
        assert (out[t, m:] == -1).all() and len(set(picks.tolist())) == m, (t, out[t])
        assert ((picks >= 0) & (picks < n)).all(), (t, picks)
        if m == 0:
            continue
        assert torch.equal(scores[t, picks].sort().values, scores[t, :n].topk(m).values.sort().values), t
        kth = scores[t, picks].min()
        equal = (scores[t, :n] == kth).nonzero().flatten()
        taken = picks[scores[t, picks] == kth].sort().values
        assert torch.equal(taken, equal[: taken.numel()]), (t, taken, equal)
