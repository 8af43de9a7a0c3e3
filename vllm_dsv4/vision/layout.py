"""Where an image goes: its canvas and patch grid, and the sentinel token block standing for it in the
prompt (docs/VISION.md §3-§4). Pure arithmetic on sizes; pixels are handled in ``preprocess.py``.

A block is ``[PAD x (3 - start % 4)] START grid [PAD PAD] END``. The grid holds the LLM cells row by
row, each row ended by a NEWLINE (an odd row count gets a row of PADs), laid out in row pairs column by
column ("N-layout"): every 4 consecutive grid tokens are a 2 x 2 patch of cells, and since the grid
starts at a multiple of 4 they fill exactly one C4 compression window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_dsv4.config import (  # noqa: F401  (the sentinel vocabulary, re-exported for the vision room)
    IMAGE,
    IMAGE_END,
    IMAGE_NEWLINE,
    IMAGE_PAD,
    IMAGE_PLACEHOLDER,
    IMAGE_START,
    NUM_SENTINELS,
    SENTINEL_BASE_ID,
    VisionConfig,
)

SENTINEL_TOKENS = tuple(f"<|place_holder_mm_span_{431 + t:04d}|>" for t in range(NUM_SENTINELS))
ALIGN = 4  # START sits at 3 mod 4, so the grid starts on a C4 window


@dataclass(frozen=True)
class ImageGrid:
    """One image's geometry. ``canvas_*``: pixels it is resampled to (multiples of the patch size);
    ``vit_*``: its ViT patch grid; ``llm_*``: its grid of LLM cells (``r x r`` patches each, edges padded);
    ``stretch``: resized to the canvas ignoring the aspect ratio (very wide images) instead of padded."""

    canvas_w: int
    canvas_h: int
    vit_h: int
    vit_w: int
    llm_h: int
    llm_w: int
    stretch: bool

    @property
    def num_patches(self) -> int:
        return self.vit_h * self.vit_w

    @property
    def num_embeds(self) -> int:
        """IMAGE tokens: one aligner output per LLM cell."""
        return self.llm_h * self.llm_w

    @property
    def num_block_tokens(self) -> int:
        return block_length(self.llm_h, self.llm_w)


def cell_grid(canvas_h: int, canvas_w: int, patch: int, ratio: int) -> tuple[int, int]:
    """LLM cells (rows, columns) of a canvas: its patch grid merged ``ratio x ratio``, edges padded."""
    return math.ceil(canvas_h // patch / ratio), math.ceil(canvas_w // patch / ratio)


def block_length(llm_h: int, llm_w: int) -> int:
    """Tokens of an image's block without the alignment pad: START, the grid (rows made even, each
    ``llm_w`` cells + NEWLINE), PAD PAD if half the grid is odd (so END lands at 0 mod 4), END."""
    rows, row_len = llm_h + llm_h % 2, llm_w + 1
    return 2 + rows * row_len + (rows // 2 * row_len) % 2 * 2


def _fit_budget(h: float, w: float, budget: int, patch: int, ratio: int) -> tuple[int, int]:
    """A canvas (height, width) in pixels for a ``h x w`` image whose block fits about ``budget`` tokens:
    the largest cell grid of the image's aspect with ``rows * (cols + 1) + 2 <= budget``; a single
    column, or two rows, where the aspect leaves less than that (docs/VISION.md §3.1 step 6)."""
    cell = patch * ratio
    aspect = h / w
    cols = math.sqrt((budget - 2) / aspect + 0.25) - 0.5  # solves rows * (cols + 1) + 2 = budget, rows = aspect * cols
    rows = cols * aspect
    if cols < 1.0:
        rows_even = (budget - 2) // 2 // 2 * 2
        return rows_even * cell, cell
    if rows < 2.0:
        return 2 * cell, ((budget - 2) // 2 - 1) * cell
    cols_int, rows_int = math.floor(cols), math.floor(rows) // 2 * 2
    scale = min(cols_int * cell / w, rows_int * cell / h)
    return math.floor(h * scale / patch) * patch, math.floor(w * scale / patch) * patch


def solve_grid(width: int, height: int, vision: VisionConfig) -> ImageGrid:
    """The canvas and grids of a ``width x height`` image (docs/VISION.md §3.1): wide images are sized as if
    ``max_wh_ratio`` wide, small ones as if scaled up to ``min_pixels``; the canvas is rounded up to whole
    patches and shrunk until its block, with the largest alignment pad, fits ``max_n_token``."""
    p, r = vision.patch_size, vision.downsample_ratio
    w, h = float(width), float(height)
    if vision.max_wh_ratio is not None and w > h * vision.max_wh_ratio:
        w = h * vision.max_wh_ratio
    if 0 < w * h < vision.min_pixels:
        grow = math.sqrt(vision.min_pixels / (w * h))
        w, h = int(w * grow), int(h * grow)
    canvas_h, canvas_w = math.ceil(h / p) * p, math.ceil(w / p) * p
    budget = vision.max_n_token - (ALIGN - 1)
    tries = budget
    while block_length(*cell_grid(canvas_h, canvas_w, p, r)) > budget:
        canvas_h, canvas_w = _fit_budget(h, w, tries, p, r)
        tries -= 1
    llm_h, llm_w = cell_grid(canvas_h, canvas_w, p, r)
    stretch = vision.max_wh_ratio is not None and width >= vision.max_wh_ratio * height
    return ImageGrid(canvas_w, canvas_h, canvas_h // p, canvas_w // p, llm_h, llm_w, stretch)


def alignment_pad(start: int) -> int:
    """PADs in front of a block placed at prompt offset ``start`` (its START then lands at 3 mod 4)."""
    return ALIGN - 1 - start % ALIGN


def block_layout(llm_h: int, llm_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An image's pad-free block: ``types`` [block_length] (IMAGE_START ..) and ``perm`` [llm_h * llm_w],
    for each IMAGE token in prompt order the row-major cell whose aligner output fills it."""
    rows, row_len = llm_h + llm_h % 2, llm_w + 1
    grid = torch.full((rows, row_len), IMAGE_PAD, dtype=torch.int64)  # a padding row stays PAD
    grid[:llm_h, :llm_w] = IMAGE
    grid[:llm_h, llm_w] = IMAGE_NEWLINE
    cell = torch.full((rows, row_len), -1, dtype=torch.int64)
    cell[:llm_h, :llm_w] = torch.arange(llm_h * llm_w).view(llm_h, llm_w)
    # N-layout: row pairs, then columns, then the pair's two rows
    order = torch.arange(rows * row_len).view(rows // 2, 2, row_len).transpose(1, 2).flatten()
    tail = (rows // 2 * row_len) % 2 * 2
    types = torch.cat([torch.tensor([IMAGE_START]), grid.flatten()[order],
                       torch.full((tail,), IMAGE_PAD, dtype=torch.int64), torch.tensor([IMAGE_END])])
    perm = cell.flatten()[order]
    return types, perm[perm >= 0]


def sentinel_ids(types: torch.Tensor) -> list[int]:
    """Token ids of sentinel types."""
    return (types + SENTINEL_BASE_ID).tolist()
