"""Weight formats of the official DeepSeek-V4 checkpoint (dsv4_architecture.md §3.3).

* FP8 block: ``float8_e4m3fn`` weight [out, in] with one scale per 128x128 block,
  ``scale[ceil(out/128), ceil(in/128)]``; ``W = q * scale`` ("weight_scale_inv" semantics).
  The scale is ``float8_e8m0fnu`` (value ``2^(byte-127)``) or, in V4-Flash-Base, float32
  powers of two.
* MXFP4 (routed experts): e2m1 values packed two per byte along ``in`` (even element in the
  low nibble), stored as int8 [out, in/2], with an e8m0 scale per 1x32 block [out, in/32].

e8m0 scales are always *reinterpreted* through their byte (exponent) and never value-converted.
Everything is vectorised; nothing loops over rows or elements.
"""

from __future__ import annotations

import math

import torch

from csrc_triton.moe_mxfp4_ref import decode_mxfp4

FP8_BLOCK = 128
FP8_MAX = 448.0
MXFP4_BLOCK = 32
FP4_MAX = 6.0

_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127  # byte 0 .. 254 (255 is NaN)


def e8m0_to_float32(scale: torch.Tensor) -> torch.Tensor:
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


def _scale_to_float32(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return e8m0_to_float32(scale)
    if scale.dtype == torch.float32:  # Flash-Base: power-of-two values stored as float32
        return scale
    raise TypeError(f"unsupported scale dtype {scale.dtype} (want float8_e8m0fnu, uint8 or float32)")


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, block_r: int, block_c: int) -> torch.Tensor:
    """Broadcast a per-block scale [ceil(rows/br), ceil(cols/bc)] to [rows, cols]."""
    s = scale.repeat_interleave(block_r, dim=0)[:rows] if block_r > 1 else scale[:rows]
    return s.repeat_interleave(block_c, dim=1)[:, :cols] if block_c > 1 else s[:, :cols]


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """FP8 (e4m3fn) block-quantised weight [out, in] -> float32: ``W[i,j] = q[i,j] * scale[i//b, j//b]``."""
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"FP8 weight must be 2-D, got shape {tuple(weight.shape)}")
    out, inp = weight.shape
    want = (math.ceil(out / block), math.ceil(inp / block))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 scale shape {tuple(scale.shape)} does not match weight {(out, inp)}: want {want}")
    s = _scale_to_float32(scale)
    return weight.to(torch.float32) * _expand_blocks(s, out, inp, block, block)


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


def _pow2_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest integer k with amax / 2^k <= qmax, clamped to the e8m0 range; int32."""
    k = torch.ceil(torch.log2(amax.to(torch.float32) / qmax))
    k = torch.nan_to_num(k, nan=_E8M0_MIN_EXP, neginf=_E8M0_MIN_EXP, posinf=_E8M0_MAX_EXP)
    k = k.clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP).to(torch.int32)
    # log2 rounding can be off by one ulp near exact powers of two: fix up exactly.
    too_small = amax.to(torch.float32) > qmax * _pow2(k)
    k = torch.where(too_small & (k < _E8M0_MAX_EXP), k + 1, k)
    return k


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact float32 2^k for integer k in [-127, 127] (built from the exponent bits)."""
    return e8m0_to_float32((k + 127).to(torch.uint8))


def _exponent_to_e8m0(k: torch.Tensor) -> torch.Tensor:
    return (k + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def quant_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight [out, in] -> (e4m3fn [out, in], e8m0 scale [ceil(out/b), ceil(in/b)]).

    Per block the scale is the smallest power of two with amax/scale <= 448; elements are
    rounded to nearest-even e4m3.
    """
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(w.shape)}")
    out, inp = w.shape
    bo, bi = math.ceil(out / block), math.ceil(inp / block)
    wf = w.to(torch.float32)
    padded = torch.nn.functional.pad(wf, (0, bi * block - inp, 0, bo * block - out))
    amax = padded.view(bo, block, bi, block).abs().amax(dim=(1, 3))
    k = _pow2_exponent(amax, FP8_MAX)
    inv = _pow2(-k)
    q = (wf * _expand_blocks(inv, out, inp, block, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, _exponent_to_e8m0(k)


def _round_to_e2m1_code(a: torch.Tensor) -> torch.Tensor:
    """|value| in [0, 6] -> 3-bit e2m1 magnitude code, round to nearest, ties to the even code.

    The code is the number of midpoints below ``a``; at a tie (a == midpoint) the midpoint counts
    iff the code above it is even, i.e. ``>=`` for the midpoints below codes 2, 4, 6.
    """
    code = (a > 0.25).to(torch.uint8)
    for i, mid in enumerate((0.75, 1.25, 1.75, 2.5, 3.5, 5.0), start=2):
        code += (a >= mid) if i % 2 == 0 else (a > mid)
    return code


def quant_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight [out, in] (in % 32 == 0) -> (int8 packed [out, in/2], e8m0 scale [out, in/32]).

    Per 1x32 block the scale is the smallest power of two with amax/scale <= 6; elements are
    rounded to the nearest e2m1 value (ties to even). Even elements go to the low nibble.
    """
    if w.dim() != 2 or w.shape[1] % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 weight must be 2-D with in % {MXFP4_BLOCK} == 0, got {tuple(w.shape)}")
    out, inp = w.shape
    blocks = w.to(torch.float32).view(out, inp // MXFP4_BLOCK, MXFP4_BLOCK)
    k = _pow2_exponent(blocks.abs().amax(dim=-1), FP4_MAX)
    v = blocks * _pow2(-k).unsqueeze(-1)
    code = _round_to_e2m1_code(v.abs().clamp(max=FP4_MAX))
    sign = ((v < 0) & (code > 0)).to(torch.uint8) << 3
    nib = (code | sign).view(out, inp // 2, 2)
    packed = nib[..., 0] | (nib[..., 1] << 4)
    return packed.view(torch.int8), _exponent_to_e8m0(k)
