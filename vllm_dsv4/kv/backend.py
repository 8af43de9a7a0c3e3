"""The attention backend every DSV4 cache component reports to vLLM.

DSV4 layers run their own forward (model/attention.py), so the backend only names the component
caches to vLLM, asks for the block-outermost layout (``BLHNC``: vLLM 0.32 then packs components with
different page sizes into one block pool) and names the per-step metadata builder (kv/metadata.py).
"""

from __future__ import annotations

from vllm.v1.attention.backend import AttentionBackend, MultipleOf

from vllm_dsv4.kv.metadata import CacheMetadataBuilder


class CacheBackend(AttentionBackend):
    """Backend of every DSV4 cache component (names other registries see carry our prefix)."""

    @staticmethod
    def get_name() -> str:
        return "DSV4_PLUGIN_CACHE"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("DSV4 cache layers run their own forward; there is no impl")

    @staticmethod
    def get_builder_cls():
        return CacheMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(1)]

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        # vLLM 0.26 only (compat adapter 3): one latent entry per token slot.
        return (num_blocks, block_size, head_size)

    @classmethod
    def supported_kv_cache_layouts(cls):
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return (KVCacheLayout.BLHNC,)
