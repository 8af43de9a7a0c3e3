"""vLLM's multimodal processor for DeepSeek-V4 Vision: images in a prompt become sentinel blocks and
their patches (docs/VISION.md §9).

vLLM (0.26 and 0.32 alike) parses the request's images (``ImageParser``: each is checked here, a bad
one answers 400 naming the problem), calls ``ImageProcessor`` on those its processor cache lacks, and
replaces each ``<｜deepseek_image｜>`` in the prompt by the image's pad-free block; ``_apply_prompt_updates``
then puts each block's alignment pad in front of it, which depends on where the block lands. The
placeholder range of an image covers pad and block; its IMAGE tokens take the tower's embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property

import torch
from transformers import BatchFeature
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
from vllm.multimodal.parse import ImageSize, MultiModalDataItems, MultiModalDataParser
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
)
from vllm.multimodal.processing.processor import PlaceholderFeaturesInfo

from vllm_dsv4 import envs
from vllm_dsv4.config import Dsv4Config, VisionConfig
from vllm_dsv4.vision import layout
from vllm_dsv4.vision.preprocess import ImageError, check_image, to_patches

MAX_IMAGE_MB = float(envs.MAX_IMAGE_MB.read())


def vision_of(hf_config) -> VisionConfig:
    vision = Dsv4Config.from_hf_config(hf_config).vision
    if vision is None:
        raise ImageError("this DeepSeek-V4 checkpoint has no vision tower (vision_n_layers is 0)")
    return vision


def check_encoded_size(item, limit_mb: float = MAX_IMAGE_MB) -> None:
    """A request's image as vLLM decoded it carries its encoded bytes (``MediaWithBytes``): refuse a large file."""
    data = getattr(item, "original_bytes", None)
    if data is not None and len(data) > limit_mb * 2**20:
        raise ImageError(f"image file is {len(data) / 2**20:.1f} MiB; the limit is {limit_mb:g} MiB "
                         f"(VLLM_DSV4_MAX_IMAGE_MB)")


class ImageParser(MultiModalDataParser):
    """vLLM's parser, then every image checked (size of file, pixels per side) before any work on it."""

    def __init__(self, vision: VisionConfig, **kwargs):
        super().__init__(**kwargs)
        self.vision = vision

    def _parse_image_data(self, data):
        items = super()._parse_image_data(data)
        for item in getattr(items, "data", None) or ():
            if not hasattr(item, "size") or not hasattr(item, "convert"):
                raise ImageError(f"DeepSeek-V4 takes images as PIL images, got {type(item).__name__}")
            check_encoded_size(item)
            check_image(item, self.vision)
        return items


class ImageProcessor:
    """What vLLM calls the HF processor: ``(text, images) -> BatchFeature`` with, over all images,
    ``patches`` [sum n_vit, 3, p, p] bf16, ``vit_grid`` / ``llm_grid`` [n_img, 2], ``perm`` [sum n_embeds]
    and ``types`` [sum block tokens] (pad-free blocks); and ``input_ids`` [[...]] of ``text`` when given
    (vLLM 0.26 tokenises through it). Blocks are left out of ``input_ids``: vLLM puts them in."""

    def __init__(self, vision: VisionConfig, tokenizer):
        self.vision, self.tokenizer = vision, tokenizer

    def __call__(self, text: str | None = None, images: Sequence | None = None, return_tensors=None,
                 **tokenizer_kwargs) -> BatchFeature:
        out = {}
        if text is not None:
            out["input_ids"] = [self.tokenizer.encode(text, **tokenizer_kwargs)]
        if images:
            out.update(self.images(images))
        return BatchFeature(out)

    def images(self, images: Sequence) -> dict[str, torch.Tensor]:
        patches, grids, perms, types = [], [], [], []
        for image in images:  # checked by ImageParser as the request arrived
            image_patches, grid = to_patches(image, self.vision)
            image_types, perm = layout.block_layout(grid.llm_h, grid.llm_w)
            patches.append(image_patches)
            grids.append(grid)
            perms.append(perm)
            types.append(image_types)
        return {"patches": torch.cat(patches),
                "vit_grid": torch.tensor([[g.vit_h, g.vit_w] for g in grids]),
                "llm_grid": torch.tensor([[g.llm_h, g.llm_w] for g in grids]),
                "perm": torch.cat(perms), "types": torch.cat(types)}


class ImageProcessingInfo(BaseProcessingInfo):
    @cached_property
    def vision(self) -> VisionConfig:
        return vision_of(self.get_hf_config())

    def get_hf_processor(self, **kwargs: object) -> ImageProcessor:
        if kwargs:
            raise ValueError(f"DeepSeek-V4 images take no processor options, got {sorted(kwargs)}")
        return ImageProcessor(self.vision, self.get_tokenizer())

    def get_data_parser(self) -> MultiModalDataParser:
        return ImageParser(self.vision, expected_hidden_size=self._get_expected_hidden_size())

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None}

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        return {"image": self.vision.max_n_token}  # the solver keeps block + alignment pad within it

    def placeholder_token_id(self) -> int:
        token_id = self.get_tokenizer().convert_tokens_to_ids(layout.IMAGE_PLACEHOLDER)
        if token_id is None or token_id == getattr(self.get_tokenizer(), "unk_token_id", None):
            raise ImageError(f"the tokenizer has no {layout.IMAGE_PLACEHOLDER} token")
        return token_id

    def check_sentinel_tokens(self) -> None:
        """The ids the model treats as sentinels must be the tokenizer's reserved tokens of those names."""
        tokenizer = self.get_tokenizer()
        for i, name in enumerate(layout.SENTINEL_TOKENS):
            if tokenizer.convert_tokens_to_ids(name) != layout.SENTINEL_BASE_ID + i:
                raise ImageError(f"the tokenizer maps {name} to {tokenizer.convert_tokens_to_ids(name)}, not "
                                 f"{layout.SENTINEL_BASE_ID + i}: image sentinel ids would collide with text")

    def largest_image(self) -> ImageSize:
        """The image size of the most IMAGE tokens (ties: the longest block) that fits the budget: the
        grid of LLM cells searched directly (a row costs a NEWLINE, so the best is not square)."""
        v = self.vision
        budget, cell = v.max_n_token - (layout.ALIGN - 1), v.patch_size * v.downsample_ratio
        best, best_key = (1, 1), (0, 0)
        for rows in range(1, budget):
            if layout.block_length(rows, 1) > budget:
                break
            for cols in range(1, budget):
                tokens = layout.block_length(rows, cols)
                if tokens > budget or (v.max_wh_ratio is not None and cols > rows * v.max_wh_ratio):
                    break
                if (rows * cols, tokens) > best_key:
                    best, best_key = (rows, cols), (rows * cols, tokens)
        return ImageSize(width=best[1] * cell, height=best[0] * cell)


class ImageDummyInputs(BaseDummyInputsBuilder[ImageProcessingInfo]):
    """Profiling inputs: placeholders, and gray images of the largest size."""

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return layout.IMAGE_PLACEHOLDER * mm_counts.get("image", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options=None):
        size = self.info.largest_image()
        overrides = mm_options.get("image") if mm_options else None
        return {"image": self._get_dummy_images(width=size.width, height=size.height,
                                                num_images=mm_counts.get("image", 0), overrides=overrides)}


class ImageMultiModalProcessor(BaseMultiModalProcessor[ImageProcessingInfo]):
    def _call_hf_processor(self, *args, **kwargs) -> BatchFeature:
        # As vLLM's own; overriding it makes vLLM 0.26 call ImageProcessor with text rather than through
        # HF's ProcessorMixin helpers, which ImageProcessor is not (compat.py adapter 7)
        return super()._call_hf_processor(*args, **kwargs)

    def _hf_processor_applies_updates(self, *args, **kwargs) -> bool:
        return False  # vLLM 0.26 asks; ImageProcessor never expands placeholders itself

    def _get_mm_fields_config(self, hf_inputs: BatchFeature,
                              hf_processor_mm_kwargs: Mapping[str, object]) -> Mapping[str, MultiModalFieldConfig]:
        vit_grid, llm_grid = hf_inputs.get("vit_grid"), hf_inputs.get("llm_grid")
        if vit_grid is None:
            vit_grid = llm_grid = torch.empty(0, 2, dtype=torch.int64)
        blocks = torch.tensor([layout.block_length(h, w) for h, w in llm_grid.tolist()], dtype=torch.int64)
        return {
            "patches": MultiModalFieldConfig.flat_from_sizes("image", vit_grid.prod(-1)),
            "vit_grid": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
            "llm_grid": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
            "perm": MultiModalFieldConfig.flat_from_sizes("image", llm_grid.prod(-1)),
            "types": MultiModalFieldConfig.flat_from_sizes("image", blocks, keep_on_cpu=True),
        }

    def _get_prompt_updates(self, mm_items: MultiModalDataItems, hf_processor_mm_kwargs: Mapping[str, object],
                            out_mm_kwargs: MultiModalKwargsItems) -> Sequence[PromptUpdate]:
        self.info.check_sentinel_tokens()
        image_id = layout.SENTINEL_BASE_ID + layout.IMAGE

        def block(item_idx: int) -> PromptUpdateDetails:
            types = out_mm_kwargs["image"][item_idx]["types"].data
            return PromptUpdateDetails.select_token_id(layout.sentinel_ids(types), image_id)

        return [PromptReplacement(modality="image", target=[self.info.placeholder_token_id()], replacement=block)]

    def _apply_prompt_updates(self, token_ids: list[int], mm_prompt_updates):
        token_ids, placeholders = super()._apply_prompt_updates(token_ids, mm_prompt_updates)
        return with_alignment_pads(token_ids, placeholders)


def with_alignment_pads(token_ids: list[int], placeholders: Mapping[str, list[PlaceholderFeaturesInfo]]
                        ) -> tuple[list[int], dict[str, list[PlaceholderFeaturesInfo]]]:
    """``token_ids`` with ``3 - start % 4`` PADs in front of each image block (its START then sits at
    3 mod 4 where it finally lands), and the placeholders moved and widened to cover their pads."""
    pad_id = layout.SENTINEL_BASE_ID + layout.IMAGE_PAD
    images = sorted(placeholders.get("image", []), key=lambda p: p.start_idx)
    out, moved, taken = [], [], 0
    for p in images:
        out += token_ids[taken:p.start_idx]
        pad = layout.alignment_pad(len(out))
        is_embed = None if p.is_embed is None else torch.cat([torch.zeros(pad, dtype=torch.bool), p.is_embed])
        moved.append(PlaceholderFeaturesInfo(modality=p.modality, item_idx=p.item_idx, start_idx=len(out),
                                             tokens=[pad_id] * pad + list(p.tokens), is_embed=is_embed))
        out += moved[-1].tokens
        taken = p.start_idx + len(p.tokens)
    out += token_ids[taken:]
    return out, {**placeholders, "image": sorted(moved, key=lambda p: p.item_idx)} if images else dict(placeholders)
