"""vLLM 0.32's own DeepSeek-V4 vision tower (``vllm/models/deepseek_v4/common/vision.py``) built on the
CPU, single process, as a test oracle: its ViT and aligner get weights by checkpoint name."""

from __future__ import annotations

import importlib.util
import socket
from types import SimpleNamespace

import torch

from vllm_dsv4.config import VisionConfig

# vLLM's own DeepSeek-V4 vision code: in 0.32 (the CPU CI), not in 0.26
HAVE_VLLM_VISION = importlib.util.find_spec("vllm.models.deepseek_v4.common.vision") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process_vllm() -> None:
    """vLLM's parallel state for one CPU process (its tower's linears ask for the TP group); idempotent."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
    parallel_state.initialize_model_parallel(1, 1)


def hf_like_config(vision: VisionConfig, hidden_size: int) -> SimpleNamespace:
    """The ``vision_*`` attributes vLLM's modules read off the HF config."""
    return SimpleNamespace(
        vision_n_layers=vision.n_layers, vision_dim=vision.dim, vision_n_heads=vision.n_heads,
        vision_inter_dim=vision.inter_dim, vision_patch_size=vision.patch_size, vision_rope_theta=vision.rope_theta,
        vision_downsample_ratio=vision.downsample_ratio, hidden_size=hidden_size)


class VllmTower:
    """``encode(patches, vit_h, vit_w)`` -> aligner rows [llm_h * llm_w, hidden] (row-major cells), fp32."""

    def __init__(self, vision: VisionConfig, hidden_size: int, weights: dict[str, torch.Tensor]):
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.models.deepseek_v4.common.vision import DeepseekV4Aligner, DeepseekV4ViT

        self._config = VllmConfig()
        with set_current_vllm_config(self._config):
            init_single_process_vllm()
            cfg = hf_like_config(vision, hidden_size)
            self.vit, self.aligner = DeepseekV4ViT(cfg).float().eval(), DeepseekV4Aligner(cfg).float().eval()
        for prefix, module in (("vision.", self.vit), ("aligner.", self.aligner)):
            own = dict(module.named_parameters())
            mine = {n[len(prefix):]: t for n, t in weights.items() if n.startswith(prefix)}
            assert set(own) == set(mine), (sorted(set(own) ^ set(mine)))
            with torch.no_grad():
                for name, param in own.items():
                    param.copy_(mine[name])
            for layer in module.modules():
                # vLLM binds its oneDNN GEMM here after loading; it refuses the aligner's strided input
                # (its CPU path for this model is a stub), so its linears compute with torch's F.linear
                if getattr(layer, "quant_method", None) is not None:
                    layer.cpu_linear = torch.nn.functional.linear

    @torch.no_grad()
    def encode(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self._config):
            return self.aligner(self.vit(patches.float(), vit_h, vit_w), vit_h, vit_w)
