"""MoE routing, Triton (docs/MODEL.md §6 steps 1-3).

Matches :func:`routing_ref.route`: ``s = sqrt(softplus(logits))``, ids = the hash table's row (hash
layers) or the top-k of ``s + bias`` found by k rounds of arg-max in registers (small k: 6 in V4;
ties go to the lower expert id), weights ``s[ids]`` renormalised (+1e-20, as HF) and scaled. One
program per block of ``BLOCK_T`` tokens holds their ``[BLOCK_T, E]`` logits (E = 256 in V4-Flash: two
tokens on one warp).

Bytes: reads ``T * E * 4`` of logits (``T * k`` of them on the hash path) + ``E * 4`` of bias,
writes ``T * k * 12`` (fp32 weights + int64 ids).

:func:`swiglu_clamped` matches :func:`routing_ref.swiglu_clamped` (the shared expert's activation) in
one launch instead of the reference's six: per (token, block of channels) it reads the gate and up
halves, clamps, applies SiLU in fp32 and writes the product. Bytes: ``T * 2I`` in, ``T * I`` out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from csrc_triton.routing_ref import RENORM_EPS


@triton.jit
def _sqrt_softplus(x):
    """``sqrt(log1p(exp(x)))`` in fp32. log1p(u) = log(1 + u) * u / ((1 + u) - 1) is exact for small u
    (where the fp32 sum 1 + u rounds); below x = -20, softplus(x) = exp(x) to fp32 precision and the
    score is ``exp(x / 2)``, which stays a normal number where exp(x) would flush to 0 on the GPU."""
    u = tl.exp(-tl.abs(x))  # (0, 1]
    w = 1.0 + u
    rounds = w == 1.0
    log1p = tl.where(rounds, u, tl.log(w) * (u / tl.where(rounds, 1.0, w - 1.0)))
    return tl.where(x < -20.0, tl.exp(0.5 * x), tl.sqrt(tl.maximum(x, 0.0) + log1p))


@triton.jit(do_not_specialize=["T"])
def _route_kernel(
    logits_ptr, bias_ptr, hash_ptr, w_ptr, id_ptr,
    T, E, top_k, rsf,
    s_lt, s_le, s_ht, s_hk,
    HASH: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    t_ok = t < T
    j = tl.arange(0, BLOCK_K)  # [BK] output slot
    out_ok = t_ok[:, None] & (j < top_k)[None, :]  # [BT, BK]
    t64 = t.to(tl.int64)
    if HASH:
        ids = tl.load(hash_ptr + t64[:, None] * s_ht + j[None, :] * s_hk, mask=out_ok, other=0).to(tl.int64)
        lg = tl.load(logits_ptr + t64[:, None] * s_lt + ids * s_le, mask=out_ok, other=0.0)
        w = _sqrt_softplus(lg.to(tl.float32))  # [BT, BK]
    else:
        e = tl.arange(0, BLOCK_E)  # [BE]
        e_ok = e < E
        lg = tl.load(logits_ptr + t64[:, None] * s_lt + e[None, :] * s_le,
                     mask=t_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
        s = _sqrt_softplus(lg)  # [BT, BE]
        sel = s
        if HAS_BIAS:
            sel = sel + tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)[None, :]
        sel = tl.where(e_ok[None, :], sel, float("-inf"))
        ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int64)
        w = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        for i in range(top_k):
            best = tl.argmax(sel, 1)  # [BT] lowest id among equal maxima
            hit = e[None, :] == best[:, None]  # [BT, BE]
            w_i = tl.sum(tl.where(hit, s, 0.0), 1)  # [BT]
            ids = tl.where(j[None, :] == i, best[:, None].to(tl.int64), ids)
            w = tl.where(j[None, :] == i, w_i[:, None], w)
            sel = tl.where(hit, float("-inf"), sel)
    w = tl.where(out_ok, w, 0.0)
    if RENORM:
        w = w / (tl.sum(w, 1)[:, None] + 1e-20)
    w = w * rsf
    tl.store(w_ptr + t64[:, None] * top_k + j[None, :], w, mask=out_ok)
    tl.store(id_ptr + t64[:, None] * top_k + j[None, :], ids, mask=out_ok)


def route(
    router_logits: Tensor,
    top_k: int,
    routed_scaling_factor: float,
    renormalize: bool,
    bias: Tensor | None = None,
    hash_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Triton :func:`routing_ref.route` (same arguments and results).

    Args:
        router_logits: ``[T, E]`` fp32 (bf16 accepted, upcast).
        top_k: experts per token (``top_k <= E``).
        routed_scaling_factor: multiplies the weights.
        renormalize: divide by the sum of the selected scores (+1e-20).
        bias: ``[E]`` selection bias, or ``None``.
        hash_ids: ``[T, top_k]`` int expert ids (hash layers), or ``None``.

    Returns:
        ``weights [T, top_k]`` fp32 and ``ids [T, top_k]`` int64; top-k slots in descending order of
        ``s + bias`` (the reference leaves the order unspecified), hash slots in the table's order.
    """
    T, E = router_logits.shape
    assert 1 <= top_k <= E, (top_k, E)
    assert RENORM_EPS == 1e-20  # the kernel's literal
    weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=router_logits.device)
    if T == 0:
        return weights, ids
    if hash_ids is not None:
        assert hash_ids.shape == (T, top_k) and not hash_ids.dtype.is_floating_point, hash_ids.shape
        hash_ids = hash_ids.to(router_logits.device)
    if bias is not None:
        assert bias.shape == (E,), bias.shape
        bias = bias.to(device=router_logits.device, dtype=torch.float32).contiguous()
    block_e = triton.next_power_of_2(E)
    # Two tokens per one-warp program (E = 256: 16 scores a thread): the k rounds of arg-max and gather
    # reduce within a warp (shuffles, no barrier); with 16 tokens on 4 warps a small step waited on the
    # latency of thousands of cross-warp reductions in a row.
    block_t = 2 if block_e <= 256 else 1
    _route_kernel[(triton.cdiv(T, block_t),)](
        router_logits, bias if bias is not None else weights, hash_ids if hash_ids is not None else ids,
        weights, ids, T, E, top_k, float(routed_scaling_factor),
        *router_logits.stride(), *(hash_ids.stride() if hash_ids is not None else (0, 0)),
        HASH=hash_ids is not None, HAS_BIAS=bias is not None, RENORM=bool(renormalize),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=max(1, min(8, block_t * block_e // 512)),
    )
    return weights, ids


@triton.jit
def swiglu_clamped_values(gate, up, limit):
    """fp32 :func:`routing_ref.swiglu_clamped` of the two halves (the gate clamped from above only);
    also the routed experts' activation (moe_mxfp4.py)."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _swiglu_kernel(x_ptr, out_ptr, inter, limit, s_xt, s_ot, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < inter
    gate = tl.load(x_ptr + t * s_xt + c, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * s_xt + inter + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * s_ot + c, swiglu_clamped_values(gate, up, limit).to(out_ptr.dtype.element_ty), mask=ok)


def swiglu_clamped(gate_up: Tensor, limit: float) -> Tensor:
    """Triton :func:`routing_ref.swiglu_clamped` (same arguments and result; channels contiguous)."""
    x = gate_up.reshape(-1, gate_up.shape[-1])
    assert x.shape[-1] % 2 == 0 and x.stride(-1) == 1, (gate_up.shape, gate_up.stride())
    inter = x.shape[-1] // 2
    out = torch.empty(x.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        block = min(1024, triton.next_power_of_2(inter))
        _swiglu_kernel[(x.shape[0], triton.cdiv(inter, block))](x, out, inter, float(limit), x.stride(0), out.stride(0),
                                                                BLOCK=block)
    return out.view(*gate_up.shape[:-1], inter)
