"""FlashMLA sparse attention (ops/flashmla.py) against our Triton kernel, its oracle (its
slot-to-cache-index mapping: tests/csrc_triton/test_cache_index_kernel.py), for decode steps (the FP8
decode kernel on the caches) and prefill steps (the prefill kernel on ``gather_slots``' bf16 buffer,
whose slot-to-buffer mapping is checked on the CPU against the reference's reads).

The GPU cases read FP8 caches in FlashMLA's layout as the model fills them (written by the
reference writer, formats.main_page_parts): V4-Flash C4 and C128 decode, window-only layers,
V4-Pro's 128 heads, a prefill-sized batch and a head count FlashMLA pads (16 -> 64). Tolerance:
kernel_cases.assert_close for bf16 (1e-2 and cosine > 0.9999): both kernels round the softmax
weights to bf16 before the value product and accumulate in fp32, in different orders.
"""

from __future__ import annotations

import pytest
import torch

from csrc_triton.paged import CacheSource
from tests.csrc_triton.kernel_cases import assert_close, sparse_attn_cached_args
from vllm_dsv4.kv.layout import Fp8Entry
from vllm_dsv4.ops import flashmla, vllm_kernels

V4 = Fp8Entry(512, 64)


def test_unreadable_caches_are_named():
    """Caches FlashMLA cannot read (the Triton kernel runs them, the reason logged): raw entries,
    other dims, pages off 16-byte alignment; V4 FP8 pages at aligned offsets are readable."""
    pool = torch.zeros(3, 64 * 584 + 48, dtype=torch.uint8)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    view_at = lambda offset: pool[:, offset : offset + 64 * 584].unflatten(1, (64, 584))  # noqa: E731
    assert flashmla._misfit(CacheSource(view_at(16), bt, 64, V4)) is None
    assert "aligned" in flashmla._misfit(CacheSource(view_at(3), bt, 64, V4))
    assert "raw" in flashmla._misfit(CacheSource(torch.zeros(3, 64, 512), bt, 64, None))
    small = Fp8Entry(64, 16)
    assert "head_dim 64" in flashmla._misfit(CacheSource(torch.zeros(3, 4, small.entry_bytes, dtype=torch.uint8),
                                                          bt, 4, small))


def _aligned(src: CacheSource) -> CacheSource:
    """The source's entries in a pool whose pages start 16 bytes into 16-byte-aligned rows (FlashMLA's
    alignment; still a padded page stride)."""
    num_blocks, E, C = src.view.shape
    row = -(-(E * C + 32) // 16) * 16
    pool = torch.full((num_blocks, row), 0xFF, dtype=torch.uint8, device=src.view.device)
    view = pool[:, 16 : 16 + E * C].unflatten(1, (E, C))
    view.copy_(src.view)
    return src._replace(view=view)


# (T, H, W, K, E, entries, visible): V4-Flash C4 decode, C128 decode (fixed width, 300 visible),
# window-only, V4-Pro heads, a prefill-sized batch, padded heads, a DSpark block step (7 requests x 5
# queries, each naming 128 context and 5 block slots: a width FlashMLA pads to 256).
CASES = [
    (32, 64, 128, 512, (64, 64), (4096, 4096), None),
    (32, 64, 128, 8192, (64, 2), (4096, 8192), 300),
    (32, 64, 128, None, (64, 64), (4096, 4096), None),
    (16, 128, 128, 512, (64, 64), (1024, 1024), None),
    (1024, 64, 128, 512, (64, 64), (4096, 4096), None),
    (32, 16, 128, 512, (64, 64), (1024, 1024), None),
    (35, 64, 133, None, (64, 64), (1024, 1024), None),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or vllm_kernels.flashmla_sparse() is None,
                    reason="FlashMLA sparse attention needs CUDA on Hopper / Blackwell with vLLM's build")
@pytest.mark.parametrize("kernel", ["sparse_attn_cached", "sparse_attn_prefill"], ids=["decode", "prefill"])
@pytest.mark.parametrize("T, H, W, K, E, entries, visible", CASES)
def test_flashmla_matches_the_triton_kernel(T, H, W, K, E, entries, visible, kernel):
    from csrc_triton.sparse_attn import sparse_attn_cached as triton_attn

    q, sink, scale, req, window, window_entries, main, main_entries = sparse_attn_cached_args(
        T, H, 512, W, K, V4, torch.bfloat16, E=E, entries=entries, visible=visible, device="cuda")
    window, main = _aligned(window), main and _aligned(main)
    args = (q, sink, scale, req, window, window_entries, main, main_entries)
    assert flashmla.why_not(q, window, main) is None
    out = getattr(flashmla, kernel)(*args)
    ref = triton_attn(*args)
    assert_close(out, ref, torch.bfloat16)
    assert (ref[:2] == 0).all() and (out[:2] == 0).all()  # row 0 padding, row 1 without a valid slot
    into = torch.full_like(q, float("nan"))  # out=: written in place (H < 64: through the padded heads)
    assert getattr(flashmla, kernel)(*args, out=into).data_ptr() == into.data_ptr()
    assert_close(into, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or vllm_kernels.flashmla_sparse() is None,
                    reason="FlashMLA sparse attention needs CUDA on Hopper / Blackwell with vLLM's build")
def test_layers_of_a_kind_share_one_plan():
    """Two C4 layers of a step: other queries, sinks and picks, the same slot-list lengths. Through one
    plan store the second call reuses the first call's scheduler plan and still matches the Triton
    kernel; the store holds that one plan."""
    from csrc_triton.sparse_attn import sparse_attn_cached as triton_attn

    plans = {}
    for seed in (0, 1):
        q, sink, scale, req, window, window_entries, main, main_entries = sparse_attn_cached_args(
            32, 64, 512, 128, 512, V4, torch.bfloat16, E=(64, 64), entries=(4096, 4096), device="cuda")
        g = torch.Generator(device="cuda").manual_seed(seed)
        q = torch.randn(q.shape, generator=g, device="cuda").to(q.dtype)
        # other picks, same valid prefix per row: permute each row's valid entries
        order = torch.argsort(torch.rand(main_entries.shape, generator=g, device="cuda") + (main_entries < 0) * 2, -1)
        main_entries = main_entries.gather(1, order)
        window, main = _aligned(window)._replace(plans=plans), _aligned(main)
        args = (q, sink, scale, req, window, window_entries, main, main_entries)
        assert_close(flashmla.sparse_attn_cached(*args), triton_attn(*args), torch.bfloat16)
    assert list(plans) == ["flashmla"] and plans["flashmla"].have_initialized


def span_rows(req, entries) -> int:
    """The rows the spans of one source's named entries take, request by request (brute force)."""
    valid = (entries >= 0) & (req[:, None] >= 0)
    named = [entries[(req == r)[:, None] & valid] for r in req[req >= 0].unique()]
    return sum(int(e.max() - e.min() + 1) for e in named if e.numel())


@pytest.mark.parametrize("fp8", [None, V4], ids=["raw", "fp8"])
@pytest.mark.parametrize("main_k", [None, 24], ids=["window-only", "compressed"])
@pytest.mark.parametrize("spare_rows", [None, 0, 7], ids=["counted", "bound-exact", "bound-above"])
def test_gathered_slots_name_the_entries_the_slots_name(fp8, main_k, spare_rows, cpu_ops):
    """Every valid slot's index points at the entry the reference reads for it, empty slots and padding
    rows at -1, and the buffer holds each request's span once: counted on the device and read, or in
    as many rows as the caller's bound (``CacheSource.span_rows_bound``) gives."""
    from csrc_triton.kv_cache_ref import read_entries

    q, sink, scale, req, window, window_entries, main, main_entries = sparse_attn_cached_args(
        12, 2, 64 if fp8 is None else 512, 6, main_k, fp8, torch.bfloat16, R=3, E=(4, 4), entries=(40, 40))
    sources = [(window, window_entries)] + ([(main, main_entries)] if main is not None else [])
    if spare_rows is not None:
        sources = [(src._replace(span_rows_bound=span_rows(req, e) + spare_rows), e) for src, e in sources]
    kv, indices = flashmla.gather_slots(req, sources, torch.bfloat16)
    assert indices.dtype == torch.int32 and indices.shape == (12, sum(e.shape[1] for _, e in sources))
    column = 0
    for src, entries in sources:
        idx = indices[:, column : column + entries.shape[1]].long()
        valid = (entries >= 0) & (req[:, None] >= 0)
        assert (idx[~valid] == -1).all() and (idx[valid] >= 0).all()
        want = read_entries(src.view, src.block_table, req.clamp(min=0)[:, None].expand_as(entries)[valid],
                            entries[valid], src.entries_per_block, src.fp8, torch.bfloat16)
        assert torch.equal(kv[idx[valid]], want)
        column += entries.shape[1]
    assert kv.shape[0] == sum(span_rows(req, e) + (spare_rows or 0) for _, e in sources)


def test_a_span_bound_below_the_spans_is_refused(cpu_ops):
    """A caller's bound too low would index past the buffer: the device-side check refuses it. On CPU
    tensors, where the check raises at once: on a GPU it is a device-side assert, which leaves the
    process's CUDA context unusable (every later test in it fails)."""
    args = sparse_attn_cached_args(12, 2, 512, 6, 24, V4, torch.bfloat16, R=3, E=(4, 4), entries=(40, 40),
                                   device="cpu")
    req, window, window_entries = args[3], args[4], args[5]
    low = window._replace(span_rows_bound=span_rows(req, window_entries) - 1)
    with pytest.raises(RuntimeError):
        flashmla.gather_slots(req, [(low, window_entries)], torch.bfloat16)


def test_gathered_spans_are_worked_out_once_per_plans(cpu_ops, monkeypatch):
    """Sources given with plans (the window, C128's entries): a second layer naming the same entries
    reuses the first one's spans, with no host read, and still decodes its own cache's entries."""
    from csrc_triton.kv_cache_ref import read_entries

    first = sparse_attn_cached_args(12, 2, 512, 6, 24, V4, torch.bfloat16, R=3, E=(4, 4), entries=(40, 40))
    req, window, window_entries, main, main_entries = first[3], first[4], first[5], first[6], first[7]
    other = sparse_attn_cached_args(12, 2, 512, 6, 24, V4, torch.bfloat16, R=3, E=(4, 4), entries=(40, 40), seed=1)
    plans = {}

    def layer(w, m):  # one layer's sources (its caches and their block tables), the step's entries
        return [(w._replace(plans=plans), window_entries), (m._replace(plans=plans), main_entries)]

    kv, indices = flashmla.gather_slots(req, layer(window, main), torch.bfloat16)
    assert set(plans) == {("gathered spans", 0), ("gathered spans", 1)}
    monkeypatch.setattr(flashmla, "_spans", lambda *args: pytest.fail("spans worked out again"))
    kv_other, indices_other = flashmla.gather_slots(req, layer(other[4], other[6]), torch.bfloat16)
    assert torch.equal(indices_other, indices) and not torch.equal(kv_other, kv)
    column = 0
    for (src, entries) in layer(other[4], other[6]):
        idx = indices[:, column : column + entries.shape[1]].long()
        valid = (entries >= 0) & (req[:, None] >= 0)
        want = read_entries(src.view, src.block_table, req.clamp(min=0)[:, None].expand_as(entries)[valid],
                            entries[valid], src.entries_per_block, src.fp8, torch.bfloat16)
        assert torch.equal(kv_other[idx[valid]].view(torch.int16), want.view(torch.int16))  # bits: NaN fillers too
        column += entries.shape[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="host synchronisation is a CUDA matter")
@pytest.mark.parametrize("bounded", [False, True], ids=["counted", "bounded"])
def test_gathering_slots_synchronises_once_per_unbounded_source(bounded):
    """gather_slots reads one number per source without a span bound on the host (its spans' total:
    the buffer's size), none for a bounded one, and makes no other synchronising call: host-built
    index tensors would each cost a pageable copy that waits for the stream (an 8k prefill made over a
    hundred such copies before; three per call here, ~24 calls, by count)."""
    import warnings

    args = sparse_attn_cached_args(64, 2, 512, 16, 24, V4, torch.bfloat16, R=3, E=(4, 4), entries=(40, 40),
                                   device="cuda")
    req, sources = args[3], [(args[4], args[5]), (args[6], args[7])]
    if bounded:
        sources = [(src._replace(span_rows_bound=span_rows(req, e)), e) for src, e in sources]
    flashmla.gather_slots(req, sources, torch.bfloat16)  # first calls (allocator, kernels) outside the count
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            flashmla.gather_slots(req, sources, torch.bfloat16)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]  # not the prototype notice
    assert len(syncs) == (0 if bounded else len(sources)), [str(w.message) for w in syncs]


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_prefill_span_bounds_cover_the_spans(ratio):
    """Attention._span_rows' host bounds against the spans of the entries a prefill step names: each
    query its window, and (the most a compressed source can name) every compressed entry it sees, over
    random requests, chunks and sequence lengths."""
    from types import SimpleNamespace

    from vllm_dsv4.model.attention import Attention

    g = torch.Generator().manual_seed(ratio)
    window = 16
    layer = SimpleNamespace(window=window, ratio=ratio)
    for _ in range(40):
        R = int(torch.randint(1, 6, (1,), generator=g))
        queries = torch.randint(1, 40, (R,), generator=g)
        lengths = queries + torch.randint(0, 300, (R,), generator=g)  # tokens already cached first
        starts = [0, *queries.cumsum(0).tolist()]
        req = torch.repeat_interleave(torch.arange(R), queries)
        positions = torch.cat([torch.arange(int(n - q), int(n)) for n, q in zip(lengths, queries)])
        md = SimpleNamespace(query_starts=starts, seq_len_bounds=lengths.tolist())
        chunk = int(torch.randint(1, starts[-1] + 1, (1,), generator=g))
        for a in range(0, starts[-1], chunk):
            rows = slice(a, a + chunk)
            window_rows, main_rows = Attention._span_rows(layer, md, rows)
            p = positions[rows]
            assert span_rows(req[rows], (p[:, None] + torch.arange(1 - window, 1)).clamp(min=-1)) <= window_rows
            if ratio:
                seen = torch.arange(int(lengths.max()) // ratio)
                assert span_rows(req[rows], torch.where(seen < (p[:, None] + 1) // ratio, seen, -1)) <= main_rows
            else:
                assert main_rows is None
