"""Weight formats of the official DeepSeek-V4 checkpoint (docs/MODEL.md §3.3).

* FP8 block: ``float8_e4m3fn`` weight [out, in] with one scale per 128x128 block,
  ``scale[ceil(out/128), ceil(in/128)]``; ``W = q * scale`` ("weight_scale_inv" semantics).
  The scale is ``float8_e8m0fnu`` (value ``2^(byte-127)``) or, in V4-Flash-Base, float32
  powers of two.
* MXFP4 (routed experts): e2m1 values packed two per byte along ``in`` (even element in the
  low nibble), stored as int8 [out, in/2], with an e8m0 scale per 1x32 block [out, in/32].

e8m0 scales are always *reinterpreted* through their byte (exponent) and never value-converted
(``csrc_triton.formats.e8m0_to_float32``). Everything is vectorised; nothing loops over rows or
elements. The inverse, the encoders the test-checkpoint maker stores weights with, is
scripts/quantize.py.
"""

from __future__ import annotations

import math

import torch

from csrc_triton.formats import FP8_BLOCK, MXFP4_BLOCK, decode_fp8, decode_mxfp4, e8m0_to_float32


def _scale_to_float32(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return e8m0_to_float32(scale)
    if scale.dtype == torch.float32:  # Flash-Base: power-of-two values stored as float32
        return scale
    raise TypeError(f"unsupported scale dtype {scale.dtype} (want float8_e8m0fnu, uint8 or float32)")


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, block_r: int, block_c: int) -> torch.Tensor:
    """Broadcast a per-block scale [ceil(rows/br), ceil(cols/bc)] to [rows, cols]."""
    s = scale.repeat_interleave(block_r, dim=0)[:rows] if block_r > 1 else scale[:rows]
    return s.repeat_interleave(block_c, dim=1)[:, :cols] if block_c > 1 else s[:, :cols]


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 (e4m3fn) block-quantised weight [out, in] -> float32: ``W[i,j] = q[i,j] * scale[i//128, j//128]``."""
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"FP8 weight must be 2-D, got shape {tuple(weight.shape)}")
    out, inp = weight.shape
    want = (math.ceil(out / FP8_BLOCK), math.ceil(inp / FP8_BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 scale shape {tuple(scale.shape)} does not match weight {(out, inp)}: want {want}")
    return decode_fp8(weight, _scale_to_float32(scale))


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 weight packed as int8/uint8 [out, in/2] with e8m0 scale [out, in/32] -> float32 [out, in]."""
    if packed.dtype == torch.int8:
        packed = packed.view(torch.uint8)
    if packed.dtype != torch.uint8:
        raise TypeError(f"MXFP4 weight must be int8 or uint8, got {packed.dtype}")
    if packed.dim() != 2:
        raise ValueError(f"MXFP4 weight must be 2-D, got shape {tuple(packed.shape)}")
    out, half = packed.shape
    inp = 2 * half
    if inp % MXFP4_BLOCK or tuple(scale.shape) != (out, inp // MXFP4_BLOCK):
        raise ValueError(
            f"MXFP4 scale shape {tuple(scale.shape)} does not match weight [{out}, {inp}]: "
            f"want {(out, inp // MXFP4_BLOCK)}"
        )
    return decode_mxfp4(packed, _scale_to_float32(scale))
