"""The csrc_triton references against transformers 5.19's DeepSeek-V4 modules, in fp32.

Oracle -> reference link of the test chain: transformers checks our PyTorch references here, and
tests/csrc_triton checks each kernel against its reference. Modules are built from the
TINY config of docs/MODEL.md §13.1 with every parameter randomised, including the ones HF
initialises to zero (sinks, position_bias = ape, hc bases, e_score_correction_bias, tid2eid), and
16 indexer heads (§13.2). Tolerance: 1e-5 absolute in fp32 (observed errors are ~1e-6 or below;
they come only from different summation orders).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402

from csrc_triton.compressor_ref import compress_windows, state_rows  # noqa: E402
from csrc_triton.indexer_ref import indexer_topk  # noqa: E402
from csrc_triton.mhc_ref import hc_head, mhc_post, mhc_pre  # noqa: E402
from csrc_triton.norm_ref import rms_norm  # noqa: E402
from csrc_triton.rope_ref import apply_rope_tail, rope_inv_freq  # noqa: E402
from csrc_triton.routing_ref import moe_experts, route, swiglu_clamped  # noqa: E402
from csrc_triton.sparse_attn_ref import sparse_attn  # noqa: E402

ATOL = 1e-5
T_LONG = 300  # reaches 2 C128 entries and 75 C4 candidates vs top-8 (§13.1)
YARN = dict(factor=16, original_max_position_embeddings=256, beta_fast=32, beta_slow=1)

# docs/MODEL.md §13.1 "TINY", official config.json key style (HF folds the legacy keys).
TINY = dict(
    vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
    head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=16,
    compress_ratios=[0, 4, 128, 4, 0], compress_rope_theta=160000, rope_theta=10000,
    rope_scaling={"type": "yarn", **YARN}, max_position_embeddings=4096,
    index_n_heads=16, index_head_dim=32, index_topk=8,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
    num_hash_layers=2, scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
    routed_scaling_factor=1.5, swiglu_limit=10.0, hidden_act="silu",
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
    num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
)
SWA_LAYER, C4_LAYER, C128_LAYER = 0, 1, 2


@pytest.fixture(scope="module")
def cfg() -> DeepseekV4Config:
    c = DeepseekV4Config(**TINY)
    c._attn_implementation = "eager"  # what from_pretrained picks; the only one V4 supports
    assert c.layer_types == [
        "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
        "compressed_sparse_attention",
    ]
    assert c.mlp_layer_types == ["hash_moe", "hash_moe", "moe", "moe"]
    return c


@pytest.fixture(scope="module")
def inv_freq(cfg):
    """Our frequencies for the two HF rope types: 'main' (SWA layers) and 'compress' (C4/C128)."""
    r = cfg.qk_rope_head_dim
    return {
        "main": rope_inv_freq(r, cfg.rope_theta),
        "compress": rope_inv_freq(r, cfg.compress_rope_theta, YARN["factor"],
                                  YARN["original_max_position_embeddings"], YARN["beta_fast"], YARN["beta_slow"]),
    }


def _randomise(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Fill every parameter with non-trivial random values (HF leaves torch.empty / zeros)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "weight" and p.dim() == 1:  # RMSNorm weights
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif leaf in ("scale", "hc_scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif leaf in ("base", "hc_base", "sinks", "position_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # projections: unit-variance outputs
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return module.eval()


def _close(ours: torch.Tensor, ref: torch.Tensor, atol: float = ATOL) -> None:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert ours.dtype == ref.dtype, (ours.dtype, ref.dtype)
    torch.testing.assert_close(ours, ref, atol=atol, rtol=0)


def _linear(x, module):
    return F.linear(x, module.weight)


# --------------------------------------------------------------------------------------- §3.1
def test_rms_norm(cfg):
    x = 3 * torch.randn(5, 7, 64)
    norm = _randomise(hf.DeepseekV4RMSNorm(64, eps=cfg.rms_norm_eps), 1)
    _close(rms_norm(x, norm.weight, cfg.rms_norm_eps), norm(x))
    _close(rms_norm(x, None, cfg.rms_norm_eps), hf.DeepseekV4UnweightedRMSNorm(cfg.rms_norm_eps)(x))


# --------------------------------------------------------------------------------------- §3.2
def test_rope_inv_freq_bitwise(cfg, inv_freq):
    rot = hf.DeepseekV4RotaryEmbedding(cfg)
    assert torch.equal(inv_freq["main"], rot.main_inv_freq)
    assert torch.equal(inv_freq["compress"], rot.compress_inv_freq)
    assert rot.compress_attention_scaling == 1.0  # no YaRN mscale (§1.2)
    assert not torch.equal(inv_freq["compress"], rope_inv_freq(16, cfg.compress_rope_theta))  # YaRN active


def test_rope_inv_freq_pro_config():
    """The real V4-Pro rope: r = 64, theta 160000, YaRN factor 16 over 65536 (§3.2: low 15, high 25)."""
    pro = DeepseekV4Config(
        qk_rope_head_dim=64, compress_ratios=[128, 128, 4, 128], num_hidden_layers=4,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                      "beta_fast": 32, "beta_slow": 1},
    )
    rot = hf.DeepseekV4RotaryEmbedding(pro)
    ours = rope_inv_freq(64, 160000, 16, 65536, 32, 1)
    assert torch.equal(ours, rot.compress_inv_freq)
    base = rope_inv_freq(64, 160000)
    ratio = ours / base
    torch.testing.assert_close(ratio[:16], torch.ones(16))
    torch.testing.assert_close(ratio[25:], torch.full((7,), 1 / 16))
    assert abs(ratio[16].item() - 0.90625) < 1e-6


@pytest.mark.parametrize("rope_type", ["main", "compress"])
def test_rope_apply(cfg, inv_freq, rope_type):
    rot = hf.DeepseekV4RotaryEmbedding(cfg)
    T, H, d = 37, 3, 64
    pos = torch.cat([torch.arange(5), torch.randint(0, 4096, (T - 5,))])  # [T]
    x = torch.randn(1, H, T, d)
    cos, sin = rot(x, position_ids=pos[None], layer_type=rope_type)  # [1, T, r/2]
    ours_in = x[0].transpose(0, 1)  # [T, H, d]
    fwd = apply_rope_tail(ours_in, pos, inv_freq[rope_type])
    _close(fwd, hf.apply_rotary_pos_emb(x, cos, sin)[0].transpose(0, 1))
    inv = apply_rope_tail(ours_in, pos, inv_freq[rope_type], inverse=True)
    _close(inv, hf.apply_rotary_pos_emb(x, cos, -sin)[0].transpose(0, 1))
    assert torch.equal(fwd[..., :48], ours_in[..., :48])  # nope part untouched
    _close(apply_rope_tail(fwd, pos, inv_freq[rope_type], inverse=True), ours_in)
    # no head axis (compressed entries, window kv): [T, d]
    _close(apply_rope_tail(ours_in[:, 0], pos, inv_freq[rope_type]), fwd[:, 0])


# ----------------------------------------------------------------------------------------- §4
def test_mhc_pre(cfg):
    hc = _randomise(hf.DeepseekV4HyperConnection(cfg), 2)
    x = torch.randn(1, 9, 4, 64)
    post, comb, collapsed = hc(x)
    y, post_r, comb_r = mhc_pre(x[0], hc.fn, hc.base, hc.scale, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
    _close(y, collapsed[0])
    _close(post_r, post[0])
    _close(comb_r, comb[0])
    assert (comb_r - comb_r.transpose(-1, -2)).abs().max() > 1e-3  # direction matters in mhc_post


class _StubAttn(torch.nn.Module):
    """Stands in for the attention inside a HF decoder layer: o = tanh(x A)."""

    def __init__(self, d):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(d, d) / math.sqrt(d))

    def forward(self, hidden_states, **kwargs):
        return torch.tanh(hidden_states @ self.a), None


class _StubMlp(torch.nn.Module):
    def forward(self, hidden_states, input_ids=None):
        return torch.sin(hidden_states) * 1.5


def test_mhc_pre_post_decoder_layer(cfg):
    """mhc_pre (the input norm fused, as the model calls it) -> sub-layer -> mhc_post twice ==
    DeepseekV4DecoderLayer (stub sub-layers)."""
    layer = hf.DeepseekV4DecoderLayer(cfg, SWA_LAYER)
    layer.self_attn, layer.mlp = _StubAttn(64), _StubMlp()
    _randomise(layer, 3)
    x = torch.randn(1, 11, 4, 64)
    with torch.no_grad():
        ref = layer(x)[0]
        X = x[0]
        for hc, norm, sub in ((layer.attn_hc, layer.input_layernorm, lambda h: layer.self_attn(h)[0]),
                              (layer.ffn_hc, layer.post_attention_layernorm, layer.mlp)):
            y, post, comb = mhc_pre(X, hc.fn, hc.base, hc.scale, cfg.rms_norm_eps, cfg.hc_eps,
                                    cfg.hc_sinkhorn_iters, norm.weight, cfg.rms_norm_eps)
            X = mhc_post(sub(y), X, post, comb)
    _close(X, ref)


def test_hc_head(cfg):
    head = _randomise(hf.DeepseekV4HyperHead(cfg), 4)
    x = torch.randn(1, 13, 4, 64)
    _close(hc_head(x[0], head.hc_fn, head.hc_base, head.hc_scale, cfg.rms_norm_eps, cfg.hc_eps), head(x)[0])


# ----------------------------------------------------------------------------------------- §6
def _sorted_by_id(w, ids):
    order = ids.argsort(dim=-1)
    return w.gather(1, order), ids.gather(1, order)


def test_topk_router(cfg):
    router = _randomise(hf.DeepseekV4TopKRouter(cfg), 5)
    x = torch.randn(64, 64)
    _, w_hf, ids_hf = router(x)
    logits = _linear(x, router)  # fp32, as §6 step 1
    w, ids = route(logits, cfg.num_experts_per_tok, cfg.routed_scaling_factor, True,
                   bias=router.e_score_correction_bias)
    w, ids = _sorted_by_id(w, ids)
    w_hf, ids_hf = _sorted_by_id(w_hf, ids_hf)
    assert torch.equal(ids, ids_hf)
    _close(w, w_hf)
    # the randomised bias changes the selection for some tokens (else the test could not see it)
    _, ids_nobias = route(logits, cfg.num_experts_per_tok, cfg.routed_scaling_factor, True)
    assert not torch.equal(ids_nobias.sort(-1).values, ids)


def _random_tid2eid(cfg, g):
    """``[vocab, k]`` table with k distinct experts per token id."""
    perm = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g).argsort(dim=-1)
    return perm[:, : cfg.num_experts_per_tok]


def test_hash_router(cfg):
    router = _randomise(hf.DeepseekV4HashRouter(cfg), 6)
    g = torch.Generator().manual_seed(6)
    k = cfg.num_experts_per_tok
    with torch.no_grad():  # k distinct experts per token id (zeros send everything to expert 0)
        router.tid2eid.copy_(_random_tid2eid(cfg, g))
    x = torch.randn(40, 64)
    input_ids = torch.randint(0, cfg.vocab_size, (40,), generator=g)
    _, w_hf, ids_hf = router(x, input_ids)
    w, ids = route(_linear(x, router), k, cfg.routed_scaling_factor, True, hash_ids=router.tid2eid[input_ids])
    assert torch.equal(ids, ids_hf)
    _close(w, w_hf)


def test_experts_and_shared_expert(cfg):
    experts = _randomise(hf.DeepseekV4Experts(cfg), 7)
    shared = _randomise(hf.DeepseekV4MLP(cfg), 8)
    with torch.no_grad():  # make the +-10 clamps bite; scale W2 so outputs stay O(1) for the atol
        experts.gate_up_proj.mul_(6)
        experts.down_proj.mul_(0.05)
        shared.gate_proj.weight.mul_(6)
        shared.up_proj.weight.mul_(6)
        shared.down_proj.weight.mul_(0.05)
    g = torch.Generator().manual_seed(7)
    T, k, E = 50, cfg.num_experts_per_tok, cfg.n_routed_experts
    x = torch.randn(T, 64, generator=g)
    ids = torch.rand(T, E - 1, generator=g).argsort(dim=-1)[:, :k]  # distinct per token; expert E-1 unused
    weights = torch.rand(T, k, generator=g)
    gate_up = torch.einsum("td,eid->tei", x, experts.gate_up_proj)
    assert (gate_up.abs() > cfg.swiglu_limit).float().mean() > 0.05
    with torch.no_grad():
        _close(moe_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj, cfg.swiglu_limit),
               experts(x, ids, weights))
        w13 = torch.cat([shared.gate_proj.weight, shared.up_proj.weight])  # [2I, D]
        ours = F.linear(swiglu_clamped(F.linear(x, w13), cfg.swiglu_limit), shared.down_proj.weight)
        _close(ours, shared(x))


@pytest.mark.parametrize("layer_idx", [1, 2], ids=["hash", "topk"])
def test_sparse_moe_block(cfg, layer_idx):
    block = _randomise(hf.DeepseekV4SparseMoeBlock(cfg, layer_idx), 9)
    g = torch.Generator().manual_seed(9)
    k = cfg.num_experts_per_tok
    if block.is_hash:
        with torch.no_grad():
            block.gate.tid2eid.copy_(_random_tid2eid(cfg, g))
    T = 33
    x = torch.randn(1, T, 64, generator=g)
    input_ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    with torch.no_grad():
        ref = block(x, input_ids=input_ids)[0]
        h = x[0]
        hash_ids = block.gate.tid2eid[input_ids[0]] if block.is_hash else None
        bias = None if block.is_hash else block.gate.e_score_correction_bias
        w, ids = route(_linear(h, block.gate), k, cfg.routed_scaling_factor, cfg.norm_topk_prob,
                       bias=bias, hash_ids=hash_ids)
        out = moe_experts(h, w, ids, block.experts.gate_up_proj, block.experts.down_proj, cfg.swiglu_limit)
        sh = block.shared_experts
        w13 = torch.cat([sh.gate_proj.weight, sh.up_proj.weight])
        out = out + F.linear(swiglu_clamped(F.linear(h, w13), cfg.swiglu_limit), sh.down_proj.weight)
    _close(out, ref)


# --------------------------------------------------------------------------------- §5.4, §5.5
def _window_rows(rows: torch.Tensor, ratio: int, overlap: bool):
    """Assemble every closed window of a full sequence: ``[N, S, 2cd]`` rows + ``[N, S]`` valid."""
    n_entries = rows.shape[0] // ratio
    S = 2 * ratio if overlap else ratio
    first = torch.arange(n_entries) * ratio - (ratio if overlap else 0)  # [N]
    idx = first[:, None] + torch.arange(S)  # [N, S]
    valid = idx >= 0
    return rows[idx.clamp(min=0)], valid


def _compressed_entries(x, comp, ratio, overlap, d, inv_freq, eps):
    """Our compressor pipeline over a full sequence: rows -> windows -> pool -> norm -> RoPE(w*m)."""
    T = x.shape[0]
    pos = torch.arange(T)
    rows = state_rows(_linear(x, comp.kv_proj), _linear(x, comp.gate_proj), comp.position_bias, pos)
    win, valid = _window_rows(rows, ratio, overlap)
    pooled = compress_windows(win, valid, overlap, d)  # [N, d]
    normed = rms_norm(pooled, comp.kv_norm.weight, eps)
    return apply_rope_tail(normed, torch.arange(pooled.shape[0]) * ratio, inv_freq)  # [N, d]


def _indexer_selection(x, q_lat, indexer, cfg, inv_freq):
    """Our indexer: keys, queries, pre-scaled head weights, top-k over the visible prefix."""
    T = x.shape[0]
    pos = torch.arange(T)
    H, di, ratio = cfg.index_n_heads, cfg.index_head_dim, indexer.compress_rate
    keys = _compressed_entries(x, indexer, ratio, True, di, inv_freq, cfg.rms_norm_eps)  # [N, di]
    q = apply_rope_tail(_linear(q_lat, indexer.q_b_proj).view(T, H, di), pos, inv_freq)  # [T, H, di]
    weights = _linear(x, indexer.scorer.weights_proj) * (di**-0.5 * H**-0.5)  # [T, H]
    return indexer_topk(q, weights, keys, (pos + 1) // ratio, cfg.index_topk)


def test_hca_compressor(cfg, inv_freq):
    comp = _randomise(hf.DeepseekV4HCACompressor(cfg), 10)
    x = torch.randn(1, T_LONG, 64)
    with torch.no_grad():
        ref, _ = comp(x, None, torch.arange(T_LONG)[None], None, C128_LAYER)  # [1, 1, N, d]
        ours = _compressed_entries(x[0], comp, 128, False, cfg.head_dim, inv_freq["compress"], cfg.rms_norm_eps)
    assert ours.shape[0] == T_LONG // 128 == 2
    _close(ours, ref[0, 0])


def test_csa_compressor(cfg, inv_freq):
    comp = _randomise(hf.DeepseekV4CSACompressor(cfg), 11)
    x = torch.randn(1, T_LONG, 64)
    q_lat = torch.randn(1, T_LONG, cfg.q_lora_rank)
    with torch.no_grad():
        ref, _ = comp(x, q_lat, torch.arange(T_LONG)[None], None, C4_LAYER)
        ours = _compressed_entries(x[0], comp, 4, True, cfg.head_dim, inv_freq["compress"], cfg.rms_norm_eps)
    assert ours.shape[0] == T_LONG // 4
    _close(ours, ref[0, 0])


def test_indexer_selection(cfg, inv_freq):
    indexer = _randomise(hf.DeepseekV4Indexer(cfg), 12)
    assert indexer.num_heads >= 16  # §13.2: fewer heads produce exact-zero score ties
    x = torch.randn(1, T_LONG, 64)
    q_lat = torch.randn(1, T_LONG, cfg.q_lora_rank)
    with torch.no_grad():
        ref = indexer(x, q_lat, torch.arange(T_LONG)[None], None, C4_LAYER)[0]  # [T, min(k, N)]
        ours = _indexer_selection(x[0], q_lat[0], indexer, cfg, inv_freq["compress"])  # [T, k]
    n_vis = (torch.arange(T_LONG) + 1) // 4
    assert ours.shape == (T_LONG, cfg.index_topk)
    assert (n_vis > cfg.index_topk).sum() > 200 and (n_vis < cfg.index_topk).any()  # both regimes
    for t in range(T_LONG):
        a = sorted(i for i in ours[t].tolist() if i >= 0)
        b = sorted(i for i in ref[t].tolist() if i >= 0)
        assert a == b, (t, a, b)
        assert len(a) == min(cfg.index_topk, n_vis[t].item())


# --------------------------------------------------------------------------------- §5.1-§5.6
def _attention_ref(attn, x, cfg, inv_freq):
    """The model's attention math composed from the references, for one sequence at positions 0..T-1."""
    T = x.shape[0]
    H, d, W, G = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window, cfg.o_groups
    eps = cfg.rms_norm_eps
    pos = torch.arange(T)
    kind = attn.layer_type
    inv = inv_freq["main" if kind == "sliding_attention" else "compress"]

    q_lat = rms_norm(_linear(x, attn.q_a_proj), attn.q_a_norm.weight, eps)  # [T, q_lora]
    q = rms_norm(_linear(q_lat, attn.q_b_proj).view(T, H, d), None, eps)  # [T, H, d]
    q = apply_rope_tail(q, pos, inv)
    kv = apply_rope_tail(rms_norm(_linear(x, attn.kv_proj), attn.kv_norm.weight, eps), pos, inv)  # [T, d]

    win = pos[:, None] - (W - 1) + torch.arange(W)  # [T, W] last W tokens incl. self
    keys, valid = [kv[win.clamp(min=0)]], [win >= 0]
    if kind == "heavily_compressed_attention":
        comp = _compressed_entries(x, attn.compressor, 128, False, d, inv, eps)  # [N, d]
        n = comp.shape[0]
        keys.append(comp[None].expand(T, n, d))
        valid.append(torch.arange(n)[None, :] < ((pos + 1) // 128)[:, None])
    elif kind == "compressed_sparse_attention":
        comp = _compressed_entries(x, attn.compressor, 4, True, d, inv, eps)  # [N, d]
        sel = _indexer_selection(x, q_lat, attn.compressor.indexer, cfg, inv)  # [T, k]
        keys.append(comp[sel.clamp(min=0)])
        valid.append(sel >= 0)
    o = sparse_attn(q, torch.cat(keys, 1), torch.cat(valid, 1), attn.sinks, d**-0.5)  # [T, H, d]
    o = apply_rope_tail(o, pos, inv, inverse=True)

    wo_a = attn.o_a_proj.weight.view(G, -1, H // G * d)  # [G, R, H/G*d]
    z = torch.einsum("tgi,gri->tgr", o.reshape(T, G, H // G * d), wo_a)  # [T, G, R]
    return _linear(z.flatten(1), attn.o_b_proj)  # [T, D]


@pytest.mark.parametrize("layer_idx", [SWA_LAYER, C4_LAYER, C128_LAYER], ids=["swa", "c4", "c128"])
def test_attention_layer(cfg, inv_freq, layer_idx):
    attn = _randomise(hf.DeepseekV4Attention(cfg, layer_idx), 20 + layer_idx)
    rot = hf.DeepseekV4RotaryEmbedding(cfg)
    x = torch.randn(1, T_LONG, 64)
    pos = torch.arange(T_LONG)[None]
    with torch.no_grad():
        mask = create_sliding_window_causal_mask(
            config=cfg, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=pos
        )
        pe = {t: rot(x, position_ids=pos, layer_type=t) for t in ("main", "compress")}
        ref, _ = attn(x, position_embeddings=pe, position_ids=pos, attention_mask=mask)
        ours = _attention_ref(attn, x[0], cfg, inv_freq)
    _close(ours, ref[0])
