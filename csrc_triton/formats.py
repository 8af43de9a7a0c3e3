"""Number formats and byte layouts that the references, the kernels, the cache layout and the loader
share: each constant and layout rule is defined here once (docs/MODEL.md §3.3).

Weights: FP8 ``float8_e4m3fn`` (largest finite value ``FP8_MAX``) with one scale per
``FP8_BLOCK`` x ``FP8_BLOCK`` block, and MXFP4 e2m1 codes with one e8m0 scale per ``MXFP4_BLOCK``
values. e8m0 scales are reinterpreted through their byte (an exponent), never value-converted.

FP8 cache entries (kv_pack_ref.py holds the codec):
- main KV (window and compressed entries), ``d = nope + rope`` values:
  ``[nope e4m3 (nope B) | rope bf16 (2*rope B) | one ue8m0 scale byte per NOPE_BLOCK nope values | pad]``
  with the scale part padded to a multiple of 8 bytes: 448 + 128 + 7 + 1 = 584 B for V4. In a cache
  block the E entries' data parts come first, then their E scale parts (:func:`main_page_parts`,
  FlashMLA's "MODEL1" FP8 sparse layout, so its kernels read our caches as they are);
- indexer key, ``di`` values: ``[e4m3 (di B) | fp32 scale (4 B)]`` = 132 B for di = 128.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128  # FP8 weights: one scale per 128 x 128 block; activations: one per 128 values
MXFP4_BLOCK = 32  # MXFP4 weights: one e8m0 scale per 32 values along the input dim
NOPE_BLOCK = 64  # FP8 main cache entries: one ue8m0 scale byte per 64 nope values
# e2m1 value of each 4-bit code: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def e8m0_to_float32(scale: Tensor) -> Tensor:
    """Exact float32 value of e8m0 scales: byte b -> 2^(b-127) (b=255 -> NaN).

    Accepts ``float8_e8m0fnu`` or ``uint8`` (raw bytes). The float32 is built bit by bit:
    b >= 1 is the normal number with exponent field b; b == 0 is the subnormal 2^-127.
    """
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise TypeError(f"e8m0 scale must be float8_e8m0fnu or uint8 bytes, got {scale.dtype}")
    b = scale.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def decode_mxfp4(packed: Tensor, scale: Tensor) -> Tensor:
    """MXFP4 -> float32: ``W[..., o, i] = e2m1(code[..., o, i]) * 2^(scale[..., o, i // 32] - 127)``.

    Args:
        packed: ``[..., out, in/2]`` uint8 / int8; byte j holds element 2j (low nibble), 2j+1 (high).
        scale: ``[..., out, in/32]`` e8m0 exponent bytes (uint8 or float8_e8m0fnu; 255 is NaN), or
            their float32 values (V4-Flash-Base stores power-of-two scales as float32).

    Returns:
        ``[..., out, in]`` float32 (exact: e2m1 times a power of two).
    """
    packed = packed.view(torch.uint8)  # [..., o, in/2]
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)  # [..., o, in]
    values = E2M1.to(packed.device)[codes.int()]  # [..., o, in]
    pow2 = scale if scale.dtype == torch.float32 else e8m0_to_float32(scale.view(torch.uint8))  # [..., o, in/32]
    blocks = values.unflatten(-1, (-1, MXFP4_BLOCK)) * pow2.unsqueeze(-1)  # [..., o, in/32, 32]
    return blocks.flatten(-2)  # [..., o, in]


def decode_fp8(q: Tensor, scale: Tensor) -> Tensor:
    """FP8 block weights -> float32: ``W[..., o, i] = e4m3(q[..., o, i]) * scale[..., o // 128, i // 128]``.

    Args:
        q: ``[..., out, in]`` float8_e4m3fn, or its bytes as uint8.
        scale: ``[..., ceil(out/128), ceil(in/128)]`` float32 (V4-Flash-Base stores powers of two so),
            or e8m0 exponent bytes (uint8 or float8_e8m0fnu).

    Returns:
        ``[..., out, in]`` float32 (exact for power-of-two scales).
    """
    out, inp = q.shape[-2:]
    pow2 = scale if scale.dtype == torch.float32 else e8m0_to_float32(scale)  # [..., out/128, in/128]
    rows = pow2.repeat_interleave(FP8_BLOCK, dim=-2)[..., :out, :]  # [..., out, in/128]
    return q.view(torch.float8_e4m3fn).float() * rows.repeat_interleave(FP8_BLOCK, dim=-1)[..., :inp]


def main_data_bytes(head_dim: int, rope_dim: int) -> int:
    """Bytes of a main entry before its scales: the e4m3 nope values and the bf16 rope values."""
    return head_dim + rope_dim


def main_entry_bytes(head_dim: int, rope_dim: int) -> int:
    scales = -(-(head_dim - rope_dim) // NOPE_BLOCK)
    return main_data_bytes(head_dim, rope_dim) + -(-scales // 8) * 8


def index_entry_bytes(index_dim: int) -> int:
    return index_dim + 4


def check_main_blocks(view: Tensor) -> None:
    """Main FP8 entries are addressed as whole blocks of contiguous bytes (``E * C`` per block)."""
    assert view.stride(2) == 1 and view.stride(1) == view.shape[2], ("main FP8 blocks must be contiguous",
                                                                      view.stride())


def main_page_parts(view: Tensor, head_dim: int, rope_dim: int) -> tuple[Tensor, Tensor]:
    """The data parts ``[num_blocks, E, data]`` and scale parts ``[num_blocks, E, C - data]`` of the
    main entries in ``view`` ``[num_blocks, E, C]`` (uint8, each block's ``E * C`` bytes contiguous):
    views of the same bytes, FlashMLA's arrangement (module doc). Concatenated on the last axis they
    are the entries as ``kv_pack_ref.pack_main`` writes them."""
    check_main_blocks(view)
    num_blocks, E, C = view.shape
    D = main_data_bytes(head_dim, rope_dim)
    pages = view.as_strided((num_blocks, E * C), (view.stride(0), 1))
    return pages[:, : E * D].unflatten(1, (E, D)), pages[:, E * D :].unflatten(1, (E, C - D))
