"""Byte layout of one cache entry per component: the one place these numbers live.

Components (the project's one vocabulary): ``swa`` raw-token window KV, ``c4``/``c128`` compressed
KV, ``indexer`` compressed indexer keys, ``state`` the compressor's open-window rows (one per
compressed cache: ``c4_state``, ``c128_state``, ``indexer_state``). See docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_dsv4.config import Dsv4Config

# Tokens per block of the per-token caches. Sliding-window groups free whole blocks, so small
# blocks keep the resident window tight; 4 and 8 follow vLLM's in-tree choice for the states.
SWA_BLOCK_TOKENS = 64
C4_STATE_BLOCK_TOKENS = 4
C128_STATE_BLOCK_TOKENS = 8


@dataclass(frozen=True)
class Component:
    """One cache component of one layer.

    ``entry_elems`` elements of ``dtype`` per entry; one entry per ``tokens_per_entry`` tokens.
    ``window_tokens`` is set for per-token caches of which only the recent window is kept.
    """

    name: str
    entry_elems: int
    dtype: torch.dtype
    tokens_per_entry: int
    block_tokens: int
    window_tokens: int | None = None

    @property
    def entry_bytes(self) -> int:
        return self.entry_elems * self.dtype.itemsize

    @property
    def entries_per_block(self) -> int:
        return self.block_tokens // self.tokens_per_entry

    @property
    def page_bytes(self) -> int:
        return self.entries_per_block * self.entry_bytes


def state_elems(ratio: int, head_dim: int) -> int:
    """A state row is ``[kv | score]``, each ``coff * head_dim`` wide (coff 2 when windows overlap)."""
    coff = 2 if ratio == 4 else 1
    return 2 * coff * head_dim


def layer_components(
    cfg: Dsv4Config, ratio: int, kv_dtype: torch.dtype, compressed_block_tokens: int
) -> dict[str, Component]:
    """Every cache component a layer of compress ratio ``ratio`` (0, 4 or 128) owns."""
    comps = {"swa": Component("swa", cfg.head_dim, kv_dtype, 1, SWA_BLOCK_TOKENS, cfg.sliding_window)}
    if ratio == 0:
        return comps
    main = "c4" if ratio == 4 else "c128"
    state_block = C4_STATE_BLOCK_TOKENS if ratio == 4 else C128_STATE_BLOCK_TOKENS
    state_window = 2 * ratio if ratio == 4 else ratio
    comps[main] = Component(main, cfg.head_dim, kv_dtype, ratio, compressed_block_tokens)
    comps[f"{main}_state"] = Component(
        f"{main}_state", state_elems(ratio, cfg.head_dim), torch.float32, 1, state_block, state_window
    )
    if ratio == 4:
        comps["indexer"] = Component("indexer", cfg.index_head_dim, kv_dtype, 4, compressed_block_tokens)
        comps["indexer_state"] = Component(
            "indexer_state", state_elems(4, cfg.index_head_dim), torch.float32, 1, state_block, state_window
        )
    return comps


def page_size_table(cfg: Dsv4Config, kv_dtype: torch.dtype, compressed_block_tokens: int = 256) -> str:
    """Markdown table of every component's page (docs/ARCHITECTURE.md embeds it; a test checks)."""
    kinds = sorted({cfg.compress_ratio(i) for i in range(cfg.num_hidden_layers)})
    count = {r: sum(cfg.compress_ratio(i) == r for i in range(cfg.num_hidden_layers)) for r in kinds}
    lines = [
        "| component | layers | tokens/entry | block (tokens) | entries/block | bytes/entry | page bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    rows: dict[str, tuple[Component, int]] = {}
    for ratio in kinds:
        for name, comp in layer_components(cfg, ratio, kv_dtype, compressed_block_tokens).items():
            prev = rows.get(name, (comp, 0))[1]
            rows[name] = (comp, prev + count[ratio])
    for name, (c, layers) in rows.items():
        lines.append(
            f"| `{name}` | {layers} | {c.tokens_per_entry} | {c.block_tokens} | {c.entries_per_block} "
            f"| {c.entry_bytes:,} | {c.page_bytes:,} |"
        )
    per_token = sum(c.entry_bytes * n / c.tokens_per_entry for c, n in rows.values() if c.window_tokens is None)
    lines.append(f"\nHistory bytes per token of context (compressed components, all layers): {per_token:,.1f}")
    return "\n".join(lines)
