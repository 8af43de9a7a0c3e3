"""Sparse attention through FlashMLA's FP8 sparse decode kernel (vLLM's vendored copy, vllm_kernels.py binding 3).

Same arguments and semantics as ``csrc_triton.sparse_attn.sparse_attn_cached``: query t attends the
window entries then the compressed entries of its request, keys = values, the per-head sink in the
denominator. Our FP8 caches already hold FlashMLA's "MODEL1" block layout (kv_pack_ref), so the
kernel reads the window cache as its ``k_cache`` and the C4 / C128 cache as its ``extra_k_cache``
as they are; each query becomes one kernel "request" of one token, its slots turned into global
cache indices (``block * E + offset``, -1 empty; ``csrc_triton/cache_index.py``). Where the kernel
does not apply (no FlashMLA, raw caches, ``d != 512``, more than 128 heads, pages not 16-byte
aligned) the Triton kernel runs (the reason logged once), which is also this path's oracle
(tests/ops/test_flashmla.py).

The kernel takes 64 or 128 query heads: fewer heads are padded with zero queries. Slot lists are
padded with -1 to a multiple of 128 (its index blocks are 64 wide, 128 on Blackwell's head-128
kernel) and cut short per query by ``topk_length`` (one past the last valid slot), so a C128 decode's
fixed-width list costs only its visible entries. The scheduler metadata (one small kernel) is planned
once per step, query chunk and layer kind: it depends on the slot lists' shapes and lengths only,
which the layers of a kind share (model/attention.py), not on the picks. A CUDA graph captures the
planning call of the first layer of each kind and replays it.

Prefill and mixed steps (``sparse_attn_prefill``) run FlashMLA's sparse prefill kernel instead,
which reads bf16 keys by index from one buffer: ``gather_slots`` decodes, per request of the step,
the span of entries its queries' slot lists name (window: the positions from the first query's
window start to the last query; compressed: the lowest to the highest pick) once into that buffer
and turns every slot into an index of it. The spans are read on the host (one small copy), which a
prefill step may do: it is never captured whole (vLLM's piecewise graphs break around attention);
the window's and C128's, the same in every layer of a kind, once per step and query chunk.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from csrc_triton import kv_cache, kv_cache_ref, sparse_attn
from csrc_triton.cache_index import global_slots
from csrc_triton.paged import CacheSource
from vllm_dsv4 import get_logger
from vllm_dsv4.ops import vllm_kernels

logger = get_logger(__name__)

HEAD_DIM = 512  # FlashMLA MODEL1: 448 FP8 nope + 64 bf16 rope values per key
ROPE_DIM = 64
SLOT_ALIGN = 128


def _padded_heads(num_heads: int) -> int | None:
    return 64 if num_heads <= 64 else 128 if num_heads <= 128 else None


def _misfit(src: CacheSource) -> str | None:
    """Why FlashMLA cannot read this cache, or None."""
    fp8, view = src.fp8, src.view
    if fp8 is None:
        return "raw (non-FP8) KV entries"
    if (fp8.value_dim, fp8.rope_dim) != (HEAD_DIM, ROPE_DIM):
        return f"head_dim {fp8.value_dim} / rope {fp8.rope_dim} (FlashMLA reads 512 / 64)"
    if view.data_ptr() % 16 or view.stride(0) % 16:
        return "cache pages not 16-byte aligned"
    return None


def why_not(q: Tensor, window: CacheSource, main: CacheSource | None) -> str | None:
    """Why FlashMLA cannot run this call (the Triton kernel does), or None when it can."""
    if vllm_kernels.flashmla_sparse() is None:
        return "no FlashMLA sparse kernel in this vLLM build or on this device"
    if not q.is_cuda or q.dtype != torch.bfloat16 or q.shape[-1] != HEAD_DIM:
        return f"queries {q.dtype} of dim {q.shape[-1]} (FlashMLA takes bf16, 512)"
    if _padded_heads(q.shape[1]) is None:
        return f"{q.shape[1]} heads (FlashMLA takes up to 128)"
    return _misfit(window) or (main and _misfit(main))


@functools.cache
def _log_fallback(reason: str) -> None:
    logger.info("vllm-dsv4: attention runs the Triton kernel, not FlashMLA: %s", reason)


def _plan(window: CacheSource, flashmla):
    """FlashMLA's scheduler plan for this call: the one made by the first call sharing the window's
    plan store (FlashMLA reuses a plan across calls whose shapes and lengths are equal, and asserts
    the shapes), or a fresh one."""
    if window.plans is None:
        return flashmla.SchedMeta()
    return window.plans.setdefault("flashmla", flashmla.SchedMeta())


def _padded_queries(q: Tensor, sink: Tensor) -> tuple[Tensor, Tensor]:
    """``(q [T, heads, d], sink [heads] fp32)`` with the heads FlashMLA takes (64 or 128): the extra
    heads are zero queries with sink 0; q itself where it already fits."""
    T, H, d = q.shape
    heads = _padded_heads(H)
    if heads == H and q.stride(-1) == 1:
        return q, sink.float().contiguous()
    q_in = q.new_zeros(T, heads, d)
    q_in[:, :H] = q
    sink_in = torch.zeros(heads, dtype=torch.float32, device=q.device)
    sink_in[:H] = sink
    return q_in, sink_in


def _kernel_out(out: Tensor | None, q: Tensor, heads: int) -> Tensor:
    """The ``[T, heads, d]`` buffer the kernel writes: the caller's ``out`` itself when it is that
    (no padded heads, contiguous), else a new one (:func:`_returned` copies the real heads back)."""
    T, H, d = q.shape
    if out is not None and heads == H and out.is_contiguous():
        return out
    return torch.empty(T, heads, d, dtype=q.dtype, device=q.device)


def _returned(buffer: Tensor, out: Tensor | None, num_heads: int) -> Tensor:
    """The result's real heads, in ``out`` when the caller gave one."""
    result = buffer[:, :num_heads]
    if out is None or out.data_ptr() == result.data_ptr():
        return result
    return out.copy_(result)


def _cache_indices(src: CacheSource, req: Tensor, entries: Tensor) -> tuple[Tensor, Tensor]:
    """``([T, 1, K'] int32 global cache indices, [T] int32 lengths)`` of the slot lists (cache_index.py)."""
    index, lengths = global_slots(src.block_table, src.entries_per_block, req, entries, SLOT_ALIGN)
    return index.unsqueeze(1), lengths


def sparse_attn_cached(q: Tensor, sink: Tensor, scale: float, req: Tensor, window: CacheSource,
                       window_entries: Tensor, main: CacheSource | None, main_entries: Tensor | None,
                       out: Tensor | None = None) -> Tensor:
    """``csrc_triton.sparse_attn.sparse_attn_cached`` through FlashMLA where it applies (module doc).

    CUDA-graph safe: no host synchronisation, shapes fixed by the arguments'.
    """
    reason = why_not(q, window, main)
    if reason:
        _log_fallback(reason)
        return sparse_attn.sparse_attn_cached(q, sink, scale, req, window, window_entries, main, main_entries, out)
    flashmla = vllm_kernels.flashmla_sparse()
    T, H, d = q.shape
    q_in, sink_in = _padded_queries(q, sink)
    heads = q_in.shape[1]
    indices, lengths = _cache_indices(window, req, window_entries)
    extra = {}
    if main is not None:
        extra_indices, extra_lengths = _cache_indices(main, req, main_entries)
        extra = dict(extra_k_cache=main.view.unsqueeze(2), extra_indices_in_kvcache=extra_indices,
                     extra_topk_length=extra_lengths)
    buffer = _kernel_out(out, q, heads)  # [T, heads, d]
    if T:
        flashmla.attend(q=q_in.unsqueeze(1), k_cache=window.view.unsqueeze(2), block_table=None, cache_seqlens=None,
                        head_dim_v=d, tile_scheduler_metadata=_plan(window, flashmla), softmax_scale=scale,
                        is_fp8_kvcache=True, indices=indices, topk_length=lengths, attn_sink=sink_in,
                        out=buffer.unsqueeze(1), **extra)
    return _returned(buffer, out, H)


class GatheredSpans(NamedTuple):
    """One source's part of :func:`gather_slots`: the ``count`` entries it decodes (requests ``req``,
    entry numbers ``entry``, [count] each, on the device) and its slots' rows of the buffer
    (``indices`` [T, n_i], -1 for an empty slot)."""

    req: Tensor
    entry: Tensor
    indices: Tensor
    count: int


def gather_slots(req: Tensor, sources: list[tuple[CacheSource, Tensor]], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The entries that slot lists name, decoded once: ``(kv [S, d] in dtype, indices [T, n] int32)``.

    ``sources``: (cache, entries ``[T, n_i]``, -1 for an empty slot) pairs whose slots are laid side by
    side in ``indices`` (``n = sum n_i``); slot j of query t names ``kv[indices[t, j]]``, which is entry
    ``entries[t, j]`` of request ``req[t]`` of its cache as ``kv_cache_ref.read_entries`` decodes it, or
    -1 (an empty slot, or ``req[t] < 0``). Per cache and request, ``kv`` holds the span from the lowest
    to the highest entry the request's queries name, once. A source given with ``plans`` names the same
    entries in every call sharing them (model/attention.py: the window, and C128's visible entries):
    its spans, which cost a host read, are worked out by the first such call and kept there. Entries
    are decoded by the Triton kernel on the GPU (where ops picks this module), by its reference on CPU
    tensors.
    """
    pieces, indices, offset = [], [], 0
    for place, (src, entries) in enumerate(sources):
        key = ("gathered spans", place)
        spans = src.plans.get(key) if src.plans is not None else None
        if spans is None:
            spans = _spans(req, src.block_table.shape[0], entries, offset, src.span_rows_bound)
            if src.plans is not None:
                src.plans[key] = spans
        if spans.count:
            read_entries = kv_cache.read_entries if src.view.is_cuda else kv_cache_ref.read_entries
            pieces.append(read_entries(src.view, src.block_table, spans.req, spans.entry, src.entries_per_block,
                                       src.fp8, dtype))
        indices.append(spans.indices)
        offset += spans.count
    if not pieces:
        return torch.empty(0, 0, dtype=dtype, device=req.device), torch.cat(indices, 1).int()
    return torch.cat(pieces), torch.cat(indices, 1).int()


def _spans(req: Tensor, num_req: int, entries: Tensor, offset: int, rows_bound: int | None) -> GatheredSpans:
    """Per request, the span from the lowest to the highest entry its queries name, laid out from row
    ``offset`` of the buffer in request order. Worked out on the device. The buffer takes
    ``rows_bound`` rows where the caller knows that many suffice (the rows after the spans decode
    entry 0 of the last request, named by no slot); else the host reads one number, the spans' total."""
    valid = (entries >= 0) & (req[:, None] >= 0)  # [T, n]
    none = torch.iinfo(torch.int64).max
    named = entries.long()
    # Each query's lowest and highest slot first, then per request: scattering all T x n slots onto a
    # few requests' two counters would serialise on their atomics.
    row_lo = torch.where(valid, named, none).amin(1)  # [T]; none / -1 for a row naming nothing
    row_hi = torch.where(valid, named, -1).amax(1)
    r = req.clamp(min=0).long()  # a padding row (req -1) names nothing, so request 0 takes no harm
    lo = torch.full((num_req,), none, dtype=torch.int64, device=req.device).scatter_reduce(0, r, row_lo, "amin")
    hi = torch.full((num_req,), -1, dtype=torch.int64, device=req.device).scatter_reduce(0, r, row_hi, "amax")
    lo = lo.clamp(max=1 << 62)  # requests no slot names: no overflow below (their counts are 0)
    counts = (hi - lo + 1).clamp(min=0)  # [R]; 0 for requests no slot names
    ends = counts.cumsum(0)
    start = ends - counts  # [R] where each request's span begins, from the source's first row
    base = (offset + start - lo)[r][:, None]  # [T, 1] kv row of entry 0's place
    indices = torch.where(valid, base + entries, -1)
    # host-built index tensors would each cost a synchronising pageable copy to the device
    if rows_bound is None or not num_req:
        total = int(ends[-1]) if num_req else 0  # the one host read (none without requests)
        span_req = torch.repeat_interleave(torch.arange(num_req, device=req.device), counts, output_size=total)
        return GatheredSpans(span_req, lo[span_req] + torch.arange(total, device=req.device) - start[span_req],
                             indices, total)
    torch._assert_async(ends[-1] <= rows_bound)  # a bound too low would index past the buffer
    row = torch.arange(rows_bound, device=req.device)
    span_req = torch.searchsorted(ends, row, right=True).clamp_(max=num_req - 1)  # [rows_bound]
    span_entry = torch.where(row < ends[-1], lo[span_req] + row - start[span_req], 0)
    return GatheredSpans(span_req, span_entry, indices, rows_bound)


def sparse_attn_prefill(q: Tensor, sink: Tensor, scale: float, req: Tensor, window: CacheSource,
                        window_entries: Tensor, main: CacheSource | None, main_entries: Tensor | None,
                        out: Tensor | None = None) -> Tensor:
    """:func:`sparse_attn_cached`'s semantics through FlashMLA's sparse prefill kernel over
    :func:`gather_slots`' buffer (module doc); the Triton kernel where FlashMLA does not apply.
    Synchronises with the host: not for CUDA-graph capture."""
    reason = why_not(q, window, main)
    if reason:
        _log_fallback(reason)
        return sparse_attn.sparse_attn_cached(q, sink, scale, req, window, window_entries, main, main_entries, out)
    T, H, d = q.shape
    sources = [(window, window_entries)] + ([(main, main_entries)] if main is not None else [])
    kv, indices = gather_slots(req, sources, q.dtype)
    if T == 0 or kv.shape[0] == 0:  # no slot anywhere: every row attends nothing
        return torch.zeros_like(q) if out is None else out.zero_()
    width = -(-indices.shape[1] // SLOT_ALIGN) * SLOT_ALIGN
    indices = torch.nn.functional.pad(indices, (0, width - indices.shape[1]), value=-1)
    q_in, sink_in = _padded_queries(q, sink)
    buffer = _kernel_out(out, q, q_in.shape[1])  # [T, heads, d]
    vllm_kernels.flashmla_sparse().prefill(q=q_in, kv=kv.unsqueeze(1), indices=indices.unsqueeze(1), sm_scale=scale,
                                     d_v=d, attn_sink=sink_in, out=buffer)
    return _returned(buffer, out, H)
