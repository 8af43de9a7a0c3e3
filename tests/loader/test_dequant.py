"""FP8 block / MXFP4 dequantization against hand-computed values, plus quantization round trips."""

from __future__ import annotations

import pytest
import torch

from csrc_triton.formats import e8m0_to_float32
from tests.conftest import load_quantize
from vllm_dsv4.loader.dequant import dequant_fp8_block, dequant_mxfp4

quant_fp8_block, quant_mxfp4 = load_quantize().quant_fp8_block, load_quantize().quant_mxfp4


def e4m3(*byte_values: int) -> torch.Tensor:
    return torch.tensor(byte_values, dtype=torch.uint8).view(torch.float8_e4m3fn)


def e8m0(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.uint8).view(torch.float8_e8m0fnu)


# ---- e8m0 reinterpretation ------------------------------------------------------------------


def test_e8m0_bytes_are_exact_powers_of_two():
    got = e8m0_to_float32(e8m0([[0, 1, 120, 126, 127, 128, 130, 254]]))[0]
    # 2^-127 is a float32 subnormal: bit pattern 0x00400000.
    assert got[0].view(torch.int32).item() == 0x00400000
    assert got[0].item() == 2.0**-127
    assert got[1].item() == 2.0**-126
    assert got[2].item() == 2.0**-7
    assert got[3].item() == 0.5
    assert got[4].item() == 1.0
    assert got[5].item() == 2.0
    assert got[6].item() == 8.0
    assert got[7].item() == 2.0**127
    assert torch.isnan(e8m0_to_float32(e8m0([[255]]))).all()


def test_e8m0_uint8_bytes_accepted():
    assert e8m0_to_float32(torch.tensor([130], dtype=torch.uint8)).item() == 8.0


# ---- FP8 block ------------------------------------------------------------------------------


def test_fp8_known_bytes():
    # e4m3fn: s eeee mmm, bias 7. 0x38 = 0 0111 000 = 1.0; 0x40 = 2.0; 0x3C = 1.5; 0xB8 = -1.0;
    # 0x7E = 1.75 * 2^8 = 448 (max); 0x01 = 2^-6 * 1/8 = 2^-9 (smallest subnormal); 0x00 = 0.
    q = e4m3(0x38, 0x40, 0x3C, 0xB8, 0x7E, 0x01, 0x00, 0x30).view(1, 8)
    scale = e8m0([[130]])  # 2^(130-127) = 8
    got = dequant_fp8_block(q, scale)
    want = torch.tensor([[1.0, 2.0, 1.5, -1.0, 448.0, 2.0**-9, 0.0, 0.5]]) * 8.0
    assert got.dtype == torch.float32
    assert torch.equal(got, want)


def test_fp8_block_layout_128():
    # [130, 260] weight -> scale [2, 3]; every block has its own scale.
    q = e4m3(0x38).expand(130, 260).contiguous()  # all 1.0
    exps = [[120, 127, 130], [125, 140, 0]]
    got = dequant_fp8_block(q, e8m0(exps))
    for bi, r in enumerate((slice(0, 128), slice(128, 130))):
        for bj, c in enumerate((slice(0, 128), slice(128, 256), slice(256, 260))):
            assert torch.equal(got[r, c], torch.full_like(got[r, c], 2.0 ** (exps[bi][bj] - 127))), (bi, bj)


def test_fp8_float32_scales_flash_base():
    q = e4m3(0x38, 0x40).view(1, 2)
    assert torch.equal(dequant_fp8_block(q, torch.tensor([[0.25]])), torch.tensor([[0.25, 0.5]]))


def test_fp8_scale_shape_checked():
    with pytest.raises(ValueError, match=r"\(2, 1\)"):
        dequant_fp8_block(e4m3(0x38).expand(129, 4).contiguous(), e8m0([[127]]))


def test_fp8_roundtrip_within_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-3, 1, 200)  # different block ranges
    q, s = quant_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (3, 2)
    sf = e8m0_to_float32(s)
    # The scale is the smallest power of two with amax / scale <= 448.
    amax = torch.nn.functional.pad(w.abs(), (0, 56, 0, 84)).view(3, 128, 2, 128).amax(dim=(1, 3))
    assert (amax / sf <= 448).all() and (amax / (sf / 2) > 448).all()
    d = dequant_fp8_block(q, s)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normals, absolute <= scale * 2^-10 below.
    err = (d - w).abs()
    scale_full = sf.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    bound = torch.maximum(w.abs() * 2.0**-4, scale_full * 2.0**-10)
    assert (err <= bound).all()


# ---- MXFP4 ----------------------------------------------------------------------------------


def test_mxfp4_known_nibbles_low_first():
    # byte 0x71: low nibble 0x1 (element 0) = +0.5, high nibble 0x7 (element 1) = +6.0
    # byte 0xF9: low 0x9 = -0.5, high 0xF = -6.0; byte 0x42: low 0x2 = 1.0, high 0x4 = 2.0
    # byte 0x53: low 0x3 = 1.5, high 0x5 = 3.0; byte 0x86: low 0x6 = 4.0, high 0x8 = -0.0
    row = [0x71, 0xF9, 0x42, 0x53, 0x86] + [0x00] * 11
    packed = torch.tensor([row], dtype=torch.uint8).view(torch.int8)
    scale = e8m0([[127]])  # 1.0
    got = dequant_mxfp4(packed, scale)
    assert got.shape == (1, 32) and got.dtype == torch.float32
    want = torch.tensor([0.5, 6.0, -0.5, -6.0, 1.0, 2.0, 1.5, 3.0, 4.0, 0.0] + [0.0] * 22)
    assert torch.equal(got[0], want)


def test_mxfp4_scale_per_32_block():
    packed = torch.full((2, 32), 0x22, dtype=torch.uint8)  # all elements 1.0, in = 64
    scale = e8m0([[130, 126], [0, 254]])
    got = dequant_mxfp4(packed, scale)
    assert torch.equal(got[0, :32], torch.full((32,), 8.0))
    assert torch.equal(got[0, 32:], torch.full((32,), 0.5))
    assert torch.equal(got[1, :32], torch.full((32,), 2.0**-127))
    assert torch.equal(got[1, 32:], torch.full((32,), 2.0**127))


def test_mxfp4_quant_exact_values_and_rounding():
    vals = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -6.0, -0.5,
            0.2, 0.3, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 2.4, 4.9]
    w = torch.tensor(vals + [0.0] * (32 - len(vals))).view(1, 32)
    q, s = quant_mxfp4(w)
    assert q.dtype == torch.int8 and q.shape == (1, 16)
    assert s.view(torch.uint8).item() == 127  # amax 6 -> scale 1
    got = dequant_mxfp4(q, s)[0, : len(vals)].tolist()
    # nearest value, ties to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert got == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -6.0, -0.5,
                   0.0, 0.5, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 2.0, 4.0]
    # packing, even element in the low nibble: (0.0, 0.5) -> 0x10, (4.0, 6.0) -> 0x76, (-6.0, -0.5) -> 0x9F
    b = q.view(torch.uint8)[0]
    assert (b[0].item(), b[3].item(), b[4].item()) == (0x10, 0x76, 0x9F)


def test_mxfp4_roundtrip_within_step():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-4, 2, 8).repeat_interleave(32)
    q, s = quant_mxfp4(w)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (64, 8)
    sf = e8m0_to_float32(s)
    amax = w.abs().view(64, 8, 32).amax(-1)
    assert (amax / sf <= 6).all() and (amax / (sf / 2) > 6).all()
    d = dequant_mxfp4(q, s)
    # Half the local e2m1 step: 0.25 below 2, 0.5 in [2, 4), 1 in [4, 6] (in units of the scale).
    scale_full = sf.repeat_interleave(32, 1)
    a = w.abs() / scale_full
    half_step = torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))
    assert ((d - w).abs() <= half_step * scale_full * (1 + 1e-6)).all()


def test_quant_zero_block_gives_zero():
    q, s = quant_mxfp4(torch.zeros(1, 32))
    assert torch.equal(dequant_mxfp4(q, s), torch.zeros(1, 32))
    q8, s8 = quant_fp8_block(torch.zeros(3, 5))
    assert torch.equal(dequant_fp8_block(q8, s8), torch.zeros(3, 5))
