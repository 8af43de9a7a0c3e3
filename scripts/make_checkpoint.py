#!/usr/bin/env python
"""Write a random DeepSeek-V4 checkpoint in the official format (config, shards, index, tokenizer).

Presets (docs/MODEL.md §13.1, §1.1):
  tiny      the TINY test config (0.6 M params), compress_ratios [0, 4, 128, 4, 0]
  tiny-pro  TINY with V4-Pro's structure: compress_ratios [128, 128, 4, 128, 4, 0], 3 hash layers, 12 experts
  ktiny     the kernel-shaped KTINY config (head_dim 512, index_head_dim 128, ...)
  flash     real V4-Flash dimensions, truncated to ``--num-layers`` (default 6) main layers
  tiny-base, flash-base   tiny / flash in V4-Flash-Base's format: FP8 routed experts, float32 scales
  tiny-0731, tiny-pro-0813, flash-0731
            the same with the DSpark drafter of V4-Flash-0731 / V4-Pro-0813 instead of the MTP module
            (docs/MODEL.md §16): one stage per target layer (the last three main layers), compress_ratios
            extended by three zeros, num_nextn_predict_layers left at 1 as the releases do
  tiny-vision   tiny-0731 with a tiny vision tower (every Vision-Exp tensor, official names and dtypes), the
                real vocabulary (image sentinels are reserved ids 129257..129261) and rms_norm_eps 1e-20
  flash-vision  Vision-Exp: flash-0731 plus the real tower, ``--vision-layers`` (default 32) ViT blocks

The quantized variant stores FP8 block-128 linears and MXFP4 routed experts with e8m0 scales
(``quantization_config`` + ``expert_dtype: fp4``); the Base presets FP8 block-128 routed experts and
every block scale as float32 powers of two (``expert_dtype: fp8``, as V4-Flash-Base stores them). The
unquantized variant encodes the SAME function: the same master weights are quantized and then stored
dequantized in bf16 (exactly representable).
Every tensor has its own generator seeded from (seed, name), so a layer's weights do not depend on
the number of layers or on the order of generation.

Shards are written group by group (top level, each layer, each draft block), each group split into
files of at most ``MAX_SHARD_BYTES``, so memory holds at most one layer's tensors.

  python scripts/make_checkpoint.py --preset tiny --out /tmp/dsv4-tiny [--unquantized] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from vllm_dsv4.config import Dsv4Config  # noqa: E402
from vllm_dsv4.loader import checkpoint as ckpt_table  # noqa: E402
from csrc_triton.formats import e8m0_to_float32  # noqa: E402
from vllm_dsv4.loader.dequant import dequant_fp8_block, dequant_mxfp4  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantize import quant_fp8_block, quant_mxfp4  # noqa: E402

MAX_SHARD_BYTES = 4 * 2**30

QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}

# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------

# The released V4-Flash config.json's model keys
_FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0],
    "compress_rope_theta": 160000,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}

# Tiny dims for CPU tests (a few MB), the structure V4-Flash's: SWA-only, C4 and C128 layers, hash-routed first layers
_TINY_OVERRIDES: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 16,
    "compress_ratios": [0, 4, 128, 4, 0],
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 256,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 4096,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "num_hash_layers": 2,
}

# V4-Pro's structure at tiny size (docs/MODEL.md §1.1): no SWA-only layer (C128, C128, then C4 /
# C128), three hash layers reaching into both compressed kinds, 2.5 routed scaling, more output groups,
# and dims that are not powers of two (a hidden size of 3 x 32, 12 experts), as Pro's 7168 and 384 are not.
_TINY_PRO_OVERRIDES: dict[str, Any] = {
    "hidden_size": 96,
    "num_hidden_layers": 5,
    "num_attention_heads": 8,
    "q_lora_rank": 48,
    "o_groups": 4,
    "compress_ratios": [128, 128, 4, 128, 4, 0],
    "index_topk": 16,
    "n_routed_experts": 12,
    "moe_intermediate_size": 64,
    "num_hash_layers": 3,
    "routed_scaling_factor": 2.5,
}

# ktiny: V4-Flash's head shapes (512-wide heads with a 64-channel rope tail, 128-wide indexer keys, a
# 128-token window), which the GPU kernels' tiles assume, at a small hidden size and expert count
_KTINY_OVERRIDES: dict[str, Any] = {
    "hidden_size": 256,
    "num_attention_heads": 8,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 128,
    "sliding_window": 128,
    "index_n_heads": 16,
    "index_head_dim": 128,
    "index_topk": 64,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 128,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 65536,
}

# What V4-Flash-0731 adds to the preview config (docs/MODEL.md §16.1): three DSpark stages
# after the last main layer (num_nextn_predict_layers stays 1); V4-Pro-0813's block is the same with
# target layers 58-60 and Markov rank 512
_FLASH_0731_OVERRIDES: dict[str, Any] = {
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0, 0, 0],
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [40, 41, 42],
    "dspark_markov_rank": 256,
}
# The tiny DSpark presets: the drafter of the release at tiny size. The noise token is "</think>", as
# 128799 is in the released tokenizer; the Markov ranks keep Pro's at twice Flash's.
_TINY_0731_OVERRIDES: dict[str, Any] = {
    **_FLASH_0731_OVERRIDES,
    "compress_ratios": [0, 4, 128, 4] + [0, 0, 0],
    "dspark_noise_token_id": 5,
    "dspark_target_layer_ids": [1, 2, 3],
    "dspark_markov_rank": 8,
}
_TINY_PRO_0813_OVERRIDES: dict[str, Any] = {
    **_TINY_0731_OVERRIDES,
    "compress_ratios": [128, 128, 4, 128, 4] + [0, 0, 0],
    "dspark_target_layer_ids": [2, 3, 4],
    "dspark_markov_rank": 16,
}

# DeepSeek-V4-Flash-Vision-Exp's additions (docs/VISION.md §1)
_VISION: dict[str, Any] = {
    "vision_n_layers": 32,
    "vision_dim": 1024,
    "vision_n_heads": 16,
    "vision_inter_dim": 2816,
    "vision_patch_size": 14,
    "vision_rope_theta": 10000.0,
    "vision_downsample_ratio": 3,
    "vision_max_n_token": 384,
    "vision_min_pixels": 147456,
    "vision_max_wh_ratio": 8,
    "rms_norm_eps": 1e-20,
}

# A tower of tiny widths; the patch, merge and token-budget arithmetic stay the real ones. The vocabulary is
# the real size: the image sentinels are the tokenizer's reserved ids 129257..129261.
_TINY_VISION_OVERRIDES: dict[str, Any] = {
    **_VISION,
    "vocab_size": 129280,
    "vision_n_layers": 2,
    "vision_dim": 32,
    "vision_n_heads": 2,
    "vision_inter_dim": 48,
}

# Each preset as its overrides of the released V4-Flash config (tiny-pro's and ktiny's on top of tiny's)
_PRESET_OVERRIDES: dict[str, dict[str, Any]] = {
    "tiny": _TINY_OVERRIDES,
    "tiny-pro": {**_TINY_OVERRIDES, **_TINY_PRO_OVERRIDES},
    "ktiny": {**_TINY_OVERRIDES, **_KTINY_OVERRIDES},
    "flash": {},
    "tiny-base": _TINY_OVERRIDES,
    "flash-base": {},
    "tiny-0731": {**_TINY_OVERRIDES, **_TINY_0731_OVERRIDES},
    "tiny-pro-0813": {**_TINY_OVERRIDES, **_TINY_PRO_OVERRIDES, **_TINY_PRO_0813_OVERRIDES},
    "flash-0731": _FLASH_0731_OVERRIDES,
    "tiny-vision": {**_TINY_OVERRIDES, **_TINY_0731_OVERRIDES, **_TINY_VISION_OVERRIDES},
    "flash-vision": {**_FLASH_0731_OVERRIDES, **_VISION},
}
PRESETS = tuple(_PRESET_OVERRIDES)
# The routed experts' format of the quantized variant (V4-Flash-Base: FP8); every other preset: MXFP4
_EXPERT_DTYPE = {"tiny-base": "fp8", "flash-base": "fp8"}

# Inert official keys (§1.1), present in the released config.json files.
_INERT = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}


def _truncate_layers(raw: dict[str, Any], num_layers: int) -> None:
    """Keep the first ``num_layers`` main-layer ratios (repeating the C4/C128 pattern if more are
    asked for), re-append the draft's ratios, cap ``num_hash_layers``, and keep DSpark's target layers
    as far from the last layer as they were."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    old = raw["num_hidden_layers"]
    main, mtp = list(raw["compress_ratios"][:old]), list(raw["compress_ratios"][old:])
    while len(main) < num_layers:
        main.append(4 if main[-1] == 128 else 128)
    raw["compress_ratios"] = main[:num_layers] + mtp
    raw["num_hidden_layers"] = num_layers
    raw["num_hash_layers"] = min(raw["num_hash_layers"], num_layers)
    if "dspark_target_layer_ids" in raw:
        targets = [i - old + num_layers for i in raw["dspark_target_layer_ids"]]
        if min(targets) < 0:
            raise ValueError(f"{num_layers} layers cannot hold the DSpark target layers {raw['dspark_target_layer_ids']}")
        raw["dspark_target_layer_ids"] = targets


def make_config(preset: str, *, quantized: bool = True, num_layers: int | None = None,
                vision_layers: int | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json dict (official key style) of a preset, with ``overrides`` (tests: e.g. a 32-token
    vocabulary, where sampled distributions can be counted); ``vision_layers``: ViT blocks of a vision preset."""
    if preset not in _PRESET_OVERRIDES:
        raise ValueError(f"unknown preset {preset!r}; choose from {PRESETS}")
    raw = json.loads(json.dumps({**_FLASH, **_PRESET_OVERRIDES[preset], **(overrides or {})}))  # a deep copy
    if preset.startswith("flash") and num_layers is None:
        num_layers = 6
    if vision_layers is not None:
        if "vision_n_layers" not in raw or vision_layers < 1:
            raise ValueError(f"--vision-layers {vision_layers}: needs a vision preset and at least 1 layer")
        raw["vision_n_layers"] = vision_layers
    if num_layers is not None and num_layers != raw["num_hidden_layers"]:
        _truncate_layers(raw, num_layers)
    raw.update(_INERT)
    if quantized:
        raw["expert_dtype"] = _EXPERT_DTYPE.get(preset, "fp4")
        raw["quantization_config"] = dict(QUANTIZATION_CONFIG)
    return raw


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def _generator(seed: int, name: str, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device).manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63))


def _randn(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    # bf16 sampling is ~2x cheaper than fp32 for the expert-sized tensors; returns float32.
    return torch.randn(shape, generator=g, dtype=torch.bfloat16, device=g.device).float()


def master_weight(name: str, shape: tuple[int, ...], cfg: Dsv4Config, seed: int, device: str = "cpu") -> torch.Tensor:
    """The float32 master value of parameter ``name`` (logical, unquantized shape).

    Scaled so activations stay O(1): linears N(0, 1/fan_in), norms 1 + N(0, 0.1^2), and every
    parameter that defaults to zero (sinks, ape, gate.bias, hc base) gets O(1) random values.
    """
    g = _generator(seed, name, device)
    last = name.rsplit(".", 1)[-1]
    if name == "embed.weight" or name in ckpt_table.SENTINEL_EMBEDDINGS:
        return _randn(g, shape)
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
        return 1.0 + 0.1 * _randn(g, shape)
    if last.endswith("_fn"):  # hc_{attn,ffn}_fn, hc_head_fn: mix logits mu ~ N(0, 1)
        return _randn(g, shape) / math.sqrt(shape[1])
    if last.endswith("_base"):
        return 0.5 * _randn(g, shape)
    if last.endswith("_scale") and last.startswith("hc_"):
        return 0.5 + torch.rand(shape, generator=g, device=g.device)
    if last == "attn_sink":
        return _randn(g, shape)
    if last == "ape":
        return 0.5 * _randn(g, shape)
    if name.endswith("gate.bias"):
        return 0.25 * _randn(g, shape)
    if last == "bias_vl":  # larger than gate.bias: image tokens then pick visibly different experts
        return _randn(g, shape)
    if last == "bias":  # the vision tower's and aligner's linears
        return 0.1 * _randn(g, shape)
    if len(shape) == 2 and last == "weight":  # every linear (incl. head, gate, compressor)
        return _randn(g, shape) / math.sqrt(shape[1])
    raise KeyError(f"no init rule for {name} {shape}")


def random_tid2eid(vocab: int, n_experts: int, k: int, g: torch.Generator) -> torch.Tensor:
    """[vocab, k] int64, each row k distinct experts."""
    return torch.rand(vocab, n_experts, generator=g).argsort(dim=1)[:, :k].contiguous()


def _materialise(
    name: str,
    logical: ckpt_table.TensorSpec,
    stored: dict[str, ckpt_table.TensorSpec],
    cfg: Dsv4Config,
    quantized: bool,
    seed: int,
    device: str = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the stored tensor(s) of one logical parameter: (name, value) [+ (scale name, scale)].

    ``stored`` is the quantized variant's table; it decides the quantization format, and
    ``quantized`` decides whether to keep the codes or store their exact bf16 dequantization.
    Values are drawn and quantised on ``device`` (a GPU makes V4-Flash-sized layers fast; its random
    stream differs from the CPU's) and yielded on the CPU.
    """
    for stored_name, value in _stored_values(name, logical, stored, cfg, quantized, seed, device):
        yield stored_name, value.cpu()


def _stored_values(name, logical, stored, cfg, quantized, seed, device):
    spec = stored[name]
    if logical.dtype == torch.int64:  # tid2eid
        yield name, random_tid2eid(cfg.vocab_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                                   _generator(seed, name))
        return
    w = master_weight(name, logical.shape, cfg, seed, device)
    if spec.dtype == torch.float8_e4m3fn:
        q, s = quant_fp8_block(w)
        if quantized:
            yield name, q
            scale_dtype = stored[ckpt_table.scale_name(name)].dtype  # e8m0, or float32 (Base)
            yield ckpt_table.scale_name(name), e8m0_to_float32(s) if scale_dtype == torch.float32 else s
        else:
            yield name, dequant_fp8_block(q, s).to(torch.bfloat16)
    elif spec.dtype == torch.int8:
        q, s = quant_mxfp4(w)
        if quantized:
            yield name, q
            yield ckpt_table.scale_name(name), s
        else:
            yield name, dequant_mxfp4(q, s).to(torch.bfloat16)
    else:
        yield name, w.to(spec.dtype).contiguous()


class _ShardWriter:
    """Writes one group's tensors into files of at most MAX_SHARD_BYTES; records the weight map."""

    def __init__(self, out: Path, weight_map: dict[str, str]):
        self.out, self.weight_map = out, weight_map
        self.files: list[str] = []
        self.total_bytes = 0

    def write_group(self, group: str, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        part, buf, size = 0, {}, 0

        def flush() -> None:
            nonlocal part, buf, size
            if not buf:
                return
            fname = f"model-{group}-{part:03d}.safetensors"
            save_file(buf, str(self.out / fname), metadata={"format": "pt"})
            (self.out / fname).chmod(0o644)
            for n in buf:
                self.weight_map[n] = fname
            self.files.append(fname)
            self.total_bytes += size
            part, buf, size = part + 1, {}, 0

        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            if buf and size + nbytes > MAX_SHARD_BYTES:
                flush()
            buf[name] = t.contiguous()
            size += nbytes
        flush()


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

# Copied from vLLM's vllm/tokenizers/deepseek_v4_encoding.py (full-width "｜" U+FF5C, "▁" U+2581).
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,  # 0
    EOS_TOKEN,  # 1
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜latest_reminder｜>",
    "｜DSML｜",  # the encoder emits "<｜DSML｜tool_calls>", "</｜DSML｜invoke>", ...
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
    "<｜▁pad▁｜>",
)
# Control tokens hidden by skip_special_tokens; the others must stay visible in decoded text
# (reasoning / tool parsers look for </think> and ｜DSML｜ in the text).
_HIDDEN = {BOS_TOKEN, EOS_TOKEN, "<｜▁pad▁｜>"}

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small language model is trained on a few
paragraphs of plain English so that the tokenizer has real merges for common words, spaces,
digits and punctuation. This text is not meant to teach anything; it only gives the byte pair
encoder enough material to learn useful pieces such as "the", "ing", "tion" and " and".

In the beginning there was a river that ran through a quiet valley. People built houses along
its banks, planted fields of wheat and barley, and learned to read the seasons from the colour
of the water. When the spring floods came they moved to the hills, and when the summer was dry
they dug wells and shared what they had. Over many years the village grew into a town, and the
town into a city with markets, schools, libraries and a harbour full of ships.

Mathematics is the study of numbers, shapes and patterns. If you add 2 and 3 you get 5; if you
multiply 12 by 12 you get 144. A triangle has three sides, a square has four, and a circle has
none. The answer to the question is 42, said the computer, after thinking for a very long time.
Question: what is 7 times 8? Answer: 56. Question: how many days are in a week? Answer: 7.

You are a helpful assistant. Please answer the user's question clearly and briefly. Let me think
about this step by step. First, I will read the problem carefully. Then I will write the answer.
The weather today is sunny with a light breeze, and the temperature will reach 21 degrees.
def add(a, b):
    return a + b
print("hello, world!")  # {"name": "get_weather", "arguments": {"city": "Paris"}}
"""


def build_tokenizer(vocab_size: int, model_max_length: int):
    """A byte-level BPE (``tokenizers.Tokenizer``) with the DeepSeek special tokens at fixed ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(t, special=t in _HIDDEN, normalized=False, single_word=False, lstrip=False, rstrip=False)
        for t in SPECIAL_TOKENS
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, 0)],
    )
    # The trainer registers all its special tokens as "special"; un-flag the visible markers so
    # decode(skip_special_tokens=True) keeps them (ids and single-token matching are unchanged).
    data = json.loads(tok.to_str())
    for entry in data["added_tokens"]:
        entry["special"] = entry["content"] in _HIDDEN
    tok = Tokenizer.from_str(json.dumps(data, ensure_ascii=False))
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    assert tok.get_vocab_size() <= vocab_size
    return tok


# A byte-level BPE needs its 256 bytes and the special tokens; a smaller vocabulary gets no tokenizer (run it
# with skip_tokenizer_init)
MIN_TOKENIZER_VOCAB = 512


def with_image_tokens(tok):
    """``tok`` with the image placeholder and the five sentinel tokens at the real tokenizer's ids: the
    reserved ids up to 129257 fill the BPE vocabulary (unreachable, no merges lead to them)."""
    from tokenizers import Tokenizer

    from vllm_dsv4.vision.layout import IMAGE_PLACEHOLDER, SENTINEL_BASE_ID, SENTINEL_TOKENS

    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for i in range(len(vocab), SENTINEL_BASE_ID):
        vocab[f"<｜reserved_{i}｜>"] = i
    for i, name in enumerate(SENTINEL_TOKENS + (IMAGE_PLACEHOLDER,)):
        vocab[name] = SENTINEL_BASE_ID + i
        data["added_tokens"].append({"id": SENTINEL_BASE_ID + i, "content": name, "single_word": False,
                                     "lstrip": False, "rstrip": False, "normalized": False,
                                     "special": name != IMAGE_PLACEHOLDER})
    tok = Tokenizer.from_str(json.dumps(data, ensure_ascii=False))
    assert [tok.token_to_id(t) for t in SENTINEL_TOKENS] == list(range(SENTINEL_BASE_ID, SENTINEL_BASE_ID + 5))
    return tok


def write_tokenizer(out: Path, vocab_size: int, model_max_length: int, image_tokens: bool = False) -> None:
    tok = build_tokenizer(min(vocab_size, 1024), model_max_length)
    if image_tokens:
        tok = with_image_tokens(tok)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": "<｜▁pad▁｜>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "legacy": True,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def make_checkpoint(
    out_dir: str | Path,
    preset: str,
    *,
    quantized: bool = True,
    seed: int = 0,
    num_layers: int | None = None,
    vision_layers: int | None = None,
    log: Callable[[str], None] | None = None,
    device: str = "cpu",
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write config.json, shards, index, tokenizer and generation_config to ``out_dir`` (``overrides``: config
    keys over the preset's)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        stale.unlink()

    sizes = dict(num_layers=num_layers, vision_layers=vision_layers, overrides=overrides)
    raw = make_config(preset, quantized=quantized, **sizes)
    raw_q = make_config(preset, quantized=True, **sizes)
    raw_u = make_config(preset, quantized=False, **sizes)
    cfg = Dsv4Config.from_dict(raw)
    cfg_q, cfg_u = Dsv4Config.from_dict(raw_q), Dsv4Config.from_dict(raw_u)

    groups: list[tuple[str, Callable[[Dsv4Config], dict]]] = [("top", ckpt_table.top_level_tensors)]
    if cfg.vision:
        groups.append(("vision", ckpt_table.vision_tensors))
    groups += [(f"layer{i:03d}", lambda c, i=i: ckpt_table.layer_tensors(c, i)) for i in range(cfg.num_hidden_layers)]
    groups += [(f"mtp{k}", lambda c, k=k: ckpt_table.draft_tensors(c, k)) for k in range(cfg.draft_layers)]

    weight_map: dict[str, str] = {}
    writer = _ShardWriter(out, weight_map)
    t0 = time.time()
    for group, table in groups:
        logical, stored = table(cfg_u), table(cfg_q)

        def tensors(logical=logical, stored=stored):
            for name, spec in logical.items():
                yield from _materialise(name, spec, stored, cfg, quantized, seed, device)

        writer.write_group(group, tensors())
        if log:
            log(f"{group}: done ({time.time() - t0:.1f}s, {writer.total_bytes / 2**30:.2f} GiB so far)")

    index = {"metadata": {"total_size": writer.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / ckpt_table.INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 1.0, "top_p": 1.0},
                   indent=2) + "\n"
    )
    if cfg.vocab_size >= MIN_TOKENIZER_VOCAB:
        write_tokenizer(out, cfg.vocab_size, cfg.max_position_embeddings, image_tokens=cfg.vision is not None)

    # Self-check against the single table (reads headers only).
    ckpt_table.validate(Dsv4Config.from_pretrained(out), ckpt_table.Checkpoint(out))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=PRESETS, required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--unquantized", action="store_true",
                    help="store bf16 (dequantized) weights, no quantization_config")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-layers", type=int, default=None, help="main layers (flash, flash-base default: 6)")
    ap.add_argument("--vision-layers", type=int, default=None, help="ViT blocks of a vision preset")
    ap.add_argument("--device", default="cpu", help="draw and quantise there, e.g. cuda (different values)")
    args = ap.parse_args(argv)
    t = time.time()
    path = make_checkpoint(args.out, args.preset, quantized=not args.unquantized, seed=args.seed,
                           num_layers=args.num_layers, vision_layers=args.vision_layers,
                           log=lambda s: print(s, flush=True), device=args.device)
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    print(f"wrote {path} ({size / 2**30:.3f} GiB) in {time.time() - t:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
