"""Manifold-constrained hyper-connections around each sub-layer (§4)."""

from __future__ import annotations

import torch
from torch import nn

from vllm_dsv4 import ops
from vllm_dsv4.config import Dsv4Config
from vllm_dsv4.model.layers import RMSNorm, fp32_param


class HyperConnection(nn.Module):
    """Mixes the n residual streams into one sub-layer input and the output back (``hc_{attn,ffn}_*``)."""

    def __init__(self, cfg: Dsv4Config):
        super().__init__()
        n, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
        self.fn, self.base, self.scale = fp32_param(mix, n * cfg.hidden_size), fp32_param(mix), fp32_param(3)
        self.rms_eps, self.hc_eps, self.iters = cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters

    def pre(self, streams: torch.Tensor, norm: RMSNorm):
        """streams [T, n, D] -> (the sub-layer's input [T, D]: the collapse normed by ``norm``, one op;
        post [T, n], comb [T, n, n])."""
        return ops.mhc_pre(streams, self.fn, self.base, self.scale, self.rms_eps, self.hc_eps, self.iters,
                           norm.weight, norm.eps)

    @staticmethod
    def post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return ops.mhc_post(out, streams, post, comb)


class HyperHead(nn.Module):
    """Final weighted stream sum before the output norm (``hc_head_*``)."""

    def __init__(self, cfg: Dsv4Config):
        super().__init__()
        n = cfg.hc_mult
        self.fn, self.base, self.scale = fp32_param(n, n * cfg.hidden_size), fp32_param(n), fp32_param(1)
        self.rms_eps, self.hc_eps = cfg.rms_norm_eps, cfg.hc_eps

    def forward(self, streams: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """streams [T, n, D] -> their collapse [T, D], normed by ``norm`` (the model's final norm) in the same
        op; None: as it is (a DSpark draft keeps it for its confidence head)."""
        if norm is None:
            return ops.hc_head(streams, self.fn, self.base, self.scale, self.rms_eps, self.hc_eps)
        return ops.hc_head(streams, self.fn, self.base, self.scale, self.rms_eps, self.hc_eps, norm.weight, norm.eps)
