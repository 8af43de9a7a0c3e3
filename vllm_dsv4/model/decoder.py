"""The DeepSeek-V4 network in forward order: embed -> streams -> blocks -> hyper-head -> norm -> head."""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

import torch
from torch import nn

from vllm_dsv4 import ops
from vllm_dsv4.config import ConfigError, Dsv4Config
from vllm_dsv4.model.attention import Attention
from vllm_dsv4.model.layers import Linear, RMSNorm, fp8_linears, fp32_linear, hold_fp8_linears
from vllm_dsv4.model.mhc import HyperConnection, HyperHead
from vllm_dsv4.model.moe import Experts, MoE
from vllm_dsv4.model.parallel import all_reduce, current_shard
from vllm_dsv4.shard import Shard


class Block(nn.Module):
    """mHC-wrapped attention and MoE sub-layers over the n residual streams (§2). ``name``: the
    official one (``layers.N``, or ``mtp.K`` for layer index ``num_hidden_layers + K``); ``prefix``:
    the model's, which vLLM knows its cache layers by."""

    def __init__(self, cfg: Dsv4Config, layer: int, name: str, prefix: str, vllm_config, kv_dtype: torch.dtype,
                 shard: Shard, attention: type[Attention] = Attention):
        super().__init__()
        self.shard = shard
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_attn, self.hc_ffn = HyperConnection(cfg), HyperConnection(cfg)
        attn_prefix = f"{prefix}.{name}.attn" if prefix else f"{name}.attn"
        self.attn = attention(cfg, cfg.layer_kind(layer), attn_prefix, vllm_config, kv_dtype, shard)
        self.ffn = MoE(cfg, layer < cfg.num_hash_layers, shard)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        x, post, comb = self.hc_attn.pre(streams, self.attn_norm)
        out = all_reduce(self.attn(x, positions, input_ids), self.shard)
        streams = self.hc_attn.post(out, streams, post, comb)
        x, post, comb = self.hc_ffn.pre(streams, self.ffn_norm)
        out = all_reduce(self.ffn(x, input_ids), self.shard)
        return self.hc_ffn.post(out, streams, post, comb)


class DeepseekV4ForCausalLM(nn.Module):
    """vLLM entry point for ``architectures: ["DeepseekV4ForCausalLM"]`` (overrides the in-tree model)."""

    # A runner with this model takes warmup.py's steps (patches.py, patch 4) where kernels compile (with the
    # reference ops, VLLM_DSV4_OPS=reference, nothing would)
    warms_up_kernels = ops.USE_KERNELS

    def __init__(self, *, vllm_config, prefix: str = "", images: bool = False):
        """``images``: built inside ``DeepseekV4ForConditionalGeneration``, the only way to serve a Vision checkpoint."""
        super().__init__()
        self.cfg = cfg = Dsv4Config.from_hf_config(vllm_config.model_config.hf_config)
        if cfg.vision is not None and not images:
            raise ConfigError("this checkpoint has a vision tower (vision_n_layers > 0): it is served as "
                              "DeepseekV4ForConditionalGeneration, which the plugin picks for it when registered")
        self.shard = shard = current_shard()  # layers raise ConfigError for dims that do not split
        dtype = vllm_config.model_config.dtype
        fp8 = fp8_linears(cfg, shard)  # empty on the CPU path: every weight dequantised at load
        self.hc_mult = cfg.hc_mult
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            self.layers.append(Block(cfg, i, f"layers.{i}", prefix, vllm_config, dtype, shard))
            hold_fp8_linears(self.layers[i], fp8, f"layers.{i}")  # block by block: one block's bf16 weights in flight
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size)
        # The draft's input, in a buffer that outlives the step (and a CUDA graph's replay), read through
        # get_mtp_target_hidden_states: MTP's (model/mtp.py) are the streams after the last block [T, n*D];
        # DSpark's (model/dspark.py) the mean of the streams after each target layer, concatenated [T, K*D].
        spec = vllm_config.speculative_config
        method = spec.method if spec is not None else None
        self.feature_layers = cfg.dspark.target_layer_ids if method == "dspark" and cfg.dspark else ()
        rows = vllm_config.scheduler_config.max_num_batched_tokens if method in ("mtp", "dspark") else 0
        width = len(self.feature_layers) * cfg.hidden_size if self.feature_layers else cfg.hc_mult * cfg.hidden_size
        self.register_buffer("draft_inputs", torch.empty(rows, width, dtype=dtype), persistent=False)

    # What vLLM's MTP proposer shares with the draft: ``target.model.embed_tokens`` and ``target.lm_head``.
    @property
    def model(self) -> SimpleNamespace:
        return SimpleNamespace(embed_tokens=self.embed)

    @property
    def lm_head(self) -> Linear:
        return self.head

    def get_mtp_target_hidden_states(self) -> torch.Tensor | None:
        return self.draft_inputs if len(self.draft_inputs) else None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    get_input_embeddings = embed_input_ids

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T], positions [T] -> final normed hidden [T, D]."""
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        streams = h.unsqueeze(1).repeat(1, self.hc_mult, 1)  # [T, n, D]
        features = {}
        for i, block in enumerate(self.layers):
            streams = block(streams, positions, input_ids)
            if i in self.feature_layers:
                features[i] = streams.mean(dim=1)
        if features:
            self.draft_inputs[: len(streams)].copy_(torch.cat([features[i] for i in self.feature_layers], dim=-1))
        elif len(self.draft_inputs):
            self.draft_inputs[: len(streams)].copy_(streams.flatten(1))
        return self.hc_head(streams, self.norm)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 from the (model-dtype) head, as the reference does (on CUDA without an fp32
        copy of the head per step: 2 GiB for V4's vocabulary)."""
        return fp32_linear(hidden_states, self.head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm_dsv4.loader.load import load_official_weights

        loaded = load_official_weights(self.cfg, weights, dict(self.named_parameters()), self.shard)
        finish_loading(self)
        return loaded


def finish_loading(model: nn.Module) -> None:
    """Bind loaded weights to their kernels (vLLM post-processes quant methods only; ours finish here)."""
    for module in model.modules():
        if isinstance(module, (Linear, Experts)):
            module.finish_loading()
