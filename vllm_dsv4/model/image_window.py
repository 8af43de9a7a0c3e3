"""The sliding window inside image blocks (docs/VISION.md §8): during prefill a token of an image block sees
the whole block, both ways, besides its usual causal window. Compressed entries and the indexer stay causal.

A block is the tokens from an IMAGE_START to the next IMAGE_END of the same request (the alignment
PADs before START are outside). The scheduler never ends a step inside one (vision/schedule.py), so a
prefill step holds each block it touches whole, and blocks are found in the step's own token ids.
"""

from __future__ import annotations

import torch

from vllm_dsv4.config import IMAGE_END, IMAGE_START, SENTINEL_BASE_ID

START_ID, END_ID = SENTINEL_BASE_ID + IMAGE_START, SENTINEL_BASE_ID + IMAGE_END


def image_blocks(input_ids: torch.Tensor, req: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, last) [T]: the positions of the START and END of the image block each token of the step
    is in, -1 for tokens outside any. A START counts with the next END of its request if no START
    comes between (a START or END without its partner opens no block)."""
    T = input_ids.shape[0]
    idx = torch.arange(T, device=input_ids.device)
    is_start, is_end = input_ids == START_ID, input_ids == END_ID
    start = torch.cummax(torch.where(is_start, idx, -1), 0).values  # [T] latest START at or before t
    end = _next(torch.where(is_end, idx, T))  # [T] earliest END at or after t
    start_after = _next(torch.where(is_start, idx, T)[1:].contiguous(), T)  # [T] earliest START after t
    s, e = start.clamp(min=0), end.clamp(max=T - 1)
    paired = (is_start & (end < T) & (req[e] == req) & (start_after > end))[s]  # [T] t's START opens a block
    inside = (start >= 0) & paired & (idx <= end[s]) & (req >= 0)
    first = torch.where(inside, positions[s], -1)
    last = torch.where(inside, positions[end[s].clamp(max=T - 1)], -1)
    return first, last


def _next(marks: torch.Tensor, fill: int | None = None) -> torch.Tensor:
    """Suffix minimum of ``marks`` (the earliest mark at or after each index), a ``fill`` appended when given."""
    if fill is not None:
        marks = torch.cat([marks, marks.new_full((1,), fill)])
    return torch.flip(torch.cummin(torch.flip(marks, [0]), 0).values, [0])


def window_entries(positions: torch.Tensor, window: int, first: torch.Tensor | None = None,
                   last: torch.Tensor | None = None, *, reach: int | None = None) -> torch.Tensor:
    """Window slots [T, W'] of each query: the positions ``p - window + 1 .. p``, widened for a token of an
    image block to ``min(p - window + 1, max(first, p - reach + 1)) .. min(last, p + reach)``; -1 for an
    empty slot. ``reach`` (with blocks): ``vision_max_n_token``, the reference's bound (a real block is shorter, so it
    never binds; sentinel ids sent as prompt tokens can pair into a longer one). ``W' = window`` without
    blocks, else at most ``window + 2 * reach``."""
    lo, hi = positions - window + 1, positions
    if first is not None:
        inside = first >= 0
        lo = torch.where(inside, torch.minimum(lo, torch.maximum(first, positions - reach + 1)), lo)
        hi = torch.where(inside, torch.minimum(last, positions + reach), hi)
    width = int((hi - lo).max()) + 1 if first is not None and positions.numel() else window
    entries = lo[:, None] + torch.arange(width, device=positions.device)  # [T, W']
    return torch.where(entries <= hi[:, None], entries, -1).clamp_(min=-1)
