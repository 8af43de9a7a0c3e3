"""The DeepSeek-V4 network in forward order: embed -> streams -> blocks -> hyper-head -> norm -> head."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from vllm_dsv4.config import Dsv4Config
from vllm_dsv4.model.attention import Attention
from vllm_dsv4.model.layers import Linear, RMSNorm, fp8_linears, fp32_linear, hold_fp8_linears
from vllm_dsv4.model.mhc import HyperConnection, HyperHead
from vllm_dsv4.model.moe import Experts, MoE
from vllm_dsv4.model.parallel import Shard, all_reduce, current_shard


class Block(nn.Module):
    """mHC-wrapped attention and MoE sub-layers over the n residual streams (§2)."""

    def __init__(self, cfg: Dsv4Config, layer: int, prefix: str, vllm_config, kv_dtype: torch.dtype, shard: Shard,
                 fp8: Mapping[str, int]):
        super().__init__()
        self.shard = shard
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_attn, self.hc_ffn = HyperConnection(cfg), HyperConnection(cfg)
        self.attn = Attention(cfg, cfg.compress_ratio(layer), f"{prefix}.attn", vllm_config, kv_dtype, shard)
        self.ffn = MoE(cfg, layer < cfg.num_hash_layers, shard)
        hold_fp8_linears(self, fp8, f"layers.{layer}")  # block by block: one block's bf16 weights in flight

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        y, post, comb = self.hc_attn.pre(streams)
        out = all_reduce(self.attn(self.attn_norm(y), positions), self.shard)
        streams = self.hc_attn.post(out, streams, post, comb)
        y, post, comb = self.hc_ffn.pre(streams)
        out = all_reduce(self.ffn(self.ffn_norm(y), input_ids), self.shard)
        return self.hc_ffn.post(out, streams, post, comb)


class DeepseekV4ForCausalLM(nn.Module):
    """vLLM entry point for ``architectures: ["DeepseekV4ForCausalLM"]`` (overrides the in-tree model)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        self.cfg = cfg = Dsv4Config.from_hf_config(vllm_config.model_config.hf_config)
        self.shard = shard = current_shard()  # layers raise ConfigError for dims that do not split
        dtype = vllm_config.model_config.dtype
        fp8 = fp8_linears(cfg, shard)  # empty on the CPU path: every weight dequantised at load
        self.hc_mult = cfg.hc_mult
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Block(cfg, i, f"{prefix}.layers.{i}" if prefix else f"layers.{i}", vllm_config, dtype, shard, fp8)
            for i in range(cfg.num_hidden_layers)
        )
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    get_input_embeddings = embed_input_ids

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T], positions [T] -> final normed hidden [T, D]."""
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        streams = h.unsqueeze(1).repeat(1, self.hc_mult, 1)  # [T, n, D]
        for block in self.layers:
            streams = block(streams, positions, input_ids)
        return self.norm(self.hc_head(streams))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 from the (model-dtype) head, as the reference does (on CUDA without an fp32
        copy of the head per step: 2 GiB for V4's vocabulary)."""
        return fp32_linear(hidden_states, self.head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm_dsv4.loader.load import load_official_weights

        loaded = load_official_weights(self.cfg, weights, dict(self.named_parameters()), self.shard)
        for module in self.modules():  # vLLM post-processes quant methods only; ours finish here
            if isinstance(module, (Linear, Experts)):
                module.finish_loading()
        return loaded
