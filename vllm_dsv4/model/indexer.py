"""Lightning indexer: picks, per query, the top-k visible C4 entries (§5.5)."""

from __future__ import annotations

import torch
from torch import nn

from vllm_dsv4 import ops
from vllm_dsv4.config import Dsv4Config, LayerKind
from vllm_dsv4.kv.layer import CacheLayer
from vllm_dsv4.model.compressor import Compressor, visible_entries
from vllm_dsv4.model.layers import Linear


class Indexer(nn.Module):
    """Scores compressed indexer keys against per-head queries from the q latent ``c_q``."""

    def __init__(self, cfg: Dsv4Config, inv_freq: torch.Tensor, state_cache: CacheLayer, key_cache: CacheLayer,
                 max_model_len: int):
        super().__init__()
        self.num_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.num_heads * self.head_dim)
        self.weights_proj = Linear(cfg.hidden_size, self.num_heads)
        self.compressor = Compressor(LayerKind.C4, cfg.hidden_size, self.head_dim, cfg.rms_norm_eps, inv_freq,
                                     state_cache, key_cache)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.key_cache = key_cache
        self.weight_scale = self.head_dim**-0.5 * self.num_heads**-0.5
        self.max_entries = -(-max_model_len // LayerKind.C4.ratio)  # the decode path's fixed score width

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, D], q_latent [T, q_lora] -> selected C4 entry numbers [T, topk], -1 where none.

        Every query is scored against its own request's keys, read through the block table: a
        prefill chunk's queries share their request's keys, a batch of decodes each has its own.
        """
        self.compressor(x, positions)
        md = self.key_cache.metadata()
        q = self.wq_b(q_latent).view(-1, self.num_heads, self.head_dim)  # [T, Hi, di]
        q = ops.apply_rope_tail(q, positions, self.inv_freq)
        weights = self.weights_proj(x)  # [T, Hi], scaled by weight_scale in fp32 inside the op
        num_visible, width = visible_entries(md, positions, LayerKind.C4, self.max_entries)
        comp = self.key_cache.component
        return ops.indexer_topk_paged(q, weights, self.key_cache.view, md.block_table, md.token_to_req, num_visible,
                                      comp.entries_per_block, comp.fp8, self.topk, width, self.weight_scale)
