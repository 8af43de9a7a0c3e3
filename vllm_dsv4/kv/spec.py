"""vLLM KV-cache specs, one per cache component, derived from kv/layout.py."""

from __future__ import annotations

from vllm_dsv4 import compat
from vllm_dsv4.kv.layout import Component


def component_spec(comp: Component):
    """A compressed component is a full-history cache; a windowed one a sliding-window cache."""
    if comp.window_tokens is None:
        return compat.compressed_spec(
            block_size=comp.block_tokens,
            entry_dim=comp.entry_elems,
            dtype=comp.dtype,
            tokens_per_entry=comp.tokens_per_entry,
        )
    return compat.window_spec(
        block_size=comp.block_tokens, entry_dim=comp.entry_elems, dtype=comp.dtype, window_tokens=comp.window_tokens
    )
