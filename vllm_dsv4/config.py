"""DeepSeek-V4 configuration as the official ``config.json`` states it, plus the layer plan.

Reads the *official* (legacy) keys directly -- ``compress_ratios``, ``num_hash_layers``,
``qk_rope_head_dim``, ``rope_scaling`` -- never transformers' normalised ``layer_types``
(whose defaults are shifted by one layer, docs/MODEL.md §1.2).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping


class LayerKind(enum.Enum):
    """What a layer attends besides its sliding window (§5.7), named as its compressed cache:
    ``swa`` nothing, ``c4`` the C4 entries its indexer picks, ``c128`` every visible C128 entry."""

    SWA = "swa"
    C4 = "c4"
    C128 = "c128"

    @property
    def ratio(self) -> int:
        """Tokens pooled into one compressed entry (``compress_ratios``); 0 for ``swa``."""
        return {LayerKind.SWA: 0, LayerKind.C4: 4, LayerKind.C128: 128}[self]

    @property
    def overlap(self) -> int:
        """Entries' worth of tokens one compressor window spans (the reference's ``coff``): C4's
        windows overlap, each also pooling the previous entry's tokens (2); C128's do not (1) (§5.4)."""
        return 2 if self is LayerKind.C4 else 1


# compress_ratios values -> layer kind (1 is also sliding-window only)
_KIND_OF_RATIO = {0: LayerKind.SWA, 1: LayerKind.SWA, 4: LayerKind.C4, 128: LayerKind.C128}

# Image sentinel token types (docs/VISION.md §4); type t is the tokenizer's reserved id SENTINEL_BASE_ID + t
# (<|place_holder_mm_span_0431|> .. _0435|>): in-vocabulary, unlike the reference's vocab_size + t, so they
# pass vLLM's prompt validation and detokenise.
IMAGE_START, IMAGE_PAD, IMAGE, IMAGE_NEWLINE, IMAGE_END = range(5)
NUM_SENTINELS = 5
SENTINEL_BASE_ID = 129257
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"  # where the chat encoding puts an image; vLLM expands it to the block
# vision_max_n_token at least: below it the image size solver has no grid of two rows to fall back on
MIN_IMAGE_TOKENS = 16


class ConfigError(ValueError):
    """A config.json that cannot describe a DeepSeek-V4 model."""


def is_mtp_draft(hf_config) -> bool:
    """Whether ``hf_config`` is vLLM's draft config for MTP drafting on a DeepSeek-V4 checkpoint: the
    checkpoint's own config with the model type rewritten to ``deepseek_mtp``."""
    return getattr(hf_config, "model_type", None) == "deepseek_mtp" and hasattr(hf_config, "compress_ratios")


@dataclass(frozen=True)
class Yarn:
    """YaRN parameters applied to compressed (C4/C128) layers only (§3.2)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class DSparkConfig:
    """The keys of a DSpark drafter (V4-Flash-0731, V4-Pro-0813): ``block_size`` tokens drafted per step by
    default, the ``noise_token_id`` filling the block after its anchor, the main layers whose outputs feed
    the drafter (one draft stage each, ``mtp.0 ..``) and the rank of its Markov head."""

    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int

    KEYS = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")

    @property
    def num_stages(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], num_layers: int, vocab_size: int) -> "DSparkConfig | None":
        """None without DSpark keys; ConfigError naming the key for a partial or inconsistent set."""
        present = [k for k in cls.KEYS if k in raw]
        if not present:
            return None
        missing = [k for k in cls.KEYS if k not in raw]
        if missing:
            raise ConfigError(f"config.json has {present} but lacks {missing}: a DSpark drafter needs all of {cls.KEYS}")
        dspark = cls(int(raw["dspark_block_size"]), int(raw["dspark_noise_token_id"]),
                     tuple(int(i) for i in raw["dspark_target_layer_ids"]), int(raw["dspark_markov_rank"]))
        ids = dspark.target_layer_ids
        if not ids or len(set(ids)) != len(ids) or not all(0 <= i < num_layers for i in ids):
            raise ConfigError(f"dspark_target_layer_ids={list(ids)}: expected distinct main layers in "
                              f"[0, num_hidden_layers = {num_layers})")
        if not 0 <= dspark.noise_token_id < vocab_size:
            raise ConfigError(f"dspark_noise_token_id={dspark.noise_token_id} is outside the vocabulary ({vocab_size})")
        if dspark.block_size < 1 or dspark.markov_rank < 1:
            raise ConfigError(f"dspark_block_size={dspark.block_size} and dspark_markov_rank={dspark.markov_rank} "
                              "must be positive")
        return dspark


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower and image layout of a Vision checkpoint (``vision_*`` keys; docs/VISION.md §1).
    Units: pixels, LLM tokens."""

    n_layers: int
    dim: int
    n_heads: int
    inter_dim: int
    patch_size: int
    rope_theta: float
    downsample_ratio: int  # the aligner merges downsample_ratio x downsample_ratio patches
    max_n_token: int  # LLM tokens per image at most, alignment pad included
    min_pixels: int  # smaller images are scaled up to this area
    max_wh_ratio: float | None  # wider images are sized as if this wide, then stretched

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "VisionConfig | None":
        """The ``vision_*`` keys of a config.json, or None for a text-only one (``vision_n_layers`` 0 or absent)."""
        n_layers = int(raw.get("vision_n_layers", 0) or 0)
        if n_layers <= 0:
            return None
        ratio = raw.get("vision_max_wh_ratio", 8)
        vision = cls(
            n_layers=n_layers,
            dim=int(raw.get("vision_dim", 1024)),
            n_heads=int(raw.get("vision_n_heads", 16)),
            inter_dim=int(raw.get("vision_inter_dim", 2816)),
            patch_size=int(raw.get("vision_patch_size", 14)),
            rope_theta=float(raw.get("vision_rope_theta", 10000.0)),
            downsample_ratio=int(raw.get("vision_downsample_ratio", 3)),
            max_n_token=int(raw.get("vision_max_n_token", 384)),
            min_pixels=int(raw.get("vision_min_pixels", 147456)),
            max_wh_ratio=None if ratio is None else float(ratio),
        )
        # 2-D RoPE rotates half of each head per image axis, in rotate-half pairs
        if vision.dim % vision.n_heads or vision.head_dim % 4:
            raise ConfigError(f"vision_dim={vision.dim} / vision_n_heads={vision.n_heads} does not give a head "
                              f"dim divisible by 4")
        if min(vision.patch_size, vision.downsample_ratio, vision.inter_dim) < 1 or vision.min_pixels < 0:
            raise ConfigError("vision_patch_size, vision_downsample_ratio and vision_inter_dim must be positive")
        if vision.max_n_token < MIN_IMAGE_TOKENS:
            raise ConfigError(f"vision_max_n_token={vision.max_n_token} is below {MIN_IMAGE_TOKENS}")
        if vision.max_wh_ratio is not None and vision.max_wh_ratio < 1:
            raise ConfigError(f"vision_max_wh_ratio={vision.max_wh_ratio} is below 1")
        return vision


@dataclass(frozen=True)
class Dsv4Config:
    """The fields of an official DeepSeek-V4 ``config.json`` the model needs. Units: tokens, dims."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    compress_rope_theta: float
    rope_theta: float
    yarn: Yarn | None
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_hash_layers: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    num_nextn_predict_layers: int
    max_position_embeddings: int
    expert_dtype: str
    quantized: bool
    dspark: DSparkConfig | None = None
    vision: VisionConfig | None = None  # set for a Vision checkpoint

    @property
    def draft_layers(self) -> int:
        """Blocks after the main layers: the DSpark stages, or the MTP modules (num_nextn_predict_layers,
        which DSpark checkpoints leave at 1)."""
        return self.dspark.num_stages if self.dspark else self.num_nextn_predict_layers

    def layer_kind(self, layer: int) -> LayerKind:
        """The kind of layer ``layer``; layers from ``num_hidden_layers`` on are the draft's (MTP modules or
        DSpark stages)."""
        return _KIND_OF_RATIO[self.compress_ratios[layer]]

    @property
    def mxfp4_experts(self) -> bool:
        """The checkpoint stores routed experts as MXFP4 (e2m1 codes + an e8m0 scale per 1x32 block)."""
        return self.quantized and self.expert_dtype == "fp4"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Dsv4Config":
        """Validate and convert an official config.json dict; raises ConfigError naming the key."""

        def need(key: str) -> Any:
            if key not in raw:
                raise ConfigError(f"config.json lacks required key {key!r}")
            return raw[key]

        num_layers = int(need("num_hidden_layers"))
        num_mtp = int(raw.get("num_nextn_predict_layers", 0))
        ratios = tuple(int(r) for r in need("compress_ratios"))
        dspark = DSparkConfig.from_dict(raw, num_layers, int(need("vocab_size")))
        bad = sorted({r for r in ratios if r not in _KIND_OF_RATIO})
        if bad:
            raise ConfigError(f"compress_ratios has unsupported values {bad}; supported: 0, 1, 4, 128")
        if dspark is not None:
            if len(ratios) != num_layers + dspark.num_stages:
                raise ConfigError(
                    f"compress_ratios has {len(ratios)} entries, expected num_hidden_layers + one per DSpark "
                    f"stage (dspark_target_layer_ids names {dspark.num_stages}) = {num_layers + dspark.num_stages}")
            if any(_KIND_OF_RATIO[r] != LayerKind.SWA for r in ratios[num_layers:]):
                raise ConfigError(f"compress_ratios gives the DSpark stages {list(ratios[num_layers:])}; "
                                  "they are sliding-window only (0)")
        elif len(ratios) < num_layers + num_mtp:
            raise ConfigError(
                f"compress_ratios has {len(ratios)} entries, expected "
                f"num_hidden_layers + num_nextn_predict_layers = {num_layers + num_mtp}"
            )
        scaling = raw.get("rope_scaling") or None
        yarn = None
        if scaling is not None:
            kind = scaling.get("type", scaling.get("rope_type"))
            if kind != "yarn":
                raise ConfigError(f"rope_scaling type {kind!r} is not supported (only 'yarn')")
            yarn = Yarn(
                factor=float(scaling["factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                beta_fast=float(scaling.get("beta_fast", 32)),
                beta_slow=float(scaling.get("beta_slow", 1)),
            )
        heads, groups = int(need("num_attention_heads")), int(need("o_groups"))
        if heads % groups:
            raise ConfigError(f"num_attention_heads={heads} is not divisible by o_groups={groups}")
        quant = raw.get("quantization_config")
        cfg = cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            head_dim=int(need("head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            q_lora_rank=int(need("q_lora_rank")),
            o_groups=groups,
            o_lora_rank=int(need("o_lora_rank")),
            sliding_window=int(need("sliding_window")),
            compress_ratios=ratios,
            compress_rope_theta=float(raw.get("compress_rope_theta", 160000.0)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            yarn=yarn,
            index_n_heads=int(need("index_n_heads")),
            index_head_dim=int(need("index_head_dim")),
            index_topk=int(need("index_topk")),
            n_routed_experts=int(need("n_routed_experts")),
            n_shared_experts=int(raw.get("n_shared_experts", 1)),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_hash_layers=int(raw.get("num_hash_layers", 0)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            swiglu_limit=float(raw.get("swiglu_limit", 0.0)),
            hc_mult=int(raw.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(raw.get("hc_eps", 1e-6)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            num_nextn_predict_layers=num_mtp,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            expert_dtype=str(raw.get("expert_dtype", "fp4") if quant else "bf16"),
            quantized=quant is not None,
            dspark=dspark,
            vision=VisionConfig.from_dict(raw),
        )
        if cfg.n_shared_experts != 1:
            raise ConfigError(f"n_shared_experts={cfg.n_shared_experts}; DeepSeek-V4 has exactly 1")
        if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim > min(cfg.head_dim, cfg.index_head_dim):
            raise ConfigError(f"qk_rope_head_dim={cfg.qk_rope_head_dim} does not fit the head dims")
        if quant is not None:
            # vLLM rewrites quant_method to the name of the config that claimed the checkpoint.
            fp8 = quant.get("quant_method") in ("fp8", "deepseek_v4_fp8", "dsv4_plugin_fp8")
            if not fp8 or tuple(quant.get("weight_block_size", ())) != (128, 128):
                raise ConfigError(f"quantization_config {quant} is not FP8 with 128x128 blocks")
            if cfg.expert_dtype not in ("fp4", "fp8"):
                raise ConfigError(f"expert_dtype {cfg.expert_dtype!r} is not 'fp4' or 'fp8'")
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Dsv4Config":
        with open(Path(path) / "config.json") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "Dsv4Config":
        """Build from vLLM's/transformers' config object (attributes keep the legacy keys)."""
        raw = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
        if "rope_scaling" not in raw or raw["rope_scaling"] is None:
            raw["rope_scaling"] = getattr(hf_config, "rope_scaling", None)
        return cls.from_dict(raw)
