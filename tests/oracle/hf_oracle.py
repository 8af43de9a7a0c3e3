"""transformers' DeepseekV4ForCausalLM as a functional oracle, loaded from an official-format checkpoint.

``load_hf_reference(ckpt_dir)`` builds the HF model in fp32 / eager / eval mode from our
``config.json`` (legacy keys, folded by ``DeepseekV4Config``), checks that the layer schedule it
built equals ``compress_ratios`` / ``num_hash_layers`` (docs/MODEL.md §1.2), renames the
official tensors to HF's names (§8.2) and dequantizes FP8 / MXFP4 weights with a decoder written
here from the format definitions (§3.3) -- deliberately independent of vllm_dsv4.loader.dequant.

Only the standard library, torch, safetensors and transformers are used; ``mtp.*`` is skipped
(HF does not build the MTP layer).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path

import torch


def _hide_broken_vision_packages() -> None:
    """torchvision / torchaudio / torchcodec wheels in the venv are built for another torch and
    break ``import transformers`` model classes (§14 pitfall 1); make transformers think they are
    absent."""
    if getattr(importlib.util.find_spec, "_dsv4_patched", False):
        return
    original = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name.split(".")[0] in ("torchvision", "torchaudio", "torchcodec"):
            return None
        return original(name, *args, **kwargs)

    find_spec._dsv4_patched = True  # type: ignore[attr-defined]
    importlib.util.find_spec = find_spec


_hide_broken_vision_packages()

_LAYER_TYPE_OF_RATIO = {0: "sliding_attention", 1: "sliding_attention", 4: "compressed_sparse_attention",
                        128: "heavily_compressed_attention"}

# --------------------------------------------------------------------------------------------
# Independent decoders (bit-level, from the format definitions)
# --------------------------------------------------------------------------------------------


def _e4m3fn_bytes_to_float(b: torch.Tensor) -> torch.Tensor:
    """OCP FP8 E4M3FN from raw bytes: s eeee mmm, bias 7, subnormals at e=0, 0x7F/0xFF = NaN."""
    b = b.to(torch.int64)
    sign = torch.where((b >> 7) & 1 == 1, -1.0, 1.0).to(torch.float64)
    e = (b >> 3) & 0xF
    m = (b & 0x7).to(torch.float64)
    normal = torch.pow(2.0, (e - 7).to(torch.float64)) * (1.0 + m / 8.0)
    subnormal = (2.0**-6) * (m / 8.0)
    val = sign * torch.where(e == 0, subnormal, normal)
    return torch.where((b & 0x7F) == 0x7F, torch.full_like(val, float("nan")), val)


def _e8m0_bytes_to_float(b: torch.Tensor) -> torch.Tensor:
    """UE8M0: 2^(byte-127); 0xFF = NaN."""
    b = b.to(torch.int64)
    val = torch.pow(2.0, (b - 127).to(torch.float64))
    return torch.where(b == 255, torch.full_like(val, float("nan")), val)


def _e2m1_nibble_to_float(n: torch.Tensor) -> torch.Tensor:
    """FP4 E2M1: s ee m, bias 1; e=0 is subnormal (0 or 0.5)."""
    n = n.to(torch.int64)
    sign = torch.where((n >> 3) & 1 == 1, -1.0, 1.0).to(torch.float64)
    e = (n >> 1) & 0x3
    m = (n & 1).to(torch.float64)
    mag = torch.where(e == 0, 0.5 * m, torch.pow(2.0, (e - 1).to(torch.float64)) * (1.0 + 0.5 * m))
    return sign * mag


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.float32:  # V4-Flash-Base: pow-2 values in fp32
        return scale.to(torch.float64)
    return _e8m0_bytes_to_float(_raw_bytes(scale))


def oracle_dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """[out, in] e4m3 with [ceil(out/b), ceil(in/b)] scales -> float32."""
    q = _e4m3fn_bytes_to_float(_raw_bytes(weight))
    s = _scale_values(scale)
    out, inp = q.shape
    rows = torch.arange(out) // block
    cols = torch.arange(inp) // block
    return (q * s[rows][:, cols]).to(torch.float32)


def oracle_dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """[out, in/2] packed bytes (element 2j in the low nibble, 2j+1 in the high) -> float32 [out, in]."""
    b = _raw_bytes(packed).to(torch.int64)
    out, half = b.shape
    vals = torch.empty(out, 2 * half, dtype=torch.float64)
    vals[:, 0::2] = _e2m1_nibble_to_float(b & 0xF)
    vals[:, 1::2] = _e2m1_nibble_to_float(b >> 4)
    s = _scale_values(scale)
    return (vals * s[:, torch.arange(2 * half) // block]).to(torch.float32)


# --------------------------------------------------------------------------------------------
# Official -> HF names (§8.2)
# --------------------------------------------------------------------------------------------

_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}

# Suffix inside "layers.N." -> HF suffix inside "model.layers.N.".
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}

_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")


# --------------------------------------------------------------------------------------------
# Checkpoint reading (safetensors index or single file)
# --------------------------------------------------------------------------------------------


def _open_tensors(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = ckpt_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(ckpt_dir / f)))
    return tensors


def _dequantized_weights(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official name -> float tensor (``.scale`` companions folded in, other dtypes unchanged)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith(".scale"):
            continue
        if name.endswith(".weight") and t.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8):
            sname = name[: -len(".weight")] + ".scale"
            if sname not in raw:
                raise KeyError(f"{name} is quantized ({t.dtype}) but {sname} is missing")
            if t.dtype == torch.float8_e4m3fn:
                out[name] = oracle_dequant_fp8(t, raw[sname])
            else:
                out[name] = oracle_dequant_mxfp4(t, raw[sname])
        elif t.dtype.is_floating_point:
            out[name] = t.to(torch.float32)
        else:
            out[name] = t
    orphans = [n for n in raw if n.endswith(".scale") and n[: -len(".scale")] + ".weight" not in raw]
    if orphans:
        raise KeyError(f"scale tensors without weight: {orphans[:5]}")
    return out


def official_to_hf(weights: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Rename official tensors to HF's; stack experts into gate_up_proj [E, 2I, D] / down_proj [E, D, I]."""
    hf: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in weights.items():
        if name.startswith("mtp."):
            continue
        if name in _TOP:
            hf[_TOP[name]] = t
            continue
        m = _EXPERT_RE.match(name)
        if m:
            layer, e, w = int(m.group(1)), int(m.group(2)), m.group(3)
            experts.setdefault(layer, {}).setdefault(w, {})[e] = t
            continue
        m = _LAYER_RE.match(name)
        if not m or m.group(2) not in _LAYER:
            raise KeyError(f"no HF name for official tensor {name}")
        hf[f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"] = t
    for layer, ws in experts.items():
        for w in ("w1", "w2", "w3"):
            got = sorted(ws.get(w, {}))
            if got != list(range(num_experts)):
                raise KeyError(f"layers.{layer}.ffn.experts.*.{w}: have experts {got}, expected 0..{num_experts - 1}")
        w1 = torch.stack([ws["w1"][e] for e in range(num_experts)])
        w3 = torch.stack([ws["w3"][e] for e in range(num_experts)])
        hf[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([w1, w3], dim=1)  # gate rows first
        hf[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([ws["w2"][e] for e in range(num_experts)])
    return hf


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def hf_config_from_json(raw: dict):
    """DeepseekV4Config from our official config.json; checks the schedule HF derives from it."""
    from transformers import DeepseekV4Config

    raw = dict(raw)
    raw.pop("quantization_config", None)  # weights are dequantized here; no HF FP8 quantizer
    cfg = DeepseekV4Config(**raw)
    n = raw["num_hidden_layers"]
    want_types = [_LAYER_TYPE_OF_RATIO[r] for r in raw["compress_ratios"][:n]]
    if list(cfg.layer_types) != want_types:
        raise AssertionError(f"HF layer_types {cfg.layer_types} != compress_ratios {raw['compress_ratios'][:n]}")
    n_hash = raw.get("num_hash_layers", 0)
    want_mlp = ["hash_moe" if i < n_hash else "moe" for i in range(n)]
    if list(cfg.mlp_layer_types) != want_mlp:
        raise AssertionError(f"HF mlp_layer_types {cfg.mlp_layer_types} != num_hash_layers={n_hash}")
    if cfg.qk_rope_head_dim != raw["qk_rope_head_dim"]:
        raise AssertionError(f"HF qk_rope_head_dim {cfg.qk_rope_head_dim} != {raw['qk_rope_head_dim']}")
    scaling = raw.get("rope_scaling")
    if scaling:
        comp = cfg.rope_parameters["compress"]
        if comp.get("rope_type") != "yarn" or float(comp.get("factor")) != float(scaling["factor"]):
            raise AssertionError(f"HF compress rope {comp} does not carry rope_scaling {scaling}")
    return cfg


def load_hf_reference(ckpt_dir: str | Path, weights: dict[str, torch.Tensor] | None = None):
    """transformers DeepseekV4ForCausalLM (fp32, eager, eval) with the checkpoint's weights (or ``weights``,
    official names, dequantised: the text model's part of a bigger checkpoint)."""
    from transformers import DeepseekV4ForCausalLM

    ckpt_dir = Path(ckpt_dir)
    raw_cfg = json.loads((ckpt_dir / "config.json").read_text())
    cfg = hf_config_from_json(raw_cfg)
    model = DeepseekV4ForCausalLM._from_config(cfg, dtype=torch.float32, attn_implementation="eager")

    if weights is None:
        weights = _dequantized_weights(_open_tensors(ckpt_dir))
    state = official_to_hf(weights, cfg.n_routed_experts)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise AssertionError(f"HF state dict mismatch: missing {missing[:10]}, unexpected {unexpected[:10]}")
    bad = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in state.items() if v.shape != own[k].shape]
    if bad:
        raise AssertionError(f"HF shape mismatch (name, checkpoint, model): {bad[:10]}")
    state = {k: v.to(own[k].dtype) for k, v in state.items()}
    result = model.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    model.eval()
    return model


def greedy_sequence(model, prompt: list[int], new_tokens: int) -> list[int]:
    """``prompt`` followed by ``model``'s greedy continuation of exactly ``new_tokens`` tokens (EOS ignored,
    as the engines under test run with ``ignore_eos``)."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False)
    return out[0].tolist()


def forced_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]`` fp64 log-probs of the token after ``prompt + tokens[:i]``, row ``i``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].double()
    return torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]


# --------------------------------------------------------------------------------------------
# MTP (§7), which transformers does not build: assembled here from its modules
# --------------------------------------------------------------------------------------------


class HFMTPReference:
    """The MTP module ``mtp.0`` of a checkpoint as §7 defines it, built from transformers' pieces: its
    block is a ``DeepseekV4DecoderLayer`` at layer index ``num_hidden_layers`` (sliding-window,
    score-routed), its norms ``DeepseekV4RMSNorm``, its head mixer ``DeepseekV4HyperHead``; the main
    model (``load_hf_reference``) gives the embedding, the head and the streams before its hyper-head.

    ``logprobs(tokens)``: for a sequence t_0..t_{N-1}, row q (0 <= q < N-1) holds the draft's fp64
    log-probs for t_{q+2} from the main model's streams at q and the embedding of t_{q+1};
    ``chained_logprobs``: a second draft step, fed the first one's output (vLLM's k > 1)."""

    def __init__(self, ckpt_dir: str | Path):
        import copy

        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

        ckpt_dir = Path(ckpt_dir)
        self.main = load_hf_reference(ckpt_dir)
        cfg = copy.deepcopy(self.main.config)
        L = cfg.num_hidden_layers
        cfg.layer_types = list(cfg.layer_types) + ["sliding_attention"]  # the MTP block's kinds (§7)
        cfg.mlp_layer_types = list(cfg.mlp_layer_types) + ["moe"]
        self.config = cfg
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.block = hf.DeepseekV4DecoderLayer(cfg, L)
        self.enorm, self.hnorm, self.norm = (hf.DeepseekV4RMSNorm(d, eps) for _ in range(3))
        self.e_proj, self.h_proj = (torch.nn.Linear(d, d, bias=False) for _ in range(2))
        self.hc_head = hf.DeepseekV4HyperHead(cfg)

        weights = {n[len("mtp.0."):]: t for n, t in _dequantized_weights(_open_tensors(ckpt_dir)).items()
                   if n.startswith("mtp.0.")}
        own = {"enorm.weight": self.enorm.weight, "hnorm.weight": self.hnorm.weight, "norm.weight": self.norm.weight,
               "e_proj.weight": self.e_proj.weight, "h_proj.weight": self.h_proj.weight,
               "hc_head_fn": self.hc_head.hc_fn, "hc_head_base": self.hc_head.hc_base,
               "hc_head_scale": self.hc_head.hc_scale}
        block_state = official_to_hf({f"layers.{L}.{n}": t for n, t in weights.items() if n not in own},
                                     cfg.n_routed_experts)
        prefix = f"model.layers.{L}."
        result = self.block.load_state_dict({n[len(prefix):]: t for n, t in block_state.items()}, strict=True)
        assert not result.missing_keys and not result.unexpected_keys, result
        with torch.no_grad():
            for name, param in own.items():
                assert param.shape == weights[name].shape, (name, param.shape, weights[name].shape)
                param.copy_(weights[name])
        for module in (self.block, self.enorm, self.hnorm, self.norm, self.e_proj, self.h_proj, self.hc_head):
            module.float().eval()

    @torch.no_grad()
    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        return self._logprobs(self._first_step(tuple(tokens))[1])

    @torch.no_grad()
    def chained_logprobs(self, tokens: list[int], position: int, draft: int) -> torch.Tensor:
        """The second draft step at ``position`` (> 0): fed the first step's output streams at
        ``position - 1`` (inputs from ``tokens``) and the embedding of ``draft``, attending the first
        step's inputs before it. fp64 log-probs [V] for the token at ``position + 2``."""
        x, out = self._first_step(tuple(tokens))  # causal: its rows before ``position`` are the prefix's
        x = torch.cat([x[:, :position], self._fuse(out[:, position - 1 : position], torch.tensor([[draft]]))], 1)
        return self._logprobs(self._block(x, torch.tensor([list(tokens[1 : position + 1]) + [draft]]))[:, -1:])[0]

    @functools.lru_cache(maxsize=8)
    def _first_step(self, tokens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The first draft step over ``tokens``: block inputs and outputs [1, N-1, n, D] at positions
        0..N-2 (the main model's streams at p and the embedding of the token at p + 1). Kept for the
        last few sequences: every second-step row of a sequence starts from it."""
        ids = torch.tensor([tokens])
        captured = {}
        hook = self.main.model.hc_head.register_forward_pre_hook(lambda m, args: captured.update(streams=args[0]))
        try:
            self.main(ids)
        finally:
            hook.remove()
        x = self._fuse(captured["streams"][:, :-1], ids[:, 1:])
        return x, self._block(x, ids[:, 1:])

    def _fuse(self, streams: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.main.model.embed_tokens(next_ids)
        return self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(embeds)).unsqueeze(2)

    def _block(self, x: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """The MTP block over inputs x [1, N, n, D] at positions 0..N-1 (causal, sliding window)."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        position_ids = torch.arange(x.shape[1]).unsqueeze(0)
        rotary, embeds = self.main.model.rotary_emb, x[:, :, 0]
        position_embeddings = {kind: rotary(embeds, position_ids=position_ids, layer_type=kind)
                               for kind in ("main", "compress")}
        mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=embeds, attention_mask=None,
                                                 past_key_values=None, position_ids=position_ids)
        return self.block(x, input_ids=next_ids, position_embeddings=position_embeddings, position_ids=position_ids,
                          attention_mask=mask, past_key_values=None)

    def _logprobs(self, streams: torch.Tensor) -> torch.Tensor:
        logits = self.main.lm_head(self.norm(self.hc_head(streams)))[0]
        return torch.log_softmax(logits.double(), -1)
