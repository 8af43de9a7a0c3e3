"""Lightning indexer: picks, per query, the top-k visible C4 entries (§5.5)."""

from __future__ import annotations

import torch
from torch import nn

from vllm_dsv4 import ops
from vllm_dsv4.config import Dsv4Config
from vllm_dsv4.model.cache import CacheLayer
from vllm_dsv4.model.compressor import Compressor
from vllm_dsv4.model.layers import Linear


class Indexer(nn.Module):
    """Scores compressed indexer keys against per-head queries from the q latent ``c_q``."""

    def __init__(self, cfg: Dsv4Config, inv_freq: torch.Tensor, state_cache: CacheLayer, key_cache: CacheLayer):
        super().__init__()
        self.num_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.num_heads * self.head_dim)
        self.weights_proj = Linear(cfg.hidden_size, self.num_heads)
        self.compressor = Compressor(4, cfg.hidden_size, self.head_dim, cfg.rms_norm_eps, inv_freq,
                                     state_cache, key_cache)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.key_cache = key_cache
        self.weight_scale = self.head_dim**-0.5 * self.num_heads**-0.5

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, D], q_latent [T, q_lora] -> selected C4 entry numbers [T, topk], -1 where none."""
        self.compressor(x, positions)
        md = self.key_cache.metadata()
        q = self.wq_b(q_latent).view(-1, self.num_heads, self.head_dim)  # [T, Hi, di]
        q = ops.apply_rope_tail(q, positions, self.inv_freq)
        weights = self.weights_proj(x).float() * self.weight_scale  # [T, Hi]
        num_visible = torch.div(positions + 1, 4, rounding_mode="floor")  # [T]
        selected = torch.full((x.shape[0], self.topk), -1, dtype=torch.long, device=x.device)
        qsl = md.query_start_loc.tolist()
        for r in range(md.num_reqs):  # keys differ per request; tokens of a request are batched
            rows = slice(qsl[r], qsl[r + 1])
            num_entries = int(num_visible[rows].max()) if qsl[r + 1] > qsl[r] else 0
            if num_entries == 0:
                continue
            entries = torch.arange(num_entries, device=x.device)
            keys = self.key_cache.read(md, torch.tensor(r, device=x.device), entries)  # [N, di]
            selected[rows] = ops.indexer_topk(q[rows], weights[rows], keys.float(), num_visible[rows], self.topk)
        return selected
