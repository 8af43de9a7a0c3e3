"""Byte layout of one cache entry per component: the one place these numbers live.

Components (the project's one vocabulary): ``swa`` raw-token window KV, ``c4``/``c128`` compressed
KV, ``indexer`` compressed indexer keys, ``state`` the compressor's open-window rows (one per
compressed cache: ``c4_state``, ``c128_state``, ``indexer_state``), ``dspark`` a DSpark stage's window
of context KV (from the target's features) and draft block keys. See docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from csrc_triton.formats import index_entry_bytes, main_entry_bytes
from vllm_dsv4.config import ConfigError, Dsv4Config, LayerKind

# Tokens per block of the per-token caches. Sliding-window groups free whole blocks, so small
# blocks keep the resident window tight; 4 and 8 follow vLLM's in-tree choice for the states.
SWA_BLOCK_TOKENS = 64
C4_STATE_BLOCK_TOKENS = 4
C128_STATE_BLOCK_TOKENS = 8


# vLLM ``kv_cache_dtype`` values: raw entries in the model dtype, or FP8 entries.
RAW_CACHE_DTYPES = ("auto", "bfloat16", "float32")
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_ds_mla")


def fp8_entries(cache_dtype: str) -> bool:
    """Whether ``--kv-cache-dtype`` asks for FP8 entries (csrc_triton/kv_pack_ref.py)."""
    if cache_dtype in FP8_CACHE_DTYPES:
        return True
    if cache_dtype in RAW_CACHE_DTYPES:
        return False
    raise ConfigError(f"kv_cache_dtype={cache_dtype!r} is not supported by DeepSeek-V4 (vllm-dsv4); "
                      f"use one of {RAW_CACHE_DTYPES + FP8_CACHE_DTYPES}")


@dataclass(frozen=True)
class Fp8Entry:
    """An entry stored as FP8 bytes: ``value_dim`` values, the last ``rope_dim`` kept bf16 (main KV),
    or ``rope_dim=None`` for an indexer key with one scale."""

    value_dim: int
    rope_dim: int | None

    @property
    def entry_bytes(self) -> int:
        return index_entry_bytes(self.value_dim) if self.rope_dim is None else main_entry_bytes(self.value_dim,
                                                                                                 self.rope_dim)


@dataclass(frozen=True)
class Component:
    """One cache component of one layer.

    ``entry_elems`` elements of ``dtype`` per entry; one entry per ``tokens_per_entry`` tokens.
    ``window_tokens`` is set for per-token caches of which only the recent window is kept;
    ``pool_ratio`` for a compressor state (the tokens one compressed entry pools).
    ``fp8`` is set when entries are FP8 bytes (``dtype`` uint8) that decode to ``fp8.value_dim`` values.
    """

    name: str
    entry_elems: int
    dtype: torch.dtype
    tokens_per_entry: int
    block_tokens: int
    window_tokens: int | None = None
    fp8: Fp8Entry | None = None
    pool_ratio: int | None = None

    @property
    def entry_bytes(self) -> int:
        return self.entry_elems * self.dtype.itemsize

    @property
    def entries_per_block(self) -> int:
        return self.block_tokens // self.tokens_per_entry

    @property
    def page_bytes(self) -> int:
        return self.entries_per_block * self.entry_bytes

    def resume_start(self, position: int) -> int:
        """First token whose entry a request resumed at ``position`` (its first token still to compute)
        reads again: 0 for compressed history; the attention window ``[p - window + 1, p]`` for ``swa`` and
        ``dspark``;
        for a compressor state the open pooling window, and for C4's overlapping windows the previous
        one too (a window closing at p reads rows ``p - 2m + 1 .. p``)."""
        if self.window_tokens is None:
            return 0
        if self.pool_ratio is None:
            return max(0, position - self.window_tokens + 1)
        ratio = self.pool_ratio
        return max(0, position // ratio * ratio - (self.window_tokens - ratio))


def state_elems(kind: LayerKind, head_dim: int) -> int:
    """A state row is ``[kv | score]``, each ``kind.overlap * head_dim`` wide."""
    return 2 * kind.overlap * head_dim


def _entry(dim: int, kv_dtype: torch.dtype, fp8: Fp8Entry | None) -> dict:
    if fp8 is None:
        return dict(entry_elems=dim, dtype=kv_dtype)
    return dict(entry_elems=fp8.entry_bytes, dtype=torch.uint8, fp8=fp8)


def layer_components(
    cfg: Dsv4Config, kind: LayerKind, kv_dtype: torch.dtype, compressed_block_tokens: int, fp8: bool = False
) -> dict[str, Component]:
    """Every cache component a layer of ``kind`` owns. With ``fp8`` the main KV and indexer keys are
    FP8 entries; compressor states stay fp32 either way."""
    main_fp8 = Fp8Entry(cfg.head_dim, cfg.qk_rope_head_dim) if fp8 else None
    comps = {"swa": Component("swa", tokens_per_entry=1, block_tokens=SWA_BLOCK_TOKENS,
                              window_tokens=cfg.sliding_window, **_entry(cfg.head_dim, kv_dtype, main_fp8))}
    if kind is LayerKind.SWA:
        return comps
    main, ratio = kind.value, kind.ratio
    state_block = C4_STATE_BLOCK_TOKENS if kind is LayerKind.C4 else C128_STATE_BLOCK_TOKENS
    state_window = kind.overlap * ratio  # the open window, and for C4 the previous one it overlaps
    comps[main] = Component(main, tokens_per_entry=ratio, block_tokens=compressed_block_tokens,
                            **_entry(cfg.head_dim, kv_dtype, main_fp8))
    comps[f"{main}_state"] = Component(
        f"{main}_state", state_elems(kind, cfg.head_dim), torch.float32, 1, state_block, state_window, pool_ratio=ratio
    )
    if kind is LayerKind.C4:
        index_fp8 = Fp8Entry(cfg.index_head_dim, None) if fp8 else None
        comps["indexer"] = Component("indexer", tokens_per_entry=ratio, block_tokens=compressed_block_tokens,
                                     **_entry(cfg.index_head_dim, kv_dtype, index_fp8))
        comps["indexer_state"] = Component(
            "indexer_state", state_elems(kind, cfg.index_head_dim), torch.float32, 1, state_block, state_window,
            pool_ratio=ratio,
        )
    return comps


def dspark_component(cfg: Dsv4Config, kv_dtype: torch.dtype, fp8: bool = False) -> Component:
    """A DSpark stage's cache: entries like ``swa``'s, by token position. Its window is one token longer: the
    block's first query, at the anchor p, reads the ``sliding_window`` positions before p (docs/MODEL.md §16.5)."""
    main_fp8 = Fp8Entry(cfg.head_dim, cfg.qk_rope_head_dim) if fp8 else None
    return Component("dspark", tokens_per_entry=1, block_tokens=SWA_BLOCK_TOKENS, window_tokens=cfg.sliding_window + 1,
                     **_entry(cfg.head_dim, kv_dtype, main_fp8))


def cache_layer_name(prefix: str, component: str) -> str:
    """vLLM layer name of ``component``'s cache in the attention module ``prefix``."""
    return f"{prefix}.{component}_cache"


def component_of_layer(cfg: Dsv4Config, layer_name: str, block_tokens: int) -> Component:
    """The component a cache layer named by :func:`cache_layer_name` holds (dtype-independent fields)."""
    name = layer_name.rsplit(".", 1)[-1].removesuffix("_cache")
    if name == "dspark":
        return dspark_component(cfg, torch.float32)
    kind = LayerKind.SWA
    if name.startswith("c128"):
        kind = LayerKind.C128
    elif name.startswith(("c4", "indexer")):
        kind = LayerKind.C4
    components = layer_components(cfg, kind, torch.float32, block_tokens)
    if name not in components:
        raise ConfigError(f"{layer_name!r} is not a DeepSeek-V4 cache layer")
    return components[name]


def page_size_table(cfg: Dsv4Config, kv_dtype: torch.dtype, compressed_block_tokens: int = 256,
                    fp8: bool = False) -> str:
    """Markdown table of every component's page (docs/ARCHITECTURE.md embeds it; a test checks)."""
    kinds = sorted({cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)}, key=lambda kind: kind.ratio)
    count = {kind: sum(cfg.layer_kind(i) is kind for i in range(cfg.num_hidden_layers)) for kind in kinds}
    lines = [
        "| component | layers | tokens/entry | block (tokens) | entries/block | bytes/entry | page bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    rows: dict[str, tuple[Component, int]] = {}
    for kind in kinds:
        for name, comp in layer_components(cfg, kind, kv_dtype, compressed_block_tokens, fp8).items():
            prev = rows.get(name, (comp, 0))[1]
            rows[name] = (comp, prev + count[kind])
    if cfg.dspark is not None:
        rows["dspark"] = (dspark_component(cfg, kv_dtype, fp8), cfg.dspark.num_stages)
    for name, (c, layers) in rows.items():
        lines.append(
            f"| `{name}` | {layers} | {c.tokens_per_entry} | {c.block_tokens} | {c.entries_per_block} "
            f"| {c.entry_bytes:,} | {c.page_bytes:,} |"
        )
    per_token = sum(c.entry_bytes * n / c.tokens_per_entry for c, n in rows.values() if c.window_tokens is None)
    lines.append(f"\nHistory bytes per token of context (compressed components, all layers): {per_token:,.1f}")
    return "\n".join(lines)
