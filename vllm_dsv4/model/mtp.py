"""The MTP draft model (§7) for vLLM's speculative decoding (``speculative_config={"method": "mtp"}``).

vLLM's proposer runs it after each target step: at position i it takes the main model's streams
after its last block (``get_mtp_target_hidden_states``, [T, n*D]) and the token at i + 1, and its
logits propose the token at i + 2. Later draft steps feed its own output streams back. It shares
the main model's embedding and head (the proposer sets ``model.embed_tokens`` and ``lm_head``) and
holds one sliding-window cache like any other block.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

import torch
from torch import nn

from vllm_dsv4.config import Dsv4Config
from vllm_dsv4.model.decoder import Block, finish_loading
from vllm_dsv4.model.layers import Linear, RMSNorm, fp8_linears, fp32_linear, hold_fp8_linears
from vllm_dsv4.model.mhc import HyperHead
from vllm_dsv4.model.parallel import current_shard
from vllm_dsv4.shard import Shard


class MTPModule(Block):
    """``mtp.K``: a block (sliding-window attention, score-routed MoE) behind an input fusion, with its
    own hyper-head and output norm."""

    def __init__(self, cfg: Dsv4Config, k: int, prefix: str, vllm_config, kv_dtype: torch.dtype, shard: Shard):
        super().__init__(cfg, cfg.num_hidden_layers + k, f"mtp.{k}", prefix, vllm_config, kv_dtype, shard)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm, self.norm = RMSNorm(d, eps), RMSNorm(d, eps), RMSNorm(d, eps)
        self.e_proj, self.h_proj = Linear(d, d), Linear(d, d)
        self.hc_head = HyperHead(cfg)

    def fuse(self, embeds: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """Embeddings [T, D] of the next tokens and streams [T, n, D] -> the block's input streams
        ``h_proj(hnorm(stream)) + e_proj(enorm(embedding))``, the embedding's term shared by all n."""
        return self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(embeds)).unsqueeze(1)


class DeepseekV4MTP(nn.Module):
    """vLLM entry point for the draft architecture ``DeepSeekV4MTPModel`` (overrides the in-tree class)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        self.cfg = cfg = Dsv4Config.from_hf_config(vllm_config.model_config.hf_config)
        self.shard = shard = current_shard()
        dtype = vllm_config.model_config.dtype
        fp8 = fp8_linears(cfg, shard)
        self.hc_mult, self.hidden_size = cfg.hc_mult, cfg.hidden_size
        # The proposer replaces model.embed_tokens with the main model's (vLLM 0.26 reads its .weight first).
        self.model = nn.Module()
        self.model.embed_tokens = SimpleNamespace(weight=None)
        self.lm_head: Linear | None = None  # the proposer sets the main model's head
        self.mtp = nn.ModuleList()
        for k in range(cfg.num_nextn_predict_layers):
            self.mtp.append(MTPModule(cfg, k, prefix, vllm_config, dtype, shard))
            hold_fp8_linears(self.mtp[k], fp8, f"mtp.{k}")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                intermediate_tensors=None, inputs_embeds: torch.Tensor | None = None,
                spec_step_idx: int = 0) -> torch.Tensor:
        """input_ids [T] (the tokens at positions + 1), positions [T], hidden_states [T, n*D] (the main
        model's streams, or this model's output of the previous draft step) -> streams [T, n*D]."""
        module = self.mtp[spec_step_idx % len(self.mtp)]
        embeds = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        streams = module.fuse(embeds, hidden_states.view(-1, self.hc_mult, self.hidden_size))
        return module(streams, positions, input_ids).flatten(1)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        """Streams [T, n*D] -> fp32 logits [T, V] through this module's hyper-head and norm and the shared head."""
        module = self.mtp[spec_step_idx % len(self.mtp)]
        y = module.hc_head(hidden_states.view(-1, self.hc_mult, self.hidden_size), module.norm)
        return fp32_linear(y, self.lm_head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm_dsv4.loader.load import load_official_weights

        loaded = load_official_weights(self.cfg, weights, dict(self.named_parameters()), self.shard, mtp=True)
        finish_loading(self)
        return loaded
