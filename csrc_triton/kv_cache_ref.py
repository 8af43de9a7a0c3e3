"""Cache entries read and written through the block table (PyTorch reference, also the CPU path).

Entry ``e`` of request ``r`` lives at ``view[block_table[r, e // E], e % E]`` with ``E`` entries per
block (docs/ARCHITECTURE.md, "KV cache"). Raw components store values as they are; FP8 components
store the entries of :mod:`csrc_triton.kv_pack_ref` (584 B main KV, 132 B indexer keys), encoded
on write and decoded on read; a block's main entries in FlashMLA's arrangement (data parts, then
scale parts: ``kv_pack_ref.main_page_parts``). ``fp8`` is anything with ``value_dim`` and ``rope_dim`` (``None`` for
an indexer key), e.g. ``vllm_dsv4.kv.layout.Fp8Entry``.

Bytes per entry read (V4, FP8 main KV, bf16 out): 584 in, 1024 out, plus the block-table lookup;
here the gather is one pass and the decode a few more over fp32 temporaries ([T, K, 584] bytes,
[T, K, 512] fp32), which the kernel (``kv_cache.py``) fuses into one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from csrc_triton.formats import main_page_parts
from csrc_triton.kv_pack_ref import pack_index, pack_main, unpack_index, unpack_main


def _address(block_table: Tensor, req: Tensor, entry: Tensor, entries_per_block: int) -> tuple[Tensor, Tensor]:
    """(physical block, offset in the block), both int64 and broadcast over ``req`` and ``entry``."""
    block = block_table[req, torch.div(entry, entries_per_block, rounding_mode="floor")]  # [...]
    return block.long(), entry % entries_per_block


def read_entries(view: Tensor, block_table: Tensor, req: Tensor, entry: Tensor, entries_per_block: int,
                 fp8, out_dtype: torch.dtype) -> Tensor:
    """Entries ``entry`` of requests ``req``, decoded.

    Args:
        view: ``[num_blocks, E, C]`` one component's entries (raw dtype, or uint8 FP8 entries); any strides.
        block_table: ``[R, max_blocks]`` int32 / int64 physical block ids.
        req: request of each entry, int; broadcasts with ``entry``.
        entry: entry numbers (>= 0, within the request's allocated blocks), int.
        entries_per_block: ``E``.
        fp8: None (raw entries) or the FP8 entry spec (``value_dim``, ``rope_dim``).
        out_dtype: dtype of the result.

    Returns:
        ``[..., value_dim]`` in ``out_dtype`` (``value_dim = C`` for raw entries).
    """
    block, offset = _address(block_table, req, entry, entries_per_block)  # [...]
    at = block.flatten(), offset.expand_as(block).flatten()
    if fp8 is None:
        values = view[at].to(out_dtype)  # [N, C]
    elif fp8.rope_dim is None:
        values = unpack_index(view[at], out_dtype)
    else:
        data, scales = main_page_parts(view, fp8.value_dim, fp8.rope_dim)
        values = unpack_main(torch.cat([data[at], scales[at]], -1), fp8.value_dim, fp8.rope_dim, out_dtype)
    return values.view(*block.shape, values.shape[-1])  # [..., value_dim]


def write_entries(view: Tensor, block_table: Tensor, req: Tensor, entry: Tensor, entries_per_block: int,
                  values: Tensor, fp8) -> None:
    """Store ``values`` ``[..., value_dim]`` as entries ``entry`` of requests ``req`` (both broadcast
    to ``values.shape[:-1]``), encoded when ``fp8`` is set, cast to ``view.dtype`` otherwise.
    Rows with ``req < 0`` (padding) are not written."""
    shape = values.shape[:-1]
    keep = req.expand(shape) >= 0  # boolean indexing syncs with the device; the kernel masks instead
    values, req, entry = values[keep], req.expand(shape)[keep], entry.expand(shape)[keep]  # [N, value_dim], [N]
    block, offset = _address(block_table, req, entry, entries_per_block)
    if fp8 is None:
        view[block, offset] = values.to(view.dtype)
    elif fp8.rope_dim is None:
        view[block, offset] = pack_index(values)
    else:
        packed = pack_main(values, fp8.rope_dim)  # [N, C]
        data, scales = main_page_parts(view, fp8.value_dim, fp8.rope_dim)
        data[block, offset] = packed[:, : data.shape[-1]]
        scales[block, offset] = packed[:, data.shape[-1] :]
