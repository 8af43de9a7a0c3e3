"""KV compressor window pooling, Triton (docs/MODEL.md §5.4; also the indexer's compressor, §5.5).

:func:`pool_state_windows` matches :func:`compressor_ref.pool_state_windows`: per entry and channel,
a softmax over the window's valid slots of the score, weighting the value, the rows read where they
sit in the state cache (through the block table: no gathered copy of the windows); invalid slots are
never read (NaN / inf in an unfilled cache slot is harmless), a window with no valid slot yields 0, a
window of request -1 is not read (decode steps pool every token's window, fixed shapes, but store only
the closing ones: 1 in 128 at C128, whose windows are 512 KB each).
One program per (entry, block of channels) holds the ``[S, BLOCK_D]`` values and scores in registers
(S = 8 for CSA, 128 for HCA).

Bytes: reads ``N * S * 2 * d * 4`` of the fp32 rows (only the half of each CSA row that the entry uses)
+ the mask and the slots' entries, writes ``N * d * 4``. The gather it replaced wrote and read back
``N * S * 2 * c * d * 4`` more (at an 8k-token prefill, 134 MB per C4 layer's main compressor).

:func:`write_state_rows` matches :func:`compressor_ref.write_state_rows`: each token's state row
``[a | z + ape[p mod m]]`` built and stored through the block table in one launch (the reference
builds the row in fp32 temporaries, then scatters it). One program per (token, block of channels).
Bytes: reads ``2 T c d`` projections (model dtype) + ``4 T c d`` of ``ape``, writes ``8 T c d``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from csrc_triton.codec import entry_slots


@triton.jit
def _compress_windows_kernel(
    view_ptr, bt_ptr, req_ptr, entry_ptr, valid_ptr, out_ptr,
    S, d, m, E,
    s_v0, s_v1, s_v2, s_r, s_en, s_es, s_bt0, s_bt1, s_vn, s_vs, s_on, s_od,
    OVERLAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    w = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)  # [BS] slot, oldest first
    e = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD] channel
    ok = tl.load(valid_ptr + w * s_vn + s * s_vs, mask=s < S, other=0) != 0  # [BS]
    ok = ok & (tl.zeros_like(s) + tl.load(req_ptr + w * s_r) >= 0)  # a window of request -1 reads nothing: 0
    block, o = entry_slots(view_ptr, bt_ptr, req_ptr, entry_ptr, w, s, ok, s_r, 0, s_en, s_es, s_bt0, s_bt1, s_v0,
                            E)  # [BS] where slot s's row sits
    if OVERLAP:
        half = (s >= m).to(tl.int32)  # CSA: slots [0, m) use the A half, [m, 2m) the B half
        kv_col = half * d  # [BS]
        score_col = 2 * d + half * d
    else:
        kv_col = 0 * s
        score_col = d + 0 * s
    mask = ok[:, None] & (e < d)[None, :]  # [BS, BD]
    base = (block + o * s_v1)[:, None]  # [BS, 1]
    kv = tl.load(base + (kv_col[:, None] + e[None, :]) * s_v2, mask=mask, other=0.0).to(tl.float32)
    score = tl.load(base + (score_col[:, None] + e[None, :]) * s_v2, mask=mask, other=float("-inf"))
    score = score.to(tl.float32)  # [BS, BD]
    mx = tl.max(score, 0)  # [BD] -inf when the window has no valid slot
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    p = tl.exp(score - mx[None, :])  # [BS, BD] 0 on invalid slots
    denom = tl.sum(p, 0)
    out = tl.sum(p * kv, 0) / tl.where(denom > 0, denom, 1.0)  # [BD]
    tl.store(out_ptr + w * s_on + e * s_od, out, mask=e < d)


def pool_state_windows(view: Tensor, block_table: Tensor, req: Tensor, entry: Tensor, valid: Tensor, overlap: bool,
                       d: int, entries_per_block: int) -> Tensor:
    """Triton :func:`compressor_ref.pool_state_windows` (same arguments and result).

    Args:
        view: ``[num_blocks, E, 2*c*d]`` fp32 state cache, any strides.
        block_table: ``[R, max_blocks]`` int32 / int64.
        req: ``[N, 1]`` int, -1 for a window nobody stores (not read, pooled to 0); entry, valid:
            ``[N, S]`` (int >= 0, bool).
        overlap: CSA layout (c = 2, S = 2m) or HCA (c = 1, S = m).
        d: output width.
        entries_per_block: ``E``.

    Returns:
        ``[N, d]`` fp32.
    """
    N, S = entry.shape
    c = 2 if overlap else 1
    assert view.dim() == 3 and view.shape[-1] == 2 * c * d and view.dtype == torch.float32, (view.shape, view.dtype)
    assert not overlap or S % 2 == 0, S
    assert req.shape == (N, 1) and valid.shape == (N, S) and valid.dtype == torch.bool, (req.shape, valid.shape)
    out = torch.empty(N, d, dtype=torch.float32, device=view.device)
    if N == 0 or d == 0:
        return out
    block_s = triton.next_power_of_2(S)
    block_d = max(16, min(triton.next_power_of_2(d), 4096 // block_s))  # [S, BLOCK_D] tiles of 4K values
    _compress_windows_kernel[(N, triton.cdiv(d, block_d))](
        view, block_table, req, entry, valid, out, S, d, S // 2 if overlap else S, entries_per_block,
        *view.stride(), req.stride(0), *entry.stride(), *block_table.stride(), *valid.stride(), *out.stride(),
        OVERLAP=overlap, BLOCK_S=block_s, BLOCK_D=block_d,
    )
    return out


@triton.jit
def _write_state_kernel(
    view_ptr, bt_ptr, req_ptr, pos_ptr, kv_ptr, gate_ptr, ape_ptr,
    W, E, ratio,
    s_v0, s_v1, s_v2, s_b0, s_b1, s_kt, s_gt, s_at,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [B] channel of each half
    r = tl.load(req_ptr + t).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    ok = (c < W) & (tl.zeros_like(c) + r >= 0)  # padding rows (r < 0) store nothing
    block = tl.load(bt_ptr + tl.maximum(r, 0) * s_b0 + (p // E) * s_b1).to(tl.int64)
    kv = tl.load(kv_ptr + t * s_kt + c, mask=ok, other=0.0).to(tl.float32)
    score = tl.load(gate_ptr + t * s_gt + c, mask=ok, other=0.0).to(tl.float32)
    score += tl.load(ape_ptr + (p % ratio) * s_at + c, mask=ok, other=0.0)
    row = view_ptr + block * s_v0 + (p % E) * s_v1
    tl.store(row + c * s_v2, kv, mask=ok)
    tl.store(row + (W + c) * s_v2, score, mask=ok)


def write_state_rows(view: Tensor, block_table: Tensor, req: Tensor, positions: Tensor, entries_per_block: int,
                     kv_proj: Tensor, gate_proj: Tensor, ape: Tensor) -> None:
    """Triton :func:`compressor_ref.write_state_rows` (same arguments; projections' channels contiguous)."""
    T, W = kv_proj.shape
    assert gate_proj.shape == (T, W) and ape.shape[1] == W and view.shape[-1] == 2 * W, (
        kv_proj.shape, gate_proj.shape, ape.shape, view.shape)
    assert view.dtype == ape.dtype == torch.float32 and kv_proj.stride(1) == gate_proj.stride(1) == ape.stride(1) == 1
    if T == 0:
        return
    block = min(1024, triton.next_power_of_2(W))
    _write_state_kernel[(T, triton.cdiv(W, block))](
        view, block_table, req, positions, kv_proj, gate_proj, ape,
        W, entries_per_block, ape.shape[0],
        *view.stride(), *block_table.stride(), kv_proj.stride(0), gate_proj.stride(0), ape.stride(0),
        BLOCK=block,
    )
