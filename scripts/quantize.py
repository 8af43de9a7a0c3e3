"""The FP8 block and MXFP4 encoders the test-checkpoint maker (make_checkpoint.py) stores weights with:
the inverse of ``vllm_dsv4/loader/dequant.py`` (docs/MODEL.md §3.3). Serving never encodes weights.

Scales are the smallest powers of two that bring each block's amax under the format's largest value,
stored as e8m0 bytes; elements round to nearest, ties to even.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from csrc_triton.formats import FP8_BLOCK, FP8_MAX, MXFP4_BLOCK, e8m0_to_float32  # noqa: E402
from vllm_dsv4.loader.dequant import expand_blocks  # noqa: E402

FP4_MAX = 6.0
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127  # byte 0 .. 254 (255 is NaN)


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
    q = (wf * expand_blocks(inv, out, inp, block, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
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
