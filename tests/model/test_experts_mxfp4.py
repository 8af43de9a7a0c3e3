"""Routed experts kept as MXFP4 (model/moe.py ``Experts``, packed storage), on the CPU.

The loader fills the packed parameters with the checkpoint's bytes, and the packed forward
(``ops.moe_experts_mxfp4``: the reference here, the Triton kernel with CUDA) equals the dequantised
storage's forward: the decode is exact, so both run the same fp32 expert math (1e-5). Under tensor
parallelism each rank computes its own experts and the ranks' partial outputs sum to the whole.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.loader.test_load import empty_params, stream
from vllm_dsv4 import ops
from vllm_dsv4.config import Dsv4Config
from vllm_dsv4.loader.checkpoint import Checkpoint
from vllm_dsv4.loader.load import load_official_weights
from vllm_dsv4.model.moe import Experts
from vllm_dsv4.shard import Shard

LAYER = 2
PREFIX = f"layers.{LAYER}.ffn.experts"
DEVICE = "cuda" if ops.USE_KERNELS else "cpu"  # where ops.moe_experts_mxfp4 runs (kernel or reference)


@pytest.fixture(scope="module")
def loaded(tiny_ckpt):
    """(cfg, checkpoint, packed Experts, dequantised Experts) of layer 2, both filled by the loader."""
    cfg, ckpt = Dsv4Config.from_pretrained(tiny_ckpt), Checkpoint(tiny_ckpt)
    assert cfg.mxfp4_experts
    both = []
    for on_gpu in (True, False):
        experts = Experts(cfg, Shard(), on_gpu=on_gpu)
        params = empty_params(cfg, ckpt)
        params.update({f"{PREFIX}.{name}": p for name, p in experts.named_parameters()})
        assert load_official_weights(cfg, stream(ckpt), params) == set(params)
        both.append(experts.to(DEVICE))
    return cfg, ckpt, *both


def _routing(cfg: Dsv4Config, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, cfg.hidden_size, generator=g)
    weights = torch.rand(T, cfg.num_experts_per_tok, generator=g)
    ids = torch.randint(0, cfg.n_routed_experts, (T, cfg.num_experts_per_tok), generator=g)
    return x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.skipif(ops.MOE_BACKEND == "marlin", reason="finish_loading hands the experts to Marlin")
def test_narrow_scales_follow_the_loaded_scale_bytes(loaded):
    """The Triton decode's single-product promise holds exactly when no scale byte passes 128."""
    _, _, packed, _ = loaded
    packed.finish_loading()
    assert packed.narrow_scales  # the checkpoint maker's experts: weights far below 16
    kept = packed.w2_scale.data[1, 2, 0].clone()
    try:
        packed.w2_scale.data[1, 2, 0] = 129
        packed.finish_loading()
        assert not packed.narrow_scales
    finally:
        packed.w2_scale.data[1, 2, 0] = kept
        packed.finish_loading()


def test_packed_parameters_hold_the_checkpoint_bytes(loaded):
    cfg, ckpt, packed, _ = loaded
    i = cfg.moe_intermediate_size
    assert packed.packed and {p.dtype for p in packed.parameters()} == {torch.uint8}
    for e in (0, cfg.n_routed_experts - 1):
        raw = lambda n, part: ckpt.get(f"{PREFIX}.{e}.{n}.{part}").view(torch.uint8).to(DEVICE)  # noqa: E731
        assert torch.equal(packed.w13[e, :i], raw("w1", "weight"))
        assert torch.equal(packed.w13[e, i:], raw("w3", "weight"))
        assert torch.equal(packed.w13_scale[e, i:], raw("w3", "scale"))
        assert torch.equal(packed.w2[e], raw("w2", "weight"))
        assert torch.equal(packed.w2_scale[e], raw("w2", "scale"))


@pytest.mark.parametrize("T", [0, 1, 9])
def test_packed_forward_equals_dequantised(loaded, T):
    cfg, _, packed, dense = loaded
    x, weights, ids = _routing(cfg, T)
    out = packed(x, weights, ids)
    assert out.shape == (T, cfg.hidden_size) and out.dtype == x.dtype
    torch.testing.assert_close(out, dense(x, weights, ids), atol=1e-5, rtol=1e-5)


def test_tensor_parallel_ranks_sum_to_the_whole(loaded):
    """Rank r of 2 holds experts [4r, 4r + 4) (packed); other ranks' picks are skipped."""
    cfg, _, packed, _ = loaded
    x, weights, ids = _routing(cfg, 7, seed=1)
    half = cfg.n_routed_experts // 2
    partials = []
    for rank in range(2):
        local = Experts(cfg, Shard(rank, 2), on_gpu=True).to(DEVICE)
        for name, p in local.named_parameters():
            p.data.copy_(getattr(packed, name).data[rank * half : (rank + 1) * half])
        partials.append(local(x, weights, ids))
    torch.testing.assert_close(partials[0] + partials[1], packed(x, weights, ids), atol=1e-5, rtol=1e-5)


def test_storage_follows_the_checkpoint_and_the_path(tiny_ckpt):
    """Packed only for MXFP4 experts on the kernel path; uint8 whatever the default float dtype (vLLM
    builds the model under its dtype), while the dequantised storage takes that dtype."""
    cfg = Dsv4Config.from_pretrained(tiny_ckpt)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        packed, cpu = Experts(cfg, Shard(), on_gpu=True), Experts(cfg, Shard(), on_gpu=False)
        fp8_experts = Experts(dataclasses.replace(cfg, expert_dtype="fp8"), Shard(), on_gpu=True)
    finally:
        torch.set_default_dtype(default)
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    assert packed.w13.dtype == packed.w13_scale.dtype == torch.uint8
    assert packed.w13.shape == (cfg.n_routed_experts, 2 * i, d // 2) and packed.w2_scale.shape[-1] == i // 32
    assert not cpu.packed and cpu.w13.dtype == torch.bfloat16 and cpu.w13.shape[-1] == d
    assert not fp8_experts.packed and not hasattr(fp8_experts, "w13_scale")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's Marlin MoE needs CUDA")
@pytest.mark.parametrize("T, E", [(1, 256), (16, 256), (300, 256), (64, 128)])
def test_marlin_moe_matches_the_reference(T, E):
    """vllm_kernels.marlin_mxfp4_experts (VLLM_DSV4_MOE=marlin) over V4-Flash-sized experts equals the
    MXFP4 reference, skipped slots included.

    Marlin stores each slot's weighted expert output ``w_j y_j`` in bf16 before the k-sum (vLLM's
    ``moe_sum``), which the reference (and our Triton MoE) accumulate in fp32. That rounds each of
    the k parts once (2^-9 relative) and the running sum k - 1 times, so per element
    ``|out - ref| <= 2^-8 k sum_j |w_j y_j| + 1e-2`` (the bf16 tolerance of the kernel tests, for the
    products' order); on an H200 the elementwise 1e-2 alone failed a few elements in a million by
    up to 0.0156, within this bound. The cosine must stay > 0.9999 as in the kernel tests.
    """
    from csrc_triton.moe_mxfp4_ref import moe_experts_mxfp4 as reference
    from tests.csrc_triton.kernel_cases import moe_mxfp4_args
    from vllm_dsv4.ops import vllm_kernels

    x, weights, ids, w13, s13, w2, s2, limit = moe_mxfp4_args(T, 4096, 2048, E, 6, torch.bfloat16, limit=10.0)
    out = vllm_kernels.marlin_mxfp4_experts(w13, s13, w2, s2, limit)(x, weights, ids).double().cpu()
    ref = reference(x, weights, ids, w13, s13, w2, s2, limit).double().cpu()
    k = ids.shape[1]
    parts = torch.zeros_like(ref)  # sum_j |w_j y_j|, each slot alone (the others skipped: id E)
    for j in range(k):
        only_j = torch.where(torch.arange(k, device=ids.device) == j, ids, E)
        parts += reference(x, weights, only_j, w13, s13, w2, s2, limit).double().cpu().abs()
    excess = (out - ref).abs() - (2.0**-8 * k * parts + 1e-2)
    assert excess.max() <= 0, ((out - ref).abs().max().item(), excess.argmax().item())
    if ref.norm() > 0:
        assert torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item() > 0.9999
