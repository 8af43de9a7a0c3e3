"""Triton apply_rope_tail against rope_ref (kernel link of the test chain).

Tolerance: kernel_cases.assert_close (fp32 1e-5; bf16 1e-2 + cosine). Positions reach 2^20, so the
kernel's cos / sin must range-reduce like torch's; the nope channels must be copied bit for bit.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from csrc_triton.rope import apply_rope_tail  # noqa: E402
from csrc_triton.rope_ref import apply_rope_tail as apply_rope_tail_ref  # noqa: E402
from tests.csrc_triton.kernel_cases import DTYPE_IDS, DTYPES, SKIP_REASON, assert_close, rope_args  # noqa: E402

pytestmark = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)
GPU = pytest.mark.gpu

# (T, mid, d, r): length 0 and 1, no middle axis (kv), two middle axes, all channels rotated (r = d),
# odd d, a head-block boundary; V4 q (64 heads x 512, r = 64), kv, indexer q (64 x 128).
SHAPES = [
    (0, (2,), 16, 8),
    (1, (1,), 8, 8),
    (5, (), 20, 8),
    (3, (2, 3), 24, 8),
    (4, (33,), 300, 16),
    pytest.param(64, (64,), 512, 64, marks=GPU),
    pytest.param(1000, (), 512, 64, marks=GPU),
    pytest.param(64, (64,), 128, 64, marks=GPU),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("inverse", [False, True], ids=["fwd", "inv"])
@pytest.mark.parametrize("T, mid, d, r", SHAPES)
def test_apply_rope_tail_matches_ref(T, mid, d, r, inverse, dtype):
    args = rope_args(T, mid, d, r, dtype, inverse)
    out = apply_rope_tail(*args)
    ref = apply_rope_tail_ref(*args)
    assert_close(out, ref, dtype)
    assert torch.equal(out[..., : d - r], args[0][..., : d - r])
    assert T == 0 or out.data_ptr() != args[0].data_ptr()


def test_apply_rope_tail_strided_and_roundtrip():
    """A non-contiguous x (the tail of a wider tensor); forward then inverse gives x back."""
    x, pos, inv_freq, _ = rope_args(3, (4,), 40, 8)
    view = x[..., 8:]  # [T, 4, 32]
    assert_close(apply_rope_tail(view, pos, inv_freq), apply_rope_tail_ref(view, pos, inv_freq), torch.float32)
    back = apply_rope_tail(apply_rope_tail(view, pos, inv_freq), pos, inv_freq, inverse=True)
    torch.testing.assert_close(back, view, atol=1e-5, rtol=1e-5)
