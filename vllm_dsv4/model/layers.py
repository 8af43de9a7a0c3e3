"""Parameter holders named as in DeepSeek's reference (``.weight``), computing with the ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dsv4 import ops


class Linear(nn.Module):
    """``y = x W^T``. FP8 checkpoints are dequantised into ``weight`` at load (loader/)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


class RMSNorm(nn.Module):
    """Weighted RMSNorm (§3.1); the weight is kept in fp32 as the reference does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def fp32_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False)
