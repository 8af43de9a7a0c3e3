"""The vision tower: a ViT with 2-D RoPE over one image's patches, and the aligner that merges r x r
patches into one LLM embedding (docs/VISION.md §5). Parameter names are the checkpoint's (``vision.*``,
``aligner.*``). Every rank holds the whole tower (it is small beside the text model: 0.47 B
parameters at Vision-Exp's size) and encodes every image.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dsv4.config import VisionConfig
from vllm_dsv4.model.layers import RMSNorm

NORM_EPS = 1e-6  # every tower RMSNorm; the text model's rms_norm_eps does not apply here


def rope_2d_angles(vit_h: int, vit_w: int, head_dim: int, theta: float) -> torch.Tensor:
    """[vit_h * vit_w, head_dim / 2] fp32: the patch at (row i, column c), row-major, turns by
    ``i * f_j`` in its first head_dim / 4 angles and ``c * f_j`` in the rest, ``f_j = theta^(-4j / head_dim)``."""
    freqs = theta ** -(torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2))  # [head_dim / 4]
    rows = torch.arange(vit_h, dtype=torch.float32).repeat_interleave(vit_w)  # [n]
    cols = torch.arange(vit_w, dtype=torch.float32).repeat(vit_h)  # [n]
    return torch.cat([rows[:, None] * freqs, cols[:, None] * freqs], dim=1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head: x [n, H, d], cos / sin [n, 1, d / 2] of the angles; pairs
    (t, t + d / 2), in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, vision: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(3 * vision.patch_size**2, vision.dim)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [n, 3, p, p] -> [n, dim] (flattened channel, row, column)."""
        return self.proj(patches.flatten(1))


class VisionAttention(nn.Module):
    def __init__(self, vision: VisionConfig):
        super().__init__()
        self.n_heads, self.head_dim = vision.n_heads, vision.head_dim
        self.wqkv = nn.Linear(vision.dim, 3 * vision.dim)  # rows: q, k, v
        self.wo = nn.Linear(vision.dim, vision.dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [n, dim], cos / sin [n, 1, head_dim / 2] -> [n, dim]: every patch sees every patch of its image."""
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.n_heads, self.head_dim).unbind(1)  # [n, H, d] each
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # [H, n, d]
        return self.wo(o.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, vision: VisionConfig):
        super().__init__()
        self.w1 = nn.Linear(vision.dim, 2 * vision.inter_dim, bias=False)  # gate rows, then up rows
        self.w2 = nn.Linear(vision.inter_dim, vision.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, vision: VisionConfig):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(vision.dim, NORM_EPS), RMSNorm(vision.dim, NORM_EPS)
        self.attn = VisionAttention(vision)
        self.mlp = VisionMLP(vision)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """``vision.*``: patch embedding, ``n_layers`` blocks, final norm."""

    def __init__(self, vision: VisionConfig):
        super().__init__()
        self.head_dim, self.rope_theta = vision.head_dim, vision.rope_theta
        self.patch_embed = PatchEmbed(vision)
        self.blocks = nn.ModuleList(VisionBlock(vision) for _ in range(vision.n_layers))
        self.norm = RMSNorm(vision.dim, NORM_EPS)

    def forward(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """One image: patches [vit_h * vit_w, 3, p, p] (row-major) -> features [vit_h * vit_w, dim]."""
        angles = rope_2d_angles(vit_h, vit_w, self.head_dim, self.rope_theta).to(patches.device)[:, None]
        cos, sin = angles.cos(), angles.sin()  # [n, 1, head_dim / 2], once for every block
        x = self.patch_embed(patches.to(self.patch_embed.proj.weight.dtype))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    """``aligner.*``: r x r patches -> one embedding of the text model's width."""

    def __init__(self, vision: VisionConfig, hidden_size: int):
        super().__init__()
        self.ratio = vision.downsample_ratio
        self.w1 = nn.Linear(vision.dim * self.ratio**2, hidden_size)
        self.w2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """features [vit_h * vit_w, dim] -> [llm_h * llm_w, hidden], cells row-major. The grid is zero-padded
        to whole cells; a cell's feature is channel-major over its r x r patches (index c * r^2 + i * r + j)."""
        r = self.ratio
        grid = F.pad(x.view(vit_h, vit_w, -1), (0, 0, 0, -vit_w % r, 0, -vit_h % r))  # [r * llm_h, r * llm_w, C]
        llm_h, llm_w = grid.shape[0] // r, grid.shape[1] // r
        cells = grid.view(llm_h, r, llm_w, r, -1).permute(0, 2, 4, 1, 3).reshape(llm_h * llm_w, -1)
        return self.w2(F.gelu(self.w1(cells)))
