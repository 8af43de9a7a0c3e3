"""The op implementations the model calls, chosen once, at import.

With CUDA, the Triton kernels of ``csrc_triton/<op>.py`` (each tested against its reference in
tests/csrc_triton); otherwise the PyTorch references ``csrc_triton/<op>_ref.py``, which are the CPU
path. Same names and signatures either way. Ops without a kernel yet use the reference everywhere.
``VLLM_DSV4_OPS=reference`` forces the references on a GPU too (to bisect a kernel against them).
``block_fp8_gemm(weight, scale)`` binds one loaded FP8 weight to its GEMM: vLLM's block-FP8 kernel
(compat.py, ledger 6) with CUDA, ``csrc_triton/fp8_linear_ref.py`` otherwise. Attention over the
caches runs FlashMLA's sparse kernels where they apply (attention/flashmla.py, falling back to ours):
``sparse_attn_cached`` for decode steps (graph-capturable), ``sparse_attn_prefill`` (same semantics,
FlashMLA's prefill kernel, host syncs) for the others;
``VLLM_DSV4_ATTN=triton`` keeps our kernel everywhere. ``VLLM_DSV4_MOE=marlin`` opts into vLLM's
Marlin MoE; ``VLLM_DSV4_OUT_PROJ`` picks ``wo_a``'s path (``auto``: by step size; ``einsum``:
``rope_quant_fp8`` then DeepGEMM's grouped GEMM, ``grouped_fp8_gemm(weight, scale, groups)``).
"""

import os

import torch

from csrc_triton import routing_ref
from csrc_triton.rope_ref import rope_inv_freq

ON_CUDA = torch.cuda.is_available()
USE_KERNELS = ON_CUDA and os.environ.get("VLLM_DSV4_OPS", "triton") != "reference"
# Packed MXFP4 experts: our Triton MoE, or vLLM's Marlin MoE (compat.py ledger 7; 1.2x faster at decode
# sizes on the H200 (docs/bench, 2026-12-05), but opt-in: with it, CUDA-graph decode parts from eager in
# the e2e comparison although the op alone replays bit for bit; docs/bench, 2026-12-04c).
MOE_BACKEND = os.environ.get("VLLM_DSV4_MOE", "triton") if USE_KERNELS else "reference"
if MOE_BACKEND not in ("triton", "marlin", "reference"):
    raise ValueError(f"VLLM_DSV4_MOE={MOE_BACKEND!r}: use 'triton' or 'marlin'")
# wo_a with FP8 weights: our fused kernel (csrc_triton/out_proj.py) up to OUT_PROJ_FUSED_MAX_TOKENS
# tokens under "auto" (on the H200 at V4-Flash's shape: 116 vs 851 us at 1 token, 890 vs 1,201 at 1,024
# against per-group GEMMs, but 6,991 vs 2,109 at 8,192; docs/bench, 2026-12-03); above it our
# de-rotating quantiser then DeepGEMM's grouped GEMM where vLLM ships it (H200, 2026-12-04: prefill
# 39,875 -> 50,712 tok/s at 8k, 34,032 -> 48,754 at 32k), else the rope kernel then vLLM's block-FP8
# GEMM per head group. "fused", "grouped" and "einsum" take one path at every size.
OUT_PROJ = os.environ.get("VLLM_DSV4_OUT_PROJ", "auto") if USE_KERNELS else "reference"
if OUT_PROJ not in ("auto", "grouped", "fused", "einsum", "reference"):
    raise ValueError(f"VLLM_DSV4_OUT_PROJ={OUT_PROJ!r}: use 'auto', 'grouped', 'fused' or 'einsum'")
OUT_PROJ_FUSED_MAX_TOKENS = 1024
ATTN_BACKEND = os.environ.get("VLLM_DSV4_ATTN", "flashmla") if USE_KERNELS else "reference"
if ATTN_BACKEND not in ("flashmla", "triton", "reference"):
    raise ValueError(f"VLLM_DSV4_ATTN={ATTN_BACKEND!r}: use 'flashmla' or 'triton'")

if USE_KERNELS:
    from csrc_triton.compressor import pool_state_windows, write_state_rows
    from csrc_triton.indexer_topk import indexer_topk_paged
    from csrc_triton.kv_cache import read_entries
    from csrc_triton.kv_insert import norm_rope_insert
    from csrc_triton.mhc import hc_head, mhc_post, mhc_pre
    from csrc_triton.moe_mxfp4 import moe_experts_mxfp4
    from csrc_triton.norm import rms_norm
    from csrc_triton.out_proj import rope_out_proj, rope_quant_fp8
    from csrc_triton.rope import apply_rope_tail, norm_rope_tail
    from csrc_triton.routing import route, swiglu_clamped
    from vllm_dsv4.compat import block_fp8_gemm, grouped_fp8_gemm

    if ATTN_BACKEND == "flashmla":
        from vllm_dsv4.attention.flashmla import sparse_attn_cached, sparse_attn_prefill
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
    from csrc_triton.moe_mxfp4_ref import moe_experts_mxfp4
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
        from vllm_dsv4.compat import has_grouped_fp8_gemm

        return has_grouped_fp8_gemm()
    return out_proj == "einsum"
