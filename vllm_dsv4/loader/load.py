"""The weight-loading loop: place each official tensor into its parameter.

A quantised weight is dequantised unless the model holds it quantised: a parameter named
``<target>_scale`` beside ``<target>`` asks for the raw FP8 / MXFP4 bytes and their scales.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import torch

from csrc_triton.formats import FP8_BLOCK, e8m0_to_float32
from vllm_dsv4.config import Dsv4Config
from vllm_dsv4.loader.checkpoint import (
    CheckpointError, TensorSpec, expected_tensors, scale_name, validate, value_problem,
)
from vllm_dsv4.loader.dequant import dequant_fp8_block, dequant_mxfp4
from vllm_dsv4.loader.names import Target, param_target, sharded_dim
from vllm_dsv4.shard import Shard


def _dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if weight.dtype == torch.float8_e4m3fn:
        return dequant_fp8_block(weight, scale)
    return dequant_mxfp4(weight, scale)


def quantized_scale_param(target: str) -> str:
    """Name of the scale parameter that marks ``target`` as held quantised."""
    return f"{target}_scale"


def _as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Raw bytes stay bytes (MXFP4 codes, e8m0 exponents); e8m0 to float32 goes through the byte."""
    if dtype == torch.uint8 and tensor.dtype in (torch.int8, torch.float8_e8m0fnu):
        return tensor.view(torch.uint8)
    if dtype == torch.float32 and tensor.dtype == torch.float8_e8m0fnu:
        return e8m0_to_float32(tensor)
    return tensor.to(dtype)


def _member_rows(target: Target, rows: int, expected: Mapping[str, TensorSpec]) -> slice:
    """The rows of ``target.part`` within a merged parameter's ``rows`` (weight or block-scale rows,
    this rank's): the members' shares of the official rows. Tensor parallelism cuts every member
    alike, and members held in FP8 are whole 128-row blocks (model/layers.py), so the shares are
    exact in either unit."""
    sizes = [expected[member].shape[0] for member in target.members]
    before, total = sum(sizes[: target.part]), sum(sizes)
    return slice(rows * before // total, rows * (before + sizes[target.part]) // total)


def _place(name: str, tensor: torch.Tensor, params: dict[str, torch.nn.Parameter], shard: Shard,
           num_experts: int, expected: Mapping[str, TensorSpec]) -> str | None:
    """Copies this rank's part of ``tensor`` into its parameter; None if another rank owns it."""
    target = param_target(name)
    if target.param not in params:
        raise CheckpointError(f"{name}: the model has no parameter {target.param!r} for it")
    dim = sharded_dim(name)
    if dim is not None:
        tensor = shard.slice(tensor, dim)
    dst = params[target.param].data
    if target.expert is not None:
        local = shard.local_expert(target.expert, num_experts)
        if local is None:
            return None
        dst = dst[local]
    if target.part is not None:
        dst = dst[_member_rows(target, dst.shape[0], expected)]
    dst.copy_(_as_dtype(tensor, dst.dtype))
    return target.param


def _place_quantized(weight_name: str, weight: torch.Tensor, scale: torch.Tensor,
                     params: dict[str, torch.nn.Parameter], shard: Shard, num_experts: int,
                     expected: Mapping[str, TensorSpec]) -> set[str | None]:
    target = param_target(weight_name).param
    scale_target = quantized_scale_param(target)
    if scale_target not in params:
        return {_place(weight_name, _dequantize(weight, scale), params, shard, num_experts, expected)}
    # The scale follows its weight: same expert / member rows / shard, under the scale parameter's name.
    dim = sharded_dim(weight_name)
    if dim is not None and weight.dtype == torch.float8_e4m3fn:
        shard.check_blocks(weight.shape[dim], FP8_BLOCK, weight_name)
    placed = _place(weight_name, weight, params, shard, num_experts, expected)
    _place(weight_name, scale, {target: params[scale_target]}, shard, num_experts, expected)
    return {placed, placed and scale_target}


def load_official_weights(
    cfg: Dsv4Config,
    weights: Iterable[tuple[str, torch.Tensor]],
    params: dict[str, torch.nn.Parameter],
    shard: Shard = Shard(),
    mtp: bool = False,
    skip: Collection[str] = (),
) -> set[str]:
    """Stream official (name, tensor) pairs into ``params``; returns the parameter names filled.

    A tensor that does not match the official table (loader/checkpoint.py) is not placed; once the
    stream ends, ``validate`` raises one CheckpointError naming every such tensor, every missing
    one, and every block-scale or hash-routing tensor holding values the format forbids (``value_problem``). FP8 /
    MXFP4 weights are held until their ``.scale`` arrives (either order). Every tensor is checked; the main model places all but
    ``mtp.*``, the MTP draft model (``mtp``) only those (vLLM streams it the whole checkpoint). A
    merged linear (names.MERGED) and a stack of experts get each member's rows. Under tensor
    parallelism each rank keeps its slice. Tensors named in ``skip`` are checked, not placed (a Vision
    checkpoint's tower where images are off).
    """
    expected = expected_tensors(cfg)
    found: dict[str, TensorSpec] = {}
    held: dict[str, torch.Tensor] = {}  # a quantised weight or its scale, waiting for the other
    loaded: set[str] = set()
    value_problems: list[str] = []
    for name, tensor in weights:
        found[name] = TensorSpec(tuple(tensor.shape), tensor.dtype)
        if expected.get(name) != found[name]:
            continue
        if problem := value_problem(cfg, name, tensor):
            value_problems.append(problem)
        if name.startswith("mtp.") != mtp or name in skip:
            continue
        if name.endswith(".scale"):
            weight_name = name[: -len(".scale")] + ".weight"
        elif name.endswith(".weight") and scale_name(name) in expected:
            weight_name = name
        else:
            loaded.add(_place(name, tensor, params, shard, cfg.n_routed_experts, expected))
            continue
        partner = scale_name(weight_name) if name == weight_name else weight_name
        if partner not in held:
            held[name] = tensor
            continue
        weight, scale = (tensor, held.pop(partner)) if name == weight_name else (held.pop(partner), tensor)
        loaded |= _place_quantized(weight_name, weight, scale, params, shard, cfg.n_routed_experts, expected)
    validate(cfg, found, value_problems)
    return loaded - {None}
