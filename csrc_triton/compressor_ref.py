"""KV compressor pooling (docs/MODEL.md §5.4; also the indexer's key compressor, §5.5 step 1).

Each token j contributes a fp32 *state row* ``[a_j | z_j + ape[j mod m]]`` (c*d values each, c = 1
for HCA, c = 2 for CSA). A compressed entry is a per-channel softmax over its window's scores,
weighting the values. The caller applies ``compressor.norm`` (:func:`norm_ref.rms_norm`) and RoPE at
position ``w * m`` (:func:`rope_ref.apply_rope_tail`) to the pooled vector. Rows are what vLLM keeps
in the compressor state cache, so the same function serves prefill and decode.
"""

from __future__ import annotations

import torch
from torch import Tensor

from csrc_triton.kv_cache_ref import read_entries, write_entries


def state_rows(kv_proj: Tensor, gate_proj: Tensor, ape: Tensor, positions: Tensor) -> Tensor:
    """Build the per-token state rows ``[a | z + ape[p mod m]]`` (§5.4).

    Args:
        kv_proj: ``[T, c*d]`` ``a = W_kv x``.
        gate_proj: ``[T, c*d]`` ``z = W_gate x``.
        ape: ``[m, c*d]`` fp32 (HF ``position_bias``); ``m`` = compress ratio.
        positions: ``[T]`` int64 absolute token positions.

    Returns:
        ``[T, 2*c*d]`` fp32.
    """
    ratio = ape.shape[0]
    score = gate_proj.float() + ape.float()[positions % ratio]  # [T, c*d]
    return torch.cat([kv_proj.float(), score], dim=-1)  # [T, 2*c*d]


def write_state_rows(view: Tensor, block_table: Tensor, req: Tensor, positions: Tensor, entries_per_block: int,
                     kv_proj: Tensor, gate_proj: Tensor, ape: Tensor) -> None:
    """Store each token's :func:`state_rows` row as entry ``positions[t]`` of request ``req[t]`` of a
    state cache (``view`` ``[num_blocks, E, 2*c*d]`` fp32, ``kv_cache_ref.write_entries``' addressing);
    rows with ``req < 0`` (padding) are not written."""
    write_entries(view, block_table, req, positions, entries_per_block, state_rows(kv_proj, gate_proj, ape, positions),
                  None)


def compress_windows(rows: Tensor, valid: Tensor, overlap: bool, d: int) -> Tensor:
    """Pool windows of state rows into compressed entries (before norm and RoPE) (§5.4).

    HCA (``overlap=False``, c = 1): the S = m rows of the entry's window, oldest first, each
    contributing ``(kv, score)`` = ``(row[:d], row[d:2d])``.

    CSA (``overlap=True``, c = 2, S = 2m): rows ``[0, m)`` are the previous window's tokens and
    contribute their A half ``(row[:d], row[2d:3d])``; rows ``[m, 2m)`` are the current window's
    tokens and contribute their B half ``(row[d:2d], row[3d:4d])``.

    Per channel e: ``out[e] = sum_s softmax_s(score[s, e]) * kv[s, e]``, in fp32. Rows with
    ``valid=False`` (e.g. the A slots of entry w = 0) get weight 0 and value 0, whatever they hold
    (garbage, inf or NaN in an unfilled cache slot is harmless). A window with no valid row yields 0.

    Args:
        rows: ``[N, S, 2*c*d]`` fp32 state rows from :func:`state_rows`.
        valid: ``[N, S]`` bool.
        overlap: CSA layout (True) or HCA (False).
        d: output width (512 main, 128 indexer).

    Returns:
        ``[N, d]`` fp32.

    Bytes: reads ``N * S * 2d`` of the rows (half of each CSA row is unused by any one entry).
    """
    c = 2 if overlap else 1
    kv, score = rows[..., : c * d], rows[..., c * d : 2 * c * d]  # [N, S, c*d] each
    if overlap:
        m = rows.shape[1] // 2
        kv = torch.cat([kv[:, :m, :d], kv[:, m:, d:]], dim=1)  # [N, 2m, d]
        score = torch.cat([score[:, :m, :d], score[:, m:, d:]], dim=1)  # [N, 2m, d]
    mask = valid[..., None]  # [N, S, 1]
    kv = torch.where(mask, kv.float(), 0.0)  # [N, S, d]
    score = torch.where(mask, score.float(), float("-inf"))  # [N, S, d]
    weight = torch.softmax(score, dim=1)  # [N, S, d] NaN where a whole window is invalid
    weight = torch.where(valid.any(dim=1)[:, None, None], weight, 0.0)  # [N, S, d]
    return (kv * weight).sum(dim=1)  # [N, d]


def pool_state_windows(view: Tensor, block_table: Tensor, req: Tensor, entry: Tensor, valid: Tensor, overlap: bool,
                       d: int, entries_per_block: int) -> Tensor:
    """:func:`compress_windows` of windows whose rows sit in a state cache: slot s of window w is entry
    ``entry[w, s]`` of request ``req[w]`` (``view`` and the addressing as :func:`write_state_rows`'); a
    window of request -1 (one nobody stores) reads nothing and pools to 0.

    Args:
        view: ``[num_blocks, E, 2*c*d]`` fp32 state cache.
        block_table: ``[R, max_blocks]`` int.
        req: ``[N, 1]`` int request of each window, or -1.
        entry: ``[N, S]`` int state entries (>= 0; those of invalid slots are not read by the kernel).
        valid, overlap, d: as :func:`compress_windows`.
        entries_per_block: ``E``.

    Returns:
        ``[N, d]`` fp32.
    """
    rows = read_entries(view, block_table, req.clamp(min=0), entry, entries_per_block, None, torch.float32)
    return compress_windows(rows, valid & (req >= 0), overlap, d)
