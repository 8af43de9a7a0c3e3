"""RMSNorm, RoPE tail and cache insert of one vector per row, fused, Triton.

Matches :func:`kv_insert_ref.norm_rope_insert` (same signature): it fuses ``norm_ref.rms_norm``,
``rope_ref.apply_rope_tail`` and ``kv_cache_ref.write_entries`` (with kv_pack_ref's codecs). One
program per block of rows loads each row, norms it in fp32, rotates the tail's interleaved pairs
(the tail loaded again, from cache, so that cos / sin are worked out for its pairs only:
``rope.rotate_pairs``), and encodes and scatters it through the block table with
kv_cache.py's codec helpers. Rows with ``req < 0`` are masked out in the kernel: no host sync, a
grid fixed by the shapes (capturable in a CUDA graph).

Numerics: the reference's fp32 operations in its order, with its two roundings to ``x.dtype`` (after
the norm, after the rotation; RNE by hand, as the interpreter's bf16 cast truncates). The mean of
squares is summed in another order and rsqrt / cos / sin come from another library, so the fp32
values before a rounding may differ by a few ulps, which now and then moves a bf16 or e4m3 rounding
to the neighbouring value (tests/csrc_triton/test_kv_insert_kernel.py states the bounds).

Bytes per row (V4 main KV, bf16 x, FP8 entry): 1024 in, 584 out (data and scale parts apart:
kv_pack_ref.main_page_parts), plus its position, request, entry
and block-table entry (the norm weight and inv_freq are shared by all rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from csrc_triton.codec import (
    entry_mode,
    entry_slots,
    main_parts,
    round_to_x,
    scale_exponent,
    store_bf16_bytes,
    store_e4m3,
    store_index_scale,
    store_scale_pad,
    store_values,
)
from csrc_triton.formats import NOPE_BLOCK
from csrc_triton.rope import rotate_pairs, tail_block


@triton.jit(do_not_specialize=["N"])
def _norm_rope_insert_kernel(
    x_ptr, w_ptr, pos_ptr, freq_ptr, view_ptr, bt_ptr, req_ptr, entry_ptr,
    N, D, pair0, E, C, nope, rope, eps,
    s_xn, s_xd, s_w, s_pos, s_req, s_entry, s_bt0, s_bt1, s_v0, s_v1, s_v2,
    MAIN: tl.constexpr, INDEX: tl.constexpr, X_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, NOPE_BLOCK: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] rows
    ok = tl.load(req_ptr + n * s_req, mask=n < N, other=-1) >= 0  # padded rows read and write nothing
    block, o = entry_slots(view_ptr, bt_ptr, req_ptr, entry_ptr, 0, n, ok, 0, s_req, 0, s_entry, s_bt0, s_bt1,
                            s_v0, E)
    block, o = block[:, None], o[:, None]  # [BN, 1]
    c = tl.arange(0, BLOCK_D)[None, :]  # [1, BD] channels
    m = ok[:, None] & (c < D)
    x = tl.load(x_ptr + n[:, None] * s_xn + c * s_xd, mask=m, other=0.0).to(tl.float32)  # [BN, BD]
    w = tl.load(w_ptr + c * s_w, mask=c < D, other=0.0).to(tl.float32)  # [1, BD]
    rms = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]  # [BN, 1]
    y = round_to_x(x * rms * w, X_BF16)  # rms_norm; lanes c >= D and padded rows hold 0; its tail is not stored
    # the tail (channels tail0 .. D - 1, the row being in cache) normed alike, then rotated: apply_rope_tail
    tail0 = 2 * pair0
    head = m & (c < tail0)  # [BN, BD] the channels stored from y
    t = tail0 + tl.arange(0, BLOCK_R)[None, :]  # [1, BR]
    mt = ok[:, None] & (t < D)
    xt = tl.load(x_ptr + n[:, None] * s_xn + t * s_xd, mask=mt, other=0.0).to(tl.float32)
    yt = round_to_x(xt * rms * tl.load(w_ptr + t * s_w, mask=t < D, other=0.0).to(tl.float32), X_BF16)
    pos = tl.load(pos_ptr + n * s_pos, mask=ok, other=0).to(tl.float32)[:, None]  # [BN, 1]
    yt = round_to_x(rotate_pairs(yt, pos, freq_ptr, D - tail0, False, BLOCK_N, BLOCK_R), X_BF16)

    row = block + o * s_v1  # [BN, 1] raw and indexer entries
    if not (MAIN or INDEX):  # raw entries: cast to the view's dtype
        store_values(row + c * s_v2, y, head, OUT_BF16)
        store_values(row + t * s_v2, yt, mt, OUT_BF16)
    elif INDEX:  # e4m3, one fp32 power-of-two scale per entry
        amax = tl.maximum(tl.max(tl.where(head, tl.abs(y), 0.0), axis=1), tl.max(tl.abs(yt), axis=1))
        k = scale_exponent(amax)[:, None]  # [BN, 1]
        store_e4m3(row + c * s_v2, y, k, head)
        store_e4m3(row + t * s_v2, yt, k, mt)
        store_index_scale(row + D * s_v2, k, ok[:, None], s_v2)
    else:  # main (bytes contiguous): e4m3 nope with one ue8m0 byte per 64 values, bf16 rope, zero pad
        data, scales = main_parts(block, o, E, nope + 2 * rope, C)
        fp8 = c < nope
        NB: tl.constexpr = BLOCK_D // NOPE_BLOCK
        blocks = tl.reshape(tl.where(fp8, tl.abs(y), 0.0), [BLOCK_N, NB, NOPE_BLOCK])
        k = scale_exponent(tl.max(blocks, axis=2))  # [BN, NB]
        k_c = tl.reshape(tl.broadcast_to(k[:, :, None], [BLOCK_N, NB, NOPE_BLOCK]), [BLOCK_N, BLOCK_D])
        store_e4m3(data + c, y, k_c, m & fp8)
        store_bf16_bytes(data + 2 * t - nope, yt, mt, 1)  # channel t at byte nope + 2 (t - nope)
        b = tl.arange(0, NB)[None, :]  # [1, NB] scale blocks, ceil(nope / 64) of them real
        tl.store(scales + b, (k + 127).to(tl.uint8), mask=ok[:, None] & (b * NOPE_BLOCK < nope))
        store_scale_pad(scales, nope, C - nope - 2 * rope, ok[:, None], NOPE_BLOCK)


def norm_rope_insert(x: Tensor, norm_weight: Tensor, eps: float, rope_positions: Tensor, inv_freq: Tensor,
                     view: Tensor, block_table: Tensor, req: Tensor, entry: Tensor, entries_per_block: int,
                     fp8) -> None:
    """Triton :func:`kv_insert_ref.norm_rope_insert` (same arguments; see the module for the numerics).

    Args:
        x: ``[N, D]`` bf16 / fp32, any strides; D even.
        norm_weight: ``[D]``; eps: the RMSNorm epsilon.
        rope_positions, req, entry: ``[N]`` int; rows with ``req < 0`` are not written (their entry and
            position are not read).
        inv_freq: ``[r / 2]`` fp32, ``r <= D``.
        view, block_table, entries_per_block, fp8: as for :func:`kv_cache.write_entries`.
    """
    assert x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16), (x.shape, x.dtype)
    N, D = x.shape
    half_r = inv_freq.numel()
    assert D % 2 == 0 and 2 * half_r <= D and norm_weight.shape == (D,), (x.shape, half_r, norm_weight.shape)
    assert rope_positions.shape == req.shape == entry.shape == (N,), (rope_positions.shape, req.shape, entry.shape)
    assert view.dim() == 3 and block_table.dim() == 2, (view.shape, block_table.shape)
    mode, dim, nope, rope = entry_mode(view, fp8)
    assert dim == D and (mode != "main" or nope == D - 2 * half_r), (dim, D, nope, half_r)  # bf16 part = the tail
    if N == 0:
        return
    block_d = max(NOPE_BLOCK, triton.next_power_of_2(D))  # whole 64-value scale blocks for main entries
    block_n = max(1, 2048 // block_d)  # not by N: one compiled kernel for every step size
    _norm_rope_insert_kernel[(triton.cdiv(N, block_n),)](
        x, norm_weight, rope_positions, inv_freq.to(device=x.device, dtype=torch.float32).contiguous(),
        view, block_table, req, entry,
        N, D, D // 2 - half_r, entries_per_block, view.shape[-1], nope, rope, eps,
        *x.stride(), norm_weight.stride(0), rope_positions.stride(0), req.stride(0), entry.stride(0),
        *block_table.stride(), *view.stride(),
        MAIN=mode == "main", INDEX=mode == "index", X_BF16=x.dtype == torch.bfloat16,
        OUT_BF16=mode == "raw" and view.dtype == torch.bfloat16,
        BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_R=tail_block(2 * half_r), NOPE_BLOCK=NOPE_BLOCK,
    )
