"""Learned gated pooling of every ``ratio`` tokens into one compressed KV entry (§5.4)."""

from __future__ import annotations

import torch
from torch import nn

from vllm_dsv4 import ops
from vllm_dsv4.model.cache import CacheLayer
from vllm_dsv4.model.layers import Linear, RMSNorm, fp32_param


class Compressor(nn.Module):
    """Writes the entries closed in this step into ``out_cache``.

    Every token's ``[kv | gate + ape]`` row goes to ``state_cache`` (a sliding window of the last
    ``coff * ratio`` tokens). A token at position p with (p+1) % ratio == 0 closes entry
    w = p // ratio: its window rows are read back, pooled, normed, roped at w * ratio and stored.
    """

    def __init__(self, ratio: int, hidden_size: int, head_dim: int, eps: float, inv_freq: torch.Tensor,
                 state_cache: CacheLayer, out_cache: CacheLayer):
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, ratio == 4
        coff = 2 if self.overlap else 1
        self.wkv_gate = Linear(hidden_size, 2 * coff * head_dim)  # official wkv, wgate rows
        self.ape = fp32_param(ratio, coff * head_dim)
        self.norm = RMSNorm(head_dim, eps)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # row s of the window closed by the token at p is position p - coff * ratio + 1 + s
        self.register_buffer("window_offsets", torch.arange(1 - coff * ratio, 1), persistent=False)
        self.state_cache, self.out_cache = state_cache, out_cache

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> None:
        """x [T, D] post-attn_norm hidden, positions [T]."""
        md_state, md_out = self.state_cache.metadata(), self.out_cache.metadata()
        req = md_state.token_to_req  # [T], -1 for padding
        kv, gate = self.wkv_gate(x).chunk(2, dim=-1)
        self.state_cache.write_state(md_state, req, positions, kv, gate, self.ape)

        closing = (req >= 0) & ((positions + 1) % self.ratio == 0)
        if md_state.decode_only:  # fixed shapes: every token pools its window, the closing ones are stored
            pos, r, out_req = positions, req, torch.where(closing, req, -1)
        elif bool(closing.any()):
            pos, r = positions[closing], req[closing]  # [N]
            out_req = r
        else:
            return
        window = pos[:, None] + self.window_offsets  # [N, S]
        valid = window >= 0
        rows = self.state_cache.read(md_state, r.clamp(min=0)[:, None], window.clamp(min=0))  # [N, S, 2*coff*d]
        pooled = ops.compress_windows(rows, valid, self.overlap, self.head_dim)  # [N, d]
        self.out_cache.insert(md_out, pooled, self.norm, pos - self.ratio + 1, self.inv_freq, out_req,
                              torch.div(pos, self.ratio, rounding_mode="floor"))
