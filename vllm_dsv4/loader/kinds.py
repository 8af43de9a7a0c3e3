"""Checkpoint kinds: the release formats a DeepSeek-V4 checkpoint comes in (docs/MODEL.md §3.3).

| kind | checkpoints | routed experts | FP8 block scales | draft module |
|---|---|---|---|---|
| ``preview`` | V4-Flash, V4-Pro (April) | MXFP4: int8 [out, in/2] + e8m0 [out, in/32] | e8m0 | MTP, ``mtp.0`` |
| ``dspark`` | V4-Flash-0731, V4-Pro-0813, the -DSpark repacks | as the preview | e8m0 | DSpark, ``mtp.0 ..`` |
| ``base`` | V4-Flash-Base | FP8 e4m3 128x128 blocks, like the linears | float32 powers of two | MTP, as its config says |

``config.json`` names the kind (``expert_dtype``: ``fp4``, or absent, for the preview and DSpark releases,
``fp8`` for Base; the ``dspark_*`` keys for the DSpark releases); the tensors' formats must agree, else
``kind_problem`` says which format they are (drafts.py checks the draft against the index). A checkpoint without
``quantization_config`` (bf16, the test presets' unquantized variant) has no kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from vllm_dsv4.config import Dsv4Config


@dataclass(frozen=True)
class Kind:
    name: str
    checkpoints: str
    expert_dtype: str  # config.json's expert_dtype
    expert_weight: torch.dtype  # a routed expert's .weight
    scale: torch.dtype  # every FP8 (and MXFP4) .scale
    draft: str = "mtp"  # the draft module (drafts.py)

    def __str__(self) -> str:
        experts = "MXFP4" if self.expert_weight == torch.int8 else "FP8"
        scales = "e8m0" if self.scale == torch.float8_e8m0fnu else "float32"
        return f"{self.checkpoints} ({experts} routed experts, {scales} scales; expert_dtype {self.expert_dtype!r})"


KINDS = (
    Kind("preview", "DeepSeek-V4-Flash / V4-Pro", "fp4", torch.int8, torch.float8_e8m0fnu),
    Kind("dspark", "DeepSeek-V4-Flash-0731 / V4-Pro-0813", "fp4", torch.int8, torch.float8_e8m0fnu, "dspark"),
    Kind("base", "DeepSeek-V4-Flash-Base", "fp8", torch.float8_e4m3fn, torch.float32),
)


def kind_of(cfg: Dsv4Config) -> Kind | None:
    """The kind ``config.json`` names; None for an unquantized checkpoint."""
    if not cfg.quantized:
        return None
    draft = "dspark" if cfg.dspark else "mtp"
    return next(k for k in KINDS if (k.expert_dtype, k.draft) == (cfg.expert_dtype, draft))


def kind_of_tensors(specs: Mapping[str, object]) -> Kind | None:
    """The first kind whose formats the tensors have (``specs``: name -> TensorSpec), judged by layer 0's
    first routed expert and its scale; None when they are none of them."""
    weight, scale = specs.get("layers.0.ffn.experts.0.w1.weight"), specs.get("layers.0.ffn.experts.0.w1.scale")
    if weight is None or scale is None:
        return None
    return next((k for k in KINDS if (weight.dtype, scale.dtype) == (k.expert_weight, k.scale)), None)


def kind_problem(cfg: Dsv4Config, specs: Mapping[str, object]) -> str | None:
    """The problem when the tensors are another kind than ``config.json`` names (or None)."""
    named, found = kind_of(cfg), kind_of_tensors(specs)
    if named is None or found is None or (found.expert_weight, found.scale) == (named.expert_weight, named.scale):
        return None
    return (f"config.json describes {named}, but the tensors are {found}: set expert_dtype "
            f"{found.expert_dtype!r} in config.json")
