"""Triton pool_state_windows and write_state_rows against compressor_ref (kernel link of the test chain).

Tolerance: kernel_cases.assert_close (fp32 1e-5). The windows' rows sit at shuffled entries of a
padded state pool; invalid slots hold NaN / inf (they must never be read); entry 1 of N >= 3 has no
valid slot and entry 3 of N >= 4 request -1: both must pool to exactly 0.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from csrc_triton.compressor import pool_state_windows, write_state_rows  # noqa: E402
from csrc_triton.compressor_ref import pool_state_windows as pool_state_windows_ref  # noqa: E402
from csrc_triton.compressor_ref import write_state_rows as write_state_rows_ref  # noqa: E402
from tests.csrc_triton.kernel_cases import (  # noqa: E402
    DTYPE_IDS, DTYPES, SKIP_REASON, assert_close, pool_windows_args, state_write_args,
)

pytestmark = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)
GPU = pytest.mark.gpu

# (N, m, d, overlap): length 0 and 1, odd d, a channel-block boundary (d = 1025 at S = 8 is 2 blocks),
# non-power-of-two windows, HCA at m = 128; V4 main (d = 512) and indexer (d = 128) widths.
SHAPES = [
    (0, 4, 8, True),
    (1, 4, 5, True),
    (3, 4, 5, False),
    (5, 3, 20, True),
    (4, 6, 17, False),
    (3, 128, 5, False),
    (2, 4, 1025, True),
    pytest.param(300, 4, 512, True, marks=GPU),
    pytest.param(300, 4, 128, True, marks=GPU),
    pytest.param(64, 128, 512, False, marks=GPU),
]


@pytest.mark.parametrize("N, m, d, overlap", SHAPES)
@pytest.mark.parametrize("E", [4, 64])
def test_pool_state_windows_matches_ref(N, m, d, overlap, E):
    args = pool_windows_args(N, m, d, overlap, E=E)
    out = pool_state_windows(*args)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert_close(out, pool_state_windows_ref(*args), torch.float32)
    for w in (1, 3)[: (N >= 3) + (N >= 4)]:  # no valid slot; request -1
        assert torch.equal(out[w], torch.zeros_like(out[w]))


# (T, W, ratio): none, one token, a channel-block boundary (W = 1030), C4 main (c d = 2 x 512) and
# indexer (2 x 128) rows, C128 (1 x 512).
STATE_SHAPES = [(0, 8, 4), (1, 8, 4), (9, 1030, 4), (12, 20, 128), pytest.param(64, 1024, 4, marks=GPU),
                pytest.param(64, 256, 4, marks=GPU), pytest.param(64, 512, 128, marks=GPU)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T, W, ratio", STATE_SHAPES)
def test_write_state_rows_matches_ref(T, W, ratio, dtype):
    """The whole pool after the write: the written rows exactly (fp32 casts and one fp32 add), padding
    rows not written, every other slot untouched."""
    view, *rest = state_write_args(T, W, ratio, dtype=dtype)
    want = view.clone()
    write_state_rows(view, *rest)
    write_state_rows_ref(want, *rest)
    assert torch.equal(view.cpu(), want.cpu())
