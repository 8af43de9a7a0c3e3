"""Routed experts on quantised weights (docs/MODEL.md §3.3 storage, §6 math).

The release checkpoints' routed experts are MXFP4: e2m1 codes packed two per byte along the input dim
(the even element in the low nibble) with one e8m0 scale byte per 1x32 block; V4-Flash-Base's are FP8
e4m3 with one float32 scale per 128x128 block, like its linears. These references decode the experts
that received tokens and run :func:`routing_ref.moe_experts` on them, so they define the kernels'
semantics (csrc_triton/moe_mxfp4.py) and are the GPU bisecting path (``VLLM_DSV4_OPS=reference``).
The CPU model path dequantises at load instead (model/moe.py).

Bytes: each hit expert's W13 and W2 once (MXFP4: ``2I*D/2 + D*I/2`` codes, ``2I*D/32 + D*I/32``
scales; FP8: ``3*D*I`` bytes), plus x gathered k times.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from csrc_triton.formats import FP8_BLOCK, decode_fp8, decode_mxfp4
from csrc_triton.routing_ref import moe_experts

DECODE_GROUP = 16  # experts decoded to fp32 at a time


def moe_experts_mxfp4(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    swiglu_limit: float,
    narrow_scales: bool = False,
    shared: Tensor | None = None,
) -> Tensor:
    """:func:`routing_ref.moe_experts` with MXFP4 expert weights (§6 steps 4-5).

    Only experts that received a token are decoded (one host sync for the set), ``DECODE_GROUP`` at
    a time, so the fp32 copies stay small; the groups' outputs are summed in fp32.

    Args:
        x: ``[T, D]`` post-``ffn_norm`` activations.
        weights: ``[T, k]`` routing weights (fp32).
        ids: ``[T, k]`` local expert ids in ``[0, E_local]``; ``E_local`` is skipped (another rank's).
        w13: ``[E_local, 2I, D/2]`` uint8 packed, rows ``[:I]`` = W1 (gate), ``[I:]`` = W3 (up).
        w13_scale: ``[E_local, 2I, D/32]`` uint8 e8m0.
        w2: ``[E_local, D, I/2]`` uint8 packed.
        w2_scale: ``[E_local, D, I/32]`` uint8 e8m0.
        swiglu_limit: L.
        narrow_scales: the kernel's hint that no scale byte passes 128; the reference decodes any.
        shared: ``[T, D]`` in ``x.dtype``, the shared expert's output (the MoE's other term), or None.

    Returns:
        ``[T, D]`` in ``x.dtype``, accumulated in fp32; plus ``shared`` (one more rounding) when given.
    """
    def decode(group: Tensor) -> tuple[Tensor, Tensor]:
        return decode_mxfp4(w13[group], w13_scale[group]), decode_mxfp4(w2[group], w2_scale[group])

    return _moe_decoded(x, weights, ids, w13.shape[0], decode, swiglu_limit, shared)


def moe_experts_fp8(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    swiglu_limit: float,
    shared: Tensor | None = None,
) -> Tensor:
    """:func:`routing_ref.moe_experts` with FP8 block expert weights (V4-Flash-Base).

    Args:
        x, weights, ids, swiglu_limit, shared: as :func:`moe_experts_mxfp4`.
        w13: ``[E_local, 2I, D]`` float8_e4m3fn, rows ``[:I]`` = W1 (gate), ``[I:]`` = W3 (up).
        w13_scale: ``[E_local, 2 * ceil(I/128), ceil(D/128)]`` float32: W1's blocks, then W3's.
        w2: ``[E_local, D, I]`` float8_e4m3fn.
        w2_scale: ``[E_local, ceil(D/128), ceil(I/128)]`` float32.

    Returns:
        ``[T, D]`` in ``x.dtype``, accumulated in fp32; plus ``shared`` (one more rounding) when given.
    """
    I, up = w13.shape[1] // 2, -(-w13.shape[1] // 2 // FP8_BLOCK)  # W3's first scale row

    def decode(group: Tensor) -> tuple[Tensor, Tensor]:
        gate = decode_fp8(w13[group, :I], w13_scale[group, :up])  # [G, I, D]
        up_rows = decode_fp8(w13[group, I:], w13_scale[group, up:])  # [G, I, D]
        return torch.cat([gate, up_rows], 1), decode_fp8(w2[group], w2_scale[group])  # [G, 2I, D], [G, D, I]

    return _moe_decoded(x, weights, ids, w13.shape[0], decode, swiglu_limit, shared)


def _moe_decoded(x: Tensor, weights: Tensor, ids: Tensor, E: int, decode: Callable[[Tensor], tuple[Tensor, Tensor]],
                 swiglu_limit: float, shared: Tensor | None) -> Tensor:
    """The experts that received a token, ``decode(group)`` -> their fp32 ``(w13, w2)`` ``DECODE_GROUP`` at a
    time (one host sync for the set), through :func:`routing_ref.moe_experts`; the groups' outputs summed
    in fp32."""
    ids = torch.where((ids >= 0) & (ids < E), ids.long(), E)  # [T, k] anything else is skipped too
    hit = torch.unique(ids[ids < E])  # [H] sorted local ids
    xf = x.float()
    out = torch.zeros_like(xf)  # [T, D]
    for group in hit.split(DECODE_GROUP):  # bounded fp32 copies: 256 V4-Flash experts decode to 26 GB
        compact = torch.full((E + 1,), group.numel(), dtype=torch.long, device=ids.device)  # others -> skip id
        compact[group] = torch.arange(group.numel(), device=ids.device)
        w13_f, w2_f = decode(group)  # [G, 2I, D], [G, D, I]
        out += moe_experts(xf, weights, compact[ids], w13_f, w2_f, swiglu_limit)
    return out.to(x.dtype) if shared is None else (out.to(x.dtype) + shared).to(x.dtype)


def align_pairs(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """The (token, slot) pairs grouped by expert into ``block_m``-row blocks (the MXFP4 MoE kernels' row
    layout, csrc_triton/moe_mxfp4.py), in pair order within an expert.

    Returns:
        ``pair_of_row [num_blocks * BLOCK_M]`` int32 pair index ``t * k + j`` (-1 on padding) and
        ``block_expert [num_blocks]`` int32 (-1 past the used blocks), with ``num_blocks`` the bound
        ``cdiv(P, BLOCK_M) + min(E, P)`` on ``sum_e ceil(count_e / BLOCK_M)``.
    """
    E, P, dev = num_experts, ids.numel(), ids.device
    flat = ids.reshape(-1).long()  # [P]
    flat = torch.where((flat >= 0) & (flat < E), flat, E)  # [P] E = skipped
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))  # [E+1]
    blocks = (counts[:E] + block_m - 1) // block_m  # [E]
    block_end = torch.cumsum(blocks, 0)  # [E]
    num_blocks = -(-P // block_m) + min(E, P)
    block_expert = torch.searchsorted(block_end, torch.arange(num_blocks, device=dev), right=True)  # [NB]
    block_expert = torch.where(block_expert < E, block_expert, -1).to(torch.int32)
    order = torch.argsort(flat, stable=True)  # [P] pairs grouped by expert
    sorted_e = flat[order]  # [P]
    first = torch.cumsum(counts, 0) - counts  # [E+1] first sorted position of each expert
    row_start = torch.cat([block_end - blocks, block_end.new_zeros(1)]) * block_m  # [E+1]
    row = row_start[sorted_e] + torch.arange(P, device=dev) - first[sorted_e]  # [P] padded row
    row = torch.where(sorted_e < E, row, num_blocks * block_m)  # skipped pairs -> a spare last row
    pair_of_row = torch.full((num_blocks * block_m + 1,), -1, dtype=torch.int32, device=dev)
    pair_of_row[row] = order.to(torch.int32)
    return pair_of_row[:-1], block_expert
