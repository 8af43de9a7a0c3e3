"""``bias_vl`` routing (docs/VISION.md §7) of the MoE gate, against a per-token loop written from the spec, on
hash and score layers and the MTP stage; text-only ids route bit for bit as without it."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_make_checkpoint
from vllm_dsv4.config import Dsv4Config, NUM_SENTINELS, SENTINEL_BASE_ID
from vllm_dsv4.model.moe import Gate


@pytest.fixture(scope="module")
def cfg() -> Dsv4Config:
    return Dsv4Config.from_dict(load_make_checkpoint().make_config("tiny-vision", quantized=False))


def random_gate(cfg: Dsv4Config, hashed: bool, seed: int) -> Gate:
    g = torch.Generator().manual_seed(seed)
    gate = Gate(cfg, hashed)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g))
        gate.bias.copy_(torch.randn(gate.bias.shape, generator=g))
        gate.bias_vl.copy_(3 * torch.randn(gate.bias_vl.shape, generator=g))  # image rows pick other experts
        if hashed:
            gate.tid2eid.copy_(torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g).argsort(1)[:, :cfg.num_experts_per_tok])
    return gate


def route_by_loop(gate: Gate, x: torch.Tensor, ids: torch.Tensor, hashed: bool):
    """§7 per token: s = sqrt(softplus(W x)); a sentinel picks top-k of s + bias_vl (hash layers too),
    text picks tid2eid[id] (hash) or top-k of s + bias; w = s[picks] / sum * routed_scaling_factor."""
    rows = []
    for t in range(x.shape[0]):
        s = torch.nn.functional.softplus(x[t].float() @ gate.weight.float().T).sqrt()
        token = int(ids[t])
        if SENTINEL_BASE_ID <= token < SENTINEL_BASE_ID + NUM_SENTINELS:
            picks = torch.topk(s + gate.bias_vl, gate.top_k).indices
        elif hashed:
            picks = gate.tid2eid[token]
        else:
            picks = torch.topk(s + gate.bias, gate.top_k).indices
        w = s[picks] / s[picks].sum() * gate.scaling
        rows.append(dict(zip(picks.tolist(), w.tolist())))
    return rows


@pytest.mark.parametrize("hashed", [True, False], ids=["hash", "score"])
def test_sentinels_route_with_bias_vl(cfg, hashed):
    gate = random_gate(cfg, hashed, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, cfg.hidden_size, generator=g)
    ids = torch.randint(2, 1000, (40,), generator=g)
    ids[5:15] = SENTINEL_BASE_ID + torch.arange(10) % NUM_SENTINELS  # all five kinds
    ids[30] = SENTINEL_BASE_ID + NUM_SENTINELS  # the next id (the placeholder) is text
    weights, picks = gate(x, ids)
    got = [dict(zip(p.tolist(), w.tolist())) for p, w in zip(picks, weights)]
    want = route_by_loop(gate, x, ids, hashed)
    for t in range(40):
        assert got[t].keys() == want[t].keys(), t
        assert all(abs(got[t][e] - want[t][e]) < 1e-6 for e in want[t]), t
    image_rows = [t for t in range(40) if 5 <= t < 15]
    text_bias = [set(torch.topk(torch.nn.functional.softplus(x[t] @ gate.weight.T).sqrt() + gate.bias,
                                gate.top_k).indices.tolist()) for t in image_rows]
    assert any(got[t].keys() != b for t, b in zip(image_rows, text_bias))  # bias_vl changed some picks


@pytest.mark.parametrize("hashed", [True, False], ids=["hash", "score"])
def test_text_routes_as_without_bias_vl(cfg, hashed):
    text_cfg = Dsv4Config.from_dict({**load_make_checkpoint().make_config("tiny-vision", quantized=False),
                                     "vision_n_layers": 0})
    gate, plain = random_gate(cfg, hashed, seed=5), Gate(text_cfg, hashed)
    plain.load_state_dict({k: v for k, v in gate.state_dict().items() if k in plain.state_dict()})
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    ids = torch.randint(2, 1000, (64,), generator=torch.Generator().manual_seed(7))
    (w, p), (w0, p0) = gate(x, ids), plain(x, ids)
    assert torch.equal(w, w0) and torch.equal(p, p0)


def test_every_gate_of_a_vision_model_holds_bias_vl(cfg):
    """Main layers (hash ones with their shipped, unused bias) and the MTP stage, as the checkpoint has them."""
    from vllm_dsv4.loader.checkpoint import expected_tensors

    names = expected_tensors(cfg)
    moe_layers = [f"layers.{i}" for i in range(cfg.num_hidden_layers)] + [
        f"mtp.{k}" for k in range(cfg.num_nextn_predict_layers)]
    for layer in moe_layers:
        assert f"{layer}.ffn.gate.bias_vl" in names and f"{layer}.ffn.gate.bias" in names
    for hashed in (True, False):
        assert {n for n, _ in Gate(cfg, hashed).named_parameters()} >= {"bias_vl", "bias"}
