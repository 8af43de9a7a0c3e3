"""mHC pre / post, Triton (docs/MODEL.md §4).

:func:`mhc_pre` matches :func:`mhc_ref.mhc_pre` (it fuses ``_mix_coefficients``, the sigmoids, the
Sinkhorn projection and the stream collapse) in two launches:

1. ``_mhc_mix_kernel``, one program per (block of ``BLOCK_T`` tokens, split of the n*D axis): the
   sum of squares and the 24-wide projection ``X fn^T`` as ``[BLOCK_T, 32]`` tensor-core dots, ~fp32
   exact: ``ieee`` for fp32 X; for bf16 / fp16 X (exact in tf32) two tf32 products, of fn's
   tf32-rounded high part and of the rest (sm_90 SASS per k step, triton 3.6: 147 instructions at
   decode, 221 for prefill tiles, against 259 / 371 with ``tf32x3``, which also splits X). With few
   tokens (decode) the n*D axis is split so that the 1.5 MB of ``fn`` is read by many SMs; the partial
   sums go to a ``[SPLIT, T, 24]`` fp32 scratch.
2. ``_mhc_pre_kernel``, one program per token: sums the splits, applies the rms factor, computes
   pre / post and the n x n Sinkhorn in registers (row softmax, a column pass, then
   ``sinkhorn_iters - 1`` row + column passes), writes post / comb and ``y = sum_i pre_i X[i]``,
   the whole row in registers, so that the sub-layer's input RMSNorm (``norm_weight``) follows
   there: one launch less per sub-layer, y rounded to X's dtype first as the separate op sees it.

:func:`hc_head` is the same pair of kernels with the hyper-head's n rows of ``fn`` (no post, no
Sinkhorn) and the model's final norm fused. X is read twice (once per launch, as the coefficients of
y need all of X first).
:func:`mhc_post` matches :func:`mhc_ref.mhc_post`: one program per (token, block of D channels).

Bytes (V4-Flash, n = 4, D = 4096, bf16 X): pre reads ``2 * 4 * D * 2`` = 64 KB per token + ``fn``
(1.5 MB, once per token block / split, from L2) and writes ``D * 2`` of y; post reads ``5 * D * 2``
and writes ``4 * D * 2`` = 72 KB per token.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from csrc_triton.codec import as_stored, store_values


@triton.jit(do_not_specialize=["T"])
def _mhc_mix_kernel(
    x_ptr, fn_ptr, part_ptr, sq_ptr,
    T, D, M, ND, k_per_split,
    s_xt, s_xn, s_xd, s_f0, s_f1,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, X_IN_TF32: tl.constexpr,
):
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    t_ok = t < T
    r = tl.arange(0, BLOCK_M)  # [BM] rows of fn = mix coefficients
    r_ok = r < M
    acc = tl.zeros([BLOCK_T, BLOCK_M], tl.float32)
    sq = tl.zeros([BLOCK_T], tl.float32)
    k_lo = split * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)  # [BK] index into the flattened n*D axis
        k_ok = kk < ND
        x_off = (kk // D) * s_xn + (kk % D) * s_xd  # [BK]
        xc = tl.load(x_ptr + t[:, None].to(tl.int64) * s_xt + x_off[None, :],
                     mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BT, BK]
        sq += tl.sum(xc * xc, 1)
        fn_t = tl.load(fn_ptr + r[None, :] * s_f0 + kk[:, None] * s_f1,
                       mask=r_ok[None, :] & k_ok[:, None], other=0.0)  # [BK, BM] = fn^T chunk
        if X_IN_TF32:  # bf16 / fp16 x is exact in tf32: fn as its tf32-rounded high part + the rest, two
            # tf32 products (~21 bits of fn; tf32x3 would split x too, and multiply three times)
            hi = ((fn_t.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
            acc += tl.dot(xc, hi, input_precision="tf32")
            acc += tl.dot(xc, fn_t - hi, input_precision="tf32")
        else:
            acc += tl.dot(xc, fn_t, input_precision="ieee")
    base = split * T + t  # [BT] row of the [SPLIT, T, *] scratch
    tl.store(part_ptr + base[:, None] * M + r[None, :], acc, mask=t_ok[:, None] & r_ok[None, :])
    tl.store(sq_ptr + base, sq, mask=t_ok)


@triton.jit(do_not_specialize=["T", "num_splits"])
def _mhc_pre_kernel(
    x_ptr, part_ptr, sq_ptr, base_ptr, scale_ptr, w_ptr, y_ptr, post_ptr, comb_ptr,
    T, D, M, num_splits, inv_nd, rms_eps, hc_eps, sinkhorn_iters, norm_eps,
    s_xt, s_xn, s_xd, s_yt, s_yd, s_w,
    N: tl.constexpr, NP: tl.constexpr, SPLITS_P: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr,
    HEAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)  # [NP] stream index (pre, post, comb rows j)
    k = tl.arange(0, NP)  # [NP] comb columns
    i_ok = i < N
    jk_ok = i_ok[:, None] & (k[None, :] < N)  # [NP, NP]
    jk = N * i[:, None] + k[None, :]  # [NP, NP] row-major n x n

    sp = tl.arange(0, SPLITS_P)  # [S] splits of the n*D axis, summed here
    sp_ok = sp < num_splits
    row = part_ptr + (sp * T + t) * M  # [S] scratch rows of this token
    mu_pre = tl.sum(tl.load(row[:, None] + i[None, :], mask=sp_ok[:, None] & i_ok[None, :], other=0.0), 0)
    sq = tl.sum(tl.load(sq_ptr + sp * T + t, mask=sp_ok, other=0.0), 0)
    rho = 1.0 / tl.sqrt(sq * inv_nd + rms_eps)  # unweighted RMS factor of flatten(X)

    pre = tl.sigmoid(rho * mu_pre * tl.load(scale_ptr) + tl.load(base_ptr + i, mask=i_ok, other=0.0)) + hc_eps
    pre = tl.where(i_ok, pre, 0.0)  # [NP]
    if not HEAD:  # a sub-layer's mixer: also post and the Sinkhorn-projected comb (the hyper-head has neither)
        mu_post = tl.sum(tl.load(row[:, None] + N + i[None, :], mask=sp_ok[:, None] & i_ok[None, :], other=0.0), 0)
        mu_comb = tl.sum(tl.load(row[:, None, None] + 2 * N + jk[None, :, :],
                                 mask=sp_ok[:, None, None] & jk_ok[None, :, :], other=0.0), 0)  # [NP, NP]
        post = 2.0 * tl.sigmoid(rho * mu_post * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + i, mask=i_ok,
                                                                                other=0.0))
        tl.store(post_ptr + t * N + i, post, mask=i_ok)

        # Sinkhorn on the n x n logits [j, k]: padded entries stay exactly 0 throughout.
        logits = rho * mu_comb * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + jk, mask=jk_ok, other=0.0)
        logits = tl.where(jk_ok, logits, float("-inf"))
        row_max = tl.max(logits, 1)  # [NP]
        row_max = tl.where(i_ok, row_max, 0.0)
        e = tl.exp(logits - row_max[:, None])  # 0 on padding
        p = e / tl.where(i_ok, tl.sum(e, 1), 1.0)[:, None]
        p = tl.where(jk_ok, p + hc_eps, 0.0)
        p = p / (tl.sum(p, 0)[None, :] + hc_eps)  # columns
        for _ in range(sinkhorn_iters - 1):
            p = p / (tl.sum(p, 1)[:, None] + hc_eps)  # rows
            p = p / (tl.sum(p, 0)[None, :] + hc_eps)  # columns
        tl.store(comb_ptr + t * N * N + jk, p, mask=jk_ok)

    # y = sum_i pre_i X[i], the whole row at once so that a norm follows in registers (the sub-layer's input
    # norm; the model's final one after the hyper-head)
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    y = tl.zeros([BLOCK_D], tl.float32)
    for s in tl.static_range(N):
        xs = tl.load(x_ptr + t * s_xt + s * s_xn + dd * s_xd, mask=d_ok, other=0.0).to(tl.float32)
        y += tl.sum(tl.where(i == s, pre, 0.0), 0) * xs
    y = as_stored(y, y_ptr)  # the collapse's own rounding, which the norm sees
    if NORM:
        y = y * tl.rsqrt(tl.sum(y * y, 0) / D + norm_eps)  # lanes past D hold 0
        y = y * tl.load(w_ptr + dd * s_w, mask=d_ok, other=0.0).to(tl.float32)
    store_values(y_ptr + t * s_yt + dd * s_yd, y, d_ok, y_ptr.dtype.element_ty == tl.bfloat16)


@triton.jit
def _mhc_post_kernel(
    o_ptr, x_ptr, post_ptr, comb_ptr, out_ptr,
    D,
    s_ot, s_od, s_xt, s_xn, s_xd, s_pt, s_pn, s_ct, s_cj, s_ck, s_yt, s_yn, s_yd,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    dd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    d_ok = dd < D
    k = tl.arange(0, NP)  # [NP] output stream
    k_ok = k < N
    o = tl.load(o_ptr + t * s_ot + dd * s_od, mask=d_ok, other=0.0).to(tl.float32)  # [BD]
    post = tl.load(post_ptr + t * s_pt + k * s_pn, mask=k_ok, other=0.0)  # [NP]
    acc = post[:, None] * o[None, :]  # [NP, BD]
    for j in tl.static_range(N):
        c = tl.load(comb_ptr + t * s_ct + j * s_cj + k * s_ck, mask=k_ok, other=0.0)  # [NP] comb[j, :]
        xj = tl.load(x_ptr + t * s_xt + j * s_xn + dd * s_xd, mask=d_ok, other=0.0).to(tl.float32)  # [BD]
        acc += c[:, None] * xj[None, :]
    tl.store(out_ptr + t * s_yt + k[:, None] * s_yn + dd[None, :] * s_yd, acc.to(out_ptr.dtype.element_ty),
             mask=k_ok[:, None] & d_ok[None, :])


MIX_BLOCK_K = 32  # the projection's k step
MIX_SPLIT_MIN = 4 * MIX_BLOCK_K  # the fewest values of the n*D axis one split of the projection takes


def _sm_count(device: torch.device) -> int:
    """The SMs the projection is spread over (1 off the GPU)."""
    if device.type != "cuda":
        return 1
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _mix_config(T: int, nd: int, device: torch.device) -> dict:
    """Tiles of the projection and the split of the n*D axis (whole BLOCK_Ks, at least MIX_SPLIT_MIN
    values each), so that decode-sized T still spreads ``fn`` over ~2 programs per SM: at V4-Flash's
    n*D = 16,384, 128 splits of 4 k steps (at 16 k steps each, only 32 programs would read ``fn`` at
    T <= 16). 64-token blocks x 32-wide k steps, 4 warps, is the fastest prefill tile measured (docs/bench);
    at T <= 64 the tile choice hardly matters."""
    block_t = 16 if T <= 512 else 64
    splits = max(1, min(triton.cdiv(2 * _sm_count(device), triton.cdiv(T, block_t)), _max_splits(nd)))
    return dict(BLOCK_T=block_t, BLOCK_K=MIX_BLOCK_K, splits=splits, num_warps=4)


def _max_splits(nd: int) -> int:
    """The most splits of the n*D axis: the pre kernel's sum over splits is sized by it, not by the
    step's count, so that one compiled kernel serves every step size."""
    return triton.cdiv(nd, MIX_SPLIT_MIN)


def mhc_pre(
    x: Tensor,
    fn: Tensor,
    base: Tensor,
    scale: Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: Tensor | None = None,
    norm_eps: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Triton :func:`mhc_ref.mhc_pre` (same arguments and results).

    Args:
        x: ``[T, n, D]`` fp32 / bf16, any strides.
        fn: ``[(2+n)*n, n*D]`` fp32.
        base: ``[(2+n)*n]`` fp32.
        scale: ``[3]`` fp32.
        rms_eps, hc_eps, sinkhorn_iters: as the reference (``sinkhorn_iters >= 1``).
        norm_weight, norm_eps: the sub-layer's input RMSNorm (``[D]``), fused; or None.

    Returns:
        ``y [T, D]`` in ``x.dtype``, ``post [T, n]`` fp32, ``comb [T, n, n]`` fp32.
    """
    T, n, D = x.shape
    M = (2 + n) * n
    assert fn.shape == (M, n * D), fn.shape
    assert base.shape == (M,) and scale.shape == (3,), (base.shape, scale.shape)
    assert sinkhorn_iters >= 1, sinkhorn_iters
    post = torch.empty(T, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=x.device)
    y = _collapse(x, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters, norm_weight, norm_eps, post, comb)
    return y, post, comb


def hc_head(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, rms_eps: float, hc_eps: float,
            norm_weight: Tensor | None = None, norm_eps: float = 0.0) -> Tensor:
    """Triton :func:`mhc_ref.hc_head` (same arguments and result): :func:`mhc_pre`'s kernels with
    ``fn [n, n*D]``, ``base [n]``, ``scale [1]`` and neither post nor comb; ``norm_weight``: the
    model's final norm, fused."""
    T, n, D = x.shape
    assert fn.shape == (n, n * D) and base.shape == (n,) and scale.shape == (1,), (fn.shape, base.shape, scale.shape)
    return _collapse(x, fn, base, scale, rms_eps, hc_eps, 1, norm_weight, norm_eps, None, None)


def _collapse(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, rms_eps: float, hc_eps: float, sinkhorn_iters: int,
              norm_weight: Tensor | None, norm_eps: float, post: Tensor | None, comb: Tensor | None) -> Tensor:
    """``y [T, D]`` from the projection and pre kernels (``fn``'s M rows); post and comb written
    where given (a sub-layer's mixer), else the hyper-head's collapse alone."""
    T, n, D = x.shape
    M = fn.shape[0]
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16), x.dtype
    assert fn.dtype == torch.float32, fn.dtype
    assert norm_weight is None or norm_weight.shape == (D,), norm_weight.shape
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    cfg = _mix_config(T, n * D, x.device)
    k_per_split = triton.cdiv(triton.cdiv(n * D, cfg.pop("splits")), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    splits = triton.cdiv(n * D, k_per_split)
    part = torch.empty(splits, T, M, dtype=torch.float32, device=x.device)
    sq = torch.empty(splits, T, dtype=torch.float32, device=x.device)
    _mhc_mix_kernel[(triton.cdiv(T, cfg["BLOCK_T"]), splits)](
        x, fn, part, sq, T, D, M, n * D, k_per_split, *x.stride(), *fn.stride(),
        BLOCK_M=max(16, triton.next_power_of_2(M)), X_IN_TF32=x.dtype != torch.float32,
        **cfg,
    )
    base = base.to(device=x.device, dtype=torch.float32).contiguous()
    scale = scale.to(device=x.device, dtype=torch.float32).contiguous()
    block_d = triton.next_power_of_2(D)
    _mhc_pre_kernel[(T,)](
        x, part, sq, base, scale, norm_weight if norm_weight is not None else base, y,
        y if post is None else post, y if comb is None else comb,  # the hyper-head writes neither
        T, D, M, splits, 1.0 / (n * D), float(rms_eps), float(hc_eps), int(sinkhorn_iters), float(norm_eps),
        *x.stride(), *y.stride(), norm_weight.stride(0) if norm_weight is not None else 0,
        N=n, NP=triton.next_power_of_2(n), SPLITS_P=triton.next_power_of_2(_max_splits(n * D)),
        BLOCK_D=block_d, NORM=norm_weight is not None, HEAD=post is None,
        num_warps=8 if block_d >= 4096 else 4,  # the row in registers: 16 values a thread at D = 4096
    )
    return y


def mhc_post(o: Tensor, x: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """Triton :func:`mhc_ref.mhc_post`: ``X'[k] = post_k * o + sum_j comb[j, k] * X[j]``.

    Args:
        o: ``[T, D]`` sub-layer output (any float dtype).
        x: ``[T, n, D]`` residual streams.
        post: ``[T, n]`` fp32.
        comb: ``[T, n, n]`` fp32.

    Returns:
        ``[T, n, D]`` in ``x.dtype``, computed in fp32.
    """
    T, n, D = x.shape
    assert o.shape == (T, D) and post.shape == (T, n) and comb.shape == (T, n, n), (o.shape, post.shape, comb.shape)
    assert post.dtype == comb.dtype == torch.float32, (post.dtype, comb.dtype)
    out = torch.empty(T, n, D, dtype=x.dtype, device=x.device)
    if T == 0 or D == 0:
        return out
    block_d = min(1024, triton.next_power_of_2(D))
    _mhc_post_kernel[(T, triton.cdiv(D, block_d))](
        o, x, post, comb, out, D,
        *o.stride(), *x.stride(), *post.stride(), *comb.stride(), *out.stride(),
        N=n, NP=triton.next_power_of_2(n), BLOCK_D=block_d,
    )
    return out
