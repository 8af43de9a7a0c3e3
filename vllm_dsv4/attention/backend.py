"""One attention backend for every DSV4 cache component, and its per-step metadata builder.

DSV4 layers run their own forward (model/attention.py), so the backend only names the component
caches to vLLM, asks for a block-outermost layout (so components with different page sizes pack
into one block pool, vllm_plugin_surface.md §2.4) and builds the step metadata below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)


@dataclass(frozen=True)
class CacheStepMetadata:
    """Where one cache component's entries live in this step. R requests, T tokens.

    ``block_table`` [R, max_blocks] and ``slot_mapping`` [T] (token slot = block * block_tokens +
    offset, -1 for padding) are this component's KV-cache group's; the rest is shared by all groups.
    """

    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_tokens: int
    query_start_loc: torch.Tensor  # [R+1] int, CPU
    seq_lens: torch.Tensor  # [R] tokens known after this step, CPU
    token_to_req: torch.Tensor  # [T] int64

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def num_computed(self) -> torch.Tensor:
        """[R] tokens already in the cache before this step."""
        return self.seq_lens - self.query_lens


class CacheMetadataBuilder(AttentionMetadataBuilder[CacheStepMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes first: the model's prefill/decode split reads contiguous ranges.
        self._init_reorder_batch_threshold(1)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        cm = common_attn_metadata
        num_reqs = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: num_reqs + 1].to(torch.int64)
        query_lens = qsl[1:] - qsl[:-1]
        token_to_req = torch.repeat_interleave(torch.arange(num_reqs), query_lens)
        num_tokens = cm.num_actual_tokens
        if token_to_req.shape[0] < num_tokens:  # padded tail tokens belong to no request
            pad = torch.full((num_tokens - token_to_req.shape[0],), -1, dtype=torch.int64)
            token_to_req = torch.cat([token_to_req, pad])
        return CacheStepMetadata(
            block_table=cm.block_table_tensor[:num_reqs],
            slot_mapping=cm.slot_mapping[:num_tokens],
            block_tokens=self.kv_cache_spec.block_size,
            query_start_loc=qsl,
            seq_lens=cm.seq_lens[:num_reqs].to("cpu", torch.int64),
            token_to_req=token_to_req.to(cm.slot_mapping.device),
        )


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
        # vLLM 0.26 only (compat ledger 3): one latent entry per token slot.
        return (num_blocks, block_size, head_size)

    @classmethod
    def supported_kv_cache_layouts(cls):
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return (KVCacheLayout.BLHNC,)
