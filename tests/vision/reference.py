"""A pure-PyTorch reference of the whole DeepSeek-V4 Vision model, from independent pieces:

- preprocessing and the sentinel layout: vLLM 0.32's ``common/mm_preprocess.py`` (``load_image``,
  ``build_image_block``), called directly;
- the tower: vLLM 0.32's ``common/vision.py`` ViT and aligner (tests/vision/vllm_tower.py);
- the text model: transformers' DeepseekV4ForCausalLM (tests/oracle/hf_oracle.py), fp32, eager;
- what transformers lacks, written here from the spec (docs/VISION.md §6-§8): the sentinel embeddings merged
  into the input, ``bias_vl`` routing of the five sentinel ids on every MoE layer, and the sliding-window
  mask widened to each image block both ways.

vLLM 0.26 (the GPU device) ships neither vLLM piece: there the reference takes ours for preprocessing and
the tower (fp32, on the CPU), which the CPU tests hold equal to vLLM 0.32's (test_layout.py, test_tower.py).
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.oracle import hf_oracle
from tests.vision.vllm_tower import HAVE_VLLM_VISION, VllmTower
from vllm_dsv4.config import VisionConfig

SENTINEL_BASE = 129257  # <|place_holder_mm_span_0431|>; types START, PAD, IMAGE, NEWLINE, END follow
START, PAD, IMAGE, NEWLINE, END = range(5)
LEARNED = {START: "image_start", PAD: "image_pad", NEWLINE: "image_newline", END: "image_end"}


@dataclass
class ExpandedPrompt:
    ids: list[int]  # the placeholders replaced by their padded blocks
    blocks: list[tuple[int, int]]  # positions of each image's START and END
    image_rows: list[torch.Tensor]  # per image, its IMAGE tokens' embeddings in prompt order [n, D]


class VisionReference:
    def __init__(self, ckpt: str | Path):
        ckpt = Path(ckpt)
        raw_cfg = json.loads((ckpt / "config.json").read_text())
        self.vision = VisionConfig.from_dict(raw_cfg)
        weights = hf_oracle._dequantized_weights(hf_oracle._open_tensors(ckpt))
        tower_weights = {n: t for n, t in weights.items() if n.startswith(("vision.", "aligner."))}
        self.tower = (VllmTower if HAVE_VLLM_VISION else OurTower)(self.vision, raw_cfg["hidden_size"], tower_weights)
        self.learned = {t: weights[name] for t, name in LEARNED.items()}
        bias_vl = {n: weights.pop(n) for n in list(weights) if n.endswith("gate.bias_vl")}
        n_hash = raw_cfg.get("num_hash_layers", 0)
        text = {n: t for n, t in weights.items() if not n.startswith(("vision.", "aligner.", "image_"))
                and not any(n == f"layers.{i}.ffn.gate.bias" for i in range(n_hash))}  # shipped, unused
        self.model = hf_oracle.load_hf_reference(ckpt, text)
        for i, layer in enumerate(self.model.model.layers):
            layer.mlp.forward = types.MethodType(_moe_with_images(bias_vl[f"layers.{i}.ffn.gate.bias_vl"]), layer.mlp)
        self.window = raw_cfg["sliding_window"]

    def expand(self, ids: list[int], images: list, placeholder_id: int) -> ExpandedPrompt:
        """Each ``placeholder_id`` in ``ids`` replaced by the next image's block, as placed there."""
        images = iter(images)
        out, blocks, rows = [], [], []
        for token in ids:
            if token != placeholder_id:
                out.append(token)
                continue
            patches, vit_h, vit_w, block_types, perm = place_image(next(images), self.vision, len(out))
            first = len(out) + block_types.tolist().index(START)
            out += (SENTINEL_BASE + block_types).tolist()
            blocks.append((first, len(out) - 1))
            rows.append(self.tower.encode(patches, vit_h, vit_w)[perm])
        return ExpandedPrompt(out, blocks, rows)

    def mask(self, length: int, blocks: list[tuple[int, int]]) -> torch.Tensor:
        """[1, 1, S, S] additive: query i sees keys i - window + 1 .. i, and inside a block [s, e] also
        s .. e (and the window before s)."""
        i = torch.arange(length)
        lo, hi = i - self.window + 1, i.clone()
        for s, e in blocks:
            inside = (i >= s) & (i <= e)
            lo = torch.where(inside, torch.minimum(lo, torch.tensor(s)), lo)
            hi = torch.where(inside, torch.tensor(e), hi)
        j = torch.arange(length)
        visible = (j[None] >= lo[:, None]) & (j[None] <= hi[:, None])
        return torch.zeros(length, length).masked_fill(~visible, float("-inf"))[None, None]

    @torch.no_grad()
    def logprobs(self, prompt: ExpandedPrompt, continuation: list[int] = ()) -> torch.Tensor:
        """fp64 next-token log-probs [S, V] at every position of prompt + continuation."""
        return torch.log_softmax(self._logits(prompt, continuation).double(), -1)

    @torch.no_grad()
    def features(self, prompt: ExpandedPrompt, continuation: list[int], layers: list[int]) -> list[torch.Tensor]:
        """What DSpark drafts from: after each of ``layers``, the mean of its streams [S, D] at every
        position of prompt + continuation."""
        from tests.oracle.dspark_ref import stream_means

        return stream_means(self.model, layers, lambda: self._logits(prompt, continuation))

    def _logits(self, prompt: ExpandedPrompt, continuation: list[int]) -> torch.Tensor:
        """[S, V] at every position of prompt + continuation."""
        ids = torch.tensor([prompt.ids + list(continuation)])
        embeds = self.model.model.embed_tokens(ids)[0].clone()  # [S, D]
        kind = ids[0] - SENTINEL_BASE
        for t, vector in self.learned.items():
            embeds[kind == t] = vector
        if prompt.image_rows:
            embeds[kind == IMAGE] = torch.cat(prompt.image_rows)
        hook = self.model.model.embed_tokens.register_forward_hook(lambda m, args, out: embeds[None])
        try:
            logits = self.model(ids, attention_mask={"in-image window": self.mask(ids.shape[1], prompt.blocks)}).logits
        finally:
            hook.remove()
        return logits[0]


def place_image(image, v: VisionConfig, start: int):
    """(patches, vit_h, vit_w, block types with the alignment pad, perm) of ``image`` placed at ``start``."""
    if not HAVE_VLLM_VISION:
        from vllm_dsv4.vision import layout, preprocess

        patches, grid = preprocess.to_patches(image, v)
        types, perm = layout.block_layout(grid.llm_h, grid.llm_w)
        types = torch.cat([torch.full((layout.alignment_pad(start),), PAD), types])
        return patches, grid.vit_h, grid.vit_w, types, perm
    from vllm.models.deepseek_v4.common import mm_preprocess

    patches, vit_h, vit_w, llm_h, llm_w = mm_preprocess.load_image(
        image, patch_size=v.patch_size, downsample_ratio=v.downsample_ratio, max_n_token=v.max_n_token,
        min_pixels=v.min_pixels, max_wh_ratio=v.max_wh_ratio)
    types, perm = mm_preprocess.build_image_block(llm_h, llm_w, start)
    return patches, vit_h, vit_w, types, perm


class OurTower:
    """vision/tower.py in fp32 on the CPU, where vLLM has no tower of its own (0.26)."""

    def __init__(self, vision: VisionConfig, hidden_size: int, weights: dict[str, torch.Tensor]):
        from vllm_dsv4.vision.tower import Aligner, ViT

        self.vit, self.aligner = ViT(vision).eval(), Aligner(vision, hidden_size).eval()
        for prefix, module in (("vision.", self.vit), ("aligner.", self.aligner)):
            module.load_state_dict({n[len(prefix):]: t for n, t in weights.items() if n.startswith(prefix)})

    @torch.no_grad()
    def encode(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        return self.aligner(self.vit(patches.float(), vit_h, vit_w), vit_h, vit_w)


def _moe_with_images(bias_vl: torch.Tensor):
    """transformers' MoE block with §7's routing: rows of the five sentinel ids pick top-k of scores +
    ``bias_vl`` (hash layers too), others as transformers routes them; weights from unbiased scores."""

    def forward(self, hidden_states, input_ids=None):
        batch, seq, dim = hidden_states.shape
        flat, ids = hidden_states.view(-1, dim), input_ids.reshape(-1)
        scores = F.softplus(F.linear(flat.float(), self.gate.weight.float())).sqrt()  # [T, E]
        if self.is_hash:
            text_pick = self.gate.tid2eid[ids].long()
        else:
            text_pick = torch.topk(scores + self.gate.e_score_correction_bias, self.gate.top_k, -1, sorted=False).indices
        image_pick = torch.topk(scores + bias_vl, self.gate.top_k, -1, sorted=False).indices
        image = ((ids >= SENTINEL_BASE) & (ids < SENTINEL_BASE + 5))[:, None]
        pick = torch.where(image, image_pick, text_pick)
        weights = scores.gather(1, pick)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.gate.routed_scaling_factor
        routed = self.experts(flat, pick, weights.to(flat.dtype)).view(batch, seq, dim)
        return routed + self.shared_experts(hidden_states)

    return forward
