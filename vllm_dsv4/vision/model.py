"""``DeepseekV4ForConditionalGeneration``: the text model behind a vision tower (docs/VISION.md §6, §9).

A Vision checkpoint says ``DeepseekV4ForCausalLM``; the plugin routes it here (patches.py, patch 9). Each image's
IMAGE tokens take the aligner's outputs (``embed_multimodal``), the other sentinel tokens learned
vectors (``embed_input_ids``); the merged embeddings enter the text model before its streams are
made. The text model also reads the raw ids: image sentinels route with ``bias_vl`` and widen the
sliding window inside their block (model/moe.py, model/image_window.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY

from vllm_dsv4.config import ConfigError, Dsv4Config
from vllm_dsv4.loader.checkpoint import SENTINEL_EMBEDDINGS, vision_tensors
from vllm_dsv4.model.decoder import DeepseekV4ForCausalLM, finish_loading
from vllm_dsv4.vision import layout
from vllm_dsv4.vision.processor import ImageDummyInputs, ImageMultiModalProcessor, ImageProcessingInfo
from vllm_dsv4.vision.tower import Aligner, ViT


@MULTIMODAL_REGISTRY.register_processor(ImageMultiModalProcessor, info=ImageProcessingInfo,
                                        dummy_inputs=ImageDummyInputs)
class DeepseekV4ForConditionalGeneration(nn.Module, SupportsMultiModal):
    """vLLM entry point for a DeepSeek-V4 checkpoint with ``vision_n_layers > 0``."""

    requires_raw_input_tokens = True  # the router and the window widening read the sentinel ids

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality == "image":
            return layout.IMAGE_PLACEHOLDER
        raise ValueError(f"DeepSeek-V4 takes images only, not {modality!r}")

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        self.cfg = cfg = Dsv4Config.from_hf_config(vllm_config.model_config.hf_config)
        if cfg.vision is None:
            raise ConfigError("DeepseekV4ForConditionalGeneration needs a vision tower (vision_n_layers > 0)")
        dtype = vllm_config.model_config.dtype
        # --limit-mm-per-prompt '{"image": 0}' serves text only: no tower, its tensors checked and skipped
        self.images = vllm_config.model_config.multimodal_config.get_limit_per_prompt("image") > 0
        if self.images:
            with self._mark_tower_model(vllm_config, {"image"}):
                self.vision = ViT(cfg.vision).to(dtype)
                self.aligner = Aligner(cfg.vision, cfg.hidden_size).to(dtype)
                for name in SENTINEL_EMBEDDINGS:
                    setattr(self, name, nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False))
        with self._mark_language_model(vllm_config):
            self.language_model = DeepseekV4ForCausalLM(vllm_config=vllm_config, prefix=prefix, images=True)
        self.warms_up_kernels = self.language_model.warms_up_kernels

    # What vLLM's MTP proposer shares with the draft, as on the text model
    @property
    def model(self):
        return self.language_model.model

    @property
    def lm_head(self):
        return self.language_model.lm_head

    def get_mtp_target_hidden_states(self) -> torch.Tensor | None:
        return self.language_model.get_mtp_target_hidden_states()

    def embed_multimodal(self, patches=None, vit_grid=None, perm=None, **unused) -> list[torch.Tensor]:
        """The IMAGE-token embeddings of each image, [n_embeds_i, D] in prompt order. ``patches`` and
        ``perm``: all images' rows concatenated (or one tensor per image); ``vit_grid`` [n_img, 2]."""
        if patches is None:
            return []
        grids = vit_grid.tolist() if torch.is_tensor(vit_grid) else [g.tolist() for g in vit_grid]
        if torch.is_tensor(patches):
            patches = patches.split([h * w for h, w in grids])
        if torch.is_tensor(perm):
            r = self.cfg.vision.downsample_ratio
            perm = perm.split([-(-h // r) * -(-w // r) for h, w in grids])
        return [self.encode(p, h, w)[order.to(p.device)] for p, (h, w), order in zip(patches, grids, perm)]

    def encode(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """One image's patches [vit_h * vit_w, 3, p, p] -> aligner rows [llm_h * llm_w, D], cells row-major."""
        return self.aligner(self.vision(patches, vit_h, vit_w), vit_h, vit_w)

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings=None, *,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        """[T] ids -> [T, D]: token embeddings; START / PAD / NEWLINE / END rows replaced by their learned
        vectors, IMAGE rows (``is_multimodal``) by ``multimodal_embeddings`` in order. Branch-free."""
        embeds = self.language_model.embed_input_ids(input_ids)
        if not self.images:
            return embeds
        kind = input_ids - layout.SENTINEL_BASE_ID  # [T]
        sentinel = (kind >= 0) & (kind < layout.NUM_SENTINELS)
        # IMAGE rows take image_pad until the tower's rows land on them (an IMAGE id outside an image does too)
        table = torch.stack([self.image_start, self.image_pad, self.image_pad, self.image_newline, self.image_end])
        embeds = torch.where(sentinel[:, None], table.to(embeds.dtype)[kind.clamp(0, layout.NUM_SENTINELS - 1)],
                             embeds)
        if multimodal_embeddings is not None and len(multimodal_embeddings):
            rows = torch.cat(list(multimodal_embeddings)).to(embeds.dtype)
            mask = is_multimodal.to(embeds.device)
            if int(mask.sum()) != rows.shape[0]:
                raise ValueError(f"{rows.shape[0]} image embeddings for {int(mask.sum())} IMAGE tokens")
            embeds[mask] = rows
        return embeds

    get_input_embeddings = embed_input_ids

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **unused) -> torch.Tensor:
        return self.language_model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Every official tensor into its parameter, by the official name (the text model's without
        its ``language_model.`` prefix), checked against the one table (loader/checkpoint.py)."""
        from vllm_dsv4.loader.load import load_official_weights

        params = {name.removeprefix("language_model."): p for name, p in self.named_parameters()}
        skip = () if self.images else set(vision_tensors(self.cfg))
        loaded = load_official_weights(self.cfg, weights, params, self.language_model.shard, skip=skip)
        finish_loading(self)
        own = dict(self.named_parameters())
        return {name if name in own else f"language_model.{name}" for name in loaded}
