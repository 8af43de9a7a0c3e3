"""How vLLM sees a DeepSeek-V4 checkpoint's ``quantization_config``.

The official checkpoints say ``quant_method: fp8`` (FP8 128x128 linears, MXFP4 routed experts).
vLLM would route that to its in-tree ``deepseek_v4_fp8`` layers, which our model does not use, and
which refuse fp32. This config claims the checkpoint for the plugin instead; on the CPU path the
loader dequantises at load (loader/load.py), so no layer gets a quantised method.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from vllm_dsv4.config import is_mtp_draft

NAME = "dsv4_plugin_fp8"


class Dsv4CheckpointQuantConfig(QuantizationConfig):
    def __init__(self, raw: dict[str, Any]):
        super().__init__()
        self.raw = raw

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Dsv4CheckpointQuantConfig":
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        # vLLM's "mtp" method loads the same checkpoint again as model type deepseek_mtp (the draft)
        is_dsv4 = getattr(hf_config, "model_type", None) == "deepseek_v4" or is_mtp_draft(hf_config)
        # vLLM renames the official "fp8" to "deepseek_v4_fp8" for this architecture before probing.
        official = hf_quant_cfg.get("quant_method") in ("fp8", "deepseek_v4_fp8")
        if is_dsv4 and official and user_quant in (None, "fp8", "deepseek_v4_fp8", NAME):
            return NAME
        return None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        return None
