"""Bindings to vLLM's own kernels, beside the ops that use them: one entry per binding (what vLLM
offers | how we bind it | where it does not bind | what runs instead). These are the same API in vLLM
0.26 and 0.32; what differs is whether a build or device has them, so each probes vLLM and falls back.

1. Block-FP8 linear kernels (GPU path) | ``vllm.model_executor.kernels.linear``: ``init_fp8_linear_kernel``
   picks, for a weight shape, the kernel vLLM's own ``Fp8LinearMethod`` would (CUDA order:
   FlashInfer+DeepGEMM, DeepGEMM, CUTLASS, Marlin, Triton); the kernel reads ``weight`` /
   ``weight_scale`` / ``weight_block_size`` off a layer, re-lays them out in
   ``process_weights_after_loading`` and computes in ``apply_weights`` | ``block_fp8_gemm()`` | no block
   kernel for the shape, or the selection API missing | ``per_token_group_quant_fp8`` +
   ``w8a8_triton_block_scaled_mm`` (``fp8_utils``), ``triton_block_fp8_gemm()``.
2. Marlin MXFP4 fused MoE (GPU path, the default where it binds; not in batch-invariant mode) |
   ``fused_moe.experts.marlin_moe`` ``fused_marlin_moe`` (what vLLM 0.26's in-tree DeepSeek-V4 runs on
   Hopper, with SILU + clamp) over weights repacked by ``marlin_utils_fp4.prepare_moe_mxfp4_layer_for_marlin``
   | ``marlin_mxfp4_experts()``; ``has_marlin_mxfp4_moe()`` says whether it binds | CPU, no Marlin in the
   build or on the device | our Triton MoE (csrc_triton/moe_mxfp4.py), which also runs in batch-invariant
   mode: Marlin's row results depend on how many rows share a call (tests/model/test_graph_replay.py).
3. FlashMLA sparse FP8 attention (GPU path) | ``vllm.v1.attention.ops.flashmla``:
   ``flash_mla_with_kvcache`` (sparse mode: ``indices`` + ``extra_k_cache``, ``attn_sink``,
   ``topk_length``) and ``FlashMLASchedMeta`` for decode, ``flash_mla_sparse_fwd`` (bf16 keys, indices,
   ``attn_sink``) for prefill | ``flashmla_sparse()`` returns them | ``is_flashmla_sparse_supported()``
   false (CPU, GPUs other than Hopper and Blackwell) | our Triton attention (ops/flashmla.py says when).
4. DeepGEMM's grouped FP8 GEMM (GPU path: ``wo_a`` above 1,024 tokens under ``VLLM_DSV4_OUT_PROJ=auto``,
   every size with ``einsum``) | ``vllm.utils.deep_gemm``: ``fp8_einsum("bhr,hdr->bhd", ...)`` and
   ``transform_sf_into_required_layout`` (what vLLM 0.26's in-tree DeepSeek-V4 runs ``wo_a`` on) |
   ``grouped_fp8_gemm()``; ``has_grouped_fp8_gemm()`` says whether it binds | no DeepGEMM in the build
   or on the device | one block-FP8 GEMM per head group (binding 1); under ``einsum`` an error naming
   the missing piece.
5. DeepGEMM warm-up sizes (GPU path) | ``vllm.model_executor.warmup.deep_gemm_warmup``:
   ``_get_fp8_gemm_nt_m_values(w, max_tokens)``, the token counts at which vLLM's DeepGEMM warm-up runs
   each of its own FP8 linear layers (``VLLM_DEEP_GEMM_WARMUP``: ``relax``, the default, the counts
   where DeepGEMM's kernel choice changes; ``full``, every count; ``skip``, none); it finds layers by
   vLLM's classes, so never ours | ``deep_gemm_warmup_sizes()`` (warmup.py runs our DeepGEMM-backed
   linears at them) | no such module | no DeepGEMM warm-up of ours.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import torch

from csrc_triton.formats import FP8_BLOCK
from vllm_dsv4 import compat, envs, get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class BlockFp8Gemm:
    """One loaded block-FP8 weight bound to the kernel computing with it: ``x [M, in] -> [M, out]`` bf16."""

    kernel: str  # the vLLM kernel class, or "triton" for the fallback
    run: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x.to(torch.bfloat16).contiguous())

    @property
    def deep_gemm(self) -> bool:
        """Whether DeepGEMM computes it (JIT-compiled per kernel choice: binding 5)."""
        return "deepgemm" in self.kernel.lower()


def deep_gemm_warmup_sizes(out_features: int, device: torch.device, max_tokens: int) -> list[int]:
    """Binding 5: the token counts vLLM's DeepGEMM warm-up runs a linear layer of ``out_features`` rows at."""
    try:
        from vllm.model_executor.warmup.deep_gemm_warmup import _get_fp8_gemm_nt_m_values
    except ImportError:
        return []
    if envs.DEEP_GEMM_WARMUP.read() == "skip":
        return []
    return _get_fp8_gemm_nt_m_values(torch.empty(out_features, 0, device=device), max_tokens)


class _KernelLayer:
    """The attributes vLLM's block-FP8 kernels read off a layer (and replace after loading)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor):
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(weight_scale, requires_grad=False)
        self.weight_block_size = [FP8_BLOCK, FP8_BLOCK]
        self.input_scale = self.input_scale_ub = None  # activation scales are dynamic


def block_fp8_gemm(weight: torch.Tensor, weight_scale: torch.Tensor) -> BlockFp8Gemm:
    """Binding 1: vLLM's block-FP8 GEMM for one freshly loaded weight (call once, after loading).

    ``weight`` float8_e4m3fn [out, in], ``weight_scale`` float32 [out/128, in/128], both whole
    128-blocks. The kernel is the one vLLM picks for the shape under the current vLLM config; its
    weight processing (e.g. DeepGEMM's UE8M0 re-quantisation, exact for power-of-two scales, and
    scale layout) runs here and may rewrite ``weight`` in place. Activations are quantised per
    token in 128-wide groups inside the call.
    """
    out_features, in_features = weight.shape
    want = (out_features // FP8_BLOCK, in_features // FP8_BLOCK)
    if (weight.dtype != torch.float8_e4m3fn or weight_scale.dtype != torch.float32
            or out_features % FP8_BLOCK or in_features % FP8_BLOCK or tuple(weight_scale.shape) != want):
        raise ValueError(f"block-FP8 GEMM wants a float8_e4m3fn weight of whole {FP8_BLOCK}-blocks and float32 "
                         f"scales {want}; got {weight.dtype} {tuple(weight.shape)}, "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
    kernel = _vllm_block_fp8_kernel((out_features, in_features))
    if kernel is None:
        return triton_block_fp8_gemm(weight, weight_scale)
    layer = _KernelLayer(weight, weight_scale)
    kernel.process_weights_after_loading(layer)
    return BlockFp8Gemm(type(kernel).__name__, functools.partial(kernel.apply_weights, layer))


def _vllm_block_fp8_kernel(weight_shape: tuple[int, int]):
    """The kernel vLLM's Fp8LinearMethod would pick for a block-FP8 weight; None if it has none."""
    try:
        from vllm.model_executor.kernels.linear import Fp8BlockScaledMMLinearKernel, init_fp8_linear_kernel
        from vllm.model_executor.layers.quantization.utils.quant_utils import (
            kFp8Dynamic128Sym,
            kFp8Static128BlockSym,
        )
    except ImportError as e:
        _warn_once(f"vLLM {compat.vllm_version()} has no block-FP8 kernel selection ({e}); using its Triton block GEMM")
        return None
    try:
        kernel = init_fp8_linear_kernel(
            activation_quant_key=kFp8Dynamic128Sym,
            weight_quant_key=kFp8Static128BlockSym,
            input_dtype=torch.bfloat16,
            out_dtype=torch.bfloat16,
            weight_shape=weight_shape,
            module_name="vllm_dsv4 Linear",
        )
    except ValueError as e:  # no kernel implements this shape on this GPU
        _warn_once(f"no vLLM block-FP8 kernel for {weight_shape}; using its Triton block GEMM ({e})")
        return None
    if not isinstance(kernel, Fp8BlockScaledMMLinearKernel):
        # Marlin (weight-only FP8, GPUs without FP8 MMA) repacks into its own layer attributes.
        _warn_once(f"vLLM picked {type(kernel).__name__} for block FP8; using its Triton block GEMM")
        return None
    return kernel


def triton_block_fp8_gemm(weight: torch.Tensor, weight_scale: torch.Tensor) -> BlockFp8Gemm:
    """The fallback: vLLM's Triton per-token-group quantisation (amax / 448 scales) and block GEMM."""
    try:
        from vllm.model_executor.layers.quantization.utils.fp8_utils import (
            per_token_group_quant_fp8,
            w8a8_triton_block_scaled_mm,
        )
    except ImportError as e:
        raise ImportError(
            f"vllm-dsv4 needs vLLM's block-FP8 Triton GEMM (fp8_utils.per_token_group_quant_fp8, "
            f"w8a8_triton_block_scaled_mm) to keep FP8 weights quantised; vLLM {compat.vllm_version()} lacks it. "
            f"VLLM_DSV4_OPS=reference serves with dequantised weights instead"
        ) from e

    def run(x: torch.Tensor) -> torch.Tensor:
        q, s = per_token_group_quant_fp8(x, FP8_BLOCK, column_major_scales=False, use_ue8m0=False)
        return w8a8_triton_block_scaled_mm(q, weight, s, weight_scale, [FP8_BLOCK, FP8_BLOCK],
                                           output_dtype=torch.bfloat16)

    return BlockFp8Gemm("triton", run)


@functools.cache
def _deep_gemm_for_grouped_gemm() -> tuple[ModuleType | None, str | None]:
    """Binding 4's module, vLLM's ``vllm.utils.deep_gemm``, and None; or None and why it cannot bind here."""
    try:
        from vllm.utils import deep_gemm
    except ImportError:
        return None, f"vLLM {compat.vllm_version()} has no vllm.utils.deep_gemm"
    if not hasattr(deep_gemm, "fp8_einsum"):
        return None, f"vLLM {compat.vllm_version()}'s vllm.utils.deep_gemm has no fp8_einsum"
    if not deep_gemm.is_deep_gemm_supported():
        return None, "DeepGEMM does not run here (a vLLM build with it, on Hopper or Blackwell)"
    return deep_gemm, None


def has_grouped_fp8_gemm() -> bool:
    """Whether binding 4 binds here."""
    return _deep_gemm_for_grouped_gemm()[0] is not None


def grouped_fp8_gemm(weight: torch.Tensor, weight_scale: torch.Tensor, groups: int):
    """Binding 4: DeepGEMM's grouped FP8 GEMM bound to a block-diagonal block-FP8 weight (group g: rows
    ``g*R .. (g+1)*R`` of ``weight`` [G*R, K], float32 scales [G*R/128, K/128]): ``(q [T, G, K] e4m3,
    scale [T, G, K/128] float32) -> [T, G*R]`` bf16, activations laid out as ``csrc_triton.out_proj.
    rope_quant_fp8`` writes them. The weight's scales are re-laid out once, here, into a copy (the
    fused kernel keeps reading ``weight_scale``)."""
    deep_gemm, why_not = _deep_gemm_for_grouped_gemm()
    if deep_gemm is None:
        raise RuntimeError(f"VLLM_DSV4_OUT_PROJ=einsum needs DeepGEMM's grouped FP8 GEMM: {why_not}")
    N, K = weight.shape
    R = N // groups
    w = weight.view(groups, R, K)
    w_scale = deep_gemm.transform_sf_into_required_layout(
        sf=weight_scale.view(groups, R // FP8_BLOCK, K // FP8_BLOCK), mn=R, k=K, recipe=(1, FP8_BLOCK, FP8_BLOCK),
        num_groups=groups, is_sfa=False)

    def run(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        out = torch.empty(q.shape[0], groups, R, dtype=torch.bfloat16, device=q.device)
        deep_gemm.fp8_einsum("bhr,hdr->bhd", (q, scale), (w, w_scale), out, recipe=(1, FP8_BLOCK, FP8_BLOCK))
        return out.flatten(1)

    return run


@functools.cache
def flashmla_sparse() -> SimpleNamespace | None:
    """Binding 3: vLLM's vendored FlashMLA sparse decode (``attend``: ``flash_mla_with_kvcache``,
    ``SchedMeta``) and prefill (``prefill``: ``flash_mla_sparse_fwd``) kernels, or None where this build
    or device has none."""
    try:
        from vllm.v1.attention.ops import flashmla
    except ImportError:
        return None
    supported, reason = flashmla.is_flashmla_sparse_supported()
    if not supported:
        logger.info("vllm-dsv4: FlashMLA sparse attention unavailable (%s); using the Triton kernel", reason)
        return None
    return SimpleNamespace(attend=flashmla.flash_mla_with_kvcache, SchedMeta=flashmla.FlashMLASchedMeta,
                           prefill=flashmla.flash_mla_sparse_fwd)


@functools.cache
def _warn_once(message: str) -> None:
    """Each message once per process: the binding that emits it runs for every FP8 linear of every layer."""
    logger.warning("vllm-dsv4: %s", message)


def has_marlin_mxfp4_moe() -> bool:
    """Binding 2: whether this vLLM build and device run the Marlin MXFP4 MoE (asked in the worker)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe  # noqa: F401
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import is_fp4_marlin_supported
    except ImportError:
        return False
    return is_fp4_marlin_supported()


def marlin_mxfp4_experts(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                         swiglu_limit: float) -> Callable:
    """Binding 2: vLLM's Marlin MXFP4 MoE over one rank's packed experts (call once, after loading).

    Takes ``csrc_triton.moe_mxfp4.moe_experts_mxfp4``'s weights (``w13`` [E, 2I, D/2] codes, gate rows
    first, ``w2`` [E, D, I/2], e8m0 scales per 32 values) and returns ``run(x, weights, ids)`` with that
    function's semantics for ids in ``[0, E]``: id E is skipped (an expert map sends it to -1).
    """
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import prepare_moe_mxfp4_layer_for_marlin
    from vllm.scalar_type import scalar_types

    num_experts = w13.shape[0]
    m13, m2, s13, s2, _, _ = prepare_moe_mxfp4_layer_for_marlin(
        SimpleNamespace(params_dtype=torch.bfloat16), w13.view(torch.uint8), w2.view(torch.uint8),
        w13_scale.view(torch.uint8), w2_scale.view(torch.uint8), None, None)
    # Map slot E (moe.Experts' id for another rank's expert) to -1: Marlin skips it.
    expert_map = torch.cat([torch.arange(num_experts, dtype=torch.int32), torch.tensor([-1], dtype=torch.int32)])
    expert_map = expert_map.to(w13.device)

    def run(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(torch.int32)
        out = fused_marlin_moe(x.to(torch.bfloat16).contiguous(), m13, m2, None, None, s13, s2, weights.float(), ids,
                               quant_type_id=scalar_types.float4_e2m1f.id, global_num_experts=num_experts + 1,
                               activation=MoEActivation.SILU, expert_map=expert_map, clamp_limit=float(swiglu_limit))
        return out.to(x.dtype)

    return run
