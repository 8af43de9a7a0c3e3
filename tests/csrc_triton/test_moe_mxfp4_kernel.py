"""Triton moe_experts_mxfp4 against moe_mxfp4_ref (kernel link of the test chain).

Tolerances: kernel_cases.assert_close. The kernel decodes the same weights the reference does (e2m1
times a power of two has two significant bits: exact in bf16) and x is exact in its dtype, so the
products are the reference's and the fp32 summation order differs, plus one rounding: like vLLM's
fused MoE, the kernel keeps the SwiGLU output h in ``x.dtype`` for the second matmul, where the
reference keeps it in fp32. With bf16 that is 2^-9 relative per element of h, independent over the
I terms of an output: an error of about 1.7e-3 times the output's std (measured in torch, D = 4096,
I = 2048, T = 300: 7e-3 at most over 1.2M outputs of std 0.58, the builder's scale). That fits
bf16's 1e-2 + 1e-2 |ref| together with the outputs' own bf16 rounding (2^-8 relative), and
1 - cosine = 3e-6 < 1e-4. Under the interpreter h stays fp32 (its fp32 -> bf16 cast truncates), so
there only the output's rounding differs. With fp32 x, h is fp32 and the dots are IEEE fp32: 1e-5.

Shapes: T = 0 and 1, k larger than E_local (repeated experts), dims that are multiples of 32 but
not of the default tiles (the launcher narrows them), experts spanning several row blocks (both
tile configs), all slots skipped; small enough for the interpreter. V4-Flash (D = 4096, I = 2048,
E = 256, k = 6) and its TP = 2 half (E_local = 128) are `gpu`-marked.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from csrc_triton.moe_mxfp4 import moe_experts_mxfp4  # noqa: E402
from csrc_triton.moe_mxfp4_ref import moe_experts_mxfp4 as moe_experts_mxfp4_ref  # noqa: E402
from tests.csrc_triton.kernel_cases import (  # noqa: E402
    DTYPE_IDS, DTYPES, SKIP_REASON, assert_close, moe_mxfp4_args,
)

pytestmark = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)
GPU = pytest.mark.gpu

# (T, D, I, E_local, k, p_hot): swiglu_limit 3 (many gate / up values clamped).
SHAPES = [
    (0, 64, 32, 4, 2, 0.0),
    (1, 32, 32, 1, 1, 0.0),
    (1, 64, 32, 3, 6, 0.0),
    (5, 96, 64, 3, 4, 0.0),
    (17, 160, 96, 5, 3, 0.0),
    (40, 64, 64, 8, 2, 0.6),  # expert 0: ~50 rows in 16-row blocks
    (70, 96, 160, 2, 3, 0.0),  # ~100 rows per expert: 64-row blocks, 32-wide tiles for D = 96
]
# V4-Flash, swiglu_limit 10 as in its config; V4-Pro's D and I (7168 = 56 x 128, not a power of two)
# with 96 of its 384 experts (one rank of four: its weights as large as Flash's 256 experts).
V4_MODELS = [
    pytest.param(1, 4096, 2048, 256, 6, 0.0, marks=GPU),
    pytest.param(16, 4096, 2048, 256, 6, 0.0, marks=GPU),
    pytest.param(300, 4096, 2048, 256, 6, 0.0, marks=GPU),
    pytest.param(64, 4096, 2048, 128, 6, 0.0, marks=GPU),
    pytest.param(16, 7168, 3072, 96, 6, 0.0, marks=GPU, id="pro-16"),
    pytest.param(300, 7168, 3072, 96, 6, 0.0, marks=GPU, id="pro-300"),
]


@pytest.mark.parametrize("narrow_scales", [False, True], ids=["any-scales", "narrow-scales"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T, D, I, E, k, p_hot", SHAPES)
def test_moe_experts_mxfp4_matches_ref(T, D, I, E, k, p_hot, dtype, narrow_scales):
    """Both decodes (one scale product where the weights' scale bytes are <= 128, as here, or two)."""
    args = moe_mxfp4_args(T, D, I, E, k, dtype, p_hot=p_hot, limit=3.0)
    out = moe_experts_mxfp4(*args, narrow_scales=narrow_scales)
    assert out.shape == (T, D)
    assert_close(out, moe_experts_mxfp4_ref(*args), dtype)
    if T > 1:  # token 0 has every slot skipped: exactly 0
        assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("T, D, I, E, k, p_hot", V4_MODELS)
def test_moe_experts_mxfp4_v4_dims(T, D, I, E, k, p_hot):
    args = moe_mxfp4_args(T, D, I, E, k, torch.bfloat16, p_hot=p_hot, limit=10.0)
    assert_close(moe_experts_mxfp4(*args, narrow_scales=True), moe_experts_mxfp4_ref(*args), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T", [0, 1, 9])
def test_moe_experts_mxfp4_adds_the_shared_output(T, dtype):
    """The shared expert's output added in the k-sum's launch: the unfused add of the routed output
    (rounded to x's dtype) and it, bit for bit where the routed sums agree."""
    args = moe_mxfp4_args(T, 64, 64, 4, 3, dtype, limit=3.0)
    shared = torch.randn(T, 64, generator=torch.Generator().manual_seed(3)).to(dtype).to(args[0].device)
    routed = moe_experts_mxfp4(*args)
    out = moe_experts_mxfp4(*args, shared=shared)
    assert torch.equal(out, (routed + shared).to(dtype))
    assert_close(out, moe_experts_mxfp4_ref(*args, shared=shared), dtype)


def test_moe_experts_mxfp4_all_skipped_is_zero():
    """No slot on this rank: zeros, whatever the weights."""
    x, weights, ids, *w, limit = moe_mxfp4_args(6, 64, 32, 4, 2, p_skip=1.0)
    out = moe_experts_mxfp4(x, weights, ids, *w, limit)
    assert torch.equal(out, torch.zeros_like(x))


def test_moe_experts_mxfp4_int32_ids_and_e8m0_scales():
    """ids as int32, scales as float8_e8m0fnu, codes as int8 (the checkpoint's dtypes) are accepted."""
    x, weights, ids, w13, s13, w2, s2, limit = moe_mxfp4_args(9, 64, 64, 4, 3, limit=3.0)
    ref = moe_experts_mxfp4_ref(x, weights, ids, w13, s13, w2, s2, limit)
    out = moe_experts_mxfp4(x, weights, ids.int(), w13.view(torch.int8), s13.view(torch.float8_e8m0fnu),
                            w2.view(torch.int8), s2.view(torch.float8_e8m0fnu), limit)
    assert_close(out, ref, x.dtype)


@pytest.mark.parametrize("narrow_scales", [False, True], ids=["any-scales", "narrow-scales"])
def test_moe_experts_mxfp4_half_codes(narrow_scales):
    """Every code +-0.5 (e2m1 0001 / 1001), the one the decode builds as a bf16 subnormal before
    scaling it: a GPU that flushed subnormal operands would zero every weight here."""
    x, weights, ids, w13, s13, w2, s2, limit = moe_mxfp4_args(5, 64, 64, 2, 2, limit=3.0)
    w13, w2 = torch.full_like(w13, 0x91), torch.full_like(w2, 0x19)  # low nibble +0.5, high -0.5 (and back)
    g = torch.Generator().manual_seed(2)
    s13 = torch.randint(124, 129, s13.shape, generator=g).to(torch.uint8).to(s13.device)
    s2 = torch.randint(120, 125, s2.shape, generator=g).to(torch.uint8).to(s2.device)
    ref = moe_experts_mxfp4_ref(x, weights, ids, w13, s13, w2, s2, limit)
    assert ref.abs().max() > 0.1
    assert_close(moe_experts_mxfp4(x, weights, ids, w13, s13, w2, s2, limit, narrow_scales), ref, x.dtype)


def test_moe_experts_mxfp4_scales_across_the_e8m0_range():
    """W13 scale bytes 129..200 (weights up to 2^75, past the 2^(s - 1) factor bf16 can hold, so both
    factors of the decode act) against x scaled by 2^-75; W2 scale bytes 10..40 (weights down to
    2^-118), the outputs compared scaled up by 2^90. Exact powers of two: any misplaced exponent shows."""
    x, weights, ids, w13, s13, w2, s2, limit = moe_mxfp4_args(9, 64, 64, 4, 3, limit=3.0)
    g = torch.Generator().manual_seed(1)
    s13 = torch.randint(129, 201, s13.shape, generator=g).to(torch.uint8).to(s13.device)
    s2 = torch.randint(10, 41, s2.shape, generator=g).to(torch.uint8).to(s2.device)
    x = x * 2.0**-75
    ref = moe_experts_mxfp4_ref(x, weights, ids, w13, s13, w2, s2, limit)
    out = moe_experts_mxfp4(x, weights, ids, w13, s13, w2, s2, limit)
    assert ref.abs().max() > 2.0**-95  # the scales reached the outputs
    assert_close(out * 2.0**90, ref * 2.0**90, x.dtype)


@pytest.mark.parametrize("config", [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=3),
                                    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2),
                                    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3)],
                         ids=["narrow", "wide", "rows128"])
def test_moe_mxfp4_other_tiles_match_ref(config):
    """The tile shapes scripts/bench_kernels.py times against the default ones compute the same."""
    args = moe_mxfp4_args(5, 64, 64, 4, 2, torch.bfloat16)
    assert_close(moe_experts_mxfp4(*args, config=config), moe_experts_mxfp4_ref(*args), torch.bfloat16)


# (T, k, E, BLOCK_M): decode (one block per hit expert), several blocks per expert, more experts than pairs
@pytest.mark.parametrize("T, k, E, block_m", [(1, 6, 256, 16), (16, 6, 8, 16), (300, 6, 16, 64), (3, 2, 64, 16)])
def test_align_pairs_matches_ref(T, k, E, block_m, monkeypatch):
    """The same blocks per expert (block_expert equal) holding the same pairs, padding and skipped ids
    (E itself, negative, past E) dropped; the order of an expert's pairs in its rows is free. The
    launcher's buffers start poisoned: the kernels write every row and block."""
    from csrc_triton import moe_mxfp4
    from csrc_triton.moe_mxfp4 import align_pairs
    from csrc_triton.moe_mxfp4_ref import align_pairs as align_pairs_ref
    from tests.csrc_triton.kernel_cases import DEVICE

    class PoisonedEmpty:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            return torch.empty(*args, **kwargs).fill_(12345)

    monkeypatch.setattr(moe_mxfp4, "torch", PoisonedEmpty())

    g = torch.Generator().manual_seed(T * k + E)
    ids = torch.randint(0, E, (T, k), generator=g)
    ids.view(-1)[:: 5] = E  # skipped slots
    ids.view(-1)[1] = -3
    ids.view(-1)[-1] = E + 7
    pair_of_row, block_expert = align_pairs(ids.to(DEVICE), E, block_m)
    want_pairs, want_blocks = align_pairs_ref(ids, E, block_m)
    assert torch.equal(block_expert.cpu(), want_blocks)
    rows, want_rows = pair_of_row.cpu().view(-1, block_m), want_pairs.view(-1, block_m)
    for e in range(E):
        mine = block_expert.cpu() == e
        assert torch.equal(rows[mine].flatten().sort().values, want_rows[mine].flatten().sort().values), e
    assert (rows[block_expert.cpu() < 0] == -1).all()
