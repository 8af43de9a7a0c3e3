"""Input builders, tolerances and the device switch shared by the kernel tests and scripts/bench_kernels.py.

Where kernels run: on CUDA when there is a GPU; otherwise only under Triton's interpreter, on CPU
tensors. Triton decides interpretation when ``triton`` is imported (its own ``tl.*`` helpers are
decorated then), so it cannot be switched per test: the CPU run of the kernel tests is its own
process, ``TRITON_INTERPRET=1 pytest tests/csrc_triton -k kernel``. Without CUDA and without that
variable the kernel tests skip (``SKIP_REASON``).

Each builder returns the positional arguments of the reference function (and of the kernel launcher,
which has the same signature), with every parameter that defaults to zero randomised (style §6.6).

Tolerances (kernel vs reference, compared in float64): fp32 inputs ``|diff| <= 1e-5 + 1e-5 |ref|``;
bf16 inputs ``|diff| <= 1e-2 + 1e-2 |ref|`` (one bf16 ulp of outputs up to 4 is 1.6e-2, and the
kernel and the reference may round the same fp32 value to neighbouring bf16 values) and cosine
similarity > 0.9999.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from csrc_triton import kv_cache_ref
from csrc_triton.formats import e8m0_to_float32
from csrc_triton.paged import CacheSource
from tests.skips import KERNELS_RUN_INTERPRETED

ON_GPU = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
SKIP_REASON = "" if ON_GPU or INTERPRET else KERNELS_RUN_INTERPRETED

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g: torch.Generator, *shape: int, dtype=torch.float32, device=DEVICE, scale: float = 1.0) -> Tensor:
    """Drawn on the CPU generator (same values on every device), then cast and moved; tensors of
    more than 2^22 values (benchmark sizes) are drawn on the device, seeded from ``g``."""
    if math.prod(shape) <= 1 << 22 or torch.device(device).type == "cpu":
        return (scale * torch.randn(*shape, generator=g)).to(dtype).to(device)
    gd = torch.Generator(device=device).manual_seed(int(torch.randint(0, 1 << 31, (1,), generator=g)))
    return (scale * torch.randn(*shape, generator=gd, device=device)).to(dtype)


def assert_close(out: Tensor, ref: Tensor, in_dtype: torch.dtype, what: str = "") -> None:
    """Kernel vs reference with the module's tolerances (fp32: 1e-5; bf16: 1e-2 + cosine)."""
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    assert out.dtype == ref.dtype, (what, out.dtype, ref.dtype)
    o, r = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(o).all() == torch.isfinite(r).all(), what
    tol = 1e-5 if in_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(o, r, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")
    if in_dtype != torch.float32 and r.numel() and r.norm() > 0:
        cos = torch.nn.functional.cosine_similarity(o.flatten(), r.flatten(), dim=0).item()
        assert cos > 0.9999, (what, cos)


# ------------------------------------------------------------------------------ sparse_attn §5.3
def sparse_attn_args(T: int, H: int, K: int, d: int, dtype=torch.float32, p_valid: float = 0.7,
                     seed: int = 0, device=DEVICE, empty_row: bool = True) -> tuple:
    """``(q [T,H,d], kv [T,K,d], valid [T,K], sink [H], scale)``; row 0 all-invalid when T > 1 (and
    ``empty_row``), NaN in every invalid slot (what an unfilled cache slot may hold)."""
    g = _gen(seed)
    q = _randn(g, T, H, d, dtype=dtype, device=device)
    kv = _randn(g, T, K, d, dtype=dtype, device=device)
    valid = torch.rand(T, K, generator=g) < p_valid  # [T, K]
    if T > 1 and empty_row:
        valid[0] = False
    kv[~valid.to(device)] = float("nan")
    sink = _randn(g, H, device=device, scale=2.0)
    return q, kv, valid.to(device), sink, d**-0.5


def _cached_source(g: torch.Generator, R: int, E: int, num_entries: int, d: int, fp8, dtype: torch.dtype,
                   req: Tensor, entries: Tensor, entry_pad: int, device) -> CacheSource:
    """A source of ``num_entries`` entries per request that holds keys at every (req, entry) of a valid
    slot (normals times ``2^j`` per 16 values, ``j`` in [-2, 1]: FP8 blocks of different scales),
    written by the reference writer, and NaN (raw) or 0xFF bytes (FP8: NaN codes, inf scales)
    everywhere else. Shuffled column-major block table (vLLM's is wider than needed: one spare
    block), strided view into a padded pool (``kv_view``)."""
    bt, num_blocks = kv_block_table(g, R, -(-num_entries // E) + 1, device)
    bt = bt.t().contiguous().t()  # [R, max_blocks], strides (1, R)
    C = d if fp8 is None else fp8.entry_bytes
    view = kv_view(g, num_blocks, E, C, dtype if fp8 is None else torch.uint8, entry_padding(fp8, entry_pad), device)
    view.fill_(float("nan") if fp8 is None else 0xFF)
    valid = (entries >= 0) & (req[:, None] >= 0)  # [T, n]
    r, e = req[:, None].expand_as(entries)[valid].long(), entries[valid].long()  # [N] each
    j = torch.randint(-2, 2, (r.shape[0], d // 16 + 1), generator=g).float().repeat_interleave(16, 1)[:, :d]
    x = (torch.randn(r.shape[0], d, generator=g) * 2.0**j).to(device)  # [N, d]
    kv_cache_ref.write_entries(view, bt, r.to(device), e.to(device), E, x, fp8)
    return CacheSource(view, bt, E, fp8)


def sparse_attn_cached_args(T: int, H: int, d: int, W: int, K: int | None, fp8=None, dtype=torch.float32,
                            R: int = 3, E: tuple[int, int] = (4, 4), entries: tuple[int, int] = (24, 24),
                            visible: int | None = None, p_hole: float = 0.2, entry_pad: int = 3,
                            padding: bool = True, seed: int = 0, device=DEVICE) -> tuple:
    """``(q [T,H,d], sink [H], scale, req [T], window, window_entries [T,W], main, main_entries [T,K])``
    of ``sparse_attn_ref.sparse_attn_cached``; ``main`` and ``main_entries`` None when ``K`` is None.

    Sources (``_cached_source``) hold raw entries in ``dtype`` (q's) or FP8 main entries (``fp8``), ``E``
    entries per block and ``entries`` entries per request (window, main). Window slots are the ``W``
    positions up to a random one (-1 before position 0), main slots ``K`` random entries, or, with
    ``visible``, ``arange(K)`` with -1 from a random count (at most ``visible``) on (a C128 decode's
    fixed-width slot list); then a share ``p_hole`` of every slot is -1. With ``padding`` and T > 2, row 0 is a
    padding row (``req = -1``, entries >= 0 that must not be read) and row 1 has no valid slot.
    ``req`` int32, window entries int64, main entries int32 (both index widths)."""
    g = _gen(seed)
    q = _randn(g, T, H, d, dtype=dtype, device=device)
    sink = _randn(g, H, device=device, scale=2.0)
    req = torch.randint(0, R, (T,), generator=g, dtype=torch.int32)
    pos = torch.randint(0, entries[0], (T, 1), generator=g)
    window_entries = pos - W + 1 + torch.arange(W)  # [T, W]
    window_entries[window_entries < 0] = -1
    window_entries[torch.rand(T, W, generator=g) < p_hole] = -1
    main_entries = None
    if K is not None:
        if visible is None:
            main_entries = torch.randint(0, entries[1], (T, K), generator=g, dtype=torch.int32)
        else:
            nv = torch.randint(0, visible + 1, (T, 1), generator=g)
            main_entries = torch.where(torch.arange(K) < nv, torch.arange(K), -1).int()
        main_entries[torch.rand(T, K, generator=g) < p_hole] = -1
    if padding and T > 2:
        req[0] = -1
        window_entries[0] = torch.arange(W) % entries[0]
        window_entries[1] = -1
        if main_entries is not None:
            main_entries[0] = torch.arange(K) % entries[1]
            main_entries[1] = -1
    window = _cached_source(g, R, E[0], entries[0], d, fp8, dtype, req, window_entries, entry_pad, device)
    main = None if K is None else _cached_source(g, R, E[1], entries[1], d, fp8, dtype, req, main_entries,
                                                  entry_pad, device)
    return (q, sink, d**-0.5, req.to(device), window, window_entries.to(device), main,
            None if main_entries is None else main_entries.to(device))


def cached_keys(source: CacheSource, req: Tensor, entries: Tensor, dtype: torch.dtype) -> Tensor:
    """``[T, n, d]`` keys of ``sparse_attn_cached`` gathered independently of ``read_entries``: the whole
    pool decoded (``kv_pack_ref.unpack_main`` or a cast), then indexed through the block table
    (invalid slots read request 0's entry 0)."""
    from csrc_triton.kv_pack_ref import unpack_main

    view, bt, E, fp8 = source.view, source.block_table, source.entries_per_block, source.fp8
    pool = view.to(dtype) if fp8 is None else unpack_main(stored_entries(view, fp8), fp8.value_dim, fp8.rope_dim,
                                                          dtype)  # [N, E, d]
    r = req.clamp(min=0).long()[:, None].expand_as(entries)
    e = entries.clamp(min=0).long()
    return pool[bt.long()[r, e // E], e % E]


def sparse_attn_bytes(T: int, H: int, K: int, d: int, dtype: torch.dtype) -> int:
    """Bytes the op must move: keys once per token, q and out once, the mask."""
    e = torch.finfo(dtype).bits // 8
    return T * K * d * e + 2 * T * H * d * e + T * K


def sparse_attn_cached_bytes(T: int, H: int, d: int, slots: int, read: int, entry_bytes: int,
                             dtype: torch.dtype) -> int:
    """Bytes :func:`sparse_attn_cached` must move: each of ``read`` valid slots' entry (``entry_bytes``)
    and block-table entry (4 B) once per token, ``slots`` entry numbers (8 B, int64 as the model's),
    q and out once."""
    e = torch.finfo(dtype).bits // 8
    return T * read * (entry_bytes + 4) + 8 * T * slots + 2 * T * H * d * e


# -------------------------------------------------------------------------------------- mHC §4
def mhc_pre_args(T: int, n: int, D: int, dtype=torch.float32, sinkhorn_iters: int = 20, seed: int = 0,
                 device=DEVICE) -> tuple:
    """``(x [T,n,D], fn [(2+n)n, nD], base, scale [3], rms_eps, hc_eps, sinkhorn_iters)``."""
    g = _gen(seed)
    M = (2 + n) * n
    x = _randn(g, T, n, D, dtype=dtype, device=device)
    fn = _randn(g, M, n * D, device=device, scale=(n * D) ** -0.5)
    base = _randn(g, M, device=device)
    scale = (0.5 + torch.rand(3, generator=g)).to(device)
    return x, fn, base, scale, 1e-6, 1e-6, sinkhorn_iters


def hc_head_args(T: int, n: int, D: int, dtype=torch.float32, norm: bool = False, seed: int = 0,
                 device=DEVICE) -> tuple:
    """``(x [T,n,D], fn [n, nD], base [n], scale [1], rms_eps, hc_eps)`` of ``mhc_ref.hc_head`` (:func:`mhc_pre_args`'
    first n rows), with ``norm`` also the final norm's ``(weight [D], eps)``."""
    x, fn, base, scale, rms_eps, hc_eps, _ = mhc_pre_args(T, n, D, dtype, seed=seed, device=device)
    args = (x, fn[:n], base[:n], scale[:1], rms_eps, hc_eps)
    return (*args, (0.5 + torch.rand(D, generator=_gen(seed + 1))).to(device), 1e-6) if norm else args


def mhc_post_args(T: int, n: int, D: int, dtype=torch.float32, seed: int = 0, device=DEVICE) -> tuple:
    """``(o [T,D], x [T,n,D], post [T,n] fp32, comb [T,n,n] fp32)``."""
    g = _gen(seed)
    o = _randn(g, T, D, dtype=dtype, device=device)
    x = _randn(g, T, n, D, dtype=dtype, device=device)
    post = (2 * torch.rand(T, n, generator=g)).to(device)
    comb = torch.rand(T, n, n, generator=g).to(device)
    return o, x, post, comb


def mhc_pre_bytes(T: int, n: int, D: int, dtype: torch.dtype) -> int:
    """X twice (the coefficients of y need all of X first), y, fn once."""
    e = torch.finfo(dtype).bits // 8
    return 2 * T * n * D * e + T * D * e + (2 + n) * n * n * D * 4


def mhc_post_bytes(T: int, n: int, D: int, dtype: torch.dtype) -> int:
    e = torch.finfo(dtype).bits // 8
    return T * D * e + 2 * T * n * D * e


# ------------------------------------------------------------------------------- compressor §5.4
def compress_args(N: int, m: int, d: int, overlap: bool, dtype=torch.float32, seed: int = 0,
                  device=DEVICE) -> tuple:
    """``(rows [N, S, 2cd], valid [N, S], overlap, d)`` with S = 2m (CSA) or m (HCA). Invalid: the
    first slot of entry 0 (all A slots for CSA), the last slot of the last entry, all of entry 1 when
    N >= 3; invalid slots hold NaN, one holds inf."""
    g = _gen(seed)
    c, S = (2, 2 * m) if overlap else (1, m)
    rows = _randn(g, N, S, 2 * c * d, device="cpu", scale=2.0)
    valid = torch.ones(N, S, dtype=torch.bool)
    if N:
        valid[0, : (m if overlap else 1)] = False
        valid[-1, -1] = False
    if N >= 3:
        valid[1] = False
    rows[~valid] = float("nan")
    if N:
        rows[0, 0] = float("inf")
    return rows.to(dtype).to(device), valid.to(device), overlap, d


def pool_windows_args(N: int, m: int, d: int, overlap: bool, E: int = 4, R: int = 3, entry_pad: int = 3,
                      seed: int = 0, device=DEVICE) -> tuple:
    """``(view, block_table, req [N, 1], entry [N, S], valid [N, S], overlap, d, E)`` of
    ``compressor_ref.pool_state_windows``: :func:`compress_args`' rows (NaN / inf in the invalid slots)
    stored at distinct entries of their window's request (window w: request w % R, its slots'
    entries shuffled) in a padded fp32 pool (``kv_view``) through a shuffled block table; window 3
    (N >= 4) then has request -1 (a window nobody stores)."""
    rows, valid, overlap, d = compress_args(N, m, d, overlap, seed=seed, device="cpu")
    S = rows.shape[1]
    g = _gen(seed + 1)
    max_blocks = -(-(-(-N // R) * S) // E) + 1
    bt, num_blocks = kv_block_table(g, R, max_blocks, "cpu")
    view = kv_view(g, num_blocks, E, rows.shape[2], torch.float32, entry_pad, device)
    req = torch.arange(N)[:, None] % R  # [N, 1]
    entry = torch.empty(N, S, dtype=torch.int64)
    for r in range(R):
        mine = (req[:, 0] == r).nonzero().squeeze(1)
        entry[mine] = torch.randperm(max_blocks * E, generator=g)[: len(mine) * S].view(-1, S)
    view[bt[req, entry // E].long().to(device), (entry % E).to(device)] = rows.to(device)
    if N >= 4:
        req[3] = -1
    return view, bt.to(device), req.to(device), entry.to(device), valid.to(device), overlap, d, E


def compress_bytes(N: int, S: int, d: int, dtype: torch.dtype) -> int:
    e = torch.finfo(dtype).bits // 8
    return N * S * 2 * d * e + N * S + N * d * 4


# ---------------------------------------------------------------------------------- indexer §5.5
def indexer_args(num_visible: list[int], N: int, H: int, di: int, topk: int, dtype=torch.float32,
                 seed: int = 0, device=DEVICE) -> tuple:
    """``(q [Tq,H,di], weights [Tq,H], keys [N,di], num_visible [Tq] int64, topk)``; weights carry
    the caller's ``di**-0.5 * H**-0.5`` and both signs."""
    g = _gen(seed)
    Tq = len(num_visible)
    q = _randn(g, Tq, H, di, dtype=dtype, device=device)
    keys = _randn(g, N, di, dtype=dtype, device=device)
    weights = _randn(g, Tq, H, device=device, scale=(di * H) ** -0.5)
    return q, weights, keys, torch.tensor(num_visible, dtype=torch.int64, device=device), topk


def indexer_ref_scores(q: Tensor, weights: Tensor, keys: Tensor) -> Tensor:
    """``[Tq, N]`` float64 scores from the formula (no masking)."""
    logits = torch.einsum("thc,nc->thn", q.double(), keys.double()).clamp(min=0)
    return torch.einsum("thn,th->tn", logits, weights.double())


def assert_valid_topk(sel: Tensor, scores: Tensor, num_visible: Tensor, topk: int, tol: float) -> None:
    """``sel [Tq, topk]`` is *a* top-k of the visible prefix of ``scores`` (ties within ``tol`` may go
    either way), -1 exactly in the spare slots, which come last (every layer's list then has the same
    valid length: ops/flashmla.py shares its plans on that), no duplicates."""
    assert sel.shape == (scores.shape[0], topk) and sel.dtype == torch.int64, (sel.shape, sel.dtype)
    for t in range(sel.shape[0]):
        nv = min(int(num_visible[t]), scores.shape[1])
        picked = [i for i in sel[t].tolist() if i >= 0]
        assert len(picked) == min(topk, nv) and len(set(picked)) == len(picked), (t, picked, nv)
        assert (sel[t, len(picked):] == -1).all(), (t, sel[t])  # the spare slots are a suffix
        assert all(i < nv for i in picked) and (sel[t] >= -1).all(), (t, picked, nv)
        rest = sorted(set(range(nv)) - set(picked))
        if picked and rest:
            lo = scores[t, picked].min().item()
            hi = scores[t, rest].max().item()
            assert lo >= hi - tol, (t, lo, hi)


def indexer_paged_args(num_visible: list[int], req: list[int], R: int, N: int, H: int, di: int, topk: int,
                       E: int, fp8=None, dtype=torch.float32, entry_pad: int = 3, seed: int = 0,
                       device=DEVICE) -> tuple:
    """``(q [B,H,di], weights [B,H], view, block_table, req [B], num_visible [B], E, fp8, topk, N)`` of
    ``indexer_ref.indexer_topk_paged``. ``view`` is a strided window of a padded pool (``kv_view``: page
    stride > ``E * C``) holding FP8 entries of normal keys (``fp8``) or normals in ``dtype``; the block
    table is shuffled, column-major (neither stride 1 per row) and one block wider than ``N`` needs
    (vLLM's covers ``max_model_len``); ``req`` int32, ``num_visible`` int64."""
    from csrc_triton.kv_pack_ref import pack_index

    g = _gen(seed)
    B = len(num_visible)
    q = _randn(g, B, H, di, dtype=dtype, device=device)
    weights = _randn(g, B, H, device=device, scale=(di * H) ** -0.5)
    bt, num_blocks = kv_block_table(g, R, -(-N // E) + 1, device)
    C = di if fp8 is None else fp8.entry_bytes
    view = kv_view(g, num_blocks, E, C, dtype if fp8 is None else torch.uint8, entry_pad, device)
    if fp8 is not None:
        view[:] = pack_index(_randn(g, num_blocks * E, di, device=device)).view(num_blocks, E, C)
    bt = bt.t().contiguous().t()  # [R, max_blocks], strides (1, R)
    req_t = torch.tensor(req, dtype=torch.int32, device=device)
    return q, weights, view, bt, req_t, torch.tensor(num_visible, dtype=torch.int64, device=device), E, fp8, topk, N


def assert_same_topk(sel: Tensor, ref: Tensor, scores: Tensor, tol: float) -> None:
    """Per row, ``sel`` and ``ref`` (``[B, topk]``) hold the same entries and the same number of -1,
    except for entries swapped at a tie: every entry picked by one only scores within ``tol`` of
    every entry picked by the other only (``scores [B, N]`` float64)."""
    assert sel.shape == ref.shape and sel.dtype == ref.dtype == torch.int64, (sel.shape, ref.shape, sel.dtype)
    for t in range(sel.shape[0]):
        a, b = sel[t].tolist(), ref[t].tolist()
        picked = [i for i in a if i >= 0]
        assert a.count(-1) == b.count(-1) and len(set(picked)) == len(picked), (t, a, b)
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        if only_a:
            gap = (scores[t, only_a][:, None] - scores[t, only_b][None, :]).abs().max().item()
            assert gap <= tol, (t, only_a, only_b, gap)


def indexer_bytes(Tq: int, H: int, di: int, N: int, topk: int, dtype: torch.dtype) -> int:
    """q once, keys once (shared by the queries), scores written and read once, indices written."""
    e = torch.finfo(dtype).bits // 8
    return Tq * H * di * e + Tq * H * 4 + N * di * e + 2 * Tq * N * 4 + Tq * topk * 8


# ----------------------------------------------------------------------------------- routing §6
def route_args(T: int, E: int, k: int, renormalize: bool = True, with_bias: bool = True,
               hashed: bool = False, dtype=torch.float32, seed: int = 0, device=DEVICE) -> tuple:
    """``(router_logits [T,E], top_k, routed_scaling_factor, renormalize, bias, hash_ids)``."""
    g = _gen(seed)
    logits = _randn(g, T, E, dtype=dtype, device=device, scale=3.0)
    bias = _randn(g, E, device=device) if with_bias else None
    hash_ids = None
    if hashed:
        hash_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k)
        hash_ids = hash_ids.to(torch.int32).to(device)
    return logits, k, 1.5, renormalize, bias, hash_ids


def route_bytes(T: int, E: int, k: int) -> int:
    return T * E * 4 + E * 4 + T * k * 12


# ------------------------------------------------------------------------------------- rope §3.2
def rope_args(T: int, mid: tuple, d: int, r: int, dtype=torch.float32, inverse: bool = False,
              seed: int = 0, device=DEVICE) -> tuple:
    """``(x [T, *mid, d], positions [T], inv_freq [r/2], inverse)``: compress-layer frequencies
    (theta 160000 + YaRN as V4), positions up to 2^20 (cos / sin need full range reduction)."""
    from csrc_triton.rope_ref import rope_inv_freq

    g = _gen(seed)
    x = _randn(g, T, *mid, d, dtype=dtype, device=device)
    positions = torch.randint(0, 1 << 20, (T,), generator=g)
    if T:
        positions[0] = 0
    inv_freq = rope_inv_freq(r, 160000.0, 16, 65536).to(device)
    return x, positions.to(device), inv_freq, inverse


def norm_rope_args(T: int, mid: tuple, d: int, r: int, dtype=torch.float32, seed: int = 0, device=DEVICE) -> tuple:
    """``(x [T, *mid, d], positions [T], inv_freq [r/2], eps)`` of ``rope_ref.norm_rope_tail``: x of
    :func:`rope_args` with each row (token, head) times ``10^j``, ``j`` in [-3, 3] (eps matters at
    10^-3), the last row zero where there are two or more (only eps keeps it finite)."""
    x, positions, inv_freq, _ = rope_args(T, mid, d, r, dtype, seed=seed, device=device)
    g = _gen(seed + 1)
    scale = 10.0 ** torch.randint(-3, 4, (T, *mid, 1), generator=g)
    x = (x.float() * scale.to(device)).to(dtype)
    if x.numel() > d:
        x.view(-1, d)[-1] = 0
    return x, positions, inv_freq, 1e-6


def rope_pair_magnitude(normed: Tensor, r: int) -> Tensor:
    """``[..., d]``: ``|n0| + |n1|`` of the pair each of the last ``r`` channels is rotated from, 0 for
    the nope channels (how far a rotated value moves when its inputs move by one ulp each)."""
    pair = normed[..., normed.shape[-1] - r :].abs().unflatten(-1, (r // 2, 2)).sum(-1)  # [..., r/2]
    return torch.cat([torch.zeros_like(normed[..., : normed.shape[-1] - r]), pair.repeat_interleave(2, -1)], -1)


def out_proj_args(T: int, H: int, d: int, r: int, G: int, R: int, dtype=torch.float32, seed: int = 0,
                  device=DEVICE) -> tuple:
    """``(o [T, H, d], positions [T], inv_freq [r/2], weight e4m3 [G*R, H/G*d], weight_scale fp32
    [G*R/128, H/G*d/128], G)``: a block-FP8 wo_a drawn so that outputs are of size ~1, block scales
    spread over 2^-2 .. 2^2 so a block read with its neighbour's scale is visibly wrong."""
    from csrc_triton.formats import e8m0_to_float32
    from tests.conftest import load_quantize

    quant_fp8_block = load_quantize().quant_fp8_block

    o, positions, inv_freq, _ = rope_args(T, (H,), d, r, dtype, seed=seed, device=device)
    g = _gen(seed + 1)
    K = H // G * d
    weight = _randn(g, G * R, K, device="cpu", scale=K**-0.5)
    spread = torch.exp2(torch.randint(-2, 3, (G * R // 128, K // 128), generator=g).float())
    weight = weight * spread.repeat_interleave(128, 0).repeat_interleave(128, 1)
    q, e8m0 = quant_fp8_block(weight)
    return o, positions, inv_freq, q.to(device), e8m0_to_float32(e8m0).to(device), G


def out_proj_bytes(T: int, H: int, d: int, G: int, R: int, dtype: torch.dtype) -> int:
    """The FP8 weight and its block scales once, the attention output in, the projection out."""
    e = torch.finfo(dtype).bits // 8
    K = H // G * d
    return G * R * K + 4 * (G * R // 128) * (K // 128) + T * H * d * e + T * G * R * e


def vllm_config_for(checkpoint) -> object:
    """What a vLLM worker has current while it loads this DeepSeek-V4 checkpoint: a VllmConfig with
    its model config (vLLM's block-FP8 kernel choice reads the model type; DeepGEMM needs it)."""
    from vllm.config import ModelConfig, VllmConfig

    from vllm_dsv4 import plugin

    plugin.register()
    return VllmConfig(model_config=ModelConfig(model=str(checkpoint), skip_tokenizer_init=True, dtype="bfloat16",
                                               max_model_len=4096))


def rope_bytes(T: int, M: int, d: int, dtype: torch.dtype) -> int:
    e = torch.finfo(dtype).bits // 8
    return 2 * T * M * d * e + 8 * T


# ------------------------------------------------------------------------------------- norm §3.1
def rms_norm_args(lead: tuple, D: int, weight_dtype=torch.float32, dtype=torch.float32, seed: int = 0,
                  device=DEVICE) -> tuple:
    """``(x [*lead, D], weight [D] or None, eps)`` of ``norm_ref.rms_norm``: rows of normals times
    ``10^j``, ``j`` in [-3, 3] per row (eps matters at 10^-3), the last row zero where there are two or
    more (only eps keeps it finite); a weight of normals (both signs) in ``weight_dtype``, None when
    that is None."""
    g = _gen(seed)
    x = torch.randn(*lead, D, generator=g) * 10.0 ** torch.randint(-3, 4, (*lead, 1), generator=g)
    if x.numel() > D:
        x.view(-1, D)[-1] = 0
    weight = None if weight_dtype is None else _randn(g, D, dtype=weight_dtype, device=device)
    return x.to(dtype).to(device), weight, 1e-6


def rms_norm_bytes(N: int, D: int, dtype: torch.dtype) -> int:
    """x read and y written once, an fp32 weight."""
    e = torch.finfo(dtype).bits // 8
    return 2 * N * D * e + 4 * D


# ------------------------------------------------------------------------- MXFP4 experts §3.3, §6
def mxfp4_experts(g: torch.Generator, E: int, out: int, inp: int, gain: float = 1.0,
                  device=DEVICE) -> tuple[Tensor, Tensor]:
    """``quant_mxfp4`` of normals of std ``gain * inp**-0.5`` times ``2^j`` per 32-block, ``j`` in
    [-3, 2] (scale bytes spread over six exponents): ``(packed [E, out, inp/2] uint8, scale
    [E, out, inp/32] uint8)``, quantised a few experts at a time (V4-Flash's W13 is 256 x 4096 x 4096)."""
    from tests.conftest import load_quantize

    quant_mxfp4 = load_quantize().quant_mxfp4

    packed = torch.empty(E, out, inp // 2, dtype=torch.uint8, device=device)
    scale = torch.empty(E, out, inp // 32, dtype=torch.uint8, device=device)
    step = max(1, (1 << 24) // max(1, out * inp))
    for e0 in range(0, E, step):
        n = min(step, E - e0)
        w = _randn(g, n * out, inp, device=device, scale=gain * inp**-0.5)  # [n*out, inp]
        j = torch.randint(-3, 3, (n * out, inp // 32, 1), generator=g).to(device)
        w = (w.view(n * out, inp // 32, 32) * torch.exp2(j.float())).view(n * out, inp)
        q, s = quant_mxfp4(w)
        packed[e0 : e0 + n] = q.view(torch.uint8).view(n, out, inp // 2)
        scale[e0 : e0 + n] = s.view(torch.uint8).view(n, out, inp // 32)
    return packed, scale


def moe_mxfp4_args(T: int, D: int, I: int, E: int, k: int, dtype=torch.bfloat16, p_skip: float = 0.2,
                   p_hot: float = 0.0, limit: float = 10.0, seed: int = 0, device=DEVICE) -> tuple:
    """``(x [T,D], weights [T,k] fp32, ids [T,k] int64, w13, w13_scale, w2, w2_scale, swiglu_limit)``.

    ``ids`` are uniform over the E local experts (repeats allowed), a share ``p_hot`` of the slots
    goes to expert 0 (an imbalanced router: one expert spans several row blocks), a share ``p_skip``
    is ``E`` (another rank's expert: skipped), and so is every slot of token 0 when T > 1. Routing
    weights are random and sum to 1.5 per token (V4's routed_scaling_factor). Sizes: x std 1, gate
    and up std about 2 (a limit of 3 clamps about 15% of them), outputs std about 0.6
    (W2 gain 0.2): the bf16 kernel's error scales with the output (test_moe_mxfp4_kernel.py), and
    the absolute 1e-2 of the bf16 tolerance must cover it for outputs near 0."""
    g = _gen(seed)
    x, weights, ids = _moe_routing(g, T, D, E, k, dtype, p_skip, p_hot, device)
    w13, w13_scale = mxfp4_experts(g, E, 2 * I, D, device=device)
    w2, w2_scale = mxfp4_experts(g, E, D, I, gain=0.2, device=device)
    return x, weights, ids, w13, w13_scale, w2, w2_scale, limit


def _moe_routing(g: torch.Generator, T: int, D: int, E: int, k: int, dtype, p_skip: float, p_hot: float,
                 device) -> tuple[Tensor, Tensor, Tensor]:
    """``(x, weights, ids)`` of :func:`moe_mxfp4_args`."""
    x = _randn(g, T, D, dtype=dtype, device=device)
    weights = torch.rand(T, k, generator=g) + 0.1
    weights = 1.5 * weights / weights.sum(-1, keepdim=True)
    ids = torch.randint(0, E, (T, k), generator=g)
    ids[torch.rand(T, k, generator=g) < p_hot] = 0
    ids[torch.rand(T, k, generator=g) < p_skip] = E
    if T > 1:
        ids[0] = E
    return x, weights.to(device), ids.to(device)


def fp8_experts(g: torch.Generator, E: int, out: int, inp: int, gain: float = 1.0,
                device=DEVICE) -> tuple[Tensor, Tensor]:
    """``quant_fp8_block`` of normals of std ``gain * inp**-0.5`` times ``2^j`` per 128x128 block, ``j`` in
    [-3, 2] (each block its own scale): ``(e4m3 [E, out, inp], float32 power-of-two scales
    [E, ceil(out/128), ceil(inp/128)])``, V4-Flash-Base's storage."""
    from tests.conftest import load_quantize

    quant_fp8_block = load_quantize().quant_fp8_block

    bo, bi = -(-out // 128), -(-inp // 128)
    q = torch.empty(E, out, inp, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(E, bo, bi, dtype=torch.float32, device=device)
    for e in range(E):
        w = _randn(g, out, inp, device=device, scale=gain * inp**-0.5)  # [out, inp]
        j = torch.randint(-3, 3, (bo, bi), generator=g).float().to(device)
        w = w * torch.exp2(j).repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inp]
        q[e], s = quant_fp8_block(w)
        scale[e] = e8m0_to_float32(s)
    return q, scale


def moe_fp8_args(T: int, D: int, I: int, E: int, k: int, dtype=torch.bfloat16, p_skip: float = 0.2,
                 p_hot: float = 0.0, limit: float = 10.0, seed: int = 0, device=DEVICE) -> tuple:
    """:func:`moe_mxfp4_args` with FP8 experts (``fp8_experts``): ``w13`` [E, 2I, D] e4m3 with W1's and
    W3's scales stacked [E, 2 ceil(I/128), ceil(D/128)], ``w2`` [E, D, I] with [E, ceil(D/128), ceil(I/128)]."""
    g = _gen(seed)
    x, weights, ids = _moe_routing(g, T, D, E, k, dtype, p_skip, p_hot, device)
    (w1, s1), (w3, s3) = fp8_experts(g, E, I, D, device=device), fp8_experts(g, E, I, D, device=device)
    w2, w2_scale = fp8_experts(g, E, D, I, gain=0.2, device=device)
    return x, weights, ids, torch.cat([w1, w3], 1), torch.cat([s1, s3], 1), w2, w2_scale, limit


def moe_mxfp4_bytes(T: int, D: int, I: int, E: int, k: int, dtype: torch.dtype) -> int:
    """Each hit expert's codes and scales once (expected hit count under uniform routing), x and out."""
    return _hit_experts(T, E, k) * (3 * D * I // 2 + 3 * D * I // 32) + 2 * T * D * (torch.finfo(dtype).bits // 8)


def moe_fp8_bytes(T: int, D: int, I: int, E: int, k: int, dtype: torch.dtype) -> int:
    """Each hit expert's e4m3 weights and float32 block scales once, x and out."""
    scales = 4 * 3 * (-(-D // 128)) * (-(-I // 128))
    return _hit_experts(T, E, k) * (3 * D * I + scales) + 2 * T * D * (torch.finfo(dtype).bits // 8)


def _hit_experts(T: int, E: int, k: int) -> int:
    """The expected number of experts T tokens of k uniform picks hit."""
    return round(E * (1 - (1 - 1 / E) ** (T * k)))


# ------------------------------------------------------------------- cache entries (kv_cache)
def kv_values(g: torch.Generator, n: int, dim: int, dtype=torch.float32, device=DEVICE) -> Tensor:
    """``[n, dim]`` normals times ``10^j`` per 16 values, ``j`` in [-6, 3]: FP8 blocks whose amax
    hits the 1e-4 floor, e4m3 subnormals, and scales over 30 binades."""
    j = torch.randint(-6, 4, (n, dim // 16 + 1), generator=g).float().repeat_interleave(16, 1)[:, :dim]
    return (torch.randn(n, dim, generator=g) * 10.0**j).to(dtype).to(device)


def kv_view(g: torch.Generator, num_blocks: int, E: int, C: int, dtype: torch.dtype, entry_pad: int = 0,
            device=DEVICE) -> Tensor:
    """``[num_blocks, E, C]`` view into a pool of random contents (bytes for uint8): each page is
    ``E * (C + entry_pad)`` elements at an offset of 3 in a row of 5 more (vLLM pads pages), and
    entry ``e`` starts ``e * (C + entry_pad)`` into its page."""
    row = E * (C + entry_pad) + 5
    if dtype == torch.uint8:
        pool = torch.randint(0, 256, (num_blocks, row), generator=g, dtype=torch.uint8)
    else:
        pool = torch.randn(num_blocks, row, generator=g).to(dtype)
    return pool.to(device)[:, 3 : 3 + E * (C + entry_pad)].unflatten(1, (E, C + entry_pad))[..., :C]


def entry_padding(fp8, entry_pad: int) -> int:
    """``entry_pad`` for raw and indexer entries; 0 for FP8 main entries, whose blocks are contiguous
    (FlashMLA's arrangement, formats.main_page_parts)."""
    return 0 if fp8 is not None and fp8.rope_dim is not None else entry_pad


def entry_parts(view: Tensor, fp8) -> tuple[Tensor, ...]:
    """The ``[num_blocks, E, *]`` views that hold the entries' bytes, in entry order: the view itself,
    or for FP8 main entries their data and scale parts (formats.main_page_parts)."""
    from csrc_triton.formats import main_page_parts

    if fp8 is None or fp8.rope_dim is None:
        return (view,)
    return main_page_parts(view, fp8.value_dim, fp8.rope_dim)


def stored_entries(view: Tensor, fp8) -> Tensor:
    """A copy ``[num_blocks, E, C]`` of every stored entry, bytes in entry order (what the codecs decode)."""
    return torch.cat(entry_parts(view, fp8), -1)


def kv_block_table(g: torch.Generator, R: int, max_blocks: int, device=DEVICE) -> tuple[Tensor, int]:
    """``([R, max_blocks] int32 shuffled distinct block ids, num_blocks)``; 3 blocks stay unused."""
    num_blocks = R * max_blocks + 3
    return torch.randperm(num_blocks, generator=g)[: R * max_blocks].view(R, max_blocks).int().to(device), num_blocks


def kv_read_args(req_shape: tuple, entry_shape: tuple, R: int, max_blocks: int, E: int, fp8=None,
                 raw_dtype=torch.float32, raw_dim: int = 24, out_dtype=torch.float32, entry_pad: int = 0,
                 encoded: bool = True, seed: int = 0, device=DEVICE) -> tuple:
    """``(view, block_table, req, entry, E, fp8, out_dtype)`` of ``kv_cache_ref.read_entries``.

    FP8 slots hold encoded entries of ``kv_values`` (``encoded``) or random bytes; raw slots random
    normals in ``raw_dtype`` (then ``out_dtype`` is ``raw_dtype``). Entries are uniform over each
    request's ``max_blocks * E`` and start with a block boundary (E - 1, E) where there is room."""
    from csrc_triton.kv_pack_ref import pack_index, pack_main

    g = _gen(seed)
    bt, num_blocks = kv_block_table(g, R, max_blocks, device)
    C = raw_dim if fp8 is None else fp8.entry_bytes
    view = kv_view(g, num_blocks, E, C, raw_dtype if fp8 is None else torch.uint8, entry_padding(fp8, entry_pad),
                   device)
    if fp8 is not None and encoded:
        x = kv_values(g, num_blocks * E, fp8.value_dim, device=device)
        packed = (pack_index(x) if fp8.rope_dim is None else pack_main(x, fp8.rope_dim)).view(num_blocks, E, C)
        for part in entry_parts(view, fp8):
            part[:], packed = packed[..., : part.shape[-1]], packed[..., part.shape[-1] :]
    req = torch.randint(0, R, req_shape, generator=g)
    entry = torch.randint(0, max_blocks * E, entry_shape, generator=g)
    if entry.numel() >= 2 and max_blocks > 1:
        entry.view(-1)[:2] = torch.tensor([E - 1, E])
    return view, bt, req.to(device), entry.to(device), E, fp8, raw_dtype if fp8 is None else out_dtype


def kv_write_args(R: int, n: int, max_blocks: int, E: int, fp8=None, raw_dtype=torch.float32, raw_dim: int = 24,
                  values_dtype=torch.float32, entry_pad: int = 0, seed: int = 0, device=DEVICE) -> tuple:
    """``(view, block_table, req [R n], entry [R n], E, values [R n, dim], fp8)`` of
    ``kv_cache_ref.write_entries``: each request writes a run of ``n`` consecutive entries from a
    random start (runs cross block boundaries), rows shuffled; the pool holds random contents."""
    g = _gen(seed)
    bt, num_blocks = kv_block_table(g, R, max_blocks, device)
    C = raw_dim if fp8 is None else fp8.entry_bytes
    view = kv_view(g, num_blocks, E, C, raw_dtype if fp8 is None else torch.uint8, entry_padding(fp8, entry_pad),
                   device)
    start = torch.randint(0, max_blocks * E - n + 1, (R, 1), generator=g)
    entry = (start + torch.arange(n)).flatten()  # [R n]
    req = torch.arange(R).repeat_interleave(n)
    perm = torch.randperm(R * n, generator=g)
    values = kv_values(g, R * n, raw_dim if fp8 is None else fp8.value_dim, values_dtype, device)
    return view, bt, req[perm].to(device), entry[perm].to(device), E, values, fp8


def kv_insert_args(N: int, D: int, r: int, fp8=None, raw_dtype=torch.float32, x_dtype=torch.float32, R: int = 3,
                   max_blocks: int = 3, E: int = 4, entry_pad: int = 0, p_pad: float = 0.25, seed: int = 0,
                   device=DEVICE) -> tuple:
    """``(x [N, D], norm_weight [D], eps, rope_positions [N], inv_freq [r/2], view, block_table, req [N],
    entry [N], E, fp8)`` of ``kv_insert_ref.norm_rope_insert``.

    Rows write distinct (request, entry) slots spread over the shuffled block table; a share ``p_pad``
    of them, and row 0 when N > 1, are padding: ``req = -1``, entry -1, x NaN (never read). x rows are
    normals times ``10^j`` per row, ``j`` in [-3, 3]; the weight is normals times ``2^j`` per 16
    channels, ``j`` in [-6, 2] (FP8 blocks of different scales). Positions within 512 of 2^16 (one 0),
    compress-layer frequencies (theta 160000 + YaRN as V4). The pool holds random contents (``kv_view``)."""
    from csrc_triton.rope_ref import rope_inv_freq

    g = _gen(seed)
    bt, num_blocks = kv_block_table(g, R, max_blocks, device)
    C = D if fp8 is None else fp8.entry_bytes
    view = kv_view(g, num_blocks, E, C, raw_dtype if fp8 is None else torch.uint8, entry_padding(fp8, entry_pad),
                   device)
    per_req = max_blocks * E
    assert N <= R * per_req, (N, R, per_req)
    slots = torch.randperm(R * per_req, generator=g)[:N]
    req, entry = slots // per_req, slots % per_req
    pad = torch.rand(N, generator=g) < p_pad
    pad[:1] = N > 1
    req[pad], entry[pad] = -1, -1
    x = torch.randn(N, D, generator=g) * 10.0 ** torch.randint(-3, 4, (N, 1), generator=g)
    x[pad] = float("nan")
    scale = 2.0 ** torch.randint(-6, 3, (D // 16 + 1,), generator=g).float().repeat_interleave(16)[:D]
    weight = torch.randn(D, generator=g) * scale
    positions = (1 << 16) - 512 + torch.randint(0, 1024, (N,), generator=g)
    positions[-1:] = 0
    inv_freq = rope_inv_freq(r, 160000.0, 16, 65536)
    return (x.to(x_dtype).to(device), weight.to(device), 1e-6, positions.to(device), inv_freq.to(device), view, bt,
            req.to(device), entry.to(device), E, fp8)


# ------------------------------------------------------------------------------ cache_index
def cache_index_args(T: int, K: int, R: int = 3, E: int = 4, max_blocks: int = 80, seed: int = 0,
                     device=DEVICE) -> tuple:
    """``(block_table, E, req, entries)`` of ``cache_index_ref.global_slots``: a shuffled block table,
    row 2 padding, row 4 all empty slots, entries uniform over -1 .. the blocks' last."""
    g = torch.Generator().manual_seed(seed)
    block_table = torch.randperm(R * max_blocks + 2, generator=g)[: R * max_blocks].view(R, max_blocks).int()
    req = torch.randint(0, R, (T,), generator=g)
    if T > 2:
        req[2] = -1
    entries = torch.randint(-1, max_blocks * E, (T, K), generator=g)
    if T > 4:
        entries[4] = -1
    return block_table.to(device), E, req.to(device), entries.to(device)


# ------------------------------------------------------------------------------ compressor state rows §5.4
def state_write_args(T: int, W: int, ratio: int, E: int = 4, R: int = 3, max_blocks: int = 6,
                     dtype=torch.bfloat16, seed: int = 0, device=DEVICE) -> tuple:
    """``(view, block_table, req [T], positions [T], E, kv_proj [T, W], gate_proj [T, W], ape [ratio, W])``
    of ``compressor_ref.write_state_rows``: distinct (request, position) slots over the shuffled block
    table, row 1 (T > 1) padding (``req = -1``, NaN projections: never read); the pool holds random
    contents; ``ape`` is fp32 with a different row per position mod ratio."""
    g = _gen(seed)
    bt, num_blocks = kv_block_table(g, R, max_blocks, device)
    view = kv_view(g, num_blocks, E, 2 * W, torch.float32, 0, device)
    slots = torch.randperm(R * max_blocks * E, generator=g)[:T]
    req, positions = slots // (max_blocks * E), slots % (max_blocks * E)
    kv = _randn(g, T, W, dtype=dtype, device="cpu")
    gate = _randn(g, T, W, dtype=dtype, device="cpu")
    if T > 1:
        req[1] = -1
        kv[1], gate[1] = float("nan"), float("nan")
    ape = _randn(g, ratio, W, device=device)
    return view, bt, req.to(device), positions.to(device), E, kv.to(device), gate.to(device), ape
