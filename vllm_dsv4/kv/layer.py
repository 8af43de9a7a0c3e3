"""A cache component as vLLM sees it: a layer that owns one KV-cache spec and its paged view."""

from __future__ import annotations

import torch
from torch import nn
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

from csrc_triton.paged import CacheSource
from vllm_dsv4 import compat, ops
from vllm_dsv4.kv.backend import CacheBackend
from vllm_dsv4.kv.layout import Component
from vllm_dsv4.kv.metadata import CacheStepMetadata
from vllm_dsv4.kv.spec import component_spec


class CacheLayer(nn.Module, AttentionLayerBase):
    """Registers ``prefix`` with vLLM so the allocator gives it pages; reads/writes entries by index.

    Entry ``e`` of request ``r`` lives at ``view[block_table[r, e // E], e % E]`` with E entries per
    block. Per-token caches index entries by token position, compressed caches by entry number.
    FP8 components encode on write; attention decodes them where it reads them (``source``).
    """

    def __init__(self, component: Component, prefix: str, vllm_config):
        super().__init__()
        self.component = component
        self.prefix = prefix
        self.kv_cache = torch.tensor([])
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    def get_attn_backend(self):
        return CacheBackend

    def get_kv_cache_spec(self, vllm_config):
        return component_spec(self.component)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def metadata(self) -> CacheStepMetadata | None:
        """This step's metadata; None in vLLM's profile and dummy runs."""
        attn_metadata = get_forward_context().attn_metadata
        return attn_metadata.get(self.prefix) if isinstance(attn_metadata, dict) else None

    @property
    def view(self) -> torch.Tensor:
        """The bound pages as ``[num_blocks, entries_per_block, entry_elems]``."""
        return compat.cache_view(self.kv_cache)

    def source(self, md: CacheStepMetadata, plans: dict | None = None) -> CacheSource:
        """This step's pages as a key source that kernels read by (request, entry); ``plans``: the
        scratch of calls with equal slot-list lengths (``CacheSource.plans``, ``StepPlan.call_scratch``)."""
        comp = self.component
        return CacheSource(self.view, md.block_table, comp.entries_per_block, comp.fp8, plans)

    def write_state(self, md: CacheStepMetadata, req: torch.Tensor, positions: torch.Tensor, kv_proj: torch.Tensor,
                    gate_proj: torch.Tensor, ape: torch.Tensor) -> None:
        """Store each token's compressor state row ``[kv | gate + ape[p mod m]]`` as entry ``positions`` of
        ``req`` (rows with req < 0: none); one fused op."""
        ops.write_state_rows(self.view, md.block_table, req, positions, self.component.entries_per_block, kv_proj,
                             gate_proj, ape)

    def insert(self, md: CacheStepMetadata, x: torch.Tensor, norm, rope_positions: torch.Tensor,
               inv_freq: torch.Tensor, req: torch.Tensor, entry: torch.Tensor) -> None:
        """Store ``rope(norm(x))`` [N, C], roped at ``rope_positions``, as entries ``entry`` of ``req``
        (rows with req < 0: none); one fused op."""
        comp = self.component
        ops.norm_rope_insert(x, norm.weight, norm.eps, rope_positions, inv_freq, self.view, md.block_table, req,
                             entry, comp.entries_per_block, comp.fp8)

    def pool_windows(self, md: CacheStepMetadata, req: torch.Tensor, entry: torch.Tensor, valid: torch.Tensor,
                     overlap: bool, d: int) -> torch.Tensor:
        """The compressor's pooled windows [N, d] fp32 of this state cache's rows: slot s of window w
        is entry ``entry[w, s]`` of request ``req[w]`` ([N, 1]); read in place, one fused op."""
        return ops.pool_state_windows(self.view, md.block_table, req, entry, valid, overlap, d,
                                      self.component.entries_per_block)
