"""The weight-loading loop: validate each tensor against the official table, dequantise, place."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from vllm_dsv4.config import Dsv4Config
from vllm_dsv4.loader.checkpoint import CheckpointError, expected_tensors
from vllm_dsv4.loader.dequant import dequant_fp8_block, dequant_mxfp4
from vllm_dsv4.loader.names import param_target

SCALE = ".scale"


def _dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if weight.dtype == torch.float8_e4m3fn:
        return dequant_fp8_block(weight, scale)
    return dequant_mxfp4(weight, scale)


def load_official_weights(
    cfg: Dsv4Config, weights: Iterable[tuple[str, torch.Tensor]], params: dict[str, torch.nn.Parameter]
) -> set[str]:
    """Stream official (name, tensor) pairs into ``params``; returns the parameter names filled.

    ``mtp.*`` tensors are checked but left to the MTP draft model. Raises CheckpointError naming the
    tensor for anything unexpected, mis-shaped, mis-typed, unpaired with its scale, or missing.
    """
    expected = expected_tensors(cfg)
    seen: set[str] = set()
    held: dict[str, torch.Tensor] = {}  # a quantised weight or scale waiting for its partner
    loaded: set[str] = set()

    def place(name: str, tensor: torch.Tensor) -> None:
        target, expert, half = param_target(name)
        param = params.get(target)
        if param is None:
            raise CheckpointError(f"{name}: no model parameter {target!r} to load it into")
        dst = param.data
        if expert is not None:
            dst = dst[expert]
            if half is not None:
                rows = dst.shape[0] // 2
                dst = dst[half * rows : (half + 1) * rows]
        if dst.shape != tensor.shape:
            raise CheckpointError(f"{name}: expected shape {tuple(dst.shape)} for {target}, found {tuple(tensor.shape)}")
        dst.copy_(tensor.to(dst.dtype))
        loaded.add(target)

    for name, tensor in weights:
        spec = expected.get(name)
        if spec is None:
            raise CheckpointError(f"{name}: unexpected tensor (not part of this config's DeepSeek-V4 format)")
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise CheckpointError(
                f"{name}: expected shape {spec.shape} {spec.dtype}, found {tuple(tensor.shape)} {tensor.dtype}"
            )
        seen.add(name)
        if name.startswith("mtp."):
            continue
        if name.endswith(SCALE):
            weight_name = name[: -len(SCALE)] + ".weight"
            if weight_name in held:
                place(weight_name, _dequantize(held.pop(weight_name), tensor))
            else:
                held[name] = tensor
        elif name[: -len(".weight")] + SCALE in expected:
            scale_name = name[: -len(".weight")] + SCALE
            if scale_name in held:
                place(name, _dequantize(tensor, held.pop(scale_name)))
            else:
                held[name] = tensor
        else:
            place(name, tensor)

    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(f"{n} {expected[n].shape} {expected[n].dtype}" for n in missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {shown}{more}")
    return loaded
