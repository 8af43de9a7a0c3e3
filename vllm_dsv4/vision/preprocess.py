"""An image's pixels -> ViT patches (docs/VISION.md §3.1 step 8, §3.2), and the checks an image must pass."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageOps

from vllm_dsv4.config import VisionConfig
from vllm_dsv4.vision.layout import ImageGrid, solve_grid

PAD_COLOR = (127, 127, 127)  # the canvas around an aspect-preserving resize


class ImageError(ValueError):
    """An image the model cannot take (vLLM answers a ValueError raised while processing with a 400)."""


def check_image(image: Image.Image, vision: VisionConfig) -> None:
    """Raise ImageError naming the problem for an image smaller than one ViT patch on a side: the
    solver would blow a 1 x 1 or 100,000 x 10 image up into a canvas of mostly invented pixels."""
    width, height = image.size
    if min(width, height) < vision.patch_size:
        raise ImageError(f"image is {width}x{height} pixels; each side must be at least {vision.patch_size} "
                         f"pixels (one vision patch)")


def to_patches(image: Image.Image, vision: VisionConfig) -> tuple[torch.Tensor, ImageGrid]:
    """Patches [vit_h * vit_w, 3, p, p] bf16 in [-1, 1], row-major over the patch grid, and the grid."""
    grid = solve_grid(image.width, image.height, vision)
    image = image.convert("RGB")
    size = (grid.canvas_w, grid.canvas_h)
    canvas = image.resize(size) if grid.stretch else ImageOps.pad(image, size, color=PAD_COLOR)
    pixels = torch.from_numpy(np.asarray(canvas, dtype=np.float32)).permute(2, 0, 1) / 255  # [3, H, W]
    pixels = ((pixels - 0.5) / 0.5).to(torch.bfloat16)
    p = vision.patch_size
    patches = pixels.view(3, grid.vit_h, p, grid.vit_w, p).permute(1, 3, 0, 2, 4)  # [vit_h, vit_w, 3, p, p]
    return patches.reshape(grid.num_patches, 3, p, p), grid
