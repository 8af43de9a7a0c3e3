"""The op implementations the model calls. Chosen once, at import.

Today every op is the PyTorch reference in ``csrc_triton/*_ref.py`` (also the CPU path); the GPU
issue swaps in the Triton kernels / vendored FlashMLA here, keeping these names and signatures.
"""

from csrc_triton.compressor_ref import compress_windows, state_rows
from csrc_triton.indexer_ref import indexer_topk
from csrc_triton.mhc_ref import hc_head, mhc_post, mhc_pre
from csrc_triton.norm_ref import rms_norm
from csrc_triton.rope_ref import apply_rope_tail, rope_inv_freq
from csrc_triton.routing_ref import moe_experts, route, swiglu_clamped
from csrc_triton.sparse_attn_ref import sparse_attn

__all__ = [
    "apply_rope_tail",
    "compress_windows",
    "hc_head",
    "indexer_topk",
    "mhc_post",
    "mhc_pre",
    "moe_experts",
    "rms_norm",
    "rope_inv_freq",
    "route",
    "sparse_attn",
    "state_rows",
    "swiglu_clamped",
]
