"""Our ViT + aligner against vLLM 0.32's (``common/vision.py``, built on the CPU with the same weights).

fp32 on both sides. The two differ in how they compute, not what: vLLM packs q/k/v through its own
linear layers and runs its encoder-attention wrapper, we use ``nn.Linear`` and PyTorch's SDPA, so sums
are ordered differently. Tolerance: 1e-5 of the output's largest entry; the reordering alone gives at
most 5e-7 here (a few fp32 ulps per layer), and the smallest real mistakes move far more: GELU's tanh
form instead of erf 1e-3, a transposed merge, patch order or missing rotation O(1)."""

from __future__ import annotations

import pytest
import torch

from tests.vision.vllm_tower import HAVE_VLLM_VISION, VllmTower
from vllm_dsv4.config import VisionConfig
from vllm_dsv4.vision.tower import Aligner, ViT, rope_2d_angles

# Tiny widths with the real patch and merge sizes; 4 heads of 16 (2-D RoPE: 4 angles per axis)
SMALL = VisionConfig(n_layers=3, dim=64, n_heads=4, inter_dim=96, patch_size=14, rope_theta=10000.0,
                     downsample_ratio=3, max_n_token=384, min_pixels=147456, max_wh_ratio=8.0)
HIDDEN = 48


def random_tower_weights(vision: VisionConfig, hidden: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tower tensor random (norm weights 1 + noise, biases nonzero), by checkpoint name."""
    g = torch.Generator().manual_seed(seed)
    vit, aligner = ViT(vision), Aligner(vision, hidden)
    out = {}
    for prefix, module in (("vision.", vit), ("aligner.", aligner)):
        for name, p in module.named_parameters():
            fan_in = p.shape[1] if p.dim() == 2 else 1
            t = torch.randn(p.shape, generator=g) / fan_in**0.5
            out[prefix + name] = 1 + 0.2 * t if "norm" in name else (t if p.dim() == 2 else 0.5 * t)
    return out


def our_tower(vision: VisionConfig, hidden: int, weights: dict[str, torch.Tensor]):
    vit, aligner = ViT(vision).eval(), Aligner(vision, hidden).eval()
    for prefix, module in (("vision.", vit), ("aligner.", aligner)):
        module.load_state_dict({n[len(prefix):]: t for n, t in weights.items() if n.startswith(prefix)}, strict=True)
    return vit, aligner


@pytest.fixture(scope="module")
def towers():
    if not HAVE_VLLM_VISION:
        pytest.skip("vLLM 0.32's own DeepSeek-V4 tower is the oracle (not in 0.26)")
    weights = random_tower_weights(SMALL, HIDDEN)
    return our_tower(SMALL, HIDDEN, weights), VllmTower(SMALL, HIDDEN, weights), weights


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ViT grids: square, wide, tall, not multiples of 3 (padded cells), a single row and column of cells
GRIDS = [(6, 6), (7, 11), (10, 4), (3, 3), (1, 9), (9, 1), (2, 2), (28, 28)]


@pytest.mark.parametrize("grid", GRIDS, ids=[f"{h}x{w}" for h, w in GRIDS])
def test_tower_equals_vllm(towers, grid):
    (vit, aligner), oracle, _ = towers
    vit_h, vit_w = grid
    patches = torch.randn(vit_h * vit_w, 3, 14, 14, generator=torch.Generator().manual_seed(vit_h * 31 + vit_w))
    with torch.no_grad():
        ours = aligner(vit(patches, vit_h, vit_w), vit_h, vit_w)
    want = oracle.encode(patches, vit_h, vit_w)
    assert ours.shape == want.shape == (-(-vit_h // 3) * -(-vit_w // 3), HIDDEN)
    assert close(ours, want) < 1e-5


def test_tower_sees_patch_order_and_position(towers):
    """The comparison is sharp: transposing the patch grid or dropping the rotation changes the output."""
    (vit, aligner), oracle, _ = towers
    patches = torch.randn(12, 3, 14, 14, generator=torch.Generator().manual_seed(5))
    want = oracle.encode(patches, 3, 4)
    with torch.no_grad():
        swapped = patches.view(3, 4, 3, 14, 14).transpose(0, 1).reshape(12, 3, 14, 14)
        assert close(aligner(vit(swapped, 3, 4), 3, 4), want) > 1e-2
        flat = vit.forward.__globals__["rope_2d_angles"]
        try:
            vit.forward.__globals__["rope_2d_angles"] = lambda h, w, d, t: torch.zeros(h * w, d // 2)
            assert close(aligner(vit(patches, 3, 4), 3, 4), want) > 1e-2
        finally:
            vit.forward.__globals__["rope_2d_angles"] = flat


def test_rope_angles_by_hand():
    """head_dim 8: freqs 1, 1/theta^(1/2); patch (row 1, col 2) of a 2 x 3 grid is patch 5."""
    angles = rope_2d_angles(2, 3, 8, 100.0)
    assert angles.shape == (6, 4)
    torch.testing.assert_close(angles[5], torch.tensor([1.0, 0.1, 2.0, 0.2]))
    torch.testing.assert_close(angles[1], torch.tensor([0.0, 0.0, 1.0, 0.1]))


def test_bf16_tower_stays_near_fp32(towers):
    """The model dtype on the GPU: bf16 weights and activations, norms and rotations in fp32."""
    (vit, aligner), _, weights = towers
    vit16, aligner16 = (m.to(torch.bfloat16) for m in our_tower(SMALL, HIDDEN, weights))
    patches = torch.randn(49, 3, 14, 14, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = aligner(vit(patches, 7, 7), 7, 7)
        got = aligner16(vit16(patches.to(torch.bfloat16), 7, 7), 7, 7).float()
    assert close(got, want) < 5e-2
