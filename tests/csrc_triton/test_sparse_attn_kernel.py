"""Triton sparse_attn / sparse_attn_cached against sparse_attn_ref (kernel link of the test chain).

Tolerances: kernel_cases.assert_close (fp32 1e-5; bf16 1e-2 + cosine > 0.9999). CPU cases are tiny
(interpreter); the V4-Flash cases (H = 64, d = 512, K = 128 + 512; FP8 main entries 512/64 of 584 B;
C128 decode's 8192 slots of a 1M max_model_len) are `gpu`-marked. The reference sparse_attn_cached is
also checked, without Triton, against the gathered composition built here.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from csrc_triton.sparse_attn import sparse_attn, sparse_attn_cached  # noqa: E402
from csrc_triton.sparse_attn_ref import sparse_attn as sparse_attn_ref  # noqa: E402
from csrc_triton.sparse_attn_ref import sparse_attn_cached as sparse_attn_cached_ref  # noqa: E402
from tests.csrc_triton.kernel_cases import (  # noqa: E402
    DEVICE, DTYPE_IDS, DTYPES, SKIP_REASON, assert_close, cached_keys, sparse_attn_args, sparse_attn_cached_args,
)
from vllm_dsv4.kv.layout import Fp8Entry  # noqa: E402

KERNEL = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)
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


@KERNEL
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T, H, K, d", SHAPES)
def test_sparse_attn_matches_ref(T, H, K, d, dtype):
    args = sparse_attn_args(T, H, K, d, dtype)
    out = sparse_attn(*args)
    assert_close(out, sparse_attn_ref(*args), dtype)
    if T > 1:  # row 0 has no valid key: exactly 0 whatever its slots hold
        assert torch.equal(out[0], torch.zeros_like(out[0]))


@KERNEL
def test_sparse_attn_strided_inputs():
    """Non-contiguous q / kv views: head-major q, kv sliced out of a wider buffer."""
    T, H, K, d = 3, 5, 9, 12
    q = sparse_attn_args(H, T, 0, d)[0].transpose(0, 1)  # [T, H, d] with strides (d, T*d, 1)
    _, kv, valid, sink, scale = sparse_attn_args(T, H, K, d + 4, seed=1)
    kv = kv[..., 2 : 2 + d]  # [T, K, d] non-contiguous
    assert_close(sparse_attn(q, kv, valid, sink, scale), sparse_attn_ref(q, kv, valid, sink, scale), torch.float32)


@KERNEL
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


@KERNEL
def test_sparse_attn_large_logits():
    """Logits in the thousands: the online max keeps exp() finite."""
    T, H, K, d = 2, 2, 70, 4
    q, kv, valid, sink, _ = sparse_attn_args(T + 1, H, K, d, p_valid=1.0)
    q, kv, valid = 30 * q[1:], 30 * kv[1:], valid[1:]
    out = sparse_attn(q, kv, valid, sink, 1.0)
    ref = sparse_attn_ref(q, kv, valid, sink, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)


# (T, H, d, rope, W, K, E, entries, visible): one row, T = 0, window-only (K None), W across key
# blocks with swa's E = 64 (windows that start past the first key blocks: -1 before position 0), a
# C128-like slot list (E = 2, arange(K) past a few visible entries: most key blocks empty), two head
# blocks, d = 256 (fp32 takes 16 x 16 tiles there), V4 dims on 4 rows (C128 decode: K = 8192 =
# max_model_len 1M / 128); a DSpark block step at V4-Flash dims (128 context + 5 block slots);
# V4-Flash C4 and C128 decode, window-only, V4-Pro heads. E = (window, main)
# entries per block, entries = (window, main) entries per request.
CACHED = [
    (5, 3, 64, 16, 6, 9, (4, 4), (24, 24), None),
    (1, 1, 64, 16, 1, 1, (4, 4), (8, 8), None),
    (0, 3, 64, 16, 4, 4, (4, 4), (8, 8), None),
    (5, 3, 64, 16, 6, None, (4, 4), (24, 24), None),
    (4, 17, 128, 32, 140, 5, (64, 4), (100, 24), None),
    (4, 5, 64, 16, 8, 150, (4, 2), (24, 160), 10),
    (3, 65, 64, 16, 5, 7, (4, 4), (24, 24), None),
    (3, 4, 256, 64, 20, 20, (4, 4), (24, 24), None),
    (4, 64, 512, 64, 128, 8192, (64, 2), (1024, 8192), 300),
    (5, 64, 512, 64, 133, None, (64, 64), (1024, 1024), None),
    pytest.param(32, 64, 512, 64, 128, 512, (64, 64), (4096, 4096), None, marks=GPU),
    pytest.param(32, 64, 512, 64, 128, 8192, (64, 2), (4096, 8192), 300, marks=GPU),
    pytest.param(32, 64, 512, 64, 128, None, (64, 64), (4096, 4096), None, marks=GPU),
    pytest.param(8, 128, 512, 64, 128, 512, (64, 64), (1024, 1024), None, marks=GPU),
]
KINDS = ["raw", "fp8"]


def _cached_args(T, H, d, rope, W, K, E, entries, visible, kind, dtype, **kw):
    fp8 = Fp8Entry(d, rope) if kind == "fp8" else None
    return sparse_attn_cached_args(T, H, d, W, K, fp8, dtype, E=E, entries=entries, visible=visible, **kw)


def _empty_rows(req, window_entries, main_entries):
    """[T] bool: padding rows and rows with no valid slot."""
    any_slot = (window_entries >= 0).any(1)
    if main_entries is not None:
        any_slot |= (main_entries >= 0).any(1)
    return (req < 0) | ~any_slot


@KERNEL
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T, H, d, rope, W, K, E, entries, visible", CACHED)
def test_sparse_attn_cached_matches_ref(T, H, d, rope, W, K, E, entries, visible, kind, dtype):
    args = _cached_args(T, H, d, rope, W, K, E, entries, visible, kind, dtype)
    window = args[4]
    assert window.view.stride(0) > window.view.shape[1] * window.view.shape[2]  # padded pages
    assert window.block_table.stride(1) != 1  # column-major, shuffled
    out = sparse_attn_cached(*args)
    assert_close(out, sparse_attn_cached_ref(*args), dtype)
    empty = _empty_rows(args[3], args[5], args[7])
    assert T <= 2 or empty[:2].all()  # row 0 padding (its entries >= 0), row 1 all -1
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))  # exactly 0, nothing read


@KERNEL
@pytest.mark.parametrize("kind", KINDS)
def test_sparse_attn_cached_strided_inputs(kind):
    """Non-contiguous q (head-major) and entry lists (column slices of wider buffers, int64 / int32)."""
    T, H, d, W, K = 4, 3, 64, 5, 6
    q, sink, scale, req, window, we, main, me = _cached_args(T, H, d, 16, W, K, (4, 4), (24, 24), None, kind,
                                                             torch.float32)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, d] with strides (d, T*d, 1)
    we = torch.cat([we, we], 1)[:, W // 2 : W // 2 + W]
    me = torch.cat([me, me], 1)[:, 1 : 1 + K]
    args = (q, sink, scale, req, window, we, main, me)
    assert_close(sparse_attn_cached(*args), sparse_attn_cached_ref(*args), torch.float32)


@KERNEL
@pytest.mark.parametrize("kind", KINDS)
def test_sparse_attn_cached_writes_into_out(kind):
    """``out=``: a caller's rows (here strided: the first half of every head row of a wider buffer)
    get, in place, what the call returns otherwise; nothing around them is touched. Both the kernel
    and the reference."""
    args = _cached_args(5, 3, 64, 16, 5, 6, (4, 4), (24, 24), None, kind, torch.float32)
    want = sparse_attn_cached_ref(*args)
    for attend in (sparse_attn_cached, sparse_attn_cached_ref):
        buffer = torch.full((7, 3, 128), float("nan"), device=want.device)
        out = buffer[1:6, :, :64]
        assert attend(*args, out=out).data_ptr() == out.data_ptr()
        assert_close(out, want, torch.float32)
        assert buffer[0].isnan().all() and buffer[6].isnan().all() and buffer[..., 64:].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("K", [7, None], ids=["window+main", "window"])
def test_sparse_attn_cached_ref_is_gathered_composition(K, kind, dtype):
    """The reference equals sparse_attn over keys gathered here (whole pool decoded, then indexed
    through the block tables) with valid = entry >= 0 and req >= 0; bit for bit."""
    args = _cached_args(6, 3, 64, 16, 5, K, (4, 4), (24, 24), None, kind, dtype, device="cpu")
    q, sink, scale, req, window, we, main, me = args
    live = req[:, None] >= 0
    keys, valid = [cached_keys(window, req, we, q.dtype)], [(we >= 0) & live]
    if main is not None:
        keys.append(cached_keys(main, req, me, q.dtype))
        valid.append((me >= 0) & live)
    expected = sparse_attn_ref(q, torch.cat(keys, 1), torch.cat(valid, 1), sink, scale)
    out = sparse_attn_cached_ref(*args)
    assert torch.equal(out, expected)
    empty = _empty_rows(req, we, me)
    assert empty[:2].all() and not empty.all()
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
