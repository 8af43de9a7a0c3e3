"""Triton read_entries / write_entries against kv_cache_ref (kernel link of the test chain).

Bitwise (style §4, data movement): the kernel's FP8 codec is integer arithmetic on the fp32 bits,
so a read equals the reference's decode bit for bit (NaN payloads aside: random bytes hold e4m3 NaN
codes), and a write leaves the whole pool byte-identical to the reference's write, padding between
pages and entries included. Views are strided windows of a padded pool, block tables shuffled,
entries cross block boundaries. V4 sizes (512/64 main entries of 584 B, 128-dim indexer keys,
K = 640 keys per query) are `gpu`-marked; the interpreter runs the same layouts small.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from csrc_triton import kv_cache_ref  # noqa: E402
from csrc_triton.kv_cache import read_entries, write_entries  # noqa: E402
from tests.csrc_triton.kernel_cases import DEVICE, SKIP_REASON, kv_read_args, kv_write_args  # noqa: E402
from vllm_dsv4.kv.layout import Fp8Entry  # noqa: E402

pytestmark = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)
GPU = pytest.mark.gpu

V4_MAIN, TINY_MAIN = Fp8Entry(512, 64), Fp8Entry(64, 16)  # 584 B, 88 B
V4_INDEX, TINY_INDEX = Fp8Entry(128, None), Fp8Entry(32, None)  # 132 B, 36 B
ENTRY_KINDS = {"raw_fp32": (None, torch.float32), "raw_bf16": (None, torch.bfloat16),
               "main_64_16": (TINY_MAIN, None), "main_512_64": (V4_MAIN, None),
               "index_32": (TINY_INDEX, None), "index_128": (V4_INDEX, None)}


def assert_same(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Same shape, dtype and bits (any NaN equals any NaN)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan)
    ints = {2: torch.int16, 4: torch.int32}[out.element_size()]
    assert torch.equal(out.view(ints)[~nan], ref.view(ints)[~nan])


def storage_bytes(view: torch.Tensor) -> torch.Tensor:
    """Every byte of the pool ``view`` looks into."""
    return torch.empty(0, dtype=torch.uint8, device=view.device).set_(view.untyped_storage())


# (kind, req shape, entry shape, R, max_blocks, E): lengths 0 and 1, a scalar request (the indexer
# reads one request's entries), E = 2 (C128), a partial last nope block (48 of 64), padded entries.
READS = [
    ("raw_fp32", (5, 1), (5, 7), 3, 3, 4),
    ("raw_bf16", (5, 1), (5, 7), 3, 3, 4),
    ("raw_fp32", (0, 1), (0, 7), 3, 3, 4),
    ("main_64_16", (4, 1), (4, 9), 3, 4, 4),
    ("main_64_16", (3, 1), (3, 0), 2, 2, 4),
    ("main_64_16", (1, 1), (1, 1), 1, 1, 4),
    ("main_64_16", (), (), 2, 3, 2),
    ("main_512_64", (2, 1), (2, 5), 2, 2, 4),
    ("main_512_64", (3, 1), (3, 4), 2, 3, 2),
    ("index_32", (), (13,), 2, 4, 4),
    ("index_32", (3, 1), (3, 6), 3, 2, 4),
    ("index_128", (2, 1), (2, 5), 2, 3, 4),
    pytest.param("main_512_64", (64, 1), (64, 640), 8, 16, 64, marks=GPU),
    pytest.param("raw_bf16", (64, 1), (64, 640), 8, 16, 64, marks=GPU),
    pytest.param("index_128", (), (16384,), 2, 256, 64, marks=GPU),
]


def _read_args(kind, req_shape, entry_shape, R, max_blocks, E, out_dtype, **kw):
    fp8, raw_dtype = ENTRY_KINDS[kind]
    raw_dim = 512 if max_blocks >= 16 else 24
    return kv_read_args(req_shape, entry_shape, R, max_blocks, E, fp8, raw_dtype or torch.float32, raw_dim,
                        out_dtype, **kw)


@pytest.mark.parametrize("entry_pad", [0, 3], ids=["dense", "padded"])
@pytest.mark.parametrize("kind, req_shape, entry_shape, R, max_blocks, E", READS)
def test_read_entries_matches_ref(kind, req_shape, entry_shape, R, max_blocks, E, entry_pad):
    raw = ENTRY_KINDS[kind][0] is None
    for out_dtype in [torch.float32] if raw else [torch.float32, torch.bfloat16]:  # raw: read in the view's dtype
        args = _read_args(kind, req_shape, entry_shape, R, max_blocks, E, out_dtype, entry_pad=entry_pad)
        out = read_entries(*args)
        ref = kv_cache_ref.read_entries(*args)
        assert out.shape == torch.broadcast_shapes(req_shape, entry_shape) + ref.shape[-1:]
        assert_same(out, ref)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: inf scales, 0 * inf
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["main_64_16", "main_512_64", "index_32"])
def test_read_entries_random_bytes(kind, out_dtype):
    """Any bytes decode as the reference does: NaN codes, scale bytes 0 (2^-127) and 255 (inf),
    subnormal products, fp32 scales of any value (indexer)."""
    args = _read_args(kind, (6, 1), (6, 11), 2, 4, 4, out_dtype, encoded=False)
    fp8 = args[5]
    if fp8.rope_dim is not None:  # scale bytes 0 and 255 in every block's first two entries
        args[0][:, :2, fp8.value_dim + fp8.rope_dim] = torch.tensor([0, 255], dtype=torch.uint8)
    assert_same(read_entries(*args), kv_cache_ref.read_entries(*args))


def test_read_entries_casts_raw_entries():
    """Raw entries to another dtype: torch's cast of the gathered entries."""
    view, bt, req, entry, E, fp8, _ = kv_read_args((4, 1), (4, 5), 2, 3, 4)
    assert_same(read_entries(view, bt, req, entry, E, None, torch.bfloat16),
                kv_cache_ref.read_entries(view, bt, req, entry, E, None, torch.bfloat16))


# (kind, values dtype, R, n entries per request, max_blocks, E)
WRITES = [
    ("raw_fp32", torch.float32, 3, 5, 3, 4),
    ("raw_bf16", torch.float32, 3, 5, 3, 4),
    ("raw_bf16", torch.bfloat16, 2, 7, 3, 4),
    ("main_64_16", torch.float32, 3, 6, 3, 4),
    ("main_64_16", torch.bfloat16, 3, 6, 3, 4),
    ("main_64_16", torch.float32, 1, 1, 1, 4),
    ("main_64_16", torch.float32, 2, 0, 1, 4),
    ("main_512_64", torch.float32, 2, 5, 3, 2),
    ("main_512_64", torch.bfloat16, 2, 5, 3, 4),
    ("index_32", torch.float32, 3, 6, 3, 4),
    ("index_128", torch.bfloat16, 2, 5, 2, 4),
    pytest.param("main_512_64", torch.bfloat16, 16, 512, 16, 64, marks=GPU),
    pytest.param("index_128", torch.bfloat16, 16, 512, 16, 64, marks=GPU),
]


@pytest.mark.parametrize("entry_pad", [0, 3], ids=["dense", "padded"])
@pytest.mark.parametrize("kind, values_dtype, R, n, max_blocks, E", WRITES)
def test_write_entries_matches_ref(kind, values_dtype, R, n, max_blocks, E, entry_pad):
    fp8, raw_dtype = ENTRY_KINDS[kind]
    raw_dim = 512 if max_blocks >= 16 else 24

    def build():
        return kv_write_args(R, n, max_blocks, E, fp8, raw_dtype or torch.float32, raw_dim, values_dtype,
                             entry_pad=entry_pad)

    args, ref_args = build(), build()
    before = storage_bytes(args[0]).clone()
    write_entries(*args)
    kv_cache_ref.write_entries(*ref_args)
    assert torch.equal(storage_bytes(args[0]), storage_bytes(ref_args[0]))
    assert n == 0 or not torch.equal(storage_bytes(args[0]), before)


@pytest.mark.parametrize("kind", ["raw_bf16", "main_64_16", "index_32"])
def test_write_entries_skips_padding_rows(kind):
    """Rows with req = -1 (CUDA-graph padding, masked decode rows) write nothing: the pool equals one
    written with the other rows alone, for kernel and reference."""
    fp8, raw_dtype = ENTRY_KINDS[kind]

    def build():
        return kv_write_args(3, 5, 3, 4, fp8, raw_dtype or torch.float32)

    padded, kept = build(), build()
    pad = torch.arange(padded[2].shape[0], device=padded[2].device) % 3 == 1
    req = torch.where(pad, -1, padded[2])
    entry = torch.where(pad, -1, padded[3])  # never read for a padding row
    write_entries(padded[0], padded[1], req, entry, padded[4], padded[5], fp8)
    write_entries(kept[0], kept[1], kept[2][~pad], kept[3][~pad], kept[4], kept[5][~pad], fp8)
    assert torch.equal(storage_bytes(padded[0]), storage_bytes(kept[0]))
    ref = build()
    kv_cache_ref.write_entries(ref[0], ref[1], req, entry, ref[4], ref[5], fp8)
    assert torch.equal(storage_bytes(ref[0]), storage_bytes(kept[0]))


def _edge_rows(dim: int, nope: int) -> torch.Tensor:
    """Rows whose encoding has no slack: amax at 448 * 2^k and one ulp either side (an fp32 log2 is
    wrong there for |k| >= 4), all-zero and -0 blocks (the 1e-4 floor), e4m3 ties (normal and
    subnormal, both signs) under a scale pinned to 1, bf16 ties in the rope part, huge values."""
    rows = []
    for k in (-20, -9, -5, 0, 4, 7, 19):
        exact = torch.tensor(448 * 2.0**k)
        for amax in (torch.nextafter(exact, torch.tensor(0.0)), exact, torch.nextafter(exact, torch.tensor(1e38))):
            rows.append(torch.full((dim,), 0.3 * 2.0**k).index_fill(0, torch.tensor([1]), -amax))
    rows += [torch.zeros(dim), torch.full((dim,), -0.0), torch.full((dim,), 3e-5)]
    ties = torch.tensor([1 + 1 / 16, 1 + 3 / 16, 2**-10, 3 * 2**-10, 2**-6 - 2**-10, 5 * 2**-10, 448 - 16,
                         15.5 * 2**-7])
    tie_row = torch.cat([ties, -ties]).repeat(dim // 16 + 1)[:dim]
    tie_row[0] = 448.0  # scale 2^0
    bf16_ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(2 + 2**-7), 3 * 2**-9 * 2**-120])
    tie_row[nope:] = bf16_ties.repeat(dim)[: dim - nope]
    rows += [tie_row, torch.full((dim,), 1e30).index_fill(0, torch.tensor([2]), -7e29)]
    return torch.stack(rows).to(DEVICE)


@pytest.mark.parametrize("fp8", [TINY_MAIN, V4_MAIN, TINY_INDEX], ids=["main_64_16", "main_512_64", "index_32"])
def test_write_entries_fp8_edges_match_ref(fp8):
    rows = _edge_rows(fp8.value_dim, fp8.value_dim - (fp8.rope_dim or 0))
    n = rows.shape[0]

    def build():
        view, bt, req, entry, E, _, _ = kv_write_args(1, n, 8, 4, fp8)
        return view, bt, req, entry, E, rows, fp8

    args, ref_args = build(), build()
    write_entries(*args)
    kv_cache_ref.write_entries(*ref_args)
    assert torch.equal(storage_bytes(args[0]), storage_bytes(ref_args[0]))
    read = (args[0], args[1], args[2], args[3], args[4], fp8, torch.float32)
    assert_same(read_entries(*read), kv_cache_ref.read_entries(*read))
