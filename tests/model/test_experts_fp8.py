"""V4-Flash-Base's routed experts held as FP8 (model/moe.py ``Experts``, FP8 storage: the GPU path's).

The loader fills the e4m3 weights and float32 block scales with the checkpoint's values, and the forward
(``ops.moe_experts_fp8``: the reference on CPU, the Triton kernel with CUDA) equals a loop over tokens
and slots written here from §6 on weights decoded by the oracle's own decoder (tests/oracle/hf_oracle.py).
Under tensor parallelism each rank computes its own experts and the partial outputs sum to the whole.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.loader.test_load import empty_params, stream
from tests.oracle.hf_oracle import oracle_dequant_fp8
from vllm_dsv4 import ops
from vllm_dsv4.config import Dsv4Config
from vllm_dsv4.loader.checkpoint import Checkpoint
from vllm_dsv4.loader.load import load_official_weights
from vllm_dsv4.model.moe import Experts
from vllm_dsv4.shard import Shard

LAYER = 2
PREFIX = f"layers.{LAYER}.ffn.experts"
DEVICE = "cuda" if ops.USE_KERNELS else "cpu"  # where ops.moe_experts_fp8 runs (kernel or reference)


@pytest.fixture(scope="module")
def loaded(tiny_base_ckpt):
    """(cfg, checkpoint, FP8-held Experts of layer 2) filled by the loader."""
    cfg, ckpt = Dsv4Config.from_pretrained(tiny_base_ckpt), Checkpoint(tiny_base_ckpt)
    experts = Experts(cfg, Shard(), on_gpu=True)
    assert experts.fp8 and not experts.packed
    params = empty_params(cfg, ckpt)
    params.update({f"{PREFIX}.{name}": p for name, p in experts.named_parameters()})
    assert load_official_weights(cfg, stream(ckpt), params) == set(params)
    return cfg, ckpt, experts.to(DEVICE)


def naive_experts(cfg: Dsv4Config, ckpt: Checkpoint, x, weights, ids):
    """``y_t = sum_j w_tj W2_e (silu(min(W1_e x_t, L)) * clamp(W3_e x_t, -L, L))``, e = ids[t, j], in float64."""
    weight = {}
    for e in ids.unique().tolist():
        for linear in ("w1", "w2", "w3"):
            name = f"{PREFIX}.{e}.{linear}"
            weight[e, linear] = oracle_dequant_fp8(ckpt.get(f"{name}.weight"), ckpt.get(f"{name}.scale")).double()
    L, y = cfg.swiglu_limit, torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double().cpu()
        for j, e in enumerate(ids[t].tolist()):
            h = F.silu((weight[e, "w1"] @ xt).clamp(max=L)) * (weight[e, "w3"] @ xt).clamp(-L, L)
            y[t] += float(weights[t, j]) * (weight[e, "w2"] @ h)
    return y


def _routing(cfg: Dsv4Config, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, cfg.hidden_size, generator=g)
    weights = torch.rand(T, cfg.num_experts_per_tok, generator=g)
    ids = torch.randint(0, cfg.n_routed_experts, (T, cfg.num_experts_per_tok), generator=g)
    return x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)


def test_fp8_parameters_hold_the_checkpoint_values(loaded):
    cfg, ckpt, experts = loaded
    i = cfg.moe_intermediate_size
    for e in (0, cfg.n_routed_experts - 1):
        get = lambda linear, part: ckpt.get(f"{PREFIX}.{e}.{linear}.{part}").to(DEVICE)  # noqa: E731
        assert torch.equal(experts.w13[e, :i].view(torch.uint8), get("w1", "weight").view(torch.uint8))
        assert torch.equal(experts.w13[e, i:].view(torch.uint8), get("w3", "weight").view(torch.uint8))
        assert torch.equal(experts.w13_scale[e], torch.cat([get("w1", "scale"), get("w3", "scale")]))
        assert torch.equal(experts.w2[e].view(torch.uint8), get("w2", "weight").view(torch.uint8))
        assert torch.equal(experts.w2_scale[e], get("w2", "scale"))


@pytest.mark.parametrize("T", [0, 1, 9])
def test_fp8_forward_equals_a_naive_loop_on_independently_decoded_weights(loaded, T):
    cfg, ckpt, experts = loaded
    x, weights, ids = _routing(cfg, T)
    out = experts(x, weights, ids)
    assert out.shape == (T, cfg.hidden_size) and out.dtype == x.dtype
    torch.testing.assert_close(out.double().cpu(), naive_experts(cfg, ckpt, x, weights, ids), atol=1e-5, rtol=1e-5)


def test_fp8_adds_the_shared_output(loaded):
    cfg, _, experts = loaded
    x, weights, ids = _routing(cfg, 5, seed=2)
    shared = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    assert torch.equal(experts(x, weights, ids, shared), experts(x, weights, ids) + shared)


def test_tensor_parallel_ranks_sum_to_the_whole(loaded):
    """Rank r of 2 holds experts [4r, 4r + 4) in FP8; other ranks' picks are skipped."""
    cfg, _, experts = loaded
    x, weights, ids = _routing(cfg, 7, seed=1)
    half = cfg.n_routed_experts // 2
    partials = []
    for rank in range(2):
        local = Experts(cfg, Shard(rank, 2), on_gpu=True).to(DEVICE)
        for name, p in local.named_parameters():
            p.data.copy_(getattr(experts, name).data[rank * half : (rank + 1) * half])
        partials.append(local(x, weights, ids))
    torch.testing.assert_close(partials[0] + partials[1], experts(x, weights, ids), atol=1e-5, rtol=1e-5)
