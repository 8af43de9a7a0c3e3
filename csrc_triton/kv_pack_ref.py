"""FP8 cache-entry codecs (PyTorch reference, also the CPU path).

Main KV entry (SWA window and compressed C4/C128 entries), ``d = nope + rope`` values:
    ``[nope e4m3 (nope B) | rope bf16 (2*rope B) | one ue8m0 scale byte per 64 nope values | pad]``
with the scale part padded to a multiple of 8 bytes: 448 + 128 + 7 + 1 = 584 B for V4. Each 64-value
nope block is scaled by the smallest power of two that brings its amax under 448 (amax floored at
1e-4), exactly the reference model's KV "FP8 simulation" (dsv4_architecture.md §3.3), so decoding
reproduces what the model was trained to see. RoPE dims stay bf16.

In a cache block the E main entries are stored as FlashMLA's "MODEL1" FP8 sparse layout expects
(so its decode kernel reads our caches as they are): the E data parts (nope + rope, 576 B for V4)
first, then the E scale parts (8 B), ``E * 584`` bytes in all (:func:`main_page_parts`).

Indexer key entry, ``di`` values: ``[e4m3 (di B) | fp32 scale (4 B)]`` = 132 B for di = 128, one
power-of-two scale per entry.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = 448.0
NOPE_BLOCK = 64
AMAX_FLOOR = 1e-4


def main_data_bytes(head_dim: int, rope_dim: int) -> int:
    """Bytes of a main entry before its scales: the e4m3 nope values and the bf16 rope values."""
    return head_dim + rope_dim


def main_entry_bytes(head_dim: int, rope_dim: int) -> int:
    scales = -(-(head_dim - rope_dim) // NOPE_BLOCK)
    return main_data_bytes(head_dim, rope_dim) + -(-scales // 8) * 8


def check_main_blocks(view: Tensor) -> None:
    """Main FP8 entries are addressed as whole blocks of contiguous bytes (``E * C`` per block)."""
    assert view.stride(2) == 1 and view.stride(1) == view.shape[2], ("main FP8 blocks must be contiguous",
                                                                      view.stride())


def main_page_parts(view: Tensor, head_dim: int, rope_dim: int) -> tuple[Tensor, Tensor]:
    """The data parts ``[num_blocks, E, data]`` and scale parts ``[num_blocks, E, C - data]`` of the
    main entries in ``view`` ``[num_blocks, E, C]`` (uint8, each block's ``E * C`` bytes contiguous):
    views of the same bytes, FlashMLA's arrangement (module doc). Concatenated on the last axis they
    are the entries as :func:`pack_main` writes them."""
    check_main_blocks(view)
    num_blocks, E, C = view.shape
    D = main_data_bytes(head_dim, rope_dim)
    pages = view.as_strided((num_blocks, E * C), (view.stride(0), 1))
    return pages[:, : E * D].unflatten(1, (E, D)), pages[:, E * D :].unflatten(1, (E, C - D))


def index_entry_bytes(index_dim: int) -> int:
    return index_dim + 4


def _pow2_scale_exponent(amax: Tensor) -> Tensor:
    """int32 k with 2^k the smallest power of two >= amax / 448 (amax floored at 1e-4).

    ``ceil(log2(r))`` read off the fp32 bits of ``r = amax / 448``, as the official inference
    kernel's ``fast_log2_ceil`` (its ``amax * fp32(1/448)`` gives the same k for every fp32 amax).
    Exact, where an fp32 ``log2`` of ``r`` one ulp above ``2^k`` rounds to ``k`` when ``|k| >= 4``
    (a scale too small). ``r`` is a positive normal number. The Triton codec (kv_cache.py) matches it.
    """
    r = amax.float().clamp(min=AMAX_FLOOR) / FP8_MAX
    bits = r.view(torch.int32)
    return ((bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)).to(torch.int32)


def _exp2(k: Tensor) -> Tensor:
    return torch.ldexp(torch.ones_like(k, dtype=torch.float32), k)


def pack_main(x: Tensor, rope_dim: int) -> Tensor:
    """[N, d] float -> [N, main_entry_bytes] uint8."""
    n, d = x.shape
    nope = d - rope_dim
    blocks = -(-nope // NOPE_BLOCK)
    out = torch.zeros(n, main_entry_bytes(d, rope_dim), dtype=torch.uint8, device=x.device)
    xn = torch.nn.functional.pad(x[:, :nope].float(), (0, blocks * NOPE_BLOCK - nope)).view(n, blocks, NOPE_BLOCK)
    k = _pow2_scale_exponent(xn.abs().amax(-1))  # [N, blocks]
    q = (xn / _exp2(k)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out[:, :nope] = q.flatten(1)[:, :nope].view(torch.uint8)
    out[:, nope : nope + 2 * rope_dim] = x[:, nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    out[:, nope + 2 * rope_dim : nope + 2 * rope_dim + blocks] = (k + 127).to(torch.uint8)
    return out


def unpack_main(packed: Tensor, head_dim: int, rope_dim: int, dtype: torch.dtype) -> Tensor:
    """[..., main_entry_bytes] uint8 -> [..., head_dim] ``dtype``."""
    nope = head_dim - rope_dim
    blocks = -(-nope // NOPE_BLOCK)
    q = packed[..., :nope].contiguous().view(torch.float8_e4m3fn).float()
    k = packed[..., nope + 2 * rope_dim : nope + 2 * rope_dim + blocks].to(torch.int32) - 127
    scale = _exp2(k).repeat_interleave(NOPE_BLOCK, -1)[..., :nope]
    rope = packed[..., nope : nope + 2 * rope_dim].contiguous().view(torch.bfloat16)
    return torch.cat([(q * scale).to(dtype), rope.to(dtype)], -1)


def pack_index(x: Tensor) -> Tensor:
    """[N, di] float -> [N, di + 4] uint8."""
    n, di = x.shape
    scale = _exp2(_pow2_scale_exponent(x.abs().amax(-1)))  # [N]
    q = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat([q.view(torch.uint8), scale[:, None].contiguous().view(torch.uint8)], -1)


def unpack_index(packed: Tensor, dtype: torch.dtype) -> Tensor:
    """[..., di + 4] uint8 -> [..., di] ``dtype``."""
    di = packed.shape[-1] - 4
    q = packed[..., :di].contiguous().view(torch.float8_e4m3fn).float()
    scale = packed[..., di:].contiguous().view(torch.float32)
    return (q * scale).to(dtype)
