"""Routed experts kept as MXFP4 (model/moe.py ``Experts``, packed storage), on the CPU.

The loader fills the packed parameters with the checkpoint's bytes. The packed forward
(``ops.moe_experts_mxfp4``: the reference here, the Triton kernel with CUDA) and the dequantised
storage's forward both equal a naive fp64 loop over tokens and picks on the oracle's MXFP4 decode
(tests/oracle/hf_oracle.py, independent of vllm_dsv4's), to 1e-5. Under tensor parallelism each rank
computes its own experts: its partial output is the loop over its experts alone.
"""

from __future__ import annotations

import dataclasses
import functools

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


def routing(cfg: Dsv4Config, T: int, seed: int = 0):
    """``(x [T, D], weights [T, k], ids [T, k])`` on DEVICE: random activations and routing."""
    g = torch.Generator().manual_seed(seed)
    x = 8 * torch.randn(T, cfg.hidden_size, generator=g)  # large enough that the SwiGLU clamps bite
    weights = torch.rand(T, cfg.num_experts_per_tok, generator=g)
    ids = torch.randint(0, cfg.n_routed_experts, (T, cfg.num_experts_per_tok), generator=g)
    return x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)


def naive_experts(cfg: Dsv4Config, ckpt: Checkpoint, x, weights, ids, experts: range) -> torch.Tensor:
    """§6 steps 4-5 in fp64, one token and one pick at a time, over the picks in ``experts``:
    ``sum_j w_j W2 (silu(min(W1 x, L)) * clamp(W3 x, -L, L))`` with the oracle's decode of the
    checkpoint's bytes (MXFP4, or FP8 in V4-Flash-Base). [T, D] float64 (CPU)."""
    from tests.oracle.hf_oracle import oracle_dequant_fp8, oracle_dequant_mxfp4

    @functools.cache
    def weight(e: int, w: str) -> torch.Tensor:
        stored, scale = ckpt.get(f"{PREFIX}.{e}.{w}.weight"), ckpt.get(f"{PREFIX}.{e}.{w}.scale")
        decode = oracle_dequant_fp8 if stored.dtype == torch.float8_e4m3fn else oracle_dequant_mxfp4
        return decode(stored, scale).double()

    limit = cfg.swiglu_limit
    x, weights, ids = x.double().cpu(), weights.double().cpu(), ids.cpu()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            if e in experts:
                gate, up = (weight(e, "w1") @ x[t]).clamp(max=limit), (weight(e, "w3") @ x[t]).clamp(-limit, limit)
                out[t] += weights[t, j] * (weight(e, "w2") @ (gate * torch.sigmoid(gate) * up))
    return out


def assert_matches(out: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 accumulation against fp64: 1e-5 relative to the output's scale."""
    scale = want.abs().max().item() if want.numel() else 0.0
    tol = 1e-5 * max(1.0, scale)
    torch.testing.assert_close(out.double().cpu(), want, atol=tol, rtol=1e-5)


def test_narrow_scales_follow_the_loaded_scale_bytes(loaded, monkeypatch):
    """The Triton decode's single-product promise holds exactly when no scale byte passes 128."""
    _, _, packed, _ = loaded
    monkeypatch.setattr(ops, "MOE_BACKEND", "triton")  # Marlin would take (and release) the packed bytes
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
def test_packed_and_dequantised_forwards_equal_the_naive_loop(loaded, T):
    cfg, ckpt, packed, dense = loaded
    x, weights, ids = routing(cfg, T)
    want = naive_experts(cfg, ckpt, x, weights, ids, range(cfg.n_routed_experts))
    for experts in (packed, dense):
        out = experts(x, weights, ids)
        assert out.shape == (T, cfg.hidden_size) and out.dtype == x.dtype
        assert_matches(out, want)


def test_tensor_parallel_ranks_compute_their_own_experts(loaded):
    """Rank r of 2 holds experts [4r, 4r + 4) (packed); other ranks' picks are skipped."""
    cfg, ckpt, packed, _ = loaded
    x, weights, ids = routing(cfg, 7, seed=1)
    half = cfg.n_routed_experts // 2
    for rank in range(2):
        local = Experts(cfg, Shard(rank, 2), on_gpu=True).to(DEVICE)
        for name, p in local.named_parameters():
            p.data.copy_(getattr(packed, name).data[rank * half : (rank + 1) * half])
        mine = range(rank * half, (rank + 1) * half)
        assert_matches(local(x, weights, ids), naive_experts(cfg, ckpt, x, weights, ids, mine))


def test_storage_follows_the_checkpoint_and_the_path(tiny_ckpt):
    """Packed only for MXFP4 experts on the kernel path; uint8 whatever the default float dtype (vLLM
    builds the model under its dtype), while the dequantised storage takes that dtype. FP8 experts
    (V4-Flash-Base) are held as e4m3 with float32 block scales there."""
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
    assert not fp8_experts.packed and fp8_experts.fp8 and not cpu.fp8 and not packed.fp8
    assert fp8_experts.w13.dtype == fp8_experts.w2.dtype == torch.float8_e4m3fn
    assert fp8_experts.w13.shape == (cfg.n_routed_experts, 2 * i, d)
    assert fp8_experts.w13_scale.dtype == torch.float32 and fp8_experts.w13_scale.shape == (cfg.n_routed_experts, 2, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's Marlin MoE needs CUDA")
@pytest.mark.parametrize("T, E", [(1, 256), (16, 256), (300, 256), (64, 128)])
def test_marlin_moe_matches_the_reference(T, E):
    """vllm_kernels.marlin_mxfp4_experts (the GPU default) over V4-Flash-sized experts equals the
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
