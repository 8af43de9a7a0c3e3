"""The DSpark draft model (docs/MODEL.md §16.4-§16.7) of V4-Flash-0731 / V4-Pro-0813.

One step drafts a block of N tokens at once: the anchor (the token the target just sampled, at position P)
and N - 1 noise tokens go through the stages ``mtp.0 ..`` (window-only, score-routed V4 blocks) whose
attention sees, besides the whole block, the ``sliding_window`` positions before the anchor: each stage's
context KV, written for every token the target processes from the target's features. The head hidden of
each block position gives base logits, which a sequential Markov head corrects by the token drafted before
(spec_decode/dspark.py runs that loop). The embedding and the head are the main model's.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from types import SimpleNamespace

import torch
from torch import nn

from vllm_dsv4.config import ConfigError, Dsv4Config, LayerKind
from vllm_dsv4.kv.layout import dspark_component
from vllm_dsv4.model.attention import Attention
from vllm_dsv4.model.decoder import Block, finish_loading
from vllm_dsv4.model.layers import Linear, RMSNorm, fp8_linears, fp32_linear, hold_fp8_linears
from vllm_dsv4.model.mhc import HyperHead
from vllm_dsv4.model.parallel import current_shard


class DSparkAttention(Attention):
    """A stage's attention (§16.6): window-only, over its own ``dspark`` cache, which holds the context KV
    of every target position and, from the anchor on, the block's keys (written by ``forward`` before it
    reads). Each of a request's ``block`` queries attends the ``sliding_window`` positions before the
    anchor and all ``block`` positions: non-causal within the block."""

    WINDOW = "dspark"

    def __init__(self, cfg: Dsv4Config, kind: LayerKind, prefix: str, vllm_config, kv_dtype, shard, block: int):
        super().__init__(cfg, kind, prefix, vllm_config, kv_dtype, shard)
        self.block = block
        self.window = cfg.sliding_window + block  # keys per query
        self.register_buffer("block_offsets", torch.arange(-cfg.sliding_window, block), persistent=False)

    @staticmethod
    def cache_components(cfg, kind, kv_dtype, compressed_block_tokens, fp8):
        return {"dspark": dspark_component(cfg, kv_dtype, fp8)}

    def _window(self, md, rows: slice, positions):
        """Entries [t, window + block] of the block queries ``rows``: the draft step gives every request
        ``block`` queries at consecutive positions, so a query's anchor is its position less its index in
        the block; -1 before position 0."""

        def make():
            index = torch.arange(rows.start, rows.start + len(positions), device=positions.device) % self.block
            return ((positions - index)[:, None] + self.block_offsets).clamp_(min=-1)

        return md.plan.window_entries.once((rows.start, rows.stop), make)

    def write_context(self, main_x: torch.Tensor, positions: torch.Tensor, md) -> None:
        """Stores ``rope(kv_norm(wkv(main_x)))`` (§16.5) at ``positions`` [T] of the tokens' requests
        (``md.token_to_req``; rows of -1: none). main_x [T, D]."""
        kv = self.wqkv_a(main_x)[..., self.q_lora_rank:]  # the official wkv's rows
        self.swa_cache.insert(md, kv, self.kv_norm, positions, self.inv_freq, md.token_to_req, positions)


class MarkovHead(nn.Module):
    """``markov_w1`` embeds the previous token [V, r]; ``markov_w2`` (an r -> V linear) turns that into a
    bias on the next position's logits (§16.7)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = Linear(rank, vocab_size)


class ConfidenceHead(nn.Module):
    """``sigmoid(proj . [h ; markov embedding])``, no bias, in fp32 (§16.7)."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = Linear(width, 1)

    def forward(self, h: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(fp32_linear(torch.cat([h, markov_embed], dim=-1), self.proj.weight)).squeeze(-1)


class DSparkStage(Block):
    """``mtp.s``: a window-only, score-routed block; stage 0 also fuses the target features
    (``main_proj``, ``main_norm``), the last stage holds the heads."""

    def __init__(self, cfg: Dsv4Config, s: int, prefix: str, vllm_config, kv_dtype, shard, block: int):
        super().__init__(cfg, cfg.num_hidden_layers + s, f"mtp.{s}", prefix, vllm_config, kv_dtype, shard,
                         attention=partial(DSparkAttention, block=block))
        d, eps, stages = cfg.hidden_size, cfg.rms_norm_eps, cfg.dspark.num_stages
        if s == 0:
            self.main_proj = Linear(stages * d, d)
            self.main_norm = RMSNorm(d, eps)
        if s == stages - 1:
            self.norm = RMSNorm(d, eps)
            self.hc_head = HyperHead(cfg)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark.markov_rank)
            self.confidence_head = ConfidenceHead(d + cfg.dspark.markov_rank)


class DeepseekV4DSpark(nn.Module):
    """vLLM entry point for the draft architecture ``DSparkDraftModel`` (overrides the in-tree class).

    T target tokens, R requests, N = ``num_speculative_tokens`` block tokens each, D hidden, V vocabulary,
    r Markov rank."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        self.cfg = cfg = Dsv4Config.from_hf_config(vllm_config.model_config.hf_config)
        if cfg.dspark is None:
            raise ConfigError("speculative decoding with method 'dspark' needs the checkpoint's dspark_* keys")
        self.shard = shard = current_shard()
        dtype = vllm_config.model_config.dtype
        block = vllm_config.speculative_config.num_speculative_tokens
        fp8 = fp8_linears(cfg, shard)
        self.hc_mult = cfg.hc_mult
        self.mtp = nn.ModuleList()
        for s in range(cfg.dspark.num_stages):
            self.mtp.append(DSparkStage(cfg, s, prefix, vllm_config, dtype, shard, block))
            hold_fp8_linears(self.mtp[s], fp8, f"mtp.{s}")
        # The main model's, set by the proposer (spec_decode/dspark.py): embed [V, D], head [V, D]
        self.model = SimpleNamespace(embed_tokens=None)
        self.lm_head: Linear | None = None

    @property
    def first(self) -> DSparkStage:
        return self.mtp[0]

    @property
    def last(self) -> DSparkStage:
        return self.mtp[-1]

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [T, K*D] -> main_x [T, D] (§16.4)."""
        return self.first.main_norm(self.first.main_proj(features))

    def write_context(self, main_x: torch.Tensor, positions: torch.Tensor, metadata: list) -> None:
        """Each stage's context KV of the target's tokens, into its cache (``metadata``: the stages'
        CacheStepMetadata of the target's step, rejected tokens' requests -1)."""
        for stage, md in zip(self.mtp, metadata):
            stage.attn.write_context(main_x, positions, md)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The block's tokens [R*N] (each request's anchor, then noise) at positions [R*N] -> the head
        hidden h [R*N, D], before the norm (the confidence head reads it)."""
        embeds = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        streams = embeds.unsqueeze(1).repeat(1, self.hc_mult, 1)  # [R*N, n, D]
        for stage in self.mtp:
            streams = stage(streams, positions, input_ids)
        return self.last.hc_head(streams, None)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Base logits U [R*N, V] fp32: the main model's head over ``norm(h)``."""
        return fp32_linear(self.last.norm(h), self.lm_head.weight)

    def markov_embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[B] -> [B, r]."""
        return self.last.markov_head.markov_w1(token_ids)

    def markov_bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        """[B, r] -> the bias [B, V] fp32 on the next position's logits."""
        return fp32_linear(markov_embed, self.last.markov_head.markov_w2.weight)

    def confidence(self, h: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """[B, D], [B, r] -> the probability [B] that each draft is accepted given the ones before it."""
        return self.last.confidence_head(h, markov_embed)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm_dsv4.loader.load import load_official_weights

        loaded = load_official_weights(self.cfg, weights, dict(self.named_parameters()), self.shard, mtp=True)
        finish_loading(self)
        return loaded
