"""Mixture of experts: hash or sqrt-softplus score routing, clamped SwiGLU experts, one shared expert (§6)."""

from __future__ import annotations

import math

import torch
from torch import nn

from csrc_triton.formats import FP8_BLOCK
from vllm_dsv4 import ops
from vllm_dsv4.config import NUM_SENTINELS, SENTINEL_BASE_ID, Dsv4Config
from vllm_dsv4.model.layers import Linear, fp32_linear, fp32_param
from vllm_dsv4.model.parallel import DpGroup, across_dp
from vllm_dsv4.ops import vllm_kernels
from vllm_dsv4.shard import Shard


class Gate(nn.Module):
    """Router. Hash layers carry ``tid2eid`` [vocab, k]; score layers a selection ``bias`` [E]. A Vision
    checkpoint adds ``bias_vl`` [E] to every gate (main layers, hash ones included, and draft stages):
    image sentinel tokens pick their experts with it instead (docs/VISION.md §7); its hash layers also ship
    a ``bias``, which routing there does not use."""

    def __init__(self, cfg: Dsv4Config, hashed: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size), requires_grad=False)
        if hashed:
            self.tid2eid = nn.Parameter(
                torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64), requires_grad=False
            )
        if not hashed or cfg.vision:
            self.bias = fp32_param(cfg.n_routed_experts)
        self.bias_vl = fp32_param(cfg.n_routed_experts) if cfg.vision else None
        self.top_k, self.scaling, self.renorm = cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.norm_topk_prob

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor):
        """x [T, D], ids [T] -> (weights [T, k] fp32, expert ids [T, k]). Router logits in fp32."""
        logits = fp32_linear(x, self.weight)  # [T, E]
        if hasattr(self, "tid2eid"):
            weights, ids = ops.route(logits, self.top_k, self.scaling, self.renorm, hash_ids=self.tid2eid[input_ids])
        else:
            weights, ids = ops.route(logits, self.top_k, self.scaling, self.renorm, bias=self.bias)
        if self.bias_vl is None:
            return weights, ids
        return self.route_images(logits, input_ids, weights, ids)

    def route_images(self, logits, input_ids, weights, ids):
        """Rows of image sentinel tokens (all five kinds) re-routed by top-k over ``scores + bias_vl``,
        their weights from the unbiased scores as for text; other rows as they are. Branch-free."""
        image = ((input_ids >= SENTINEL_BASE_ID) & (input_ids < SENTINEL_BASE_ID + NUM_SENTINELS))[:, None]
        image_weights, image_ids = ops.route(logits, self.top_k, self.scaling, self.renorm, bias=self.bias_vl)
        return torch.where(image, image_weights, weights), torch.where(image, image_ids.to(ids.dtype), ids)


class SharedExpert(nn.Module):
    """This rank's slice of the shared expert's intermediate dim (a partial output)."""

    def __init__(self, cfg: Dsv4Config, shard: Shard):
        super().__init__()
        inter = shard.part(cfg.moe_intermediate_size, "moe_intermediate_size")
        self.w13 = Linear(cfg.hidden_size, 2 * inter)  # official w1 (gate), w3 (up) rows
        self.w2 = Linear(inter, cfg.hidden_size)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(ops.swiglu_clamped(self.w13(x), self.limit))


class Experts(nn.Module):
    """This rank's routed experts (``Shard.experts_per_rank`` of them from ``Shard.first_expert``:
    whole experts over all DP x TP ranks), stacked (w1 rows first in ``w13``), in one of three storages.

    Dequantised (the CPU path, and bf16 checkpoints): ``w13`` [E_local, 2I, D] and ``w2``
    [E_local, D, I] in the model dtype; the loader dequantises into them. MXFP4, kept packed when
    the checkpoint's experts are MXFP4 and ``on_gpu`` (also under ``VLLM_DSV4_OPS=reference``, whose
    MXFP4 reference decodes only the experts a step uses: 6 layers of V4-Flash's experts dequantised
    to fp32 would be 155 GB): ``w13`` uint8 [E_local, 2I, D/2] + ``w13_scale`` uint8
    [E_local, 2I, D/32], ``w2`` uint8 [E_local, D, I/2] + ``w2_scale`` uint8 [E_local, D, I/32], the
    checkpoint's bytes (the loader copies raw bytes into
    any ``<target>`` with a ``<target>_scale`` beside it), computed by ``ops.moe_experts_mxfp4``. FP8
    (V4-Flash-Base's experts, ``on_gpu``): ``w13`` float8_e4m3fn [E_local, 2I, D] + ``w13_scale`` float32
    [E_local, 2 ceil(I/128), ceil(D/128)] (W1's blocks, then W3's), ``w2`` [E_local, D, I] + ``w2_scale``
    [E_local, ceil(D/128), ceil(I/128)], computed by ``ops.moe_experts_fp8``.
    """

    def __init__(self, cfg: Dsv4Config, shard: Shard, on_gpu: bool = ops.ON_CUDA):
        super().__init__()
        e, i, d = shard.experts_per_rank(cfg.n_routed_experts), cfg.moe_intermediate_size, cfg.hidden_size
        self.packed = on_gpu and cfg.mxfp4_experts
        self.fp8 = on_gpu and cfg.quantized and not cfg.mxfp4_experts
        if self.packed:
            self.w13, self.w13_scale = _bytes(e, 2 * i, d // 2), _bytes(e, 2 * i, d // 32)
            self.w2, self.w2_scale = _bytes(e, d, i // 2), _bytes(e, d, i // 32)
        elif self.fp8:
            bi, bd = math.ceil(i / FP8_BLOCK), math.ceil(d / FP8_BLOCK)
            self.w13, self.w13_scale = _fp8(e, 2 * i, d), fp32_param(e, 2 * bi, bd)
            self.w2, self.w2_scale = _fp8(e, d, i), fp32_param(e, bd, bi)
        else:
            self.w13 = nn.Parameter(torch.empty(e, 2 * i, d), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(e, d, i), requires_grad=False)
        self.first_expert, self.num_local = shard.first_expert(cfg.n_routed_experts), e
        self.holds_all = e == cfg.n_routed_experts  # then the router's ids are local ids already
        self.limit = cfg.swiglu_limit
        self.marlin = None  # vLLM's Marlin MoE over repacked weights, when ``uses_marlin()``
        self.narrow_scales = False  # every scale byte <= 128: the Triton decode's single product (finish_loading)

    def finish_loading(self) -> None:
        """After loading: note whether the scales are narrow (one host read), and hand the packed
        experts to vLLM's Marlin MoE where it runs them (``uses_marlin``: it repacks them; the
        checkpoint-layout copies are released)."""
        if not self.packed:
            return
        self.narrow_scales = all(int(s.max()) <= 128 for s in (self.w13_scale, self.w2_scale) if s.numel())
        if not uses_marlin():
            return
        self.marlin = vllm_kernels.marlin_mxfp4_experts(self.w13.data, self.w13_scale.data, self.w2.data,
                                                  self.w2_scale.data, self.limit)
        for name in ("w13", "w13_scale", "w2", "w2_scale"):
            getattr(self, name).data = torch.empty(0, dtype=torch.uint8, device=self.w13.device)

    def forward(self, x, weights, ids, shared: torch.Tensor | None = None):
        """Partial output over this rank's experts: other ranks' picks become the skipped id E_local;
        plus ``shared`` (the shared expert's output, in x's dtype) when given, in the packed experts'
        own launch (a rounding of the routed sum, then the add, as the unfused add)."""
        if self.holds_all:
            local = ids
        else:
            local = ids - self.first_expert
            mine = (local >= 0) & (local < self.num_local)
            local = torch.where(mine, local, torch.full_like(local, self.num_local))
        if self.marlin is not None:
            routed = self.marlin(x, weights, local)
        elif self.packed:
            return ops.moe_experts_mxfp4(x, weights, local, self.w13, self.w13_scale, self.w2, self.w2_scale,
                                         self.limit, self.narrow_scales, shared)
        elif self.fp8:
            return ops.moe_experts_fp8(x, weights, local, self.w13, self.w13_scale, self.w2, self.w2_scale,
                                       self.limit, shared)
        else:
            routed = ops.moe_experts(x, weights, local, self.w13, self.w2, self.limit)
        return routed if shared is None else (routed + shared).to(x.dtype)


def uses_marlin() -> bool:
    """Whether packed experts run vLLM's Marlin MoE (``ops.MOE_BACKEND``; ``auto``: where vLLM ships it)."""
    return ops.MOE_BACKEND == "marlin" or (ops.MOE_BACKEND == "auto" and vllm_kernels.has_marlin_mxfp4_moe())


def _bytes(*shape: int) -> nn.Parameter:
    """Raw checkpoint bytes (explicitly uint8: vLLM's default dtype applies to float tensors only)."""
    return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)


def _fp8(*shape: int) -> nn.Parameter:
    """The checkpoint's e4m3 weights as they are (the loader copies a dtype it is given unchanged)."""
    return nn.Parameter(torch.empty(*shape, dtype=torch.float8_e4m3fn), requires_grad=False)


class MoE(nn.Module):
    """Returns this rank's partial output, to be all-reduced over the TP group (model/parallel.py).

    Under data parallelism the routed experts see the tokens of every DP rank (``across_dp``):
    routing happens here, on this rank's tokens; the shared expert stays on them.
    """

    def __init__(self, cfg: Dsv4Config, hashed: bool, shard: Shard, dp_group: DpGroup | None = None):
        super().__init__()
        self.gate = Gate(cfg, hashed)
        self.experts = Experts(cfg, shard)
        self.shared_experts = SharedExpert(cfg, shard)
        self.shard, self.dp_group = shard, dp_group or DpGroup()

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        shared = self.shared_experts(x)
        if self.shard.dp_size > 1:
            return (across_dp(self.experts, self.shard, self.dp_group, x, weights, ids) + shared).to(x.dtype)
        return self.experts(x, weights, ids, shared)
