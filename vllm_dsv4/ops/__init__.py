"""The op implementations the model calls, chosen once, at import.

With CUDA, the Triton kernels of ``csrc_triton/<op>.py`` (each tested against its reference in
tests/csrc_triton); otherwise the PyTorch references ``csrc_triton/<op>_ref.py``, which are the CPU
path. Same names and signatures either way. Ops without a kernel yet use the reference everywhere.
``block_fp8_gemm(weight, scale)`` binds one loaded FP8 weight to its GEMM: vLLM's block-FP8 kernel
(vllm_kernels.py, binding 1) with CUDA, ``csrc_triton/fp8_linear_ref.py`` otherwise. Attention over
the caches runs FlashMLA's sparse kernels where they apply (flashmla.py, falling back to ours):
``sparse_attn_cached`` for decode steps (graph-capturable), ``sparse_attn_prefill`` (same semantics,
FlashMLA's prefill kernel, host syncs) for the others. The switches (``VLLM_DSV4_OPS``, ``_MOE``,
``_BATCH_INVARIANT``, ``_OUT_PROJ``, ``_ATTN``) are envs.py's.
"""

import torch

from csrc_triton import routing_ref
from csrc_triton.rope_ref import rope_inv_freq
from vllm_dsv4 import envs

ON_CUDA = torch.cuda.is_available()
USE_KERNELS = ON_CUDA and envs.OPS.read() != "reference"
# Batch-invariant mode: a row's result never depends on the other rows of its step, nor on the padding
# rows a CUDA graph adds to reach its captured size, so CUDA-graph decode repeats eager bit for bit
# (tests/e2e/test_gpu_path.py).
BATCH_INVARIANT = USE_KERNELS and (envs.BATCH_INVARIANT.read() == "1" or bool(envs.VLLM_BATCH_INVARIANT.read()))
# Packed MXFP4 experts (vllm_kernels.py, binding 2): "auto" takes vLLM's Marlin MoE where vLLM ships it
# (faster per call than ours at decode and prefill sizes, docs/bench), but its tiling follows the row
# count, so a row's result moves by a bf16 rounding with the batch's padding; batch-invariant mode
# takes our Triton MoE, which reduces each row alone.
MOE_BACKEND = envs.MOE.read() if USE_KERNELS else "reference"
if BATCH_INVARIANT and MOE_BACKEND == "marlin":
    raise ValueError("VLLM_DSV4_MOE=marlin is not batch-invariant: unset it or VLLM_DSV4_BATCH_INVARIANT")
if BATCH_INVARIANT and MOE_BACKEND == "auto":
    MOE_BACKEND = "triton"
# wo_a with FP8 weights: our fused kernel (csrc_triton/out_proj.py) up to OUT_PROJ_FUSED_MAX_TOKENS
# tokens under "auto", where it beats one GEMM per head group; above it, where the fused kernel's
# per-token work loses to GEMMs, our de-rotating quantiser then DeepGEMM's grouped GEMM where vLLM ships
# it, else the rope kernel then vLLM's block-FP8 GEMM per head group (docs/bench has the measurements).
# "fused", "grouped" and "einsum" take one path at every size.
OUT_PROJ = envs.OUT_PROJ.read() if USE_KERNELS else "reference"
OUT_PROJ_FUSED_MAX_TOKENS = 1024
ATTN_BACKEND = envs.ATTN.read() if USE_KERNELS else "reference"

if USE_KERNELS:
    from csrc_triton.compressor import pool_state_windows, write_state_rows
    from csrc_triton.indexer_topk import indexer_topk_paged
    from csrc_triton.kv_cache import read_entries
    from csrc_triton.kv_insert import norm_rope_insert
    from csrc_triton.mhc import hc_head, mhc_post, mhc_pre
    from csrc_triton.moe_mxfp4 import moe_experts_fp8, moe_experts_mxfp4
    from csrc_triton.norm import rms_norm
    from csrc_triton.out_proj import rope_out_proj, rope_quant_fp8
    from csrc_triton.rope import apply_rope_tail, norm_rope_tail
    from csrc_triton.routing import route, swiglu_clamped
    from vllm_dsv4.ops.vllm_kernels import block_fp8_gemm, grouped_fp8_gemm

    if ATTN_BACKEND == "flashmla":
        from vllm_dsv4.ops.flashmla import sparse_attn_cached, sparse_attn_prefill
    else:
        from csrc_triton.sparse_attn import sparse_attn_cached

        sparse_attn_prefill = sparse_attn_cached
else:
    from csrc_triton.compressor_ref import pool_state_windows, write_state_rows
    from csrc_triton.fp8_linear_ref import block_fp8_gemm, grouped_fp8_gemm
    from csrc_triton.indexer_ref import indexer_topk_paged
    from csrc_triton.kv_cache_ref import read_entries
    from csrc_triton.kv_insert_ref import norm_rope_insert
    from csrc_triton.mhc_ref import hc_head, mhc_post, mhc_pre
    from csrc_triton.moe_mxfp4_ref import moe_experts_fp8, moe_experts_mxfp4
    from csrc_triton.norm_ref import rms_norm
    from csrc_triton.out_proj_ref import rope_out_proj, rope_quant_fp8
    from csrc_triton.rope_ref import apply_rope_tail, norm_rope_tail
    from csrc_triton.routing_ref import route, swiglu_clamped
    from csrc_triton.sparse_attn_ref import sparse_attn_cached

    sparse_attn_prefill = sparse_attn_cached

__all__ = [
    "apply_rope_tail",
    "block_fp8_gemm",
    "grouped_fp8_gemm",
    "hc_head",
    "indexer_topk_paged",
    "mhc_post",
    "mhc_pre",
    "moe_experts",
    "moe_experts_fp8",
    "moe_experts_mxfp4",
    "norm_rope_insert",
    "norm_rope_tail",
    "pool_state_windows",
    "read_entries",
    "rope_out_proj",
    "rope_quant_fp8",
    "rms_norm",
    "rope_inv_freq",
    "route",
    "sparse_attn_cached",
    "sparse_attn_prefill",
    "swiglu_clamped",
    "write_state_rows",
]


DENSE_EXPERTS_EVERY_EXPERT_MAX_TOKENS = 512  # vLLM's largest CUDA-graph size by default


def moe_experts(x, weights, ids, w13, w2, swiglu_limit):
    """Routed experts of a checkpoint with unquantised experts (no kernel: PyTorch everywhere). On a
    GPU, steps of up to ``DENSE_EXPERTS_EVERY_EXPERT_MAX_TOKENS`` tokens and every graph capture take
    the formulation without host reads, so that graphs and eager steps of one size compute alike."""
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing or (x.is_cuda and x.shape[0] <= DENSE_EXPERTS_EVERY_EXPERT_MAX_TOKENS):
        return routing_ref.moe_experts_every_expert(x, weights, ids, w13, w2, swiglu_limit)
    return routing_ref.moe_experts(x, weights, ids, w13, w2, swiglu_limit)


def binds_grouped_gemm(out_proj: str) -> bool:
    """Whether an FP8 ``wo_a`` binds one grouped GEMM (``grouped_fp8_gemm``) under ``out_proj``: with
    ``einsum``, and with ``auto`` where DeepGEMM's exists (asked at bind time, in the worker: it reads
    the GPU)."""
    if out_proj == "auto" and USE_KERNELS:
        from vllm_dsv4.ops import vllm_kernels

        return vllm_kernels.has_grouped_fp8_gemm()
    return out_proj == "einsum"
