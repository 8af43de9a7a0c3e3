"""Lightning indexer: picks, per query, the top-k visible C4 entries (§5.5)."""

from __future__ import annotations

import torch
from torch import nn

from vllm_dsv4 import ops
from vllm_dsv4.config import Dsv4Config
from vllm_dsv4.model.cache import CacheLayer
from vllm_dsv4.model.compressor import Compressor
from vllm_dsv4.model.layers import Linear


# Key entries gathered per batched decode call (requests x longest visible prefix): 2^22 x 128 values.
DECODE_GATHER_ENTRIES = 1 << 22


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
        qsl = md.query_start_loc  # CPU
        single = (qsl[1:] - qsl[:-1]) == 1
        decodes = torch.nonzero(single).flatten()
        if len(decodes):  # batched: each token against its own request's keys, padded to the group's longest
            rows = qsl[decodes]
            visible = num_visible[rows.to(x.device)].cpu()
            for group in groups_by_length(visible, DECODE_GATHER_ENTRIES):
                r = rows[group].to(x.device)
                selected[r] = self._select(md, q[r], weights[r], num_visible[r], decodes[group].to(x.device)[:, None],
                                           int(visible[group[0]]))
        for r in torch.nonzero(~single & (qsl[1:] > qsl[:-1])).flatten().tolist():  # prefill chunks, one by one
            rows = slice(int(qsl[r]), int(qsl[r + 1]))  # a request's tokens share its keys
            selected[rows] = self._select(md, q[rows], weights[rows], num_visible[rows],
                                          torch.tensor(r, device=x.device), int(num_visible[rows].max()))
        return selected

    def _select(self, md, q, weights, num_visible, req, num_entries: int) -> torch.Tensor:
        """Top-k among the first ``num_entries`` keys of request(s) ``req`` (a scalar, or [B, 1] per row)."""
        if num_entries == 0:
            return torch.full((q.shape[0], self.topk), -1, dtype=torch.long, device=q.device)
        keys = self.key_cache.read(md, req, torch.arange(num_entries, device=q.device))  # [N, di] or [B, N, di]
        return ops.indexer_topk(q, weights, keys.to(q.dtype), num_visible, self.topk)


def groups_by_length(lengths: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """Indices of ``lengths``, longest first, in groups whose size x longest length stays within ``budget``."""
    order = torch.argsort(lengths, descending=True)
    groups, start = [], 0
    while start < len(order):
        size = max(1, budget // max(int(lengths[order[start]]), 1))
        groups.append(order[start : start + size])
        start += size
    return groups
