"""A paged cache component as the kernels and their references read it."""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import Tensor


class CacheSource(NamedTuple):
    """One paged cache component keys are read from: entry ``e`` of request ``r`` is
    ``view[block_table[r, e // entries_per_block], e % entries_per_block]`` (kv_cache_ref)."""

    view: Tensor  # [num_blocks, E, C], any strides: raw entries (q's dtype) or uint8 FP8 main entries
    block_table: Tensor  # [R, max_blocks] int32 / int64
    entries_per_block: int  # E
    fp8: Any  # None (raw) or the FP8 main-entry spec (``value_dim``, ``rope_dim``), e.g. vllm_dsv4.kv.layout.Fp8Entry
    # Scratch shared by the calls of one step, query chunk and layer kind: plans made from the slot
    # lists' lengths, or, where a source's entries are the same in all those calls, from its entries
    # (vllm_dsv4/ops/flashmla.py); None: plan per call.
    plans: dict | None = None
    # Known on the host, at least the rows a call's requests' spans of named entries take together
    # (vllm_dsv4/ops/flashmla.py sizes its key buffer by it instead of reading their total); None: unknown.
    span_rows_bound: int | None = None
