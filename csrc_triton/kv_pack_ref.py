"""FP8 cache-entry codecs (PyTorch reference, also the CPU path).

The entry byte layouts are formats.py's. Each 64-value nope block of a main entry is scaled by the
smallest power of two that brings its amax under 448 (amax floored at 1e-4), exactly the reference
model's KV "FP8 simulation" (docs/MODEL.md §3.3), so decoding reproduces what the model was trained
to see; RoPE dims stay bf16. An indexer key has one power-of-two scale per entry.
"""

from __future__ import annotations

import torch
from torch import Tensor

from csrc_triton.formats import FP8_MAX, NOPE_BLOCK, main_entry_bytes

AMAX_FLOOR = 1e-4


def _pow2_scale_exponent(amax: Tensor) -> Tensor:
    """int32 k with 2^k the smallest power of two >= amax / 448 (amax floored at 1e-4).

    ``ceil(log2(r))`` read off the fp32 bits of ``r = amax / 448``, as the official inference
    kernel's ``fast_log2_ceil`` (its ``amax * fp32(1/448)`` gives the same k for every fp32 amax).
    Exact, where an fp32 ``log2`` of ``r`` one ulp above ``2^k`` rounds to ``k`` when ``|k| >= 4``
    (a scale too small). ``r`` is a positive normal number. The Triton codec (codec.py) matches it.
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
