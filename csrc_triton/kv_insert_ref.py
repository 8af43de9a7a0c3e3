"""RMSNorm, RoPE tail and cache insert of one vector per row (PyTorch reference, also the CPU path).

``value = apply_rope_tail(rms_norm(x, w, eps), positions, inv_freq)`` stored as entry ``entry`` of
request ``req`` (``kv_cache_ref.write_entries``): the new token's KV into ``swa`` (``kv_norm``, roped
at the token's position, docs/MODEL.md §5.1) and each closed window into ``c4`` / ``c128`` /
``indexer`` (``compressor.norm``, roped at the window start, §5.4). The value is rounded to
``x.dtype`` after the norm and after the rotation, as the unfused ops return it, then encoded (FP8
entries) or cast to the view's dtype (raw entries).

Bytes per row (V4 main KV, bf16 x, FP8 entry): 1024 in, 584 out, plus the weight (shared) and the
row's position, request, entry and block-table entry. Here the norm, the rotation and the packing each
make a pass over ``[N, C]`` temporaries, which the kernel (``kv_insert.py``) fuses into one.
"""

from __future__ import annotations

from torch import Tensor

from csrc_triton.kv_cache_ref import write_entries
from csrc_triton.norm_ref import rms_norm
from csrc_triton.rope_ref import apply_rope_tail


def norm_rope_insert(x: Tensor, norm_weight: Tensor, eps: float, rope_positions: Tensor, inv_freq: Tensor,
                     view: Tensor, block_table: Tensor, req: Tensor, entry: Tensor, entries_per_block: int,
                     fp8) -> None:
    """Write ``apply_rope_tail(rms_norm(x, norm_weight, eps), rope_positions, inv_freq)`` of rows with ``req >= 0``.

    Args:
        x: ``[N, C]`` bf16 / fp32, one vector per row (C = 512 main KV, 128 indexer keys).
        norm_weight: ``[C]`` RMSNorm weight; eps: its epsilon.
        rope_positions: ``[N]`` int, the position each row is rotated at.
        inv_freq: ``[r / 2]`` fp32 (``rope_ref.rope_inv_freq``); the last ``r`` channels rotate.
        view, block_table, entries_per_block, fp8: as for ``kv_cache_ref.write_entries``.
        req: ``[N]`` int request of each row; rows with ``req < 0`` (padding) are not written.
        entry: ``[N]`` int entry number of each row (``>= 0`` where ``req >= 0``); each (request,
            entry) at most once.
    """
    keep = req >= 0  # [N]; boolean indexing syncs with the device, the kernel masks instead
    value = apply_rope_tail(rms_norm(x[keep], norm_weight, eps), rope_positions[keep], inv_freq)  # [M, C]
    write_entries(view, block_table, req[keep], entry[keep], entries_per_block, value, fp8)
