"""Edge cases of the csrc_triton references against naive per-token loops written from the spec.

The loops below are deliberately simple (one token / head / entry at a time, float64 where it
helps) and are transcribed from docs/MODEL.md, not from the references. The batched
references must agree with them on the corners the oracle test (tests/oracle) does not reach:
length 0 and 1, top-k larger than what is visible, nothing visible, all-invalid rows, garbage in
invalid slots, chunk boundaries, low-precision inputs. Tolerance: 1e-5 absolute (fp32 vs float64).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from csrc_triton import indexer_ref, sparse_attn_ref
from csrc_triton.compressor_ref import compress_windows, state_rows
from csrc_triton.indexer_ref import indexer_topk
from csrc_triton.mhc_ref import hc_head, mhc_post, mhc_pre
from csrc_triton.formats import decode_mxfp4
from csrc_triton.moe_mxfp4_ref import moe_experts_mxfp4
from csrc_triton.norm_ref import rms_norm
from csrc_triton.rope_ref import apply_rope_tail, rope_inv_freq
from csrc_triton.routing_ref import moe_experts, moe_experts_every_expert, route, swiglu_clamped
from csrc_triton.sparse_attn_ref import sparse_attn

ATOL = 1e-5


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _close(ours, ref, atol=ATOL):
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    torch.testing.assert_close(ours.double(), ref.double(), atol=atol, rtol=0)


# --------------------------------------------------------------------------------------- §3.1
@pytest.mark.parametrize("shape", [(0, 8), (1, 1), (3, 5, 8)])
def test_rms_norm_naive(shape):
    x = torch.randn(shape)
    w = torch.randn(shape[-1])
    ref = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    _close(rms_norm(x, None, 1e-6), ref)
    _close(rms_norm(x, w, 1e-6), ref * w.double())


def test_rms_norm_keeps_dtype():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    y = rms_norm(x, torch.ones(16), 1e-6)
    assert y.dtype == torch.bfloat16
    _close(y, rms_norm(x.float(), None, 1e-6), atol=2e-2)


# --------------------------------------------------------------------------------------- §3.2
def test_rope_inv_freq_plain():
    f = rope_inv_freq(8, 10000.0)
    _close(f, torch.tensor([10000.0 ** (-2 * i / 8) for i in range(4)], dtype=torch.float64))


def _rope_naive(x, positions, inv_freq, inverse=False):
    """Complex multiply of each interleaved pair of the tail by e^{+-i p f} (the reference's form)."""
    out = x.double().clone()
    r = 2 * len(inv_freq)
    d = x.shape[-1]
    for t in range(x.shape[0]):
        for i in range(r // 2):
            ang = positions[t].item() * inv_freq[i].item() * (-1 if inverse else 1)
            z = torch.complex(x[t, ..., d - r + 2 * i].double(), x[t, ..., d - r + 2 * i + 1].double())
            z = z * complex(math.cos(ang), math.sin(ang))
            out[t, ..., d - r + 2 * i], out[t, ..., d - r + 2 * i + 1] = z.real, z.imag
    return out


@pytest.mark.parametrize("T", [0, 1, 5])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope_tail_naive(T, inverse):
    inv = rope_inv_freq(8, 160000.0, 16, 256)
    x = torch.randn(T, 3, 20)
    pos = torch.randint(0, 5000, (T,))
    _close(apply_rope_tail(x, pos, inv, inverse=inverse), _rope_naive(x, pos, inv, inverse))


def test_apply_rope_tail_position_zero_and_dtype():
    inv = rope_inv_freq(8, 10000.0)
    x = torch.randn(4, 2, 16, dtype=torch.bfloat16)
    y = apply_rope_tail(x, torch.zeros(4, dtype=torch.int64), inv)
    assert y.dtype == torch.bfloat16 and torch.equal(y, x)
    assert y.data_ptr() != x.data_ptr()


# ----------------------------------------------------------------------------------------- §4
def _mhc_pre_naive(x, fn, base, scale, rms_eps, hc_eps, iters):
    T, n, D = x.shape
    ys, posts, combs = [], [], []
    for t in range(T):
        v = x[t].reshape(-1).double()
        mu = (fn.double() @ v) / math.sqrt(v.pow(2).mean().item() + rms_eps)  # rho * (phi v)
        pre = torch.sigmoid(scale[0] * mu[:n] + base[:n]) + hc_eps
        post = 2 * torch.sigmoid(scale[1] * mu[n : 2 * n] + base[n : 2 * n])
        M = (scale[2] * mu[2 * n :] + base[2 * n :]).view(n, n)
        P = torch.softmax(M, dim=1) + hc_eps
        P = P / (P.sum(0, keepdim=True) + hc_eps)
        for _ in range(iters - 1):
            P = P / (P.sum(1, keepdim=True) + hc_eps)
            P = P / (P.sum(0, keepdim=True) + hc_eps)
        ys.append(sum(pre[i] * x[t, i].double() for i in range(n)))
        posts.append(post)
        combs.append(P)
    if T == 0:
        return torch.zeros(0, D), torch.zeros(0, n), torch.zeros(0, n, n)
    return torch.stack(ys), torch.stack(posts), torch.stack(combs)


@pytest.mark.parametrize("T", [0, 1, 3])
def test_mhc_naive(T):
    n, D = 4, 8
    x = torch.randn(T, n, D)
    fn = torch.randn((2 + n) * n, n * D) / math.sqrt(n * D)
    base, scale = torch.randn((2 + n) * n), 0.5 + torch.rand(3)
    y, post, comb = mhc_pre(x, fn, base, scale, 1e-6, 1e-6, 20)
    y_n, post_n, comb_n = _mhc_pre_naive(x, fn.double(), base.double(), scale.double(), 1e-6, 1e-6, 20)
    _close(y, y_n)
    _close(post, post_n)
    _close(comb, comb_n)
    assert post.dtype == comb.dtype == torch.float32
    w = torch.rand(D) + 0.5  # the sub-layer's input norm, fused
    normed = y_n * w / (y_n.square().mean(-1, keepdim=True) + 1e-6).sqrt()
    _close(mhc_pre(x, fn, base, scale, 1e-6, 1e-6, 20, w, 1e-6)[0], normed)

    o = torch.randn(T, D)
    ref = torch.zeros(T, n, D, dtype=torch.float64)
    for t in range(T):
        for k in range(n):
            ref[t, k] = post[t, k].double() * o[t].double() + sum(
                comb[t, j, k].double() * x[t, j].double() for j in range(n)
            )
    _close(mhc_post(o, x, post, comb), ref)

    hfn, hbase, hscale = torch.randn(n, n * D) / math.sqrt(n * D), torch.randn(n), torch.rand(1) + 0.5
    ref_h = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        v = x[t].reshape(-1).double()
        mu = (hfn.double() @ v) / math.sqrt(v.pow(2).mean().item() + 1e-6)
        pre = torch.sigmoid(hscale.double() * mu + hbase.double()) + 1e-6
        ref_h[t] = sum(pre[i] * x[t, i].double() for i in range(n))
    _close(hc_head(x, hfn, hbase, hscale, 1e-6, 1e-6), ref_h)


def test_mhc_post_keeps_residual_dtype():
    x = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    out = mhc_post(torch.randn(2, 8, dtype=torch.bfloat16), x, torch.rand(2, 4), torch.rand(2, 4, 4))
    assert out.dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------- §6
@pytest.mark.parametrize("T", [0, 1, 6])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_route_naive(T, renormalize, with_bias):
    E, k, rsf = 8, 3, 2.5
    logits = 3 * torch.randn(T, E)
    bias = torch.randn(E) if with_bias else None
    w, ids = route(logits, k, rsf, renormalize, bias=bias)
    assert w.shape == ids.shape == (T, k) and ids.dtype == torch.int64 and w.dtype == torch.float32
    for t in range(T):
        s = [math.sqrt(math.log1p(math.exp(v))) for v in logits[t].tolist()]
        sel_key = [s[e] + (bias[e].item() if with_bias else 0.0) for e in range(E)]
        sel = sorted(range(E), key=lambda e: -sel_key[e])[:k]
        total = sum(s[e] for e in sel) if renormalize else 1.0
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        assert sorted(got) == sorted(sel)
        for e in sel:
            assert abs(got[e] - s[e] / total * rsf) < ATOL


def test_route_hash_keeps_table_order():
    logits = torch.randn(5, 8)
    hash_ids = torch.tensor([[7, 0], [3, 3], [1, 2], [0, 7], [5, 4]], dtype=torch.int32)
    w, ids = route(logits, 2, 1.5, True, bias=torch.full((8,), 100.0), hash_ids=hash_ids)
    assert ids.dtype == torch.int64 and torch.equal(ids, hash_ids.long())  # bias ignored
    s = F.softplus(logits).sqrt().gather(1, ids)
    _close(w, s / s.sum(-1, keepdim=True) * 1.5)


def test_swiglu_clamped_naive():
    L = 10.0
    gu = torch.tensor([[-30.0, 3.0, 20.0, -20.0], [30.0, -5.0, 20.0, 0.5]])  # I = 2
    ref = torch.zeros(2, 2, dtype=torch.float64)
    for t in range(2):
        for i in range(2):
            g, u = min(gu[t, i].item(), L), max(min(gu[t, 2 + i].item(), L), -L)
            ref[t, i] = g / (1 + math.exp(-g)) * u
    _close(swiglu_clamped(gu, L), ref)
    assert swiglu_clamped(gu.bfloat16(), L).dtype == torch.bfloat16


# the reference, and its formulation without host reads (what CUDA graphs capture for unquantised experts)
MOE_EXPERTS = pytest.mark.parametrize("moe_experts", [moe_experts, moe_experts_every_expert],
                                      ids=["by_expert", "every_expert"])


@MOE_EXPERTS
@pytest.mark.parametrize("T", [0, 1, 7])
def test_moe_experts_naive(T, moe_experts):
    E, k, D, I, L = 6, 2, 8, 4, 1.0
    x = torch.randn(T, D)
    ids = torch.stack([torch.randperm(E - 2)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
    weights = torch.rand(T, k)
    w13, w2 = torch.randn(E, 2 * I, D), torch.randn(E, D, I)
    ref = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = ids[t, j].item()
            h = w13[e].double() @ x[t].double()
            g, u = h[:I].clamp(max=L), h[I:].clamp(-L, L)
            ref[t] += weights[t, j].double() * (w2[e].double() @ (F.silu(g) * u))
    out = moe_experts(x, weights, ids, w13, w2, L)
    assert out.dtype == x.dtype
    _close(out, ref)


@MOE_EXPERTS
def test_moe_experts_skips_the_not_on_this_rank_id(moe_experts):
    """Id E (one past the last local expert) contributes nothing, whatever its weight."""
    E, k, D, I, L = 4, 2, 8, 4, 1.0
    x, weights = torch.randn(5, D), torch.rand(5, k) + 1
    ids = torch.tensor([[0, 4], [4, 4], [1, 2], [4, 3], [2, 0]])
    w13, w2 = torch.randn(E, 2 * I, D), torch.randn(E, D, I)
    zeroed = torch.where(ids == E, torch.zeros_like(weights), weights)
    _close(moe_experts(x, weights, ids, w13, w2, L), moe_experts(x, zeroed, ids.clamp(max=E - 1), w13, w2, L))
    assert moe_experts(x, weights, ids, w13, w2, L)[1].abs().max() == 0


def test_decode_mxfp4_equals_the_oracle_decode():
    """The decode (also the loader's, loader/dequant.py) equals the oracle's float64 bit arithmetic
    exactly, signed zeros included: every byte of codes, every scale byte (255 = NaN), stacked
    experts, int8 codes and e8m0 scales as stored, and float32 scale values (V4-Flash-Base)."""
    from tests.oracle.hf_oracle import oracle_dequant_mxfp4

    packed = torch.randint(0, 256, (3, 256, 64), dtype=torch.uint8)  # [E, out, in/2]
    packed[0] = torch.arange(256, dtype=torch.uint8)[:, None]  # every byte
    scale = torch.randint(0, 256, (3, 256, 4), dtype=torch.uint8)  # [E, out, in/32]
    scale[1] = torch.arange(256, dtype=torch.uint8)[:, None]  # every exponent
    got = decode_mxfp4(packed.view(torch.int8), scale.view(torch.float8_e8m0fnu))  # [E, out, in]
    want = torch.stack([oracle_dequant_mxfp4(packed[e], scale[e]) for e in range(3)])
    nan = torch.isnan(want)
    assert got.dtype == torch.float32 and torch.equal(torch.isnan(got), nan) and nan.any()
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    values = torch.ldexp(torch.ones(3, 256, 4), scale.int().clamp(max=254) - 127)  # as V4-Flash-Base stores them
    want = torch.stack([oracle_dequant_mxfp4(packed[e], values[e]) for e in range(3)])
    assert torch.equal(decode_mxfp4(packed, values).view(torch.int32), want.view(torch.int32))


def test_moe_experts_mxfp4_ref_is_moe_experts_on_dequantised_weights():
    """Decoding only the hit experts changes nothing: same result as moe_experts on all of them,
    with skipped ids (E) and an id nobody hit."""
    from tests.conftest import load_quantize
    from vllm_dsv4.loader.dequant import dequant_mxfp4

    quant_mxfp4 = load_quantize().quant_mxfp4

    E, k, D, I, L = 5, 3, 64, 32, 2.0
    w13 = [quant_mxfp4(torch.randn(2 * I, D)) for _ in range(E)]
    w2 = [quant_mxfp4(torch.randn(D, I)) for _ in range(E)]
    x, weights = torch.randn(6, D), torch.rand(6, k)
    ids = torch.tensor([[0, 5, 2], [5, 5, 5], [4, 0, 0], [2, 5, 4], [1, 2, 0], [4, 4, 1]])  # expert 3 unused
    stack = lambda ws, i: torch.stack([w[i].view(torch.uint8) for w in ws])  # noqa: E731
    out = moe_experts_mxfp4(x, weights, ids, stack(w13, 0), stack(w13, 1), stack(w2, 0), stack(w2, 1), L)
    dense13 = torch.stack([dequant_mxfp4(*w) for w in w13])
    dense2 = torch.stack([dequant_mxfp4(*w) for w in w2])
    _close(out, moe_experts(x, weights, ids, dense13, dense2, L))
    assert out[1].abs().max() == 0

# ----------------------------------------------------------------------------------------- §5.4
def test_state_rows_naive():
    T, cd, m = 9, 6, 4
    kv, gate, ape = torch.randn(T, cd), torch.randn(T, cd), torch.randn(m, cd)
    pos = torch.arange(100, 100 + T)
    ref = torch.stack([torch.cat([kv[t], gate[t] + ape[pos[t].item() % m]]) for t in range(T)])
    out = state_rows(kv.bfloat16(), gate.bfloat16(), ape, pos)
    assert out.dtype == torch.float32
    _close(state_rows(kv, gate, ape, pos), ref)


def _pool_naive(rows, valid, overlap, d):
    N, S, _ = rows.shape
    c, m = (2, S // 2) if overlap else (1, S)
    out = torch.zeros(N, d, dtype=torch.float64)
    for w in range(N):
        for e in range(d):
            vals, scores = [], []
            for s in range(S):
                if not valid[w, s]:
                    continue
                half = 0 if (overlap and s < m) else (1 if overlap else 0)
                vals.append(rows[w, s, half * d + e].item())
                scores.append(rows[w, s, c * d + half * d + e].item())
            if scores:
                mx = max(scores)
                ex = [math.exp(z - mx) for z in scores]
                out[w, e] = sum(a * b for a, b in zip(ex, vals)) / sum(ex)
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["hca", "csa"])
@pytest.mark.parametrize("N", [0, 1, 3])
def test_compress_windows_naive(overlap, N):
    d, m = 5, 4
    c = 2 if overlap else 1
    S = 2 * m if overlap else m
    rows = 2 * torch.randn(N, S, 2 * c * d)
    valid = torch.ones(N, S, dtype=torch.bool)
    if N:
        valid[0, : (m if overlap else 1)] = False  # CSA entry 0: no previous window
        valid[-1, -1] = False
        rows[~valid] = float("nan")  # what an unfilled cache slot may hold
        rows[0, 0] = float("inf")
    ref = _pool_naive(rows, valid, overlap, d)
    out = compress_windows(rows, valid, overlap, d)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    _close(out, ref)


@pytest.mark.parametrize("overlap", [False, True], ids=["hca", "csa"])
def test_compress_windows_all_invalid_is_zero(overlap):
    S = 8 if overlap else 4
    rows = torch.full((2, S, 2 * (2 if overlap else 1) * 3), float("nan"))
    valid = torch.zeros(2, S, dtype=torch.bool)
    assert torch.equal(compress_windows(rows, valid, overlap, 3), torch.zeros(2, 3))


# ----------------------------------------------------------------------------------------- §5.5
def _indexer_naive(q, weights, keys, num_visible, topk):
    Tq = q.shape[0]
    out = []
    for t in range(Tq):
        nv = min(num_visible[t].item(), keys.shape[0])
        scores = []
        for w in range(nv):
            s = sum(weights[t, h].item() * max(0.0, (q[t, h].double() @ keys[w].double()).item())
                    for h in range(q.shape[1]))
            scores.append((s, w))
        scores.sort(key=lambda sw: -sw[0])
        out.append(sorted(w for _, w in scores[:topk]))
    return out


def _index_sets(sel):
    return [sorted(i for i in row.tolist() if i >= 0) for row in sel]


@pytest.mark.parametrize(
    "num_visible, N",
    [([0], 0), ([0], 5), ([1], 5), ([0, 1, 2, 3, 4, 5], 5), ([5, 9, 12, 12], 12), ([12] * 3, 12)],
    ids=["no-keys", "nv0", "nv1", "ramp-below-topk", "mixed", "all-above-topk"],
)
def test_indexer_topk_naive(num_visible, N):
    H, di, topk = 16, 8, 4
    Tq = len(num_visible)
    q, keys = torch.randn(Tq, H, di), torch.randn(N, di)
    weights = torch.randn(Tq, H)
    nv = torch.tensor(num_visible, dtype=torch.int64)
    sel = indexer_topk(q, weights, keys, nv, topk)
    assert sel.shape == (Tq, topk) and sel.dtype == torch.int64
    assert _index_sets(sel) == _indexer_naive(q, weights, keys, nv, topk)
    n_valid = (sel >= 0).sum(-1)
    assert n_valid.tolist() == [min(topk, v) for v in num_visible]  # -1 exactly in the spare slots
    assert ((sel == -1) | (sel >= 0)).all()


def test_indexer_topk_empty_and_chunked(monkeypatch):
    assert indexer_topk(torch.randn(0, 4, 8), torch.randn(0, 4), torch.randn(3, 8),
                        torch.zeros(0, dtype=torch.int64), 2).shape == (0, 2)
    Tq, H, di, N = 7, 16, 8, 10
    q, keys, weights = torch.randn(Tq, H, di), torch.randn(N, di), torch.randn(Tq, H)
    nv = torch.tensor([0, 1, 3, 5, 8, 10, 10])
    whole = indexer_topk(q, weights, keys, nv, 4)
    monkeypatch.setattr(indexer_ref, "_CHUNK_ELEMS", 2 * H * N + 1)  # chunks of 2 queries, ragged end
    assert _index_sets(indexer_topk(q, weights, keys, nv, 4)) == _index_sets(whole)


# ----------------------------------------------------------------------------------------- §5.3
def _attn_naive(q, kv, valid, sink, scale):
    T, H, d = q.shape
    out = torch.zeros(T, H, d, dtype=torch.float64)
    for t in range(T):
        idx = [j for j in range(kv.shape[1]) if valid[t, j]]
        for h in range(H):
            logits = [scale * (q[t, h].double() @ kv[t, j].double()).item() for j in idx]
            M = max(logits + [sink[h].item()])
            ex = [math.exp(v - M) for v in logits]
            den = sum(ex) + math.exp(sink[h].item() - M)
            for e, j in zip(ex, idx):
                out[t, h] += e / den * kv[t, j].double()
    return out


@pytest.mark.parametrize("T, K", [(0, 4), (1, 1), (1, 6), (5, 7), (3, 0)])
def test_sparse_attn_naive(T, K):
    H, d = 3, 8
    q, kv = torch.randn(T, H, d), torch.randn(T, K, d)
    valid = torch.rand(T, K) > 0.3
    if T > 1:
        valid[0] = False  # all-invalid row: only the sink -> output 0
    kv[~valid] = float("nan")  # invalid slots may hold anything
    sink = 2 * torch.randn(H)
    out = sparse_attn(q, kv, valid, sink, d**-0.5)
    assert out.shape == (T, H, d) and torch.isfinite(out).all()
    _close(out, _attn_naive(q, kv, valid, sink, d**-0.5))
    if T > 1:
        assert torch.equal(out[0], torch.zeros(H, d))


def test_sparse_attn_large_logits_and_sink():
    """Big logits must not overflow; a huge sink drives the output to 0, a -inf sink is no sink."""
    H, d, K = 2, 4, 5
    q, kv = 30 * torch.randn(2, H, d), 30 * torch.randn(2, K, d)
    valid = torch.ones(2, K, dtype=torch.bool)
    sink = torch.tensor([0.0, 1.0])
    _close(sparse_attn(q, kv, valid, sink, 1.0), _attn_naive(q, kv, valid, sink, 1.0), atol=1e-4)
    assert sparse_attn(q, kv, valid, torch.full((H,), 1e4), 1e-3).abs().max() < 1e-30
    no_sink = sparse_attn(q, kv, valid, torch.full((H,), float("-inf")), 0.1)
    p = torch.softmax(0.1 * torch.einsum("thd,tkd->thk", q, kv), -1)
    _close(no_sink, torch.einsum("thk,tkd->thd", p, kv), atol=1e-4)


def test_sparse_attn_chunked_and_dtype(monkeypatch):
    T, H, d, K = 9, 2, 8, 5
    q, kv = torch.randn(T, H, d, dtype=torch.bfloat16), torch.randn(T, K, d, dtype=torch.bfloat16)
    valid = torch.rand(T, K) > 0.2
    sink = torch.randn(H)
    whole = sparse_attn(q, kv, valid, sink, d**-0.5)
    assert whole.dtype == torch.bfloat16
    monkeypatch.setattr(sparse_attn_ref, "_CHUNK_ELEMS", 4 * K * (d + H) - 1)  # chunks of 3 tokens
    assert torch.equal(sparse_attn(q, kv, valid, sink, d**-0.5), whole)
    _close(whole.float(), _attn_naive(q.float(), kv.float(), valid, sink, d**-0.5), atol=2e-2)


def test_indexer_topk_per_query_keys_equal_one_call_per_query():
    g = torch.Generator().manual_seed(5)
    q, weights = torch.randn(6, 4, 8, generator=g), torch.randn(6, 4, generator=g)
    keys, nv = torch.randn(6, 11, 8, generator=g), torch.tensor([0, 1, 4, 11, 7, 9])
    batched = indexer_topk(q, weights, keys, nv, 5)
    for t in range(6):
        alone = indexer_topk(q[t : t + 1], weights[t : t + 1], keys[t], nv[t : t + 1], 5)
        assert _index_sets(batched[t : t + 1]) == _index_sets(alone)


def test_indexer_topk_paged_reads_each_requests_keys_once(monkeypatch):
    """The CPU path gathers a request's keys once for all its rows, [N, di], not once per row: a
    prefill chunk of T queries would hold [T, N, di] (gigabytes for one long prompt). Rows: a padding
    row, 20 queries of request 1, 3 of request 0."""
    from tests.csrc_triton.kernel_cases import indexer_paged_args
    from vllm_dsv4.kv.layout import Fp8Entry

    num_visible = [0] + [min(40, (p + 1) // 4) for p in range(0, 140, 7)] + [40, 33, 12]
    args = indexer_paged_args(num_visible, [-1] + [1] * 20 + [0] * 3, 2, 40, 16, 32, 6, 8, Fp8Entry(32, None),
                              device="cpu")
    read, reads = indexer_ref.read_entries, []
    monkeypatch.setattr(indexer_ref, "read_entries", lambda *a: reads.append(read(*a)) or reads[-1])
    picks = indexer_ref.indexer_topk_paged(*args)
    assert [tuple(r.shape) for r in reads] == [(40, 32), (40, 32)]
    assert (picks[0] == -1).all() and (picks[1:] >= 0).any()
