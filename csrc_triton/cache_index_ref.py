"""Slot lists -> global cache indices, the sparse-index format of FlashMLA's kernels (PyTorch
reference, also the oracle of ``cache_index.py``).

A slot names entry ``e`` of request ``r`` (a window position or a compressed entry number; -1 for an
empty slot). FlashMLA reads a paged cache as one flat array of entries, so the slot becomes the
entry's global index ``block_table[r, e // E] * E + e % E`` (E entries per block), -1 where the slot
is empty or the query is padding (``r < 0``). Lists are padded with -1 to a multiple of ``align``
(FlashMLA's index blocks), and each query's length is one past its last valid slot (FlashMLA's
``topk_length``: a fixed-width decode list then costs only its valid prefix).
"""

from __future__ import annotations

import torch
from torch import Tensor


def global_slots(block_table: Tensor, entries_per_block: int, req: Tensor, entries: Tensor,
                 align: int) -> tuple[Tensor, Tensor]:
    """``(index [T, K'] int32, lengths [T] int32)``, K' = K rounded up to ``align`` (at least ``align``).

    Args:
        block_table: ``[R, max_blocks]`` int physical block ids of the component.
        entries_per_block: E.
        req: ``[T]`` request of each query, -1 for padding rows.
        entries: ``[T, K]`` entry numbers, -1 for empty slots; valid ones lie in the request's blocks.
        align: the padding multiple.
    """
    K = entries.shape[1]
    E = entries_per_block
    valid = (entries >= 0) & (req[:, None] >= 0)  # [T, K]
    e = entries.clamp(min=0).long()
    block = block_table[req.clamp(min=0).long()[:, None], e // E].long()  # [T, K]
    index = torch.where(valid, block * E + e % E, -1).to(torch.int32)
    width = max(align, -(-K // align) * align)
    index = torch.nn.functional.pad(index, (0, width - K), value=-1)  # [T, K']
    position = torch.arange(1, width + 1, device=entries.device, dtype=torch.int32)
    return index, torch.where(index >= 0, position, 0).amax(-1)
