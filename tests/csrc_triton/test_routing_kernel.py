"""Triton route and swiglu_clamped against routing_ref (kernel link of the test chain).

Selection: each row's ids must be *a* top-k of ``s + bias`` (float64, ties within 1e-6 may go either
way); on fp32 logits (no ties) the id sets equal the reference's. Weights: the reference's hash path
evaluated at the kernel's ids, same slot order (fp32 outputs: 1e-5).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from csrc_triton.routing import route, swiglu_clamped  # noqa: E402
from csrc_triton.routing_ref import route as route_ref  # noqa: E402
from csrc_triton.routing_ref import swiglu_clamped as swiglu_clamped_ref  # noqa: E402
from tests.csrc_triton.kernel_cases import (  # noqa: E402
    DTYPE_IDS, DTYPES, SKIP_REASON, assert_close, assert_valid_topk, route_args,
)

pytestmark = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)
GPU = pytest.mark.gpu

# (T, E, k): length 0 and 1, a token block boundary, odd E, k = E, V4-Flash (E = 256, k = 6).
SHAPES = [(0, 8, 3), (1, 8, 3), (17, 8, 3), (5, 13, 13), (3, 256, 6), pytest.param(4096, 256, 6, marks=GPU),
          pytest.param(7, 384, 6, marks=GPU)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("renormalize, with_bias", [(True, True), (False, False)], ids=["renorm-bias", "plain"])
@pytest.mark.parametrize("T, E, k", SHAPES)
def test_route_topk_matches_ref(T, E, k, renormalize, with_bias, dtype):
    logits, k, rsf, renormalize, bias, _ = route_args(T, E, k, renormalize, with_bias, dtype=dtype)
    w, ids = route(logits, k, rsf, renormalize, bias)
    assert w.shape == ids.shape == (T, k) and w.dtype == torch.float32 and ids.dtype == torch.int64
    sel_key = F.softplus(logits.double()).sqrt() + (0 if bias is None else bias.double())
    assert_valid_topk(ids.cpu(), sel_key.cpu(), torch.full((T,), E), k, tol=1e-6)
    w_at_ids, _ = route_ref(logits, k, rsf, renormalize, bias, hash_ids=ids)
    assert_close(w, w_at_ids, torch.float32)
    if dtype == torch.float32 and T:
        _, ids_ref = route_ref(logits, k, rsf, renormalize, bias)
        assert torch.equal(ids.sort(-1).values, ids_ref.sort(-1).values)


@pytest.mark.parametrize("T, E, k", [(0, 8, 2), (5, 8, 2), (9, 13, 4), pytest.param(4096, 256, 6, marks=GPU)])
def test_route_hash_matches_ref(T, E, k):
    logits, k, rsf, renormalize, bias, hash_ids = route_args(T, E, k, hashed=True)
    w, ids = route(logits, k, rsf, renormalize, bias, hash_ids)
    w_ref, ids_ref = route_ref(logits, k, rsf, renormalize, bias, hash_ids)
    assert torch.equal(ids, ids_ref)  # the table's order, bias ignored
    assert_close(w, w_ref, torch.float32)


def test_route_extreme_logits():
    """Very negative logits keep their tiny score (log1p), large ones are linear (softplus(x) ~ x)."""
    logits = torch.tensor([[-30.0, -20.0, -90.0, 0.0, 25.0, 80.0, -5.0, 3.0]], device=route_args(1, 8, 2)[0].device)
    w, ids = route(logits, 8, 1.0, False)
    w_ref, _ = route_ref(logits, 8, 1.0, False, hash_ids=ids)
    assert_close(w, w_ref, torch.float32)
    assert (w > 0).all()


# (leading shape, I): one token, a channel block boundary, 3-d input, V4-Flash's shared expert (I = 2048).
SWIGLU_SHAPES = [((1,), 8), ((5,), 1030), ((2, 3), 16), pytest.param((64,), 2048, marks=GPU),
                 pytest.param((8192,), 2048, marks=GPU)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("lead, inter", SWIGLU_SHAPES)
def test_swiglu_clamped_matches_ref(lead, inter, dtype):
    """Values spread over +-4L, so both clamps and SiLU's both tails are exercised."""
    from tests.csrc_triton.kernel_cases import DEVICE

    g = torch.Generator().manual_seed(inter)
    limit = 3.0
    gate_up = (torch.randn(*lead, 2 * inter, generator=g) * 4 * limit).to(dtype).to(DEVICE)
    assert_close(swiglu_clamped(gate_up, limit), swiglu_clamped_ref(gate_up, limit), dtype)
