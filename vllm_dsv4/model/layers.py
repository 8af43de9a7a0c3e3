"""Parameter holders named as in DeepSeek's reference (``.weight``), computing with the ops."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dsv4 import ops
from vllm_dsv4.config import ConfigError, Dsv4Config
from csrc_triton.formats import FP8_BLOCK
from vllm_dsv4.loader.checkpoint import expected_tensors
from vllm_dsv4.loader.names import param_target, sharded_dim
from vllm_dsv4.shard import Shard


class Linear(nn.Module):
    """``y = x W^T``, W [out, in], in one of two storages.

    Dequantised (the CPU path, and any weight not held in FP8): ``weight`` in the model dtype; the
    loader dequantises FP8 checkpoints into it. FP8 (``hold_fp8``, on the GPU path): ``weight``
    float8_e4m3fn [out, in] and ``weight_scale`` float32 [out/128, in/128], the checkpoint's bytes,
    computed by ``ops.block_fp8_gemm`` once ``finish_loading`` has bound them to it.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.register_parameter("weight_scale", None)
        self.groups = 1
        self.gemms: tuple = ()  # one ops.block_fp8_gemm per row group, after finish_loading
        self.grouped_gemm = None  # or all row groups' ops.grouped_fp8_gemm (ops.binds_grouped_gemm)

    def hold_fp8(self, groups: int = 1) -> None:
        """Before loading: keep the checkpoint's FP8 bytes and block scales instead of dequantising.

        ``groups`` > 1 splits the rows into independent GEMMs for ``grouped`` (each whole blocks).
        """
        rows = self.out_features // groups
        if rows * groups != self.out_features or (groups > 1 and rows % FP8_BLOCK):
            raise ValueError(f"{self.out_features} rows do not split into {groups} groups of whole "
                             f"{FP8_BLOCK}-row FP8 blocks")
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=torch.float8_e4m3fn,
                                               device=device), requires_grad=False)
        blocks = (math.ceil(self.out_features / FP8_BLOCK), math.ceil(self.in_features / FP8_BLOCK))
        self.weight_scale = nn.Parameter(torch.empty(blocks, dtype=torch.float32, device=device), requires_grad=False)
        self.groups = groups

    def finish_loading(self, out_proj: str | None = None) -> None:
        """After loading: bind each row group's FP8 weight to its GEMM. Grouped rows bind as ``out_proj``
        (default ``ops.OUT_PROJ``) says: one grouped GEMM where ``ops.binds_grouped_gemm``, none with
        ``fused`` (only the fused kernel reads them), one GEMM per group otherwise. Binding keeps the
        values of ``weight`` and ``weight_scale``, which the fused kernel reads under ``auto``: the
        checkpoint's scales are powers of two, so DeepGEMM's UE8M0 re-quantisation changes nothing
        (tests/model/test_fp8_linear.py checks both paths after binding)."""
        out_proj = out_proj or ops.OUT_PROJ
        if self.weight_scale is None or (self.groups > 1 and out_proj == "fused"):
            return
        if self.groups > 1 and ops.binds_grouped_gemm(out_proj):
            self.grouped_gemm = ops.grouped_fp8_gemm(self.weight.data, self.weight_scale.data, self.groups)
            return
        rows = self.out_features // self.groups
        block_rows = rows // FP8_BLOCK if self.groups > 1 else self.weight_scale.shape[0]
        self.gemms = tuple(
            ops.block_fp8_gemm(self.weight.data[g * rows : (g + 1) * rows],
                               self.weight_scale.data[g * block_rows : (g + 1) * block_rows])
            for g in range(self.groups)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if self.weight_scale is None:
            return F.linear(x.to(self.weight.dtype), self.weight)
        if self.groups != 1:
            raise ValueError(f"this FP8 linear holds {self.groups} row groups: call grouped()")
        return self._bound()[0](x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """Block-diagonal linear (§5.6): group-major x [G, T, in] -> [T, G, out/G], group g through
        rows g of W: ``einsum('gti,gri->tgr', x, W.view(G, out/G, in))``."""
        num_groups = x.shape[0]
        if self.weight_scale is None:
            w = self.weight.view(num_groups, -1, self.in_features)  # [G, R, in]
            return torch.einsum("gti,gri->tgr", x.to(w.dtype), w)
        if len(self._bound()) != num_groups:
            raise ValueError(f"x has {num_groups} groups; this FP8 linear holds {self.groups}")
        return torch.stack([gemm(xg) for gemm, xg in zip(self.gemms, x)], dim=1)

    def grouped_quantised(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The block-diagonal FP8 linear over activations already quantised per group as
        ``ops.rope_quant_fp8`` returns them (q [T, G, in] e4m3, scale [T, G, in/128]) -> [T, G * out/G]."""
        if self.grouped_gemm is None:
            raise RuntimeError("grouped_quantised() needs a weight bound to a grouped GEMM "
                               "(VLLM_DSV4_OUT_PROJ=einsum, or auto with DeepGEMM)")
        return self.grouped_gemm(q, scale)

    def _bound(self) -> tuple:
        if not self.gemms:
            raise RuntimeError("FP8 linear used before finish_loading() bound its weight to a GEMM")
        return self.gemms


def fp8_linears(cfg: Dsv4Config, shard: Shard = Shard(), on_gpu: bool = ops.USE_KERNELS) -> dict[str, int]:
    """The one place deciding which linears stay FP8: our weight parameter name -> row groups.

    On the GPU path, every FP8 128x128-block weight of the official table (loader/checkpoint.py)
    whose shape is whole blocks (the kernels quantise activations in 128-wide groups), except the
    stacked routed experts (moe.py); a merged linear (loader/names.py) only when all its
    members are, so each member's rows start on a block; ``wo_a``'s rows are its ``o_groups`` output
    groups (§5.6), held where ``ops.rope_out_proj`` could read them. Nothing on the CPU path or for an
    unquantised checkpoint: the loader dequantises every weight not held. Raises ConfigError when
    tensor parallelism would cut a held weight's blocks.
    """
    if not (on_gpu and cfg.quantized):
        return {}
    held, not_whole_blocks = {}, set()
    for name, spec in expected_tensors(cfg).items():
        target = param_target(name)
        if spec.dtype != torch.float8_e4m3fn or target.expert is not None:
            continue
        wo_a = name.endswith(".attn.wo_a.weight")
        # ops.rope_out_proj's 128-wide K blocks stay within a head
        if any(size % FP8_BLOCK for size in spec.shape) or (wo_a and cfg.head_dim % FP8_BLOCK):
            not_whole_blocks.add(target.param)
            continue
        dim = sharded_dim(name)
        if dim is not None:
            shard.check_blocks(spec.shape[dim], FP8_BLOCK, name)
        held[target.param] = shard.part(cfg.o_groups, "o_groups") if wo_a else 1
    return {param: groups for param, groups in held.items() if param not in not_whole_blocks}


def hold_fp8_linears(module: nn.Module, held: Mapping[str, int], prefix: str) -> None:
    """Switch the Linears of ``module`` (named ``prefix.*`` in the model) that ``held`` names to FP8."""
    switched = set()
    for name, child in module.named_modules(prefix=prefix):
        if isinstance(child, Linear) and f"{name}.weight" in held:
            child.hold_fp8(held[f"{name}.weight"])
            switched.add(f"{name}.weight")
    expected = {name for name in held if name.startswith(f"{prefix}.")}
    if switched != expected:
        raise ConfigError(f"the model has no Linear for FP8 weights {sorted(expected - switched)}")


class RMSNorm(nn.Module):
    """Weighted RMSNorm (§3.1); the weight is kept in fp32 as the reference does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x W^T`` with fp32 products and accumulation, as the reference's ``F.linear(x.float(), W.float())``
    (router logits, output logits). On CUDA with x and W both bf16 / fp16, one half-precision GEMM with
    fp32 output computes exactly that (half x half products are exact in fp32) without fp32 copies of
    x and W per step."""
    if x.is_cuda and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype:
        return torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
    return F.linear(x.float(), weight.float())


def fp32_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False)
