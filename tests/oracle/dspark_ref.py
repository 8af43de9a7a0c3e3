"""A DSpark drafter (docs/MODEL.md §16.4-§16.7) written from the spec, for one request, fp32.

Independent of vLLM and of the plugin: the V4 blocks are transformers' modules (``DeepseekV4DecoderLayer``
for each stage, ``DeepseekV4HyperHead``, ``DeepseekV4RMSNorm``; the main model from
``hf_oracle.load_hf_reference``), the rest is written out here from the spec:

- features: after target layer t, the mean of its n output streams (``aux_t``, §16.4), concatenated in the
  order of ``dspark_target_layer_ids``; ``main_x = main_norm(main_proj(features))`` (§16.4);
- context KV of stage s at every position p before the anchor: ``RoPE_p(kv_norm_s(wkv_s(main_x[p])))``
  (§16.5), the last ``sliding_window`` of them;
- the block: the anchor and ``N - 1`` noise tokens at positions P .. P+N-1, the embedding copied to n
  streams, through the stages; each stage's attention sees the context KV and every block key, with no mask
  (non-causal). The decoder layer gets its keys through the cache hook it calls
  (``past_key_values.update``): the hook puts the context in front of the block's own keys;
- head: ``h = hc_head(X)`` (pre-norm), ``U = head(norm(h))``; Markov stage: ``U_k + W2 W1[prev]`` with
  ``prev`` the anchor, then each draft; confidence ``sigmoid(w . [h_k ; W1[prev_k]])`` (§16.7).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from tests.oracle.hf_oracle import _dequantized_weights, _open_tensors, load_hf_reference, official_to_hf


class _ContextCache:
    """What a decoder layer's attention reads for its keys: the stage's context KV, then its own."""

    def __init__(self, context: torch.Tensor):
        self.context = context  # [1, 1, C, d]

    def update(self, key, value, layer_idx):
        keys = torch.cat([self.context, key], dim=2)
        return keys, keys


def stream_means(model, layers: list[int], forward) -> list[torch.Tensor]:
    """The mean over the n streams [S, D] after each of ``layers`` of transformers' ``model`` while
    ``forward()`` runs it over one sequence."""
    captured = {}
    hooks = [model.model.layers[t].register_forward_hook(
        lambda module, args, out, t=t: captured.update({t: out[0].mean(dim=1)})) for t in layers]
    try:
        forward()
    finally:
        for hook in hooks:
            hook.remove()
    return [captured[t] for t in layers]


class HFDSparkReference:
    """``draft(tokens, anchor, n)``: every intermediate of one draft step of a request whose committed
    tokens are ``tokens`` (positions 0 .. P-1) and whose anchor (the token the target just sampled) sits
    at position P = len(tokens)."""

    def __init__(self, ckpt_dir: str | Path, main=None):
        """``main``: the target model when the checkpoint holds more than transformers' (a Vision one);
        its ``features`` then come from the caller."""
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

        ckpt_dir = Path(ckpt_dir)
        raw = json.loads((ckpt_dir / "config.json").read_text())
        self.main = load_hf_reference(ckpt_dir) if main is None else main
        cfg = copy.deepcopy(self.main.config)
        L, self.targets = cfg.num_hidden_layers, list(raw["dspark_target_layer_ids"])
        S = len(self.targets)
        cfg.layer_types = list(cfg.layer_types) + ["sliding_attention"] * S  # the stages are window-only
        cfg.mlp_layer_types = list(cfg.mlp_layer_types) + ["moe"] * S  # and score-routed
        self.config, self.noise, self.window = cfg, raw["dspark_noise_token_id"], raw["sliding_window"]
        weights = _dequantized_weights(_open_tensors(ckpt_dir))
        self.stages = []
        for s in range(S):
            # (a Vision stage's gate.bias_vl routes image sentinels only, never in a block of anchor + noise)
            block = {f"layers.{L + s}.{n[len(f'mtp.{s}.'):]}": t for n, t in weights.items()
                     if n.startswith(f"mtp.{s}.") and not n.startswith(tuple(f"mtp.{s}.{x}" for x in _HEADS))
                     and not n.endswith("gate.bias_vl")}
            stage = hf.DeepseekV4DecoderLayer(cfg, L + s)
            prefix = f"model.layers.{L + s}."
            state = {n[len(prefix):]: t for n, t in official_to_hf(block, cfg.n_routed_experts).items()}
            result = stage.load_state_dict(state, strict=True)
            assert not result.missing_keys and not result.unexpected_keys, result
            self.stages.append(stage.float().eval())
        last = f"mtp.{S - 1}."
        self.main_proj = weights["mtp.0.main_proj.weight"]  # [D, S*D]
        self.main_norm = self._norm(weights["mtp.0.main_norm.weight"])
        self.norm = self._norm(weights[last + "norm.weight"])
        self.hc_head = hf.DeepseekV4HyperHead(cfg)
        with torch.no_grad():
            for part in ("fn", "base", "scale"):
                getattr(self.hc_head, f"hc_{part}").copy_(weights[f"{last}hc_head_{part}"])
        self.hc_head.float().eval()
        self.markov_w1 = weights[last + "markov_head.markov_w1.weight"]  # [V, r]
        self.markov_w2 = weights[last + "markov_head.markov_w2.weight"]  # [V, r]
        self.confidence_w = weights[last + "confidence_head.proj.weight"]  # [1, D + r]

    def _norm(self, weight):
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

        norm = hf.DeepseekV4RMSNorm(weight.shape[0], self.config.rms_norm_eps)
        with torch.no_grad():
            norm.weight.copy_(weight)
        return norm.float().eval()

    @torch.no_grad()
    def features(self, tokens: list[int]) -> list[torch.Tensor]:
        """``aux_t`` [P, D] of each target layer t: the mean over the n streams after it."""
        return stream_means(self.main, self.targets, lambda: self.main(torch.tensor([tokens])))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [1, 1, T, d] roped at ``positions`` with the window-only layers' rope (no YaRN)."""
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

        cos, sin = self.main.model.rotary_emb(x[:, 0], position_ids=positions[None], layer_type="main")
        return apply_rotary_pos_emb(x, cos, sin)

    @torch.no_grad()
    def draft(self, tokens: list[int], anchor: int, n: int, drafts: list[int] | None = None,
              features: list[torch.Tensor] | None = None) -> dict:
        """The step's intermediates; the Markov stage feeds its own greedy drafts forward, or ``drafts``
        (what the engine drafted, to score a sampled draft's distributions). ``features``: those of a
        longer sequence starting with ``tokens`` (the main model is causal), to save recomputing them."""
        P = len(tokens)
        features = [f[:P] for f in features] if features is not None else self.features(tokens)
        main_x = self.main_norm(torch.cat(features, dim=-1) @ self.main_proj.T)  # [P, D]
        ctx_pos = torch.arange(max(P - self.window, 0), P)
        ids = torch.tensor([[anchor] + [self.noise] * (n - 1)])
        pos = torch.arange(P, P + n)
        embeds = self.main.model.embed_tokens(ids)
        X = embeds.unsqueeze(2).repeat(1, 1, self.config.hc_mult, 1)  # [1, N, n, D]
        rope = {kind: self.main.model.rotary_emb(embeds, position_ids=pos[None], layer_type=kind)
                for kind in ("main", "compress")}
        context, stages = [], []
        for stage in self.stages:
            attn = stage.self_attn
            kv = attn.kv_norm(attn.kv_proj(main_x[ctx_pos]))  # [C, d]
            ctx = self._rope(kv.view(1, 1, len(ctx_pos), -1), ctx_pos)
            context.append(ctx[0, 0])
            X = stage(X, input_ids=ids, position_embeddings=rope, position_ids=pos[None], attention_mask=None,
                      past_key_values=_ContextCache(ctx))
            stages.append(X[0])
        h = self.hc_head(X)[0]  # [N, D]
        base = self.main.lm_head(self.norm(h))  # [N, V]
        prev, logits, out, markov = anchor, [], [], []
        for k in range(n):
            e = self.markov_w1[prev]
            row = base[k] + self.markov_w2 @ e
            out.append(int(row.argmax()) if drafts is None else drafts[k])
            logits.append(row)
            markov.append(e)
            prev = out[-1]
        confidence = torch.sigmoid(torch.cat([h, torch.stack(markov)], -1) @ self.confidence_w[0])
        return {"features": features, "main_x": main_x, "context_positions": ctx_pos, "context_kv": context,
                "stages": stages, "head_hidden": h, "base_logits": base, "logits": torch.stack(logits),
                "drafts": out, "confidence": confidence}


# Tensors of a stage that are not its block: stage 0's feature fusion, the last stage's heads (§16.2)
_HEADS = ("norm.", "hc_head_", "markov_head.", "confidence_head.", "main_proj.", "main_norm.")
