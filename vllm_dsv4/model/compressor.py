"""Learned gated pooling of every ``ratio`` tokens into one compressed KV entry (§5.4)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from vllm_dsv4.config import LayerKind
from vllm_dsv4.kv.layer import CacheLayer
from vllm_dsv4.kv.metadata import CacheStepMetadata
from vllm_dsv4.model.layers import Linear, RMSNorm, fp32_param


class Compressor(nn.Module):
    """Writes the entries closed in this step into ``out_cache``.

    Every token's ``[kv | gate + ape]`` row goes to ``state_cache`` (a sliding window of the last
    ``coff * ratio`` tokens, ``coff = kind.overlap``). A token at position p with (p+1) % ratio == 0
    closes entry w = p // ratio: its window rows are read back, pooled, normed, roped at w * ratio and
    stored.
    """

    def __init__(self, kind: LayerKind, hidden_size: int, head_dim: int, eps: float, inv_freq: torch.Tensor,
                 state_cache: CacheLayer, out_cache: CacheLayer):
        super().__init__()
        self.kind, self.ratio, self.head_dim = kind, kind.ratio, head_dim
        ratio, coff = kind.ratio, kind.overlap
        self.overlap = coff > 1
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
        # Which windows close depends on the step's tokens only: the first compressor of this kind
        # works it out and every later layer's reuses it (a CUDA graph replays that first computation).
        closed = md_state.plan.closed_windows.once(self.kind, lambda: self._closed_windows(
            req, positions, md_state.decode_only, md_state.block_table.shape[0]))
        pooled = self.state_cache.pool_windows(md_state, closed.out_req[:, None], closed.read_entry, closed.valid,
                                               self.overlap, self.head_dim)  # [N, d]; 0 where not stored
        self.out_cache.insert(md_out, pooled, self.norm, closed.rope_positions, self.inv_freq, closed.out_req,
                              closed.entry)

    def _closed_windows(self, req: torch.Tensor, positions: torch.Tensor, decode_only: bool,
                        num_reqs: int) -> ClosedWindows:
        """The windows this step's tokens close: a token at p with (p+1) % ratio == 0 closes entry
        p // ratio, roped at its window's first position. Fixed-size lists, no host read."""
        closing = (req >= 0) & ((positions + 1) % self.ratio == 0)
        if decode_only:  # fixed shapes: a row per token, the closing ones pooled and stored
            pos, out_req = positions, torch.where(closing, req, -1)
        else:  # the closing tokens, packed in order into a list of the most that can close
            # (each request's tokens have consecutive positions: n of them close at most n // ratio + 1
            # windows), padded with request -1 (neither pooled nor stored)
            T = positions.shape[0]
            size = T // self.ratio + num_reqs
            torch._assert_async(closing.sum() <= size)
            place = torch.where(closing, closing.cumsum(0) - 1, size)  # [T]; the others to slot `size`
            token = torch.full((size + 1,), T, dtype=torch.int64, device=req.device)  # T: the padding row
            token = token.scatter_(0, place, torch.arange(T, device=req.device))[:size]  # [N]
            pos = torch.cat([positions, positions.new_zeros(1)])[token]
            out_req = torch.cat([req, req.new_full((1,), -1)])[token]
        window = pos[:, None] + self.window_offsets  # [N, S]
        return ClosedWindows(read_entry=window.clamp(min=0), valid=window >= 0, rope_positions=pos - self.ratio + 1,
                             out_req=out_req, entry=torch.div(pos, self.ratio, rounding_mode="floor"))


def visible_entries(md: CacheStepMetadata, positions: torch.Tensor, kind: LayerKind,
                    max_entries: int) -> tuple[torch.Tensor, int]:
    """``(num_visible [T], width)``: the compressed entries of ``kind`` each query sees, (p + 1) // ratio,
    and how many a step scores or attends: ``max_entries`` in decode steps (fixed shapes, what a CUDA
    graph replays), else the step's largest count, from the longest request's length on the host (a
    query at p sees (p + 1) // ratio); either rounded up to a multiple of 16: Triton compiles the
    kernels that take the width (scores, selection, attention, slot lists) once for widths divisible
    by 16 and once for others, so a width that followed the step's length would compile while
    serving. Once per step: every layer's are the same."""

    def count():
        num_visible = torch.div(positions + 1, kind.ratio, rounding_mode="floor")
        width = max_entries if md.decode_only else max(md.max_seq_len // kind.ratio, 1)
        return num_visible, -(-width // 16) * 16

    return md.plan.visible_entries.once(kind, count)


class ClosedWindows(NamedTuple):
    """The compressed entries a step closes, N of them: where their window rows are pooled from (state
    entries [N, S], which rows exist [N, S]) and where each pooled entry goes (rope position, request
    (-1: neither pooled nor stored), entry number; [N] each)."""

    read_entry: torch.Tensor
    valid: torch.Tensor
    rope_positions: torch.Tensor
    out_req: torch.Tensor
    entry: torch.Tensor
