"""Triton norm_rope_insert against kv_insert_ref (kernel link of the test chain).

Exact: every byte of the pool outside the written entries (page and entry padding, slots no row
writes, whatever a padded row with ``req = -1`` would address) is left as it was, by the kernel and
by the reference.

Written entries, kernel vs reference (values decoded, compared in float64). The kernel does the
reference's fp32 operations with its roundings to x.dtype, but sums the squares in another order and
takes rsqrt / cos / sin from another library, so the fp32 values before a rounding differ by a few
ulps (2^-23 each), and a rounding may land on the neighbouring value. An output may so differ by one
ulp of itself plus one ulp of each value of the normed pair ``(n0, n1)`` it is rotated from (rope
channels only): ``|out - ref| <= u (max(|out|, |ref|) + |n0| + |n1|)`` with ``u = 2^-7 + 2^-18`` when
a bf16 rounding is involved (x or the view bf16: one ulp is at most 2^-7 of the value) and
``u = 2^-18`` in pure fp32 (the few ulps, with room for the GPU's approximate rsqrt and fused
multiply-adds). FP8 entries add one e4m3 step either way: ``2^-3 (|out| + |ref|)`` (3 mantissa bits;
a neighbouring value or a block scale one binade apart) plus ``2^-16 max(amax, 1e-4)`` for e4m3
subnormals (scale ``2^k < 2 amax / 448``, subnormal step ``2^(k-9)``). Roundings rarely move, so
besides the bound at least 99% of the written values (FP8: bytes) must be identical whenever a bf16
or e4m3 rounding is involved.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from csrc_triton import kv_cache_ref, kv_insert_ref  # noqa: E402
from csrc_triton.kv_insert import norm_rope_insert  # noqa: E402
from csrc_triton.kv_pack_ref import unpack_index, unpack_main  # noqa: E402
from csrc_triton.norm_ref import rms_norm  # noqa: E402
from csrc_triton.rope_ref import apply_rope_tail  # noqa: E402
from tests.csrc_triton.kernel_cases import SKIP_REASON, entry_parts, kv_insert_args, rope_pair_magnitude  # noqa: E402
from vllm_dsv4.kv.layout import Fp8Entry  # noqa: E402

KERNEL = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)
GPU = pytest.mark.gpu

# kind -> (fp8, raw view dtype, D, r): V4-Flash main KV (512, rope 64, 584 B) and indexer keys
# (128, rope 64, 132 B), small ones with a partial nope block (48 of 64) and r < D / 2.
KINDS = {"raw_fp32": (None, torch.float32, 24, 8), "raw_bf16": (None, torch.bfloat16, 24, 8),
         "raw_bf16_512": (None, torch.bfloat16, 512, 64),
         "main_64_16": (Fp8Entry(64, 16), None, 64, 16), "main_512_64": (Fp8Entry(512, 64), None, 512, 64),
         "index_32": (Fp8Entry(32, None), None, 32, 8), "index_128": (Fp8Entry(128, None), None, 128, 64)}


def _args(kind, x_dtype, N, R=3, max_blocks=3, E=4, **kw):
    fp8, raw_dtype, D, r = KINDS[kind]
    return kv_insert_args(N, D, r, fp8, raw_dtype or torch.float32, x_dtype, R, max_blocks, E, **kw)


def storage_bytes(view: torch.Tensor) -> torch.Tensor:
    """Every byte of the pool ``view`` looks into."""
    return torch.empty(0, dtype=torch.uint8, device=view.device).set_(view.untyped_storage())


def _written(write, build) -> torch.Tensor:
    """Run ``write`` on ``build()``'s arguments; return the written entries ``[M, C]`` (rows with req >= 0),
    after checking that every other byte of the pool is as a fresh ``build()`` holds it."""
    args, before = build(), build()
    write(*args)
    view, bt, req, entry, E, fp8 = args[5], args[6], args[7], args[8], args[9], args[10]
    keep = req >= 0
    block, offset = bt[req[keep], entry[keep] // E].long(), entry[keep] % E
    slots = torch.cat([part[block, offset] for part in entry_parts(view, fp8)], -1)  # [M, C] copy
    for part, part_before in zip(entry_parts(view, fp8), entry_parts(before[5], fp8)):
        part[block, offset] = part_before[block, offset]
    assert torch.equal(storage_bytes(view), storage_bytes(before[5]))
    return slots


def _decode(slots: torch.Tensor, fp8) -> torch.Tensor:
    if fp8 is None:
        return slots.double()
    if fp8.rope_dim is None:
        return unpack_index(slots, torch.float32).double()
    return unpack_main(slots, fp8.value_dim, fp8.rope_dim, torch.float32).double()


def assert_insert_matches_ref(build) -> None:
    """The kernel and the reference on ``build()``'s arguments: bytes outside the written entries
    untouched, written entries within the module's bounds."""
    out = _written(norm_rope_insert, build)
    ref = _written(kv_insert_ref.norm_rope_insert, build)
    x, weight, eps, _, inv_freq, view, _, req, _, _, fp8 = build()
    keep = req >= 0
    assert out.shape == ref.shape, (out.shape, ref.shape)
    if out.numel() == 0:
        return
    o, f = _decode(out, fp8).cpu(), _decode(ref, fp8).cpu()
    assert torch.isfinite(f).all()
    normed = rms_norm(x[keep], weight, eps).double().cpu()  # [M, D], the reference's normed values
    rounded = fp8 is not None or torch.bfloat16 in (x.dtype, view.dtype)
    u = (2**-7 if torch.bfloat16 in (x.dtype, view.dtype) else 0.0) + 2**-18
    bound = u * (torch.maximum(o.abs(), f.abs()) + rope_pair_magnitude(normed, 2 * inv_freq.numel()))
    if fp8 is not None:
        amax = f.abs().amax(-1, keepdim=True).clamp(min=1e-4)
        bound += 2**-3 * (o.abs() + f.abs()) + 2**-16 * amax
    excess = (o - f).abs() - bound
    assert excess.max() <= 0, ((o - f).abs().max().item(), excess.argmax().item())
    if rounded:
        same = (out == ref).double().mean().item()
        assert same >= 0.99, same


# (kind, x dtype, N, R, max_blocks, E): lengths 0 and 1, E = 2 (C128), rows spread over many blocks.
CASES = [
    ("raw_fp32", torch.float32, 9, 3, 3, 4),
    ("raw_fp32", torch.bfloat16, 9, 3, 3, 4),
    ("raw_bf16", torch.float32, 9, 3, 3, 4),
    ("raw_bf16", torch.bfloat16, 9, 3, 3, 4),
    ("raw_bf16", torch.bfloat16, 0, 2, 2, 4),
    ("raw_bf16", torch.bfloat16, 1, 2, 2, 4),
    ("main_64_16", torch.float32, 12, 3, 3, 4),
    ("main_64_16", torch.bfloat16, 12, 2, 4, 2),
    ("main_64_16", torch.bfloat16, 1, 1, 1, 4),
    ("index_32", torch.float32, 9, 3, 3, 4),
    ("index_32", torch.bfloat16, 9, 2, 4, 2),
    ("raw_bf16_512", torch.bfloat16, 40, 4, 4, 4),
    ("main_512_64", torch.bfloat16, 40, 4, 4, 4),
    ("main_512_64", torch.float32, 40, 4, 4, 4),
    ("index_128", torch.bfloat16, 40, 4, 4, 4),
    ("index_128", torch.float32, 40, 4, 4, 4),
    pytest.param("main_512_64", torch.bfloat16, 4096, 16, 16, 64, marks=GPU),
    pytest.param("raw_bf16_512", torch.bfloat16, 4096, 16, 16, 64, marks=GPU),
    pytest.param("index_128", torch.bfloat16, 4096, 16, 16, 64, marks=GPU),
]


@KERNEL
@pytest.mark.parametrize("entry_pad", [0, 3], ids=["dense", "padded"])
@pytest.mark.parametrize("kind, x_dtype, N, R, max_blocks, E", CASES)
def test_norm_rope_insert_matches_ref(kind, x_dtype, N, R, max_blocks, E, entry_pad):
    assert_insert_matches_ref(lambda: _args(kind, x_dtype, N, R, max_blocks, E, entry_pad=entry_pad))


@KERNEL
@pytest.mark.parametrize("kind", ["raw_fp32", "main_64_16", "index_32"])
def test_norm_rope_insert_strided_x_int32_indices(kind):
    """x a column window of a wider tensor, int32 positions / requests / entries, an int64 block table."""

    def build():
        x, weight, eps, pos, inv_freq, view, bt, req, entry, E, fp8 = _args(kind, torch.bfloat16, 9)
        wide = torch.cat([torch.full_like(x, float("nan")), x, x], 1)[:, x.shape[1] : 2 * x.shape[1]]
        return (wide, weight, eps, pos.int(), inv_freq, view, bt.long(), req.int(), entry.int(), E, fp8)

    assert not build()[0].is_contiguous()
    assert_insert_matches_ref(build)


@KERNEL
@pytest.mark.parametrize("kind", ["raw_bf16", "main_512_64", "index_128"])
def test_norm_rope_insert_all_rows_padded(kind):
    """No row has a request: the pool stays byte-identical."""
    args = _args(kind, torch.bfloat16, 16, p_pad=1.0)
    before = storage_bytes(args[5]).clone()
    norm_rope_insert(*args)
    assert torch.equal(storage_bytes(args[5]), before)


@pytest.mark.parametrize("kind", ["raw_fp32", "main_64_16", "index_32"])
def test_ref_is_the_unfused_ops_row_by_row(kind):
    """The reference equals rms_norm, apply_rope_tail and write_entries applied to each row with a
    request, one at a time, and skips the padded rows (bit for bit: the same ops)."""
    build = lambda: _args(kind, torch.bfloat16, 9, device="cpu")  # noqa: E731
    ref = _written(kv_insert_ref.norm_rope_insert, build)
    x, weight, eps, pos, inv_freq, view, bt, req, entry, E, fp8 = build()
    for t in range(x.shape[0]):
        if req[t] >= 0:
            value = apply_rope_tail(rms_norm(x[t : t + 1], weight, eps), pos[t : t + 1], inv_freq)
            kv_cache_ref.write_entries(view, bt, req[t : t + 1], entry[t : t + 1], E, value, fp8)
    keep = req >= 0
    block, offset = bt[req[keep], entry[keep] // E].long(), entry[keep] % E
    assert torch.equal(torch.cat([part[block, offset] for part in entry_parts(view, fp8)], -1), ref)
