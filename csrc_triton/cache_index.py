"""Slot lists -> global cache indices in one Triton kernel (semantics and oracle:
``cache_index_ref.global_slots``).

The reference's ~20 elementwise and gather launches per slot list (twice per attention layer on the
FlashMLA path, every decode step) become one: a program per query walks its slot list in blocks,
looks each valid slot's block up in the block table, writes the global index (-1 elsewhere, up to
the padded width) and the query's length. Bytes: ``4 T K`` slots in, ``4 T K'`` indices out, one
block-table read per valid slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 128


@triton.jit(do_not_specialize=["K", "s_et"])
def _global_slots_kernel(
    bt_ptr, req_ptr, entries_ptr, index_ptr, length_ptr,
    K, width, E, s_b0, s_b1, s_et, s_ek,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    r = tl.load(req_ptr + t).to(tl.int64)
    last = tl.zeros([BLOCK], tl.int32)  # per lane: one past the last valid slot seen
    for k0 in range(0, width, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        e = tl.load(entries_ptr + t * s_et + k * s_ek, mask=k < K, other=-1).to(tl.int64)
        valid = tl.where(r >= 0, e, -1) >= 0  # a padding row (r < 0) has only empty slots
        block = tl.load(bt_ptr + r * s_b0 + (e // E) * s_b1, mask=valid, other=0).to(tl.int64)
        tl.store(index_ptr + t * width + k, tl.where(valid, block * E + e % E, -1).to(tl.int32), mask=k < width)
        last = tl.maximum(last, tl.where(valid, k + 1, 0).to(tl.int32))
    tl.store(length_ptr + t, tl.max(last, 0))


def global_slots(block_table: Tensor, entries_per_block: int, req: Tensor, entries: Tensor,
                 align: int) -> tuple[Tensor, Tensor]:
    """Triton :func:`cache_index_ref.global_slots` (same arguments and results)."""
    T, K = entries.shape
    width = max(align, -(-K // align) * align)
    index = torch.empty(T, width, dtype=torch.int32, device=entries.device)
    lengths = torch.empty(T, dtype=torch.int32, device=entries.device)
    if T:
        _global_slots_kernel[(T,)](
            block_table, req, entries, index, lengths, K, width, entries_per_block,
            *block_table.stride(), *entries.stride(), BLOCK=BLOCK,
        )
    return index, lengths
