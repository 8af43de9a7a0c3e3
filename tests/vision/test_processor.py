"""The multimodal processor's pieces that do not need an engine: the alignment pads put in front of each
block as it lands, the profiling image size (against vLLM 0.32's own search), the image checks, and
the processor's outputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from tests.vision.test_layout import VISION, SizeOnly
from vllm_dsv4.config import VisionConfig
from vllm_dsv4.vision import layout
from vllm_dsv4.vision.preprocess import ImageError
from vllm_dsv4.vision.processor import ImageParser, ImageProcessor, ImageProcessingInfo, with_alignment_pads

PAD_ID = layout.SENTINEL_BASE_ID + layout.IMAGE_PAD


def placeholder(item_idx: int, start: int, llm: tuple[int, int]):
    from vllm.multimodal.processing.processor import PlaceholderFeaturesInfo

    types, _ = layout.block_layout(*llm)
    tokens = layout.sentinel_ids(types)
    return PlaceholderFeaturesInfo(modality="image", item_idx=item_idx, start_idx=start, tokens=tokens,
                                   is_embed=types == layout.IMAGE)


@pytest.mark.parametrize("starts", [(0, 200), (1, 130), (2, 118), (3, 117), (5, 300)])
def test_alignment_pads_follow_where_blocks_land(starts):
    """Blocks at ``starts`` of a prompt of text tokens 7: each gets 3 - (its final offset % 4) PADs, so its
    START sits at 3 mod 4 after the pads of earlier blocks moved it."""
    a, b = placeholder(0, starts[0], (3, 4)), placeholder(1, starts[1], (2, 2))
    ids = [7] * starts[0] + a.tokens + [7] * (starts[1] - starts[0] - len(a.tokens)) + b.tokens + [7] * 5
    out, moved = with_alignment_pads(ids, {"image": [b, a]})
    first, second = moved["image"]
    assert (first.item_idx, second.item_idx) == (0, 1)
    for p, original in ((first, a), (second, b)):
        pad = layout.alignment_pad(p.start_idx)
        assert p.tokens == [PAD_ID] * pad + original.tokens and out[p.start_idx:p.start_idx + len(p.tokens)] == p.tokens
        assert (p.start_idx + pad) % 4 == 3 and out[p.start_idx + pad] == layout.SENTINEL_BASE_ID
        assert torch.equal(p.is_embed, torch.cat([torch.zeros(pad, dtype=torch.bool), original.is_embed]))
    assert second.start_idx == starts[1] + len(first.tokens) - len(a.tokens)
    assert [t for t in out if t != PAD_ID] == [t for t in ids if t != PAD_ID] and out.count(7) == ids.count(7)


def test_no_image_leaves_the_prompt_alone():
    out, placeholders = with_alignment_pads([1, 2, 3], {"image": []})
    assert out == [1, 2, 3] and placeholders == {"image": []}


@pytest.mark.parametrize("vision", [VISION, VisionConfig(1, 64, 1, 8, 16, 1e4, 2, 64, 4096, 4.0),
                                    VisionConfig(1, 64, 1, 8, 14, 1e4, 3, 100, 0, None)])
def test_largest_image_equals_vllm(vision):
    mm_preprocess = pytest.importorskip("vllm.models.deepseek_v4.common.mm_preprocess",
                                        reason="vLLM 0.32's own search is the oracle (not in 0.26)")
    DeepseekV4VLProcessingInfo = mm_preprocess.DeepseekV4VLProcessingInfo

    hf = SimpleNamespace(vision_patch_size=vision.patch_size, vision_downsample_ratio=vision.downsample_ratio,
                         vision_max_wh_ratio=vision.max_wh_ratio, vision_max_n_token=vision.max_n_token)
    want = DeepseekV4VLProcessingInfo.get_image_size_with_most_features(SimpleNamespace(get_hf_config=lambda: hf))
    ours = ImageProcessingInfo.largest_image(SimpleNamespace(vision=vision))
    assert (ours.width, ours.height) == (want.width, want.height)
    grid = layout.solve_grid(ours.width, ours.height, vision)  # the size maps back to its own grid
    assert grid.num_embeds * vision.patch_size**2 * vision.downsample_ratio**2 == ours.width * ours.height


def test_processor_outputs_concatenate_images():
    images = [Image.new("RGB", (224, 224), (10, 20, 30)), Image.new("RGB", (500, 130), (200, 0, 9))]
    tokenizer = SimpleNamespace(encode=lambda text, **kw: [len(text)])
    out = ImageProcessor(VISION, tokenizer)(text="abc", images=images)
    grids = [layout.solve_grid(i.width, i.height, VISION) for i in images]
    assert out["input_ids"] == [[3]]
    assert out["vit_grid"].tolist() == [[g.vit_h, g.vit_w] for g in grids]
    assert out["llm_grid"].tolist() == [[g.llm_h, g.llm_w] for g in grids]
    assert out["patches"].shape == (sum(g.num_patches for g in grids), 3, 14, 14)
    assert len(out["perm"]) == sum(g.num_embeds for g in grids)
    assert len(out["types"]) == sum(g.num_block_tokens for g in grids)


class Wrapped:
    """An image as vLLM's media loader hands it over: the pixels and the file's bytes."""

    def __init__(self, image, nbytes):
        self.media, self.original_bytes = image, b"\0" * nbytes

    def __getattr__(self, name):
        return getattr(self.media, name)


def test_parser_refuses_bad_images_by_name():
    parser = ImageParser(VISION, expected_hidden_size=None)
    assert len(parser.parse_mm_data({"image": [Image.new("RGB", (20, 20))]})["image"]) == 1
    with pytest.raises(ImageError, match="1x1 pixels"):
        parser.parse_mm_data({"image": [Image.new("RGB", (20, 20)), Image.new("RGB", (1, 1))]})
    with pytest.raises(ImageError, match="100000x10 pixels"):
        parser.parse_mm_data({"image": [SizeOnly(100_000, 10)]})
    with pytest.raises(ImageError, match=r"image file is 25.0 MiB; the limit is 20 MiB"):
        parser.parse_mm_data({"image": [Wrapped(Image.new("RGB", (20, 20)), 25 * 2**20)]})
    with pytest.raises(ImageError, match="PIL images"):
        parser.parse_mm_data({"image": [torch.zeros(3, 20, 20)]})
