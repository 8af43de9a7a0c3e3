"""V4-Flash-Base's routed experts held as FP8 (model/moe.py ``Experts``, FP8 storage: the GPU path's).

The loader fills the e4m3 weights and float32 block scales with the checkpoint's values, and the forward
(``ops.moe_experts_fp8``: the reference on CPU, the Triton kernel with CUDA) equals test_experts_mxfp4's
naive fp64 loop on the oracle's own FP8 decode (tests/oracle/hf_oracle.py). Under tensor parallelism each
rank's partial output is the loop over its experts alone.
"""

from __future__ import annotations

import pytest
import torch

from tests.loader.test_load import empty_params, stream
from tests.model.test_experts_mxfp4 import DEVICE, PREFIX, assert_matches, naive_experts, routing
from vllm_dsv4.config import Dsv4Config
from vllm_dsv4.loader.checkpoint import Checkpoint
from vllm_dsv4.loader.load import load_official_weights
from vllm_dsv4.model.moe import Experts
from vllm_dsv4.shard import Shard


@pytest.fixture(scope="module")
def loaded(tiny_base_ckpt):
    """(cfg, checkpoint, FP8-held Experts of test_experts_mxfp4's layer) filled by the loader."""
    cfg, ckpt = Dsv4Config.from_pretrained(tiny_base_ckpt), Checkpoint(tiny_base_ckpt)
    experts = Experts(cfg, Shard(), on_gpu=True)
    assert experts.fp8 and not experts.packed
    params = empty_params(cfg, ckpt)
    params.update({f"{PREFIX}.{name}": p for name, p in experts.named_parameters()})
    assert load_official_weights(cfg, stream(ckpt), params) == set(params)
    return cfg, ckpt, experts.to(DEVICE)


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
def test_fp8_forward_equals_the_naive_loop(loaded, T):
    cfg, ckpt, experts = loaded
    x, weights, ids = routing(cfg, T)
    out = experts(x, weights, ids)
    assert out.shape == (T, cfg.hidden_size) and out.dtype == x.dtype
    assert_matches(out, naive_experts(cfg, ckpt, x, weights, ids, range(cfg.n_routed_experts)))


def test_fp8_adds_the_shared_output(loaded):
    cfg, _, experts = loaded
    x, weights, ids = routing(cfg, 5, seed=2)
    shared = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    assert torch.equal(experts(x, weights, ids, shared), experts(x, weights, ids) + shared)


def test_tensor_parallel_ranks_compute_their_own_experts(loaded):
    """Rank r of 2 holds experts [4r, 4r + 4) in FP8; other ranks' picks are skipped."""
    cfg, ckpt, experts = loaded
    x, weights, ids = routing(cfg, 7, seed=1)
    half = cfg.n_routed_experts // 2
    for rank in range(2):
        local = Experts(cfg, Shard(rank, 2), on_gpu=True).to(DEVICE)
        for name, p in local.named_parameters():
            p.data.copy_(getattr(experts, name).data[rank * half : (rank + 1) * half])
        mine = range(rank * half, (rank + 1) * half)
        assert_matches(local(x, weights, ids), naive_experts(cfg, ckpt, x, weights, ids, mine))
