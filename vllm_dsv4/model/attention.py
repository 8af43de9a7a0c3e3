"""DeepSeek-V4 attention: one shared K=V latent head over a raw-token window plus compressed history.

Per layer kind (§5.7): ``swa`` attends the window only; ``c128`` adds every visible C128 entry;
``c4`` adds the C4 entries the indexer selects. Each kind owns its cache components (kv/layout.py).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_dsv4 import compat, envs, ops
from vllm_dsv4.config import Dsv4Config, LayerKind
from vllm_dsv4.kv.layer import CacheLayer
from vllm_dsv4.kv.layout import cache_layer_name, fp8_entries, layer_components
from vllm_dsv4.kv.metadata import CacheStepMetadata
from vllm_dsv4.model.compressor import Compressor, visible_entries
from vllm_dsv4.model.image_window import image_blocks, window_entries
from vllm_dsv4.model.indexer import Indexer
from vllm_dsv4.model.layers import Linear, RMSNorm, fp32_param
from vllm_dsv4.shard import Shard

# Queries attended per call, at most: the kernels read keys in place, so there a call takes a whole
# 8k-token step (each call costs host reads, the spans' sizes, and launches, and each chunk re-decodes
# the entries its requests' earlier chunks already decoded); the reference path gathers the keys.
QUERY_CHUNK = int(envs.ATTN_QUERY_CHUNK.read("8192" if ops.USE_KERNELS else "2048"))
# Bytes a call may hold per query: its [t, W + K] slot lists live through a handful of int64
# temporaries (flashmla._spans: ~40 bytes per slot at the peak), the reference path's gathered fp32 keys
# take 4 * d per slot. vLLM's profile run binds no cache, so it never sees them: the bound keeps them
# small beside the memory vLLM leaves free (at a 1M-token context a C128 query has 8,320 slots, and
# 8,192 queries' lists would take ~2.7 GB; bounded, ~3,200 queries per call).
ATTN_CALL_BYTES = int(envs.ATTN_CALL_BYTES.read())


def layer_inv_freq(cfg: Dsv4Config, kind: LayerKind) -> torch.Tensor:
    """θ=rope_theta without YaRN on window-only layers; compress θ with YaRN elsewhere (§3.2)."""
    if kind is LayerKind.SWA:
        return ops.rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta)
    yarn = cfg.yarn
    if yarn is None:
        return ops.rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta)
    return ops.rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta, yarn.factor,
                             yarn.original_max_position_embeddings, yarn.beta_fast, yarn.beta_slow)


def grouped_out_proj(o: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, wo_a: Linear,
                     groups: int) -> torch.Tensor:
    """``wo_a`` unfused (§5.6): the inverse-RoPE op, then one GEMM per head group; [T, H, d] -> [T, G * R].
    The rope op writes group-major, so each group's GEMM reads contiguous rows without a transpose copy."""
    T, H, d = o.shape
    per_group = o.new_empty(groups, T, H // groups, d)  # [G, T, H/G, d]
    ops.apply_rope_tail(o.view(T, groups, H // groups, d), positions, inv_freq, inverse=True,
                        out=per_group.transpose(0, 1))
    return wo_a.grouped(per_group.flatten(2)).flatten(1)


class Attention(nn.Module):
    """Returns this rank's partial output: its heads and output groups (model/parallel.py)."""

    WINDOW = "swa"  # the component whose entries are the raw-token window (cache_components' key)
    cache_components = staticmethod(layer_components)

    def __init__(self, cfg: Dsv4Config, kind: LayerKind, prefix: str, vllm_config, kv_dtype: torch.dtype,
                 shard: Shard):
        super().__init__()
        self.kind, self.ratio, self.eps = kind, kind.ratio, cfg.rms_norm_eps
        self.images = cfg.vision is not None  # prefill widens the window inside image blocks
        self.image_reach = cfg.vision.max_n_token if self.images else 0
        self.head_dim, self.window, self.o_rank = cfg.head_dim, cfg.sliding_window, cfg.o_lora_rank
        self.num_heads = shard.part(cfg.num_attention_heads, "num_attention_heads")
        self.groups = shard.part(cfg.o_groups, "o_groups")
        heads_per_group = cfg.num_attention_heads // cfg.o_groups
        self.q_lora_rank = cfg.q_lora_rank
        self.wqkv_a = Linear(cfg.hidden_size, cfg.q_lora_rank + self.head_dim)  # official wq_a, wkv rows
        self.q_norm = RMSNorm(cfg.q_lora_rank, self.eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.num_heads * self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, self.eps)
        self.wo_a = Linear(heads_per_group * self.head_dim, self.groups * self.o_rank)
        self.wo_b = Linear(self.groups * self.o_rank, cfg.hidden_size)
        self.attn_sink = fp32_param(self.num_heads)
        inv_freq = layer_inv_freq(cfg, kind)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # window slot w of the query at p is position p - window + 1 + w
        self.register_buffer("window_offsets", torch.arange(1 - self.window, 1), persistent=False)

        cache_config = vllm_config.cache_config
        components = self.cache_components(cfg, kind, kv_dtype, cache_config.block_size,
                                           fp8_entries(cache_config.cache_dtype))
        caches = {name: CacheLayer(comp, cache_layer_name(prefix, name), vllm_config)
                  for name, comp in components.items()}
        self.swa_cache = caches[self.WINDOW]
        self.main_cache = None  # swa: the window is its only cache
        if kind is not LayerKind.SWA:
            self.main_cache = caches[kind.value]
            self.compressor = Compressor(kind, cfg.hidden_size, self.head_dim, self.eps, inv_freq,
                                         caches[f"{kind.value}_state"], self.main_cache)
        max_model_len = vllm_config.model_config.max_model_len
        if kind is LayerKind.C4:
            self.indexer = Indexer(cfg, inv_freq, caches["indexer_state"], caches["indexer"], max_model_len)
        self.max_c128_entries = -(-max_model_len // LayerKind.C128.ratio)
        self._attend = compat.eager_break(self._attend_eager)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [T, D] post-attn_norm, positions and ids [T] -> [T, D]. The projections depend on x only; what
        reads or writes the step's caches runs in ``_attend``, where a breakable CUDA graph breaks
        (compat.eager_break): piecewise graphs of mixed and prefill steps capture the rest."""
        num_tokens = x.shape[0]
        q_latent, kv = self.wqkv_a(x).split([self.q_lora_rank, self.head_dim], dim=-1)
        q_latent = self.q_norm(q_latent)  # [T, q_lora]
        q = self.wq_b(q_latent).view(num_tokens, self.num_heads, self.head_dim)
        q = ops.norm_rope_tail(q, positions, self.inv_freq, self.eps)  # [T, H, d], per-head norm then RoPE
        o = torch.empty_like(q)
        self._attend(x, q_latent, q, kv, positions, input_ids, o)
        return self.wo_b(self.out_proj(o, positions))

    def _attend_eager(self, x, q_latent, q, kv, positions, input_ids, o) -> None:
        """Insert this step's KV, compress, pick C4 entries and attend: o [T, H, d] written in place
        (zeros in vLLM's profile and dummy runs, which bind no cache, and in rows past the step's
        tokens: a piecewise graph pads the step to its captured size)."""
        md = self.swa_cache.metadata()
        num_tokens = 0 if md is None else md.token_to_req.shape[0]
        o[num_tokens:].zero_()
        if not num_tokens:
            return
        x, q_latent, q, kv, positions, input_ids, o = (t[:num_tokens] for t in (x, q_latent, q, kv, positions,
                                                                                 input_ids, o))
        req = md.token_to_req  # [T], -1 for padding
        self.swa_cache.insert(md, kv, self.kv_norm, positions, self.inv_freq, req, positions)
        main = picks = None
        image_window = self._image_window(md, positions, input_ids)
        slots = self.window if image_window is None else image_window.shape[1]
        if self.kind is not LayerKind.SWA:  # every write of this step lands before any read
            self.compressor(x, positions)
            main = self.main_cache.source(self.main_cache.metadata())
            if self.kind is LayerKind.C4:
                picks = self.indexer(x, q_latent, positions)  # [T, topk], -1 where none
                slots += picks.shape[1]
            else:
                slots += visible_entries(md, positions, self.kind, self.max_c128_entries)[1]
        attend = ops.sparse_attn_cached if md.decode_only else ops.sparse_attn_prefill
        chunk = self._query_chunk(slots)
        for start in range(0, num_tokens, chunk):
            rows = slice(start, start + chunk)
            # Layers of one kind see slot lists of the same lengths in a chunk (window: the positions;
            # C128: the visible count; C4: min(top-k, visible), picks first), so they share plans.
            plans = md.plan.call_scratch.once((rows.start, rows.stop, self.kind), dict)
            window_rows = main_rows = None
            if not md.decode_only:
                reach = 0 if image_window is None else image_window.shape[1] - self.window
                window_rows, main_rows = md.plan.span_rows.once((rows.start, rows.stop, self.kind),
                                                                lambda: self._span_rows(md, rows, reach))
            window = self.swa_cache.source(md, plans)._replace(span_rows_bound=window_rows)
            chunk_main, entries = main, None
            if self.kind is LayerKind.C4:
                chunk_main, entries = main._replace(span_rows_bound=main_rows), picks[rows]
            elif self.kind is LayerKind.C128:
                # C128 layers name the same entries (every visible one), so they share what is planned from them.
                chunk_main = main._replace(plans=plans, span_rows_bound=main_rows)
                entries = self._every_visible(md, rows, positions)
            window_entries = self._window(md, rows, positions[rows]) if image_window is None else image_window[rows]
            attend(q[rows], self.attn_sink, self.head_dim**-0.5, req[rows], window, window_entries, chunk_main,
                   entries, out=o[rows])

    def _span_rows(self, md: CacheStepMetadata, rows: slice, reach: int = 0) -> tuple[int, int | None]:
        """Host bounds on the buffer rows of a prefill call over the queries ``rows`` (``CacheSource.
        span_rows_bound``): a request with n of them, at consecutive positions, names at most
        n + window - 1 window entries, plus twice ``reach`` where image blocks widen windows (a block cut
        by the call's rows reaches up to ``reach`` before its first query and after its last), and at
        most L // ratio compressed ones at a length of at most L tokens (None where vLLM gives no such
        lengths)."""
        starts, lengths = md.query_starts, md.seq_len_bounds
        counted = self.ratio and lengths is not None
        window_rows = main_rows = 0
        for r in range(len(starts) - 1):
            queries = min(rows.stop, starts[r + 1]) - max(rows.start, starts[r])
            if queries > 0:
                window_rows += queries + self.window - 1 + 2 * reach
                main_rows += lengths[r] // self.ratio if counted else 0
        return window_rows, main_rows if counted else None

    def _query_chunk(self, slots: int) -> int:
        """Queries per call when each attends ``slots`` slots: ``QUERY_CHUNK``, fewer where their
        temporaries would pass ``ATTN_CALL_BYTES``. Depends on shapes only (a decode step's ``slots``
        are fixed by max_model_len), so a CUDA graph replays the same calls. With kernels, a multiple
        of 16: each pass's slices then start 16-byte aligned, as compiled kernels are specialised."""
        per_slot = 40 if ops.USE_KERNELS else 4 * self.head_dim
        chunk = max(1, min(QUERY_CHUNK, ATTN_CALL_BYTES // (slots * per_slot)))
        return max(16, chunk // 16 * 16) if ops.USE_KERNELS else chunk

    def _image_window(self, md: CacheStepMetadata, positions, input_ids):
        """A prefill step's window slots [T, W'] widened inside its image blocks (model/image_window.py),
        once per step; None without blocks, and in decode steps (never inside one): the plain window."""
        if not self.images or md.decode_only:
            return None

        def make():
            first, last = image_blocks(input_ids, md.token_to_req, positions)
            if not bool((first >= 0).any()):
                return None
            return window_entries(positions, self.window, first, last, reach=self.image_reach)

        return md.plan.image_window.once((), make)

    def _window(self, md: CacheStepMetadata, rows: slice, positions):
        """SWA entries [t, W] of the queries ``rows``: the last ``window`` token positions up to each
        query, -1 before position 0 (once per step and chunk: every layer's are the same)."""
        return md.plan.window_entries.once((rows.start, rows.stop),
                                           lambda: (positions[:, None] + self.window_offsets).clamp_(min=-1))

    def _every_visible(self, md: CacheStepMetadata, rows: slice, positions):
        """C128 entry numbers [t, K] the queries ``rows`` attend: every visible one, then -1 (once per
        step and chunk: every C128 layer's are the same)."""

        def make():
            num_visible, width = visible_entries(md, positions, self.kind, self.max_c128_entries)
            entries = torch.arange(width, device=positions.device)
            return torch.where(entries < num_visible[rows, None], entries, -1)

        return md.plan.c128_entries.once((rows.start, rows.stop), make)

    def out_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """De-rotate and down-project per head group (§5.6): [T, H, d] -> [T, G * o_rank]: all in one
        kernel, de-rotate and quantise then one grouped GEMM, or the rope kernel then one GEMM per
        group (``ops.OUT_PROJ``; ``auto`` picks by step size)."""
        fused = ops.OUT_PROJ == "fused" or (ops.OUT_PROJ == "auto" and o.shape[0] <= ops.OUT_PROJ_FUSED_MAX_TOKENS)
        if self.wo_a.weight_scale is not None and fused:
            return ops.rope_out_proj(o, positions, self.inv_freq, self.wo_a.weight, self.wo_a.weight_scale,
                                     self.groups)
        if self.wo_a.grouped_gemm is not None:
            return self.wo_a.grouped_quantised(*ops.rope_quant_fp8(o, positions, self.inv_freq, self.groups))
        return grouped_out_proj(o, positions, self.inv_freq, self.wo_a, self.groups)
