"""Image sizing, patches and the sentinel block against vLLM 0.32's own DeepSeek-V4 preprocessing
(``vllm/models/deepseek_v4/common/mm_preprocess.py``, called directly as the oracle) and the spec's
worked examples (docs/VISION.md §3.3, derived by hand from the formulas)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from vllm_dsv4.config import VisionConfig
from vllm_dsv4.vision import layout
from vllm_dsv4.vision.preprocess import ImageError, check_image, to_patches

VISION = VisionConfig(n_layers=1, dim=64, n_heads=1, inter_dim=8, patch_size=14, rope_theta=1e4,
                      downsample_ratio=3, max_n_token=384, min_pixels=147456, max_wh_ratio=8.0)


@pytest.fixture(scope="module")
def oracle():
    return pytest.importorskip("vllm.models.deepseek_v4.common.mm_preprocess",
                               reason="vLLM 0.32's own DeepSeek-V4 preprocessing is the oracle (not in 0.26)")


def oracle_load(oracle, image, vision=VISION):
    return oracle.load_image(image, patch_size=vision.patch_size, downsample_ratio=vision.downsample_ratio,
                             max_n_token=vision.max_n_token, min_pixels=vision.min_pixels,
                             max_wh_ratio=vision.max_wh_ratio)


class SizeOnly:
    """An image of any size that holds no pixels (a 100,000 x 100,000 image would take 30 GB): its
    resize returns a uniform image of the new size, which is all the canvas step reads."""

    def __init__(self, width: int, height: int):
        self.size, self.width, self.height, self.mode = (width, height), width, height, "RGB"

    def convert(self, mode):
        return self

    def resize(self, size, *args, **kwargs):
        return Image.new("RGB", size, (200, 30, 90))


# (W, H) -> canvas (w, h), ViT grid (h, w), LLM grid (h, w), IMAGE tokens, pad-free block tokens, stretched
WORKED_EXAMPLES = [
    ((224, 224), (392, 392), (28, 28), (10, 10), 100, 114, False),
    ((640, 480), (644, 490), (35, 46), (12, 16), 192, 206, False),
    ((1024, 768), (882, 658), (47, 63), (16, 21), 336, 354, False),
    ((1920, 1080), (1036, 588), (42, 74), (14, 25), 350, 366, False),
    ((3000, 3000), (756, 756), (54, 54), (18, 18), 324, 346, False),
    ((4000, 500), (2016, 252), (18, 144), (6, 48), 288, 298, True),
    ((100, 2000), (112, 2002), (143, 8), (48, 3), 144, 194, False),
]


@pytest.mark.parametrize("size, canvas, vit, llm, embeds, tokens, stretch", WORKED_EXAMPLES,
                         ids=[f"{w}x{h}" for (w, h), *_ in WORKED_EXAMPLES])
def test_worked_examples(size, canvas, vit, llm, embeds, tokens, stretch):
    grid = layout.solve_grid(*size, VISION)
    assert (grid.canvas_w, grid.canvas_h) == canvas
    assert (grid.vit_h, grid.vit_w) == vit
    assert (grid.llm_h, grid.llm_w) == llm
    assert (grid.num_embeds, grid.num_block_tokens, grid.stretch) == (embeds, tokens, stretch)
    types, perm = layout.block_layout(grid.llm_h, grid.llm_w)
    assert len(types) == tokens and int((types == layout.IMAGE).sum()) == embeds


# Tiny, small, typical, huge, extreme aspect ratios both ways, odd LLM row counts, sizes off the patch grid
SIZES = [(1, 1), (2, 3), (13, 14), (14, 14), (15, 29), (37, 53), (224, 224), (225, 223), (383, 385),
         (640, 480), (800, 600), (1023, 767), (1280, 720), (1920, 1080), (2048, 2048), (4032, 3024),
         (12000, 9000), (100_000, 100_000), (4000, 500), (4001, 500), (3999, 500), (5000, 20), (100_000, 10),
         (10, 100_000), (20, 5000), (100, 2000), (113, 1000), (300, 2500), (500, 300), (1000, 130),
         (130, 1000), (441, 147), (600, 126), (7, 3000), (3000, 7)]


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_grid_and_patches_equal_vllm(oracle, size):
    image = SizeOnly(*size)
    patches, grid = to_patches(image, VISION)
    want_patches, vit_h, vit_w, llm_h, llm_w = oracle_load(oracle, SizeOnly(*size))
    assert (grid.vit_h, grid.vit_w, grid.llm_h, grid.llm_w) == (vit_h, vit_w, llm_h, llm_w)
    assert grid.num_block_tokens <= VISION.max_n_token - (layout.ALIGN - 1)
    assert patches.dtype == want_patches.dtype and torch.equal(patches, want_patches)


@pytest.mark.parametrize("size", [(37, 53), (224, 224), (641, 479), (4000, 500), (100, 2000), (16, 900)])
def test_patches_of_real_pixels_equal_vllm(oracle, size):
    """Random pixels: the resample (pad or stretch), the [-1, 1] scaling and the patch order all show."""
    g = torch.Generator().manual_seed(size[0] * 7 + size[1])
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    image = Image.fromarray(pixels, "RGB")
    patches, grid = to_patches(image, VISION)
    want, *_ = oracle_load(oracle, image)
    assert patches.shape == (grid.num_patches, 3, 14, 14)
    assert torch.equal(patches, want)
    assert patches.abs().max() <= 1.0


@pytest.mark.parametrize("mode", ["L", "RGBA", "P"])
def test_other_modes_are_converted_as_vllm(oracle, mode):
    image = Image.new(mode, (300, 200), 90)
    assert torch.equal(to_patches(image, VISION)[0], oracle_load(oracle, image)[0])


def test_other_configs_equal_vllm(oracle):
    """A smaller budget, no aspect clamp, other patch and merge sizes."""
    for vision in (VisionConfig(1, 64, 1, 8, 16, 1e4, 2, 64, 4096, 4.0),
                   VisionConfig(1, 64, 1, 8, 14, 1e4, 3, 100, 0, None),
                   VisionConfig(1, 64, 1, 8, 8, 1e4, 4, 40, 10000, 2.0)):
        for size in ((1, 1), (300, 200), (5000, 40), (40, 5000), (1920, 1080), (333, 777)):
            grid = to_patches(SizeOnly(*size), vision)[1]
            _, *want = oracle_load(oracle, SizeOnly(*size), vision)
            assert (grid.vit_h, grid.vit_w, grid.llm_h, grid.llm_w) == tuple(want), (vision, size)
            assert grid.num_block_tokens <= vision.max_n_token - 3


GRIDS = [(1, 1), (1, 2), (2, 1), (2, 2), (3, 5), (4, 4), (5, 3), (6, 48), (10, 10), (11, 7), (48, 3), (188, 1),
         (2, 189), (17, 20), (13, 13)]


@pytest.mark.parametrize("llm", GRIDS, ids=[f"{h}x{w}" for h, w in GRIDS])
def test_block_layout_equals_vllm(oracle, llm):
    types, perm = layout.block_layout(*llm)
    want_types, want_perm = oracle.build_image_block_pad_free(*llm)
    assert torch.equal(types, want_types) and torch.equal(perm, want_perm)
    assert len(types) == layout.block_length(*llm)
    assert sorted(perm.tolist()) == list(range(llm[0] * llm[1]))
    for start in range(9):  # the whole block as placed at `start`, pad included
        pad = layout.alignment_pad(start)
        full_types, full_perm = oracle.build_image_block(*llm, start)
        assert torch.equal(torch.cat([torch.full((pad,), layout.IMAGE_PAD), types]), full_types)
        assert (start + pad) % 4 == 3  # START at 3 mod 4
        assert (start + pad + len(types) - 1) % 4 == 0  # END at 0 mod 4
        assert torch.equal(perm, full_perm)


def test_n_layout_by_hand():
    """2 x 2 cells: rows (c0 c1 NL), (c2 c3 NL), laid out by column within the row pair; the grid's
    half (3 tokens) is odd, so two PADs bring END to 0 mod 4."""
    S, P, I, N, E = range(5)
    types, perm = layout.block_layout(2, 2)
    assert types.tolist() == [S, I, I, I, I, N, N, P, P, E]
    assert perm.tolist() == [0, 2, 1, 3]
    types, perm = layout.block_layout(1, 1)  # one row: a PAD row under it; the grid's half (2) is even
    assert types.tolist() == [S, I, P, N, P, E] and perm.tolist() == [0]


def test_sentinel_ids():
    assert layout.sentinel_ids(torch.arange(5)) == [129257, 129258, 129259, 129260, 129261]
    assert layout.SENTINEL_TOKENS[0] == "<|place_holder_mm_span_0431|>"
    assert layout.SENTINEL_TOKENS[4] == "<|place_holder_mm_span_0435|>"


@pytest.mark.parametrize("size", [(1, 1), (13, 500), (100_000, 10), (10, 100_000)])
def test_images_under_one_patch_are_refused(size):
    with pytest.raises(ImageError, match=f"{size[0]}x{size[1]} pixels"):
        check_image(SizeOnly(*size), VISION)


def test_images_of_one_patch_pass():
    check_image(SizeOnly(14, 14), VISION)
    check_image(SizeOnly(14, 100_000), VISION)
