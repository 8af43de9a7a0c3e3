"""The official DeepSeek-V4 checkpoint format: one table of every tensor name, shape and dtype.

``expected_tensors(cfg)`` is the single source of truth (docs/MODEL.md §8.1) for the
loader, the validator and the test-checkpoint maker (scripts/make_checkpoint.py).

Dtypes:
* FP8 linears (``wq_a wq_b wkv wo_a wo_b indexer.wq_b shared_experts.* mtp e_proj/h_proj``):
  ``float8_e4m3fn`` + ``<name>.scale`` [ceil(out/128), ceil(in/128)], ``float8_e8m0fnu`` or float32
  powers of two as the checkpoint's kind says (``kinds.py``: V4-Flash-Base has float32).
* routed experts: MXFP4 int8 [out, in/2] + ``.scale`` e8m0 [out, in/32] (``expert_dtype == "fp4"``)
  or FP8 block like the linears (``"fp8"``).
* unquantized config (no ``quantization_config``): all of the above are bf16, no ``.scale``.
* bf16: embed, head, norms, ``gate.weight``, compressor / indexer-compressor wkv/wgate,
  ``indexer.weights_proj``. fp32: ``attn_sink``, ``ape``, ``gate.bias``, ``hc_*``.
  int64: ``gate.tid2eid`` [vocab, num_experts_per_tok].
* Vision checkpoints add the tower, aligner and sentinel embeddings (bf16, ``vision_tensors``) and, on
  every MoE layer, ``gate.bias_vl`` (fp32; on hash layers with an unused ``gate.bias``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from csrc_triton.formats import FP8_BLOCK, MXFP4_BLOCK
from vllm_dsv4.config import DSparkConfig, Dsv4Config, LayerKind
from vllm_dsv4.loader.kinds import kind_of, kind_problem

MAX_REPORTED_PROBLEMS = 10

INDEX_FILE = "model.safetensors.index.json"
# The learned embeddings of the image sentinel tokens other than IMAGE (whose rows the aligner gives)
SENTINEL_EMBEDDINGS = ("image_start", "image_pad", "image_newline", "image_end")
SINGLE_FILE = "model.safetensors"

# safetensors header dtype strings -> torch dtypes.
_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """The checkpoint directory does not hold the tensors the config describes."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{self.shape} {_dtype_name(self.dtype)}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------


def scale_name(weight_name: str) -> str:
    """``a.b.weight`` -> ``a.b.scale`` (the block-scale companion of a quantized weight)."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"{weight_name!r} does not end in '.weight'")
    return weight_name[: -len(".weight")] + ".scale"


def fp8_scale_dtype(cfg: Dsv4Config) -> torch.dtype:
    """The FP8 block scales' dtype of a quantized checkpoint's kind: e8m0, or float32 (V4-Flash-Base)."""
    return kind_of(cfg).scale


class _Table:
    """Accumulates name -> TensorSpec with helpers per storage format."""

    def __init__(self, cfg: Dsv4Config):
        self.cfg = cfg
        self.specs: dict[str, TensorSpec] = {}

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        assert name not in self.specs, name
        self.specs[name] = TensorSpec(tuple(int(s) for s in shape), dtype)

    def bf16(self, name: str, *shape: int) -> None:
        self.add(name, shape, torch.bfloat16)

    def fp32(self, name: str, *shape: int) -> None:
        self.add(name, shape, torch.float32)

    def fp8_linear(self, name: str, out: int, inp: int) -> None:
        """``name`` ends in .weight; FP8 block-128 when quantized, else bf16."""
        if not self.cfg.quantized:
            self.bf16(name, out, inp)
            return
        self.add(name, (out, inp), torch.float8_e4m3fn)
        self.add(scale_name(name), (math.ceil(out / FP8_BLOCK), math.ceil(inp / FP8_BLOCK)), fp8_scale_dtype(self.cfg))

    def expert_linear(self, name: str, out: int, inp: int) -> None:
        if not self.cfg.quantized:
            self.bf16(name, out, inp)
        elif self.cfg.mxfp4_experts:
            self.add(name, (out, inp // 2), torch.int8)
            self.add(scale_name(name), (out, inp // MXFP4_BLOCK), torch.float8_e8m0fnu)
        else:
            self.fp8_linear(name, out, inp)


def _hc(t: _Table, prefix: str) -> None:
    """mHC params of one sub-layer: fn [(2+n)n, nD], base [(2+n)n], scale [3] (fp32)."""
    cfg = t.cfg
    n, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
    t.fp32(f"{prefix}_fn", mix, n * cfg.hidden_size)
    t.fp32(f"{prefix}_base", mix)
    t.fp32(f"{prefix}_scale", 3)


def _hc_head(t: _Table, prefix: str) -> None:
    cfg = t.cfg
    n = cfg.hc_mult
    t.fp32(f"{prefix}hc_head_fn", n, n * cfg.hidden_size)
    t.fp32(f"{prefix}hc_head_base", n)
    t.fp32(f"{prefix}hc_head_scale", 1)


def _compressor(t: _Table, prefix: str, kind: LayerKind, head_dim: int) -> None:
    """wkv/wgate [c*hd, D] bf16, ape [ratio, c*hd] fp32, norm [hd] bf16; c = ``kind.overlap``."""
    d = t.cfg.hidden_size
    width = kind.overlap * head_dim
    t.bf16(f"{prefix}.wkv.weight", width, d)
    t.bf16(f"{prefix}.wgate.weight", width, d)
    t.fp32(f"{prefix}.ape", kind.ratio, width)
    t.bf16(f"{prefix}.norm.weight", head_dim)


def _block(t: _Table, p: str, kind: LayerKind, hash_routed: bool) -> None:
    """One transformer block (main layer or the MTP block) under prefix ``p`` (ends with '.')."""
    cfg = t.cfg
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    t.bf16(f"{p}attn_norm.weight", d)
    t.bf16(f"{p}ffn_norm.weight", d)
    _hc(t, f"{p}hc_attn")
    _hc(t, f"{p}hc_ffn")

    a = f"{p}attn."
    t.fp8_linear(f"{a}wq_a.weight", cfg.q_lora_rank, d)
    t.bf16(f"{a}q_norm.weight", cfg.q_lora_rank)
    t.fp8_linear(f"{a}wq_b.weight", h * hd, cfg.q_lora_rank)
    t.fp8_linear(f"{a}wkv.weight", hd, d)
    t.bf16(f"{a}kv_norm.weight", hd)
    t.fp8_linear(f"{a}wo_a.weight", cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups)
    t.fp8_linear(f"{a}wo_b.weight", d, cfg.o_groups * cfg.o_lora_rank)
    t.fp32(f"{a}attn_sink", h)
    if kind is not LayerKind.SWA:
        _compressor(t, f"{a}compressor", kind, hd)
    if kind is LayerKind.C4:
        ihd, ih = cfg.index_head_dim, cfg.index_n_heads
        t.fp8_linear(f"{a}indexer.wq_b.weight", ih * ihd, cfg.q_lora_rank)
        t.bf16(f"{a}indexer.weights_proj.weight", ih, d)
        _compressor(t, f"{a}indexer.compressor", LayerKind.C4, ihd)

    f = f"{p}ffn."
    e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    t.bf16(f"{f}gate.weight", e, d)
    if hash_routed:
        t.add(f"{f}gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), torch.int64)
    if not hash_routed or cfg.vision:  # Vision checkpoints ship an (unused) bias on hash layers too
        t.fp32(f"{f}gate.bias", e)
    if cfg.vision:
        t.fp32(f"{f}gate.bias_vl", e)  # the routing bias of image sentinel tokens
    for j in range(e):
        t.expert_linear(f"{f}experts.{j}.w1.weight", inter, d)
        t.expert_linear(f"{f}experts.{j}.w2.weight", d, inter)
        t.expert_linear(f"{f}experts.{j}.w3.weight", inter, d)
    t.fp8_linear(f"{f}shared_experts.w1.weight", inter, d)
    t.fp8_linear(f"{f}shared_experts.w2.weight", d, inter)
    t.fp8_linear(f"{f}shared_experts.w3.weight", inter, d)


def top_level_tensors(cfg: Dsv4Config) -> dict[str, TensorSpec]:
    """embed, head, final norm and the head mixer (no ``layers.`` / ``mtp.`` prefix)."""
    t = _Table(cfg)
    t.bf16("embed.weight", cfg.vocab_size, cfg.hidden_size)
    t.bf16("head.weight", cfg.vocab_size, cfg.hidden_size)
    t.bf16("norm.weight", cfg.hidden_size)
    _hc_head(t, "")
    return t.specs


def layer_tensors(cfg: Dsv4Config, layer: int) -> dict[str, TensorSpec]:
    """Tensors of main layer ``layer`` (``layers.N.*``)."""
    if not 0 <= layer < cfg.num_hidden_layers:
        raise IndexError(f"layer {layer} out of range [0, {cfg.num_hidden_layers})")
    t = _Table(cfg)
    _block(t, f"layers.{layer}.", cfg.layer_kind(layer), hash_routed=layer < cfg.num_hash_layers)
    return t.specs


def mtp_tensors(cfg: Dsv4Config, k: int) -> dict[str, TensorSpec]:
    """Tensors of MTP module ``k`` (``mtp.k.*``): fusion, head mixer and a score-routed block.

    Its attention type is ``compress_ratios[num_hidden_layers + k]`` (0, SWA-only, in every
    released config).
    """
    if not 0 <= k < cfg.num_nextn_predict_layers:
        raise IndexError(f"MTP module {k} out of range [0, {cfg.num_nextn_predict_layers})")
    t = _Table(cfg)
    p, d = f"mtp.{k}.", cfg.hidden_size
    t.fp8_linear(f"{p}e_proj.weight", d, d)
    t.fp8_linear(f"{p}h_proj.weight", d, d)
    t.bf16(f"{p}enorm.weight", d)
    t.bf16(f"{p}hnorm.weight", d)
    t.bf16(f"{p}norm.weight", d)
    _hc_head(t, p)
    _block(t, p, cfg.layer_kind(cfg.num_hidden_layers + k), hash_routed=False)
    return t.specs


def dspark_stage_tensors(cfg: Dsv4Config, s: int) -> dict[str, TensorSpec]:
    """Tensors of DSpark stage ``s`` (``mtp.s.*``, §16.2): a sliding-window, score-routed block;
    stage 0 also fuses the target features (``main_proj`` over one hidden per target layer, ``main_norm``),
    the last stage holds the heads (``norm``, ``hc_head_*``, the Markov factors and the confidence head)."""
    dspark = cfg.dspark
    if dspark is None or not 0 <= s < dspark.num_stages:
        raise IndexError(f"DSpark stage {s} out of range for this config")
    t = _Table(cfg)
    p, d, r = f"mtp.{s}.", cfg.hidden_size, dspark.markov_rank
    _block(t, p, cfg.layer_kind(cfg.num_hidden_layers + s), hash_routed=False)
    if s == 0:
        t.fp8_linear(f"{p}main_proj.weight", d, dspark.num_stages * d)
        t.bf16(f"{p}main_norm.weight", d)
    if s == dspark.num_stages - 1:
        t.bf16(f"{p}norm.weight", d)
        _hc_head(t, p)
        t.bf16(f"{p}markov_head.markov_w1.weight", cfg.vocab_size, r)
        t.bf16(f"{p}markov_head.markov_w2.weight", cfg.vocab_size, r)
        t.bf16(f"{p}confidence_head.proj.weight", 1, d + r)
    return t.specs


def draft_tensors(cfg: Dsv4Config, k: int) -> dict[str, TensorSpec]:
    """Tensors of draft block ``k`` (``mtp.k.*``): a DSpark stage or an MTP module, as the config says."""
    return dspark_stage_tensors(cfg, k) if cfg.dspark else mtp_tensors(cfg, k)


def vision_tensors(cfg: Dsv4Config) -> dict[str, TensorSpec]:
    """The vision tower (``vision.*``), the aligner and the four learned sentinel embeddings, all bf16;
    none for a text-only checkpoint."""
    v, t = cfg.vision, _Table(cfg)
    if v is None:
        return t.specs
    t.bf16("vision.patch_embed.proj.weight", v.dim, 3 * v.patch_size**2)
    t.bf16("vision.patch_embed.proj.bias", v.dim)
    for i in range(v.n_layers):
        p = f"vision.blocks.{i}."
        t.bf16(f"{p}norm1.weight", v.dim)
        t.bf16(f"{p}attn.wqkv.weight", 3 * v.dim, v.dim)
        t.bf16(f"{p}attn.wqkv.bias", 3 * v.dim)
        t.bf16(f"{p}attn.wo.weight", v.dim, v.dim)
        t.bf16(f"{p}attn.wo.bias", v.dim)
        t.bf16(f"{p}norm2.weight", v.dim)
        t.bf16(f"{p}mlp.w1.weight", 2 * v.inter_dim, v.dim)
        t.bf16(f"{p}mlp.w2.weight", v.dim, v.inter_dim)
    t.bf16("vision.norm.weight", v.dim)
    t.bf16("aligner.w1.weight", cfg.hidden_size, v.dim * v.downsample_ratio**2)
    t.bf16("aligner.w1.bias", cfg.hidden_size)
    t.bf16("aligner.w2.weight", cfg.hidden_size, cfg.hidden_size)
    t.bf16("aligner.w2.bias", cfg.hidden_size)
    for name in SENTINEL_EMBEDDINGS:
        t.bf16(name, cfg.hidden_size)
    return t.specs


def expected_tensors(cfg: Dsv4Config) -> dict[str, TensorSpec]:
    """Every tensor of the official checkpoint, name -> (shape, dtype)."""
    specs = dict(top_level_tensors(cfg))
    specs.update(vision_tensors(cfg))
    for layer in range(cfg.num_hidden_layers):
        specs.update(layer_tensors(cfg, layer))
    for k in range(cfg.draft_layers):
        specs.update(draft_tensors(cfg, k))
    return specs


# Tensors only an MTP module has (§7), and only DSpark stages have (§16.2, §16.3), under ``mtp.<i>.``.
MTP_ONLY = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight")
DSPARK_ONLY = ("main_proj.weight", "main_norm.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
_DRAFT_BLOCK = re.compile(r"^mtp\.(\d+)\.(.+)$")


def draft_blocks(names: Iterable[str]) -> dict[int, set[str]]:
    """The draft blocks an index holds: block number (``mtp.<i>.``) -> the names under it, prefix stripped."""
    blocks: dict[int, set[str]] = {}
    for name in names:
        m = _DRAFT_BLOCK.match(name)
        if m:
            blocks.setdefault(int(m.group(1)), set()).add(m.group(2))
    return blocks


def holds_draft_tensors(names: Iterable[str] | None, suffixes: tuple[str, ...]) -> list[str]:
    """The draft tensors of ``names`` that end in one of ``suffixes``, sorted."""
    blocks = draft_blocks(names or ())
    return sorted(f"mtp.{i}.{rest}" for i, rests in blocks.items() for rest in rests if rest in suffixes)


def dspark_problems(dspark: DSparkConfig | None, names: Iterable[str]) -> list[str]:
    """Where config.json and the index disagree about a DSpark drafter: DSpark keys over an MTP module or
    the reverse, or an index whose stages (its distinct ``mtp.<i>.`` blocks) are not one per target layer."""
    names = list(names)
    mtp_only, dspark_only = holds_draft_tensors(names, MTP_ONLY), holds_draft_tensors(names, DSPARK_ONLY)
    if dspark is None:
        if dspark_only:
            return [f"the index holds DSpark stage tensors ({', '.join(dspark_only[:3])}) but config.json has no "
                    f"{DSparkConfig.KEYS[0]} / {DSparkConfig.KEYS[2]}"]
        return []
    problems = []
    if mtp_only:
        problems.append(f"config.json has the dspark_* keys of a DSpark drafter but the index holds MTP module "
                        f"tensors ({', '.join(mtp_only[:3])})")
    stages = sorted(draft_blocks(names))
    if stages != list(range(dspark.num_stages)):
        problems.append(f"the index holds draft stages {['mtp.%d' % i for i in stages]}, but "
                        f"dspark_target_layer_ids names {dspark.num_stages} target layers "
                        f"(one stage mtp.0 .. mtp.{dspark.num_stages - 1} each)")
    return problems


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (no tensor data is read)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or n > 100 * 2**20:
                raise CheckpointError(f"{path.name}: not a safetensors file (header length {n})")
            header = json.loads(f.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path.name}: cannot read safetensors header ({e})") from e
    header.pop("__metadata__", None)
    return header


class Checkpoint:
    """A directory of safetensors shards (with ``model.safetensors.index.json``) or one file.

    Listing names, shapes and dtypes reads only the shard headers; ``get`` loads one tensor.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory")
        index = self.path / INDEX_FILE
        if index.exists():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{INDEX_FILE}: no valid 'weight_map' ({e})") from e
        elif (self.path / SINGLE_FILE).exists():
            weight_map = None  # type: ignore[assignment]
        else:
            raise CheckpointError(f"{self.path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")

        shards = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
        self._file_of: dict[str, str] = {}
        self._specs: dict[str, TensorSpec] = {}
        for shard in shards:
            shard_path = self.path / shard
            if not shard_path.exists():
                raise CheckpointError(f"{INDEX_FILE} references missing shard {shard}")
            for name, info in _read_header(shard_path).items():
                if weight_map is not None and weight_map.get(name) != shard:
                    continue  # not indexed here: invisible to index-driven loaders
                dtype = _ST_DTYPES.get(info["dtype"])
                if dtype is None:
                    raise CheckpointError(f"{name}: unsupported safetensors dtype {info['dtype']} in {shard}")
                self._file_of[name] = shard
                self._specs[name] = TensorSpec(tuple(info["shape"]), dtype)
        if weight_map is not None:
            lost = sorted(n for n in weight_map if n not in self._specs)
            if lost:
                more = f" (and {len(lost) - 5} more)" if len(lost) > 5 else ""
                raise CheckpointError(
                    f"{INDEX_FILE} lists tensors absent from their shard: "
                    + ", ".join(f"{n} -> {weight_map[n]}" for n in lost[:5])
                    + more
                )
        self._handles: dict[str, object] = {}

    def names(self) -> list[str]:
        return sorted(self._specs)

    def __contains__(self, name: str) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._specs)

    def spec(self, name: str) -> TensorSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise CheckpointError(f"{name}: not in checkpoint {self.path}") from None

    def specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    def shard_of(self, name: str) -> str:
        self.spec(name)
        return self._file_of[name]

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        shard = self.shard_of(name)
        handle = self._handles.get(shard)
        if handle is None:
            handle = safe_open(str(self.path / shard), framework="pt", device="cpu")
            self._handles[shard] = handle
        return handle.get_tensor(name)  # type: ignore[attr-defined]

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _problems(cfg: Dsv4Config, found: dict[str, TensorSpec]) -> list[str]:
    want = expected_tensors(cfg)
    problems: list[str] = dspark_problems(cfg.dspark, found)
    scale_owner = {}
    for name, spec in want.items():
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in want:
            scale_owner[name] = name[: -len(".scale")] + ".weight"

    for name, spec in want.items():
        got = found.get(name)
        if got is None:
            owner = scale_owner.get(name)
            if owner is not None:
                problems.append(
                    f"{name}: missing block scale of quantized weight {owner} "
                    f"(expected {spec})"
                )
            else:
                problems.append(f"{name}: missing (expected {spec})")
        elif got != spec:
            what = "shape" if got.shape != spec.shape and got.dtype == spec.dtype else (
                "dtype" if got.shape == spec.shape else "shape and dtype")
            hint = ""
            quant_dtypes = (torch.float8_e4m3fn, torch.int8)
            if got.dtype in quant_dtypes and not cfg.quantized:
                hint = " (quantized weight, but config.json has no quantization_config)"
            elif got.dtype == torch.bfloat16 and spec.dtype in quant_dtypes and cfg.quantized:
                hint = " (unquantized weight, but config.json has a quantization_config)"
            elif ".experts." in name and {got.dtype, spec.dtype} == set(quant_dtypes):
                hint = f" (config.json expert_dtype is {cfg.expert_dtype!r})"
            problems.append(f"{name}: expected {what} {spec}, found {got}{hint}")

    for name in sorted(set(found) - set(want)):
        hint = ""
        if name.endswith(".scale") and not cfg.quantized:
            hint = "; config.json has no quantization_config"
        elif name.startswith(("layers.", "mtp.")):
            hint = ("; check num_hidden_layers / num_nextn_predict_layers / dspark_target_layer_ids / "
                    "compress_ratios / num_hash_layers")
        problems.append(f"{name}: unexpected tensor {found[name]} (not in the official layout{hint})")
    return problems


def scale_problem(name: str, scale: torch.Tensor) -> str | None:
    """The problem with a block-scale tensor: e8m0 byte 255 is NaN (every weight of its block would be);
    a float32 scale (V4-Flash-Base) must be 0 or a positive power of two, as the format stores them and
    the GPU path's FP8 GEMMs assume (vLLM's UE8M0 re-quantisation of the scales is then exact)."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        bad, what = int((scale.view(torch.uint8) == 255).sum()), "NaN"
    else:
        mantissa, _ = torch.frexp(scale.float())
        power_of_two = torch.isfinite(scale) & (scale > 0) & (mantissa == 0.5)
        bad, what = int((~(power_of_two | (scale == 0))).sum()), "not a power of two (or 0)"
    return f"{name}: {bad} of {scale.numel()} block scales are {what}" if bad else None


def expert_ids_out_of_range(name: str, ids: torch.Tensor, num_experts: int) -> str | None:
    """The problem with a hash-routing table (``gate.tid2eid``) naming an expert that does not exist:
    its ids index the experts' weights on the device, unchecked."""
    bad = int(((ids < 0) | (ids >= num_experts)).sum())
    return f"{name}: {bad} of {ids.numel()} expert ids are outside [0, {num_experts})" if bad else None


def value_problem(cfg: Dsv4Config, name: str, tensor: torch.Tensor) -> str | None:
    """What is wrong with the values of a tensor of the right name, shape and dtype; None if nothing."""
    if name.endswith(".scale"):
        return scale_problem(name, tensor)
    if name.endswith(".gate.tid2eid"):
        return expert_ids_out_of_range(name, tensor, cfg.n_routed_experts)
    return None


def validate(cfg: Dsv4Config, ckpt: Checkpoint | dict[str, TensorSpec], value_problems: Sequence[str] = ()) -> None:
    """Raise CheckpointError listing (up to 10) missing / extra / mis-shaped / mis-typed tensors, and
    ``value_problems`` found while reading them (``value_problem``); first, tensors of another checkpoint
    kind than config.json names (``kinds.kind_problem``)."""
    found = ckpt.specs() if isinstance(ckpt, Checkpoint) else dict(ckpt)
    problems = [p for p in [kind_problem(cfg, found)] if p] + _problems(cfg, found) + list(value_problems)
    if not problems:
        return
    shown = problems[:MAX_REPORTED_PROBLEMS]
    more = len(problems) - len(shown)
    where = f" in {ckpt.path}" if isinstance(ckpt, Checkpoint) else ""
    msg = f"checkpoint{where} does not match config.json ({len(problems)} problem(s)):\n  " + "\n  ".join(shown)
    if more:
        msg += f"\n  ... and {more} more"
    raise CheckpointError(msg)
